"""`Engine.call`: one structured call, and the record of every request it made.

A call asks for one structured answer. Natively the model is forced to call
the terminal tool whose input schema is the output model. One call may make
several provider requests, all counted in `CallAttempts` and all capped by
``retry.max_attempts``:

* transport retries (the shared retry loop, as in a run);
* continuations of a turn whose reply paused it (``pause_turn``, a
  compaction), as in a run (phase ``continuation``);
* schema-violation retries: the validation error is fed back (phase ``repair``);
* truncation retries: a reply cut at ``max_tokens`` is asked again with
  ``max_tokens`` doubled, up to the growth ceiling (`growth_ceiling`), or
  kept as it is with ``retry.grow_max_tokens=False``;
* optionally, a last fallback from the native mode to a prompt-embedded
  schema (phase ``fallback``) after the native attempts failed validation.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Generic, Literal, NoReturn, TypeVar

import pydantic

from loopengine import _validate
from loopengine._attempt import request, settle_cut
from loopengine._errors import OutcomeError, StructuredOutputError, ToolInputError
from loopengine._invocation import Invocation
from loopengine._lifecycle import ending, finish
from loopengine._operation import Operation
from loopengine._outcome import Outcome
from loopengine._run import CONTINUED_STOPS
from loopengine._tools import validated
from loopengine._usage import Usage
from loopengine.guards._checkpoints import (
    ConversationState,
    GuardTrip,
    check_before_attempt,
    check_credits,
)
from loopengine.persistence._records import AttemptRecord
from loopengine.providers._base import ProviderRequest, ProviderResponse
from loopengine.providers._faults import FaultKind, ProviderError
from loopengine.providers._retry import RetryStop

__all__ = ["CallAttempts", "CallResult", "StructuredOutputError", "growth_ceiling", "run_call"]

M = TypeVar("M", bound=pydantic.BaseModel)

ANSWER_TOOL = "final_answer"

GROWTH_FACTOR = 4
"""Without a published model limit, truncation retries may grow a call's
``max_tokens`` to this many times its first request's."""


def growth_ceiling(operation: Operation, first_max_tokens: int) -> int:
    """The most ``max_tokens`` a call's truncation retries may ask for (docs/structured-calls.md).

    The operation's ``model_max_output_tokens`` when it publishes one (the
    model's own output limit), else `GROWTH_FACTOR` times the call's first
    ``max_tokens``. Never below the first request's.
    """
    if operation.model_max_output_tokens is not None:
        return max(first_max_tokens, operation.model_max_output_tokens)
    return first_max_tokens * GROWTH_FACTOR


@dataclass(frozen=True, slots=True)
class CallAttempts:
    """Every provider request one structured call made (docs/structured-calls.md,
    "The attempts record")."""

    count: int
    """Requests sent: transport, schema and truncation retries and the fallback included;
    a request refused before it was sent is not one."""
    output_tokens: int
    """Output tokens summed over every attempt that reported usage."""
    usage_complete: bool
    """False when some attempt reported no usage, or only a floor of it (a cut
    stream, or cache writes whose lifetime the reply does not tell,
    ``usage_approx``): ``output_tokens`` (or the cost) is then a floor."""
    structured_output: Literal["native", "prompt"]
    """The final attempt's mode: ``native`` (a forced tool call) or ``prompt``
    (a schema embedded in the prompt)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CallResult(Generic[M]):
    """The result of `Engine.call`."""

    data: M
    """The validated answer."""
    usage: Usage
    """The usage of the attempt whose output ``data`` is."""
    attempts: CallAttempts
    """Every request the call made."""
    invocation_id: str
    """The ledger id of the call."""
    cost_usd: Decimal
    """The charged cost: the successful attempts."""
    credits: int
    """Rounded charges of the call's requests."""
    attempt_log: tuple[AttemptRecord, ...] = field(default=(), repr=False)
    """Every attempt, dispatched and settled."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CallSpec:
    """A validated call request (internal)."""

    messages: list[dict[str, Any]]
    system: list[dict[str, Any]] | None
    output: type[pydantic.BaseModel]
    max_tokens: int
    prompt_fallback: bool


async def run_call(inv: Invocation, spec: CallSpec) -> CallResult[Any]:
    """Make the call; return its result or raise an `OutcomeError` carrying ``attempts``."""
    call = _Call(inv, spec)
    # A call cut (cancelled, failed) ends with what its turns were served (R03).
    async with ending(inv, lambda: (call.turn, 0, inv.turns_credits)):
        # The call's one deadline: every wait inside ends at it.
        with inv.clock.deadline_scope(inv.deadline.at):
            return await call.run()
        # The deadline cut a wait: settle the attempt it cut, and end time_limit.
        await settle_cut(inv)
        if call.turn and not inv.attempts_in_turn(call.turn):
            call.turn -= 1  # cut before the turn's request: no turn
        # Read at the deadline, which the scope says has come.
        trip = check_before_attempt(call._state(), inv.limits, inv.deadline.at)
        assert trip is not None
        await call._fail_trip(trip)


class _Call:
    def __init__(self, inv: Invocation, spec: CallSpec) -> None:
        self.inv = inv
        self.spec = spec
        self.turn = 0
        self.messages = list(spec.messages)
        self.paused = False
        """Whether the messages end with a reply that paused its turn (`CONTINUED_STOPS`)."""
        schema = _validate.model_schema("output", spec.output)
        self.schema = schema
        self.tool = {
            "name": ANSWER_TOOL,
            "description": "Give the answer. Its input is the answer itself.",
            "input_schema": schema,
        }

    @property
    def credits(self) -> int:
        """Its turns' rounded charges (R03), a cut turn's included: what it was served."""
        return self.inv.turns_credits

    async def run(self) -> CallResult[Any]:
        inv = self.inv
        if inv.denied is not None:
            await self._fail_trip(inv.denied)
        budget = inv.policy.max_attempts
        # The first request asks for what the caller or the operation gave,
        # never more than the operation allows one request (R13); only a
        # truncation retry may ask for more, up to the growth ceiling.
        max_tokens = min(self.spec.max_tokens, inv.operation.output_ceiling)
        ceiling = growth_ceiling(inv.operation, max_tokens)
        phase = "turn"
        mode: Literal["native", "prompt"] = "native"
        invalid_seen = False
        last_reason, last_detail = "invalid", ""
        while True:
            remaining = budget - len(inv.records)
            if remaining <= 0:
                await self._finish(Outcome.INCOMPLETE)
                raise StructuredOutputError(
                    f"call {inv.id}: no valid answer in {len(inv.records)} attempts "
                    f"(last: {last_reason}{': ' + last_detail if last_detail else ''})",
                    attempts=len(inv.records), reason=last_reason, detail=last_detail,
                )
            trip = check_credits(self._state(), inv.limits)
            if trip is not None:
                await self._fail_trip(trip)
            if self.paused:
                phase = "continuation"  # the paused turn goes on, in its mode
            else:
                mode = "native"
                if self.spec.prompt_fallback and invalid_seen and remaining == 1:
                    mode, phase = "prompt", "fallback"
                self.turn += 1
            tokens = max_tokens
            response = await request(
                inv, turn=self.turn, phase=phase,
                build=functools.partial(self._build, max_tokens=tokens, mode=mode),
                max_attempts=remaining,
            )
            if not isinstance(response, ProviderResponse) and not inv.attempts_in_turn(
                    self.turn):
                # Refused before its request was sent (a guard, the provider's
                # `check_request`): no request, so no turn (R01).
                self.turn -= 1
            if isinstance(response, GuardTrip):
                await self._fail_trip(response)
            if isinstance(response, RetryStop):
                await self._fail_fault(response)
            assert isinstance(response, ProviderResponse)

            if response.stop_reason == "refusal":
                await self._fail_trip(GuardTrip(Outcome.REFUSED, "stop_reason", "refusal", None,
                                                "the model refused"))
            if response.stop_reason == "model_context_window_exceeded":
                await self._fail_trip(GuardTrip(Outcome.INCOMPLETE, "stop_reason",
                                                str(response.stop_reason), None,
                                                "the context window was exceeded"))
            if response.stop_reason in CONTINUED_STOPS:
                # A server tool loop paused (or a compaction did): the reply goes
                # back as the last message and the next request continues the
                # turn, as in a run; it is no answer, nor a wrong one.
                self._add_reply(response)
                self.paused = True
                continue
            if response.stop_reason == "max_tokens":
                # A cut-off reply is never parsed: ask again, with room to finish.
                last_reason, last_detail = "truncated", f"cut at max_tokens={tokens}"
                if inv.policy.grow_max_tokens:
                    max_tokens = min(tokens * 2, ceiling)
                phase = "turn" if mode == "native" else "fallback"
                continue

            data, error = self._parse(response, mode)
            if data is not None:
                await self._finish(Outcome.COMPLETED)
                return CallResult(
                    data=data,
                    usage=response.usage or Usage(),
                    attempts=CallAttempts(
                        count=len(inv.records),
                        output_tokens=inv.output_tokens,
                        usage_complete=inv.usage_complete,
                        structured_output=mode,
                    ),
                    invocation_id=inv.id,
                    cost_usd=inv.cost_usd,
                    credits=self.credits,
                    attempt_log=tuple(inv.records),
                )
            invalid_seen = True
            last_reason, last_detail = "invalid", error
            self._feed_back(response, mode, error)
            phase = "repair"

    def _state(self) -> ConversationState:
        return ConversationState(turns=self.turn, tool_calls=0, credits=self.credits,
                                 deadline=self.inv.deadline)

    def _build(self, timeout: float, *, max_tokens: int, mode: str) -> ProviderRequest:
        container = self.inv.live_container()  # a repair goes to the reply's container
        if mode == "native":
            return ProviderRequest(
                model=self.inv.operation.model, max_tokens=max_tokens, messages=self.messages,
                system=self.spec.system, tools=[self.tool],
                tool_choice={"type": "tool", "name": ANSWER_TOOL}, timeout=timeout,
                cache=self.inv.operation.cache, metadata={"turn": self.turn, "mode": mode},
                features=self.inv.features, container=container,
            )
        instruction = {
            "type": "text",
            "text": "Reply with one JSON object and nothing else. It must match this JSON "
                    "Schema:\n" + json.dumps(self.schema, sort_keys=True),
        }
        # The answer tool stays defined, not to be called: the native attempts'
        # calls and their error results are in the messages, and the Messages
        # API refuses tool blocks in a request that defines no tools.
        return ProviderRequest(
            model=self.inv.operation.model, max_tokens=max_tokens, messages=self.messages,
            system=[*(self.spec.system or []), instruction], tools=[self.tool],
            tool_choice={"type": "none"}, timeout=timeout,
            cache=self.inv.operation.cache, metadata={"turn": self.turn, "mode": mode},
            features=self.inv.features, container=container,
        )

    def _parse(self, response: ProviderResponse, mode: str) -> tuple[Any, str]:
        output = self.spec.output
        if mode == "native":
            blocks = [b for b in response.content
                      if b.get("type") == "tool_use" and b.get("name") == ANSWER_TOOL]
            if not blocks:
                return None, f"the reply did not call the {ANSWER_TOOL} tool"
            candidate: Any = blocks[0].get("input", {})
        else:
            text = "".join(b.get("text", "") for b in response.content
                           if b.get("type") == "text")
            candidate = _json_object(text)
            if candidate is None:
                return None, "the reply held no JSON object"
        try:
            return validated(output, candidate, from_json=mode != "native"), ""
        except ToolInputError as error:
            return None, str(error)

    def _add_reply(self, response: ProviderResponse) -> None:
        """Add a reply's blocks to the messages: to the paused turn's message when
        it continues one, else as an assistant message of their own."""
        content = [dict(b) for b in response.content]
        if self.paused:
            last = self.messages[-1]
            self.messages[-1] = {**last, "content": [*last["content"], *content]}
        else:
            self.messages = [*self.messages, {"role": "assistant", "content": content}]
        self.paused = False

    def _feed_back(self, response: ProviderResponse, mode: str, error: str) -> None:
        content = [dict(b) for b in response.content]
        self._add_reply(response)
        text = f"The answer does not match the required schema: {error}. Try again."
        calls = [b for b in content if b.get("type") == "tool_use"]
        if mode == "native" and calls:
            # Each call is answered for itself: only the first answer was
            # checked (as in a run), so the error is that one's alone.
            first = next((b for b in calls if b.get("name") == ANSWER_TOOL), None)
            self.messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": b.get("id"),
                 "content": text if b is first or first is None else _NOT_CHECKED,
                 "is_error": True} for b in calls
            ]})
        else:
            self.messages.append({"role": "user", "content": text})

    async def _finish(self, outcome: Outcome, trip: GuardTrip | None = None) -> None:
        await finish(self.inv, outcome.value, turns=self.turn, tool_calls=0, credits=self.credits,
                              trip=trip)

    async def _fail_trip(self, trip: GuardTrip) -> NoReturn:
        await self._finish(trip.outcome, trip)
        raise OutcomeError(f"call {self.inv.id} ended {trip.outcome.value}: {trip.message}",
                           outcome=trip.outcome.value, attempts=len(self.inv.records))

    async def _fail_fault(self, stop: RetryStop) -> NoReturn:
        fault = stop.fault
        outcome = (Outcome.CREDIT_EXHAUSTED if fault.kind is FaultKind.CREDIT_EXHAUSTED
                   else Outcome.PROVIDER_ERROR)
        await self._finish(outcome)
        raise ProviderError(
            f"call {self.inv.id} ended {outcome.value}: {fault.kind.value} fault after "
            f"{len(self.inv.records)} attempts ({stop.reason}): {fault.message}",
            fault=fault, outcome=outcome.value, attempts=len(self.inv.records),
        )


_NOT_CHECKED = (f"Not checked: a reply's first call of {ANSWER_TOOL} is its answer, and only "
                f"that one is checked. Give the whole answer in one call of {ANSWER_TOOL}.")
"""The result of a call a reply made beside its first answer, which alone was checked."""


def _json_object(text: str) -> str | None:
    """The outermost ``{...}`` of a reply, code fences and prose around it ignored."""
    text = re.sub(r"```(?:json)?", "", text)
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end <= start:
        return None
    return text[start:end + 1]
