"""One crossing turn for a whole tree of delegated runs (docs/tools.md, R03): children
running at once in one tool batch take turns to send while a hold may be crossed,
so the tree passes its root's hold by one turn's charge at most."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio

import loopengine as le
from loopengine import audit
from loopengine.persistence import SQLiteLedger
from loopengine.providers import Reply, ScriptedProvider
from loopengine.providers._base import ProviderRequest, ProviderResponse, TextCallback
from loopengine.testing import FakeClock
from loopengine.testing import Reply as WireReply

from ..conftest import PRICES
from .conftest import Route
from .test_audit_tree import named
from .test_subagents import ACME, lookup, spend

HOLD, CHILD_TURN = 100, 60


class InFlightProvider(ScriptedProvider):
    """A script that counts the requests in flight at once: each request first lets
    every other task run until it blocks (a sibling ready to send sends meanwhile,
    unless the crossing permit holds it back), then is served."""

    in_flight = 0
    most_in_flight = 0

    async def send(self, request: ProviderRequest, *,
                   on_text: TextCallback | None = None) -> ProviderResponse:
        """Serve the next item, counting the requests in flight meanwhile."""
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await anyio.wait_all_tasks_blocked()
            return await super().send(request, on_text=on_text)
        finally:
            self.in_flight -= 1


def three_researchers(reply: Any) -> list[Any]:
    """The parent's batch of three delegations (10 credits), then six child turns of
    60 each: enough for every child to send twice if nothing held them back."""
    batch = reply.tool_calls(*[("researcher", {"task": t}) for t in "abc"], usage=spend(10))
    child = [reply.tool_calls(("lookup", {"key": str(i)}), usage=spend(CHILD_TURN))
             for i in range(6)]
    return [batch, *child, reply.text("parent answer")]


async def run_tree(engine: le.Engine, operation: Any, accounts: le.CreditAccounts
                   ) -> tuple[le.RunResult, le.AccountBalance]:
    """The parent (hold 100) with its researcher tool, on acme's account of 1000."""
    await accounts.grant("acme", 1000)
    researcher = le.agent_tool(engine, operation("child.op"), name="researcher",
                               description="Researches a task.", tools=[lookup])
    result = await engine.run(operation("parent.op", credit_hold=HOLD), "go",
                              tools=[researcher], attribution=ACME)
    return result, await accounts.balance("acme")


def check_settled(path: Path, result: le.RunResult, balance: le.AccountBalance) -> None:
    """Each row keeps its own credits, the account settled the tree's once, and the
    audit reconciles."""
    conn = audit.open_ledger(path)
    try:
        rows = [dict(r) for r in conn.execute(
            "SELECT operation, outcome, credits, parent_invocation_id FROM invocations")]
        entries = [tuple(r) for r in conn.execute(
            "SELECT kind, credits FROM account_entries WHERE kind != 'grant' ORDER BY id")]
        report = audit.reconcile(conn)
    finally:
        conn.close()
    children = [r for r in rows if r["operation"] == "child.op"]
    assert sorted(r["credits"] for r in children) == [0, CHILD_TURN, CHILD_TURN]
    assert {r["outcome"] for r in children} == {"credit_limit"}
    assert {r["parent_invocation_id"] for r in children} == {result.invocation_id}
    assert entries == [("reserve", HOLD), ("settle", result.credits_total),
                       ("release", HOLD)]
    assert (balance.spent, balance.reserved) == (result.credits_total, 0)
    assert report.ok, report


async def test_concurrent_children_take_turns_to_cross_and_the_tree_crosses_once(
    clock: FakeClock, tmp_path: Path,
) -> None:
    """Three children at once, each turn 60, under a hold of 100 with 10 spent: one
    request is in flight at a time; the first child's turn (70), the second's
    crosses (130), and nothing more is sent: 130 is past 100 by less than one
    turn (without the permit the third child's turn is sent too: 190)."""
    provider = InFlightProvider(three_researchers(Reply), clock=clock)
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as ledger:
        engine = le.Engine(provider, ledger=ledger, clock=clock, prices=PRICES,
                           accounts=(accounts := le.CreditAccounts(ledger)))
        result, balance = await run_tree(engine, named, accounts)
    assert provider.most_in_flight == 1
    assert len(provider.requests) == 3  # the parent's, then two child turns; no more
    assert result.outcome is le.Outcome.CREDIT_LIMIT
    assert (result.credits, result.credits_total) == (10, 10 + 2 * CHILD_TURN)
    assert result.credits_total - HOLD <= CHILD_TURN
    check_settled(path, result, balance)


async def test_the_tree_crosses_once_through_each_provider_s_wire(
    route: Route, tmp_path: Path,
) -> None:
    """The same tree through the real SDKs and their fake servers: two child turns
    sent, the tree's 130 past the hold of 100 by less than one turn, settled once."""
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as ledger:
        accounts = le.CreditAccounts(ledger)
        engine, _ = route.wire.engine(*three_researchers(WireReply), ledger=ledger,
                                      accounts=accounts)
        result, balance = await run_tree(engine, route.named, accounts)
    assert len(route.wire.requests) == 3
    assert result.outcome is le.Outcome.CREDIT_LIMIT
    assert result.credits_total == 10 + 2 * CHILD_TURN
    check_settled(path, result, balance)
