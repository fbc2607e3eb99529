"""The open reservations of credit accounts (docs/accounts.md): the table the
accounts' transactions read instead of walking the journal stays what the
journal says through every path that reserves or releases, on SQLite and
PostgreSQL; the migration fills it from a journal written before it; and
``audit reconcile`` reports a table that differs from its journal."""

from __future__ import annotations

import random
import sqlite3
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

import loopengine as le
from loopengine import audit, events
from loopengine.persistence import PostgresLedger, SQLiteLedger
from loopengine.persistence import _postgres_schema as pg_schema
from loopengine.persistence._schema import MIGRATIONS, migrate
from loopengine.providers import Reply, ScriptedProvider
from loopengine.testing import FakeClock

from .conftest import PRICES, operation
from .pause_scenarios import Sender, send
from .postgres_support import PostgresServer, fresh_schema
from .test_recovery import Charger, crashed

ACME = le.Attribution(tenant="acme")


@pytest.fixture
def ledger(each_database: Any) -> Any:
    """A SQLite ledger, then a PostgreSQL one (`each_database`)."""
    return each_database


async def query(ledger: Any, sql: str) -> list[tuple[Any, ...]]:
    """``sql``'s rows, read on the ledger's own connection (between its writes)."""
    return [tuple(r) for r in await ledger._transact_qmark(
        lambda conn: conn.execute(sql).fetchall(), "read")]


async def open_now(ledger: Any) -> dict[int, str]:
    """The open reservations (entry id: invocation), after checking that the
    table is exactly what the journal says, counted here from its entries
    (a release closes its invocation's oldest reservation still held), and that
    each account's ``reserved`` is what the table holds."""
    held = {entry: (account, invocation, expires)
            for entry, account, invocation, expires in await query(
                ledger, "SELECT entry_id, account, invocation_id, expires_at "
                        "FROM open_reservations")}
    reserves: dict[str, list[tuple[int, str, Any, int]]] = {}
    releases: dict[str, int] = {}
    for entry, account, kind, invocation, expires, credits in await query(
            ledger, "SELECT id, account, kind, invocation_id, expires_at, credits "
                    "FROM account_entries ORDER BY id"):
        if kind == "reserve":
            reserves.setdefault(invocation, []).append((entry, account, expires, credits))
        elif kind == "release":
            releases[invocation] = releases.get(invocation, 0) + 1
    still = {entry: (account, invocation, expires, credits)
             for invocation, made in reserves.items()
             for entry, account, expires, credits in made[releases.get(invocation, 0):]}
    assert held == {entry: row[:3] for entry, row in still.items()}
    reserved = dict(await query(ledger, "SELECT account, reserved FROM accounts"))
    for account, total in reserved.items():
        assert total == sum(row[3] for row in still.values() if row[0] == account)
    return {entry: row[1] for entry, row in still.items()}


async def test_the_open_set_follows_every_path_that_reserves_or_releases(
        ledger: Any, clock: FakeClock) -> None:
    """Reserve, settle, pause, resume, a grant and a balance that expire, a
    reservation again of the same run and a recovery: after each the table is
    the journal's unreleased reservations, and the account's ``reserved``."""
    accounts = le.CreditAccounts(ledger, clock=clock)
    await accounts.grant("acme", 10_000)
    assert await open_now(ledger) == {}
    during: list[dict[int, str]] = []

    async def watch(event: events.Event) -> None:
        if isinstance(event, events.AttemptStarted):
            during.append(await open_now(ledger))

    # Reserve, then settle.
    engine = le.Engine(ScriptedProvider([Reply.text("done")], clock=clock), ledger=ledger,
                       clock=clock, prices=PRICES, accounts=accounts, observers=[watch])
    done = await engine.run(operation(credit_hold=500), "go", attribution=ACME)
    assert list(during.pop().values()) == [done.invocation_id]
    assert await open_now(ledger) == {}

    # A pause releases its segment's reservation; the resume reserves again,
    # and its end releases that one.
    sender = Sender()
    engine = le.Engine(ScriptedProvider([Reply.tool_calls(send("a")), Reply.text("done")],
                                        clock=clock),
                       ledger=ledger, clock=clock, prices=PRICES, accounts=accounts,
                       observers=[watch])
    paused = await engine.run(operation(credit_hold=500), "go", tools=[sender.tool],
                              attribution=ACME)
    assert paused.state is not None and list(during.pop().values()) == [paused.invocation_id]
    assert await open_now(ledger) == {}
    resumed = await engine.resume(paused.state, decisions={paused.pending[0].id: le.Approve()},
                                  tools=[sender.tool])
    assert resumed.outcome is le.Outcome.COMPLETED
    assert list(during.pop().values()) == [paused.invocation_id]
    assert await open_now(ledger) == {}
    assert (await accounts.balance("acme")).reserved == 0

    # Reservations whose processes died: a grant settles the one expired, a
    # balance the next; one not expired yet stays.
    def reserve(invocation: str, seconds: float) -> Any:
        return accounts.reserve("acme", invocation, 100,
                                expires_at=clock.wall() + timedelta(seconds=seconds),
                                credits_per_usd=Decimal(1000), credit_quantum=1)

    await reserve("dead-1", 10)
    await reserve("dead-2", 20)
    await reserve("dead-3", 300)
    assert sorted((await open_now(ledger)).values()) == ["dead-1", "dead-2", "dead-3"]
    clock.advance(15)
    await accounts.grant("acme", 1)
    assert sorted((await open_now(ledger)).values()) == ["dead-2", "dead-3"]
    clock.advance(10)
    assert (await accounts.balance("acme")).reserved == 100
    assert list((await open_now(ledger)).values()) == ["dead-3"]

    # A run reserving again (a recovery) first settles and releases what its
    # dead segment held; a recovery alone releases it.
    first = next(iter(await open_now(ledger)))
    again = await reserve("dead-3", 300)
    assert again.credits == 100
    held = await open_now(ledger)
    assert list(held.values()) == ["dead-3"] and next(iter(held)) > first
    await accounts.recover("acme", "dead-3")
    assert await open_now(ledger) == {}
    balance = await accounts.balance("acme")
    assert balance.reserved == 0 and balance.available == balance.granted - balance.spent


async def test_a_crashed_run_s_reservation_is_taken_over_by_its_recovery(
        ledger: Any, clock: FakeClock) -> None:
    """A run killed in a tool leaves its reservation open; the resume that
    recovers it closes that one (and pauses on the call in doubt); the next
    holds its own while it runs; its end leaves nothing open."""
    accounts = le.CreditAccounts(ledger, clock=clock, key=lambda _: "acme", default_hold=500)
    await accounts.grant("acme", 10_000)
    charger = Charger()
    charger.crash_on = "charge"
    script = [Reply.tool_calls(("charge", {"card": "4242"})), Reply.text("done")]
    engine = le.Engine(ScriptedProvider(script, clock=clock), ledger=ledger, clock=clock,
                       prices=PRICES, accounts=accounts, run_store=le.RunStore(ledger),
                       rng=random.Random(3))
    await crashed(engine, charger)
    (left, run_id), = (await open_now(ledger)).items()
    during: list[dict[int, str]] = []

    async def watch(event: events.Event) -> None:
        if isinstance(event, events.AttemptStarted):
            during.append(await open_now(ledger))

    engine = le.Engine(ScriptedProvider([Reply.text("done")], clock=clock), ledger=ledger,
                       clock=clock, prices=PRICES, accounts=accounts,
                       run_store=le.RunStore(ledger), observers=[watch])
    # Its charge may have run: the recovery pauses on it at once, holding
    # nothing; approved, it reserves again.
    doubt = await engine.resume(run_id, tools=charger.tools, force=True)
    assert doubt.outcome is le.Outcome.PAUSED and doubt.pending[0].reason == "in_doubt"
    assert await open_now(ledger) == {} and during == []
    done = await engine.resume(run_id, tools=charger.tools,
                               decisions={doubt.pending[0].id: le.Approve()})
    assert done.outcome is le.Outcome.COMPLETED
    (now_held, same), = during[0].items()
    assert same == run_id and now_held > left
    assert await open_now(ledger) == {}


async def reconciled(ledger: Any) -> list[tuple[str, str, int, int, str | None]]:
    """What ``audit reconcile`` says of the accounts: (account, column, recorded,
    computed, invocation) for each figure that differs."""
    if isinstance(ledger, SQLiteLedger):
        await ledger.flush()
        conn = audit.open_ledger(ledger.path)
    else:
        from psycopg.conninfo import conninfo_to_dict

        dsn = conninfo_to_dict(ledger.dsn)
        conn = audit.open_ledger(f"postgresql:///{dsn['dbname']}?host={dsn['host']}"
                                 f"&port={dsn['port']}&user={dsn['user']}",
                                 schema=ledger.schema)
    try:
        found = audit.reconcile(conn).accounts
    finally:
        conn.close()
    return [(m.account, m.column, m.recorded, m.computed, m.invocation_id) for m in found]


async def test_reconcile_reports_an_open_table_that_differs_from_its_journal(
        ledger: Any, clock: FakeClock) -> None:
    """A row deleted, a row added for a released reservation, and an expiry
    changed: each is reported as ``open`` with its run, none hidden."""
    accounts = le.CreditAccounts(ledger, clock=clock)
    await accounts.grant("acme", 1_000)
    for invocation in ("held-1", "held-2", "held-3", "closed"):
        await accounts.reserve("acme", invocation, 10,
                               expires_at=clock.wall() + timedelta(hours=1),
                               credits_per_usd=Decimal(1000), credit_quantum=1)
        clock.advance(1)  # each its own expiry
    await accounts.recover("acme", "closed")
    assert sorted((await open_now(ledger)).values()) == ["held-1", "held-2", "held-3"]
    closed = (await query(ledger, "SELECT id FROM account_entries WHERE kind = 'reserve' "
                                  "AND invocation_id = 'closed'"))[0][0]
    assert await reconciled(ledger) == []

    def tamper(conn: Any) -> None:
        conn.execute("DELETE FROM open_reservations WHERE invocation_id = 'held-1'")
        conn.execute("INSERT INTO open_reservations (entry_id, account, invocation_id, "
                     "expires_at) SELECT id, account, invocation_id, expires_at "
                     f"FROM account_entries WHERE id = {closed}")
        conn.execute("UPDATE open_reservations SET expires_at = "
                     "(SELECT expires_at FROM open_reservations WHERE invocation_id = 'held-3') "
                     "WHERE invocation_id = 'held-2'")
        conn.execute("UPDATE open_reservations SET invocation_id = 'other' "
                     "WHERE invocation_id = 'held-3'")

    await ledger._transact_qmark(tamper, "tamper")
    found = await reconciled(ledger)
    assert sorted(found) == sorted([
        ("acme", "open", 0, 1, "held-1"),     # the journal holds it, the table lost it
        ("acme", "open", 1, 0, "closed"),     # released in the journal, held in the table
        ("acme", "open", 1, 0, "held-2"),     # its expiry changed: not as its entry reads
        ("acme", "open", 0, 1, "held-2"),
        ("acme", "open", 1, 0, "other"),      # another run's name on it
        ("acme", "open", 0, 1, "held-3"),
    ])


# -- the migration ------------------------------------------------------------------------

PREVIOUS = next(m.version for m in MIGRATIONS
                if m.name == "the open reservations of credit accounts") - 1
"""The version before the open reservations' table."""

# A journal as the previous version wrote it: (kind, invocation, credits).
# "paused" released its first segment's reservation and reserved again
# (open); "twice" paused and ended (closed); "ended" settled; "dead" and
# "late" never released (open, "late" expiring later).
JOURNAL = [("grant", None, 10_000), ("reserve", "ended", 100), ("settle", "ended", 30),
           ("reserve", "paused", 100), ("settle", "paused", 20), ("release", "ended", 100),
           ("release", "paused", 100), ("reserve", "twice", 50), ("reserve", "dead", 70),
           ("release", "twice", 50), ("reserve", "paused", 80), ("reserve", "twice", 40),
           ("reserve", "late", 60), ("release", "twice", 40)]
OPEN_AFTER = {"paused": 80, "dead": 70, "late": 60}


def journal_rows(clock: FakeClock) -> list[tuple[Any, ...]]:
    """`JOURNAL` as ``account_entries`` rows, the accounts row as its sums."""
    rows = []
    for n, (kind, invocation, credits) in enumerate(JOURNAL):
        at = clock.wall() + timedelta(seconds=n)
        expires = at + timedelta(seconds=3600 if invocation == "late" else 60)
        rows.append(("acme", at.isoformat(), kind, credits, invocation,
                     *((expires.isoformat(), "1000", 1) if kind == "reserve"
                       else (None, None, None))))
    return rows


SUMS = {"granted": 10_000, "spent": 50,
        "reserved": sum(c for k, _, c in JOURNAL if k == "reserve")
        - sum(c for k, _, c in JOURNAL if k == "release")}
INSERT = ("INSERT INTO account_entries (account, at, kind, credits, invocation_id, "
          "expires_at, credits_per_usd, credit_quantum) VALUES (?, ?, ?, ?, ?, ?, ?, ?)")


async def after_migration(ledger: Any, clock: FakeClock) -> None:
    """The migrated ledger holds `OPEN_AFTER`; the accounts then expire them."""
    held = await open_now(ledger)
    assert sorted(held.values()) == sorted(OPEN_AFTER)
    assert SUMS["reserved"] == sum(OPEN_AFTER.values())
    # The journal has no runs behind it (their charges are not checked here).
    assert [m for m in await reconciled(ledger) if m[1] == "open"] == []
    accounts = le.CreditAccounts(ledger, clock=clock)
    clock.advance(600)  # past the expiries but "late"'s
    assert (await accounts.balance("acme")).reserved == OPEN_AFTER["late"]
    assert list((await open_now(ledger)).values()) == ["late"]


async def test_a_ledger_of_the_previous_version_migrates_its_open_reservations(
        tmp_path: Path, clock: FakeClock) -> None:
    """A SQLite file written before the table: opened by this code, the table
    holds exactly the reservations its journal leaves unreleased, and the
    journal's index by expiry is gone."""
    path = tmp_path / "ledger.db"
    conn = sqlite3.connect(path, isolation_level=None)
    assert migrate(conn, migrations=MIGRATIONS[:PREVIOUS]) == PREVIOUS
    for row in journal_rows(clock):
        conn.execute(INSERT, row)
    conn.execute("INSERT INTO accounts VALUES ('acme', ?, ?, ?, ?)",
                 (*SUMS.values(), clock.wall().isoformat()))
    conn.close()
    with SQLiteLedger(path) as ledger:
        await after_migration(ledger, clock)
    with sqlite3.connect(path) as conn:
        indexes = {r[0] for r in conn.execute("SELECT name FROM sqlite_master "
                                              "WHERE type = 'index'")}
    assert "open_reservations_expiry" in indexes and "account_entries_reserved" not in indexes


async def test_a_postgres_ledger_of_the_previous_version_migrates_its_open_reservations(
        postgres_server: PostgresServer, clock: FakeClock) -> None:
    """The same on PostgreSQL."""
    schema = fresh_schema()
    with postgres_server.connect(autocommit=False) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
        conn.execute(f"SET search_path = {schema}")
        conn.commit()
        assert pg_schema.migrate(conn, schema=schema, name="test",
                                 migrations=pg_schema.MIGRATIONS[:PREVIOUS]) == PREVIOUS
        with conn.transaction():
            for row in journal_rows(clock):
                conn.execute(INSERT.replace("?", "%s"), row)
            conn.execute("INSERT INTO accounts VALUES ('acme', %s, %s, %s, %s)",
                         (*SUMS.values(), clock.wall()))
    async with PostgresLedger(postgres_server.dsn(), schema=schema) as ledger:
        await after_migration(ledger, clock)
        indexes = {r[0] for r in await query(
            ledger, f"SELECT indexname FROM pg_indexes WHERE schemaname = '{schema}'")}
    assert "open_reservations_expiry" in indexes and "account_entries_reserved" not in indexes
