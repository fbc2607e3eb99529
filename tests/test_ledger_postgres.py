"""`PostgresLedger` itself, against a real server the suite starts: its schema and
migrations, when its writes are committed, group commit, what it refuses, a
lost connection, and the event loops it serves.

The `Ledger` contract (R07, S01, cancellation, identical rows) runs on it in
tests/test_ledger_contract.py; several processes writing one database are in
tests/test_ledger_postgres_processes.py.
"""

from __future__ import annotations

import asyncio
import os
import random
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest

import loopengine as le
from loopengine.persistence import (
    AttemptSettle,
    PostgresLedger,
    SQLiteLedger,
)
from loopengine.persistence import _postgres_schema as pg_schema
from loopengine.persistence._postgres import APPLICATION_NAME
from loopengine.persistence._schema import (
    ATTEMPT_COLUMNS,
    INVOCATION_COLUMNS,
    MIGRATIONS,
    SCHEMA_TABLE,
    SCHEMA_VERSION,
    Migration,
)
from loopengine.providers import AnthropicProvider, Reply, ScriptedProvider
from loopengine.testing import FakeAnthropicServer, FakeClock

from .conftest import PRICES, EngineFactory, operation
from .ledger_support import (
    dispatch,
    end,
    judge,
    lookup,
    overloaded,
    read_rows,
    settle,
    start,
    teammate_script,
)
from .postgres_support import (
    PostgresServer,
    fresh_schema,
    read_postgres,
    require_module,
    round_trips,
)

psycopg = require_module("psycopg")

FAST = le.RetryPolicy(max_attempts=7, initial_wait=0.001, max_wait=0.001)

Factory = Callable[..., PostgresLedger]


@pytest.fixture
def make_ledger(postgres_server: PostgresServer) -> Iterator[Factory]:
    """``make_ledger(**kwargs)``: a PostgresLedger on a schema of its own (unless
    ``schema=`` says otherwise), closed after the test."""
    made: list[PostgresLedger] = []

    def make(**kwargs: Any) -> PostgresLedger:
        kwargs.setdefault("schema", fresh_schema())
        ledger = PostgresLedger(kwargs.pop("dsn", postgres_server.dsn()), **kwargs)
        made.append(ledger)
        return ledger

    yield make
    for ledger in made:
        ledger.close()


def query(ledger: PostgresLedger, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    """Rows of ``sql`` run on another connection, in the ledger's schema."""
    with psycopg.connect(ledger.dsn, autocommit=True) as conn:
        if ledger.schema is not None:
            conn.execute(psycopg.sql.SQL("SET search_path = {}").format(
                psycopg.sql.Identifier(ledger.schema)))
        cursor = conn.execute(sql, params)  # type: ignore[arg-type]
        return cursor.fetchall() if cursor.description else []


# -- the schema and its migrations ---------------------------------------------------------


async def test_schema_matches_sqlite_with_postgres_types(
    make_ledger: Factory, tmp_path: Path
) -> None:
    """The tables, their columns and their order are SQLite's (credit accounts too);
    ids are text, counts, tokens and money bigint, flags smallint, times timestamptz;
    everything lives in the ledger's schema and the schema is at the current version."""
    ledger = make_ledger()
    await ledger.open()
    columns: dict[str, dict[str, str]] = {}
    for table, column, kind in query(
            ledger, "SELECT table_name, column_name, data_type FROM information_schema.columns "
            "WHERE table_schema = %s ORDER BY table_name, ordinal_position", ledger.schema):
        columns.setdefault(table, {})[column] = kind
    assert tuple(columns["invocations"]) == INVOCATION_COLUMNS
    assert tuple(columns["attempts"]) == ATTEMPT_COLUMNS
    SQLiteLedger(tmp_path / "ledger.db").close()
    conn = sqlite3.connect(tmp_path / "ledger.db")
    for table in ("accounts", "account_entries", "open_reservations", SCHEMA_TABLE):
        sqlite_columns = [r[1] for r in conn.execute(f"PRAGMA table_info({table})")]
        assert list(columns[table]) == sqlite_columns, table
    conn.close()
    invocations, attempts = columns["invocations"], columns["attempts"]
    assert invocations["id"] == attempts["invocation_id"] == "text"
    for column in ("cost_nanousd", "provider_cost_nanousd", "credits", "input_tokens",
                   "attempt_count"):
        assert invocations[column] == "bigint", column
    assert attempts["cost_nanousd"] == attempts["output_tokens"] == "bigint"
    assert invocations["incomplete"] == attempts["charged"] == attempts["usage_approx"] \
        == "smallint"
    assert invocations["started_at"] == invocations["ended_at"] == attempts["started_at"] \
        == "timestamp with time zone"
    assert columns["accounts"]["spent"] == columns["account_entries"]["credits"] == "bigint"
    assert query(ledger, f"SELECT MAX(version) FROM {SCHEMA_TABLE}") == [(SCHEMA_VERSION,)]
    assert query(ledger, "SELECT to_regclass('public.invocations')") == [(None,)]


def test_the_postgres_history_follows_the_sqlite_one() -> None:
    """Every SQLite migration has its PostgreSQL step, of the same version and name,
    so both stores always have the same tables and columns."""
    assert [(m.version, m.name) for m in pg_schema.MIGRATIONS] == [
        (m.version, m.name) for m in MIGRATIONS]


async def test_ten_ledgers_opening_a_fresh_database_at_once_migrate_it_once(
    postgres_server: PostgresServer, make_ledger: Factory
) -> None:
    """Ten ledgers (each its own connection, as ten processes would) open one new
    database at the same moment: every one opens, each migration is applied once
    (the advisory lock), and the tables are in the database's current schema."""
    dsn = postgres_server.create_database()
    ledgers = [make_ledger(dsn=dsn, schema=None) for _ in range(10)]
    async with anyio.create_task_group() as group:
        for ledger in ledgers:
            group.start_soon(ledger.open)
    rows = query(ledgers[0], f"SELECT version FROM {SCHEMA_TABLE} ORDER BY version")
    assert rows == [(m.version,) for m in pg_schema.MIGRATIONS]
    assert query(ledgers[0], "SELECT to_regclass('public.invocations')::text") == [
        ("invocations",)]
    # And they all write.
    for n, ledger in enumerate(ledgers):
        await ledger.start_invocation(start(f"inv-{n}"))
        await ledger.end_invocation(end(f"inv-{n}"))
    assert query(ledgers[0], "SELECT count(*) FROM invocations") == [(10,)]


async def test_a_newer_schema_is_refused(make_ledger: Factory) -> None:
    """A schema migrated by a newer loopengine is refused with LedgerError, and the
    refused ledger writes nothing."""
    first = make_ledger()
    await first.open()
    query(first, f"INSERT INTO {SCHEMA_TABLE} VALUES (99, 'from the future', now())")
    newer = make_ledger(schema=first.schema)
    with pytest.raises(le.LedgerError, match="schema version 99, newer than this loopengine"):
        await newer.open()
    with pytest.raises(le.LedgerError, match="newer"):
        await newer.start_invocation(start())
    assert query(first, "SELECT count(*) FROM invocations") == [(0,)]


async def test_tables_that_are_not_a_ledger_are_refused(
    postgres_server: PostgresServer, make_ledger: Factory
) -> None:
    """A schema holding an unrelated ``invocations`` table is not taken for a ledger."""
    schema = fresh_schema()
    with postgres_server.connect() as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
        conn.execute(f"CREATE TABLE {schema}.invocations (id int)")
    with pytest.raises(le.LedgerError, match="is not a loopengine ledger"):
        await make_ledger(schema=schema).open()


def test_a_failing_migration_is_rolled_back_whole(postgres_server: PostgresServer) -> None:
    """A step that fails half-way leaves neither its first statement nor its row."""
    schema = fresh_schema()
    step = SCHEMA_VERSION + 1
    broken = (*pg_schema.MIGRATIONS,
              Migration(step, "half a step", ("CREATE TABLE extra (a int)", "NOT SQL")))
    with postgres_server.connect(autocommit=False) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
        conn.execute(f"SET search_path = {schema}")
        conn.commit()
        with pytest.raises(le.LedgerError, match=rf"migration {step} \(half a step\) failed"):
            pg_schema.migrate(conn, schema=schema, name="test", migrations=broken)
        assert conn.execute("SELECT to_regclass('extra')").fetchone() == (None,)
        assert pg_schema.schema_version(conn) == SCHEMA_VERSION
        conn.rollback()


# -- construction and opening ---------------------------------------------------------------


def test_constructing_does_no_io_and_a_bad_server_is_a_ledger_error(tmp_path: Path) -> None:
    """A ledger on a server that is not there constructs; opening it raises LedgerError
    naming the server, never its password."""
    ledger = PostgresLedger(f"host={tmp_path} port=1 user=u password=s3cret dbname=d",
                            connect_timeout=2)
    assert "not opened" in repr(ledger) and "s3cret" not in repr(ledger)

    async def main() -> None:
        with pytest.raises(le.LedgerError, match="cannot connect") as caught:
            await ledger.open()
        assert "s3cret" not in str(caught.value) and str(tmp_path) in str(caught.value)
        # libpq's message is two lines ("... failed: No such file or directory", a
        # tab, "Is the server running locally..."): the error reads as one.
        assert "\n" not in str(caught.value) and "\t" not in str(caught.value)

    anyio.run(main)
    ledger.close()


@pytest.mark.parametrize("bad", [
    {"max_retained_attempts": 0}, {"max_retained_attempts": True}, {"linger": -1},
    {"linger": float("nan")}, {"connect_timeout": float("inf")}, {"max_batch": 0},
    {"schema": ""}, {"dsn": "host='unterminated"},
    # a NUL was a LedgerError at the first connection; PostgreSQL names hold 63 bytes
    {"schema": "ledger\x00"}, {"schema": "line\nbreak"}, {"schema": "x" * 64}, {"schema": 3},
])
def test_bad_arguments_are_refused(bad: dict[str, Any]) -> None:
    """Invalid settings raise ConfigError naming the argument, at construction."""
    field = next(iter(bad))
    dsn = bad.pop("dsn", "host=/nowhere dbname=d")
    with pytest.raises(le.ConfigError) as caught:
        PostgresLedger(dsn, **bad)
    assert caught.value.field == field


async def test_invocation_rows_have_room_on_their_pages_for_their_updates(
    make_ledger: Factory,
) -> None:
    """Migration 5: invocations keep half of each page free (fillfactor 50), so the
    two updates of an invocation's totals per attempt can stay on its page
    (heap-only: no index entry each); attempts, updated once each, stay packed."""
    ledger = make_ledger()
    await ledger.open()
    assert query(ledger, "SELECT relname, reloptions FROM pg_class WHERE oid IN "
                 "('invocations'::regclass, 'attempts'::regclass) ORDER BY relname") == [
        ("attempts", None), ("invocations", ["fillfactor=50"])]


def test_the_plain_with_form_opens_writes_from_a_thread_and_closes(
    make_ledger: Factory,
) -> None:
    """``with PostgresLedger(...)`` opens at once (as `SQLiteLedger` does): its
    writer is a thread of this process, gone once the block closes the ledger,
    and what was queued is committed."""
    ledger = make_ledger()

    def writers() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith("loopengine-writer")]

    async def main() -> None:
        await ledger.start_invocation(start())
        await ledger.end_invocation(end())

    before = writers()
    with ledger as opened:
        assert opened is ledger and repr(ledger).endswith("open)")
        assert len(writers()) == len(before) + 1
        anyio.run(main)
    assert ledger.closed and writers() == before
    assert query(ledger, "SELECT outcome FROM invocations") == [("completed",)]


# -- when writes are committed --------------------------------------------------------------


async def test_the_row_is_committed_when_the_request_reaches_the_server(
    make_ledger: Factory,
) -> None:
    """Through the SDK: when each
    request reaches the loopback server, another connection already sees its row as
    dispatched and the previous reply settled; the ledger's tokens equal the server's."""
    ledger = make_ledger(linger=30)
    seen: list[list[tuple[Any, ...]]] = []

    def witness(reply: Reply) -> Any:
        def look(request: Any) -> Reply:
            seen.append(query(ledger, "SELECT ordinal, outcome FROM attempts ORDER BY ordinal"))
            return reply
        return look

    with FakeAnthropicServer([witness(Reply.tool_calls(("lookup", {"key": "a"}))),
                              witness(Reply.text("done"))]) as server:
        provider = AnthropicProvider(api_key="k", base_url=server.url,
                                     http_client=httpx2.AsyncClient())
        engine = le.Engine(provider, ledger=ledger, prices=PRICES)
        result = await engine.run(operation(), "go", tools=[lookup])
        await provider.aclose()
        served = server.usage_served
    assert result.outcome is le.Outcome.COMPLETED
    assert seen == [[(1, "dispatched")], [(1, "ok"), (2, "dispatched")]]
    invocations, _ = await read_rows(ledger)
    (row,) = invocations.values()
    assert (row["input_tokens"], row["output_tokens"]) == (served.input_tokens,
                                                           served.output_tokens)


async def test_a_reply_is_committed_before_its_tools_run(
    make_ledger: Factory, make_engine: EngineFactory
) -> None:
    """While the reply's tool runs, another connection already sees the attempt
    settled with the usage the provider served (docs/ledger.md)."""
    ledger = make_ledger(linger=30)
    seen: list[list[tuple[Any, ...]]] = []

    @le.tool
    async def look(key: str) -> str:
        """Look at the ledger from outside."""
        seen.append(await anyio.to_thread.run_sync(
            query, ledger, "SELECT ordinal, outcome, input_tokens FROM attempts"))
        return "seen"

    engine, _, _ = make_engine(Reply.tool_calls(("look", {"key": "k"}), usage=le.Usage(77, 5)),
                               Reply.text("done"), ledger=ledger)
    result = await engine.run(operation(), "go", tools=[look])
    assert result.outcome is le.Outcome.COMPLETED
    assert seen == [[(1, "ok", 77)]]


async def test_a_schema_name_is_an_identifier_not_sql(
    postgres_server: PostgresServer, make_ledger: Factory
) -> None:
    """Any schema name works, quoted as an identifier: one with spaces, quotes and
    capitals holds the tables, and nothing else is created."""
    ledger = make_ledger(schema='Ledger "q"; DROP TABLE x -- 1')
    await ledger.start_invocation(start())
    await ledger.end_invocation(end())
    with postgres_server.connect() as conn:
        rows = conn.execute("SELECT table_name FROM information_schema.tables "
                            "WHERE table_schema = %s ORDER BY 1", (ledger.schema,)).fetchall()
    assert [r[0] for r in rows] == ["account_entries", "accounts", "attempts", "invocations",
                                    SCHEMA_TABLE, "open_reservations", "run_states",
                                    "segments", "tool_calls"]
    assert read_postgres(ledger)[0]["inv-1"]["outcome"] == "completed"


async def test_sequential_run_commits_each_dispatch_each_served_settle_and_the_end(
    make_ledger: Factory, make_engine: EngineFactory
) -> None:
    """A run of n attempts commits each dispatch (the first carrying the start), each
    served settle and the end (carrying any settle of nothing served)."""
    ledger = make_ledger(linger=30)
    engine, _, _ = make_engine(*teammate_script(), ledger=ledger)
    result = await engine.run(operation(retry=FAST), "go", tools=[lookup], accept=judge)
    served = sum(1 for r in result.attempt_log if r.settle is not None and r.settle.served)
    assert result.attempts.count == 6 and 0 < served <= 6
    assert ledger.commits == 6 + served + 1
    assert ledger.writes == 1 + 6 + 6 + 1


async def test_a_durable_write_costs_two_round_trips(make_ledger: Factory) -> None:
    """Each durable write's transaction reaches the server in two round trips: its
    BEGIN, its id and its statements in one pipeline, then its commit (which
    waits for the disk); a statement once prepared is not parsed again."""
    ledger = make_ledger()
    await ledger.start_invocation(start())
    first = await round_trips(ledger, lambda: ledger.dispatch_attempt(dispatch(1)))
    assert [trip[:2] for trip in first] == [["BEGIN", "SELECT txid_current()"],
                                            ["Query COMMIT"]]
    # The start and its segment, then the dispatch and the totals.
    assert [s.split(" (")[0] for s in first[0][2:]] == [
        'INSERT INTO invocations', 'INSERT INTO segments', 'INSERT INTO attempts',
        "UPDATE invocations AS i SET attempt_count = i.attempt_count + v.attempt_count, "
        "attempts_retained = i.attempts_retained + v.attempts_retained, incomplete = "
        "GREATEST(i.incomplete, v.incomplete), input_tokens = i.input_tokens + v.input_tokens,"
        " output_tokens = i.output_tokens + v.output_tokens, cache_read_tokens = "
        "i.cache_read_tokens + v.cache_read_tokens, cache_write_tokens = i.cache_write_tokens"
        " + v.cache_write_tokens, cache_write_1h_tokens = i.cache_write_1h_tokens + "
        "v.cache_write_1h_tokens, cost_nanousd = i.cost_nanousd + v.cost_nanousd, "
        "provider_cost_nanousd = i.provider_cost_nanousd + v.provider_cost_nanousd, "
        "web_search_requests = i.web_search_requests + v.web_search_requests, "
        "web_fetch_requests = i.web_fetch_requests + v.web_fetch_requests, reasoning_tokens "
        "= i.reasoning_tokens + v.reasoning_tokens, iterations = i.iterations + v.iterations,"
        " fee_nanousd = i.fee_nanousd + v.fee_nanousd FROM"]
    for ordinal in range(1, 8):
        if ordinal > 1:
            await ledger.dispatch_attempt(dispatch(ordinal))
        trips = await round_trips(ledger, partial(ledger.settle_attempt, settle(ordinal)))
        assert len(trips) == 2 and len(trips[0]) == 4 and trips[1] == ["Query COMMIT"]
    # Used five times, every statement of a settle is prepared.
    assert trips[0] == ["Prepared"] * 4
    assert ledger.commits == 14  # seven dispatches (the first with the start), seven settles


async def test_concurrent_runs_share_commits(make_ledger: Factory) -> None:
    """200 runs at once: far fewer commits than writes, every row complete."""
    ledger = make_ledger()
    clock = FakeClock()

    async def one(n: int) -> None:
        provider = ScriptedProvider(
            [overloaded(), Reply.tool_calls(("lookup", {"key": str(n)})), Reply.text("a")],
            clock=clock)
        engine = le.Engine(provider, ledger=ledger, prices=PRICES, clock=clock,
                           rng=random.Random(n))
        result = await engine.run(operation(retry=FAST), "go", tools=[lookup])
        assert result.outcome is le.Outcome.COMPLETED

    async with anyio.create_task_group() as group:
        for n in range(200):
            group.start_soon(one, n)
    invocations, attempts = await read_rows(ledger)
    assert len(invocations) == 200 and len(attempts) == 600
    assert all(r["outcome"] == "completed" and r["attempt_count"] == 3
               for r in invocations.values())
    # Without grouping: one commit per dispatch, per served settle and per end, 1,200.
    assert ledger.commits < 1200 / 3


async def test_a_deferred_settle_is_committed_within_the_linger(make_ledger: Factory) -> None:
    """With no later durable write, a settle of nothing served still lands after ``linger``."""
    ledger = make_ledger(linger=0.05)
    await ledger.start_invocation(start())
    await ledger.dispatch_attempt(dispatch(1))
    await ledger.settle_attempt(AttemptSettle(
        invocation_id="inv-1", ordinal=1, outcome="error", latency_ms=1, http_status=529))

    def settled_within(seconds: float) -> bool:
        give_up = time.monotonic() + seconds
        while time.monotonic() < give_up:
            if query(ledger, "SELECT outcome FROM attempts") == [("error",)]:
                return True
            time.sleep(0.01)
        return False

    assert await anyio.to_thread.run_sync(settled_within, 30.0)  # a bound for a hang


async def test_close_commits_what_is_still_deferred(make_ledger: Factory) -> None:
    """Leaving the context manager commits every queued write; the ledger is closed."""
    async with make_ledger(linger=30) as ledger:
        await ledger.start_invocation(start())
        await ledger.dispatch_attempt(dispatch(1))
        await ledger.settle_attempt(AttemptSettle(
            invocation_id="inv-1", ordinal=1, outcome="error", latency_ms=1))
    assert ledger.closed
    assert query(ledger, "SELECT outcome FROM attempts") == [("error",)]
    with pytest.raises(le.LedgerError, match="closed"):
        await ledger.start_invocation(start("late"))


# -- what the ledger refuses -----------------------------------------------------------------


async def test_refused_writes_raise_ledger_error(make_ledger: Factory) -> None:
    """An unknown invocation, an attempt settled twice, or a write after the end raise
    LedgerError; the refused writes add nothing and other invocations go on."""
    ledger = make_ledger()
    with pytest.raises(le.LedgerError, match="no invocation ghost"):
        await ledger.dispatch_attempt(dispatch(1, "ghost"))
    await ledger.start_invocation(start())
    await ledger.dispatch_attempt(dispatch(1))
    await ledger.settle_attempt(settle(1))
    with pytest.raises(le.LedgerError, match="not dispatched or is already settled"):
        await ledger.settle_attempt(settle(1))
    await ledger.start_invocation(start("inv-2"))
    await ledger.end_invocation(end("inv-2"))
    with pytest.raises(le.LedgerError, match="already ended"):
        await ledger.dispatch_attempt(dispatch(1, "inv-2"))
    # A value no bigint holds fails its own write alone, in the same batch as others.
    await ledger.start_invocation(start("inv-3"))
    with pytest.raises(le.LedgerError, match="out of range for type bigint"):
        await ledger.dispatch_attempt(replace(dispatch(1, "inv-3"), max_tokens=2**70))
    await ledger.dispatch_attempt(dispatch(1, "inv-3"))
    assert query(ledger, "SELECT id, input_tokens, attempt_count, outcome FROM invocations "
                         "ORDER BY id") == [("inv-1", 10, 1, "running"),
                                            ("inv-2", 0, 0, "completed"),
                                            ("inv-3", 0, 1, "running")]


async def test_a_ledger_continues_an_invocation_another_one_started(
    make_ledger: Factory,
) -> None:
    """A second ledger (another process) settling and ending an invocation the first
    started reads its committed state: totals add up, nothing is counted twice."""
    first = make_ledger(max_retained_attempts=2)
    second = make_ledger(schema=first.schema, max_retained_attempts=2)
    await first.start_invocation(start())
    for ordinal in (1, 2, 3):
        await first.dispatch_attempt(dispatch(ordinal))
    for ordinal in (1, 2, 3):
        await second.settle_attempt(settle(ordinal))
    # The first still takes attempt 1 for unsettled; the row says otherwise, and the
    # settle is refused without adding to the totals.
    with pytest.raises(le.LedgerError, match="expected to update 1 dispatched attempt rows"):
        await first.settle_attempt(settle(1))
    third = make_ledger(schema=first.schema, max_retained_attempts=2)
    await third.end_invocation(end())
    assert query(first, "SELECT attempt_count, attempts_retained, incomplete, input_tokens, "
                        "cost_nanousd, outcome FROM invocations") == [(3, 2, 1, 30, 36,
                                                                        "completed")]


# -- a lost connection ------------------------------------------------------------------------


async def test_a_lost_connection_is_connected_again_and_the_run_completes(
    postgres_server: PostgresServer, make_ledger: Factory, make_engine: EngineFactory
) -> None:
    """The ledger's connection is killed (pg_terminate_backend) while a tool runs: the
    next dispatch finds it gone, connects again and is written there, so the run
    completes; every row is written once and the totals count each attempt once."""
    ledger = make_ledger()
    killed: list[int] = []

    @le.tool
    async def kill(key: str) -> str:
        """Terminate the ledger's connections."""
        killed.append(await anyio.to_thread.run_sync(postgres_server.terminate,
                                                     APPLICATION_NAME))
        return "killed"

    engine, provider, _ = make_engine(Reply.tool_calls(("kill", {"key": "k"})),
                                      Reply.text("done"), ledger=ledger)
    result = await engine.run(operation(), "go", tools=[kill])
    assert result.outcome is le.Outcome.COMPLETED
    assert killed and killed[0] >= 1
    assert len(provider.requests) == 2 and ledger.reconnects == 1
    invocations, attempts = await read_rows(ledger)
    (first,) = invocations.values()
    assert [(a["ordinal"], a["outcome"]) for a in attempts.values()] == [(1, "ok"), (2, "ok")]
    assert first["outcome"] == "completed" and first["attempt_count"] == 2
    assert first["input_tokens"] == sum(a["input_tokens"] for a in attempts.values())


def test_a_ledger_made_before_a_fork_is_opened_by_the_child_that_uses_it(
    make_ledger: Factory,
) -> None:
    """Constructing does no I/O, so a ledger made before a fork (at import, in a
    pre-forking server) works in the child that first uses it; one opened before
    the fork raises LedgerError in the child instead of sharing its connection."""
    unopened, opened = make_ledger(), make_ledger()
    anyio.run(opened.open)

    async def write(ledger: PostgresLedger) -> None:
        await ledger.start_invocation(start())
        await ledger.end_invocation(end())

    def in_child(ledger: PostgresLedger) -> int:
        pid = os.fork()
        if pid == 0:  # the child: report through the exit status, never return
            code = 3
            try:
                anyio.run(write, ledger)
                code = 0
            except le.LedgerError as error:
                code = 1 if "a forked process must open its own" in str(error) else 2
            finally:
                os._exit(code)
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

    assert in_child(unopened) == 0
    assert in_child(opened) == 1
    assert query(opened, "SELECT outcome FROM invocations") == []
    assert query(unopened, "SELECT outcome FROM invocations") == [("completed",)]
    assert "not opened" in repr(unopened)  # the parent's copy is still unopened


# -- the event loops it serves ------------------------------------------------------------------


def test_one_ledger_serves_consecutive_event_loops_and_trio(make_ledger: Factory) -> None:
    """The writer is a thread of its own: one ledger serves two consecutive
    ``asyncio.run`` calls and anyio's trio backend, fifty concurrent runs on each."""
    ledger = make_ledger()

    async def runs() -> None:
        async def one(n: int) -> None:
            provider = ScriptedProvider([Reply.tool_calls(("lookup", {"key": str(n)})),
                                         Reply.text("a")])
            engine = le.Engine(provider, ledger=ledger, prices=PRICES)
            result = await engine.run(operation(), "go", tools=[lookup])
            assert result.outcome is le.Outcome.COMPLETED

        async with anyio.create_task_group() as group:
            for n in range(50):
                group.start_soon(one, n)

    asyncio.run(runs())
    asyncio.run(runs())
    anyio.run(runs, backend="trio")
    invocations, attempts = read_postgres(ledger)
    assert len(invocations) == 150 and len(attempts) == 300
    assert all(r["outcome"] == "completed" for r in invocations.values())
