"""`PostgresLedger`'s writer: the connection that commits what the ledger queues.

The ledger's writer thread (`_threaded`) drives it, as `SQLiteLedger`'s
drives `_writer`. The ledger's rules are the planner's (`_planner`); this
file supplies PostgreSQL's transaction on one connection of its own and
runs the statements the ledger rendered (`_postgres._statement`): each kind
of row for the whole batch in one statement, all of them in one round trip
(a pipeline), then the commit. psycopg releases the interpreter lock while
it waits on the server, so the event loop runs meanwhile.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from loopengine.persistence import _planner
from loopengine.persistence._threaded import Call, run_calls

if TYPE_CHECKING:
    import psycopg

APPLICATION_NAME = "loopengine-ledger"
"""The ``application_name`` of the ledger's connections (seen in ``pg_stat_activity``)."""


@dataclass(frozen=True, slots=True)
class Settings:
    """What the writer needs, rendered by the ledger."""

    dsn: str
    name: str
    """The server, database and schema, for messages (never the password)."""
    max_retained: int
    connect_args: dict[str, Any]
    """Keyword arguments of ``psycopg.connect``."""
    setup: list[str]
    """The statements every connection runs first (``synchronous_commit``, ...)."""
    statements: dict[str, str]
    """The statement of each kind of row (`_planner.statements`)."""


class PostgresWriter(_planner.Counted):
    """The writer: a `_planner.Store` on one connection of its own.

    Not thread-safe: the ledger's writer thread calls it. A lost connection
    fails the batch it carried and is closed; the next batch connects again.
    """

    def __init__(self, settings: Settings) -> None:
        import psycopg

        self.settings = settings
        self.name = settings.name
        self.errors: tuple[type[BaseException], ...] = (psycopg.Error, OverflowError,
                                                        TypeError, ValueError)
        self._planner = _planner.Planner(self, settings.max_retained)
        self._sql = settings.statements
        self._conn: psycopg.Connection[tuple[Any, ...]] | None = None

    def open(self) -> None:
        """Connect (raises `psycopg.Error` when the server cannot be reached)."""
        self.begin()

    def commit(self, ops: Sequence[_planner.Op]) -> list[tuple[int, str]]:
        """Write ``ops`` in one transaction (on a database error, each on its own).

        Returns:
            The durable ops refused, as ``(op_id, message)``.
        """
        return self._planner.commit(ops)

    def run_calls(self, calls: Sequence[Call]) -> None:
        """Run each call on the connection, in one transaction, once an empty query
        shows the session still answers (else on a new one): a connection the
        server ended while idle is replaced rather than reported, as a
        transaction of many steps is not retried."""
        import psycopg

        if self._conn is not None:
            try:
                self._conn.execute("")
            except psycopg.Error:
                self.close()
        run_calls(self, lambda: self._conn, calls)

    def maybe_checkpoint(self, waiting: Callable[[], bool]) -> None:
        """Nothing to do between commits: the server checkpoints itself."""

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
        """Make sure of a connection: the one held, else a new one."""
        import psycopg

        conn = self._conn
        if conn is not None and (conn.closed or conn.broken):
            self.close()
            conn = None
        if conn is None:
            s = self.settings
            conn = psycopg.connect(s.dsn, **s.connect_args)
            try:
                for statement in s.setup:
                    conn.execute(statement)
                conn.commit()
            except BaseException:
                conn.close()
                raise
            self._conn = conn

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

    def isolates(self, error: BaseException) -> bool:
        """A write that failed is worth retrying alone, unless the connection is gone
        (then nothing more can be written on it)."""
        conn = self._conn
        return conn is not None and not conn.broken and not conn.closed


def rows_json(rows: Sequence[Sequence[Any]]) -> str:
    """``rows`` as the JSON the statements read (`_postgres._statement`). A value
    JSON cannot carry (NaN, an object) raises here, and one its column refuses (an
    integer past 64 bits, a NUL in text) fails its statement: either way the
    write fails alone once the planner retries the batch write by write."""
    return json.dumps(rows, separators=(",", ":"), allow_nan=False)
