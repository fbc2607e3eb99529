"""`PostgresLedger`: the attempt ledger on a PostgreSQL server, for runs on many hosts.

How it writes:

* The ledger's rules are the planner's (`_planner`), the ones `SQLiteLedger`
  writes under; this file supplies PostgreSQL's statements and transaction
  (`_Store`) and the queue in front of them.
* One writer thread per ledger owns a connection from a psycopg pool. A call
  numbers its write and queues it. A write that must be durable when the
  call returns (a dispatch, a served settle, an end) wakes the writer; the
  writer takes everything queued into one transaction, one statement per
  kind of row for all of them (their rows as one JSON parameter), and
  commits with ``synchronous_commit`` on: under many concurrent runs one
  round trip and one WAL flush carry the writes of all of them (group
  commit). The calls
  wait for the commit on their own event loops; the event loop never waits
  on the server outside an ``await``.
* A deferred write (a start, a settle of nothing served) travels with the
  next durable write, or is committed on its own after ``linger`` seconds.
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

import asyncio
import atexit
import functools
import heapq
import itertools
import json
import math
import os
import threading
import time
import weakref
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final

import anyio.to_thread

from loopengine._errors import LedgerError
from loopengine.persistence import _planner
from loopengine.persistence._ops import check_arguments, dispatch_op, end_op, settle_op, start_op
from loopengine.persistence._planner import FLUSH, Op
from loopengine.persistence._protocol import DEFAULT_MAX_RETAINED_ATTEMPTS
from loopengine.persistence._records import (
    AttemptDispatch,
    AttemptSettle,
    InvocationEnd,
    InvocationStart,
)
from loopengine.persistence._waiting import CommitWaits, Receipt, release
from loopengine.persistence._waiting import Waiter as _Waiter

if TYPE_CHECKING:
    import psycopg
    import psycopg_pool
    from psycopg import sql

__all__ = ["PostgresLedger"]

APPLICATION_NAME: Final = "loopengine-ledger"
"""The ``application_name`` of the ledger's connections (seen in ``pg_stat_activity``)."""


class PostgresLedger(CommitWaits):
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
    ) -> None:
        if not isinstance(dsn, str):
            raise LedgerError(f"dsn must be a connection string, got {type(dsn).__name__}")
        if schema is not None and (not isinstance(schema, str) or not schema):
            raise LedgerError(f"schema must be a non-empty name or None, got {schema!r}")
        check_arguments(max_retained_attempts=max_retained_attempts, max_batch=max_batch,
                        seconds={"linger": linger, "connect_timeout": connect_timeout})
        try:
            import psycopg
            import psycopg_pool  # noqa: F401  # only checked for here
        except ImportError as error:
            raise LedgerError("PostgresLedger needs psycopg 3 and psycopg-pool: "
                              "pip install 'loopengine[postgres]'") from error
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
        self._max_retained = max_retained_attempts
        self._linger = float(linger)
        self._max_batch = max_batch
        self._connect_timeout = float(connect_timeout)
        self._lock = threading.Lock()
        """Guards everything below."""
        self._wakeup = threading.Condition(self._lock)
        """Wakes the writer: a durable write queued, the ledger closing."""
        self._opening = threading.Lock()
        self._pid = os.getpid()
        """The process that opened it (set again by `open`)."""
        self._opened = False
        self._closed = False
        self._stopping = False
        self._broken: str | None = None
        """Why no write can be made any more (the writer failed), or None."""
        self._queue: list[Op] = []
        """Writes numbered and not yet taken by the writer, in call order."""
        self._urgent = False
        """A durable write is in the queue."""
        self._deferred_since = 0.0
        self._next_id = 0
        self._done = 0
        """Every write numbered up to this is committed (or refused)."""
        self._refused: dict[int, str] = {}
        """Durable writes refused, by number, until their caller reads it."""
        self._waiters: list[tuple[int, int, _Waiter]] = []
        """A heap of ``(write number, sequence, waiter)``."""
        self._sequence = itertools.count()
        self._pool: psycopg_pool.ConnectionPool[psycopg.Connection[tuple[Any, ...]]] | None = None
        self._store: _Store | None = None
        self._planner: _planner.Planner | None = None
        self._writer: threading.Thread | None = None

    # -- opening and closing ------------------------------------------------------------

    async def open(self) -> None:
        """Connect, create or migrate the schema, and start the writer (once).

        Raises:
            LedgerError: the server cannot be reached, the schema holds tables
                that are not a ledger's or is newer than this code, or the
                ledger is closed.
        """
        if not self._opened:
            await anyio.to_thread.run_sync(self._open)

    def _open(self) -> None:
        with self._opening:
            if self._closed:
                raise LedgerError(f"{self.name}: the ledger is closed")
            if self._opened:
                return
            import psycopg
            import psycopg_pool

            from loopengine.persistence import _postgres_schema

            # A ledger made before a fork and first used after it is the
            # child's: its process is the one that opens it.
            self._pid = os.getpid()

            # The migration's own connection, outside the pool, so that a server
            # that cannot be reached is reported with its own words.
            try:
                conn = psycopg.connect(self.dsn, **self._connect_args())
            except psycopg.Error as error:
                raise LedgerError(f"{self.name}: cannot connect: {error}") from error
            try:
                self._configure(conn)
                _postgres_schema.migrate(conn, schema=self.schema, name=self.name)
            except psycopg.Error as error:
                raise LedgerError(f"{self.name}: cannot open the ledger: {error}") from error
            finally:
                conn.close()
            pool: psycopg_pool.ConnectionPool[psycopg.Connection[tuple[Any, ...]]] = (
                psycopg_pool.ConnectionPool(
                    self.dsn, min_size=1, max_size=2, open=False, kwargs=self._connect_args(),
                    configure=self._configure, check=psycopg_pool.ConnectionPool.check_connection,
                    timeout=self._connect_timeout, name=APPLICATION_NAME))
            pool.open(wait=False)
            self._pool = pool
            self._store = _Store(self.name, pool, self._connect_timeout)
            self._planner = _planner.Planner(self._store, self._max_retained)
            self._writer = threading.Thread(target=self._write, daemon=True,
                                            name=f"loopengine-ledger:{self.name}")
            self._writer.start()
            _open_ledgers.add(self)
            self._opened = True

    def _connect_args(self) -> dict[str, Any]:
        return {"application_name": APPLICATION_NAME,
                "connect_timeout": max(1, math.ceil(self._connect_timeout))}

    def _configure(self, conn: psycopg.Connection[tuple[Any, ...]]) -> None:
        """Settings of every connection: durable commits, UTC, the ledger's schema."""
        from psycopg import sql

        settings: list[sql.SQL | sql.Composed] = [sql.SQL("SET synchronous_commit = on"),
                                                  sql.SQL("SET TimeZone = 'UTC'")]
        if self.schema is not None:
            settings.append(sql.SQL("SET search_path = {}").format(sql.Identifier(self.schema)))
        for statement in settings:
            conn.execute(statement)
        conn.commit()

    def close(self) -> None:
        """Commit what is queued, stop the writer and close the connections.

        Blocks until the writer is done; from async code prefer `aclose`.
        Closing twice is harmless.
        """
        # Holding `_opening` throughout: a second close returns only once the
        # first has committed everything, as the first does.
        with self._opening:
            with self._lock:
                already = self._stopping
                self._closed = self._stopping = True
                self._wakeup.notify()
            writer = self._writer
            if already or writer is None or os.getpid() != self._pid:
                return  # (a forked copy: the process that opened it closes it)
            writer.join()
            with self._lock:
                self._break("the ledger is closed")
            assert self._pool is not None
            self._pool.close()
            _open_ledgers.discard(self)

    async def aclose(self) -> None:
        """`close` in a worker thread, so the event loop keeps running meanwhile."""
        await anyio.to_thread.run_sync(self.close)

    async def __aenter__(self) -> PostgresLedger:
        await self.open()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open" if self._opened else "not opened"
        return f"PostgresLedger({self.name!r}, {state})"

    # -- the Ledger protocol ---------------------------------------------------------

    @property
    def max_retained_attempts(self) -> int:
        """Attempt rows kept per invocation (R07)."""
        return self._max_retained

    async def start_invocation(self, record: InvocationStart) -> None:
        """Record a new invocation as ``running`` (committed with the next durable write).

        Raises:
            LedgerError: the ledger cannot be opened, or is closed.
        """
        await self.open()
        self._queue_op(start_op(record), durable=False)

    async def dispatch_attempt(self, record: AttemptDispatch) -> None:
        """Record an attempt as ``dispatched``; committed when this returns.

        Raises:
            LedgerError: the row could not be written (or an earlier deferred
                write of this invocation failed); the request must not be sent.
        """
        await self.open()
        await self._wait(self._queue_op(dispatch_op(record), durable=True))

    def begin_dispatch(self, record: AttemptDispatch) -> Receipt:
        """Queue an attempt's ``dispatched`` row and return at once.

        The request may go on the wire once the receipt's ``wait()`` returns;
        it raises `LedgerError` where `dispatch_attempt` would have.

        Raises:
            LedgerError: the ledger is closed.
        """
        if not self._opened:
            # Nothing has opened it yet: the receipt's wait opens it, then writes.
            return Receipt(functools.partial(self.dispatch_attempt, record))
        return Receipt(functools.partial(
            self._wait, self._queue_op(dispatch_op(record), durable=True)))

    async def settle_attempt(self, record: AttemptSettle) -> None:
        """Settle an attempt and add it to the invocation's totals, in one transaction.

        A settle that carries what the provider served (`AttemptSettle.served`)
        is committed when this returns; any other travels with the next
        durable write (or after ``linger`` seconds).

        Raises:
            LedgerError: the ledger is closed, or the served settle (or an
                earlier deferred write of this invocation) could not be written.
        """
        op = settle_op(record)
        await self.open()
        if record.served:
            await self._wait(self._queue_op(op, durable=True))
        else:
            self._queue_op(op, durable=False)

    async def end_invocation(self, record: InvocationEnd) -> None:
        """Settle the invocation with its outcome; everything before is committed on return.

        Raises:
            LedgerError: the row could not be written, or an earlier deferred
                write of this invocation failed.
        """
        await self.open()
        await self._wait(self._queue_op(end_op(record), durable=True))

    # -- more than the protocol ------------------------------------------------------

    async def flush(self) -> None:
        """Wait until every write queued so far is committed.

        Raises:
            LedgerError: the ledger cannot be opened, or is closed.
        """
        await self.open()
        await self._wait(self._queue_op([FLUSH, 0], durable=True))

    @property
    def commits(self) -> int:
        """Transactions this ledger has committed."""
        return self._planner.commits if self._planner is not None else 0

    @property
    def writes(self) -> int:
        """Writes (starts, dispatches, settles, ends) this ledger has committed."""
        return self._planner.writes if self._planner is not None else 0

    @property
    def closed(self) -> bool:
        """True once `close` has been called (or the writer failed)."""
        return self._closed

    # -- queueing and waiting --------------------------------------------------------

    def _queue_op(self, op: Op, *, durable: bool) -> int:
        """Number ``op`` and queue it (waking the writer for a durable one)."""
        if self._opened and os.getpid() != self._pid:
            raise LedgerError(f"{self.name}: this ledger was opened in process {self._pid}; "
                              "a forked process must open its own PostgresLedger")
        with self._lock:
            if self._broken is not None:
                raise LedgerError(self._broken)
            if self._closed:
                raise LedgerError(f"{self.name}: the ledger is closed")
            self._next_id += 1
            op[1] = self._next_id
            if not self._queue:
                self._deferred_since = time.monotonic()
            self._queue.append(op)
            if durable or not self._linger:
                if not self._urgent:
                    self._urgent = True
                    self._wakeup.notify()
            elif len(self._queue) == 1:
                self._wakeup.notify()  # the writer times the linger from here
            return self._next_id

    async def _wait_for(self, number: int) -> None:
        with self._lock:
            if self._done >= number:
                return
            if self._broken is not None:
                raise LedgerError(self._broken)
            try:
                loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
            except RuntimeError:
                loop = None  # another backend (trio): woken through its token
            waiter = _Waiter(loop)
            heapq.heappush(self._waiters, (number, next(self._sequence), waiter))
        try:
            await waiter.wait()
        finally:
            with self._lock:
                waiter.gone = True
        if self._done < number:
            raise LedgerError(self._broken or f"{self.name}: the ledger is closed")

    def _report(self, done: int, refused: list[tuple[int, str]]) -> None:
        """Take in a batch's outcome and wake its waiters. Called holding `_lock`."""
        for number, message in refused:
            self._refused[number] = message
        if done > self._done:
            self._done = done
            self._release(done)

    def _break(self, reason: str) -> None:
        """No write can be made any more: fail every waiter. Called holding `_lock`."""
        if self._broken is None:
            self._broken = reason if reason.startswith(self.name) else f"{self.name}: {reason}"
            self._closed = True
        self._release(None)

    def _release(self, done: int | None) -> None:
        """Wake the waiters of writes up to ``done`` (all when None). Holding `_lock`."""
        release(self._waiters, done)

    # -- the writer thread -------------------------------------------------------------

    def _write(self) -> None:
        """Take what is queued into one transaction whenever a durable write waits
        (or a deferred one has lingered), until the ledger closes."""
        planner, store = self._planner, self._store
        assert planner is not None and store is not None
        try:
            while True:
                with self._lock:
                    while not self._urgent:
                        if self._stopping:
                            if not self._queue:
                                return
                            break
                        if not self._queue:
                            self._wakeup.wait()
                            continue
                        left = self._deferred_since + self._linger - time.monotonic()
                        if left <= 0:
                            break
                        self._wakeup.wait(left)
                    ops, self._queue, self._urgent = self._queue, [], False
                refused: list[tuple[int, str]] = []
                for start in range(0, len(ops), self._max_batch):
                    refused += planner.commit(ops[start:start + self._max_batch])
                with self._lock:
                    self._report(ops[-1][1], refused)
        except BaseException as error:
            # A bug here must not leave callers waiting forever.
            with self._lock:
                self._break(f"the ledger's writer failed: {error!r}")
            raise
        finally:
            store.release()


class _Store:
    """PostgreSQL's statements and transaction, for the planner (`_planner.Store`).

    Each kind of row is written for the whole batch by one statement over
    ``unnest`` of one array per column, whatever the number of rows, so a
    batch costs a few round trips and one commit.
    """

    def __init__(self, name: str,
                 pool: psycopg_pool.ConnectionPool[psycopg.Connection[tuple[Any, ...]]],
                 timeout: float) -> None:
        import psycopg

        self.name = name
        self.errors: tuple[type[BaseException], ...] = (psycopg.Error, OverflowError,
                                                        TypeError, ValueError)
        self._pool = pool
        self._timeout = timeout
        self._conn: psycopg.Connection[tuple[Any, ...]] | None = None
        # Rendered once: the same text each time lets psycopg prepare it.
        self._sql = {kind: _statement(kind).as_string() for kind in _KINDS}

    def begin(self) -> None:
        """Take a connection (the one held, or a fresh one from the pool)."""
        if self._conn is None:
            self._conn = self._pool.getconn(timeout=self._timeout)

    def load(self, invocation_id: str) -> _planner.Known | None:
        """The committed state of an invocation another ledger started (or forgotten)."""
        assert self._conn is not None
        row = self._conn.execute(
            "SELECT attempts_retained, outcome FROM invocations WHERE id = %s", (invocation_id,),
        ).fetchone()
        if row is None:
            return None
        unsettled = self._conn.execute(
            "SELECT ordinal FROM attempts WHERE invocation_id = %s AND outcome = 'dispatched'",
            (invocation_id,),
        ).fetchall()
        return _planner.Known(int(row[0]), row[1] != "running", [int(r[0]) for r in unsettled])

    def execute(self, batch: _planner.Batch) -> None:
        """Write the batch, each kind of row in one statement, all of them in one
        round trip (a pipeline), then check what each update changed.

        One round trip, not one per statement: the writer thread waits for the
        interpreter lock again after each, and while the event loop is busy
        that wait (up to the switch interval, 5 ms) is most of a statement's
        cost.
        """
        conn = self._conn
        assert conn is not None
        planned = _planner.statements(batch)
        with conn.pipeline() as pipeline:
            cursors = [conn.execute(self._sql[kind], (_rows_json(rows),))
                       for kind, rows, _ in planned]
            pipeline.sync()
        for cursor, (_, rows, what) in zip(cursors, planned, strict=True):
            if what is not None:
                _planner.expect(cursor.rowcount, len(rows), what)

    def finish(self) -> None:
        """Commit (``synchronous_commit`` on: durable when it returns)."""
        assert self._conn is not None
        self._conn.commit()

    def abort(self) -> None:
        """Roll back; a connection that is lost (or will not roll back) goes back to
        the pool, which replaces it."""
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
        self.release()

    def isolates(self, error: BaseException) -> bool:
        """A write that failed is worth retrying alone, unless the connection is gone
        (then nothing more can be written on it)."""
        import psycopg_pool

        conn = self._conn
        return (conn is not None and not conn.broken and not conn.closed
                and not isinstance(error, psycopg_pool.PoolTimeout))

    def release(self) -> None:
        """Give the connection back to the pool (it discards a broken one)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                self._pool.putconn(conn)
            except Exception:  # the pool is closing: nothing to give back to
                conn.close()


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


def _rows_json(rows: Sequence[Sequence[Any]]) -> str:
    """``rows`` as the JSON the statements read (`_statement`). A value JSON cannot
    carry (NaN, an object) raises here, and one its column refuses (an integer
    past 64 bits, a NUL in text) fails its statement: either way the write
    fails alone once the planner retries the batch write by write."""
    return json.dumps(rows, separators=(",", ":"), allow_nan=False)


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


_open_ledgers: weakref.WeakSet[PostgresLedger] = weakref.WeakSet()


@atexit.register
def _close_open_ledgers() -> None:
    # Commits what is still queued before the interpreter stops.
    for ledger in list(_open_ledgers):
        try:
            ledger.close()
        except Exception:  # exiting anyway, with nobody to report to
            pass
