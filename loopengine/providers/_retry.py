"""`RetryPolicy` and the retry decisions every provider shares (R05, R06, R13).

The engine's retry loop (one, for every provider) asks `after_fault` what
follows a fault. It retries only retryable faults, waits with exponential backoff and
jitter capped at ``max_wait`` (or what the provider's ``retry-after`` asked),
never sleeps a wait that would outlast the deadline, obeys ``x-should-retry:
false``, and never switches to another model or provider: the one it was
given is the published route.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import InitVar, dataclass, fields
from typing import Literal

from loopengine import _validate
from loopengine._errors import ConfigError
from loopengine._named import NamedFields, given, replaced_from
from loopengine.guards._checkpoints import GuardTrip
from loopengine.providers._faults import ProviderFault

__all__ = ["MAX_ATTEMPTS_CEILING", "RetryPolicy", "RetryStop", "after_fault", "backoff_wait"]

MAX_ATTEMPTS_CEILING = 16
"""No policy may allow more than this many attempts."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy(NamedFields):
    """How many times, and how patiently, a failed request is tried again.

    Waits are in seconds. Built values are validated: ``RetryPolicy(max_attempts=17)``
    raises `ConfigError` with ``field == "max_attempts"``. Given as a run's or
    a call's override, a policy narrows only the fields it was built with
    (see `narrow`).
    """

    max_attempts: int = 3
    """Requests per turn (or per structured call), first try included: 1..16 (R05)."""
    initial_wait: float = 0.5
    """The base wait before the first retry; it doubles for each later one."""
    max_wait: float = 8.0
    """The cap on one backoff wait (a provider's ``retry-after`` may ask for more)."""
    grow_max_tokens: bool = True
    """`Engine.call`: double ``max_tokens`` when a reply was cut off, up to the
    call's growth ceiling (docs/structured-calls.md); False keeps it."""
    _origin: InitVar[RetryPolicy | None] = replaced_from()
    """Internal: the instance `dataclasses.replace` copies (see loopengine._named)."""

    def __post_init__(self, _origin: RetryPolicy | None) -> None:
        for f in fields(self):
            _check_field(f.name, getattr(self, f.name))
        if self.max_wait < self.initial_wait:
            raise ConfigError(
                "max_wait",
                f"must be at least initial_wait ({self.max_wait} < {self.initial_wait})",
            )
        object.__setattr__(self, "initial_wait", float(self.initial_wait))
        object.__setattr__(self, "max_wait", float(self.max_wait))

    @classmethod
    def from_mapping(cls, values: Mapping[str, object]) -> RetryPolicy:
        """Build a policy from a mapping; unknown keys are errors."""
        _check_mapping(values)
        return cls(**values)  # type: ignore[arg-type]

    def narrow(self, override: RetryPolicy | Mapping[str, object] | None) -> RetryPolicy:
        """Return this (published) policy narrowed by a caller's ``override``.

        The policy narrows, never widens: ``max_attempts`` above this one is
        clamped to it, ``grow_max_tokens`` can only be turned off, waits can
        only grow. An override narrows only what it names: the keys of a
        mapping, or the fields passed to the `RetryPolicy(...)`; every other
        setting keeps this policy's value.

        Raises:
            ConfigError: a malformed override; the field is prefixed ``retry.``.
        """
        if override is None:
            return self
        named = given(override, RetryPolicy, field="retry", check=_check_mapping)
        max_attempts = int(named.get("max_attempts", self.max_attempts))  # type: ignore[call-overload]
        max_wait = max(self.max_wait, float(named.get("max_wait", self.max_wait)))  # type: ignore[arg-type]
        initial = max(self.initial_wait, float(named.get("initial_wait", 0.0)))  # type: ignore[arg-type]
        return RetryPolicy(
            max_attempts=min(self.max_attempts, max_attempts),
            initial_wait=min(initial, max_wait),
            max_wait=max_wait,
            grow_max_tokens=self.grow_max_tokens and named.get("grow_max_tokens") is not False,
        )


def _check_field(name: str, value: object) -> None:
    if name == "max_attempts":
        _validate.integer(name, value, minimum=1, maximum=MAX_ATTEMPTS_CEILING)
    elif name == "grow_max_tokens":
        _validate.boolean(name, value)
    else:
        _validate.seconds(name, value, positive=False)


def _check_mapping(values: Mapping[str, object]) -> None:
    _validate.known_keys("retry", values, (f.name for f in fields(RetryPolicy)),
                         "a retry setting")
    for key, value in values.items():
        _check_field(key, value)


def backoff_wait(policy: RetryPolicy, retry: int, rng: random.Random) -> float:
    """The wait before retry number ``retry`` (1 = the first retry).

    The base doubles each retry up to ``max_wait``; the jitter takes a random
    point in its upper half, so consecutive waits never shrink before the cap.
    """
    base: float = min(policy.max_wait, policy.initial_wait * (2.0 ** (retry - 1)))
    return base * (0.5 + 0.5 * rng.random())


@dataclass(frozen=True, slots=True)
class RetryStop:
    """The retry loop gave up on a fault."""

    fault: ProviderFault
    """The last attempt's fault."""
    attempts: int
    """Attempts made in this loop."""
    reason: Literal["permanent", "not_retryable", "exhausted", "deadline"]
    """``permanent``: the kind is never retried; ``not_retryable``: the provider
    said ``x-should-retry: false``; ``exhausted``: ``max_attempts`` reached;
    ``deadline``: the wait would outlast the run's time."""


def after_fault(
    fault: ProviderFault,
    attempt: int,
    cap: int,
    *,
    policy: RetryPolicy,
    rng: random.Random,
    before_attempt: Callable[[], GuardTrip | None],
    remaining: Callable[[], float],
) -> GuardTrip | RetryStop | float:
    """What follows attempt number ``attempt`` that raised ``fault``: a stop, the
    pre-attempt guard's trip, or the seconds to wait before the next attempt.

    The decisions of the engine's one retry loop, in their order.

    Args:
        fault: What the attempt raised.
        attempt: The attempt's number in this loop (1 = the first).
        cap: The most attempts the loop may make.
        policy: Waits.
        rng: Jitter source.
        before_attempt: The pre-attempt guard (no request once no time remains).
        remaining: Seconds left before the run's deadline.
    """
    if not fault.kind.retryable:
        return RetryStop(fault, attempt, "permanent")
    if fault.should_retry is False:
        return RetryStop(fault, attempt, "not_retryable")
    # An attempt cut by the deadline leaves no time: that is the time
    # limit speaking, not the provider.
    trip = before_attempt()
    if trip is not None:
        return trip
    if attempt >= cap:
        return RetryStop(fault, attempt, "exhausted")
    if fault.retry_after is not None:
        wait = max(0.0, fault.retry_after)
    else:
        wait = backoff_wait(policy, attempt, rng)
    if wait >= remaining():
        return RetryStop(fault, attempt, "deadline")
    return wait
