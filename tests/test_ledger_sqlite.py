"""`SQLiteLedger` itself: its schema, when its writes are durable, group commit,
what it refuses, what it never stores, and its migrations."""

from __future__ import annotations

import os
import random
import sqlite3
import stat
import time
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest

import loopengine as le
from loopengine.persistence import (
    SQLiteLedger,
)
from loopengine.persistence import _writer as writer_module
from loopengine.persistence._schema import (
    ATTEMPT_COLUMNS,
    INVOCATION_COLUMNS,
    MIGRATIONS,
    SCHEMA_TABLE,
    SCHEMA_VERSION,
    Migration,
    migrate,
)
from loopengine.providers import (
    AnthropicProvider,
    Provider,
    ProviderRequest,
    ProviderResponse,
    Reply,
    ScriptedProvider,
    TextCallback,
)
from loopengine.testing import FakeAnthropicServer, FakeClock

from .conftest import PRICES, EngineFactory, operation
from .ledger_support import (
    connect,
    dispatch,
    end,
    judge,
    lookup,
    overloaded,
    read_db,
    settle,
    start,
    teammate_script,
)

FAST = le.RetryPolicy(max_attempts=7, initial_wait=0.001, max_wait=0.001)

# The columns docs/ledger.md documents ("Schema") and audit tools rely on.
DOCUMENTED_INVOCATION_COLUMNS = """id operation operation_version provider model tenant user_id
    feature correlation_id started_at ended_at outcome turns tool_calls attempt_count
    attempts_retained incomplete input_tokens output_tokens cache_read_tokens
    cache_write_tokens cost_nanousd provider_cost_nanousd credits""".split()
DOCUMENTED_ATTEMPT_COLUMNS = """invocation_id ordinal turn attempt phase served_by started_at
    latency_ms outcome fault aborted_reason http_status error_code input_tokens output_tokens
    cache_read_tokens cache_write_tokens usage_approx cost_nanousd charged price_ref
    response_id request_id stop_reason max_tokens timeout_ms wait_ms""".split()

# -- the schema -------------------------------------------------------------------------


def test_schema_has_every_documented_column(tmp_path: Path) -> None:
    """Both tables carry every documented column, money and counts as INTEGER, and
    the attempts key is (invocation_id, ordinal); the file is in WAL mode."""
    path = tmp_path / "ledger.db"
    SQLiteLedger(path).close()
    conn = connect(path)
    invocations = {r["name"]: r for r in conn.execute("PRAGMA table_info(invocations)")}
    attempts = {r["name"]: r for r in conn.execute("PRAGMA table_info(attempts)")}
    assert set(DOCUMENTED_INVOCATION_COLUMNS) <= set(invocations)
    assert set(DOCUMENTED_ATTEMPT_COLUMNS) <= set(attempts)
    assert tuple(invocations) == INVOCATION_COLUMNS and tuple(attempts) == ATTEMPT_COLUMNS
    for column in ("cost_nanousd", "provider_cost_nanousd", "credits", "input_tokens"):
        assert invocations[column]["type"] == "INTEGER"
    assert attempts["cost_nanousd"]["type"] == "INTEGER"
    key = sorted((r["pk"], r["name"]) for r in attempts.values() if r["pk"])
    assert [name for _, name in key] == ["invocation_id", "ordinal"]
    assert [r["name"] for r in invocations.values() if r["pk"]] == ["id"]
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute(f"SELECT MAX(version) FROM {SCHEMA_TABLE}").fetchone()[0] \
        == SCHEMA_VERSION
    conn.close()


async def test_times_are_iso_utc_text_and_money_is_integer(
    tmp_path: Path, make_engine: EngineFactory
) -> None:
    """Stored times are ISO-8601 UTC text of one width; costs and credits are integers."""
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as ledger:
        engine, _, _ = make_engine(*teammate_script(), ledger=ledger)
        await engine.run(operation(retry=FAST), "go", tools=[lookup], accept=judge)
    conn = connect(path)
    (started, ended, money, credits), = conn.execute(
        "SELECT started_at, ended_at, typeof(cost_nanousd), typeof(credits) FROM invocations")
    assert (money, credits) == ("integer", "integer")
    assert started == "2026-01-01T00:00:00.000000+00:00"
    assert datetime.fromisoformat(ended).utcoffset().total_seconds() == 0  # type: ignore[union-attr]
    widths = {len(r[0]) for r in conn.execute("SELECT started_at FROM attempts")}
    assert widths == {len(started)}
    types = {r[0] for r in conn.execute("SELECT typeof(cost_nanousd) FROM attempts")}
    assert types == {"integer", "null"}
    conn.close()


# -- durability and commits ----------------------------------------------------------


class Witness(Provider):
    """A provider that looks at the database file while its request is on the wire."""

    name = "anthropic"

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen: list[tuple[str, list[tuple[int, str]]]] = []

    async def send(self, request: ProviderRequest, *,
                   on_text: TextCallback | None = None) -> ProviderResponse:
        conn = connect(self.path)
        (outcome,), = conn.execute("SELECT outcome FROM invocations")
        rows = [(r["ordinal"], r["outcome"]) for r in
                conn.execute("SELECT ordinal, outcome FROM attempts ORDER BY ordinal")]
        conn.close()
        self.seen.append((outcome, rows))
        return ProviderResponse(content=[{"type": "text", "text": "ok"}], stop_reason="end_turn",
                                usage=le.Usage(1, 1), response_id=f"msg_{len(self.seen)}")


async def test_the_dispatched_row_is_on_disk_before_the_request_is_sent(tmp_path: Path) -> None:
    """While a request is on the wire, another connection already sees its row as
    dispatched (and the previous attempt's settle, which shared that commit)."""
    path = tmp_path / "ledger.db"
    provider = Witness(path)
    with SQLiteLedger(path, linger=30) as ledger:
        engine = le.Engine(provider, ledger=ledger, prices=PRICES)
        result = await engine.run(operation(max_turns=3), "go",
                                  accept=lambda answer: len(provider.seen) == 3)
    assert result.outcome is le.Outcome.COMPLETED
    assert provider.seen == [
        ("running", [(1, "dispatched")]),
        ("running", [(1, "ok"), (2, "dispatched")]),
        ("running", [(1, "ok"), (2, "ok"), (3, "dispatched")]),
    ]
    invocations, _ = read_db(path)
    assert [r["outcome"] for r in invocations.values()] == ["completed"]


async def test_sequential_run_commits_each_dispatch_each_served_settle_and_the_end(
    tmp_path: Path, make_engine: EngineFactory
) -> None:
    """A run of n attempts commits each dispatch (the first carrying the start),
    each settle of what the provider served (durable before the reply is acted
    on), and the end (carrying any settle of nothing served)."""
    with SQLiteLedger(tmp_path / "ledger.db", linger=30) as ledger:
        engine, _, _ = make_engine(*teammate_script(), ledger=ledger)
        result = await engine.run(operation(retry=FAST), "go", tools=[lookup], accept=judge)
        assert result.attempts.count == 6
        served = sum(1 for r in result.attempt_log if r.settle is not None and r.settle.served)
        assert 0 < served <= 6
        assert ledger.commits == 6 + served + 1
        assert ledger.writes == 1 + 6 + 6 + 1


async def test_concurrent_runs_share_commits(tmp_path: Path) -> None:
    """Many runs at once: their writes are grouped into far fewer commits than
    attempts, and every run's rows are complete."""
    path = tmp_path / "ledger.db"
    clock = FakeClock()
    with SQLiteLedger(path) as ledger:

        async def one(n: int) -> None:
            provider = ScriptedProvider(
                [overloaded(), Reply.tool_calls(("lookup", {"key": str(n)})), Reply.text("a")],
                clock=clock)
            run_engine = le.Engine(provider, ledger=ledger, prices=PRICES, clock=clock,
                                   rng=random.Random(n))
            result = await run_engine.run(operation(retry=FAST), "go", tools=[lookup])
            assert result.outcome is le.Outcome.COMPLETED

        async with anyio.create_task_group() as group:
            for n in range(200):
                group.start_soon(one, n)
        commits = ledger.commits
    invocations, attempts = read_db(path)
    assert len(invocations) == 200 and len(attempts) == 600
    assert all(r["outcome"] == "completed" and r["attempt_count"] == 3
               for r in invocations.values())
    # Without grouping: one commit per dispatch, per served settle (the 400
    # replies) and per end, 1,200.
    assert commits < 1200 / 3


async def test_a_deferred_settle_is_committed_within_the_linger(tmp_path: Path) -> None:
    """With no later durable write, a settle still reaches the file after ``linger``."""
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path, linger=0.05) as ledger:
        await ledger.start_invocation(start())
        await ledger.dispatch_attempt(dispatch(1))
        await ledger.settle_attempt(settle(1))

        def settled_within(seconds: float) -> bool:
            # Another reader polling the file: nothing else tells it when.
            give_up = time.monotonic() + seconds
            while time.monotonic() < give_up:
                if read_db(path)[1][("inv-1", 1)]["outcome"] == "ok":
                    return True
                time.sleep(0.01)
            return False

        assert await anyio.to_thread.run_sync(settled_within, 30.0)  # a bound for a hang
        assert read_db(path)[0]["inv-1"]["input_tokens"] == 10


async def test_close_commits_what_is_still_deferred(tmp_path: Path) -> None:
    """Closing (sync or async) commits every queued write, and the file is whole."""
    path = tmp_path / "ledger.db"
    async with SQLiteLedger(path, linger=30) as ledger:
        await ledger.start_invocation(start())
        await ledger.dispatch_attempt(dispatch(1))
        await ledger.settle_attempt(settle(1))
    assert ledger.closed
    invocations, attempts = read_db(path)
    assert attempts[("inv-1", 1)]["outcome"] == "ok"
    assert invocations["inv-1"]["cost_nanousd"] == 12
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()


async def test_the_writer_checkpoints_so_the_wal_does_not_grow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the sequential path the writer checkpoints between its own commits
    (here every 16), so the WAL is rewritten from its start instead of growing
    by every commit; nothing written is lost."""
    monkeypatch.setattr(writer_module, "CHECKPOINT_COMMITS", 16)
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path, linger=30) as ledger:
        for n in range(80):
            await ledger.start_invocation(start(f"inv-{n}"))
            for ordinal in range(1, 5):
                await ledger.dispatch_attempt(dispatch(ordinal, f"inv-{n}"))
                await ledger.settle_attempt(settle(ordinal, f"inv-{n}"))
            await ledger.end_invocation(end(f"inv-{n}"))
        assert ledger.commits == 80 * (4 + 4 + 1)  # dispatches, served settles, ends
        # Every commit adds at least one page-sized frame to the WAL: grown by
        # all 720 it would hold 720 of them; restarted every 16 commits, it
        # never holds more than those commits' few frames each.
        conn = sqlite3.connect(path)
        (page,), = conn.execute("PRAGMA page_size")
        conn.close()
        wal = await anyio.Path(f"{path}-wal").stat()
        assert wal.st_size < 100 * (page + 24)
    invocations, attempts = read_db(path)
    assert len(invocations) == 80 and len(attempts) == 320
    assert all(r["outcome"] == "completed" and r["input_tokens"] == 40
               for r in invocations.values())
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()


# -- what the ledger refuses -----------------------------------------------------------


async def test_refused_writes_raise_ledger_error(tmp_path: Path) -> None:
    """An unknown invocation, a second start, an attempt settled twice or never
    dispatched, or a write after the end raise LedgerError; other invocations go on."""
    with SQLiteLedger(tmp_path / "ledger.db") as ledger:
        with pytest.raises(le.LedgerError, match="no invocation ghost"):
            await ledger.dispatch_attempt(dispatch(1, "ghost"))
        await ledger.start_invocation(start())
        await ledger.start_invocation(start())  # deferred: reported by the next durable call
        with pytest.raises(le.LedgerError, match="already exists"):
            await ledger.dispatch_attempt(dispatch(1))

        await ledger.start_invocation(start("inv-2"))
        await ledger.dispatch_attempt(dispatch(1, "inv-2"))
        await ledger.settle_attempt(settle(1, "inv-2"))
        # A settle of what the provider served is durable: refused at once, and
        # so is every later write of its invocation.
        with pytest.raises(le.LedgerError, match="not dispatched or is already settled"):
            await ledger.settle_attempt(settle(1, "inv-2"))
        with pytest.raises(le.LedgerError, match="not dispatched or is already settled"):
            await ledger.end_invocation(end("inv-2"))

        await ledger.start_invocation(start("inv-3"))
        await ledger.dispatch_attempt(dispatch(1, "inv-3"))
        with pytest.raises(le.LedgerError, match="already dispatched"):
            await ledger.dispatch_attempt(dispatch(1, "inv-3"))
        await ledger.settle_attempt(settle(1, "inv-3"))
        await ledger.end_invocation(end("inv-3"))
        with pytest.raises(le.LedgerError, match="already ended"):
            await ledger.dispatch_attempt(dispatch(2, "inv-3"))
    invocations, attempts = read_db(tmp_path / "ledger.db")
    assert invocations["inv-3"]["outcome"] == "completed"
    assert invocations["inv-3"]["input_tokens"] == 10  # the refused settle added nothing
    assert invocations["inv-2"]["input_tokens"] == 10
    with pytest.raises(le.LedgerError, match="closed"):
        await ledger.start_invocation(start("late"))


async def test_engine_run_raises_ledger_error_and_sends_nothing(tmp_path: Path) -> None:
    """A ledger that cannot record the dispatch stops the run before the request goes out."""
    ledger = SQLiteLedger(tmp_path / "ledger.db")
    ledger.close()
    provider = ScriptedProvider([Reply.text("never")])
    engine = le.Engine(provider, ledger=ledger, prices=PRICES)
    with pytest.raises(le.LedgerError, match="closed"):
        await engine.run(operation(), "go")
    assert provider.requests == []


@pytest.mark.parametrize("bad", [
    {"max_retained_attempts": 0}, {"max_retained_attempts": True}, {"busy_timeout": -1},
    {"linger": float("nan")}, {"linger": float("inf")}, {"busy_timeout": 1e400},
    {"max_batch": 0},
])
def test_bad_arguments_are_refused(tmp_path: Path, bad: dict[str, Any]) -> None:
    """Invalid settings raise ConfigError naming the argument, before any file is touched."""
    with pytest.raises(le.ConfigError) as caught:
        SQLiteLedger(tmp_path / "ledger.db", **bad)
    assert caught.value.field == next(iter(bad))
    assert not (tmp_path / "ledger.db").exists()


def test_files_that_are_not_ledgers_are_refused(tmp_path: Path) -> None:
    """A non-SQLite file, a database with foreign tables of the ledger's names, an
    in-memory database (a bad argument: ConfigError) and a missing directory raise
    LedgerError saying what is wrong."""
    text = tmp_path / "notes.txt"
    text.write_text("not a database at all, but long enough to have a header" * 20)
    with pytest.raises(le.LedgerError, match="not a SQLite database"):
        SQLiteLedger(text)
    foreign = tmp_path / "foreign.db"
    conn = sqlite3.connect(foreign)
    conn.execute("CREATE TABLE invocations (x)")
    conn.commit()
    conn.close()
    with pytest.raises(le.LedgerError, match="not a loopengine ledger"):
        SQLiteLedger(foreign)
    with pytest.raises(le.ConfigError, match="WAL"):
        SQLiteLedger(":memory:")
    with pytest.raises(le.LedgerError, match="cannot open"):
        SQLiteLedger(tmp_path / "missing" / "ledger.db")


# -- what the ledger never stores --------------------------------------------------------


async def test_canaries_never_reach_the_database_files(tmp_path: Path) -> None:
    """Strings placed in the prompt, the system prompt, a tool input, a tool output and
    the API key reach the provider, and appear in none of the database, WAL or SHM."""
    canaries = {name: f"CANARY-{name}-7f3a9c" for name in
                ("prompt", "system", "tool-input", "tool-output", "api-key")}

    @le.tool
    async def fetch(query: str) -> str:
        """Fetch something."""
        return f"{canaries['tool-output']} for {query}"

    path = tmp_path / "ledger.db"
    with FakeAnthropicServer([
        Reply.tool_calls(("fetch", {"query": canaries["tool-input"]})),
        Reply.text("answered"),
    ]) as server:
        provider = AnthropicProvider(api_key=canaries["api-key"], base_url=server.url,
                                     http_client=httpx2.AsyncClient(verify=False))
        ledger = SQLiteLedger(path, linger=30)
        engine = le.Engine(provider, ledger=ledger, prices=PRICES)
        result = await engine.run(operation(), f"Question {canaries['prompt']}",
                                  system=f"Be kind {canaries['system']}", tools=[fetch])
        await provider.aclose()
        wire = "".join(str(r.headers) + str(r.body) for r in server.requests)
    assert result.outcome is le.Outcome.COMPLETED
    assert all(canary in wire for canary in canaries.values())

    assert {"ledger.db", "ledger.db-wal", "ledger.db-shm"} <= files_in(tmp_path)
    assert leaks(tmp_path, canaries) == []
    ledger.close()
    assert leaks(tmp_path, canaries) == []
    assert read_db(path)[0][result.invocation_id]["outcome"] == "completed"


def files_in(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


def leaks(directory: Path, canaries: dict[str, str]) -> list[str]:
    """Which canaries appear in which files of ``directory`` (UTF-8 or UTF-16)."""
    found = []
    for file in directory.iterdir():
        data = file.read_bytes()
        found += [f"{name} in {file.name}" for name, canary in canaries.items()
                  if canary.encode() in data or canary.encode("utf-16-le") in data]
    return found


# -- migrations ----------------------------------------------------------------------------


def test_an_older_ledger_is_migrated_and_keeps_its_rows(tmp_path: Path) -> None:
    """A version-1 file opens as the current version, each step recorded, rows intact."""
    path = tmp_path / "ledger.db"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    assert migrate(conn, migrations=MIGRATIONS[:1]) == 1
    conn.execute("INSERT INTO invocations (id, operation, operation_version, provider, model, "
                 "started_at) VALUES ('old', 'op', '1', 'anthropic', 'm', '2025-01-01')")
    conn.close()
    SQLiteLedger(path).close()
    conn = connect(path)
    versions = [tuple(r)[:2] for r in conn.execute(
        f"SELECT version, name FROM {SCHEMA_TABLE} ORDER BY version")]
    assert versions == [(m.version, m.name) for m in MIGRATIONS]
    assert [r[0] for r in conn.execute("SELECT id FROM invocations")] == ["old"]
    indexes = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    assert {"invocations_started_at", "invocations_running"} <= indexes
    conn.close()


def test_a_failing_migration_leaves_nothing_behind(tmp_path: Path) -> None:
    """A step that fails half-way is rolled back whole: no table, no version row."""
    path = tmp_path / "ledger.db"
    SQLiteLedger(path).close()
    broken = Migration(SCHEMA_VERSION + 1, "broken step",
                       ("CREATE TABLE half_done (x)", "CREATE TABLE invocations (x)"))
    conn = sqlite3.connect(path, isolation_level=None)
    with pytest.raises(le.LedgerError, match="rolled back"):
        migrate(conn, migrations=(*MIGRATIONS, broken))
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert "half_done" not in tables
    assert conn.execute(f"SELECT MAX(version) FROM {SCHEMA_TABLE}").fetchone()[0] \
        == SCHEMA_VERSION
    conn.close()


def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    """A file migrated by a newer loopengine is not written by this one."""
    path = tmp_path / "ledger.db"
    SQLiteLedger(path).close()
    conn = sqlite3.connect(path)
    conn.execute(f"INSERT INTO {SCHEMA_TABLE} VALUES (?, 'future', '2030-01-01')",
                 (SCHEMA_VERSION + 1,))
    conn.commit()
    conn.close()
    with pytest.raises(le.LedgerError, match="newer than this loopengine"):
        SQLiteLedger(path)


async def test_migration_4_keeps_every_attempt_row_and_allows_the_wrap_up_phase(
    tmp_path: Path,
) -> None:
    """A version-3 ledger with rows: rebuilding ``attempts`` for the ``wrap_up``
    phase keeps every row and column as it was."""
    from loopengine.persistence._schema import MIGRATIONS, migrate

    path = tmp_path / "ledger.db"
    conn = sqlite3.connect(path, isolation_level=None)
    migrate(conn, migrations=MIGRATIONS[:3])
    conn.execute("INSERT INTO invocations (id, operation, operation_version, provider, model, "
                 "started_at) VALUES ('inv-1', 'op', '1', 'anthropic', 'm', '2026-01-01')")
    conn.execute("INSERT INTO attempts (invocation_id, ordinal, turn, attempt, phase, "
                 "served_by, started_at, outcome, input_tokens, response_id, max_tokens, "
                 "timeout_ms, wait_ms) VALUES ('inv-1', 1, 1, 1, 'repair', 'anthropic:m', "
                 "'2026-01-01', 'ok', 7, 'msg_1', 64, 1000, 0)")
    before = conn.execute("SELECT * FROM attempts").fetchall()
    conn.close()
    with SQLiteLedger(path) as ledger:
        await ledger.start_invocation(start("inv-2"))
        await ledger.dispatch_attempt(replace(dispatch(1, "inv-2"), phase="wrap_up"))
        await ledger.end_invocation(end("inv-2"))
    conn = sqlite3.connect(path)
    version = conn.execute("SELECT MAX(version) FROM loopengine_schema").fetchone()[0]
    assert version == SCHEMA_VERSION
    after = conn.execute("SELECT * FROM attempts WHERE invocation_id = 'inv-1'").fetchall()
    # Later migrations add columns at the end (the usage vector): NULL on old rows.
    assert [row[:len(before[0])] for row in after] == before
    assert after[0][len(before[0]):] == (None,) * (len(after[0]) - len(before[0]))
    assert conn.execute("SELECT phase FROM attempts WHERE invocation_id = 'inv-2'").fetchall() \
        == [("wrap_up",)]
    conn.close()


# -- a new ledger file is its owner's only, however its path is reached ---------------------


def _new_ledger_modes(path: Path, umask: int) -> dict[str, int]:
    """The modes of the files in the directory of ``path``'s target (links left
    out) once a new ledger, opened at ``path`` under ``umask``, has written."""
    old = os.umask(umask)
    try:
        ledger = SQLiteLedger(path)
    finally:
        os.umask(old)
    async def write() -> None:
        await ledger.start_invocation(start())
        await ledger.dispatch_attempt(dispatch(1))

    with ledger:
        anyio.run(write)
        directory = path.resolve().parent
        return {p.name: stat.S_IMODE(p.lstat().st_mode) for p in directory.iterdir()
                if not p.is_symlink()}


PRIVATE = {"ledger.db": 0o600, "ledger.db-wal": 0o600, "ledger.db-shm": 0o600}


@pytest.mark.parametrize("beside", [True, False])
def test_a_ledger_created_through_a_symbolic_link_is_0600(
    tmp_path: Path, beside: bool,
) -> None:
    """A path that is a dangling symbolic link (to a file not created yet, beside it
    or in another directory) gets the link's target created 0600, with its -wal
    and -shm, under a permissive umask."""
    where = tmp_path / "real"
    where.mkdir()
    link = (where if beside else tmp_path) / "link.db"
    link.symlink_to(where / "ledger.db")
    assert _new_ledger_modes(link, 0o000) == PRIVATE
    assert link.is_symlink()


def test_a_ledger_in_a_group_writable_directory_is_0600_with_its_leftovers(
    tmp_path: Path,
) -> None:
    """In a group-writable (shared) directory, a new ledger is 0600, and a -wal and
    -shm left there under its name with wider modes are made 0600 too."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o2775)
    for leftover in ("ledger.db-wal", "ledger.db-shm"):
        (shared / leftover).write_bytes(b"")
        (shared / leftover).chmod(0o666)
    assert _new_ledger_modes(shared / "ledger.db", 0o002) == PRIVATE


def test_a_sqlite_library_older_than_3_33_is_refused_before_the_file_is_touched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An invocation's end is an ``UPDATE ... FROM``: on SQLite 3.31 (as some
    distributions' Pythons link) every run would fail at its end, so the ledger
    refuses to open, saying what it needs, and creates nothing."""
    path = tmp_path / "ledger.db"
    monkeypatch.setattr(sqlite3, "sqlite_version_info", (3, 31, 1))
    with pytest.raises(le.LedgerError, match=r"SQLite 3\.31\.1, and the ledger needs 3\.33\.0"):
        SQLiteLedger(path)
    assert not path.exists()
    monkeypatch.setattr(sqlite3, "sqlite_version_info", (3, 33, 0))
    SQLiteLedger(path).close()
    assert path.exists()
