"""Engine construction and run inputs: clear errors, nothing sent, nothing lost."""

from __future__ import annotations

from typing import Any

import pytest

import loopengine as le
from loopengine.persistence import MemoryLedger
from loopengine.providers import Reply, ScriptedProvider

from .conftest import PRICES, EngineFactory, operation


def test_engine_needs_a_provider_per_route() -> None:
    """A mapping's keys must be the providers' own names; non-providers are refused."""
    scripted = ScriptedProvider([], name="anthropic")
    assert le.Engine({"anthropic": scripted}).providers == {"anthropic": scripted}
    with pytest.raises(le.ConfigError, match="named"):
        le.Engine({"bedrock": scripted})
    with pytest.raises(le.ConfigError) as info:
        le.Engine(object())  # type: ignore[arg-type]
    assert info.value.field == "provider"
    with pytest.raises(le.ConfigError) as info:
        le.Engine(scripted, ledger=object())  # type: ignore[arg-type]
    assert info.value.field == "ledger"
    with pytest.raises(le.ConfigError) as info:
        le.Engine(scripted, observers=[42])  # type: ignore[list-item]
    assert info.value.field == "observers[0]"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"messages": ""}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"system": [{"type": "image"}]}, "system[0]"),
        ({"output": dict}, "output"),
        ({"accept": "yes"}, "accept"),
        ({"tools": ["search"]}, "tools[0]"),
        ({"attribution": {"tenant": "acme"}}, "attribution"),
        ({"limits": {"max_turns": -1}}, "limits.max_turns"),
    ],
)
async def test_bad_run_input_is_refused_before_anything_is_sent(
    make_engine: EngineFactory, kwargs: dict[str, Any], field: str
) -> None:
    """Each bad input is a ConfigError naming it; no request, no ledger row."""
    engine, provider, ledger = make_engine(Reply.text("x"))
    messages = kwargs.pop("messages", "go")
    with pytest.raises(le.ConfigError) as info:
        await engine.run(operation(), messages, **kwargs)
    assert info.value.field == field
    assert provider.requests == [] and ledger.invocations == {}


async def test_callers_messages_are_never_modified(make_engine: EngineFactory) -> None:
    """The run works on its own copy of the caller's messages and system blocks."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    system = [{"type": "text", "text": "be brief"}]
    engine, _, _ = make_engine(Reply.tool_calls(("missing", {})), Reply.text("done"))
    result = await engine.run(operation(), messages, system=system)
    assert messages == [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert system == [{"type": "text", "text": "be brief"}]
    assert len(result.messages) == 4


async def test_transcript_is_kept_whatever_the_outcome(make_engine: EngineFactory) -> None:
    """A run ended by a guard still returns every message exchanged, its unrun calls
    closed by one user message of is_error results."""
    engine, _, _ = make_engine(Reply.tool_calls(("lookup", {}), ("lookup", {})))
    result = await engine.run(operation(max_tool_batch=1), "go")
    assert result.outcome is le.Outcome.TOOL_BATCH_LIMIT
    assert [m["role"] for m in result.messages] == ["user", "assistant", "user"]
    assert [b["type"] for b in result.messages[1]["content"]] == ["tool_use", "tool_use"]
    closing = result.messages[-1]["content"]
    assert [b["tool_use_id"] for b in closing] == [b["id"] for b in result.messages[1]["content"]]
    assert all(b["is_error"] is True and b["content"].startswith("Not run") for b in closing)


@pytest.mark.parametrize("asynchronous", [False, True])
async def test_on_text_receives_streamed_text(make_engine: EngineFactory,
                                              asynchronous: bool) -> None:
    """Text deltas reach the run's on_text callback, sync or async."""
    seen: list[str] = []

    async def async_cb(text: str) -> None:
        seen.append(text)

    engine, _, _ = make_engine(Reply.text("Hello there"))
    result = await engine.run(operation(), "go",
                              on_text=async_cb if asynchronous else seen.append)
    assert result.outcome is le.Outcome.COMPLETED and seen == ["Hello there"]


async def test_the_scripted_provider_streams_to_engine_stream(make_engine: EngineFactory) -> None:
    """engine.stream on the scripted provider yields its reply's text as a TextDelta."""
    engine, _, _ = make_engine(Reply.text("Hello there"))
    async with engine.stream(operation(), "go") as run:
        deltas = [event.text async for event in run if isinstance(event, le.events.TextDelta)]
    assert deltas == ["Hello there"] and run.result.answer == "Hello there"


class Plain(le.providers.Provider):
    """A provider of one's own that does not stream (the protocol's default)."""

    def __init__(self) -> None:
        self.sent = 0

    @property
    def name(self) -> str:
        return "anthropic"

    async def send(self, request: le.providers.ProviderRequest, *,
                   on_text: le.providers.TextCallback | None = None,
                   ) -> le.providers.ProviderResponse:
        self.sent += 1
        return le.providers.ProviderResponse(content=[{"type": "text", "text": "hi"}],
                                             stop_reason="end_turn")


async def test_reading_the_text_of_a_provider_that_cannot_stream_is_refused() -> None:
    """on_text or engine.stream on a provider whose streaming is False is a ConfigError
    saying how to stream, before anything is sent or recorded; without them it runs."""
    provider, ledger = Plain(), MemoryLedger()
    engine = le.Engine(provider, ledger=ledger, prices=PRICES)
    with pytest.raises(le.ConfigError, match="cannot stream") as info:
        await engine.run(operation(), "go", on_text=print)
    assert info.value.field == "on_text"
    with pytest.raises(le.ConfigError, match="provider that streams") as info:
        async with engine.stream(operation(), "go"):
            pass
    assert info.value.field == "Engine.stream"
    assert provider.sent == 0 and ledger.invocations == {}
    assert (await engine.run(operation(), "go")).answer == "hi"


async def test_pause_turn_is_continued_within_the_turn(make_engine: EngineFactory) -> None:
    """pause_turn sends another request of the same turn (phase continuation)."""
    paused = Reply(content=[{"type": "text", "text": "Searching. "}], stop_reason="pause_turn")
    engine, provider, ledger = make_engine(paused, Reply.text("Found it."))
    result = await engine.run(operation(max_turns=1), "go")
    assert result.outcome is le.Outcome.COMPLETED and result.turns == 1
    assert result.answer == "Searching. Found it."
    assert [(r["turn"], r["attempt"], r["phase"]) for r in ledger.attempts.values()] == [
        (1, 1, "turn"), (1, 2, "continuation")]
    assert provider.requests[1].messages[-1] == {
        "role": "assistant", "content": [{"type": "text", "text": "Searching. "}]}


async def test_raise_for_outcome() -> None:
    """completed returns the result; other outcomes raise OutcomeError with the attempts."""
    done = await le.Engine(ScriptedProvider([Reply.text("ok")]), prices=PRICES).run(
        operation(), "go")
    assert done.raise_for_outcome() is done
    capped = await le.Engine(ScriptedProvider([Reply.text("x", stop_reason="max_tokens")]),
                             prices=PRICES).run(operation(), "go")
    with pytest.raises(le.OutcomeError) as info:
        capped.raise_for_outcome()
    assert (info.value.outcome, info.value.attempts) == ("incomplete", 1)
    assert not isinstance(info.value, le.ProviderError)
