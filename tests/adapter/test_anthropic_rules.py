"""The rules that cross the provider, through AnthropicProvider -> the real
``anthropic`` SDK -> FakeAnthropicServer on loopback.

The scenarios are tests/rule_scenarios.py's, shared with the OpenAI provider's
tests; each test adds what the Messages API wire shows, so the rules are
proved on the wire, not just at the provider seam. Every test runs with JSON
responses and with server-sent events.
"""

from __future__ import annotations

from typing import Any

import loopengine as le
from loopengine.providers import CachePolicy, FaultKind
from loopengine.providers._cache import cache_marker_problem
from loopengine.testing import ErrorReply, FakeClock, Reply

from .. import rule_scenarios as scenarios
from ..conftest import MODEL, PRICES, operation
from ..rule_scenarios import Counter, lookup
from .conftest import STREAMING, Harness, markers_on_the_wire, tool_results

ROUTE = scenarios.Route(operation=operation, prices=PRICES)
"""The Anthropic route of the shared scenarios (tests/rule_scenarios.py)."""


@STREAMING
async def test_r01_turn_limit_after_exactly_max_turns_requests_anthropic(
    wire: Harness, stream: bool
) -> None:
    """Without an accepted answer the run ends turn_limit after max_turns wire requests."""
    await scenarios.r01_turn_limit(wire, ROUTE, stream)


@STREAMING
async def test_r02_oversized_batch_runs_no_handler_anthropic(wire: Harness, stream: bool) -> None:
    """A batch over max_tool_batch ends the run; no handler runs, nothing more is sent."""
    await scenarios.r02_oversized_batch(wire, ROUTE, stream)


@STREAMING
async def test_r03_credit_hold_greater_than_ends_exactly_continues_anthropic(
    wire: Harness, stream: bool
) -> None:
    """Turns of 120 credits round to 150: 150 and 300 continue under a hold of 300,
    the third turn crosses it, stops further work and stays billed."""
    await scenarios.r03_credit_hold(wire, ROUTE, stream)


@STREAMING
async def test_r04_no_attempt_timeout_above_the_remaining_time_anthropic(
    wire: Harness, clock: FakeClock, stream: bool
) -> None:
    """Each wire request's timeout is min(attempt_timeout, remaining); none is sent
    once no time remains."""
    await scenarios.r04_attempt_timeouts(wire, ROUTE, clock, stream)
    # The anthropic SDK sends it as x-stainless-timeout.
    assert [r.headers["x-stainless-timeout"] for r in wire.requests] == ["6.0", "5.0"]


@STREAMING
async def test_r05_transient_faults_retry_with_growing_waits_anthropic(
    wire: Harness, clock: FakeClock, stream: bool
) -> None:
    """Overloads are retried with growing waits, three attempts by default."""
    result = await scenarios.r05_transient_retries(wire, ROUTE, clock, stream,
                                                   ErrorReply.overloaded())
    assert result.fault is not None and result.fault.kind is FaultKind.OVERLOADED


@STREAMING
async def test_r05_malformed_or_unauthorized_requests_are_not_retried_anthropic(
    wire: Harness, clock: FakeClock, stream: bool
) -> None:
    """A 400 invalid_request_error and a 401 are each sent once."""
    for status in (400, 401):
        engine, _ = wire.engine(ErrorReply(status=status), stream=stream)
        result = await engine.run(operation(), "go")
        assert result.outcome is le.Outcome.PROVIDER_ERROR
        assert result.fault is not None and result.fault.http_status == status
        assert len(result.attempt_log) == 1
    assert len(wire.requests) == 2
    assert clock.sleeps == []


@STREAMING
async def test_r06_depleted_balance_is_credit_exhausted_not_retried_anthropic(
    wire: Harness, clock: FakeClock, stream: bool
) -> None:
    """A 429 naming the spend limit ends credit_exhausted after one request."""
    engine, _ = wire.engine(ErrorReply.spend_limit(), Reply.text("never"), stream=stream)
    result = await engine.run(operation(), "go")
    assert result.outcome is le.Outcome.CREDIT_EXHAUSTED
    assert len(wire.requests) == 1 and clock.sleeps == []
    assert result.fault is not None
    assert (result.fault.http_status, result.fault.error_code) == (
        429, "enforced_spend_limit_reached")


@STREAMING
async def test_r07_attempts_record_turn_retry_usage_timing_and_price_and_cap_rows_anthropic(
    wire: Harness, stream: bool
) -> None:
    """Each attempt is a row with its turn, try, usage, timing, ids and own price;
    past the retained rows, attempts are counted and the record marked incomplete."""
    rows, _ = await scenarios.r07_attempt_rows(wire, ROUTE, stream, ErrorReply.overloaded())
    assert (rows[0]["fault"], rows[0]["http_status"]) == ("overloaded", 529)
    assert rows[1]["response_id"] == "msg_fake_0002"


@STREAMING
async def test_r08_one_user_message_holds_every_tool_result_anthropic(
    wire: Harness, stream: bool
) -> None:
    """The model receives one user message with a tool_result for every call."""
    await scenarios.r08_one_results_message(wire, ROUTE, stream)
    sent = wire.requests[1].messages
    assert [m["role"] for m in sent] == ["user", "assistant", "user"]
    asked = [b["id"] for b in sent[1]["content"] if b["type"] == "tool_use"]
    results = tool_results(wire.requests[1])
    assert len(sent[-1]["content"]) == len(results) == 3
    assert [r["tool_use_id"] for r in results] == asked
    assert [r["content"] for r in results] == ["value of a", "value of b", "value of c"]


@STREAMING
async def test_r09_handler_error_reaches_the_model_as_is_error_anthropic(
    wire: Harness, stream: bool
) -> None:
    """A raising handler gives an is_error tool_result with the exception's message."""
    await scenarios.r09_handler_error(wire, ROUTE, stream)
    (error,) = tool_results(wire.requests[1])
    assert error["is_error"] is True and error["content"] == "no such key: x"


@STREAMING
async def test_r10_rejected_answer_feedback_is_an_error_result_anthropic(
    wire: Harness, stream: bool
) -> None:
    """Structured mode: the judge's feedback goes back as an is_error result and
    consumes one unit of tool budget; the repair turn completes."""
    await scenarios.r10_rejected_answer(wire, ROUTE, stream)
    (feedback,) = tool_results(wire.requests[1])
    assert feedback["is_error"] is True and feedback["content"] == "too small"
    assert [t["name"] for t in wire.requests[0].body["tools"]] == ["final_answer"]


@STREAMING
async def test_r11_refusal_ends_refused_and_cutoff_is_incomplete_anthropic(
    wire: Harness, stream: bool
) -> None:
    """A refusal is sent once and ends refused; a max_tokens answer is never accepted."""
    await scenarios.r11_refusal_and_cutoff(wire, ROUTE, stream)


@STREAMING
async def test_r12_at_most_four_markers_on_the_wire_anthropic(
    wire: Harness, stream: bool
) -> None:
    """Six system markers, three message markers and every policy marker asked for:
    the wire request carries four, chosen by the documented priority, and no
    one-hour marker after a five-minute one (the server refuses that, as the API
    does)."""
    marker = {"type": "ephemeral"}
    system = [{"type": "text", "text": f"rule {i}", "cache_control": marker} for i in range(6)]
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "q1", "cache_control": marker}]},
        {"role": "assistant",
         "content": [{"type": "text", "text": "a1", "cache_control": marker}]},
        {"role": "user", "content": [{"type": "text", "text": "q2", "cache_control": marker}]},
    ]
    counter = Counter()
    op = le.Operation(name="test.cached", provider="anthropic", model=MODEL,
                      cache=CachePolicy(system=True, tools=True, conversation=True, ttl="1h"))
    engine, _ = wire.engine(Reply.tool_calls(lookup()), Reply.text("done"), stream=stream)
    result = await engine.run(op, messages, system=system, tools=[counter.tool])
    assert result.outcome is le.Outcome.COMPLETED
    first, second = wire.requests
    assert markers_on_the_wire(first) == markers_on_the_wire(second) == 4
    body = first.body
    policy_marker = {"type": "ephemeral", "ttl": "1h"}
    assert body["tools"][-1]["cache_control"] == policy_marker
    assert body["system"][-1]["cache_control"] == policy_marker
    # The fourth is the caller's newest remaining marker: the assistant's. The
    # conversation marker comes after that five-minute marker: it is sent as one.
    assert body["messages"][1]["content"][0]["cache_control"] == marker
    assert body["messages"][-1]["content"][-1]["cache_control"] == marker
    # The conversation marker moved onto the newest message (the tool results),
    # and the fourth is now the caller's newest marker: q2, no longer the last one.
    sent = second.body["messages"]
    assert sent[-1]["content"][-1]["cache_control"] == marker
    assert sent[2]["content"][0]["cache_control"] == marker
    assert "cache_control" not in sent[1]["content"][0]
    assert all(cache_marker_problem(request.body) is None for request in wire.requests)


@STREAMING
async def test_r12_markers_inside_tool_results_count_on_the_wire_anthropic(
    wire: Harness, stream: bool
) -> None:
    """A caller's history whose tool_result blocks carry five markers of their own,
    plus the policy's conversation marker: four reach the server, which takes the
    request (it refuses more, as the API does). The run is given the tool its
    history calls: the API refuses tool blocks in a request that defines none."""
    marker = {"type": "ephemeral"}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "look it up"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_old",
                                           "name": "lookup", "input": {"key": "a"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_old",
                                      "content": [{"type": "text", "text": f"part {k}",
                                                   "cache_control": marker}
                                                  for k in range(5)]}]},
    ]
    op = le.Operation(name="test.cached", provider="anthropic", model=MODEL,
                      cache=CachePolicy(conversation=True))
    engine, _ = wire.engine(Reply.text("done"), stream=stream)
    result = await engine.run(op, messages, tools=[Counter().tool])
    assert result.outcome is le.Outcome.COMPLETED
    (request,) = wire.requests
    assert markers_on_the_wire(request) == 4
    sent = request.body["messages"][-1]["content"][0]
    assert sent["cache_control"] == marker
    assert ["cache_control" in b for b in sent["content"]] == [False, False, True, True, True]


@STREAMING
async def test_r13_failures_never_switch_model_or_route_anthropic(
    wire: Harness, stream: bool
) -> None:
    """Every retry goes to the published model on the same route."""
    await scenarios.r13_no_substitute(wire, ROUTE, stream, other_route="bedrock")
    assert {r.body["model"] for r in wire.requests} == {MODEL}


@STREAMING
async def test_r14_accepted_answer_wins_over_tool_and_credit_checks_anthropic(
    wire: Harness, stream: bool
) -> None:
    """An accepted final answer completes before the batch and credit checks."""
    await scenarios.r14_accepted_answer_wins(wire, ROUTE, stream)


@STREAMING
async def test_r15_missing_handler_is_a_recoverable_is_error_anthropic(
    wire: Harness, stream: bool
) -> None:
    """A call to an unknown tool gets an is_error result and the run carries on."""
    await scenarios.r15_missing_handler(wire, ROUTE, stream)
    (error,) = tool_results(wire.requests[1])
    assert error["is_error"] is True and "translate" in error["content"]
    (ok,) = tool_results(wire.requests[2])
    assert "is_error" not in ok and ok["content"] == "value of x"


@STREAMING
async def test_s01_overload_then_success_charges_the_success_anthropic(
    wire: Harness, stream: bool
) -> None:
    """Both attempts are recorded; the successful one's usage (what the server
    served) determines the charge."""
    result, _ = await scenarios.s01_charge_the_success(wire, ROUTE, stream,
                                                       ErrorReply.overloaded())
    first, second = result.attempt_log
    assert first.settle is not None and second.settle is not None
    assert (first.settle.fault, first.settle.http_status) == ("overloaded", 529)
    assert second.settle.response_id == "msg_fake_0002"


@STREAMING
async def test_s02_repaired_answer_completes_within_remaining_controls_anthropic(
    wire: Harness, stream: bool
) -> None:
    """The first answer is rejected and the rejection goes back as the next user
    message; the repaired one is accepted within the remaining turns and budget."""
    await scenarios.s02_repaired_text_answer(wire, ROUTE, stream)
    assert wire.requests[1].body["messages"] == [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "text", "text": "42"}]},
        {"role": "user", "content": "in words"}]

