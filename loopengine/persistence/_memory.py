"""`MemoryLedger`: the `Ledger` contract in memory, for tests and embedding.

Its rules are the planner's (`_planner`), the ones every store keeps: this
file supplies only dicts shaped like the tables' rows as the planner's
`Store`. Each call commits its write at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loopengine._errors import LedgerError
from loopengine.persistence import _planner
from loopengine.persistence._account_store import TreeRun
from loopengine.persistence._ops import check_arguments, dispatch_op, end_op, settle_op, start_op
from loopengine.persistence._protocol import DEFAULT_MAX_RETAINED_ATTEMPTS
from loopengine.persistence._records import (
    AttemptDispatch,
    AttemptSettle,
    InvocationEnd,
    InvocationProgress,
    InvocationStart,
)
from loopengine.persistence._schema import ATTEMPT_COLUMNS, INVOCATION_COLUMNS

__all__ = ["MemoryLedger"]

_NEW_INVOCATION = {**dict.fromkeys(INVOCATION_COLUMNS, 0), "ended_at": None,
                   "outcome": "running", "pause_seal": None}
_NEW_ATTEMPT = {**dict.fromkeys(ATTEMPT_COLUMNS), "outcome": "dispatched"}


class MemoryLedger:
    """Keeps invocations and attempts as dicts shaped like the SQLite rows.

    As strict as `SQLiteLedger`, by the same rules: a second dispatch or
    settle of one attempt, and any write after the invocation ended, raise
    `LedgerError` (a refused start, as on every store, from the invocation's
    next call).

    Args:
        max_retained_attempts: Attempt rows kept per invocation (R07).

    Raises:
        ConfigError: ``max_retained_attempts`` is not a positive integer.

    Attributes:
        invocations: Invocation rows by id.
        attempts: Attempt rows by ``(invocation_id, ordinal)``.
        segments: Running segment rows by ``(invocation_id, ordinal)``.
        calls: Every call made to the ledger, in order, as ``(method, ordinal or id)``.
    """

    def __init__(self, max_retained_attempts: int = DEFAULT_MAX_RETAINED_ATTEMPTS) -> None:
        check_arguments(max_retained_attempts=max_retained_attempts, max_batch=1, seconds={})
        self.max_retained_attempts = max_retained_attempts
        self._rows = _Rows(max_retained_attempts)
        self.invocations = self._rows.invocations
        self.attempts = self._rows.attempts
        self.segments = self._rows.segments
        self.calls: list[tuple[str, int | str]] = []

    def __repr__(self) -> str:
        return f"MemoryLedger({len(self.invocations)} invocations)"

    async def start_invocation(self, record: InvocationStart) -> None:
        """Record the invocation as running."""
        self._commit(("start", record.id), start_op(record))

    async def dispatch_attempt(self, record: AttemptDispatch) -> None:
        """Count the attempt; keep its row while under the retention cap."""
        self._commit(("dispatch", record.ordinal), dispatch_op(record))

    async def settle_attempt(self, record: AttemptSettle) -> None:
        """Settle the row (if retained) and add to the invocation's totals."""
        self._commit(("settle", record.ordinal), settle_op(record))

    async def end_invocation(self, record: InvocationEnd) -> None:
        """Settle the invocation."""
        self._commit(("end", record.id), end_op(record))

    async def read_progress(self, invocation_id: str) -> InvocationProgress | None:
        """The invocation's committed progress (`_planner.read_progress`), or None."""
        row = self.invocations.get(invocation_id)
        if row is None:
            return None
        return _planner.read_progress(
            lambda sql: [[row[column] for column in
                          _planner.PROGRESS_COLUMNS + _planner.PROGRESS_USAGE]])

    async def read_tree(self, invocation_id: str) -> list[TreeRun]:
        """The run ``invocation_id`` and every run below it, in the order they
        started: what `SQLiteLedger.read_tree` reads, from the dicts."""
        below: dict[str, list[str]] = {}
        for row in self.invocations.values():
            if row["parent_invocation_id"] is not None:
                below.setdefault(row["parent_invocation_id"], []).append(row["id"])
        members = [invocation_id]
        for member in members:  # grows as it goes: each run's children after it
            members += below.get(member, ())
        rows = [self.invocations[m] for m in members if m in self.invocations]
        # Only a running run's attempts are read: an ended one's counts are its row's.
        running = {row["id"] for row in rows if row["outcome"] == "running"}
        reached: dict[str, int] = {}
        turn_costs: dict[str, dict[int, int]] = {}
        for (owner, _), attempt in self.attempts.items():
            if owner not in running:
                continue
            turn = attempt["turn"]
            reached[owner] = max(reached.get(owner, 0), turn)
            if attempt["charged"] and attempt["cost_nanousd"] is not None:
                by_turn = turn_costs.setdefault(owner, {})
                by_turn[turn] = by_turn.get(turn, 0) + attempt["cost_nanousd"]
        return [TreeRun(row["id"], row["outcome"], max(row["turns"], reached.get(row["id"], 0)),
                        row["tool_calls"], row["credits"],
                        tuple(turn_costs.get(row["id"], {}).values()))
                for row in sorted(rows, key=lambda row: (row["started_at"], row["id"]))]

    def _commit(self, call: tuple[str, int | str], op: _planner.Op) -> None:
        """Note ``call`` (`calls`) and commit its ``op`` at once.

        Raises:
            LedgerError: the op was refused.
        """
        self.calls.append(call)
        for _, message in self._rows.planner.commit([op]):
            raise LedgerError(message)


class _Rows(_planner.Store):
    """The dicts as the planner's store: each write applied whole, or refused
    before it starts."""

    errors = (KeyError,)
    """A row inserted twice (a primary key's violation, on the other stores)."""

    def __init__(self, max_retained: int) -> None:
        super().__init__("memory ledger", max_retained)
        self.invocations: dict[str, dict[str, Any]] = {}
        self.attempts: dict[tuple[str, int], dict[str, Any]] = {}
        self.segments: dict[tuple[str, int], dict[str, Any]] = {}

    def begin(self) -> None:
        """Nothing to open."""

    def finish(self) -> None:
        """Nothing to commit."""

    def abort(self) -> None:
        """Nothing to roll back."""

    def isolates(self, error: BaseException) -> bool:
        """One write at a time: nothing to isolate."""
        return False

    def load(self, invocation_id: str) -> _planner.Known | None:
        """An invocation's state, from its rows."""
        row = self.invocations.get(invocation_id)
        if row is None:
            return None
        unsettled = [ordinal for (owner, ordinal), attempt in self.attempts.items()
                     if owner == invocation_id and attempt["outcome"] == "dispatched"]
        last = max((ordinal for owner, ordinal in self.segments if owner == invocation_id),
                   default=None)
        segment = None if last is None else self.segments[(invocation_id, last)]
        return _planner.Known(row["attempts_retained"],
                              row["outcome"] not in _planner.OPEN_OUTCOMES, unsettled, last,
                              segment is not None and segment["ended_at"] is None
                              and segment["outcome"] is None)

    def execute(self, batch: _planner.Batch) -> None:
        """Apply the batch's rows to the dicts."""
        _planner.execute(batch, self._run)

    def _run(self, kind: str, rows: list[Sequence[Any]]) -> int:
        changed = 0
        for row in rows:
            if kind in ("start", "dispatch"):
                # A row inserted twice fails as a primary key would.
                table: dict[Any, dict[str, Any]]
                columns: tuple[str, ...]
                if kind == "start":
                    table, key, new = self.invocations, row[0], _NEW_INVOCATION
                    columns = _planner.INVOCATION_INSERT
                else:
                    table, key, new = self.attempts, (row[0], row[1]), _NEW_ATTEMPT
                    columns = _planner.ATTEMPT_INSERT
                if key in table:
                    raise KeyError(f"{key!r} already exists")
                table[key] = {**new, **dict(zip(columns, row, strict=True))}
            elif kind == "open":
                if (row[0], row[1]) in self.segments:
                    raise KeyError(f"segment {row[1]} of {row[0]} already exists")
                self.segments[(row[0], row[1])] = {
                    **dict(zip(_planner.SEGMENT_OPEN, row, strict=True)),
                    "ended_at": None, "outcome": None}
            elif kind == "close":
                segment = self.segments.get((row[-2], row[-1]))
                if segment is not None:
                    segment.update(zip(_planner.SEGMENT_CLOSE, row[:-2], strict=True))
                    changed += 1
            elif kind == "settle":
                attempt = self.attempts.get((row[-2], row[-1]))
                if attempt is not None and attempt["outcome"] == "dispatched":
                    attempt.update(zip(_planner.ATTEMPT_SETTLE, row[:-2], strict=True))
                    changed += 1
            elif kind == "add":
                invocation = self.invocations[row[-1]]
                for n, column in enumerate(_planner.DELTA_COLUMNS):
                    invocation[column] = (max(invocation[column], row[n])
                                          if n == _planner.INCOMPLETE
                                          else invocation[column] + row[n])
                changed += 1
            else:
                invocation = self.invocations[row[-1]]
                # What it must still be (`_planner.Batch.ends`).
                outcome, expect = row[-3], row[-2]
                if expect is None or (invocation["outcome"] == outcome
                                      and (invocation["pause_seal"] or "") == expect):
                    invocation.update(zip(_planner.END_SET, row[:-3], strict=True))
                    changed += 1
        return changed
