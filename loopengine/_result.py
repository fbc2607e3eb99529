"""`RunResult` and `AttemptsSummary`: what a run returns, whatever its outcome."""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from loopengine._errors import OutcomeError
from loopengine._outcome import Outcome
from loopengine._runstate import PendingCall, RunState
from loopengine._usage import Usage
from loopengine.guards._checkpoints import GuardTrip
from loopengine.persistence._records import AttemptRecord
from loopengine.providers._faults import ProviderError, ProviderFault

__all__ = ["AttemptsSummary", "RunResult"]


@dataclass(frozen=True, slots=True)
class AttemptsSummary:
    """The provider requests a run or call really made."""

    count: int
    """Every wire request, retries, continuations and repairs included."""
    output_tokens: int
    """Output tokens summed over the attempts that reported usage."""
    usage_complete: bool
    """False when some attempt reported no usage, or only a floor of it (a cut
    stream, or cache writes whose lifetime the reply does not tell,
    ``usage_approx``): ``output_tokens`` (or the cost) is then a floor. An
    attempt with no reply counts too (a 529, a refused connection), though the
    audit lists only answered ones as usage unknown; not `incomplete`, which
    is about the ledger's rows (docs/ledger.md)."""
    retained: int
    """Attempt rows the ledger kept (0 without a ledger)."""
    incomplete: bool
    """True when the ledger kept fewer rows than attempts were made (R07)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunResult:
    """The outcome of `Engine.run`, with its whole transcript and accounting.

    An outcome is a value, not an exception: call `raise_for_outcome` to turn
    anything but ``completed`` into one.
    """

    outcome: Outcome
    """How the run ended."""
    answer: Any
    """The accepted answer (text, or a model instance in structured mode); None otherwise."""
    turns: int
    """Turn requests sent."""
    tool_calls: int
    """Tool budget consumed: answered calls plus returned rejections."""
    usage: Usage
    """Tokens summed over every attempt that reported usage (what was served)."""
    cost_usd: Decimal
    """The charged cost: successful attempts only (S01)."""
    provider_cost_usd: Decimal
    """The cost of every attempt that reported usage: what the provider may bill."""
    credits: int
    """Accumulated rounded turn charges (R03) of this run's own turns."""
    attempts: AttemptsSummary
    """The wire requests made."""
    invocation_id: str
    """The ledger id of this run."""
    messages: list[dict[str, Any]]
    """The transcript: the given messages, every response and every tool result.

    Always a history to continue from: a tool call the run did not run (a
    refused batch, a deadline) is closed with an ``is_error`` result saying
    why, so appending a user message and calling `Engine.run` again is valid.
    A ``paused`` run's last reply still waits for its calls' results: continue
    it with `Engine.resume`."""
    trip: GuardTrip | None = None
    """The guard that ended the run, if one did."""
    fault: ProviderFault | None = None
    """The last provider fault, when one ended the run."""
    unpriced: bool = False
    """True when some attempt could not be priced (its cost is not in ``cost_usd``)."""
    detail: str = ""
    """Why the run ended, in a sentence."""
    credits_total: int = 0
    """``credits`` plus those of the runs it delegated to (sub-agents, theirs
    included): what its hold counted and its account is charged (docs/tools.md)."""
    attempt_log: tuple[AttemptRecord, ...] = field(default=(), repr=False)
    """Every attempt of this running segment, dispatched and settled, in order."""
    pending: tuple[PendingCall, ...] = ()
    """For ``paused``: the tool calls that wait for a decision (`Engine.resume`)."""
    state: RunState | None = field(default=None, repr=False)
    """For ``paused`` (and a resume denied admission): what `Engine.resume`
    continues from. It holds the transcript: store it where conversation text
    may be kept."""

    @property
    def completed(self) -> bool:
        """True when the outcome is ``completed``."""
        return self.outcome is Outcome.COMPLETED

    def raise_for_outcome(self) -> RunResult:
        """Return self when completed, else raise.

        Raises:
            ProviderError: the run ended with ``provider_error`` or ``credit_exhausted``.
            OutcomeError: the run ended with any other outcome.
        """
        if self.outcome is Outcome.COMPLETED:
            return self
        message = f"run {self.invocation_id} ended {self.outcome.value}: {self.detail}"
        if self.fault is not None and self.outcome in (
            Outcome.PROVIDER_ERROR, Outcome.CREDIT_EXHAUSTED
        ):
            raise ProviderError(message, fault=self.fault, outcome=self.outcome.value,
                                attempts=self.attempts.count, result=self)
        raise OutcomeError(message, outcome=self.outcome.value, attempts=self.attempts.count,
                           result=self)
