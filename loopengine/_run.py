"""The tool loop of `Engine.run`, with its checkpoints in their fixed order.

For each response, in this order, the first check that ends the run wins:

1. terminal responses (refusal, cut-off) - R11;
2. final answers: validated, then judged; accepted ends ``completed`` at once,
   before any later check (R14); rejected goes back for repair (R10);
3. the tool batch: too large for ``max_tool_batch`` or the budget left (R02);
4. credits: accumulated rounded turn charges above the hold (R03);
5. tools: the whole batch runs concurrently; one combined results message (R08,
   R09, R15).

Before each turn: the turn limit (R01), then the time limit (R04). See
docs/guards.md.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import logging
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence, Set
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Any

import anyio
import anyio.lowlevel
import pydantic

from loopengine import _validate
from loopengine._attempt import request, settle_cut
from loopengine._context import context_for
from loopengine._errors import ConfigError, MCPServerError, RunBusyError
from loopengine._invocation import Invocation
from loopengine._judge import DEFAULT_REJECTION, Accept, Reject
from loopengine._lifecycle import (
    begin,
    finish,
    first_error,
    stop_outcome,
    stopped,
    uninterrupted,
)
from loopengine._outcome import Outcome
from loopengine._pause import (
    decided_results,
    pause,
    pending_approvals,
    prepare_resume,
    progress_of,
    resume_begin,
    take_run,
)
from loopengine._pricing import nanousd_to_usd
from loopengine._raised import own_failure, withheld
from loopengine._result import RunResult
from loopengine._runstate import Approve, Decision, PendingCall, RunState, json_digest
from loopengine._runstore import CallMark, lease_expiry, new_owner
from loopengine._tools import (
    Tool,
    ToolInputError,
    ToolSource,
    render_tool_output,
    validated,
)
from loopengine._usage import Usage
from loopengine.events import ToolCallEvent
from loopengine.guards._checkpoints import (
    ConversationState,
    GuardTrip,
    check_before_attempt,
    check_before_turn,
    check_credits,
    check_delegated_credits,
    check_rejection_budget,
    check_terminal,
    check_tool_batch,
    needs_crossing_permit,
)
from loopengine.guards._limits import Limits
from loopengine.providers._base import (
    ProviderRequest,
    ProviderResponse,
    TextCallback,
    new_call_id,
)
from loopengine.providers._faults import FaultKind
from loopengine.providers._retry import RetryStop

__all__ = ["MAX_CONTINUATIONS", "RunSpec", "ToolErrorText", "default_tool_error_text",
           "final_tool_definition", "give_back", "resume_loop", "run_loop"]

logger = logging.getLogger("loopengine")

MAX_CONTINUATIONS = 8
"""Continuations one turn may make before it ends ``incomplete``."""

CONTINUED_STOPS = frozenset({"pause_turn", "compaction"})
"""Stop reasons that pause a turn the next request continues: a server tool
loop that paused (``pause_turn``), and a context-management compaction with
``pause_after_compaction`` (``compaction``: the reply holds the compaction
block, which goes back, and the turn goes on after it)."""

ACCEPTED_TEXT = "The answer was accepted."
"""The tool result that closes an accepted structured answer's call in ``result.messages``."""

ToolErrorText = Callable[[str, BaseException], str]
"""``(tool_name, error) -> text``: what the model is told when a handler raised."""


def default_tool_error_text(tool_name: str, error: BaseException) -> str:
    """The exception's message (its type name when it has none).

    The text is shown to the model (R09): handlers should raise messages fit
    to disclose to it, or the engine should be given another hook.
    """
    return str(error) or type(error).__name__


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSpec:
    """A validated run request (internal)."""

    messages: list[dict[str, Any]]
    system: list[dict[str, Any]] | None
    tools: tuple[Tool, ...]
    output: type[pydantic.BaseModel] | None
    accept: Callable[[Any], Any] | None
    on_text: TextCallback | None
    tool_error_text: ToolErrorText
    final_tool: str
    sources: tuple[Tool | ToolSource, ...] = ()
    """The run's tools as given, when some come from a `ToolSource` (else
    empty): read again before each turn and each batch (`_Loop._refresh_tools`)."""


@dataclass(slots=True)
class _Answer:
    """A response's offered final answer (or the lack of one)."""

    accepted: bool
    value: Any = None
    feedback: str = ""


def run_loop(inv: Invocation, spec: RunSpec) -> Coroutine[Any, Any, RunResult]:
    """Run the conversation; return its result.

    Raises the caller's cancellation, and an error that ended the run without an
    outcome (a `LedgerError`, a provider's `LoopEngineError`), each after
    recording the invocation ``cancelled`` or ``failed``."""
    # The loop's own coroutine, not one awaiting it: a waiting conversation
    # holds every frame between `Engine.run` and the SDK.
    return _Loop(inv, spec).run()


async def resume_loop(inv: Invocation, spec: RunSpec, state: RunState,
                      decisions: Mapping[str, Decision], *, recovering: bool = False,
                      undecided: bool = False, adopt: bool = False,
                      untaken: str | None = None,
                      release: Callable[[], Coroutine[Any, Any, None]] | None = None
                      ) -> RunResult:
    """Resume the paused run of ``state`` (`loopengine._pause`): decide its pending
    batch, then go on as `run_loop` does, as the same invocation.

    ``recovering``: the state is the run store's last checkpoint of a run whose
    process died (docs/pause-and-resume.md). ``undecided``: its pending calls (in
    doubt) have no decisions yet: the run pauses again at once, before anything
    is sent. ``adopt``: the run paused without a run store and resumes on an
    engine with one: its first checkpoint inserts its row, before it takes the
    pause, so it goes on under the store (docs/pause-and-resume.md).
    ``untaken``: a recovery of the row such a resume left, its take not made:
    the seal of the pause it takes (`prepare_resume`).
    ``release``: gives back the run its run store's claim took, when the
    resume fails before it begins.

    Raises:
        ConfigError: the run cannot resume (not paused, its pause timed out),
            before anything is sent.
        RunBusyError: another resume took the pause first; nothing was recorded.
    """
    try:
        conversation = await prepare_resume(inv, state, recovering=recovering,
                                            untaken=untaken)
    except BaseException:
        # Refused or failed before anything was recorded (a ledger it could not
        # read): the run is left as it was found, not held until its lease expires.
        await give_back(inv.id, release)
        raise
    inv.base_turns = conversation.turns
    loop = _Loop(inv, spec, resumed=(state, decisions))
    loop.state = conversation
    loop.charged = conversation.turns  # the paused turn's charge is in its credits
    loop.answered_calls = dict(state.answered_calls)
    loop._given_messages = state.given
    loop.adopting = adopt
    loop.recovering = recovering
    if undecided:
        # Taken in a segment of its own, as any recovery is: the dead process's
        # stays open (docs/ledger.md), and this one ends with the pause.
        await loop._begin_resumed(pausing=True)
        if inv.accounts is not None and inv.account is not None:
            # Paused at once: the dead segment's reservation is settled and
            # released now, not at the next resume.
            await inv.accounts.recover(inv.account, inv.id)
        return await loop._pause(state.pending)
    return await loop.run()


async def give_back(run_id: str, release: Callable[[], Coroutine[Any, Any, None]] | None
                    ) -> None:
    """Give back a resume's run store claim (``release``), whatever cancels the
    caller: a resume that fails before it begins leaves its run as it found
    it. A failure is logged: the run is free once its lease expires."""
    if release is None:
        return
    with anyio.CancelScope(shield=True):
        try:
            await release()
        except Exception:
            logger.exception("run %s: its run store claim could not be given back; it is "
                             "free once its lease expires", run_id)


class _Loop:
    __slots__ = ("_call_ids", "_call_ids_of", "_given_messages", "adopting", "answered_calls",
                 "charged", "cut_results", "recovering",
                 "definitions", "inv", "left_out", "permit", "resumed", "sourced", "spec",
                 "state", "tools", "transcript", "wrapping")

    def __init__(self, inv: Invocation, spec: RunSpec,
                 resumed: tuple[RunState, Mapping[str, Decision]] | None = None) -> None:
        self.inv = inv
        self.spec = spec
        self.resumed = resumed
        """The paused run this loop resumes, and the decisions on its pending calls."""
        # `normalize_messages` made them the run's own copy, used once: the
        # transcript grows from it (no second copy to hold for the run).
        self.transcript: list[dict[str, Any]] = spec.messages
        # Messages from here on are the run's own: only those are closed at the end.
        self._given_messages = len(self.transcript)
        # The ids of the calls of the transcript's first ``_call_ids_of`` messages
        # (`unique_call_ids`), grown as replies arrive, not read again each turn.
        # A dict's keys, not a set: a dict holding only strings is not tracked by
        # the garbage collector, a set is, and thousands of conversations wait.
        self._call_ids: dict[str, None] = {}
        self._call_ids_of = 0
        self.state = ConversationState(turns=0, tool_calls=0, credits=0, deadline=inv.deadline)
        self.tools: dict[str, Tool]
        self.definitions: list[dict[str, Any]]
        self._use_tools(spec.tools)
        # Only a run with tool sources holds these (thousands of runs wait at once).
        self.sourced: dict[int, tuple[Tool, ...]] | None = None
        """Each tool source's tools (by its index in ``spec.sources``) as last read."""
        self.left_out: set[tuple[int, str]] | None = None
        """The sources' tools left out for their names (each said once)."""
        if spec.sources:
            self.sourced, self.left_out = {}, set()
            for index, source in enumerate(spec.sources):
                if isinstance(source, ToolSource):
                    try:
                        self.sourced[index] = source.tools
                    except RuntimeError:  # closed since the run's tools were checked
                        self.sourced[index] = ()
        self.answered_calls: dict[str, int] = {}
        """Calls of each tool that ran its handler (or were let through to it)."""
        self.charged = 0
        """The last turn whose charge is in the credits."""
        self.cut_results: list[dict[str, Any]] | None = None
        """A tool batch's results when the run's deadline cut it."""
        self.wrapping: str | None = None
        """Why the turn being sent is a wrap-up turn (``turns``, ``budget``), or None."""
        self.permit: anyio.Lock | None = None
        """The tree's crossing permit while this run's turn holds it (docs/tools.md)."""
        self.adopting = False
        """A resume whose run store holds no row of the run (it paused without
        one): its first checkpoint inserts it."""
        self.recovering = False
        """A resume of a run whose process died, from its run store's row."""

    @property
    def limits(self) -> Limits:
        """The run's limits (its admission may have narrowed the credit hold)."""
        return self.inv.limits

    def _use_tools(self, tools: Sequence[Tool]) -> None:
        """Offer ``tools`` (and the terminal tool, last) from the next request on."""
        self.tools = {t.name: t for t in tools}
        definitions = [t.definition for t in tools]
        if self.spec.output is not None:
            definitions.append(final_tool_definition(self.spec.output, self.spec.final_tool))
        self.definitions = definitions

    async def _refresh_tools(self) -> None:
        """Read the run's tool sources again (`ToolSource`): the next request
        offers their tools as they are now, and a call is answered by its
        tool as it is now. A source's tool whose name another tool of the run
        (or the terminal tool, or a server tool) has is left out, and a source
        that cannot give its tools keeps the ones it gave last: a change never
        ends a run."""
        spec = self.spec
        assert self.sourced is not None and self.left_out is not None  # a run with sources
        fixed = [t for t in spec.sources if isinstance(t, Tool)]
        taken = {t.name for t in fixed} | {s.name for s in self.inv.features.server_tools}
        if spec.output is not None:
            taken.add(spec.final_tool)
        tools = list(fixed)
        for index, source in enumerate(spec.sources):
            if isinstance(source, Tool):
                continue
            try:
                current = await source.current_tools()
            except Exception as error:
                logger.warning("run %s: the tools of %r could not be read again (%s); it "
                               "keeps those it had", self.inv.id, source, error)
                current = self.sourced.get(index, ())
            self.sourced[index] = current
            for item in current:
                if item.name in taken:
                    if (index, item.name) not in self.left_out:
                        self.left_out.add((index, item.name))
                        logger.warning("run %s: %r has a tool %r, a name the run's other "
                                       "tools have: it is left out", self.inv.id, source,
                                       item.name)
                    continue
                taken.add(item.name)
                tools.append(item)
        offered = self.tools.values()
        if len(tools) == len(offered) and all(a is b for a, b in zip(tools, offered, strict=True)):
            return  # the same tools: the definitions (the terminal tool's schema too) stand
        self._use_tools(tools)

    # -- the loop ------------------------------------------------------------------

    async def run(self) -> RunResult:
        """Run the conversation to its outcome.

        `loopengine._lifecycle.ending` written out in this frame rather than entered with
        ``async with`` (an async generator and its context manager): a waiting
        conversation holds every frame and object between `Engine.run` and
        the SDK, and thousands wait at once."""
        inv = self.inv
        try:
            # The run's one deadline: every wait inside ends at it (a wait that
            # passes it is cut here, and `_deadline_passed` ends the run).
            with inv.clock.deadline_scope(inv.deadline.at):
                if self.resumed is None:
                    await begin(inv)
                else:
                    if self.adopting:
                        # The run's row, leased, before the pause is taken: a
                        # process that dies between the two leaves the run
                        # paused in the ledger and held by a lease that expires,
                        # which a recovery takes (docs/pause-and-resume.md). Of
                        # two resumes adopting the run, the other gets
                        # RunBusyError here.
                        await self._checkpoint(self._paused_state(), create=True)
                    # Takes the pause: of two resumes, the other gets RunBusyError here.
                    await self._begin_resumed()
                if inv.denied is not None:
                    if self.resumed is not None:
                        return await self._pause(self.resumed[0].pending, outcome=Outcome(
                            inv.denied.outcome), detail=inv.denied.message)
                    return await self._end(inv.denied.outcome, trip=inv.denied)
                # The run's lease and first checkpoint (a resume renews its lease).
                if inv.run_store is not None and not self.adopting:
                    await self._checkpoint(None if self.resumed else self._snapshot(),
                                           create=self.resumed is None)
                phase = "turn"
                if self.resumed is not None:
                    decided = await self._decided_batch(*self.resumed)
                    if isinstance(decided, RunResult):
                        return decided
                    phase = decided
                while True:
                    if self.sourced is not None:
                        # Before the checks: a wait for a source's tools counts as time.
                        await self._refresh_tools()
                    trip = check_before_turn(self.state, self.limits, inv.clock.now())
                    if trip is None:
                        await self._take_permit()
                        # The tree's credits too, read once no other turn that may
                        # cross is in flight: a tool batch's delegated runs spent.
                        trip = check_delegated_credits(inv.credit_tree())
                    if trip is not None:
                        self._release_permit()
                        return await self._end(trip.outcome, trip=trip)
                    turn = self.state.turns + 1
                    self.state = replace(self.state, turns=turn)
                    self.wrapping = self._wrap_up_due(turn)
                    if self.wrapping is not None:
                        phase = "wrap_up"
                        self._add_wrap_up_text()
                    # The turn's request, its retries and its continuations.
                    reply = await request(inv, turn=turn, phase=phase, build=self._build,
                                          on_text=self.spec.on_text)
                    if isinstance(reply, ProviderResponse):
                        self.transcript.append({"role": "assistant",
                                                "content": _copy_blocks(reply.content)})
                        if reply.stop_reason in CONTINUED_STOPS:
                            reply = await self._continue_turn(turn, reply.stop_reason)
                    self._charge(turn)
                    if not isinstance(reply, ProviderResponse):
                        if not inv.attempts_in_turn(turn):
                            # Time ran out between the two checks, or the provider refused
                            # the request before the wire: no request, so no turn (R01).
                            self.state = replace(self.state, turns=turn - 1)
                        return await self._stopped(reply)
                    stop_reason = reply.stop_reason
                    # The transcript has its own copy: the next turn's wait must not
                    # keep this reply alive.
                    del reply
                    step = await self._review(turn, stop_reason)
                    if isinstance(step, RunResult):
                        return step
                    phase = step
            return await self._deadline_passed()
        except RunBusyError:
            # Another process took the run over (its lease had expired): the
            # run is its now, so nothing is recorded here.
            self._release_permit()
            inv.ended = inv.announced = True
            raise
        except BaseException as error:
            # The caller's cancellation, or an error ending the run without an
            # outcome; anything else passes untouched (`stop_outcome`).
            outcome = stop_outcome(error)
            if outcome is not None:
                self._charge_cut_turn()
                self._release_permit()
                await stopped(inv, outcome, error, self._progress)
            raise

    async def _begin_resumed(self, *, pausing: bool = False) -> None:
        """Take the pause and begin the resumed segment (`resume_begin`); or,
        ``pausing`` (a recovery that pauses again at once for decisions on
        its calls), only take it (`take_run`).

        An adopting resume, or a recovery, whose take is refused (another
        resume, on an engine without a run store, took the pause first: a
        recovery takes a pause only from the row a dead adopting resume left)
        deletes the run's row: the run is another's, and no recovery may take
        it from there (a later one would take it without a pause's seal).

        Raises:
            RunBusyError: another resume took the pause first.
        """
        inv = self.inv
        try:
            if pausing:
                await take_run(inv, self.state, inv.clock.wall())
            else:
                await resume_begin(inv, self.state)
        except RunBusyError:
            if (self.adopting or self.recovering) and inv.run_store is not None \
                    and inv.lease_owner is not None:
                await give_back(inv.id, functools.partial(inv.run_store.drop, inv.id,
                                                          inv.lease_owner))
            raise

    def _charge_cut_turn(self) -> None:
        """A run cut mid-turn (its caller cancelled it, or it failed): what the
        turn was served so far is billed (R03), as a turn cut by the deadline is."""
        if self.state.turns > self.charged:
            self._charge(self.state.turns)
        if self.charged <= self.state.turns and self.inv.turn_charge.get(self.state.turns + 1):
            # A recovered run's turn its dead process was served, cut before
            # it was sent again: billed all the same.
            self._charge(self.state.turns + 1)

    async def _deadline_passed(self) -> RunResult:
        """The run's deadline cut a wait (an attempt, its row's write, the tools,
        an observer, the judge): settle what it cut and end ``time_limit`` (R04)."""
        inv = self.inv
        await settle_cut(inv)
        turn = self.state.turns
        self._charge_cut_turn()  # what the cut turn was served is billed (R03)
        if self.cut_results is not None:
            # The batch's results, the cut calls' among them (`_run_tools`);
            # its calls are counted already (`_answer_batch`).
            self.transcript.append({"role": "user", "content": self.cut_results})
        if turn and not inv.attempts_in_turn(turn):
            # Cut before the turn's first request: no request, so no turn (R01).
            self.state = replace(self.state, turns=turn - 1)
        # Read at the deadline, which the scope says has come.
        trip = check_before_attempt(self.state, self.limits, inv.deadline.at)
        assert trip is not None
        return await self._end(trip.outcome, trip=trip)

    def _progress(self) -> tuple[int, int, int]:
        return self.state.turns, self.state.tool_calls, self.state.credits

    async def _review(self, turn: int, stop_reason: str | None) -> RunResult | str:
        """The checkpoints of the turn's reply (the newest transcript message), in
        their order: the run's result when one ends it, else the next turn's
        phase (``turn`` or ``repair``)."""
        # 1. Terminal responses (R11). A cut-off reply's tool calls are never run.
        trip = check_terminal(stop_reason)
        if trip is not None:
            return await self._end(trip.outcome, trip=trip)

        blocks = self.transcript[-1]["content"]
        earlier = len(self.transcript) - 1
        self._call_ids.update(dict.fromkeys(call_ids(self.transcript[self._call_ids_of:earlier])))
        self._call_ids_of = earlier
        unique_call_ids(blocks, self._call_ids.keys())
        tool_uses = [b for b in blocks if b.get("type") == "tool_use"]
        results: list[dict[str, Any]] = []
        feedback_message: str | None = None
        rejected = False

        # A wrap-up turn that still asks for tools at the turn limit runs none.
        if self.wrapping == "turns" and [
                b for b in tool_uses if b.get("name") != self.spec.final_tool]:
            trip = check_before_turn(self.state, self.limits, self.inv.clock.now())
            assert trip is not None
            return await self._end(trip.outcome, trip=trip)

        # 2. Final answers (R10, R14).
        if self.spec.output is None:
            batch = tool_uses
            if not tool_uses:
                text = "".join(b.get("text", "") for b in blocks if b.get("type") == "text")
                answer = await self._judge(text, "accept")
                if answer.accepted:
                    return await self._end(Outcome.COMPLETED, answer=answer.value)
                rejected, feedback_message = True, answer.feedback
        else:
            finals = [b for b in tool_uses if b.get("name") == self.spec.final_tool]
            batch = [b for b in tool_uses if b.get("name") != self.spec.final_tool]
            if finals:
                answer = await self._structured_answer(finals[0])
                if answer.accepted:
                    return await self._end(
                        Outcome.COMPLETED, answer=answer.value,
                        answered=[_tool_result(finals[0], ACCEPTED_TEXT)])
                rejected = True
                results.append(_tool_result(finals[0], answer.feedback, error=True))
                batch = [*finals[1:], *batch]
            elif not tool_uses:
                rejected = True
                feedback_message = (
                    f"Give your answer by calling the {self.spec.final_tool} tool."
                )

        if rejected:
            trip = check_rejection_budget(self.state, self.limits)
            if trip is not None:
                return await self._end(trip.outcome, trip=trip, answered=results)
            self.state = replace(self.state, tool_calls=self.state.tool_calls + 1)

        # 3. The tool batch (R02): all of it or none of it.
        if batch:
            trip = check_tool_batch(self.state, self.limits, len(batch))
            if trip is not None:
                return await self._end(trip.outcome, trip=trip, answered=results)

        # 4. Credits (R03): more than the hold stops further work.
        trip = check_credits(self.state, self.limits)
        if trip is not None:
            return await self._end(trip.outcome, trip=trip, answered=results)

        # 5. Tools (R08, R09, R15); a call that needs approval pauses the whole
        # batch before any of its handlers runs (docs/pause-and-resume.md).
        # Each call is answered by its tool as it is now (a source may have
        # changed while the model answered).
        if self.sourced is not None:
            await self._refresh_tools()
        pending = pending_approvals(batch, self.tools, self.inv.id)
        if pending and self.inv.parent is not None:
            # Nothing could resume a delegated run (its parent goes on without
            # it), so it does not pause: it ends, none of its batch run.
            return await self._end(Outcome.INCOMPLETE, answered=results, detail=(
                f"{len(pending)} tool call(s) need approval, which a delegated run cannot "
                "wait for: " + ", ".join(
                    f"{call.tool} {_validate.shown(call.input)}" for call in pending)))
        if pending:
            return await self._pause(pending, batch=batch, results=results, repair=rejected)
        return await self._answer_batch(turn, batch, results, feedback_message, rejected)

    async def _answer_batch(
        self, turn: int, batch: Sequence[Mapping[str, Any]], results: list[dict[str, Any]],
        feedback_message: str | None, rejected: bool,
        decided: Mapping[str, tuple[str, bool]] | None = None,
        whole: Sequence[Mapping[str, Any]] | None = None, unoffered: Set[str] = frozenset(),
        in_doubt: Set[str] = frozenset(),
    ) -> str:
        """Run the batch, add its results (or the feedback) to the transcript;
        return the next turn's phase (``decided``, ``whole``, ``unoffered``,
        ``in_doubt``: a resumed batch's, `_run_tools`)."""
        if batch:
            if self.inv.run_store is not None:
                # Checkpoint the settled reply: a crash from here on resumes
                # this batch, each call as its row says.
                approved = {i for i, d in (self.resumed[1] if self.resumed else {}).items()
                            if isinstance(d, Approve)}
                await self._checkpoint(
                    self._snapshot(batch=batch, results=results, repair=rejected),
                    calls=[(str(b.get("id")), turn, str(b.get("name")),
                            "approved" if str(b.get("id")) in approved else "requested")
                           for b in batch if str(b.get("id")) not in (decided or {})])
            try:
                await self._run_tools(turn, batch, results, decided, whole, unoffered,
                                      in_doubt)
            finally:
                # Every call of a batch that began uses its unit of tool budget
                # (R08), whatever cut the batch (the run's deadline, its
                # caller's cancellation, a KeyboardInterrupt): its handlers may
                # have run, and the run's end records the budget as used.
                self.state = replace(self.state, tool_calls=self.state.tool_calls + len(batch))
        if results:
            self.transcript.append({"role": "user", "content": results})
        elif feedback_message is not None:
            self.transcript.append({"role": "user", "content": feedback_message})
        if self.inv.run_store is not None:
            await self._checkpoint(self._snapshot(repair=rejected))
        return "repair" if rejected else "turn"

    async def _decided_batch(self, state: RunState,
                             decisions: Mapping[str, Decision]) -> str | RunResult:
        """A resumed run's paused batch: approved calls run, denied and supplied
        ones get their decision's result; each uses tool budget (R08). The run's
        result when the batch's checks under the resumed run's limits end it,
        else the next turn's phase."""
        if not state.batch and not state.results:
            # No batch waits (a recovered run checkpointed between turns, or
            # before its first): the next turn goes.
            return "repair" if state.repair else "turn"
        calls = {str(b.get("id")): b for b in self.transcript[-1]["content"]
                 if b.get("type") == "tool_use"}
        # A recovered run's calls that ended before its process died have
        # their results in its checkpoint: they are not run again.
        done = {str(r.get("tool_use_id")) for r in state.results} & set(state.batch)
        whole = [calls[call_id] for call_id in state.batch if call_id in calls]
        batch = [block for block in whole if str(block.get("id")) not in done]
        untouched = not done and not self.recovering and all(
            call.reason != "in_doubt" for call in state.pending)
        if untouched:
            # Nothing of the batch has run: it is checked again, as any batch
            # is, under the resumed run's limits (a published operation given
            # to the resume may have narrowed them, docs/pause-and-resume.md):
            # refused, none of it runs (R02, R03).
            trip = check_tool_batch(self.state, self.limits, len(whole)) if whole else None
            if trip is None:
                trip = check_credits(self.state, self.limits)
            if trip is not None:
                return await self._end(trip.outcome, trip=trip, answered=list(state.results))
        self.state = replace(self.state, tool_calls=self.state.tool_calls + len(done))
        if self.sourced is not None:
            await self._refresh_tools()  # the tools may have changed during the pause
        # A call of a tool the run did not have when the model asked (a name it
        # made up) is answered as such, whatever the resume was given: a tool
        # of that name added now was never offered, nor asked about (its
        # approval), so it is not run.
        unoffered = set() if state.tools is None else {
            str(block.get("id")) for block in batch if str(block.get("name")) not in state.tools}
        if untouched:
            # A call that needed no approval at the pause may need it now (its
            # tool, as the resume gives it, asks): never run unasked, it pauses
            # the batch again, listed after the calls asked about before,
            # whose decisions are asked for again with it (one batch, decided
            # together: none of it has run).
            asked = {call.id for call in state.pending}
            now = pending_approvals([b for b in batch if str(b.get("id")) not in asked
                                     and str(b.get("id")) not in unoffered],
                                    self.tools, self.inv.id)
            if now:
                return await self._pause((*state.pending, *now), batch=whole,
                                         results=list(state.results), repair=state.repair)
        return await self._answer_batch(
            self.state.turns, batch, list(state.results), None, state.repair,
            decided_results(decisions), whole, unoffered,
            {call.id for call in state.pending if call.reason == "in_doubt"})

    async def _pause(self, pending: tuple[PendingCall, ...], *,
                     batch: Sequence[Mapping[str, Any]] | None = None,
                     results: list[dict[str, Any]] | None = None, repair: bool = False,
                     outcome: Outcome = Outcome.PAUSED, detail: str | None = None) -> RunResult:
        """Pause the run before its batch runs (or, for a resume its account did
        not admit, pause it again with the same batch)."""
        inv = self.inv
        paused_at = None
        if self.resumed is not None and batch is None:
            before = self.resumed[0]
            batch_ids, results, repair = before.batch, before.results, before.repair
            if outcome is not Outcome.PAUSED:
                # Not admitted: still the same pause, its clock not reset.
                paused_at = before.paused_at
        else:
            assert batch is not None and results is not None
            batch_ids = tuple(str(b.get("id")) for b in batch)
        state = self._snapshot(batch_ids=batch_ids, results=results, repair=repair,
                               pending=pending, paused_at=paused_at)
        if paused_at is not None:
            # The same pause: the state it returned, which the caller may hold
            # still, keeps its seal (no running time was added). A recovered
            # run's turn that its dead process was served is billed: its
            # charge is in the credits the pause records (R03).
            assert self.resumed is not None  # only a resume keeps its pause's time
            before = self.resumed[0]
            progress = state.progress
            state = replace(before, progress=replace(
                progress, running_seconds=before.progress.running_seconds,
                credits=progress.credits + inv.turn_credits(self.state.turns + 1)))
        # A compare-and-set on the run still being this segment's, as an end is.
        await pause(inv, state)
        if inv.run_store is not None:
            await self._checkpoint(state, paused=True, calls=[
                (call.id, self.state.turns, call.tool,
                 "in_doubt" if call.reason == "in_doubt" else "requested")
                for call in pending])
        if detail is None:
            detail = (f"{len(pending)} tool call(s) wait for approval: "
                      f"{', '.join(call.tool for call in pending)}")
        return self._result(outcome, detail=detail, trip=inv.denied, pending=pending,
                            state=state)

    def _paused_state(self) -> RunState:
        """The paused run this loop resumes, as its state, with the counts the
        ledger gave the resume (`prepare_resume`), not the caller's.

        Everything else is the pause's own, its running time included: the
        state's seal is the pause's (`RunState.seal`), which a recovery of
        a row a resume left before its first checkpoint (`StoredRun.unsettled_take`)
        reads to tell a pause nobody took from one another resume took
        (`Engine._settle_take`). A
        snapshot of the loop would differ: the time since the resume began,
        the tools it was given in addition, an output model's digest as the
        resume sends its schema."""
        assert self.resumed is not None
        before = self.resumed[0]
        counts = progress_of(self.inv, self.state)
        return replace(before, progress=replace(
            counts, running_seconds=before.progress.running_seconds,
            descendant_credits=before.progress.descendant_credits))

    def _snapshot(self, *, batch: Sequence[Mapping[str, Any]] = (),
                  batch_ids: tuple[str, ...] | None = None,
                  results: Sequence[dict[str, Any]] = (), repair: bool = False,
                  pending: tuple[PendingCall, ...] = (),
                  paused_at: Any = None) -> RunState:
        """The run as a `RunState` now: its transcript, the batch being answered
        (and the results it has), its pending calls and its progress."""
        inv = self.inv
        return RunState(
            invocation_id=inv.id, operation=inv.operation, limits=inv.asked_limits,
            retry=inv.policy, attribution=inv.attribution, system=self.spec.system,
            messages=self.transcript, given=self._given_messages,
            final_tool=self.spec.final_tool, structured=self.spec.output is not None,
            # The terminal tool's definition is the last one (`__init__`).
            output_digest=None if self.spec.output is None else json_digest(
                self.definitions[-1]),
            tools=tuple(self.tools), features=inv.features, pending=pending,
            batch=batch_ids if batch_ids is not None else tuple(
                str(b.get("id")) for b in batch),
            results=list(results), repair=repair,
            answered_calls=dict(self.answered_calls), progress=progress_of(inv, self.state),
            paused_at=paused_at or inv.clock.wall(), container=inv.container)

    async def _checkpoint(self, state: RunState | None, *, calls: Sequence[CallMark] = (),
                          results: Sequence[Mapping[str, Any]] | None = None,
                          paused: bool = False, create: bool = False) -> None:
        """Write the run's checkpoint to its run store, durably: its state
        (when given) or the results of the batch it answers (``results``), its
        lease renewed (or released, ``paused``) and its calls' statuses.
        Nothing without a run store.

        Raises:
            RunBusyError: another process took the run over.
        """
        inv = self.inv
        store = inv.run_store
        if store is None:
            return
        if inv.lease_owner is None:
            inv.lease_owner = new_owner()
        if create:
            # The invocation's row first: a store never holds a run its ledger lacks.
            flush = getattr(inv.ledger, "flush", None)
            if flush is not None:
                await flush()
        await store.checkpoint(
            inv.id, inv.lease_owner, now=inv.clock.wall(),
            state=None if state is None else state.dumps(),
            results=None if results is None else json.dumps(list(results)).encode(),
            expires_at=lease_expiry(inv, store.lease_grace), paused=paused, calls=calls,
            create=create)

    async def _continue_turn(self, turn: int,
                             paused: str) -> ProviderResponse | GuardTrip | RetryStop:
        """The turn paused (`CONTINUED_STOPS`): send its continuations, each one's
        blocks added to the turn's message, until a reply does not pause."""
        continuations = 0
        while True:
            continuations += 1
            if continuations > MAX_CONTINUATIONS:
                return GuardTrip(
                    Outcome.INCOMPLETE, "stop_reason", paused, MAX_CONTINUATIONS,
                    f"the turn paused more than {MAX_CONTINUATIONS} times",
                )
            reply = await request(self.inv, turn=turn, phase="continuation", build=self._build,
                                           on_text=self.spec.on_text)
            if not isinstance(reply, ProviderResponse):
                return reply
            self.transcript[-1]["content"].extend(_copy_blocks(reply.content))
            if reply.stop_reason not in CONTINUED_STOPS:
                return reply
            paused = reply.stop_reason

    def _wrap_up_due(self, turn: int) -> str | None:
        """Whether this turn wraps up (docs/guards.md): the last turn ``max_turns``
        permits, or the tool budget spent; None when ``wrap_up`` is off."""
        limits = self.limits
        if not limits.wrap_up:
            return None
        if turn >= limits.max_turns:
            return "turns"
        if limits.max_tool_calls is not None and self.state.tool_calls >= limits.max_tool_calls:
            return "budget"
        return None

    def _add_wrap_up_text(self) -> None:
        """Append the operation's wrap-up instruction to the newest user message."""
        text = {"type": "text", "text": self.inv.operation.wrap_up_text}
        last = self.transcript[-1]
        if last.get("role") != "user":
            self.transcript.append({"role": "user", "content": [text]})
        elif isinstance(last["content"], str):
            last["content"] = [{"type": "text", "text": last["content"]}, text]
        else:
            last["content"].append(text)

    def _tool_choice(self) -> dict[str, Any] | None:
        """A wrap-up turn disables the tools (the definitions stay, so the
        transcript stays valid); in structured mode it forces the answer tool."""
        if self.wrapping is None:
            return None
        if self.spec.output is not None:
            return {"type": "tool", "name": self.spec.final_tool}
        return {"type": "none"}

    def _build(self, timeout: float) -> ProviderRequest:
        return ProviderRequest(
            model=self.inv.operation.model,
            max_tokens=self.inv.operation.output_ceiling,
            messages=self.transcript,
            system=self.spec.system,
            tools=self.definitions,
            tool_choice=self._tool_choice(),
            timeout=timeout,
            cache=self.inv.operation.cache,
            metadata={"turn": self.state.turns},
            features=self.inv.features,
            container=self.inv.live_container(),
        )

    def _charge(self, turn: int) -> None:
        """Add the turn's rounded charge; the crossing turn stays billed (R03, S01).
        The tree's holds now see it: the turn gives up the crossing permit."""
        self.charged = turn
        credits = self.inv.turn_credits(turn)
        self.inv.add_credits(credits)  # and to the runs above, for their holds
        self.state = replace(self.state, credits=self.state.credits + credits)
        self._release_permit()

    async def _take_permit(self) -> None:
        """Before a turn under a credit hold: take the tree's crossing permit, so the
        turn is the only one in flight in the tree that may cross a hold (docs/tools.md).
        Held by nobody (a run alone in its tree), it is taken without waiting."""
        if not needs_crossing_permit(self.inv.credit_tree()):
            return
        permit = self.inv.crossing_permit()
        try:
            permit.acquire_nowait()
        except anyio.WouldBlock:
            await permit.acquire()
        self.permit = permit

    def _release_permit(self) -> None:
        """Give the crossing permit back, when this run holds it."""
        if self.permit is not None:
            self.permit.release()
            self.permit = None

    # -- answers ----------------------------------------------------------------------

    async def _structured_answer(self, block: Mapping[str, Any]) -> _Answer:
        assert self.spec.output is not None
        try:
            value = validated(self.spec.output, block.get("input", {}))
        except ToolInputError as error:
            return _Answer(False, feedback="The answer does not match the required schema: "
                                           + str(error))
        return await self._judge(value, self.spec.final_tool)

    async def _judge(self, value: Any, name: str) -> _Answer:
        """Run the consumer's judge; a judge that raises is a rejection (R10).

        A judge that raises, or returns something that is not a verdict, has a
        bug: the answer still counts as rejected, and the bug is logged at
        ERROR (with the traceback of what it raised) so that it is seen.
        """
        if self.spec.accept is None:
            return _Answer(True, value)
        try:
            verdict = self.spec.accept(value)
            if inspect.isawaitable(verdict):
                verdict = await verdict
        except BaseException as error:
            if not own_failure(error):
                raise
            logger.error("run %s: the judge raised %s; the answer counts as rejected (R10)",
                         self.inv.id, type(error).__name__, exc_info=withheld(error))
            return _Answer(False, feedback="The answer could not be checked: "
                                           + await self._error_text(name, error))
        if verdict is True or isinstance(verdict, Accept):
            return _Answer(True, value)
        if verdict is False:
            return _Answer(False, feedback=DEFAULT_REJECTION)
        if isinstance(verdict, Reject):
            return _Answer(False, feedback=verdict.feedback)
        logger.error("run %s: the judge returned %s, not Accept, Reject or a bool; the answer "
                     "counts as rejected (R10)", self.inv.id, type(verdict).__name__)
        return _Answer(False, feedback="The answer could not be checked: "
                       + await self._error_text(name, TypeError(
                           f"the judge returned {type(verdict).__name__}, not Accept or Reject")))

    async def _error_text(self, name: str, error: BaseException) -> str:
        """What the model is told of ``error`` (R09): the ``tool_error_text``
        hook's text (awaited when the hook is async, as a judge's verdict is),
        as a string JSON can carry (a lone surrogate in it, from an exception's
        message, replaced by U+FFFD as in a handler's result).

        A hook that raises or returns something other than a string has a bug:
        it is logged at ERROR with its traceback, and the model is told only
        the error's type (the hook may exist to keep messages from the model).
        """
        try:
            text: object = self.spec.tool_error_text(name, error)
            if inspect.isawaitable(text):
                text = await text
            if not isinstance(text, str):
                raise TypeError(f"the tool_error_text hook returned {type(text).__name__}, "
                                "not str")
        except BaseException as bug:
            if not own_failure(bug):
                raise
            logger.error("run %s: the tool_error_text hook raised %s on an error of %s; the "
                         "model is told only the error's type", self.inv.id,
                         type(bug).__name__, name, exc_info=withheld(bug))
            text = f"{name} failed ({type(error).__name__})."
        rendered = render_tool_output(text)
        assert isinstance(rendered, str)  # a string renders as a string
        return rendered

    # -- tools --------------------------------------------------------------------------

    async def _run_tools(
        self, turn: int, batch: Sequence[Mapping[str, Any]], out: list[dict[str, Any]],
        decided: Mapping[str, tuple[str, bool]] | None = None,
        whole: Sequence[Mapping[str, Any]] | None = None, unoffered: Set[str] = frozenset(),
        in_doubt: Set[str] = frozenset(),
    ) -> None:
        """Run the whole batch concurrently, within the run's deadline; add their
        results to ``out``. A call the deadline cut gets an error result; a call
        in ``decided`` (denied or supplied on resume: ``(text, is_error)``) gets
        that result and runs nothing. With a run store, a call is recorded
        ``started`` before its handler runs, and its end with the batch's
        results so far, its own included: ``in_doubt`` when its result is not
        known (its timeout cut it, or its MCP server was lost during it), since
        it may have done its work. ``whole``: a resumed batch's calls, those
        answered before its pause or crash included, in the order asked (the
        tools' ``max_calls`` are counted over them); ``unoffered``: calls of a
        tool the run did not have when the model asked, answered as an unknown
        tool's; ``in_doubt``: calls a recovery found in doubt, which count
        against their tool's ``max_calls`` whatever their decision (their
        handler may have run)."""
        decided = decided or {}
        inv = self.inv
        before = list(out)
        observed = bool(inv.observers)  # events are built only for someone to see
        usage = inv.turn_usage(turn) if observed else Usage()
        spend = inv.turn_cost_usd(turn) if observed else Decimal(0)
        results: list[dict[str, Any] | None] = [None] * len(batch)
        unknown: set[int] = set()  # calls ended without a known result: they may have run
        # Each call's input is checked before any handler runs, and a tool's
        # max_calls counted in the batch's order (the calls then run at once):
        # only a call let through to its handler counts, not one whose input
        # failed its check. A resumed batch is counted whole (``whole``), the
        # calls that ended before its pause or crash too, as its first run
        # counted them: the counts it starts from are those before the batch.
        checked: dict[str, Any] = {}
        """Each call's handler argument, or the `ToolInputError` of its input."""
        capped: set[str] = set()
        for block in batch if whole is None else whole:
            call_id = str(block.get("id"))
            known = None if call_id in unoffered else self.tools.get(str(block.get("name")))
            if known is None or (call_id in decided and call_id not in in_doubt):
                continue
            try:
                checked[call_id] = known.validate(block.get("input", {}))
            except ToolInputError as error:
                checked[call_id] = error
                continue
            if known.max_calls is None:
                continue
            count = self.answered_calls.get(known.name, 0)
            if count >= known.max_calls:
                capped.add(call_id)
            else:
                self.answered_calls[known.name] = count + 1

        running: dict[int, float] = {}
        """Calls announced ``started`` and not announced ended, with when they started."""

        async def tool_event(index: int, status: str, latency: float,
                             error: str | None = None) -> None:
            if status == "started":
                running[index] = inv.clock.now()
            else:
                running.pop(index, None)
            if not observed:
                return
            block = batch[index]
            await inv.emit(ToolCallEvent(
                run_id=inv.id, at=inv.clock.wall(), tool_name=str(block.get("name")),
                status=status,  # type: ignore[arg-type]
                latency_ms=max(0, round(latency * 1000)),
                token_cost=usage.total_input_tokens + usage.output_tokens,
                input_tokens=usage.total_input_tokens, output_tokens=usage.output_tokens,
                model_id=inv.operation.model, provider=inv.operation.provider,
                spend_usd=spend, tool_use_id=str(block.get("id")), turn=turn, error=error,
            ))
            if status == "started" and index in running:
                # The call runs from its announcement on: the time its observers
                # took is not the call's (its latency_ms).
                running[index] = inv.clock.now()

        stopped: list[BaseException] = []
        """What stops the batch and is raised from the run's own task."""

        async def one(index: int, block: Mapping[str, Any]) -> None:
            try:
                await answered(index, block)
            except anyio.get_cancelled_exc_class():
                raise
            except Exception as error:
                if not isinstance(error, RunBusyError):
                    raise  # an error (a ledger's): the task group raises it
                # Another process took the run over: no further handler runs here.
                stopped.append(error)
                group.cancel_scope.cancel()
            except BaseException as error:
                # A KeyboardInterrupt or SystemExit leaving this task would end
                # an asyncio event loop before the run records its end: it is
                # raised from the run's task instead.
                stopped.append(error)
                group.cancel_scope.cancel()

        async def answered(index: int, block: Mapping[str, Any]) -> None:
            await answer(index, block)
            if inv.run_store is None:
                return
            call_id = str(block.get("id"))
            given = decided.get(call_id)
            result = results[index]
            if given is not None:
                status = "denied" if given[1] else "supplied"
            elif index in unknown:
                status = "in_doubt"
            else:
                status = "failed" if result is None or result.get("is_error") else "succeeded"
            # The call's end and its result, in one write: a crash never loses
            # the result of a call recorded as ended. The batch's results so
            # far, not the state: its transcript was written before the batch.
            await self._checkpoint(
                None, results=[*before, *(r for r in results if r is not None)],
                calls=[(call_id, turn, str(block.get("name")), status)])

        async def answer(index: int, block: Mapping[str, Any]) -> None:
            name = str(block.get("name"))
            call_id = str(block.get("id"))
            await tool_event(index, "started", 0.0)
            started = running[index]
            handler = None if call_id in unoffered else self.tools.get(name)
            given = decided.get(call_id)
            if given is not None:
                text, denied = given
                if not denied:
                    results[index] = _tool_result(block, text)
                    await tool_event(index, "succeeded", 0.0)
                    return
                failed = "denied"
            elif name == self.spec.final_tool:
                text, failed = "Only the first final answer of a turn is considered.", "duplicate"
            elif call_id in unoffered:
                text, failed = (f"There was no tool named {name!r} when this call was made; "
                                "it was not run."), "unknown tool"
            elif handler is None:
                available = ", ".join(sorted(self.tools)) or "none"
                text, failed = f"There is no tool named {name!r}. Available tools: {available}.", \
                    "unknown tool"
            elif call_id in capped:
                text = (f"{name} may be called at most {handler.max_calls} times in this run; "
                        "this call was not run.")
                failed = "max_calls"
            else:
                argument = checked[call_id]
                if isinstance(argument, ToolInputError):
                    text, failed = f"Invalid input for {name}: {argument}", "invalid input"
                else:
                    if inv.run_store is not None:
                        # Durable before the handler runs: a crash from here on
                        # leaves the call in doubt, never silently run twice.
                        await self._checkpoint(None, calls=[(call_id, turn, name, "started")])
                    # Its deadline read as its timeout starts.
                    context = (None if handler.context_parameter is None
                               else context_for(inv, call_id, handler.timeout))
                    try:
                        if handler.timeout is None:
                            value = await handler.invoke(argument, context)
                        else:
                            with inv.clock.cancel_scope(handler.timeout) as limit:
                                try:
                                    value = await handler.invoke(argument, context)
                                except BaseException as error:
                                    if limit.cancel_called and own_failure(error):
                                        # The handler made an error of its timeout's
                                        # cancellation (caught it, raised another):
                                        # cut all the same, its result not known.
                                        raise _ToolTimeout(handler.timeout) from None
                                    raise
                            if limit.cancelled_caught:
                                raise _ToolTimeout(handler.timeout)
                    except _ToolTimeout as late:
                        text = (f"{name} did not finish within its timeout of "
                                f"{late.seconds:g}s; its result is not known.")
                        failed = "timeout"
                        unknown.add(index)
                    except BaseException as error:
                        if not own_failure(error):
                            # The run's cancellation, or what stops the run
                            # (KeyboardInterrupt, SystemExit): never the model's
                            # to read. The call ends here, then the run (`run`).
                            if not isinstance(error, anyio.get_cancelled_exc_class()):
                                await tool_event(index, "failed", inv.clock.now() - started,
                                                 f"handler raised {type(error).__name__}")
                            raise
                        # A handler that made an error of the run's cancellation
                        # (its deadline, its caller's) was cut by it all the same:
                        # the cancellation goes on, and the call is in doubt.
                        await anyio.lowlevel.checkpoint_if_cancelled()
                        # Raising is how a handler reports a failure to the model
                        # (R09), so a WARNING, not an ERROR; the traceback shows a
                        # raise that was a bug.
                        logger.warning("run %s: tool %s raised %s; the model gets an error "
                                       "result (R09)", inv.id, name, type(error).__name__,
                                       exc_info=withheld(error))
                        text = await self._error_text(name, error)
                        failed = f"handler raised {type(error).__name__}"
                        if isinstance(error, MCPServerError) and error.result_unknown:
                            unknown.add(index)
                    else:
                        try:
                            content = render_tool_output(value)
                        except Exception as error:
                            # A value JSON cannot carry (a key that is not a string,
                            # a cycle, nesting too deep, a __str__ that raises): the
                            # handler's bug, told to the model as a failed call.
                            logger.warning("run %s: tool %s returned a value that cannot be "
                                           "sent as its result (%s); the model gets an "
                                           "error result", inv.id, name,
                                           type(error).__name__, exc_info=withheld(error))
                            text = (f"{name} returned a value that cannot be sent as a tool "
                                    f"result ({type(error).__name__}).")
                            failed = "invalid output"
                        else:
                            results[index] = _tool_result(block, content)
                            await tool_event(index, "succeeded", inv.clock.now() - started)
                            return
            results[index] = _tool_result(block, text, error=True)
            await tool_event(index, "failed", inv.clock.now() - started, failed)

        async def collect() -> None:
            for index, block in enumerate(batch):
                result = results[index]
                if result is None:
                    result = _tool_result(
                        block, "The tool call did not finish before the run's time ran out.",
                        error=True)
                    await tool_event(index, "failed", inv.clock.now() - began, "deadline")
                out.append(result)

        async def end_cut() -> None:
            # The calls whose handlers the run's end cut (the caller cancelled
            # it, or an error ended it): each is announced ended, so that an
            # observer never holds a call open. A run store records them
            # ``in_doubt`` when the run ends (`RunStore.drop`): they may have
            # done their work.
            for index in sorted(running):
                await tool_event(index, "failed", inv.clock.now() - running[index], "cancelled")

        began = inv.clock.now()
        try:
            async with anyio.create_task_group() as group:
                for index, block in enumerate(batch):
                    group.start_soon(one, index, block)
            if stopped:
                raise stopped[0]
        except BaseExceptionGroup as grouped:
            # What ended the task group (a ledger's error from a call's
            # checkpoint, a handler's KeyboardInterrupt) reaches the run as it
            # was raised, not in a group; the first, when several calls raised.
            await uninterrupted(end_cut)
            raise first_error(grouped) from None
        except anyio.get_cancelled_exc_class():
            if inv.deadline.remaining(inv.clock.now()) > 0:
                await uninterrupted(end_cut)
                raise  # the caller's cancellation
            # The run's deadline: the calls it cut get error results, which
            # `_deadline_passed` adds to the transcript.
            with anyio.CancelScope(shield=True):
                await collect()
            self.cut_results = out
            raise
        except BaseException:
            await uninterrupted(end_cut)
            raise
        await collect()

    # -- endings -------------------------------------------------------------------------

    async def _stopped(self, reason: GuardTrip | RetryStop) -> RunResult:
        if isinstance(reason, GuardTrip):
            return await self._end(reason.outcome, trip=reason)
        fault = reason.fault
        outcome = (Outcome.CREDIT_EXHAUSTED if fault.kind is FaultKind.CREDIT_EXHAUSTED
                   else Outcome.PROVIDER_ERROR)
        why = {
            "permanent": "is not retried",
            "not_retryable": "was not retried: the provider said not to",
            "exhausted": f"persisted through {reason.attempts} attempts",
            "deadline": "was not retried: the wait would outlast the run's time",
        }[reason.reason]
        detail = f"{fault.kind.value} fault {why}: {fault.message}"
        return await self._end(outcome, fault=fault, detail=detail)

    async def _end(
        self,
        outcome: Outcome,
        *,
        answer: Any = None,
        trip: GuardTrip | None = None,
        fault: Any = None,
        detail: str | None = None,
        answered: Sequence[dict[str, Any]] = (),
    ) -> RunResult:
        """End the run with ``outcome`` and return its result.

        ``answered`` holds the tool results the last response's calls already
        have (a rejected answer's feedback, an accepted one's receipt); every
        other call of that response is closed as not run.
        """
        inv = self.inv
        if detail is None:
            detail = trip.message if trip else "the answer was accepted"
        # The end is a compare-and-set on the run still being this segment's
        # when it holds a run store's lease (`loopengine._lifecycle.held_end`):
        # a segment whose run another process took over ends nothing of it,
        # and announces nothing (its `GuardTripped` comes after the write).
        await finish(inv, outcome.value, turns=self.state.turns,
                     tool_calls=self.state.tool_calls, credits=self.state.credits, trip=trip)
        self._close_unrun_calls(answered, f"Not run: the run ended {outcome.value} before "
                                          f"this call ran: {detail}.")
        return self._result(outcome, answer=answer, trip=trip, fault=fault, detail=detail)

    def _result(self, outcome: Outcome, *, detail: str, answer: Any = None,
                trip: GuardTrip | None = None, fault: Any = None,
                pending: tuple[PendingCall, ...] = (), state: RunState | None = None,
                ) -> RunResult:
        inv = self.inv
        return RunResult(
            outcome=outcome,
            answer=answer,
            turns=self.state.turns,
            tool_calls=self.state.tool_calls,
            usage=inv.usage,
            cost_usd=inv.cost_usd,
            provider_cost_usd=nanousd_to_usd(inv.provider_cost_nanousd),
            credits=self.state.credits,
            credits_total=self.state.credits + inv.descendant_credits,
            attempts=inv.summary(),
            invocation_id=inv.id,
            messages=self.transcript,
            trip=trip,
            fault=fault if fault is not None else (
                inv.last_fault if outcome in (Outcome.PROVIDER_ERROR, Outcome.CREDIT_EXHAUSTED)
                else None),
            unpriced=inv.unpriced,
            detail=detail,
            attempt_log=tuple(inv.records),
            pending=pending,
            state=state,
        )

    def _close_unrun_calls(self, answered: Sequence[dict[str, Any]], why: str) -> None:
        """Give every ``tool_use`` of the run's last response a ``tool_result``.

        ``result.messages`` must be a history the caller can continue by
        appending a user message (docs/guards.md): the API refuses a ``tool_use``
        without a ``tool_result`` in the next message. One user message holds
        every result, in the order of the calls, as after a turn's tools (R08).
        """
        if len(self.transcript) <= self._given_messages:
            return
        last = self.transcript[-1]
        if last.get("role") != "assistant" or not isinstance(last.get("content"), list):
            return
        calls = [b for b in last["content"] if b.get("type") == "tool_use"]
        if not calls:
            return
        by_id = {r.get("tool_use_id"): r for r in answered}
        self.transcript.append({"role": "user", "content": [
            by_id.get(b.get("id")) or _tool_result(b, why, error=True) for b in calls
        ]})


def final_tool_definition(output: type[pydantic.BaseModel], name: str) -> dict[str, Any]:
    """The terminal tool of structured mode: the model answers by calling it."""
    return {
        "name": name,
        "description": "Give your final answer. Call this exactly once, when you "
                       "have the answer, with the answer as its input.",
        "input_schema": _validate.model_schema("output", output),
    }


class _ToolTimeout(Exception):
    """A call ran past its tool's ``timeout`` (internal)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(seconds)
        self.seconds = seconds


def _copy_blocks(content: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [{key: _copy_tree(item) for key, item in b.items()} for b in content]


def _copy_tree(value: Any) -> Any:
    """A deep copy of a reply's JSON: plain dicts and lists copied, strings, numbers
    and None kept, anything else by `copy.deepcopy` (a third of its cost on JSON)."""
    kind = type(value)
    if kind is dict:
        return {key: _copy_tree(item) for key, item in value.items()}
    if kind is list:
        return [_copy_tree(item) for item in value]
    if kind is str or kind is int or kind is float or kind is bool or value is None:
        return value
    return copy.deepcopy(value)


def call_ids(messages: Sequence[Mapping[str, Any]]) -> Iterator[str]:
    """The ids of the tool calls of ``messages``."""
    return (str(b.get("id")) for m in messages if isinstance(m.get("content"), list)
            for b in m["content"] if isinstance(b, Mapping) and b.get("type") == "tool_use")


def unique_call_ids(blocks: Sequence[dict[str, Any]], used: Set[str]) -> None:
    """Give each tool call of a reply (``blocks``, the transcript's own copy) an
    id no other call of the conversation (``used``, the ids of the earlier
    messages' calls, or this reply) has: a call without one, or with one the
    server gave another call too (some servers that speak a vendor's API name
    every call ``0``, or none), gets a new one, which the transcript carries
    back to the server.

    A call's id names its result, its row in a run store (what a recovery
    reads to run it once) and its `ToolContext.idempotency_key`: two calls
    under one id would share them, the second taken for the first (its result
    for the first's, or an idempotent API's replay of the first)."""
    mine: set[str] = set()
    for block in blocks:
        if block.get("type") != "tool_use":
            continue
        call_id = block.get("id")
        if not isinstance(call_id, str) or not call_id or call_id in used or call_id in mine:
            call_id = block["id"] = new_call_id()
        mine.add(call_id)


def _tool_result(block: Mapping[str, Any], content: Any, *, error: bool = False) -> dict[str, Any]:
    result: dict[str, Any] = {"type": "tool_result", "tool_use_id": block.get("id"),
                              "content": content}
    if error:
        result["is_error"] = True
    return result


def check_unique_tools(tools: Sequence[Tool], final_tool: str, structured: bool,
                       places: Sequence[tuple[str, str]] | None = None) -> None:
    """Tool names must be unique and must not take the terminal tool's name.

    ``places``: where the caller put each tool (`ExpandedTools.places`: a
    source's tools share its position), which an error names; default each
    tool's own position in ``tools``."""
    where = places if places is not None else [(f"tools[{i}]", "") for i in range(len(tools))]

    def described(i: int) -> str:
        field, source = where[i]
        return f"{field} ({source})" if source else field

    seen: dict[str, int] = {}
    for i, item in enumerate(tools):
        field, source = where[i]
        if not isinstance(item, Tool):
            raise ConfigError(field, f"must be a Tool (use @loopengine.tool), got {item!r}")
        if item.name in seen:
            raise ConfigError(field, f"two tools are named {item.name!r}: "
                                     f"{described(seen[item.name])} and {described(i)}")
        if structured and item.name == final_tool:
            raise ConfigError(field, f"{final_tool!r} is the terminal tool's name"
                                     + (f" (a tool of {source})" if source else ""))
        seen[item.name] = i
