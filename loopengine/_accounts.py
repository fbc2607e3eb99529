"""`CreditAccounts`: prepaid credit balances that admit runs (docs/accounts.md).

A run on an account reserves its credit hold before its first request and
settles its real charge at its end. Both are one transaction on the ledger's
own database (``BEGIN IMMEDIATE`` on a SQLite file; on PostgreSQL one that
first takes the account's row lock), so the check and the reservation cannot
interleave with another process's: the runs of every process (and host)
together never reserve more than the account has.

Every change is a row of the append-only journal ``account_entries``; the
``accounts`` row is kept equal to the journal's sums, in the same
transaction:

* ``granted`` = the ``grant`` entries;
* ``spent`` = the ``settle`` and ``expire`` entries (real charges);
* ``reserved`` = the ``reserve`` entries minus the ``release`` entries.

The reservations not yet released are also rows of ``open_reservations``,
written and deleted with their journal entries (`_account_store.journal`):
a transaction finds an account's expired ones there, at a cost that follows
the runs in flight, not every run the account has had.

A reservation carries an expiry (the run's deadline plus a grace). Whichever
process next touches the account (an admission, a grant, a balance) settles
an expired reservation whose run never settled (its process died): charged
what the ledger's settled attempts of that invocation charged (its credits,
if it ended), and released.

Each transaction runs on the ledger's own connection, in its writer thread,
between two batches of the ledger's writes (`ThreadedLedger._transact_qmark`): the
event loop never waits on the database, and no connection is opened per
transaction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any, TypeVar

from loopengine import _validate
from loopengine._attribution import Attribution
from loopengine._clock import Clock, SystemClock
from loopengine._errors import ConfigError
from loopengine.persistence import _account_store as store
from loopengine.persistence._account_store import AccountBalance
from loopengine.persistence._postgres import PostgresLedger
from loopengine.persistence._schema import format_time
from loopengine.persistence._sqlite import SQLiteLedger

__all__ = ["AccountBalance", "CreditAccounts", "Reservation", "recorded_account"]

T = TypeVar("T")

DEFAULT_EXPIRY_GRACE = 60.0
"""Seconds past a run's deadline before its reservation may be settled by another process."""

UNBOUNDED_RUN = 3600.0
"""The deadline assumed, for expiry only, of a run without ``total_time``."""


@dataclass(frozen=True, slots=True)
class Reservation:
    """A run's admission: what it reserved on which account (internal)."""

    account: str
    invocation_id: str
    credits: int
    """The hold reserved; 0 when the run was denied."""
    available: int
    """What the account had available before this reservation."""
    entry: int | None = None
    """Its ``reserve`` entry's id in the journal (None when denied): what its
    settlement releases, and only while it is still held."""


class CreditAccounts:
    """Prepaid credit balances on a ledger's database, for `loopengine.Engine`.

    Args:
        ledger: The `SQLiteLedger` (or `PostgresLedger`) whose database holds
            the accounts.
        key: ``(Attribution) -> str | None``: the account of a run (default:
            its ``tenant``); a plain function, not an ``async def`` one. A
            run whose key is None runs outside accounts.
        default_hold: The credit hold of a run on an account whose operation
            publishes none (a run on an account needs one).
        expiry_grace: Seconds past a run's deadline after which another
            process may settle its reservation (its process is taken as dead).
        clock: Where the current time comes from, for the journal's times
            and the expiry of reservations (both their dates and when they
            pass, whatever clock a run's engine keeps): the engine's clock
            (`loopengine.testing.FakeClock` in tests); default the system's.

    Raises:
        ConfigError: a ledger that cannot hold accounts, or a bad argument.
    """

    def __init__(
        self,
        ledger: Any,
        *,
        key: Callable[[Attribution], str | None] | None = None,
        default_hold: int | None = None,
        expiry_grace: float = DEFAULT_EXPIRY_GRACE,
        clock: Clock | None = None,
    ) -> None:
        if isinstance(ledger, PostgresLedger):
            path = ledger.name
        elif isinstance(ledger, SQLiteLedger):
            path = ledger.path
        else:
            raise ConfigError("ledger", "credit accounts live in the ledger's database: give "
                                        f"them a SQLiteLedger or a PostgresLedger, not "
                                        f"{_validate.shown(ledger)}")
        if key is not None:
            _validate.sync_callable("key", key, "(Attribution) -> str | None")
        _validate.integer("default_hold", default_hold, minimum=1, optional=True)
        _validate.seconds("expiry_grace", expiry_grace, positive=False)
        _validate.clock("clock", clock)
        self.ledger: SQLiteLedger | PostgresLedger = ledger
        self.path: str = path
        """The SQLite file, or the PostgreSQL server's name (never a password)."""
        self.default_hold = default_hold
        self.expiry_grace = float(expiry_grace)
        self._key = key
        self._clock: Clock = clock or SystemClock()

    def __repr__(self) -> str:
        return f"CreditAccounts({self.path!r}, default_hold={self.default_hold})"

    def account_for(self, attribution: Attribution) -> str | None:
        """The account a run with ``attribution`` is charged to (None: no account)."""
        if self._key is None:
            return attribution.tenant
        account = self._key(attribution)
        if account is not None:
            _validate.recorded_name("accounts.key", account)
        return account

    # -- the public operations ------------------------------------------------------

    async def grant(self, account: str, credits: int, note: str | None = None) -> AccountBalance:
        """Add ``credits`` to ``account`` (created at its first grant); return its balance.

        Raises:
            ConfigError: an empty account name, credits not a positive integer,
                or a grant that would take the account's granted credits past
                2**63 - 1 (nothing is written).
            LedgerError: the database could not be written.
        """
        _check_account(account)
        _validate.required_integer("credits", credits, minimum=1)
        _validate.recorded_text("note", note)

        def work(conn: Any, now: str) -> tuple[AccountBalance, bool]:
            store.lock(conn, account)
            store.close_reservations(conn, account, now, expired=True)
            before = store.read(conn, account)
            if before.granted > _validate.MAX_INTEGER - credits:
                # SQLite would store the sum as an inexact real, PostgreSQL refuse it.
                return before, False
            store.journal(conn, account, now, "grant", credits, None, note)
            # Read again, not added to ``before``: an account created by this
            # grant had no row to lock, and another host's first grant,
            # committed meanwhile, is in the row this one added to.
            return store.read(conn, account), True

        balance, granted = await self._transaction(account, work)
        if not granted:
            raise ConfigError("credits", f"account {account!r} has {balance.granted} "
                                         f"granted: {credits} more would pass the largest "
                                         f"count a ledger stores ({_validate.MAX_INTEGER})")
        return balance

    async def balance(self, account: str) -> AccountBalance:
        """``account``'s granted, spent, reserved and available credits (zeros if unknown).

        Settles the account's expired reservations first.

        Raises:
            LedgerError: the database could not be read or written.
        """
        _check_account(account)

        def work(conn: Any, now: str) -> AccountBalance:
            store.lock(conn, account)
            store.close_reservations(conn, account, now, expired=True)
            return store.read(conn, account)

        return await self._transaction(account, work)

    # -- what the engine calls ----------------------------------------------------------

    def expiry(self, total_time: float | None) -> datetime:
        """When a reservation made now, for a run of ``total_time`` seconds (None:
        unbounded), may be settled by another process (internal): dated by these
        accounts' clock, the one every admission, grant and balance reads
        expiries with, whatever clock the run's engine keeps."""
        return self._clock.wall() + timedelta(seconds=(total_time or UNBOUNDED_RUN)
                                              + self.expiry_grace)

    async def reserve(self, account: str, invocation_id: str, hold: int, *,
                      expires_at: datetime, credits_per_usd: Decimal,
                      credit_quantum: int, margin: int = 0) -> Reservation:
        """Reserve up to ``hold + margin`` credits for a run, in one transaction
        (internal); ``margin`` is the worst case of its crossing turn's server-tool
        fees.

        Less available narrows the reservation to what is; nothing available
        past the margin reserves nothing (``credits == 0``) and writes nothing.
        A reservation of the same invocation still held is a running segment's
        whose process died (a recovery reserves again): it is settled for what
        the ledger says it spent and released first, in the same transaction.
        """

        def work(conn: Any, now: str) -> Reservation:
            store.lock(conn, account)
            store.close_reservations(conn, account, now, expired=True, recovered=invocation_id)
            available = store.read(conn, account).available
            amount = max(0, min(hold + margin, available))
            if amount <= margin:
                amount = 0  # nothing left for the hold itself
            entry = None
            if amount:
                entry = store.journal(conn, account, now, "reserve", amount, invocation_id,
                                      None, expires_at=format_time(expires_at),
                                      rate=str(credits_per_usd), quantum=credit_quantum)
            return Reservation(account, invocation_id, amount, available, entry)

        return await self._transaction(account, work)

    async def recover(self, account: str, invocation_id: str, *,
                      stopped: bool = False) -> None:
        """Settle the reservation a run's dead segment left, for what the ledger
        says it spent, and release it (internal): a recovered run that pauses
        at once, before it reserves again, holds nothing while it waits.

        ``stopped``: instead, the reservation a run's admission made after the
        run stopped waiting for it (its caller cancelled it, or its deadline
        passed), settled at the run's end. Queued on the ledger's writer after
        that admission, it finds the reservation made (or none, when the
        admission reserved nothing); on a ledger already closing, where it may
        run on a writer of its own first, the reservation is left to its
        expiry."""

        def work(conn: Any, now: str) -> None:
            store.lock(conn, account)
            store.close_reservations(conn, account, now, expired=False,
                                     recovered=invocation_id, stopped=stopped)

        await self._transaction(account, work)

    async def settle(self, reservation: Reservation, credits: int) -> None:
        """Charge a run's real ``credits`` (its total so far) and release its
        reservation, in one transaction; once per reservation (a second call
        changes nothing) (internal). A resumed run's earlier segments were
        settled when it paused, and a run alive past its reservation's expiry
        was charged by the expiry what it had spent then: only what it charged
        since is added.

        Only ``reservation`` itself is released, and only while it is held: a
        settlement that lands late (its ledger was unreachable past the run's
        deadline) after a resume in another process recovered it and reserved
        anew leaves the new segment's reservation to that segment."""

        def work(conn: Any, now: str) -> None:
            store.lock(conn, reservation.account)
            invocation_id = reservation.invocation_id
            journaled = store.entries(conn, invocation_id)
            held = reservation.entry is not None and store.is_open(conn, reservation.entry)
            if not held and not journaled.outlived:
                return  # settled already, or recovered by a later segment
            # A run whose reservation expired while it still ran is charged
            # what it spent since, on top of what the expiry charged.
            charge = credits - journaled.settled
            if charge > 0:
                store.journal(conn, reservation.account, now, "settle", charge,
                              invocation_id, None)
            if held:
                store.journal(conn, reservation.account, now, "release", reservation.credits,
                              invocation_id, None)

        await self._transaction(reservation.account, work)

    # -- the transaction ------------------------------------------------------------------

    async def _transaction(self, account: str, work: Callable[[Any, str], T]) -> T:
        """``work(connection, now)`` in one transaction on the ledger's own connection
        (``BEGIN IMMEDIATE`` on SQLite; on PostgreSQL the row lock of ``account``,
        the one account it touches, serializes that account across hosts).

        A cancelled wait (the caller's, or the run's deadline) stops waiting;
        the transaction, once queued, still ends in the writer's thread: a
        reservation made after its run stopped waiting is settled by the run's
        end (`recover` with ``stopped``), which the writer runs after it.
        """
        now = format_time(self._clock.wall())
        return await self.ledger._transact_qmark(lambda conn: work(conn, now),
                                                 "the accounts could not be written",
                                                 lock=("accounts", account))


async def recorded_account(ledger: Any, invocation_id: str) -> str | None:
    """The account the run ``invocation_id`` reserved its credits on, as its
    journal says, or None: it never ran on an account (or ``ledger`` cannot
    hold accounts), in one query.

    Raises:
        LedgerError: the database could not be read.
    """
    if not isinstance(ledger, SQLiteLedger | PostgresLedger):
        return None
    return await ledger._transact_qmark(lambda conn: store.account_of(conn, invocation_id),
                                       "the accounts could not be read")


def _check_account(account: object) -> None:
    _validate.recorded_name("account", account)
