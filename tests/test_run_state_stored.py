"""A run state written by this version of loopengine, stored as it was written:
later code must still load it, encode it alike and seal it alike (a ledger
keeps the seal of each paused run, docs/pause-and-resume.md); and one written
by earlier code resumes to the ledger's accounts."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest

import loopengine as le
from loopengine import events
from loopengine.providers import Reply, ScriptedProvider
from loopengine.testing import FakeClock

from .conftest import PRICES, operation
from .pause_scenarios import Sender, send

STORED = """{
 "format": "loopengine.run_state",
 "version": 1,
 "invocation_id": "inv_stored",
 "operation": {
  "name": "coder",
  "version": "1",
  "provider": "anthropic",
  "model": "claude-sonnet-4-5",
  "max_output_tokens": 4096,
  "model_max_output_tokens": null,
  "wrap_up_text": "Answer now.",
  "limits": {
   "max_turns": 10,
   "max_tool_batch": 8,
   "max_tool_calls": 32,
   "total_time": 120.0,
   "attempt_timeout": 60.0,
   "credit_hold": null,
   "wrap_up": false,
   "pause_timeout": null
  },
  "retry": {
   "max_attempts": 3,
   "initial_wait": 0.5,
   "max_wait": 8.0,
   "grow_max_tokens": true
  },
  "cache": {
   "system": false,
   "tools": false,
   "conversation": false,
   "ttl": "5m"
  },
  "thinking": {
   "budget_tokens": 1024,
   "adaptive": false,
   "effort": null
  },
  "server_tools": [
   {
    "type": "code_execution_20250825",
    "name": "code_execution",
    "max_uses": null,
    "params": {}
   }
  ]
 },
 "limits": {
  "max_turns": 10,
  "max_tool_batch": 8,
  "max_tool_calls": 32,
  "total_time": 120.0,
  "attempt_timeout": 60.0,
  "credit_hold": null,
  "wrap_up": false,
  "pause_timeout": null
 },
 "retry": {
  "max_attempts": 3,
  "initial_wait": 0.5,
  "max_wait": 8.0,
  "grow_max_tokens": true
 },
 "attribution": {
  "tenant": null,
  "user_id": null,
  "feature": null,
  "correlation_id": null
 },
 "system": null,
 "messages": [
  {
   "role": "user",
   "content": "go"
  },
  {
   "role": "assistant",
   "content": [
    {
     "type": "tool_use",
     "id": "toolu_000001",
     "name": "send",
     "input": {
      "to": "ann"
     }
    }
   ]
  }
 ],
 "given": 1,
 "final_tool": "final_answer",
 "structured": false,
 "output_digest": null,
 "tools": [
  "send"
 ],
 "features": {
  "thinking": {
   "budget_tokens": 1024,
   "adaptive": false,
   "effort": null
  },
  "server_tools": [
   {
    "type": "code_execution_20250825",
    "name": "code_execution",
    "max_uses": null,
    "params": {}
   }
  ]
 },
 "pending": [
  [
   "toolu_000001",
   "send",
   {
    "to": "ann"
   },
   "approval"
  ]
 ],
 "batch": [
  "toolu_000001"
 ],
 "results": [],
 "repair": false,
 "answered_calls": {},
 "progress": {
  "turns": 1,
  "tool_calls": 0,
  "credits": 1,
  "attempts": 1,
  "cost_nanousd": 600000,
  "provider_cost_nanousd": 600000,
  "running_seconds": 1.5,
  "descendant_credits": 0,
  "turn_input_tokens": 100,
  "turn_output_tokens": 20,
  "turn_cost_nanousd": 600000,
  "usage": {
   "input_tokens": 100,
   "output_tokens": 20,
   "cache_read_tokens": 0,
   "cache_write_tokens": 0,
   "cache_write_1h_tokens": 0,
   "web_search_requests": 0,
   "web_fetch_requests": 0,
   "reasoning_tokens": 0,
   "iterations": [],
   "service_tier": null,
   "inference_geo": null,
   "speed": null
  }
 },
 "paused_at": "2026-03-01T12:00:00+00:00",
 "extra": {},
 "container": {
  "id": "container_stored",
  "expires_at": "2026-03-01T12:30:00+00:00"
 }
}"""
"""A paused run's state (version 1), as `RunState.dumps` wrote it (indented
here): thinking, a code execution container, one call waiting for approval."""

STORED_SEAL = "f1c3cef60e7d0b25d4ae9b5ad1e7909b7de6abbcd01c33ed98f705a8d305b4b3"
"""Its seal when it was written."""


def test_a_stored_state_loads_and_encodes_alike() -> None:
    """The stored state loads with its container (an aware expiry), encodes to
    the same JSON and keeps the seal its ledger would hold."""
    state = le.RunState.loads(STORED)
    assert state.container is not None
    assert state.container.id == "container_stored"
    assert state.container.expires_at == datetime(2026, 3, 1, 12, 30, tzinfo=UTC)
    assert [(p.id, p.tool, p.input) for p in state.pending] == [
        ("toolu_000001", "send", {"to": "ann"})]
    assert state.features is not None and state.features.thinking == le.Thinking(
        budget_tokens=1024)
    assert json.loads(state.dumps()) == json.loads(STORED)
    assert state.seal() == STORED_SEAL


@pytest.mark.parametrize("container", [
    {"id": "c1", "expires_at": "2026-01-01T00:00:00"},
    {"id": "c1"},
    {"id": 7, "expires_at": "2026-01-01T00:00:00+00:00"},
    {"id": "c1", "expires_at": "not a time"},
    ["c1", "2026-01-01T00:00:00+00:00"],
], ids=["naive", "no-expiry", "id-not-text", "bad-expiry", "not-an-object"])
def test_a_stored_state_with_a_damaged_container_never_loads(container: object) -> None:
    """A container in another shape than the one written (an expiry without a UTC
    offset included) is a ConfigError on the state, never a container guessed at."""
    raw = json.loads(STORED)
    raw["container"] = container
    with pytest.raises(le.ConfigError, match="state"):
        le.RunState.loads(json.dumps(raw))


async def test_a_state_written_before_unreported_iterations_resumes_with_the_ledger_s_count(
        each_ledger: Any, clock: FakeClock) -> None:
    """Earlier code typed ``message`` the iteration a sum of usages adds for a
    request that reported none, where this code types it `UsageIteration.UNREPORTED`.
    A run paused after a reply reporting two iterations and one reporting none,
    its state as earlier code wrote it, resumes to a usage whose
    ``reported_iterations`` is the ledger's ``iterations``, in its result and its
    `RunEnded` alike, not one more."""
    ledger = each_ledger
    sender, seen = Sender(), []
    reported = le.Usage.from_iterations((
        le.UsageIteration(type="compaction", input_tokens=60, output_tokens=10),
        le.UsageIteration(type="message", input_tokens=40, output_tokens=10)))
    provider = ScriptedProvider([
        Reply(content=[{"type": "tool_use", "id": "c1", "name": "lookup", "input": {}}],
              stop_reason="tool_use", usage=reported),
        Reply.tool_calls(send("a"), usage=le.Usage(input_tokens=100, output_tokens=20)),
        Reply.text("done", usage=le.Usage(input_tokens=100, output_tokens=20))], clock=clock)

    @le.tool
    def lookup() -> str:
        """Look it up."""
        return "found"

    engine = le.Engine(provider, ledger=ledger, clock=clock, prices=PRICES,
                       observers=[seen.append])
    paused = await engine.run(operation(), "go", tools=[lookup, sender.tool])
    assert paused.state is not None and paused.usage.reported_iterations == 2
    assert [i.type for i in paused.usage.iterations] == [
        "compaction", "message", le.UsageIteration.UNREPORTED]
    earlier = le.RunState.loads(paused.state.dumps().replace(
        b'"unreported"', b'"message"'))
    assert earlier.progress.usage.reported_iterations == 3
    assert earlier.seal() == paused.state.seal()

    done = await engine.resume(earlier, decisions={paused.pending[0].id: le.Approve()},
                               tools=[lookup, sender.tool])
    assert done.outcome is le.Outcome.COMPLETED and sender.sent == ["a"]
    progress = await ledger.read_progress(done.invocation_id)
    assert progress.iterations == 2 == done.usage.reported_iterations
    (ended,) = [e for e in seen if isinstance(e, events.RunEnded)]
    assert ended.usage == done.usage


@pytest.mark.parametrize("reason", ["approval", "in_doubt"])
def test_a_pending_call_loads_with_a_reason_a_pending_call_has(reason: str) -> None:
    """A pending call's reason is one `PendingCall` has; any other is a ConfigError
    on the state, never a call that waits for a reason nothing decides."""
    raw = json.loads(STORED)
    raw["pending"][0][3] = reason
    assert le.RunState.loads(json.dumps(raw)).pending[0].reason == reason
    raw["pending"][0][3] = "maybe"
    with pytest.raises(le.ConfigError, match="pending call toolu_000001 has reason 'maybe'"):
        le.RunState.loads(json.dumps(raw))
