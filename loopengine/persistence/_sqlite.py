"""`SQLiteLedger`: the attempt ledger in one SQLite file, written by one writer thread.

The calls, the queue and the group commit are `ThreadedLedger`'s; the
thread's connection is `_writer.Writer`, which takes whatever has queued
into one ``BEGIN IMMEDIATE`` transaction (sqlite3 lets go of the interpreter
lock while it steps and syncs). A sequential run costs one commit per
attempt (its dispatch, which also carries the previous settle) and one for
its end. Several processes may share the file: WAL lets readers work during
a write, ``BEGIN IMMEDIATE`` lets the busy handler wait for another
process's lock, and totals are updated with ``column = column + ?``.
"""

from __future__ import annotations

import os
import sqlite3
import stat
import time

from loopengine import _validate
from loopengine._errors import ConfigError, LedgerError
from loopengine.persistence import _writer
from loopengine.persistence._ops import check_arguments
from loopengine.persistence._planner import Refused
from loopengine.persistence._protocol import DEFAULT_MAX_RETAINED_ATTEMPTS
from loopengine.persistence._schema import migrate
from loopengine.persistence._threaded import ThreadedLedger

__all__ = ["SQLiteLedger"]

MIN_SQLITE = (3, 33, 0)
"""The oldest SQLite library the ledger's statements run on: an invocation's end
is an ``UPDATE ... FROM`` (SQLite 3.33), its totals an upsert (3.24)."""

class SQLiteLedger(ThreadedLedger):
    """The attempt ledger in a SQLite file (docs/ledger.md).

    Opening creates the file if needed, migrates its schema and starts the
    writer thread, synchronously (open it at startup, not inside a busy event
    loop). Use it as a context manager (sync or async) or call `close` /
    `aclose` to commit what is queued and stop the writer; a ledger still
    open when the interpreter exits is closed then. Open one per process
    (after any fork: a forked copy refuses every call); many concurrent runs,
    from one or several event loops, may share it.

    Durability follows the `Ledger` contract: a dispatch, a served settle and
    an invocation's end are on disk (``synchronous=FULL``) when the call
    returns; a start or an unserved settle is committed with the next durable
    write or within ``linger`` seconds, whichever comes first. A write the
    ledger refuses (an unknown invocation, an attempt settled twice) raises
    `LedgerError` from the call when it is durable, else from that
    invocation's next durable call.

    Args:
        path: The database file. A new one is created readable by its owner
            only (0600), with its -wal and -shm, also through a symbolic link.
        max_retained_attempts: Attempt rows kept per invocation; later attempts
            only increase ``attempt_count`` and set ``incomplete`` (R07).
        busy_timeout: Seconds each try waits for another process's write lock
            (past it the writer tries again, and the writes wait); also how
            long `close` waits for it before it gives up on the writes queued.
        linger: Seconds a deferred write waits at most to share a durable
            write's commit before it is committed on its own (0: never waits).
        max_batch: The most writes one transaction carries.

    Raises:
        ConfigError: an argument is invalid (``.field`` names it).
        LedgerError: the file cannot be created or opened, is not a ledger, or
            has a schema newer than this code; or the SQLite library Python
            is linked with is older than 3.33 (`MIN_SQLITE`).
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
        check_arguments(max_retained_attempts=max_retained_attempts, max_batch=max_batch,
                        seconds={"busy_timeout": busy_timeout, "linger": linger})
        text = _ledger_path(path)
        check_library(sqlite3.sqlite_version_info, text)
        self.path = text
        """The database file."""
        self._setup(self.path, max_retained_attempts, linger, max_batch,
                    give_up=float(busy_timeout))
        self.busy_timeout = float(busy_timeout)
        """Seconds each try of a write waits for another process's write lock."""
        _prepare_file(self.path, self.busy_timeout)
        self._start(self._new_writer())

    def _new_writer(self) -> _writer.Writer:
        writer = _writer.Writer(self.path, self._max_retained, self.busy_timeout)
        try:
            writer.open()
        except (sqlite3.Error, Refused) as error:
            raise LedgerError(f"{self.path}: cannot open the ledger: {error}") from error
        return writer

    def __repr__(self) -> str:
        return f"SQLiteLedger({self.path!r}, {'closed' if self._closed else 'open'})"


# -- opening ------------------------------------------------------------------------------


def check_library(version: tuple[int, ...], path: str) -> None:
    """Refuse a SQLite library older than `MIN_SQLITE` before the file is touched:
    on one, every run would fail at its end with a syntax error.

    Raises:
        LedgerError: ``version`` is older; the message says which is needed.
    """
    if tuple(version) < MIN_SQLITE:
        raise LedgerError(
            f"{path}: cannot open the ledger: Python's sqlite3 module is linked with "
            f"SQLite {'.'.join(map(str, version))}, and the ledger needs "
            f"{'.'.join(map(str, MIN_SQLITE))} or newer (a Python built with a newer "
            "libsqlite3, or PostgresLedger)")


def _ledger_path(path: str | os.PathLike[str]) -> str:
    """The ledger's file path as text, refused here when SQLite could not hold a ledger in it.

    Raises:
        ConfigError: not a path, an empty or blank path, a NUL byte (all
            `_validate.file_path`'s), or ``:memory:``.
    """
    text = _validate.file_path("path", path)
    if text == ":memory:":
        raise ConfigError("path", ":memory: is an in-memory database, which cannot hold a "
                          "ledger: the ledger needs WAL journaling, in a file other processes "
                          "can open")
    return text


def _create_private(path: str) -> bool:
    """Create ``path`` empty and readable by its owner only, unless it exists
    already; say whether it was created.

    A symbolic link (dangling or not) is followed, so the file created is its
    target, 0600 like any other. An existing file keeps the mode its owner
    gave it.

    Raises:
        LedgerError: the file cannot be created (a missing directory, no permission).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    try:
        # O_EXCL refuses any link, dangling or not: create the link's target.
        fd = os.open(os.path.realpath(path), flags, 0o600)
    except FileExistsError:
        return False
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
    return True


def _private_companions(path: str) -> None:
    """Make a new ledger's -wal and -shm its owner's only, as the file is.

    SQLite creates them with the database file's mode, but it reuses files
    left at those names (a deleted ledger's, or another user's in a shared
    directory), whatever their mode and owner.

    Raises:
        LedgerError: one of them belongs to another user.
    """
    real = os.path.realpath(path)
    for companion in (real + "-wal", real + "-shm"):
        try:
            status = os.stat(companion)
        except FileNotFoundError:
            continue
        if hasattr(os, "geteuid") and status.st_uid != os.geteuid():
            raise LedgerError(
                f"{path}: refusing to open a new ledger: {companion} belongs to another user "
                f"(uid {status.st_uid}), who could read or change it")
        if stat.S_IMODE(status.st_mode) & 0o077:
            os.chmod(companion, 0o600)


def _prepare_file(path: str, busy_timeout: float) -> None:
    """Create or migrate the ledger file, checking that it can hold a ledger.

    A new file is created 0600 (`_create_private`) before SQLite opens it,
    and its -wal and -shm are made so once SQLite has them open.

    Raises:
        LedgerError: it cannot be created or opened, is not a SQLite database
            or not a ledger, cannot use WAL, or has a newer schema.
    """
    created = _create_private(path)
    try:
        conn = sqlite3.connect(path, timeout=busy_timeout, isolation_level=None)
    except sqlite3.Error as error:
        raise LedgerError(f"{path}: cannot open the ledger: {error}") from error
    try:
        mode = _journal_wal(conn, busy_timeout)
        if mode != "wal":
            raise LedgerError(
                f"{path}: the ledger needs WAL journaling, and this database reports "
                f"journal_mode={mode}"
            )
        migrate(conn, path=path)
        if created:
            _private_companions(path)
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
