"""Every rule (R01-R15) and scenario (S01, S02) through OpenAIProvider -> the real
``openai`` SDK -> FakeOpenAIServer on loopback.

The scenarios are tests/rule_scenarios.py's, shared with the Anthropic adapter's
tests (the same scripts of `Reply` items, tools and limits); each test adds
what the Chat Completions server received: one ``tool`` message per call in
one request, ``is_error`` results the model reads as errors, no attempt
timeout above the remaining time. Every test runs with JSON responses and with
server-sent events.
"""

from __future__ import annotations

from typing import Any

import loopengine as le
from loopengine.providers import CachePolicy
from loopengine.testing import ErrorReply, FakeClock, Reply

from .. import rule_scenarios as scenarios
from ..adapter.conftest import STREAMING
from ..rule_scenarios import Counter, lookup
from .conftest import MODEL, PRICES, OpenAIHarness, calls_asked, openai_operation, tool_messages

ROUTE = scenarios.Route(operation=openai_operation, prices=PRICES)
"""The OpenAI route of the shared scenarios (tests/rule_scenarios.py)."""



@STREAMING
async def test_r01_turn_limit_after_exactly_max_turns_requests_openai(
    wire: OpenAIHarness, stream: bool
) -> None:
    """Without an accepted answer the run ends turn_limit after max_turns wire requests."""
    await scenarios.r01_turn_limit(wire, ROUTE, stream)


@STREAMING
async def test_r02_oversized_parallel_batch_runs_no_handler_openai(
    wire: OpenAIHarness, stream: bool
) -> None:
    """Three parallel tool calls are one batch: over max_tool_batch, the run ends with
    no handler run and nothing more sent."""
    await scenarios.r02_oversized_batch(wire, ROUTE, stream)
    assert len(wire.requests[0].body["tools"]) == 1


@STREAMING
async def test_r03_credit_hold_greater_than_ends_exactly_continues_openai(
    wire: OpenAIHarness, stream: bool
) -> None:
    """Turns of 120 credits round to 150: 150 and 300 continue under a hold of 300,
    the third turn crosses it, stops further work and stays billed."""
    await scenarios.r03_credit_hold(wire, ROUTE, stream)


@STREAMING
async def test_r04_no_attempt_timeout_above_the_remaining_time_openai(
    wire: OpenAIHarness, clock: FakeClock, stream: bool
) -> None:
    """Each wire request's timeout is min(attempt_timeout, remaining); none is sent
    once no time remains."""
    await scenarios.r04_attempt_timeouts(wire, ROUTE, clock, stream)
    # The openai SDK sends it as x-stainless-read-timeout.
    assert [r.headers["x-stainless-read-timeout"] for r in wire.requests] == ["6.0", "5.0"]


@STREAMING
async def test_r05_transient_faults_retry_with_growing_waits_openai(
    wire: OpenAIHarness, clock: FakeClock, stream: bool
) -> None:
    """503s are retried with growing waits, three attempts by default; the SDK itself
    never retries (max_retries=0: each attempt is one request)."""
    await scenarios.r05_transient_retried(wire, ROUTE, clock, stream)
    assert [r.headers["x-stainless-retry-count"] for r in wire.requests] == ["0", "0", "0"]


@STREAMING
async def test_r05_malformed_or_unauthorized_requests_are_not_retried_openai(
    wire: OpenAIHarness, clock: FakeClock, stream: bool
) -> None:
    """A 400, a 422 and a 401 are each sent once."""
    await scenarios.r05_permanent_not_retried(wire, ROUTE, clock, stream)


@STREAMING
async def test_r06_insufficient_quota_is_credit_exhausted_not_retried_openai(
    wire: OpenAIHarness, clock: FakeClock, stream: bool
) -> None:
    """OpenAI's 429 insufficient_quota ends credit_exhausted after one request."""
    await scenarios.r06_openai_insufficient_quota(wire, ROUTE, clock, stream)


@STREAMING
async def test_r07_attempts_record_turn_retry_usage_timing_and_price_and_cap_rows_openai(
    wire: OpenAIHarness, stream: bool
) -> None:
    """Each attempt is a row with its turn, try, usage, timing, ids and own price;
    past the retained rows, attempts are counted and the record marked incomplete."""
    await scenarios.r07_openai_attempt_rows(wire, ROUTE, stream, "chatcmpl-fake-0002")


@STREAMING
async def test_r08_one_tool_message_per_call_in_one_request_openai(
    wire: OpenAIHarness, stream: bool
) -> None:
    """Three parallel calls: the next request answers each with one tool message,
    right after the assistant's tool_calls, in order; each consumed tool budget."""
    await scenarios.r08_one_results_message(wire, ROUTE, stream)
    sent = wire.requests[1]
    assert [m["role"] for m in sent.messages] == ["user", "assistant", "tool", "tool", "tool"]
    asked = calls_asked(sent)
    assert [c["input"] for c in asked] == [{"key": "a"}, {"key": "b"}, {"key": "c"}]
    answers = tool_messages(sent)
    assert [m["tool_call_id"] for m in answers] == [c["id"] for c in asked]
    assert [m["content"] for m in answers] == ["value of a", "value of b", "value of c"]


@STREAMING
async def test_r09_handler_error_reaches_the_model_as_an_error_openai(
    wire: OpenAIHarness, stream: bool
) -> None:
    """A raising handler's message reaches the model in its tool message, marked as an
    error (Chat Completions has no is_error flag)."""
    await scenarios.r09_handler_error(wire, ROUTE, stream)
    (error,) = tool_messages(wire.requests[1])
    assert error["content"] == "Error: no such key: x"


@STREAMING
async def test_r10_rejected_answer_feedback_is_an_error_result_openai(
    wire: OpenAIHarness, stream: bool
) -> None:
    """Structured mode: the terminal tool is a function; the judge's feedback goes back
    as an error tool message and consumes one unit of tool budget; the repair completes."""
    await scenarios.r10_rejected_answer(wire, ROUTE, stream)
    (feedback,) = tool_messages(wire.requests[1])
    assert feedback["content"] == "Error: too small"
    (tool,) = wire.requests[0].body["tools"]
    assert tool["type"] == "function" and tool["function"]["name"] == "final_answer"
    assert tool["function"]["parameters"]["required"] == ["city", "population"]


@STREAMING
async def test_r11_content_filter_is_refused_and_length_is_incomplete_openai(
    wire: OpenAIHarness, stream: bool
) -> None:
    """finish_reason content_filter (and a refusal) is sent once and ends refused;
    length is a cut-off answer, never accepted."""
    await scenarios.r11_refusal_and_cutoff(wire, ROUTE, stream)
    # The fake sent the Chat Completions finish reasons for those stop reasons.
    engine, _ = wire.engine(Reply.text("I can't", stop_reason="content_filter"),
                            Reply.text("Paris is the cap", stop_reason="length"),
                            stream=stream)
    refused = await engine.run(openai_operation(), "go")
    assert refused.outcome is le.Outcome.REFUSED
    assert refused.attempt_log[0].settle.stop_reason == "refusal"  # type: ignore[union-attr]
    cut = await engine.run(openai_operation(), "go", accept=lambda _: True)
    assert cut.outcome is le.Outcome.INCOMPLETE and cut.answer is None
    assert len(wire.requests) == 5


@STREAMING
async def test_r12_cache_markers_never_reach_the_chat_completions_wire_openai(
    wire: OpenAIHarness, stream: bool
) -> None:
    """However many markers the caller and the policy ask for, the request carries
    none (the API caches prompt prefixes on its own): never more than four."""
    marker = {"type": "ephemeral"}
    system = [{"type": "text", "text": f"rule {i}", "cache_control": marker} for i in range(6)]
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "q1", "cache_control": marker}]},
        {"role": "assistant",
         "content": [{"type": "text", "text": "a1", "cache_control": marker}]},
        {"role": "user", "content": [{"type": "text", "text": "q2", "cache_control": marker}]},
    ]
    counter = Counter()
    op = le.Operation(name="test.cached", provider="openai", model=MODEL,
                      cache=CachePolicy(system=True, tools=True, conversation=True))
    engine, _ = wire.engine(Reply.tool_calls(lookup()), Reply.text("done"), stream=stream)
    result = await engine.run(op, messages, system=system, tools=[counter.tool])
    assert result.outcome is le.Outcome.COMPLETED
    for request in wire.requests:
        assert "cache_control" not in repr(request.body)
    assert wire.requests[0].messages[:4] == [
        {"role": "system", "content": "\n\n".join(f"rule {i}" for i in range(6))},
        {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"}]


@STREAMING
async def test_r13_failures_never_switch_model_or_route_openai(
    wire: OpenAIHarness, stream: bool
) -> None:
    """Every retry goes to the published model on the same route, recorded openai:<model>."""
    result = await scenarios.r13_no_substitute(wire, ROUTE, stream, other_route="anthropic")
    assert {a.dispatch.served_by for a in result.attempt_log} == {f"openai:{MODEL}"}


@STREAMING
async def test_r14_accepted_answer_wins_over_tool_and_credit_checks_openai(
    wire: OpenAIHarness, stream: bool
) -> None:
    """An accepted final answer completes before the batch and credit checks."""
    await scenarios.r14_accepted_answer_wins(wire, ROUTE, stream)


@STREAMING
async def test_r15_missing_handler_is_a_recoverable_error_openai(
    wire: OpenAIHarness, stream: bool
) -> None:
    """A call to an unknown tool gets an error tool message and the run carries on."""
    await scenarios.r15_missing_handler(wire, ROUTE, stream)
    (error,) = tool_messages(wire.requests[1])
    assert error["content"].startswith("Error: ") and "translate" in error["content"]
    (ok,) = tool_messages(wire.requests[2])
    assert ok["content"] == "value of x"


@STREAMING
async def test_r15_malformed_arguments_are_a_recoverable_error_openai(
    wire: OpenAIHarness, stream: bool
) -> None:
    """Arguments that are not a JSON object give an error tool message (no handler runs
    on them); the model repairs the call and the run completes."""
    await scenarios.r15_malformed_arguments(wire, ROUTE, stream)
    second = wire.requests[1]
    # The call goes back as the model sent it, answered by an error.
    (call,) = [m for m in second.messages if m["role"] == "assistant"][0]["tool_calls"]
    assert call["function"]["arguments"] == '{"key": "a"'
    (error,) = tool_messages(second)
    assert error["tool_call_id"] == "call_bad"
    assert error["content"].startswith("Error: Invalid input for lookup")


@STREAMING
async def test_s01_failure_then_success_charges_the_success_openai(
    wire: OpenAIHarness, stream: bool
) -> None:
    """Both attempts are recorded; the successful one's usage (what the server
    served) determines the charge."""
    result, _ = await scenarios.s01_charge_the_success(wire, ROUTE, stream,
                                                       ErrorReply(status=503))
    first, second = result.attempt_log
    assert first.settle is not None and second.settle is not None
    assert (first.settle.fault, first.settle.http_status) == ("server_error", 503)
    assert second.settle.response_id == "chatcmpl-fake-0002"


@STREAMING
async def test_s02_repaired_answer_completes_within_remaining_controls_openai(
    wire: OpenAIHarness, stream: bool
) -> None:
    """The first answer is rejected (its feedback reaches the model as a user
    message); the repaired one is accepted within the remaining turns and budget."""
    await scenarios.s02_repaired_text_answer(wire, ROUTE, stream)
    assert wire.requests[1].messages == [
        {"role": "user", "content": "go"}, {"role": "assistant", "content": "42"},
        {"role": "user", "content": "in words"}]


async def test_r15_a_history_with_malformed_arguments_can_be_continued_openai(
    wire: OpenAIHarness,
) -> None:
    """result.messages of a run whose model sent malformed arguments is a history the
    caller can continue (docs/guards.md)."""
    counter = Counter()
    broken = Reply(content=[{"type": "tool_use", "id": "call_bad", "name": "lookup",
                             "input": "{oops"}], stop_reason="tool_use")
    engine, _ = wire.engine(broken, Reply.text("done"), Reply.text("again"))
    first = await engine.run(openai_operation(), "go", tools=[counter.tool])
    assert first.outcome is le.Outcome.COMPLETED
    again = await engine.run(openai_operation(), [*first.messages,
                                                  {"role": "user", "content": "more"}],
                             tools=[counter.tool])
    assert again.outcome is le.Outcome.COMPLETED
