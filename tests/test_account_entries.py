"""How a run's settlement reads its journal entries: an expiry's release is
known by the reservation's expiry it carries (or, written by an earlier
version that kept none, by its note)."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
from typing import Any

import loopengine as le
from loopengine.persistence._account_store import RunEntries, entries, every_entries
from loopengine.testing import FakeClock


async def _reserve(accounts: le.CreditAccounts, clock: FakeClock, run: str) -> Any:
    return await accounts.reserve("acme", run, 100, expires_at=clock.wall() + timedelta(minutes=1),
                                  credits_per_usd=Decimal(1000), credit_quantum=1)


async def _expired(ledger: Any, run: str) -> tuple[le.CreditAccounts, Any]:
    """Accounts on ``ledger`` whose one reservation, of ``run``, has expired
    (found by the balance, which settles expired reservations) with nothing
    charged."""
    clock = FakeClock()
    accounts = le.CreditAccounts(ledger, clock=clock)
    await accounts.grant("acme", 1000)
    reservation = await _reserve(accounts, clock, run)
    clock.advance(120)
    assert await accounts.balance("acme") == le.AccountBalance("acme", 1000, 0, 0, 1000)
    return accounts, reservation


async def _releases(ledger: Any, run: str) -> list[tuple[Any, ...]]:
    return [tuple(r) for r in await ledger._transact_qmark(lambda conn: conn.execute(
        "SELECT note, expires_at IS NOT NULL FROM account_entries "
        "WHERE invocation_id = ? AND kind = 'release' ORDER BY id", (run,)).fetchall(), "read")]


async def test_a_run_alive_past_an_expiry_that_charged_nothing_settles_its_credits(
        each_database: Any) -> None:
    """An expiry that found nothing charged (no entry but its release): the run,
    still alive, settles its whole credits at its end, once."""
    accounts, reservation = await _expired(each_database, "alive")
    assert await _releases(each_database, "alive") == [
        ("released after its reservation expired", 1)]
    await accounts.settle(reservation, 40)
    await accounts.settle(reservation, 40)
    assert await accounts.balance("acme") == le.AccountBalance("acme", 1000, 40, 0, 960)


async def test_a_recovery_that_charged_nothing_is_not_an_expiry(each_database: Any) -> None:
    """A reservation a recovery released with no charge: a late settlement of
    the dead segment's reservation changes nothing."""
    clock = FakeClock()
    accounts = le.CreditAccounts(each_database, clock=clock)
    await accounts.grant("acme", 1000)
    reservation = await _reserve(accounts, clock, "dead")
    await accounts.recover("acme", "dead")
    assert await _releases(each_database, "dead") == [("released when its run was recovered", 0)]
    await accounts.settle(reservation, 40)
    assert await accounts.balance("acme") == le.AccountBalance("acme", 1000, 0, 0, 1000)


async def test_r03_an_expiry_written_without_expires_at_is_still_an_expiry(
        each_database: Any) -> None:
    """A fleet part-way through an upgrade shares one schema: an expiry's
    release written by the version that kept no ``expires_at`` on it (only its
    note says it was an expiry) still leaves the run alive past it to settle
    its credits."""
    accounts, reservation = await _expired(each_database, "alive")
    await each_database._transact_qmark(lambda conn: conn.execute(
        "UPDATE account_entries SET expires_at = NULL WHERE invocation_id = ? "
        "AND kind = 'release'", ("alive",)), "the earlier version's release")
    assert await _releases(each_database, "alive") == [
        ("released after its reservation expired", 0)]
    await accounts.settle(reservation, 40)
    assert await accounts.balance("acme") == le.AccountBalance("acme", 1000, 40, 0, 960)


async def test_every_runs_entries_read_at_once_are_each_runs_own(each_database: Any) -> None:
    """The audit reads every run's summary in one statement (`every_entries`): for
    a run alive past its expiry, one recovered, one settled and one still
    reserved it is what each run's own reading (`entries`) says."""
    await _expired(each_database, "alive")
    clock = FakeClock()
    accounts = le.CreditAccounts(each_database, clock=clock)
    await _reserve(accounts, clock, "dead")
    await accounts.recover("acme", "dead")
    await accounts.settle(await _reserve(accounts, clock, "done"), 25)
    await _reserve(accounts, clock, "running")

    def read(conn: Any) -> tuple[dict[str, RunEntries], list[RunEntries]]:
        runs = ("alive", "dead", "done", "running")
        return every_entries(conn), [entries(conn, run) for run in runs]

    every, each = await each_database._transact_qmark(read, "read")
    assert each == [RunEntries(True, True, 0), RunEntries(True, False, 0),
                    RunEntries(True, False, 25), RunEntries(False, False, 0)]
    assert every == dict(zip(("alive", "dead", "done", "running"), each, strict=True))
