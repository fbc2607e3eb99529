"""Events: their exact order in a run, their fields, and observers that misbehave."""

from __future__ import annotations

import logging
import random
from dataclasses import fields
from datetime import timedelta
from decimal import Decimal
from typing import Any

import anyio
import pytest

import loopengine as le
from loopengine import events
from loopengine.persistence import MemoryLedger
from loopengine.providers import FaultKind, ProviderFault, Reply, ScriptedProvider
from loopengine.testing import FakeClock

MODEL = "claude-events-test"

PRICES = le.PriceBook(
    [le.ModelPrice(provider="anthropic", model=MODEL, input_per_mtok=Decimal(3),
                   output_per_mtok=Decimal(15), cache_read_per_mtok=Decimal("0.3"),
                   cache_write_per_mtok=Decimal("3.75"))],
    credits_per_usd=Decimal(1000),
)

# Cached tokens on purpose: the events must count them inside the input.
USAGE = le.Usage(input_tokens=100, output_tokens=20, cache_read_tokens=30, cache_write_tokens=10)
USAGE_USD = Decimal("0.0006465")  # (100*3 + 20*15 + 30*0.3 + 10*3.75) / 1e6

OPERATION = le.Operation(name="events.test", provider="anthropic", model=MODEL,
                         max_output_tokens=256, limits=le.Limits(max_turns=2))


def scripted(clock: FakeClock) -> ScriptedProvider:
    """A retry on turn 1, a tool on each turn, and no answer, so max_turns trips."""
    return ScriptedProvider([
        # Reported usage on a failed attempt: billed by the provider, never charged (S01).
        ProviderFault(FaultKind.OVERLOADED, "overloaded", http_status=529,
                      usage=le.Usage(input_tokens=50, output_tokens=5)),
        tool_reply("toolu_a", "lookup", {"key": "a"}),
        tool_reply("toolu_b", "missing_tool", {}),
    ], clock=clock)


def tool_reply(call_id: str, name: str, tool_input: dict[str, Any]) -> Reply:
    """A tool call with a fixed id, so that two runs' transcripts compare equal."""
    return Reply(content=[{"type": "tool_use", "id": call_id, "name": name,
                           "input": tool_input}], stop_reason="tool_use", usage=USAGE)


def lookup_tool(clock: FakeClock) -> le.Tool:
    """A tool that takes a quarter of a second of fake time."""

    @le.tool(name="lookup", description="Look a key up.")
    async def lookup(key: str) -> str:
        await clock.sleep(0.25)
        return f"value of {key}"

    return lookup


def make_engine(clock: FakeClock, observers: list[Any]) -> le.Engine:
    return le.Engine(scripted(clock), prices=PRICES, clock=clock, rng=random.Random(3),
                     observers=observers)


async def run_scripted(observers: list[Any]) -> tuple[le.RunResult, FakeClock]:
    clock = FakeClock()
    result = await make_engine(clock, observers).run(OPERATION, "go",
                                                     tools=[lookup_tool(clock)])
    return result, clock


def shape(event: events.Event) -> tuple[Any, ...]:
    """The identifying fields of an event, for comparing sequences."""
    if isinstance(event, events.TurnStarted):
        return ("TurnStarted", event.turn, event.phase)
    if isinstance(event, events.AttemptStarted):
        return ("AttemptStarted", event.ordinal, event.turn, event.attempt)
    if isinstance(event, events.AttemptSettled):
        return ("AttemptSettled", event.ordinal, event.outcome, event.fault)
    if isinstance(event, events.ToolCallEvent):
        return ("ToolCallEvent", event.tool_name, event.status)
    if isinstance(event, events.GuardTripped):
        return ("GuardTripped", event.guard, event.observed, event.limit)
    if isinstance(event, events.RunEnded):
        return ("RunEnded", event.outcome)
    return (type(event).__name__,)


EXPECTED = [
    ("RunStarted",),
    ("TurnStarted", 1, "turn"),
    ("AttemptStarted", 1, 1, 1),
    ("AttemptSettled", 1, "error", "overloaded"),
    ("AttemptStarted", 2, 1, 2),
    ("AttemptSettled", 2, "ok", None),
    ("ToolCallEvent", "lookup", "started"),
    ("ToolCallEvent", "lookup", "succeeded"),
    ("TurnStarted", 2, "turn"),
    ("AttemptStarted", 3, 2, 1),
    ("AttemptSettled", 3, "ok", None),
    ("ToolCallEvent", "missing_tool", "started"),
    ("ToolCallEvent", "missing_tool", "failed"),
    ("GuardTripped", "max_turns", 2, 2),
    ("RunEnded", "turn_limit"),
]


async def test_exact_event_sequence_of_a_run_with_a_retry_and_a_guard_trip() -> None:
    """A retried turn, two tool calls and a max_turns trip give exactly this sequence."""
    seen: list[events.Event] = []
    result, clock = await run_scripted([seen.append])
    assert result.outcome is le.Outcome.TURN_LIMIT
    assert [shape(e) for e in seen] == EXPECTED
    assert {e.run_id for e in seen} == {result.invocation_id}
    # Times come from the engine's clock and never go backwards.
    assert [e.at for e in seen] == sorted(e.at for e in seen)


async def test_events_carry_the_run_and_attempt_facts() -> None:
    """RunStarted, the attempts, the guard trip and RunEnded say what happened."""
    seen: list[events.Event] = []
    result, clock = await run_scripted([seen.append])
    started = seen[0]
    assert isinstance(started, events.RunStarted)
    assert (started.operation, started.operation_version, started.provider, started.model,
            started.kind) == ("events.test", "1", "anthropic", MODEL, "run")

    attempts = [e for e in seen if isinstance(e, events.AttemptStarted)]
    settled = [e for e in seen if isinstance(e, events.AttemptSettled)]
    wait = clock.sleeps[0]
    assert wait > 0
    assert [a.wait_ms for a in attempts] == [0, round(wait * 1000), 0]
    assert attempts[1].at - attempts[0].at == timedelta(seconds=wait)
    assert all(a.max_tokens == 256 and a.served_by == f"anthropic:{MODEL}" for a in attempts)

    failed, ok = settled[0], settled[1]
    assert (failed.http_status, failed.charged, failed.usage) == (
        529, False, le.Usage(input_tokens=50, output_tokens=5))
    assert failed.cost_usd == Decimal("0.000225")  # priced, but not charged
    assert (ok.charged, ok.usage, ok.cost_usd, ok.stop_reason) == (True, USAGE, USAGE_USD,
                                                                   "tool_use")
    assert ok.response_id is not None and ok.request_id is not None

    trip = seen[-2]
    assert isinstance(trip, events.GuardTripped)
    assert (trip.outcome, trip.limit) == ("turn_limit", 2)
    ended = seen[-1]
    assert isinstance(ended, events.RunEnded)
    assert (ended.turns, ended.tool_calls, ended.attempts, ended.credits) == (
        result.turns, result.tool_calls, 3, result.credits)
    assert (ended.usage, ended.cost_usd) == (result.usage, result.cost_usd)


async def test_tool_call_event_fields_are_filled_from_the_asking_turn() -> None:
    """Every field of the `tool.call` payload is set: tokens, model, provider, spend of
    the asking turn."""
    seen: list[events.Event] = []
    result, _ = await run_scripted([seen.append])
    calls = [e for e in seen if isinstance(e, events.ToolCallEvent)]
    assert len(calls) == 4
    for call in calls:
        assert call.run_id == result.invocation_id
        # 100 uncached + 30 read + 10 written, plus 20 out.
        assert (call.input_tokens, call.output_tokens, call.token_cost) == (140, 20, 160)
        assert (call.model_id, call.provider) == (MODEL, "anthropic")
        # The failed attempt of turn 1 reported usage but is not part of its spend.
        assert call.spend_usd == USAGE_USD
    started, succeeded, missing_started, missing_failed = calls
    assert (started.turn, started.latency_ms, started.error) == (1, 0, None)
    assert (succeeded.status, succeeded.latency_ms, succeeded.error) == ("succeeded", 250, None)
    assert [c.tool_use_id for c in calls] == ["toolu_a", "toolu_a", "toolu_b", "toolu_b"]
    assert (missing_started.turn, missing_failed.turn) == (2, 2)
    assert (missing_failed.status, missing_failed.error) == ("failed", "unknown tool")


async def test_failed_handler_gives_a_failed_tool_call_event() -> None:
    """A handler that raises ends its call ``failed`` with the exception's type."""
    clock = FakeClock()

    @le.tool(name="broken", description="Always fails.")
    def broken() -> str:
        raise RuntimeError("no")

    seen: list[events.Event] = []
    provider = ScriptedProvider([Reply.tool_calls(("broken", {})), Reply.text("done")],
                                clock=clock)
    engine = le.Engine(provider, prices=PRICES, clock=clock, observers=[seen.append])
    result = await engine.run(OPERATION, "go", tools=[broken])
    assert result.outcome is le.Outcome.COMPLETED
    calls = [e for e in seen if isinstance(e, events.ToolCallEvent)]
    assert [(c.status, c.error) for c in calls] == [
        ("started", None), ("failed", "handler raised RuntimeError")]


async def test_async_and_sync_observers_receive_the_same_events_in_order() -> None:
    """An async observer is awaited; it sees what a sync observer sees, in order."""
    sync_seen: list[events.Event] = []
    async_seen: list[events.Event] = []

    async def async_observer(event: events.Event) -> None:
        await anyio.lowlevel.checkpoint()
        async_seen.append(event)

    await run_scripted([sync_seen.append, async_observer])
    assert [shape(e) for e in async_seen] == EXPECTED
    assert async_seen == sync_seen


def outcome_facts(result: le.RunResult) -> tuple[Any, ...]:
    return (result.outcome, result.turns, result.tool_calls, result.usage, result.cost_usd,
            result.credits, result.attempts, result.messages)


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_raising_observer_leaves_the_outcome_unchanged_and_is_logged(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An observer that raises on every event changes nothing and is logged each time."""
    baseline, _ = await run_scripted([])

    def sync_bad(event: events.Event) -> None:
        raise ValueError("observer bug")

    async def async_bad(event: events.Event) -> None:
        await anyio.lowlevel.checkpoint()
        raise ValueError("observer bug")

    after: list[events.Event] = []
    with caplog.at_level(logging.ERROR, logger="loopengine"):
        result, _ = await run_scripted([sync_bad if kind == "sync" else async_bad,
                                        after.append])
    assert outcome_facts(result) == outcome_facts(baseline)
    # The observers after the broken one still get every event.
    assert [shape(e) for e in after] == EXPECTED
    failures = [r for r in caplog.records if r.name == "loopengine"
                and r.levelno == logging.ERROR]
    assert len(failures) == len(EXPECTED)
    assert all(r.exc_info is not None and r.exc_info[0] is ValueError for r in failures)
    assert "RunStarted" in failures[0].getMessage()


def test_events_are_frozen() -> None:
    """An event cannot be changed after it is made."""
    event = events.TurnStarted(run_id="r", at=FakeClock().wall(), turn=1, phase="turn")
    with pytest.raises(AttributeError):
        event.turn = 2  # type: ignore[misc]


def test_tool_call_event_has_the_reference_fields() -> None:
    """ToolCallEvent carries the `tool.call` payload and accounting fields
    (docs/observability.md, "Fields")."""
    names = {f.name for f in fields(events.ToolCallEvent)}
    assert {"run_id", "tool_name", "status", "latency_ms", "token_cost", "input_tokens",
            "output_tokens", "model_id", "provider", "spend_usd"} <= names


@pytest.mark.parametrize("slow_on", [events.TurnStarted, events.AttemptStarted])
def test_r04_a_slow_observer_does_not_eat_into_the_attempt_s_timeout(
        slow_on: type[events.Event]) -> None:
    """An observer that takes 6 s on the attempt's announcement leaves the attempt
    its whole 10 s: a reply 6 s after it was sent is not cut as a timeout and
    retried (another request, billed). On trio's MockClock, whose time jumps
    only when every task waits: no real time passes."""
    import trio
    import trio.testing

    seen: list[events.Event] = []

    async def slow(event: events.Event) -> None:
        seen.append(event)
        if type(event) is slow_on:
            await anyio.sleep(6.0)

    async def main() -> le.RunResult:
        provider = ScriptedProvider([Reply.text("in time", delay=6.0), Reply.text("retried")])
        engine = le.Engine(provider, prices=PRICES, observers=[slow])
        operation = le.Operation(name="events.test", provider="anthropic", model=MODEL,
                                 max_output_tokens=256, limits=le.Limits(attempt_timeout=10.0))
        return await engine.run(operation, "go")

    result = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert (result.outcome, result.answer) == (le.Outcome.COMPLETED, "in time")
    assert [(e.outcome, e.fault) for e in seen if isinstance(e, events.AttemptSettled)] == [
        ("ok", None)]


async def test_a_slow_observer_s_time_is_not_a_tool_call_s_latency() -> None:
    """An observer that takes 5 s on a call's ``started`` leaves its latency_ms
    what the handler took (250 ms), as without it."""
    clock = FakeClock()
    seen: list[events.Event] = []

    async def slow(event: events.Event) -> None:
        seen.append(event)
        if isinstance(event, events.ToolCallEvent) and event.status == "started":
            await clock.sleep(5.0)

    await make_engine(clock, [slow]).run(OPERATION, "go", tools=[lookup_tool(clock)])
    calls = [e for e in seen if isinstance(e, events.ToolCallEvent)]
    assert [(c.tool_name, c.status, c.latency_ms) for c in calls] == [
        ("lookup", "started", 0), ("lookup", "succeeded", 250),
        ("missing_tool", "started", 0), ("missing_tool", "failed", 0)]


async def test_r07_an_observer_s_system_exit_before_the_request_settles_the_announced_attempt(
) -> None:
    """An observer raising SystemExit on `AttemptStarted` stops the run (``failed``)
    after the attempt's row was written and announced, before its request went
    out: the attempt is settled ``aborted`` (nothing sent), in the ledger and to
    observers, and counted, so that no row and no observer holds it open; the
    turn it alone would have sent is not counted (R01)."""
    clock = FakeClock()
    seen: list[events.Event] = []

    def exits(event: events.Event) -> None:
        if isinstance(event, events.AttemptStarted):
            raise SystemExit(3)

    ledger = MemoryLedger()
    provider = ScriptedProvider([Reply.text("never sent")], clock=clock)
    engine = le.Engine(provider, ledger=ledger, prices=PRICES, clock=clock,
                       observers=[seen.append, exits])
    with pytest.raises(SystemExit):
        await engine.run(OPERATION, "go")
    assert provider.requests == []
    (row,) = ledger.attempts.values()
    assert (row["ordinal"], row["outcome"], row["aborted_reason"]) == (1, "aborted", "external")
    assert [shape(e) for e in seen] == [
        ("RunStarted",), ("TurnStarted", 1, "turn"), ("AttemptStarted", 1, 1, 1),
        ("AttemptSettled", 1, "aborted", None), ("RunEnded", "failed")]
    ended = seen[-1]
    assert isinstance(ended, events.RunEnded) and (ended.attempts, ended.turns) == (1, 0)
    (invocation,) = ledger.invocations.values()
    assert (invocation["outcome"], invocation["turns"]) == ("failed", 0)
