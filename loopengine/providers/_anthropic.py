"""`AnthropicProvider`: the Messages API through the official ``anthropic`` SDK.

One `send` is one wire request. The SDK client is always used with
``max_retries=0``: the SDK would otherwise retry 408, 409, 429 and 5xx on its
own, invisibly, and every wire request must be an attempt the engine counts,
prices and records. Each request carries the engine's attempt timeout, which
the engine has already capped at the run's remaining time (R04).

Every SDK (and transport) error becomes one `ProviderFault` in `classify_error`,
the one place where the fault table of DESIGN.md §3 is applied:

=====================  ===========================================================
fault kind             from
=====================  ===========================================================
``credit_exhausted``   a spend-limit ``error_code`` (e.g. a 429 with
                       ``enforced_spend_limit_reached``), 402 / ``billing_error``,
                       "Your credit balance is too low", "You have reached your
                       specified API usage limits", OpenAI-style quota codes
``timeout``            408, ``timeout_error`` mid-stream, the SDK's timeout
``rate_limited``       429 (``retry-after-ms`` / ``retry-after`` honoured)
``overloaded``         529, ``overloaded_error`` (also mid-stream, after a 200)
``server_error``       409, 500, 502, 503, 504, other 5xx, ``api_error``, a body
                       that is not a message
``connection``         refused, reset or closed before a response: a transport
                       error (httpx2's, or an ``OSError``)
``aborted``            the stream or body was cut after the response began, a
                       stream that ended without ``message_stop``, an idle stream
``unauthorized``       401, 403
``bad_request``        400 ``invalid_request_error``, 404, 413, 422, other 4xx;
                       the client failing on its own state rather than on the
                       connection (``error_code`` ``client_state``: an event
                       loop that ended, a closed client), since such a request
                       may have reached the server and must not be sent twice
=====================  ===========================================================

Credit exhaustion is checked first, whatever the status (R06). A server's
``x-should-retry`` is carried as `ProviderFault.should_retry`; the engine obeys
``false``. Usage that arrived before a stream broke is reported as a floor
(``usage_approx``). The caller's cancellation is never caught here.

A connection belongs to the event loop that opened it. A provider built from
keywords keeps one SDK client per event loop that sends through it, and
closes each as its loop shuts down, so one provider serves consecutive
``asyncio.run`` calls (a sync web handler, a Celery task). A client (or an
``http_client``) the caller gave is used on the first loop that sends only;
on another loop, `AnthropicProvider.send` raises `ConfigError` before
anything is sent.
"""

from __future__ import annotations

import asyncio
import email.utils
import inspect
import logging
import math
import ssl
import threading
import weakref
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from contextvars import ContextVar
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Self, TypeAlias

import anthropic
import anyio
import anyio.lowlevel
import httpx2

from loopengine import _validate
from loopengine._errors import ConfigError
from loopengine._usage import Usage
from loopengine.providers._base import ProviderRequest, ProviderResponse
from loopengine.providers._cache import place_cache_markers
from loopengine.providers._faults import FaultKind, ProviderFault

__all__ = [
    "DEFAULT_STREAM_IDLE_TIMEOUT",
    "AnthropicProvider",
    "classify_error",
    "retry_after",
    "usage_from_api",
]

DEFAULT_STREAM_IDLE_TIMEOUT = 60.0
"""Seconds a stream may go without an event before the attempt is aborted (``idle``)."""

AsyncClient: TypeAlias = (
    anthropic.AsyncAnthropic | anthropic.AsyncAnthropicBedrock | anthropic.AsyncAnthropicVertex
)
"""The SDK clients the provider accepts."""

# Lowercased fragments of the messages Anthropic sends for a depleted prepaid
# balance (400) and for a reached workspace usage limit (400); matched whatever
# the status, since a proxy may relay them as 429 (R06).
_CREDIT_MESSAGES = (
    "credit balance is too low",
    "reached your specified api usage limits",
)
_CREDIT_CODES = frozenset({
    "insufficient_quota",
    "credit_balance_exhausted",
    "billing_hard_limit_reached",
    "linked_organization_billing_unavailable",
})
_CREDIT_CODE_SUFFIXES = ("_spend_limit_reached", "_spend_limit_exceeded")

# Lowercased fragments of the RuntimeErrors asyncio, anyio and trio raise for
# a resource used on an event loop it does not belong to (or after its loop
# ended); the SDK's own RuntimeErrors (an unexpected event order) never say so.
_LOOP_STATE = ("event loop", "different loop", "async context")

# The error code of a failure of the client's own state (an event loop that
# ended, a closed client), not of the connection.
_CLIENT_STATE = "client_state"

_TYPE_KINDS = {
    "invalid_request_error": FaultKind.BAD_REQUEST,
    "not_found_error": FaultKind.BAD_REQUEST,
    "request_too_large": FaultKind.BAD_REQUEST,
    "authentication_error": FaultKind.UNAUTHORIZED,
    "permission_error": FaultKind.UNAUTHORIZED,
    "billing_error": FaultKind.CREDIT_EXHAUSTED,
    "rate_limit_error": FaultKind.RATE_LIMITED,
    "timeout_error": FaultKind.TIMEOUT,
    "api_error": FaultKind.SERVER_ERROR,
    "overloaded_error": FaultKind.OVERLOADED,
    "conflict_error": FaultKind.SERVER_ERROR,
}

_STATUS_KINDS = {
    401: FaultKind.UNAUTHORIZED,
    402: FaultKind.CREDIT_EXHAUSTED,
    403: FaultKind.UNAUTHORIZED,
    408: FaultKind.TIMEOUT,
    # 409 is Anthropic's lock timeout: transient, the SDK itself would retry it.
    409: FaultKind.SERVER_ERROR,
    429: FaultKind.RATE_LIMITED,
    529: FaultKind.OVERLOADED,
}


_BEFORE_WIRE: ContextVar[Callable[[], Awaitable[None]] | None] = ContextVar(
    "loopengine_before_wire", default=None)
"""The `ProviderRequest.before_wire` of the request this task is sending."""

_GATED: dict[type[Any], type[Any]] = {}

logger = logging.getLogger("loopengine")


def _gates(cls: type[Any]) -> bool:
    """Whether clients of ``cls`` have the request hook `_gated` extends."""
    return inspect.iscoroutinefunction(getattr(cls, "_prepare_request", None))


def _gated(cls: type[Any]) -> type[Any]:
    """``cls`` with its request hook extended to await `_BEFORE_WIRE`.

    The SDK calls ``_prepare_request`` (the hook its Bedrock and Vertex clients
    override to sign requests) after it has built and serialised a request and
    immediately before handing it to the HTTP client: the last moment before
    the wire that belongs to the client.
    """
    gated = _GATED.get(cls)
    if gated is None:

        async def _prepare_request(self: Any, request: httpx2.Request) -> None:
            await super(gated, self)._prepare_request(request)  # type: ignore[arg-type]
            before_wire = _BEFORE_WIRE.get()
            if before_wire is not None:
                await before_wire()

        gated = _GATED[cls] = type(cls.__name__, (cls,), {
            "_prepare_request": _prepare_request, "__module__": __name__,
            "__doc__": cls.__doc__, "__qualname__": f"loopengine:{cls.__qualname__}"})
    return gated


def _route_name(client: object) -> str:
    if isinstance(client, anthropic.AsyncAnthropicBedrock):
        return "bedrock"
    if isinstance(client, anthropic.AsyncAnthropicVertex):
        return "vertex"
    if isinstance(client, anthropic.AsyncAnthropicFoundry):
        return "foundry"
    return "anthropic"


# -- event loops: a client's connections belong to the loop that opened them ---------------


def _running_loop() -> object:
    """The running event loop: the asyncio loop, or the native token of anyio's
    other backend (trio's ``TrioToken``), which is as unique to its run."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return anyio.lowlevel.current_token().native_token


def _nothing() -> None:
    """A no-op, scheduled to ask a trio run whether it is still running."""


def _ended(loop: object) -> bool:
    """Whether ``loop`` has ended for good: nothing can ever run on it again."""
    if isinstance(loop, asyncio.AbstractEventLoop):
        return loop.is_closed()
    try:
        # A trio token refuses new work once its run is over (RunFinishedError).
        loop.run_sync_soon(_nothing, idempotent=True)  # type: ignore[attr-defined]
    except RuntimeError:
        return True
    return False


def _reference(loop: object) -> Callable[[], object | None]:
    """A reference to ``loop`` that does not keep an ended loop alive."""
    try:
        return weakref.ref(loop)
    except TypeError:  # a loop class without weak references
        return lambda: loop


class _ClientPerLoop:
    """One SDK client for each event loop that sends, closed as its loop shuts down.

    A pooled connection belongs to the event loop that opened it: on the next
    loop its socket is still open and a request written on it reaches the
    server, but reading the answer fails (``RuntimeError: Event loop is
    closed``). So each loop gets a client of its own, built from the same
    keywords (the TLS context, which costs tens of milliseconds to load, is
    shared; it holds no connection).

    A client is closed on its own loop, as that loop shuts down: each client
    comes with an async generator started on its loop, and the loop closes
    the async generators still open when it shuts down (``asyncio.run``,
    ``asyncio.Runner``, ``trio.run`` and ``anyio.run`` all do), which runs the
    close while the loop can still run it. A loop closed without that step
    (``loop.close()`` alone) cannot run anything again: its client is dropped
    when another loop first sends, and its sockets are left to the garbage
    collector.
    """

    def __init__(self, build: Callable[[], AsyncClient]) -> None:
        self._build = build
        self._lock = threading.Lock()
        # Built at once, so that a bad keyword fails when the provider is
        # built; the next loop that sends claims it.
        self._spare: AsyncClient | None = build()
        self._clients: dict[object, tuple[AsyncClient, AsyncGenerator[None, None]]] = {}

    def current(self) -> AsyncClient:
        """The running loop's client if it has one, else the one the next loop
        that sends will use (a client no loop has used yet)."""
        try:
            entry = self._clients.get(_running_loop())
        except RuntimeError:  # no event loop is running
            entry = None
        if entry is not None:
            return entry[0]
        with self._lock:
            if self._spare is None:
                self._spare = self._build()
            return self._spare

    async def get(self) -> AsyncClient:
        """The running loop's client, built for it on its first request."""
        loop = _running_loop()
        entry = self._clients.get(loop)
        if entry is not None:
            return entry[0]
        with self._lock:
            client, self._spare = self._spare, None
        if client is None:
            client = self._build()
        closer = self._close_with_loop(loop, client)
        with self._lock:
            self._clients[loop] = (client, closer)
        self._forget_ended()
        # Its first step registers the generator with this loop; it never
        # suspends, so no other task can see the entry before it is armed.
        await closer.asend(None)
        return client

    async def aclose(self) -> None:
        """Close the running loop's client (the next request builds another)."""
        with self._lock:
            entry = self._clients.pop(_running_loop(), None)
        if entry is not None:
            await entry[1].aclose()
        self._forget_ended()

    def _forget_ended(self) -> None:
        # Clients of loops that ended without shutting down their async
        # generators: no loop can close them now, and keeping them would leak.
        with self._lock:
            for loop in [loop for loop in self._clients if _ended(loop)]:
                del self._clients[loop]

    async def _close_with_loop(self, loop: object, client: AsyncClient) -> AsyncGenerator[None]:
        """Wait at the yield until ``loop`` shuts its async generators down (or
        `aclose` closes this one), then close ``client`` on ``loop``."""
        try:
            yield
        finally:
            with self._lock:
                if self._clients.get(loop, (None,))[0] is client:
                    del self._clients[loop]
            # trio cancels async work while it finalises async generators;
            # closing sockets is exactly the work that must still happen.
            with anyio.CancelScope(shield=True):
                try:
                    await client.close()
                except Exception:
                    logger.warning("could not close the Anthropic client of an event loop "
                                   "that shut down", exc_info=True)


class AnthropicProvider:
    """The Anthropic Messages API as a `Provider`, through the ``anthropic`` SDK.

    Args:
        client: An ``anthropic.AsyncAnthropic`` (or ``AsyncAnthropicBedrock``,
            ``AsyncAnthropicVertex``) client. The provider uses a copy of it
            with ``max_retries=0`` and never closes it. Its connections belong
            to the event loop they were opened on, so the provider uses it on
            the first event loop that sends through it only: a request on any
            other loop (a second ``asyncio.run``) raises `ConfigError` before
            anything is sent.
        stream: Stream each response (server-sent events) and hand text
            deltas to the run's ``on_text`` callback.
        stream_idle_timeout: Seconds a stream may go without an event before
            the attempt is aborted with reason ``idle`` (and retried).
        **client_kwargs: Without ``client``: the keywords to build an
            ``AsyncAnthropic`` (``api_key``, ``base_url``, ``timeout``...).
            The provider builds one client per event loop that sends through
            it, so one provider (and one `loopengine.Engine`) serves
            consecutive ``asyncio.run`` calls, each on a client of its own;
            each loop's client is closed as that loop shuts down, or by
            `aclose` on that loop. An ``http_client`` among the keywords
            cannot be rebuilt per loop: the provider then builds one client
            on it, usable on the first event loop that sends only (as a
            ``client`` is), and closes it in `aclose`.

    Raises:
        ConfigError: both a client and client keywords, a synchronous client,
            ``max_retries`` other than 0, or a bad ``stream_idle_timeout``.

    The provider awaits each attempt's ledger write (`ProviderRequest.before_wire`)
    in the SDK client's request hook, after the request is built and just
    before it is handed to the HTTP client (``awaits_before_wire``).

    Example::

        provider = AnthropicProvider(api_key=key, stream=True)
        engine = loopengine.Engine(provider)
    """

    awaits_before_wire: bool
    """True: `send` awaits `ProviderRequest.before_wire` just before the wire."""

    def __init__(
        self,
        client: AsyncClient | None = None,
        *,
        stream: bool = False,
        stream_idle_timeout: float = DEFAULT_STREAM_IDLE_TIMEOUT,
        **client_kwargs: Any,
    ) -> None:
        _validate.boolean("stream", stream)
        self._idle = _validate.required_seconds("stream_idle_timeout", stream_idle_timeout)
        if client_kwargs.get("max_retries", 0) != 0:
            raise ConfigError("max_retries", "the SDK must not retry on its own: every wire "
                                             "request is an attempt the engine counts; set the "
                                             "operation's RetryPolicy instead")
        client_kwargs.pop("max_retries", None)
        # Set when the provider is bound to one client of the caller's making
        # (a client, or an http_client), which works on one event loop only.
        self._bound: AsyncClient | None = None
        self._bound_as = "client"
        self._home: Callable[[], object | None] | None = None
        self._per_loop: _ClientPerLoop | None = None
        self._owned = False
        self._lock = threading.Lock()
        if client is None:
            self._owned = True
            if client_kwargs.get("http_client") is not None:
                self._bound_as = "http_client"
                base: AsyncClient = anthropic.AsyncAnthropic(max_retries=0, **client_kwargs)
                self._bound = self._own_copy(base)
            else:
                client_kwargs.pop("http_client", None)
                self._per_loop = _ClientPerLoop(self._builder(client_kwargs))
                base = self._per_loop.current()
        else:
            if client_kwargs:
                raise ConfigError("client", "give a client or the keywords to build one, not "
                                            f"both (got {', '.join(sorted(client_kwargs))})")
            if not isinstance(client, anthropic.AsyncAnthropic | anthropic.AsyncAnthropicBedrock
                              | anthropic.AsyncAnthropicVertex):
                raise ConfigError("client", f"must be an async anthropic client, got "
                                            f"{type(client).__name__}")
            base = client
            self._bound = self._own_copy(client)
        self.awaits_before_wire = _gates(type(self.client))
        self._name = _route_name(base)
        self._stream = stream

    @staticmethod
    def _own_copy(base: AsyncClient) -> AsyncClient:
        # A copy shares the caller's connection pool; only its retries differ.
        client = base.with_options(max_retries=0)
        if _gates(type(client)):
            # Our own copy (never the caller's client) awaits the attempt's
            # ledger write just before the wire; copies of it do the same.
            client.__class__ = _gated(type(client))
        return client

    @staticmethod
    def _builder(client_kwargs: dict[str, Any]) -> Callable[[], AsyncClient]:
        tls: list[ssl.SSLContext] = []

        def build() -> AsyncClient:
            if not tls:
                # The SDK's default verification (the system's certificates),
                # loaded once for every client this provider builds.
                tls.append(httpx2.create_ssl_context())
            # The HTTP client the SDK would build, on the shared TLS context.
            http_client = anthropic.DefaultAsyncHttpxClient(verify=tls[0])
            client: AsyncClient = anthropic.AsyncAnthropic(
                max_retries=0, http_client=http_client, **client_kwargs)
            # Built as the SDK's own class (which alone runs the SDK's
            # credential chain), then given the request hook.
            if _gates(type(client)):
                client.__class__ = _gated(type(client))
            return client

        return build

    @property
    def name(self) -> str:
        """``anthropic``, or ``bedrock`` / ``vertex`` / ``foundry`` for those clients."""
        return self._name

    @property
    def client(self) -> AsyncClient:
        """The SDK client requests go through (``max_retries=0``).

        For a provider built from keywords (without ``http_client``): the
        running event loop's client once it has sent, else the client the
        next event loop to send will use.
        """
        if self._per_loop is not None:
            return self._per_loop.current()
        assert self._bound is not None
        return self._bound

    @property
    def streaming(self) -> bool:
        """Whether responses are streamed."""
        return self._stream

    async def aclose(self) -> None:
        """Close the client the provider built for the running event loop.

        A provider built from keywords closes the running loop's client (a
        later request builds another); one built on an ``http_client`` closes
        that client. A ``client`` passed in is left open.
        """
        if self._per_loop is not None:
            await self._per_loop.aclose()
        elif self._owned and self._bound is not None:
            await self._bound.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"AnthropicProvider(name={self._name!r}, stream={self._stream})"

    async def send(self, request: ProviderRequest) -> ProviderResponse:
        """Make one Messages request within ``request.timeout``.

        Raises:
            ProviderFault: the request failed; every SDK error is classified.
            ConfigError: the client given to the provider belongs to another
                event loop than the running one; nothing was sent.
        """
        client = await self._per_loop.get() if self._per_loop is not None else self._on_home()
        params = self._params(request)
        token = _BEFORE_WIRE.set(request.before_wire)
        try:
            if self._stream:
                return await self._send_streaming(client, request, params)
            return await self._send_plain(client, params)
        finally:
            _BEFORE_WIRE.reset(token)

    def check_ready(self) -> None:
        """Before an attempt is recorded: refuse a given client on another event loop.

        Raises:
            ConfigError: the client (or ``http_client``) given to the provider
                was first used on another event loop than the running one.
        """
        if self._per_loop is None:
            self._on_home()

    def _on_home(self) -> AsyncClient:
        """The bound client, if the running loop is the one it was first used on."""
        assert self._bound is not None
        loop = _running_loop()
        home = self._home
        if home is None:
            with self._lock:
                if self._home is None:
                    self._home = _reference(loop)
                home = self._home
        first = home()
        if first is loop:
            return self._bound
        state = "which has ended" if first is None or _ended(first) else "which is still open"
        given = ("the client given to AnthropicProvider" if self._bound_as == "client"
                 else "the http_client given to AnthropicProvider")
        raise ConfigError(self._bound_as, f"{given} was first used on another event loop, "
                          f"{state}: its pooled connections belong to that loop and cannot be "
                          "used on this one, so nothing was sent. Build the provider from "
                          "keywords without an http_client (it keeps a client per event loop), "
                          "or give it a client made for this loop")

    def _params(self, request: ProviderRequest) -> dict[str, Any]:
        # Markers are placed on every request, so the wire never carries more
        # than four whatever the caller marked (R12).
        system, tools, messages = place_cache_markers(
            request.cache, system=request.system, tools=request.tools,
            messages=request.messages,
        )
        params: dict[str, Any] = {
            "model": request.model,
            "max_tokens": request.max_tokens,
            "messages": messages,
            "timeout": request.timeout,
        }
        if system:
            params["system"] = system
        if tools:
            params["tools"] = tools
        if request.tool_choice is not None:
            params["tool_choice"] = dict(request.tool_choice)
        return params

    async def _send_plain(self, client: AsyncClient, params: dict[str, Any]) -> ProviderResponse:
        # The raw-response form hands over the body as JSON: the engine keeps
        # Anthropic-shaped dicts, so building the SDK's models would be wasted.
        try:
            async with client.messages.with_streaming_response.create(**params) as raw:
                request_id = raw.headers.get("request-id")
                status = raw.status_code
                try:
                    body = await raw.json()
                except (httpx2.HTTPError, anthropic.APIError) as error:
                    raise classify_error(error, request_id=request_id, in_body=True) from error
                except ValueError:
                    body = None
        except (anthropic.AnthropicError, httpx2.HTTPError) as error:
            raise classify_error(error) from error
        if not isinstance(body, Mapping) or not isinstance(body.get("content"), list):
            raise ProviderFault(FaultKind.SERVER_ERROR, "the response body is not a message",
                                http_status=status, error_code="invalid_response",
                                request_id=request_id)
        return ProviderResponse(
            content=body["content"],
            stop_reason=body.get("stop_reason"),
            usage=usage_from_api(body.get("usage")),
            response_id=_text(body.get("id")),
            request_id=request_id,
            http_status=status,
            model=_text(body.get("model")),
        )

    async def _send_streaming(
        self, client: AsyncClient, request: ProviderRequest, params: dict[str, Any]
    ) -> ProviderResponse:
        on_text = request.on_text
        try:
            manager = client.messages.stream(**params)
            stream = await manager.__aenter__()
        except (anthropic.AnthropicError, httpx2.HTTPError) as error:
            raise classify_error(error) from error
        started = stopped = False
        try:
            while True:
                with anyio.move_on_after(self._idle) as idle:
                    try:
                        event = await stream.__anext__()
                    except StopAsyncIteration:
                        break
                    except (anthropic.AnthropicError, httpx2.HTTPError, ValueError,
                            RuntimeError) as error:
                        snapshot = stream.current_message_snapshot if started else None
                        raise classify_error(
                            error, request_id=stream.request_id, in_body=True,
                            usage=_snapshot_usage(snapshot),
                            response_id=snapshot.id if snapshot is not None else None,
                        ) from error
                if idle.cancelled_caught:
                    snapshot = stream.current_message_snapshot if started else None
                    raise ProviderFault(
                        FaultKind.ABORTED,
                        f"the stream sent no event for {self._idle:g}s",
                        http_status=stream.response.status_code, aborted_reason="idle",
                        request_id=stream.request_id, usage=_snapshot_usage(snapshot),
                        usage_approx=True,
                        response_id=snapshot.id if snapshot is not None else None,
                    )
                if event.type == "message_start":
                    started = True
                elif event.type == "text":
                    if on_text is not None:
                        try:
                            maybe = on_text(event.text)
                            if inspect.isawaitable(maybe):
                                await maybe
                        except Exception as error:
                            # The engine raises the callback's own exception to
                            # its caller; the fault carries what was served.
                            snapshot = stream.current_message_snapshot if started else None
                            raise ProviderFault(
                                FaultKind.ABORTED, "the on_text callback raised",
                                http_status=stream.response.status_code,
                                request_id=stream.request_id,
                                usage=_snapshot_usage(snapshot), usage_approx=True,
                                response_id=snapshot.id if snapshot is not None else None,
                            ) from error
                elif event.type == "message_stop":
                    stopped = True
        finally:
            # Closing releases the connection; it must happen even while the
            # caller's cancellation (or the attempt timeout) unwinds us.
            with anyio.CancelScope(shield=True):
                await stream.close()
        snapshot = stream.current_message_snapshot if started else None
        if not stopped:
            # The SDK returns quietly from a stream cut short; its message has
            # whatever arrived, so its usage is only a floor.
            raise ProviderFault(
                FaultKind.ABORTED, "the stream ended before message_stop",
                http_status=stream.response.status_code, request_id=stream.request_id,
                usage=_snapshot_usage(snapshot), usage_approx=True,
                response_id=snapshot.id if snapshot is not None else None,
            )
        assert snapshot is not None
        return ProviderResponse(
            content=[block.to_dict() for block in snapshot.content],
            stop_reason=snapshot.stop_reason,
            usage=_snapshot_usage(snapshot),
            response_id=snapshot.id,
            request_id=stream.request_id,
            http_status=stream.response.status_code,
            model=snapshot.model,
        )


def _snapshot_usage(snapshot: Any) -> Usage | None:
    if snapshot is None or getattr(snapshot, "usage", None) is None:
        return None
    return usage_from_api(snapshot.usage.to_dict())


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return 0
    return value


def usage_from_api(raw: object) -> Usage | None:
    """Map an Anthropic ``usage`` object (a dict) to `Usage`.

    ``input_tokens`` stays the uncached input (Anthropic's convention);
    ``cache_creation_input_tokens`` is the cache write, of which
    ``cache_creation.ephemeral_1h_input_tokens`` is the one-hour part. Missing
    or null counts are 0; a missing usage object is None.
    """
    if not isinstance(raw, Mapping):
        return None
    write = _count(raw.get("cache_creation_input_tokens"))
    creation = raw.get("cache_creation")
    one_hour = 0
    if isinstance(creation, Mapping):
        five_minutes = _count(creation.get("ephemeral_5m_input_tokens"))
        one_hour = _count(creation.get("ephemeral_1h_input_tokens"))
        if write == 0:
            write = five_minutes + one_hour
    return Usage(
        input_tokens=_count(raw.get("input_tokens")),
        output_tokens=_count(raw.get("output_tokens")),
        cache_read_tokens=_count(raw.get("cache_read_input_tokens")),
        cache_write_tokens=write,
        cache_write_1h_tokens=min(one_hour, write),
    )


# -- classification: the one place SDK errors become faults ---------------------------------


def classify_error(
    error: BaseException,
    *,
    request_id: str | None = None,
    in_body: bool = False,
    usage: Usage | None = None,
    response_id: str | None = None,
    now: datetime | None = None,
) -> ProviderFault:
    """Classify an SDK or transport error as one `ProviderFault` (DESIGN.md §3).

    Args:
        error: What the SDK (or the HTTP transport under it) raised.
        request_id: The request id, when the response had begun.
        in_body: The error came while the body or stream was being read, after
            a response began: a transport failure there cuts the stream
            (``aborted``) rather than failing to connect.
        usage: Usage reported before the failure (a stream's floor).
        response_id: The message id, when the stream had announced one.
        now: The current time, for ``retry-after`` given as an HTTP date.

    Returns:
        The fault; it is never raised here.
    """
    approx = usage is not None
    if isinstance(error, anthropic.APIStatusError):
        return _status_fault(error, usage=usage, response_id=response_id, now=now)
    if isinstance(error, anthropic.APITimeoutError | httpx2.TimeoutException):
        return ProviderFault(FaultKind.TIMEOUT, "the SDK's request timed out",
                             request_id=request_id, usage=usage, usage_approx=approx,
                             response_id=response_id)
    own = _own_failure(error)
    if own is not None:
        # Not the connection: the request may well have reached the server
        # (and be billed), so it is not retried, nor recorded as a
        # connection that failed.
        return ProviderFault(FaultKind.BAD_REQUEST,
                             f"the client failed on its own state, not on the connection "
                             f"({type(own).__name__}: {own}); the request may have reached "
                             "the server, so it is not retried",
                             error_code=_CLIENT_STATE,
                             request_id=request_id, usage=usage, usage_approx=approx,
                             response_id=response_id)
    if isinstance(error, anthropic.APIConnectionError):
        return ProviderFault(FaultKind.CONNECTION, f"connection failed: {_cause(error)}",
                             request_id=request_id)
    if isinstance(error, httpx2.HTTPError | httpx2.StreamError):
        kind = FaultKind.ABORTED if in_body else FaultKind.CONNECTION
        return ProviderFault(kind, f"the transport failed: {type(error).__name__}: {error}",
                             http_status=200 if in_body else None, request_id=request_id,
                             usage=usage, usage_approx=approx, response_id=response_id)
    if isinstance(error, anthropic.APIResponseValidationError | ValueError | RuntimeError):
        return ProviderFault(FaultKind.SERVER_ERROR,
                             f"the response is not a valid message: {type(error).__name__}",
                             http_status=getattr(error, "status_code", None),
                             error_code="invalid_response", request_id=request_id,
                             usage=usage, usage_approx=approx, response_id=response_id)
    # Any other SDK error (missing credentials, a bad argument) is our
    # request's fault and will not improve on retry.
    return ProviderFault(FaultKind.BAD_REQUEST, f"{type(error).__name__}: {error}",
                         request_id=request_id)


def _own_failure(error: BaseException) -> BaseException | None:
    """The error of the client's own state behind ``error``, or None.

    The SDK reports whatever its HTTP client raised as an
    ``APIConnectionError``, but only a transport error (httpx2's, or an
    ``OSError``) means the connection failed. Anything else is the client's
    own state: a connection pooled on an event loop that has ended answers
    ``RuntimeError: Event loop is closed`` after its request was written.
    Read from a stream, such an error comes as it is.
    """
    if isinstance(error, anthropic.APIConnectionError):
        cause = error.__cause__
        if cause is None or isinstance(cause, httpx2.HTTPError | httpx2.StreamError | OSError):
            return None
        return cause
    if isinstance(error, RuntimeError) and any(
            fragment in str(error).lower() for fragment in _LOOP_STATE):
        return error
    return None


def _cause(error: BaseException) -> str:
    cause = error.__cause__
    if cause is None:
        return str(error)
    return f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__


def _status_fault(
    error: anthropic.APIStatusError,
    *,
    usage: Usage | None,
    response_id: str | None,
    now: datetime | None,
) -> ProviderFault:
    status = error.status_code
    body = error.body
    error_type = error.type or _nested(body, "error", "type")
    code = error.error_code or _nested(body, "error", "code")
    message = error.api_message or _nested(body, "error", "message") or ""
    headers = error.response.headers
    kind = _kind(status, error_type, code, message)
    should = headers.get("x-should-retry")
    where = "mid-stream " if status == 200 else ""
    return ProviderFault(
        kind,
        f"HTTP {status} {where}{error_type or 'error'}: {message}".rstrip(": "),
        http_status=status,
        error_code=code or error_type,
        retry_after=retry_after(headers, now=now),
        should_retry=True if should == "true" else False if should == "false" else None,
        request_id=error.request_id,
        response_id=response_id,
        usage=usage,
        usage_approx=usage is not None,
    )


def _nested(body: object, *keys: str) -> str | None:
    for key in keys:
        if not isinstance(body, Mapping):
            return None
        body = body.get(key)
    return body if isinstance(body, str) else None


def _kind(status: int, error_type: str | None, code: str | None, message: str) -> FaultKind:
    """The fault kind of an error response (or of a mid-stream error event, status 200)."""
    lowered = message.lower()
    if (
        status == 402
        or error_type == "billing_error"
        or (code is not None and (code in _CREDIT_CODES or code.endswith(_CREDIT_CODE_SUFFIXES)))
        or any(fragment in lowered for fragment in _CREDIT_MESSAGES)
    ):
        return FaultKind.CREDIT_EXHAUSTED
    if status == 200 or (status >= 500 and error_type == "overloaded_error"):
        # After a 200 only the event's type tells what went wrong; an unknown
        # type mid-stream is the server's failure.
        return _TYPE_KINDS.get(error_type or "", FaultKind.SERVER_ERROR)
    if status in _STATUS_KINDS:
        return _STATUS_KINDS[status]
    if status >= 500:
        return FaultKind.SERVER_ERROR
    return FaultKind.BAD_REQUEST


def retry_after(headers: Mapping[str, str], *, now: datetime | None = None) -> float | None:
    """Seconds a response asks the client to wait, or None.

    ``retry-after-ms`` (milliseconds, Anthropic's) wins over ``retry-after``,
    which is seconds or an HTTP date. Negative or unparseable values are None.
    """
    milliseconds = _number(headers.get("retry-after-ms"))
    if milliseconds is not None:
        return milliseconds / 1000.0
    value = headers.get("retry-after")
    if value is None:
        return None
    seconds = _number(value)
    if seconds is not None:
        return seconds
    try:
        at = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if at.tzinfo is None:
        at = at.replace(tzinfo=UTC)
    return max(0.0, (at - (now or datetime.now(UTC))).total_seconds())


def _number(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    if math.isnan(number) or math.isinf(number) or number < 0:
        return None
    return number
