"""The facts a ledger stores: operational facts only, never conversation content.

None of these records has a field for message text, system prompts, tool
inputs or outputs, or keys; a ledger cannot store what it is never given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from loopengine._usage import Usage

__all__ = ["AttemptDispatch", "AttemptRecord", "AttemptSettle", "InvocationEnd",
           "InvocationStart"]


@dataclass(frozen=True, slots=True, kw_only=True)
class InvocationStart:
    """An invocation (one run or call) begins; its row is written as ``running``."""

    id: str
    operation: str
    operation_version: str
    provider: str
    model: str
    tenant: str | None
    user_id: str | None
    feature: str | None
    correlation_id: str | None
    started_at: datetime
    parent_invocation_id: str | None = None
    """The invocation whose tool started this one (a sub-agent), or None for a root."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptDispatch:
    """An attempt is about to go on the wire; its row is written as ``dispatched``."""

    invocation_id: str
    ordinal: int
    """1-based dispatch order over the whole invocation."""
    turn: int
    attempt: int
    """1-based dispatched try within the turn (continuations included)."""
    phase: str
    """``turn``, ``repair``, ``continuation``, ``fallback`` or ``wrap_up``."""
    served_by: str
    started_at: datetime
    max_tokens: int
    timeout_ms: int
    wait_ms: int
    """Backoff slept before this attempt."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptSettle:
    """An attempt came back (or was cut); its row is settled."""

    invocation_id: str
    ordinal: int
    outcome: str
    """``ok``, ``error`` or ``aborted``."""
    latency_ms: int
    fault: str | None = None
    aborted_reason: str | None = None
    http_status: int | None = None
    error_code: str | None = None
    usage: Usage | None = None
    usage_approx: bool = False
    cost_nanousd: int | None = None
    fee_nanousd: int | None = None
    """The part of ``cost_nanousd`` that is per-request fees (web searches...); None
    when the attempt was not priced."""
    charged: bool = False
    price_ref: str | None = None
    response_id: str | None = None
    request_id: str | None = None
    stop_reason: str | None = None

    @property
    def served(self) -> bool:
        """The provider served something this settle carries: a reply, usage (what
        it may bill) or a response id. Such a settle must be durable before
        anything acts on the attempt (docs/ledger.md); one that carries nothing
        served (an error status, a request the ledger held back, a timeout
        before any byte) may wait for the next durable write."""
        return self.outcome == "ok" or self.usage is not None or self.response_id is not None


@dataclass(frozen=True, slots=True, kw_only=True)
class InvocationEnd:
    """An invocation ended; its row is settled with the outcome. A pause is
    recorded so too (outcome ``paused``), and a resume (``running``, with no
    ``ended_at``): neither ends it."""

    id: str
    ended_at: datetime | None
    outcome: str
    turns: int
    tool_calls: int
    credits: int
    at: datetime | None = None
    """When it was written (a resume's running segment starts then); None:
    ``ended_at``, or the system's time when that is None too."""
    seal: str | None = None
    """A pause's seal (`loopengine.RunState.seal` of the state it returned),
    kept while it is paused, or a resume's token of its own (so a commit lost
    on the way is read back as its, never another resume's); None otherwise."""
    expect_seal: str | None = None
    """A compare-and-set on the pause (a resume's, a pause timeout's end): the
    row must still be ``paused`` with this seal (``""``: a pause that recorded
    none), or the write changes nothing and is refused (another resume took
    the pause). None: no condition."""
    expect_outcome: str = "paused"
    """The outcome ``expect_seal``'s condition holds the row to: ``paused`` (a
    resume's, a pause timeout's end), or ``running``: the end or pause of a
    segment that holds a run store's lease, with its own token (``""`` for a
    run's first segment), so a segment whose run another process took over
    ends nothing of it; or a recovery ending a run its dead process left
    running (a sub-agent's, docs/pause-and-resume.md, ``keep_segment``),
    which must still be running, so it is ended once."""
    keep_segment: bool = False
    """The end leaves the row's open segment open, as a dead process left it
    (a recovery ending a run that process left running)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class InvocationProgress:
    """An invocation's committed progress, as a ledger reads it back: what a
    resumed run enforces its budgets from (never from the state it was given)."""

    outcome: str
    """``running``, ``paused``, or how it ended."""
    ended_at: datetime | None
    """When it ended, or paused (None while running)."""
    turns: int
    """Turns recorded at its last pause or end."""
    tool_calls: int
    """Tool budget consumed, recorded at its last pause or end."""
    credits: int
    """Credits charged, recorded at its last pause or end."""
    attempt_count: int
    """Attempts dispatched (every one, past the retention cap too)."""
    cost_nanousd: int
    """The charged cost of its settled attempts."""
    provider_cost_nanousd: int
    """The cost of every priced attempt."""
    usage: Usage = field(default_factory=Usage)
    """The usage of its settled attempts (every one, past the retention cap too),
    without their sampling iterations."""
    seal: str | None = None
    """The seal of its pause while it is paused (`InvocationEnd.seal`)."""
    iterations: int = 0
    """The sampling iterations its settled attempts reported, summed
    (`Usage.reported_iterations`), which ``usage`` does not list."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptRecord:
    """One attempt, dispatched and settled: what `RunResult.attempt_log` holds."""

    dispatch: AttemptDispatch
    settle: AttemptSettle | None
    """None while the attempt is on the wire."""

    @property
    def ordinal(self) -> int:
        """The attempt's dispatch order in its invocation."""
        return self.dispatch.ordinal

    @property
    def outcome(self) -> str:
        """``dispatched`` while on the wire, then ``ok``, ``error`` or ``aborted``."""
        return self.settle.outcome if self.settle else "dispatched"
