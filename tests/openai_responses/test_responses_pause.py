"""Pause and resume through OpenAIResponsesProvider -> the real ``openai`` SDK ->
FakeOpenAIServer's ``/v1/responses`` (the scenarios are tests/pause_scenarios.py's,
shared with the other routes' tests)."""

from __future__ import annotations

from pathlib import Path

from loopengine.testing import FakeClock, FakeOpenAIServer

from .. import pause_scenarios as scenarios
from .. import rule_scenarios
from .conftest import PRICES, ResponsesHarness, function_outputs, openai_operation

ROUTE = rule_scenarios.Route(operation=openai_operation, prices=PRICES)


async def test_approval_round_trip_resumes_in_another_process_responses(
        wire: ResponsesHarness, fake_openai_server: FakeOpenAIServer, tmp_path: Path) -> None:
    """Paused here, resumed by another process on the same SQLite ledger file."""
    await scenarios.approval_round_trip_in_another_process(
        wire, ROUTE, tmp_path, "openai-responses", fake_openai_server.base_url)
    assert all(r.path == "/v1/responses" for r in fake_openai_server.requests)


async def test_denied_call_the_model_recovers_from_responses(wire: ResponsesHarness) -> None:
    """A denied call gives an error function_call_output with the reason; the model
    answers."""
    await scenarios.denied_call_the_model_recovers_from(wire, ROUTE)
    (sent,) = function_outputs(wire.requests[-1])
    assert "bob opted out" in sent["output"] and sent["output"].startswith("Error: ")


async def test_budgets_across_a_pause_come_from_the_ledger_responses(
        wire: ResponsesHarness) -> None:
    """3 of max_turns=4 used before the pause: exactly one more turn, whatever the state says."""
    await scenarios.budgets_across_a_pause(wire, ROUTE)


async def test_pause_timeout_refuses_the_resume_and_ends_time_limit_responses(
        wire: ResponsesHarness, clock: FakeClock) -> None:
    """Past pause_timeout, resume raises ConfigError and the invocation ends time_limit."""
    await scenarios.pause_timeout_ends_time_limit(wire, ROUTE, clock)


async def test_accounts_settle_at_the_pause_and_reserve_again_at_the_resume_responses(
        wire: ResponsesHarness, tmp_path: Path) -> None:
    """The pause settles and releases; the resume reserves what the hold leaves."""
    await scenarios.accounts_across_a_pause(wire, ROUTE, tmp_path)
