"""A run that delegated to a sub-agent and then pauses (docs/pause-and-resume.md,
docs/tools.md): its sub-agent's credits are part of what its pause settles, of
what its resume's hold and reservation count, and of its total after the resume."""

from __future__ import annotations

from pathlib import Path

import pytest

import loopengine as le
from loopengine import audit
from loopengine.persistence import SQLiteLedger
from loopengine.testing import Reply

from ..pause_scenarios import Sender, send
from .conftest import Route
from .test_subagents import ACME, spend


async def test_a_pause_settles_its_sub_agents_credits_and_its_resume_counts_them(
        route: Route, tmp_path: Path) -> None:
    """Parent turn 10, child 200, parent turn 10 that pauses, then a resumed
    turn of 10. The pause settles the tree's 220; the resume reserves what the
    hold leaves of the tree (1000 - 220); the run ends with the tree's 230,
    charged once, and the audit reconciles."""
    sender = Sender()
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as ledger:
        accounts = le.CreditAccounts(ledger)
        engine, _ = route.wire.engine(
            Reply.tool_calls(("helper", {"task": "research"}), usage=spend(10)),
            Reply.text("found it", usage=spend(200)),
            Reply.tool_calls(send("bob"), usage=spend(10)),
            Reply.text("told bob", usage=spend(10)),
            ledger=ledger, accounts=accounts)
        await accounts.grant("acme", 10_000)
        helper = le.agent_tool(engine, route.named("child.op"), name="helper",
                               description="Helps.")
        paused = await engine.run(route.named("parent.op", credit_hold=1000), "go",
                                  tools=[helper, sender.tool], attribution=ACME)
        assert paused.outcome is le.Outcome.PAUSED and paused.state is not None
        assert (paused.credits, paused.credits_total) == (20, 220)
        assert await accounts.balance("acme") == le.AccountBalance("acme", 10_000, 220, 0,
                                                                     9_780)
        done = await engine.resume(paused.state.dumps(), tools=[helper, sender.tool],
                                   decisions={paused.pending[0].id: le.Approve()})
        balance = await accounts.balance("acme")
        conn = audit.open_ledger(path)
        try:
            reserved = [int(r[0]) for r in conn.execute(
                "SELECT credits FROM account_entries WHERE kind = 'reserve' ORDER BY id")]
            report = audit.reconcile(conn)
        finally:
            conn.close()
    assert done.outcome is le.Outcome.COMPLETED and sender.sent == ["bob"]
    assert (done.credits, done.credits_total) == (30, 230)
    assert reserved == [1000, 780]
    assert balance == le.AccountBalance("acme", 10_000, 230, 0, 9_770)
    assert report.ok, report


async def test_a_resumed_runs_hold_counts_its_sub_agents_credits(
        route: Route, tmp_path: Path) -> None:
    """Without an account too: a hold of 300, the child's 200 spent before the
    pause; the resumed turn (100) takes the tree past it, so the run ends
    credit_limit before another turn, as it would have without the pause."""
    sender = Sender()
    with SQLiteLedger(tmp_path / "ledger.db") as ledger:
        engine, _ = route.wire.engine(
            Reply.tool_calls(("helper", {"task": "research"}), usage=spend(10)),
            Reply.text("found it", usage=spend(200)),
            Reply.tool_calls(send("bob"), usage=spend(10)),
            Reply.tool_calls(("helper", {"task": "more"}), usage=spend(100)),
            Reply.text("never sent"),
            ledger=ledger)
        helper = le.agent_tool(engine, route.named("child.op"), name="helper",
                               description="Helps.")
        paused = await engine.run(route.named("parent.op", credit_hold=300), "go",
                                  tools=[helper, sender.tool])
        assert paused.state is not None and paused.credits_total == 220
        done = await engine.resume(paused.state, tools=[helper, sender.tool],
                                   decisions={paused.pending[0].id: le.Approve()})
    assert done.outcome is le.Outcome.CREDIT_LIMIT
    assert done.credits_total == 320 and sender.sent == ["bob"]
    assert len(route.wire.requests) == 4


class Crash(BaseException):
    """Stands in for the death of the process (nothing catches it)."""


async def test_a_run_recovered_after_its_sub_agent_was_cut_by_the_crash_counts_its_spend(
        route: Route, tmp_path: Path) -> None:
    """The process dies inside the sub-agent's tool, after the child's reply
    (200) was settled and before any checkpoint knew of it. Recovered by id,
    the parent learns from the ledger what its sub-agent charged: its total,
    its account and its ledger agree on the tree's 220."""
    path = tmp_path / "ledger.db"

    @le.tool
    def explode(key: str) -> str:
        """Die."""
        raise Crash

    with SQLiteLedger(path) as ledger:
        accounts = le.CreditAccounts(ledger)
        await accounts.grant("acme", 10_000)
        engine, _ = route.wire.engine(
            Reply.tool_calls(("helper", {"task": "research"}), usage=spend(10)),
            Reply.tool_calls(("explode", {"key": "k"}), usage=spend(200)),
            Reply.text("done", usage=spend(10)),
            ledger=ledger, accounts=accounts, run_store=le.RunStore(ledger))
        helper = le.agent_tool(engine, route.named("child.op"), name="helper",
                               description="Helps.", tools=[explode])
        with pytest.raises(BaseException):  # noqa: B017 - the stand-in for a dead process
            await engine.run(route.named("parent.op", credit_hold=1000, total_time=600.0),
                             "go", tools=[helper], attribution=ACME)
        conn = audit.open_ledger(path)
        try:
            [run_id] = [str(r[0]) for r in conn.execute(
                "SELECT id FROM invocations WHERE parent_invocation_id IS NULL")]
        finally:
            conn.close()
        paused = await engine.resume(run_id, tools=[helper], force=True)
        assert [c.reason for c in paused.pending] == ["in_doubt"]
        done = await engine.resume(run_id, tools=[helper],
                                   decisions={paused.pending[0].id: le.Supply("found it")})
        balance = await accounts.balance("acme")
    assert done.outcome is le.Outcome.COMPLETED
    assert (done.credits, done.credits_total) == (20, 220)
    assert (balance.spent, balance.reserved) == (220, 0)
