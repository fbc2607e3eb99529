"""Guards: the limits of a conversation and the pure checks made at each checkpoint."""

from loopengine.guards._checkpoints import (
    ConversationState,
    GuardTrip,
    attempt_timeout,
    check_admission,
    check_before_attempt,
    check_before_turn,
    check_credits,
    check_delegated_credits,
    check_rejection_budget,
    check_terminal,
    check_tool_batch,
    needs_crossing_permit,
    unconfirmed_by_deadline,
)
from loopengine.guards._credits import turn_credits
from loopengine.guards._deadline import Deadline
from loopengine.guards._limits import Limits

__all__ = [
    "ConversationState",
    "Deadline",
    "GuardTrip",
    "Limits",
    "attempt_timeout",
    "check_before_attempt",
    "check_admission",
    "check_before_turn",
    "check_credits",
    "check_delegated_credits",
    "check_rejection_budget",
    "check_terminal",
    "check_tool_batch",
    "needs_crossing_permit",
    "turn_credits",
    "unconfirmed_by_deadline",
]
