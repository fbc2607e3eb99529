"""`ScriptedProvider`: scripted replies and faults, in-process, for tests.

Each `send` takes the next item of the script: a `Reply` is answered, a
`ProviderFault` is raised, a callable is called with the request and its
result used. Every request received is kept in ``requests`` so that tests can
assert on exactly what the engine sent.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import anyio
import anyio.lowlevel

from loopengine import _validate
from loopengine._clock import Clock, SystemClock
from loopengine._errors import ConfigError
from loopengine._features import Features
from loopengine._usage import Usage
from loopengine.providers._base import (
    DEFAULT_BILLING,
    FEATURES,
    STOP_REASONS,
    Billing,
    ProviderRequest,
    ProviderResponse,
    TextCallback,
    check_reply,
    genai_operation_of,
    hand_text,
)
from loopengine.providers._faults import FaultKind, ProviderFault, timed_out

__all__ = ["Reply", "ScriptItem", "ScriptedProvider"]

DEFAULT_USAGE = Usage(input_tokens=100, output_tokens=20)
"""The usage a scripted reply reports unless it says otherwise."""

_ids = itertools.count(1)


@dataclass(frozen=True, slots=True, kw_only=True)
class Reply:
    """One scripted response.

    Build with `Reply.text`, `Reply.tool_calls`, `Reply.final` or directly.
    ``usage=None`` scripts a response that reports no usage.
    """

    content: Sequence[Mapping[str, Any]]
    """Anthropic-shaped content blocks."""
    stop_reason: str | None = "end_turn"
    """The stop reason to report: one of `STOP_REASONS` for a `ScriptedProvider`
    (which refuses any other, None too); a fake server serves what it is given."""
    usage: Usage | None = DEFAULT_USAGE
    """The usage to report, or None for none."""
    delay: float = 0.0
    """Seconds (on the provider's clock) before answering; beyond the request's
    timeout the attempt fails with a ``timeout`` fault after the timeout."""
    response_id: str | None = None
    """The response id to report; generated when None."""

    def __post_init__(self) -> None:
        check_reply(self.content, self.stop_reason, self.usage)
        _validate.seconds("delay", self.delay, positive=False)

    @classmethod
    def text(
        cls,
        text: str,
        *,
        stop_reason: str = "end_turn",
        usage: Usage | None = DEFAULT_USAGE,
        delay: float = 0.0,
    ) -> Reply:
        """A text reply.

        Raises:
            ConfigError: ``text`` is not a string, ``usage`` not a `Usage`
                (or None), or ``delay`` not a number of seconds.
        """
        _string("text", text)
        return cls(content=[{"type": "text", "text": text}], stop_reason=stop_reason,
                   usage=usage, delay=delay)

    @classmethod
    def tool_calls(
        cls,
        *calls: tuple[str, Mapping[str, Any]],
        text: str | None = None,
        usage: Usage | None = DEFAULT_USAGE,
        delay: float = 0.0,
    ) -> Reply:
        """A reply asking for tools: each call is ``(name, input)``.

        Raises:
            ConfigError: a call that is not a ``(name, input)`` pair of a
                non-empty string and a mapping (``calls[i]``), a ``text``
                that is not a string, or a bad ``usage`` or ``delay``.
        """
        for index, call in enumerate(calls):
            if isinstance(call, str | bytes) or not isinstance(call, Sequence) \
                    or len(call) != 2 or not isinstance(call[1], Mapping):
                raise ConfigError(f"calls[{index}]", "must be a (name, input) pair, input a "
                                                     f"mapping, got {_validate.shown(call)}")
            _validate.text(f"calls[{index}][0]", call[0])
        if text is not None:
            _string("text", text)
        content: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
        for name, tool_input in calls:
            content.append(
                {"type": "tool_use", "id": f"toolu_{next(_ids):06d}", "name": name,
                 "input": dict(tool_input)}
            )
        return cls(content=content, stop_reason="tool_use", usage=usage, delay=delay)

    @classmethod
    def final(
        cls,
        data: Mapping[str, Any],
        *,
        tool_name: str = "final_answer",
        usage: Usage | None = DEFAULT_USAGE,
    ) -> Reply:
        """A structured-mode answer: a call of the terminal tool with ``data``.

        Raises:
            ConfigError: ``data`` is not a mapping, ``tool_name`` not a
                non-empty string, or a bad ``usage``.
        """
        if not isinstance(data, Mapping):
            raise ConfigError("data", f"must be a mapping, got {_validate.shown(data)}")
        _validate.text("tool_name", tool_name)
        return cls.tool_calls((tool_name, data), usage=usage)


def _string(field: str, value: object) -> None:
    if not isinstance(value, str):
        raise ConfigError(field, f"must be a string, got {_validate.shown(value)}")


ScriptItem = Reply | ProviderFault | Callable[[ProviderRequest], "Reply | ProviderFault"]
"""A reply, a fault to raise, or a function of the request giving either."""


@dataclass
class ScriptedProvider:
    """A provider that serves a script, in order, and records every request.

    Args:
        script: The replies and faults to serve, one per request (a list or
            any iterable of them; anything else is a `ConfigError`, and so
            is a reply whose stop reason no provider sends: one not in
            `STOP_REASONS`, such as ``"end_trun"`` or None).
        name: The route it stands in for (an operation's ``provider``).
        clock: The clock on which reply delays pass (a `FakeClock` in tests).
        inference_geo: Where it says every reply is served, for a test of a
            regional endpoint's pricing (`Provider.inference_geo`).

    When the script runs out, further requests fail with a ``bad_request``
    fault that says so, which ends the run with ``provider_error``. A reply's
    text blocks are handed whole to ``on_text`` (it streams, a block at a
    time), and it can send every optional request feature (a script answers
    anything).
    """

    streaming = True
    """A reply's text blocks go to ``on_text``, one call each."""
    features = FEATURES
    """A script answers any request."""

    script: Iterable[ScriptItem] = ()
    name: str = "anthropic"
    clock: Clock = field(default_factory=SystemClock)
    inference_geo: str | None = None
    """Where its replies are served, when that changes their price
    (`Provider.inference_geo`); None: list rates."""
    requests: list[ProviderRequest] = field(default_factory=list, init=False)
    """Every request received, with its own copy of the messages."""

    def __post_init__(self) -> None:
        _validate.text("name", self.name)
        _validate.clock("clock", self.clock)
        _validate.text("inference_geo", self.inference_geo, optional=True)
        self._items = iter(_script("script", self.script))

    def add(self, *items: ScriptItem) -> None:
        """Append items to the script.

        Raises:
            ConfigError: an item that is not a `Reply`, a `ProviderFault` or a
                callable (``items[i]``), or a reply whose stop reason no
                provider sends (``items[i].stop_reason``).
        """
        self._items = itertools.chain(self._items, _script("items", items))

    @property
    def vendor(self) -> str:
        """The route it stands in for (`name`)."""
        return self.name

    @property
    def genai_operation(self) -> str:
        """What the requests of the route it stands in for are, as far as its name
        says (`genai_operation_of`): ``generate_content`` for ``google``, else
        ``chat``."""
        return genai_operation_of(self.name)

    def billing(self, model: str, features: Features) -> Billing:
        """``Billing()``: a reply is billed as the script's usage says, web searches
        and long-context rates included (`Provider.billing`)."""
        return DEFAULT_BILLING

    def check_ready(self) -> None:
        """Always ready: a script needs no connection."""

    def check_request(self, request: ProviderRequest) -> None:
        """Any request: a script answers whatever it is sent."""

    async def send(self, request: ProviderRequest, *,
                   on_text: TextCallback | None = None) -> ProviderResponse:
        """Serve the next script item (see the class docstring)."""
        self.requests.append(replace(request, messages=copy.deepcopy(list(request.messages))))
        item = next(self._items, None)
        if item is None:
            raise ProviderFault(
                FaultKind.BAD_REQUEST,
                f"the script has no reply for request {len(self.requests)}",
            )
        if callable(item) and not isinstance(item, Reply | ProviderFault):
            # Known only now: a bad stop reason is the same ConfigError, raised
            # to the run's caller (the run is recorded failed).
            item = item(request)
            if isinstance(item, Reply):
                _stop_reason(f"the reply to request {len(self.requests)}", item)
        if isinstance(item, ProviderFault):
            await anyio.lowlevel.checkpoint()
            raise item
        if item.delay > request.timeout:
            await self.clock.sleep(request.timeout)
            raise timed_out(request.timeout)
        if item.delay:
            await self.clock.sleep(item.delay)
        else:
            await anyio.lowlevel.checkpoint()
        await hand_text(on_text, item.content)
        number = len(self.requests)
        return ProviderResponse(
            content=copy.deepcopy(list(item.content)),
            stop_reason=item.stop_reason,
            usage=item.usage,
            response_id=item.response_id or f"msg_scripted_{number:04d}",
            request_id=f"req_scripted_{number:04d}",
            model=request.model,
        )


def _script(field: str, items: object) -> list[ScriptItem]:
    """The items of a script, each a `Reply` with a stop reason a provider sends,
    a `ProviderFault` or a callable."""
    checked = _validate.items(field, items)
    for index, item in enumerate(checked):
        if not (isinstance(item, Reply | ProviderFault) or callable(item)):
            raise ConfigError(f"{field}[{index}]", "must be a Reply, a ProviderFault or a "
                                                   "function of the request giving one, got "
                                                   f"{_validate.shown(item)}")
        if isinstance(item, Reply):
            _stop_reason(f"{field}[{index}]", item)
        elif not isinstance(item, ProviderFault):
            _validate.sync_callable(f"{field}[{index}]", item, "(request) -> item")
    return checked


def _stop_reason(where: str, reply: Reply) -> None:
    """Refuse a reply whose stop reason no provider hands the engine (a typo such
    as ``"end_trun"``, or None): served, it would make the engine do what no real
    provider can make it do, where every provider's reply carries one of
    `STOP_REASONS` or is a fault.

    Raises:
        ConfigError: ``<where>.stop_reason`` is not one of `STOP_REASONS`.
    """
    if reply.stop_reason not in STOP_REASONS:
        known = ", ".join(sorted(STOP_REASONS))
        raise ConfigError(f"{where}.stop_reason", f"must be a stop reason a provider sends "
                                                  f"({known}), got "
                                                  f"{_validate.shown(reply.stop_reason)}")
