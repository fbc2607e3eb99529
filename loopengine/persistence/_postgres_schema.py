"""The ledger's PostgreSQL schema and its migrations.

The same tables, column names, constraints and indexes as the SQLite schema:
the very statements of `_schema` (`_schema.TABLES`), rendered with
PostgreSQL's types (docs/ledger.md, "PostgreSQL"; `POSTGRES_TYPES`): ``text`` for ids and
names, ``bigint`` for counts, tokens, nano-USD and credits, ``smallint`` 0/1
for flags (so the audit's ``SUM(...)`` queries read both stores alike) and
``timestamptz`` for times.

The version lives in ``loopengine_schema`` as on SQLite. Each migration is one
transaction that first takes a transaction-scoped advisory lock
(``pg_advisory_xact_lock``) keyed by the schema the tables live in: however
many processes and hosts open a fresh database at the same moment, one of
them applies each step and the others find its row once the lock is theirs.
The lock goes with the transaction, so a process killed mid-migration leaves
neither a half-applied step nor a held lock.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Final

import psycopg

from loopengine._errors import LedgerError
from loopengine.persistence._schema import (
    PARENT_COLUMN,
    PAUSE_SEAL,
    SCHEMA_TABLE,
    SEGMENT_TABLE,
    TABLES,
    USAGE_VECTOR,
    Migration,
    check_not_newer,
    history,
    refuse_clash,
)

__all__ = ["MIGRATIONS", "SCHEMA_VERSION", "column_type", "migrate", "schema_version"]

POSTGRES_TYPES: Final = {"INTEGER": "bigint", "FLAG": "smallint", "TIME": "timestamptz",
                         "SERIAL": "bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY"}
"""PostgreSQL's spelling of the tables' types (`_schema.history`)."""

# A wrap-up turn's attempts (docs/guards.md) have the phase ``wrap_up``: where
# SQLite rebuilds the table, PostgreSQL replaces the constraint.
_WRAP_UP_PHASE = (
    "ALTER TABLE attempts DROP CONSTRAINT attempts_phase_check, ADD CONSTRAINT "
    "attempts_phase_check CHECK (phase IN ('turn', 'repair', 'continuation', 'fallback', "
    "'wrap_up'))",
)

# Every attempt updates its invocation's totals twice (its dispatch, its
# settle). PostgreSQL writes each update as a new version of the row; with
# room on the row's page it is a heap-only tuple (HOT: no index touched, the
# old version pruned in place), and without it the row moves and all three
# indexes of invocations get a new entry. A half-full page keeps that room
# (measured: the totals' update cost 36-43 µs per attempt at the default
# fillfactor of 100, 15-20 µs at 50). Pages written before keep their layout.
_INVOCATION_ROOM = ("ALTER TABLE invocations SET (fillfactor = 50)",)

MIGRATIONS = history(POSTGRES_TYPES, _WRAP_UP_PHASE, _INVOCATION_ROOM)
"""The schema's history, oldest first: the SQLite history's steps, step for step."""

SCHEMA_VERSION = MIGRATIONS[-1].version
"""The version this code writes and reads."""

_COLUMN_KINDS: Final = {
    column: kind for statement in (*TABLES, *PARENT_COLUMN, *USAGE_VECTOR, *SEGMENT_TABLE,
                                                 *PAUSE_SEAL)
    for column, kind in re.findall(r"(?:^\s+|ADD COLUMN )(\w+) (TEXT|\{\w+\})", statement,
                                   re.MULTILINE)}
"""Each column of ``invocations``, ``attempts`` (those the later migrations add
too) and ``segments``: ``TEXT`` or its type's placeholder."""

# Two keys for the advisory lock: this constant ("le" "dg" in ASCII) and the
# schema's name hashed, so that ledgers in other schemas migrate independently.
_LOCK_CLASS: Final = 0x6C65_6467


def column_type(column: str) -> str:
    """The PostgreSQL type of a column of ``invocations``, ``attempts`` or ``segments``."""
    kind = _COLUMN_KINDS[column]
    return "text" if kind == "TEXT" else POSTGRES_TYPES[kind.strip("{}")]


def schema_version(conn: psycopg.Connection[tuple[object, ...]]) -> int | None:
    """The applied schema version in the connection's current schema, or None when
    it holds no ledger."""
    found = conn.execute(
        "SELECT 1 FROM pg_tables WHERE schemaname = current_schema() AND tablename = %s",
        (SCHEMA_TABLE,),
    ).fetchone()
    if found is None:
        return None
    row = conn.execute(f"SELECT MAX(version) FROM {SCHEMA_TABLE}").fetchone()
    return int(str(row[0])) if row and row[0] is not None else 0


def migrate(
    conn: psycopg.Connection[tuple[object, ...]],
    *,
    schema: str | None,
    name: str,
    migrations: Sequence[Migration] = MIGRATIONS,
) -> int:
    """Create the schema if needed and apply every migration it lacks, each in one
    transaction under the advisory lock.

    ``conn`` must be idle, not in autocommit mode, with its ``search_path`` naming
    ``schema`` when one is given (the tables go in its current schema).

    Args:
        conn: The connection to migrate with.
        schema: The schema to create if it is missing (None: the current one).
        name: How to name the database in error messages.
        migrations: The schema history (the real one unless a test says otherwise).

    Returns:
        The schema version after migrating.

    Raises:
        LedgerError: the schema holds tables named like the ledger's without being
            one, or a schema newer than this code, or a migration failed (it is
            then rolled back entirely).
        psycopg.Error: the server failed otherwise (the connection was lost).
    """
    known = migrations[-1].version if migrations else 0
    with conn.transaction():
        version = schema_version(conn)
    check_not_newer(name, version, known)
    if version == known:
        return version
    for migration in migrations:
        version = _apply(conn, migration, schema, name)
        check_not_newer(name, version, known)
    return version if version is not None else 0


def _apply(conn: psycopg.Connection[tuple[object, ...]], migration: Migration,
           schema: str | None, name: str) -> int:
    """Apply one step unless it is there already; return the version after it."""
    try:
        with conn.transaction():
            if schema is not None:
                conn.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))",
                             (_LOCK_CLASS, schema))
                conn.execute(psycopg.sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(
                    psycopg.sql.Identifier(schema)))
            else:
                conn.execute("SELECT pg_advisory_xact_lock(%s, hashtext(current_schema()))",
                             (_LOCK_CLASS,))
            version = schema_version(conn)
            if version is None:
                refuse_clash(name, conn.execute(
                    "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() "
                    "AND tablename IN ('invocations', 'attempts')").fetchall())
                conn.execute(f"CREATE TABLE {SCHEMA_TABLE} (version integer PRIMARY KEY, "
                             "name text NOT NULL, applied_at timestamptz NOT NULL)")
                version = 0
            if version >= migration.version:
                return version
            for statement in migration.statements:
                conn.execute(statement)
            conn.execute(
                f"INSERT INTO {SCHEMA_TABLE} (version, name, applied_at) "
                "VALUES (%s, %s, now())", (migration.version, migration.name))
            return migration.version
    except psycopg.DatabaseError as error:
        if isinstance(error, psycopg.OperationalError):
            raise  # the connection, not the step: the caller says so
        raise LedgerError(f"{name}: migration {migration.version} ({migration.name}) failed "
                          f"and was rolled back: {error}") from error
