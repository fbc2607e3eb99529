"""A structured call's truncation retries grow ``max_tokens`` by default
(docs/structured-calls.md), through AnthropicProvider -> the real ``anthropic`` SDK
-> FakeAnthropicServer.

``max_output_tokens`` is the first request's ``max_tokens``; each truncation retry
doubles it up to the growth ceiling: ``model_max_output_tokens`` when the
operation publishes one, else four times the first request's ``max_tokens``.
"""

from __future__ import annotations

from typing import Any

import pydantic
import pytest

import loopengine as le
from loopengine.testing import Reply

from ..conftest import MODEL
from .conftest import STREAMING, Harness


class Scene(pydantic.BaseModel):
    scene: str


def scene_op(max_output_tokens: int = 64, *, model_max_output_tokens: int | None = None,
             max_attempts: int = 5) -> le.Operation:
    return le.Operation(name="book.scene", provider="anthropic", model=MODEL,
                        max_output_tokens=max_output_tokens,
                        model_max_output_tokens=model_max_output_tokens,
                        retry=le.RetryPolicy(max_attempts=max_attempts))


def truncated() -> Reply:
    """A reply cut at max_tokens in the middle of the answer tool's input."""
    return Reply(content=[{"type": "tool_use", "id": "toolu_cut", "name": "final_answer",
                           "input": {}}], stop_reason="max_tokens")


def on_the_wire(wire: Harness) -> list[Any]:
    return [r.body["max_tokens"] for r in wire.requests]


@STREAMING
async def test_truncation_retries_grow_64_128_256_without_a_max_tokens_argument(
    wire: Harness, stream: bool
) -> None:
    """No max_tokens= given, no model limit published: 64, 128, 256, then 256 (4 x 64)."""
    engine, ledger = wire.engine(truncated(), truncated(), truncated(),
                                 Reply.final({"scene": "done"}), stream=stream)
    result = await engine.call(scene_op(64), "Write the scene.", output=Scene)
    assert result.data == Scene(scene="done")
    assert on_the_wire(wire) == [64, 128, 256, 256]
    assert result.attempts.count == 4
    assert [row["max_tokens"] for row in ledger.attempts.values()] == [64, 128, 256, 256]


async def test_the_published_model_limit_is_the_growth_ceiling(wire: Harness) -> None:
    """With model_max_output_tokens=200 growth stops there, not at 4 x the first request."""
    engine, _ = wire.engine(truncated(), truncated(), truncated(),
                            Reply.final({"scene": "done"}))
    result = await engine.call(scene_op(64, model_max_output_tokens=200), "Write.",
                               output=Scene)
    assert on_the_wire(wire) == [64, 128, 200, 200]
    assert result.attempts.count == 4


async def test_a_published_model_limit_above_four_times_lets_growth_go_further(
    wire: Harness,
) -> None:
    """The model's own limit, when published, replaces the 4x ceiling: 64 ... 512."""
    engine, _ = wire.engine(truncated(), truncated(), truncated(), truncated(),
                            Reply.final({"scene": "done"}))
    await engine.call(scene_op(64, model_max_output_tokens=100_000), "Write.", output=Scene)
    assert on_the_wire(wire) == [64, 128, 256, 512, 1024]


async def test_a_smaller_max_tokens_argument_sets_the_first_request_and_the_ceiling(
    wire: Harness,
) -> None:
    """max_tokens=100 on a 64 000-token operation: 100, 200, 400, 400 (4 x 100)."""
    engine, _ = wire.engine(truncated(), truncated(), truncated(),
                            Reply.final({"scene": "done"}))
    await engine.call(scene_op(64_000), "Write.", output=Scene, max_tokens=100)
    assert on_the_wire(wire) == [100, 200, 400, 400]


async def test_a_max_tokens_argument_above_the_operation_is_clamped(wire: Harness) -> None:
    """A caller cannot widen the first request past max_output_tokens (R13)."""
    engine, _ = wire.engine(truncated(), Reply.final({"scene": "done"}))
    await engine.call(scene_op(64), "Write.", output=Scene, max_tokens=10_000)
    assert on_the_wire(wire) == [64, 128]


async def test_grow_max_tokens_false_override_keeps_the_budget_and_the_attempts(
    wire: Harness,
) -> None:
    """RetryPolicy(grow_max_tokens=False) turns growth off and keeps the published
    max_attempts=5 (an override narrows only what it names)."""
    engine, _ = wire.engine(*[truncated() for _ in range(4)], Reply.final({"scene": "done"}))
    result = await engine.call(scene_op(64, max_attempts=5), "Write.", output=Scene,
                               retry=le.RetryPolicy(grow_max_tokens=False))
    assert on_the_wire(wire) == [64] * 5
    assert result.attempts.count == 5


async def test_truncation_retries_stop_at_max_attempts_at_the_ceiling(wire: Harness) -> None:
    """Growth never outlasts retry.max_attempts: the call fails truncated, attempts counted."""
    engine, _ = wire.engine(*[truncated() for _ in range(4)])
    with pytest.raises(le.StructuredOutputError) as info:
        await engine.call(scene_op(64, max_attempts=4), "Write.", output=Scene)
    assert on_the_wire(wire) == [64, 128, 256, 256]
    assert info.value.reason == "truncated" and info.value.attempts == 4


async def test_a_run_does_not_grow_each_turn_asks_for_max_output_tokens(
    wire: Harness,
) -> None:
    """Engine.run keeps asking for max_output_tokens: growth is a structured call's.
    (The run has a tool, so that its second request, holding the unknown tool's
    call and error result, defines tools, as the Messages API requires.)"""
    engine, _ = wire.engine(Reply.tool_calls(("missing", {})), Reply.text("done"))
    present = le.Tool("present", "A tool the model does not call.", {"type": "object"},
                      lambda _: "unused")
    result = await engine.run(scene_op(64, model_max_output_tokens=50), "go", tools=[present])
    assert result.outcome is le.Outcome.COMPLETED
    assert on_the_wire(wire) == [50, 50]
