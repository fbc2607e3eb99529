"""Every query of an audit reads one snapshot of the ledger, on SQLite as on
PostgreSQL: runs written while an auditor reads (a live ledger) never make
its answers disagree, such as an account's balance against its journal."""

from __future__ import annotations

import random
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

import loopengine as le
from loopengine import audit
from loopengine.providers import Reply, ScriptedProvider

from .conftest import MODEL
from .test_ledger_usage_vector import ledger_of

PRICES = le.PriceBook([le.ModelPrice(provider="anthropic", model=MODEL, input_per_mtok=3,
                                     output_per_mtok=15)], credits_per_usd=Decimal(1_000_000))


async def charged_run(ledger: Any, accounts: le.CreditAccounts) -> le.RunResult:
    engine = le.Engine(ScriptedProvider([Reply.text("done")]), ledger=ledger, prices=PRICES,
                       accounts=accounts, rng=random.Random(1))
    operation = le.Operation(name="live.op", provider="anthropic", model=MODEL,
                             limits=le.Limits(credit_hold=10_000))
    return await engine.run(operation, "go", attribution=le.Attribution(tenant="acme"))


@pytest.mark.parametrize("store", ["sqlite", "postgres"])
async def test_an_audit_reads_one_snapshot_while_runs_are_written(
    store: str, tmp_path: Path, request: pytest.FixtureRequest,
) -> None:
    """A run recorded (reserved, charged, settled) after the audit's first query
    is in none of its later answers: the runs, the spend, the accounts and their
    journal all read the ledger as it was, so reconcile finds nothing off."""
    async with ledger_of(store, tmp_path, request) as (ledger, db):
        accounts = le.CreditAccounts(ledger)
        await accounts.grant("acme", 1_000_000)
        first = await charged_run(ledger, accounts)
        await ledger.flush()
        conn = audit.open_ledger(db)
        try:
            before = audit.runs(conn)
            (balance,) = audit.accounts(conn)
            await charged_run(ledger, accounts)
            await ledger.flush()
            assert audit.runs(conn) == before == [r for r in before
                                                  if r.id == first.invocation_id]
            assert [r.invocations for r in audit.spend(conn)] == [1]
            assert audit.accounts(conn) == [balance]
            reconciled = audit.reconcile(conn)
        finally:
            conn.close()
    assert (reconciled.invocations, reconciled.accounts, reconciled.mismatches) == (1, [], [])
    assert reconciled.ok
