"""Overrides narrow only what they name (docs/guards.md, R13), through AnthropicProvider ->
the real ``anthropic`` SDK -> FakeAnthropicServer.

A published operation's limits and retry policy are ceilings; a caller's
``limits=`` or ``retry=`` may lower the fields it names, and every other field
keeps its published value, not the class default of the override object.
"""

from __future__ import annotations

import dataclasses

import loopengine as le
from loopengine.testing import ErrorReply, FakeClock, Reply

from ..conftest import MODEL
from .conftest import STREAMING, Harness


def published(**limits: object) -> le.Operation:
    """Published with limits wider than every class default."""
    values: dict[str, object] = {"max_turns": 20, "attempt_timeout": 300.0,
                                 "total_time": 900.0, "max_tool_calls": 64, **limits}
    return le.Operation(name="teammate.answer", provider="anthropic", model=MODEL,
                        max_output_tokens=256, limits=le.Limits(**values),  # type: ignore[arg-type]
                        retry=le.RetryPolicy(max_attempts=5, initial_wait=0.01, max_wait=0.02))


@le.tool
async def lookup(key: str) -> str:
    """Look a key up."""
    return f"value of {key}"


def tool_turns(n: int) -> list[Reply]:
    return [Reply.tool_calls(("lookup", {"key": str(i)})) for i in range(n)]


@STREAMING
async def test_a_credit_hold_override_keeps_the_published_timeout_and_turns_anthropic(
    wire: Harness, stream: bool
) -> None:
    """Limits(credit_hold=10_000) on max_turns=20, attempt_timeout=300: every request
    carries the 300 s timeout, and the run goes past the class default of 10 turns."""
    engine, ledger = wire.engine(*tool_turns(12), Reply.text("done"), stream=stream)
    result = await engine.run(published(), "go", tools=[lookup],
                              limits=le.Limits(credit_hold=10_000))
    assert result.outcome is le.Outcome.COMPLETED
    assert result.turns == 13 == len(wire.requests)
    # The SDK hands the per-request timeout to the server as x-stainless-timeout.
    assert {r.timeout for r in wire.requests} == {300.0}
    assert {row["timeout_ms"] for row in ledger.attempts.values()} == {300_000}


async def test_the_named_field_still_narrows_anthropic(wire: Harness) -> None:
    """The field the override names does narrow: a hold of 300 credits ends the run
    credit_limit on its third turn (120 credits a turn), each at the published timeout."""
    engine, ledger = wire.engine(*tool_turns(5))
    result = await engine.run(published(), "go", tools=[lookup],
                              limits=le.Limits(credit_hold=300))
    assert result.outcome is le.Outcome.CREDIT_LIMIT
    assert result.turns == 3 and result.credits == 360
    assert {row["timeout_ms"] for row in ledger.attempts.values()} == {300_000}


async def test_a_replaced_override_names_its_fields_and_the_replaced_one_anthropic(
    wire: Harness,
) -> None:
    """dataclasses.replace(Limits(credit_hold=...), max_turns=3) narrows the hold and
    the turns, and keeps the published 300 s timeout."""
    engine, ledger = wire.engine(*tool_turns(5))
    override = dataclasses.replace(le.Limits(credit_hold=10_000), max_turns=3)
    result = await engine.run(published(), "go", tools=[lookup], limits=override)
    assert result.outcome is le.Outcome.TURN_LIMIT and result.turns == 3
    assert {row["timeout_ms"] for row in ledger.attempts.values()} == {300_000}


async def test_a_mapping_override_narrows_only_its_keys_anthropic(wire: Harness) -> None:
    """{"max_turns": 2} ends the run after two turns, at the published timeout."""
    engine, ledger = wire.engine(*tool_turns(3))
    result = await engine.run(published(), "go", tools=[lookup], limits={"max_turns": 2})
    assert result.outcome is le.Outcome.TURN_LIMIT and result.turns == 2
    assert {row["timeout_ms"] for row in ledger.attempts.values()} == {300_000}


async def test_a_retry_override_keeps_the_published_attempts_and_waits_anthropic(
    wire: Harness, clock: FakeClock
) -> None:
    """RetryPolicy(grow_max_tokens=False) keeps max_attempts=5 (the class default is 3)
    and the published waits of at most 0.02 s (the class default starts at 0.5 s)."""
    engine, ledger = wire.engine(*[ErrorReply.overloaded() for _ in range(4)],
                                 Reply.text("done"))
    result = await engine.run(published(), "go",
                              retry=le.RetryPolicy(grow_max_tokens=False))
    assert result.outcome is le.Outcome.COMPLETED
    assert len(wire.requests) == 5 == result.attempts.count
    assert len(clock.sleeps) == 4 and max(clock.sleeps) <= 0.02
    assert all(row["wait_ms"] <= 20 for row in ledger.attempts.values())


async def test_a_retry_override_still_narrows_what_it_names_anthropic(wire: Harness) -> None:
    """RetryPolicy(max_attempts=2) on a published 5 gives up after two requests."""
    engine, _ = wire.engine(*[ErrorReply.overloaded() for _ in range(3)], Reply.text("late"))
    result = await engine.run(published(), "go", retry=le.RetryPolicy(max_attempts=2))
    assert result.outcome is le.Outcome.PROVIDER_ERROR
    assert len(wire.requests) == 2
