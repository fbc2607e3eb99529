"""``result.messages`` is always a valid history to continue from (docs/guards.md),
through AnthropicProvider -> the real ``anthropic`` SDK -> FakeAnthropicServer.

A run that ends with tool calls it did not run closes each with an ``is_error``
tool result saying why, in one user message, so that a chat backend can append
the next user message and call ``run`` again. FakeAnthropicServer does not check
that pairing, so the second run's first request goes through `paired`, a script
item that answers with the API's 400 when a ``tool_use`` has no ``tool_result``
in the next message; the tests also check the messages themselves.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import anyio
import pydantic

import loopengine as le
from loopengine.testing import ErrorReply, FakeAnthropicServer, RecordedRequest, Reply

from ..clock_support import ExpiringClock
from ..conftest import MODEL, PRICES
from .conftest import STREAMING, Harness, harness


def pairing_problem(messages: list[dict[str, Any]]) -> str | None:
    """What the Messages API would refuse in ``messages``, as far as tool calls go.

    The API merges consecutive messages of one role into one turn; each
    ``tool_use`` of an assistant turn needs a ``tool_result`` in the next turn,
    before any other block of it, and each ``tool_result`` answers a
    ``tool_use`` of the turn just before.
    """
    turns: list[tuple[str, list[dict[str, Any]]]] = []
    for message in messages:
        content = message["content"]
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if turns and turns[-1][0] == message["role"]:
            turns[-1][1].extend(blocks)
        else:
            turns.append((message["role"], list(blocks)))
    if not turns or turns[0][0] != "user":
        return "the first message must be a user message"
    for i, (role, blocks) in enumerate(turns):
        if role == "assistant":
            uses = [b["id"] for b in blocks if b.get("type") == "tool_use"]
            following = turns[i + 1][1] if i + 1 < len(turns) else []
            answered = {b["tool_use_id"] for b in following if b.get("type") == "tool_result"}
            missing = [u for u in uses if u not in answered]
            if missing:
                return (f"messages.{i}: tool_use ids were found without tool_result blocks "
                        f"immediately after: {', '.join(missing)}")
        else:
            kinds = [b.get("type") for b in blocks]
            first_other = next((j for j, k in enumerate(kinds) if k != "tool_result"),
                               len(kinds))
            if "tool_result" in kinds[first_other:]:
                return f"messages.{i}: tool_result blocks must come before any other block"
            previous = turns[i - 1][1] if i > 0 else []
            asked = {b["id"] for b in previous if b.get("type") == "tool_use"}
            unknown = [b["tool_use_id"] for b in blocks
                       if b.get("type") == "tool_result" and b["tool_use_id"] not in asked]
            if unknown:
                return f"messages.{i}: unexpected tool_use_id in tool_result: {unknown[0]}"
    return None


def paired(reply: Reply) -> Callable[[RecordedRequest], Reply | ErrorReply]:
    """Serve ``reply`` if the request's messages pair every tool call, else the API's 400."""

    def serve(request: RecordedRequest) -> Reply | ErrorReply:
        problem = pairing_problem(request.messages)
        if problem is not None:
            return ErrorReply(status=400, message=problem)
        return reply

    return serve


def op(output_tokens: int = 256, **limits: Any) -> le.Operation:
    return le.Operation(name="teammate.answer", provider="anthropic", model=MODEL,
                        max_output_tokens=output_tokens, limits=le.Limits(**limits))


class Counter:
    """A lookup tool that counts its calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []

        async def lookup(key: str) -> str:
            self.calls.append(key)
            return f"value of {key}"

        self.tool = le.tool(name="lookup", description="Look a key up.")(lookup)


def lookup(key: str) -> tuple[str, dict[str, Any]]:
    return ("lookup", {"key": key})


NEXT = {"role": "user", "content": "Thanks. One lookup at a time, please: what is a?"}
"""The message a chat backend appends to continue a conversation."""


def closing(result: le.RunResult) -> list[dict[str, Any]]:
    """The run's last message, which must close the response before it."""
    last = result.messages[-1]
    assert last["role"] == "user" and result.messages[-2]["role"] == "assistant"
    return list(last["content"])


async def continue_run(engine: le.Engine, result: le.RunResult, tools: list[le.Tool]) -> (
        le.RunResult):
    """Append the next user message to ``result.messages`` and run again."""
    history = [*result.messages, NEXT]
    assert pairing_problem(history) is None
    return await engine.run(op(), history, tools=tools)


@STREAMING
async def test_a_refused_batch_history_plus_a_user_message_completes_a_second_run(
    wire: Harness, stream: bool
) -> None:
    """tool_batch_limit: no handler ran, each call is closed is_error saying why, and the
    messages plus a new user message complete a second run on the real SDK."""
    counter = Counter()
    engine, _ = wire.engine(Reply.tool_calls(lookup("a"), lookup("b"), lookup("c")),
                            paired(Reply.text("a is 1")), stream=stream)
    first = await engine.run(op(max_tool_batch=2), "Look up a, b and c.", tools=[counter.tool])
    assert first.outcome is le.Outcome.TOOL_BATCH_LIMIT and counter.calls == []

    asked = [b["id"] for b in first.messages[1]["content"] if b["type"] == "tool_use"]
    results = closing(first)
    assert [r["tool_use_id"] for r in results] == asked
    assert all(r["type"] == "tool_result" and r["is_error"] is True for r in results)
    assert all("Not run: the run ended tool_batch_limit" in r["content"]
               and "max_tool_batch=2" in r["content"] for r in results)
    # Without the closing message, the API would refuse the continued history.
    assert pairing_problem([*first.messages[:-1], NEXT]) is not None

    second = await continue_run(engine, first, [counter.tool])
    assert second.outcome is le.Outcome.COMPLETED and second.answer == "a is 1"
    assert len(wire.requests) == 2
    sent = wire.requests[1].messages
    assert sent[:len(first.messages)] == first.messages and sent[-1] == NEXT


async def test_a_spent_tool_budget_closes_the_unrun_calls(wire: Harness) -> None:
    """tool_limit: a batch larger than the budget left is closed, not half run."""
    counter = Counter()
    engine, _ = wire.engine(Reply.tool_calls(lookup("a")),
                            Reply.tool_calls(lookup("b"), lookup("c")),
                            paired(Reply.text("done")))
    first = await engine.run(op(max_tool_calls=2), "go", tools=[counter.tool])
    assert first.outcome is le.Outcome.TOOL_LIMIT and counter.calls == ["a"]
    results = closing(first)
    assert len(results) == 2 and all(r["is_error"] for r in results)
    assert all("tool_limit" in r["content"] for r in results)
    second = await continue_run(engine, first, [counter.tool])
    assert second.outcome is le.Outcome.COMPLETED


async def test_a_credit_limit_with_a_pending_batch_closes_it(wire: Harness) -> None:
    """credit_limit: the batch the crossing turn asked for is closed as not run."""
    counter = Counter()
    engine, _ = wire.engine(Reply.tool_calls(lookup("a")), Reply.tool_calls(lookup("b")),
                            paired(Reply.text("done")), prices=PRICES)
    first = await engine.run(op(credit_hold=200), "go", tools=[counter.tool])
    assert first.outcome is le.Outcome.CREDIT_LIMIT and counter.calls == ["a"]
    (result,) = closing(first)
    assert result["is_error"] is True and "credit_limit" in result["content"]
    second = await continue_run(engine, first, [counter.tool])
    assert second.outcome is le.Outcome.COMPLETED


async def test_a_cut_off_reply_with_a_tool_call_is_closed(wire: Harness) -> None:
    """incomplete: a reply cut at max_tokens in a tool call never runs it, and closes it."""
    counter = Counter()
    cut = Reply(content=[{"type": "tool_use", "id": "toolu_cut", "name": "lookup",
                          "input": {}}], stop_reason="max_tokens")
    engine, _ = wire.engine(cut, paired(Reply.text("done")))
    first = await engine.run(op(), "go", tools=[counter.tool])
    assert first.outcome is le.Outcome.INCOMPLETE and counter.calls == []
    (result,) = closing(first)
    assert result["tool_use_id"] == "toolu_cut" and result["is_error"] is True
    second = await continue_run(engine, first, [counter.tool])
    assert second.outcome is le.Outcome.COMPLETED


class City(pydantic.BaseModel):
    city: str


async def test_an_accepted_structured_answer_is_closed_as_accepted(wire: Harness) -> None:
    """completed (structured): the final_answer call gets a plain result, the calls the
    accepted answer skipped (R14) are closed is_error."""
    counter = Counter()
    engine, _ = wire.engine(Reply.tool_calls(("final_answer", {"city": "Oslo"}), lookup("a")),
                            paired(Reply.text("You are welcome.")))
    first = await engine.run(op(), "Which city?", tools=[counter.tool], output=City)
    assert first.outcome is le.Outcome.COMPLETED and first.answer == City(city="Oslo")
    accepted, skipped = closing(first)
    assert accepted["content"] == "The answer was accepted." and "is_error" not in accepted
    assert skipped["is_error"] is True and "the answer was accepted" in skipped["content"]
    assert counter.calls == [] and first.tool_calls == 0
    second = await continue_run(engine, first, [counter.tool])
    assert second.outcome is le.Outcome.COMPLETED


async def test_a_rejected_structured_answer_without_budget_keeps_its_feedback(
    wire: Harness,
) -> None:
    """tool_limit on a rejection: the final_answer call is closed with the judge's
    feedback, the other call as not run."""
    engine, _ = wire.engine(Reply.tool_calls(("final_answer", {"city": "Atlantis"}),
                                             lookup("a")),
                            paired(Reply.text("Sorry.")))
    first = await engine.run(op(max_tool_calls=0), "Which city?", tools=[Counter().tool],
                             output=City, accept=lambda a: le.Reject("not a real city"))
    assert first.outcome is le.Outcome.TOOL_LIMIT
    rejected, unrun = closing(first)
    assert rejected["is_error"] is True and rejected["content"] == "not a real city"
    assert unrun["is_error"] is True and unrun["content"].startswith("Not run")
    second = await continue_run(engine, first, [Counter().tool])
    assert second.outcome is le.Outcome.COMPLETED


async def test_a_turn_limit_history_already_ends_with_the_results(wire: Harness) -> None:
    """turn_limit: the last turn's tools ran, so their results already close it."""
    counter = Counter()
    engine, _ = wire.engine(Reply.tool_calls(lookup("a")), paired(Reply.text("done")))
    first = await engine.run(op(max_turns=1), "go", tools=[counter.tool])
    assert first.outcome is le.Outcome.TURN_LIMIT and counter.calls == ["a"]
    (result,) = closing(first)
    assert result["content"] == "value of a" and "is_error" not in result
    second = await continue_run(engine, first, [counter.tool])
    assert second.outcome is le.Outcome.COMPLETED


async def test_a_deadline_history_closes_the_handlers_it_cut_and_a_sync_one_runs_on(
    fake_anthropic_server: FakeAnthropicServer,
) -> None:
    """time_limit: the handlers still running at the deadline get is_error results, and
    the run returns at the deadline. A sync handler's thread cannot be stopped: it goes
    on after the run returned, and what it returns is discarded. The handlers never
    finish by themselves (the sync one waits to be released), and the deadline
    passes on a clock the test moves once both are running: nothing races it."""
    clock = ExpiringClock()
    sync_running, release, finished = threading.Event(), threading.Event(), threading.Event()
    async_running = anyio.Event()

    @le.tool
    def slow_sync(key: str) -> str:
        """Block its worker thread past the deadline, until released."""
        sync_running.set()
        release.wait(60)
        finished.set()
        return "late sync result"

    @le.tool
    async def slow_async(key: str) -> str:
        """Await past the deadline."""
        async_running.set()
        await anyio.sleep_forever()
        return "late async result"

    async with harness(fake_anthropic_server, clock) as wire:
        engine, _ = wire.engine(
            Reply.tool_calls(("slow_sync", {"key": "a"}), ("slow_async", {"key": "b"})),
            paired(Reply.text("done")))
        ended: list[le.RunResult] = []

        async def run() -> None:
            ended.append(await engine.run(op(total_time=4.0), "go",
                                          tools=[slow_sync, slow_async]))

        async with anyio.create_task_group() as group:
            group.start_soon(run)
            await async_running.wait()
            assert await anyio.to_thread.run_sync(sync_running.wait, 60)
            clock.advance(4.0)  # the deadline, with both handlers running
        (first,) = ended
        assert first.outcome is le.Outcome.TIME_LIMIT
        assert not finished.is_set()  # the run returned without waiting for the thread
        release.set()
        results = closing(first)
        assert len(results) == 2 and all(r["is_error"] is True for r in results)
        assert all("did not finish before the run's time ran out" in r["content"]
                   for r in results)
        second = await continue_run(engine, first, [slow_sync, slow_async])
        assert second.outcome is le.Outcome.COMPLETED
        assert finished.wait(60)  # the abandoned thread ran to its end
        assert "late sync result" not in str(first.messages)
