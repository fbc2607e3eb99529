"""`loopengine audit` as an auditor cross-checks it: the same answer, in the same
order, from a SQLite and a PostgreSQL ledger whatever the server's collation;
an invocation found by the same id on both; and a reconciliation or an
export whose cost grows with the ledger, not with its square."""

from __future__ import annotations

import random
import sqlite3
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from click.testing import CliRunner, Result

import loopengine as le
from loopengine import audit
from loopengine.cli import main
from loopengine.persistence import SQLiteLedger
from loopengine.providers import Reply, ScriptedProvider
from loopengine.testing import FakeClock

from .conftest import PRICES, operation

# Names whose order differs between byte order (SQLite, a "C" collation) and a
# language's collation (en-US sorts "acme" before "Zenith", and ignores "_").
TENANTS = ("acme", "Zenith", "_under", "beta")


def cli(*args: str) -> Result:
    return CliRunner().invoke(main, ["audit", *args])


async def record(ledger: Any) -> list[le.RunResult]:
    """One run per tenant, each on an account, all costing the same."""
    accounts = le.CreditAccounts(ledger)
    results = []
    for n, tenant in enumerate(TENANTS):
        await accounts.grant(tenant, 10_000)
        clock = FakeClock(wall_start=datetime(2026, 3, 1, n, tzinfo=UTC))
        engine = le.Engine(ScriptedProvider([Reply.text("done")], clock=clock), ledger=ledger,
                           prices=PRICES, clock=clock, rng=random.Random(n), accounts=accounts)
        results.append(await engine.run(operation(credit_hold=1000), "go",
                                        attribution=le.Attribution(tenant=tenant)))
    return results


async def test_a_run_s_charge_is_read_from_its_own_rows(tmp_path: Path) -> None:
    """reconcile checks each reserving run's charge against its tree's rows, looked up
    by their keys: it never reads every attempt row of the ledger per run, which
    made a ledger of 50,000 runs take most of an hour."""
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as lite:
        await record(lite)
    conn = audit.open_ledger(path)
    assert isinstance(conn, sqlite3.Connection)
    statements: list[str] = []
    try:
        conn.set_trace_callback(statements.append)
        assert audit.reconcile(conn).accounts == []
        conn.set_trace_callback(None)
        trees = [s for s in statements if s.startswith("WITH RECURSIVE tree")]
        assert len(trees) == 2 * len(TENANTS)
        for statement in trees:
            plan = [str(row[3]) for row in conn.execute(f"EXPLAIN QUERY PLAN {statement}")]
            assert not [step for step in plan if step.startswith(("SCAN a", "SCAN i"))], plan
    finally:
        conn.close()
