"""Pause and resume through GeminiProvider -> the real ``google-genai`` SDK ->
FakeGeminiServer on loopback (the scenarios are tests/pause_scenarios.py's,
shared with the other routes' tests)."""

from __future__ import annotations

from pathlib import Path

from loopengine.testing import FakeClock, FakeGeminiServer

from .. import pause_scenarios as scenarios
from .conftest import ROUTE, GeminiHarness, function_responses


async def test_approval_round_trip_resumes_in_another_process_gemini(
        wire: GeminiHarness, fake_gemini_server: FakeGeminiServer, tmp_path: Path) -> None:
    """Paused here, resumed by another process on the same SQLite ledger file."""
    await scenarios.approval_round_trip_in_another_process(
        wire, ROUTE, tmp_path, "gemini", fake_gemini_server.url)
    # The resumed request answers the approved call with its functionResponse.
    (answer,) = function_responses(fake_gemini_server.requests[-1])
    assert answer["name"] == "send" and answer["response"] == {"result": "sent to bob"}


async def test_denied_call_the_model_recovers_from_gemini(wire: GeminiHarness) -> None:
    """A denied call gives an error functionResponse with the reason; the model answers."""
    await scenarios.denied_call_the_model_recovers_from(wire, ROUTE)
    (sent,) = function_responses(wire.requests[-1])
    assert sent["name"] == "send" and list(sent["response"]) == ["error"]
    assert "bob opted out" in sent["response"]["error"]


async def test_budgets_across_a_pause_come_from_the_ledger_gemini(wire: GeminiHarness) -> None:
    """3 of max_turns=4 used before the pause: exactly one more turn, whatever the state says."""
    await scenarios.budgets_across_a_pause(wire, ROUTE)


async def test_pause_timeout_refuses_the_resume_and_ends_time_limit_gemini(
        wire: GeminiHarness, clock: FakeClock) -> None:
    """Past pause_timeout, resume raises ConfigError and the invocation ends time_limit."""
    await scenarios.pause_timeout_ends_time_limit(wire, ROUTE, clock)


async def test_accounts_settle_at_the_pause_and_reserve_again_at_the_resume_gemini(
        wire: GeminiHarness, tmp_path: Path) -> None:
    """The pause settles and releases; the resume reserves what the hold leaves."""
    await scenarios.accounts_across_a_pause(wire, ROUTE, tmp_path)
