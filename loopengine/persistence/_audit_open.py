"""Opening a ledger for the audit: a SQLite file read-only, or a PostgreSQL
ledger in one read-only snapshot (loopengine.persistence._audit_postgres).

The queries (loopengine.persistence._audit) read either through the same
calls: ``execute(sql, parameters)`` with ``?`` placeholders, rows read by
position or by column name, times as the ledger's ISO-8601 UTC text.
"""

from __future__ import annotations

import os
import sqlite3
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TypeAlias

from loopengine._errors import LedgerError
from loopengine.persistence._audit_postgres import PostgresReader, is_postgres_url
from loopengine.persistence._schema import SCHEMA_TABLE, check_not_newer, later_view

__all__ = ["AuditConnection", "describe_value", "has_table", "open_ledger", "stream"]

AuditConnection: TypeAlias = sqlite3.Connection | PostgresReader
"""What `open_ledger` returns and every audit query reads."""

def open_ledger(path: str | os.PathLike[str], *, schema: str | None = None) -> AuditConnection:
    """Open a ledger file read-only, after checking that it is one this code reads.

    The file is opened with SQLite's ``mode=ro``, so nothing is written to it,
    and it is never created. Every query of the connection reads one
    snapshot (one read transaction, ended by ``close``), whatever is written
    meanwhile. A user who may write the file and its directory
    reads it with SQLite's locks (SQLite may leave an empty -wal and -shm
    beside it, as any reader does). A file this user cannot write (another
    user's file, a read-only directory or medium) whose write-ahead log is
    absent is opened ``immutable=1``: SQLite then reads it without the
    shared-memory index it could not create. When a write-ahead log is
    present and cannot be read, the error says why and what to do.

    A ``postgresql://`` URL instead of a path reads a PostgreSQL ledger, every
    query in one ``REPEATABLE READ, READ ONLY`` transaction, so the answers
    come from one snapshot that concurrent writes do not change.

    Args:
        path: The database file, or a ``postgresql://`` URL.
        schema: PostgreSQL only: the schema the ledger is in (the server's
            ``search_path`` by default).

    Returns:
        A read-only connection; its rows are read by position or by column name.

    Raises:
        LedgerError: the path is not a readable file, the file is not a SQLite
            database or not a loopengine ledger, has a schema newer than this
            code, or cannot be read by this user (the message says why).
    """
    if is_postgres_url(path):
        return PostgresReader.open(str(path), schema=schema)
    if schema is not None:
        raise LedgerError("--schema names a PostgreSQL schema; a SQLite ledger has none")
    file = _existing_file(path)
    uri, wal_blocks = _read_only_uri(file)
    try:
        conn = sqlite3.connect(uri, uri=True)
    except sqlite3.Error as error:  # pragma: no cover - connect defers opening the file
        raise LedgerError(f"{file} cannot be opened: {error}") from error
    try:
        _check_ledger(conn, file, wal_blocks)
    except BaseException:
        conn.close()
        raise
    conn.row_factory = sqlite3.Row
    # One read transaction for every query the connection runs: they all read
    # the snapshot its first query takes, as on PostgreSQL, so runs written
    # meanwhile (a live ledger) never make two answers disagree (an account's
    # balance and its journal, a total and its rows).
    conn.execute("BEGIN")
    return conn


def _existing_file(path: str | os.PathLike[str]) -> Path:
    try:
        text = os.fspath(path)
    except TypeError:
        raise LedgerError(f"a ledger path must be a str or a path, got {path!r}") from None
    if not isinstance(text, str):
        raise LedgerError(f"a ledger path must be a str or a path, got {path!r}")
    if not text:
        raise LedgerError("no ledger file given (the path is empty)")
    if "\0" in text:
        raise LedgerError(f"{text!r} cannot be a ledger file: the path contains a NUL byte")
    file = Path(text)
    try:
        status = file.stat()
    except FileNotFoundError:
        raise LedgerError(f"{file}: no such file") from None
    except OSError as error:
        raise LedgerError(f"{file}: cannot be read: {error.strerror or error}") from None
    if stat.S_ISDIR(status.st_mode):
        raise LedgerError(f"{file}: not a file (it is a directory)")
    if not stat.S_ISREG(status.st_mode):
        # A FIFO or a device would block SQLite or be read as garbage.
        raise LedgerError(f"{file}: not a file (not a regular file)")
    if not os.access(file, os.R_OK):
        raise LedgerError(f"{file}: this user cannot read it (permission denied)")
    return file


def _read_only_uri(file: Path) -> tuple[str, str | None]:
    """The URI to open ``file`` with, and why a write-ahead log may block reading it."""
    real = file.resolve()
    uri = real.as_uri() + "?mode=ro"
    if os.access(real, os.W_OK) and os.access(real.parent, os.W_OK):
        # This user could write the file: SQLite's ordinary read-only opening
        # (with its locks, so a writer may be working meanwhile) works.
        return uri, None
    wal, shm = Path(f"{real}-wal"), Path(f"{real}-shm")
    try:
        wal_size: int | None = wal.stat().st_size
    except FileNotFoundError:
        wal_size = None
    except OSError:
        wal_size = -1
    if wal_size is None or (wal_size == 0 and not os.path.lexists(shm)):
        # No write-ahead log (or an empty one that no writer has open, for a
        # writer keeps its -shm beside it): everything committed is in the
        # file itself, and immutable=1 reads it without creating -wal/-shm.
        return uri + "&immutable=1", None
    why = (f"it has a write-ahead log ({wal.name}: a process is writing the ledger, or "
           "one stopped before it was checkpointed), and reading that log needs its "
           f"shared-memory index ({shm.name}), which this user can neither open nor create "
           f"in {real.parent}. Audit it as a user who can write that directory, once every "
           "process writing it has closed it, or from a copy its owner makes with "
           "`sqlite3 LEDGER \".backup COPY\"`")
    return uri, why


def _check_ledger(conn: sqlite3.Connection, file: Path, wal_blocks: str | None) -> None:
    # A hand-made file cannot make reading it run SQL functions of its choosing.
    conn.execute("PRAGMA trusted_schema = OFF")
    try:
        kinds = {str(name): str(kind) for name, kind in conn.execute(
            "SELECT name, type FROM sqlite_master WHERE type IN ('table', 'view')")}
    except sqlite3.Error as error:
        code = getattr(error, "sqlite_errorname", "")
        if code in ("SQLITE_NOTADB", "SQLITE_CORRUPT"):
            raise LedgerError(f"{file} is not a SQLite database ({error})") from None
        if wal_blocks is not None:
            raise LedgerError(f"{file} cannot be read by this user: {wal_blocks}") from None
        raise LedgerError(f"{file} cannot be read: {error}") from None
    try:
        check_not_newer(str(file), _schema_version(conn, file, kinds.get(SCHEMA_TABLE)))
        # A ledger older than the later migrations lacks their columns: it is
        # read through a temporary view of each table that supplies them (the
        # file itself is never written), so every query reads one schema.
        for table in ("invocations", "attempts"):
            kind = kinds.get(table)
            if kind not in (None, "table"):
                raise LedgerError(f"{file} is not a loopengine ledger: {table} is a {kind}, "
                                  "not a table")
            have = {str(row[1]) for row in conn.execute(f"PRAGMA table_info({table})")}
            view = later_view(str(file), table, have, f"main.{table}")
            if view is not None:
                conn.execute(view)
    except sqlite3.Error as error:
        raise LedgerError(f"{file} is not a loopengine ledger ({error})") from None


def _schema_version(conn: sqlite3.Connection, file: Path, kind: str | None) -> int:
    if kind is None:
        raise LedgerError(f"{file} is not a loopengine ledger (it has no {SCHEMA_TABLE} "
                          "table)")
    if kind != "table":
        raise LedgerError(f"{file} is not a loopengine ledger: {SCHEMA_TABLE} is a {kind}, "
                          "not a table")
    bad = conn.execute(f"SELECT version FROM {SCHEMA_TABLE} "
                       "WHERE typeof(version) NOT IN ('integer', 'null') LIMIT 1").fetchone()
    if bad is not None:
        raise LedgerError(f"{file} is not a loopengine ledger: its {SCHEMA_TABLE} table holds "
                          f"the version {describe_value(bad[0])}, not an integer")
    row = conn.execute(f"SELECT MAX(version) FROM {SCHEMA_TABLE}").fetchone()
    return int(row[0]) if row[0] is not None else 0



# -- values --------------------------------------------------------------------------


def describe_value(value: object) -> str:
    """A stored value as error messages name it: its SQLite type and a short repr."""
    if value is None:
        return "NULL"
    if isinstance(value, bytes):
        shown = value[:16].hex().upper()
        return f"a BLOB (X'{shown}{'…' if len(value) > 16 else ''}')"
    if isinstance(value, float):
        return f"a real number ({value!r})"
    if isinstance(value, int):
        return f"an integer ({value})"
    text = repr(value)
    return f"text ({text[:40]}{'…' if len(text) > 40 else ''})"


def stream(conn: AuditConnection, query: str, parameters: Sequence[Any] = ()) -> Iterator[Any]:
    """The rows of a query of many rows (an export), read as they are used, never
    all held at once: SQLite's cursor reads so; PostgreSQL's rows come through a
    server-side cursor (`PostgresReader.stream`)."""
    if isinstance(conn, sqlite3.Connection):
        return iter(conn.execute(query, parameters))
    return conn.stream(query, parameters)


def has_table(conn: AuditConnection, name: str) -> bool:
    """Whether the ledger has table ``name`` (an older ledger lacks the accounts)."""
    if isinstance(conn, sqlite3.Connection):
        return conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
                            (name,)).fetchone() is not None
    return conn.has_table(name)
