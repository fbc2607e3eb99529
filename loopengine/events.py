"""Events: typed, frozen facts about a run, delivered to observers as they happen.

An observer is any callable taking one event, sync or async, given as
``Engine(provider, observers=[...])``. Observers are called in order, and the
run waits for them (not always from the task awaiting the run: a tool call's
events come from its own task, and on asyncio a run's end from a task the run
awaits, docs/observability.md); one that raises is logged and never changes
the run. Events carry
operational facts only, never message text or tool data.

Order within a run: `RunStarted`; per turn `TurnStarted`, then per attempt
`AttemptStarted` and `AttemptSettled`; `ToolCallEvent` (``started``, then
``succeeded`` or ``failed``) for each call; `GuardTripped` when a guard ends
the run; `RunEnded` last (also for a cancelled run, with outcome
``cancelled``, and for one that raised an error, with outcome ``failed``).

A run that pauses for approval (docs/pause-and-resume.md) ends its running
segment with `RunPaused` instead of `RunEnded`; its resume begins the next
segment with `RunResumed` instead of `RunStarted`, with the same ``run_id``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Literal

from loopengine._usage import Usage

__all__ = [
    "AttemptSettled",
    "AttemptStarted",
    "Event",
    "GuardTripped",
    "Observer",
    "RunEnded",
    "RunPaused",
    "RunResumed",
    "RunSegment",
    "RunStarted",
    "RunTotals",
    "TextDelta",
    "ToolCallEvent",
    "TurnStarted",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """Fields every event has."""

    run_id: str
    """The invocation id of the run (or call)."""
    at: datetime
    """When it happened (UTC, from the engine's clock)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSegment(Event):
    """The fields of an event that begins a running segment of an invocation
    (`RunStarted`, `RunResumed`)."""

    operation: str
    operation_version: str
    provider: str
    model: str
    kind: Literal["run", "call"]
    tenant: str | None = None
    feature: str | None = None
    correlation_id: str | None = None
    """The caller's correlation id (`loopengine.Attribution`), if it gave one."""
    vendor: str | None = None
    """Whose API serves the route (``anthropic`` for a route named
    ``anthropic-eu``): what ``served_by`` and prices name."""
    genai_operation: str | None = None
    """What the route's requests are, as the OpenTelemetry GenAI conventions
    name the operation (`loopengine.providers.Provider.genai_operation`):
    ``chat``, or ``generate_content`` for Gemini's."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunStarted(RunSegment):
    """A run or structured call began."""

    parent_invocation_id: str | None = None
    """The run whose tool started this one (a delegated run, docs/tools.md), or None."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnStarted(Event):
    """A turn's first attempt is about to be sent (a turn refused before any
    request, for lack of time, is never announced)."""

    turn: int
    phase: str
    """``turn``, ``repair``, ``fallback`` or ``wrap_up`` (the last turn, sent without tools)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class _Attempt(Event):
    """The identity of an attempt, which its start and its settle both carry
    (as its dispatch records it)."""

    ordinal: int
    turn: int
    attempt: int
    phase: str
    served_by: str
    provider: str
    model: str
    max_tokens: int


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptStarted(_Attempt):
    """An attempt was recorded as dispatched and goes on the wire."""

    timeout_ms: int
    wait_ms: int


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptSettled(_Attempt):
    """An attempt came back or failed."""

    outcome: str
    """``ok``, ``error`` or ``aborted``."""
    latency_ms: int
    fault: str | None
    """The `FaultKind` value, for failed attempts."""
    http_status: int | None
    error_code: str | None
    aborted_reason: str | None
    usage: Usage | None
    usage_approx: bool
    cost_usd: Decimal | None
    """This attempt's price, or None when unpriced or without usage."""
    charged: bool
    response_id: str | None
    request_id: str | None
    stop_reason: str | None
    response_model: str | None = None
    """The model the provider says served the reply, when it says."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GuardTripped(Event):
    """A guard ended the run."""

    guard: str
    """``max_turns``, ``total_time``, ``max_tool_batch``, ``max_tool_calls``,
    ``credit_hold`` or ``stop_reason``."""
    observed: float | int | str
    limit: float | int | str | None
    outcome: str
    message: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCallEvent(Event):
    """A tool call started or finished: the ``tool.call`` payload's fields
    (docs/observability.md, "Fields").

    The accounting detail (tokens, model, provider, spend) is that of the turn
    whose response asked for the call.
    """

    tool_name: str
    status: Literal["started", "succeeded", "failed"]
    latency_ms: int
    """0 for ``started``."""
    token_cost: int
    """All tokens of the asking turn: input (cached included) plus output."""
    input_tokens: int
    """The asking turn's input tokens, cached included."""
    output_tokens: int
    model_id: str
    provider: str
    spend_usd: Decimal
    """The asking turn's charged cost."""
    tool_use_id: str
    turn: int
    error: str | None = None
    """For ``failed``: why (``unknown tool``, ``invalid input``, ``handler raised
    <ExceptionType>``, ``deadline``, ``cancelled``...; docs/observability.md)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunTotals(Event):
    """The fields of an event that ends a running segment of an invocation
    (`RunEnded`, `RunPaused`): the invocation's totals so far."""

    turns: int
    """Turns sent (every segment)."""
    tool_calls: int
    """Tool budget consumed."""
    attempts: int
    """Attempts made."""
    usage: Usage
    """Usage of the attempts that reported it."""
    cost_usd: Decimal
    """The charged cost."""
    credits: int
    """Credits charged (a pause settles them on the account)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunEnded(RunTotals):
    """The run ended (also when cancelled: outcome ``cancelled``; when it raised
    an error instead of reaching an outcome: ``failed``)."""

    outcome: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RunPaused(RunTotals):
    """The run paused: tool calls of its last reply wait for decisions
    (`loopengine.RunResult.pending`); nothing runs until `Engine.resume`.
    Emitted once per pause, in place of `RunEnded`."""

    pending: int
    """Tool calls waiting for a decision."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunResumed(RunSegment):
    """A paused run was resumed (`Engine.resume`): the same invocation begins
    its next running segment. Emitted once per resume, in place of `RunStarted`."""

    paused_seconds: float = 0.0
    """How long the run waited (wall time between its pause and this resume)."""
    turns: int = 0
    """Turns sent before the pause (from the ledger when the run has one)."""
    tool_calls: int = 0
    """Tool budget consumed before the pause."""
    attempts: int = 0
    """Attempts made before the pause."""
    credits: int = 0
    """Credits charged before the pause."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TextDelta(Event):
    """A piece of streamed answer text, for `loopengine.Engine.stream` only.

    It carries conversation text, so observers never get it (they see
    operational facts only). A retried attempt streams its own text from the
    start: tell the attempts apart by ``attempt`` (or ``ordinal``)."""

    turn: int
    attempt: int
    """The try within the turn, as in `AttemptStarted`."""
    ordinal: int
    """The attempt's dispatch order in the run, as in the ledger."""
    text: str


Observer = Callable[[Event], Awaitable[None] | None]
"""An observer: any callable taking one event, sync or async."""
