"""`RunStore`: where runs keep their resumable state, their lease and their tool
calls' statuses, in the ledger's own database (docs/pause-and-resume.md, "Crash
recovery: the run store").

Two tables (`loopengine.persistence._schema.RUN_TABLES`, one migration on
every store):

* ``run_states``: one row per run that has not ended: its `RunState` (the
  transcript lives here and nowhere else), a ``version`` that every write
  raises, and the lease of the process running it (``lease_owner``,
  ``lease_expires_at``: the run's deadline plus a grace), or ``paused_at``
  while it waits paused. The row is deleted when the run ends.
* ``tool_calls``: each tool call's status (``requested``, ``approved``,
  ``denied``, ``started``, ``succeeded``, ``failed``, ``in_doubt``,
  ``supplied``) and its times; never its input or output.

Every write is one transaction on the ledger's connection, in its writer
thread (`ThreadedLedger._transact_qmark`), durable when it returns. Taking a run
(`RunStore.claim`) is a compare-and-set on ``version``: of two resumes of
one run, in any processes on any hosts, exactly one proceeds and the other
raises `RunBusyError` before anything is sent. Every later write of the run
checks that its process still holds the lease, so a process whose run was
taken over never runs another handler of it.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import uuid
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from loopengine import _validate
from loopengine._accounts import UNBOUNDED_RUN
from loopengine._errors import ConfigError, LedgerError, RunBusyError
from loopengine._runstate import RunState
from loopengine.persistence._memory import MemoryLedger
from loopengine.persistence._postgres import PostgresLedger
from loopengine.persistence._schema import (
    RUN_RESULTS,
    RUN_TABLES,
    SQLITE_TYPES,
    format_time,
    render,
    stored_time,
)
from loopengine.persistence._sqlite import SQLiteLedger

if TYPE_CHECKING:
    from loopengine._invocation import Invocation

__all__ = ["DEFAULT_LEASE_GRACE", "UNBOUNDED_RUN", "CallMark", "RunStore", "StoredRun",
           "holds_run", "lease_expiry", "new_owner", "take_token",
           "taken_without_store"]

T = TypeVar("T")

DEFAULT_LEASE_GRACE = 60.0
"""Seconds past a run's deadline before another process may take it over."""

ENDED_STATUSES = frozenset({"succeeded", "failed", "denied", "supplied"})
"""Statuses that end a call (``ended_at`` is set with them)."""


@dataclass(frozen=True, slots=True)
class StoredRun:
    """A run's row in ``run_states``."""

    invocation_id: str
    state: bytes
    """Its `RunState`, encoded (`RunState.loads` reads it)."""
    version: int
    """Raised by every write: what a resume's compare-and-set expects."""
    lease_owner: str | None
    """The process running it (None while paused)."""
    lease_expires_at: datetime | None
    """When its lease expires: past it another process may take the run over."""
    paused_at: datetime | None
    """When it paused (None while it runs)."""

    def unsettled_take(self, saved: RunState) -> bool:
        """Whether the row runs while it holds a paused state (its pending calls): a
        resume wrote it to take that pause (an adopting resume's insert, a
        resume's or a recovery's claim) and its process died, or it failed,
        before the run's first checkpoint after the take. Whether it took the
        pause, or another resume did, only the ledger's seal says
        (`taken_without_store`)."""
        return self.paused_at is None and bool(saved.pending)

    def check_free(self, now: datetime, force: bool) -> None:
        """Raise unless a resume may take the run now: it is paused, or the
        lease of the process running it has expired, or ``force``.

        Raises:
            RunBusyError: it runs under a lease that has not expired.
        """
        lease = self.lease_expires_at
        if self.paused_at is None and not force and lease is not None and lease > now:
            raise RunBusyError(self.invocation_id, self.lease_owner,
                               f"its lease runs until {format_time(lease)}; resume it "
                               "then, or with force=True if its process is dead")


CallMark = tuple[str, int, str, str]
"""``(call_id, turn, tool, status)``: a tool call's new status."""


_MEMORY: weakref.WeakKeyDictionary[MemoryLedger, sqlite3.Connection] = \
    weakref.WeakKeyDictionary()
"""The run store tables of each `MemoryLedger`."""


def new_owner() -> str:
    """A lease owner id: this host, this process, and a part unique to the segment."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


_UNSTORED = "resumed:unstored:"


def take_token(owner: str | None) -> str:
    """What a resume's take of a paused run writes as the ledger's seal while its
    segment runs: ``resumed:`` and the segment's lease owner; without a run
    store, ``resumed:unstored:`` and a random part. Unique to the segment; a
    recovery of a row a resume left before its first checkpoint
    (`StoredRun.unsettled_take`) tells from it whether a resume on an engine
    without a run store took the pause (`taken_without_store`)."""
    return f"resumed:{owner}" if owner is not None else f"{_UNSTORED}{uuid.uuid4().hex}"


def taken_without_store(seal: str | None) -> bool:
    """Whether ``seal``, the ledger's while a resumed run runs, is the take of a
    resume on an engine without a run store (`take_token`): the run is that
    resume's, and no row of a run store holds it. A token written by earlier
    versions (``resumed:`` and 32 hex digits, whichever resume took it) is
    not: a recovery goes on with it, as those versions did."""
    return seal is not None and seal.startswith(_UNSTORED)


def lease_expiry(inv: Invocation, grace: float) -> datetime:
    """When the lease of ``inv``'s running segment expires: its deadline plus ``grace``."""
    remaining = min(inv.deadline.remaining(inv.clock.now()), UNBOUNDED_RUN)
    return inv.clock.wall() + timedelta(seconds=max(0.0, remaining) + grace)


class RunStore:
    """Runs' resumable state, leases and tool call statuses, in a ledger's database.

    Give it to ``Engine(..., run_store=store)`` (with the same ledger): the
    engine then checkpoints each run after each settled reply and each tool
    batch, writes each call ``started`` before its handler runs, and
    ``engine.resume(invocation_id)`` resumes a paused run, or recovers a run
    whose process died, in any process that opens the same database.

    Args:
        ledger: A `SQLiteLedger` or `PostgresLedger` (the tables live in its
            database, written by its writer thread), or a `MemoryLedger` (the
            tables in this process's memory: for tests; nothing survives it).
        lease_grace: Seconds past a run's deadline before another process may
            take it over (``resume(invocation_id)`` without ``force``).

    Raises:
        ConfigError: another kind of ledger, or a bad ``lease_grace``.
    """

    def __init__(self, ledger: Any, *, lease_grace: float = DEFAULT_LEASE_GRACE) -> None:
        if not isinstance(ledger, SQLiteLedger | PostgresLedger | MemoryLedger):
            raise ConfigError("ledger", "a run store lives in the ledger's database: give it "
                                        "a SQLiteLedger, a PostgresLedger or a MemoryLedger, "
                                        f"not {_validate.shown(ledger)}")
        _validate.seconds("lease_grace", lease_grace, positive=False)
        self.ledger: SQLiteLedger | PostgresLedger | MemoryLedger = ledger
        self.lease_grace = float(lease_grace)
        self._memory: sqlite3.Connection | None = None
        if isinstance(ledger, MemoryLedger):
            # The same tables and statements, in this process's memory, one
            # database per ledger (every store on it shares it).
            self._memory = _MEMORY.get(ledger)
            if self._memory is None:
                self._memory = sqlite3.connect(":memory:", isolation_level=None,
                                               check_same_thread=False)
                for statement in (*render(RUN_TABLES, SQLITE_TYPES), *RUN_RESULTS):
                    self._memory.execute(statement)
                _MEMORY[ledger] = self._memory

    def __repr__(self) -> str:
        return f"RunStore({self.ledger!r})"

    # -- reading ------------------------------------------------------------------------

    async def load(self, invocation_id: str) -> StoredRun | None:
        """The stored run, or None when the store holds none by that id (it
        ended, or never ran with a run store).

        Raises:
            LedgerError: the database could not be read.
        """

        def work(conn: Any) -> tuple[Any, ...] | None:
            row = conn.execute(
                "SELECT state, results, version, lease_owner, lease_expires_at, paused_at "
                "FROM run_states WHERE invocation_id = ?", (invocation_id,)).fetchone()
            return None if row is None else tuple(row)

        row = await self._transact(work)
        if row is None:
            return None
        state, results, version, owner, expires, paused = row
        data = state.encode() if isinstance(state, str) else bytes(state)
        if results is not None:
            # The batch's results its calls' ends wrote since the state was.
            data = replace(RunState.loads(data), results=json.loads(results)).dumps()
        return StoredRun(invocation_id, data, int(version), owner, stored_time(expires),
                         stored_time(paused))

    async def tool_calls(self, invocation_id: str) -> dict[str, str]:
        """Each recorded tool call of the run and its status, by call id.

        Raises:
            LedgerError: the database could not be read.
        """

        def work(conn: Any) -> dict[str, str]:
            rows = conn.execute("SELECT call_id, status FROM tool_calls "
                                "WHERE invocation_id = ?", (invocation_id,)).fetchall()
            return {str(call): str(status) for call, status in rows}

        return await self._transact(work)

    # -- what the engine writes (internal) ---------------------------------------------------

    async def claim(self, invocation_id: str, owner: str, *, version: int,
                    expires_at: datetime, now: datetime, force: bool) -> None:
        """Take the run for a resume: a compare-and-set on its ``version`` (internal).

        Raises:
            RunBusyError: another resume took it since it was read (and may
                have ended it), or it runs under a lease that has not expired
                (and ``force`` is false).
        """

        def work(conn: Any) -> None:
            lock = " FOR UPDATE" if getattr(conn, "locks_rows", False) else ""
            row = conn.execute(
                "SELECT version, lease_owner, lease_expires_at, paused_at FROM run_states "
                f"WHERE invocation_id = ?{lock}", (invocation_id,)).fetchone()
            if row is None:
                # It was there when read: another resume took it, and ended it.
                raise RunBusyError(invocation_id, None, "another resume took it and ended it")
            found, holder, expires, paused = row
            if int(found) != version:
                raise RunBusyError(invocation_id, holder, "another resume took it")
            StoredRun(invocation_id, b"", int(found), holder, stored_time(expires),
                      stored_time(paused)).check_free(now, force)
            changed = conn.execute(
                "UPDATE run_states SET version = version + 1, lease_owner = ?, "
                "lease_expires_at = ?, paused_at = NULL, updated_at = ? "
                "WHERE invocation_id = ? AND version = ?",
                (owner, format_time(expires_at), format_time(now), invocation_id,
                 version)).rowcount
            if changed != 1:
                raise RunBusyError(invocation_id, None, "another resume took it")

        await self._transact(work, lock=invocation_id)

    async def checkpoint(self, invocation_id: str, owner: str, *, now: datetime,
                         state: bytes | None = None, results: bytes | None = None,
                         expires_at: datetime | None = None, paused: bool = False,
                         calls: Sequence[CallMark] = (), create: bool = False) -> None:
        """Write the run's state (when given) or the results its batch has so far
        (``results``, JSON: the state's transcript is not written again), renew
        or release its lease, and set its calls' statuses, in one transaction,
        durable on return (internal).

        ``create`` inserts the row of a new run, or of a paused run a resume
        adopts (it paused without a run store); otherwise the row must be held
        by ``owner``. ``paused`` releases the lease and sets ``paused_at``.

        Raises:
            RunBusyError: another process took the run over, or (``create``)
                another resume adopted it first.
        """
        at = format_time(now)
        lease = (None if paused or expires_at is None else format_time(expires_at))

        def work(conn: Any) -> None:
            holder = None if paused else owner
            paused_at = at if paused else None
            if create:
                assert state is not None
                # A run paused without a run store is adopted by the resume
                # that inserts its row: of two such resumes, the key lets one.
                inserted = conn.execute(
                    "INSERT INTO run_states (invocation_id, state, version, lease_owner, "
                    "lease_expires_at, paused_at, updated_at) VALUES (?, ?, 1, ?, ?, ?, ?) "
                    "ON CONFLICT (invocation_id) DO NOTHING",
                    (invocation_id, state.decode(), holder, lease, paused_at, at)).rowcount
                if inserted != 1:
                    raise RunBusyError(invocation_id, None, "another resume took it")
            else:
                sets = "version = version + 1, lease_owner = ?, updated_at = ?"
                values: list[Any] = [holder, at]
                if state is not None:
                    sets += ", state = ?, results = NULL"
                    values.append(state.decode())
                if results is not None:
                    sets += ", results = ?"
                    values.append(results.decode())
                if lease is not None or paused:
                    sets += ", lease_expires_at = ?, paused_at = ?"
                    values += [lease, paused_at]
                changed = conn.execute(
                    f"UPDATE run_states SET {sets} WHERE invocation_id = ? "
                    "AND lease_owner = ?", (*values, invocation_id, owner)).rowcount
                if changed != 1:
                    raise RunBusyError(invocation_id, None,
                                       "another process took the run over")
            for call_id, turn, tool, status in calls:
                started = at if status == "started" else None
                ended = at if status in ENDED_STATUSES else None
                conn.execute(
                    "INSERT INTO tool_calls (invocation_id, call_id, turn, tool, status, "
                    "started_at, ended_at) VALUES (?, ?, ?, ?, ?, ?, ?) "
                    "ON CONFLICT (invocation_id, call_id) DO UPDATE SET "
                    "status = excluded.status, "
                    "started_at = COALESCE(excluded.started_at, tool_calls.started_at), "
                    "ended_at = COALESCE(excluded.ended_at, tool_calls.ended_at)",
                    (invocation_id, call_id, turn, tool, status, started, ended))

        await self._transact(work, lock=invocation_id)

    async def release(self, invocation_id: str, owner: str, *,
                      paused_at: datetime | None) -> None:
        """Give back a run `claim` took, if ``owner`` still holds it: a resume
        that failed before it recorded anything (a ledger it could not read)
        leaves the run as it found it, paused since ``paused_at`` (or, None,
        free for a recovery), not held until its lease expires (internal)."""

        def work(conn: Any) -> None:
            conn.execute(
                "UPDATE run_states SET version = version + 1, lease_owner = NULL, "
                "lease_expires_at = NULL, paused_at = ? WHERE invocation_id = ? "
                "AND lease_owner = ?",
                (None if paused_at is None else format_time(paused_at), invocation_id,
                 owner))

        await self._transact(work, lock=invocation_id)

    async def drop(self, invocation_id: str, owner: str | None, *,
                   version: int | None = None) -> None:
        """Delete the ended run's row if ``owner`` holds it (or, given ``version``,
        if it is still at that version, whoever holds it), and mark ``in_doubt``
        its calls still ``started``: the run ended while their handlers ran
        (its deadline or a cancellation cut them), so whether they did their
        work is not known (internal). A row ``owner`` does not hold (another
        process took the run over, and holds or paused it) is left as it is.
        """
        held = ("version", version) if version is not None else ("lease_owner", owner)

        def work(conn: Any) -> None:
            dropped = conn.execute(f"DELETE FROM run_states WHERE invocation_id = ? AND "
                                   f"{held[0]} = ?", (invocation_id, held[1])).rowcount
            if dropped:
                conn.execute("UPDATE tool_calls SET status = 'in_doubt' WHERE "
                             "invocation_id = ? AND status = 'started'", (invocation_id,))

        await self._transact(work, lock=invocation_id)

    # -- the transaction -------------------------------------------------------------------

    async def _transact(self, work: Callable[[Any], T], *, lock: str | None = None) -> T:
        """``work(connection)`` in one transaction (``?`` parameters on every store);
        ``lock``: the run whose rows it writes (`_transact`)."""
        return await _transact(self.ledger, self._memory, work, lock)


async def holds_run(ledger: Any, invocation_id: str) -> bool:
    """Whether a run store on ``ledger`` holds the run ``invocation_id`` (it
    paused, or its process died, under a run store), in one query; False for a
    ledger no run store can live in (`RunStore`).

    Raises:
        LedgerError: the database could not be read.
    """
    if not isinstance(ledger, SQLiteLedger | PostgresLedger | MemoryLedger):
        return False
    memory = _MEMORY.get(ledger) if isinstance(ledger, MemoryLedger) else None
    if isinstance(ledger, MemoryLedger) and memory is None:
        return False  # no run store was ever made on it

    def work(conn: Any) -> bool:
        return conn.execute("SELECT 1 FROM run_states WHERE invocation_id = ?",
                            (invocation_id,)).fetchone() is not None

    return await _transact(ledger, memory, work)


async def _transact(ledger: SQLiteLedger | PostgresLedger | MemoryLedger,
                    memory: sqlite3.Connection | None, work: Callable[[Any], T],
                    lock: str | None = None) -> T:
    """``work(connection)`` in one transaction on the run store tables of
    ``ledger`` (``memory``: a `MemoryLedger`'s), ``?`` parameters on every store.

    ``lock``: the run whose rows ``work`` writes (its ``run_states`` row, then
    its ``tool_calls``), each held until the commit: the writer runs the calls
    it commits together in the runs' order, as every host's does, so two
    hosts each writing runs the other writes (resuming, recovering or taking
    them over) never wait for each other (`Call.lock`)."""
    failure = "the run store could not be written"
    if isinstance(ledger, PostgresLedger | SQLiteLedger):
        return await ledger._transact_qmark(
            work, failure, lock=None if lock is None else ("run_states", lock))
    conn = memory
    assert conn is not None
    try:
        conn.execute("BEGIN IMMEDIATE")
        try:
            result = work(conn)
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
    except sqlite3.Error as error:
        raise LedgerError(f"{failure}: {error}") from error
    return result

