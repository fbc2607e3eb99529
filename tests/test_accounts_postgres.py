"""Credit accounts on PostgreSQL (docs/accounts.md): the same admission, settlement
and journal as on SQLite, with the account's row lock serializing its
reservations across processes and hosts."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import pytest

import loopengine as le
from loopengine.persistence import PostgresLedger
from loopengine.persistence._postgres import APPLICATION_NAME
from loopengine.providers import Reply, ScriptedProvider

from .conftest import PRICES, operation
from .ledger_support import lookup, queued
from .postgres_support import PostgresServer, round_trips, waits_for_a_lock
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


def _database(postgres_server: PostgresServer) -> tuple[str, str]:
    """A new empty database: its connection string and its name."""
    dsn = postgres_server.create_database()
    return dsn, dsn.rsplit("dbname=", 1)[1]


def _ledger_sessions(postgres_server: PostgresServer, dbname: str) -> list[tuple[int, Any]]:
    """The live sessions of the ledger on ``dbname``: (pid, backend_start)."""
    with postgres_server.connect() as conn:
        return conn.execute(
            "SELECT pid, backend_start FROM pg_stat_activity "
            "WHERE application_name = %s AND datname = %s ORDER BY pid",
            (APPLICATION_NAME, dbname)).fetchall()


def _settled_sessions(postgres_server: PostgresServer, dbname: str,
                      count: int) -> list[tuple[int, Any]]:
    """`_ledger_sessions` once there are ``count`` of them: a backend whose client
    closed, or that was terminated, leaves the list a moment later."""
    give_up = time.monotonic() + 30  # a bound for a hang, not a measure
    while True:
        sessions = _ledger_sessions(postgres_server, dbname)
        if len(sessions) == count or time.monotonic() > give_up:
            return sessions
        time.sleep(0.02)


async def test_accounts_run_on_the_ledgers_own_session(
    postgres_server: PostgresServer,
) -> None:
    """Opening a connection costs the server a backend process: the accounts'
    transactions run on the ledger writer's one session, beside its writes; a
    session the server ended is replaced, not reported; closing the ledger ends it."""
    dsn, dbname = _database(postgres_server)
    async with PostgresLedger(dsn) as ledger:
        accounts = le.CreditAccounts(ledger)
        await accounts.grant("acme", 1_000)
        first = _ledger_sessions(postgres_server, dbname)
        async with anyio.create_task_group() as group:
            for _ in range(10):
                group.start_soon(accounts.grant, "acme", 1)
                group.start_soon(accounts.balance, "acme")
        assert len(first) == 1
        assert _ledger_sessions(postgres_server, dbname) == first

        assert postgres_server.terminate(APPLICATION_NAME) == 1
        assert _settled_sessions(postgres_server, dbname, 0) == []
        balance = await accounts.balance("acme")  # the ended session is not used
        assert balance.granted == 1_010
        replaced = _ledger_sessions(postgres_server, dbname)
        assert len(replaced) == 1 and replaced != first
        # Replaced before the transaction began, not lost under it and retried.
        assert ledger.reconnects == 0
    assert _settled_sessions(postgres_server, dbname, 0) == []


async def test_a_transaction_on_a_session_in_use_costs_its_statements_and_two_round_trips(
    postgres_server: PostgresServer,
) -> None:
    """A session in steady use is not asked first whether it still answers: an
    account's transaction sends its BEGIN, its id and its savepoint in one
    round trip, then its own statements, then its commit (which releases the
    savepoint); two at once share the transaction, each in a savepoint."""
    dsn, _ = _database(postgres_server)
    async with PostgresLedger(dsn) as ledger:
        accounts = le.CreditAccounts(ledger)
        await accounts.grant("acme", 1_000)
        trips = await round_trips(ledger, lambda: accounts.balance("acme"))
        assert trips[0] == ["BEGIN", "SELECT txid_current()", "SAVEPOINT loopengine_call"]
        assert trips[-1] == ["Query COMMIT"]
        assert all(len(trip) == 1 and "SAVEPOINT" not in trip[0] for trip in trips[1:-1])
        assert len(trips) > 2

        async def two() -> None:
            # The writer is held by a transaction until both grants wait for
            # it, then runs them in the next one.
            held, gate = threading.Event(), threading.Event()

            def hold(conn: Any) -> None:
                held.set()
                gate.wait()

            async with anyio.create_task_group() as group:
                group.start_soon(ledger._transact_qmark, hold, "held")
                await anyio.to_thread.run_sync(held.wait)
                group.start_soon(accounts.grant, "acme", 1)
                group.start_soon(accounts.grant, "acme", 2)

                def queued() -> None:
                    while len(ledger._calls) < 2:
                        time.sleep(0.001)
                    gate.set()

                await anyio.to_thread.run_sync(queued)

        trips = await round_trips(ledger, two)
        statements = [s for trip in trips for s in trip]
        first = ["BEGIN", "SELECT txid_current()", "SAVEPOINT loopengine_call"]
        assert trips[0] == first and trips[1] == ["Query COMMIT"] and trips[2] == first
        assert ["RELEASE SAVEPOINT loopengine_call", "SAVEPOINT loopengine_call"] in trips
        assert statements.count("Query COMMIT") == 2 and trips[-1] == ["Query COMMIT"]
        assert (await accounts.balance("acme")).granted == 1_003


async def test_a_failed_transaction_fails_alone(
    postgres_server: PostgresServer,
) -> None:
    """A transaction that failed (here: the accounts' tables are gone) raises
    LedgerError and is rolled back; once the tables are back, the next one
    succeeds on the same session."""
    dsn, dbname = _database(postgres_server)
    async with PostgresLedger(dsn) as ledger:
        accounts = le.CreditAccounts(ledger)
        await accounts.grant("acme", 5)
        first = _ledger_sessions(postgres_server, dbname)
        import psycopg

        with psycopg.connect(dsn, autocommit=True) as pg:
            pg.execute("ALTER TABLE accounts RENAME TO accounts_away")
            try:
                with pytest.raises(le.LedgerError, match="the accounts could not be written"):
                    await accounts.balance("acme")
            finally:
                pg.execute("ALTER TABLE accounts_away RENAME TO accounts")
        assert (await accounts.balance("acme")).granted == 5
        assert _ledger_sessions(postgres_server, dbname) == first



async def test_one_transactions_accounts_are_locked_in_one_order(
    postgres_server: PostgresServer,
) -> None:
    """The accounts' transactions queued together share one transaction, and each
    holds its account's row lock until it commits: queued as ``b`` then ``a`` while
    another host's transaction holds ``a`` and then asks for ``b``, they once
    locked ``b``, waited for ``a``, and the server broke the deadlock by failing
    ``a``'s balance with a LedgerError (under load, one account transaction in
    three, across two accounts and six processes). The calls of a transaction
    lock their accounts in the accounts' order, as every host's do: ``a`` first,
    so the other host takes ``b``, commits, and both balances are read."""
    import psycopg

    dsn, dbname = _database(postgres_server)
    async with PostgresLedger(dsn) as ledger:
        accounts = le.CreditAccounts(ledger)
        for name in ("a", "b"):
            await accounts.grant(name, 100)
        with psycopg.connect(dsn) as other:  # its locks held until it commits
            # The ledger's session is the one that looks for a deadlock (at 1 s).
            other.execute("SET deadlock_timeout = '10min'")
            other.execute("SELECT 1 FROM accounts WHERE account = 'a' FOR UPDATE")
            held, gate = threading.Event(), threading.Event()

            def hold(conn: Any) -> None:
                held.set()
                gate.wait()

            read: dict[str, le.AccountBalance] = {}

            async def balance(name: str) -> None:
                read[name] = await accounts.balance(name)

            async with anyio.create_task_group() as group:
                # The writer is held until both balances are queued behind it.
                group.start_soon(ledger._transact_qmark, hold, "held")
                await anyio.to_thread.run_sync(held.wait)
                for count, name in enumerate(("b", "a"), start=1):
                    group.start_soon(balance, name)
                    await anyio.to_thread.run_sync(queued, ledger, count)
                gate.set()
                await anyio.to_thread.run_sync(waits_for_a_lock, postgres_server, dbname)
                await anyio.to_thread.run_sync(
                    other.execute, "SELECT 1 FROM accounts WHERE account = 'b' FOR UPDATE")
                other.commit()
    assert read == {"a": le.AccountBalance("a", 100, 0, 0, 100),
                    "b": le.AccountBalance("b", 100, 0, 0, 100)}


async def test_an_account_transaction_reads_committed_whatever_the_servers_default(
    postgres_server: PostgresServer,
) -> None:
    """A database whose default isolation is ``repeatable read`` (a DBA's setting):
    an admission that waited for an account's row lock while another host changed
    the row reads what that host committed, as the row lock promises. Its
    transaction took its snapshot before the wait, and failed with a LedgerError
    ("could not serialize access due to concurrent update") at every such wait:
    30 admissions of a process in 30, under four processes on one account."""
    import psycopg

    dsn, dbname = _database(postgres_server)
    with postgres_server.connect() as admin:
        admin.execute(f"ALTER DATABASE {dbname} SET default_transaction_isolation = "
                      "'repeatable read'")
    async with PostgresLedger(dsn) as ledger:
        accounts = le.CreditAccounts(ledger)
        await accounts.grant("acme", 100)
        with psycopg.connect(dsn) as other:  # another host's transaction on the row
            other.execute("UPDATE accounts SET granted = granted + 50 "
                          "WHERE account = 'acme'")
            read: list[le.AccountBalance] = []

            async def balance() -> None:
                read.append(await accounts.balance("acme"))

            async with anyio.create_task_group() as group:
                group.start_soon(balance)
                await anyio.to_thread.run_sync(waits_for_a_lock, postgres_server, dbname)
                other.execute("INSERT INTO account_entries (account, at, kind, credits) "
                              "VALUES ('acme', now(), 'grant', 50)")
                other.commit()
    assert read == [le.AccountBalance("acme", 150, 0, 0, 150)]


async def test_a_grant_that_creates_an_account_returns_what_another_hosts_grant_added(
    postgres_server: PostgresServer,
) -> None:
    """Two hosts grant a new account at once: there is no row yet to lock, so the
    second grant's row waits on the first's and adds to it. The balance it returns
    is the row's as it committed (150), not the zeros it read before the first
    grant committed plus its own 100."""
    import psycopg

    dsn, dbname = _database(postgres_server)
    async with PostgresLedger(dsn) as ledger:
        accounts = le.CreditAccounts(ledger)
        await accounts.balance("acme")  # the tables exist, the account does not
        with psycopg.connect(dsn) as other:  # another host's first grant, not committed
            other.execute("INSERT INTO account_entries (account, at, kind, credits) "
                          "VALUES ('acme', now(), 'grant', 50)")
            other.execute("INSERT INTO accounts (account, granted, spent, reserved, "
                          "updated_at) VALUES ('acme', 50, 0, 0, now())")
            granted: list[le.AccountBalance] = []

            async def grant() -> None:
                granted.append(await accounts.grant("acme", 100))

            async with anyio.create_task_group() as group:
                group.start_soon(grant)
                await anyio.to_thread.run_sync(waits_for_a_lock, postgres_server, dbname)
                other.commit()
        balance = await accounts.balance("acme")
    assert granted == [balance] == [le.AccountBalance("acme", 150, 0, 0, 150)]
