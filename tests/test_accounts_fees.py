"""An account's reservation counts the worst case of a turn's server-tool fees
(docs/accounts.md): the hold plus every web search and web fetch tool used ``max_uses``
times, so the crossing turn's fees are reserved before they are spent."""

from __future__ import annotations

import dataclasses
from decimal import Decimal
from pathlib import Path

import pytest

import loopengine as le
from loopengine import events
from loopengine.persistence import SQLiteLedger
from loopengine.providers import Reply, ScriptedProvider

from .conftest import MODEL, operation
from .ledger_support import lookup, read_db
from .test_accounts import ACME, journal_matches

# One credit per token (1,000,000 credits per USD at $1 per million tokens); a web
# search is $0.05 per 1,000 (50 credits), a web fetch $0.02 per 1,000 (20 credits).
PRICES = le.PriceBook(
    [le.ModelPrice(provider="anthropic", model=MODEL, input_per_mtok=Decimal(1),
                   output_per_mtok=Decimal(1), web_search_per_k=Decimal("0.05"),
                   web_fetch_per_k=Decimal("0.02"))],
    credits_per_usd=Decimal(1_000_000))

TOOLS = (le.ServerTool(type="web_search_20250305", name="web_search", max_uses=3),
         le.ServerTool(type="web_fetch_20250910", name="web_fetch", max_uses=2),
         le.ServerTool(type="bash_20250124", name="bash"))
"""Worst case of one turn: 3 x 50 + 2 x 20 = 190 credits of fees (bash has none)."""

MARGIN = 190


def researching(**limits: object) -> le.Operation:
    """The tests' operation with the server tools above."""
    return dataclasses.replace(operation(**limits), server_tools=TOOLS)


def searching_turn() -> Reply:
    """A turn that uses every server tool to its max_uses: 120 credits of tokens plus
    the 190 of fees."""
    return Reply.tool_calls(("lookup", {"key": "k"}), usage=le.Usage(
        input_tokens=100, output_tokens=20, web_search_requests=3, web_fetch_requests=2))


def engine_on(ledger: SQLiteLedger, accounts: le.CreditAccounts,
              *script: Reply) -> tuple[le.Engine, ScriptedProvider, list[int]]:
    """An engine on the account, and the reserved credits seen at each attempt's start."""
    provider = ScriptedProvider(list(script))
    seen: list[int] = []

    async def watch(event: events.Event) -> None:
        if isinstance(event, events.AttemptStarted):
            seen.append((await accounts.balance("acme")).reserved)

    return le.Engine(provider, ledger=ledger, prices=PRICES, accounts=accounts,
                     observers=[watch]), provider, seen


async def test_the_reservation_is_the_hold_plus_a_turn_s_worst_case_fees(
    tmp_path: Path,
) -> None:
    """Hold 500, fees 190 at worst per turn: 690 is reserved. Two turns of 310 cross
    the hold (the second is the crossing turn, R03); the account, granted 700, is
    charged 620 and never goes below what it had, since the crossing turn's fees
    were reserved; the estimate's fee part is the same worst case, to the nano-USD."""
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as ledger:
        accounts = le.CreditAccounts(ledger)
        await accounts.grant("acme", 700)
        engine, provider, seen = engine_on(ledger, accounts, searching_turn(),
                                           searching_turn(), searching_turn())
        estimate = engine.estimate(researching(credit_hold=500, max_turns=2), "go")
        result = await engine.run(researching(credit_hold=500), "go", tools=[lookup],
                                  attribution=ACME)
        balance = await accounts.balance("acme")
    assert seen == [500 + MARGIN, 500 + MARGIN]
    assert result.outcome is le.Outcome.CREDIT_LIMIT
    assert result.credits == 620 and len(provider.requests) == 2
    assert balance == le.AccountBalance("acme", 700, 620, 0, 80)
    assert estimate.fee_usd == Decimal("0.000380")  # 2 turns x (3 x $0.00005 + 2 x $0.00002)
    journal_matches(path)


async def test_less_available_narrows_the_hold_after_the_fee_margin(tmp_path: Path) -> None:
    """400 available: 400 is reserved, of which the hold is what the margin leaves
    (210); the run ends credit_limit when it passes 210."""
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as ledger:
        accounts = le.CreditAccounts(ledger)
        await accounts.grant("acme", 400)
        engine, provider, seen = engine_on(ledger, accounts, searching_turn(),
                                           searching_turn())
        result = await engine.run(researching(credit_hold=500), "go", tools=[lookup],
                                  attribution=ACME)
    assert seen == [400]
    assert result.outcome is le.Outcome.CREDIT_LIMIT
    assert result.trip is not None and result.trip.limit == 400 - MARGIN
    assert result.credits == 310 and len(provider.requests) == 1
    journal_matches(path)


async def test_nothing_past_the_fee_margin_denies_admission(tmp_path: Path) -> None:
    """150 available, less than one turn's worst-case fees: nothing is reserved, the
    run ends admission_denied before any request, and the reason names the fees."""
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as ledger:
        accounts = le.CreditAccounts(ledger)
        await accounts.grant("acme", 150)
        engine, provider, _ = engine_on(ledger, accounts, searching_turn())
        result = await engine.run(researching(credit_hold=500), "go", tools=[lookup],
                                  attribution=ACME)
        balance = await accounts.balance("acme")
    assert result.outcome is le.Outcome.ADMISSION_DENIED and provider.requests == []
    assert result.detail is not None and f"server-tool fees ({MARGIN})" in result.detail
    assert balance == le.AccountBalance("acme", 150, 0, 0, 150)
    journal_matches(path)


async def test_a_run_narrowing_max_uses_reserves_its_own_worst_case(tmp_path: Path) -> None:
    """A run that lowers a tool's max_uses (features=) reserves that run's worst case:
    one search and no fetch, 50 credits."""
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as ledger:
        accounts = le.CreditAccounts(ledger)
        await accounts.grant("acme", 1000)
        engine, _, seen = engine_on(ledger, accounts, Reply.text("done"))
        result = await engine.run(
            researching(credit_hold=500), "go", attribution=ACME,
            features={"server_tools": (dataclasses.replace(TOOLS[0], max_uses=1),)})
    assert result.outcome is le.Outcome.COMPLETED
    assert seen == [550]


async def test_a_fee_without_max_uses_is_refused_on_an_account(tmp_path: Path) -> None:
    """A web search without max_uses has no worst case to reserve: a run on an account
    is a ConfigError before anything is recorded; outside accounts it runs."""
    unbounded = dataclasses.replace(
        operation(credit_hold=500),
        server_tools=(le.ServerTool(type="web_search_20250305", name="web_search"),))
    with SQLiteLedger(tmp_path / "ledger.db") as ledger:
        accounts = le.CreditAccounts(ledger)
        await accounts.grant("acme", 1000)
        engine, provider, _ = engine_on(ledger, accounts, Reply.text("done"))
        with pytest.raises(le.ConfigError, match="web_search has a fee and no max_uses") as info:
            await engine.run(unbounded, "go", attribution=ACME)
        assert info.value.field == "server_tools" and provider.requests == []
        outside = await engine.run(unbounded, "go")
    assert outside.outcome is le.Outcome.COMPLETED


async def delegating_root(ledger: SQLiteLedger, researcher_operation: le.Operation,
                          researcher_script: list[Reply], *, same_engine: bool,
                          ) -> tuple[le.RunResult, le.CreditAccounts, ScriptedProvider,
                                     ScriptedProvider]:
    """A root run on account ``acme`` (granted 1000, hold 500, no server tools) whose
    first turn delegates to a ``researcher`` of ``researcher_operation``, on the
    root's engine or on one without accounts; the result, the accounts, and the
    root's and the researcher's providers."""
    accounts = le.CreditAccounts(ledger)
    await accounts.grant("acme", 1000)
    root_provider = ScriptedProvider([Reply.tool_calls(("researcher", {"task": "t"})),
                                      Reply.text("root done")])
    engine = le.Engine(root_provider, ledger=ledger, prices=PRICES, accounts=accounts)
    child_provider = ScriptedProvider(researcher_script)
    child_engine = le.Engine(child_provider, ledger=ledger, prices=PRICES,
                             accounts=accounts if same_engine else None)
    researcher = le.agent_tool(child_engine, researcher_operation, name="researcher",
                               description="Researches.", tools=[lookup])
    result = await engine.run(operation(credit_hold=500), "go", tools=[researcher],
                              attribution=ACME)
    return result, accounts, root_provider, child_provider


@pytest.mark.parametrize("child_on", ["the same engine", "an engine without accounts"])
async def test_a_sub_agent_s_fees_stay_inside_its_root_s_reservation(
    tmp_path: Path, child_on: str,
) -> None:
    """A root on an account with no server tools (hold 500, nothing reserved for
    fees) delegates to a researcher whose turns may run 190 credits of fees. The
    researcher's turns see the root's hold lowered by those fees (310): its first
    turn (tree at 120) is sent, its second (tree at 430) is not. The account passes
    the reservation by the root's crossing turn's tokens only (550 of 500), where the
    researcher's second turn of fees once took it to 740."""
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as ledger:
        result, accounts, root_provider, child_provider = await delegating_root(
            ledger, researching(), [searching_turn(), searching_turn(), Reply.text("done")],
            same_engine=child_on == "the same engine")
        balance = await accounts.balance("acme")
    assert len(child_provider.requests) == 1 and len(root_provider.requests) == 2
    assert result.outcome is le.Outcome.COMPLETED
    assert result.credits == 240 and result.credits_total == 550
    assert balance == le.AccountBalance("acme", 1000, 550, 0, 450)
    journal_matches(path)


async def test_a_sub_agent_with_a_fee_and_no_max_uses_is_refused_under_an_account(
    tmp_path: Path,
) -> None:
    """A researcher whose web search has no max_uses, on an engine without accounts,
    delegated to by a run on an account: its worst case has no bound, so the call is
    refused (an error result naming server_tools), nothing recorded or sent."""
    unbounded = dataclasses.replace(
        operation(), server_tools=(le.ServerTool(type="web_search_20250305",
                                                 name="web_search"),))
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as ledger:
        result, _, root_provider, child_provider = await delegating_root(
            ledger, unbounded, [Reply.text("never")], same_engine=False)
    assert child_provider.requests == []
    assert result.outcome is le.Outcome.COMPLETED
    [_, answer] = [m for m in root_provider.requests[1].messages if m["role"] == "user"]
    [block] = answer["content"]
    assert block["is_error"] and "web_search has a fee and no max_uses" in str(block)
    invocations, _ = read_db(path)
    assert list(invocations) == [result.invocation_id]
