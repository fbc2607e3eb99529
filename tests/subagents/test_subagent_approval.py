"""A delegated run whose tool batch needs approval (docs/tools.md): nothing could
resume it, so it ends ``incomplete`` with none of its batch run, instead of being
left paused for ever; its parent's model is told which calls needed approval."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import loopengine as le
from loopengine import audit, events
from loopengine.persistence import SQLiteLedger
from loopengine.testing import Reply

from ..pause_scenarios import Sender, send
from .conftest import Route
from .test_subagents import ACME, last_results


@pytest.mark.parametrize("how", ["agent_tool", "ctx.run"])
async def test_a_delegated_run_whose_batch_needs_approval_ends_incomplete_not_paused(
    route: Route, tmp_path: Path, how: str,
) -> None:
    """The child's reply asks for ``send`` (needs approval) and ``lookup`` (does
    not): neither handler runs, the child ends ``incomplete`` (its RunEnded
    emitted, no RunPaused, no run store row), the parent's model gets an
    ``is_error`` result naming ``send``, the parent completes, the account
    holds nothing and the audit reconciles."""
    sender = Sender()
    looked_up: list[str] = []
    children: list[le.RunResult] = []

    @le.tool
    def lookup(key: str) -> str:
        """Look a key up."""
        looked_up.append(key)
        return key.upper()

    seen: list[Any] = []
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as ledger:
        accounts = le.CreditAccounts(ledger)
        await accounts.grant("acme", 1000)
        engine, _ = route.wire.engine(
            Reply.tool_calls(("helper", {"task": "tell bob"})),                  # parent
            Reply.tool_calls(send("bob"), ("lookup", {"key": "bob"})),           # child
            Reply.text("bob was not told"),                                       # parent
            ledger=ledger, accounts=accounts, observers=[seen.append],
            run_store=le.RunStore(ledger))
        child_op = route.named("child.op", pause_timeout=60)
        if how == "agent_tool":
            helper = le.agent_tool(engine, child_op, name="helper", description="Helps.",
                                   tools=[sender.tool, lookup])
        else:
            @le.tool(name="helper")
            async def helper(task: str, ctx: le.ToolContext) -> str:
                """Helps."""
                child = await ctx.run(child_op, task, tools=[sender.tool, lookup])
                children.append(child)
                if child.outcome is not le.Outcome.COMPLETED:
                    raise RuntimeError(f"the helper ended {child.outcome.value}: "
                                       f"{child.detail}")
                return str(child.answer)
        result = await engine.run(route.named("parent.op", credit_hold=500), "go",
                                  tools=[helper], attribution=ACME)
        balance = await accounts.balance("acme")
        stored_runs = await le.RunStore(ledger).load(result.invocation_id)

    assert result.outcome is le.Outcome.COMPLETED and result.answer == "bob was not told"
    assert sender.sent == [] and looked_up == []
    assert len(route.wire.requests) == 3
    [answered] = last_results(result.messages[:3])
    text = str(answered["content"])
    assert answered["is_error"] and "incomplete" in text
    assert "approval" in text and "send" in text and "'to': 'bob'" in text
    if how == "ctx.run":
        [child] = children
        assert child.outcome is le.Outcome.INCOMPLETE
        assert child.pending == () and child.state is None
        # Its transcript closes every call of the batch as not run.
        closed = last_results(child.messages)
        assert [b["is_error"] for b in closed] == [True, True]
        assert all("Not run" in str(b["content"]) for b in closed)
    conn = audit.open_ledger(path)
    try:
        rows = {r["operation"]: dict(r) for r in conn.execute(
            "SELECT id, operation, outcome, parent_invocation_id FROM invocations")}
        kept = conn.execute("SELECT COUNT(*) FROM run_states").fetchone()[0]
        report = audit.reconcile(conn)
    finally:
        conn.close()
    child_row = rows["child.op"]
    assert child_row["outcome"] == "incomplete"
    assert child_row["parent_invocation_id"] == result.invocation_id
    assert rows["parent.op"]["outcome"] == "completed"
    assert kept == 0 and stored_runs is None
    ended = {e.run_id: e.outcome for e in seen if isinstance(e, events.RunEnded)}
    assert ended == {child_row["id"]: "incomplete", result.invocation_id: "completed"}
    assert not [e for e in seen if isinstance(e, events.RunPaused)]
    assert (balance.reserved, balance.spent) == (0, result.credits_total)
    assert report.ok, report
