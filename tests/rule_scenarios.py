"""The rule scenarios that cross the provider, defined once and run through each
shipped provider (tests/adapter/test_anthropic_rules.py, tests/openai/test_openai_rules.py).

Each scenario scripts the provider's loopback fake with the same `Reply` items,
runs the engine, and asserts what holds whatever the vendor: the outcome, the
number of requests the server received, the handlers that ran, the credits.
It returns the result; the provider's own test then checks what only its wire
can show (how tool results and errors are rendered, its status codes and ids).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import pydantic

import loopengine as le
from loopengine.persistence import MemoryLedger
from loopengine.testing import CutStream, ErrorReply, FakeClock, Reply


@dataclass(frozen=True)
class Route:
    """What a scenario needs of a provider's route: its operation and prices."""

    operation: Callable[..., le.Operation]
    """The test operation on this route, limits as keywords."""
    prices: le.PriceBook
    """One USD per million tokens in and out, one credit per micro-dollar."""
    model_of: Callable[[Any], str | None] = lambda request: request.body["model"]
    """The model a recorded request names (Bedrock, Vertex and Gemini name it in the path)."""
    request_ids: bool = True
    """Whether the API sends a request id header (Gemini's does not)."""

    def prices_with_quantum(self, quantum: int) -> le.PriceBook:
        """`prices`, with each turn's charge rounded up to ``quantum`` credits."""
        return le.PriceBook(self.prices.prices, credits_per_usd=self.prices.credits_per_usd,
                            credit_quantum=quantum)


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
    """A call of the `Counter` tool."""
    return ("lookup", {"key": key})


class Answer(pydantic.BaseModel):
    city: str
    population: int


Wire = Any
"""A harness: ``engine(*script, stream=..., **engine_kwargs)``, ``requests``, ``server``."""


async def r01_turn_limit(wire: Wire, route: Route, stream: bool) -> le.RunResult:
    """Without an accepted answer the run ends turn_limit after max_turns wire requests."""
    counter = Counter()
    engine, _ = wire.engine(*[Reply.tool_calls(lookup()) for _ in range(6)], stream=stream)
    result = await engine.run(route.operation(max_turns=3), "go", tools=[counter.tool])
    assert result.outcome is le.Outcome.TURN_LIMIT
    assert len(wire.requests) == 3 == result.turns
    assert len(counter.calls) == 3
    return result


async def r02_oversized_batch(wire: Wire, route: Route, stream: bool) -> le.RunResult:
    """A batch over max_tool_batch ends the run; no handler runs, nothing more is sent."""
    counter = Counter()
    engine, _ = wire.engine(Reply.tool_calls(lookup("a"), lookup("b"), lookup("c")),
                            Reply.text("never"), stream=stream)
    result = await engine.run(route.operation(max_tool_batch=2), "go", tools=[counter.tool])
    assert result.outcome is le.Outcome.TOOL_BATCH_LIMIT
    assert counter.calls == [] and result.tool_calls == 0
    assert len(wire.requests) == 1
    return result


async def r03_credit_hold(wire: Wire, route: Route, stream: bool) -> le.RunResult:
    """Turns of 120 credits round to 150: 150 and 300 continue under a hold of 300,
    the third turn crosses it, stops further work and stays billed."""
    counter = Counter()
    engine, ledger = wire.engine(*[Reply.tool_calls(lookup(str(i))) for i in range(5)],
                                 stream=stream, prices=route.prices_with_quantum(50))
    result = await engine.run(route.operation(credit_hold=300), "go", tools=[counter.tool])
    assert result.outcome is le.Outcome.CREDIT_LIMIT
    assert len(wire.requests) == 3
    assert result.credits == 450
    assert counter.calls == ["0", "1"]
    (row,) = ledger.invocations.values()
    assert row["credits"] == 450
    # The server served three replies of 100 in / 20 out: all of it is billed.
    assert wire.server.usage_served == result.usage == le.Usage(input_tokens=300,
                                                                output_tokens=60)
    return result


async def r04_attempt_timeouts(wire: Wire, route: Route, clock: FakeClock,
                               stream: bool) -> le.RunResult:
    """Each wire request's timeout is min(attempt_timeout, remaining); none is sent
    once no time remains."""
    counter = Counter(before=lambda _: clock.advance(5.0))  # each tool call takes 5 s
    engine, _ = wire.engine(Reply.tool_calls(lookup()), Reply.tool_calls(lookup()),
                            Reply.text("never sent"), stream=stream)
    result = await engine.run(route.operation(total_time=10.0, attempt_timeout=6.0), "go",
                              tools=[counter.tool])
    assert result.outcome is le.Outcome.TIME_LIMIT
    # The SDK hands the per-request timeout to the server in a header.
    assert [r.timeout for r in wire.requests] == [6.0, 5.0]
    assert [a.dispatch.timeout_ms for a in result.attempt_log] == [6000, 5000]
    return result


async def r08_one_results_message(wire: Wire, route: Route, stream: bool) -> le.RunResult:
    """Three calls in one reply are answered together in the next request, each
    consuming a unit of tool budget."""
    counter = Counter()
    engine, _ = wire.engine(Reply.tool_calls(lookup("a"), lookup("b"), lookup("c")),
                            Reply.text("done"), stream=stream)
    result = await engine.run(route.operation(), "go", tools=[counter.tool])
    assert result.outcome is le.Outcome.COMPLETED and result.tool_calls == 3
    assert counter.calls == ["a", "b", "c"] and len(wire.requests) == 2
    return result


async def r09_handler_error(wire: Wire, route: Route, stream: bool) -> le.RunResult:
    """A raising handler's message goes back to the model; the run completes."""

    @le.tool
    async def explode(key: str) -> str:
        """Always fails."""
        raise RuntimeError(f"no such key: {key}")

    engine, _ = wire.engine(Reply.tool_calls(("explode", {"key": "x"})), Reply.text("sorry"),
                            stream=stream)
    result = await engine.run(route.operation(), "go", tools=[explode])
    assert result.outcome is le.Outcome.COMPLETED and len(wire.requests) == 2
    return result


async def r10_rejected_answer(wire: Wire, route: Route, stream: bool) -> le.RunResult:
    """Structured mode: the judge's feedback goes back as an error result and
    consumes one unit of tool budget; the repair turn completes."""
    engine, _ = wire.engine(Reply.final({"city": "Paris", "population": 1}),
                            Reply.final({"city": "Paris", "population": 2_100_000}),
                            stream=stream)
    result = await engine.run(
        route.operation(), "go", output=Answer,
        accept=lambda a: le.Accept() if a.population > 1000 else le.Reject("too small"),
    )
    assert result.outcome is le.Outcome.COMPLETED
    assert result.answer == Answer(city="Paris", population=2_100_000)
    assert result.tool_calls == 1
    assert [a.dispatch.phase for a in result.attempt_log] == ["turn", "repair"]
    return result


async def r11_refusal_and_cutoff(wire: Wire, route: Route, stream: bool) -> None:
    """A refusal is sent once and ends refused; a cut-off answer is never accepted,
    nor one that filled the context window."""
    engine, _ = wire.engine(Reply.text("I can't", stop_reason="refusal"), stream=stream)
    refused = await engine.run(route.operation(), "go")
    assert refused.outcome is le.Outcome.REFUSED and len(wire.requests) == 1
    engine, _ = wire.engine(Reply.text("Paris is the cap", stop_reason="max_tokens"),
                            stream=stream)
    cut = await engine.run(route.operation(), "go", accept=lambda _: True)
    assert cut.outcome is le.Outcome.INCOMPLETE and cut.answer is None
    engine, _ = wire.engine(Reply.text("...", stop_reason="model_context_window_exceeded"),
                            stream=stream)
    full = await engine.run(route.operation(), "go")
    assert full.outcome is le.Outcome.INCOMPLETE
    assert len(wire.requests) == 3


async def r13_no_substitute(wire: Wire, route: Route, stream: bool,
                            other_route: str) -> le.RunResult:
    """Every retry goes to the published model on the same route; an operation on
    another route is refused, not served."""
    from loopengine.testing import ErrorReply

    engine, _ = wire.engine(*[ErrorReply(status=500) for _ in range(3)], stream=stream)
    op = route.operation()
    result = await engine.run(op, "go")
    assert result.outcome is le.Outcome.PROVIDER_ERROR
    assert {route.model_of(r) for r in wire.requests} == {op.model}
    assert {a.dispatch.served_by for a in result.attempt_log} == {f"{op.provider}:{op.model}"}
    other = le.Operation(name="x", provider=other_route, model=op.model)
    try:
        await engine.run(other, "go")
    except le.ConfigError as error:
        assert error.field == "provider"
    else:  # pragma: no cover - the assertion below explains the failure
        raise AssertionError(f"a {other_route} operation ran on the {op.provider} provider")
    assert len(wire.requests) == 3
    return result


async def r14_accepted_answer_wins(wire: Wire, route: Route, stream: bool) -> le.RunResult:
    """An accepted final answer completes before the batch and credit checks."""
    counter = Counter()
    engine, _ = wire.engine(
        Reply.tool_calls(("final_answer", {"city": "Oslo", "population": 700_000}),
                         lookup("a"), lookup("b")),
        stream=stream, prices=route.prices_with_quantum(50),
    )
    result = await engine.run(route.operation(credit_hold=10, max_tool_batch=1,
                                              max_tool_calls=0),
                              "go", tools=[counter.tool], output=Answer)
    assert result.outcome is le.Outcome.COMPLETED
    assert result.answer == Answer(city="Oslo", population=700_000)
    assert result.tool_calls == 0 and counter.calls == []
    assert len(wire.requests) == 1 and result.credits == 150
    return result


async def r15_missing_handler(wire: Wire, route: Route, stream: bool) -> Counter:
    """A call to an unknown tool gets an error result and the run carries on."""
    counter = Counter()
    engine, _ = wire.engine(Reply.tool_calls(("translate", {"text": "hi"})),
                            Reply.tool_calls(lookup("x")), Reply.text("done"), stream=stream)
    result = await engine.run(route.operation(), "go", tools=[counter.tool])
    assert result.outcome is le.Outcome.COMPLETED
    assert len(wire.requests) == 3 and counter.calls == ["x"]
    return counter


async def s01_charge_the_success(wire: Wire, route: Route, stream: bool,
                                 transient: Any) -> tuple[le.RunResult, Any]:
    """A transient failure, then success: both attempts recorded; the successful
    one's usage (what the server served) determines the charge."""
    engine, ledger = wire.engine(
        transient, Reply.text("hello", usage=le.Usage(input_tokens=100, output_tokens=20)),
        stream=stream,
    )
    result = await engine.run(route.operation(), "go")
    assert result.outcome is le.Outcome.COMPLETED and result.answer == "hello"
    first, second = result.attempt_log
    assert first.settle is not None and second.settle is not None
    assert first.settle.outcome == "error"
    assert (second.settle.outcome, second.settle.charged) == ("ok", True)
    assert first.settle.request_id == ("req_fake_0001" if route.request_ids else None)
    assert wire.server.usage_served == result.usage == le.Usage(input_tokens=100,
                                                                output_tokens=20)
    assert result.cost_usd == Decimal("0.00012") and result.credits == 120
    (row,) = ledger.invocations.values()
    assert (row["attempt_count"], row["input_tokens"], row["output_tokens"],
            row["cost_nanousd"]) == (2, 100, 20, 120_000)
    return result, ledger


async def r05_permanent_not_retried(wire: Wire, route: Route, clock: FakeClock,
                                    stream: bool) -> None:
    """A 400, a 422 and a 401 are each sent once."""
    for status in (400, 422, 401):
        engine, _ = wire.engine(ErrorReply(status=status), stream=stream)
        result = await engine.run(route.operation(), "go")
        assert result.outcome is le.Outcome.PROVIDER_ERROR
        assert result.fault is not None and result.fault.http_status == status
        assert len(result.attempt_log) == 1
    assert len(wire.requests) == 3
    assert clock.sleeps == []


async def r06_openai_insufficient_quota(wire: Wire, route: Route, clock: FakeClock,
                                        stream: bool) -> None:
    """OpenAI's 429 insufficient_quota ends credit_exhausted after one request."""
    engine, _ = wire.engine(ErrorReply.insufficient_quota(), Reply.text("never"), stream=stream)
    result = await engine.run(route.operation(), "go")
    assert result.outcome is le.Outcome.CREDIT_EXHAUSTED
    assert len(wire.requests) == 1 and clock.sleeps == []
    assert result.fault is not None
    assert (result.fault.http_status, result.fault.error_code) == (429, "insufficient_quota")


async def r07_attempt_rows(wire: Wire, route: Route, stream: bool, transient: Any,
                           ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Each attempt is a row with its turn, try, usage, timing, ids and own price;
    past the retained rows, attempts are counted and the record marked incomplete.
    Returns the retained attempt rows, in order, and the invocation row."""
    counter = Counter()
    ledger = MemoryLedger(max_retained_attempts=3)
    engine, _ = wire.engine(
        transient, Reply.tool_calls(lookup("a")),
        ErrorReply(status=429), Reply.text("done", usage=le.Usage(input_tokens=300,
                                                                  output_tokens=10,
                                                                  cache_read_tokens=200)),
        stream=stream, ledger=ledger)
    fast = le.RetryPolicy(max_attempts=4, initial_wait=0.001, max_wait=0.002)
    op = route.operation(retry=fast)
    result = await engine.run(op, "go", tools=[counter.tool])
    assert result.outcome is le.Outcome.COMPLETED
    assert (result.attempts.count, result.attempts.retained, result.attempts.incomplete) == (
        4, 3, True)
    rows = sorted(ledger.attempts.values(), key=lambda r: r["ordinal"])
    assert [(r["turn"], r["attempt"], r["outcome"]) for r in rows] == [
        (1, 1, "error"), (1, 2, "ok"), (2, 1, "error")]
    assert rows[2]["fault"] == "rate_limited"
    assert [r["request_id"] for r in rows] == ["req_fake_0001", "req_fake_0002",
                                               "req_fake_0003"]
    assert [r["cost_nanousd"] for r in rows] == [None, 120_000, None]
    assert all(r["served_by"] == f"{op.provider}:{op.model}"
               and r["latency_ms"] is not None for r in rows)
    (invocation,) = ledger.invocations.values()
    assert (invocation["attempt_count"], invocation["incomplete"]) == (4, 1)
    assert invocation["provider"] == op.provider
    # The fourth attempt has no row, but its usage (cached tokens apart) is in the totals.
    assert (invocation["input_tokens"], invocation["cache_read_tokens"],
            invocation["output_tokens"]) == (400, 200, 30)
    assert invocation["cost_nanousd"] == 120_000 + 510_000
    return rows, invocation


async def r05_transient_retries(wire: Wire, route: Route, clock: FakeClock, stream: bool,
                                transient: Any) -> le.RunResult:
    """A transient fault is retried with growing waits, three attempts by default;
    the SDK itself never retries (max_retries=0: each attempt is one request, as
    the Stainless SDKs' ``x-stainless-retry-count`` shows)."""
    engine, _ = wire.engine(*[transient for _ in range(4)], stream=stream)
    result = await engine.run(route.operation(), "go")
    assert result.outcome is le.Outcome.PROVIDER_ERROR
    assert len(wire.requests) == 3
    assert [r.headers["x-stainless-retry-count"] for r in wire.requests] == ["0", "0", "0"]
    assert len(clock.sleeps) == 2 and clock.sleeps[0] < clock.sleeps[1]
    assert result.fault is not None and result.fault.retryable
    return result


async def r05_transient_retried(wire: Wire, route: Route, clock: FakeClock,
                                stream: bool) -> le.RunResult:
    """503s are retried with growing waits, three attempts by default, as server errors."""
    result = await r05_transient_retries(wire, route, clock, stream, ErrorReply(status=503))
    assert result.fault is not None and result.fault.kind.value == "server_error"
    return result


async def r07_openai_attempt_rows(wire: Wire, route: Route, stream: bool,
                                  response_id: str) -> None:
    """`r07_attempt_rows` after a 500: ``response_id`` is the id the route's fake
    gives its second response."""
    rows, _ = await r07_attempt_rows(wire, route, stream, ErrorReply(status=500))
    assert rows[0]["fault"] == "server_error"
    assert rows[1]["response_id"] == response_id


async def r15_malformed_arguments(wire: Wire, route: Route, stream: bool) -> le.RunResult:
    """Arguments that are not a JSON object (the call ``call_bad``) are answered by an
    error result, no handler runs on them; the model repairs the call and the run
    completes."""
    counter = Counter()
    broken = Reply(content=[{"type": "tool_use", "id": "call_bad", "name": "lookup",
                             "input": '{"key": "a"'}], stop_reason="tool_use")
    engine, _ = wire.engine(broken, Reply.tool_calls(lookup("a")), Reply.text("done"),
                            stream=stream)
    result = await engine.run(route.operation(), "go", tools=[counter.tool])
    assert result.outcome is le.Outcome.COMPLETED
    assert counter.calls == ["a"] and result.tool_calls == 2
    return result


async def s02_repaired_text_answer(wire: Wire, route: Route, stream: bool) -> le.RunResult:
    """The first answer ("42") is rejected ("in words"); the repaired one is accepted
    within the remaining turns and budget, after exactly two requests."""
    engine, _ = wire.engine(Reply.text("42"), Reply.text("forty-two"), Reply.text("never"),
                            stream=stream)
    result = await engine.run(
        route.operation(max_turns=2, max_tool_calls=1), "go",
        accept=lambda a: le.Accept() if a.isalpha() or "-" in a else le.Reject("in words"),
    )
    assert result.outcome is le.Outcome.COMPLETED
    assert result.answer == "forty-two"
    assert result.turns == 2 and result.tool_calls == 1
    assert len(wire.requests) == 2
    return result


async def fault_case(wire: Wire, route: Route, case: Any, stream: bool) -> Any:
    """Run one row of a fault table (``case``: tests/adapter/test_anthropic_faults.py's
    `Case`) on ``wire``'s provider, followed by a good reply, and check it: the right
    kind, retried or not, the right outcome. Returns the ledger."""
    # Every case has a minute of (real) time, so a busy machine cannot turn its
    # fault into a timeout; the timeout rows run on trio's MockClock instead
    # (`timeout_case`).
    assert not case.mock_clock, "a timeout row runs in timeout_case"
    engine, ledger = wire.engine(case.item, Reply.text("recovered"), stream=stream,
                                 provider_kwargs={"stream_idle_timeout": case.idle_timeout})
    result = await engine.run(route.operation(attempt_timeout=case.attempt_timeout), "go")
    return _check_fault_case(wire, case, result, ledger)


def timeout_case(wire: Wire, route: Route, case: Any, stream: bool) -> Any:
    """Run a timeout row of a fault table (the SDK's own timeout, the provider's
    stream idle limit) as `fault_case` does, on trio's MockClock, whose time moves
    only when the test moves it: once the first request has reached the server,
    which never answers it (or goes quiet after some events, once the client has
    read their text), and every task waits, the clock jumps past the timeout. No
    real time is waited for, and a busy machine cannot race the timeout: the
    retry's good reply has all the time it needs, since the clock stands still.
    Returns the ledger."""
    import threading

    import trio
    import trio.testing

    mock = trio.testing.MockClock()
    arrived = threading.Event()
    idle = case.idle_timeout < case.attempt_timeout

    def first(request: Any) -> Any:
        arrived.set()
        return case.item

    texted = threading.Event()

    def ready() -> bool:
        # Bounded in real time, well within the test's own timeout: a row that
        # never gets there fails here, saying so.
        return arrived.wait(30) and (not idle or texted.wait(30))

    async def main() -> Any:
        engine, ledger = wire.engine(first, Reply.text("recovered"), stream=stream,
                                     provider_kwargs={"stream_idle_timeout": case.idle_timeout})
        ended: list[le.RunResult] = []

        async def run() -> None:
            ended.append(await engine.run(
                route.operation(attempt_timeout=case.attempt_timeout), "go",
                on_text=(lambda _: texted.set()) if stream else None))

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run)
                assert await trio.to_thread.run_sync(ready), "the first request never " \
                    "reached the server (or, for an idle stream, its text the client)"
                # The client now waits on the server, its timeout (or idle limit)
                # counted from this instant of the mock clock.
                await trio.testing.wait_all_tasks_blocked()
                mock.jump(min(case.attempt_timeout, case.idle_timeout) + 1.0)
        finally:
            await wire.aclose()
        (result,) = ended
        return _check_fault_case(wire, case, result, ledger)

    return trio.run(main, clock=mock)


def _check_fault_case(wire: Wire, case: Any, result: le.RunResult, ledger: Any) -> Any:
    from loopengine.providers import FaultKind

    first = result.attempt_log[0].settle
    assert first is not None
    assert first.fault == case.kind.value
    assert first.outcome == case.attempt_outcome
    clock: FakeClock = wire.clock
    if case.retried:
        assert result.outcome is le.Outcome.COMPLETED and result.answer == "recovered"
        assert len(wire.requests) == 2 and len(result.attempt_log) == 2
        assert len(clock.sleeps) == 1
    else:
        expected = (le.Outcome.CREDIT_EXHAUSTED if case.kind is FaultKind.CREDIT_EXHAUSTED
                    else le.Outcome.PROVIDER_ERROR)
        assert result.outcome is expected
        assert len(wire.requests) == 1 and len(result.attempt_log) == 1
        assert clock.sleeps == []
        assert result.fault is not None and result.fault.kind is case.kind
    (row, *_) = ledger.attempts.values()
    assert (row["fault"], row["outcome"]) == (case.kind.value, case.attempt_outcome)
    return ledger


async def cut_before_any_usage(wire: Wire, route: Route) -> le.RunResult:
    """A stream cut before it sent a single event: the attempt is aborted with its
    usage unknown (None), never flagged a floor (``usage_approx``: only usage that
    arrived can be a floor), and the run's totals say they are incomplete."""
    reply = Reply.text("never sent", usage=le.Usage(input_tokens=50, output_tokens=5))
    engine, ledger = wire.engine(CutStream(reply=reply, after=0), Reply.text("recovered"),
                                 stream=True)
    result = await engine.run(route.operation(), "go")
    assert result.outcome is le.Outcome.COMPLETED and result.answer == "recovered"
    cut = result.attempt_log[0].settle
    assert cut is not None
    assert (cut.outcome, cut.fault, cut.usage, cut.usage_approx) == (
        "aborted", "aborted", None, False)
    assert result.attempts.usage_complete is False
    row = ledger.attempts[(result.invocation_id, 1)]
    assert (row["outcome"], row["input_tokens"], row["usage_approx"]) == ("aborted", None, False)
    return result
