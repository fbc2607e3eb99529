"""`Outcome`: how a conversation ended (a contract: the ledger stores these)."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["Outcome"]


class Outcome(StrEnum):
    """How a run or call ended.

    A run always ends with one of the values from ``COMPLETED`` to
    ``ADMISSION_DENIED``, or stops ``PAUSED`` until it is resumed;
    ``RUNNING``, ``CANCELLED`` and ``FAILED`` appear only in the ledger and
    in `loopengine.events.RunEnded` (a run still in progress, one the caller
    cancelled, and one that raised an error: the cancellation or the error
    propagated instead of becoming a result).
    """

    COMPLETED = "completed"
    """An answer was accepted."""
    TURN_LIMIT = "turn_limit"
    """``max_turns`` turn requests were sent without an accepted answer (R01)."""
    TOOL_BATCH_LIMIT = "tool_batch_limit"
    """One turn asked for more tool calls than ``max_tool_batch`` (R02)."""
    TOOL_LIMIT = "tool_limit"
    """The tool budget (``max_tool_calls``) could not answer the next batch (R02, R10)."""
    CREDIT_LIMIT = "credit_limit"
    """The accumulated rounded turn charges exceeded ``credit_hold`` (R03)."""
    TIME_LIMIT = "time_limit"
    """No time remained for another request (R04)."""
    REFUSED = "refused"
    """The model refused (``stop_reason == "refusal"``, R11)."""
    INCOMPLETE = "incomplete"
    """The answer was cut off (``max_tokens``, context window), never accepted (R11);
    or a delegated run's tool batch needed approval, which nothing could give
    it (docs/tools.md): none of the batch ran."""
    PROVIDER_ERROR = "provider_error"
    """A provider fault that was permanent, or whose retries ran out (R05)."""
    CREDIT_EXHAUSTED = "credit_exhausted"
    """The provider account has no balance or hit its spend limit (R06)."""
    ADMISSION_DENIED = "admission_denied"
    """The run's credit account had nothing available to reserve: nothing was sent."""
    PAUSED = "paused"
    """The run waits for decisions on its pending tool calls (``result.pending``);
    `Engine.resume` continues it as the same invocation (docs/pause-and-resume.md)."""
    RUNNING = "running"
    """Ledger only: the invocation has not ended (or its process died)."""
    CANCELLED = "cancelled"
    """Ledger only: the caller cancelled the run."""
    FAILED = "failed"
    """Ledger only: the run raised an error instead of reaching an outcome (a
    `LedgerError`, or a provider's `LoopEngineError` such as a diverged replay)."""
