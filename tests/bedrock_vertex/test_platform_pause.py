"""Pause and resume through AnthropicProvider on Amazon Bedrock and Google Vertex AI
-> the SDK's platform clients -> FakeBedrockServer / FakeVertexServer on
loopback, once per platform (the scenarios are tests/pause_scenarios.py's,
shared with the other routes' tests)."""

from __future__ import annotations

from pathlib import Path

from loopengine.testing import FakeAnthropicServer, FakeClock, FakeVertexServer

from .. import pause_scenarios as scenarios
from .conftest import PlatformHarness


async def test_approval_round_trip_resumes_in_another_process_on_the_platform(
        wire: PlatformHarness, platform_server: FakeAnthropicServer, tmp_path: Path) -> None:
    """Paused here, resumed by another process (its own platform client) on the same
    SQLite ledger file; both requests went to the platform's model path."""
    url = (platform_server.base_url if isinstance(platform_server, FakeVertexServer)
           else platform_server.url)
    await scenarios.approval_round_trip_in_another_process(
        wire, wire.platform.scenario_route, tmp_path, wire.platform.route, url)
    assert [wire.platform.scenario_route.model_of(r) for r in platform_server.requests] == [
        wire.platform.model] * 2


async def test_denied_call_the_model_recovers_from_on_the_platform(
        wire: PlatformHarness) -> None:
    """A denied call gives an is_error result with the reason; the model answers."""
    await scenarios.denied_call_the_model_recovers_from(wire, wire.platform.scenario_route)
    # On the wire: the denial is a tool_result block marked is_error.
    sent = [b for b in wire.requests[-1].body["messages"][-1]["content"]
            if b.get("type") == "tool_result"]
    assert sent[0]["is_error"] is True and "bob opted out" in str(sent[0]["content"])


async def test_budgets_across_a_pause_come_from_the_ledger_on_the_platform(
        wire: PlatformHarness) -> None:
    """3 of max_turns=4 used before the pause: exactly one more turn, whatever the state says."""
    await scenarios.budgets_across_a_pause(wire, wire.platform.scenario_route)


async def test_pause_timeout_refuses_the_resume_and_ends_time_limit_on_the_platform(
        wire: PlatformHarness, clock: FakeClock) -> None:
    """Past pause_timeout, resume raises ConfigError and the invocation ends time_limit."""
    await scenarios.pause_timeout_ends_time_limit(wire, wire.platform.scenario_route, clock)


async def test_accounts_settle_at_the_pause_and_reserve_again_at_the_resume_on_the_platform(
        wire: PlatformHarness, tmp_path: Path) -> None:
    """The pause settles and releases; the resume reserves what the hold leaves."""
    await scenarios.accounts_across_a_pause(wire, wire.platform.scenario_route, tmp_path)
