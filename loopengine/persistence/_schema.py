"""The ledger's SQLite schema and its migrations.

The schema is versioned in the table ``loopengine_schema``: one row per
applied migration (``version``, ``name``, ``applied_at``). A migration and its
row are written in one ``BEGIN IMMEDIATE`` transaction, so a migration either
happened entirely or not at all, and two processes opening a fresh file at
once cannot both apply it (the second sees the row once it gets the lock).

Migrations only add: a table or column docs/ledger.md documents ("Schema") is never renamed
or dropped, because audit tools read them by name.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from loopengine._errors import LedgerError

__all__ = [
    "ATTEMPT_COLUMNS",
    "INVOCATION_COLUMNS",
    "MIGRATIONS",
    "OPEN_RESERVATIONS",
    "PARENT_COLUMN",
    "RUN_RESULTS",
    "RUN_TABLES",
    "SEGMENT_TABLE",
    "TOOL_CALL_STATUSES",
    "UNRELEASED",
    "SCHEMA_TABLE",
    "SCHEMA_VERSION",
    "USAGE_COLUMNS",
    "Migration",
    "check_not_newer",
    "format_time",
    "history",
    "later_select",
    "migrate",
    "refuse_clash",
    "schema_version",
    "stored_time",
]

SCHEMA_TABLE = "loopengine_schema"


@dataclass(frozen=True, slots=True)
class Migration:
    """One step of the schema's history.

    Attributes:
        version: The version the database has once this step is applied.
        name: What the step does, in a few words (stored with it).
        statements: The SQL statements, run in order in one transaction.
    """

    version: int
    name: str
    statements: Sequence[str]


# The tables, written once for both stores: each column's type is a
# placeholder that `render` fills with the dialect's type (`SQLITE_TYPES`
# here; PostgreSQL's in _postgres_schema), so both stores have the same
# tables, columns, constraints and indexes.
TABLES = (
    """CREATE TABLE invocations (
        id TEXT PRIMARY KEY NOT NULL,
        operation TEXT NOT NULL,
        operation_version TEXT NOT NULL,
        provider TEXT NOT NULL,
        model TEXT NOT NULL,
        tenant TEXT,
        user_id TEXT,
        feature TEXT,
        correlation_id TEXT,
        started_at {TIME} NOT NULL,
        ended_at {TIME},
        outcome TEXT NOT NULL DEFAULT 'running',
        turns {INTEGER} NOT NULL DEFAULT 0,
        tool_calls {INTEGER} NOT NULL DEFAULT 0,
        attempt_count {INTEGER} NOT NULL DEFAULT 0,
        attempts_retained {INTEGER} NOT NULL DEFAULT 0,
        incomplete {FLAG} NOT NULL DEFAULT 0 CHECK (incomplete IN (0, 1)),
        input_tokens {INTEGER} NOT NULL DEFAULT 0,
        output_tokens {INTEGER} NOT NULL DEFAULT 0,
        cache_read_tokens {INTEGER} NOT NULL DEFAULT 0,
        cache_write_tokens {INTEGER} NOT NULL DEFAULT 0,
        cache_write_1h_tokens {INTEGER} NOT NULL DEFAULT 0,
        cost_nanousd {INTEGER} NOT NULL DEFAULT 0,
        provider_cost_nanousd {INTEGER} NOT NULL DEFAULT 0,
        credits {INTEGER} NOT NULL DEFAULT 0
    )""",
    # A rowid table, not WITHOUT ROWID: rows are appended in dispatch order
    # (a few hot pages per commit), where keying the rows by a random
    # invocation id would scatter every commit over the whole tree; measured
    # at twice the write throughput.
    """CREATE TABLE attempts (
        invocation_id TEXT NOT NULL REFERENCES invocations (id),
        ordinal {INTEGER} NOT NULL,
        turn {INTEGER} NOT NULL,
        attempt {INTEGER} NOT NULL,
        phase TEXT NOT NULL
            CHECK (phase IN ('turn', 'repair', 'continuation', 'fallback')),
        served_by TEXT NOT NULL,
        started_at {TIME} NOT NULL,
        latency_ms {INTEGER},
        outcome TEXT NOT NULL DEFAULT 'dispatched'
            CHECK (outcome IN ('dispatched', 'ok', 'error', 'aborted')),
        fault TEXT,
        aborted_reason TEXT,
        http_status {INTEGER},
        error_code TEXT,
        input_tokens {INTEGER},
        output_tokens {INTEGER},
        cache_read_tokens {INTEGER},
        cache_write_tokens {INTEGER},
        cache_write_1h_tokens {INTEGER},
        usage_approx {FLAG} NOT NULL DEFAULT 0 CHECK (usage_approx IN (0, 1)),
        cost_nanousd {INTEGER},
        charged {FLAG} NOT NULL DEFAULT 0 CHECK (charged IN (0, 1)),
        price_ref TEXT,
        response_id TEXT,
        request_id TEXT,
        stop_reason TEXT,
        max_tokens {INTEGER} NOT NULL,
        timeout_ms {INTEGER} NOT NULL,
        wait_ms {INTEGER} NOT NULL,
        PRIMARY KEY (invocation_id, ordinal)
    )""",
)

# Only invocations are indexed beyond their keys: an attempt row is written
# twice per request on the hot path, and every index on it costs both writes,
# while audit queries over attempts are rare and scan well.
AUDIT_INDEXES = (
    "CREATE INDEX invocations_started_at ON invocations (started_at)",
    # Partial: reconciliation looks for the few invocations still open, and
    # this stays as small as the number of runs in flight.
    "CREATE INDEX invocations_running ON invocations (id) WHERE outcome = 'running'",
)

# Credit accounts (docs/accounts.md): a balance per account, kept equal to the
# sums of its append-only journal. A reservation's entry also carries its
# expiry and the credit rate of its run, so that another process can settle
# it exactly once it has expired.
ACCOUNT_TABLES = (
    """CREATE TABLE accounts (
        account TEXT PRIMARY KEY NOT NULL,
        granted {INTEGER} NOT NULL DEFAULT 0,
        spent {INTEGER} NOT NULL DEFAULT 0,
        reserved {INTEGER} NOT NULL DEFAULT 0,
        updated_at {TIME} NOT NULL
    )""",
    """CREATE TABLE account_entries (
        id {SERIAL},
        account TEXT NOT NULL,
        at {TIME} NOT NULL,
        kind TEXT NOT NULL
            CHECK (kind IN ('grant', 'reserve', 'settle', 'release', 'expire')),
        credits {INTEGER} NOT NULL CHECK (credits >= 0),
        invocation_id TEXT,
        note TEXT,
        expires_at {TIME},
        credits_per_usd TEXT,
        credit_quantum {INTEGER}
    )""",
    "CREATE INDEX account_entries_invocation ON account_entries (invocation_id) "
    "WHERE invocation_id IS NOT NULL",
    "CREATE INDEX account_entries_reserved ON account_entries (account, expires_at) "
    "WHERE kind = 'reserve'",
)


SQLITE_TYPES: Final = {"INTEGER": "INTEGER", "FLAG": "INTEGER", "TIME": "TEXT",
                       "SERIAL": "INTEGER PRIMARY KEY AUTOINCREMENT"}
"""SQLite's spelling of the tables' types: integers, 0/1 flags, times as ISO-8601
text, and an id the table numbers itself."""


def render(statements: Sequence[str], types: Mapping[str, str]) -> tuple[str, ...]:
    """``statements`` with each type placeholder (``{INTEGER}``, ``{FLAG}``,
    ``{TIME}``, ``{SERIAL}``) spelled as ``types`` says."""
    return tuple(statement.format_map(types) for statement in statements)


# A delegated run (a sub-agent, docs/tools.md) names the run that started it;
# NULL for a root. The same statements on both stores (plain text type); the
# partial index finds a run's children and stays as small as the delegations.
PARENT_COLUMN = (
    "ALTER TABLE invocations ADD COLUMN parent_invocation_id TEXT",
    "CREATE INDEX invocations_parent ON invocations (parent_invocation_id) "
    "WHERE parent_invocation_id IS NOT NULL",
)

# A wrap-up turn's attempts (docs/guards.md) have the phase ``wrap_up``. SQLite
# cannot change a CHECK constraint in place: the table is rebuilt, same name,
# same columns in the same order, same rows.
_WRAP_UP_PHASE = (
    TABLES[1].replace("CREATE TABLE attempts (", "CREATE TABLE attempts_rebuilt (")
    .replace("'continuation', 'fallback')", "'continuation', 'fallback', 'wrap_up')"),
    "INSERT INTO attempts_rebuilt SELECT * FROM attempts",
    "DROP TABLE attempts",
    "ALTER TABLE attempts_rebuilt RENAME TO attempts",
)

# The whole usage vector (docs/pricing.md): server tool requests, reasoning
# tokens, sampling iterations and the fee part of the cost. An attempt's are
# NULL when it reported no usage (the fee: when it was not priced), as its
# tokens are; an invocation's are totals, 0 until an attempt adds to them.
USAGE_COLUMNS: Final = ("web_search_requests", "web_fetch_requests", "reasoning_tokens",
                        "iterations", "fee_nanousd")
"""The usage vector's columns, on both ``attempts`` and ``invocations``, in table order."""

LATER_COLUMNS: Final[dict[str, dict[str, str]]] = {
    "invocations": {"parent_invocation_id": "CAST(NULL AS TEXT)",
                    **dict.fromkeys(USAGE_COLUMNS, "CAST(0 AS BIGINT)"),
                    "pause_seal": "CAST(NULL AS TEXT)"},
    "attempts": dict.fromkeys(USAGE_COLUMNS, "CAST(NULL AS BIGINT)"),
}
"""Columns later migrations added to the two ledger tables, and what the audit
reads for them in a ledger older than them: a ledger of roots (no parent),
invocations that counted none of the usage vector and hold no pause's seal,
attempts whose usage was not read whole (NULL, as the migration leaves them)."""


def later_view(name: str, table: str, have: Collection[str], source: str) -> str | None:
    """The statement of a temporary view of ``table`` (whose columns are ``have``,
    read from ``source``) that supplies the later columns it lacks (``value AS
    column``), so that the audit reads one schema; None when it lacks none.

    Raises:
        LedgerError: it has no such table, or lacks a column every ledger has
            (it is no ledger).
    """
    select = later_select(name, table, have, source)
    return None if select is None else f"CREATE TEMP VIEW {table} AS {select}"


def later_select(name: str, table: str, have: Collection[str], source: str) -> str | None:
    """The query of `later_view`'s view (``SELECT *, value AS column ... FROM
    source``); None when ``table`` lacks no later column.

    Raises:
        LedgerError: as `later_view`.
    """
    if not have:
        raise LedgerError(f"{name} is not a loopengine ledger: it has no {table} table")
    wanted = INVOCATION_COLUMNS if table == "invocations" else ATTEMPT_COLUMNS
    later = LATER_COLUMNS[table]
    missing = [c for c in wanted if c not in have and c not in later]
    if missing:
        raise LedgerError(f"{name} is not a loopengine ledger: table {table} lacks "
                          f"{', '.join(missing)}")
    supplied = [f"{value} AS {c}" for c, value in later.items() if c not in have]
    return f"SELECT *, {', '.join(supplied)} FROM {source}" if supplied else None


USAGE_VECTOR = (
    *(f"ALTER TABLE attempts ADD COLUMN {column} {{INTEGER}}" for column in USAGE_COLUMNS),
    *(f"ALTER TABLE invocations ADD COLUMN {column} {{INTEGER}} NOT NULL DEFAULT 0"
      for column in USAGE_COLUMNS),
)
"""The statements of the usage vector's migration, rendered for each store."""

# Paused and running runs (docs/pause-and-resume.md): a run's resumable state (its
# transcript lives here and nowhere else; the row goes when the run ends),
# the lease of the process running it (``version`` makes taking it a
# compare-and-set), and the status of each tool call, never its input or
# output.
TOOL_CALL_STATUSES: Final = ("requested", "approved", "denied", "started", "succeeded",
                             "failed", "in_doubt", "supplied")
"""What ``tool_calls.status`` may hold."""

RUN_TABLES = (
    """CREATE TABLE run_states (
        invocation_id TEXT PRIMARY KEY NOT NULL,
        state TEXT NOT NULL,
        version {INTEGER} NOT NULL DEFAULT 1,
        lease_owner TEXT,
        lease_expires_at {TIME},
        paused_at {TIME},
        updated_at {TIME} NOT NULL
    )""",
    f"""CREATE TABLE tool_calls (
        invocation_id TEXT NOT NULL,
        call_id TEXT NOT NULL,
        turn {{INTEGER}} NOT NULL,
        tool TEXT NOT NULL,
        status TEXT NOT NULL
            CHECK (status IN ({", ".join(f"'{s}'" for s in TOOL_CALL_STATUSES)})),
        started_at {{TIME}},
        ended_at {{TIME}},
        PRIMARY KEY (invocation_id, call_id)
    )""",
)
"""The run store's tables (`loopengine.RunStore`), rendered for each store."""

RUN_RESULTS = ("ALTER TABLE run_states ADD COLUMN results TEXT",)
"""The results a batch has so far, written at each call's end apart from the
run's state (whose transcript is written once a batch, not once a call);
NULL when the state holds them all."""

# A run that pauses and resumes, or whose process died and was recovered,
# runs in segments (docs/pause-and-resume.md): one row each, for every run with a ledger.
# ``outcome`` says how the segment ended (``paused``, or the invocation's
# outcome); it and ``ended_at`` stay NULL while it runs, and for good when its
# process died (the next segment is a recovery). Never any conversation text.
SEGMENT_TABLE = (
    """CREATE TABLE segments (
        invocation_id TEXT NOT NULL,
        ordinal {INTEGER} NOT NULL,
        started_at {TIME} NOT NULL,
        ended_at {TIME},
        outcome TEXT,
        PRIMARY KEY (invocation_id, ordinal)
    )""",
)
"""The running segments' table, rendered for each store."""

PAUSE_SEAL = ("ALTER TABLE invocations ADD COLUMN pause_seal TEXT",)
"""A paused invocation's seal: the digest of the `RunState` its pause returned
(`RunState.seal`), which a resume must hand back (docs/pause-and-resume.md);
while a resumed run runs, a token of the resume that took it; NULL otherwise.
A digest, never the state: nothing of the conversation can be read from it."""

UNRELEASED: Final = (
    "SELECT r.id AS entry_id, r.account AS account, r.invocation_id AS invocation_id, "
    "r.expires_at AS expires_at FROM account_entries AS r WHERE r.kind = 'reserve' "
    "AND (SELECT COUNT(*) FROM account_entries AS e WHERE e.invocation_id = r.invocation_id "
    "AND e.kind = 'release') < (SELECT COUNT(*) FROM account_entries AS e "
    "WHERE e.invocation_id = r.invocation_id AND e.kind = 'reserve' AND e.id <= r.id)")
"""The journal's own answer to which reservations are still held, as
``open_reservations``' rows: each ``reserve`` entry with fewer releases of its
invocation than its reservations up to this one (a paused run released one,
and its resume reserved again: one per running segment). It walks every
entry ever journaled, so the accounts' transactions read the table
(`OPEN_RESERVATIONS`) instead; the migration fills the table with it, and
the audit checks the table against it."""

# The reservations still held, apart from the journal, so that an account's
# transactions (every one first settles its expired reservations) cost what is
# open, not the account's history. A row is written with its ``reserve`` entry
# and deleted with the ``release`` that closes it, in the same transaction
# (`_account_store.journal`); its other figures are the entry's, read by its
# id. It replaces the journal's index of reservations by expiry, which grew
# with every run ever admitted. Filled from the journal as it stands.
OPEN_RESERVATIONS = (
    """CREATE TABLE open_reservations (
        entry_id {INTEGER} PRIMARY KEY NOT NULL,
        account TEXT NOT NULL,
        invocation_id TEXT NOT NULL,
        expires_at {TIME}
    )""",
    "CREATE INDEX open_reservations_expiry ON open_reservations (account, expires_at)",
    "CREATE INDEX open_reservations_invocation ON open_reservations (invocation_id)",
    "INSERT INTO open_reservations (entry_id, account, invocation_id, expires_at) "
    + UNRELEASED,
    "DROP INDEX IF EXISTS account_entries_reserved",
)
"""The open reservations' migration, the same on both stores."""


def history(types: Mapping[str, str], wrap_up_phase: Sequence[str],
            invocation_room: Sequence[str]) -> tuple[Migration, ...]:
    """The schema's history, oldest first, rendered with a store's ``types``: the
    same steps on both stores, but for the two each spells its own way."""
    steps: tuple[tuple[str, Sequence[str]], ...] = (
        ("invocations and attempts", TABLES),
        ("invocation indexes for period and reconciliation queries", AUDIT_INDEXES),
        ("credit accounts and their journal", ACCOUNT_TABLES),
        ("the wrap_up phase of attempts", wrap_up_phase),
        ("room beside each invocation row for its updates", invocation_room),
        ("the parent of a delegated run", PARENT_COLUMN),
        ("the usage vector: server tool requests, reasoning, iterations, fees", USAGE_VECTOR),
        ("run states, their leases, and tool call statuses", RUN_TABLES),
        ("the running segments of each invocation", SEGMENT_TABLE),
        ("a batch's results apart from its run's state", RUN_RESULTS),
        ("the seal of a paused invocation's state", PAUSE_SEAL),
        ("the open reservations of credit accounts", OPEN_RESERVATIONS),
    )
    return tuple(Migration(version, name, render(statements, types))
                 for version, (name, statements) in enumerate(steps, start=1))


# PostgreSQL leaves room on each invocation's page for the new versions of its
# row (_postgres_schema); SQLite updates rows in place: nothing to do.
MIGRATIONS = history(SQLITE_TYPES, _WRAP_UP_PHASE, ())
"""The schema's history, oldest first."""

SCHEMA_VERSION = MIGRATIONS[-1].version
"""The version this code writes and reads."""

INVOCATION_COLUMNS = (
    "id", "operation", "operation_version", "provider", "model", "tenant", "user_id",
    "feature", "correlation_id", "started_at", "ended_at", "outcome", "turns", "tool_calls",
    "attempt_count", "attempts_retained", "incomplete", "input_tokens", "output_tokens",
    "cache_read_tokens", "cache_write_tokens", "cache_write_1h_tokens", "cost_nanousd",
    "provider_cost_nanousd", "credits", "parent_invocation_id", *USAGE_COLUMNS, "pause_seal",
)
"""The columns of ``invocations``, in table order."""

ATTEMPT_COLUMNS = (
    "invocation_id", "ordinal", "turn", "attempt", "phase", "served_by", "started_at",
    "latency_ms", "outcome", "fault", "aborted_reason", "http_status", "error_code",
    "input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens",
    "cache_write_1h_tokens", "usage_approx", "cost_nanousd", "charged", "price_ref",
    "response_id", "request_id", "stop_reason", "max_tokens", "timeout_ms", "wait_ms",
    *USAGE_COLUMNS,
)
"""The columns of ``attempts``, in table order."""


def stored_time(value: Any) -> datetime | None:
    """A time as a store gives it back: `format_time`'s text on SQLite, a
    datetime on PostgreSQL, or None."""
    if value is None or isinstance(value, datetime):
        return value
    return datetime.fromisoformat(str(value))


def format_time(moment: datetime) -> str:
    """``moment`` as fixed-width ISO-8601 UTC text: ``2026-01-01T09:30:00.000000+00:00``.

    Fixed width (microseconds always present, always ``+00:00``) keeps text
    order equal to time order, so period filters are plain string
    comparisons. A naive datetime is taken to be UTC already.
    """
    if moment.tzinfo is UTC:
        return moment.isoformat(timespec="microseconds")
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    elif moment.utcoffset():
        moment = moment.astimezone(UTC)
    elif moment.tzinfo is not UTC:
        moment = moment.replace(tzinfo=UTC)
    return moment.isoformat(timespec="microseconds")


def schema_version(conn: sqlite3.Connection) -> int | None:
    """The applied schema version, or None when the file is not a ledger.

    Raises:
        sqlite3.DatabaseError: the file is not a SQLite database.
    """
    found = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (SCHEMA_TABLE,)
    ).fetchone()
    if found is None:
        return None
    row = conn.execute(f"SELECT MAX(version) FROM {SCHEMA_TABLE}").fetchone()
    return int(row[0]) if row and row[0] is not None else 0


def migrate(
    conn: sqlite3.Connection,
    *,
    migrations: Sequence[Migration] = MIGRATIONS,
    path: str = "the database",
) -> int:
    """Apply every migration the database lacks, each in its own transaction.

    ``conn`` must be in autocommit mode (``isolation_level=None``) so that the
    transactions here are the only ones.

    Args:
        conn: The connection to migrate.
        migrations: The schema history (the real one unless a test says otherwise).
        path: How to name the file in error messages.

    Returns:
        The schema version after migrating.

    Raises:
        LedgerError: the file is not a SQLite database, holds tables named like
            the ledger's without being one, has a schema newer than this code,
            or a migration failed (it is then rolled back entirely).
    """
    known = migrations[-1].version if migrations else 0
    try:
        version = schema_version(conn)
        if version is None:
            refuse_clash(path, conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' "
                "AND name IN ('invocations', 'attempts')").fetchall())
        check_not_newer(path, version, known)
        if version == known:
            return version
        for migration in migrations:
            _apply(conn, migration, path)
        version = schema_version(conn) or 0
        check_not_newer(path, version, known)
        return version
    except sqlite3.DatabaseError as error:
        raise LedgerError(f"{path} could not be opened as a ledger: {error}") from error


def check_not_newer(name: str, version: int | None, known: int = SCHEMA_VERSION) -> None:
    """Refuse a ledger whose schema ``version`` is newer than ``known`` (this code's).

    Raises:
        LedgerError: it is newer.
    """
    if version is not None and version > known:
        raise LedgerError(f"{name} has ledger schema version {version}, newer than this "
                          f"loopengine understands ({known}); upgrade loopengine to use it")


def refuse_clash(name: str, clash: Sequence[Sequence[Any]]) -> None:
    """Refuse a database without a ledger's schema table whose tables ``clash``
    (their names, one a row) with a ledger's.

    Raises:
        LedgerError: some do.
    """
    if clash:
        names = ", ".join(sorted(str(r[0]) for r in clash))
        raise LedgerError(f"{name} is not a loopengine ledger: it has tables named {names} "
                          f"but no {SCHEMA_TABLE} table")


def _apply(conn: sqlite3.Connection, migration: Migration, path: str) -> None:
    # BEGIN IMMEDIATE takes the write lock before reading the version, so the
    # check and the migration cannot interleave with another process's.
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute(
            f"CREATE TABLE IF NOT EXISTS {SCHEMA_TABLE} (version INTEGER PRIMARY KEY, "
            "name TEXT NOT NULL, applied_at TEXT NOT NULL)"
        )
        row = conn.execute(
            f"SELECT 1 FROM {SCHEMA_TABLE} WHERE version = ?", (migration.version,)
        ).fetchone()
        if row is None:
            for statement in migration.statements:
                conn.execute(statement)
            conn.execute(
                f"INSERT INTO {SCHEMA_TABLE} (version, name, applied_at) VALUES (?, ?, ?)",
                (migration.version, migration.name, format_time(datetime.now(UTC))),
            )
        conn.execute("COMMIT")
    except BaseException as error:
        # BaseException: an interrupt mid-migration must not leave half a step.
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        if isinstance(error, sqlite3.Error):
            raise LedgerError(
                f"{path}: migration {migration.version} ({migration.name}) failed and was "
                f"rolled back: {error}"
            ) from error
        raise
