"""The shared retry loop, without real sleeping."""

from __future__ import annotations

import math
import random

import pytest

import loopengine as le
from loopengine.guards import GuardTrip
from loopengine.providers import (
    FaultKind,
    ProviderFault,
    ProviderResponse,
    RetryStop,
    backoff_wait,
    run_with_retries,
)
from loopengine.testing import FakeClock

OK = ProviderResponse(content=[{"type": "text", "text": "ok"}], stop_reason="end_turn")


def sender(*outcomes: ProviderFault | ProviderResponse):  # type: ignore[no-untyped-def]
    calls: list[tuple[int, float]] = []
    items = iter(outcomes)

    async def send(attempt: int, wait: float) -> ProviderResponse:
        calls.append((attempt, wait))
        item = next(items)
        if isinstance(item, ProviderFault):
            raise item
        return item

    return send, calls


async def run(send, clock: FakeClock, *, remaining: float = math.inf,  # type: ignore[no-untyped-def]
              policy: le.RetryPolicy | None = None, max_attempts: int | None = None):
    return await run_with_retries(
        send, policy=policy or le.RetryPolicy(), clock=clock,
        remaining=lambda: remaining, before_attempt=lambda: None, rng=random.Random(1),
        max_attempts=max_attempts,
    )


def test_backoff_doubles_with_jitter_in_the_upper_half() -> None:
    """wait(n) lies in [base/2, base] with base = initial * 2**(n-1), capped."""
    policy = le.RetryPolicy(initial_wait=1.0, max_wait=6.0)
    rng = random.Random(3)
    for retry, base in ((1, 1.0), (2, 2.0), (3, 4.0), (4, 6.0), (9, 6.0)):
        for _ in range(50):
            assert base / 2 <= backoff_wait(policy, retry, rng) <= base


async def test_the_wait_slept_is_reported_to_the_next_attempt() -> None:
    """Each attempt learns the backoff slept before it."""
    clock = FakeClock()
    send, calls = sender(ProviderFault("overloaded", "x"), ProviderFault("timeout", "y"), OK)
    assert await run(send, clock) is OK
    assert [c[0] for c in calls] == [1, 2, 3]
    assert calls[0][1] == 0.0 and [c[1] for c in calls[1:]] == clock.sleeps


async def test_exhaustion_and_explicit_caps() -> None:
    """The policy's cap, or a lower explicit one, bounds the attempts."""
    clock = FakeClock()
    send, calls = sender(*[ProviderFault("server_error", "x") for _ in range(5)])
    stop = await run(send, clock, max_attempts=2)
    assert isinstance(stop, RetryStop) and stop.reason == "exhausted" and stop.attempts == 2
    assert len(calls) == 2


@pytest.mark.parametrize("kind", ["bad_request", "unauthorized", "credit_exhausted"])
async def test_permanent_kinds_stop_at_once(kind: str) -> None:
    """Permanent faults and credit exhaustion are never retried."""
    clock = FakeClock()
    send, calls = sender(ProviderFault(kind, "no"), OK)
    stop = await run(send, clock)
    assert isinstance(stop, RetryStop) and stop.reason == "permanent"
    assert len(calls) == 1 and clock.sleeps == []


async def test_a_wait_longer_than_the_time_left_is_not_slept() -> None:
    """The loop gives up rather than sleep past the deadline."""
    clock = FakeClock()
    send, _ = sender(ProviderFault("rate_limited", "x", retry_after=5.0), OK)
    stop = await run(send, clock, remaining=4.0)
    assert isinstance(stop, RetryStop) and stop.reason == "deadline"
    assert clock.sleeps == []


async def test_guard_before_each_attempt() -> None:
    """The pre-attempt guard is consulted before every attempt, retries included."""
    clock = FakeClock()
    send, calls = sender(ProviderFault("overloaded", "x"), OK)
    trip = GuardTrip(le.Outcome.TIME_LIMIT, "total_time", 0.0, 1.0, "out of time")
    checks = iter([None, trip])
    result = await run_with_retries(
        send, policy=le.RetryPolicy(), clock=clock, remaining=lambda: math.inf,
        before_attempt=lambda: next(checks), rng=random.Random(1),
    )
    assert result is trip and len(calls) == 1


def test_fault_kind_table() -> None:
    """Exactly the transient kinds are retryable (DESIGN.md section 3)."""
    assert {k.value for k in FaultKind if k.retryable} == {
        "timeout", "rate_limited", "overloaded", "server_error", "connection", "aborted"}
    assert not ProviderFault("overloaded", "x", should_retry=False).retryable
