"""The rules that cross the provider, through AnthropicProvider -> the real
``anthropic`` SDK -> FakeAnthropicServer on loopback.

Each test asserts on what the server received, so the rules are proved on the
wire, not just at the provider seam. Every test runs with JSON responses and
with server-sent events.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pydantic

import loopengine as le
from loopengine.providers import CachePolicy, FaultKind
from loopengine.providers._cache import cache_marker_problem
from loopengine.testing import ErrorReply, FakeClock, Reply

from ..conftest import MODEL, PRICES, operation
from .conftest import STREAMING, Harness, markers_on_the_wire, tool_results


class Counter:
    """A tool whose handler counts its calls."""

    def __init__(self, name: str = "lookup", before: Any = None) -> None:
        self.calls: list[str] = []

        async def handler(key: str) -> str:
            if before is not None:
                before(key)
            self.calls.append(key)
            return f"value of {key}"

        self.tool = le.tool(name=name, description="Look a key up.")(handler)


def lookup(key: str = "k") -> tuple[str, dict[str, Any]]:
    return ("lookup", {"key": key})


def quantum_prices(quantum: int) -> le.PriceBook:
    return le.PriceBook(PRICES.prices, credits_per_usd=PRICES.credits_per_usd,
                        credit_quantum=quantum)


class Answer(pydantic.BaseModel):
    city: str
    population: int


@STREAMING
async def test_r01_turn_limit_after_exactly_max_turns_requests_anthropic(
    wire: Harness, stream: bool
) -> None:
    """Without an accepted answer the run ends turn_limit after max_turns wire requests."""
    counter = Counter()
    engine, _ = wire.engine(*[Reply.tool_calls(lookup()) for _ in range(6)], stream=stream)
    result = await engine.run(operation(max_turns=3), "go", tools=[counter.tool])
    assert result.outcome is le.Outcome.TURN_LIMIT
    assert len(wire.requests) == 3 == result.turns
    assert len(counter.calls) == 3


@STREAMING
async def test_r02_oversized_batch_runs_no_handler_anthropic(wire: Harness, stream: bool) -> None:
    """A batch over max_tool_batch ends the run; no handler runs, nothing more is sent."""
    counter = Counter()
    engine, _ = wire.engine(Reply.tool_calls(lookup("a"), lookup("b"), lookup("c")),
                            Reply.text("never"), stream=stream)
    result = await engine.run(operation(max_tool_batch=2), "go", tools=[counter.tool])
    assert result.outcome is le.Outcome.TOOL_BATCH_LIMIT
    assert counter.calls == [] and result.tool_calls == 0
    assert len(wire.requests) == 1


@STREAMING
async def test_r03_credit_hold_greater_than_ends_exactly_continues_anthropic(
    wire: Harness, stream: bool
) -> None:
    """Turns of 120 credits round to 150: 150 and 300 continue under a hold of 300,
    the third turn crosses it, stops further work and stays billed."""
    counter = Counter()
    engine, ledger = wire.engine(*[Reply.tool_calls(lookup(str(i))) for i in range(5)],
                                 stream=stream, prices=quantum_prices(50))
    result = await engine.run(operation(credit_hold=300), "go", tools=[counter.tool])
    assert result.outcome is le.Outcome.CREDIT_LIMIT
    assert len(wire.requests) == 3
    assert result.credits == 450
    assert counter.calls == ["0", "1"]
    (row,) = ledger.invocations.values()
    assert row["credits"] == 450
    # The server served three replies of 100 in / 20 out: all of it is billed.
    assert wire.server.usage_served == result.usage == le.Usage(input_tokens=300,
                                                                output_tokens=60)


@STREAMING
async def test_r04_no_attempt_timeout_above_the_remaining_time_anthropic(
    wire: Harness, clock: FakeClock, stream: bool
) -> None:
    """Each wire request's timeout is min(attempt_timeout, remaining); none is sent
    once no time remains."""
    counter = Counter(before=lambda _: clock.advance(5.0))  # each tool call takes 5 s
    engine, _ = wire.engine(Reply.tool_calls(lookup()), Reply.tool_calls(lookup()),
                            Reply.text("never sent"), stream=stream)
    result = await engine.run(operation(total_time=10.0, attempt_timeout=6.0), "go",
                              tools=[counter.tool])
    assert result.outcome is le.Outcome.TIME_LIMIT
    # The SDK hands the per-request timeout to the server as x-stainless-timeout.
    assert [r.timeout for r in wire.requests] == [6.0, 5.0]
    assert [a.dispatch.timeout_ms for a in result.attempt_log] == [6000, 5000]
    remaining = [10.0, 5.0]
    assert all(r.timeout is not None and r.timeout <= left
               for r, left in zip(wire.requests, remaining, strict=True))


@STREAMING
async def test_r05_transient_faults_retry_with_growing_waits_anthropic(
    wire: Harness, clock: FakeClock, stream: bool
) -> None:
    """Overloads are retried with growing waits, three attempts by default."""
    engine, _ = wire.engine(*[ErrorReply.overloaded() for _ in range(4)], stream=stream)
    result = await engine.run(operation(), "go")
    assert result.outcome is le.Outcome.PROVIDER_ERROR
    assert len(wire.requests) == 3
    # max_retries=0: the SDK itself never retried; each attempt is one request.
    assert [r.headers["x-stainless-retry-count"] for r in wire.requests] == ["0", "0", "0"]
    assert len(clock.sleeps) == 2 and clock.sleeps[0] < clock.sleeps[1]
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
async def test_r08_one_user_message_holds_every_tool_result_anthropic(
    wire: Harness, stream: bool
) -> None:
    """The model receives one user message with a tool_result for every call."""
    counter = Counter()
    engine, _ = wire.engine(Reply.tool_calls(lookup("a"), lookup("b"), lookup("c")),
                            Reply.text("done"), stream=stream)
    result = await engine.run(operation(), "go", tools=[counter.tool])
    assert result.outcome is le.Outcome.COMPLETED and result.tool_calls == 3
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

    @le.tool
    async def explode(key: str) -> str:
        """Always fails."""
        raise RuntimeError(f"no such key: {key}")

    engine, _ = wire.engine(Reply.tool_calls(("explode", {"key": "x"})), Reply.text("sorry"),
                            stream=stream)
    result = await engine.run(operation(), "go", tools=[explode])
    assert result.outcome is le.Outcome.COMPLETED
    (error,) = tool_results(wire.requests[1])
    assert error["is_error"] is True and error["content"] == "no such key: x"


@STREAMING
async def test_r10_rejected_answer_feedback_is_an_error_result_anthropic(
    wire: Harness, stream: bool
) -> None:
    """Structured mode: the judge's feedback goes back as an is_error result and
    consumes one unit of tool budget; the repair turn completes."""
    engine, _ = wire.engine(Reply.final({"city": "Paris", "population": 1}),
                            Reply.final({"city": "Paris", "population": 2_100_000}),
                            stream=stream)
    result = await engine.run(
        operation(), "go", output=Answer,
        accept=lambda a: le.Accept() if a.population > 1000 else le.Reject("too small"),
    )
    assert result.outcome is le.Outcome.COMPLETED
    assert result.answer == Answer(city="Paris", population=2_100_000)
    assert result.tool_calls == 1
    (feedback,) = tool_results(wire.requests[1])
    assert feedback["is_error"] is True and feedback["content"] == "too small"
    assert [t["name"] for t in wire.requests[0].body["tools"]] == ["final_answer"]
    assert [a.dispatch.phase for a in result.attempt_log] == ["turn", "repair"]


@STREAMING
async def test_r11_refusal_ends_refused_and_cutoff_is_incomplete_anthropic(
    wire: Harness, stream: bool
) -> None:
    """A refusal is sent once and ends refused; a max_tokens answer is never accepted."""
    engine, _ = wire.engine(Reply.text("I can't", stop_reason="refusal"), stream=stream)
    refused = await engine.run(operation(), "go")
    assert refused.outcome is le.Outcome.REFUSED and len(wire.requests) == 1
    engine, _ = wire.engine(Reply.text("Paris is the cap", stop_reason="max_tokens"),
                            stream=stream)
    cut = await engine.run(operation(), "go", accept=lambda _: True)
    assert cut.outcome is le.Outcome.INCOMPLETE and cut.answer is None
    engine, _ = wire.engine(Reply.text("...", stop_reason="model_context_window_exceeded"),
                            stream=stream)
    full = await engine.run(operation(), "go")
    assert full.outcome is le.Outcome.INCOMPLETE
    assert len(wire.requests) == 3


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
    request (it refuses more, as the API does)."""
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
    result = await engine.run(op, messages)
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
    engine, _ = wire.engine(*[ErrorReply(status=500) for _ in range(3)], stream=stream)
    result = await engine.run(operation(), "go")
    assert result.outcome is le.Outcome.PROVIDER_ERROR
    assert {r.body["model"] for r in wire.requests} == {MODEL}
    assert {a.dispatch.served_by for a in result.attempt_log} == {f"anthropic:{MODEL}"}
    other = le.Operation(name="x", provider="bedrock", model=MODEL)
    try:
        await engine.run(other, "go")
    except le.ConfigError as error:
        assert error.field == "provider"
    else:  # pragma: no cover - the assertion below explains the failure
        raise AssertionError("a bedrock operation ran on the anthropic provider")
    assert len(wire.requests) == 3


@STREAMING
async def test_r14_accepted_answer_wins_over_tool_and_credit_checks_anthropic(
    wire: Harness, stream: bool
) -> None:
    """An accepted final answer completes before the batch and credit checks."""
    counter = Counter()
    engine, _ = wire.engine(
        Reply.tool_calls(("final_answer", {"city": "Oslo", "population": 700_000}),
                         lookup("a"), lookup("b")),
        stream=stream, prices=quantum_prices(50),
    )
    result = await engine.run(operation(credit_hold=10, max_tool_batch=1, max_tool_calls=0),
                              "go", tools=[counter.tool], output=Answer)
    assert result.outcome is le.Outcome.COMPLETED
    assert result.answer == Answer(city="Oslo", population=700_000)
    assert result.tool_calls == 0 and counter.calls == []
    assert len(wire.requests) == 1 and result.credits == 150


@STREAMING
async def test_r15_missing_handler_is_a_recoverable_is_error_anthropic(
    wire: Harness, stream: bool
) -> None:
    """A call to an unknown tool gets an is_error result and the run carries on."""
    counter = Counter()
    engine, _ = wire.engine(Reply.tool_calls(("translate", {"text": "hi"})),
                            Reply.tool_calls(lookup("x")), Reply.text("done"), stream=stream)
    result = await engine.run(operation(), "go", tools=[counter.tool])
    assert result.outcome is le.Outcome.COMPLETED
    (error,) = tool_results(wire.requests[1])
    assert error["is_error"] is True and "translate" in error["content"]
    (ok,) = tool_results(wire.requests[2])
    assert "is_error" not in ok and ok["content"] == "value of x"
    assert len(wire.requests) == 3 and counter.calls == ["x"]


@STREAMING
async def test_s01_overload_then_success_charges_the_success_anthropic(
    wire: Harness, stream: bool
) -> None:
    """Both attempts are recorded; the successful one's usage (what the server
    served) determines the charge."""
    engine, ledger = wire.engine(
        ErrorReply.overloaded(),
        Reply.text("hello", usage=le.Usage(input_tokens=100, output_tokens=20)),
        stream=stream,
    )
    result = await engine.run(operation(), "go")
    assert result.outcome is le.Outcome.COMPLETED and result.answer == "hello"
    first, second = result.attempt_log
    assert first.settle is not None and second.settle is not None
    assert (first.settle.outcome, first.settle.fault, first.settle.http_status) == (
        "error", "overloaded", 529)
    assert (second.settle.outcome, second.settle.charged) == ("ok", True)
    assert first.settle.request_id == "req_fake_0001"
    assert second.settle.response_id == "msg_fake_0002"
    assert wire.server.usage_served == result.usage == le.Usage(input_tokens=100,
                                                                output_tokens=20)
    assert result.cost_usd == Decimal("0.00012") and result.credits == 120
    (row,) = ledger.invocations.values()
    assert (row["attempt_count"], row["input_tokens"], row["output_tokens"],
            row["cost_nanousd"]) == (2, 100, 20, 120_000)
