"""The ledger's writer: the one connection that commits what `SQLiteLedger` queues.

`SQLiteLedger` runs this in a child process of its own (or, where that cannot
be, in a thread). In a process the writer holds its own interpreter lock: its
planning, its statements and its fsyncs run beside the event loop instead of
taking turns with it, and an attempt's commit overlaps the building of its
request. The child runs this file by path (``python -I -S _writer.py ...``)
without importing loopengine, so it uses the standard library only (and the
planner, ``_planner.py`` beside it, loaded by its path).

The writes arrive as *ops* (`_planner`): flat lists ``[kind, op_id, *fields]``
of plain values (text, integers, None), numbered by the ledger in the order it
queued them. The writer takes whatever has arrived into one ``BEGIN IMMEDIATE``
transaction (group commit), has the planner check each op against what it
knows of its invocation (the ledger's rules are the planner's, shared with
`PostgresLedger`; this file supplies SQLite's statements), and reports,
after the commit, the highest op id it has finished and the durable ops it
refused. Between processes both travel through pipes as frames of `marshal`
data: an op frame is its data's length and the op's id (``<IQ``), then the op
with 0 in place of its id (so the ledger can encode an op, and refuse one that
cannot be encoded, before it numbers it); a report frame is its data's length
(``<I``), then the report. Op ids run
1, 2, 3... in the order the frames are sent; the writer checks each one, so a
stream that lost its framing stops with `StreamError` instead of waiting for
a frame that never ends.
"""

from __future__ import annotations

import marshal
import os
import select
import signal
import sqlite3
import struct
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING or __package__:
    from loopengine.persistence import _planner
else:
    # Run by path as the ledger's writer process (`main`), where loopengine is
    # not importable: load the planner beside this file by its path.
    import importlib.util

    def _load_sibling(name: str) -> Any:
        spec = importlib.util.spec_from_file_location(
            name, os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up by name
        spec.loader.exec_module(module)
        return module

    _planner = _load_sibling("_planner")

# The ops, their kinds and fields, and the rules they are written under are
# the planner's (shared with every store); this file supplies SQLite's
# statements, its transaction and the child process.
START, DISPATCH, SETTLE, END, FLUSH, STOP = (_planner.START, _planner.DISPATCH, _planner.SETTLE,
                                             _planner.END, _planner.FLUSH, _planner.STOP)
Op = _planner.Op
Refused = _planner.Refused
INVOCATION_INSERT, ATTEMPT_INSERT = _planner.INVOCATION_INSERT, _planner.ATTEMPT_INSERT
ATTEMPT_SETTLE, END_SET = _planner.ATTEMPT_SETTLE, _planner.END_SET

# Increments, never absolute values: correct whoever else wrote the row.
_ADD = tuple(f"{c} = MAX({c}, {{}})" if n == _planner.INCOMPLETE else f"{c} = {c} + {{}}"
             for n, c in enumerate(_planner.DELTA_COLUMNS))

# UPDATE ... FROM (3.33) lets one statement update many rows.
_UPDATE_FROM = sqlite3.sqlite_version_info >= (3, 33, 0)
_LARGEST_CHUNK = 1024
_WIDTH = {"start": len(INVOCATION_INSERT), "dispatch": len(ATTEMPT_INSERT),
          "settle": len(ATTEMPT_SETTLE) + 2, "add": len(_ADD) + 1, "end": len(END_SET) + 1}

_HEADER = struct.Struct("<I")
_OP_HEADER = struct.Struct("<IQ")
# What a pipe holds at most (Linux's default): a larger read would return no
# more, and a buffer past malloc's mmap threshold costs an mmap and munmap
# (a TLB shootdown with the checkpoint thread alive) on every wake-up.
_READ_SIZE = 1 << 16


# -- frames ----------------------------------------------------------------------------


def frame(value: Any) -> bytes:
    """``value`` as one report frame: its marshalled length, then the data."""
    data = marshal.dumps(value)
    return _HEADER.pack(len(data)) + data


def unframe(buffer: bytearray) -> list[Any]:
    """Take every complete report frame off the front of ``buffer``."""
    values = []
    start, end = 0, len(buffer)
    while end - start >= 4:
        (size,) = _HEADER.unpack_from(buffer, start)
        if end - start - 4 < size:
            break
        values.append(marshal.loads(bytes(buffer[start + 4:start + 4 + size])))
        start += 4 + size
    del buffer[:start]
    return values


def encode_op(op: Op) -> bytes:
    """The data of an op frame (its id is sent apart, in `op_frame`).

    Raises:
        ValueError: a field is not a plain value (text, integer, float, None).
    """
    return marshal.dumps(op)


def op_frame(op_id: int, data: bytes) -> bytes:
    """An op frame: the encoded op (`encode_op`) under its id."""
    return _OP_HEADER.pack(len(data), op_id) + data


class StreamError(Exception):
    """The op stream lost its framing: an op's id is not the next one. Nothing
    from there on can be trusted (a torn write would otherwise leave the writer
    waiting for a frame that never ends).

    Attributes:
        ops: The complete ops before the break, still good to commit.
    """

    def __init__(self, message: str, ops: list[Op]) -> None:
        super().__init__(message)
        self.ops = ops


def unframe_ops(buffer: bytearray, expected: int) -> list[Op]:
    """Take every complete op frame off the front of ``buffer``, ids filled in.

    Ops are numbered one by one; ``expected`` is the id of the first one due.

    Raises:
        StreamError: an op header carries another id than the one due.
    """
    ops: list[Op] = []
    start, end, header = 0, len(buffer), _OP_HEADER.size
    try:
        while end - start >= header:
            size, op_id = _OP_HEADER.unpack_from(buffer, start)
            if op_id != expected:
                raise StreamError(f"the ledger's op stream is corrupt: op {op_id} arrived "
                                  f"where op {expected} was due", ops)
            if end - start - header < size:
                break
            op = marshal.loads(bytes(buffer[start + header:start + header + size]))
            op[1] = op_id
            ops.append(op)
            expected += 1
            start += header + size
    finally:
        del buffer[:start]
    return ops


# -- the SQL -----------------------------------------------------------------------------


class _Statements:
    """The SQL of each write, for one row or many rows at once.

    One statement carries all the rows of a kind because the sqlite3 module
    releases the interpreter lock around every step: row by row
    (``executemany``) a writer thread would wait for the lock once per row
    while the event loop holds it, and one statement waits once. Statements
    are built for a few row counts (`_padded`), the rows padded with NULL keys
    that match nothing, so the distinct statements stay prepared in the
    connection's cache. One row, the sequential path's usual case, takes the
    plain statement and its own parameters as they are.
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

    def run(self, kind: str, rows: list[Sequence[Any]]) -> int:
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
        table, columns = (("invocations", INVOCATION_INSERT) if kind == "start"
                          else ("attempts", ATTEMPT_INSERT))
        if rows == 1:
            return f"INSERT INTO {table} ({', '.join(columns)}) VALUES {values}"
        return (f"INSERT INTO {table} ({', '.join(columns)}) "
                f"SELECT * FROM (VALUES {values}) WHERE column1 IS NOT NULL")
    if kind == "settle":
        if rows == 1:
            sets = ", ".join(f"{c} = ?" for c in ATTEMPT_SETTLE)
            return (f"UPDATE attempts SET {sets} WHERE invocation_id = ? AND ordinal = ? "
                    "AND outcome = 'dispatched'")
        sets = ", ".join(f"{c} = v.column{i + 1}" for i, c in enumerate(ATTEMPT_SETTLE))
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
        return f"UPDATE invocations SET {', '.join(f'{c} = ?' for c in END_SET)} WHERE id = ?"
    sets = ", ".join(f"{c} = v.column{i + 1}" for i, c in enumerate(END_SET))
    return (f"UPDATE invocations SET {sets} FROM (VALUES {values}) AS v "
            f"WHERE invocations.id = v.column{width}")


# -- the writer ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Settings:
    """How the writer behaves (sent to a child process as a tuple)."""

    path: str
    max_retained: int
    busy_timeout: float
    checkpoint_commits: int
    """A checkpoint is due after this many commits..."""
    checkpoint_writes: int
    """...or this many writes, whichever comes first."""


class Writer(_planner.Counted):
    """The connection that turns ops into rows: SQLite's `_planner.Store`.

    Not thread-safe: one thread (of the ledger's process, or of its child)
    calls it. `open` raises `sqlite3.Error` or `Refused`; `commit` never raises
    for a write it refuses: it reports it.
    """

    errors: tuple[type[BaseException], ...] = (sqlite3.Error, OverflowError, TypeError,
                                               ValueError)
    """A database error, or a value SQLite cannot bind (an integer past 64 bits):
    the same path, so one bad write never sinks the others."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.path = settings.path
        self.name = settings.path
        self._planner = _planner.Planner(self, settings.max_retained)
        self._uncheckpointed = self._uncheckpointed_writes = 0
        self._conn: sqlite3.Connection | None = None
        self._statements: _Statements | None = None
        self._checkpointer: _Checkpointer | None = None

    def open(self) -> None:
        """Connect with the ledger's settings (the schema is already current)."""
        s = self.settings
        conn = sqlite3.connect(s.path, timeout=s.busy_timeout, isolation_level=None,
                               cached_statements=512, check_same_thread=False)
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(s.busy_timeout * 1000)}")
            mode = str(conn.execute("PRAGMA journal_mode").fetchone()[0])
            if mode != "wal":
                raise Refused(f"{s.path}: the ledger needs WAL journaling, and this "
                              f"database reports journal_mode={mode}")
            # FULL: in WAL mode NORMAL may lose the last commits on power loss,
            # and a billing record must not.
            conn.execute("PRAGMA synchronous = FULL")
            # Checkpoints are made between commits (`checkpoint`), never inside one.
            conn.execute("PRAGMA wal_autocheckpoint = 0")
            # Foreign keys stay declared but unenforced: the writer already
            # refuses an attempt of an invocation it does not know, and the
            # per-row parent lookup would cost every insert.
            self._statements = _Statements(conn)
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        self._checkpointer = _Checkpointer(s.path, s.busy_timeout)

    def close(self) -> None:
        """Stop the checkpointer and close the connection (it checkpoints what is left)."""
        if self._checkpointer is not None:
            self._checkpointer.stop()
        if self._conn is not None:
            self._conn.close()

    # -- committing ---------------------------------------------------------------------

    def commit(self, ops: Sequence[Op]) -> list[tuple[int, str]]:
        """Write ``ops`` in one transaction (on a database error, each on its own).

        Returns:
            The durable ops refused, as ``(op_id, message)``.
        """
        commits, writes = self.commits, self.writes
        refused = self._planner.commit(ops)
        self._uncheckpointed += self.commits - commits
        self._uncheckpointed_writes += self.writes - writes
        return refused

    # -- the store the planner writes through -----------------------------------------

    def begin(self) -> None:
        """``BEGIN IMMEDIATE``: the write lock up front, so the busy handler applies."""
        assert self._statements is not None
        self._statements.cursor.execute("BEGIN IMMEDIATE")

    def load(self, invocation_id: str) -> _planner.Known | None:
        """The committed state of an invocation another ledger started (or forgotten)."""
        conn = self._conn
        assert conn is not None
        return _planner.read_known(
            lambda sql: conn.execute(sql.format("?"), (invocation_id,)).fetchall())

    def execute(self, batch: _planner.Batch) -> None:
        """Write the batch, each kind of row in one statement."""
        assert self._statements is not None
        _planner.execute(batch, self._statements.run)

    def finish(self) -> None:
        """``COMMIT`` (``synchronous=FULL``: on disk when it returns)."""
        assert self._statements is not None
        self._statements.cursor.execute("COMMIT")

    def abort(self) -> None:
        """Roll back the transaction, if one is open."""
        assert self._conn is not None
        if self._conn.in_transaction:
            self._conn.execute("ROLLBACK")

    def isolates(self, error: BaseException) -> bool:
        """Every failure inside the transaction is worth retrying write by write."""
        return True

    def maybe_checkpoint(self, waiting: Callable[[], bool]) -> None:
        """After a commit: copy the WAL back into the database if that is due.

        ``waiting()`` tells whether writes are already waiting. When none is,
        the checkpoint is made here, between two of the writer's own commits:
        it reaches the end of the WAL (unless another process's reader holds
        it back), so the next commit starts the WAL over and rewrites it in
        place instead of appending to an ever larger file. While writes keep
        coming it is put off, up to four times the allowance, and then left to
        the checkpointer's thread (which seldom catches up with the last
        commit while commits keep coming, hence the preference for here).
        """
        s = self.settings
        commits, writes = self._uncheckpointed, self._uncheckpointed_writes
        if commits < s.checkpoint_commits and writes < s.checkpoint_writes:
            return
        if not waiting():
            self._uncheckpointed = self._uncheckpointed_writes = 0
            assert self._conn is not None
            try:
                self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
            except sqlite3.Error:
                pass  # a checkpoint is an optimisation; the next one retries
        elif commits >= 4 * s.checkpoint_commits or writes >= 4 * s.checkpoint_writes:
            self._uncheckpointed = self._uncheckpointed_writes = 0
            assert self._checkpointer is not None
            self._checkpointer.poke()


class _Checkpointer:
    """Copies the WAL back into the database, off the writer's path.

    The writer pokes it when a checkpoint is overdue while writes keep
    arriving (otherwise the writer checkpoints itself). A passive checkpoint
    never blocks writers or readers; it copies what no reader still needs, at
    most every ``interval`` seconds.
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


# -- the child process ----------------------------------------------------------------


def run_batches(writer: Any, ops: list[Op], max_batch: int) -> list[tuple[int, str]]:
    """Commit ``ops`` in transactions of at most ``max_batch``; return the refused
    durable ops."""
    refused: list[tuple[int, str]] = []
    for start in range(0, len(ops), max_batch):
        refused += writer.commit(ops[start:start + max_batch])
    return refused


def ignore_terminal_signals() -> None:
    """Terminal signals go to the whole process group: a writer process outlives
    them so that the ledger can still commit and stop it in order."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)


def refuse_to_start(acks_fd: int, message: str) -> int:
    """Say why the writer could not open (one ``(-1, message)`` frame); the exit code."""
    os.write(acks_fd, frame((-1, message)))
    return 1


def serve_process(settings: Settings, max_batch: int, ops_fd: int, acks_fd: int) -> int:
    """The child process of `SQLiteLedger`: open the file's writer, then `serve`."""
    ignore_terminal_signals()
    writer = Writer(settings)
    try:
        writer.open()
    except (sqlite3.Error, Refused) as error:
        return refuse_to_start(acks_fd, f"cannot open the ledger: {error}")
    return serve(writer, max_batch, ops_fd, acks_fd)


def serve(writer: Any, max_batch: int, ops_fd: int, acks_fd: int) -> int:
    """A writer process's loop, for any store's writer (opened already): read op
    frames, commit them, answer with ack frames.

    An ack is ``(done_through, refused, commits, writes)`` after each commit;
    the first one, ``(0, [], 0, 0)``, says the writer is open. A failure to
    open (`refuse_to_start`, or any later failure of the writer itself) is one
    frame ``(-1, message)`` before the process exits. The writer stops after a
    STOP op or at the end of its input (the ledger's process ended, however
    it ended), having committed everything it received.
    """
    os.set_blocking(acks_fd, False)
    # Acks the ledger has not read yet wait here, in order, rather than block
    # the writer; it looks for room whenever it waits for ops.
    pending = bytearray(frame((0, [], 0, 0)))
    _send_pending(acks_fd, pending)
    buffer = bytearray()
    next_op = 1
    ended = False
    code = 0
    try:
        while not ended:
            # One blocking read returns whatever the pipe holds (a system call
            # per wake-up); only with acks held back does it wait on both.
            if not pending or select.select([ops_fd], [acks_fd], [])[0]:
                data = os.read(ops_fd, _READ_SIZE)
                if data:
                    buffer.extend(data)
                else:
                    ended = True
            corrupt: StreamError | None = None
            try:
                ops = unframe_ops(buffer, next_op)
            except StreamError as error:
                ops, corrupt = error.ops, error
            if ops:
                refused = run_batches(writer, ops, max_batch)
                pending.extend(frame((ops[-1][1], refused, writer.commits, writer.writes)))
                ended = ended or any(op[0] == STOP for op in ops)
                next_op = ops[-1][1] + 1
            if corrupt is not None:
                # What came before is committed; what follows cannot be read.
                pending.extend(frame((-1, str(corrupt))))
                code = 1
                break
            if pending:
                _send_pending(acks_fd, pending)
            if not ended:
                writer.maybe_checkpoint(lambda: bool(select.select([ops_fd], [], [], 0)[0]))
    except BaseException as error:  # a bug: say so rather than leave waiters hanging
        pending.extend(frame((-1, f"the ledger's writer failed: {error!r}")))
        raise
    finally:
        writer.close()
        if pending:
            os.set_blocking(acks_fd, True)
            try:
                os.write(acks_fd, pending)
            except OSError:
                pass  # the ledger's process is gone: nobody is left to tell
    return code


def _send_pending(fd: int, pending: bytearray) -> None:
    """Write what the pipe takes of ``pending``."""
    try:
        written = os.write(fd, pending)
    except BlockingIOError:
        return
    except BrokenPipeError:
        # The ledger's process is gone; its input will end too.
        written = len(pending)
    del pending[:written]


def main(argv: list[str]) -> int:
    """``_writer.py OPS_FD ACKS_FD SETTINGS``: run as the ledger's child process."""
    ops_fd, acks_fd = int(argv[1]), int(argv[2])
    values = marshal.loads(bytes.fromhex(argv[3]))
    max_batch = values[-1]
    return serve_process(Settings(*values[:-1]), max_batch, ops_fd, acks_fd)


def settings_argument(settings: Settings, max_batch: int) -> str:
    """``settings`` and ``max_batch`` as the command-line argument `main` reads."""
    return marshal.dumps((settings.path, settings.max_retained, settings.busy_timeout,
                          settings.checkpoint_commits, settings.checkpoint_writes,
                          max_batch)).hex()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
