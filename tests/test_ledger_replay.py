"""A PostgreSQL connection lost during a COMMIT: the writer reconnects and replays
the batch only if it did not commit, so nothing is written or counted twice.

The loss is made in the writer itself (its commit runs, or not, then its
connection is closed and the commit raises as libpq does), so no test races
the server: whatever the server says afterwards, the rows must be right.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import anyio
import pytest

import loopengine as le
from loopengine.persistence import PostgresLedger

from .ledger_support import dispatch, end, settle, start
from .postgres_support import PostgresServer, fresh_schema, read_postgres, require_module

psycopg = require_module("psycopg")


@pytest.fixture
def ledger(postgres_server: PostgresServer) -> Iterator[PostgresLedger]:
    """An open PostgresLedger on a schema of its own (no linger: every write is
    handed to the writer at once)."""
    made = PostgresLedger(postgres_server.dsn(), schema=fresh_schema(), linger=0)
    anyio.run(made.open)
    try:
        yield made
    finally:
        made.close()


def lose_next_commit(ledger: PostgresLedger, *, lands: bool, forget_id: bool = False) -> None:
    """The writer's next commit loses its connection: after committing when
    ``lands``, before otherwise; with ``forget_id`` the transaction's id is
    forgotten too, so the writer must read the rows to know."""
    writer: Any = ledger._writer
    real: Callable[[], None] = writer.finish

    def finish() -> None:
        del writer.finish  # once
        if lands:
            real()
        if forget_id:
            writer._xid = None
        writer._conn.close()
        raise psycopg.OperationalError("server closed the connection unexpectedly")

    writer.finish = finish


STEPS: dict[str, Callable[[PostgresLedger], Any]] = {
    "start": lambda ledger: ledger.start_invocation(start()),
    "dispatch": lambda ledger: ledger.dispatch_attempt(dispatch(1)),
    "settle": lambda ledger: ledger.settle_attempt(settle(1)),
    "end": lambda ledger: ledger.end_invocation(end()),
}
"""An invocation's writes, in order, each committed on its own (a flush after each)."""


@pytest.mark.parametrize("forget_id", [False, True], ids=["by-transaction-id", "by-rows"])
@pytest.mark.parametrize("lands", [True, False], ids=["committed", "not-committed"])
@pytest.mark.parametrize("lost", list(STEPS))
async def test_a_write_whose_commit_lost_its_connection_is_written_once(
    ledger: PostgresLedger, lost: str, lands: bool, forget_id: bool,
) -> None:
    """A start, dispatch, settle or end whose COMMIT lost the connection, whether
    that commit reached the server or not: the call returns as if nothing
    happened, the row is there once, and the totals count the attempt once."""
    for name, step in STEPS.items():
        if name == lost:
            lose_next_commit(ledger, lands=lands, forget_id=forget_id)
        with anyio.fail_after(30):
            await step(ledger)
            await ledger.flush()
    assert ledger.reconnects == 1
    invocations, attempts = read_postgres(ledger)
    (row,) = invocations.values()
    assert [(a["ordinal"], a["outcome"], a["input_tokens"]) for a in attempts.values()] == [
        (1, "ok", 10)]
    assert (row["outcome"], row["attempt_count"], row["attempts_retained"], row["input_tokens"],
            row["output_tokens"], row["cost_nanousd"]) == ("completed", 1, 1, 10, 2, 12)


@pytest.mark.parametrize("lands", [True, False], ids=["committed", "not-committed"])
async def test_an_account_transaction_whose_commit_lost_its_connection_runs_once(
    ledger: PostgresLedger, lands: bool,
) -> None:
    """A grant whose COMMIT lost the connection is applied once: not run again when
    the server says it committed, run again when it says it did not."""
    accounts = le.CreditAccounts(ledger)
    await accounts.grant("acme", 5)
    lose_next_commit(ledger, lands=lands)
    with anyio.fail_after(30):
        await accounts.grant("acme", 7)
    assert (await accounts.balance("acme")).granted == 12
    assert ledger.reconnects == 1


async def test_an_account_transaction_that_cannot_be_known_fails_rather_than_runs_twice(
    ledger: PostgresLedger,
) -> None:
    """When neither the transaction's id nor any row can say whether a lost COMMIT
    of the accounts landed, the grant raises LedgerError instead of being run a
    second time; it did land, once."""
    accounts = le.CreditAccounts(ledger)
    await accounts.grant("acme", 5)
    lose_next_commit(ledger, lands=True, forget_id=True)
    with anyio.fail_after(30), pytest.raises(le.LedgerError, match="cannot be read back"):
        await accounts.grant("acme", 7)
    assert (await accounts.balance("acme")).granted == 12


@pytest.mark.parametrize("forget_id", [False, True], ids=["by-transaction-id", "by-rows"])
async def test_a_resume_whose_commit_was_lost_is_never_taken_for_another_resumes(
    ledger: PostgresLedger, postgres_server: PostgresServer, forget_id: bool,
) -> None:
    """A resume's conditional write (running, taking the pause) loses its COMMIT,
    which did not land, and another resume takes the pause meanwhile: the
    writer does not read the other's ``running`` as its own (each resume
    writes a token of its own), replays, finds the pause gone and refuses the
    write, so only the other resume goes on."""
    await ledger.start_invocation(start())
    await ledger.end_invocation(replace(end(), outcome="paused", seal="s1"))
    await ledger.flush()
    writer: Any = ledger._writer

    def finish() -> None:
        del writer.finish  # once: this resume's write
        if forget_id:
            writer._xid = None
        writer._conn.close()  # lost before it landed
        # Another resume, in another process, takes the pause meanwhile.
        with psycopg.connect(postgres_server.dsn(), autocommit=True) as other:
            other.execute(psycopg.sql.SQL("UPDATE {}.invocations SET outcome = 'running', "
                                          "pause_seal = 'resumed:other' WHERE id = 'inv-1' "
                                          "AND outcome = 'paused' AND pause_seal = 's1'"
                                          ).format(psycopg.sql.Identifier(ledger.schema)))
        raise psycopg.OperationalError("server closed the connection unexpectedly")

    writer.finish = finish
    with anyio.fail_after(30), pytest.raises(le.LedgerError):
        await ledger.end_invocation(replace(end(), ended_at=None, outcome="running",
                                            seal="resumed:mine", expect_seal="s1"))
    assert ledger.reconnects == 1
    progress = await ledger.read_progress("inv-1")
    assert progress is not None
    assert (progress.outcome, progress.seal) == ("running", "resumed:other")
