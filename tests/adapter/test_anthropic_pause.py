"""Pause and resume through AnthropicProvider -> the real ``anthropic`` SDK ->
FakeAnthropicServer on loopback (the scenarios are tests/pause_scenarios.py's,
shared with the OpenAI provider's tests)."""

from __future__ import annotations

from pathlib import Path

from loopengine.testing import FakeAnthropicServer, FakeClock

from .. import pause_scenarios as scenarios
from .. import rule_scenarios
from ..conftest import PRICES, operation
from .conftest import Harness

ROUTE = rule_scenarios.Route(operation=operation, prices=PRICES)


async def test_approval_round_trip_resumes_in_another_process_anthropic(
        wire: Harness, fake_anthropic_server: FakeAnthropicServer, tmp_path: Path) -> None:
    """Paused here, resumed by another process on the same SQLite ledger file."""
    await scenarios.approval_round_trip_in_another_process(
        wire, ROUTE, tmp_path, "anthropic", fake_anthropic_server.url)


async def test_denied_call_the_model_recovers_from_anthropic(wire: Harness) -> None:
    """A denied call gives an is_error result with the reason; the model answers."""
    await scenarios.denied_call_the_model_recovers_from(wire, ROUTE)
    # On the wire: the denial is a tool_result block marked is_error.
    sent = [b for b in wire.requests[-1].messages[-1]["content"]
            if b.get("type") == "tool_result"]
    assert sent[0]["is_error"] is True and "bob opted out" in str(sent[0]["content"])


async def test_budgets_across_a_pause_come_from_the_ledger_anthropic(wire: Harness) -> None:
    """3 of max_turns=4 used before the pause: exactly one more turn, whatever the state says."""
    await scenarios.budgets_across_a_pause(wire, ROUTE)


async def test_pause_timeout_refuses_the_resume_and_ends_time_limit_anthropic(
        wire: Harness, clock: FakeClock) -> None:
    """Past pause_timeout, resume raises ConfigError and the invocation ends time_limit."""
    await scenarios.pause_timeout_ends_time_limit(wire, ROUTE, clock)


async def test_accounts_settle_at_the_pause_and_reserve_again_at_the_resume_anthropic(
        wire: Harness, tmp_path: Path) -> None:
    """The pause settles and releases; the resume reserves what the hold leaves."""
    await scenarios.accounts_across_a_pause(wire, ROUTE, tmp_path)
