"""`PostgresLedger`: the attempt ledger on a PostgreSQL server, for runs on many hosts.

The calls, the queue and the group commit are `ThreadedLedger`'s, the rules
the planner's; this file renders PostgreSQL's statements and runs them on
the writer thread's one connection (`PostgresWriter`): a batch's rows of
each kind in one statement (one JSON parameter), all of them in one round
trip, then a commit with ``synchronous_commit`` on. Many processes and hosts
write one database: each invocation's rows are written by the ledger that
started it, totals are increments (``column = column + ...``) and nothing is
cached that another process could change. A lost connection is connected
again, and what it carried replayed once it is known not to have committed
(`ThreadedLedger`, `PostgresWriter.committed`; docs/ledger.md).
"""

from __future__ import annotations

import json
import math
import os
import select
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

import anyio.to_thread

from loopengine import _validate
from loopengine._errors import ConfigError, LedgerError
from loopengine.persistence import _planner
from loopengine.persistence._ops import check_arguments
from loopengine.persistence._protocol import DEFAULT_MAX_RETAINED_ATTEMPTS
from loopengine.persistence._qmark import QmarkConnection
from loopengine.persistence._threaded import Call, ThreadedLedger, Writer

if TYPE_CHECKING:
    import psycopg

__all__ = ["APPLICATION_NAME", "SESSION_TIMES", "PostgresLedger", "server_words"]

APPLICATION_NAME: Final = "loopengine-ledger"
"""The ``application_name`` of the ledger's connections (seen in ``pg_stat_activity``)."""

# Every statement the writer runs finds its rows by key (an invocation's id,
# an attempt's invocation and ordinal). The planner does not know how many
# rows a batch's JSON holds, and while `attempts` has no statistics (a young
# ledger) it takes the table for a small one: it settled a batch by scanning
# every attempt row (8-10 ms for 50 settles beside 20,000 rows, growing with
# the table) instead of 50 lookups in the primary key (2 ms). On the writer's
# own connections only, a scan is the last resort.
_WRITER_PLANS: Final = "SET enable_seqscan = off"

SESSION_TIMES: Final = ("SET TimeZone = 'UTC'", "SET DateStyle = 'ISO, YMD'")
"""How a connection to the ledger's server reads and writes times, whatever the
server's, database's or role's defaults: in UTC, and as ISO text, the only
style psycopg parses (a database set to ``DateStyle = 'SQL, DMY'`` sends
``29/03/2026 05:30:00 UTC``, which it cannot read)."""

_UNAVAILABLE: Final = ("08", "53", "57", "58")
"""SQLSTATE classes that mean the server cannot serve for now, whatever is asked
(the connection, its resources, an operator's intervention, the system), so
the writes wait for it instead of failing (`PostgresWriter.lost`)."""

_TCP_CHECKS: Final[dict[str, Callable[[float], int]]] = {
    "keepalives": lambda timeout: 1,
    "keepalives_idle": lambda timeout: max(1, math.ceil(timeout / 3)),
    "keepalives_interval": lambda timeout: max(1, math.ceil(timeout / 9)),
    "keepalives_count": lambda timeout: 3,
    "tcp_user_timeout": lambda timeout: max(1000, math.ceil(timeout * 1000)),
}
"""libpq's TCP settings of the ledger's connections, from ``connect_timeout``
(ignored on a Unix socket)."""
_CANCELED: Final = "57014"
"""A statement cancelled (a ``statement_timeout``): the same write would be
cancelled again, so it fails instead of waiting."""


class PostgresLedger(ThreadedLedger):
    """The attempt ledger on a PostgreSQL server (docs/ledger.md, "PostgreSQL").

    Constructing it does no I/O: it connects, creates and migrates its schema
    (once, however many processes start at the same moment) and starts its
    writer thread on first use or on `open`. Use it as an async context
    manager (``async with``), as a plain one (``with``: it opens at once,
    blocking, as `SQLiteLedger` does), or call `aclose` (or `close`) to commit
    what is queued and let go of the server; a ledger still open when the
    interpreter exits is closed then. Many concurrent runs, from one or
    several event loops (asyncio or trio), may share one ledger; open one per
    process (a forked copy refuses every call).

    Durability follows the `Ledger` contract, with ``synchronous_commit`` on
    for every connection: a dispatch, a served settle and an invocation's end
    are committed when the call returns; a start or an unserved settle is
    committed with the next durable write or within ``linger`` seconds. A
    write the ledger refuses (an unknown or ended invocation, an attempt
    settled twice) raises `LedgerError` from the call when it is durable,
    else from that invocation's next durable call. A lost connection (a
    terminated session, a restart, a failover) refuses nothing: the writer
    connects again and replays what it carried, unless it had committed
    (docs/ledger.md, "A lost connection").

    Args:
        dsn: A libpq connection string or ``postgresql://`` URL.
        schema: The schema that holds the tables (created if missing); None:
            the connection's current schema (normally ``public``).
        max_retained_attempts: Attempt rows kept per invocation; later attempts
            only increase ``attempt_count`` and set ``incomplete`` (R07).
        linger: Seconds a deferred write waits at most to share a durable
            write's commit before it is committed on its own (0: never waits).
        max_batch: The most writes one transaction carries.
        connect_timeout: Seconds each try to connect waits; also how long
            `close` waits for a server that cannot be reached before it gives
            up on the writes still queued.

    Raises:
        ConfigError: an argument is invalid (``.field`` names it).
        LedgerError: psycopg is not installed (the ``postgres`` extra).
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
    ) -> None:
        if not isinstance(dsn, str):
            raise ConfigError("dsn", f"must be a connection string, got {type(dsn).__name__}")
        if schema is not None:
            # A NUL (or another control character) would fail at the first
            # connection as a LedgerError; PostgreSQL names hold 63 bytes.
            _validate.recorded_name("schema", schema, max_length=63)
        check_arguments(max_retained_attempts=max_retained_attempts, max_batch=max_batch,
                        seconds={"linger": linger, "connect_timeout": connect_timeout})
        try:
            import psycopg
        except ImportError as error:
            raise LedgerError("PostgresLedger needs psycopg 3: "
                              "pip install 'loopengine-core[postgres]'") from error
        try:
            params = psycopg.conninfo.conninfo_to_dict(dsn)
        except psycopg.ProgrammingError as error:
            raise ConfigError("dsn", "is not a PostgreSQL connection string: "
                                     f"{str(error).strip()}") from None
        self.dsn = dsn
        """The connection string (it may hold a password: it is never printed)."""
        self.schema = schema
        """The schema of the tables, or None for the connection's current one."""
        self.name = _describe_server(params, schema)
        """The server, database and schema, for messages (never the password)."""
        self._setup(self.name, max_retained_attempts, linger, max_batch,
                    give_up=float(connect_timeout))
        self._connect_timeout = float(connect_timeout)
        self._params = params
        self._opening = threading.Lock()
        """Held while opening and closing: one of them at a time."""

    # -- opening and closing ------------------------------------------------------------

    async def open(self) -> None:
        """Connect, create or migrate the schema, and start the writer (once).

        Raises:
            LedgerError: the server cannot be reached, the schema holds tables
                that are not a ledger's or is newer than this code, or the
                ledger is closed.
        """
        if self._writer is None:
            await anyio.to_thread.run_sync(self._open_now)

    async def _open(self) -> None:
        await self.open()

    def _open_now(self) -> None:
        with self._opening:
            if self._closed:
                raise LedgerError(f"{self.name}: the ledger is closed")
            if self._writer is not None:
                return
            import psycopg

            from loopengine.persistence import _postgres_schema

            # The migration's own connection, outside the writer, so that a
            # server that cannot be reached is reported with its own words.
            try:
                conn = self._connect()
            except psycopg.Error as error:
                raise LedgerError(f"{self.name}: cannot connect: {server_words(error)}") from error
            try:
                _postgres_schema.migrate(conn, schema=self.schema, name=self.name)
            except psycopg.Error as error:
                raise LedgerError(f"{self.name}: cannot open the ledger: "
                                  f"{server_words(error)}") from error
            finally:
                conn.close()
            self._pid = os.getpid()  # a ledger made before a fork opens in the child
            self._start(self._new_writer())

    def _new_writer(self) -> PostgresWriter:
        import psycopg

        writer = PostgresWriter(self)
        try:
            writer.begin()
        except psycopg.Error as error:
            raise LedgerError(f"{self.name}: cannot connect: {server_words(error)}") from error
        return writer

    def _connect(self) -> psycopg.Connection[tuple[Any, ...]]:
        """A new connection to the server, set up as every one of the ledger's is
        (durable commits, ``read committed`` whatever the database's default,
        UTC, the ledger's schema): the migration's, the writer's.

        Raises:
            psycopg.Error: the server cannot be reached, or refused a setting.
        """
        import psycopg
        from psycopg import sql

        args: dict[str, Any] = {"application_name": APPLICATION_NAME,
                                "connect_timeout": max(1, math.ceil(self._connect_timeout))}
        # A server that vanished from the network without closing the session
        # (a failover's old address, a dropped route) would hold a statement
        # until the system's TCP timeout, many minutes: TCP keepalives and a
        # bound on unacknowledged data find it within about connect_timeout,
        # so the writer reconnects. The DSN's own settings win.
        for name, value in _TCP_CHECKS.items():
            if name not in self._params:
                args[name] = value(self._connect_timeout)
        conn = psycopg.connect(self.dsn, **args)
        try:
            conn.execute("SET synchronous_commit = on")
            # What the transactions are written for: a statement that waited
            # for a row lock (an account's, a run's) reads what its holder
            # committed. A DBA's repeatable read or serializable default would
            # fail each transaction that waited instead.
            conn.execute("SET default_transaction_isolation = 'read committed'")
            for setting in SESSION_TIMES:
                conn.execute(setting)
            if self.schema is not None:
                conn.execute(sql.SQL("SET search_path = {}").format(sql.Identifier(self.schema)))
            conn.commit()
        except BaseException:
            conn.close()
            raise
        return conn

    def close(self) -> None:
        """Commit what is queued, stop the writer and let go of the server.

        Blocks until the writer is done; from async code prefer `aclose`.
        Closing twice is harmless.
        """
        if self._pid != os.getpid():
            super().close()  # a forked copy (`_opening` may have been copied held)
            return
        # Holding `_opening`: a close waits for an open under way, and an open
        # after it finds the ledger closed.
        with self._opening:
            super().close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open" if self._writer else "not opened"
        return f"PostgresLedger({self.name!r}, {state})"


class PostgresWriter(Writer):
    """The writer: a `_planner.Store` on one connection of its own, running the
    statements its ledger rendered (`_statement`): each kind of row for the
    whole batch in one statement, all of them in one round trip (a pipeline),
    then the commit.

    A lost connection is closed (`lost`); the writer thread connects again
    and asks whether a transaction lost during its commit committed
    (`committed`) before it replays it.
    """

    def __init__(self, ledger: PostgresLedger) -> None:
        import psycopg

        super().__init__(ledger.name, ledger.max_retained_attempts)
        self.errors = (psycopg.Error, OverflowError, TypeError, ValueError)
        self._ledger = ledger
        self._sql = {kind: _statement(kind) for kind in _planner.ROW_COLUMNS}
        self._conn: psycopg.Connection[tuple[Any, ...]] | None = None
        self._xid: int | None = None
        """The open transaction's id (`committed` asks the server about it)."""

    def qmark(self) -> QmarkConnection:
        """The connection as `QmarkConnection`."""
        return QmarkConnection(self._conn)

    def run_calls(self, calls: Sequence[Call]) -> None:
        """`Writer.run_calls`, on a new session when the server ended this one while
        it was idle: such a session is replaced before the transaction begins,
        rather than lost under it (logged, counted in ``reconnects``, the
        transaction run again).

        The server says goodbye as it ends a session (its reason, then the end
        of the stream), so only a session with something to read is asked, with
        an empty query, whether it still answers: one in steady use costs no
        round trip for it."""
        import psycopg

        conn = self._conn
        if conn is not None and not conn.closed and _readable(conn.fileno()):
            try:
                conn.execute("")
            except psycopg.Error:
                self.close()
        super().run_calls(calls)

    def forget(self) -> None:
        """In a forked child: point the copied socket at nothing, so that freeing
        the copy never ends the parent's session (libpq says goodbye on close)."""
        conn, self._conn = self._conn, None
        if conn is not None and not conn.closed:
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, conn.fileno())
            os.close(null)

    def close(self) -> None:
        """Close the connection."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    # -- the store the planner writes through -----------------------------------------

    def begin(self) -> None:
        """Make sure of a connection: the one held, else a new one
        (`PostgresLedger._connect`, with `_WRITER_PLANS`)."""
        conn = self._conn
        if conn is not None and (conn.closed or conn.broken):
            self.close()
        if self._conn is None:
            conn = self._ledger._connect()
            try:
                # Its transactions are begun by the writer (`execute`, `savepoint`):
                # psycopg's own BEGIN would cost a round trip of its own.
                conn.autocommit = True
                conn.execute(_WRITER_PLANS)
            except BaseException:
                conn.close()
                raise
            self._conn = conn

    def execute(self, batch: _planner.Batch) -> None:
        """Write the batch, each kind of row in one statement, all of them in one
        round trip (a pipeline), then check what each update changed."""
        conn = self._conn
        assert conn is not None
        planned = _planner.statements(batch)
        self._xid = None
        if not planned:
            return
        # One round trip (the pipeline's one sync, as it ends): the BEGIN, the
        # transaction's id (should the connection be lost during the commit,
        # it tells whether it committed) and the statements.
        with conn.pipeline():
            conn.execute("BEGIN")
            xid = conn.execute("SELECT txid_current()")
            cursors = [conn.execute(self._sql[kind], (rows_json(rows),))
                       for kind, rows, _ in planned]
        row = xid.fetchone()
        self._xid = int(row[0]) if row else None
        for cursor, (_, rows, what) in zip(cursors, planned, strict=True):
            if what is not None:
                _planner.expect(cursor.rowcount, len(rows), what)

    def finish(self) -> None:
        """Commit (``synchronous_commit`` on: durable when it returns)."""
        assert self._conn is not None
        self._conn.commit()

    def abort(self) -> None:
        """Roll back; a connection that is lost (or will not roll back) is closed,
        and the next batch connects again."""
        import psycopg

        conn = self._conn
        if conn is None:
            return
        if not conn.broken and not conn.closed:
            try:
                conn.rollback()
                return
            except psycopg.Error:
                pass
        self.close()

    def savepoint(self, *, first: bool) -> None:
        """`Writer.savepoint` in one round trip; the first also begins the
        transaction and notes its id (`committed`)."""
        conn = self._conn
        assert conn is not None
        with conn.pipeline():
            if first:
                conn.execute("BEGIN")
                xid = conn.execute("SELECT txid_current()")
            else:
                conn.execute("RELEASE SAVEPOINT loopengine_call")
            conn.execute("SAVEPOINT loopengine_call")
        if first:
            row = xid.fetchone()
            self._xid = int(row[0]) if row else None

    def lost(self, error: BaseException) -> bool:
        """The server cannot be reached on this connection: it is gone (a
        terminated session, a restart, a network failure), the server is
        shutting down, starting or out of resources (`_UNAVAILABLE`), or it is a
        standby that cannot take writes (a failover under way). The connection
        is closed, to connect anew."""
        import psycopg

        conn = self._conn
        if conn is None:  # connecting failed
            return isinstance(error, psycopg.OperationalError)
        state = getattr(error, "sqlstate", None)
        if not (conn.broken or conn.closed or state == "25006"
                or ((state or "").startswith(_UNAVAILABLE) and state != _CANCELED)
                # libpq's own error about the session (no SQLSTATE), such as
                # "cannot exit pipeline mode while busy" as it goes
                or (state is None and isinstance(error, psycopg.OperationalError))):
            return False
        self.close()
        return True

    def committed(self, lost: _planner.Lost) -> bool | None:
        """Whether the transaction lost during its commit committed, as the server
        says of its id (``txid_status``): ``in progress`` (the old session is
        still finishing) is asked again later; an id the server has never seen
        (a standby promoted without it) did not; one too old to know is read
        from the batch's rows (`Writer.evidence`)."""
        import psycopg

        xid = self._xid
        conn = self._conn
        assert conn is not None
        if xid is not None:
            try:
                row = conn.execute("SELECT txid_status(%s)", (xid,)).fetchone()
            except psycopg.errors.InvalidParameterValue:
                return False  # "in the future": this server never had it
            status = row[0] if row else None
            if status == "in progress":
                return None
            if status is not None:
                return bool(status == "committed")
        return self.evidence(lost.batch)

    def isolates(self, error: BaseException) -> bool:
        """A write that failed is worth retrying alone, unless the connection is gone
        (then nothing more can be written on it)."""
        conn = self._conn
        return conn is not None and not conn.broken and not conn.closed


def _readable(fd: int) -> bool:
    """Whether ``fd`` has something to read (or has ended), without waiting."""
    if hasattr(select, "poll"):
        poll = select.poll()
        poll.register(fd, select.POLLIN)
        return bool(poll.poll(0))
    return bool(select.select([fd], [], [], 0)[0])  # Windows (no poll; any socket number)


def rows_json(rows: Sequence[Sequence[Any]]) -> str:
    """``rows`` as the JSON the statements read (`_statement`). A value JSON cannot
    carry (NaN, an object) raises here, and one its column refuses (an integer
    past 64 bits, a NUL in text) fails its statement: either way the write
    fails alone once the planner retries the batch write by write."""
    return json.dumps(rows, separators=(",", ":"), allow_nan=False)


def _statement(kind: str) -> str:
    """The statement that writes every row of ``kind`` at once (`_planner.many_rows`),
    its one parameter the rows as a JSON array of arrays (`rows_json`)."""
    from loopengine.persistence._postgres_schema import column_type

    def cast(column: str) -> str:
        if kind == "add" and column != "id":
            return "bigint"  # a change to a total
        return "text" if column.startswith("expect_") else column_type(column)

    # One JSON text for all the rows, not an array parameter per column: the
    # json module encodes a batch in a third of the CPU psycopg takes to adapt
    # its values one by one (1.4 against 4.5 ms for 500 settles), and the
    # writer's CPU, shared with the event loop, is what limits it under many
    # concurrent runs. One row costs what plain parameters do.
    values = ", ".join(f"(e ->> {n})::{cast(c)} AS {c}"
                       for n, c in enumerate(_planner.ROW_COLUMNS[kind]))
    return _planner.many_rows(
        kind, f"(SELECT {values} FROM jsonb_array_elements(%s::jsonb) AS e) AS v", "GREATEST")


def server_words(error: BaseException) -> str:
    """What the server (or libpq) said, on one line: libpq breaks a message over
    lines (``Connection refused`` then a tab and ``Is the server running...``),
    which a one-line error (and the CLI, which escapes them) would show as
    ``\\x0a\\x09``."""
    return " ".join(str(error).split())


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
