"""`loopengine audit` as an auditor cross-checks it: the same answer, in the same
order, from a SQLite and a PostgreSQL ledger whatever the database's collation,
date style or time zone, and whatever the auditor's role may create; an
invocation found by the same start of its id on both; the documented SQL
summing money as exactly as the commands; and a reconciliation or an export
whose cost grows with the ledger, not with its square or all at once."""

from __future__ import annotations

import json
import random
import sqlite3
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

import loopengine as le
from loopengine import audit
from loopengine.cli import main
from loopengine.persistence import PostgresLedger, SQLiteLedger
from loopengine.providers import Reply, ScriptedProvider
from loopengine.testing import FakeClock

from .conftest import PRICES, operation
from .postgres_support import PostgresServer

# Names whose order differs between byte order (SQLite, a "C" collation) and a
# language's collation (en-US sorts "acme" before "Zenith", and ignores "_").
TENANTS = ("acme", "Zenith", "_under", "beta")


@le.tool(approval=True)
async def send(to: str) -> str:
    """Send it to someone."""
    return "sent"


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


async def on_both(tmp_path: Path, server: PostgresServer,
                  recorder: Callable[[Any], Awaitable[Any]]) -> tuple[str, str, Any, Any]:
    """What ``recorder`` records, in a SQLite file and in a PostgreSQL database
    whose collation is en-US (ICU), as a server's default often is: ``--db`` of
    each, and what it returned on each."""
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as lite:
        on_sqlite = await recorder(lite)
    dbname = f"en_{random.Random().getrandbits(48):012x}"
    with server.connect(autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {dbname} TEMPLATE template0 LOCALE_PROVIDER icu "
                     "ICU_LOCALE 'en-US' LOCALE 'C'")
    async with PostgresLedger(server.dsn(dbname)) as pg:
        on_pg = await recorder(pg)
    return (str(path), f"postgresql:///{dbname}?host={server.directory}&port=5432"
                       f"&user={server.user}", on_sqlite, on_pg)


@pytest.fixture
async def both(tmp_path: Path, postgres_server: PostgresServer) -> tuple[str, str]:
    """`record`'s runs on both stores (`on_both`): ``--db`` of each."""
    lite, pg, _, _ = await on_both(tmp_path, postgres_server, record)
    return lite, pg


async def test_names_are_ordered_alike_on_sqlite_and_on_postgresql(
        both: tuple[str, str]) -> None:
    """`accounts` and `spend` (whose groups here cost the same) list their names in
    one order on both stores, the stored text's order, not the server's language's."""
    lite, pg = both
    for command in (["spend", "--by", "tenant", "--json"], ["accounts", "--json"]):
        on_sqlite, on_pg = cli(*command, "--db", lite), cli(*command, "--db", pg)
        assert on_sqlite.exit_code == on_pg.exit_code == 0, on_pg.output
        names = [row.get("account", row.get("tenant")) for row in json.loads(on_pg.output)]
        assert names == sorted(TENANTS), command
        assert names == [row.get("account", row.get("tenant"))
                         for row in json.loads(on_sqlite.output)], command


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


async def test_show_finds_a_run_by_the_same_start_of_its_id_on_both_stores(
        both: tuple[str, str]) -> None:
    """A start of an id is matched as written on both stores: SQLite's LIKE ignored
    case, so an id's start in capitals found the run there and not on PostgreSQL."""
    lite, pg = both
    for db in (lite, pg):
        listed = json.loads(cli("runs", "--db", db, "--json", "--tenant", "acme").output)
        run_id = listed[0]["id"]
        found = cli("show", run_id[:8], "--db", db, "--json")
        assert found.exit_code == 0, found.output
        assert json.loads(found.output)["invocation"]["id"] == run_id
        # A start with a letter in it (a uuid's hex digits a-f).
        start = run_id[:max(8, next(n for n, c in enumerate(run_id) if c.isalpha()) + 1)]
        capitals = cli("show", start.upper(), "--db", db)
        assert capitals.exit_code == 2 and "no invocation" in capitals.output, db
        wildcard = cli("show", run_id[:4] + "_", "--db", db)
        assert wildcard.exit_code == 2 and "no invocation" in wildcard.output, db


async def test_an_export_from_postgresql_reads_its_rows_as_it_writes_them(
        both: tuple[str, str]) -> None:
    """The rows of an export come through a server-side cursor: the client holds a
    batch of them at a time, not the whole ledger (an export of 150,000 attempts
    took 200 MB where the same from SQLite takes 36 MB); the rows are the same."""
    lite, pg = both
    conn = audit.open_ledger(pg)
    try:
        rows, again = audit.export_rows(conn), audit.export_rows(conn)
        first = next(rows)
        (open_cursors,) = conn.execute("SELECT COUNT(*) FROM pg_cursors").fetchone()
        assert open_cursors == 1
        assert next(again) == first  # two exports read at once
        exported = [first, *rows]
    finally:
        conn.close()
    conn = audit.open_ledger(lite)
    try:
        on_sqlite = list(audit.export_rows(conn))
    finally:
        conn.close()
    ignored = ("invocation_id", "started_at")
    assert [{k: v for k, v in row.items() if k not in ignored} for row in exported] == \
        [{k: v for k, v in row.items() if k not in ignored} for row in on_sqlite]


async def test_the_documented_sql_runs_and_sums_money_exactly(tmp_path: Path) -> None:
    """Every query of docs/ledger.md runs on a ledger the engine wrote, its money
    columns are exact (integer nano-USD, or decimal text: never a REAL, which
    rounds), and its spend per tenant is what `audit spend` says."""
    import re

    text = (Path(__file__).parent.parent / "docs" / "ledger.md").read_text(encoding="utf-8")
    queries = re.findall(r"^```sql\n(.*?)^```", text, re.S | re.M)
    assert len(queries) >= 8
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as lite:
        runs = await record(lite)
    conn = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    try:
        results = [conn.execute(q, {"id": runs[0].invocation_id}).fetchall() for q in queries]
    finally:
        conn.close()
    reader = audit.open_ledger(path)
    try:
        expected = {row.key: row for row in audit.spend(reader)}
    finally:
        reader.close()
    for rows in results:
        for row in rows:
            for column in row.keys():
                if "usd" in column:
                    assert isinstance(row[column], int | str | None), (column, row[column])
    by_tenant = {row["tenant"]: row for row in results[0]}
    assert {t: (r["charged_nanousd"], r["charged_usd"]) for t, r in by_tenant.items()} == {
        t: (r.cost_nanousd, f"{r.cost_usd:.9f}") for t, r in expected.items()}


async def test_a_database_whose_times_are_not_iso_utc_is_written_and_audited(
        postgres_server: PostgresServer) -> None:
    """A database whose default date style is ``SQL, DMY`` (and time zone New York):
    psycopg parses only ISO times, so a run store could not read its runs back
    there, and the audit of any run failed as "a bug in loopengine". The
    ledger's and the audit's sessions now set their times to ISO and UTC: the
    runs are recorded, paused and resumed, and audited with their start times."""
    dsn = postgres_server.create_database()
    dbname = dsn.rsplit("dbname=", 1)[1]
    with postgres_server.connect() as conn:
        conn.execute(f"ALTER DATABASE {dbname} SET DateStyle = 'SQL, DMY'")
        conn.execute(f"ALTER DATABASE {dbname} SET TimeZone = 'America/New_York'")
    async with PostgresLedger(dsn) as pg:
        await record(pg)
        # A run the run store pauses and resumes: it reads its times back.
        engine = le.Engine(ScriptedProvider([Reply.tool_calls(("send", {"to": "x"})),
                                             Reply.text("sent")]),
                           ledger=pg, prices=PRICES, run_store=le.RunStore(pg))
        paused = await engine.run(operation(), "go", tools=[send])
        done = await engine.resume(paused.invocation_id, tools=[send],
                                   decisions={paused.pending[0].id: le.Approve()})
        assert done.completed
    db = (f"postgresql:///{dbname}?host={postgres_server.directory}&port=5432"
          f"&user={postgres_server.user}")
    runs = cli("runs", "--db", db, "--json", "--since", "2026-03-01T01:00:00+00:00",
               "--until", "2026-03-02")
    assert runs.exit_code == 0, runs.output
    assert [r["started_at"] for r in json.loads(runs.output)] == [
        "2026-03-01T03:00:00.000000+00:00", "2026-03-01T02:00:00.000000+00:00",
        "2026-03-01T01:00:00.000000+00:00"]
    for command in (["export", "--format", "jsonl"], ["reconcile"], ["accounts"]):
        result = cli(*command, "--db", db)
        assert result.exit_code == 0, (command, result.output)


def test_an_older_postgresql_ledger_is_audited_by_a_read_only_role(
        postgres_server: PostgresServer) -> None:
    """A version-5 ledger lacks the later columns; they were supplied by temporary
    views, which a read-only role (or a standby) may not create, so every
    command exited 2. Its queries now supply them in themselves."""
    import psycopg

    from loopengine.persistence._postgres_schema import MIGRATIONS, migrate

    dsn = postgres_server.create_database()
    dbname = dsn.rsplit("dbname=", 1)[1]
    with psycopg.connect(dsn) as conn:
        migrate(conn, schema=None, name="old", migrations=MIGRATIONS[:5])
        conn.execute("INSERT INTO invocations (id, operation, operation_version, provider, "
                      "model, tenant, started_at, outcome, credits) VALUES ('old-1', 'op', "
                      "'1', 'anthropic', 'm', 'acme', '2026-01-01T00:00:00+00:00', "
                      "'completed', 7)")
        conn.commit()
    db = (f"postgresql:///{dbname}?host={postgres_server.directory}&port=5432"
          f"&user={postgres_server.user}&options=-cdefault_transaction_read_only%3Don")
    for command in (["runs"], ["spend", "--roll-up"], ["show", "old"], ["reconcile"],
                    ["export"], ["accounts"]):
        result = cli(*command, "--db", db)
        assert result.exit_code == 0, (command, result.output)
    rolled = json.loads(cli("spend", "--roll-up", "--json", "--db", db).output)
    assert [(r["tenant"], r["credits"], r["web_search_requests"]) for r in rolled] == [
        ("acme", 7, 0)]


async def pause_two_calls(ledger: Any) -> le.RunResult:
    """A run paused on two calls waiting for approval (no start time yet), their
    ids as a provider writes them, in mixed case."""
    ask = [{"type": "tool_use", "id": id_, "name": "send", "input": {"to": id_}}
           for id_ in ("toolu_01abc", "toolu_01Zzz")]
    engine = le.Engine(ScriptedProvider([Reply(content=ask, stop_reason="tool_use")]),
                       ledger=ledger, prices=PRICES, run_store=le.RunStore(ledger))
    paused = await engine.run(operation(), "go", tools=[send])
    assert paused.outcome is le.Outcome.PAUSED
    return paused


async def test_tool_calls_are_listed_in_one_order_on_both_stores(
        tmp_path: Path, postgres_server: PostgresServer) -> None:
    """Tool calls of one turn without times (waiting for approval, in `show`), or
    started at one time (a batch, in reconcile's calls in doubt), were ordered
    by their ids in the database's collation: ``toolu_01Zzz`` first on SQLite,
    last on an en-US PostgreSQL. Both now list them in their ids' character
    order (and a call without a time first, where PostgreSQL put it last)."""
    import psycopg

    lite, pg, on_sqlite, on_pg = await on_both(tmp_path, postgres_server, pause_two_calls)
    for db, run in ((lite, on_sqlite), (pg, on_pg)):
        shown = cli("show", run.invocation_id, "--db", db, "--json")
        assert shown.exit_code == 0, shown.output
        assert [c["call_id"] for c in json.loads(shown.output)["tool_calls"]] == [
            "toolu_01Zzz", "toolu_01abc"], db
    # As a process that died while its batch ran leaves them: started together.
    started = ("UPDATE tool_calls SET status = 'started', "
               "started_at = '2026-03-01T00:00:00.000000+00:00'")
    with sqlite3.connect(lite) as conn:
        conn.execute(started)
    with psycopg.connect(pg) as conn:
        conn.execute(started)
    for db in (lite, pg):
        in_doubt = json.loads(cli("reconcile", "--db", db, "--json").output)["in_doubt"]
        assert [c["call_id"] for c in in_doubt] == ["toolu_01Zzz", "toolu_01abc"], db
