"""`Engine.call`: the attempts record and the per-call retry policy
(docs/structured-calls.md).

The conformance legs, one for each promise of those two sections, run through the
real `anthropic` SDK against FakeAnthropicServer, which acts as the witness: it
clamps each reply's output tokens to the request's ``max_tokens`` (so growth is
visible) and records ``max_tokens`` and ``tool_choice`` as it received them.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import pydantic
import pytest

import loopengine as le
from loopengine.persistence import MemoryLedger
from loopengine.providers import (
    AnthropicProvider,
    FaultKind,
    ProviderFault,
    RecordingProvider,
    ReplayProvider,
    Reply,
    ScriptedProvider,
)
from loopengine.testing import ErrorReply, FakeAnthropicServer, FakeClock, RecordedRequest

from .conftest import MODEL, PRICES


class Scene(pydantic.BaseModel):
    scene: str


FORCED = {"type": "tool", "name": "final_answer"}


def op(max_output_tokens: int = 8000, **retry: Any) -> le.Operation:
    return le.Operation(name="book.scene", provider="anthropic", model=MODEL,
                        max_output_tokens=max_output_tokens,
                        retry=le.RetryPolicy(initial_wait=0.01, max_wait=0.02, **retry))


def witness(wanted: int, data: dict[str, Any] | None = None) -> Callable[[RecordedRequest], Reply]:
    """A reply wanting ``wanted`` output tokens, clamped to the request's max_tokens;
    a clamped reply is truncated (stop_reason max_tokens)."""

    def reply(request: RecordedRequest) -> Reply:
        cap = int(request.body["max_tokens"])
        usage = le.Usage(input_tokens=50, output_tokens=min(wanted, cap))
        if wanted > cap:
            return Reply(content=[{"type": "tool_use", "id": "toolu_cut", "name": "final_answer",
                                   "input": {}}], stop_reason="max_tokens", usage=usage)
        return Reply.final(data or {"scene": "done"}, usage=usage)

    return reply


@pytest.fixture
async def server() -> AsyncIterator[FakeAnthropicServer]:
    with FakeAnthropicServer() as running:
        yield running
        for provider in _open:
            await provider.aclose()
        _open.clear()


_open: list[AnthropicProvider] = []


def anthropic(server: FakeAnthropicServer, **kwargs: Any) -> AnthropicProvider:
    """A provider on the server, closed when the test ends."""
    provider = AnthropicProvider(api_key=kwargs.pop("api_key", "sk-test"), base_url=server.url)
    _open.append(provider)
    return provider


def engine_on(server: FakeAnthropicServer, **kwargs: Any) -> le.Engine:
    return le.Engine(anthropic(server), prices=PRICES, **kwargs)


def sent(server: FakeAnthropicServer, key: str) -> list[Any]:
    return [r.body.get(key) for r in server.requests]


# -- The eight conformance legs ------------------------------------------------------


async def test_leg_count_includes_the_truncation_retry(server: FakeAnthropicServer) -> None:
    """A truncated first reply and a complete second: count 2, max_tokens doubled."""
    server.add(witness(1800), witness(1800))
    result = await engine_on(server).call(op(), "Write the scene.", output=Scene, max_tokens=1000)
    assert result.attempts.count == 2 == len(server.requests)
    assert sent(server, "max_tokens") == [1000, 2000]
    assert sent(server, "tool_choice") == [FORCED, FORCED]
    assert result.data == Scene(scene="done")


async def test_leg_output_tokens_summed_over_attempts(server: FakeAnthropicServer) -> None:
    """outputTokens sums every attempt; usage is the attempt the data came from."""
    server.add(witness(2000), witness(2000))
    result = await engine_on(server).call(op(), "Write.", output=Scene, max_tokens=1800)
    assert sent(server, "max_tokens") == [1800, 3600]
    assert result.attempts.output_tokens == 1800 + 2000
    assert result.attempts.usage_complete is True
    assert result.usage.output_tokens == 2000
    assert result.attempts.output_tokens == server.usage_served.output_tokens


async def test_leg_usage_incomplete_when_an_attempt_reported_none(
    server: FakeAnthropicServer,
) -> None:
    """An overloaded attempt reports no usage: usageComplete is false, outputTokens a floor."""
    server.add(ErrorReply.overloaded(), witness(300))
    result = await engine_on(server).call(op(), "Write.", output=Scene)
    assert result.attempts.count == 2
    assert result.attempts.usage_complete is False
    assert result.attempts.output_tokens == 300


async def test_leg_native_versus_prompt(server: FakeAnthropicServer) -> None:
    """Native is a forced tool call; after native failures the fallback embeds the schema."""
    server.add(Reply.final({"wrong": 1}), Reply.final({"wrong": 2}),
               Reply.text('Here it is: ```json\n{"scene": "from the prompt"}\n```'))
    ledger = MemoryLedger()
    result = await engine_on(server, ledger=ledger).call(op(), "Write.", output=Scene,
                                                         prompt_fallback=True)
    assert result.attempts.structured_output == "prompt"
    assert [row["phase"] for row in ledger.attempts.values()] == ["turn", "repair", "fallback"]
    assert result.data == Scene(scene="from the prompt")
    assert sent(server, "tool_choice") == [FORCED, FORCED, {"type": "none"}]
    last = server.requests[-1].body
    # The answer tool stays defined, not to be called: the native attempts' calls
    # are in the messages, and the Messages API refuses tool blocks without tools.
    assert [t["name"] for t in last["tools"]] == ["final_answer"]
    assert "JSON Schema" in last["system"][-1]["text"]

    server.add(witness(10))
    native = await engine_on(server).call(op(), "Write.", output=Scene, prompt_fallback=True)
    assert native.attempts.structured_output == "native" and native.attempts.count == 1


async def test_leg_grow_max_tokens_false_keeps_the_budget(server: FakeAnthropicServer) -> None:
    """With grow_max_tokens false, no attempt asks for more than the request's max_tokens."""
    server.add(witness(1800), witness(900))
    result = await engine_on(server).call(op(), "Write.", output=Scene, max_tokens=1000,
                                          retry={"grow_max_tokens": False})
    assert sent(server, "max_tokens") == [1000, 1000]
    assert result.attempts.count == 2


async def test_leg_growth_never_exceeds_the_growth_ceiling(
    server: FakeAnthropicServer,
) -> None:
    """Without a published model limit, doubling stops at four times the first max_tokens."""
    server.add(witness(5000), witness(5000), witness(5000), witness(5000))
    with pytest.raises(le.StructuredOutputError) as info:
        await engine_on(server).call(op(max_output_tokens=3000, max_attempts=4), "Write.",
                                     output=Scene, max_tokens=1000)
    assert sent(server, "max_tokens") == [1000, 2000, 4000, 4000]
    assert info.value.attempts == 4 and info.value.reason == "truncated"


async def test_leg_max_attempts_one_makes_one_request(server: FakeAnthropicServer) -> None:
    """maxAttempts 1: one request; a truncation then throws carrying attempts 1."""
    server.add(witness(1800), witness(10))
    with pytest.raises(le.OutcomeError) as info:
        await engine_on(server).call(op(), "Write.", output=Scene, max_tokens=1000,
                                     retry={"max_attempts": 1})
    assert info.value.attempts == 1
    assert len(server.requests) == 1


@pytest.mark.parametrize("value", [0, 17, 2.5, "3", -1])
async def test_leg_malformed_max_attempts_refused_naming_the_field(
    server: FakeAnthropicServer, value: Any
) -> None:
    """A malformed retry is refused with field retry.max_attempts, never ignored."""
    with pytest.raises(le.ConfigError) as info:
        await engine_on(server).call(op(), "Write.", output=Scene, retry={"max_attempts": value})
    assert info.value.field == "retry.max_attempts"
    with pytest.raises(le.ConfigError) as direct:
        le.RetryPolicy(max_attempts=value)
    assert direct.value.field == "max_attempts"
    assert server.requests == []


async def test_leg_replay_equals_the_recording(server: FakeAnthropicServer,
                                               tmp_path: Path) -> None:
    """A replayed call reports the recorded attempts and data, with no network."""
    server.add(ErrorReply.overloaded(), witness(1800), witness(1800))
    path = tmp_path / "call.jsonl"
    recorder = RecordingProvider(anthropic(server, api_key="sk-canary-123"), path)
    recorded = await le.Engine(recorder, prices=PRICES).call(op(), "Write.", output=Scene,
                                                             max_tokens=1000)
    assert "sk-canary-123" not in path.read_text()

    clock = FakeClock()
    replayed = await le.Engine(ReplayProvider(path), prices=PRICES, clock=clock).call(
        op(), "Write.", output=Scene, max_tokens=1000)
    assert replayed.attempts == recorded.attempts
    assert replayed.data == recorded.data
    assert recorded.attempts.count == 3 and len(server.requests) == 3


# -- Beyond the legs -----------------------------------------------------------------


async def test_replay_fails_loudly_when_the_request_diverges(tmp_path: Path) -> None:
    """A different request than the recorded one raises ReplayMismatchError."""
    path = tmp_path / "call.jsonl"
    recorder = RecordingProvider(ScriptedProvider([Reply.final({"scene": "a"})]), path)
    await le.Engine(recorder, prices=PRICES).call(op(), "Write.", output=Scene)
    with pytest.raises(le.ReplayMismatchError, match="messages"):
        await le.Engine(ReplayProvider(path), prices=PRICES).call(op(), "Write something else.",
                                                                  output=Scene)


async def test_replayed_run_has_the_recorded_outcome(tmp_path: Path) -> None:
    """Record and replay work for runs too: same outcome, same attempts."""
    path = tmp_path / "run.jsonl"
    script = [ProviderFault(FaultKind.OVERLOADED, "busy"), Reply.text("first"), Reply.text("ok")]
    recorder = RecordingProvider(ScriptedProvider(script), path)
    clock = FakeClock()

    def judge(answer: str) -> bool:
        return answer == "ok"

    recorded = await le.Engine(recorder, prices=PRICES, clock=clock).run(op(), "Hi", accept=judge)
    replayed = await le.Engine(ReplayProvider(path), prices=PRICES, clock=FakeClock()).run(
        op(), "Hi", accept=judge)
    assert (replayed.outcome, replayed.answer, replayed.attempts) == (
        recorded.outcome, recorded.answer, recorded.attempts)
    assert replayed.attempts.count == 3


async def test_a_replay_is_priced_where_the_recorded_provider_served(tmp_path: Path) -> None:
    """A provider that declares an inference geo (a Vertex regional endpoint)
    records its replies' usage with it, so the replay is priced as the recorded
    run was: at the price entry's multiplier for that geo."""
    path = tmp_path / "run.jsonl"
    inner = ScriptedProvider([Reply.text("ok", usage=le.Usage(input_tokens=1000,
                                                             output_tokens=100))],
                             inference_geo="us-east5")
    book = le.PriceBook([le.ModelPrice(
        provider="anthropic", model=MODEL, input_per_mtok=Decimal(3),
        output_per_mtok=Decimal(15), inference_geo_multipliers={"us-east5": Decimal("1.1")})])
    recorded = await le.Engine(RecordingProvider(inner, path), prices=book).run(op(), "Hi")
    replayed = await le.Engine(ReplayProvider(path), prices=book).run(op(), "Hi")
    assert recorded.usage.inference_geo == replayed.usage.inference_geo == "us-east5"
    assert recorded.cost_usd == replayed.cost_usd == Decimal("0.00495")


async def test_schema_violation_is_fed_back() -> None:
    """An invalid reply is retried with the validation error as an error tool result."""
    provider = ScriptedProvider([Reply.final({"scene": 3}), Reply.final({"scene": "ok"})])
    ledger = MemoryLedger()
    engine = le.Engine(provider, ledger=ledger, prices=PRICES)
    result = await engine.call(op(), "Write.", output=Scene)
    assert result.attempts.count == 2
    feedback = provider.requests[1].messages[-1]["content"][0]
    assert feedback["is_error"] is True and "scene" in feedback["content"]
    assert [row["phase"] for row in ledger.attempts.values()] == ["turn", "repair"]
    (invocation,) = ledger.invocations.values()
    assert invocation["outcome"] == "completed" and invocation["attempt_count"] == 2


async def test_transport_retries_count_against_max_attempts() -> None:
    """max_attempts caps every request of the call, transport retries included."""
    provider = ScriptedProvider([ProviderFault("overloaded", "busy"), Reply.final({"x": 1}),
                                 Reply.final({"scene": "late"})])
    engine = le.Engine(provider, prices=PRICES, clock=FakeClock(), rng=random.Random(1))
    with pytest.raises(le.StructuredOutputError) as info:
        await engine.call(op(), "Write.", output=Scene, retry={"max_attempts": 2})
    assert info.value.attempts == 2 and len(provider.requests) == 2


async def test_max_attempts_above_the_operation_is_clamped() -> None:
    """A per-call cap above the operation's ceiling is clamped, not widened."""
    provider = ScriptedProvider([Reply.final({"x": i}) for i in range(10)])
    engine = le.Engine(provider, prices=PRICES)
    with pytest.raises(le.StructuredOutputError) as info:
        await engine.call(op(max_attempts=3), "Write.", output=Scene, retry={"max_attempts": 16})
    assert info.value.attempts == 3


async def test_provider_failure_carries_the_attempts() -> None:
    """A call ended by faults raises ProviderError with the number of requests made."""
    provider = ScriptedProvider([ProviderFault("server_error", "boom") for _ in range(3)])
    engine = le.Engine(provider, prices=PRICES, clock=FakeClock())
    with pytest.raises(le.ProviderError) as info:
        await engine.call(op(), "Write.", output=Scene)
    assert info.value.attempts == 3 and info.value.fault.kind is FaultKind.SERVER_ERROR


async def test_refusal_is_not_retried() -> None:
    """A refused call raises at once with outcome refused."""
    provider = ScriptedProvider([Reply.text("no", stop_reason="refusal"), Reply.final({})])
    with pytest.raises(le.OutcomeError) as info:
        await le.Engine(provider, prices=PRICES).call(op(), "Write.", output=Scene)
    assert (info.value.outcome, info.value.attempts) == ("refused", 1)


async def test_call_needs_an_output_model() -> None:
    """output must be a pydantic model class."""
    engine = le.Engine(ScriptedProvider([]), prices=PRICES)
    with pytest.raises(le.ConfigError) as info:
        await engine.call(op(), "Write.", output=dict)  # type: ignore[type-var]
    assert info.value.field == "output"


@pytest.mark.parametrize(("limits", "field"), [
    ({"max_turns": 1}, "max_turns"), (le.Limits(max_tool_calls=0), "max_tool_calls"),
    ({"wrap_up": False}, "wrap_up"), ({"pause_timeout": 5.0}, "pause_timeout")])
async def test_a_call_refuses_a_limit_it_does_not_apply(limits: Any, field: str) -> None:
    """A call applies its time and credit limits; a run's limit named for it would
    be ignored (``max_turns=1`` would not stop a second request), so it is refused
    before anything is sent, pointing at ``retry.max_attempts``."""
    provider = ScriptedProvider([Reply.text("no answer"), Reply.final({"scene": "done"})])
    with pytest.raises(le.ConfigError, match="retry=") as refused:
        await le.Engine(provider).call(op(), "Write it.", output=Scene, limits=limits)
    assert refused.value.field == f"limits.{field}"
    assert provider.requests == []

    # The limits it applies narrow it; a run's limit given as None narrows nothing.
    called = await le.Engine(provider).call(
        op(), "Write it.", output=Scene,
        limits={"total_time": 30.0, "attempt_timeout": 10.0, "max_turns": None})
    assert called.data == Scene(scene="done") and called.attempts.count == 2
