"""Pause and resume through OpenAIProvider -> the real ``openai`` SDK ->
FakeOpenAIServer on loopback (the scenarios are tests/pause_scenarios.py's,
shared with the Anthropic provider's tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from loopengine.testing import FakeClock, FakeOpenAIServer, Reply

from .. import pause_scenarios as scenarios
from .. import rule_scenarios
from .conftest import PRICES, OpenAIHarness, openai_operation, tool_messages

ROUTE = rule_scenarios.Route(operation=openai_operation, prices=PRICES)


async def test_approval_round_trip_resumes_in_another_process_openai(
        wire: OpenAIHarness, fake_openai_server: FakeOpenAIServer, tmp_path: Path) -> None:
    """Paused here, resumed by another process on the same SQLite ledger file."""
    await scenarios.approval_round_trip_in_another_process(
        wire, ROUTE, tmp_path, "openai", fake_openai_server.base_url)


@pytest.mark.parametrize("carried", [
    {"type": "reasoning_content", "reasoning_content": "Send it to bob."},
    {"type": "reasoning_details", "reasoning_details": [
        {"type": "reasoning.text", "text": "Send it.", "signature": "c2ln", "index": 0}]},
    {"extra_content": {"google": {"thought_signature": "c2lnLW9uZQ=="}}},
], ids=["reasoning_content", "reasoning_details", "thought_signature"])
async def test_what_the_server_requires_back_reaches_the_request_resumed_in_another_process(
        wire: OpenAIHarness, fake_openai_server: FakeOpenAIServer, tmp_path: Path,
        carried: dict[str, Any]) -> None:
    """The tool-call turn the run paused on came with what its server requires
    back on it (DeepSeek's reasoning_content, OpenRouter's reasoning_details,
    Gemini's thought signature in the call's extra_content): the other
    process's request carries it, or the fake refuses it as those servers do."""
    call = {"type": "tool_use", "id": "call_1", "name": "send", "input": {"to": "bob"}}
    content = ([{**call, **carried}] if "extra_content" in carried else [carried, call])
    await scenarios.approval_round_trip_in_another_process(
        wire, ROUTE, tmp_path, "openai", fake_openai_server.base_url,
        asks=Reply(content=content, stop_reason="tool_use"))
    (turn,) = [m for m in fake_openai_server.requests[-1].body["messages"]
               if m["role"] == "assistant"]
    if "extra_content" in carried:
        assert turn["tool_calls"][0]["extra_content"] == carried["extra_content"]
    else:
        assert turn[carried["type"]] == carried[carried["type"]]


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
