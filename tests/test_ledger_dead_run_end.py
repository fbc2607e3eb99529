"""The ledger's end of a run its dead process left running (a sub-agent's, ended
by its root's recovery: docs/pause-and-resume.md): a compare-and-set on the row
still being ``running``, through the one writer every store shares, on each
store, through two connections as two processes hold them."""

from __future__ import annotations

from typing import Any

import pytest

import loopengine as le
from loopengine.persistence import MemoryLedger
from loopengine.persistence._records import (
    AttemptDispatch,
    AttemptSettle,
    InvocationEnd,
    InvocationProgress,
)

from .test_pause_seal import AT, _end, _start, two_handles  # noqa: F401 - a fixture


def _dead_end(invocation_id: str, credits: int) -> InvocationEnd:
    return InvocationEnd(id=invocation_id, ended_at=AT, outcome="failed", turns=0,
                         tool_calls=0, credits=credits, expect_outcome="running",
                         expect_seal="", keep_segment=True)


async def _segments(ledger: Any, invocation_id: str) -> list[tuple[Any, ...]]:
    """``(ordinal, ended_at, outcome)`` of each segment of the invocation."""
    if isinstance(ledger, MemoryLedger):
        return [(ordinal, row["ended_at"], row["outcome"])
                for (owner, ordinal), row in sorted(ledger.segments.items())
                if owner == invocation_id]
    await ledger.flush()
    found = await ledger._transact_qmark(lambda conn: conn.execute(
        "SELECT ordinal, ended_at, outcome FROM segments WHERE invocation_id = ? "
        "ORDER BY ordinal", (invocation_id,)).fetchall(), "read")
    return [tuple(r) for r in found]


async def _progress(ledger: Any, invocation_id: str) -> InvocationProgress:
    found = await ledger.read_progress(invocation_id)
    assert found is not None
    return found


async def test_a_run_left_running_is_ended_once_its_attempts_and_open_segment_kept(
        two_handles: tuple[Any, Any]) -> None:  # noqa: F811 - the fixture imported
    """Ended ``failed`` with the credits given, its unsettled attempt still
    dispatched and its segment still open (its process died there); a second
    such end, through the other connection, is refused and changes nothing."""
    one, two = two_handles
    await one.start_invocation(_start("child"))
    await one.dispatch_attempt(AttemptDispatch(
        invocation_id="child", ordinal=1, turn=1, attempt=1, phase="turn", served_by="m",
        started_at=AT, max_tokens=10, timeout_ms=1000, wait_ms=0))
    await one.settle_attempt(AttemptSettle(invocation_id="child", ordinal=1, outcome="ok",
                                           latency_ms=5, usage=le.Usage(10, 5),
                                           cost_nanousd=70, charged=True))
    await one.dispatch_attempt(AttemptDispatch(
        invocation_id="child", ordinal=2, turn=2, attempt=1, phase="turn", served_by="m",
        started_at=AT, max_tokens=10, timeout_ms=1000, wait_ms=0))
    await two.end_invocation(_dead_end("child", 7))
    ended = await _progress(one, "child")
    assert (ended.outcome, ended.credits, ended.attempt_count, ended.cost_nanousd) == \
        ("failed", 7, 2, 70)
    assert await _segments(one, "child") == [(1, None, None)]
    with pytest.raises(le.LedgerError):
        await one.end_invocation(_dead_end("child", 9))
    assert await _progress(two, "child") == ended


async def test_the_end_of_a_run_left_running_leaves_a_paused_or_ended_run_alone(
        two_handles: tuple[Any, Any]) -> None:  # noqa: F811 - the fixture imported
    """A paused run and an ended one are not running: the end is refused, and
    they stay as they were."""
    one, two = two_handles
    await one.start_invocation(_start("paused"))
    await one.end_invocation(_end("paused", "paused", seal="s1"))
    await one.start_invocation(_start("done"))
    await one.end_invocation(_end("done", "completed"))
    for invocation_id in ("paused", "done"):
        before = await _progress(two, invocation_id)
        with pytest.raises(le.LedgerError):
            await two.end_invocation(_dead_end(invocation_id, 3))
        assert await _progress(one, invocation_id) == before
    assert (await _progress(one, "paused")).seal == "s1"
