"""Every rule (R01-R15) and scenario (S01, S02) through GeminiProvider -> the real
``google-genai`` SDK -> FakeGeminiServer on loopback.

The scenarios are tests/rule_scenarios.py's, shared with the other providers'
tests (the same scripts of `Reply` items, tools and limits); each test adds
what the Gemini server received: one ``functionResponse`` part per call in one
content, errors the model reads as errors, no attempt timeout above the
remaining time. Every test runs with JSON responses and with server-sent events.
"""

from __future__ import annotations

from typing import Any

import loopengine as le
from loopengine.persistence import MemoryLedger
from loopengine.providers import CachePolicy, FaultKind
from loopengine.testing import ErrorReply, FakeClock, Reply

from .. import rule_scenarios as scenarios
from ..adapter.conftest import STREAMING
from ..rule_scenarios import Counter, lookup
from .conftest import (
    MODEL,
    ROUTE,
    GeminiHarness,
    contents,
    function_calls,
    function_responses,
    gemini_operation,
    model_in_path,
)

FAST = le.RetryPolicy(max_attempts=4, initial_wait=0.001, max_wait=0.002)


@STREAMING
async def test_r01_turn_limit_after_exactly_max_turns_requests_gemini(
    wire: GeminiHarness, stream: bool
) -> None:
    """Without an accepted answer the run ends turn_limit after max_turns wire requests."""
    await scenarios.r01_turn_limit(wire, ROUTE, stream)
    assert all(r.path.endswith(":streamGenerateContent?alt=sse" if stream
                               else ":generateContent") for r in wire.requests)


@STREAMING
async def test_r02_oversized_parallel_batch_runs_no_handler_gemini(
    wire: GeminiHarness, stream: bool
) -> None:
    """Three parallel function calls are one batch: over max_tool_batch, the run ends
    with no handler run and nothing more sent."""
    await scenarios.r02_oversized_batch(wire, ROUTE, stream)
    (tool,) = wire.requests[0].body["tools"]
    assert [d["name"] for d in tool["functionDeclarations"]] == ["lookup"]


@STREAMING
async def test_r03_credit_hold_greater_than_ends_exactly_continues_gemini(
    wire: GeminiHarness, stream: bool
) -> None:
    """Turns of 120 credits round to 150: 150 and 300 continue under a hold of 300,
    the third turn crosses it, stops further work and stays billed."""
    await scenarios.r03_credit_hold(wire, ROUTE, stream)


@STREAMING
async def test_r04_no_attempt_timeout_above_the_remaining_time_gemini(
    wire: GeminiHarness, clock: FakeClock, stream: bool
) -> None:
    """Each wire request's timeout is min(attempt_timeout, remaining); none is sent
    once no time remains."""
    await scenarios.r04_attempt_timeouts(wire, ROUTE, clock, stream)
    # The google-genai SDK sends it as X-Server-Timeout, in whole seconds.
    assert [r.headers["x-server-timeout"] for r in wire.requests] == ["6", "5"]


@STREAMING
async def test_r05_transient_faults_retry_with_growing_waits_gemini(
    wire: GeminiHarness, clock: FakeClock, stream: bool
) -> None:
    """503s are retried with growing waits, three attempts by default; the SDK itself
    never retries (each attempt is one request)."""
    # (The shared scenario reads the Stainless SDKs' retry-count header, which
    # the google-genai SDK does not send.)
    engine, _ = wire.engine(*[ErrorReply(status=503) for _ in range(4)], stream=stream)
    result = await engine.run(gemini_operation(), "go")
    assert result.outcome is le.Outcome.PROVIDER_ERROR
    assert len(wire.requests) == 3 == len(result.attempt_log)
    assert len(clock.sleeps) == 2 and clock.sleeps[0] < clock.sleeps[1]
    assert result.fault is not None and result.fault.kind is FaultKind.SERVER_ERROR


@STREAMING
async def test_r05_malformed_or_unauthorized_requests_are_not_retried_gemini(
    wire: GeminiHarness, clock: FakeClock, stream: bool
) -> None:
    """A 400 INVALID_ARGUMENT, a 422 and a 401 UNAUTHENTICATED are each sent once."""
    await scenarios.r05_permanent_not_retried(wire, ROUTE, clock, stream)
    assert [r.headers["x-goog-api-key"] for r in wire.requests] == ["test-key"] * 3


@STREAMING
async def test_r06_depleted_credits_and_disabled_billing_are_credit_exhausted_gemini(
    wire: GeminiHarness, clock: FakeClock, stream: bool
) -> None:
    """Depleted prepayment credits (a 429), a 403 BILLING_DISABLED and the 400 of a
    project whose billing must be enabled end credit_exhausted after one request
    each, not retried."""
    server = wire.server
    billing_required = ErrorReply(status=400, body={"error": {
        "code": 400, "status": "FAILED_PRECONDITION",
        "message": "Gemini API free tier is not available in your country. Please enable "
                   "billing on your project in Google AI Studio."}})
    for item, status, code in ((server.credits_depleted(), 429, "RESOURCE_EXHAUSTED"),
                               (server.billing_disabled(), 403, "BILLING_DISABLED"),
                               (billing_required, 400, "FAILED_PRECONDITION")):
        engine, _ = wire.engine(item, stream=stream)
        result = await engine.run(gemini_operation(), "go")
        assert result.outcome is le.Outcome.CREDIT_EXHAUSTED
        assert result.fault is not None
        assert (result.fault.http_status, result.fault.error_code) == (status, code)
        assert len(result.attempt_log) == 1
    assert len(wire.requests) == 3 and clock.sleeps == []


@STREAMING
async def test_r07_attempts_record_turn_retry_usage_timing_and_price_and_cap_rows_gemini(
    wire: GeminiHarness, stream: bool
) -> None:
    """Each attempt is a row with its turn, try, usage, timing, ids and own price;
    past the retained rows, attempts are counted and the record marked incomplete."""
    counter = Counter()
    ledger = MemoryLedger(max_retained_attempts=3)
    engine, _ = wire.engine(
        ErrorReply(status=500), Reply.tool_calls(lookup("a")),
        wire.server.quota_exceeded("0.5s"),
        Reply.text("done", usage=le.Usage(input_tokens=300, output_tokens=10,
                                          cache_read_tokens=200)),
        stream=stream, ledger=ledger)
    result = await engine.run(gemini_operation(retry=FAST), "go", tools=[counter.tool])
    assert result.outcome is le.Outcome.COMPLETED
    assert (result.attempts.count, result.attempts.retained, result.attempts.incomplete) == (
        4, 3, True)
    rows = sorted(ledger.attempts.values(), key=lambda r: r["ordinal"])
    assert [(r["turn"], r["attempt"], r["outcome"], r["fault"]) for r in rows] == [
        (1, 1, "error", "server_error"), (1, 2, "ok", None), (2, 1, "error", "rate_limited")]
    assert rows[1]["response_id"] == "resp-fake-0002"
    assert [r["cost_nanousd"] for r in rows] == [None, 120_000, None]
    assert all(r["served_by"] == f"google:{MODEL}" and r["latency_ms"] is not None
               for r in rows)
    (invocation,) = ledger.invocations.values()
    assert (invocation["attempt_count"], invocation["incomplete"]) == (4, 1)
    # The fourth attempt has no row, but its usage (cached tokens apart) is in the totals.
    assert (invocation["input_tokens"], invocation["cache_read_tokens"],
            invocation["output_tokens"]) == (400, 200, 30)
    assert invocation["cost_nanousd"] == 120_000 + 510_000


@STREAMING
async def test_r08_one_function_response_per_call_in_one_content_gemini(
    wire: GeminiHarness, stream: bool
) -> None:
    """Three parallel calls: the next request answers each with one functionResponse
    part, in one user content right after the model's calls, in order."""
    await scenarios.r08_one_results_message(wire, ROUTE, stream)
    sent = wire.requests[1]
    assert [c["role"] for c in contents(sent)] == ["user", "model", "user"]
    asked = function_calls(sent)
    assert [c["args"] for c in asked] == [{"key": "a"}, {"key": "b"}, {"key": "c"}]
    answers = function_responses(sent)
    assert [(a["id"], a["name"]) for a in answers] == [(c["id"], "lookup") for c in asked]
    assert [a["response"] for a in answers] == [{"result": f"value of {k}"} for k in "abc"]


@STREAMING
async def test_r09_handler_error_reaches_the_model_as_an_error_gemini(
    wire: GeminiHarness, stream: bool
) -> None:
    """A raising handler's message reaches the model in its functionResponse, as an
    ``error`` rather than a ``result``."""
    await scenarios.r09_handler_error(wire, ROUTE, stream)
    (error,) = function_responses(wire.requests[1])
    assert error["name"] == "explode" and error["response"] == {"error": "no such key: x"}


@STREAMING
async def test_r10_rejected_answer_feedback_is_an_error_result_gemini(
    wire: GeminiHarness, stream: bool
) -> None:
    """Structured mode: the terminal tool is a function declaration; the judge's
    feedback goes back as an error functionResponse and consumes one unit of tool
    budget; the repair completes."""
    await scenarios.r10_rejected_answer(wire, ROUTE, stream)
    (feedback,) = function_responses(wire.requests[1])
    assert feedback == {**feedback, "name": "final_answer", "response": {"error": "too small"}}
    (tool,) = wire.requests[0].body["tools"]
    (declaration,) = tool["functionDeclarations"]
    assert declaration["name"] == "final_answer"
    assert declaration["parameters_json_schema"]["required"] == ["city", "population"]


@STREAMING
async def test_r11_safety_is_refused_and_max_tokens_is_incomplete_gemini(
    wire: GeminiHarness, stream: bool
) -> None:
    """finishReason SAFETY is sent once and ends refused; MAX_TOKENS is a cut-off
    answer, never accepted."""
    await scenarios.r11_refusal_and_cutoff(wire, ROUTE, stream)
    # The fake sent Gemini's finish reasons for those stop reasons.
    engine, _ = wire.engine(Reply.text("I can't", stop_reason="SAFETY"),
                            Reply.text("Paris is the cap", stop_reason="MAX_TOKENS"),
                            stream=stream)
    refused = await engine.run(gemini_operation(), "go")
    assert refused.outcome is le.Outcome.REFUSED
    assert refused.attempt_log[0].settle.stop_reason == "refusal"  # type: ignore[union-attr]
    cut = await engine.run(gemini_operation(), "go", accept=lambda _: True)
    assert cut.outcome is le.Outcome.INCOMPLETE and cut.answer is None
    assert len(wire.requests) == 5


@STREAMING
async def test_r12_cache_markers_never_reach_the_gemini_wire(
    wire: GeminiHarness, stream: bool
) -> None:
    """However many markers the caller and the policy ask for, the request carries
    none (Gemini caches implicitly): never more than four."""
    marker = {"type": "ephemeral"}
    system = [{"type": "text", "text": f"rule {i}", "cache_control": marker} for i in range(6)]
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "q1", "cache_control": marker}]},
        {"role": "assistant",
         "content": [{"type": "text", "text": "a1", "cache_control": marker}]},
        {"role": "user", "content": [{"type": "text", "text": "q2", "cache_control": marker}]},
    ]
    counter = Counter()
    op = le.Operation(name="test.cached", provider="gemini", model=MODEL,
                      cache=CachePolicy(system=True, tools=True, conversation=True))
    engine, _ = wire.engine(Reply.tool_calls(lookup()), Reply.text("done"), stream=stream)
    result = await engine.run(op, messages, system=system, tools=[counter.tool])
    assert result.outcome is le.Outcome.COMPLETED
    for request in wire.requests:
        assert "cache" not in repr(request.body).lower()
    first = wire.requests[0].body
    assert first["systemInstruction"]["parts"] == [{"text": f"rule {i}"} for i in range(6)]
    assert contents(wire.requests[0]) == [
        {"role": "user", "parts": [{"text": "q1"}]},
        {"role": "model", "parts": [{"text": "a1"}]},
        {"role": "user", "parts": [{"text": "q2"}]}]


@STREAMING
async def test_r13_failures_never_switch_model_or_route_gemini(
    wire: GeminiHarness, stream: bool
) -> None:
    """Every retry goes to the published model on the same route, recorded
    google:<model> (the vendor's name, whatever the route is called)."""
    op = gemini_operation()
    engine, _ = wire.engine(*[ErrorReply(status=500) for _ in range(3)], stream=stream)
    result = await engine.run(op, "go")
    assert result.outcome is le.Outcome.PROVIDER_ERROR
    assert {model_in_path(r) for r in wire.requests} == {MODEL}
    assert {a.dispatch.served_by for a in result.attempt_log} == {f"google:{MODEL}"}
    other = le.Operation(name="x", provider="anthropic", model=MODEL)
    try:
        await engine.run(other, "go")
    except le.ConfigError as error:
        assert error.field == "provider"
    else:  # pragma: no cover - the assertion below explains the failure
        raise AssertionError("an anthropic operation ran on the gemini provider")
    assert len(wire.requests) == 3


@STREAMING
async def test_r14_accepted_answer_wins_over_tool_and_credit_checks_gemini(
    wire: GeminiHarness, stream: bool
) -> None:
    """An accepted final answer completes before the batch and credit checks."""
    await scenarios.r14_accepted_answer_wins(wire, ROUTE, stream)


@STREAMING
async def test_r15_missing_handler_is_a_recoverable_error_gemini(
    wire: GeminiHarness, stream: bool
) -> None:
    """A call to an unknown function gets an error functionResponse and the run
    carries on."""
    await scenarios.r15_missing_handler(wire, ROUTE, stream)
    (error,) = function_responses(wire.requests[1])
    assert error["name"] == "translate" and "translate" in error["response"]["error"]
    (ok,) = function_responses(wire.requests[2])
    assert ok["response"] == {"result": "value of x"}


@STREAMING
async def test_s01_failure_then_success_charges_the_success_gemini(
    wire: GeminiHarness, stream: bool
) -> None:
    """Both attempts are recorded; the successful one's usage (what the server
    served) determines the charge."""
    result, _ = await scenarios.s01_charge_the_success(wire, ROUTE, stream,
                                                       ErrorReply(status=503))
    first, second = result.attempt_log
    assert first.settle is not None and second.settle is not None
    assert (first.settle.fault, first.settle.http_status) == ("server_error", 503)
    assert second.settle.response_id == "resp-fake-0002"


@STREAMING
async def test_s02_repaired_answer_completes_within_remaining_controls_gemini(
    wire: GeminiHarness, stream: bool
) -> None:
    """The first answer is rejected (its feedback reaches the model as user text);
    the repaired one is accepted within the remaining turns and budget."""
    await scenarios.s02_repaired_text_answer(wire, ROUTE, stream)
    assert contents(wire.requests[1]) == [
        {"role": "user", "parts": [{"text": "go"}]},
        {"role": "model", "parts": [{"text": "42"}]},
        {"role": "user", "parts": [{"text": "in words"}]}]
