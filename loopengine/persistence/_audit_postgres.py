"""The audit of a PostgreSQL ledger: one consistent snapshot, read by the same
queries as a SQLite file.

``loopengine audit ... --db postgresql://...`` copies the ledger's rows, in one
``REPEATABLE READ, READ ONLY`` transaction (a snapshot no concurrent write
changes), into an in-memory SQLite database built by the SQLite schema's own
migrations, with times as the ledger's ISO-8601 UTC text. Every audit query
then runs unchanged on it, so both stores give the same answers from one set
of queries. The copy holds the whole ledger: for a very large one, audit a
replica or an export of the period.
"""

from __future__ import annotations

import sqlite3
from datetime import datetime
from typing import Any

from loopengine._errors import LedgerError
from loopengine.persistence._schema import (
    ATTEMPT_COLUMNS,
    INVOCATION_COLUMNS,
    SCHEMA_VERSION,
    format_time,
    migrate,
)

__all__ = ["display_name", "is_postgres_url", "snapshot"]

_ACCOUNT_COLUMNS = ("account", "granted", "spent", "reserved", "updated_at")
_ENTRY_COLUMNS = ("id", "account", "at", "kind", "credits", "invocation_id", "note",
                  "expires_at", "credits_per_usd", "credit_quantum")
_TABLES = (("invocations", INVOCATION_COLUMNS), ("attempts", ATTEMPT_COLUMNS),
           ("accounts", _ACCOUNT_COLUMNS), ("account_entries", _ENTRY_COLUMNS))


def is_postgres_url(db: object) -> bool:
    """Whether ``--db`` names a PostgreSQL server rather than a SQLite file."""
    return isinstance(db, str) and db.startswith(("postgresql://", "postgres://"))


def display_name(db: object) -> str:
    """How to name ``--db`` in a message: a URL without its password."""
    if not is_postgres_url(db):
        return str(db)
    try:
        import psycopg

        from loopengine.persistence._postgres import _describe_server

        return _describe_server(psycopg.conninfo.conninfo_to_dict(str(db)), None)
    except Exception:  # not importable, or not a connection string
        return "the PostgreSQL ledger"


def snapshot(dsn: str) -> sqlite3.Connection:
    """The ledger at ``dsn``, copied into an in-memory SQLite database.

    Returns:
        A connection whose rows are `sqlite3.Row`, as `open_ledger` returns.

    Raises:
        LedgerError: psycopg is not installed, the server cannot be reached, the
            database holds no ledger or one newer than this code.
    """
    try:
        import psycopg
    except ImportError:
        raise LedgerError("auditing a PostgreSQL ledger needs psycopg 3: "
                          "pip install 'loopengine-core[postgres]'") from None
    from loopengine.persistence._postgres import _describe_server

    try:
        name = _describe_server(psycopg.conninfo.conninfo_to_dict(dsn), None)
    except psycopg.ProgrammingError as error:
        raise LedgerError(f"--db is not a PostgreSQL connection URL: {error}") from None
    try:
        pg = psycopg.connect(dsn, connect_timeout=10, application_name="loopengine-audit")
    except psycopg.Error as error:
        raise LedgerError(f"{name}: cannot connect: {error}") from None
    memory = sqlite3.connect(":memory:", isolation_level=None)
    try:
        pg.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        version = _version(pg)
        if version is None:
            raise LedgerError(f"{name} holds no loopengine ledger (no loopengine_schema table)")
        if version > SCHEMA_VERSION:
            raise LedgerError(f"{name} has ledger schema version {version}, newer than this "
                              f"loopengine understands ({SCHEMA_VERSION}); upgrade loopengine")
        migrate(memory, path=name)
        for table, columns in _TABLES:
            if version < 3 and table.startswith("account"):
                continue
            rows = pg.execute(f"SELECT {', '.join(columns)} FROM {table}").fetchall()
            memory.execute("BEGIN")
            memory.executemany(
                f"INSERT INTO {table} ({', '.join(columns)}) "
                f"VALUES ({', '.join('?' * len(columns))})",
                [tuple(_plain(value) for value in row) for row in rows])
            memory.execute("COMMIT")
        pg.rollback()
    except psycopg.Error as error:
        memory.close()
        raise LedgerError(f"{name}: cannot read the ledger: {error}") from None
    except BaseException:
        memory.close()
        raise
    finally:
        pg.close()
    memory.row_factory = sqlite3.Row
    return memory


def _version(pg: Any) -> int | None:
    found = pg.execute("SELECT to_regclass('loopengine_schema')").fetchone()
    if found is None or found[0] is None:
        return None
    row = pg.execute("SELECT MAX(version) FROM loopengine_schema").fetchone()
    return int(row[0]) if row and row[0] is not None else 0


def _plain(value: Any) -> Any:
    """A PostgreSQL value as the SQLite ledger stores it (times as ISO text)."""
    if isinstance(value, datetime):
        return format_time(value)
    return value
