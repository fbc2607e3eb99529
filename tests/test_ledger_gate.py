"""The gate before the wire: an attempt whose timeout runs out while the ledger
still holds its request back is recorded as never sent.

The engine's attempt timeout is a real cancel scope (a `FakeClock` never
expires one), so these tests run on the real clock, with short waits.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

import loopengine as le
from loopengine.persistence import AttemptDispatch, EarlyDispatchLedger, MemoryLedger
from loopengine.providers import Reply, ScriptedProvider

from .conftest import PRICES, operation

pytestmark = pytest.mark.realtime


class SlowLedger(MemoryLedger):
    """Writes each dispatch only after ``delays[ordinal]`` seconds."""

    def __init__(self, delays: dict[int, float]) -> None:
        super().__init__()
        self.delays = delays

    def begin_dispatch(self, record: AttemptDispatch) -> Any:
        ledger = self
        written = anyio.Event()
        started = False

        class Receipt:
            async def wait(self) -> None:
                nonlocal started
                if not started:
                    started = True
                    # Shielded: the write goes on whoever stops waiting for it.
                    with anyio.CancelScope(shield=True):
                        await anyio.sleep(ledger.delays.get(record.ordinal, 0.0))
                        await ledger.dispatch_attempt(record)
                        written.set()
                await written.wait()

        return Receipt()


def engine(ledger: MemoryLedger, *script: Any) -> tuple[le.Engine, ScriptedProvider]:
    provider = ScriptedProvider(list(script))
    return le.Engine(provider, ledger=ledger, prices=PRICES), provider


async def test_r04_a_timeout_at_the_ledger_gate_is_recorded_as_not_sent() -> None:
    """The first row takes longer to write than the attempt may last: the request
    never reaches the provider, its row (still written) is settled as a timeout
    with error_code ``not_sent``, and the retry goes out once its row is written."""
    ledger = SlowLedger({1: 0.5})
    assert isinstance(ledger, EarlyDispatchLedger)
    engine_, provider = engine(ledger, Reply.text("ok"))
    result = await engine_.run(operation(attempt_timeout=0.1), "go",
                               retry={"initial_wait": 0.01, "max_wait": 0.01})
    assert result.outcome is le.Outcome.COMPLETED
    assert len(provider.requests) == 1  # only the retry reached the provider
    first, second = (ledger.attempts[(result.invocation_id, n)] for n in (1, 2))
    assert (first["outcome"], first["fault"], first["error_code"]) == (
        "error", "timeout", "not_sent")
    assert first["http_status"] is None and first["input_tokens"] is None
    assert (second["outcome"], second["error_code"]) == ("ok", None)


async def test_r04_a_timeout_after_the_gate_is_a_plain_timeout() -> None:
    """Once the row is written the request goes out: a provider that does not answer
    in time is an ordinary timeout, with no ``not_sent`` code."""
    ledger = SlowLedger({1: 0.02})
    # 0.02 s at the gate, then 0.49 s on the wire: the 0.5 s attempt ends on the wire.
    engine_, provider = engine(ledger, Reply.text("late", delay=0.49), Reply.text("ok"))
    result = await engine_.run(operation(attempt_timeout=0.5), "go",
                               retry={"initial_wait": 0.01, "max_wait": 0.01})
    assert result.outcome is le.Outcome.COMPLETED
    assert len(provider.requests) == 2
    first = ledger.attempts[(result.invocation_id, 1)]
    assert (first["fault"], first["error_code"]) == ("timeout", None)
