"""The engine's one retry loop, without real sleeping: each test runs a
conversation on a `FakeClock` against a scripted provider."""

from __future__ import annotations

import random
from typing import Any

import pytest

import loopengine as le
from loopengine.persistence import MemoryLedger
from loopengine.providers import (
    FaultKind,
    ProviderFault,
    Reply,
    ScriptedProvider,
    backoff_wait,
)
from loopengine.testing import FakeClock

from .conftest import PRICES, operation


async def run(*script: Any, clock: FakeClock, **run_kwargs: Any,
              ) -> tuple[le.RunResult, ScriptedProvider, MemoryLedger]:
    """One run of the test operation through the engine's retry loop."""
    limits = run_kwargs.pop("limits", {})
    provider = ScriptedProvider(list(script), clock=clock)
    ledger = MemoryLedger()
    engine = le.Engine(provider, ledger=ledger, prices=PRICES, clock=clock,
                       rng=random.Random(1))
    result = await engine.run(operation(**limits), "go", **run_kwargs)
    return result, provider, ledger


def test_backoff_doubles_with_jitter_in_the_upper_half() -> None:
    """wait(n) lies in [base/2, base] with base = initial * 2**(n-1), capped."""
    policy = le.RetryPolicy(initial_wait=1.0, max_wait=6.0)
    rng = random.Random(3)
    for retry, base in ((1, 1.0), (2, 2.0), (3, 4.0), (4, 6.0), (9, 6.0)):
        for _ in range(50):
            assert base / 2 <= backoff_wait(policy, retry, rng) <= base


async def test_the_wait_slept_is_recorded_on_the_next_attempt() -> None:
    """Each attempt's row holds the backoff slept before it."""
    clock = FakeClock()
    result, provider, ledger = await run(
        ProviderFault("overloaded", "x"), ProviderFault("timeout", "y"), Reply.text("ok"),
        clock=clock)
    assert result.outcome is le.Outcome.COMPLETED and len(provider.requests) == 3
    waits = [row["wait_ms"] for row in ledger.attempts.values()]
    assert waits == [0, *(round(wait * 1000) for wait in clock.sleeps)]


async def test_exhaustion_and_explicit_caps() -> None:
    """The policy's cap, or a lower one given for the run, bounds the attempts."""
    clock = FakeClock()
    result, provider, _ = await run(*[ProviderFault("server_error", "x") for _ in range(5)],
                                    clock=clock, retry={"max_attempts": 2})
    assert result.outcome is le.Outcome.PROVIDER_ERROR and "2 attempts" in result.detail
    assert len(provider.requests) == 2


@pytest.mark.parametrize("kind", ["bad_request", "unauthorized", "credit_exhausted"])
async def test_permanent_kinds_stop_at_once(kind: str) -> None:
    """Permanent faults and credit exhaustion are never retried."""
    clock = FakeClock()
    result, provider, _ = await run(ProviderFault(kind, "no"), Reply.text("ok"), clock=clock)
    assert result.outcome in (le.Outcome.PROVIDER_ERROR, le.Outcome.CREDIT_EXHAUSTED)
    assert len(provider.requests) == 1 and clock.sleeps == []


async def test_a_wait_longer_than_the_time_left_is_not_slept() -> None:
    """The loop gives up rather than sleep past the deadline."""
    clock = FakeClock()
    result, provider, _ = await run(
        ProviderFault("rate_limited", "x", retry_after=5.0), Reply.text("ok"), clock=clock,
        limits={"total_time": 4.0})
    assert result.outcome is le.Outcome.PROVIDER_ERROR
    assert "the wait would outlast the run's time" in result.detail
    assert len(provider.requests) == 1 and clock.sleeps == []


async def test_the_time_guard_is_asked_before_each_attempt() -> None:
    """The pre-attempt guard is consulted before every attempt, retries included:
    a fault that arrives once no time remains ends the run at the time limit."""
    clock = FakeClock()

    def late(request: Any) -> ProviderFault:
        clock.advance(10.0)  # the attempt took the run's whole time
        return ProviderFault("overloaded", "x")

    result, provider, _ = await run(late, Reply.text("ok"), clock=clock,
                                    limits={"total_time": 5.0})
    assert result.outcome is le.Outcome.TIME_LIMIT and len(provider.requests) == 1


def test_fault_kind_table() -> None:
    """Exactly the transient kinds are retryable (docs/architecture.md, "Providers and
    faults")."""
    assert {k.value for k in FaultKind if k.retryable} == {
        "timeout", "rate_limited", "overloaded", "server_error", "connection", "aborted"}
    assert not ProviderFault("overloaded", "x", should_retry=False).retryable
