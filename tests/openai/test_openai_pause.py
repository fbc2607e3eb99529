"""Pause and resume through OpenAIProvider -> the real ``openai`` SDK ->
FakeOpenAIServer on loopback (the scenarios are tests/pause_scenarios.py's,
shared with the Anthropic provider's tests)."""

from __future__ import annotations

from pathlib import Path

from loopengine.testing import FakeClock, FakeOpenAIServer

from .. import pause_scenarios as scenarios
from .. import rule_scenarios
from .conftest import PRICES, OpenAIHarness, openai_operation, tool_messages

ROUTE = rule_scenarios.Route(operation=openai_operation, prices=PRICES)


async def test_approval_round_trip_resumes_in_another_process_openai(
        wire: OpenAIHarness, fake_openai_server: FakeOpenAIServer, tmp_path: Path) -> None:
    """Paused here, resumed by another process on the same SQLite ledger file."""
    await scenarios.approval_round_trip_in_another_process(
        wire, ROUTE, tmp_path, "openai", fake_openai_server.base_url)


async def test_denied_call_the_model_recovers_from_openai(wire: OpenAIHarness) -> None:
    """A denied call gives an error tool message with the reason; the model answers."""
    await scenarios.denied_call_the_model_recovers_from(wire, ROUTE)
    # On the wire: the denial is the call's tool message.
    sent = tool_messages(wire.requests[-1])
    assert len(sent) == 1 and "bob opted out" in str(sent[0]["content"])


async def test_budgets_across_a_pause_come_from_the_ledger_openai(wire: OpenAIHarness) -> None:
    """3 of max_turns=4 used before the pause: exactly one more turn, whatever the state says."""
    await scenarios.budgets_across_a_pause(wire, ROUTE)


async def test_pause_timeout_refuses_the_resume_and_ends_time_limit_openai(
        wire: OpenAIHarness, clock: FakeClock) -> None:
    """Past pause_timeout, resume raises ConfigError and the invocation ends time_limit."""
    await scenarios.pause_timeout_ends_time_limit(wire, ROUTE, clock)


async def test_accounts_settle_at_the_pause_and_reserve_again_at_the_resume_openai(
        wire: OpenAIHarness, tmp_path: Path) -> None:
    """The pause settles and releases; the resume reserves what the hold leaves."""
    await scenarios.accounts_across_a_pause(wire, ROUTE, tmp_path)
