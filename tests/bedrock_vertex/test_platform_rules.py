"""Every rule (R01-R15) and scenario (S01, S02) through AnthropicProvider on Amazon
Bedrock and on Google Vertex AI -> the SDK's platform clients -> FakeBedrockServer
(event-stream framing) / FakeVertexServer on loopback.

The scenarios are tests/rule_scenarios.py's, shared with the Anthropic and
OpenAI providers' tests; each test adds what the platform's wire shows (the
model in the path, the platform's error shapes and request ids). Every test
runs on both platforms, with JSON responses and with streamed ones.
"""

from __future__ import annotations

from typing import Any

import loopengine as le
from loopengine.providers import CachePolicy, FaultKind
from loopengine.providers._cache import cache_marker_problem
from loopengine.testing import ErrorReply, FakeClock, Reply

from .. import rule_scenarios as scenarios
from ..adapter.conftest import STREAMING, markers_on_the_wire, tool_results
from ..rule_scenarios import Counter, lookup
from .conftest import Platform, PlatformHarness


@STREAMING
async def test_r01_turn_limit_after_exactly_max_turns_requests_platform(
    wire: PlatformHarness, platform: Platform, stream: bool
) -> None:
    """Without an accepted answer the run ends turn_limit after max_turns wire requests."""
    await scenarios.r01_turn_limit(wire, platform.scenario_route, stream)


@STREAMING
async def test_r02_oversized_batch_runs_no_handler_platform(
    wire: PlatformHarness, platform: Platform, stream: bool
) -> None:
    """A batch over max_tool_batch ends the run; no handler runs, nothing more is sent."""
    await scenarios.r02_oversized_batch(wire, platform.scenario_route, stream)


@STREAMING
async def test_r03_credit_hold_greater_than_ends_exactly_continues_platform(
    wire: PlatformHarness, platform: Platform, stream: bool
) -> None:
    """Turns of 120 credits round to 150: 150 and 300 continue under a hold of 300,
    the third turn crosses it, stops further work and stays billed."""
    await scenarios.r03_credit_hold(wire, platform.scenario_route, stream)


@STREAMING
async def test_r04_no_attempt_timeout_above_the_remaining_time_platform(
    wire: PlatformHarness, platform: Platform, clock: FakeClock, stream: bool
) -> None:
    """Each wire request's timeout is min(attempt_timeout, remaining); none is sent
    once no time remains."""
    await scenarios.r04_attempt_timeouts(wire, platform.scenario_route, clock, stream)
    assert [r.headers["x-stainless-timeout"] for r in wire.requests] == ["6.0", "5.0"]


@STREAMING
async def test_r05_transient_faults_retry_with_growing_waits_platform(
    wire: PlatformHarness, platform: Platform, clock: FakeClock, stream: bool
) -> None:
    """The platform's overload (Bedrock's ServiceUnavailableException, the model's 529
    relayed by Vertex) is retried with growing waits, three attempts by default;
    the SDK itself never retries."""
    result = await scenarios.r05_transient_retries(wire, platform.scenario_route, clock,
                                                   stream, platform.transient())
    assert result.fault is not None and result.fault.kind is FaultKind.OVERLOADED


@STREAMING
async def test_r05_malformed_or_unauthorized_requests_are_not_retried_platform(
    wire: PlatformHarness, platform: Platform, clock: FakeClock, stream: bool
) -> None:
    """The platform's 400 (ValidationException, INVALID_ARGUMENT) and 403
    (AccessDeniedException, PERMISSION_DENIED) are each sent once."""
    for item, kind in ((platform.malformed(), FaultKind.BAD_REQUEST),
                       (platform.denied(), FaultKind.UNAUTHORIZED)):
        engine, _ = wire.engine(item, stream=stream)
        result = await engine.run(platform.operation(), "go")
        assert result.outcome is le.Outcome.PROVIDER_ERROR
        assert result.fault is not None
        assert (result.fault.kind, result.fault.http_status) == (kind, item.status)
        assert result.fault.error_code == item.type
        assert len(result.attempt_log) == 1
    assert len(wire.requests) == 2
    assert clock.sleeps == []


@STREAMING
async def test_r06_depleted_funds_end_credit_exhausted_not_retried_platform(
    wire: PlatformHarness, platform: Platform, clock: FakeClock, stream: bool
) -> None:
    """Vertex: a 403 whose reason is BILLING_DISABLED (the project cannot be billed)
    ends credit_exhausted after one request. Bedrock: a 403 AccessDeniedException
    for INVALID_PAYMENT_INSTRUMENT (the account's Marketplace subscription to
    Claude cannot be billed) does too; Bedrock has no balance to deplete, so its
    429s (ThrottlingException, and a service quota reached) are rate limits,
    retried, never credit exhaustion, and an AccessDeniedException for anything
    else is unauthorized."""
    if platform.name == "vertex":
        engine, _ = wire.engine(
            ErrorReply(status=403, type="PERMISSION_DENIED", error_code="BILLING_DISABLED",
                       message="This API method requires billing to be enabled."),
            Reply.text("never"), stream=stream)
        result = await engine.run(platform.operation(), "go")
        assert result.outcome is le.Outcome.CREDIT_EXHAUSTED
        assert len(wire.requests) == 1 and clock.sleeps == []
        assert result.fault is not None
        assert (result.fault.http_status, result.fault.error_code) == (403, "BILLING_DISABLED")
        return
    engine, _ = wire.engine(
        ErrorReply(status=403, type="AccessDeniedException",
                   message="Model access is denied due to INVALID_PAYMENT_INSTRUMENT:"
                           "A valid payment instrument must be provided."),
        stream=stream)
    result = await engine.run(platform.operation(), "go")
    assert result.outcome is le.Outcome.CREDIT_EXHAUSTED
    assert len(wire.requests) == 1 and clock.sleeps == []
    assert result.fault is not None
    assert (result.fault.http_status, result.fault.error_code) == (403, "AccessDeniedException")
    engine, _ = wire.engine(
        ErrorReply(status=403, type="AccessDeniedException",
                   message="You don't have access to the model with the specified model ID."),
        stream=stream)
    result = await engine.run(platform.operation(), "go")
    assert result.outcome is le.Outcome.PROVIDER_ERROR
    assert result.fault is not None and result.fault.kind is le.FaultKind.UNAUTHORIZED
    assert len(wire.requests) == 2 and clock.sleeps == []
    engine, _ = wire.engine(
        ErrorReply(status=429, type="ThrottlingException",
                   message="Too many tokens, please wait before trying again."),
        ErrorReply(status=400, type="ServiceQuotaExceededException",
                   message="Your request exceeds the service quota for your account."),
        Reply.text("served"), stream=stream)
    result = await engine.run(platform.operation(), "go")
    assert result.outcome is le.Outcome.COMPLETED and result.answer == "served"
    assert [a.settle.fault for a in result.attempt_log if a.settle] == [
        "rate_limited", "rate_limited", None]
    assert len(wire.requests) == 5 and len(clock.sleeps) == 2


@STREAMING
async def test_r07_attempts_record_turn_retry_usage_timing_and_price_and_cap_rows_platform(
    wire: PlatformHarness, platform: Platform, stream: bool
) -> None:
    """Each attempt is a row with its turn, try, usage, timing, ids and own price;
    past the retained rows, attempts are counted and the record marked incomplete.
    Bedrock's request id is its x-amzn-requestid, a failed attempt's included."""
    rows, _ = await scenarios.r07_attempt_rows(wire, platform.scenario_route, stream,
                                               platform.transient())
    assert rows[0]["fault"] == "overloaded"
    assert rows[1]["response_id"] == "msg_fake_0002"


@STREAMING
async def test_r08_one_user_message_holds_every_tool_result_platform(
    wire: PlatformHarness, platform: Platform, stream: bool
) -> None:
    """The model receives one user message with a tool_result for every call."""
    await scenarios.r08_one_results_message(wire, platform.scenario_route, stream)
    sent = wire.requests[1].messages
    assert [m["role"] for m in sent] == ["user", "assistant", "user"]
    asked = [b["id"] for b in sent[1]["content"] if b["type"] == "tool_use"]
    results = tool_results(wire.requests[1])
    assert [r["tool_use_id"] for r in results] == asked
    assert [r["content"] for r in results] == ["value of a", "value of b", "value of c"]


@STREAMING
async def test_r09_handler_error_reaches_the_model_as_is_error_platform(
    wire: PlatformHarness, platform: Platform, stream: bool
) -> None:
    """A raising handler gives an is_error tool_result with the exception's message."""
    await scenarios.r09_handler_error(wire, platform.scenario_route, stream)
    (error,) = tool_results(wire.requests[1])
    assert error["is_error"] is True and error["content"] == "no such key: x"


@STREAMING
async def test_r10_rejected_answer_feedback_is_an_error_result_platform(
    wire: PlatformHarness, platform: Platform, stream: bool
) -> None:
    """Structured mode: the judge's feedback goes back as an is_error result and
    consumes one unit of tool budget; the repair turn completes."""
    await scenarios.r10_rejected_answer(wire, platform.scenario_route, stream)
    (feedback,) = tool_results(wire.requests[1])
    assert feedback["is_error"] is True and feedback["content"] == "too small"
    assert [t["name"] for t in wire.requests[0].body["tools"]] == ["final_answer"]


@STREAMING
async def test_r11_refusal_ends_refused_and_cutoff_is_incomplete_platform(
    wire: PlatformHarness, platform: Platform, stream: bool
) -> None:
    """A refusal is sent once and ends refused; a max_tokens answer is never accepted."""
    await scenarios.r11_refusal_and_cutoff(wire, platform.scenario_route, stream)


@STREAMING
async def test_r12_at_most_four_markers_on_the_wire_platform(
    wire: PlatformHarness, platform: Platform, stream: bool
) -> None:
    """Six system markers, three message markers and every policy marker: the
    platform's request carries four (the fake refuses more, as the API does)."""
    marker = {"type": "ephemeral"}
    system = [{"type": "text", "text": f"rule {i}", "cache_control": marker} for i in range(6)]
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "q1", "cache_control": marker}]},
        {"role": "assistant",
         "content": [{"type": "text", "text": "a1", "cache_control": marker}]},
        {"role": "user", "content": [{"type": "text", "text": "q2", "cache_control": marker}]},
    ]
    counter = Counter()
    op = le.Operation(name="test.cached", provider=platform.route, model=platform.model,
                      cache=CachePolicy(system=True, tools=True, conversation=True, ttl="1h"))
    engine, _ = wire.engine(Reply.tool_calls(lookup()), Reply.text("done"), stream=stream)
    result = await engine.run(op, messages, system=system, tools=[counter.tool])
    assert result.outcome is le.Outcome.COMPLETED
    assert [markers_on_the_wire(r) for r in wire.requests] == [4, 4]
    assert all(cache_marker_problem(r.body) is None for r in wire.requests)


@STREAMING
async def test_r13_failures_never_switch_model_or_route_platform(
    wire: PlatformHarness, platform: Platform, stream: bool
) -> None:
    """Every retry goes to the published model (in the request path) on the same
    route; an ``anthropic`` operation is refused by the platform's engine."""
    await scenarios.r13_no_substitute(wire, platform.scenario_route, stream,
                                      other_route="anthropic")
    assert all(platform.model in r.path or platform.model.replace("@", "%40") in r.path
               for r in wire.requests)


@STREAMING
async def test_r14_accepted_answer_wins_over_tool_and_credit_checks_platform(
    wire: PlatformHarness, platform: Platform, stream: bool
) -> None:
    """An accepted final answer completes before the batch and credit checks."""
    await scenarios.r14_accepted_answer_wins(wire, platform.scenario_route, stream)


@STREAMING
async def test_r15_missing_handler_is_a_recoverable_is_error_platform(
    wire: PlatformHarness, platform: Platform, stream: bool
) -> None:
    """A call to an unknown tool gets an is_error result and the run carries on."""
    await scenarios.r15_missing_handler(wire, platform.scenario_route, stream)
    (error,) = tool_results(wire.requests[1])
    assert error["is_error"] is True and "translate" in error["content"]


@STREAMING
async def test_s01_overload_then_success_charges_the_success_platform(
    wire: PlatformHarness, platform: Platform, stream: bool
) -> None:
    """Both attempts are recorded; the successful one's usage (what the server
    served) determines the charge."""
    result, _ = await scenarios.s01_charge_the_success(wire, platform.scenario_route, stream,
                                                       platform.transient())
    first, second = result.attempt_log
    assert first.settle is not None and second.settle is not None
    assert first.settle.fault == "overloaded"
    assert second.settle.response_id == "msg_fake_0002"


@STREAMING
async def test_s02_repaired_answer_completes_within_remaining_controls_platform(
    wire: PlatformHarness, platform: Platform, stream: bool
) -> None:
    """The first answer is rejected (its feedback reaches the model); the repaired
    one is accepted within the remaining turns and budget."""
    engine, _ = wire.engine(Reply.text("42"), Reply.text("forty-two"), Reply.text("never"),
                            stream=stream)
    result = await engine.run(
        platform.operation(max_turns=2, max_tool_calls=1), "go",
        accept=lambda a: le.Accept() if a.isalpha() or "-" in a else le.Reject("in words"),
    )
    assert result.outcome is le.Outcome.COMPLETED
    assert result.answer == "forty-two"
    assert result.turns == 2 and result.tool_calls == 1
    assert len(wire.requests) == 2
