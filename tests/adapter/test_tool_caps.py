"""Per-tool caps and timeouts (docs/tools.md): a call past its tool's
``max_calls``, or running past its ``timeout``, gets a recoverable ``is_error``
result and the run goes on within its budgets (R08). Through AnthropicProvider,
the real SDK and the loopback server."""

from __future__ import annotations

import threading

import anyio
import anyio.to_thread
import pytest
import trio
import trio.testing

import loopengine as le
from loopengine import events
from loopengine.persistence import MemoryLedger
from loopengine.providers import ScriptedProvider
from loopengine.testing import Reply

from ..conftest import PRICES, operation
from .conftest import Harness, tool_results


async def test_max_calls_answers_the_first_calls_and_refuses_the_rest(wire: Harness) -> None:
    """``max_calls=1`` and three calls over two turns: the handler runs once, the
    other two get error results naming the cap, each uses a unit of budget, and
    the run completes."""
    ran: list[str] = []
    seen: list[events.Event] = []

    @le.tool(max_calls=1)
    def probe(key: str) -> str:
        """Look a key up."""
        ran.append(key)
        return key.upper()

    engine, _ = wire.engine(Reply.tool_calls(("probe", {"key": "a"}), ("probe", {"key": "b"})),
                            Reply.tool_calls(("probe", {"key": "c"})), Reply.text("done"),
                            observers=[seen.append])
    result = await engine.run(operation(), "go", tools=[probe])
    assert result.outcome is le.Outcome.COMPLETED and result.tool_calls == 3
    assert ran == ["a"]
    first, second = tool_results(wire.requests[1]), tool_results(wire.requests[2])
    assert [r.get("is_error", False) for r in first] == [False, True]
    assert "at most 1 times" in first[1]["content"]
    assert second[0]["is_error"] and "at most 1 times" in second[0]["content"]
    failed = [e for e in seen if isinstance(e, events.ToolCallEvent) and e.status == "failed"]
    assert [e.error for e in failed] == ["max_calls", "max_calls"]


async def test_max_calls_zero_never_runs_the_handler(wire: Harness) -> None:
    @le.tool(max_calls=0)
    def never(key: str) -> str:
        """Never runs."""
        raise AssertionError("ran")

    engine, _ = wire.engine(Reply.tool_calls(("never", {"key": "a"})), Reply.text("ok"))
    result = await engine.run(operation(), "go", tools=[never])
    assert result.outcome is le.Outcome.COMPLETED
    assert tool_results(wire.requests[1])[0]["is_error"]


async def test_a_call_whose_input_fails_its_check_uses_none_of_the_cap(wire: Harness) -> None:
    """``max_calls=1``: a call whose input fails its check never reaches the
    handler (R15), so it is not one of the calls the cap counts; the model's
    corrected call, in the same batch after it and in the next turn, runs
    once, and only the one after that is refused."""
    ran: list[int] = []

    @le.tool(max_calls=1)
    def pay(amount: int) -> str:
        """Pay an amount."""
        ran.append(amount)
        return "paid"

    engine, _ = wire.engine(
        Reply.tool_calls(("pay", {"amount": "ten"}), ("pay", {"amount": 10})),
        Reply.tool_calls(("pay", {"amount": 11})), Reply.text("done"))
    result = await engine.run(operation(), "go", tools=[pay])
    assert result.outcome is le.Outcome.COMPLETED and result.tool_calls == 3
    assert ran == [10]
    invalid, paid = tool_results(wire.requests[1])
    assert invalid["is_error"] and "Invalid input for pay" in invalid["content"]
    assert paid["content"] == "paid" and "is_error" not in paid
    (capped,) = tool_results(wire.requests[2])
    assert capped["is_error"] and "at most 1 times" in capped["content"]


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_a_handler_past_its_timeout_gets_an_error_result(kind: str) -> None:
    """A handler that runs past ``timeout=0.2``: the async one is cancelled, the
    sync one's thread abandoned (it finishes later, unseen); the call's result is
    an error naming the timeout and the run completes 0.2 s after it began. On
    trio's MockClock, in process: the time is exact and nothing sleeps for real."""
    finished, release = threading.Event(), threading.Event()

    async def slow_async(key: str) -> str:
        """Take too long."""
        await anyio.sleep(10)
        return "late"

    def slow_sync(key: str) -> str:
        """Take too long, in a thread: until the test releases it."""
        release.wait(30)
        finished.set()
        return "late"

    handler = le.tool(slow_async if kind == "async" else slow_sync, name="slow", timeout=0.2)
    seen: list[events.Event] = []
    provider = ScriptedProvider([Reply.tool_calls(("slow", {"key": "a"})), Reply.text("ok")])
    engine = le.Engine(provider, prices=PRICES, observers=[seen.append])
    outcome: list[tuple[le.RunResult, float]] = []

    async def main() -> None:
        began = anyio.current_time()
        result = await engine.run(operation(), "go", tools=[handler])
        outcome.append((result, anyio.current_time() - began))

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    ((result, elapsed),) = outcome
    (timed_out,) = provider.requests[1].messages[-1]["content"]
    assert result.outcome is le.Outcome.COMPLETED and result.tool_calls == 1
    assert elapsed == pytest.approx(0.2)
    assert timed_out["is_error"] and "timeout of 0.2s" in timed_out["content"]
    failed = [e for e in seen if isinstance(e, events.ToolCallEvent) and e.status == "failed"]
    assert [e.error for e in failed] == ["timeout"]
    if kind == "sync":
        assert not finished.is_set()
        release.set()
        assert finished.wait(30)  # the abandoned thread runs on to its end


def test_a_handler_that_makes_an_error_of_its_timeout_is_still_timed_out() -> None:
    """A handler that catches its timeout's cancellation and raises an error of
    its own: the call was cut all the same, so the model reads the timeout
    ("its result is not known") and the run store records the call
    ``in_doubt`` (it may have done its work), not ``failed``. On trio's
    MockClock: nothing sleeps for real."""

    @le.tool(timeout=0.2)
    async def transfer(amount: int) -> str:
        """Transfer an amount."""
        try:
            await anyio.sleep(10)
        except BaseException:
            raise RuntimeError("transfer aborted") from None
        return "transferred"

    ledger = MemoryLedger()
    store = le.RunStore(ledger)
    provider = ScriptedProvider([Reply.tool_calls(("transfer", {"amount": 5})),
                                 Reply.text("ok")])
    engine = le.Engine(provider, ledger=ledger, prices=PRICES, run_store=store)
    outcome: list[tuple[le.RunResult, dict[str, str]]] = []

    async def main() -> None:
        result = await engine.run(operation(), "go", tools=[transfer])
        outcome.append((result, await store.tool_calls(result.invocation_id)))

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    ((result, rows),) = outcome
    assert result.outcome is le.Outcome.COMPLETED
    (cut,) = provider.requests[1].messages[-1]["content"]
    assert cut["is_error"] and "timeout of 0.2s; its result is not known" in cut["content"]
    assert list(rows.values()) == ["in_doubt"]


def test_an_abandoned_sync_handler_holds_no_thread_for_later_calls() -> None:
    """On trio a thread holds its limiter's token until it ends, even once its
    caller abandoned it: a sync handler past its timeout, abandoned, kept one
    of the default limiter's tokens, and once those were gone every later sync
    handler waited for one (until its run's deadline). An abandoned handler
    now gives its token back at once, as on asyncio, and the next call runs.
    One token stands for the forty the default limiter has. On trio's
    MockClock; the runs have no deadline, so time moves only to the timeout."""
    release = threading.Event()

    @le.tool(timeout=0.2)
    def stuck(key: str) -> str:
        """Wait until the test lets it go."""
        release.wait(30)
        return "late"

    @le.tool
    def quick(key: str) -> str:
        """Answer at once."""
        return f"quick {key}"

    provider = ScriptedProvider([Reply.tool_calls(("stuck", {"key": "a"})), Reply.text("ok"),
                                 Reply.tool_calls(("quick", {"key": "b"})), Reply.text("ok")])
    engine = le.Engine(provider, prices=PRICES)
    seen: list[tuple[le.RunResult, int]] = []

    async def main() -> None:
        limiter = anyio.to_thread.current_default_thread_limiter()
        limiter.total_tokens = 1
        try:
            first = await engine.run(operation(total_time=None), "go", tools=[stuck])
            seen.append((first, limiter.borrowed_tokens))
            if limiter.borrowed_tokens == 0:
                seen.append((await engine.run(operation(total_time=None), "go",
                                              tools=[quick]), limiter.borrowed_tokens))
        finally:
            release.set()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    first, held = seen[0]
    assert first.outcome is le.Outcome.COMPLETED and held == 0
    (second, _) = seen[1]
    assert second.outcome is le.Outcome.COMPLETED
    (answer,) = provider.requests[3].messages[-1]["content"]
    assert answer["content"] == "quick b"


def test_caps_and_timeouts_are_validated() -> None:
    def handler(key: str) -> str:
        """A handler."""
        return key

    for bad in (-1, 1.5, "2", True):
        with pytest.raises(le.ConfigError) as info:
            le.tool(handler, max_calls=bad)  # type: ignore[call-overload]
        assert info.value.field == "max_calls"
    for bad_timeout in (0, -1, float("nan"), "1"):
        with pytest.raises(le.ConfigError) as info:
            le.tool(handler, timeout=bad_timeout)  # type: ignore[call-overload]
        assert info.value.field == "timeout"
    built = le.tool(handler, max_calls=3, timeout=2)
    assert (built.max_calls, built.timeout) == (3, 2.0)
