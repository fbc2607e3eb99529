"""Reading a PostgreSQL ledger for the audit: the same queries as on SQLite,
run on the server in one read-only snapshot.

``loopengine audit ... --db postgresql://...`` opens one connection and one
``REPEATABLE READ, READ ONLY`` transaction, so every query of a command sees
the same snapshot whatever is written meanwhile. `PostgresReader` speaks the
audit's side of the ``sqlite3`` interface: ``execute(sql, parameters)`` with
``?`` placeholders, rows read by position or by column name, and values as the
SQLite ledger stores them (times as ISO-8601 UTC text, sums as integers), so
the queries in loopengine.persistence._audit are written once for both stores.
psycopg is imported only when a PostgreSQL ledger is opened.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from decimal import Decimal
from typing import Any

from loopengine._errors import LedgerError
from loopengine.persistence._qmark import percent_s
from loopengine.persistence._schema import check_not_newer, format_time, later_select

__all__ = ["PostgresReader", "display_name", "is_postgres_url"]


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


class _Row:
    """One result row, read as `sqlite3.Row` reads: by position, by column name,
    unpacked, or turned into a dict."""

    __slots__ = ("_index", "_values")

    def __init__(self, values: tuple[Any, ...], index: dict[str, int]) -> None:
        self._values = values
        self._index = index

    def __getitem__(self, key: int | str) -> Any:
        return self._values[self._index[key] if isinstance(key, str) else key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def keys(self) -> list[str]:
        """The column names, in order."""
        return list(self._index)


def _plain(value: Any) -> Any:
    """A PostgreSQL value as the SQLite ledger holds it: times as the ledger's
    ISO text, and a whole ``numeric`` (what ``SUM(bigint)`` returns) as an int."""
    if isinstance(value, datetime):
        return format_time(value)
    if isinstance(value, Decimal) and value == value.to_integral_value():
        return int(value)
    return value


def _row_factory(cursor: Any) -> Callable[[Sequence[Any]], _Row]:
    index = {column.name: i for i, column in enumerate(cursor.description or ())}

    def make(values: Sequence[Any]) -> _Row:
        return _Row(tuple(_plain(v) for v in values), index)

    return make


class PostgresReader:
    """A PostgreSQL ledger opened for the audit (`open`): one connection, one
    read-only snapshot, closed with `close`."""

    def __init__(self, connection: Any, name: str) -> None:
        self._pg = connection
        self.name = name
        """How messages name the server (no password)."""
        self._streams = 0
        """Server-side cursors opened so far (`stream`), which name them."""
        self._later: dict[str, str] = {}
        """The query of each table that lacks later columns (`_supply_later_columns`)."""

    @classmethod
    def open(cls, dsn: str, *, schema: str | None = None) -> PostgresReader:
        """Connect to ``dsn`` and begin the snapshot, after checking that the
        database (in ``schema``, or on the server's ``search_path``) holds a
        ledger this code reads.

        Raises:
            LedgerError: psycopg is not installed, ``dsn`` is not a connection
                URL, the server cannot be reached, or the database holds no
                ledger or one newer than this code.
        """
        try:
            import psycopg
            from psycopg import sql
        except ImportError:
            raise LedgerError("auditing a PostgreSQL ledger needs psycopg 3: "
                              "pip install 'loopengine-core[postgres]'") from None
        from loopengine.persistence._postgres import SESSION_TIMES, _describe_server, server_words

        try:
            name = _describe_server(psycopg.conninfo.conninfo_to_dict(dsn), schema)
        except psycopg.ProgrammingError as error:
            raise LedgerError("--db is not a PostgreSQL connection URL: "
                              f"{server_words(error)}") from None
        try:
            pg = psycopg.connect(dsn, connect_timeout=10, application_name="loopengine-audit")
        except psycopg.Error as error:
            raise LedgerError(f"{name}: cannot connect: {server_words(error)}") from None
        reader = cls(pg, name)
        try:
            for setting in SESSION_TIMES:
                reader.execute(setting)
            if schema is not None:
                reader.execute(sql.SQL("SET search_path TO {}")
                               .format(sql.Identifier(schema)).as_string(pg))
            if not reader.has_table("loopengine_schema"):
                where = f" in schema {schema}" if schema is not None else ""
                raise LedgerError(f"{name} holds no loopengine ledger{where} (no "
                                  "loopengine_schema table)")
            row = reader.execute("SELECT MAX(version) FROM loopengine_schema").fetchone()
            check_not_newer(name, int(row[0]) if row and row[0] is not None else 0)
            reader._supply_later_columns()
            pg.commit()
            # The snapshot every query of the command reads.
            reader.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        except BaseException:
            pg.close()
            raise
        return reader

    def _supply_later_columns(self) -> None:
        """A ledger older than the later migrations lacks their columns: each query
        reads it through a common table expression of each such table that
        supplies them (`_reading`), so every query reads one schema, as on
        SQLite. Nothing is created on the server, not even a temporary view: an
        auditor's read-only role, or a standby server, refuses that."""
        from psycopg import sql

        row = self.execute("SELECT current_schema()").fetchone()
        where = row[0] if row else None
        for table in ("invocations", "attempts"):
            source = sql.SQL("{}.{}").format(sql.Identifier(str(where)), sql.Identifier(table))
            select = later_select(self.name, table, self.columns(table),
                                  source.as_string(self._pg))
            if select is not None:
                self._later[table] = select

    def _reading(self, query: str) -> str:
        """``query`` as it runs: with ``?`` placeholders as psycopg's, and, on an
        older ledger, the tables that lack later columns named by common table
        expressions that supply them (not materialized: the planner reads
        through them to the table and its indexes)."""
        if self._later and query.startswith(("SELECT ", "WITH ")):
            tables = ", ".join(f"{table} AS NOT MATERIALIZED ({select})"
                               for table, select in self._later.items())
            if query.startswith("WITH RECURSIVE "):
                query = f"WITH RECURSIVE {tables}, {query.removeprefix('WITH RECURSIVE ')}"
            elif query.startswith("WITH "):
                query = f"WITH {tables}, {query.removeprefix('WITH ')}"
            else:
                query = f"WITH {tables} {query}"
        return percent_s(query)

    def execute(self, query: str, parameters: Sequence[Any] = ()) -> Any:
        """Run one of the audit's queries (``?`` placeholders) in the snapshot.

        Returns:
            A cursor: iterate it, or ``fetchone()`` / ``fetchall()``.

        Raises:
            LedgerError: the server refused or failed the query.
        """
        import psycopg

        try:
            cursor = self._pg.cursor(row_factory=_row_factory)
            return cursor.execute(self._reading(query), tuple(parameters))
        except (psycopg.Error, ValueError) as error:  # ValueError: a NUL in a parameter
            raise self._refused(error) from None

    def stream(self, query: str, parameters: Sequence[Any] = ()) -> Iterator[_Row]:
        """Run a query of many rows (an export) in the snapshot, yielding its rows as
        they come: read through a server-side cursor, a thousand at a time, so a
        ledger of millions of attempts is never held in memory at once.

        Raises:
            LedgerError: the server refused or failed the query.
        """
        import psycopg

        try:
            # A name of its own: two exports may be read at once.
            self._streams += 1
            cursor = self._pg.cursor(name=f"loopengine_audit_{self._streams}",
                                     row_factory=_row_factory)
            cursor.itersize = 1000
            with cursor:
                cursor.execute(self._reading(query), tuple(parameters))
                yield from cursor
        except (psycopg.Error, ValueError) as error:  # ValueError: a NUL in a parameter
            raise self._refused(error) from None

    def _refused(self, error: Exception) -> LedgerError:
        """The error of a query the server refused or failed (or psycopg, for a NUL
        in a parameter), naming the server without its password."""
        from loopengine.persistence._postgres import server_words

        return LedgerError(f"{self.name}: cannot read the ledger: {server_words(error)}")

    def has_table(self, name: str) -> bool:
        """Whether ``name`` is a table on the snapshot's search path."""
        row = self.execute("SELECT to_regclass(?) IS NOT NULL", (name,)).fetchone()
        return bool(row[0])

    def columns(self, table: str) -> set[str]:
        """The columns of ``table`` in the ledger's schema (empty: no such table)."""
        return {str(row[0]) for row in self.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_schema = "
            "current_schema() AND table_name = ?", (table,))}

    def close(self) -> None:
        """End the snapshot and close the connection."""
        self._pg.close()
