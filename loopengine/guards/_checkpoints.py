"""The checkpoint functions: pure functions of the conversation state.

Each returns a `GuardTrip` when the conversation must end there, or None. They
do no I/O and read no clock: the engine passes the time in. The engine calls
them in the fixed order of docs/guards.md; this module only decides.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from loopengine._outcome import Outcome
from loopengine.guards._deadline import Deadline
from loopengine.guards._limits import Limits

__all__ = [
    "ConversationState",
    "GuardTrip",
    "attempt_timeout",
    "check_before_attempt",
    "check_before_turn",
    "check_admission",
    "check_credits",
    "check_delegated_credits",
    "check_rejection_budget",
    "check_terminal",
    "check_tool_batch",
    "needs_crossing_permit",
    "unconfirmed_by_deadline",
]

TERMINAL_STOP_REASONS = {
    "refusal": Outcome.REFUSED,
    "max_tokens": Outcome.INCOMPLETE,
    "model_context_window_exceeded": Outcome.INCOMPLETE,
}


@dataclass(frozen=True, slots=True)
class ConversationState:
    """What the guards see of a conversation between two checkpoints."""

    turns: int
    """Turn requests sent so far (a turn's retries and continuations are not turns)."""
    tool_calls: int
    """Tool budget consumed: answered tool calls plus returned rejections."""
    credits: int
    """Accumulated rounded turn charges."""
    deadline: Deadline
    """The conversation's absolute deadline."""


@dataclass(frozen=True, slots=True)
class GuardTrip:
    """A guard that ended the conversation, with what it saw."""

    outcome: Outcome
    """The outcome the conversation ends with."""
    guard: str
    """Which guard: ``max_turns``, ``total_time``, ``max_tool_batch``,
    ``max_tool_calls``, ``credit_hold`` or ``stop_reason``."""
    observed: float | int | str
    """The value the guard observed."""
    limit: float | int | str | None
    """The limit it was compared with."""
    message: str
    """A sentence for people."""


def check_before_turn(state: ConversationState, limits: Limits, now: float) -> GuardTrip | None:
    """Before each turn: the turn limit (R01), then the time limit (R04)."""
    if state.turns >= limits.max_turns:
        return GuardTrip(
            Outcome.TURN_LIMIT,
            "max_turns",
            state.turns,
            limits.max_turns,
            f"{state.turns} turns sent without an accepted answer (max_turns={limits.max_turns})",
        )
    return check_before_attempt(state, limits, now)


def check_before_attempt(
    state: ConversationState, limits: Limits, now: float
) -> GuardTrip | None:
    """Before each wire request (retries included): no request once no time remains (R04)."""
    if state.deadline.expired(now):
        return _time_limit(limits, "no time remains for another request")
    return None


def _time_limit(limits: Limits, why: str) -> GuardTrip:
    """The time limit's trip (R04), ``why`` said with the limit."""
    return GuardTrip(Outcome.TIME_LIMIT, "total_time", 0.0, limits.total_time,
                     f"{why} (total_time={limits.total_time})")


def attempt_timeout(limits: Limits, deadline: Deadline, now: float,
                    effective: float = math.inf) -> float:
    """The timeout of the next attempt: ``min(attempt_timeout, remaining)`` (R04),
    where the time remaining ends at the run's deadline or at ``effective``, the
    earliest deadline around the run (the caller's own), whichever comes first."""
    return max(0.0, min(limits.attempt_timeout, deadline.remaining(now), effective - now))


def unconfirmed_by_deadline(limits: Limits, what: str) -> GuardTrip:
    """The time limit, when the ledger (or the account) did not confirm ``what``
    (the attempt, the reply, the reservation) before the deadline: nothing may
    be sent, or act on a reply, that is not recorded (R04)."""
    return _time_limit(limits, f"the ledger did not record {what} before the deadline")


def check_admission(account: str, reserved: int, available: int, hold: int,
                    fees: int = 0, spent: int = 0) -> GuardTrip | None:
    """Admission (docs/accounts.md): a run whose account had nothing to reserve for its
    hold (past ``fees``, the worst case of one turn's server-tool fees, reserved
    on top) is denied before any request; a partial reservation narrows the hold.

    ``hold`` is what the run asked to reserve; a resumed run asks for what its
    hold leaves after the ``spent`` credits settled at its pause (a credit, when
    it leaves none), and its message says so."""
    if reserved > 0:
        return None
    asked = (f"this run's hold of {hold}" if not spent else
             f"the {hold} credit{'s' if hold != 1 else ''} this resumed run asks for "
             f"({spent} of its hold already spent)")
    return GuardTrip(
        Outcome.ADMISSION_DENIED,
        "account",
        available,
        hold,
        # The figure `audit accounts` and `balance` show: an account a run's
        # crossing turn overdrew stays below zero until granted more.
        f"account {account!r} has {available} credits available"
        f"{' (overdrawn)' if available < 0 else ''}, "
        f"nothing to reserve for {asked}"
        + (f" past the worst case of a turn's server-tool fees ({fees})" if fees else ""),
    )


def check_terminal(stop_reason: str | None) -> GuardTrip | None:
    """A terminal response: a refusal or a cut-off answer ends the run (R11)."""
    outcome = TERMINAL_STOP_REASONS.get(stop_reason or "")
    if outcome is None:
        return None
    return GuardTrip(
        outcome,
        "stop_reason",
        str(stop_reason),
        None,
        f"the response stopped with {stop_reason!r}",
    )


def _remaining_budget(state: ConversationState, limits: Limits) -> int | None:
    if limits.max_tool_calls is None:
        return None
    return max(0, limits.max_tool_calls - state.tool_calls)


def check_rejection_budget(state: ConversationState, limits: Limits) -> GuardTrip | None:
    """A rejected answer needs one unit of tool budget to be returned (R10)."""
    remaining = _remaining_budget(state, limits)
    if remaining is not None and remaining < 1:
        return GuardTrip(
            Outcome.TOOL_LIMIT,
            "max_tool_calls",
            state.tool_calls + 1,
            limits.max_tool_calls,
            "the tool budget is spent, so the rejected answer cannot be returned "
            f"for repair (max_tool_calls={limits.max_tool_calls})",
        )
    return None


def check_tool_batch(
    state: ConversationState, limits: Limits, batch_size: int
) -> GuardTrip | None:
    """A tool batch: larger than ``max_tool_batch``, or than the budget left (R02)."""
    if limits.max_tool_batch is not None and batch_size > limits.max_tool_batch:
        return GuardTrip(
            Outcome.TOOL_BATCH_LIMIT,
            "max_tool_batch",
            batch_size,
            limits.max_tool_batch,
            f"one turn asked for {batch_size} tool calls (max_tool_batch={limits.max_tool_batch})",
        )
    remaining = _remaining_budget(state, limits)
    if remaining is not None and batch_size > remaining:
        return GuardTrip(
            Outcome.TOOL_LIMIT,
            "max_tool_calls",
            state.tool_calls + batch_size,
            limits.max_tool_calls,
            f"{batch_size} tool calls asked for with {remaining} left in the budget "
            f"(max_tool_calls={limits.max_tool_calls})",
        )
    return None


def check_credits(state: ConversationState, limits: Limits) -> GuardTrip | None:
    """Credits: an accumulated total *greater* than the hold ends the run (R03)."""
    if limits.credit_hold is not None and state.credits > limits.credit_hold:
        return GuardTrip(
            Outcome.CREDIT_LIMIT,
            "credit_hold",
            state.credits,
            limits.credit_hold,
            f"{state.credits} credits charged, more than the hold of {limits.credit_hold}",
        )
    return None


def check_delegated_credits(tree: Sequence[tuple[int | None, int]]) -> GuardTrip | None:
    """Before a turn, in a tree of delegated runs (sub-agents, docs/tools.md): each
    ``(credit_hold, credits)`` of the run and of its ancestors, ``credits``
    counting that run's own turns plus its descendants'. One past its hold
    ends the run ``credit_limit`` without sending (R03: the tree passes a hold
    by the crossing turns only)."""
    for hold, credits in tree:
        if hold is not None and credits > hold:
            return GuardTrip(
                Outcome.CREDIT_LIMIT,
                "credit_hold",
                credits,
                hold,
                f"{credits} credits charged by a run and the runs it delegated to, more "
                f"than its hold of {hold}",
            )
    return None


def needs_crossing_permit(tree: Sequence[tuple[int | None, int]]) -> bool:
    """Whether a turn must hold its tree's crossing permit from its send until its
    charge is added (docs/tools.md): whenever a hold is set on the run or above it.

    ``tree`` is `check_delegated_credits`'s. A turn's charge is not known until
    its reply, so any turn under a hold may be the one that crosses it. With
    one such turn in flight at a time in a tree, and the holds checked once
    the permit is held, every turn starts with each hold above it not passed:
    the whole tree passes each hold by its one crossing turn at most (R03).
    """
    return any(hold is not None for hold, _ in tree)
