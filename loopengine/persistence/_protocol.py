"""The `Ledger` contract every attempt store implements."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from loopengine.persistence._records import (
    AttemptDispatch,
    AttemptSettle,
    InvocationEnd,
    InvocationStart,
)

__all__ = ["DEFAULT_MAX_RETAINED_ATTEMPTS", "Ledger"]

DEFAULT_MAX_RETAINED_ATTEMPTS = 64
"""Attempt rows kept per invocation; later attempts only count (R07)."""


@runtime_checkable
class Ledger(Protocol):
    """Where invocations and their attempts are recorded.

    The engine calls, for each invocation: `start_invocation` once, then for
    each attempt `dispatch_attempt` (before the request goes on the wire) and
    `settle_attempt` (after), then `end_invocation` once. Durability:

    * when `dispatch_attempt` returns, the dispatched row (and everything
      recorded before it) is durable: a process killed while the request is on
      the wire leaves an unsettled row, never a missing one;
    * when `settle_attempt` returns, a settle that carries what the provider
      served (`AttemptSettle.served`: a reply, usage, a response id) is
      durable, so a process killed while the reply's tools run has lost
      nothing the provider served; any other settle may return before it is
      durable, if it becomes durable no later than the next durable write;
    * when `end_invocation` returns, the whole invocation is durable.

    After `max_retained_attempts` rows, further attempts add no rows: they
    increase the invocation's ``attempt_count`` and set ``incomplete`` (R07).
    The invocation's totals are kept with each settle, so they reconcile with
    its attempts by construction.
    """

    @property
    def max_retained_attempts(self) -> int:
        """Attempt rows kept per invocation."""
        ...

    async def start_invocation(self, record: InvocationStart) -> None:
        """Record a new invocation as ``running``."""
        ...

    async def dispatch_attempt(self, record: AttemptDispatch) -> None:
        """Record an attempt as ``dispatched``, durably, before it is sent."""
        ...

    async def settle_attempt(self, record: AttemptSettle) -> None:
        """Settle a dispatched attempt and add its usage and cost to the totals."""
        ...

    async def end_invocation(self, record: InvocationEnd) -> None:
        """Settle the invocation with its outcome, durably."""
        ...
