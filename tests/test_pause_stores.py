"""A paused invocation on every ledger store (memory, SQLite, PostgreSQL): the
planner takes its further writes, `read_progress` gives its budgets back, and
its account settles per running segment (docs/pause-and-resume.md)."""

from __future__ import annotations

import contextlib
import random
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

import loopengine as le
from loopengine.persistence import PostgresLedger, SQLiteLedger
from loopengine.providers import Reply, ScriptedProvider
from loopengine.testing import FakeClock

from .conftest import PRICES, operation
from .pause_scenarios import Sender, send
from .postgres_support import PostgresServer, fresh_schema

STORES = ["memory", "sqlite", "postgres"]


@pytest.fixture
def ledger(each_ledger: Any) -> Any:
    """Each store in turn (`each_ledger`)."""
    return each_ledger


async def paused_on(ledger: Any, clock: FakeClock) -> tuple[le.Engine, Sender, le.RunResult]:
    """A run paused on ``send`` (its next reply says ``done``): its engine, tool, result."""
    sender = Sender()
    provider = ScriptedProvider([Reply.tool_calls(send("a")), Reply.text("done")], clock=clock)
    engine = le.Engine(provider, ledger=ledger, clock=clock, prices=PRICES,
                       rng=random.Random(7))
    paused = await engine.run(operation(), "go", tools=[sender.tool])
    assert paused.state is not None
    return engine, sender, paused


async def test_a_paused_invocation_takes_writes_and_reads_back_its_progress(
        ledger: Any, clock: FakeClock) -> None:
    """Paused: read_progress says paused, with its turns, credits, attempts and the
    time it paused; resumed to its end: completed, ordinals dense."""
    engine, sender, paused = await paused_on(ledger, clock)
    progress = await ledger.read_progress(paused.invocation_id)
    assert (progress.outcome, progress.turns, progress.tool_calls, progress.credits,
            progress.attempt_count) == ("paused", 1, 0, 120, 1)
    assert isinstance(progress.ended_at, datetime)
    assert progress.ended_at == paused.state.paused_at
    done = await engine.resume(paused.state, decisions={paused.pending[0].id: le.Approve()},
                               tools=[sender.tool])
    assert done.outcome is le.Outcome.COMPLETED
    progress = await ledger.read_progress(paused.invocation_id)
    assert (progress.outcome, progress.turns, progress.tool_calls, progress.credits,
            progress.attempt_count) == ("completed", 2, 1, 240, 2)
    assert await ledger.read_progress("no-such-invocation") is None


async def paused_on_account(store: Any, clock: FakeClock, sender: Sender, granted: int,
                            hold: int = 500) -> tuple[le.Engine, ScriptedProvider,
                                                      le.CreditAccounts, le.RunResult]:
    """A run on account ``acme`` (granted ``granted``, ``hold``), paused on ``send``."""
    accounts = le.CreditAccounts(store)
    await accounts.grant("acme", granted)
    provider = ScriptedProvider([Reply.tool_calls(send("a")), Reply.text("done")], clock=clock)
    engine = le.Engine(provider, ledger=store, clock=clock, prices=PRICES, accounts=accounts)
    paused = await engine.run(operation(credit_hold=hold), "go", tools=[sender.tool],
                              attribution=le.Attribution(tenant="acme"))
    return engine, provider, accounts, paused


async def test_accounts_across_a_pause_on_postgres(postgres_server: PostgresServer,
                                                   clock: FakeClock) -> None:
    """On PostgreSQL too: the pause settles 120 and releases the hold; the resume
    reserves what the hold leaves; the run ends with 240 spent and nothing held."""
    sender = Sender()
    async with PostgresLedger(postgres_server.dsn(), schema=fresh_schema()) as store:
        engine, provider, accounts, paused = await paused_on_account(store, clock, sender, 1000)
        assert await accounts.balance("acme") == le.AccountBalance("acme", 1000, 120, 0, 880)
        assert paused.state is not None
        done = await engine.resume(paused.state, decisions={paused.pending[0].id: le.Approve()},
                                   tools=[sender.tool])
        assert done.outcome is le.Outcome.COMPLETED
        assert await accounts.balance("acme") == le.AccountBalance("acme", 1000, 240, 0, 760)


async def test_a_resume_its_account_cannot_admit_keeps_the_state(tmp_path: Path,
                                                                  clock: FakeClock) -> None:
    """Nothing available at the resume: admission_denied, nothing sent, the state
    kept, the invocation paused again; after a grant the same state resumes,
    the one the caller held from the first pause too (time passed during the
    denied resume adds no running time: its seal is unchanged)."""
    sender = Sender()
    with SQLiteLedger(tmp_path / "ledger.db") as store:
        engine, provider, accounts, paused = await paused_on_account(store, clock, sender, 150)
        assert paused.state is not None
        engine.observers = [*engine.observers, lambda event: clock.advance(5) if isinstance(
            event, le.events.RunResumed) else None]
        # Another run spends what is left.
        other = await accounts.reserve("acme", "someone-else", 30, expires_at=datetime.max,
                                       credits_per_usd=PRICES.credits_per_usd,
                                       credit_quantum=PRICES.credit_quantum)
        assert other.credits == 30
        decisions = {paused.pending[0].id: le.Approve()}
        denied = await engine.resume(paused.state, decisions=decisions, tools=[sender.tool])
        assert denied.outcome is le.Outcome.ADMISSION_DENIED
        assert denied.state is not None and denied.pending == paused.pending
        assert sender.sent == [] and len(provider.requests) == 1
        assert (await store.read_progress(paused.invocation_id)).outcome == "paused"
        assert denied.state.seal() == paused.state.seal()
        await accounts.grant("acme", 1000)
        done = await engine.resume(paused.state.dumps(), decisions=decisions,
                                   tools=[sender.tool])
        assert done.outcome is le.Outcome.COMPLETED and sender.sent == ["a"]
        assert done.invocation_id == paused.invocation_id


async def test_r03_a_run_paused_at_exactly_its_hold_resumes_on_its_account(
        tmp_path: Path, clock: FakeClock) -> None:
    """Its one turn charged exactly its hold (120 of 120) before it paused:
    reaching the hold is no trip, so the resume is admitted (a credit reserved),
    the approved call runs, and its next turn crosses the hold as a run
    without an account's would; the account is charged the 240."""
    sender = Sender()
    with SQLiteLedger(tmp_path / "ledger.db") as store:
        engine, _, accounts, paused = await paused_on_account(store, clock, sender, 10_000,
                                                              hold=120)
        assert paused.outcome is le.Outcome.PAUSED and paused.credits == 120
        done = await engine.resume(paused.state, tools=[sender.tool],
                                   decisions={paused.pending[0].id: le.Approve()})
        balance = await accounts.balance("acme")
    assert done.outcome is le.Outcome.COMPLETED and sender.sent == ["a"]
    assert done.credits == 240 and (balance.spent, balance.reserved) == (240, 0)


async def test_a_resume_at_exactly_its_hold_denied_says_what_it_asked_for(
        tmp_path: Path, clock: FakeClock) -> None:
    """Paused at exactly its hold (120 of 120) on an account nothing is left in:
    the resume asks for one credit and is denied, and its message says it was
    that credit, its hold already spent, not a hold of 1."""
    sender = Sender()
    with SQLiteLedger(tmp_path / "ledger.db") as store:
        engine, provider, _, paused = await paused_on_account(store, clock, sender, 120,
                                                              hold=120)
        assert paused.state is not None and paused.credits == 120
        denied = await engine.resume(paused.state, tools=[sender.tool],
                                     decisions={paused.pending[0].id: le.Approve()})
    assert denied.outcome is le.Outcome.ADMISSION_DENIED and sender.sent == []
    assert len(provider.requests) == 1
    assert ("nothing to reserve for the 1 credit this resumed run asks for "
            "(120 of its hold already spent)") in denied.detail
    assert "hold of 1" not in denied.detail


@pytest.mark.parametrize("store_kind", ["sqlite", "postgres"])
async def test_a_run_paused_on_an_account_resumes_only_where_that_account_is_charged(
        store_kind: str, tmp_path: Path, request: pytest.FixtureRequest,
        clock: FakeClock) -> None:
    """A run that reserved on acme, resumed on an engine without accounts or one
    whose key names another account: a ConfigError before anything is sent or
    recorded (its segment would spend uncharged); on an engine charging acme it
    resumes, and acme is charged the whole run."""
    sender = Sender()
    async with contextlib.AsyncExitStack() as stack:
        if store_kind == "sqlite":
            store: Any = stack.enter_context(SQLiteLedger(tmp_path / "ledger.db"))
        else:
            server: PostgresServer = request.getfixturevalue("postgres_server")
            store = await stack.enter_async_context(
                PostgresLedger(server.dsn(), schema=fresh_schema()))
        _, provider, accounts, paused = await paused_on_account(store, clock, sender, 1000)
        assert paused.state is not None
        decisions = {paused.pending[0].id: le.Approve()}
        elsewhere = le.CreditAccounts(store, key=lambda attribution: "globex")
        for wrong in (None, elsewhere):
            engine = le.Engine(provider, ledger=store, clock=clock, prices=PRICES,
                               accounts=wrong)
            with pytest.raises(le.ConfigError, match="reserved its credits on account 'acme'"):
                await engine.resume(paused.state, decisions=decisions, tools=[sender.tool])
        assert sender.sent == [] and len(provider.requests) == 1
        assert (await store.read_progress(paused.invocation_id)).outcome == "paused"
        engine = le.Engine(provider, ledger=store, clock=clock, prices=PRICES,
                           accounts=accounts)
        done = await engine.resume(paused.state, decisions=decisions, tools=[sender.tool])
        assert done.outcome is le.Outcome.COMPLETED and sender.sent == ["a"]
        assert await accounts.balance("acme") == le.AccountBalance("acme", 1000, 240, 0, 760)
