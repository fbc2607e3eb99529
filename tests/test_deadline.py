"""One deadline per run (R04): a cancel scope at the run's absolute deadline
around everything the run awaits, each attempt's timeout taken from the
earliest deadline around it. On trio's MockClock: time is exact, concurrent
waits overlap, and nothing sleeps for real."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pydantic
import pytest
import trio
import trio.testing

import loopengine as le
from loopengine.events import AttemptSettled, AttemptStarted, Event
from loopengine.persistence import MemoryLedger
from loopengine.providers import (
    Provider,
    ProviderRequest,
    ProviderResponse,
    Reply,
    ScriptedProvider,
    TextCallback,
)

from .conftest import PRICES, operation


class Silent(Provider):
    """A provider that never answers."""

    name = "anthropic"

    def __init__(self) -> None:
        self.requests: list[ProviderRequest] = []

    async def send(self, request: ProviderRequest, *,
                   on_text: TextCallback | None = None) -> ProviderResponse:
        self.requests.append(request)
        await anyio.Event().wait()
        raise AssertionError("unreachable")


def on_mock_clock(run: Callable[[], Awaitable[Any]]) -> tuple[Any, float]:
    """``run()`` on trio with MockClock(autojump_threshold=0): its value and the
    (mock) seconds it took."""
    seen: list[tuple[Any, float]] = []

    async def main() -> None:
        began = anyio.current_time()
        value = await run()
        seen.append((value, anyio.current_time() - began))

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return seen[0]


def test_r04_an_attempt_in_flight_at_the_deadline_is_cut_there() -> None:
    """A provider that never answers, total_time=5 and attempt_timeout=60: the run
    ends ``time_limit`` at 5 s exactly; the attempt, sent with a 5 s timeout, is
    ``aborted``/``deadline`` with a ``timeout`` fault; observers see it start and
    settle."""
    ledger, events = MemoryLedger(), list[Event]()
    provider = Silent()
    engine = le.Engine(provider, ledger=ledger, prices=PRICES, observers=[events.append])
    result, took = on_mock_clock(lambda: engine.run(operation(total_time=5.0), "go"))
    assert result.outcome is le.Outcome.TIME_LIMIT and took == pytest.approx(5.0)
    assert result.turns == 1 and provider.requests[0].timeout == pytest.approx(5.0)
    (row,) = ledger.attempts.values()
    assert (row["outcome"], row["aborted_reason"], row["fault"]) == (
        "aborted", "deadline", "timeout")
    assert [type(e) for e in events if isinstance(e, AttemptStarted | AttemptSettled)] == [
        AttemptStarted, AttemptSettled]


def test_r04_a_judge_still_deciding_at_the_deadline_ends_the_run_there() -> None:
    """The deadline holds everywhere: a judge that never returns is cut at the
    deadline, and the run ends ``time_limit`` with its reply billed."""

    async def undecided(answer: str) -> le.Accept:
        await anyio.Event().wait()
        raise AssertionError("unreachable")

    engine = le.Engine(ScriptedProvider([Reply.text("maybe")]), prices=PRICES)
    result, took = on_mock_clock(lambda: engine.run(operation(total_time=3.0), "go",
                                                    accept=undecided))
    assert result.outcome is le.Outcome.TIME_LIMIT and took == pytest.approx(3.0)
    assert result.turns == 1 and result.credits > 0


@le.tool
async def quick(key: str) -> str:
    """Answer at once."""
    return f"value of {key}"


@le.tool
async def stuck(key: str) -> str:
    """Never finish."""
    await anyio.Event().wait()
    raise AssertionError("unreachable")


def test_r04_tools_running_at_the_deadline_get_error_results() -> None:
    """Two handlers of one batch, one quick and one that never finishes: at the
    deadline the quick one's result stands, the other gets an error result saying
    why, both count against the tool budget, and ``result.messages`` can be
    continued."""
    engine = le.Engine(ScriptedProvider([
        Reply.tool_calls(("quick", {"key": "a"}), ("stuck", {"key": "b"}))]), prices=PRICES)
    result, took = on_mock_clock(lambda: engine.run(operation(total_time=2.0), "go",
                                                    tools=[quick, stuck]))
    assert result.outcome is le.Outcome.TIME_LIMIT and took == pytest.approx(2.0)
    assert result.tool_calls == 2
    first, second = result.messages[-1]["content"]
    assert first["content"] == "value of a" and "is_error" not in first
    assert second["is_error"] and "did not finish before the run's time ran out" in (
        second["content"])


def test_r04_a_callers_earlier_deadline_caps_the_attempt_timeout() -> None:
    """Inside the caller's own ``move_on_after(3)``, a run with total_time=10 sends
    its attempt with a 3 s timeout (the earliest deadline around it); the caller's
    scope then cancels the run, recorded ``cancelled``."""
    ledger = MemoryLedger()
    provider = Silent()
    engine = le.Engine(provider, ledger=ledger, prices=PRICES)

    async def run() -> None:
        with anyio.move_on_after(3):
            await engine.run(operation(total_time=10.0), "go")

    _, took = on_mock_clock(run)
    assert took == pytest.approx(3.0)
    assert provider.requests[0].timeout == pytest.approx(3.0)
    (invocation,) = ledger.invocations.values()
    (row,) = ledger.attempts.values()
    assert invocation["outcome"] == "cancelled"
    assert (row["outcome"], row["aborted_reason"], row["timeout_ms"]) == (
        "aborted", "external", 3000)


def test_r04_a_structured_call_is_cut_at_its_deadline() -> None:
    """`Engine.call` runs under the same one deadline: a provider that never
    answers ends the call ``time_limit`` at its deadline, its attempt recorded."""

    class Answer(pydantic.BaseModel):
        value: str

    ledger = MemoryLedger()
    engine = le.Engine(Silent(), ledger=ledger, prices=PRICES)

    async def call() -> BaseException | None:
        try:
            await engine.call(operation(total_time=4.0), "go", output=Answer)
        except le.LoopEngineError as error:
            return error
        return None

    error, took = on_mock_clock(call)
    assert took == pytest.approx(4.0)
    assert getattr(error, "outcome", None) == "time_limit"
    (invocation,) = ledger.invocations.values()
    (row,) = ledger.attempts.values()
    assert invocation["outcome"] == "time_limit"
    assert (row["outcome"], row["aborted_reason"]) == ("aborted", "deadline")
