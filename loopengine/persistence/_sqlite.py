"""`SQLiteLedger`: the attempt ledger in one SQLite file, written by one thread.

How it writes:

* Every write goes through a queue to one writer thread that owns the
  connection. The event loop never waits on SQLite: a call appends its record
  to the queue and, when the write must be durable before the call returns
  (an attempt's dispatch, an invocation's end), wakes the writer and awaits a
  future that the writer completes once the commit is on disk.
* The writer takes whatever is queued into one ``BEGIN IMMEDIATE``
  transaction, so under many concurrent runs one fsync carries the writes of
  all of them (group commit), and consecutive writes to one invocation
  collapse into one update of its row.
* A write that may be deferred (an invocation's start, an attempt's settle)
  does not wake the writer: it shares the commit of the next durable write,
  or is committed within ``linger`` seconds (the writer looks again by itself
  ``linger`` after each commit). A sequential run costs one commit and one
  wake-up of the writer per attempt (its dispatch, which also carries the
  previous settle), and one of each for its end.
* Checkpoints keep the WAL small: every few hundred commits the writer makes
  one itself when no durable write is waiting, so the WAL is rewritten from
  its start instead of growing; while durable writes keep arriving, a second
  thread makes them.

The file is safe for several processes at once: WAL lets readers work during
a write, ``BEGIN IMMEDIATE`` takes the write lock up front so the busy handler
(``busy_timeout``) waits for it instead of failing a half-done transaction,
and nothing here caches a row another process could change (invocation totals
are updated with ``column = column + ?``).
"""

from __future__ import annotations

import asyncio
import atexit
import os
import queue
import sqlite3
import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final

import anyio
import anyio.lowlevel
import anyio.to_thread

from loopengine._errors import LedgerError
from loopengine.persistence._protocol import DEFAULT_MAX_RETAINED_ATTEMPTS
from loopengine.persistence._records import (
    AttemptDispatch,
    AttemptSettle,
    InvocationEnd,
    InvocationStart,
)
from loopengine.persistence._schema import format_time, migrate

__all__ = ["SQLiteLedger"]

# Operation kinds on the writer's queue.
_START: Final = 0
_DISPATCH: Final = 1
_SETTLE: Final = 2
_END: Final = 3
_FLUSH: Final = 4
_STOP: Final = 5

# Deltas of one invocation within a batch, in `_ADD` column order.
_D_COUNT, _D_RETAINED, _D_INCOMPLETE = 0, 1, 2
_D_INPUT, _D_OUTPUT, _D_CACHE_READ, _D_CACHE_WRITE, _D_CACHE_WRITE_1H = 3, 4, 5, 6, 7
_D_COST, _D_PROVIDER_COST = 8, 9
_D_WIDTH = 10

_INVOCATION_INSERT = ("id", "operation", "operation_version", "provider", "model", "tenant",
                      "user_id", "feature", "correlation_id", "started_at")
_ATTEMPT_INSERT = ("invocation_id", "ordinal", "turn", "attempt", "phase", "served_by",
                   "started_at", "max_tokens", "timeout_ms", "wait_ms")
_ATTEMPT_SETTLE = ("outcome", "latency_ms", "fault", "aborted_reason", "http_status",
                   "error_code", "input_tokens", "output_tokens", "cache_read_tokens",
                   "cache_write_tokens", "cache_write_1h_tokens", "usage_approx",
                   "cost_nanousd", "charged", "price_ref", "response_id", "request_id",
                   "stop_reason")
# Increments, never absolute values: correct whoever else wrote the row.
_ADD = ("attempt_count = attempt_count + {}", "attempts_retained = attempts_retained + {}",
        "incomplete = MAX(incomplete, {})", "input_tokens = input_tokens + {}",
        "output_tokens = output_tokens + {}", "cache_read_tokens = cache_read_tokens + {}",
        "cache_write_tokens = cache_write_tokens + {}",
        "cache_write_1h_tokens = cache_write_1h_tokens + {}",
        "cost_nanousd = cost_nanousd + {}",
        "provider_cost_nanousd = provider_cost_nanousd + {}")
_END_SET = ("ended_at", "outcome", "turns", "tool_calls", "credits")

# A checkpoint is due after this many commits or writes (about 3 MiB of WAL
# on the sequential path, like SQLite's own 1,000-page autocheckpoint). The
# writer makes it itself after a commit that leaves no durable write waiting;
# past four times as many, the checkpointer's thread makes it.
_CHECKPOINT_COMMITS: Final = 256
_CHECKPOINT_WRITES: Final = 4096

# UPDATE ... FROM (3.33) lets one statement update many rows.
_UPDATE_FROM = sqlite3.sqlite_version_info >= (3, 33, 0)
_LARGEST_CHUNK = 1024
_WIDTH = {"start": len(_INVOCATION_INSERT), "dispatch": len(_ATTEMPT_INSERT),
          "settle": len(_ATTEMPT_SETTLE) + 2, "add": len(_ADD) + 1, "end": len(_END_SET) + 1}


class _Statements:
    """The SQL of each write, for one row or many rows at once.

    One statement carries all the rows of a kind because the sqlite3 module
    releases the GIL around every step: row by row (``executemany``) the
    writer would wait for the GIL once per row while the event loop holds it
    (up to the interpreter's switch interval each time), and one statement
    waits once. Statements are built for a few row counts (`_padded`), the
    rows padded with NULL keys that match nothing, so the distinct statements
    stay prepared in the connection's cache. One row, the sequential path's
    usual case, takes the plain statement and its own parameters as they are.
    """

    def __init__(self, conn: sqlite3.Connection) -> None:
        variable_limit = conn.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)
        chunk = 1
        while chunk * 2 <= min(_LARGEST_CHUNK, variable_limit // max(_WIDTH.values())):
            chunk *= 2
        self.largest = chunk if _UPDATE_FROM else 1
        self.cursor = conn.cursor()
        """The one cursor of every write (none is made per statement)."""
        self._single = {kind: _build_sql(kind, 1) for kind in _WIDTH}
        self._cache: dict[tuple[str, int], str] = {}

    def run(self, kind: str, rows: list[tuple[Any, ...]]) -> int:
        """Execute ``kind`` for every row; return the number of rows changed."""
        cursor = self.cursor
        if len(rows) == 1:
            return cursor.execute(self._single[kind], rows[0]).rowcount
        if self.largest == 1:
            return cursor.executemany(self._single[kind], rows).rowcount
        changed = 0
        width = _WIDTH[kind]
        for start in range(0, len(rows), self.largest):
            chunk = rows[start:start + self.largest]
            size = _padded(len(chunk))
            params = [value for row in chunk for value in row]
            if size > len(chunk):
                params.extend([None] * (width * (size - len(chunk))))
            key = (kind, size)
            sql = self._cache.get(key)
            if sql is None:
                sql = self._cache[key] = _build_sql(kind, size)
            changed += cursor.execute(sql, params).rowcount
        return changed


def _padded(rows: int) -> int:
    """The statement size for ``rows`` rows: four sizes per power of two (8, 10, 12,
    14, 16, 20, 24, 28, 32...), so padding stays under a quarter and the distinct
    statements few."""
    if rows <= 8:
        return rows
    step = 1 << (rows.bit_length() - 3)
    return -(-rows // step) * step


def _build_sql(kind: str, rows: int) -> str:
    """The statement writing ``rows`` rows of ``kind`` (padding rows have NULL keys)."""
    width = _WIDTH[kind]
    row = "(" + ", ".join("?" * width) + ")"
    values = ", ".join([row] * rows)
    if kind in ("start", "dispatch"):
        table, columns = (("invocations", _INVOCATION_INSERT) if kind == "start"
                          else ("attempts", _ATTEMPT_INSERT))
        if rows == 1:
            return f"INSERT INTO {table} ({', '.join(columns)}) VALUES {values}"
        return (f"INSERT INTO {table} ({', '.join(columns)}) "
                f"SELECT * FROM (VALUES {values}) WHERE column1 IS NOT NULL")
    if kind == "settle":
        if rows == 1:
            sets = ", ".join(f"{c} = ?" for c in _ATTEMPT_SETTLE)
            return (f"UPDATE attempts SET {sets} WHERE invocation_id = ? AND ordinal = ? "
                    "AND outcome = 'dispatched'")
        sets = ", ".join(f"{c} = v.column{i + 1}" for i, c in enumerate(_ATTEMPT_SETTLE))
        return (f"UPDATE attempts SET {sets} FROM (VALUES {values}) AS v "
                f"WHERE attempts.invocation_id = v.column{width - 1} "
                f"AND attempts.ordinal = v.column{width} AND attempts.outcome = 'dispatched'")
    if kind == "add":
        if rows == 1:
            return f"UPDATE invocations SET {', '.join(a.format('?') for a in _ADD)} WHERE id = ?"
        sets = ", ".join(a.format(f"v.column{i + 1}") for i, a in enumerate(_ADD))
        return (f"UPDATE invocations SET {sets} FROM (VALUES {values}) AS v "
                f"WHERE invocations.id = v.column{width}")
    assert kind == "end"
    if rows == 1:
        return f"UPDATE invocations SET {', '.join(f'{c} = ?' for c in _END_SET)} WHERE id = ?"
    sets = ", ".join(f"{c} = v.column{i + 1}" for i, c in enumerate(_END_SET))
    return (f"UPDATE invocations SET {sets} FROM (VALUES {values}) AS v "
            f"WHERE invocations.id = v.column{width}")


class _Ticket:
    """What a caller awaits for a durable write; completed in the caller's event loop.

    On asyncio (anyio's default backend) it is a bare future, woken with
    ``call_soon_threadsafe``: a durable write is awaited once per attempt, and
    this costs a fraction of an `anyio.Event` with its loop token. Elsewhere
    (trio) it is an `anyio.Event`, set through anyio's loop token.
    """

    __slots__ = ("error", "event", "future", "loop", "token")

    def __init__(self) -> None:
        self.error: LedgerError | None = None
        self.loop: asyncio.AbstractEventLoop | None
        self.future: asyncio.Future[None] | None
        self.event: anyio.Event | None
        self.token: anyio.lowlevel.EventLoopToken | None
        try:
            self.loop = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = self.future = None
            self.event = anyio.Event()
            self.token = anyio.lowlevel.current_token()
        else:
            self.future = self.loop.create_future()
            self.event = self.token = None

    async def wait(self) -> None:
        if self.future is not None:
            await self.future
        else:
            assert self.event is not None
            await self.event.wait()


_Op = tuple[int, Any, _Ticket | None]


@dataclass(slots=True)
class _Live:
    """What the writer knows of an invocation it writes (writer thread only)."""

    retained: int
    unsettled: set[int] = field(default_factory=set)
    """Retained attempts still ``dispatched``."""
    overflow: set[int] | None = field(default_factory=set)
    """Attempts past the retention cap not yet settled; None when unknown (an
    invocation started by another ledger), and then any ordinal is accepted."""
    ended: bool = False


@dataclass(slots=True)
class _Batch:
    """The rows one transaction writes, grouped by statement."""

    starts: list[tuple[Any, ...]] = field(default_factory=list)
    dispatches: list[tuple[Any, ...]] = field(default_factory=list)
    settles: list[tuple[Any, ...]] = field(default_factory=list)
    deltas: dict[str, list[int]] = field(default_factory=dict)
    ends: list[tuple[Any, ...]] = field(default_factory=list)
    touched: set[str] = field(default_factory=set)
    """Invocations whose `_Live` this batch changed (forgotten if it rolls back)."""
    done: list[_Ticket] = field(default_factory=list)
    """Tickets of the ops this batch carries (set when it commits)."""
    failed: list[tuple[_Ticket, LedgerError]] = field(default_factory=list)
    """Tickets of ops refused while planning (set whatever happens)."""
    planned: int = 0
    """Writes accepted into this batch."""


class SQLiteLedger:
    """The attempt ledger in a SQLite file (DESIGN.md §7).

    Opening creates the file if needed and migrates its schema, synchronously
    (open it at startup, not inside a busy event loop). Use it as a context
    manager (sync or async) or call `close` / `aclose` to flush and stop its
    writer thread; a ledger still open when the interpreter exits is flushed
    then. Open one per process (after any fork); many concurrent runs, from
    one or several event loops, may share it.

    Durability follows the `Ledger` contract: a dispatch and an invocation's
    end are on disk (``synchronous=FULL``) when the call returns; a start or a
    settle is committed with the next durable write or within ``linger``
    seconds, whichever comes first. A write the ledger refuses (an unknown
    invocation, an attempt settled twice) raises `LedgerError` from the call
    when it is durable, else from that invocation's next durable call.

    Args:
        path: The database file.
        max_retained_attempts: Attempt rows kept per invocation; later attempts
            only increase ``attempt_count`` and set ``incomplete`` (R07).
        busy_timeout: Seconds to wait for another process's write lock before
            a write fails.
        linger: Seconds a deferred write waits at most to share a durable
            write's commit before it is committed on its own.
        max_batch: The most writes one transaction carries.

    Raises:
        LedgerError: the file cannot be opened, is not a ledger, or has a
            schema newer than this code; or an argument is invalid.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_retained_attempts: int = DEFAULT_MAX_RETAINED_ATTEMPTS,
        busy_timeout: float = 30.0,
        linger: float = 0.5,
        max_batch: int = 20_000,
    ) -> None:
        if isinstance(max_retained_attempts, bool) or not isinstance(max_retained_attempts, int) \
                or max_retained_attempts < 1:
            raise LedgerError(
                f"max_retained_attempts must be a positive integer, got {max_retained_attempts!r}")
        for name, value in (("busy_timeout", busy_timeout), ("linger", linger)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                raise LedgerError(f"{name} must be a non-negative number of seconds, got {value!r}")
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise LedgerError(f"max_batch must be a positive integer, got {max_batch!r}")
        self.path = os.fspath(path)
        """The database file."""
        self._max_retained = max_retained_attempts
        self._busy_timeout = float(busy_timeout)
        self._linger = float(linger)
        self._max_batch = max_batch
        # The writes, in call order, taken by the writer all at once. A
        # deferred write is only appended: the writer looks again by itself at
        # the latest `linger` after its last commit. A durable write (or a
        # deferred one while the writer sleeps with no deadline) also wakes it
        # with a token on `_signal`, one token until the writer next takes.
        self._ops: list[_Op] = []
        self._urgent = False
        """`_ops` holds a durable write (or the stop): commit without lingering."""
        self._sleeping = False
        """The writer waits with no deadline: a deferred write must wake it."""
        self._signalled = False
        """A token is on `_signal` since the writer last took `_ops`."""
        self._signal: queue.SimpleQueue[None] = queue.SimpleQueue()
        # Guards `_ops` and the flags with `_closed`: nothing is queued after the stop.
        self._lock = threading.Lock()
        self._closed = False
        self._pid = os.getpid()
        self._live: dict[str, _Live] = {}
        self._statements: _Statements  # made with the connection
        self._checkpointer: _Checkpointer
        self._failed: dict[str, LedgerError] = {}
        self._commits = 0
        self._uncheckpointed = self._uncheckpointed_writes = 0
        """Commits and writes since the last checkpoint was asked for."""
        self._writes = 0
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._writer, name=f"loopengine-ledger:{self.path}", daemon=True
        )
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            self._closed = True
            error = self._startup_error
            if isinstance(error, LedgerError):
                raise error
            raise LedgerError(f"{self.path}: {error}") from error
        _open_ledgers.add(self)

    # -- the Ledger protocol ---------------------------------------------------------

    @property
    def max_retained_attempts(self) -> int:
        """Attempt rows kept per invocation (R07)."""
        return self._max_retained

    async def start_invocation(self, record: InvocationStart) -> None:
        """Record a new invocation as ``running`` (committed with the next durable write).

        Raises:
            LedgerError: the ledger is closed.
        """
        self._put(_START, record, None)

    async def dispatch_attempt(self, record: AttemptDispatch) -> None:
        """Record an attempt as ``dispatched``; durable when this returns.

        Raises:
            LedgerError: the row could not be written (or an earlier deferred
                write of this invocation failed); the request must not be sent.
        """
        await self._durable(_DISPATCH, record)

    async def settle_attempt(self, record: AttemptSettle) -> None:
        """Settle an attempt and add it to the invocation's totals, in one transaction.

        Committed with the next durable write (or after ``linger`` seconds).

        Raises:
            LedgerError: the ledger is closed.
        """
        self._put(_SETTLE, record, None)

    async def end_invocation(self, record: InvocationEnd) -> None:
        """Settle the invocation with its outcome; everything before is durable on return.

        Raises:
            LedgerError: the row could not be written, or an earlier deferred
                write of this invocation failed.
        """
        await self._durable(_END, record)

    # -- more than the protocol ------------------------------------------------------

    async def flush(self) -> None:
        """Wait until every write queued so far is committed.

        Raises:
            LedgerError: the ledger is closed.
        """
        await self._durable(_FLUSH, None)

    @property
    def commits(self) -> int:
        """Transactions this ledger has committed (one fsync each)."""
        return self._commits

    @property
    def writes(self) -> int:
        """Writes (starts, dispatches, settles, ends) this ledger has committed."""
        return self._writes

    @property
    def closed(self) -> bool:
        """True once `close` has been called (or the ledger failed to open)."""
        return self._closed

    def close(self) -> None:
        """Commit what is queued, stop the writer thread and close the file.

        Blocks until the writer is done; from async code prefer `aclose`.
        Closing twice is harmless.
        """
        with self._lock:
            if not self._closed:
                self._closed = True
                self._ops.append((_STOP, None, None))
                self._urgent = True
                self._wake_writer()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()
        _open_ledgers.discard(self)

    async def aclose(self) -> None:
        """`close` in a worker thread, so the event loop keeps running meanwhile."""
        await anyio.to_thread.run_sync(self.close)

    def __enter__(self) -> SQLiteLedger:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def __aenter__(self) -> SQLiteLedger:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"SQLiteLedger({self.path!r}, {state})"

    # -- the caller's side -----------------------------------------------------------

    def _put(self, kind: int, record: Any, ticket: _Ticket | None) -> None:
        if os.getpid() != self._pid:
            raise LedgerError(
                f"{self.path}: this ledger was opened in process {self._pid}; a forked "
                "process must open its own SQLiteLedger"
            )
        with self._lock:
            if self._closed:
                raise LedgerError(f"{self.path}: the ledger is closed")
            self._ops.append((kind, record, ticket))
            if ticket is not None:
                self._urgent = True
                self._wake_writer()
            elif self._sleeping or not self._linger:
                self._wake_writer()

    def _wake_writer(self) -> None:
        # Called holding `_lock`.
        if not self._signalled:
            self._signalled = True
            self._signal.put(None)

    async def _durable(self, kind: int, record: Any) -> None:
        ticket = _Ticket()
        self._put(kind, record, ticket)
        # Cancelling this wait does not cancel the write: it is queued and
        # will be committed; only the caller stops waiting for it.
        if ticket.future is not None:
            await ticket.future
        else:
            await ticket.wait()
        if ticket.error is not None:
            raise ticket.error

    # -- the writer thread ---------------------------------------------------------

    def _writer(self) -> None:
        try:
            conn = self._connect()
        except BaseException as error:
            self._startup_error = error
            self._ready.set()
            return
        self._ready.set()
        pending: list[_Op] = []
        checkpointer = _Checkpointer(self.path, self._busy_timeout)
        self._checkpointer = checkpointer
        try:
            self._write_loop(conn, pending)
        except BaseException as error:
            # A bug here must not leave callers waiting forever.
            self._closed = True
            failure = LedgerError(f"{self.path}: the ledger's writer failed: {error!r}")
            self._abandon(pending, failure)
            raise
        finally:
            checkpointer.stop()
            conn.close()
            self._abandon([], LedgerError(f"{self.path}: the ledger is closed"))

    def _write_loop(self, conn: sqlite3.Connection, pending: list[_Op]) -> None:
        lock, signal, linger, max_batch = self._lock, self._signal, self._linger, self._max_batch
        # Until `deadline` the writer looks at `_ops` again by itself, so a
        # deferred write needs no wake-up: after a commit, one linger long.
        deadline: float | None = None
        while True:
            with lock:
                idle = not self._ops
                self._sleeping = idle and deadline is None
            if idle:
                if deadline is None:
                    signal.get()
                else:
                    timeout = deadline - time.monotonic()
                    if timeout > 0:
                        try:
                            signal.get(timeout=timeout)
                        except queue.Empty:
                            pass
            with lock:
                taken, self._ops = self._ops, []
                urgent = self._urgent
                self._urgent = self._sleeping = self._signalled = False
            pending.extend(taken)
            if not pending:
                if deadline is not None and time.monotonic() >= deadline:
                    deadline = None
                continue
            if deadline is None:
                # Woken from its sleep by a deferred write: hold it one linger.
                deadline = time.monotonic() + linger
            if urgent or len(pending) >= max_batch or time.monotonic() >= deadline:
                stop = pending[-1][0] == _STOP  # the last write there will be
                while pending:
                    self._commit(conn, pending[:max_batch])
                    del pending[:max_batch]
                if stop:
                    return
                if (self._uncheckpointed >= _CHECKPOINT_COMMITS
                        or self._uncheckpointed_writes >= _CHECKPOINT_WRITES):
                    if not self._urgent:
                        self._checkpoint(conn)
                    elif (self._uncheckpointed >= 4 * _CHECKPOINT_COMMITS
                            or self._uncheckpointed_writes >= 4 * _CHECKPOINT_WRITES):
                        # Durable writes keep waiting, and a checkpoint here
                        # would hold them up: the checkpointer's thread makes it.
                        self._uncheckpointed = self._uncheckpointed_writes = 0
                        self._checkpointer.poke()
                deadline = time.monotonic() + linger

    def _checkpoint(self, conn: sqlite3.Connection) -> None:
        """Copy the WAL back into the database while no caller waits on the writer.

        Made between two of its own commits, the checkpoint reaches the end of
        the WAL (unless another process's reader holds it back), so the next
        commit starts the WAL over and rewrites it in place instead of
        appending to an ever larger file. A second thread checkpointing while
        commits keep coming seldom catches up with the last one.
        """
        self._uncheckpointed = self._uncheckpointed_writes = 0
        try:
            conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        except sqlite3.Error:
            pass  # a checkpoint is an optimisation; the next one retries

    def _abandon(self, pending: Iterable[_Op], error: LedgerError) -> None:
        """Fail the tickets of ops that will never be written."""
        with self._lock:
            taken, self._ops = self._ops, []
        tickets = [op[2] for op in (*pending, *taken) if op[2] is not None]
        for ticket in tickets:
            ticket.error = error
        _wake_all(tickets)

    def _connect(self) -> sqlite3.Connection:
        try:
            conn = sqlite3.connect(self.path, timeout=self._busy_timeout, isolation_level=None,
                                   cached_statements=512)
        except sqlite3.Error as error:
            raise LedgerError(f"{self.path}: cannot open the ledger: {error}") from error
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout * 1000)}")
            mode = self._journal_wal(conn)
            if mode != "wal":
                raise LedgerError(
                    f"{self.path}: the ledger needs WAL journaling, and this database "
                    f"reports journal_mode={mode} (an in-memory database cannot hold a ledger)"
                )
            # FULL: in WAL mode NORMAL may lose the last commits on power loss,
            # and a billing record must not.
            conn.execute("PRAGMA synchronous = FULL")
            # Checkpoints run on their own thread (`_Checkpointer`): done in
            # the writer's commit, one would stall every waiting run.
            conn.execute("PRAGMA wal_autocheckpoint = 0")
            # Foreign keys stay declared but unenforced: the writer already
            # refuses an attempt of an invocation it does not know, and the
            # per-row parent lookup would cost every insert.
            migrate(conn, path=self.path)
            self._statements = _Statements(conn)
        except sqlite3.DatabaseError as error:
            conn.close()
            raise LedgerError(f"{self.path} is not a SQLite database ({error})") from error
        except BaseException:
            conn.close()
            raise
        return conn

    def _journal_wal(self, conn: sqlite3.Connection) -> str:
        # Switching a fresh file to WAL needs a lock the busy handler does not
        # always wait for, so several processes opening one new file retry here.
        give_up = time.monotonic() + self._busy_timeout
        while True:
            try:
                return str(conn.execute("PRAGMA journal_mode = WAL").fetchone()[0])
            except sqlite3.OperationalError as error:
                if "locked" not in str(error) or time.monotonic() > give_up:
                    raise
                time.sleep(0.01)

    def _commit(self, conn: sqlite3.Connection, ops: list[_Op]) -> None:
        """Write ``ops`` in one transaction; on a database error, each on its own."""
        batch = _Batch()
        began = False
        try:
            cursor = self._statements.cursor
            cursor.execute("BEGIN IMMEDIATE")
            began = True
            self._plan(conn, batch, ops)
            self._execute(batch)
            cursor.execute("COMMIT")
        except sqlite3.Error as error:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            # Forget what this batch taught the writer: the next write to
            # those invocations reads their committed state again.
            for invocation_id in batch.touched:
                self._live.pop(invocation_id, None)
            if began and len(ops) > 1:
                # Isolate the write that failed so the others still land.
                for op in ops:
                    self._commit(conn, [op])
                return
            # A single write failed, or the write lock could not be had within
            # the busy timeout (retrying each write would wait that long again).
            failed = _Batch()
            for op in ops:
                failure = LedgerError(f"{self.path}: {_describe(op)} failed: {error}")
                failure.__cause__ = error
                self._refuse(op, failure, failed)
            self._finish(failed)
            return
        self._commits += 1
        self._uncheckpointed += 1
        self._uncheckpointed_writes += batch.planned
        self._writes += batch.planned
        self._finish(batch)

    def _finish(self, batch: _Batch) -> None:
        tickets = batch.done
        for ticket, error in batch.failed:
            ticket.error = error
            tickets.append(ticket)
        _wake_all(tickets)

    def _refuse(self, op: _Op, error: LedgerError, batch: _Batch) -> None:
        kind, record, ticket = op
        if ticket is not None:
            batch.failed.append((ticket, error))
        elif kind in (_START, _SETTLE):
            # Nobody awaits a deferred write: its invocation's next durable
            # call reports the failure, and nothing more is written for it.
            self._failed.setdefault(_invocation_id(kind, record), error)

    # -- planning: check each op against what is known and turn it into rows ------

    def _plan(self, conn: sqlite3.Connection, batch: _Batch, ops: list[_Op]) -> None:
        failed = self._failed
        for op in ops:
            kind, record, ticket = op
            if kind < _FLUSH:
                try:
                    if failed:
                        error = failed.get(_invocation_id(kind, record))
                        if error is not None:
                            raise error
                    if kind == _SETTLE:
                        self._plan_settle(conn, batch, record)
                    elif kind == _DISPATCH:
                        self._plan_dispatch(conn, batch, record)
                    elif kind == _START:
                        self._plan_start(batch, record)
                    else:
                        self._plan_end(conn, batch, record)
                except LedgerError as error:
                    self._refuse(op, error, batch)
                    continue
                batch.planned += 1
            if ticket is not None:
                batch.done.append(ticket)

    def _touch(self, conn: sqlite3.Connection, batch: _Batch, invocation_id: str) -> _Live:
        batch.touched.add(invocation_id)
        live = self._live.get(invocation_id)
        if live is not None and not live.ended:
            return live
        if live is None:
            # Not started by this ledger (or forgotten after a rollback): read
            # its committed state.
            row = conn.execute(
                "SELECT attempts_retained, outcome FROM invocations WHERE id = ?",
                (invocation_id,),
            ).fetchone()
            if row is None:
                raise LedgerError(f"{self.path}: no invocation {invocation_id}")
            unsettled = conn.execute(
                "SELECT ordinal FROM attempts WHERE invocation_id = ? AND outcome = 'dispatched'",
                (invocation_id,),
            ).fetchall()
            live = _Live(int(row[0]), {int(r[0]) for r in unsettled}, None,
                         ended=row[1] != "running")
            self._live[invocation_id] = live
        if live.ended:
            raise LedgerError(f"{self.path}: invocation {invocation_id} has already ended")
        return live

    def _plan_start(self, batch: _Batch, r: InvocationStart) -> None:
        if r.id in self._live:
            raise LedgerError(f"{self.path}: invocation {r.id} already exists")
        batch.touched.add(r.id)
        self._live[r.id] = _Live(0)
        batch.starts.append((
            r.id, r.operation, r.operation_version, r.provider, r.model, r.tenant, r.user_id,
            r.feature, r.correlation_id, format_time(r.started_at),
        ))

    def _plan_dispatch(self, conn: sqlite3.Connection, batch: _Batch, r: AttemptDispatch) -> None:
        live = self._touch(conn, batch, r.invocation_id)
        overflow = live.overflow
        if r.ordinal in live.unsettled or (overflow is not None and r.ordinal in overflow):
            raise LedgerError(
                f"{self.path}: attempt {r.ordinal} of {r.invocation_id} is already dispatched")
        deltas = batch.deltas.get(r.invocation_id)
        if deltas is None:
            deltas = batch.deltas[r.invocation_id] = [0] * _D_WIDTH
        deltas[_D_COUNT] += 1
        if live.retained >= self._max_retained:
            # R07: past the cap an attempt is counted, not kept.
            deltas[_D_INCOMPLETE] = 1
            if overflow is not None:
                overflow.add(r.ordinal)
            return
        live.retained += 1
        live.unsettled.add(r.ordinal)
        deltas[_D_RETAINED] += 1
        batch.dispatches.append((
            r.invocation_id, r.ordinal, r.turn, r.attempt, r.phase, r.served_by,
            format_time(r.started_at), r.max_tokens, r.timeout_ms, r.wait_ms,
        ))

    def _plan_settle(self, conn: sqlite3.Connection, batch: _Batch, r: AttemptSettle) -> None:
        live = self._touch(conn, batch, r.invocation_id)
        if r.ordinal in live.unsettled:
            live.unsettled.discard(r.ordinal)
            retained = True
        elif live.overflow is None or r.ordinal in live.overflow:
            if live.overflow is not None:
                live.overflow.discard(r.ordinal)
            retained = False
        else:
            raise LedgerError(
                f"{self.path}: attempt {r.ordinal} of {r.invocation_id} was not dispatched "
                "or is already settled")
        deltas = batch.deltas.get(r.invocation_id)
        if deltas is None:
            deltas = batch.deltas[r.invocation_id] = [0] * _D_WIDTH
        usage = r.usage
        if usage is not None:
            deltas[_D_INPUT] += usage.input_tokens
            deltas[_D_OUTPUT] += usage.output_tokens
            deltas[_D_CACHE_READ] += usage.cache_read_tokens
            deltas[_D_CACHE_WRITE] += usage.cache_write_tokens
            deltas[_D_CACHE_WRITE_1H] += usage.cache_write_1h_tokens
        cost = r.cost_nanousd
        if cost is not None:
            # S01: every priced attempt is what the provider may bill; only
            # the charged (successful) ones are what the run costs.
            deltas[_D_PROVIDER_COST] += cost
            if r.charged:
                deltas[_D_COST] += cost
        if not retained:
            return
        if usage is None:
            batch.settles.append((
                r.outcome, r.latency_ms, r.fault, r.aborted_reason, r.http_status, r.error_code,
                None, None, None, None, None, int(r.usage_approx), cost, int(r.charged),
                r.price_ref, r.response_id, r.request_id, r.stop_reason, r.invocation_id,
                r.ordinal,
            ))
        else:
            batch.settles.append((
                r.outcome, r.latency_ms, r.fault, r.aborted_reason, r.http_status, r.error_code,
                usage.input_tokens, usage.output_tokens, usage.cache_read_tokens,
                usage.cache_write_tokens, usage.cache_write_1h_tokens, int(r.usage_approx),
                cost, int(r.charged), r.price_ref, r.response_id, r.request_id, r.stop_reason,
                r.invocation_id, r.ordinal,
            ))

    def _plan_end(self, conn: sqlite3.Connection, batch: _Batch, r: InvocationEnd) -> None:
        live = self._touch(conn, batch, r.id)
        live.ended = True
        batch.ends.append((format_time(r.ended_at), r.outcome, r.turns, r.tool_calls,
                           r.credits, r.id))

    def _execute(self, batch: _Batch) -> None:
        run = self._statements.run
        # Statement order: rows exist before they are updated.
        if batch.starts:
            run("start", batch.starts)
        if batch.dispatches:
            run("dispatch", batch.dispatches)
        if batch.settles:
            _expect(run("settle", batch.settles), len(batch.settles),
                    "dispatched attempt rows")
        if batch.deltas:
            _expect(run("add", [(*d, i) for i, d in batch.deltas.items()]),
                    len(batch.deltas), "invocation rows")
        if batch.ends:
            _expect(run("end", batch.ends), len(batch.ends), "invocation rows")
        for row in batch.ends:
            # Ended: nothing more will be written for it by the engine.
            self._live.pop(row[-1], None)


def _expect(changed: int, count: int, what: str) -> None:
    if changed != count:
        # Another writer changed rows this one counted on: let the per-write
        # path find out which write it was.
        raise sqlite3.IntegrityError(f"expected to update {count} {what}, updated {changed}")


def _invocation_id(kind: int, record: Any) -> str:
    if kind in (_START, _END):
        return str(record.id)
    return str(record.invocation_id)


def _describe(op: _Op) -> str:
    kind, record, _ = op
    if kind == _START:
        return f"starting invocation {record.id}"
    if kind == _DISPATCH:
        return f"dispatching attempt {record.ordinal} of {record.invocation_id}"
    if kind == _SETTLE:
        return f"settling attempt {record.ordinal} of {record.invocation_id}"
    if kind == _END:
        return f"ending invocation {record.id}"
    return "committing"


def _wake(tickets: list[_Ticket]) -> None:
    for ticket in tickets:
        if ticket.future is not None:
            if not ticket.future.done():  # done: its waiter was cancelled
                ticket.future.set_result(None)
        elif ticket.event is not None:
            ticket.event.set()


def _wake_all(tickets: list[_Ticket]) -> None:
    """Complete each ticket in its own event loop, without waiting for that loop."""
    if len(tickets) == 1 and tickets[0].loop is not None:  # the sequential path
        try:
            tickets[0].loop.call_soon_threadsafe(_wake, tickets)
        except Exception:  # the loop has finished: nobody is waiting any more
            pass
        return
    by_loop: dict[int, tuple[_Ticket, list[_Ticket]]] = {}
    for ticket in tickets:
        loop: object = ticket.loop if ticket.loop is not None else (
            ticket.token.native_token if ticket.token is not None else None)
        entry = by_loop.get(id(loop))
        if entry is None:
            by_loop[id(loop)] = (ticket, [ticket])
        else:
            entry[1].append(ticket)
    for first, group in by_loop.values():
        try:
            if first.loop is not None:
                first.loop.call_soon_threadsafe(_wake, group)
            elif first.token is not None:
                first.token.backend_class.run_sync_soon(_wake, (group,),
                                                        first.token.native_token)
        except Exception:  # the loop has finished: nobody is waiting any more
            pass


class _Checkpointer:
    """Copies the WAL back into the database file, off the writer's path.

    The writer pokes it when a checkpoint is due while durable writes are
    queued (otherwise the writer checkpoints itself). A passive checkpoint never blocks
    writers or readers; it copies what no reader still needs, at most every
    ``interval`` seconds. The last connection to close checkpoints what is left.
    """

    def __init__(self, path: str, busy_timeout: float, interval: float = 0.1) -> None:
        self._path = path
        self._busy_timeout = busy_timeout
        self._interval = interval
        self._wanted = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"loopengine-checkpoint:{path}",
                                        daemon=True)
        self._thread.start()

    def poke(self) -> None:
        """Ask for a checkpoint (cheap; many pokes make one checkpoint)."""
        self._wanted.set()

    def stop(self) -> None:
        """Stop the thread and close its connection."""
        self._stopping.set()
        self._wanted.set()
        self._thread.join()

    def _run(self) -> None:
        try:
            conn = sqlite3.connect(self._path, timeout=self._busy_timeout, isolation_level=None)
        except sqlite3.Error:
            return  # the writer's own connection reports what is wrong with the file
        try:
            while True:
                self._wanted.wait()
                if self._stopping.is_set():
                    return
                self._wanted.clear()
                try:
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                except sqlite3.Error:
                    pass  # a checkpoint is an optimisation; the next one retries
                if self._stopping.wait(self._interval):
                    return
        finally:
            conn.close()


_open_ledgers: weakref.WeakSet[SQLiteLedger] = weakref.WeakSet()


@atexit.register
def _close_open_ledgers() -> None:
    # The writer is a daemon thread (it must not keep a process alive); this
    # commits what it still holds before the interpreter stops it.
    for ledger in list(_open_ledgers):
        try:
            ledger.close()
        except Exception:  # exiting anyway, with nobody to report to
            pass
