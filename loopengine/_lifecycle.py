"""The lifecycle of a run or call: its start, its end, and the cleanup nothing
interrupts.

`begin` records the invocation running and admits it on its account;
`finish` records its outcome; `ending` (or `stop_outcome` and `stopped`, for
a body that keeps the handling in its own frame) records a run that stopped
without an outcome, ``cancelled`` or ``failed``. Once begun, an invocation
is always ended: the cleanup runs to its end through any cancellation
(`uninterrupted`), `RunEnded` is announced once, and the exception
propagates.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from datetime import datetime

import anyio
import anyio.lowlevel

from loopengine._admission import admit, settle_account
from loopengine._attempt import settle
from loopengine._errors import LedgerError, LoopEngineError, RunBusyError
from loopengine._invocation import LEDGER_GRACE, Invocation
from loopengine._raised import stray_cancellation
from loopengine.events import GuardTripped, RunEnded, RunStarted
from loopengine.guards._checkpoints import GuardTrip
from loopengine.persistence._records import InvocationEnd, InvocationStart

__all__ = ["begin", "end_paused", "ending", "finish", "first_error", "forget_run", "held_end",
           "stop_outcome", "stopped", "uninterrupted", "write_row"]

logger = logging.getLogger("loopengine")

Progress = Callable[[], tuple[int, int, int]]
"""Gives a run's ``(turns, tool_calls, credits)`` so far."""


async def uninterrupted(step: Callable[[], Awaitable[None]]) -> None:
    """Run ``step`` to its end whatever cancellation arrives meanwhile, then raise
    the cancellation, if one arrived.

    An anyio shield keeps the caller's cancel scopes out. On asyncio a native
    `asyncio.Task.cancel()` still reaches a shielded await, so there the step
    runs in a task of its own, and this waits for it through every
    cancellation: cleanup, once started, finishes."""
    with anyio.CancelScope(shield=True):
        # The running backend as anyio sees it: a trio run started from a thread
        # that also runs an asyncio loop is trio's, whose shield holds.
        if not isinstance(anyio.lowlevel.current_token().native_token,
                          asyncio.AbstractEventLoop):
            await step()
            return
        task = asyncio.ensure_future(step())
        interrupted: BaseException | None = None
        while True:
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError as error:
                if task.done():
                    raise
                interrupted = error
                continue
            break
    if interrupted is not None:
        raise interrupted


def first_error(grouped: BaseExceptionGroup[BaseException]) -> BaseException:
    """The exception a task group's group stands for: its first that is not a
    cancellation (the others were cancelled because of it), else its first,
    from nested groups too. Call it on the running event loop."""
    leaves: list[BaseException] = []
    pending: list[BaseException] = [grouped]
    while pending:
        error = pending.pop(0)
        if isinstance(error, BaseExceptionGroup):
            pending[:0] = error.exceptions
        else:
            leaves.append(error)
    cancellation = anyio.get_cancelled_exc_class()
    return next((e for e in leaves if not isinstance(e, cancellation)), leaves[0])


async def begin(inv: Invocation) -> None:
    """Record the invocation as running and announce it.

    From here on the invocation is begun: whatever stops it is recorded
    (`ending`). A ledger that refuses the start leaves nothing begun."""
    at = inv.clock.wall()
    inv.begun = True
    if inv.ledger is not None:
        # A new row keeps no token while its first segment runs it.
        inv.segment_token = ""
        try:
            await inv.ledger.start_invocation(InvocationStart(
                id=inv.id,
                operation=inv.operation.name,
                operation_version=inv.operation.version,
                provider=inv.operation.provider,
                model=inv.operation.model,
                tenant=inv.attribution.tenant,
                user_id=inv.attribution.user_id,
                feature=inv.attribution.feature,
                correlation_id=inv.attribution.correlation_id,
                started_at=at,
                parent_invocation_id=inv.parent.id if inv.parent is not None else None,
            ))
        except LoopEngineError as error:
            inv.begun = False
            inv.count_attempts_on(error)  # none: nothing was sent
            raise
    await inv.emit(RunStarted(
        run_id=inv.id, at=at, operation=inv.operation.name,
        operation_version=inv.operation.version, provider=inv.operation.provider,
        model=inv.operation.model, kind="run" if inv.kind == "run" else "call",
        tenant=inv.attribution.tenant, feature=inv.attribution.feature,
        correlation_id=inv.attribution.correlation_id, vendor=inv.vendor,
        genai_operation=inv.genai_operation,
        parent_invocation_id=inv.parent.id if inv.parent is not None else None,
    ))
    if inv.accounts is not None:
        await admit(inv, at)


async def finish(
    inv: Invocation, outcome: str, *, turns: int, tool_calls: int, credits: int,
    trip: GuardTrip | None = None,
) -> None:
    """Settle the invocation with ``outcome`` (ledger, events, log).

    A cancellation that arrives before the end is written ends the
    invocation ``cancelled`` instead (`ending`). Once the end is being
    written it is finished, uninterrupted: a cancellation arriving then
    propagates afterwards, and the ledger and `RunEnded` keep ``outcome``.
    ``trip``'s `GuardTripped` is emitted once the end is written, just before
    `RunEnded`: an end refused because another process took the run over
    (`held_end`) announces neither."""
    at = inv.clock.wall()
    await anyio.lowlevel.checkpoint()  # a pending cancellation is the end

    async def end() -> None:
        await _write_end(inv, at, outcome, turns=turns, tool_calls=tool_calls,
                         credits=credits, trip=trip)

    await uninterrupted(end)


def held_end(inv: Invocation, record: InvocationEnd) -> InvocationEnd:
    """``record`` (an end or a pause of the run) as this segment may write it:
    a compare-and-set on the row still being ``running`` with this segment's
    token (`Invocation.segment_token`) when the segment holds a run store's
    lease, so a segment whose run another process took over (its lease
    expired while it was only slow) ends and pauses nothing of it; as it is
    otherwise (a run without a run store, or a record with its own condition)."""
    if record.expect_seal is not None or not _holds_lease(inv):
        return record
    assert inv.segment_token is not None  # `_holds_lease`
    return replace(record, expect_seal=inv.segment_token, expect_outcome="running")


def _holds_lease(inv: Invocation) -> bool:
    """This segment holds a run store's lease on a ledger row it knows its token of."""
    return (inv.run_store is not None and inv.lease_owner is not None
            and inv.segment_token is not None)


async def write_row(inv: Invocation, record: InvocationEnd) -> None:
    """Write ``record`` (an end, a pause, or a resume's take of the run's row):
    as it is without a condition, else a compare-and-set (``record.expect_seal``,
    on the row still being ``record.expect_outcome``): a resume's take of a
    pause, or the end or pause of a segment holding a run store's lease
    (`held_end`).

    Raises:
        RunBusyError: the ledger refused a compare-and-set because the row is
            no longer what it expects: another resume took the pause, or
            another process took the run over (and may have ended or paused it).
        LedgerError: the ledger refused it for another reason.
    """
    assert inv.ledger is not None
    if record.expect_seal is None:
        await inv.ledger.end_invocation(record)
        return
    try:
        await inv.ledger.end_invocation(record)
    except LedgerError:
        if await _taken(inv, record.expect_outcome, record.expect_seal or ""):
            why = ("another resume took its pause" if record.expect_outcome == "paused"
                   else "another process took the run over")
            raise RunBusyError(inv.id, None, why) from None
        raise


async def _taken(inv: Invocation, outcome: str, seal: str) -> bool:
    """Whether the ledger's row is no longer ``outcome`` with ``seal`` (read
    back after a refused write); False when it cannot be read."""
    read = getattr(inv.ledger, "read_progress", None)
    if read is None:
        return True
    try:
        found = await read(inv.id)
    except LoopEngineError:
        return False
    return found is None or found.outcome != outcome or (found.seal or "") != seal


async def _write_end(inv: Invocation, at: datetime, outcome: str, *, turns: int, tool_calls: int,
                     credits: int, expect_seal: str | None = None,
                     trip: GuardTrip | None = None) -> None:
    """Write the end, settle the account, forget the stored state, announce it
    (``trip``'s `GuardTripped`, then `RunEnded`).

    Raises:
        RunBusyError: the end was refused, the run being another's (another
            resume took the pause, another process took the run over):
            nothing of it is settled, forgotten or announced here.
    """
    inv.ended = True
    taken = written = False
    try:
        if inv.ledger is not None:
            record = held_end(inv, InvocationEnd(
                id=inv.id, ended_at=at, outcome=outcome, turns=turns, tool_calls=tool_calls,
                credits=credits, expect_seal=expect_seal))
            confirmed = await inv.confirm(write_row(inv, record), at_least=LEDGER_GRACE)
            if not confirmed:
                logger.warning("%s %s: the ledger did not confirm its end (%s) by its "
                               "deadline; the write stays queued", inv.kind, inv.id,
                               outcome)
        written = True
    except RunBusyError:
        # Its account's reservation is the new owner's to settle (a recovery
        # settles the segment it took over), and `RunEnded` would claim an end
        # that did not happen.
        taken = inv.announced = True
        raise
    finally:
        if not taken:
            if trip is not None:
                # Only now: a segment whose run was taken over trips nothing of it.
                await inv.emit(GuardTripped(
                    run_id=inv.id, at=at, guard=trip.guard, observed=trip.observed,
                    limit=trip.limit, outcome=trip.outcome.value, message=trip.message))
            try:
                # The account is settled however the end's write went
                # (docs/accounts.md), once for a tree of delegated runs: the root
                # is charged its descendants' credits too (a child holds no
                # reservation of its own, docs/tools.md).
                await settle_account(inv, credits + inv.descendant_credits)
                await forget_run(inv)
            except BaseException:
                if written:
                    # The end is recorded: `RunEnded` says the outcome the ledger
                    # keeps, then the account's error propagates.
                    await _announce_end(inv, at, outcome, turns=turns,
                                        tool_calls=tool_calls, credits=credits)
                raise
    logger.info(
        "%s %s ended %s: operation=%s turns=%d tool_calls=%d attempts=%d "
        "cost_nanousd=%d credits=%d",
        inv.kind, inv.id, outcome, inv.operation.name, turns, tool_calls,
        inv.base_attempts + len(inv.records), inv.cost_nanousd, credits,
    )
    await _announce_end(inv, at, outcome, turns=turns, tool_calls=tool_calls,
                             credits=credits)


async def forget_run(inv: Invocation) -> None:
    """Delete the ended run's row from its run store (docs/pause-and-resume.md),
    when this segment holds it; a failure is logged: the run has ended whatever
    the store says."""
    if inv.run_store is None or inv.lease_owner is None:
        return
    try:
        confirmed = await inv.confirm(inv.run_store.drop(inv.id, inv.lease_owner),
                                      at_least=LEDGER_GRACE)
    except LoopEngineError:
        logger.exception("run %s: its stored state could not be deleted", inv.id)
        return
    if not confirmed:
        logger.warning("run %s: the deletion of its stored state was not confirmed by its "
                       "deadline; the write stays queued", inv.id)


async def end_paused(inv: Invocation, outcome: str, *, turns: int, tool_calls: int,
                     credits: int) -> None:
    """End a paused invocation that will not resume (its pause outlasted
    ``pause_timeout``): the ledger's end, its stored state deleted, `RunEnded`.

    The end takes the pause as a resume would (`Invocation.pause_seal`).

    Raises:
        RunBusyError: another resume took the pause first; nothing was recorded.
    """
    async def end() -> None:
        await _write_end(inv, inv.clock.wall(), outcome, turns=turns, tool_calls=tool_calls,
                         credits=credits, expect_seal=inv.pause_seal)

    await uninterrupted(end)


async def _announce_end(inv: Invocation, at: datetime, outcome: str, *, turns: int, tool_calls: int,
                        credits: int) -> None:
    """Emit `RunEnded`, once: an observer's run ends however the run does."""
    if inv.announced:
        return
    inv.announced = True
    await inv.emit(RunEnded(
        run_id=inv.id, at=at, outcome=outcome, turns=turns, tool_calls=tool_calls,
        attempts=inv.base_attempts + len(inv.records), usage=inv.usage, cost_usd=inv.cost_usd,
        credits=credits,
    ))


@contextlib.asynccontextmanager
async def ending(inv: Invocation, progress: Progress) -> AsyncIterator[None]:
    """Begin the invocation (`begin`), around the body of a run or call that
    may stop without an outcome.

    ``progress()`` gives its ``(turns, tool_calls, credits)`` so far. The
    caller's cancellation, wherever it lands once the start is recorded
    (an observer awaiting `RunStarted` included), settles the in-flight
    attempt ``aborted``/``external`` and the invocation ``cancelled``; any
    other error (a `LedgerError`, a provider's `LoopEngineError`, the
    ``on_text`` callback's own exception) records it ``failed`` and gets
    its attempt count. Either way the cleanup runs to its end (`uninterrupted`:
    a second cancellation or a native `asyncio.Task.cancel()` waits for it),
    `RunEnded` is announced once and the exception propagates. An
    `OutcomeError` comes after its outcome was recorded and announced:
    nothing is added but its count.
    """
    try:
        await begin(inv)
        yield
    except BaseException as error:
        outcome = stop_outcome(error)
        if outcome is not None:
            await stopped(inv, outcome, error, progress)
        raise


def stop_outcome(error: BaseException) -> str | None:
    """How ``error``, stopping the body of a run or call before its outcome,
    ends the invocation: ``cancelled`` for the caller's cancellation (a
    KeyboardInterrupt counts: Ctrl-C, which trio raises where it lands, where
    asyncio's runner cancels its main task); ``failed`` for an error (a
    `LedgerError`, a provider's `LoopEngineError`, the ``on_text`` callback's
    own exception, a SystemExit, a stray CancelledError: `stray_cancellation`);
    None for any other `BaseException`, which passes untouched, as the death
    of the process would (a recovery ends the run, docs/pause-and-resume.md).
    Call it on the running event loop."""
    if isinstance(error, Exception | SystemExit) or stray_cancellation(error):
        return "failed"
    if isinstance(error, (KeyboardInterrupt, asyncio.CancelledError,
                          anyio.get_cancelled_exc_class())):
        return "cancelled"
    return None


async def stopped(inv: Invocation, outcome: str, error: BaseException,
                  progress: Progress) -> None:
    """``error`` stopped the body of `ending` (`stop_outcome` gave ``outcome``):
    record the invocation ``outcome`` if it was begun, and give a failure's
    ``error`` its attempt count; the caller then re-raises.

    `ending`'s handler, for a body that cannot be written in an ``async
    with`` (the run loop keeps it in its own frame, see `loopengine._run`).
    """
    if inv.begun:
        await _cleanup(inv, outcome, progress)
    if outcome == "failed":
        inv.count_attempts_on(error)


async def _cleanup(inv: Invocation, outcome: str, progress: Progress) -> None:
    async def step() -> None:
        await _end_without_outcome(inv, outcome, *progress())

    try:
        await uninterrupted(step)
    except anyio.get_cancelled_exc_class():
        if outcome != "cancelled":
            raise  # a failure cancelled meanwhile: the cancellation wins
        # cancelled again meanwhile: the cancellation being handled propagates


async def _end_without_outcome(inv: Invocation, outcome: str, turns: int, tool_calls: int,
                               credits: int) -> None:
    """Record the invocation ``cancelled`` or ``failed`` as far as the ledger
    still can, then announce the end.

    A cancelled run's in-flight attempt is settled ``aborted``/``external``.
    A failed run's is too once its row was written (a SystemExit raised
    while it was on the wire, by the ``on_text`` callback, say, or before it
    was sent, by an observer of its `AttemptStarted`): the ledger has it.
    One whose row was not written is not: the error came from writing its
    row (or from the ledger breaking), so it never went out (a request is
    sent only once its row is written); it is not one of the run's
    attempts. Either way a turn that only an unsent request would have sent
    was not sent (R01 counts turn requests sent). A ledger
    failure here is logged, not raised: it must not replace the exception
    that ended the run."""
    if outcome == "failed":
        flight = inv.in_flight
        if flight is not None and not flight.written:
            inv.records.pop(flight.index)
            inv.in_flight = flight = None
        unsent = flight.index if flight is not None and not flight.sent else None
        # A turn whose request was never sent is no turn (R01); the turns of
        # the segments before a resume were sent (a recovered run's dead
        # segment's last one too, sent again now).
        sent = max((r.dispatch.turn for i, r in enumerate(inv.records) if i != unsent),
                   default=0)
        turns = min(turns, max(sent, inv.base_turns, *inv.earlier_attempts))
    what = "the cancellation" if outcome == "cancelled" else "its failure"
    try:
        if inv.in_flight is not None:
            await settle(inv, inv.in_flight, None, None, external=True)
        if not inv.ended:
            await _write_end(inv, inv.clock.wall(), outcome, turns=turns,
                                  tool_calls=tool_calls, credits=credits)
    except RunBusyError:
        _log_taken_over(inv, what)
        return
    except LedgerError:
        if _holds_lease(inv) and await _taken(
                inv, "running", inv.segment_token or ""):
            # Another process took the run over and ended it (its attempt's
            # settle was refused): nothing of it is this segment's to announce.
            inv.announced = True
            _log_taken_over(inv, what)
            return
        logger.exception("run %s: the ledger could not record %s", inv.id, what)
    await _announce_end(inv, inv.clock.wall(), outcome, turns=turns,
                             tool_calls=tool_calls, credits=credits)


def _log_taken_over(inv: Invocation, what: str) -> None:
    logger.warning("run %s: another process took the run over; %s is not recorded and "
                   "no RunEnded is emitted here", inv.id, what)
