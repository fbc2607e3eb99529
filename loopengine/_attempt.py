"""One attempt, one way: dispatch, send, settle; and the engine's one retry loop.

`request` sends one request of a turn with retries. Each try is an
`attempt`: its row is written to the ledger and awaited until durable
(bounded by the run's deadline: past it nothing is sent), then the provider
sends it, then `settle` records its outcome, usage and price and emits its
events. What follows a fault (a stop, the time guard's trip, a wait) is
decided by `loopengine.providers._retry.after_fault`.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
from collections.abc import Callable

import anyio

from loopengine._errors import LedgerError, LoopEngineError
from loopengine._invocation import InFlight, Invocation
from loopengine._pricing import nanousd_to_usd
from loopengine._raised import own_failure
from loopengine.events import AttemptSettled, AttemptStarted, TextDelta, TurnStarted
from loopengine.guards._checkpoints import GuardTrip, attempt_timeout
from loopengine.persistence._records import AttemptDispatch, AttemptRecord, AttemptSettle
from loopengine.providers._base import (
    ProviderRequest,
    ProviderResponse,
    TextCallback,
    unwatch_cuts,
    watch_cuts,
)
from loopengine.providers._faults import FaultKind, ProviderFault, timed_out
from loopengine.providers._retry import RetryPolicy, RetryStop, after_fault

__all__ = ["Unsent", "attempt", "request", "settle", "settle_cut"]

logger = logging.getLogger("loopengine")


class Unsent(Exception):
    """A request the provider refused before the wire (`Provider.check_request`):
    no row was written, nothing was sent, the turn gained no attempt."""

    def __init__(self, fault: ProviderFault) -> None:
        super().__init__(str(fault))
        self.fault = fault
        """The provider's refusal."""


async def request(
    inv: Invocation,
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
    policy = policy or inv.policy
    cap = policy.max_attempts if max_attempts is None else max_attempts
    wait = 0.0
    tries = 0
    outcome: ProviderResponse | GuardTrip | RetryStop
    while True:
        trip = inv.before_attempt()
        if trip is not None:
            outcome = trip
            break
        tries += 1
        try:
            outcome = await attempt(inv, turn, phase, build, wait, on_text)
            break
        except Unsent as unsent:
            # Never sent, so not an attempt; the same request would be refused again.
            outcome = RetryStop(unsent.fault, tries - 1, "permanent")
            break
        except ProviderFault as fault:
            after = after_fault(fault, tries, cap, policy=policy, rng=inv.rng,
                                before_attempt=inv.before_attempt,
                                remaining=inv.remaining)
            if isinstance(after, GuardTrip | RetryStop):
                outcome = after
                break
            wait = after
        await inv.clock.sleep(wait)
    if isinstance(outcome, RetryStop):
        inv.last_fault = outcome.fault
    return outcome


async def attempt(
    inv: Invocation, turn: int, phase: str, build: Callable[[float], ProviderRequest], wait: float,
    on_text: TextCallback | None,
) -> ProviderResponse:
    """One attempt, one way: its dispatch is written and awaited, then the
    request is sent, then the attempt is settled.

    Raises:
        Unsent: the provider refused the request before its row was written
            (`Provider.check_request`): nothing was recorded or sent.
    """
    # Raises before anything is recorded or sent.
    inv.provider.check_ready()
    now = inv.clock.now()
    timeout = attempt_timeout(inv.limits, inv.deadline, now, inv.clock.effective_deadline())
    capped = timeout < inv.limits.attempt_timeout
    request = build(timeout)
    try:
        inv.provider.check_request(request)
    except ProviderFault as refused:
        raise Unsent(refused) from refused
    sent = inv.turn_attempts[turn] = inv.turn_attempts.get(turn, 0) + 1
    number = sent + inv.earlier_attempts.get(turn, 0)
    observed = 0.0  # the time its observers took: the run's, not the attempt's
    if sent == 1 and inv.observers:
        # Announced with its first dispatch, so a turn the time guard
        # refused at its first attempt is never announced.
        before = inv.clock.now()
        await inv.emit(TurnStarted(run_id=inv.id, at=inv.clock.wall(), turn=turn,
                                   phase=phase))
        observed += inv.clock.now() - before
    dispatch = AttemptDispatch(
        invocation_id=inv.id,
        ordinal=inv.base_attempts + len(inv.records) + 1,
        turn=turn,
        attempt=number,
        phase=phase,
        served_by=inv.served_by,
        started_at=inv.clock.wall(),
        max_tokens=request.max_tokens,
        timeout_ms=math.ceil(timeout * 1000),
        wait_ms=round(wait * 1000),
    )
    inv.records.append(AttemptRecord(dispatch=dispatch, settle=None))
    flight = InFlight(len(inv.records) - 1, now)
    inv.in_flight = flight
    while inv.ledger is not None:
        # Durable before anything is sent. The wait is bounded by the run's
        # deadline, the scope around the run: past it, nothing is sent and the
        # attempt is settled by `settle_cut`.
        try:
            await inv.ledger.dispatch_attempt(dispatch)
            break
        except LedgerError:
            try:
                taken = await _taken_since(inv, dispatch.ordinal)
            except BaseException:
                # Cut as it read (its caller's cancellation): nothing of this
                # attempt was written or sent, so it is none of the run's.
                inv.records.pop(flight.index)
                inv.in_flight = None
                raise
            if not taken:
                raise
        # The segment this one took the run over from, still alive, sent more
        # of the turn since this one read the run: nothing was sent for this
        # attempt, which goes on after them.
        logger.warning("run %s: attempt %d was taken by a request of the segment this one "
                       "took the run over from; sent as attempt %d", inv.id, dispatch.ordinal,
                       dispatch.ordinal + taken)
        inv.base_attempts += taken
        inv.earlier_attempts[turn] = inv.earlier_attempts.get(turn, 0) + taken
        number += taken
        dispatch = dataclasses.replace(dispatch, ordinal=dispatch.ordinal + taken,
                                       attempt=number)
        inv.records[flight.index] = AttemptRecord(dispatch=dispatch, settle=None)
    flight.written = True
    if inv.observers:
        # Building an event costs about as much as the rest of the
        # attempt's bookkeeping: skip it when nobody listens.
        flight.announced = True
        before = inv.clock.now()
        await _announce(inv, dispatch)
        observed += inv.clock.now() - before
    text: TextCallback | None = None
    if on_text is not None or inv.text_sink is not None:
        text = _guarded_text(flight, on_text, _delta(inv, turn, number, dispatch.ordinal))
    response: ProviderResponse | None = None
    fault: ProviderFault | None = None
    flight.started = inv.clock.now()
    flight.clock = inv.clock
    # The attempt's time runs from its start: what its row's write took is spent,
    # not what its observers took (a slow observer slows the run, and only the
    # run's deadline counts it: it never turns a reply in time into a timeout).
    left = max(0.0, timeout - (flight.started - now - observed))
    flight.ends = flight.started + left
    flight.deadline = min(inv.deadline.at, inv.clock.effective_deadline())
    flight.sent = True
    # A stream the cancellations below cut reports what it had served, which the
    # settle keeps (the server may bill it).
    watching = watch_cuts(flight)
    try:
        # Cut at the run's deadline by the scope around the run (`settle_cut`
        # settles it then), or sooner by its own timeout.
        try:
            with inv.clock.cancel_scope(left) as scope:
                response = await inv.provider.send(request, on_text=text)
        finally:
            unwatch_cuts(watching)
        if scope.cancelled_caught:
            response = None
            fault = timed_out(timeout)
    except ProviderFault as raised:
        fault = raised
    except LoopEngineError as error:
        if flight.callback_error is not None:
            await _callback_failed(inv, flight, response=None, fault=None)
        # A misuse the caller must see (a replay that diverged): settle, then raise.
        await settle(inv, flight, None, ProviderFault(
            FaultKind.BAD_REQUEST, f"{type(error).__name__}: {error}"), external=False)
        raise
    except BaseException as error:
        if not own_failure(error):
            # The caller's cancellation (settled by `cancelled`, shielded), the
            # run's deadline (settled by `settle_cut`), or what stops the run.
            raise
        # A provider must raise only ProviderFault: anything else it raised (a
        # stray CancelledError included: a future something else cancelled)
        # is its failure, settled as the attempt's, not the run's cancellation.
        if flight.callback_error is None:
            fault = ProviderFault(
                FaultKind.BAD_REQUEST,
                f"the provider raised {type(error).__name__} instead of a ProviderFault",
            )
    if flight.callback_error is not None:
        await _callback_failed(inv, flight, response=response, fault=fault)
    # A timeout cut short by the run's deadline is the deadline's doing.
    cut = fault is not None and fault.kind is FaultKind.TIMEOUT and (capped or flight.deadline_cut)
    inv.deadline_cut = inv.deadline_cut or flight.deadline_cut
    # Nothing acts on a reply before its settle is durable (docs/ledger.md): a
    # deadline that passes while it is written ends the run instead.
    fault = await settle(inv, flight, response, fault, external=False, cut_by_deadline=cut)
    if fault is not None:
        raise fault
    assert response is not None
    return response


async def _taken_since(inv: Invocation, ordinal: int) -> int:
    """How many attempts from ``ordinal`` on another segment of the run has
    dispatched, when this segment's dispatch of ``ordinal`` was refused; 0 when
    none did (the refusal was the ledger's own, to be raised).

    Only a segment that took its run over (resumed or recovered under a run
    store: it writes a token of its own, `take_run`) can find one: the segment
    it took the run from may still be alive (its process was only slow, or a
    clock ahead found its lease expired) and send a request of its turn (a
    retry) before its next checkpoint tells it the run is no longer its own.
    Its numbers are the ledger's count: those it dispatched after this
    segment read the run's (`prepare_resume`)."""
    read = getattr(inv.ledger, "read_progress", None)
    if inv.run_store is None or inv.segment_token is None or read is None:
        return 0
    try:
        found = await read(inv.id)
    except LedgerError:
        return 0
    return 0 if found is None else max(0, found.attempt_count - ordinal + 1)


async def _report(inv: Invocation, settle: AttemptSettle, dispatch: AttemptDispatch,
                  response: ProviderResponse | None) -> None:
    """Log the settled attempt and emit its `AttemptSettled`."""
    usage, outcome, latency_ms = settle.usage, settle.outcome, settle.latency_ms
    charged = settle.charged
    logger.debug(
        "attempt %s#%d turn=%d try=%d phase=%s served_by=%s outcome=%s fault=%s "
        "status=%s latency_ms=%d output_tokens=%s",
        inv.id, dispatch.ordinal, dispatch.turn, dispatch.attempt, dispatch.phase,
        inv.served_by, outcome, settle.fault, settle.http_status, latency_ms,
        usage.output_tokens if usage else None,
    )
    if inv.observers:
        await inv.emit(AttemptSettled(
            run_id=inv.id, at=inv.clock.wall(), ordinal=dispatch.ordinal, turn=dispatch.turn,
            attempt=dispatch.attempt, phase=dispatch.phase, served_by=inv.served_by,
            provider=inv.operation.provider, model=inv.operation.model,
            max_tokens=dispatch.max_tokens, outcome=outcome, latency_ms=latency_ms,
            fault=settle.fault, http_status=settle.http_status, error_code=settle.error_code,
            aborted_reason=settle.aborted_reason, usage=usage, usage_approx=settle.usage_approx,
            cost_usd=(nanousd_to_usd(settle.cost_nanousd)
                      if settle.cost_nanousd is not None else None),
            charged=charged, response_id=settle.response_id, request_id=settle.request_id,
            stop_reason=settle.stop_reason,
            response_model=response.model if response is not None else None,
        ))


async def _announce(inv: Invocation, dispatch: AttemptDispatch) -> None:
    """Emit the attempt's `AttemptStarted`."""
    await inv.emit(AttemptStarted(
        run_id=inv.id, at=dispatch.started_at, ordinal=dispatch.ordinal, turn=dispatch.turn,
        attempt=dispatch.attempt, phase=dispatch.phase, served_by=inv.served_by,
        provider=inv.operation.provider, model=inv.operation.model,
        max_tokens=dispatch.max_tokens, timeout_ms=dispatch.timeout_ms,
        wait_ms=dispatch.wait_ms,
    ))


async def settle_cut(inv: Invocation) -> None:
    """The run's deadline passed: settle the attempt it cut, if one was in flight,
    ``aborted`` with reason ``deadline`` (with a ``timeout`` fault once its
    request was sent; with none while it waited for its row: nothing was sent)."""
    flight = inv.in_flight
    if flight is None:
        return
    fault = ProviderFault(FaultKind.TIMEOUT, "the run's deadline passed") if flight.sent else None
    await settle(inv, flight, None, fault, external=False, cut_by_deadline=True)


async def _callback_failed(inv: Invocation, flight: InFlight, *, response: ProviderResponse | None,
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
    await settle(inv, flight, response, cut, external=response is None, fault_kind=False)
    raise error


async def settle(
    inv: Invocation,
    flight: InFlight,
    response: ProviderResponse | None,
    fault: ProviderFault | None,
    *,
    external: bool,
    fault_kind: bool = True,
    cut_by_deadline: bool = False,
) -> ProviderFault | None:
    """Settle the attempt in flight and report it; a write the ledger does not
    confirm in time (`Invocation.confirm`) stays queued. ``fault_kind=False``: the
    attempt was cut by us, not by a provider fault (none is recorded).
    ``cut_by_deadline``: the run's deadline ended it (``aborted``/``deadline``).

    Returns the fault the attempt ended with: ``fault``, or, when its usage
    would take one of the run's totals past what a ledger column holds
    (`Invocation.past_limit`), a ``server_error`` with ``error_code``
    ``invalid_response`` standing for the reply (or fault) it replaces, whose
    usage is then unknown, as for a count no reply can hold (docs/ledger.md)."""
    inv.in_flight = None
    dispatch = inv.records[flight.index].dispatch
    if not flight.announced and inv.observers:
        # Cut (the run's deadline, the caller's cancellation) after its row
        # was written or queued, before it was announced: observers see it
        # start, then settle, as they do every attempt the ledger has.
        flight.announced = True
        await _announce(inv, dispatch)
    latency_ms = max(0, round((inv.clock.now() - flight.started) * 1000))
    reason: str | None = None
    # What the server sent: the reply, else the fault's, else, for a stream a
    # cancellation cut (its timeout, the run's deadline, the caller's), what it
    # had served by then, a floor (its settle records no fault for it).
    served = response if response is not None else fault
    if flight.served is not None and response is None and (
            fault is None or fault.usage is None and fault.response_id is None):
        served = flight.served
    usage = served.usage if served is not None else None
    priced = None
    if usage is not None:
        usage = usage.served_in(inv.geo)  # the endpoint's region (Vertex's)
        priced = inv.prices.price(inv.vendor, inv.operation.model, usage,
                                  dispatch.started_at, billing=inv.billing)
        past = inv.past_limit(usage, priced, dispatch.turn, charged=response is not None)
        if past is not None:
            fault = served = _past_limit(past, served)
            response = usage = priced = None
            external, fault_kind = False, True
    if response is not None:
        outcome = "ok"
    elif fault is not None:
        aborted = fault.kind is FaultKind.ABORTED or cut_by_deadline
        outcome = "aborted" if aborted else "error"
    else:
        outcome = "aborted"
    if external:
        reason = "external"
    elif outcome == "aborted":
        reason = (fault.aborted_reason if fault is not None else None) or (
            "deadline" if cut_by_deadline else None)
    charged = outcome == "ok" and priced is not None
    settle = AttemptSettle(
        invocation_id=inv.id,
        ordinal=dispatch.ordinal,
        outcome=outcome,
        latency_ms=latency_ms,
        fault=fault.kind.value if fault and fault_kind else None,
        aborted_reason=reason,
        http_status=served.http_status if served is not None else None,
        error_code=fault.error_code if fault else None,
        usage=usage,
        usage_approx=served is not None and served.usage_approx,
        cost_nanousd=priced.cost_nanousd if priced else None,
        fee_nanousd=priced.fee_nanousd if priced else None,
        charged=charged,
        price_ref=priced.price_ref if priced else None,
        response_id=served.response_id if served is not None else None,
        request_id=served.request_id if served is not None else None,
        stop_reason=response.stop_reason if response else None,
    )
    inv.records[flight.index] = AttemptRecord(dispatch=dispatch, settle=settle)
    if response is not None and response.container is not None:
        # The container the model's files are in: the run's later requests go to it.
        inv.container = response.container
    if usage is None or settle.usage_approx:
        # None reported, or only a floor of it (a cut stream): the totals are floors.
        inv.usage_complete = False
    if usage is not None:
        inv.usage = inv.usage + usage
        inv.output_tokens += usage.output_tokens
        if priced is None:
            inv.unpriced = True
            if inv.served_by not in inv.unpriced_warned:
                inv.unpriced_warned.add(inv.served_by)
                logger.warning(
                    "%s has no price (neither genai-prices nor the PriceBook knows "
                    "it%s): its attempts are recorded with no cost and the results "
                    "say unpriced=True; add a ModelPrice to price them",
                    inv.served_by,
                    "" if usage.inference_geo is None else
                    f" served in {usage.inference_geo!r}: give the ModelPrice "
                    "inference_geo_multipliers for it")
    if priced is not None:
        inv.provider_cost_nanousd += priced.cost_nanousd
        if charged:
            inv.cost_nanousd += priced.cost_nanousd
            inv.add_charge(dispatch.turn, priced.cost_nanousd)
    try:
        if inv.ledger is not None:
            await inv.confirm(inv.ledger.settle_attempt(settle))
    finally:
        # Reported even when the run's deadline (or the caller) cut the wait for
        # the settle's write: it stays queued, and observers pair every start.
        with anyio.CancelScope(shield=True):
            await _report(inv, settle, dispatch, response)
    return fault


def _past_limit(past: str, served: ProviderResponse | ProviderFault | None) -> ProviderFault:
    """The fault of an attempt whose reported usage would take ``past`` (one of
    the run's totals) beyond 2**63 - 1: the ``invalid_response`` of what was
    ``served`` (the reply, or the fault that carried the usage)."""
    assert served is not None
    return ProviderFault(
        FaultKind.SERVER_ERROR,
        f"the reply reports an impossible usage: it would take {past} past 2**63 - 1",
        error_code="invalid_response", http_status=served.http_status,
        request_id=served.request_id, response_id=served.response_id)


def _delta(inv: Invocation, turn: int, attempt: int, ordinal: int) -> Callable[[str], None] | None:
    """The attempt's text as `TextDelta` events to the stream, if there is one."""
    sink = inv.text_sink
    if sink is None:
        return None

    def deliver(text: str) -> None:
        sink(TextDelta(run_id=inv.id, at=inv.clock.wall(), turn=turn, attempt=attempt,
                       ordinal=ordinal, text=text))

    return deliver


def _guarded_text(flight: InFlight, on_text: TextCallback | None,
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
        except BaseException as error:
            # Its own failure (a stray CancelledError included), not the run's
            # cancellation nor what stops the run.
            if flight.callback_error is None and own_failure(error):
                flight.callback_error = error
            raise

    return guarded
