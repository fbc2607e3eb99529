"""A CancelledError that no cancellation of the run raised (the code awaited a
future something else cancelled) coming out of a provider's ``send``, the
``on_text`` callback or a tool's approval check is that code's failure, never
the run's cancellation (`loopengine._raised`); a real cancellation of the run
stays ``cancelled``. On asyncio and on trio (where an asyncio CancelledError
cancels nothing)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import anyio
import pytest

import loopengine as le
from loopengine.events import Event, RunEnded
from loopengine.persistence import MemoryLedger
from loopengine.providers import Reply, ScriptedProvider

from .conftest import PRICES, operation

OP = operation()
BACKENDS = pytest.mark.parametrize("backend", ["asyncio", "trio"])


def cancelled_future() -> asyncio.Future[None]:
    """A future something else cancelled (on trio, which runs no asyncio loop,
    a CancelledError is raised as it comes instead)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # trio
        raise asyncio.CancelledError from None
    future: asyncio.Future[None] = loop.create_future()
    future.cancel()
    return future


async def stray() -> None:
    """Raise a CancelledError nothing cancelling the running task raised: on
    asyncio, by awaiting a future something else cancelled."""
    await cancelled_future()


def stray_now() -> None:
    """`stray` for sync code: a cancelled future's result."""
    cancelled_future().result()


class StrayProvider(ScriptedProvider):
    """A provider whose first ``send`` raises a stray CancelledError."""

    async def send(self, request: Any, **kwargs: Any) -> Any:
        """Raise it on the first request; serve the script after."""
        if not self.requests:
            self.requests.append(request)
            await stray()
        return await super().send(request, **kwargs)


class WaitingProvider(ScriptedProvider):
    """A provider that never answers; ``arrived`` is set once it waits."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.arrived = anyio.Event()

    async def send(self, request: Any, **kwargs: Any) -> Any:
        """Wait for ever (the run's cancellation ends it)."""
        self.arrived.set()
        await anyio.sleep_forever()


def recorded(ledger: MemoryLedger, seen: list[Event]) -> tuple[str, str, dict[str, Any]]:
    """The run's outcome as the ledger records it and as its one `RunEnded`
    says, and its one attempt's row."""
    (invocation,) = ledger.invocations.values()
    (end,) = [e for e in seen if isinstance(e, RunEnded)]
    (attempt,) = ledger.attempts.values()
    return invocation["outcome"], end.outcome, attempt


@BACKENDS
def test_a_stray_cancellation_from_send_is_the_attempts_failure(backend: str) -> None:
    """`send` raises a CancelledError nothing cancelling the run raised: the
    attempt is settled ``error`` (a provider must raise only ProviderFault,
    ``bad_request``, not retried) and the run ends ``provider_error``; it is
    not recorded ``cancelled``, and no cancellation reaches the caller."""
    ledger = MemoryLedger()
    seen: list[Event] = []

    async def main() -> le.RunResult:
        engine = le.Engine(StrayProvider([Reply.text("never sent")]), ledger=ledger,
                           prices=PRICES, observers=[seen.append])
        return await engine.run(OP, "go")

    result = anyio.run(main, backend=backend)
    assert result.outcome is le.Outcome.PROVIDER_ERROR
    assert result.fault is not None and result.fault.kind is le.FaultKind.BAD_REQUEST
    assert "CancelledError" in result.fault.message
    outcome, announced, attempt = recorded(ledger, seen)
    assert (outcome, announced) == ("provider_error", "provider_error")
    assert (attempt["outcome"], attempt["fault"]) == ("error", "bad_request")


@BACKENDS
def test_a_stray_cancellation_from_on_text_is_the_callbacks_failure(backend: str) -> None:
    """The ``on_text`` callback raises a stray CancelledError: as for any
    exception of the callback, the attempt is settled ``aborted``/``external``,
    the run is recorded ``failed`` (not ``cancelled``) and the callback's
    exception propagates as itself."""
    ledger = MemoryLedger()
    seen: list[Event] = []

    async def on_text(text: str) -> None:
        await stray()

    async def main() -> None:
        engine = le.Engine(ScriptedProvider([Reply.text("streamed")]), ledger=ledger,
                           prices=PRICES, observers=[seen.append])
        with pytest.raises(asyncio.CancelledError):
            await engine.run(OP, "go", on_text=on_text)

    anyio.run(main, backend=backend)
    outcome, announced, attempt = recorded(ledger, seen)
    assert (outcome, announced) == ("failed", "failed")
    assert (attempt["outcome"], attempt["aborted_reason"]) == ("aborted", "external")


@BACKENDS
def test_a_stray_cancellation_from_an_approval_check_asks_for_approval(
        backend: str, caplog: pytest.LogCaptureFixture) -> None:
    """A tool's approval callable raises a stray CancelledError: as when it
    raises anything else, its call waits for approval (logged at ERROR), and
    the run pauses; nothing is cancelled."""
    ledger = MemoryLedger()
    ran: list[str] = []

    def approval(call: le.PendingCall) -> bool:
        stray_now()
        return False

    @le.tool(approval=approval)
    async def refund(order: str) -> str:
        """Refund an order."""
        ran.append(order)
        return "refunded"

    async def main() -> le.RunResult:
        engine = le.Engine(ScriptedProvider([Reply.tool_calls(("refund", {"order": "A"}))]),
                           ledger=ledger, prices=PRICES)
        return await engine.run(OP, "go", tools=[refund])

    with caplog.at_level(logging.ERROR, logger="loopengine"):
        result = anyio.run(main, backend=backend)
    assert result.outcome is le.Outcome.PAUSED and ran == []
    assert [(call.tool, call.reason) for call in result.pending] == [("refund", "approval")]
    assert "the approval check of tool refund raised" in caplog.text
    (invocation,) = ledger.invocations.values()
    assert invocation["outcome"] == "paused"


@BACKENDS
@pytest.mark.parametrize("streaming", [False, True], ids=["send", "on_text"])
def test_the_runs_own_cancellation_stays_cancelled(backend: str, streaming: bool) -> None:
    """The caller cancels the run while `send` waits (with an ``on_text`` or
    without): the attempt is settled ``aborted``/``external``, the run is
    recorded ``cancelled`` and the cancellation propagates."""
    ledger = MemoryLedger()
    seen: list[Event] = []
    reached: list[str] = []

    async def main() -> None:
        provider = WaitingProvider([])
        engine = le.Engine(provider, ledger=ledger, prices=PRICES, observers=[seen.append])
        scope = anyio.CancelScope()

        async def run() -> None:
            with scope:
                await engine.run(OP, "go", on_text=print if streaming else None)
                reached.append("returned")
            reached.append("cancelled" if scope.cancelled_caught else "not cancelled")

        async with anyio.create_task_group() as group:
            group.start_soon(run)
            await provider.arrived.wait()
            scope.cancel()

    anyio.run(main, backend=backend)
    assert reached == ["cancelled"]
    outcome, announced, attempt = recorded(ledger, seen)
    assert (outcome, announced) == ("cancelled", "cancelled")
    assert (attempt["outcome"], attempt["aborted_reason"]) == ("aborted", "external")
