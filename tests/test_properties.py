"""Properties over random scripts of replies and faults (hypothesis).

Whatever the provider does, within the engine's own bounds: the outcome is an
`Outcome`, turns never exceed ``max_turns``, answered calls never exceed
``max_tool_calls``, a turn's tries never exceed ``max_attempts``, no handler of
a refused batch runs, the ledger reconciles with the result, and the run
raises nothing.
"""

from __future__ import annotations

import random
from typing import Any

import anyio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import loopengine as le
from loopengine.persistence import MemoryLedger
from loopengine.providers import FaultKind, ProviderFault, Reply, ScriptedProvider
from loopengine.testing import FakeClock

from .conftest import PRICES, operation

TOOL_NAMES = ["lookup", "lookup", "lookup", "missing"]


@st.composite
def script_item(draw: st.DrawFn) -> Any:
    kind = draw(st.sampled_from(["text", "tools", "fault", "stop", "pause"]))
    usage = draw(st.one_of(st.none(), st.builds(
        le.Usage, input_tokens=st.integers(0, 5000), output_tokens=st.integers(0, 2000))))
    delay = draw(st.sampled_from([0.0, 0.0, 0.0, 5.0, 40.0]))
    if kind == "text":
        return Reply.text(draw(st.sampled_from(["yes", "no", ""])), usage=usage, delay=delay)
    if kind == "tools":
        n = draw(st.integers(1, 5))
        calls = [(draw(st.sampled_from(TOOL_NAMES)),
                  {"key": draw(st.sampled_from(["a", "b", "boom"]))} if draw(st.booleans())
                  else {"nokey": 1}) for _ in range(n)]
        return Reply.tool_calls(*calls, usage=usage, delay=delay)
    if kind == "fault":
        fault_kind = draw(st.sampled_from(list(FaultKind)))
        return ProviderFault(
            fault_kind, "scripted fault",
            retry_after=draw(st.one_of(st.none(), st.floats(0, 30))),
            should_retry=draw(st.sampled_from([None, None, False])),
            usage=usage if fault_kind is FaultKind.ABORTED else None,
        )
    if kind == "pause":
        return Reply(content=[{"type": "text", "text": "thinking"}], stop_reason="pause_turn",
                     usage=usage)
    reason = draw(st.sampled_from(["refusal", "max_tokens", "model_context_window_exceeded"]))
    return Reply.text("stop", stop_reason=reason, usage=usage)


limits_strategy = st.fixed_dictionaries({
    "max_turns": st.integers(1, 6),
    "max_tool_batch": st.one_of(st.none(), st.integers(1, 4)),
    "max_tool_calls": st.one_of(st.none(), st.integers(0, 8)),
    "total_time": st.one_of(st.none(), st.floats(1, 100)),
    "attempt_timeout": st.floats(0.5, 30),
    "credit_hold": st.one_of(st.none(), st.integers(0, 20_000)),
})


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    script=st.lists(script_item(), min_size=0, max_size=25),
    limits=limits_strategy,
    max_attempts=st.integers(1, 4),
    verdicts=st.lists(st.booleans(), max_size=10),
    structured=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_invariants_hold_for_any_script(
    script: list[Any], limits: dict[str, Any], max_attempts: int, verdicts: list[bool],
    structured: bool, seed: int,
) -> None:
    """The engine's bounds hold whatever the provider replies."""
    handled: list[str] = []

    @le.tool
    async def lookup(key: str) -> str:
        """Look up."""
        handled.append(key)
        if key == "boom":
            raise RuntimeError("boom")
        return key

    verdict_iter = iter(verdicts)

    def judge(_: Any) -> bool:
        return next(verdict_iter, True)

    clock = FakeClock()
    if structured:
        # Structured mode: the text replies are not answers; add final answers.
        script = [Reply.final({"value": "x"}) if isinstance(i, Reply) and
                  i.stop_reason == "end_turn" and i.content and i.content[0].get("text") == "yes"
                  else i for i in script]
    provider = ScriptedProvider(script, clock=clock)
    ledger = MemoryLedger()
    engine = le.Engine(provider, ledger=ledger, prices=PRICES, clock=clock,
                       rng=random.Random(seed))
    op = operation(retry=le.RetryPolicy(max_attempts=max_attempts), **limits)

    from pydantic import BaseModel

    class Out(BaseModel):
        value: str

    async def main() -> le.RunResult:
        return await engine.run(op, "go", tools=[lookup], accept=judge,
                                output=Out if structured else None)

    result = anyio.run(main)

    assert isinstance(result.outcome, le.Outcome)
    assert result.outcome not in (le.Outcome.RUNNING, le.Outcome.CANCELLED)
    assert result.turns <= limits["max_turns"]
    if limits["max_tool_calls"] is not None:
        assert result.tool_calls <= limits["max_tool_calls"]
        assert len(handled) <= limits["max_tool_calls"]

    # Attempts: one per wire request; within a turn, each retry segment is capped.
    assert result.attempts.count == len(provider.requests) == len(result.attempt_log)
    segments: dict[tuple[int, int], int] = {}
    segment = 0
    last_turn = 0
    for record in result.attempt_log:
        if record.dispatch.turn != last_turn:
            last_turn, segment = record.dispatch.turn, 0
        segments[(last_turn, segment)] = segments.get((last_turn, segment), 0) + 1
        if record.settle is not None and record.settle.outcome == "ok":
            segment += 1
    assert all(n <= max_attempts for n in segments.values())
    assert {r.dispatch.turn for r in result.attempt_log} <= set(range(1, result.turns + 1))

    # Handlers ran for exactly the calls that were answered: none of a refused batch,
    # whose calls are closed as not run.
    answered_lookups = 0
    for asked, answered in zip(result.messages, result.messages[1:], strict=False):
        if asked["role"] == "assistant" and answered["role"] == "user" and isinstance(
            answered["content"], list
        ):
            results = {b["tool_use_id"]: b for b in answered["content"]
                       if b.get("type") == "tool_result"}
            answered_lookups += sum(
                1 for b in asked["content"]
                if b.get("type") == "tool_use" and b["name"] == "lookup"
                and isinstance(b["input"].get("key"), str)
                and not str(results[b["id"]]["content"]).startswith("Not run:")
            )
    assert len(handled) == answered_lookups

    # The transcript can be continued: every tool_use has its tool_result next.
    for asked, answered in zip(result.messages, result.messages[1:], strict=False):
        if asked["role"] == "assistant":
            uses = [b["id"] for b in asked["content"] if b.get("type") == "tool_use"]
            given = [b["tool_use_id"] for b in answered["content"]
                     if isinstance(b, dict) and b.get("type") == "tool_result"] \
                if isinstance(answered["content"], list) else []
            assert sorted(given) == sorted(uses)
    if result.messages[-1]["role"] == "assistant":
        assert not [b for b in result.messages[-1]["content"] if b.get("type") == "tool_use"]

    # The ledger reconciles with the result.
    (row,) = ledger.invocations.values()
    assert row["outcome"] == result.outcome.value
    assert row["attempt_count"] == result.attempts.count
    assert (row["turns"], row["tool_calls"], row["credits"]) == (
        result.turns, result.tool_calls, result.credits)
    assert row["output_tokens"] == result.attempts.output_tokens == result.usage.output_tokens
    assert row["cost_nanousd"] == sum(a["cost_nanousd"] or 0 for a in ledger.attempts.values()
                                      if a["charged"])
    assert all(a["outcome"] in ("ok", "error", "aborted") for a in ledger.attempts.values())
