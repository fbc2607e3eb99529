"""The period filters of `loopengine.audit` read their bounds as times, on SQLite
as on PostgreSQL: a bound with an offset or ``Z`` selects the runs it names
(SQLite compares the stored times as text, PostgreSQL as times), and one that
is no time is refused rather than matching nothing."""

from __future__ import annotations

import random
from datetime import UTC, datetime
from pathlib import Path

import pytest

import loopengine as le
from loopengine import audit
from loopengine.providers import Reply, ScriptedProvider
from loopengine.testing import FakeClock

from .conftest import PRICES, operation
from .test_ledger_usage_vector import ledger_of


@pytest.mark.parametrize("store", ["sqlite", "postgres"])
async def test_a_period_bound_with_an_offset_is_the_time_it_names(
    store: str, tmp_path: Path, request: pytest.FixtureRequest,
) -> None:
    """One run at 01:00 UTC: a period from 02:00+01:00 (or 01:00Z) to 03:00+01:00
    holds it in runs, spend and export; one from 01:00:00.000001Z does not; and
    ``since="yesterday"`` raises ValueError."""
    async with ledger_of(store, tmp_path, request) as (ledger, db):
        clock = FakeClock(wall_start=datetime(2026, 1, 5, 1, tzinfo=UTC))
        engine = le.Engine(ScriptedProvider([Reply.text("done")], clock=clock), ledger=ledger,
                           prices=PRICES, clock=clock, rng=random.Random(1))
        run = await engine.run(operation(), "go")
        await ledger.flush()
    conn = audit.open_ledger(db)
    try:
        for since, until in (("2026-01-05T02:00:00+01:00", "2026-01-05T03:00:00+01:00"),
                             ("2026-01-05T01:00:00Z", "2026-01-05T01:00:00.000001Z"),
                             ("2026-01-04T20:00:00-05:00", "2026-01-06")):
            assert [r.id for r in audit.runs(conn, since=since, until=until)] == \
                [run.invocation_id], (since, until)
            assert [r.invocations for r in audit.spend(conn, since=since, until=until)] == [1]
            assert len(list(audit.export_rows(conn, since=since, until=until))) == 1
        assert audit.runs(conn, since="2026-01-05T01:00:00.000001Z") == []
        assert audit.runs(conn, until="2026-01-05T02:00:00+01:00") == []
        with pytest.raises(ValueError, match="'yesterday' is not a date"):
            audit.runs(conn, since="yesterday")
    finally:
        conn.close()
