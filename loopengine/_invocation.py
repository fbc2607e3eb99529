"""One invocation's accounting: every attempt recorded, priced and reported once.

`Invocation` is shared by `Engine.run` and `Engine.call`. It numbers attempts,
writes each to the ledger before it goes on the wire and settles it after,
prices it at its start time, keeps the totals, and emits the events. The
run loop and the structured call decide *what* to send; this decides nothing
about the conversation.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import logging
import math
import random
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

import anyio
import anyio.lowlevel

from loopengine._accounts import CreditAccounts, Reservation, expiry
from loopengine._attribution import Attribution
from loopengine._clock import Clock
from loopengine._errors import LedgerError, LoopEngineError
from loopengine._operation import Operation
from loopengine._outcome import Outcome
from loopengine._pricing import PriceBook, nanousd_to_usd
from loopengine._result import AttemptsSummary
from loopengine._usage import Usage
from loopengine.events import (
    AttemptSettled,
    AttemptStarted,
    Event,
    GuardTripped,
    Observer,
    RunEnded,
    RunStarted,
    TextDelta,
    TurnStarted,
)
from loopengine.guards._checkpoints import (
    ConversationState,
    GuardTrip,
    attempt_timeout,
    check_before_attempt,
)
from loopengine.guards._credits import turn_credits
from loopengine.guards._deadline import Deadline
from loopengine.guards._limits import Limits
from loopengine.persistence._protocol import Ledger
from loopengine.persistence._records import (
    AttemptDispatch,
    AttemptRecord,
    AttemptSettle,
    InvocationEnd,
    InvocationStart,
)
from loopengine.providers._base import (
    Provider,
    ProviderRequest,
    ProviderResponse,
    TextCallback,
    vendor_of,
)
from loopengine.providers._faults import FaultKind, ProviderFault
from loopengine.providers._retry import RetryPolicy, RetryStop, after_fault

logger = logging.getLogger("loopengine")

__all__ = ["Invocation"]


@dataclass(slots=True)
class _InFlight:
    index: int
    started: float
    callback_error: Exception | None = None
    """What the run's ``on_text`` callback raised during this attempt."""


_NOBODY = Attribution()
"""The attribution of a run given none (frozen: one instance serves them all)."""

LEDGER_GRACE = 0.2
"""Seconds past the deadline that the ledger's writes are awaited, and the least
an invocation's end is awaited: past them the run returns, its writes queued
(a stalled writer cannot hold a run past its deadline, R04)."""


async def uninterrupted(step: Callable[[], Awaitable[None]]) -> None:
    """Run ``step`` to its end whatever cancellation arrives meanwhile, then raise
    the cancellation, if one arrived.

    An anyio shield keeps the caller's cancel scopes out. On asyncio a native
    `asyncio.Task.cancel()` still reaches a shielded await, so there the step
    runs in a task of its own, and this waits for it through every
    cancellation: cleanup, once started, finishes."""
    with anyio.CancelScope(shield=True):
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # another backend (trio): its shield holds
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


class Invocation:
    """The accounting of one run or call (internal)."""

    # Slots: thousands are alive at once in a busy process.
    __slots__ = (
        "_announced", "_begun", "_ended", "_in_flight",
        "_reply_unconfirmed", "_reservation", "_turn_attempts", "_turn_charge",
        "_unpriced_warned", "account", "accounts", "attribution", "clock", "cost_nanousd",
        "deadline", "denied", "id", "kind", "last_fault", "ledger", "limits", "observers",
        "operation", "output_tokens", "policy", "prices", "provider", "provider_cost_nanousd",
        "records", "rng", "served_by", "started", "text_sink", "unpriced", "usage",
        "usage_complete", "vendor",
    )

    def __init__(
        self,
        *,
        kind: str,
        operation: Operation,
        provider: Provider,
        limits: Limits,
        policy: RetryPolicy,
        attribution: Attribution | None,
        ledger: Ledger | None,
        prices: PriceBook,
        clock: Clock,
        rng: random.Random,
        observers: Sequence[Observer],
        unpriced_warned: set[str] | None = None,
        accounts: CreditAccounts | None = None,
        account: str | None = None,
        text_sink: Callable[[TextDelta], None] | None = None,
    ) -> None:
        self.id = str(uuid.uuid4())
        self.kind = kind
        self.operation = operation
        self.provider = provider
        self.limits = limits
        self.policy = policy
        self.attribution = attribution or _NOBODY
        self.ledger = ledger
        self.prices = prices
        self.clock = clock
        self.rng = rng
        self.observers = tuple(observers)
        self.vendor = vendor_of(provider)
        """Whose API serves the route: what ``served_by`` and prices name."""
        self.served_by = f"{self.vendor}:{operation.model}"
        self.started = clock.now()
        self.deadline = Deadline.after(self.started, limits.total_time)
        self.records: list[AttemptRecord] = []
        self.usage = Usage()
        self.usage_complete = True
        self.output_tokens = 0
        self.cost_nanousd = 0
        self.provider_cost_nanousd = 0
        self.unpriced = False
        self.last_fault: ProviderFault | None = None
        self._turn_attempts: dict[int, int] = {}
        self._turn_charge: dict[int, int] = {}
        self._in_flight: _InFlight | None = None
        self._ended = False
        self._announced = False
        self._begun = False
        self._reply_unconfirmed = False
        self.accounts = accounts if account is not None else None
        self.account = account
        self._reservation: Reservation | None = None
        self.text_sink = text_sink
        """Where streamed text goes as `TextDelta` (`Engine.stream`), or None."""
        self.denied: GuardTrip | None = None
        """Set by `begin` when the run's account had nothing to reserve."""
        self._unpriced_warned = unpriced_warned if unpriced_warned is not None else set()

    # -- events -------------------------------------------------------------

    async def emit(self, event: Event) -> None:
        """Deliver ``event`` to every observer; an observer's failure is only logged."""
        for observer in self.observers:
            try:
                maybe = observer(event)
                if inspect.isawaitable(maybe):
                    await maybe
            except Exception:
                logger.exception("observer %r failed on %s; the run goes on",
                                  observer, type(event).__name__)

    # -- lifecycle ------------------------------------------------------------

    async def begin(self) -> None:
        """Record the invocation as running and announce it.

        From here on the invocation is begun: whatever stops it is recorded
        (`ending`). A ledger that refuses the start leaves nothing begun."""
        at = self.clock.wall()
        self._begun = True
        if self.ledger is not None:
            try:
                await self.ledger.start_invocation(InvocationStart(
                    id=self.id,
                    operation=self.operation.name,
                    operation_version=self.operation.version,
                    provider=self.operation.provider,
                    model=self.operation.model,
                    tenant=self.attribution.tenant,
                    user_id=self.attribution.user_id,
                    feature=self.attribution.feature,
                    correlation_id=self.attribution.correlation_id,
                    started_at=at,
                ))
            except LoopEngineError as error:
                self._begun = False
                self.count_attempts_on(error)  # none: nothing was sent
                raise
        await self.emit(RunStarted(
            run_id=self.id, at=at, operation=self.operation.name,
            operation_version=self.operation.version, provider=self.operation.provider,
            model=self.operation.model, kind="run" if self.kind == "run" else "call",
            tenant=self.attribution.tenant, feature=self.attribution.feature,
            correlation_id=self.attribution.correlation_id, vendor=self.vendor,
        ))
        if self.accounts is not None:
            await self._admit(at)

    async def _admit(self, at: datetime) -> None:
        """Reserve the run's credit hold on its account before its first request
        (§13): less available narrows the hold; nothing available denies the run."""
        assert self.accounts is not None and self.account is not None
        hold = self.limits.credit_hold
        assert hold is not None  # the engine gives every run on an account a hold
        accounts, account = self.accounts, self.account
        got: list[Reservation] = []

        async def reserve() -> None:
            got.append(await accounts.reserve(
                account, self.id, hold,
                expires_at=expiry(at, self.limits.total_time, accounts.expiry_grace),
                credits_per_usd=self.prices.credits_per_usd,
                credit_quantum=self.prices.credit_quantum))

        if not await self._confirm(reserve()):
            self.denied = GuardTrip(Outcome.TIME_LIMIT, "total_time", 0.0,
                                    self.limits.total_time,
                                    "the account's reservation was not confirmed before the "
                                    f"deadline (total_time={self.limits.total_time})")
            return
        reservation = got[0]
        if reservation.credits == 0:
            self.denied = GuardTrip(
                Outcome.ADMISSION_DENIED, "account", reservation.available, hold,
                f"account {account!r} has {max(0, reservation.available)} credits available, "
                f"nothing to reserve for this run's hold of {hold}")
            return
        self._reservation = reservation
        if reservation.credits < hold:
            # A narrowing (R13): the run may spend only what was reserved.
            self.limits = dataclasses.replace(self.limits, credit_hold=reservation.credits)

    async def finish(
        self, outcome: str, *, turns: int, tool_calls: int, credits: int,
        trip: GuardTrip | None = None,
    ) -> None:
        """Settle the invocation with ``outcome`` (ledger, events, log).

        A cancellation that arrives before the end is written ends the
        invocation ``cancelled`` instead (`ending`). Once the end is being
        written it is finished, uninterrupted: a cancellation arriving then
        propagates afterwards, and the ledger and `RunEnded` keep ``outcome``."""
        at = self.clock.wall()
        if trip is not None:
            await self.emit(GuardTripped(
                run_id=self.id, at=at, guard=trip.guard, observed=trip.observed,
                limit=trip.limit, outcome=trip.outcome.value, message=trip.message,
            ))
        await anyio.lowlevel.checkpoint()  # a pending cancellation is the end

        async def end() -> None:
            await self._write_end(at, outcome, turns=turns, tool_calls=tool_calls,
                                  credits=credits)

        await uninterrupted(end)

    async def _write_end(self, at: datetime, outcome: str, *, turns: int, tool_calls: int,
                         credits: int) -> None:
        self._ended = True
        try:
            if self.ledger is not None:
                confirmed = await self._confirm(self.ledger.end_invocation(
                    InvocationEnd(id=self.id, ended_at=at, outcome=outcome, turns=turns,
                                  tool_calls=tool_calls, credits=credits)
                ), at_least=LEDGER_GRACE)
                if not confirmed:
                    logger.warning("%s %s: the ledger did not confirm its end (%s) by its "
                                   "deadline; the write stays queued", self.kind, self.id,
                                   outcome)
        finally:
            # The account is settled however the end's write went (§13).
            await self._settle_account(credits)
        logger.info(
            "%s %s ended %s: operation=%s turns=%d tool_calls=%d attempts=%d "
            "cost_nanousd=%d credits=%d",
            self.kind, self.id, outcome, self.operation.name, turns, tool_calls,
            len(self.records), self.cost_nanousd, credits,
        )
        await self._announce_end(at, outcome, turns=turns, tool_calls=tool_calls,
                                 credits=credits)

    async def _announce_end(self, at: datetime, outcome: str, *, turns: int, tool_calls: int,
                            credits: int) -> None:
        """Emit `RunEnded`, once: an observer's run ends however the run does."""
        if self._announced:
            return
        self._announced = True
        await self.emit(RunEnded(
            run_id=self.id, at=at, outcome=outcome, turns=turns, tool_calls=tool_calls,
            attempts=len(self.records), usage=self.usage, cost_usd=self.cost_usd,
            credits=credits,
        ))

    @contextlib.asynccontextmanager
    async def ending(self, progress: Callable[[], tuple[int, int, int]]) -> AsyncIterator[None]:
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
            await self.begin()
            yield
        except anyio.get_cancelled_exc_class():
            await self.cancelled(progress)
            raise
        except Exception as error:
            await self.failed(error, progress)
            raise

    async def cancelled(self, progress: Callable[[], tuple[int, int, int]]) -> None:
        """The caller's cancellation reached the body of `ending`: record the
        invocation ``cancelled`` if it was begun; the caller then re-raises.

        `ending`'s handler, for a body that cannot be written in an ``async
        with`` (the run loop keeps it in its own frame, see `loopengine._run`).
        """
        if self._begun:
            await self._cleanup("cancelled", progress)

    async def failed(self, error: Exception,
                     progress: Callable[[], tuple[int, int, int]]) -> None:
        """``error`` stopped the body of `ending`: record the invocation
        ``failed`` if it was begun and give ``error`` its attempt count; the
        caller then re-raises."""
        if self._begun:
            await self._cleanup("failed", progress)
        self.count_attempts_on(error)

    async def _cleanup(self, outcome: str, progress: Callable[[], tuple[int, int, int]]) -> None:
        async def step() -> None:
            await self._end_without_outcome(outcome, *progress())

        try:
            await uninterrupted(step)
        except anyio.get_cancelled_exc_class():
            if outcome != "cancelled":
                raise  # a failure cancelled meanwhile: the cancellation wins
            # cancelled again meanwhile: the cancellation being handled propagates

    async def _end_without_outcome(self, outcome: str, turns: int, tool_calls: int,
                                   credits: int) -> None:
        """Record the invocation ``cancelled`` or ``failed`` as far as the ledger
        still can, then announce the end.

        A cancelled run's in-flight attempt is settled ``aborted``/``external``.
        A failed run's is not: the error came from writing its row (or from the
        ledger breaking), so it never went out (a request is sent only once its
        row is written); it is not one of the run's attempts, and a turn it alone
        would have sent was not sent (R01 counts turn requests sent). A ledger
        failure here is logged, not raised: it must not replace the exception
        that ended the run."""
        if outcome == "failed":
            if self._in_flight is not None:
                self.records.pop(self._in_flight.index)
                self._in_flight = None
            # A turn whose request was never sent is no turn (R01).
            turns = min(turns, max((r.dispatch.turn for r in self.records), default=0))
        try:
            if self._in_flight is not None:
                await self._settle(self._in_flight, None, None, external=True)
            if not self._ended:
                await self._write_end(self.clock.wall(), outcome, turns=turns,
                                      tool_calls=tool_calls, credits=credits)
        except LedgerError:
            what = "the cancellation" if outcome == "cancelled" else "its failure"
            logger.exception("run %s: the ledger could not record %s", self.id, what)
        await self._announce_end(self.clock.wall(), outcome, turns=turns,
                                 tool_calls=tool_calls, credits=credits)

    def _delta(self, turn: int, attempt: int, ordinal: int) -> Callable[[str], None] | None:
        """The attempt's text as `TextDelta` events to the stream, if there is one."""
        sink = self.text_sink
        if sink is None:
            return None

        def deliver(text: str) -> None:
            sink(TextDelta(run_id=self.id, at=self.clock.wall(), turn=turn, attempt=attempt,
                           ordinal=ordinal, text=text))

        return deliver

    async def _settle_account(self, credits: int) -> None:
        """Charge the run's real credits on its account and release its hold, once."""
        if self._reservation is None or self.accounts is None:
            return
        reservation, self._reservation = self._reservation, None
        settled = await self._confirm(self.accounts.settle(reservation, credits),
                                      at_least=LEDGER_GRACE)
        if not settled:
            logger.warning("%s %s: its account's settlement was not confirmed by its "
                           "deadline; it completes later, or at the reservation's expiry",
                           self.kind, self.id)

    async def _confirm(self, write: Awaitable[None], *, at_least: float = 0.0) -> bool:
        """Await a ledger write, no later than `LEDGER_GRACE` past the deadline
        (and at least ``at_least`` seconds); False when it was not confirmed by
        then (it stays queued)."""
        limit = max(self.deadline.remaining(self.clock.now()) + LEDGER_GRACE, at_least)
        with self.clock.cancel_scope(limit) as scope:
            await write
        return not scope.cancelled_caught

    def count_attempts_on(self, error: BaseException) -> None:
        """Give a loopengine error that ends this run or call its attempt count."""
        if isinstance(error, LoopEngineError) and error.attempts is None:
            error.attempts = len(self.records)

    # -- attempts ----------------------------------------------------------------

    async def request(
        self,
        *,
        turn: int,
        phase: str,
        build: Callable[[float], ProviderRequest],
        max_attempts: int | None = None,
        policy: RetryPolicy | None = None,
        on_text: TextCallback | None = None,
    ) -> ProviderResponse | GuardTrip | RetryStop:
        """Send one request of ``turn`` with retries; every try is an attempt.

        The engine's one retry loop: each fault's next step (a stop, the time
        guard's trip, or a wait) is decided by `after_fault`.

        Args:
            turn: The turn number the attempts belong to.
            phase: ``turn``, ``repair``, ``continuation`` or ``fallback``.
            build: Makes the request for a given timeout.
            max_attempts: A lower cap than the policy's (a call's remaining budget).
            policy: The retry policy (the invocation's by default).
            on_text: The run's callback for streamed text.
        """
        # Written out in this frame (no closure per attempt): a conversation
        # holds it for as long as it waits on the model, and thousands wait at once.
        policy = policy or self.policy
        cap = policy.max_attempts if max_attempts is None else max_attempts
        wait = 0.0
        attempt = 0
        outcome: ProviderResponse | GuardTrip | RetryStop
        while True:
            trip = self._before_attempt()
            if trip is not None:
                outcome = trip
                break
            attempt += 1
            try:
                outcome = await self._attempt(turn, phase, build, wait, on_text)
                break
            except ProviderFault as fault:
                after = after_fault(fault, attempt, cap, policy=policy, rng=self.rng,
                                    before_attempt=self._before_attempt,
                                    remaining=self._remaining)
                if isinstance(after, GuardTrip | RetryStop):
                    outcome = after
                    break
                wait = after
            await self.clock.sleep(wait)
        if isinstance(outcome, RetryStop):
            self.last_fault = outcome.fault
        elif self._reply_unconfirmed:
            # Nothing may act on a reply the ledger has not recorded (DESIGN §7),
            # and the deadline has passed waiting for it.
            self._reply_unconfirmed = False
            return GuardTrip(Outcome.TIME_LIMIT, "total_time", 0.0, self.limits.total_time,
                             "the ledger did not record the reply before the deadline "
                             f"(total_time={self.limits.total_time})")
        return outcome

    def _remaining(self) -> float:
        return self.deadline.remaining(self.clock.now())

    def _before_attempt(self) -> GuardTrip | None:
        # The pre-attempt guard reads only the deadline, which never moves: its
        # state is built for the check rather than kept for the whole run.
        return check_before_attempt(
            ConversationState(turns=0, tool_calls=0, credits=0, deadline=self.deadline),
            self.limits, self.clock.now())

    async def _attempt(
        self, turn: int, phase: str, build: Callable[[float], ProviderRequest], wait: float,
        on_text: TextCallback | None,
    ) -> ProviderResponse | GuardTrip:
        """One attempt, one way: its dispatch is written and awaited, then the
        request is sent, then the attempt is settled."""
        # Raises before anything is recorded or sent.
        self.provider.check_ready()
        now = self.clock.now()
        timeout = attempt_timeout(self.limits, self.deadline, now)
        capped = timeout < self.limits.attempt_timeout
        request = build(timeout)
        number = self._turn_attempts[turn] = self._turn_attempts.get(turn, 0) + 1
        if number == 1 and self.observers:
            # Announced with its first dispatch, so a turn the time guard
            # refused at its first attempt is never announced.
            await self.emit(TurnStarted(run_id=self.id, at=self.clock.wall(), turn=turn,
                                        phase=phase))
        dispatch = AttemptDispatch(
            invocation_id=self.id,
            ordinal=len(self.records) + 1,
            turn=turn,
            attempt=number,
            phase=phase,
            served_by=self.served_by,
            started_at=self.clock.wall(),
            max_tokens=request.max_tokens,
            timeout_ms=math.ceil(timeout * 1000),
            wait_ms=round(wait * 1000),
        )
        self.records.append(AttemptRecord(dispatch=dispatch, settle=None))
        flight = _InFlight(len(self.records) - 1, now)
        self._in_flight = flight
        if self.ledger is not None and not await self._confirm(
                self.ledger.dispatch_attempt(dispatch)):
            # The row was not durable by the deadline: nothing may be sent. The
            # attempt is settled behind its queued row, and the run ends.
            await self._settle(flight, None, None, external=False, cut_by_deadline=True)
            return GuardTrip(Outcome.TIME_LIMIT, "total_time", 0.0, self.limits.total_time,
                             "the ledger did not record the attempt before the deadline "
                             f"(total_time={self.limits.total_time}); nothing was sent")
        if self.observers:
            # Building an event costs about as much as the rest of the
            # attempt's bookkeeping: skip it when nobody listens.
            await self.emit(AttemptStarted(
                run_id=self.id, at=dispatch.started_at, ordinal=dispatch.ordinal, turn=turn,
                attempt=number, phase=phase, served_by=self.served_by,
                provider=self.operation.provider, model=self.operation.model,
                max_tokens=request.max_tokens, timeout_ms=dispatch.timeout_ms,
                wait_ms=dispatch.wait_ms,
            ))
        text: TextCallback | None = None
        if on_text is not None or self.text_sink is not None:
            text = _guarded_text(flight, on_text, self._delta(turn, number, dispatch.ordinal))
        response: ProviderResponse | None = None
        fault: ProviderFault | None = None
        flight.started = self.clock.now()
        # The attempt's time runs from its start: what its row's write took is spent.
        left = max(0.0, timeout - (flight.started - now))
        try:
            with self.clock.cancel_scope(left) as scope:
                response = await self.provider.send(request, on_text=text)
            if scope.cancelled_caught:
                response = None
                fault = ProviderFault(FaultKind.TIMEOUT, f"no response within {timeout:.3f}s")
        except ProviderFault as raised:
            fault = raised
        except anyio.get_cancelled_exc_class():
            raise  # the caller's cancellation: settled by `cancelled`, shielded
        except LoopEngineError as error:
            if flight.callback_error is not None:
                await self._callback_failed(flight, response=None, fault=None)
            # A misuse the caller must see (a replay that diverged): settle, then raise.
            await self._settle(flight, None, ProviderFault(
                FaultKind.BAD_REQUEST, f"{type(error).__name__}: {error}"), external=False)
            raise
        except Exception as error:  # a provider must raise only ProviderFault
            if flight.callback_error is None:
                fault = ProviderFault(
                    FaultKind.BAD_REQUEST,
                    f"the provider raised {type(error).__name__} instead of a ProviderFault",
                )
        if flight.callback_error is not None:
            await self._callback_failed(flight, response=response, fault=fault)
        # A timeout cut short by the run's deadline is the deadline's doing.
        cut = fault is not None and fault.kind is FaultKind.TIMEOUT and capped
        if not await self._settle(flight, response, fault, external=False, cut_by_deadline=cut):
            self._reply_unconfirmed = response is not None
        if fault is not None:
            raise fault
        assert response is not None
        return response

    async def _callback_failed(self, flight: _InFlight, *, response: ProviderResponse | None,
                               fault: ProviderFault | None) -> None:
        """The run's ``on_text`` callback raised: settle the attempt with what the
        server sent (``ok`` with a whole reply, else ``aborted``/``external``:
        the caller stopped reading it, no provider fault) and raise the
        callback's own exception to the caller."""
        error = flight.callback_error
        assert error is not None
        usage = fault.usage if fault is not None else None
        cut = None if response is not None else ProviderFault(
            FaultKind.ABORTED, f"the on_text callback raised {type(error).__name__}",
            usage=usage, usage_approx=usage is not None,
            http_status=fault.http_status if fault else None,
            request_id=fault.request_id if fault else None,
            response_id=fault.response_id if fault else None)
        await self._settle(flight, response, cut, external=response is None, fault_kind=False)
        raise error

    async def _settle(
        self,
        flight: _InFlight,
        response: ProviderResponse | None,
        fault: ProviderFault | None,
        *,
        external: bool,
        fault_kind: bool = True,
        cut_by_deadline: bool = False,
    ) -> bool:
        """Settle the attempt in flight; False when the ledger did not confirm a
        served settle by the deadline (`_confirm`). ``fault_kind=False``: the
        attempt was cut by us, not by a provider fault (none is recorded).
        ``cut_by_deadline``: the run's deadline ended it (``aborted``/``deadline``)."""
        self._in_flight = None
        dispatch = self.records[flight.index].dispatch
        latency_ms = max(0, round((self.clock.now() - flight.started) * 1000))
        reason: str | None = None
        if response is not None:
            outcome, usage = "ok", response.usage
        elif fault is not None:
            usage = fault.usage
            aborted = fault.kind is FaultKind.ABORTED or cut_by_deadline
            outcome = "aborted" if aborted else "error"
        else:
            outcome, usage = "aborted", None
        if external:
            reason = "external"
        elif outcome == "aborted":
            reason = (fault.aborted_reason if fault is not None else None) or (
                "deadline" if cut_by_deadline else None)
        priced = (
            self.prices.price(self.vendor, self.operation.model, usage,
                              dispatch.started_at)
            if usage is not None else None
        )
        charged = outcome == "ok" and priced is not None
        settle = AttemptSettle(
            invocation_id=self.id,
            ordinal=dispatch.ordinal,
            outcome=outcome,
            latency_ms=latency_ms,
            fault=fault.kind.value if fault and fault_kind else None,
            aborted_reason=reason,
            http_status=(response.http_status if response else
                         fault.http_status if fault else None),
            error_code=fault.error_code if fault else None,
            usage=usage,
            usage_approx=bool(fault and fault.usage_approx),
            cost_nanousd=priced.cost_nanousd if priced else None,
            charged=charged,
            price_ref=priced.price_ref if priced else None,
            response_id=response.response_id if response else (
                fault.response_id if fault else None),
            request_id=response.request_id if response else (
                fault.request_id if fault else None),
            stop_reason=response.stop_reason if response else None,
        )
        self.records[flight.index] = AttemptRecord(dispatch=dispatch, settle=settle)
        if usage is None:
            self.usage_complete = False
        else:
            self.usage = self.usage + usage
            self.output_tokens += usage.output_tokens
            if priced is None:
                self.unpriced = True
                if self.served_by not in self._unpriced_warned:
                    self._unpriced_warned.add(self.served_by)
                    logger.warning(
                        "%s has no price (neither genai-prices nor the PriceBook knows "
                        "it): its attempts are recorded with no cost and the results "
                        "say unpriced=True; add a ModelPrice to price them",
                        self.served_by)
        if priced is not None:
            self.provider_cost_nanousd += priced.cost_nanousd
            if charged:
                self.cost_nanousd += priced.cost_nanousd
                self._turn_charge[dispatch.turn] = (
                    self._turn_charge.get(dispatch.turn, 0) + priced.cost_nanousd
                )
        confirmed = True
        if self.ledger is not None:
            confirmed = await self._confirm(self.ledger.settle_attempt(settle))
        logger.debug(
            "attempt %s#%d turn=%d try=%d phase=%s served_by=%s outcome=%s fault=%s "
            "status=%s latency_ms=%d output_tokens=%s",
            self.id, dispatch.ordinal, dispatch.turn, dispatch.attempt, dispatch.phase,
            self.served_by, outcome, settle.fault, settle.http_status, latency_ms,
            usage.output_tokens if usage else None,
        )
        if self.observers:
            await self.emit(AttemptSettled(
                run_id=self.id, at=self.clock.wall(), ordinal=dispatch.ordinal, turn=dispatch.turn,
                attempt=dispatch.attempt, phase=dispatch.phase, served_by=self.served_by,
                provider=self.operation.provider, model=self.operation.model,
                max_tokens=dispatch.max_tokens, outcome=outcome, latency_ms=latency_ms,
                fault=settle.fault, http_status=settle.http_status, error_code=settle.error_code,
                aborted_reason=settle.aborted_reason, usage=usage, usage_approx=settle.usage_approx,
                cost_usd=nanousd_to_usd(priced.cost_nanousd) if priced else None,
                charged=charged, response_id=settle.response_id, request_id=settle.request_id,
                stop_reason=settle.stop_reason,
                response_model=response.model if response is not None else None,
            ))
        return confirmed

    # -- accounting -----------------------------------------------------------------

    def attempts_in_turn(self, turn: int) -> int:
        """Attempts dispatched for ``turn`` so far."""
        return self._turn_attempts.get(turn, 0)

    def turn_credits(self, turn: int) -> int:
        """The turn's charge in credits, rounded up to the quantum (R03)."""
        return turn_credits(self._turn_charge.get(turn, 0), self.prices.credits_per_usd,
                            self.prices.credit_quantum)

    def turn_cost_usd(self, turn: int) -> Decimal:
        """The turn's charged cost in USD."""
        return nanousd_to_usd(self._turn_charge.get(turn, 0))

    def turn_usage(self, turn: int) -> Usage:
        """The usage of the turn's successful attempts."""
        total = Usage()
        for record in self.records:
            settle = record.settle
            if (record.dispatch.turn == turn and settle is not None and settle.outcome == "ok"
                    and settle.usage is not None):
                total = total + settle.usage
        return total

    @property
    def cost_usd(self) -> Decimal:
        """The charged cost so far."""
        return nanousd_to_usd(self.cost_nanousd)

    def summary(self) -> AttemptsSummary:
        """The attempts made so far."""
        count = len(self.records)
        if self.ledger is None:
            retained = 0
        else:
            retained = min(count, self.ledger.max_retained_attempts)
        return AttemptsSummary(
            count=count,
            output_tokens=self.output_tokens,
            usage_complete=self.usage_complete,
            retained=retained,
            incomplete=self.ledger is not None and retained < count,
        )


def _guarded_text(flight: _InFlight, on_text: TextCallback | None,
                  delta: Callable[[str], None] | None) -> TextCallback:
    """``on_text`` (and the run's stream of deltas) remembering what the callback
    raised: the caller's exception, not the provider's fault (whatever the
    provider makes of it)."""

    async def guarded(text: str) -> None:
        if delta is not None:
            delta(text)
        if on_text is None:
            return
        try:
            maybe = on_text(text)
            if inspect.isawaitable(maybe):
                await maybe
        except Exception as error:
            if flight.callback_error is None:
                flight.callback_error = error
            raise

    return guarded
