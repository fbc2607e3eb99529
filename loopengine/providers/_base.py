"""The `Provider` seam: send one request within a timeout, return one response.

A provider does one wire request per `Provider.send` call and never retries
on its own: the engine's retry loop does, so that every wire request is an
attempt it counts, prices and records. A provider reports a failure by raising
one `ProviderFault`; nothing else may escape it.

The flow is one way: the engine writes the attempt's ledger row and awaits it,
then calls `Provider.send`, then settles the attempt. A provider never sees an
attempt whose row is not durable.

A provider declares what it can do (`Provider.vendor`, `Provider.streaming`,
`Provider.features`, `Provider.check_ready`, `Provider.check_request`) and how
its requests are billed (`Provider.billing`); the engine reads the
declarations, never guesses. A provider of one's own subclasses `Provider`
and inherits the plain defaults (its vendor is its route, it does not
stream, it sends no optional feature, it is always ready, it can send any
request, each request is billed as its usage says).
"""

from __future__ import annotations

import functools
import re
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from typing import Any, ParamSpec, Protocol, TypeVar, runtime_checkable

import anyio

from loopengine._errors import ConfigError
from loopengine._features import Features
from loopengine._pricing import (
    DEFAULT_BILLING,
    STANDARD_GEOS,
    STANDARD_SPEEDS,
    STANDARD_TIERS,
    Billing,
)
from loopengine._usage import Usage
from loopengine._validate import MAX_INTEGER, binary_note, moment, shown
from loopengine.providers._cache import CachePolicy
from loopengine.providers._faults import FaultKind, ProviderFault

__all__ = ["DEFAULT_BILLING", "FEATURES", "STOP_REASONS", "Billing", "Container", "Provider",
           "ProviderRequest", "ProviderResponse", "ServedSink", "TextCallback", "cut_sink",
           "genai_operation_of", "hand_text", "media_note", "new_call_id", "priced_geo",
           "priced_speed", "priced_tier", "reported_usage", "text_or_none", "token_count",
           "unwatch_cuts", "watch_cuts"]

P = ParamSpec("P")
U = TypeVar("U")

TextCallback = Callable[[str], Awaitable[None] | None]
"""Receives streamed text deltas, sync or async."""


class ServedSink(Protocol):
    """What a reply cut by a cancellation (a stream, or a body being read) reports
    to: the engine's attempt in flight."""

    def keep_served(self, cut: ProviderFault) -> None:
        """Keep what a reply had served when a cancellation cut it."""

    def cut_by(self) -> str:
        """What a cancellation cutting the attempt now is: ``timeout``, its own
        timeout, elapsed by the engine's clock; ``deadline``, that timeout
        capped at the run's deadline (or a deadline of its caller's), elapsed;
        ``caller``, anything else (the caller cancelled the run)."""
        ...

    def cut_at_deadline(self) -> None:
        """Take the timeout the provider is about to raise as a cut by the run's
        deadline (a replay of an attempt the deadline cut, whose replayed clock
        has not reached it): the run ends on its time limit, as recorded."""
        ...


_watching: dict[int, ServedSink] = {}
"""The attempt in flight of each task sending a request, by anyio task id: a
context variable would do, but would add objects to every conversation waiting
on its reply (docs/performance.md)."""


def new_call_id() -> str:
    """An id for a tool call its server named no id for (or gave another call's).

    Unique across processes, not only within this one: a run paused (or
    crashed) here may go on in another process, on another host, and its
    calls there must not take the ids of its calls here. A call's id names its
    result in the transcript, its row in the run store's ``tool_calls`` and its
    `ToolContext.idempotency_key`: a payment made under another call's key
    would be taken for that one's replay, and never made."""
    return f"call_{uuid.uuid4().hex}"


NEW_CALL_ID = re.compile(r"call_[0-9a-f]{32}")
"""What `new_call_id` makes: an id a replay cannot make again, so it compares a
request with its recording as though each were the same (`ReplayProvider`)."""


def watch_cuts(sink: ServedSink) -> int:
    """Have a reply that a cancellation cuts in this task (the attempt's timeout,
    the run's deadline, the caller's cancellation), a stream or a body after its
    headers, report what it had served to ``sink``: an ``aborted`` fault
    carrying its status, ids and usage so far. A
    cancellation must propagate, so it cannot carry them itself; without this
    the attempt would be recorded as if the server had sent nothing, though it
    may bill what it sent. Returns the key for `unwatch_cuts`."""
    key = anyio.get_current_task().id
    _watching[key] = sink
    return key


def unwatch_cuts(key: int) -> None:
    """End what `watch_cuts` began."""
    _watching.pop(key, None)


def cut_sink() -> ServedSink | None:
    """Where a reply cut in this task reports what it had served (`watch_cuts`)."""
    return _watching.get(anyio.get_current_task().id)


_GEMINI_NAMES = frozenset({"google", "gemini", "gemini-vertex"})
"""The Gemini API's vendor and `GeminiProvider`'s routes (on the Gemini API, on
Vertex AI)."""


def genai_operation_of(name: str) -> str:
    """The OpenTelemetry GenAI operation of the requests of a vendor or route
    (``name``) when nothing more is known of them (a script's, a recording's,
    an event that does not say): ``generate_content`` for Gemini's (vendor
    ``google``, routes ``gemini`` and ``gemini-vertex``), else ``chat``.
    Vertex AI's vendor, ``google-vertex``, serves Claude and Gemini alike, so
    it is ``chat`` unless the provider says (`Provider.genai_operation`)."""
    return "generate_content" if name in _GEMINI_NAMES else "chat"


FEATURES = frozenset(item.name for item in fields(Features))
"""The optional request features an operation may publish (docs/providers.md); a provider
names those it can send in `Provider.features`."""

STOP_REASONS = frozenset({"end_turn", "max_tokens", "stop_sequence", "tool_use", "pause_turn",
                          "compaction", "refusal", "model_context_window_exceeded"})
"""The stop reasons a `ProviderResponse` may carry: the Messages API's (the
``anthropic`` SDK's ``BetaStopReason``: its ``StopReason`` and ``compaction``,
a compaction's pause), each read by the engine. Every provider translates its
API's own into these; a reply with another one, or none, is a fault, never an
answer."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ProviderRequest:
    """One model request, in the Anthropic Messages shape.

    ``messages``, ``system`` and ``tools`` are the engine's own copies; a
    provider may read them but must not keep references past `send`.
    """

    model: str
    """The operation's model; a provider never substitutes another (R13)."""
    max_tokens: int
    """The output token cap of this request."""
    messages: Sequence[Mapping[str, Any]]
    """Anthropic-shaped message dicts."""
    system: Sequence[Mapping[str, Any]] | None = None
    """Anthropic text blocks, or None."""
    tools: Sequence[Mapping[str, Any]] = ()
    """Tool definitions (``name``, ``description``, ``input_schema``)."""
    tool_choice: Mapping[str, Any] | None = None
    """Anthropic ``tool_choice``, or None for the provider default (auto)."""
    timeout: float = 60.0
    """Seconds this request may take, already capped at the run's remaining time."""
    cache: CachePolicy = field(default_factory=CachePolicy)
    """Where the provider may place cache markers."""
    metadata: Mapping[str, Any] = field(default_factory=dict)
    """Facts about the request for providers that record (turn, phase); never sent."""
    features: Features = field(default_factory=Features)
    """The run's request features (the operation's, narrowed): thinking, server
    tools, betas... The engine has checked that the provider declares each one
    it enables (`Provider.features`)."""
    container: str | None = None
    """The id of the code execution container an earlier reply of the run
    named (`ProviderResponse.container`), while it has not expired: the
    Messages API's ``container``, so files made in one turn are there the
    next. None: no container yet (or it expired)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ProviderResponse:
    """One successful model response."""

    content: Sequence[Mapping[str, Any]]
    """Anthropic-shaped content blocks (``text``, ``tool_use``, ...)."""
    stop_reason: str | None
    """``end_turn``, ``tool_use``, ``max_tokens``, ``pause_turn``, ``refusal``... (one of
    `STOP_REASONS`)."""
    usage: Usage | None = None
    """What the provider reported, or None when it reported nothing."""
    response_id: str | None = None
    """The provider's response (message) id."""
    request_id: str | None = None
    """The provider's request id."""
    http_status: int | None = 200
    """The HTTP status of the response, when there is one."""
    model: str | None = None
    """The model the provider says served the request."""
    usage_approx: bool = False
    """True when ``usage`` is a floor of what the provider bills: a part the reply
    does not detail was counted at its cheapest rate (a stream's cache writes
    of mixed lifetimes that outgrew the split it reported). The ledger flags
    the attempt as it flags a cut stream's usage (``usage_approx``)."""
    container: Container | None = None
    """The code execution container the reply used (the Messages API's
    ``container``), or None; the run sends its id on its later requests."""

    def __post_init__(self) -> None:
        check_reply(self.content, self.stop_reason, self.usage)
        if self.container is not None and not isinstance(self.container, Container):
            raise ConfigError("container", "must be a Container or None, got "
                                           f"{shown(self.container)}")


def check_reply(content: object, stop_reason: object, usage: object) -> None:
    """Check the parts of a response the engine reads (a `ProviderResponse` a
    provider returns, a scripted `Reply`), where it is built.

    Raises:
        ConfigError: ``content`` is not a list of mappings (content blocks),
            ``stop_reason`` is not text or None, or ``usage`` not a `Usage`
            or None: each failed mid-run, with a TypeError or AttributeError
            escaping the run.
    """
    if isinstance(content, str | bytes | Mapping) or not isinstance(content, Sequence):
        raise ConfigError("content", f"must be a list of content blocks, got {shown(content)}")
    for index, block in enumerate(content):
        if not isinstance(block, Mapping):
            raise ConfigError(f"content[{index}]", "must be a content block (a mapping), got "
                                                   f"{shown(block)}")
    if stop_reason is not None and not isinstance(stop_reason, str):
        raise ConfigError("stop_reason", f"must be text or None, got {shown(stop_reason)}")
    if usage is not None and not isinstance(usage, Usage):
        raise ConfigError("usage", f"must be a Usage or None, got {shown(usage)}")


@dataclass(frozen=True, slots=True)
class Container:
    """A code execution container a reply named: where the model's files live
    between the requests of a run, until it expires.

    Raises:
        ConfigError: an ``id`` that is not a non-empty string, or an
            ``expires_at`` that is not a timezone-aware datetime (it is
            compared with the engine's aware clock).
    """

    id: str
    """The container's id, sent back as the request's ``container``."""
    expires_at: datetime
    """When the container expires (UTC); past it, it is not sent."""

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ConfigError("id", f"must be a non-empty string, got {shown(self.id)}")
        moment("expires_at", self.expires_at)

    def live(self, now: datetime) -> str | None:
        """The id, while the container has not expired at ``now``; else None."""
        return self.id if now < self.expires_at else None

    @classmethod
    def from_json(cls, raw: object, *, strict: bool = False) -> Container | None:
        """A container as a message, a recording or a run state names it (the shape
        `to_json` writes): ``{"id": ..., "expires_at": ...}``, the expiry in ISO
        8601. None when ``raw`` is None.

        Args:
            raw: The JSON value.
            strict: Take only what `to_json` wrote (a run state's): another
                shape, or an expiry that names no UTC offset, raises. Otherwise
                (a reply, a recording) another shape names no container (None)
                and an expiry without a zone is UTC.

        Raises:
            ValueError: with ``strict``, ``raw`` is not in `to_json`'s shape.
        """
        if raw is None:
            return None
        ident, expires = (raw.get("id"), raw.get("expires_at")) if isinstance(
            raw, Mapping) else (None, None)
        moment: datetime | None = None
        if isinstance(ident, str) and ident and isinstance(expires, str):
            try:
                moment = datetime.fromisoformat(expires)
            except ValueError:
                pass
        if moment is None or (strict and moment.tzinfo is None):
            if strict:
                raise ValueError('expected a container, {"id": ..., "expires_at": ...} with '
                                 f"a UTC offset, got {shown(raw)}")
            return None
        return cls(str(ident), moment if moment.tzinfo else moment.replace(tzinfo=UTC))

    def to_json(self) -> dict[str, str]:
        """The container in the shape `from_json` reads."""
        return {"id": self.id, "expires_at": self.expires_at.isoformat()}


@runtime_checkable
class Provider(Protocol):
    """The seam between the engine and a model API, and what it declares it can do.

    `name` and `send` are what every provider writes; the declarations have
    plain defaults, inherited by a provider that subclasses `Provider`.
    """

    @property
    def name(self) -> str:
        """The route this provider serves (``anthropic``, ``aws-bedrock``...): an
        operation's ``provider`` must equal it (R13)."""
        ...

    @property
    def vendor(self) -> str:
        """Whose API the requests reach; ``served_by`` and prices name it, so two
        routes of one vendor are priced and recorded alike. Default: `name`."""
        return self.name

    @property
    def genai_operation(self) -> str:
        """What its requests are, as the OpenTelemetry GenAI conventions name the
        operation (``gen_ai.operation.name``): ``chat`` for a chat API
        (Anthropic's Messages, on any platform; OpenAI's Chat Completions and
        Responses), ``generate_content`` for Gemini's ``generateContent`` (on
        the Gemini API or Vertex AI). Default: ``chat``."""
        return "chat"

    @property
    def streaming(self) -> bool:
        """Whether it can stream: given an ``on_text``, `send` streams that
        request and hands it the text as it arrives. A run that reads the
        text (``on_text``, `loopengine.Engine.stream`) on a provider that
        cannot is refused with a `loopengine.ConfigError` before anything
        is recorded. Default: False."""
        return False

    @property
    def inference_geo(self) -> str | None:
        """Where every request it sends is served, when that changes the price
        and the reply does not say so (a regional endpoint whose rates differ
        from the vendor's list), as `loopengine.Usage.inference_geo` keeps
        it: each reply's usage carries it, so it is priced with that geo's
        multiplier, and a ``credit_hold`` run is refused before anything is
        recorded where the prices have none. Default: None (list rates)."""
        return None

    def billing(self, model: str, features: Features) -> Billing:
        """How its requests to ``model`` with ``features`` are billed beyond what
        their usage reports (`Billing`: the web searches every request runs,
        whether long-context rates can apply, a web search fee of the tool's
        own). The engine asks once per run, before anything is recorded, and
        prices the run's credit hold check, its reservations, its estimate
        and every attempt with the answer. Default: ``Billing()``, a request
        billed as its usage says."""
        return DEFAULT_BILLING

    @property
    def features(self) -> frozenset[str]:
        """The optional request features (of `FEATURES`) it can send; an operation
        that publishes another is refused before anything is recorded. A
        provider that sends only some server tools names each kind it sends
        as ``server_tools:<type prefix>`` (``server_tools:web_search_``)
        instead of ``server_tools``. Default: none."""
        return frozenset()

    def check_ready(self) -> None:
        """Called before each attempt's ledger row is written: raise a
        `loopengine.LoopEngineError` (say a `ConfigError`) when the provider
        cannot send from here (a client bound to another event loop). Nothing
        is recorded for that attempt; the run fails with that error. Default:
        always ready."""

    def check_request(self, request: ProviderRequest) -> None:
        """Called with each attempt's request before its ledger row is written:
        raise a `loopengine.providers.ProviderFault` (``bad_request``, say with
        ``error_code`` ``untranslatable``) for a request this provider could
        not put on the wire (a block its API has no equivalent for). Cheap and
        pure: it reads the request, sends nothing. Nothing is recorded for
        that attempt, it is not retried (the same request would fail the same
        way) and the run ends ``provider_error`` with that fault. Default:
        every request can be sent."""

    async def send(self, request: ProviderRequest, *,
                   on_text: TextCallback | None = None) -> ProviderResponse:
        """Make one wire request within ``request.timeout``.

        Args:
            request: What to send.
            on_text: Given only when the run reads the text: a streaming
                provider streams this request and hands it the text deltas
                as they arrive (None: nobody reads them, the provider may
                read the reply whole). When it
                raises, the provider stops reading and raises an ``aborted``
                `ProviderFault` carrying what was served so far (usage, ids),
                or lets the exception out: either way the engine settles the
                attempt without a fault and raises the callback's own
                exception to the caller.

        Raises:
            ProviderFault: the request failed; nothing else may escape.
        """
        ...


async def hand_text(on_text: TextCallback | None, content: Sequence[Mapping[str, Any]]) -> None:
    """Hand each text block of a whole reply's ``content`` to ``on_text``, one call
    each: how a provider whose replies are not streamed from a wire streams them."""
    if on_text is None:
        return
    for block in content:
        if block.get("type") == "text" and block.get("text"):
            maybe = on_text(str(block["text"]))
            if maybe is not None:
                await maybe


def media_note(block: Mapping[str, Any]) -> str:
    """What stands, as text, for an image or document block a message cannot carry
    (a tool result's, on a route whose tool results are text): a note the model
    can read, naming what it was (``[image: image/png, 68 bytes, not shown]``,
    ``[image: <url>, not shown]``), or a text document's own text."""
    kind = block.get("type")
    source = block.get("source")
    source = source if isinstance(source, Mapping) else {}
    if source.get("type") == "base64":
        return binary_note(str(kind), source.get("media_type"), source.get("data"))
    if kind == "document" and source.get("type") == "text":
        return str(source.get("data", ""))
    if source.get("type") == "url":
        return f"[{kind}: {source.get('url')}, not shown]"
    return f"[{kind}, not shown]"


def text_or_none(value: object) -> str | None:
    """``value`` when it is a string, else None: a field of a provider's JSON."""
    return value if isinstance(value, str) else None


def token_count(value: object) -> int:
    """``value`` when it is a count (a non-negative integer), else 0: a usage
    field of a provider's JSON, missing or null.

    Raises:
        ProviderFault: ``server_error``, ``error_code`` ``invalid_response``:
            a count above `MAX_INTEGER` (2**63 - 1), which no reply can hold
            and no ledger column can store.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return 0
    if value > MAX_INTEGER:
        raise _impossible(f"a count of {value.bit_length()} bits")
    return value


def reported_usage(parse: Callable[P, U]) -> Callable[P, U]:
    """Decorate a provider's parser of a reply's usage so that a usage `Usage`
    refuses (counts that add up beyond `MAX_INTEGER`) is a fault of the
    attempt, ``server_error`` with ``error_code`` ``invalid_response``, like a
    count `token_count` refuses; never a `ConfigError`, which is the caller's.
    """
    @functools.wraps(parse)
    def parsed(*args: P.args, **kwargs: P.kwargs) -> U:
        try:
            return parse(*args, **kwargs)
        except ConfigError as error:
            raise _impossible(str(error)) from None

    return parsed


def _impossible(what: str) -> ProviderFault:
    return ProviderFault(FaultKind.SERVER_ERROR, f"the reply reports an impossible usage: "
                                                 f"{what}", error_code="invalid_response")


def priced_tier(value: object) -> str | None:
    """The service tier a reply reports, as `Usage.service_tier` keeps it: None
    for a standard tier (Anthropic ``standard``, OpenAI ``default``), which
    every reply names and which is priced at the list rates, so that only a
    tier that changes the price (``flex``, ``priority``, ``batch``...) is kept."""
    return _priced(value, STANDARD_TIERS)


def priced_geo(value: object) -> str | None:
    """The ``inference_geo`` a reply reports, as `Usage.inference_geo` keeps it:
    None for the default ``global`` and for ``not_available`` (a model without
    data residency: list rates), else the geo (``us``)."""
    return _priced(value, STANDARD_GEOS)


def priced_speed(value: object) -> str | None:
    """The ``speed`` a reply reports, as `Usage.speed` keeps it: None for
    ``standard`` (list rates), else the speed (``fast``)."""
    return _priced(value, STANDARD_SPEEDS)


def _priced(value: object, standard: frozenset[str]) -> str | None:
    if not isinstance(value, str) or not value or value in standard:
        return None
    return value
