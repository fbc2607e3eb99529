"""A ledger keeps what it refused only as long as someone can still be told.

A refused deferred write (a start, a settle of nothing served) is raised by
its invocation's next durable write, up to and including its end; once the
end has been refused the run writes nothing more, and the ledger forgets it.
A refused durable write is raised to the call that waits for it; a call that
stopped waiting leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import sqlite3
from pathlib import Path
from typing import Any

import anyio
import pytest

import loopengine as le
from loopengine.persistence import MemoryLedger, SQLiteLedger, _planner

from .ledger_support import dispatch, end, start


def planner_of(ledger: Any) -> _planner.Planner:
    if isinstance(ledger, MemoryLedger):
        return ledger._rows.planner
    assert ledger._writer is not None
    return ledger._writer.planner


async def test_a_refused_deferred_write_is_raised_until_its_end_then_forgotten(
        each_ledger: Any) -> None:
    """A second start of one invocation is refused (deferred: nobody waits for
    it); its next writes raise it, its end too, and then the ledger holds
    nothing for it. A paused end does not end it: the refusal stays."""
    ledger = each_ledger
    await ledger.start_invocation(start())
    await ledger.start_invocation(start())
    with pytest.raises(le.LedgerError, match="already exists"):
        await ledger.dispatch_attempt(dispatch(1))
    assert "inv-1" in planner_of(ledger)._failed
    with pytest.raises(le.LedgerError, match="already exists"):
        await ledger.end_invocation(dataclasses.replace(end(), outcome="paused"))
    assert "inv-1" in planner_of(ledger)._failed
    with pytest.raises(le.LedgerError, match="already exists"):
        await ledger.end_invocation(end())
    assert planner_of(ledger)._failed == {}


async def test_a_refused_write_whose_caller_stopped_waiting_leaves_nothing(
        tmp_path: Path) -> None:
    """A dispatch refused after its caller was cancelled is told to nobody and
    kept nowhere; the calls after it are answered as before."""
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as ledger:
        await ledger.start_invocation(start())
        await ledger.dispatch_attempt(dispatch(1))
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")  # the writer waits for the file's lock
        try:
            with anyio.CancelScope() as scope:
                scope.cancel()  # it queues its write, then stops waiting at once
                await ledger.dispatch_attempt(dispatch(1, "ghost"))
            assert scope.cancelled_caught
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        await ledger.flush()
        assert ledger._waiters == []
        with pytest.raises(le.LedgerError, match="no invocation ghost"):
            await ledger.dispatch_attempt(dispatch(2, "ghost"))
        await ledger.dispatch_attempt(dispatch(2))
        assert ledger._waiters == []
