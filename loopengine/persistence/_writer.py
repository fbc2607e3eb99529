"""The ledger's writer: the one connection that commits what `SQLiteLedger` queues.

`SQLiteLedger` runs this in a child process of its own (or, where that cannot
be, in a thread). In a process the writer holds its own interpreter lock: its
planning, its statements and its fsyncs run beside the event loop instead of
taking turns with it, and an attempt's commit overlaps the building of its
request. The child runs this file by path (``python -I -S _writer.py ...``)
without importing loopengine, so it uses the standard library only.

The writes arrive as *ops*: flat lists ``[kind, op_id, *fields]`` of plain
values (text, integers, None), numbered by the ledger in the order it queued
them. The writer takes whatever has arrived into one ``BEGIN IMMEDIATE``
transaction (group commit), checks each op against what it knows of its
invocation, and reports, after the commit, the highest op id it has finished
and the durable ops it refused. Between processes both travel through pipes
as frames of `marshal` data: an op frame is its data's length and the op's
id (``<IQ``), then the op with 0 in place of its id (so the ledger can encode
an op, and refuse one that cannot be encoded, before it numbers it); a
report frame is its data's length (``<I``), then the report. Op ids run
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
from dataclasses import dataclass, field
from typing import Any, Final

# Op kinds. START is deferred (nobody waits for it), and so is a SETTLE of
# nothing served; the others are durable: somebody waits until they are
# committed.
START: Final = 0
DISPATCH: Final = 1
SETTLE: Final = 2
END: Final = 3
FLUSH: Final = 4
STOP: Final = 5

Op = list[Any]
"""``[kind, op_id, *fields]``; the fields of each kind are listed below."""

# (START, op_id, id, operation, operation_version, provider, model, tenant,
#  user_id, feature, correlation_id, started_at)
INVOCATION_INSERT: Final = ("id", "operation", "operation_version", "provider", "model",
                            "tenant", "user_id", "feature", "correlation_id", "started_at")
# (DISPATCH, op_id, invocation_id, ordinal, turn, attempt, phase, served_by,
#  started_at, max_tokens, timeout_ms, wait_ms)
ATTEMPT_INSERT: Final = ("invocation_id", "ordinal", "turn", "attempt", "phase", "served_by",
                         "started_at", "max_tokens", "timeout_ms", "wait_ms")
# (SETTLE, op_id, invocation_id, ordinal, *ATTEMPT_SETTLE): the five token
# counts are None when the attempt reported no usage.
ATTEMPT_SETTLE: Final = ("outcome", "latency_ms", "fault", "aborted_reason", "http_status",
                         "error_code", "input_tokens", "output_tokens", "cache_read_tokens",
                         "cache_write_tokens", "cache_write_1h_tokens", "usage_approx",
                         "cost_nanousd", "charged", "price_ref", "response_id", "request_id",
                         "stop_reason")
# (END, op_id, id, *END_SET)
END_SET: Final = ("ended_at", "outcome", "turns", "tool_calls", "credits")
# (FLUSH, op_id) and (STOP, op_id) carry nothing.

# Increments, never absolute values: correct whoever else wrote the row.
_ADD = ("attempt_count = attempt_count + {}", "attempts_retained = attempts_retained + {}",
        "incomplete = MAX(incomplete, {})", "input_tokens = input_tokens + {}",
        "output_tokens = output_tokens + {}", "cache_read_tokens = cache_read_tokens + {}",
        "cache_write_tokens = cache_write_tokens + {}",
        "cache_write_1h_tokens = cache_write_1h_tokens + {}",
        "cost_nanousd = cost_nanousd + {}",
        "provider_cost_nanousd = provider_cost_nanousd + {}")
# Deltas of one invocation within a batch, in `_ADD` order.
_D_COUNT, _D_RETAINED, _D_INCOMPLETE = 0, 1, 2
_D_INPUT, _D_COST, _D_PROVIDER_COST = 3, 8, 9
_D_WIDTH = 10

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


class Refused(Exception):
    """A write the writer will not make (its message says why)."""


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


@dataclass(slots=True)
class _Live:
    """What the writer knows of an invocation it writes."""

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

    starts: list[Sequence[Any]] = field(default_factory=list)
    dispatches: list[Sequence[Any]] = field(default_factory=list)
    settles: list[Sequence[Any]] = field(default_factory=list)
    deltas: dict[str, list[int]] = field(default_factory=dict)
    ends: list[Sequence[Any]] = field(default_factory=list)
    touched: set[str] = field(default_factory=set)
    """Invocations whose `_Live` this batch changed (forgotten if it rolls back)."""
    refused: list[tuple[int, str]] = field(default_factory=list)
    """Durable ops refused while planning: ``(op_id, message)``."""
    planned: int = 0
    """Writes accepted into this batch."""


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


class Writer:
    """The connection and the bookkeeping that turns ops into rows.

    Not thread-safe: one thread (of the ledger's process, or of its child)
    calls it. `open` raises `sqlite3.Error` or `Refused`; `commit` never raises
    for a write it refuses: it reports it.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.path = settings.path
        self.commits = 0
        """Transactions committed (one fsync each)."""
        self.writes = 0
        """Ops committed (starts, dispatches, settles, ends)."""
        self._live: dict[str, _Live] = {}
        self._failed: dict[str, str] = {}
        """Invocations whose deferred write was refused: their next writes are too."""
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
        conn, statements = self._conn, self._statements
        assert conn is not None and statements is not None
        batch = _Batch()
        began = False
        try:
            cursor = statements.cursor
            cursor.execute("BEGIN IMMEDIATE")
            began = True
            self._plan(batch, ops)
            self._execute(batch)
            cursor.execute("COMMIT")
        except (sqlite3.Error, OverflowError, TypeError, ValueError) as error:
            # A database error, or a value SQLite cannot bind (an integer past
            # 64 bits): the same path, so one bad write never sinks the others.
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            # Forget what this batch taught the writer: the next write to
            # those invocations reads their committed state again.
            for invocation_id in batch.touched:
                self._live.pop(invocation_id, None)
            if began and len(ops) > 1:
                # Isolate the write that failed so the others still land.
                refused: list[tuple[int, str]] = []
                for op in ops:
                    refused += self.commit([op])
                return refused
            # A single write failed, or the write lock could not be had within
            # the busy timeout (retrying each write would wait that long again).
            failed = _Batch()
            for op in ops:
                self._refuse(op, f"{self.path}: {_describe(op)} failed: {error}", failed)
            return failed.refused
        self.commits += 1
        self.writes += batch.planned
        self._uncheckpointed += 1
        self._uncheckpointed_writes += batch.planned
        return batch.refused

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

    def _refuse(self, op: Op, message: str, batch: _Batch) -> None:
        kind = op[0]
        if kind in (START, SETTLE):
            # A deferred write may have nobody awaiting it: its invocation's
            # next durable write reports the failure, and nothing more is
            # written for it.
            self._failed.setdefault(op[2], message)
        if kind != START:
            # A settle of what the provider served is awaited: report it too.
            batch.refused.append((op[1], message))

    # -- planning: check each op against what is known and turn it into rows ------

    def _plan(self, batch: _Batch, ops: Sequence[Op]) -> None:
        failed = self._failed
        for op in ops:
            kind = op[0]
            if kind >= FLUSH:
                continue
            try:
                if failed:
                    message = failed.get(op[2])
                    if message is not None:
                        raise Refused(message)
                if kind == SETTLE:
                    self._plan_settle(batch, op)
                elif kind == DISPATCH:
                    self._plan_dispatch(batch, op)
                elif kind == START:
                    self._plan_start(batch, op)
                else:
                    self._plan_end(batch, op)
            except Refused as refusal:
                self._refuse(op, str(refusal), batch)
                continue
            batch.planned += 1

    def _touch(self, batch: _Batch, invocation_id: str) -> _Live:
        batch.touched.add(invocation_id)
        live = self._live.get(invocation_id)
        if live is not None and not live.ended:
            return live
        if live is None:
            # Not started by this ledger (or forgotten after a rollback): read
            # its committed state.
            assert self._conn is not None
            row = self._conn.execute(
                "SELECT attempts_retained, outcome FROM invocations WHERE id = ?",
                (invocation_id,),
            ).fetchone()
            if row is None:
                raise Refused(f"{self.path}: no invocation {invocation_id}")
            unsettled = self._conn.execute(
                "SELECT ordinal FROM attempts WHERE invocation_id = ? AND outcome = 'dispatched'",
                (invocation_id,),
            ).fetchall()
            live = _Live(int(row[0]), {int(r[0]) for r in unsettled}, None,
                         ended=row[1] != "running")
            self._live[invocation_id] = live
        if live.ended:
            raise Refused(f"{self.path}: invocation {invocation_id} has already ended")
        return live

    def _plan_start(self, batch: _Batch, op: Op) -> None:
        invocation_id = op[2]
        if invocation_id in self._live:
            raise Refused(f"{self.path}: invocation {invocation_id} already exists")
        batch.touched.add(invocation_id)
        self._live[invocation_id] = _Live(0)
        batch.starts.append(op[2:])

    def _deltas(self, batch: _Batch, invocation_id: str) -> list[int]:
        deltas = batch.deltas.get(invocation_id)
        if deltas is None:
            deltas = batch.deltas[invocation_id] = [0] * _D_WIDTH
        return deltas

    def _plan_dispatch(self, batch: _Batch, op: Op) -> None:
        invocation_id, ordinal = op[2], op[3]
        live = self._touch(batch, invocation_id)
        overflow = live.overflow
        if ordinal in live.unsettled or (overflow is not None and ordinal in overflow):
            raise Refused(
                f"{self.path}: attempt {ordinal} of {invocation_id} is already dispatched")
        deltas = self._deltas(batch, invocation_id)
        deltas[_D_COUNT] += 1
        if live.retained >= self.settings.max_retained:
            # R07: past the cap an attempt is counted, not kept.
            deltas[_D_INCOMPLETE] = 1
            if overflow is not None:
                overflow.add(ordinal)
            return
        live.retained += 1
        live.unsettled.add(ordinal)
        deltas[_D_RETAINED] += 1
        batch.dispatches.append(op[2:])

    def _plan_settle(self, batch: _Batch, op: Op) -> None:
        invocation_id, ordinal = op[2], op[3]
        live = self._touch(batch, invocation_id)
        if ordinal in live.unsettled:
            live.unsettled.discard(ordinal)
            retained = True
        elif live.overflow is None or ordinal in live.overflow:
            if live.overflow is not None:
                live.overflow.discard(ordinal)
            retained = False
        else:
            raise Refused(
                f"{self.path}: attempt {ordinal} of {invocation_id} was not dispatched "
                "or is already settled")
        deltas = self._deltas(batch, invocation_id)
        # op[4:] is ATTEMPT_SETTLE: tokens at 10..14, cost at 16, charged at 17.
        if op[10] is not None:
            for index in range(5):
                deltas[_D_INPUT + index] += op[10 + index]
        cost = op[16]
        if cost is not None:
            # S01: every priced attempt is what the provider may bill; only
            # the charged (successful) ones are what the run costs.
            deltas[_D_PROVIDER_COST] += cost
            if op[17]:
                deltas[_D_COST] += cost
        if retained:
            batch.settles.append((*op[4:], invocation_id, ordinal))

    def _plan_end(self, batch: _Batch, op: Op) -> None:
        invocation_id = op[2]
        live = self._touch(batch, invocation_id)
        live.ended = True
        batch.ends.append((*op[3:], invocation_id))

    def _execute(self, batch: _Batch) -> None:
        statements = self._statements
        assert statements is not None
        run = statements.run
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


def _describe(op: Op) -> str:
    kind = op[0]
    if kind == START:
        return f"starting invocation {op[2]}"
    if kind == DISPATCH:
        return f"dispatching attempt {op[3]} of {op[2]}"
    if kind == SETTLE:
        return f"settling attempt {op[3]} of {op[2]}"
    if kind == END:
        return f"ending invocation {op[2]}"
    return "committing"


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


def run_batches(writer: Writer, ops: list[Op], max_batch: int) -> list[tuple[int, str]]:
    """Commit ``ops`` in transactions of at most ``max_batch``; return the refused
    durable ops."""
    refused: list[tuple[int, str]] = []
    for start in range(0, len(ops), max_batch):
        refused += writer.commit(ops[start:start + max_batch])
    return refused


def serve_process(settings: Settings, max_batch: int, ops_fd: int, acks_fd: int) -> int:
    """The child process: read op frames, commit them, answer with ack frames.

    An ack is ``(done_through, refused, commits, writes)`` after each commit;
    the first one, ``(0, [], 0, 0)``, says the writer is open. A failure to
    open (or any later failure of the writer itself) is one frame
    ``(-1, message)`` before the process exits. The writer stops after a STOP
    op or at the end of its input (the ledger's process ended, however it
    ended), having committed everything it received.
    """
    # Terminal signals go to the whole process group: the writer outlives
    # them so that the ledger can still commit and stop it in order.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    writer = Writer(settings)
    try:
        writer.open()
    except (sqlite3.Error, Refused) as error:
        os.write(acks_fd, frame((-1, f"cannot open the ledger: {error}")))
        return 1
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
