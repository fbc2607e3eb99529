"""Credit accounts on PostgreSQL (DESIGN.md §13): the same admission, settlement
and journal as on SQLite, with the account's row lock serializing its
reservations across processes and hosts."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import anyio

import loopengine as le
from loopengine.persistence import PostgresLedger
from loopengine.providers import Reply, ScriptedProvider

from .conftest import PRICES, operation
from .ledger_support import lookup
from .postgres_support import PostgresServer
from .test_audit_postgres import audit, url_of

CHILD = Path(__file__).with_name("accounts_child.py")
ACME = le.Attribution(tenant="acme")


async def test_a_run_reserves_and_settles_on_postgresql(postgres_server: PostgresServer) -> None:
    """Grant, a run that settles its charge, a run denied on an empty account; the
    audit finds the accounts equal to their journal."""
    dsn = postgres_server.create_database()
    async with PostgresLedger(dsn) as ledger:
        accounts = le.CreditAccounts(ledger)
        await accounts.grant("acme", 300)
        engine = le.Engine(ScriptedProvider([Reply.tool_calls(("lookup", {"key": "a"})),
                                             Reply.text("a")]),
                           ledger=ledger, prices=PRICES, accounts=accounts)
        done = await engine.run(operation(credit_hold=250), "go", tools=[lookup],
                                attribution=ACME)
        denied_engine = le.Engine(ScriptedProvider([Reply.text("never")]), ledger=ledger,
                                  prices=PRICES, accounts=accounts)
        first = await denied_engine.run(operation(credit_hold=100), "go",
                                        attribution=le.Attribution(tenant="nobody"))
        balance = await accounts.balance("acme")
    assert done.outcome is le.Outcome.COMPLETED and done.credits == 240
    assert balance == le.AccountBalance("acme", 300, 240, 0, 60)
    assert first.outcome is le.Outcome.ADMISSION_DENIED and first.attempts.count == 0
    checked = audit("reconcile", "--db", url_of(postgres_server, dsn.rsplit("dbname=", 1)[1]),
                    "--json")
    assert '"accounts": []' in checked.output


def test_four_processes_never_reserve_more_than_the_account_has_on_postgresql(
    postgres_server: PostgresServer,
) -> None:
    """The race of tests/test_accounts.py on one PostgreSQL database: exactly the 30
    runs that fit are admitted, the other 70 end ``admission_denied``."""
    dsn = postgres_server.create_database()

    async def grant() -> None:
        async with PostgresLedger(dsn) as ledger:
            await le.CreditAccounts(ledger).grant("acme", 30 * 120)

    anyio.run(grant)
    go = Path(tempfile.mkdtemp(prefix="loopengine-race-")) / "go"
    children = [subprocess.Popen([sys.executable, "-P", str(CHILD), "race-pg", dsn, "25",
                                  str(go)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True) for _ in range(4)]
    for child in children:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "READY"
    go.touch()
    outcomes: Counter[str] = Counter()
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        outcomes.update(out.split())
    assert outcomes == {"completed": 30, "admission_denied": 70}
    dbname = dsn.rsplit("dbname=", 1)[1]
    import psycopg

    with psycopg.connect(dsn) as pg:
        row = pg.execute("SELECT granted, spent, reserved FROM accounts").fetchone()
        sums = dict(pg.execute("SELECT kind, SUM(credits) FROM account_entries "
                               "GROUP BY kind").fetchall())
    assert row == (3600, 3600, 0)
    assert sums["grant"] == 3600 and sums["settle"] == 3600
    assert sums["reserve"] == sums["release"] == 3600
    assert audit("accounts", "--db", url_of(postgres_server, dbname)).exit_code == 0
