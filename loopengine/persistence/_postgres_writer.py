"""`PostgresLedger`'s writer: the connection that commits what the ledger queues.

The ledger runs it in a child process of its own (or, where that cannot be,
in a thread), as `SQLiteLedger` runs `_writer`: in a process the writer holds
its own interpreter lock, so its planning, its statements and its waits on
the server run beside the event loop instead of taking turns with it. The
child runs this file by path (``python -I _postgres_writer.py OPS_FD ACKS_FD
SETTINGS_FD``): it imports psycopg from the installed packages and nothing of
loopengine but `_writer` and `_planner`, loaded by their paths. Its settings
(the connection string among them, which may hold a password) arrive through
the third pipe, never on the command line. It speaks `_writer`'s frames and
serves with `_writer.serve`.

The ledger's rules are the planner's (`_planner`); this file supplies
PostgreSQL's transaction and runs the statements the ledger rendered
(`_postgres._statement`): each kind of row for the whole batch in one
statement, all of them in one round trip (a pipeline), then the commit.
"""

from __future__ import annotations

import json
import marshal
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING or __package__:
    from loopengine.persistence import _planner, _writer
else:
    # Run by path as the ledger's writer process (`main`), where loopengine may
    # not be importable: the writer's loop beside this file, found last on the
    # path (so nothing installed is shadowed), loads the planner by its path.
    sys.path.append(os.path.dirname(os.path.abspath(__file__)))
    import _writer

    _planner = _writer._planner

if TYPE_CHECKING:
    import psycopg
    import psycopg_pool

APPLICATION_NAME = "loopengine-ledger"
"""The ``application_name`` of the ledger's connections (seen in ``pg_stat_activity``)."""


@dataclass(frozen=True, slots=True)
class Settings:
    """What the writer needs, rendered by the ledger (sent to a child process as a
    tuple, through a pipe)."""

    dsn: str
    name: str
    """The server, database and schema, for messages (never the password)."""
    max_retained: int
    max_batch: int
    connect_timeout: float
    connect_args: dict[str, Any]
    """Keyword arguments of ``psycopg.connect``."""
    setup: list[str]
    """The statements every connection runs first (``synchronous_commit``, ...)."""
    statements: dict[str, str]
    """The statement of each kind of row (`_planner.statements`)."""

    def encode(self) -> bytes:
        """These settings as the bytes `decode` reads."""
        return marshal.dumps((self.dsn, self.name, self.max_retained, self.max_batch,
                              self.connect_timeout, self.connect_args, self.setup,
                              self.statements))

    @classmethod
    def decode(cls, data: bytes) -> Settings:
        """The settings `encode` wrote."""
        return cls(*marshal.loads(data))


class PostgresWriter(_planner.Counted):
    """The writer: a `_planner.Store` on one pooled connection, and what
    `_writer.serve` drives (`commit`, `maybe_checkpoint`, `close`).

    Not thread-safe: one thread (of the ledger's process, or of its child)
    calls it. A lost connection fails the batch it carried and goes back to
    the pool, which replaces it; the next batch takes a fresh one, checked
    first.
    """

    def __init__(self, settings: Settings) -> None:
        import psycopg

        self.settings = settings
        self.name = settings.name
        self.errors: tuple[type[BaseException], ...] = (psycopg.Error, OverflowError,
                                                        TypeError, ValueError)
        self._planner = _planner.Planner(self, settings.max_retained)
        self._sql = settings.statements
        self._pool: psycopg_pool.ConnectionPool[psycopg.Connection[tuple[Any, ...]]] | None = None
        self._conn: psycopg.Connection[tuple[Any, ...]] | None = None

    def open(self) -> None:
        """Start the pool (its connections open in the background)."""
        import psycopg_pool

        s = self.settings
        pool: psycopg_pool.ConnectionPool[psycopg.Connection[tuple[Any, ...]]] = (
            psycopg_pool.ConnectionPool(
                s.dsn, min_size=1, max_size=2, open=False, kwargs=s.connect_args,
                configure=self._configure, check=psycopg_pool.ConnectionPool.check_connection,
                timeout=s.connect_timeout, name=APPLICATION_NAME))
        pool.open(wait=False)
        self._pool = pool

    def _configure(self, conn: psycopg.Connection[tuple[Any, ...]]) -> None:
        for statement in self.settings.setup:
            conn.execute(statement)
        conn.commit()

    def commit(self, ops: Sequence[_planner.Op]) -> list[tuple[int, str]]:
        """Write ``ops`` in one transaction (on a database error, each on its own).

        Returns:
            The durable ops refused, as ``(op_id, message)``.
        """
        return self._planner.commit(ops)

    def maybe_checkpoint(self, waiting: Any) -> None:
        """Nothing to do between commits: the server checkpoints itself."""

    def close(self) -> None:
        """Give the connection back and close the pool."""
        self.release()
        if self._pool is not None:
            self._pool.close()

    # -- the store the planner writes through -----------------------------------------

    def begin(self) -> None:
        """Take a connection (the one held, or a fresh one from the pool)."""
        if self._conn is None:
            assert self._pool is not None
            self._conn = self._pool.getconn(timeout=self.settings.connect_timeout)

    def load(self, invocation_id: str) -> _planner.Known | None:
        """The committed state of an invocation another ledger started (or forgotten)."""
        conn = self._conn
        assert conn is not None
        return _planner.read_known(
            lambda sql: conn.execute(sql.format("%s"), (invocation_id,)).fetchall())

    def execute(self, batch: _planner.Batch) -> None:
        """Write the batch, each kind of row in one statement, all of them in one
        round trip (a pipeline), then check what each update changed."""
        conn = self._conn
        assert conn is not None
        planned = _planner.statements(batch)
        with conn.pipeline() as pipeline:
            cursors = [conn.execute(self._sql[kind], (rows_json(rows),))
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
            assert self._pool is not None
            try:
                self._pool.putconn(conn)
            except Exception:  # the pool is closing: nothing to give back to
                conn.close()


def rows_json(rows: Sequence[Sequence[Any]]) -> str:
    """``rows`` as the JSON the statements read (`_postgres._statement`). A value
    JSON cannot carry (NaN, an object) raises here, and one its column refuses (an
    integer past 64 bits, a NUL in text) fails its statement: either way the
    write fails alone once the planner retries the batch write by write."""
    return json.dumps(rows, separators=(",", ":"), allow_nan=False)


def main(argv: list[str]) -> int:
    """``_postgres_writer.py OPS_FD ACKS_FD SETTINGS_FD``: the ledger's child process."""
    ops_fd, acks_fd, settings_fd = int(argv[1]), int(argv[2]), int(argv[3])
    _writer.ignore_terminal_signals()
    data = bytearray()
    while chunk := os.read(settings_fd, 1 << 16):
        data += chunk
    os.close(settings_fd)
    settings = Settings.decode(bytes(data))
    try:
        import psycopg  # noqa: F401
        import psycopg_pool  # noqa: F401
    except ImportError as error:
        return _writer.refuse_to_start(
            acks_fd, f"the writer process cannot import psycopg and psycopg-pool ({error})")
    writer = PostgresWriter(settings)
    try:
        writer.open()
    except Exception as error:  # psycopg's, or the pool's: said, not raised
        return _writer.refuse_to_start(acks_fd, f"cannot open the ledger: {error}")
    return _writer.serve(writer, settings.max_batch, ops_fd, acks_fd)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
