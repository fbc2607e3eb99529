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
* A database it cannot reach (a lost connection, a lock held past the busy
  timeout: `Store.lost`) refuses nothing: the thread tries again with a
  bounded, jittered backoff, asks whether a transaction lost during its
  commit committed (`Writer.committed`), and replays it if not. A close
  gives up on it after ``give_up`` seconds. An unexpected exception
  replaces the writer and replays its batch once.

A forked child's copy refuses every call; a ledger still open at interpreter
exit is closed then, committing what is queued. A kill of the whole process
loses the writes queued but not committed: an unsettled row, never a
missing one.
"""

from __future__ import annotations

import atexit
import heapq
import logging
import math
import os
import random
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final, Self, TypeVar

import anyio.to_thread

from loopengine._errors import LedgerError
from loopengine.persistence._account_store import TreeRun, tree
from loopengine.persistence._ops import dispatch_op, end_op, settle_op, start_op
from loopengine.persistence._planner import (
    END_SET,
    FLUSH,
    OPEN_OUTCOMES,
    Batch,
    Known,
    Lost,
    Op,
    Refused,
    Store,
    read_progress,
)
from loopengine.persistence._records import (
    AttemptDispatch,
    AttemptSettle,
    InvocationEnd,
    InvocationProgress,
    InvocationStart,
)
from loopengine.persistence._waiting import Waiter, release, wake_all

__all__ = ["Call", "ThreadedLedger", "Writer"]

T = TypeVar("T")

logger = logging.getLogger("loopengine")


@dataclass(slots=True)
class Call:
    """A transaction of the ledger's database other than a batch of ops (a credit
    account's): ``work(connection)``, run by the writer thread in its own
    transaction; its result or exception goes back to the awaiting caller."""

    work: Callable[[Any], Any]
    failure: str
    """What a database error means to the caller, for its `LedgerError`."""
    lock: tuple[str, str] | None = None
    """The row it locks first and holds until its commit, as ``(table, key)``: a
    credit account's (``("accounts", account)``, `_account_store.lock`) or a
    run store's run (``("run_states", invocation_id)``, its other rows the
    run's); None: it locks none. The calls of one transaction lock theirs in
    that order (`Writer.run_calls`)."""
    waiter: Waiter = field(default_factory=Waiter)
    result: Any = None
    error: BaseException | None = None


class Writer(Store):
    """A store's connection as the writer thread drives it: the planner's `Store`
    (whose transaction also carries the other callers' transactions,
    `run_calls`), its housekeeping and its end (`_writer.Writer`,
    `_postgres.PostgresWriter`). Not thread-safe: the thread calls it."""

    _conn: Any = None
    """The connection (once `Store.begin` has made sure of one)."""

    def qmark(self) -> Any:
        """The connection as SQL written with SQLite's ``?`` parameters expects it
        (the SQL of the calls, the accounts' and the run store's, is written once,
        with them)."""
        return self._conn

    def load(self, invocation_id: str) -> Known | None:
        """The committed state of an invocation another ledger started (or forgotten)."""
        def rows(sql: str) -> list[Any]:
            return list(self.qmark().execute(sql, (invocation_id,)).fetchall())

        found = rows("SELECT attempts_retained, outcome FROM invocations WHERE id = ?")
        if not found:
            return None
        retained, outcome = found[0]
        unsettled = rows("SELECT ordinal FROM attempts WHERE invocation_id = ? "
                         "AND outcome = 'dispatched'")
        segment = rows("SELECT ordinal, outcome, ended_at FROM segments WHERE invocation_id = ? "
                       "ORDER BY ordinal DESC LIMIT 1")
        last, how, ended_at = segment[0] if segment else (None, None, None)
        return Known(int(retained), outcome not in OPEN_OUTCOMES, [int(r[0]) for r in unsettled],
                     None if last is None else int(last), how is None and ended_at is None)

    def run_calls(self, calls: Sequence[Call]) -> None:
        """Run ``calls`` on the connection, each in a savepoint of one transaction
        (one commit for all of them, as a batch of ops shares one): a call that
        raises is rolled back alone; a transaction that cannot begin or commit
        fails every call. A database error becomes the call's `LedgerError`.

        The calls that lock a row run first, in the rows' order (`Call.lock`:
        the accounts', then the runs'; the others after them, as they came):
        each lock is held until the commit, so every host's transactions take
        theirs in one order, and no two wait for each other (a deadlock, which
        the server breaks by failing one of them).

        Raises:
            Lost: the database could not be reached (`Store.lost`); no call is
                failed for it, and they run again once it can
                (`ThreadedLedger`), unless the transaction committed.
        """

        def fail(call: Call, error: BaseException) -> None:
            call.result = None
            call.error = (LedgerError(f"{self.name}: {call.failure}: {error}")
                          if isinstance(error, self.errors) else error)

        committing = False
        try:
            self.begin()
            ordered = sorted(calls, key=lambda call: (call.lock is None, call.lock or ("", "")))
            for index, call in enumerate(ordered):
                call.result = call.error = None
                self.savepoint(first=index == 0)
                try:
                    call.result = call.work(self.qmark())
                except Exception as error:
                    self._conn.execute("ROLLBACK TO SAVEPOINT loopengine_call")
                    fail(call, error)
            # The commit releases the last call's savepoint.
            committing = True
            self.finish()
        except self.errors as error:
            lost = self.lost(error)
            self.abort()
            if lost:
                raise Lost(None, [], error, uncertain=committing) from error
            for call in calls:
                if call.error is None:
                    fail(call, error)

    def savepoint(self, *, first: bool) -> None:
        """Before a call of `run_calls`, open the savepoint it rolls back to should
        it raise: the ``first`` in the transaction just begun (where a store notes
        what tells, once a lost connection is back, whether it committed:
        `committed`), each later one once the previous call's is released."""
        if not first:
            self._conn.execute("RELEASE SAVEPOINT loopengine_call")
        self._conn.execute("SAVEPOINT loopengine_call")

    def committed(self, lost: Lost) -> bool | None:
        """Whether the transaction of ``lost``, whose commit was under way when the
        connection was lost, committed: read on the new connection. None: not
        known yet (the old session may still be committing), ask again later.

        Raises:
            Refused: it cannot be known; the writes must not be replayed blindly.
        """
        return False

    def evidence(self, batch: Batch | None) -> bool:
        """Whether ``batch`` committed, read from its rows: its transaction wrote
        them all or none, so one row it inserted (or settled, or ended) that is
        there (or settled, or ended) says it did.

        Raises:
            Refused: the batch changed only totals, which no row tells apart,
                or it is a transaction of other callers (None).
        """
        unknown = Refused(f"{self.name}: the connection was lost while a transaction "
                          "committed, and whether it did cannot be read back")
        if batch is None:
            raise unknown
        if not (batch.starts or batch.dispatches or batch.settles or batch.deltas
                or batch.ends):
            return True  # it wrote nothing: committed or not, the same
        conn = self.qmark()
        if batch.starts:
            found = conn.execute("SELECT 1 FROM invocations WHERE id = ?",
                                 (batch.starts[0][0],)).fetchall()
            return bool(found)
        elif batch.dispatches:
            row = batch.dispatches[0]
            found = conn.execute("SELECT 1 FROM attempts WHERE invocation_id = ? "
                                 "AND ordinal = ?", (row[0], row[1])).fetchall()
            return bool(found)
        elif batch.settles:
            row = batch.settles[0]
            found = conn.execute("SELECT outcome FROM attempts WHERE invocation_id = ? "
                                 "AND ordinal = ?", (row[-2], row[-1])).fetchall()
            return bool(found) and found[0][0] != "dispatched"
        elif batch.ends:
            end = batch.ends[0]
            found = conn.execute("SELECT outcome, pause_seal FROM invocations WHERE id = ?",
                                 (end[-1],)).fetchall()
            # The outcome it wrote, and the seal: a pause's, or the token of
            # the resume that wrote ``running`` back (another resume's differs).
            seal = end[END_SET.index("pause_seal")]
            return bool(found) and found[0][0] == end[1] and (
                seal is None or found[0][1] == seal)
        raise unknown

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

    def _setup(self, label: str, max_retained: int, linger: float, max_batch: int,
               give_up: float) -> None:
        self._label = label
        self._give_up = give_up
        """Seconds a `close` waits for a database that cannot be reached."""
        self._close_requested = threading.Event()
        """Set by `close`: a wait for the database ends, to give up by the deadline."""
        self._give_up_at = math.inf
        """When the writes still waiting for the database are given up (`close`)."""
        self._reconnects = 0
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
        self._waiters: list[tuple[int, Waiter]] = []
        """A heap of ``(write number, waiter)``: one waiter a number, the call that
        queued that write."""
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
        await self._defer(start_op(record))

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
        else:
            await self._defer(settle_op(record))

    async def end_invocation(self, record: InvocationEnd) -> None:
        """Settle the invocation with its outcome; everything before is durable on return.

        Raises:
            LedgerError: the row could not be written, or an earlier deferred
                write of this invocation failed.
        """
        await self._durable(end_op(record))

    # -- more than the protocol ------------------------------------------------------

    async def read_progress(self, invocation_id: str) -> InvocationProgress | None:
        """The invocation's committed progress (what a resume enforces its
        budgets from), or None when the ledger has no such invocation.

        Raises:
            LedgerError: the database could not be read.
        """
        def work(conn: Any) -> InvocationProgress | None:
            return read_progress(lambda sql: conn.execute(sql, (invocation_id,)).fetchall())

        return await self._transact_qmark(work, "the invocation could not be read")

    async def read_tree(self, invocation_id: str) -> list[TreeRun]:
        """The run ``invocation_id`` and every run below it (its sub-agents', theirs
        included), as committed, in the order they started (`_account_store.tree`):
        what a recovery of the run reads of its sub-agents.

        Raises:
            LedgerError: the database could not be read.
        """
        return await self._transact_qmark(lambda conn: tree(conn, invocation_id),
                                          "the ledger could not be read")

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
        return self._writer.planner.commits if self._writer is not None else 0

    @property
    def writes(self) -> int:
        """Writes (starts, dispatches, settles, ends) this ledger has committed."""
        self._check_fork()
        return self._writer.planner.writes if self._writer is not None else 0

    @property
    def reconnects(self) -> int:
        """Times the writer found the database again after losing it (a connection
        lost, a lock held past the busy timeout) and replayed what was waiting."""
        return self._reconnects

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
            if first:
                self._give_up_at = time.monotonic() + self._give_up
            self._wake.notify()
        self._close_requested.set()
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

    async def _defer(self, op: Op) -> None:
        """Queue a deferred write, to be committed with the next durable one."""
        await self._queue(op, None)

    async def _durable(self, op: Op) -> None:
        """Queue a durable write (with every deferred one before it) and wait for it.

        Raises:
            LedgerError: the write was refused, or the ledger closed or broke first.
        """
        waiter = Waiter()
        number = await self._queue(op, waiter)
        try:
            await waiter.wait()
        finally:
            waiter.gone = True
        if waiter.refused is not None:
            raise LedgerError(waiter.refused)
        if self._done < number:
            raise LedgerError(self._broken or f"{self._label}: the ledger is closed")

    async def _queue(self, op: Op, waiter: Waiter | None) -> int:
        """Number ``op`` and queue it: durable with the ``waiter`` its call waits on
        (which is told if it is refused: a refusal nobody waits for is not kept),
        deferred without one. Returns its number."""
        if self._writer is None:
            await self._open()
        with self._lock:
            self._check()
            self._next_id += 1
            number = op[1] = self._next_id
            if waiter is not None:
                heapq.heappush(self._waiters, (number, waiter))
                self._ready += self._deferred
                self._deferred.clear()
                self._ready.append(op)
                self._wake.notify()
            elif not self._linger:
                self._ready.append(op)
                self._wake.notify()
            elif self._deferred:
                self._deferred.append(op)
            else:
                self._deferred_since = time.monotonic()
                self._deferred.append(op)
                self._wake.notify()  # a thread waiting for nothing now waits a linger
        return number

    async def _transact_qmark(self, work: Callable[[Any], T], failure: str, *,
                              lock: tuple[str, str] | None = None) -> T:
        """Run ``work(connection)`` in a transaction of its own on the writer's
        connection, between two batches; return its result or raise its error.
        The connection takes SQLite's ``?`` parameters on every store
        (`Writer.qmark`); ``lock`` names the row ``work`` locks first (`Call.lock`).

        A cancelled caller stops waiting; the transaction, once queued, still
        runs and ends in the thread.

        Raises:
            LedgerError: the ledger cannot be opened, or is closed, or the
                database failed the transaction (the message starts with
                ``failure``).
        """
        if self._writer is None:
            await self._open()
        call = Call(work, failure, lock)
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
        """``call`` on a writer of its own, once: a closed ledger has no thread to
        wait for a database that cannot be reached (a lost connection, a lock
        held past the busy timeout), so the call fails with a `LedgerError`."""
        writer = self._new_writer()
        try:
            writer.run_calls([call])
        except Lost as lost:
            raise LedgerError(f"{self._label}: {call.failure}: {lost.error}") from lost.error
        finally:
            writer.close()
        if call.error is not None:
            raise call.error
        return call.result

    # -- the thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    ops, calls = self._take()
                    if ops is None:
                        return
                done = 0
                refused: list[tuple[int, str]] = []
                for start in range(0, len(ops), self._max_batch):
                    refused += self._commit(ops[start:start + self._max_batch])
                    done = ops[min(start + self._max_batch, len(ops)) - 1][1]
                if done:
                    with self._lock:
                        self._done = done
                        release(self._waiters, done, dict(refused))
                if calls:
                    self._run_calls(calls)
                    wake_all([call.waiter for call in calls if not call.waiter.gone])
                writer = self._writer
                assert writer is not None
                writer.maybe_checkpoint(lambda: bool(self._ready or self._calls))
        except BaseException as error:
            # A bug here must not leave callers waiting forever: each is told.
            with self._lock:
                self._break(f"the ledger's writer failed: {error!r}")
            if not isinstance(error, Exception):
                raise
            logger.error("%s: the ledger's writer failed", self._label, exc_info=True)
        finally:
            if self._writer is not None:
                self._writer.close()

    def _commit(self, ops: list[Op]) -> list[tuple[int, str]]:
        """Commit ``ops`` (one batch), however long the database stays away: a
        transaction lost with its connection is replayed once the database is
        back, unless it committed after all (`_recover`). Returns the durable
        ops refused."""
        refused: list[tuple[int, str]] = []
        pending = ops
        restarted = False
        while pending:
            writer = self._writer
            assert writer is not None
            try:
                return refused + writer.planner.commit(pending)
            except Lost as lost:
                refused += lost.refused
                try:
                    committed = self._recover(lost, len(lost.ops) + len(lost.rest))
                except Refused as refusal:
                    return refused + self._give_up_ops(lost.ops + lost.rest, str(refusal))
                pending = lost.rest if committed else lost.ops + lost.rest
                if committed and lost.batch is not None:
                    refused += writer.planner.committed(lost.batch)
            except Exception as error:
                # A bug, not the database: the writer is replaced (its
                # transaction rolled back) and the batch replayed once.
                if restarted:
                    return refused + self._give_up_ops(
                        pending, f"{self._label}: the ledger's writer failed: {error!r}")
                logger.error("%s: the ledger's writer failed; restarting it and replaying "
                             "%d writes", self._label, len(pending), exc_info=True)
                self._restart()
                restarted = True
        return refused

    def _run_calls(self, calls: list[Call]) -> None:
        """Run ``calls`` in one transaction, however long the database stays away:
        run again once it is back, unless that transaction committed after all."""
        while True:
            writer = self._writer
            assert writer is not None
            try:
                writer.run_calls(calls)
                return
            except Lost as lost:
                try:
                    if self._recover(lost, len(calls)):
                        return
                except Refused as refusal:
                    for call in calls:
                        call.result, call.error = None, LedgerError(
                            f"{refusal}: {call.failure}")
                    return

    def _restart(self) -> None:
        """Replace the writer by a new one on the same database (its counts kept)."""
        old = self._writer
        assert old is not None
        try:
            old.abort()
        finally:
            old.close()
        new = self._new_writer()
        new.planner.commits, new.planner.writes = old.planner.commits, old.planner.writes
        self._writer = new

    def _recover(self, lost: Lost, waiting: int) -> bool:
        """Wait for the database to come back after ``lost`` (retrying with a
        bounded, jittered backoff) and tell whether the lost transaction
        committed after all (only a lost commit may have).

        Raises:
            Refused: the ledger was closed and the database did not come back
                within its ``give_up`` seconds, or whether the transaction
                committed cannot be known.
        """
        writer = self._writer
        assert writer is not None
        since = time.monotonic()
        logger.warning("%s: the database cannot be reached (%s); %d writes wait, retrying",
                       self._label, lost.error, waiting)
        delay = 0.0
        while True:
            pause = delay * random.uniform(0.5, 1.0)
            if self._close_requested.is_set():
                # Closing: give up at `_give_up_at`, and not before.
                left = self._give_up_at - time.monotonic()
                if left <= 0:
                    raise Refused(f"{self._label}: the database could not be reached within "
                                  f"{self._give_up:g}s of closing the ledger ({lost.error})")
                time.sleep(min(pause, left))
            else:
                self._close_requested.wait(pause)
            delay = min(max(2 * delay, _FIRST_RETRY), _LONGEST_RETRY)
            try:
                # A connection again (raises one of ``errors`` while the
                # database still cannot be reached).
                writer.begin()
                writer.abort()
                committed = writer.committed(lost) if lost.uncertain else False
            except Refused:
                writer.abort()
                raise
            except writer.errors as error:
                if not writer.lost(error):
                    writer.abort()
                    raise Refused(f"{self._label}: after the connection was lost, whether "
                                  f"its last transaction committed cannot be read: {error}"
                                  ) from error
                writer.abort()
                lost.error = error
                continue
            writer.abort()
            if committed is None:
                continue
            self._reconnects += 1
            logger.warning("%s: the database is back after %.1fs; the lost transaction "
                           "%s; %d writes go on", self._label, time.monotonic() - since,
                           "had committed" if committed else "is replayed", waiting)
            return committed

    def _give_up_ops(self, ops: list[Op], message: str) -> list[tuple[int, str]]:
        """Refuse ``ops`` (the writer could not make them), logged: the durable
        ones, returned, raise ``message`` to their callers."""
        logger.error("%s; %d writes are not recorded", message, len(ops))
        writer = self._writer
        assert writer is not None
        return writer.planner.refuse(ops, lambda op: message)

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


_FIRST_RETRY: Final = 0.05
"""Seconds before the second attempt to reach a database that was lost (the
first is at once: a terminated session is replaced by the next connection)."""
_LONGEST_RETRY: Final = 1.0
"""The longest wait between two attempts (each wait is jittered down by up to
half, so many processes that lost one server do not all return at once)."""


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
