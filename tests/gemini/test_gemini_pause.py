"""Pause and resume through GeminiProvider -> the real ``google-genai`` SDK ->
FakeGeminiServer on loopback (the scenarios are tests/pause_scenarios.py's,
shared with the other routes' tests)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import anyio

from loopengine.testing import FakeClock, FakeGeminiServer, Reply
from loopengine.testing._gemini_server import signature_of

from .. import pause_scenarios as scenarios
from .conftest import ROUTE, GeminiHarness, contents, function_responses


async def test_approval_round_trip_resumes_in_another_process_gemini(
        wire: GeminiHarness, fake_gemini_server: FakeGeminiServer, tmp_path: Path) -> None:
    """Paused here, resumed by another process on the same SQLite ledger file."""
    await scenarios.approval_round_trip_in_another_process(
        wire, ROUTE, tmp_path, "gemini", fake_gemini_server.url)
    # The resumed request answers the approved call with its functionResponse.
    (answer,) = function_responses(fake_gemini_server.requests[-1])
    assert answer["name"] == "send" and answer["response"] == {"result": "sent to bob"}


async def test_a_thought_signature_reaches_the_request_resumed_in_another_process(
        wire: GeminiHarness, fake_gemini_server: FakeGeminiServer, tmp_path: Path) -> None:
    """The call the run paused on came with a thought signature, which the API
    requires back with it while its turn goes on: the other process's request
    carries it on that call, or the fake refuses the request as Gemini 3 does."""
    signed = Reply(content=[{"type": "thinking", "thinking": "", "signature": "c2lnLW9uZQ=="},
                            {"type": "tool_use", "name": "send", "input": {"to": "bob"}}],
                   stop_reason="tool_use")
    await scenarios.approval_round_trip_in_another_process(
        wire, ROUTE, tmp_path, "gemini", fake_gemini_server.url, asks=signed)
    (call,) = [part for content in contents(fake_gemini_server.requests[-1])
               for part in content["parts"] if "functionCall" in part]
    assert signature_of(call) == b"sig-one"


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


def _unnamed_send(to: str) -> Reply:
    """A reply calling ``send`` as the Gemini API may: a functionCall without an id."""
    return Reply(content=[{"type": "tool_use", "name": "send", "input": {"to": to}}],
                 stop_reason="tool_use")


async def test_a_call_sent_without_an_id_keeps_an_id_no_other_process_gives(
        fake_gemini_server: FakeGeminiServer, tmp_path: Path) -> None:
    """The API sends function calls without ids; the provider gives each one. A
    run pauses in one process on such a call; another process resumes it, runs
    the call, and pauses on the next one, which got its id there: the two ids
    differ, so the second call is not taken for the first (its result, its
    run store row, its idempotency key: a key equal to the first's would have
    an idempotent API replay the first call instead of making this one)."""
    fake_gemini_server.add(_unnamed_send("bob"), _unnamed_send("carol"))
    path, state, log = tmp_path / "ledger.db", tmp_path / "state.json", tmp_path / "sent.txt"

    async def child(decisions: str) -> dict[str, Any]:
        ran = await anyio.run_process(
            [sys.executable, "-m", "tests.pause_child", "gemini", str(path),
             fake_gemini_server.url, str(state), decisions, str(log)],
            check=False, cwd=scenarios.ROOT)
        assert ran.returncode == 0, ran.stderr.decode()
        facts: dict[str, Any] = json.loads(ran.stdout.decode().strip().splitlines()[-1])
        return facts

    first = await child("run")
    assert first["outcome"] == "paused" and len(first["pending"]) == 1
    second = await child(json.dumps({first["pending"][0]: ["approve"]}))
    assert second["outcome"] == "paused" and second["invocation_id"] == first["invocation_id"]
    assert log.read_text() == "bob\n"
    assert len(second["pending"]) == 1 and second["pending"] != first["pending"]
    # The ids the API's next request carried back are the two calls' own.
    ids = [part["functionCall"].get("id") for content in contents(fake_gemini_server.requests[-1])
           for part in content["parts"] if "functionCall" in part]
    assert ids == first["pending"]
