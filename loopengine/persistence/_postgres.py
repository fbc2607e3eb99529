"""`PostgresLedger`: the attempt ledger on a PostgreSQL server, for runs on many hosts.

How it writes:

* The calls, the queue and the group commit are `PipedLedger`'s (`_piped`),
  the ones `SQLiteLedger` writes through, and the ledger's rules are the
  planner's (`_planner`); this file renders PostgreSQL's statements, and
  `_postgres_writer` runs them.
* One writer, by default a child process of the ledger's own (else a
  thread), owns a connection from a psycopg pool. It takes everything queued
  into one transaction, one statement per kind of row for all of them (their
  rows as one JSON parameter) in one round trip, and commits with
  ``synchronous_commit`` on: under many concurrent runs one round trip and
  one WAL flush carry the writes of all of them (group commit). The calls
  wait for the commit on their own event loops; the event loop never waits
  on the server outside an ``await``.
* Many processes and hosts write one database: each invocation's rows are
  written by the ledger that started it, totals are increments
  (``column = column + ...``), and nothing is cached that another process
  could change, so nothing is lost or counted twice and no two writers wait
  on each other's rows.
* A lost connection fails the writes of the batch it carried with
  `LedgerError` (so a dispatch that was not committed is never sent), and the
  next batch takes a fresh connection from the pool, checked first.
"""

from __future__ import annotations

import functools
import math
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

import anyio.to_thread

from loopengine._errors import LedgerError
from loopengine.persistence import _planner, _postgres_writer
from loopengine.persistence._ops import check_arguments
from loopengine.persistence._piped import _START_TIMEOUT, PipedLedger, WriterKind, WriterProcess
from loopengine.persistence._postgres_writer import APPLICATION_NAME, PostgresWriter
from loopengine.persistence._protocol import DEFAULT_MAX_RETAINED_ATTEMPTS

if TYPE_CHECKING:
    import psycopg
    from psycopg import sql

__all__ = ["ACCOUNTS_APPLICATION_NAME", "APPLICATION_NAME", "PostgresLedger", "borrow", "connect",
           "give_back"]

_WRITER_FILE: Final = os.path.abspath(_postgres_writer.__file__)

# Every statement the writer runs finds its rows by key (an invocation's id,
# an attempt's invocation and ordinal). The planner does not know how many
# rows a batch's JSON holds, and while `attempts` has no statistics (a young
# ledger) it takes the table for a small one: it settled a batch by scanning
# every attempt row (8-10 ms for 50 settles beside 20,000 rows, growing with
# the table) instead of 50 lookups in the primary key (2 ms). On the writer's
# own connections only, a scan is the last resort.
_WRITER_PLANS: Final = "SET enable_seqscan = off"


class PostgresLedger(PipedLedger):
    """The attempt ledger on a PostgreSQL server (DESIGN.md §7b).

    Constructing it does no I/O: it connects, creates and migrates its schema
    (once, however many processes start at the same moment) and starts its
    writer on first use or on `open`. Use it as an async context manager, or
    call `aclose` (or `close`) to commit what is queued and let go of the
    server; a ledger still open when the interpreter exits is closed then.
    Many concurrent runs, from one or several event loops (asyncio or trio),
    may share one ledger; open one per process.

    Durability follows the `Ledger` contract, with ``synchronous_commit`` on
    for every connection: a dispatch, a served settle and an invocation's end
    are committed when the call returns (for `begin_dispatch`, when its
    receipt's wait returns); a start or an unserved settle is committed with
    the next durable write or within ``linger`` seconds. A write the ledger
    refuses (an unknown or ended invocation, an attempt settled twice) or
    cannot make (the connection was lost) raises `LedgerError` from the call
    when it is durable, else from that invocation's next durable call.

    Args:
        dsn: A libpq connection string or ``postgresql://`` URL.
        schema: The schema that holds the tables (created if missing); None:
            the connection's current schema (normally ``public``).
        max_retained_attempts: Attempt rows kept per invocation; later attempts
            only increase ``attempt_count`` and set ``incomplete`` (R07).
        linger: Seconds a deferred write waits at most to share a durable
            write's commit before it is committed on its own (0: never waits).
        max_batch: The most writes one transaction carries.
        connect_timeout: Seconds to wait for a connection (opening, and after
            one was lost) before the writes waiting on it fail.
        writer: ``"process"``: a child process writes (it needs a runnable
            ``sys.executable`` that can import psycopg, and POSIX pipes);
            ``"thread"``: a thread of this process writes; ``"auto"`` (the
            default): a process where one can be started, else a thread.

    Raises:
        LedgerError: an argument is invalid, or psycopg is not installed (the
            ``postgres`` extra).
    """

    def __init__(
        self,
        dsn: str,
        *,
        schema: str | None = None,
        max_retained_attempts: int = DEFAULT_MAX_RETAINED_ATTEMPTS,
        linger: float = 0.5,
        max_batch: int = 20_000,
        connect_timeout: float = 30.0,
        writer: WriterKind = "auto",
    ) -> None:
        if not isinstance(dsn, str):
            raise LedgerError(f"dsn must be a connection string, got {type(dsn).__name__}")
        if schema is not None and (not isinstance(schema, str) or not schema):
            raise LedgerError(f"schema must be a non-empty name or None, got {schema!r}")
        check_arguments(max_retained_attempts=max_retained_attempts, max_batch=max_batch,
                        seconds={"linger": linger, "connect_timeout": connect_timeout})
        if writer not in ("auto", "process", "thread"):
            raise LedgerError(f"writer must be 'auto', 'process' or 'thread', got {writer!r}")
        try:
            import psycopg
            import psycopg_pool  # noqa: F401  # only checked for here
        except ImportError as error:
            raise LedgerError("PostgresLedger needs psycopg 3 and psycopg-pool: "
                              "pip install 'loopengine-core[postgres]'") from error
        try:
            params = psycopg.conninfo.conninfo_to_dict(dsn)
        except psycopg.ProgrammingError as error:
            raise LedgerError(f"dsn is not a PostgreSQL connection string: {error}") from None
        self.dsn = dsn
        """The connection string (it may hold a password: it is never printed)."""
        self.schema = schema
        """The schema of the tables, or None for the connection's current one."""
        self.name = _describe_server(params, schema)
        """The server, database and schema, for messages (never the password)."""
        self._setup(self.name, max_retained_attempts, linger)
        self._max_batch = max_batch
        self._connect_timeout = float(connect_timeout)
        self._writer_kind: WriterKind = writer
        self._opening = threading.Lock()
        """Held while opening and closing: one of them at a time."""
        self._opened = False
        self._kept = _KeptConnections()
        """Connections `borrow` keeps between transactions."""

    # -- opening and closing ------------------------------------------------------------

    async def open(self) -> None:
        """Connect, create or migrate the schema, and start the writer (once).

        Raises:
            LedgerError: the server cannot be reached, the schema holds tables
                that are not a ledger's or is newer than this code, the writer
                cannot start, or the ledger is closed.
        """
        if not self._opened:
            await anyio.to_thread.run_sync(self._open_now)

    async def _open(self) -> None:
        await self.open()

    def _open_now(self) -> None:
        with self._opening:
            if self._closed:
                raise LedgerError(f"{self.name}: the ledger is closed")
            if self._opened:
                return
            import psycopg

            from loopengine.persistence import _postgres_schema

            # The migration's own connection, outside the writer, so that a
            # server that cannot be reached is reported with its own words.
            try:
                conn = connect(self)
            except psycopg.Error as error:
                raise LedgerError(f"{self.name}: cannot connect: {error}") from error
            try:
                _postgres_schema.migrate(conn, schema=self.schema, name=self.name)
            except psycopg.Error as error:
                raise LedgerError(f"{self.name}: cannot open the ledger: {error}") from error
            finally:
                conn.close()
            settings = _postgres_writer.Settings(
                self.dsn, self.name, self._max_retained, self._max_batch,
                self._connect_timeout, self._connect_args(),
                [*(statement.as_string() for statement in self._setup_statements()),
                 _WRITER_PLANS],
                {kind: _statement(kind).as_string() for kind in _KINDS})
            self._start(self._writer_kind, WriterProcess(
                _WRITER_FILE, site=True, secret=settings.encode(),
                timeout=self._connect_timeout + _START_TIMEOUT),
                functools.partial(_thread_writer, settings), self._max_batch)
            self._opened = True

    def _connect_args(self) -> dict[str, Any]:
        return {"application_name": APPLICATION_NAME,
                "connect_timeout": max(1, math.ceil(self._connect_timeout))}

    def _setup_statements(self) -> list[sql.SQL | sql.Composed]:
        """Settings of every connection: durable commits, UTC, the ledger's schema."""
        from psycopg import sql

        settings: list[sql.SQL | sql.Composed] = [sql.SQL("SET synchronous_commit = on"),
                                                  sql.SQL("SET TimeZone = 'UTC'")]
        if self.schema is not None:
            settings.append(sql.SQL("SET search_path = {}").format(sql.Identifier(self.schema)))
        return settings

    def _configure(self, conn: psycopg.Connection[tuple[Any, ...]]) -> None:
        """Apply `_setup_statements` to ``conn`` (and commit)."""
        for statement in self._setup_statements():
            conn.execute(statement)
        conn.commit()

    def close(self) -> None:
        """Commit what is queued, stop the writer and let go of the server.

        Blocks until the writer is done; from async code prefer `aclose`.
        Closing twice is harmless.
        """
        # Holding `_opening`: a close waits for an open under way, and an open
        # after it finds the ledger closed.
        with self._opening:
            super().close()
        self._kept.close()

    async def __aenter__(self) -> PostgresLedger:
        await self.open()
        return self

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open" if self._opened else "not opened"
        return f"PostgresLedger({self.name!r}, {state})"


ACCOUNTS_APPLICATION_NAME: Final = "loopengine-accounts"
"""How the credit accounts' connections (`borrow`) show in ``pg_stat_activity``;
the writer's and the migration's show as `APPLICATION_NAME`."""


def connect(ledger: PostgresLedger, *,
            application_name: str = APPLICATION_NAME) -> psycopg.Connection[tuple[Any, ...]]:
    """A new connection to ``ledger``'s server, set up as the writer's are
    (durable commits, UTC, the ledger's schema), for this package's other users
    of the server (the migration, the credit accounts) to use and close.

    Raises:
        psycopg.Error: the server cannot be reached, or refused a setting.
    """
    import psycopg

    conn = psycopg.connect(ledger.dsn, **{**ledger._connect_args(),
                                          "application_name": application_name})
    try:
        ledger._configure(conn)
    except BaseException:
        conn.close()
        raise
    return conn


IDLE_KEPT: Final = 2
"""Connections `borrow` keeps open between transactions, per ledger."""


def borrow(ledger: PostgresLedger) -> psycopg.Connection[tuple[Any, ...]]:
    """A connection to ``ledger``'s server, set up as `connect` sets one up, for
    one transaction of this package's other users of the server (the credit
    accounts), in any thread; `give_back` it once done.

    Opening a connection costs the server a new backend process and both sides
    several milliseconds, which an admission would pay twice per run: so the
    connection is one kept from an earlier transaction when one of them still
    answers (checked with an empty query), else a new one.

    Raises:
        psycopg.Error: no connection could be made.
    """
    conn = ledger._kept.take()
    if conn is None:
        conn = connect(ledger, application_name=ACCOUNTS_APPLICATION_NAME)
    return conn


def give_back(ledger: PostgresLedger, conn: psycopg.Connection[tuple[Any, ...]], *,
              reusable: bool) -> None:
    """Keep a `borrow` ed connection for the next transaction (up to `IDLE_KEPT`),
    if ``reusable`` (its transaction ended without an error), idle, and the
    ledger is not closed; else close it."""
    if not (reusable and ledger._kept.keep(conn)):
        conn.close()


class _KeptConnections:
    """The idle connections of one process, shared by its threads: a forked
    child starts with none (its parent's sessions are neither used nor closed
    there)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[psycopg.Connection[tuple[Any, ...]]] = []
        self._pid = os.getpid()
        self._closed = False

    def _mine(self) -> list[psycopg.Connection[tuple[Any, ...]]]:
        # Called holding `_lock`.
        if self._pid != os.getpid():
            self._idle, self._pid = [], os.getpid()
        return self._idle

    def take(self) -> psycopg.Connection[tuple[Any, ...]] | None:
        """A kept connection that still answers, or None; dead ones are closed."""
        from psycopg import pq
        from psycopg_pool import ConnectionPool

        while True:
            with self._lock:
                idle = self._mine()
                if not idle:
                    return None
                conn = idle.pop()
            try:
                if conn.info.transaction_status != pq.TransactionStatus.IDLE:
                    raise ValueError("not idle")
                ConnectionPool.check_connection(conn)
            except Exception:  # gone (the server restarted, the session was ended)
                conn.close()
                continue
            return conn

    def keep(self, conn: psycopg.Connection[tuple[Any, ...]]) -> bool:
        """Keep ``conn`` if it is open and idle, there is room and `close` has not
        been called; say whether it was kept."""
        from psycopg import pq

        if conn.closed or conn.info.transaction_status != pq.TransactionStatus.IDLE:
            return False
        with self._lock:
            idle = self._mine()
            if self._closed or len(idle) >= IDLE_KEPT:
                return False
            idle.append(conn)
            return True

    def close(self) -> None:
        """Close this process's kept connections, and keep none from now on."""
        with self._lock:
            idle, self._idle = self._mine(), []
            self._closed = True
        for conn in idle:
            conn.close()


def _thread_writer(settings: _postgres_writer.Settings) -> PostgresWriter:
    """The writer of a ledger that writes from a thread, opened."""
    writer = PostgresWriter(settings)
    writer.open()
    return writer


_KINDS: Final = ("start", "dispatch", "settle", "add", "end")


def _statement(kind: str) -> sql.Composable:
    """The statement that writes every row of ``kind`` at once (`_planner.Batch` row
    order), its one parameter the rows as a JSON array of arrays (`_rows_json`)."""
    from psycopg import sql  # noqa: F811  # imported for typing only above

    from loopengine.persistence._postgres_schema import column_type

    def source(columns: Sequence[str], types: Sequence[str]) -> sql.Composable:
        # One JSON text for all the rows, not an array parameter per column:
        # the json module encodes a batch in a third of the CPU psycopg takes
        # to adapt its values one by one (1.4 against 4.5 ms for 500 settles),
        # and the writer's CPU, shared with the event loop, is what limits it
        # under many concurrent runs. One row costs what plain parameters do.
        values = sql.SQL(", ").join(
            sql.SQL(f"(e ->> {n})::{t} AS {{}}").format(sql.Identifier(c))
            for n, (c, t) in enumerate(zip(columns, types, strict=True)))
        return sql.SQL("(SELECT {} FROM jsonb_array_elements(%s::jsonb) AS e) AS v").format(
            values)

    def sets(columns: Sequence[str], value: str = "v.{0}") -> sql.Composable:
        return sql.SQL(", ").join(sql.SQL(f"{c} = {value.format(c)}") for c in columns)

    columns: tuple[str, ...]
    if kind in ("start", "dispatch"):
        table, columns = (("invocations", _planner.INVOCATION_INSERT) if kind == "start"
                          else ("attempts", _planner.ATTEMPT_INSERT))
        return sql.SQL("INSERT INTO {} ({}) SELECT * FROM {}").format(
            sql.Identifier(table), sql.SQL(", ").join(map(sql.Identifier, columns)),
            source(columns, [column_type(c) for c in columns]))
    if kind == "settle":
        columns = (*_planner.ATTEMPT_SETTLE, "invocation_id", "ordinal")
        return sql.SQL("UPDATE attempts AS a SET {} FROM {} WHERE a.invocation_id = "
                       "v.invocation_id AND a.ordinal = v.ordinal AND a.outcome = 'dispatched'"
                       ).format(sets(_planner.ATTEMPT_SETTLE),
                                source(columns, [column_type(c) for c in columns]))
    if kind == "add":
        # Increments, never absolute values: right whoever else wrote the row.
        columns = (*_planner.DELTA_COLUMNS, "id")
        totals = [f"{c} = GREATEST(i.{c}, v.{c})" if n == _planner.INCOMPLETE
                  else f"{c} = i.{c} + v.{c}" for n, c in enumerate(_planner.DELTA_COLUMNS)]
        return sql.SQL("UPDATE invocations AS i SET {} FROM {} WHERE i.id = v.id").format(
            sql.SQL(", ".join(totals)),
            source(columns, ["bigint"] * len(_planner.DELTA_COLUMNS) + ["text"]))
    assert kind == "end"
    columns = (*_planner.END_SET, "id")
    return sql.SQL("UPDATE invocations AS i SET {} FROM {} WHERE i.id = v.id").format(
        sets(_planner.END_SET), source(columns, [column_type(c) for c in columns]))


def _describe_server(params: dict[str, Any], schema: str | None) -> str:
    """``postgresql ledger user@host:port/dbname[.schema]``, without a password."""
    host = str(params.get("host") or os.environ.get("PGHOST") or "localhost")
    port = params.get("port") or os.environ.get("PGPORT")
    user = params.get("user") or os.environ.get("PGUSER")
    dbname = params.get("dbname") or os.environ.get("PGDATABASE") or user or ""
    where = f"{user}@{host}" if user else host
    if port:
        where += f":{port}"
    return f"postgresql ledger {where}/{dbname}" + (f" (schema {schema})" if schema else "")
