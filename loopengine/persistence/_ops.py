"""The ledger's records as the planner's ops (`_planner`), for every store.

Each builder returns ``[kind, 0, *fields]``: the store numbers the op in
place of the 0 when it queues it. Times become fixed-width ISO-8601 UTC text
(`format_time`), which SQLite stores as it is and PostgreSQL reads as
``timestamptz``.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime

from loopengine import _validate
from loopengine.persistence._planner import DISPATCH, END, SETTLE, START, Op
from loopengine.persistence._records import (
    AttemptDispatch,
    AttemptSettle,
    InvocationEnd,
    InvocationStart,
)
from loopengine.persistence._schema import format_time

__all__ = ["check_arguments", "dispatch_op", "end_op", "settle_op", "start_op"]


def start_op(r: InvocationStart) -> Op:
    """The START op of an invocation."""
    return [START, 0, r.id, r.operation, r.operation_version, r.provider, r.model, r.tenant,
            r.user_id, r.feature, r.correlation_id, format_time(r.started_at),
            r.parent_invocation_id]


def dispatch_op(r: AttemptDispatch) -> Op:
    """The DISPATCH op of an attempt."""
    return [DISPATCH, 0, r.invocation_id, r.ordinal, r.turn, r.attempt, r.phase, r.served_by,
            format_time(r.started_at), r.max_tokens, r.timeout_ms, r.wait_ms]


def settle_op(r: AttemptSettle) -> Op:
    """The SETTLE op of an attempt (its token and usage counts None without usage)."""
    usage = r.usage
    if usage is None:
        tokens: tuple[int | None, ...] = (None, None, None, None, None)
        counts: tuple[int | None, ...] = (None, None, None, None)
    else:
        tokens = (usage.input_tokens, usage.output_tokens, usage.cache_read_tokens,
                  usage.cache_write_tokens, usage.cache_write_1h_tokens)
        counts = (usage.web_search_requests, usage.web_fetch_requests, usage.reasoning_tokens,
                  usage.reported_iterations)
    return [SETTLE, 0, r.invocation_id, r.ordinal, r.outcome, r.latency_ms, r.fault,
            r.aborted_reason, r.http_status, r.error_code, *tokens, int(r.usage_approx),
            r.cost_nanousd, int(r.charged), r.price_ref, r.response_id, r.request_id,
            r.stop_reason, *counts,
            # A priced attempt has a fee part, 0 when it ran no paid request.
            r.fee_nanousd if r.fee_nanousd is not None or r.cost_nanousd is None else 0]


def end_op(r: InvocationEnd) -> Op:
    """The END op of an invocation."""
    ended_at = None if r.ended_at is None else format_time(r.ended_at)
    at = r.at or r.ended_at or datetime.now(UTC)
    return [END, 0, r.id, ended_at, r.outcome, r.turns, r.tool_calls, r.credits, r.seal,
            format_time(at), r.expect_seal, r.expect_outcome, int(r.keep_segment)]


def check_arguments(*, max_retained_attempts: object, max_batch: object,
                    seconds: Mapping[str, object]) -> None:
    """The arguments every store takes: a positive retention cap and batch size,
    and finite non-negative seconds (each named in ``seconds``).

    Raises:
        ConfigError: the first argument that is not so (``.field`` names it).
    """
    _validate.integer("max_retained_attempts", max_retained_attempts, minimum=1)
    for label, value in seconds.items():
        _validate.seconds(label, value, positive=False)
    _validate.integer("max_batch", max_batch, minimum=1)
