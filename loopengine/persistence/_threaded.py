"""The front of a ledger whose one writer thread commits what its calls queue.

Shared by `SQLiteLedger` and `PostgresLedger`, each of which hands its opened
`Writer` (a `_planner.Store`) to `ThreadedLedger._start`. As aiosqlite's
connection thread, plus batching:

* A call numbers its write (an op, a plain list: `_ops`) and queues it. A
  durable one (a dispatch, a served settle, an end) is handed to the thread
  at once, with every deferred one queued before it, and the call waits for
  its commit; a deferred one (a start, a settle of nothing served) travels
  with the next durable write, or is committed once it has waited ``linger``
  seconds.
* The thread takes whatever has queued into one transaction: writes queue
  while the previous commit runs (group commit). It wakes each waiting call
  on the call's own event loop (`_waiting`).
* Between batches it runs the other transactions of the database (the
  credit accounts'), on the same connection.

A forked child's copy refuses every call; a ledger still open at interpreter
exit is closed then, committing what is queued. A kill of the whole process
loses the writes queued but not committed: an unsettled row, never a
missing one.
"""

from __future__ import annotations

import asyncio
import atexit
import heapq
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Self, TypeVar

import anyio.to_thread

from loopengine._errors import LedgerError
from loopengine.persistence._ops import dispatch_op, end_op, settle_op, start_op
from loopengine.persistence._planner import FLUSH, Known, Op, Store, read_known
from loopengine.persistence._records import (
    AttemptDispatch,
    AttemptSettle,
    InvocationEnd,
    InvocationStart,
)
from loopengine.persistence._waiting import Waiter, release, wake_all

__all__ = ["Call", "ThreadedLedger", "Writer"]

T = TypeVar("T")

logger = logging.getLogger("loopengine")


class Call:
    """A transaction of the ledger's database other than a batch of ops (a credit
    account's): ``work(connection)``, run by the writer thread in its own
    transaction; its result or exception goes back to the awaiting caller."""

    __slots__ = ("error", "failure", "result", "waiter", "work")

    def __init__(self, work: Callable[[Any], Any], failure: str, waiter: Waiter) -> None:
        self.work = work
        self.failure = failure
        """What a database error means to the caller, for its `LedgerError`."""
        self.waiter = waiter
        self.result: Any = None
        self.error: BaseException | None = None


class Writer(Store):
    """A store's connection as the writer thread drives it: the planner's `Store`
    (whose transaction also carries the other callers' transactions,
    `run_calls`), its housekeeping and its end (`_writer.Writer`,
    `_postgres.PostgresWriter`). Not thread-safe: the thread calls it."""

    _conn: Any = None
    """The connection (once `Store.begin` has made sure of one)."""
    marker = "?"
    """The connection's parameter marker."""

    def load(self, invocation_id: str) -> Known | None:
        """The committed state of an invocation another ledger started (or forgotten)."""
        conn = self._conn
        return read_known(
            lambda sql: conn.execute(sql.format(self.marker), (invocation_id,)).fetchall())

    def run_calls(self, calls: Sequence[Call]) -> None:
        """Run ``calls`` on the connection, each in a savepoint of one transaction
        (one commit for all of them, as a batch of ops shares one): a call that
        raises is rolled back alone; a transaction that cannot begin or commit
        fails every call. A database error becomes the call's `LedgerError`."""

        def fail(call: Call, error: BaseException) -> None:
            call.result = None
            call.error = (LedgerError(f"{self.name}: {call.failure}: {error}")
                          if isinstance(error, self.errors) else error)

        try:
            self.begin()
            for call in calls:
                self._conn.execute("SAVEPOINT loopengine_call")
                try:
                    call.result = call.work(self._conn)
                except Exception as error:
                    self._conn.execute("ROLLBACK TO SAVEPOINT loopengine_call")
                    fail(call, error)
                self._conn.execute("RELEASE SAVEPOINT loopengine_call")
            self.finish()
        except self.errors as error:
            self.abort()
            for call in calls:
                if call.error is None:
                    fail(call, error)

    def maybe_checkpoint(self, waiting: Callable[[], bool]) -> None:
        """After a commit: housekeeping that is due (``waiting()``: writes wait)."""

    def forget(self) -> None:
        """In a forked child: let go of the connection without touching the
        parent's session."""

    def close(self) -> None:
        """Let go of the database."""
        raise NotImplementedError


class ThreadedLedger:
    """The calls of a ledger whose one writer thread commits its ops (see the module).

    A store sets its name and arguments with `_setup`, then hands its opened
    writer to `_start` (at construction, or when first used).
    """

    _label: str
    """How the ledger is named in messages (its file, its server)."""

    def _setup(self, label: str, max_retained: int, linger: float, max_batch: int) -> None:
        self._label = label
        self._max_retained = max_retained
        self._linger = float(linger)
        self._max_batch = max_batch
        self._pid = os.getpid()
        self._lock = threading.Lock()
        """Guards everything below."""
        self._wake = threading.Condition(self._lock)
        """Wakes the thread: writes or calls are ready, or the ledger closes."""
        self._closed = False
        self._closing = False
        """A `close` has begun (the first one stops the thread)."""
        self._broken: str | None = None
        """Why no write can be made any more, or None."""
        self._next_id = 0
        self._deferred: list[Op] = []
        """Deferred writes not handed to the thread yet, in call order."""
        self._deferred_since = 0.0
        self._ready: list[Op] = []
        """Writes for the thread's next transaction, in number order."""
        self._calls: list[Call] = []
        self._done = 0
        """Every write numbered up to this is committed (or refused)."""
        self._refused: dict[int, str] = {}
        """Durable writes refused, by number, until their caller reads it."""
        self._waiters: list[tuple[int, int, Waiter]] = []
        """A heap of ``(write number, sequence, waiter)``."""
        self._sequence = 0
        self._writer: Writer | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        """Set once a `close` has stopped the thread; a second `close` waits for it."""

    def _start(self, writer: Writer) -> None:
        """Start the thread that writes through ``writer`` (opened)."""
        self._writer = writer
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"loopengine-writer:{self._label}")
        self._thread.start()
        _open_ledgers.add(self)

    async def _open(self) -> None:
        """Start the writer if the store starts it on first use (else nothing)."""

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
        if self._writer is None:
            await self._open()
        self._defer(start_op(record))

    async def dispatch_attempt(self, record: AttemptDispatch) -> None:
        """Record an attempt as ``dispatched``; durable when this returns.

        Raises:
            LedgerError: the row could not be written (or an earlier deferred
                write of this invocation failed); the request must not be sent.
        """
        await self._durable(dispatch_op(record))

    async def settle_attempt(self, record: AttemptSettle) -> None:
        """Settle an attempt and add it to the invocation's totals, in one transaction.

        A settle that carries what the provider served (`AttemptSettle.served`)
        is durable when this returns; any other is committed with the next
        durable write (or after ``linger`` seconds).

        Raises:
            LedgerError: the ledger is closed, or the served settle (or an
                earlier deferred write of this invocation) could not be written.
        """
        if record.served:
            await self._durable(settle_op(record))
            return
        if self._writer is None:
            await self._open()
        self._defer(settle_op(record))

    async def end_invocation(self, record: InvocationEnd) -> None:
        """Settle the invocation with its outcome; everything before is durable on return.

        Raises:
            LedgerError: the row could not be written, or an earlier deferred
                write of this invocation failed.
        """
        await self._durable(end_op(record))

    # -- more than the protocol ------------------------------------------------------

    async def flush(self) -> None:
        """Wait until every write queued so far is committed.

        Raises:
            LedgerError: the ledger cannot be opened, or is closed.
        """
        await self._durable([FLUSH, 0])

    @property
    def commits(self) -> int:
        """Transactions this ledger has committed (each one durable commit)."""
        self._check_fork()
        return self._writer.commits if self._writer is not None else 0

    @property
    def writes(self) -> int:
        """Writes (starts, dispatches, settles, ends) this ledger has committed."""
        self._check_fork()
        return self._writer.writes if self._writer is not None else 0

    @property
    def closed(self) -> bool:
        """True once `close` has been called (or the writer is gone)."""
        return self._closed

    def close(self) -> None:
        """Commit what is queued, stop the writer and let go of the database.

        Blocks until the writer is done; from async code prefer `aclose`.
        Closing twice is harmless.
        """
        thread = self._thread
        if thread is None or self._pid != os.getpid():
            self._closed = True  # not started, or a forked copy: nothing to stop here
            return
        with self._lock:
            first, self._closing = not self._closing, True
            self._closed = True
            self._wake.notify()
        if not first:
            # Another thread is closing it (the user's close beside atexit's):
            # return only once everything is committed, as that one will.
            self._stopped.wait()
            return
        thread.join()
        with self._lock:
            self._break("the ledger is closed")
        _open_ledgers.discard(self)
        self._stopped.set()

    def _stopping(self) -> bool:
        return self._closed or self._broken is not None

    async def aclose(self) -> None:
        """`close` in a worker thread, so the event loop keeps running meanwhile."""
        await anyio.to_thread.run_sync(self.close)

    def _open_now(self) -> None:
        """Start the writer now, blocking, if the store starts it on first use."""

    def __enter__(self) -> Self:
        self._open_now()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        await self._open()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # -- queueing --------------------------------------------------------------------

    def _check_fork(self) -> None:
        if self._pid != os.getpid():
            raise LedgerError(self._forked())

    def _forked(self) -> str:
        return (f"{self._label}: this ledger was opened in process {self._pid}; a forked "
                f"process must open its own {type(self).__name__}")

    def _check(self) -> None:
        # Called holding `_lock`.
        if self._broken is not None:
            raise LedgerError(self._broken)
        if self._closed:
            raise LedgerError(f"{self._label}: the ledger is closed")

    def _defer(self, op: Op) -> None:
        with self._lock:
            self._check()
            self._next_id += 1
            op[1] = self._next_id
            if not self._linger:
                self._ready.append(op)
                self._wake.notify()
                return
            if not self._deferred:
                self._deferred_since = time.monotonic()
                self._wake.notify()  # a thread waiting for nothing now waits a linger
            self._deferred.append(op)

    async def _durable(self, op: Op) -> None:
        """Queue a durable write (with every deferred one before it) and wait for it."""
        if self._writer is None:
            await self._open()
        with self._lock:
            self._check()
            self._next_id += 1
            number = op[1] = self._next_id
            if self._deferred:
                self._ready += self._deferred
                self._deferred.clear()
            self._ready.append(op)
            self._wake.notify()
        if self._done < number:
            await self._wait_for(number)
        if self._refused:
            with self._lock:
                message = self._refused.pop(number, None)
            if message is not None:
                raise LedgerError(message)

    async def _wait_for(self, number: int) -> None:
        """Return once write ``number`` is committed (or refused)."""
        with self._lock:
            if self._done >= number:
                return
            if self._broken is not None:
                raise LedgerError(self._broken)
            waiter = Waiter(_running_loop())
            self._sequence += 1
            heapq.heappush(self._waiters, (number, self._sequence, waiter))
        try:
            await waiter.wait()
        finally:
            waiter.gone = True
        if self._done < number:
            raise LedgerError(self._broken or f"{self._label}: the ledger is closed")

    async def _transact(self, work: Callable[[Any], T], failure: str) -> T:
        """Run ``work(connection)`` in a transaction of its own on the writer's
        connection, between two batches; return its result or raise its error.

        A cancelled caller stops waiting; the transaction, once queued, still
        runs and ends in the thread.

        Raises:
            LedgerError: the ledger cannot be opened, or is closed, or the
                database failed the transaction (the message starts with
                ``failure``).
        """
        if self._writer is None:
            await self._open()
        call = Call(work, failure, Waiter(_running_loop()))
        with self._lock:
            closed = self._closing and self._pid == os.getpid()
            if not closed:
                self._check()
                self._calls.append(call)
                self._wake.notify()
        if closed:
            # Closed by its owner (under a run that still settles its account):
            # the transaction runs on a connection of its own.
            return await anyio.to_thread.run_sync(self._transact_closed, call,
                                                  abandon_on_cancel=True)
        try:
            await call.waiter.wait()
        finally:
            call.waiter.gone = True
        if call.error is not None:
            raise call.error
        result: T = call.result
        return result

    def _new_writer(self) -> Writer:
        """A new writer on the store's database, opened (raises `LedgerError`)."""
        raise NotImplementedError

    def _transact_closed(self, call: Call) -> Any:
        writer = self._new_writer()
        try:
            writer.run_calls([call])
        finally:
            writer.close()
        if call.error is not None:
            raise call.error
        return call.result

    # -- the thread ----------------------------------------------------------------

    def _run(self) -> None:
        writer = self._writer
        assert writer is not None
        try:
            while True:
                with self._lock:
                    ops, calls = self._take()
                    if ops is None:
                        return
                done = 0
                refused: list[tuple[int, str]] = []
                for start in range(0, len(ops), self._max_batch):
                    refused += writer.commit(ops[start:start + self._max_batch])
                    done = ops[min(start + self._max_batch, len(ops)) - 1][1]
                if done:
                    with self._lock:
                        self._refused.update(refused)
                        self._done = done
                        release(self._waiters, done)
                if calls:
                    writer.run_calls(calls)
                    wake_all([call.waiter for call in calls if not call.waiter.gone])
                writer.maybe_checkpoint(lambda: bool(self._ready or self._calls))
        except BaseException as error:
            # A bug here must not leave callers waiting forever: each is told.
            with self._lock:
                self._break(f"the ledger's writer failed: {error!r}")
            if not isinstance(error, Exception):
                raise
            logger.error("%s: the ledger's writer failed", self._label, exc_info=True)
        finally:
            writer.close()

    def _take(self) -> tuple[list[Op] | None, list[Call]]:
        """What the thread does next: the ops and calls to run, once some are due,
        or None once the ledger closes with nothing left. Holding `_lock`."""
        while True:
            if self._deferred and (self._stopping() or
                                   time.monotonic() >= self._deferred_since + self._linger):
                self._ready += self._deferred
                self._deferred.clear()
            if self._ready or self._calls:
                ops, self._ready = self._ready, []
                calls, self._calls = self._calls, []
                return ops, calls
            if self._stopping():
                return None, []
            self._wake.wait(self._deferred_since + self._linger - time.monotonic()
                            if self._deferred else None)

    def _break(self, reason: str) -> None:
        """No write can be made any more: fail every waiter. Holding `_lock`."""
        if self._broken is None:
            self._broken = f"{self._label}: {reason}"
            self._closed = True
        release(self._waiters, None)
        calls, self._calls = self._calls, []
        for call in calls:
            call.error = LedgerError(self._broken)
        wake_all([call.waiter for call in calls])


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # not asyncio (anyio's trio backend)
        return None


_open_ledgers: weakref.WeakSet[ThreadedLedger] = weakref.WeakSet()


@atexit.register
def _close_open_ledgers() -> None:
    # Commits what is still queued before the interpreter stops.
    for ledger in list(_open_ledgers):
        try:
            ledger.close()
        except Exception:  # exiting anyway, with nobody to report to
            pass


def _forget_in_child() -> None:
    # The thread and the connection are the parent's: the child's copy refuses
    # every call, with a fresh lock (the fork may have copied it held), and
    # never touches the parent's connection.
    for ledger in list(_open_ledgers):
        ledger._lock = threading.Lock()
        ledger._wake = threading.Condition(ledger._lock)
        ledger._waiters, ledger._calls, ledger._ready, ledger._deferred = [], [], [], []
        ledger._closed = True
        ledger._broken = ledger._forked()
        if ledger._writer is not None:
            ledger._writer.forget()
    _open_ledgers.clear()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_forget_in_child)
