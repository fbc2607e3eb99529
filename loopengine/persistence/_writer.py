"""SQLite's writer: the one connection that commits what `SQLiteLedger` queues.

The ledger's writer thread (`_threaded`) hands it whatever has queued; it
takes that into one ``BEGIN IMMEDIATE`` transaction (group commit), has the
planner check each op against what it knows of its invocation (the ledger's
rules are the planner's, shared with `PostgresLedger`; this file supplies
SQLite's statements and transaction), and reports the durable ops it refused.
Between batches it runs the other transactions of the file (the credit
accounts'), and checkpoints the WAL when that is due.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Sequence
from typing import Any, Final

from loopengine.persistence import _planner
from loopengine.persistence._planner import Refused
from loopengine.persistence._threaded import Writer as _Writer

_LARGEST_CHUNK = 1024


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
        width = max(map(len, _planner.ROW_COLUMNS.values()))
        while chunk * 2 <= min(_LARGEST_CHUNK, variable_limit // width):
            chunk *= 2
        self.largest = chunk
        self.cursor = conn.cursor()
        """The one cursor of every write (none is made per statement)."""
        self._cache: dict[tuple[str, int], str] = {}

    def run(self, kind: str, rows: list[Sequence[Any]]) -> int:
        """Execute ``kind`` for every row; return the number of rows changed."""
        cursor = self.cursor
        if len(rows) == 1:
            return cursor.execute(_SINGLE[kind], rows[0]).rowcount
        changed = 0
        width = len(_planner.ROW_COLUMNS[kind])
        for start in range(0, len(rows), self.largest):
            chunk = rows[start:start + self.largest]
            size = _padded(len(chunk))
            params = [value for row in chunk for value in row]
            if size > len(chunk):
                params.extend([None] * (width * (size - len(chunk))))
            key = (kind, size)
            sql = self._cache.get(key)
            if sql is None:
                sql = self._cache[key] = _many(kind, size)
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


def _many(kind: str, rows: int) -> str:
    """The statement writing ``rows`` rows of ``kind`` at once (`_planner.many_rows`;
    padding rows have NULL keys)."""
    columns = _planner.ROW_COLUMNS[kind]
    row = "(" + ", ".join("?" * len(columns)) + ")"
    names = ", ".join(f"column{n} AS {c}" for n, c in enumerate(columns, start=1))
    keep = " WHERE column1 IS NOT NULL" if kind in _planner.INSERTS else ""
    return _planner.many_rows(
        kind, f"(SELECT {names} FROM (VALUES {', '.join([row] * rows)}){keep}) AS v", "MAX")


_SINGLE: Final = {
    **{kind: f"INSERT INTO {table} ({', '.join(columns)}) VALUES "
             f"({', '.join('?' * len(columns))})"
       for kind, (table, columns) in _planner.INSERTS.items()},
    "settle": f"UPDATE attempts SET {', '.join(f'{c} = ?' for c in _planner.ATTEMPT_SETTLE)} "
              "WHERE invocation_id = ? AND ordinal = ? AND outcome = 'dispatched'",
    "close": "UPDATE segments SET ended_at = ?, outcome = ? WHERE invocation_id = ? "
             "AND ordinal = ?",
    # Increments, never absolute values: correct whoever else wrote the row.
    "add": "UPDATE invocations SET " + ", ".join(
        f"{c} = MAX({c}, ?)" if n == _planner.INCOMPLETE else f"{c} = {c} + ?"
        for n, c in enumerate(_planner.DELTA_COLUMNS)) + " WHERE id = ?",
    "end": _many("end", 1),
}
"""The statement of one row of each kind, its parameters the row as it is."""


# -- the writer ------------------------------------------------------------------------------

# A checkpoint is due after this many commits or writes (about 3 MiB of WAL
# on the sequential path, like SQLite's own 1,000-page autocheckpoint). The
# writer makes it itself after a commit that leaves nothing waiting; past
# four times as many, its checkpointer thread makes it.
CHECKPOINT_COMMITS: Final = 256
CHECKPOINT_WRITES: Final = 4096
CHECKPOINT_INTERVAL: Final = 0.1
"""The checkpointer's shortest wait between two checkpoints, in seconds."""


class Writer(_Writer):
    """The connection that turns ops into rows: SQLite's `_planner.Store`.

    `open` raises `sqlite3.Error` or `Refused`; its planner's commit never raises
    for a write it refuses: it reports it.

    Args:
        path: The ledger's file (its schema already current).
        max_retained: Attempt rows kept per invocation (R07).
        busy_timeout: Seconds to wait for another process's write lock.
    """

    errors: tuple[type[BaseException], ...] = (sqlite3.Error, OverflowError, TypeError,
                                               ValueError)
    """A database error, or a value SQLite cannot bind (an integer past 64 bits):
    the same path, so one bad write never sinks the others."""

    def __init__(self, path: str, max_retained: int, busy_timeout: float) -> None:
        super().__init__(path, max_retained)
        self._busy_timeout = busy_timeout
        self._checkpointed = (0, 0)
        """The commits and writes counted at the last checkpoint."""
        self._conn: sqlite3.Connection | None = None
        self._statements: _Statements | None = None
        self._checkpointer: _Checkpointer | None = None

    def open(self) -> None:
        """Connect with the ledger's settings (the schema is already current)."""
        conn = sqlite3.connect(self.name, timeout=self._busy_timeout, isolation_level=None,
                               cached_statements=512, check_same_thread=False)
        try:
            mode = str(conn.execute("PRAGMA journal_mode").fetchone()[0])
            if mode != "wal":
                raise Refused(f"{self.name}: the ledger needs WAL journaling, and this "
                              f"database reports journal_mode={mode}")
            # FULL: in WAL mode NORMAL may lose the last commits on power loss,
            # and a billing record must not.
            conn.execute("PRAGMA synchronous = FULL")
            # A run store's transcript, deleted when its run ends, is zeroed on
            # its pages rather than left in the file's free pages (the build's
            # default is off in many Pythons).
            conn.execute("PRAGMA secure_delete = ON")
            # Checkpoints are made between commits (`maybe_checkpoint`), never inside one.
            conn.execute("PRAGMA wal_autocheckpoint = 0")
            # Foreign keys stay declared but unenforced: the writer already
            # refuses an attempt of an invocation it does not know, and the
            # per-row parent lookup would cost every insert.
            self._statements = _Statements(conn)
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        self._checkpointer = _Checkpointer(self.name, self._busy_timeout)

    def close(self) -> None:
        """Stop the checkpointer and close the connection (it checkpoints what is left)."""
        if self._checkpointer is not None:
            self._checkpointer.stop()
        if self._conn is not None:
            self._conn.close()

    # -- the store the planner writes through -----------------------------------------

    def begin(self) -> None:
        """``BEGIN IMMEDIATE``: the write lock up front, so the busy handler applies."""
        assert self._statements is not None
        self._statements.cursor.execute("BEGIN IMMEDIATE")

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

    def lost(self, error: BaseException) -> bool:
        """Another process held the write lock past the busy timeout: the writes
        wait and are tried again (a failed ``COMMIT`` leaves nothing committed,
        so `committed` is always False here)."""
        return isinstance(error, sqlite3.OperationalError) and any(
            word in str(error) for word in ("locked", "busy"))

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
        commits = self.planner.commits - self._checkpointed[0]
        writes = self.planner.writes - self._checkpointed[1]
        if commits < CHECKPOINT_COMMITS and writes < CHECKPOINT_WRITES:
            return
        if not waiting():
            self._checkpointed = (self.planner.commits, self.planner.writes)
            assert self._conn is not None
            try:
                self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
            except sqlite3.Error:
                pass  # a checkpoint is an optimisation; the next one retries
        elif commits >= 4 * CHECKPOINT_COMMITS or writes >= 4 * CHECKPOINT_WRITES:
            self._checkpointed = (self.planner.commits, self.planner.writes)
            assert self._checkpointer is not None
            self._checkpointer.poke()


class _Checkpointer:
    """Copies the WAL back into the database, off the writer's path.

    The writer pokes it when a checkpoint is overdue while writes keep
    arriving (otherwise the writer checkpoints itself). A passive checkpoint
    never blocks writers or readers; it copies what no reader still needs, at
    most every `CHECKPOINT_INTERVAL` seconds.
    """

    def __init__(self, path: str, busy_timeout: float) -> None:
        self._path = path
        self._busy_timeout = busy_timeout
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
                if self._stopping.wait(CHECKPOINT_INTERVAL):
                    return
        finally:
            conn.close()
