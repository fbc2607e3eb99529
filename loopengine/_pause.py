"""Pausing a run for approval, and resuming it as the same invocation
(docs/pause-and-resume.md).

A batch that passed checkpoints 1-4 and holds a call whose tool asks for
approval (`pending_approvals`) runs none of its handlers: the run pauses
(`pause`): the ledger records the invocation ``paused`` (not ended), its
account settles what it spent and releases the rest of its reservation, and
`RunPaused` is emitted. `prepare_resume` carries a paused invocation into a
new running segment: its budgets come from the ledger's rows (never from the
state the caller hands back), its deadline from the running time it had
left, and a pause that outlasted ``Limits.pause_timeout`` ends it
``time_limit``. `resume_begin` records it ``running`` again, emits
`RunResumed` and reserves its credits again.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any

from loopengine._admission import admit, settle_account
from loopengine._errors import ConfigError, LedgerError, RunBusyError
from loopengine._invocation import LEDGER_GRACE, Invocation
from loopengine._lifecycle import (
    end_paused,
    forget_run,
    held_end,
    uninterrupted,
    write_row,
)
from loopengine._pricing import nanousd_to_usd
from loopengine._raised import own_failure
from loopengine._runstate import Approve, Decision, Deny, PendingCall, Progress, RunState
from loopengine._runstore import take_token
from loopengine._tools import Tool
from loopengine._usage import Usage, UsageIteration
from loopengine.events import RunEnded, RunPaused, RunResumed
from loopengine.guards._checkpoints import ConversationState
from loopengine.guards._deadline import Deadline
from loopengine.persistence._account_store import TreeRun, descendants
from loopengine.persistence._planner import PROGRESS_USAGE, usage_counts
from loopengine.persistence._records import InvocationEnd, InvocationProgress

__all__ = ["check_seal", "decided_results", "end_dead_descendants", "pause",
           "pending_approvals", "prepare_resume", "resume_begin", "take_run"]

logger = logging.getLogger("loopengine")


def pending_approvals(batch: Sequence[Mapping[str, Any]], tools: Mapping[str, Tool],
                      run_id: str) -> tuple[PendingCall, ...]:
    """The calls of ``batch`` whose tool asks for approval (none: the batch runs).

    A tool's ``approval`` callable that raises (its own failure, `own_failure`:
    a stray CancelledError too), or answers anything but a bool (``None`` from
    a missing ``return``), counts as asking: a call is never run because its
    check failed."""
    pending: list[PendingCall] = []
    for block in batch:
        tool = tools.get(str(block.get("name")))
        if tool is None or tool.approval is False:
            continue
        call = PendingCall(str(block.get("id")), tool.name, block.get("input", {}), "approval")
        needs = True
        if callable(tool.approval):
            try:
                answer = tool.approval(call)
            except BaseException as error:
                if not own_failure(error):
                    raise  # the run's cancellation, or what stops the run
                # Its own failure, a stray CancelledError included (a future
                # something else cancelled): never the run's cancellation.
                logger.exception("run %s: the approval check of tool %s raised; the call "
                                 "waits for approval", run_id, tool.name)
            else:
                if isinstance(answer, bool):
                    needs = answer
                else:
                    logger.error("run %s: the approval check of tool %s answered %s, not a "
                                 "bool; the call waits for approval", run_id, tool.name,
                                 type(answer).__name__)
        if needs:
            pending.append(call)
    return tuple(pending)


def decided_results(decisions: Mapping[str, Decision]) -> dict[str, tuple[str, bool]]:
    """The results that decisions give without running a handler: ``{call_id:
    (text, is_error)}`` for each denied or supplied call (approved ones run)."""
    out: dict[str, tuple[str, bool]] = {}
    for call_id, decision in decisions.items():
        if isinstance(decision, Approve):
            continue
        if isinstance(decision, Deny):
            out[call_id] = (f"Not run: the call was denied: {decision.reason}", True)
        else:
            out[call_id] = (decision.text, False)
    return out


async def pause(inv: Invocation, state: RunState) -> None:
    """Record the run ``paused`` (since ``state.paused_at``), settle its account
    for what it spent and release the rest of its hold, and emit `RunPaused`;
    nothing interrupts it."""
    at = inv.clock.wall()
    progress = state.progress

    async def announce() -> None:
        await inv.emit(RunPaused(
            run_id=inv.id, at=at, turns=progress.turns, tool_calls=progress.tool_calls,
            attempts=progress.attempts, usage=inv.usage, cost_usd=inv.cost_usd,
            credits=progress.credits, pending=len(state.pending)))

    async def step() -> None:
        # Like an end, but the invocation stays open: its next segment goes on.
        inv.ended = inv.announced = True
        taken = paused = False
        try:
            if inv.ledger is not None:
                # With a run store, a compare-and-set on the run being this segment's.
                record = held_end(inv, InvocationEnd(
                    id=inv.id, ended_at=state.paused_at, outcome="paused", turns=progress.turns,
                    tool_calls=progress.tool_calls, credits=progress.credits,
                    seal=state.seal()))
                confirmed = await inv.confirm(write_row(inv, record), at_least=LEDGER_GRACE)
                if not confirmed:
                    logger.warning("run %s: the ledger did not confirm its pause by its "
                                   "deadline; the write stays queued", inv.id)
            paused = True
        except RunBusyError:
            # Another process took the run over: it paused nothing, and its
            # reservation is the new owner's to settle (docs/pause-and-resume.md).
            taken = True
            raise
        except BaseException:
            # The pause was not recorded (the ledger refused it): the run is
            # not paused but failed, and its end is recorded, as far as the
            # ledger still can, and announced as any failed run's is.
            inv.ended = inv.announced = False
            raise
        finally:
            if not taken:
                try:
                    # Its sub-agents' credits too: one reservation pays for the tree.
                    await settle_account(inv, progress.credits + progress.descendant_credits)
                except BaseException:
                    if paused:
                        # The pause is recorded: observers see it, then the
                        # account's error propagates.
                        await announce()
                    raise
        logger.info("run %s paused: operation=%s turns=%d tool_calls=%d attempts=%d "
                    "credits=%d pending=%d", inv.id, inv.operation.name, progress.turns,
                    progress.tool_calls, progress.attempts, progress.credits,
                    len(state.pending))
        await announce()

    await uninterrupted(step)


def progress_of(inv: Invocation, conversation: ConversationState) -> Progress:
    """The run's progress now, for its state."""
    asking = inv.turn_usage(conversation.turns)
    return Progress(
        turns=conversation.turns, tool_calls=conversation.tool_calls,
        credits=conversation.credits, attempts=inv.base_attempts + len(inv.records),
        cost_nanousd=inv.cost_nanousd, provider_cost_nanousd=inv.provider_cost_nanousd,
        usage=inv.usage, running_seconds=inv.clock.now() - inv.started,
        descendant_credits=inv.descendant_credits,
        turn_input_tokens=asking.total_input_tokens, turn_output_tokens=asking.output_tokens,
        turn_cost_nanousd=inv.turn_cost_nanousd(conversation.turns))


async def prepare_resume(inv: Invocation, state: RunState, *, recovering: bool = False,
                         untaken: str | None = None) -> ConversationState:
    """Make ``inv`` the next segment of the paused invocation of ``state``;
    return the conversation's counts to go on from.

    With a ledger, the counts (turns, tool calls, credits, attempts, cost)
    and the time of the pause are its rows', whatever the state says; without
    one, the state is trusted. ``recovering``: the invocation's process died
    while it ran (its state is the run store's last checkpoint): the
    ledger holds it ``running``; its attempts, cost and usage are the
    ledger's, its turns, tool calls and credits the checkpoint's (the ledger
    writes those only when a segment ends). Whatever the dead segment
    dispatched after that checkpoint belongs to the turn it was on, which is
    sent again: its attempt numbers go on from them, and their charge is in
    that turn's credits (R03), so a reply billed just before a crash counts
    against the hold. ``untaken``: a recovery of the row an adopting resume
    left before its take: the seal of the pause to take.

    Raises:
        ConfigError: the ledger has no such invocation, or it is not paused,
            or ``state`` is not the state its pause returned (the ledger
            keeps that state's `RunState.seal`), or the pause outlasted
            ``Limits.pause_timeout`` (the invocation is then ended
            ``time_limit``).
        RunBusyError: it is running: another resume took it.
    """
    inv.id = state.invocation_id
    saved = state.progress
    progress = InvocationProgress(
        outcome="paused", ended_at=state.paused_at, turns=saved.turns,
        tool_calls=saved.tool_calls, credits=saved.credits, attempt_count=saved.attempts,
        cost_nanousd=saved.cost_nanousd, provider_cost_nanousd=saved.provider_cost_nanousd)
    if inv.ledger is not None:
        read = getattr(inv.ledger, "read_progress", None)
        if read is None:
            raise ConfigError("ledger", f"{inv.ledger!r} cannot read an invocation back "
                                        "(read_progress), so it cannot resume a run")
        found: InvocationProgress | None = await read(state.invocation_id)
        if found is None:
            raise ConfigError("state", f"the ledger has no invocation {state.invocation_id}")
        if found.outcome == "running" and not recovering:
            # Taken by another resume (a run store's runs are taken by their lease).
            raise RunBusyError(state.invocation_id, None, "it is running: another resume "
                                                          "took its pause")
        # A recovered run's process may have died as it paused.
        if found.outcome not in (("running", "paused") if recovering else ("paused",)):
            # It ended (and a process died before it forgot its stored state).
            await forget_run(inv)
            raise ConfigError("state", f"invocation {state.invocation_id} is not paused: "
                                       f"it is {found.outcome}")
        if not recovering:
            if found.seal is not None:
                check_seal(state, found.seal)
            # What its end or its resume must find: this pause ("": one whose
            # ledger recorded no seal).
            inv.pause_seal = found.seal or ""
        elif untaken is not None:
            # A recovery of the row a dead adopting resume left before its take:
            # the pause is taken as a resume takes it, so that a resume without
            # a run store that took it since keeps it.
            inv.pause_seal = untaken
        progress = found
        if recovering:
            progress = replace(found, turns=saved.turns, tool_calls=saved.tool_calls,
                               credits=saved.credits, ended_at=state.paused_at)
    now = inv.clock.wall()
    timeout = inv.limits.pause_timeout
    paused_at = progress.ended_at or state.paused_at
    waited = (now - paused_at).total_seconds()
    if recovering and (progress.outcome != "paused" or inv.ledger is None):
        waited = 0.0  # it did not wait paused: its process died while it ran
    if timeout is not None and waited > timeout:
        await end_paused(inv, "time_limit", turns=progress.turns,
                         tool_calls=progress.tool_calls, credits=progress.credits)
        raise ConfigError("state", f"run {inv.id} waited {waited:g}s paused, longer than its "
                                   f"pause_timeout of {timeout:g}s; it ended time_limit")
    inv.base_attempts = progress.attempt_count
    if recovering:
        # The turn its process died in is sent again: its attempts go on, and
        # what they were charged is part of that turn's charge.
        resent = progress.turns + 1
        if progress.attempt_count > saved.attempts:
            inv.earlier_attempts = {resent: progress.attempt_count - saved.attempts}
        if progress.cost_nanousd > saved.cost_nanousd:
            inv.add_charge(resent, progress.cost_nanousd - saved.cost_nanousd)
    inv.cost_nanousd = progress.cost_nanousd
    inv.provider_cost_nanousd = progress.provider_cost_nanousd
    inv.usage = usage_of(saved.usage if isinstance(saved.usage, Usage) else Usage(),
                         progress.usage if inv.ledger is not None else None,
                         progress.iterations)
    inv.output_tokens = inv.usage.output_tokens
    inv.paused_seconds = max(0.0, waited)
    # The turn whose calls waited was sent before the pause: its calls' events
    # carry its accounting all the same.
    inv.paused_turn = (saved.turns, Usage(input_tokens=saved.turn_input_tokens,
                                          output_tokens=saved.turn_output_tokens),
                       saved.turn_cost_nanousd)
    # Its credits and its sub-agents' so far: the tree its hold and any
    # sub-agent it starts again count from.
    inv.credits = progress.credits
    inv.descendant_credits = saved.descendant_credits
    inv.container = state.container  # where the model's files are, while it lives
    # The stores' reading of a run's tree of sub-agents (a recovery's ledger
    # has it: its run store lives in a shipped ledger's database).
    read = getattr(inv.ledger, "read_tree", None)
    if recovering and read is not None:
        # Its sub-agents may have spent after its last checkpoint, as its
        # process died: what the ledger says they charged.
        inv.descendant_credits = max(saved.descendant_credits,
                                     await end_dead_descendants(inv, read))
    # total_time counts running time only: the deadline is what was left.
    inv.started = inv.clock.now() - saved.running_seconds
    inv.deadline = Deadline.after(inv.started, inv.limits.total_time)
    return ConversationState(turns=progress.turns, tool_calls=progress.tool_calls,
                             credits=progress.credits, deadline=inv.deadline)


async def end_dead_descendants(
        inv: Invocation, read_tree: Callable[[str], Awaitable[Sequence[TreeRun]]]) -> int:
    """End each run that the recovered run ``inv`` delegated to (its tree below
    it) and that its dead process left ``running``; return what its tree below
    it charged (`descendants`).

    Each is ended ``failed`` (its process died under it: it reached no
    outcome), its tool calls as the ledger has them, its turns the last its
    attempt rows were sent in (an attempt it left dispatched stays so), its
    credits what `descendants` counts for it, so the tree's charge is the same
    before and after. Through the
    ledger's writer, as a compare-and-set on the row still being
    ``running``: of two recoveries (or a recovery recovered again) one ends
    it. A run paused or ended is not touched. Each one ended gets the
    `RunEnded` its process could not emit (outcome ``failed``, its totals as
    recorded), from the recovery, once.

    ``read_tree`` is the ledger's (``read_tree``): the run's tree as committed.
    """
    prices = inv.prices
    rate, quantum = prices.credits_per_usd, prices.credit_quantum
    runs = await read_tree(inv.id)
    charged, dead = descendants(runs, inv.id, rate, quantum)
    assert inv.ledger is not None
    at = inv.clock.wall()
    for member, turns, tool_calls, credits in dead:
        try:
            await inv.ledger.end_invocation(InvocationEnd(
                id=member, ended_at=at, outcome="failed", turns=turns, tool_calls=tool_calls,
                credits=credits, expect_outcome="running", expect_seal="", keep_segment=True))
        except LedgerError as error:
            # Ended meanwhile (by another recovery), or the write failed: the
            # row is as the ledger has it; `audit reconcile` lists one left running.
            logger.warning("run %s: its sub-agent run %s, left running by its dead "
                           "process, was not ended: %s", inv.id, member, error)
            continue
        logger.warning("run %s: its sub-agent run %s was left running by its dead process; "
                       "ended failed (turns=%d tool_calls=%d credits=%d)", inv.id, member,
                       turns, tool_calls, credits)
        # Its `RunEnded`, which its process could not emit: its totals as recorded.
        read = getattr(inv.ledger, "read_progress", None)
        recorded: InvocationProgress | None = None if read is None else await read(member)
        if recorded is not None:
            await inv.emit(RunEnded(
                run_id=member, at=at, outcome="failed", turns=turns, tool_calls=tool_calls,
                attempts=recorded.attempt_count, usage=recorded.usage,
                cost_usd=nanousd_to_usd(recorded.cost_nanousd), credits=credits))
    return int(charged)


def check_seal(state: RunState, seal: str) -> None:
    """Raise unless ``state`` is the state whose `RunState.seal` its pause kept.

    Raises:
        ConfigError: it is an earlier pause's state, another run's, or one
            edited in more than the counts a ledger keeps itself.
    """
    if state.seal() != seal:
        raise ConfigError("state", f"is not the latest pause of run {state.invocation_id}: "
                                   "an earlier pause's state, another run's, or one edited "
                                   "in more than its counts (the ledger keeps the seal of "
                                   "the state its pause returned)")


def usage_of(saved: Usage, ledger: Usage | None, iterations: int = 0) -> Usage:
    """The usage a resumed run goes on from: the state's, which has its sampling
    iterations, while the ledger's totals (``ledger``, None without one) agree
    with it; the attempts it lacks added (a recovered segment's, settled after
    its checkpoint); the ledger's alone when the state claims more than it.

    ``iterations``: the sampling iterations the ledger counted for the run's
    attempts. A state encoded before a sum of usages told the iteration it
    adds for a request that reported none apart (`UsageIteration.UNREPORTED`)
    names that one ``message``: as many of its ``message`` iterations as it
    counts beyond the ledger's, the last, are taken for such, so that the
    run's `Usage.reported_iterations` is the ledger's count again."""
    if ledger is None:
        return saved
    lacking = [getattr(ledger, name) - getattr(saved, name) for name in PROGRESS_USAGE]
    if not any(lacking):
        return _unreported(saved, saved.reported_iterations - iterations)
    if min(lacking) >= 0:
        try:
            return _unreported(saved, saved.reported_iterations - iterations) + usage_counts(
                lacking)
        except ConfigError:
            pass  # not a usage on its own (the state was edited): the ledger's
    return ledger


def _unreported(usage: Usage, surplus: int) -> Usage:
    """``usage`` with its last ``surplus`` ``message`` iterations of the request's
    own model typed `UsageIteration.UNREPORTED` (`usage_of`)."""
    found = list(usage.iterations)
    for index in reversed(range(len(found))):
        if surplus <= 0:
            break
        if found[index].type == "message" and found[index].model is None:
            found[index] = replace(found[index], type=UsageIteration.UNREPORTED)
            surplus -= 1
    return replace(usage, iterations=tuple(found)) if found != list(usage.iterations) else usage


async def take_run(inv: Invocation, conversation: ConversationState, at: datetime) -> None:
    """Record the invocation ``running`` again: its next segment opens (a dead
    process's stays open). Nothing without a ledger.

    Of a pause, a compare-and-set on its seal, so of two resumes of one pause,
    in any processes, one proceeds; a recovery's lease already took the run.

    Raises:
        RunBusyError: another resume took the pause first; nothing was recorded.
    """
    if inv.ledger is None:
        return
    # A token of this resume in place of the seal: a commit lost on the way
    # is read back as this resume's, never as another's (`Writer.evidence`).
    record = InvocationEnd(
        id=inv.id, ended_at=None, outcome="running", turns=conversation.turns,
        tool_calls=conversation.tool_calls, credits=conversation.credits, at=at,
        seal=take_token(inv.lease_owner), expect_seal=inv.pause_seal)
    # Without a pause's seal, a recovery's: its lease took the run.
    await write_row(inv, record)
    # What this segment's end or pause must find (`held_end`).
    inv.segment_token = record.seal


async def resume_begin(inv: Invocation, conversation: ConversationState) -> None:
    """Record the paused invocation ``running`` again, emit `RunResumed`, and
    reserve its credit hold again (admission may narrow it, or deny the run).

    Recording it ``running`` takes the pause: a compare-and-set on its seal,
    so of two resumes of one pause, in any processes, one proceeds.

    Raises:
        RunBusyError: another resume took the pause first; nothing was recorded.
    """
    at = inv.clock.wall()
    inv.begun = True
    await take_run(inv, conversation, at)
    await inv.emit(RunResumed(
        run_id=inv.id, at=at, operation=inv.operation.name,
        operation_version=inv.operation.version, provider=inv.operation.provider,
        model=inv.operation.model, kind="run", tenant=inv.attribution.tenant,
        feature=inv.attribution.feature, correlation_id=inv.attribution.correlation_id,
        vendor=inv.vendor, genai_operation=inv.genai_operation,
        paused_seconds=inv.paused_seconds, turns=conversation.turns,
        tool_calls=conversation.tool_calls, attempts=inv.base_attempts,
        credits=conversation.credits))
    if inv.accounts is not None:
        # The hold left: the credits charged before the pause were settled then
        # (and a recovered run's dead segment's, with the reservation it left).
        await admit(inv, at, spent=conversation.credits + inv.descendant_credits
                    + inv.turn_credits(conversation.turns + 1))
