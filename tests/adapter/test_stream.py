"""`Engine.stream` (docs/observability.md): a run's events and its text deltas as an async
iterator, through AnthropicProvider, the real SDK and the loopback server."""

from __future__ import annotations

import anyio
import pytest

import loopengine as le
from loopengine import events
from loopengine.testing import Reply, StallStream, StreamErrorEvent

from ..conftest import operation
from ..ledger_support import lookup
from .conftest import FAST_RETRY, Harness


async def test_deltas_carry_turn_and_attempt_across_a_retried_stream(wire: Harness) -> None:
    """An overload mid-stream, then a retry: each delta says its turn, attempt
    and ordinal; the retried attempt's deltas alone make the answer."""
    engine, _ = wire.engine(
        StreamErrorEvent(reply=Reply.text("first try text"), after=4),
        Reply.text("the whole answer"), stream=True)
    seen: list[events.Event] = []
    async with engine.stream(operation(retry=FAST_RETRY), "go") as run:
        async for event in run:
            seen.append(event)
    result = run.result
    assert result.outcome is le.Outcome.COMPLETED and result.answer == "the whole answer"
    deltas = [e for e in seen if isinstance(e, events.TextDelta)]
    assert {(d.turn, d.attempt, d.ordinal) for d in deltas} == {(1, 1, 1), (1, 2, 2)}
    assert "".join(d.text for d in deltas if d.attempt == 2) == "the whole answer"
    assert all(d.run_id == run.run_id == result.invocation_id for d in deltas)
    assert isinstance(seen[0], events.RunStarted) and isinstance(seen[-1], events.RunEnded)
    settled = [e for e in seen if isinstance(e, events.AttemptSettled)]
    assert [s.outcome for s in settled] == ["error", "ok"]


async def test_the_stream_result_is_what_run_returns(wire: Harness) -> None:
    """The same script through `run` and through `stream`: equal results."""
    script = [Reply.tool_calls(("lookup", {"key": "a"})), Reply.text("A it is")]
    engine, _ = wire.engine(*script, stream=True)
    ran = await engine.run(operation(), "go", tools=[lookup])
    wire.server.add(*script)
    async with engine.stream(operation(), "go", tools=[lookup]) as run:
        kinds = [type(event).__name__ async for event in run]
    streamed = run.result
    assert "ToolCallEvent" in kinds and "TextDelta" in kinds
    for field in ("outcome", "answer", "turns", "tool_calls", "usage", "cost_usd", "credits"):
        assert getattr(streamed, field) == getattr(ran, field), field
    assert shape(streamed.messages) == shape(ran.messages)


def shape(messages: list[dict[str, object]]) -> list[tuple[object, ...]]:
    """Each message's role and blocks, without the ids the server makes up."""
    out: list[tuple[object, ...]] = []
    for message in messages:
        content = message["content"]
        blocks = content if isinstance(content, list) else [{"type": "text", "text": content}]
        out.append((message["role"], *[
            tuple(sorted((k, str(v)) for k, v in b.items() if k not in ("id", "tool_use_id")))
            for b in blocks]))
    return out


async def test_breaking_out_early_cancels_the_run(wire: Harness) -> None:
    """Leaving the loop at the first delta cancels the run: the ledger records it
    ``cancelled`` and its attempt ``aborted``/``external``."""
    engine, ledger = wire.engine(
        StallStream(reply=Reply.text("a long answer, slowly"), after=4, seconds=3600),
        stream=True)
    with anyio.fail_after(30):  # a hang guard; the stall never ends by itself
        async with engine.stream(operation(), "go") as run:
            async for event in run:
                if isinstance(event, events.TextDelta):
                    break
    (invocation,) = ledger.invocations.values()
    assert invocation["outcome"] == "cancelled"
    (attempt,) = ledger.attempts.values()
    assert (attempt["outcome"], attempt["aborted_reason"]) == ("aborted", "external")
    with pytest.raises(le.LoopEngineError, match="was cancelled: its stream was left before"):
        _ = run.result


async def test_bad_input_is_refused_at_the_start(wire: Harness) -> None:
    engine, _ = wire.engine()
    with pytest.raises(le.ConfigError) as info:
        async with engine.stream(operation(), "go", tols=[lookup]):
            pass
    assert info.value.field == "tols"
    with pytest.raises(le.ConfigError):
        async with engine.stream(operation(), ""):
            pass
    assert wire.requests == []


class _Mine(Exception):
    """The caller's own error, raised inside the stream's block."""


async def test_an_error_raised_in_the_block_reaches_the_caller_as_raised(wire: Harness) -> None:
    """The caller's own exception inside ``async with engine.stream(...)`` (or reading
    ``run.result`` before the end) propagates as it was raised, with its cause: it
    came out wrapped in an ExceptionGroup. The run is cancelled, as on a ``break``."""
    engine, ledger = wire.engine(
        StallStream(reply=Reply.text("a long answer, slowly"), after=4, seconds=3600),
        stream=True)
    cause = KeyError("why")
    with anyio.fail_after(30), pytest.raises(_Mine) as caught:  # a hang guard
        async with engine.stream(operation(), "go") as run:
            async for event in run:
                if isinstance(event, events.TextDelta):
                    raise _Mine("stop here") from cause
    assert caught.value.__cause__ is cause
    (invocation,) = ledger.invocations.values()
    assert invocation["outcome"] == "cancelled"
    with anyio.fail_after(30), pytest.raises(le.LoopEngineError, match="has not ended"):
        async with engine.stream(operation(), "go") as run:
            _ = run.result
