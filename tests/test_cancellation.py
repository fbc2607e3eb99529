"""The caller's cancellation propagates; it is recorded, never turned into an outcome."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import pydantic
import pytest
import trio
import trio.testing

import loopengine as le
from loopengine.events import AttemptSettled, AttemptStarted, Event, RunEnded, ToolCallEvent
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
from .test_deadline import on_mock_clock


class Hanging(Provider):
    """A provider whose requests never come back (until cancelled)."""

    name = "anthropic"

    def __init__(self) -> None:
        self.started = anyio.Event()

    async def send(self, request: ProviderRequest, *,
                   on_text: TextCallback | None = None) -> ProviderResponse:
        self.started.set()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")


async def test_cancel_while_a_request_is_on_the_wire() -> None:
    """The in-flight attempt settles aborted/external, the invocation cancelled, and the
    cancellation reaches the caller's scope."""
    ledger = MemoryLedger()
    events: list[Event] = []
    provider = Hanging()
    engine = le.Engine(provider, ledger=ledger, prices=PRICES, observers=[events.append])
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as group:
            async def run() -> None:
                await engine.run(operation(), "go")
                raise AssertionError("run returned after cancellation")

            group.start_soon(run)
            await provider.started.wait()
            scope.cancel()
    assert scope.cancelled_caught
    (invocation,) = ledger.invocations.values()
    assert invocation["outcome"] == "cancelled"
    (attempt,) = ledger.attempts.values()
    assert (attempt["outcome"], attempt["aborted_reason"]) == ("aborted", "external")
    assert isinstance(events[-1], RunEnded) and events[-1].outcome == "cancelled"


async def test_cancel_while_tools_run() -> None:
    """Cancelled during a tool handler: the invocation is cancelled, the handler stopped."""
    entered = anyio.Event()
    finished: list[bool] = []

    @le.tool
    async def slow(key: str) -> str:
        """Take forever."""
        entered.set()
        await anyio.sleep_forever()
        finished.append(True)
        return key

    ledger = MemoryLedger()
    provider = ScriptedProvider([Reply.tool_calls(("slow", {"key": "k"}))])
    engine = le.Engine(provider, ledger=ledger, prices=PRICES)
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as group:
            group.start_soon(lambda: engine.run(operation(), "go", tools=[slow]))
            await entered.wait()
            scope.cancel()
    assert scope.cancelled_caught and finished == []
    (invocation,) = ledger.invocations.values()
    assert invocation["outcome"] == "cancelled"
    assert [a["outcome"] for a in ledger.attempts.values()] == ["ok"]


async def test_r08_a_batch_cut_by_the_callers_cancellation_uses_its_tool_budget() -> None:
    """Cancelled while the second turn's batch runs (one call answered, one
    still running): the ledger records the run's three calls, as it would
    had the deadline cut the batch; the cut batch's calls may have run."""
    entered = anyio.Event()

    @le.tool
    async def slow(key: str) -> str:
        """Take forever."""
        entered.set()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    @le.tool
    async def fast(key: str) -> str:
        """Answer at once."""
        return key

    ledger = MemoryLedger()
    provider = ScriptedProvider([Reply.tool_calls(("fast", {"key": "a"})),
                                 Reply.tool_calls(("fast", {"key": "b"}), ("slow", {"key": "c"}))])
    engine = le.Engine(provider, ledger=ledger, prices=PRICES)
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as group:
            group.start_soon(lambda: engine.run(operation(), "go", tools=[slow, fast]))
            await entered.wait()
            scope.cancel()
    assert scope.cancelled_caught
    (invocation,) = ledger.invocations.values()
    assert (invocation["outcome"], invocation["turns"], invocation["tool_calls"]) == (
        "cancelled", 2, 3)


@pytest.mark.parametrize("cut", ["the caller", "the deadline"])
def test_r04_a_handler_that_makes_an_error_of_the_runs_cancellation_is_cut_in_doubt(
        cut: str) -> None:
    """A handler that catches the run's cancellation (its caller's, or its
    deadline's) and raises an error of its own: its call was cut all the
    same, so the run store records it ``in_doubt``, never ``failed``, and a
    deadline's transcript says it did not finish, not the handler's error.
    On trio's MockClock: nothing sleeps for real."""
    rows: dict[str, str] = {}
    ended: list[le.RunResult] = []

    async def main() -> None:
        entered = anyio.Event()

        @le.tool
        async def transfer(amount: int) -> str:
            """Transfer an amount."""
            entered.set()
            try:
                await anyio.sleep_forever()
            except BaseException:
                raise RuntimeError("transfer aborted") from None
            raise AssertionError("unreachable")

        ledger = MemoryLedger()
        store = le.RunStore(ledger)
        provider = ScriptedProvider([Reply.tool_calls(("transfer", {"amount": 5}))])
        engine = le.Engine(provider, ledger=ledger, prices=PRICES, run_store=store)
        if cut == "the deadline":
            ended.append(await engine.run(operation(total_time=2.0), "go", tools=[transfer]))
        else:
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as group:
                    group.start_soon(lambda: engine.run(operation(), "go", tools=[transfer]))
                    await entered.wait()
                    scope.cancel()
        (invocation_id,) = ledger.invocations
        rows.update(await store.tool_calls(invocation_id))

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert list(rows.values()) == ["in_doubt"]
    if ended:
        (result,) = ended
        assert result.outcome is le.Outcome.TIME_LIMIT
        (answer,) = result.messages[-1]["content"]
        assert "did not finish before the run's time ran out" in answer["content"]


def test_run_deadline_bounds_tool_handlers() -> None:
    """Handlers run under the run's deadline: a slow one is cut at it exactly
    (on trio's MockClock, nothing sleeps for real), the run ends time_limit."""

    @le.tool
    async def slow(key: str) -> str:
        """Never finish by itself."""
        await anyio.sleep(3600)
        return key

    provider = ScriptedProvider([Reply.tool_calls(("slow", {"key": "k"})), Reply.text("never")])
    engine = le.Engine(provider, prices=PRICES)
    # The handler never ends: only the deadline does.
    result, took = on_mock_clock(
        lambda: engine.run(operation(total_time=5.0), "go", tools=[slow]))
    assert result.outcome is le.Outcome.TIME_LIMIT and took == pytest.approx(5.0)
    (tool_result,) = result.messages[-1]["content"]
    assert tool_result["is_error"] is True and "time" in tool_result["content"]
    assert len(provider.requests) == 1


@pytest.mark.parametrize("where", ["judge", "handler"])
async def test_exceptions_of_user_code_are_not_cancellation(where: str) -> None:
    """A judge or handler raising is a rejection or an error result, never a crash."""

    @le.tool
    async def boom(key: str) -> str:
        """Fail."""
        raise KeyError(key)

    def judge(answer: str) -> bool:
        if where == "judge" and answer == "a":
            raise ZeroDivisionError("bad judge")
        return True

    script = [Reply.tool_calls(("boom", {"key": "k"})), Reply.text("a"), Reply.text("b")]
    engine = le.Engine(ScriptedProvider(script), prices=PRICES)
    result = await engine.run(operation(), "go", tools=[boom], accept=judge)
    assert result.outcome is le.Outcome.COMPLETED
    assert result.answer == ("b" if where == "judge" else "a")


class ServedThenHanging(ScriptedProvider):
    """Serves its script, then its next request never comes back (until cancelled)."""

    def __init__(self, *script: Reply) -> None:
        super().__init__(list(script))
        self.served = len(script)
        self.started = anyio.Event()

    async def send(self, request: ProviderRequest, *,
                   on_text: TextCallback | None = None) -> ProviderResponse:
        if self.served:
            self.served -= 1
            return await super().send(request, on_text=on_text)
        self.started.set()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")


async def test_r03_a_run_cancelled_mid_turn_is_charged_what_the_turn_was_served() -> None:
    """Cancelled while its turn's continuation is on the wire, after the turn's
    first reply (pause_turn) was served: that reply is billed, so the run's
    credits and its account's charge count it, as a turn cut by the deadline."""
    ledger = MemoryLedger()
    paused_turn = Reply(content=[{"type": "text", "text": "Searching. "}],
                        stop_reason="pause_turn")
    provider = ServedThenHanging(paused_turn)
    engine = le.Engine(provider, ledger=ledger, prices=PRICES)
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as group:
            group.start_soon(engine.run, operation(), "go")
            await provider.started.wait()
            scope.cancel()
    assert scope.cancelled_caught
    (invocation,) = ledger.invocations.values()
    assert invocation["outcome"] == "cancelled"
    assert invocation["credits"] == 120 and invocation["cost_nanousd"] > 0


async def test_r03_a_call_that_fails_after_its_answer_was_served_is_charged_for_it() -> None:
    """`Engine.call` too: its ledger fails just after settling the served,
    charged attempt (the write landed): the call ends failed with that turn's
    charge, as a run would."""

    class Answer(pydantic.BaseModel):
        city: str

    class FailsAfterSettling(MemoryLedger):
        async def settle_attempt(self, record: Any) -> None:
            await super().settle_attempt(record)
            raise le.LedgerError("the disk filled up after the write")

    ledger = FailsAfterSettling()
    provider = ScriptedProvider([Reply.tool_calls(("final_answer", {"city": "Oslo"}))])
    engine = le.Engine(provider, ledger=ledger, prices=PRICES)
    with pytest.raises(le.LedgerError):
        await engine.call(operation(), "Where?", output=Answer)
    (invocation,) = ledger.invocations.values()
    assert invocation["outcome"] == "failed"
    assert invocation["credits"] == 120 and invocation["cost_nanousd"] > 0


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_call_cut_by_the_callers_cancellation_is_announced_ended(backend: str) -> None:
    """Cancelled while one handler of a batch runs: that call's `ToolCallEvent`
    says ``failed`` (``error`` ``cancelled``) before `RunEnded`, the call that
    finished keeps its ``succeeded``, and the run store records the cut call
    ``in_doubt`` (it may have done its work), the finished one ``succeeded``."""
    seen: list[Event] = []
    rows: dict[str, str] = {}

    async def main() -> None:
        entered = anyio.Event()

        @le.tool
        async def slow(key: str) -> str:
            """Take forever."""
            entered.set()
            await anyio.sleep_forever()
            raise AssertionError("unreachable")

        @le.tool
        async def fast(key: str) -> str:
            """Answer at once."""
            return key

        ledger = MemoryLedger()
        store = le.RunStore(ledger)
        provider = ScriptedProvider([Reply.tool_calls(("slow", {"key": "a"}),
                                                      ("fast", {"key": "b"}))])
        engine = le.Engine(provider, ledger=ledger, prices=PRICES, run_store=store,
                           observers=[seen.append])
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as group:
                group.start_soon(lambda: engine.run(operation(), "go", tools=[slow, fast]))
                await entered.wait()
                scope.cancel()
        assert scope.cancelled_caught
        (invocation_id,) = ledger.invocations
        assert ledger.invocations[invocation_id]["outcome"] == "cancelled"
        rows.update(await store.tool_calls(invocation_id))

    anyio.run(main, backend=backend)
    calls = [(e.tool_name, e.status, e.error) for e in seen if isinstance(e, ToolCallEvent)]
    assert sorted(calls) == sorted([("slow", "started", None), ("fast", "started", None),
                                    ("fast", "succeeded", None), ("slow", "failed", "cancelled")])
    assert calls[-1] == ("slow", "failed", "cancelled")
    assert isinstance(seen[-1], RunEnded) and seen[-1].outcome == "cancelled"
    ended = {e.tool_use_id: e.status for e in seen
             if isinstance(e, ToolCallEvent) and e.status != "started"}
    assert rows == {call_id: "in_doubt" if status == "failed" else status
                    for call_id, status in ended.items()}
    assert sorted(rows.values()) == ["in_doubt", "succeeded"]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_an_attempt_cancelled_once_its_row_is_written_is_announced_then_settled(
        backend: str) -> None:
    """Cancelled just after an attempt's dispatch row was written, before it was
    announced or sent: observers see its `AttemptStarted` and then its
    `AttemptSettled` (``aborted``/``external``), as the ledger has it; never a
    settle for an attempt they did not see start."""
    seen: list[Event] = []
    rows: list[dict[str, Any]] = []

    async def main() -> None:
        with anyio.CancelScope() as scope:

            class CancelsAfterDispatch(MemoryLedger):
                async def dispatch_attempt(self, record: Any) -> None:
                    await super().dispatch_attempt(record)
                    scope.cancel()
                    await anyio.lowlevel.checkpoint()

            ledger = CancelsAfterDispatch()
            engine = le.Engine(ScriptedProvider([Reply.text("never sent")]), ledger=ledger,
                               prices=PRICES, observers=[seen.append])
            await engine.run(operation(), "go")
        assert scope.cancelled_caught
        rows.extend(ledger.attempts.values())
        assert [i["outcome"] for i in ledger.invocations.values()] == ["cancelled"]

    anyio.run(main, backend=backend)
    assert [(r["outcome"], r["aborted_reason"]) for r in rows] == [("aborted", "external")]
    attempts = [e for e in seen if isinstance(e, AttemptStarted | AttemptSettled)]
    assert [type(e).__name__ for e in attempts] == ["AttemptStarted", "AttemptSettled"]
    assert {e.ordinal for e in attempts} == {1}
    settled = attempts[1]
    assert isinstance(settled, AttemptSettled)
    assert (settled.outcome, settled.aborted_reason) == ("aborted", "external")
    assert isinstance(seen[-1], RunEnded) and seen[-1].outcome == "cancelled"
