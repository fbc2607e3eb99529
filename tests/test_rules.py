"""The business rules R01-R15 and scenarios S01-S02, driven through ScriptedProvider.

Each test is named after the rule it proves. R07 (attempt retention) is proved
against the SQLite ledger in test_ledger_*.py, and R12 on the wire through
the Anthropic adapter; R12's placement rule is proved here as a pure function.
"""

from __future__ import annotations

import copy
import json
from decimal import Decimal
from typing import Any

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import loopengine as le
from loopengine.providers import (
    CachePolicy,
    FaultKind,
    ProviderFault,
    Reply,
    place_cache_markers,
)
from loopengine.providers._cache import cache_marker_problem, cache_markers

from .conftest import PRICES, EngineFactory, operation


class Counter:
    """A tool whose handler counts its calls."""

    def __init__(self, name: str = "lookup") -> None:
        self.calls: list[dict[str, Any]] = []

        async def handler(key: str) -> str:
            self.calls.append({"key": key})
            return f"value of {key}"

        self.tool = le.tool(name=name, description="Look a key up.")(handler)


def lookup(key: str = "k") -> tuple[str, dict[str, Any]]:
    return ("lookup", {"key": key})


def overloaded(**kw: Any) -> ProviderFault:
    return ProviderFault(FaultKind.OVERLOADED, "overloaded", http_status=529, **kw)


# -- R01 ---------------------------------------------------------------------------


async def test_r01_turn_limit_after_exactly_max_turns_requests(make_engine: EngineFactory) -> None:
    """Without an accepted answer the run ends turn_limit after max_turns turn requests."""
    counter = Counter()
    engine, provider, _ = make_engine(*[Reply.tool_calls(lookup()) for _ in range(10)])
    result = await engine.run(operation(max_turns=3), "go", tools=[counter.tool])
    assert result.outcome is le.Outcome.TURN_LIMIT
    assert result.turns == 3
    assert len(provider.requests) == 3
    assert result.trip is not None and result.trip.guard == "max_turns"


async def test_r01_retries_are_attempts_not_turns(make_engine: EngineFactory) -> None:
    """A retried turn is still one turn: three turns, four wire requests."""
    counter = Counter()
    engine, provider, _ = make_engine(
        overloaded(), *[Reply.tool_calls(lookup()) for _ in range(3)]
    )
    result = await engine.run(operation(max_turns=3), "go", tools=[counter.tool])
    assert result.outcome is le.Outcome.TURN_LIMIT
    assert result.turns == 3
    assert len(provider.requests) == 4
    assert [r.dispatch.turn for r in result.attempt_log] == [1, 1, 2, 3]


async def test_r01_rejected_answers_do_not_extend_the_turn_limit(
    make_engine: EngineFactory,
) -> None:
    """Repair turns count as turns: rejections forever end at max_turns."""
    engine, provider, _ = make_engine(*[Reply.text(f"try {i}") for i in range(5)])
    result = await engine.run(operation(max_turns=2), "go", accept=lambda _: False)
    assert result.outcome is le.Outcome.TURN_LIMIT
    assert len(provider.requests) == 2


# -- R02 ---------------------------------------------------------------------------


async def test_r02_oversized_batch_runs_no_handler(make_engine: EngineFactory) -> None:
    """A batch over max_tool_batch ends the run before any handler of it runs."""
    counter = Counter()
    engine, provider, _ = make_engine(Reply.tool_calls(lookup("a"), lookup("b"), lookup("c")))
    result = await engine.run(operation(max_tool_batch=2), "go", tools=[counter.tool])
    assert result.outcome is le.Outcome.TOOL_BATCH_LIMIT
    assert counter.calls == []
    assert result.tool_calls == 0
    assert result.trip is not None and (result.trip.observed, result.trip.limit) == (3, 2)


async def test_r02_batch_beyond_remaining_budget_runs_no_handler(
    make_engine: EngineFactory,
) -> None:
    """A batch larger than the tool budget left ends tool_limit: never half a batch."""
    counter = Counter()
    engine, provider, _ = make_engine(
        Reply.tool_calls(lookup("a"), lookup("b")),
        Reply.tool_calls(lookup("c"), lookup("d")),
    )
    result = await engine.run(operation(max_tool_calls=3), "go", tools=[counter.tool])
    assert result.outcome is le.Outcome.TOOL_LIMIT
    assert [c["key"] for c in counter.calls] == ["a", "b"]
    assert result.tool_calls == 2


# -- R03 ---------------------------------------------------------------------------


def quantum_prices(quantum: int) -> le.PriceBook:
    return le.PriceBook(PRICES.prices, credits_per_usd=PRICES.credits_per_usd,
                        credit_quantum=quantum)


async def test_r03_credit_hold_greater_than_ends_exactly_continues(
    make_engine: EngineFactory,
) -> None:
    """Each turn (120 credits) rounds up to 150; 150 and 300 continue under a hold
    of 300, the third turn crosses it, stops further work and stays billed."""
    counter = Counter()
    engine, provider, _ = make_engine(
        *[Reply.tool_calls(lookup(str(i))) for i in range(5)], prices=quantum_prices(50)
    )
    result = await engine.run(operation(credit_hold=300), "go", tools=[counter.tool])
    assert result.outcome is le.Outcome.CREDIT_LIMIT
    assert result.turns == 3
    assert result.credits == 450
    assert [c["key"] for c in counter.calls] == ["0", "1"]  # the crossing turn's tool never ran
    assert result.trip is not None and (result.trip.observed, result.trip.limit) == (450, 300)


async def test_r03_rounding_happens_per_turn_before_accumulating(
    make_engine: EngineFactory,
) -> None:
    """Three turns of 120 credits at a quantum of 50 cost 450, not ceil(360) = 400."""
    counter = Counter()
    engine, _, _ = make_engine(
        Reply.tool_calls(lookup()), Reply.tool_calls(lookup()), Reply.text("done"),
        prices=quantum_prices(50),
    )
    result = await engine.run(operation(), "go", tools=[counter.tool])
    assert result.outcome is le.Outcome.COMPLETED
    assert result.credits == 450


async def test_r03_checked_after_final_answers(make_engine: EngineFactory) -> None:
    """An answer on the crossing turn is accepted: credits are checked after answers."""
    engine, _, _ = make_engine(Reply.text("the answer"), prices=quantum_prices(50))
    result = await engine.run(operation(credit_hold=100), "go")
    assert result.outcome is le.Outcome.COMPLETED
    assert result.credits == 150


async def test_r03_unpriced_model_with_hold_is_a_config_error(
    make_engine: EngineFactory,
) -> None:
    """A credit hold cannot be enforced without a price: refused before any request."""
    engine, provider, ledger = make_engine(Reply.text("x"), prices=le.PriceBook(fallback=False))
    with pytest.raises(le.ConfigError) as info:
        await engine.run(operation(credit_hold=10), "go")
    assert info.value.field == "prices"
    assert provider.requests == [] and ledger.invocations == {}


# -- R04 ---------------------------------------------------------------------------


async def test_r04_attempt_timeout_capped_and_no_request_once_time_is_gone(
    make_engine: EngineFactory,
) -> None:
    """Each attempt's timeout is min(attempt_timeout, remaining); at zero nothing is sent."""
    counter = Counter()
    engine, provider, _ = make_engine(
        Reply.tool_calls(lookup(), delay=5.0),
        Reply.tool_calls(lookup(), delay=5.0),
        Reply.text("never sent"),
    )
    result = await engine.run(operation(total_time=10.0, attempt_timeout=6.0), "go",
                              tools=[counter.tool])
    assert [r.timeout for r in provider.requests] == [6.0, 5.0]
    assert result.outcome is le.Outcome.TIME_LIMIT
    assert result.turns == 2
    assert [r.dispatch.timeout_ms for r in result.attempt_log] == [6000, 5000]


async def test_r04_attempt_cut_by_the_deadline_is_aborted(make_engine: EngineFactory) -> None:
    """An attempt still running when the deadline comes is aborted with reason deadline."""
    engine, provider, _ = make_engine(Reply.text("slow", delay=30.0))
    result = await engine.run(operation(total_time=10.0, attempt_timeout=60.0), "go")
    assert result.outcome is le.Outcome.TIME_LIMIT
    (attempt,) = result.attempt_log
    assert attempt.settle is not None
    assert (attempt.settle.outcome, attempt.settle.aborted_reason) == ("aborted", "deadline")


async def test_r04_retry_wait_beyond_the_deadline_is_not_slept(
    make_engine: EngineFactory, clock: Any
) -> None:
    """A retry-after longer than the remaining time ends the run instead of sleeping."""
    engine, provider, _ = make_engine(
        ProviderFault(FaultKind.RATE_LIMITED, "slow down", http_status=429, retry_after=30.0),
        Reply.text("never sent"),
    )
    result = await engine.run(operation(total_time=10.0), "go")
    assert result.outcome is le.Outcome.PROVIDER_ERROR
    assert clock.sleeps == []
    assert len(provider.requests) == 1
    assert "outlast" in result.detail


# -- R05 ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind",
    [FaultKind.TIMEOUT, FaultKind.RATE_LIMITED, FaultKind.OVERLOADED, FaultKind.SERVER_ERROR,
     FaultKind.CONNECTION, FaultKind.ABORTED],
)
async def test_r05_transient_faults_are_retried(
    make_engine: EngineFactory, kind: FaultKind
) -> None:
    """Timeouts, rate limits, overload, server faults, connections and aborts retry."""
    engine, provider, _ = make_engine(ProviderFault(kind, "transient"), Reply.text("ok"))
    result = await engine.run(operation(), "go")
    assert result.outcome is le.Outcome.COMPLETED
    assert len(provider.requests) == 2


async def test_r05_default_three_attempts_with_growing_waits(
    make_engine: EngineFactory, clock: Any
) -> None:
    """By default a turn makes three attempts, and the waits between them grow."""
    engine, provider, _ = make_engine(*[overloaded() for _ in range(5)])
    result = await engine.run(operation(), "go")
    assert result.outcome is le.Outcome.PROVIDER_ERROR
    assert len(provider.requests) == 3
    assert len(clock.sleeps) == 2 and clock.sleeps[0] < clock.sleeps[1]
    assert [r.dispatch.attempt for r in result.attempt_log] == [1, 2, 3]
    assert result.fault is not None and result.fault.kind is FaultKind.OVERLOADED


async def test_r05_waits_grow_until_the_cap(make_engine: EngineFactory, clock: Any) -> None:
    """Backoff doubles (with jitter in its upper half) and never exceeds max_wait."""
    policy = le.RetryPolicy(max_attempts=8, initial_wait=0.5, max_wait=4.0)
    engine, _, _ = make_engine(*[overloaded() for _ in range(8)])
    await engine.run(operation(retry=policy), "go")
    assert len(clock.sleeps) == 7
    assert all(a <= b for a, b in zip(clock.sleeps[:3], clock.sleeps[1:4], strict=True))
    assert all(w <= 4.0 for w in clock.sleeps)
    assert clock.sleeps[0] >= 0.25


@pytest.mark.parametrize("kind", [FaultKind.BAD_REQUEST, FaultKind.UNAUTHORIZED])
async def test_r05_malformed_or_unauthorized_requests_are_not_retried(
    make_engine: EngineFactory, kind: FaultKind, clock: Any
) -> None:
    """A bad or unauthorized request is sent once and ends provider_error."""
    engine, provider, _ = make_engine(ProviderFault(kind, "no"), Reply.text("never"))
    result = await engine.run(operation(), "go")
    assert result.outcome is le.Outcome.PROVIDER_ERROR
    assert len(provider.requests) == 1
    assert clock.sleeps == []


async def test_r05_should_retry_false_is_obeyed(make_engine: EngineFactory) -> None:
    """x-should-retry: false stops retries even of a transient kind."""
    engine, provider, _ = make_engine(overloaded(should_retry=False), Reply.text("never"))
    result = await engine.run(operation(), "go")
    assert result.outcome is le.Outcome.PROVIDER_ERROR
    assert len(provider.requests) == 1


async def test_r05_retry_after_is_honoured(make_engine: EngineFactory, clock: Any) -> None:
    """A rate limit's retry-after is the wait slept."""
    engine, _, _ = make_engine(
        ProviderFault(FaultKind.RATE_LIMITED, "slow down", retry_after=2.5), Reply.text("ok")
    )
    result = await engine.run(operation(), "go")
    assert result.outcome is le.Outcome.COMPLETED
    assert clock.sleeps == [2.5]
    assert result.attempt_log[1].dispatch.wait_ms == 2500


# -- R06 ---------------------------------------------------------------------------


async def test_r06_credit_exhaustion_is_not_retried(make_engine: EngineFactory, clock: Any) -> None:
    """A rate limit that names a depleted balance ends credit_exhausted, unretried."""
    engine, provider, _ = make_engine(
        ProviderFault(FaultKind.CREDIT_EXHAUSTED, "spend limit reached", http_status=429,
                      error_code="enforced_spend_limit_reached"),
        Reply.text("never"),
    )
    result = await engine.run(operation(), "go")
    assert result.outcome is le.Outcome.CREDIT_EXHAUSTED
    assert len(provider.requests) == 1
    assert clock.sleeps == []
    with pytest.raises(le.ProviderError) as info:
        result.raise_for_outcome()
    assert info.value.fault.kind is FaultKind.CREDIT_EXHAUSTED
    assert info.value.attempts == 1


# -- R08 ---------------------------------------------------------------------------


async def test_r08_one_combined_tool_results_message(make_engine: EngineFactory) -> None:
    """The model receives every result of a batch in one user message; each consumes budget."""
    counter = Counter()
    engine, provider, _ = make_engine(
        Reply.tool_calls(lookup("a"), lookup("b"), lookup("c")), Reply.text("done")
    )
    result = await engine.run(operation(), "go", tools=[counter.tool])
    assert result.outcome is le.Outcome.COMPLETED
    assert result.tool_calls == 3
    sent = provider.requests[1].messages
    assert len(sent) == 3 and sent[-1]["role"] == "user"
    results = sent[-1]["content"]
    asked = [b["id"] for b in sent[1]["content"] if b["type"] == "tool_use"]
    assert [r["tool_use_id"] for r in results] == asked
    assert [r["content"] for r in results] == ["value of a", "value of b", "value of c"]


async def test_r08_handlers_of_a_batch_run_concurrently(make_engine: EngineFactory) -> None:
    """The handlers of one batch overlap: each waits inside until both are inside
    (run one after the other, the first would wait for ever)."""
    import anyio

    inside: list[str] = []
    both = anyio.Event()

    @le.tool
    async def wait(key: str) -> str:
        """Wait for the other call of the batch."""
        inside.append(key)
        if len(inside) == 2:
            both.set()
        with anyio.fail_after(30):  # a bound for a broken engine, never reached
            await both.wait()
        return key

    engine, _, _ = make_engine(Reply.tool_calls(("wait", {"key": "a"}), ("wait", {"key": "b"})),
                               Reply.text("done"))
    result = await engine.run(operation(), "go", tools=[wait])
    assert result.outcome is le.Outcome.COMPLETED
    assert sorted(inside) == ["a", "b"]


# -- R09 ---------------------------------------------------------------------------


async def test_r09_handler_error_becomes_an_error_result(make_engine: EngineFactory) -> None:
    """A raising handler gives the model an is_error result with the message; the run goes on."""

    @le.tool
    def fetch(key: str) -> str:
        """Fetch a record."""
        raise RuntimeError("record store unavailable")

    engine, provider, _ = make_engine(Reply.tool_calls(("fetch", {"key": "1"})), Reply.text("ok"))
    result = await engine.run(operation(), "go", tools=[fetch])
    assert result.outcome is le.Outcome.COMPLETED
    (tool_result,) = provider.requests[1].messages[-1]["content"]
    assert tool_result["is_error"] is True
    assert tool_result["content"] == "record store unavailable"
    assert result.tool_calls == 1


async def test_r09_tool_error_text_hook_decides_what_the_model_sees(
    make_engine: EngineFactory,
) -> None:
    """The configurable hook rewrites handler errors before the model sees them."""

    @le.tool
    async def fetch(key: str) -> str:
        """Fetch a record."""
        raise RuntimeError("password=hunter2 at db-7")

    engine, provider, _ = make_engine(
        Reply.tool_calls(("fetch", {"key": "1"})), Reply.text("ok"),
        tool_error_text=lambda name, error: f"{name} failed ({type(error).__name__})",
    )
    await engine.run(operation(), "go", tools=[fetch])
    (tool_result,) = provider.requests[1].messages[-1]["content"]
    assert tool_result["content"] == "fetch failed (RuntimeError)"


# -- R10 ---------------------------------------------------------------------------


class Answer(pydantic.BaseModel):
    city: str
    population: int


async def test_r10_rejection_returns_feedback_as_tool_error_and_consumes_budget(
    make_engine: EngineFactory,
) -> None:
    """In structured mode the feedback is an error result for the answer call."""
    engine, provider, _ = make_engine(
        Reply.final({"city": "Paris", "population": 1}),
        Reply.final({"city": "Paris", "population": 2_100_000}),
    )
    result = await engine.run(
        operation(), "go", output=Answer,
        accept=lambda a: le.Accept() if a.population > 1000 else le.Reject("too small"),
    )
    assert result.outcome is le.Outcome.COMPLETED
    assert result.tool_calls == 1
    (feedback,) = provider.requests[1].messages[-1]["content"]
    assert feedback["type"] == "tool_result" and feedback["is_error"] is True
    assert feedback["content"] == "too small"
    assert [r.dispatch.phase for r in result.attempt_log] == ["turn", "repair"]


async def test_r10_text_mode_feedback_is_a_user_message(make_engine: EngineFactory) -> None:
    """In text mode the feedback goes back as a user text message."""
    engine, provider, _ = make_engine(Reply.text("maybe"), Reply.text("yes"))
    result = await engine.run(operation(), "go",
                              accept=lambda a: a == "yes" or le.Reject("be decisive"))
    assert result.outcome is le.Outcome.COMPLETED and result.answer == "yes"
    assert provider.requests[1].messages[-1] == {"role": "user", "content": "be decisive"}
    assert result.tool_calls == 1


async def test_r10_failing_judge_is_a_rejection(make_engine: EngineFactory) -> None:
    """A judge that raises rejects; the repair uses the existing budgets."""
    calls = 0

    async def judge(answer: str) -> le.Accept:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise LookupError("validator offline")
        return le.Accept()

    engine, provider, _ = make_engine(Reply.text("a"), Reply.text("b"))
    result = await engine.run(operation(), "go", accept=judge)
    assert result.outcome is le.Outcome.COMPLETED and result.answer == "b"
    assert "validator offline" in provider.requests[1].messages[-1]["content"]
    assert result.tool_calls == 1


async def test_r10_schema_violation_is_a_rejection(make_engine: EngineFactory) -> None:
    """An answer that fails the output schema is rejected with the validation error."""
    engine, provider, _ = make_engine(Reply.final({"city": "Paris"}),
                                      Reply.final({"city": "Paris", "population": 3}))
    result = await engine.run(operation(), "go", output=Answer)
    assert result.outcome is le.Outcome.COMPLETED
    assert result.answer == Answer(city="Paris", population=3)
    feedback = provider.requests[1].messages[-1]["content"][0]["content"]
    assert "population" in feedback and "Field required" in feedback


async def test_r10_rejection_needs_tool_budget(make_engine: EngineFactory) -> None:
    """Rejections consume the tool budget; with none left the run ends tool_limit."""
    engine, provider, _ = make_engine(Reply.text("a"), Reply.text("b"), Reply.text("c"))
    result = await engine.run(operation(max_tool_calls=1), "go", accept=lambda _: False)
    assert result.outcome is le.Outcome.TOOL_LIMIT
    assert len(provider.requests) == 2
    assert result.tool_calls == 1


# -- R11 ---------------------------------------------------------------------------


async def test_r11_refusal_ends_refused_without_retry(make_engine: EngineFactory) -> None:
    """A refusal is terminal: one request, outcome refused."""
    engine, provider, _ = make_engine(Reply.text("I can't", stop_reason="refusal"),
                                      Reply.text("never"))
    result = await engine.run(operation(), "go")
    assert result.outcome is le.Outcome.REFUSED
    assert len(provider.requests) == 1 and result.answer is None


async def test_r11_cut_off_answer_is_incomplete_never_accepted(
    make_engine: EngineFactory,
) -> None:
    """A max_tokens answer is incomplete even when the judge would accept it."""
    judged: list[str] = []
    engine, _, _ = make_engine(Reply.text("Paris is the cap", stop_reason="max_tokens"))
    result = await engine.run(operation(), "go", accept=lambda a: judged.append(a) or True)
    assert result.outcome is le.Outcome.INCOMPLETE
    assert result.answer is None and judged == []


async def test_r11_context_window_exceeded_is_incomplete(make_engine: EngineFactory) -> None:
    """model_context_window_exceeded ends incomplete."""
    engine, _, _ = make_engine(Reply.text("...", stop_reason="model_context_window_exceeded"))
    result = await engine.run(operation(), "go")
    assert result.outcome is le.Outcome.INCOMPLETE


# -- R12 ---------------------------------------------------------------------------


def test_r12_never_more_than_four_markers_whatever_is_asked() -> None:
    """Policy markers plus six caller system markers and three message markers: four kept."""
    marker = {"type": "ephemeral"}
    system = [{"type": "text", "text": f"s{i}", "cache_control": marker} for i in range(6)]
    messages = [
        {"role": "user", "content": [{"type": "text", "text": f"u{i}", "cache_control": marker}]}
        for i in range(3)
    ]
    tools = [{"name": "t", "description": "", "input_schema": {"type": "object"}}]
    policy = CachePolicy(system=True, tools=True, conversation=True)
    out_system, out_tools, out_messages = place_cache_markers(
        policy, system=system, tools=tools, messages=messages
    )
    assert len(cache_markers({"system": out_system, "tools": out_tools,
                              "messages": out_messages})) == 4
    # The documented priority: conversation, tools, system, then the caller's newest.
    assert "cache_control" in out_messages[-1]["content"][-1]
    assert "cache_control" in out_tools[-1]
    assert "cache_control" in out_system[-1]  # type: ignore[index]
    assert "cache_control" in out_messages[1]["content"][-1]
    # The caller's objects are untouched.
    assert all("cache_control" in b for b in system)



def test_r12_markers_inside_tool_results_count_toward_the_four() -> None:
    """Markers on the blocks inside a tool_result are the caller's too: counted,
    capped, the latest kept first, and the caller's message left as it was."""
    marker = {"type": "ephemeral"}
    inner = [{"type": "text", "text": f"part {k}", "cache_control": marker} for k in range(5)]
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "x",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": inner}]},
    ]
    policy = CachePolicy(conversation=True)
    _, _, out = place_cache_markers(policy, system=None, tools=[], messages=messages)
    assert len(cache_markers({"messages": out})) == 4
    result = out[-1]["content"][0]
    assert result["cache_control"] == policy.marker  # the conversation marker
    assert ["cache_control" in b for b in result["content"]] == [False, False, True, True, True]
    assert all("cache_control" in b for b in inner)
    assert "cache_control" not in messages[-1]["content"][0]


def test_r12_no_one_hour_marker_after_a_five_minute_one() -> None:
    """Anthropic refuses a 1h marker after a 5m one (tools, system, messages in
    that order): a kept 1h marker after a 5m one is sent as 5m; 1h markers
    before every 5m one stay 1h."""
    five, hour = {"type": "ephemeral"}, {"type": "ephemeral", "ttl": "1h"}
    system = [{"type": "text", "text": "rules", "cache_control": five}]
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "doc", "cache_control": hour}]},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "q"},
    ]
    tools = [{"name": "t", "description": "", "input_schema": {"type": "object"}}]
    policy = CachePolicy(tools=True, conversation=True, ttl="1h")
    out_system, out_tools, out_messages = place_cache_markers(
        policy, system=system, tools=tools, messages=messages)
    assert out_tools[-1]["cache_control"] == hour
    assert out_system is not None and out_system[0]["cache_control"] == five
    assert out_messages[0]["content"][0]["cache_control"] == five
    assert out_messages[-1]["content"][-1]["cache_control"] == five
    assert messages[0]["content"][0]["cache_control"] == hour  # the caller's, untouched


_ABSENT = "absent"
_NULL = "null"
# No marker, an explicit null (no marker either), or a marker of some lifetime.
_TTL = st.sampled_from([_ABSENT, _NULL, {"type": "ephemeral"}, {"type": "ephemeral", "ttl": "5m"},
                        {"type": "ephemeral", "ttl": "1h"}])


def _mark(block: dict[str, Any], marker: Any) -> dict[str, Any]:
    if marker == _NULL:
        block["cache_control"] = None
    elif marker != _ABSENT:
        block["cache_control"] = marker
    return block


def _text(text: str, marker: Any) -> dict[str, Any]:
    return _mark({"type": "text", "text": text}, marker)


def _asked(marker: Any) -> bool:
    return marker not in (_ABSENT, _NULL)


@settings(max_examples=300, deadline=None)
@given(system=st.lists(_TTL, max_size=6), tools=st.lists(_TTL, max_size=4),
       texts=st.lists(st.lists(_TTL, min_size=1, max_size=3), min_size=1, max_size=4),
       inner=st.lists(_TTL, max_size=4), deep=st.lists(_TTL, max_size=4),
       on_result=_TTL, on_search=_TTL,
       policy=st.builds(CachePolicy, system=st.booleans(), tools=st.booleans(),
                        conversation=st.booleans(), ttl=st.sampled_from(["5m", "1h"])))
def test_r12_any_request_leaves_with_markers_the_api_accepts(
    system: list[Any], tools: list[Any], texts: list[list[Any]], inner: list[Any],
    deep: list[Any], on_result: Any, on_search: Any, policy: CachePolicy,
) -> None:
    """Whatever the caller marked (any lifetimes, explicit nulls, blocks nested two
    levels down in a tool result) and whatever the policy asks: at most four
    markers reach the wire (counted in the JSON itself), as many as were asked
    for up to four, none 1h after a 5m one, and the caller's objects unchanged."""
    system_in = [_text(f"s{i}", m) for i, m in enumerate(system)]
    tools_in = [_mark({"name": f"t{i}", "description": "", "input_schema": {"type": "object"}},
                      m) for i, m in enumerate(tools)]
    messages_in: list[dict[str, Any]] = []
    for i, markers in enumerate(texts):
        role = "user" if i % 2 == 0 else "assistant"
        messages_in.append({"role": role, "content": [_text(f"m{i}.{j}", m)
                                                      for j, m in enumerate(markers)]})
    messages_in.append({"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "t0", "input": {}}]})
    search = _mark({"type": "search_result", "source": "s", "title": "t",
                    "content": [_text(f"d{k}", m) for k, m in enumerate(deep)]}, on_search)
    result = _mark({"type": "tool_result", "tool_use_id": "t",
                    "content": [*(_text(f"r{k}", m) for k, m in enumerate(inner)), search]},
                   on_result)
    messages_in.append({"role": "user", "content": [result]})
    before = copy.deepcopy((system_in, tools_in, messages_in))
    out_system, out_tools, out_messages = place_cache_markers(
        policy, system=system_in or None, tools=tools_in, messages=messages_in)
    body = {"system": out_system, "tools": out_tools, "messages": out_messages}
    assert cache_marker_problem(body) is None
    # Places asked for: the caller's, and the policy's where the caller had none
    # (the conversation marker goes on the tool_result block).
    places = sum(_asked(m) for m in [*system, *tools, *inner, *deep, on_search, on_result,
                                     *sum(texts, [])])
    places += int(policy.conversation and not _asked(on_result))
    places += int(policy.tools and bool(tools) and not _asked(tools[-1]))
    places += int(policy.system and bool(system) and not _asked(system[-1]))
    on_the_wire = json.dumps(body).count('"cache_control": {')
    assert on_the_wire == len(cache_markers(body)) == min(4, places)
    assert (system_in, tools_in, messages_in) == before


def test_r12_markers_two_levels_down_and_in_documents_are_capped() -> None:
    """A search result inside a tool result, and a document's own text blocks: their
    markers count toward the four like any other."""
    marker = {"type": "ephemeral"}
    search = {"type": "search_result", "source": "s", "title": "t",
              "content": [_text(f"d{k}", marker) for k in range(3)]}
    document = {"type": "document", "source": {"type": "content", "content": [
        _text(f"p{k}", marker) for k in range(3)]}}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [document, {"type": "text", "text": "q"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "x",
                                           "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                      "content": [search]}]},
    ]
    _, _, out = place_cache_markers(CachePolicy(conversation=True), system=None, tools=[],
                                    messages=messages)
    assert json.dumps(out).count('"cache_control": {') == 4
    result = out[-1]["content"][0]
    assert result["cache_control"] == marker  # the conversation marker
    # Then the latest of the caller's: the search result's three blocks.
    assert all("cache_control" in b for b in result["content"][0]["content"])
    assert not any("cache_control" in b for b in out[0]["content"][0]["source"]["content"])
    assert all("cache_control" in b for b in search["content"])  # the caller's, untouched


def test_r12_a_null_marker_is_no_marker() -> None:
    """``cache_control: None`` asks for nothing: it takes no place among the four and
    does not count as a five-minute marker before a one-hour one."""
    tools = [{"name": f"t{i}", "description": "", "input_schema": {"type": "object"},
              "cache_control": None} for i in range(4)]
    system = [{"type": "text", "text": "rules"}]
    policy = CachePolicy(system=True, conversation=True, ttl="1h")
    out_system, out_tools, out_messages = place_cache_markers(
        policy, system=system, tools=tools, messages=[{"role": "user", "content": "q"}])
    assert not any("cache_control" in t for t in out_tools)
    assert out_system is not None and out_system[0]["cache_control"] == policy.marker
    assert out_messages[0]["content"][0]["cache_control"] == policy.marker
    assert cache_marker_problem({"tools": tools, "system": out_system,
                                 "messages": out_messages}) is None


# -- R13 ---------------------------------------------------------------------------


async def test_r13_an_unserved_route_is_refused_not_substituted(
    make_engine: EngineFactory,
) -> None:
    """An operation published on another route never runs on this engine's provider."""
    engine, provider, _ = make_engine(Reply.text("x"))
    other = le.Operation(name="x", provider="openai", model="gpt-x")
    with pytest.raises(le.ConfigError) as info:
        await engine.run(other, "go")
    assert info.value.field == "provider"
    assert provider.requests == []


async def test_r13_failures_never_switch_model(make_engine: EngineFactory) -> None:
    """Every retry goes to the same published model."""
    engine, provider, _ = make_engine(overloaded(), overloaded(), overloaded())
    result = await engine.run(operation(), "go")
    assert result.outcome is le.Outcome.PROVIDER_ERROR
    assert {r.model for r in provider.requests} == {"claude-sonnet-4-5"}
    assert {r.dispatch.served_by for r in result.attempt_log} == {"anthropic:claude-sonnet-4-5"}


async def test_r13_callers_cannot_widen_published_limits(make_engine: EngineFactory) -> None:
    """A limits override above the published value is clamped to it."""
    counter = Counter()
    engine, provider, _ = make_engine(*[Reply.tool_calls(lookup()) for _ in range(10)])
    result = await engine.run(operation(max_turns=2), "go", tools=[counter.tool],
                              limits={"max_turns": 50}, retry={"max_attempts": 16})
    assert result.outcome is le.Outcome.TURN_LIMIT
    assert len(provider.requests) == 2


async def test_r13_callers_can_narrow_published_limits(make_engine: EngineFactory) -> None:
    """A narrower override applies."""
    counter = Counter()
    engine, provider, _ = make_engine(*[Reply.tool_calls(lookup()) for _ in range(10)])
    result = await engine.run(operation(max_turns=5), "go", tools=[counter.tool],
                              limits=le.Limits(max_turns=2))
    assert result.turns == 2


# -- R14 ---------------------------------------------------------------------------


async def test_r14_accepted_answer_wins_over_later_tool_and_credit_checks(
    make_engine: EngineFactory,
) -> None:
    """An accepted answer completes before the batch and credit checks; no tool runs."""
    counter = Counter()
    engine, _, _ = make_engine(
        Reply.tool_calls(("final_answer", {"city": "Oslo", "population": 700_000}),
                         lookup("a"), lookup("b"), lookup("c")),
        prices=quantum_prices(50),
    )
    result = await engine.run(
        operation(credit_hold=10, max_tool_batch=1, max_tool_calls=0), "go",
        tools=[counter.tool], output=Answer,
    )
    assert result.outcome is le.Outcome.COMPLETED
    assert result.answer == Answer(city="Oslo", population=700_000)
    assert result.tool_calls == 0 and counter.calls == []
    assert result.credits == 150  # billed all the same


# -- R15 ---------------------------------------------------------------------------


async def test_r15_missing_handler_is_a_recoverable_error(make_engine: EngineFactory) -> None:
    """A call to an unknown tool gets an error result; later turns carry on."""
    counter = Counter()
    engine, provider, _ = make_engine(
        Reply.tool_calls(("translate", {"text": "hi"})),
        Reply.tool_calls(lookup("x")),
        Reply.text("done"),
    )
    result = await engine.run(operation(), "go", tools=[counter.tool])
    assert result.outcome is le.Outcome.COMPLETED
    (error,) = provider.requests[1].messages[-1]["content"]
    assert error["is_error"] is True and "translate" in error["content"]
    assert "lookup" in error["content"]
    assert result.tool_calls == 2 and len(counter.calls) == 1


async def test_r15_invalid_input_never_reaches_the_handler(make_engine: EngineFactory) -> None:
    """Input failing the tool's schema gets an error result; the handler does not run."""
    counter = Counter()
    engine, provider, _ = make_engine(
        Reply.tool_calls(("lookup", {"key": 42})), Reply.text("done")
    )
    result = await engine.run(operation(), "go", tools=[counter.tool])
    assert result.outcome is le.Outcome.COMPLETED
    (error,) = provider.requests[1].messages[-1]["content"]
    assert error["is_error"] is True and "key" in error["content"]
    assert counter.calls == []


async def test_r15_a_boolean_is_not_an_enum_or_const_number(make_engine: EngineFactory) -> None:
    """A raw schema's ``enum`` and ``const`` compare as JSON does: ``true`` is not
    the number 1, nor ``0`` the boolean false (Python's ``True == 1`` let them
    through to the handler); ``1.0`` is the number 1."""
    seen: list[dict[str, Any]] = []
    tool = le.Tool("level", "Set a level.", {
        "type": "object", "properties": {"level": {"enum": [0, 1, 2]},
                                         "dry": {"const": False},
                                         "tags": {"const": [1, {"a": 0}]}}},
        handler=lambda args: seen.append(args) or "set")
    engine, provider, _ = make_engine(
        Reply.tool_calls(("level", {"level": True}), ("level", {"dry": 0}),
                         ("level", {"tags": [True, {"a": False}]}),
                         ("level", {"level": 1.0, "dry": False, "tags": [1, {"a": 0}]})),
        Reply.text("done"))
    result = await engine.run(operation(), "go", tools=[tool])
    assert result.outcome is le.Outcome.COMPLETED
    *refused, ran = provider.requests[1].messages[-1]["content"]
    assert [r.get("is_error") for r in refused] == [True, True, True]
    assert "level" in refused[0]["content"] and "dry" in refused[1]["content"]
    assert ran["content"] == "set"
    assert seen == [{"level": 1.0, "dry": False, "tags": [1, {"a": 0}]}]


async def test_r15_a_property_a_pattern_names_is_not_an_additional_one(
        make_engine: EngineFactory) -> None:
    """``patternProperties`` with ``additionalProperties: false``: a property
    whose name a pattern matches is allowed and checked against that pattern's
    schema (it was refused as an additional property, so the tool could not
    be called with its own schema's input); any other name is refused."""
    seen: list[dict[str, Any]] = []
    tool = le.Tool("tag", "Tag a record.", {
        "type": "object", "properties": {"id": {"type": "string"}},
        "patternProperties": {"^x-": {"type": "string"}}, "additionalProperties": False},
        handler=lambda args: seen.append(args) or "tagged")
    engine, provider, _ = make_engine(
        Reply.tool_calls(("tag", {"id": "r1", "x-team": "ops"}), ("tag", {"x-team": 7}),
                         ("tag", {"team": "ops"})),
        Reply.text("done"))
    result = await engine.run(operation(), "go", tools=[tool])
    assert result.outcome is le.Outcome.COMPLETED
    ran, wrong_type, unnamed = provider.requests[1].messages[-1]["content"]
    assert ran["content"] == "tagged" and seen == [{"id": "r1", "x-team": "ops"}]
    assert wrong_type["is_error"] and "x-team: expected string" in wrong_type["content"]
    assert unnamed["is_error"] and "team: is not an allowed property" in unnamed["content"]


# -- S01 / S02 -----------------------------------------------------------------------


async def test_s01_overload_then_success_both_visible_success_charged(
    make_engine: EngineFactory,
) -> None:
    """Both attempts are recorded; only the successful one's usage is charged."""
    from loopengine import Usage

    engine, _, ledger = make_engine(
        overloaded(usage=le.Usage(input_tokens=50, output_tokens=0)),
        Reply.text("hello", usage=Usage(input_tokens=100, output_tokens=20)),
    )
    result = await engine.run(operation(), "go")
    assert result.outcome is le.Outcome.COMPLETED
    first, second = result.attempt_log
    assert first.settle is not None and second.settle is not None
    assert (first.settle.outcome, first.settle.charged) == ("error", False)
    assert (second.settle.outcome, second.settle.charged) == ("ok", True)
    assert result.cost_usd == Decimal("0.00012")
    assert result.provider_cost_usd == Decimal("0.00017")
    assert result.credits == 120
    (row,) = ledger.invocations.values()
    assert (row["attempt_count"], row["cost_nanousd"], row["provider_cost_nanousd"]) == (
        2, 120_000, 170_000)


async def test_s02_repaired_answer_completes_within_remaining_controls(
    make_engine: EngineFactory,
) -> None:
    """The first answer is rejected, the repaired one accepted: the run ends on it."""
    engine, provider, _ = make_engine(Reply.text("42"), Reply.text("forty-two"),
                                      Reply.text("never"))
    result = await engine.run(
        operation(max_turns=2, max_tool_calls=1), "go",
        accept=lambda a: le.Accept() if a.isalpha() or "-" in a else le.Reject("in words"),
    )
    assert result.outcome is le.Outcome.COMPLETED
    assert result.answer == "forty-two"
    assert result.turns == 2 and result.tool_calls == 1
    assert len(provider.requests) == 2
    assert [m["role"] for m in result.messages] == ["user", "assistant", "user", "assistant"]
