"""`SQLiteLedger`: the attempt ledger in one SQLite file, written by one writer.

How it writes: the calls, the queue and the group commit are `PipedLedger`'s
(`_piped`); the writer that owns the file's one write connection is
`_writer.Writer`, by default in a child process of the ledger's own
(``python -I -S _writer.py``), else in a thread. It takes whatever has
arrived into one ``BEGIN IMMEDIATE`` transaction, so under many concurrent
runs one fsync carries the writes of all of them. A sequential run costs one
commit per attempt (its dispatch, which also carries the previous settle)
and one for its end.

The file is safe for several processes at once: WAL lets readers work during
a write, ``BEGIN IMMEDIATE`` takes the write lock up front so the busy handler
(``busy_timeout``) waits for it instead of failing a half-done transaction,
and nothing caches a row another process could change (invocation totals are
updated with ``column = column + ?``).
"""

from __future__ import annotations

import functools
import os
import sqlite3
import time
from types import TracebackType
from typing import Final, Literal

from loopengine._errors import LedgerError
from loopengine.persistence import _writer
from loopengine.persistence._ops import check_arguments
from loopengine.persistence._piped import _START_TIMEOUT, PipedLedger, WriterKind, WriterProcess
from loopengine.persistence._protocol import DEFAULT_MAX_RETAINED_ATTEMPTS
from loopengine.persistence._schema import migrate

__all__ = ["SQLiteLedger"]

# A checkpoint is due after this many commits or writes (about 3 MiB of WAL
# on the sequential path, like SQLite's own 1,000-page autocheckpoint). The
# writer makes it itself after a commit that leaves nothing waiting; past
# four times as many, its checkpointer thread makes it. Read when a ledger opens.
_CHECKPOINT_COMMITS: Final = 256
_CHECKPOINT_WRITES: Final = 4096

_WRITER_FILE: Final = os.path.abspath(_writer.__file__)


class SQLiteLedger(PipedLedger):
    """The attempt ledger in a SQLite file (DESIGN.md §7).

    Opening creates the file if needed, migrates its schema and starts the
    writer, synchronously (open it at startup, not inside a busy event loop).
    Use it as a context manager (sync or async) or call `close` / `aclose` to
    commit what is queued and stop the writer; a ledger still open when the
    interpreter exits is closed then. Open one per process (after any fork);
    many concurrent runs, from one or several event loops, may share it.

    Durability follows the `Ledger` contract: a dispatch and an invocation's
    end are on disk (``synchronous=FULL``) when the call returns (or, for
    `begin_dispatch`, when its receipt's wait returns); a start or a settle is
    committed with the next durable write or within ``linger`` seconds,
    whichever comes first. A write the ledger refuses (an unknown invocation,
    an attempt settled twice) raises `LedgerError` from the call when it is
    durable, else from that invocation's next durable call.

    Args:
        path: The database file.
        max_retained_attempts: Attempt rows kept per invocation; later attempts
            only increase ``attempt_count`` and set ``incomplete`` (R07).
        busy_timeout: Seconds to wait for another process's write lock before
            a write fails.
        linger: Seconds a deferred write waits at most to share a durable
            write's commit before it is committed on its own (0: never waits).
        max_batch: The most writes one transaction carries.
        writer: ``"process"``: a child process writes (it needs a runnable
            ``sys.executable`` and POSIX pipes); ``"thread"``: a thread of
            this process writes; ``"auto"`` (the default): a process where
            one can be started, else a thread.

    Raises:
        LedgerError: the file cannot be opened, is not a ledger, or has a
            schema newer than this code; the writer cannot start; or an
            argument is invalid.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_retained_attempts: int = DEFAULT_MAX_RETAINED_ATTEMPTS,
        busy_timeout: float = 30.0,
        linger: float = 0.5,
        max_batch: int = 20_000,
        writer: WriterKind = "auto",
    ) -> None:
        check_arguments(max_retained_attempts=max_retained_attempts, max_batch=max_batch,
                        seconds={"busy_timeout": busy_timeout, "linger": linger})
        if writer not in ("auto", "process", "thread"):
            raise LedgerError(f"writer must be 'auto', 'process' or 'thread', got {writer!r}")
        self.path = _ledger_path(path)
        """The database file."""
        self._setup(self.path, max_retained_attempts, linger)
        self._busy_timeout = float(busy_timeout)
        _prepare_file(self.path, self._busy_timeout)
        settings = _writer.Settings(self.path, max_retained_attempts, self._busy_timeout,
                                    _CHECKPOINT_COMMITS, _CHECKPOINT_WRITES)
        self._start(writer, WriterProcess(
            _WRITER_FILE, [_writer.settings_argument(settings, max_batch)],
            timeout=self._busy_timeout + _START_TIMEOUT),
            functools.partial(_thread_writer, settings), max_batch)

    @property
    def writer(self) -> Literal["process", "thread"]:
        """Where the writer runs: a child ``process`` or a ``thread`` of this one."""
        return self._channel.kind or "thread"

    def __enter__(self) -> SQLiteLedger:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def __aenter__(self) -> SQLiteLedger:
        return self

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"SQLiteLedger({self.path!r}, {state}, writer={self.writer!r})"


def _thread_writer(settings: _writer.Settings) -> _writer.Writer:
    """The writer of a ledger that writes from a thread, opened."""
    writer = _writer.Writer(settings)
    try:
        writer.open()
    except (sqlite3.Error, _writer.Refused) as error:
        raise LedgerError(f"{settings.path}: cannot open the ledger: {error}") from error
    return writer


# -- opening ------------------------------------------------------------------------------


def _ledger_path(path: str | os.PathLike[str]) -> str:
    """The ledger's file path as text, refused here when SQLite could not hold a ledger in it.

    Raises:
        LedgerError: not a path, an empty path, a NUL byte, or ``:memory:``.
    """
    try:
        text = os.fspath(path)
    except TypeError:
        raise LedgerError(f"path must be a str or an os.PathLike of str, got {path!r}") from None
    if not isinstance(text, str):
        raise LedgerError(f"path must be a str or an os.PathLike of str, got {path!r}")
    if not text:
        raise LedgerError(
            "the ledger needs a file path, and the path is empty (SQLite would open a private "
            "temporary database, deleted when it closes, that no other process can read)")
    if "\0" in text:
        raise LedgerError(f"{text!r} cannot be a ledger file: the path contains a NUL byte")
    if text == ":memory:":
        raise LedgerError(":memory: is an in-memory database, which cannot hold a ledger: the "
                          "ledger needs WAL journaling, in a file other processes can open")
    return text


def _create_private(path: str) -> None:
    """Create ``path`` empty and readable by its owner only, unless it exists already.

    SQLite creates a new database's -wal and -shm with the database file's
    permission bits (and forces them past the umask), so they are 0600 too.
    An existing file keeps the mode its owner gave it.

    Raises:
        LedgerError: the file cannot be created (a missing directory, no permission).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        return
    except OSError as error:
        raise LedgerError(
            f"{path}: cannot open the ledger: cannot create the file "
            f"({error.strerror or error})") from error
    try:
        if hasattr(os, "fchmod"):
            # The umask can only take bits away, but one such as 0o277 would
            # take the owner's write bit too.
            os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def _prepare_file(path: str, busy_timeout: float) -> None:
    """Create or migrate the ledger file, checking that it can hold a ledger.

    A new file is created 0600 (`_create_private`) before SQLite opens it.

    Raises:
        LedgerError: it cannot be created or opened, is not a SQLite database
            or not a ledger, cannot use WAL, or has a newer schema.
    """
    _create_private(path)
    try:
        conn = sqlite3.connect(path, timeout=busy_timeout, isolation_level=None)
    except sqlite3.Error as error:
        raise LedgerError(f"{path}: cannot open the ledger: {error}") from error
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
        mode = _journal_wal(conn, busy_timeout)
        if mode != "wal":
            raise LedgerError(
                f"{path}: the ledger needs WAL journaling, and this database reports "
                f"journal_mode={mode}"
            )
        migrate(conn, path=path)
    except sqlite3.DatabaseError as error:
        raise LedgerError(f"{path} is not a SQLite database ({error})") from error
    except (TypeError, ValueError) as error:
        # A hand-made schema table whose version is not an integer.
        raise LedgerError(f"{path} is not a loopengine ledger: its schema version cannot be "
                          f"read ({error})") from error
    finally:
        conn.close()


def _journal_wal(conn: sqlite3.Connection, busy_timeout: float) -> str:
    # Switching a fresh file to WAL needs a lock the busy handler does not
    # always wait for, so several processes opening one new file retry here.
    give_up = time.monotonic() + busy_timeout
    while True:
        try:
            return str(conn.execute("PRAGMA journal_mode = WAL").fetchone()[0])
        except sqlite3.OperationalError as error:
            if "locked" not in str(error) or time.monotonic() > give_up:
                raise
            time.sleep(0.01)
