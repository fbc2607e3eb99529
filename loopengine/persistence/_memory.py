"""`MemoryLedger`: the `Ledger` contract in memory, for tests and embedding."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from loopengine._errors import LedgerError
from loopengine.persistence._protocol import DEFAULT_MAX_RETAINED_ATTEMPTS
from loopengine.persistence._records import (
    AttemptDispatch,
    AttemptSettle,
    InvocationEnd,
    InvocationStart,
)

__all__ = ["MemoryLedger"]


@dataclass
class MemoryLedger:
    """Keeps invocations and attempts as dicts shaped like the SQLite rows.

    As strict as `SQLiteLedger`: a second dispatch or settle of one attempt,
    and any write after the invocation ended, raise `LedgerError`.

    Args:
        max_retained_attempts: Attempt rows kept per invocation (R07).

    Attributes:
        invocations: Invocation rows by id.
        attempts: Attempt rows by ``(invocation_id, ordinal)``.
        calls: Every call made to the ledger, in order, as ``(method, ordinal)``.
    """

    max_retained_attempts: int = DEFAULT_MAX_RETAINED_ATTEMPTS
    invocations: dict[str, dict[str, Any]] = field(default_factory=dict)
    attempts: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    calls: list[tuple[str, int | str]] = field(default_factory=list)
    _dispatched: set[tuple[str, int]] = field(default_factory=set, repr=False)
    _settled: set[tuple[str, int]] = field(default_factory=set, repr=False)

    async def start_invocation(self, record: InvocationStart) -> None:
        """Record the invocation as running."""
        self.calls.append(("start", record.id))
        if record.id in self.invocations:
            raise LedgerError(f"invocation {record.id} already exists")
        self.invocations[record.id] = {
            **{k: getattr(record, k) for k in record.__dataclass_fields__},
            "started_at": record.started_at.isoformat(),
            "ended_at": None, "outcome": "running", "turns": 0, "tool_calls": 0,
            "attempt_count": 0, "attempts_retained": 0, "incomplete": 0,
            "input_tokens": 0, "output_tokens": 0, "cache_read_tokens": 0,
            "cache_write_tokens": 0, "cost_nanousd": 0, "provider_cost_nanousd": 0,
            "credits": 0,
        }

    async def dispatch_attempt(self, record: AttemptDispatch) -> None:
        """Count the attempt; keep its row while under the retention cap."""
        self.calls.append(("dispatch", record.ordinal))
        inv = self._open(record.invocation_id)
        key = (record.invocation_id, record.ordinal)
        if key in self._dispatched:
            raise LedgerError(f"attempt {record.ordinal} of {record.invocation_id} was already "
                              "dispatched")
        self._dispatched.add(key)
        inv["attempt_count"] += 1
        if inv["attempts_retained"] >= self.max_retained_attempts:
            inv["incomplete"] = 1
            return
        inv["attempts_retained"] += 1
        row = {k: getattr(record, k) for k in record.__dataclass_fields__}
        row.update(started_at=record.started_at.isoformat(), outcome="dispatched")
        self.attempts[(record.invocation_id, record.ordinal)] = row

    async def settle_attempt(self, record: AttemptSettle) -> None:
        """Settle the row (if retained) and add to the invocation's totals."""
        self.calls.append(("settle", record.ordinal))
        inv = self._open(record.invocation_id)
        key = (record.invocation_id, record.ordinal)
        if key not in self._dispatched or key in self._settled:
            raise LedgerError(f"attempt {record.ordinal} of {record.invocation_id} is not "
                              "awaiting settlement")
        self._settled.add(key)
        usage = record.usage
        if usage is not None:
            inv["input_tokens"] += usage.input_tokens
            inv["output_tokens"] += usage.output_tokens
            inv["cache_read_tokens"] += usage.cache_read_tokens
            inv["cache_write_tokens"] += usage.cache_write_tokens
        if record.cost_nanousd is not None:
            inv["provider_cost_nanousd"] += record.cost_nanousd
            if record.charged:
                inv["cost_nanousd"] += record.cost_nanousd
        row = self.attempts.get((record.invocation_id, record.ordinal))
        if row is None:
            return
        settled = replace(record, usage=None)
        row.update({k: getattr(settled, k) for k in settled.__dataclass_fields__
                    if k not in ("usage", "invocation_id", "ordinal")})
        row.update(
            input_tokens=usage.input_tokens if usage else None,
            output_tokens=usage.output_tokens if usage else None,
            cache_read_tokens=usage.cache_read_tokens if usage else None,
            cache_write_tokens=usage.cache_write_tokens if usage else None,
            usage_approx=int(record.usage_approx), charged=int(record.charged),
        )

    async def end_invocation(self, record: InvocationEnd) -> None:
        """Settle the invocation."""
        self.calls.append(("end", record.id))
        inv = self._open(record.id)
        inv.update(ended_at=record.ended_at.isoformat(), outcome=record.outcome,
                   turns=record.turns, tool_calls=record.tool_calls, credits=record.credits)

    def _open(self, invocation_id: str) -> dict[str, Any]:
        """The invocation's row, which must exist and not have ended."""
        inv = self.invocations.get(invocation_id)
        if inv is None:
            raise LedgerError(f"no invocation {invocation_id}")
        if inv["outcome"] != "running":
            raise LedgerError(f"invocation {invocation_id} has already ended ({inv['outcome']})")
        return inv
