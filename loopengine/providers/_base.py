"""The `Provider` seam: send one request within a timeout, return one response.

A provider does one wire request per `Provider.send` call and never retries
on its own: the engine's retry loop does, so that every wire request is an
attempt it counts, prices and records. A provider reports a failure by raising
one `ProviderFault`; nothing else may escape it.

The attempt's ledger row must be durable before the request goes on the wire.
By default the engine waits for that before it calls `Provider.send`. A
provider whose class sets ``awaits_before_wire = True`` instead receives the
wait as `ProviderRequest.before_wire` and awaits it at the last moment before
sending, so the ledger's commit overlaps the building of the request (the SDK's
serialisation, headers, signing) instead of preceding it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from loopengine._usage import Usage
from loopengine.providers._cache import CachePolicy

__all__ = ["Provider", "ProviderRequest", "ProviderResponse", "TextCallback", "vendor_of"]

TextCallback = Callable[[str], Awaitable[None] | None]
"""Receives streamed text deltas, sync or async."""


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
    on_text: TextCallback | None = None
    """Streaming providers hand text deltas to this callback. When it raises, a
    provider stops reading and raises an ``aborted`` `ProviderFault` carrying
    what was served so far (usage, ids), or lets the exception out: either way
    the engine settles the attempt without a fault and raises the callback's
    own exception to the caller."""
    metadata: Mapping[str, Any] = field(default_factory=dict)
    """Facts about the request for providers that record (turn, phase); never sent."""
    before_wire: Callable[[], Awaitable[None]] | None = None
    """Given only to a provider whose ``awaits_before_wire`` is true: await it
    immediately before the request goes on the wire. It returns once the
    attempt's ledger row is durable; when it raises (`loopengine.LedgerError`)
    nothing may be sent, and the error must propagate as it is, not as a
    `ProviderFault`. Awaiting it again is harmless."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ProviderResponse:
    """One successful model response."""

    content: Sequence[Mapping[str, Any]]
    """Anthropic-shaped content blocks (``text``, ``tool_use``, ...)."""
    stop_reason: str | None
    """``end_turn``, ``tool_use``, ``max_tokens``, ``pause_turn``, ``refusal``..."""
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


@runtime_checkable
class Provider(Protocol):
    """The seam between the engine and a model API."""

    @property
    def name(self) -> str:
        """The route this provider serves (``anthropic``, ``bedrock``...): an
        operation's ``provider`` must equal it (R13)."""
        ...

    # Optional: ``awaits_before_wire = True`` on the class when `send` awaits
    # `ProviderRequest.before_wire` just before the wire (see the module docstring).
    #
    # Optional: ``check_ready(self) -> None``, called before each attempt's
    # ledger row is written: it raises a `loopengine.LoopEngineError` (say a
    # `ConfigError`) when the provider cannot send from here (a client bound to
    # another event loop). Nothing is recorded for that attempt; the run fails
    # with that error.

    async def send(self, request: ProviderRequest) -> ProviderResponse:
        """Make one wire request within ``request.timeout``.

        Raises:
            ProviderFault: the request failed; nothing else may escape.
        """
        ...


def vendor_of(provider: Provider) -> str:
    """Whose API ``provider`` reaches: its ``vendor`` when it names one (a provider
    serving a named route), else its route ``name``. ``served_by`` and prices
    name the vendor, so two routes of one vendor are priced and recorded alike."""
    vendor = getattr(provider, "vendor", None)
    return vendor if isinstance(vendor, str) and vendor else provider.name
