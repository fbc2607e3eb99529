"""The front of a ledger whose writes one writer commits: `PipedLedger`.

Shared by `SQLiteLedger` and `PostgresLedger`; each supplies its writer (a
`_planner.Store` under the shared `Planner`, in `_writer` and
`_postgres_writer`) and how to start it.

How it writes:

* One writer owns the connection: by default a child process of the
  ledger's own, else a thread. In a process the writer holds its own
  interpreter lock, so its planning, statements and commits run beside the
  event loop instead of taking turns with it (a writer thread must win the
  interpreter lock back from a busy event loop each time it returns from the
  database, and that wait is most of a batch's time under many runs).
* A call numbers its write and frames it (`_writer.op_frame`). A write that
  must be durable when the call returns (an attempt's dispatch, a served
  settle, an invocation's end) is sent to the writer at once, with every
  deferred write queued before it; the call then waits until the writer
  reports the commit. The writer takes whatever has arrived into one
  transaction, so under many concurrent runs one commit carries the writes
  of all of them (group commit).
* A write that may be deferred (an invocation's start, a settle of nothing
  served) is only queued: it travels with the next durable write, or a
  helper thread sends it within ``linger`` seconds.
* `begin_dispatch` sends a dispatch and returns at once; the engine hands the
  wait to the provider, which awaits it just before the request goes on the
  wire. Meanwhile the writer commits: the event loop's thread never waits on
  the database.
* The writer reports through a pipe (process) or directly (thread). A waiting
  call first reads what the pipe already holds; only when its write is not
  done yet does its event loop watch the pipe.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import heapq
import logging
import os
import queue
import select
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Final, Literal, Protocol

import anyio
import anyio.lowlevel
import anyio.to_thread

from loopengine._errors import LedgerError
from loopengine.persistence import _writer
from loopengine.persistence._ops import dispatch_op, end_op, settle_op, start_op
from loopengine.persistence._records import (
    AttemptDispatch,
    AttemptSettle,
    InvocationEnd,
    InvocationStart,
)
from loopengine.persistence._waiting import CommitWaits, Receipt, release
from loopengine.persistence._waiting import Waiter as _Waiter
from loopengine.persistence._writer import FLUSH, STOP, Op

__all__ = ["PipedLedger", "WriterKind", "WriterProcess"]

logger = logging.getLogger("loopengine")

WriterKind = Literal["auto", "process", "thread"]
"""Where a ledger's writer runs (the ``writer=`` argument of both stores)."""

# How long opening waits for a writer process to say it is ready, beyond the
# store's own timeout (its first look at the database may wait for a lock).
_START_TIMEOUT: Final = 30.0


class Writer(Protocol):
    """What commits the ops, in a thread or a child process (`_writer.Writer`,
    `_postgres_writer.PostgresWriter`)."""

    @property
    def commits(self) -> int:
        """Transactions committed."""
        ...

    @property
    def writes(self) -> int:
        """Ops committed."""
        ...

    def commit(self, ops: Sequence[Op]) -> list[tuple[int, str]]:
        """Write ``ops`` in one transaction; return the durable ops refused."""
        ...

    def maybe_checkpoint(self, waiting: Callable[[], bool]) -> None:
        """After a commit: housekeeping that is due (``waiting()``: writes wait)."""
        ...

    def close(self) -> None:
        """Let go of the database."""
        ...


class WriterProcess:
    """How to start a store's writer as a child process.

    The child runs ``file`` as a script (``python -I [-S] file OPS_FD ACKS_FD
    ...``) and speaks `_writer`'s frames through the two pipes; ``secret``,
    when given, reaches it through a third pipe whose descriptor is its last
    argument (so a password never shows in the process list).

    Args:
        file: The writer's script.
        arguments: Its arguments after the two pipes' descriptors.
        site: Whether the child may import installed packages (``-S`` when not).
        secret: Bytes only the child reads, or None.
        timeout: Seconds to wait for it to say it is ready.
    """

    def __init__(self, file: str, arguments: Sequence[str] = (), *, site: bool = False,
                 secret: bytes | None = None, timeout: float = _START_TIMEOUT) -> None:
        self.file = file
        self.arguments = list(arguments)
        self.site = site
        self.secret = secret
        self.timeout = timeout

    def can_spawn(self) -> bool:
        """Whether a writer process can be started: POSIX pipes, an interpreter that
        looks like one (not a frozen application, nor a server embedding Python
        whose executable would start the server) and the writer's file on disk."""
        executable = sys.executable or ""
        return (os.name == "posix" and os.path.isfile(executable)
                and os.path.basename(executable).lower().startswith(("python", "pypy"))
                and not getattr(sys, "frozen", False) and os.path.isfile(self.file))


class PipedLedger(CommitWaits):
    """The calls of a ledger whose one writer commits framed ops (see the module).

    A store sets its name and arguments with `_setup`, then starts its writer
    with `_start` (at construction, or when first used).
    """

    _label: str
    """How the ledger is named in messages (its file, its server)."""

    def _setup(self, label: str, max_retained: int, linger: float) -> None:
        self._label = label
        self._max_retained = max_retained
        self._linger = float(linger)
        self._lock = threading.Lock()
        """Guards everything below, and the channel's sending and reading."""
        self._pid = os.getpid()
        self._forks = _forks
        """The process's fork count when it opened: another value means a forked child."""
        self._closed = False
        self._broken: str | None = None
        """Why no write can be made any more (the writer is gone), or None."""
        self._next_id = 0
        self._deferred = bytearray()
        """Frames of the deferred writes not sent yet, in call order."""
        self._deferred_since = 0.0
        self._done = 0
        """Every write numbered up to this is committed (or refused)."""
        self._refused: dict[int, str] = {}
        """Durable writes the writer refused, by number, until their caller reads it."""
        self._commits = self._writes = 0
        self._waiters: list[tuple[int, int, _Waiter]] = []
        """A heap of ``(write number, sequence, waiter)``."""
        self._sequence = 0
        self._readers: dict[asyncio.AbstractEventLoop, int] = {}
        """Event loops watching the writer's pipe, with their waiters' count."""
        self._watchers = 0
        """Waiters on other backends: the helper thread watches the pipe for them."""
        self._activity = False
        self._helper_idle = False
        self._stopping = False
        self._closing = threading.Event()
        """Set once a `close` has stopped the writer; a second `close` waits for it."""
        self._channel: _Channel = _NOT_STARTED
        """How writes reach the writer (`_NOT_STARTED` until `_start`)."""

    def _start(self, kind: WriterKind, process: WriterProcess,
               thread_writer: Callable[[], Writer], max_batch: int) -> None:
        """Start the writer: a child process (``process``) unless ``kind`` says
        ``thread`` or, for ``auto``, a process cannot be started; then a thread
        running ``thread_writer()`` (which opens it, raising `LedgerError`)."""
        self._pid = os.getpid()
        self._forks = _forks
        channel: _Channel
        if kind != "thread" and (kind == "process" or process.can_spawn()):
            try:
                channel = _ProcessChannel(self, process, max_batch)
            except (OSError, LedgerError) as error:
                if kind == "process":
                    if isinstance(error, LedgerError):
                        raise
                    raise LedgerError(
                        f"{self._label}: cannot start the ledger's writer process: {error}"
                    ) from error
                logger.warning("%s: the ledger's writer process did not start (%s); "
                               "writing from a thread instead", self._label, error)
                channel = _ThreadChannel(self, thread_writer(), max_batch)
        else:
            channel = _ThreadChannel(self, thread_writer(), max_batch)
        self._channel = channel
        # A socket pair, not a pipe: `select` takes sockets everywhere.
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self._helper = threading.Thread(target=self._help, daemon=True,
                                        name=f"loopengine-ledger:{self._label}")
        self._helper.start()
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
        if self._channel is _NOT_STARTED:
            await self._open()
        self._defer(start_op(record))

    async def dispatch_attempt(self, record: AttemptDispatch) -> None:
        """Record an attempt as ``dispatched``; durable when this returns.

        Raises:
            LedgerError: the row could not be written (or an earlier deferred
                write of this invocation failed); the request must not be sent.
        """
        if self._channel is _NOT_STARTED:
            await self._open()
        await self._wait(self._send(dispatch_op(record)))

    def begin_dispatch(self, record: AttemptDispatch) -> Receipt:
        """Send an attempt's ``dispatched`` row to the writer and return at once.

        The request may go on the wire once the receipt's ``wait()`` returns;
        it raises `LedgerError` where `dispatch_attempt` would have.

        Raises:
            LedgerError: the ledger is closed.
        """
        if self._channel is _NOT_STARTED:
            # Not started yet: the receipt's wait starts it, then writes.
            return Receipt(functools.partial(self.dispatch_attempt, record))
        return Receipt(functools.partial(self._wait, self._send(dispatch_op(record))))

    async def settle_attempt(self, record: AttemptSettle) -> None:
        """Settle an attempt and add it to the invocation's totals, in one transaction.

        A settle that carries what the provider served (`AttemptSettle.served`)
        is durable when this returns; any other is committed with the next
        durable write (or after ``linger`` seconds).

        Raises:
            LedgerError: the ledger is closed, or the served settle (or an
                earlier deferred write of this invocation) could not be written.
        """
        op = settle_op(record)
        if self._channel is _NOT_STARTED:
            await self._open()
        if record.served:
            await self._wait(self._send(op))
        else:
            self._defer(op)

    async def end_invocation(self, record: InvocationEnd) -> None:
        """Settle the invocation with its outcome; everything before is durable on return.

        Raises:
            LedgerError: the row could not be written, or an earlier deferred
                write of this invocation failed.
        """
        if self._channel is _NOT_STARTED:
            await self._open()
        await self._wait(self._send(end_op(record)))

    # -- more than the protocol ------------------------------------------------------

    async def flush(self) -> None:
        """Wait until every write queued so far is committed.

        Raises:
            LedgerError: the ledger cannot be opened, or is closed.
        """
        if self._channel is _NOT_STARTED:
            await self._open()
        await self._wait(self._send([FLUSH, 0]))

    @property
    def writer(self) -> Literal["process", "thread"] | None:
        """Where the writer runs: a child ``process`` or a ``thread`` of this one
        (None until it starts: a `PostgresLedger` not opened yet)."""
        return self._channel.kind

    @property
    def writer_pid(self) -> int | None:
        """The writer process's id, or None when the writer is a thread."""
        process = getattr(self._channel, "process", None)
        return process.pid if process is not None else None

    @property
    def commits(self) -> int:
        """Transactions this ledger has committed (each one durable commit)."""
        return self._counts()[0]

    @property
    def writes(self) -> int:
        """Writes (starts, dispatches, settles, ends) this ledger has committed."""
        return self._counts()[1]

    def _counts(self) -> tuple[int, int]:
        """The commits and writes the writer has reported so far."""
        self._check_process()
        with self._lock:
            self._channel.poll()
            return self._commits, self._writes

    @property
    def closed(self) -> bool:
        """True once `close` has been called (or the writer is gone)."""
        return self._closed

    def close(self) -> None:
        """Commit what is queued, stop the writer and let go of the database.

        Blocks until the writer is done; from async code prefer `aclose`.
        Closing twice is harmless.
        """
        if self._forks != _forks or self._channel is _NOT_STARTED:
            self._closed = True  # (a forked copy: the process that opened it closes it)
            return
        with self._lock:
            if self._stopping:
                second = True
            else:
                second = False
                closing = not self._closed
                self._closed = True
                self._stopping = True
                if closing and self._broken is None:
                    self._next_id += 1
                    self._send_frames(_writer.op_frame(self._next_id, _STOP_OP))
        if second:
            # Another thread is closing it (the user's close beside atexit's):
            # return only once everything is committed, as that one will.
            self._closing.wait()
            return
        self._channel.join()
        self._wake_helper()
        self._helper.join()
        with self._lock:
            self._break("the ledger is closed")
        self._wake_r.close()
        self._wake_w.close()
        self._channel.release()
        _open_ledgers.discard(self)
        self._closing.set()

    async def aclose(self) -> None:
        """`close` in a worker thread, so the event loop keeps running meanwhile."""
        await anyio.to_thread.run_sync(self.close)

    async def __aenter__(self) -> PipedLedger:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # -- queueing ------------------------------------------------------------------

    def _check_process(self) -> None:
        # Before taking `_lock`: a fork may have copied it held. (A counter the
        # fork hook moves, not `os.getpid()`: that is a system call per write.)
        if self._forks != _forks:
            raise LedgerError(
                f"{self._label}: this ledger was opened in process {self._pid}; a forked "
                f"process must open its own {type(self).__name__}"
            )

    def _check(self) -> None:
        # Called holding `_lock`.
        if self._broken is not None:
            raise LedgerError(self._broken)
        if self._closed:
            raise LedgerError(f"{self._label}: the ledger is closed")

    def _encode(self, op: Op) -> bytes:
        """The op's frame data; a value that cannot be recorded is refused here,
        before the write is numbered, so it never holds up anyone else's."""
        try:
            return _writer.encode_op(op)
        except ValueError:
            pass
        try:
            # A subclass of str or int (an enum member, say) as its plain value.
            return _writer.encode_op([_plain(value) for value in op])
        except ValueError as error:
            raise LedgerError(f"{self._label}: a value of this write cannot be recorded "
                              f"({error}): {op!r}") from None

    def _numbered(self, data: bytes) -> bytes:
        """Check the ledger is open, number the encoded op ``data`` (`_encode`)
        and frame it. Called holding `_lock`."""
        self._check()
        self._next_id += 1
        self._activity = True
        return _writer.op_frame(self._next_id, data)

    def _defer(self, op: Op) -> None:
        data = self._encode(op)
        self._check_process()
        with self._lock:
            frame = self._numbered(data)
            if not self._linger:
                self._channel.send(frame)
                return
            if not self._deferred:
                self._deferred_since = time.monotonic()
                if self._helper_idle:
                    self._wake_helper()
            self._deferred += frame

    def _send(self, op: Op) -> int:
        """Send a durable write, and every deferred one before it; return its number."""
        data = self._encode(op)
        self._check_process()
        with self._lock:
            self._send_frames(self._numbered(data))
            return self._next_id

    def _send_frames(self, frame: bytes = b"") -> None:
        """Send the deferred writes, then ``frame``. Called holding `_lock`."""
        if self._deferred:
            frame = bytes(self._deferred) + frame
            self._deferred.clear()
        if frame:
            self._channel.send(frame)

    def _wake_helper(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # already woken, or closed

    # -- waiting -------------------------------------------------------------------

    async def _wait_for(self, number: int) -> None:
        self._check_process()
        channel = self._channel
        with self._lock:
            # The pipe is not read here: the write was sent a moment ago, so its
            # report is seldom there yet, and a read that finds nothing is a
            # system call per wait. What is there wakes the loop's watch of the
            # pipe at once (it reports readiness, not changes).
            if self._done >= number:
                return
            if self._broken is not None:
                raise LedgerError(self._broken)
            try:
                loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            waiter = _Waiter(loop)
            fd = channel.fileno()
            if loop is not None:
                count = self._readers.get(loop, 0)
                if count == 0 and fd is not None:
                    loop.add_reader(fd, self._readable)  # first: it may raise
                self._readers[loop] = count + 1
            else:
                self._watchers += 1
                if fd is not None:
                    self._wake_helper()
            self._sequence += 1
            heapq.heappush(self._waiters, (number, self._sequence, waiter))
        try:
            await waiter.wait()
        finally:
            with self._lock:
                waiter.gone = True
                if loop is not None:
                    count = self._readers[loop] - 1
                    if count:
                        self._readers[loop] = count
                    else:
                        del self._readers[loop]
                        if fd is not None:
                            # Also once the writer is gone: its pipe at its end
                            # would keep this loop waking up.
                            loop.remove_reader(fd)
                            if not self._readers:
                                channel.unwatched()
                else:
                    self._watchers -= 1
        if self._done < number:
            raise LedgerError(self._broken or f"{self._label}: the ledger is closed")

    def _readable(self) -> None:
        # An event loop saw the writer's pipe readable.
        with self._lock:
            self._channel.poll()

    def _report(self, done: int, refused: list[tuple[int, str]], commits: int,
                writes: int) -> None:
        """Take in what the writer reports after a commit. Called holding `_lock`."""
        for number, message in refused:
            self._refused[number] = message
        self._commits, self._writes = commits, writes
        if done > self._done:
            self._done = done
            self._release(done)

    def _break(self, reason: str) -> None:
        """The writer is gone: fail every waiter. Called holding `_lock`."""
        if self._broken is None:
            self._broken = f"{self._label}: {reason}"
            self._closed = True
        # Each woken waiter stops its loop's watch of the pipe as it returns.
        self._release(None)

    def _release(self, done: int | None) -> None:
        """Wake the waiters of writes up to ``done`` (all when None). Holding `_lock`."""
        release(self._waiters, done)

    # -- the helper thread ------------------------------------------------------------

    def _help(self) -> None:
        """Send deferred writes once they have lingered, write what the pipe did not
        take, and watch the writer's pipe for waiters of other event-loop backends."""
        try:
            self._help_loop()
        except BaseException as error:
            # Without its helper the ledger could strand a write: say so to
            # every caller rather than leave one waiting.
            with self._lock:
                self._break(f"the ledger's helper thread failed: {error!r}")
            raise

    def _help_loop(self) -> None:
        channel, linger = self._channel, self._linger
        while True:
            with self._lock:
                if self._stopping:
                    return
                timeout: float | None = None
                if self._deferred:
                    due = self._deferred_since + linger
                    now = time.monotonic()
                    if now >= due:
                        self._send_frames()
                        timeout = linger
                    else:
                        timeout = due - now
                elif self._activity and linger:
                    # Writes keep coming: look again after a linger instead of
                    # being woken by the next deferred write.
                    timeout = linger
                self._activity = False
                self._helper_idle = timeout is None
                channel.poll()  # keeps the writer's pipe from filling while nobody waits
                fd = channel.fileno()
                readable: list[Any] = [self._wake_r]
                if fd is not None and self._watchers:
                    readable.append(fd)
                writable = channel.blocked()
            ready, _, _ = select.select(readable, writable, [], timeout)
            if self._wake_r in ready:
                try:
                    self._wake_r.recv(512)
                except OSError:
                    pass
            with self._lock:
                self._helper_idle = False
                channel.poll()
                if writable:
                    channel.send(b"")


_STOP_OP: Final = _writer.encode_op([STOP, 0])


def _plain(value: Any) -> Any:
    """``value`` as the plain type `marshal` takes (an enum member as its value)."""
    if isinstance(value, str) and type(value) is not str:
        return str.__str__(value)
    if isinstance(value, int) and type(value) not in (int, bool):
        return int(value)
    if isinstance(value, float) and type(value) is not float:
        return float(value)
    return value


# -- the writer's two homes ---------------------------------------------------------------


class _Channel:
    """How writes reach the writer and its reports come back (called holding the
    ledger's lock, but for `join` and `release`)."""

    kind: Literal["process", "thread"] | None = None

    def send(self, frames: bytes) -> None:
        """Hand op frames to the writer (never blocks)."""
        raise LedgerError("the ledger's writer has not started")

    def poll(self) -> None:
        """Take in the reports that have arrived (never blocks)."""

    def fileno(self) -> int | None:
        """The pipe an event loop watches for reports, if there is one."""
        return None

    def blocked(self) -> list[int]:
        """The pipe to wait on for room, when sent writes are held back."""
        return []

    def unwatched(self) -> None:
        """No event loop watches `fileno` any more."""

    def join(self) -> None:
        """Wait for the writer to stop (after a STOP was sent, or its end)."""

    def release(self) -> None:
        """Close what is left once the writer has stopped."""

    def forget(self) -> None:
        """In a forked child: let go of the pipes without touching the writer."""


_NOT_STARTED: Final = _Channel()
"""The channel of a ledger whose writer has not started."""


class _ProcessChannel(_Channel):
    """The writer in a child process, spoken to through two pipes."""

    kind: Literal["process", "thread"] = "process"

    def __init__(self, ledger: PipedLedger, spec: WriterProcess, max_batch: int) -> None:
        self._ledger = ledger
        ops_read, ops_write = os.pipe()
        acks_read, acks_write = os.pipe()
        secret_read = secret_write = -1
        ours, theirs = [ops_write, acks_read], [ops_read, acks_write]
        argv = [sys.executable, "-I", *(() if spec.site else ("-S",)), spec.file,
                str(ops_read), str(acks_write), *spec.arguments]
        try:
            if spec.secret is not None:
                secret_read, secret_write = os.pipe()
                ours.append(secret_write)
                theirs.append(secret_read)
                argv.append(str(secret_read))
            self.process = subprocess.Popen(
                argv, pass_fds=theirs, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, close_fds=True,
            )
        except BaseException:
            for fd in ours + theirs:
                os.close(fd)
            raise
        # The child's ends are the child's alone: its input ends when ours closes.
        for fd in theirs:
            os.close(fd)
        if spec.secret is not None:
            try:
                os.write(secret_write, spec.secret)  # far less than a pipe holds
            except OSError:
                pass  # the child is gone already: the handshake says so
            os.close(secret_write)
        self._ops = ops_write
        self._acks = acks_read
        self._held = bytearray()
        """Frames the pipe did not take yet (the helper thread writes them)."""
        self._incoming = bytearray()
        self._ended = False
        self._released = False
        os.set_blocking(self._ops, False)
        try:
            self._handshake(spec.timeout)
        except BaseException:
            self.process.kill()
            self.process.wait()
            self.release()
            raise
        os.set_blocking(self._acks, False)

    def _handshake(self, timeout: float) -> None:
        path = self._ledger._label
        give_up = time.monotonic() + timeout
        while True:
            left = give_up - time.monotonic()
            if left <= 0:
                raise LedgerError(f"{path}: the ledger's writer process did not start within "
                                  f"{timeout:g}s")
            ready, _, _ = select.select([self._acks], [], [], left)
            if not ready:
                continue
            data = os.read(self._acks, 1 << 16)
            if not data:
                code = self.process.wait()
                raise LedgerError(f"{path}: the ledger's writer process exited with code "
                                  f"{code} before it started")
            self._incoming.extend(data)
            frames = _writer.unframe(self._incoming)
            if frames:
                first = frames[0]
                if first[0] == -1:
                    raise LedgerError(f"{path}: {first[1]}")
                return

    def send(self, frames: bytes) -> None:
        if self._ended:
            return
        if self._held:
            self._held += frames
            data: bytes | bytearray = self._held
        else:
            data = frames
        if not data:
            return
        try:
            written = os.write(self._ops, data)
        except BlockingIOError:
            written = 0
        except OSError as error:  # BrokenPipeError: the writer is gone
            self.poll()
            self._ledger._break(f"the ledger's writer process is gone ({error})")
            return
        if data is self._held:
            del self._held[:written]
        elif written < len(data):
            self._held += data[written:]
        if self._held:
            self._ledger._wake_helper()

    def poll(self) -> None:
        if self._ended:
            return
        while True:
            try:
                data = os.read(self._acks, _READ_SIZE)
            except BlockingIOError:
                break
            if not data:
                self._ended = True
                break
            self._incoming.extend(data)
            if len(data) < _READ_SIZE:
                break  # the pipe held less than asked: it is empty now
        ledger = self._ledger
        for report in _writer.unframe(self._incoming):
            if report[0] == -1:
                ledger._break(str(report[1]))
            else:
                ledger._report(*report)
        if self._ended:
            if ledger._stopping:
                ledger._break("the ledger is closed")
                return
            try:  # it closed its end: it is exiting, give it a moment to finish
                code: int | None = self.process.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                code = None
            ledger._break(f"the ledger's writer process exited (code {code})")

    def fileno(self) -> int | None:
        return None if self._ended else self._acks

    def blocked(self) -> list[int]:
        return [self._ops] if self._held and not self._ended else []

    def unwatched(self) -> None:
        if self._released:
            self._close_acks()

    def join(self) -> None:
        # Read reports (and write what is held back) until the writer's end.
        while True:
            with self._ledger._lock:
                self.send(b"")
                self.poll()
                if self._ended:
                    break
                writable = self.blocked()
            select.select([self._acks], writable, [], 1.0)
        self.process.wait()

    def release(self) -> None:
        self._released = True
        _close(self._ops)
        if not self._ledger._readers:
            # A loop still watching the pipe removes its watch by number when
            # its call returns (`unwatched`): until then the number must not
            # go to another file.
            self._close_acks()

    def _close_acks(self) -> None:
        if self._acks >= 0:
            _close(self._acks)
            self._acks = -1

    def forget(self) -> None:
        self._ended = True
        self._held.clear()
        _close(self._ops)
        self._close_acks()


class _ThreadChannel(_Channel):
    """The writer in a thread of this process (fed the same frames)."""

    kind: Literal["process", "thread"] = "thread"

    def __init__(self, ledger: PipedLedger, writer: Writer, max_batch: int) -> None:
        self._ledger = ledger
        self._max_batch = max_batch
        self._frames = bytearray()
        self._next_op = 1
        self._signalled = False
        self._signal: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._writer = writer
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"loopengine-writer:{ledger._label}")
        self._thread.start()

    def send(self, frames: bytes) -> None:
        if frames:
            self._frames += frames
            if not self._signalled:
                self._signalled = True
                self._signal.put(None)

    def join(self) -> None:
        self._thread.join()

    def _run(self) -> None:
        ledger, writer = self._ledger, self._writer
        try:
            while True:
                self._signal.get()
                corrupt: _writer.StreamError | None = None
                with ledger._lock:
                    try:
                        ops = _writer.unframe_ops(self._frames, self._next_op)
                    except _writer.StreamError as error:
                        ops, corrupt = error.ops, error
                    self._signalled = False
                if ops:
                    self._next_op = ops[-1][1] + 1
                    refused = _writer.run_batches(writer, ops, self._max_batch)
                    with ledger._lock:
                        ledger._report(ops[-1][1], refused, writer.commits, writer.writes)
                if corrupt is not None:
                    # What came before is committed; what follows cannot be read.
                    with ledger._lock:
                        ledger._break(str(corrupt))
                    return
                if not ops:
                    continue
                if any(op[0] == STOP for op in ops):
                    return
                writer.maybe_checkpoint(lambda: bool(self._frames))
        except BaseException as error:
            # A bug here must not leave callers waiting forever.
            with ledger._lock:
                ledger._break(f"the ledger's writer failed: {error!r}")
            raise
        finally:
            writer.close()


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


_open_ledgers: weakref.WeakSet[PipedLedger] = weakref.WeakSet()


@atexit.register
def _close_open_ledgers() -> None:
    # Commits what is still queued before the interpreter stops.
    for ledger in list(_open_ledgers):
        try:
            ledger.close()
        except Exception:  # exiting anyway, with nobody to report to
            pass


_forks = 0
"""Forks this process has come from (moved by `_forget_in_child`)."""
_READ_SIZE: Final = 1 << 16


def _forget_in_child() -> None:
    # A forked child must not hold the writer's pipe open: the writer stops at
    # the end of its input, once the process that opened the ledger is gone.
    # Its copy of the ledger refuses every call (`_check_process`), and gets a
    # fresh lock in case the fork copied the old one held.
    global _forks
    _forks += 1
    for ledger in list(_open_ledgers):
        ledger._lock = threading.Lock()
        ledger._channel.forget()
    _open_ledgers.clear()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_forget_in_child)
