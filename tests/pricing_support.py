"""One priced run through a real provider, for the tests that check a reply's price."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import loopengine as le
from loopengine.providers import Provider
from loopengine.testing import FakeClock


async def priced_run(provider: Provider, prices: le.PriceBook, operation: le.Operation,
                     at: datetime) -> tuple[le.RunResult, dict[str, Any]]:
    """Run ``operation`` once on ``provider`` (its server scripted with one reply) at
    wall time ``at``; the run must complete. Its result and its one attempt row."""
    ledger = le.persistence.MemoryLedger()
    engine = le.Engine(provider, ledger=ledger, prices=prices, clock=FakeClock(wall_start=at))
    result = await engine.run(operation, "go")
    assert result.outcome is le.Outcome.COMPLETED
    (row,) = ledger.attempts.values()
    return result, row
