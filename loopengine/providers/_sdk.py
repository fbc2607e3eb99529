"""What every provider on a Stainless SDK (``anthropic``, ``openai``) shares:
`SDKProvider` (its `send`, its declarations, closing), `provider_clients`
(its clients from its arguments), `json_body` (reading a reply whole) and
`read_stream` (reading a streamed reply).

The clients themselves, one per event loop or one bound to its first loop,
are ``_clients.py``'s.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any, Generic, Self, TypeVar, cast

import anyio
import httpx2

from loopengine import _validate
from loopengine._errors import ConfigError
from loopengine._features import Features
from loopengine._usage import Usage
from loopengine.providers._base import (
    DEFAULT_BILLING,
    Billing,
    ProviderRequest,
    ProviderResponse,
    TextCallback,
    cut_sink,
)
from loopengine.providers._clients import (
    BoundClient,
    C,
    ClientPerLoop,
    client_keywords,
    client_or_keywords,
    connection_limit,
    http_client,
    shared_tls,
)
from loopengine.providers._faults import Classifier, FaultKind, ProviderFault

__all__ = ["DEFAULT_STREAM_IDLE_TIMEOUT", "NO_SDK_RETRIES", "SDKProvider", "import_sdk",
           "json_body", "keep_if_cut", "provider_clients", "read_stream"]

E = TypeVar("E")

NO_SDK_RETRIES = ("the SDK must not retry on its own: every wire request is an attempt the "
                  "engine counts; set the operation's RetryPolicy instead")
"""Why a provider refuses retries asked of its SDK (``max_retries``, ``retry_options``)."""

DEFAULT_STREAM_IDLE_TIMEOUT = 60.0
"""Seconds a stream may go without an event before the attempt is aborted (``idle``)."""


def import_sdk(module: str, package: str, *, provider: str, extra: str) -> Any:
    """The SDK ``module`` (of the distribution ``package``) that ``provider`` sends
    through, imported on first use: never when ``loopengine`` is.

    Raises:
        ImportError: the ``extra`` that brings it is not installed (the message
            says how to install it).
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:  # pragma: no cover - the dev install has the extras
        raise ImportError(f"{provider} needs the {package} SDK, which is not installed: "
                          f"pip install 'loopengine-core[{extra}]'") from error


def keep_if_cut(error: BaseException, served: Callable[[], ProviderFault]) -> None:
    """A reply this task was reading was cut by ``error``: when it is a
    cancellation (the attempt's timeout, the run's deadline, the caller's),
    report what the server had sent by then (``served()``: its status, ids and
    usage so far) to `cut_sink`, the attempt in flight. A cancellation must
    propagate, so it cannot carry them itself; anything else is the caller's
    to classify."""
    if isinstance(error, Exception):
        return
    sink = cut_sink()
    if sink is not None:
        sink.keep_served(served())


async def read_stream(
    events: AsyncIterator[E],
    *,
    idle: float,
    failures: tuple[type[BaseException], ...],
    classify: Classifier,
    take: Callable[[E], str | None],
    on_text: TextCallback | None,
    close: Callable[[], Awaitable[None]],
    missing: Callable[[], str | None],
    http_status: int,
    request_id: str | None,
    served: Callable[[], tuple[Usage | None, str | None]],
) -> None:
    """Read a streamed reply to its end, the same way for every SDK provider.

    Each event goes to ``take``, which returns its text, if any, for
    ``on_text``. A stream quiet for ``idle`` seconds is cut (an ``aborted``
    fault, reason ``idle``); an error among ``failures`` while reading is
    classified by ``classify`` (``in_body``); an ``on_text`` that raises
    stops the reading with a cut (reason None) raised from its exception
    (the engine raises the callback's own exception to its caller; the fault
    carries what was served). ``close`` runs however the reading ends: it
    releases the connection, even while the caller's cancellation (or the
    attempt timeout) unwinds; what the stream had served by then goes to
    `cut_sink` (`keep_if_cut`), since the cancellation itself carries nothing. A
    stream that ended without what ``missing``
    names (its last event, its usage...) is cut ("the stream ended before
    <what>").

    Each such fault carries ``http_status``, ``request_id`` and what the
    stream had served (``served()``: its usage so far and its response id);
    a cut's usage is a floor (``usage_approx``) whenever there is one. A
    stream cut before any usage arrived has none: its usage is unknown, not
    a floor of zero.
    """

    def cut(message: str, reason: str | None) -> ProviderFault:
        usage, response_id = served()
        return ProviderFault(FaultKind.ABORTED, message, http_status=http_status,
                             aborted_reason=reason, request_id=request_id, usage=usage,
                             usage_approx=usage is not None, response_id=response_id)

    try:
        while True:
            with anyio.move_on_after(idle) as quiet:
                try:
                    event = await events.__anext__()
                except StopAsyncIteration:
                    break
                except failures as error:
                    usage, response_id = served()
                    raise classify(error, request_id=request_id, in_body=True, usage=usage,
                                   response_id=response_id) from error
            if quiet.cancelled_caught:
                raise cut(f"the stream sent nothing for {idle:g}s", "idle")
            text = take(event)
            if text and on_text is not None:
                try:
                    maybe = on_text(text)
                    if inspect.isawaitable(maybe):
                        await maybe
                except Exception as error:
                    raise cut("the on_text callback raised", None) from error
    except BaseException as error:
        keep_if_cut(error, lambda: cut("the stream was cancelled", None))
        raise
    finally:
        with anyio.CancelScope(shield=True):
            await close()
    lacking = missing()
    if lacking is not None:
        # The SDKs return quietly from a stream cut short.
        raise cut(f"the stream ended before {lacking}", None)


async def json_body(
    create: Callable[..., AbstractAsyncContextManager[Any]], params: dict[str, Any], *,
    what: str, valid: Callable[[Mapping[str, Any]], bool], classify: Classifier,
    failures: Callable[[], tuple[type[BaseException], ...]],
    request_id_of: Callable[[Mapping[str, str]], str | None],
) -> tuple[Mapping[str, Any], str | None, int]:
    """One request through an SDK method's raw-response form (``create`` of
    ``with_streaming_response``): its body as JSON, its request id (read from
    the headers by ``request_id_of``) and its status. The raw form hands over the
    body as JSON: the engine keeps dicts, so building the SDK's models would be
    wasted. A cancellation that cuts the body once the status and headers
    have arrived reports them to `cut_sink` (`keep_if_cut`), as a cut
    stream's are: the server answered, and may bill the reply.

    Raises:
        ProviderFault: the request failed (an error among ``failures()``,
            classified by ``classify``), or its body is not ``what`` (a JSON
            object that ``valid`` accepts): ``server_error``, ``error_code``
            ``invalid_response``.
    """
    try:
        async with create(**params) as raw:
            request_id = request_id_of(raw.headers)
            status: int = raw.status_code
            try:
                body = await raw.json()
            except failures() as error:
                raise classify(error, request_id=request_id, in_body=True) from error
            except ValueError:
                body = None
            except BaseException as error:
                # Cut while the body arrived: the server answered, and may bill it.
                keep_if_cut(error, lambda: ProviderFault(
                    FaultKind.ABORTED, "the reply was cancelled while its body was read",
                    http_status=status, request_id=request_id))
                raise
    except failures() as error:
        raise classify(error) from error
    if not isinstance(body, Mapping) or not valid(body):
        raise ProviderFault(FaultKind.SERVER_ERROR, f"the response body is not {what}",
                            http_status=status, error_code="invalid_response",
                            request_id=request_id)
    return body, request_id, status


def provider_clients(
    owner: str,
    client: C | None,
    client_kwargs: dict[str, Any],
    *,
    max_connections: int | None,
    accepts: tuple[type[Any], ...],
    build: Callable[..., C],
    sdk_default: Callable[..., httpx2.AsyncClient],
) -> ClientPerLoop[C] | BoundClient[C]:
    """Where a provider gets its SDK clients, from its arguments.

    A ``client`` is used through a copy with ``max_retries=0`` (sharing its
    connection pool), on its first event loop only. Keywords with an
    ``http_client`` build one client on it, likewise bound, closed by the
    provider. Other keywords build one client per event loop (`http_client`).

    Args:
        owner: The provider's class name, for messages.
        client: The caller's SDK client, or None.
        client_kwargs: The keywords to build one: ``max_retries`` may only be 0
            (and is dropped: the provider always sets it).
        max_connections: The provider's ``max_connections``.
        accepts: The SDK client classes ``client`` may be.
        build: The SDK client class to build from the keywords.
        sdk_default: The SDK's default httpx client class.

    Raises:
        ConfigError: a bad ``max_connections``, ``max_retries`` other than 0,
            both a client and keywords, a client that is not ``accepts``, or a
            keyword ``build`` does not take or of the wrong type
            (`client_keywords`).
    """
    connections = connection_limit(max_connections, client, client_kwargs)
    if client_kwargs.get("max_retries", 0) != 0:
        raise ConfigError("max_retries", NO_SDK_RETRIES)
    client_kwargs.pop("max_retries", None)
    client_or_keywords(client, client_kwargs)
    client_keywords(build, client_kwargs)
    if client is not None:
        if not isinstance(client, accepts):
            names = " or ".join(kind.__name__ for kind in accepts)
            raise ConfigError("client", f"must be an async SDK client ({names}), got "
                                        f"{type(client).__name__}")
        copy: C = cast(Any, client).with_options(max_retries=0)
        return BoundClient(owner, copy)
    if client_kwargs.get("http_client") is not None:
        return BoundClient(owner, build(max_retries=0, **client_kwargs),
                           given_as="http_client", owned=True)
    client_kwargs.pop("http_client", None)
    tls = shared_tls()

    def per_loop(on_asyncio: bool) -> C:
        return build(max_retries=0, http_client=http_client(
            tls(), connections, on_asyncio=on_asyncio, sdk_default=sdk_default),
            **client_kwargs)

    return ClientPerLoop(owner, per_loop)


class SDKProvider(Generic[C]):
    """What every provider on a managed SDK client shares: the client of the
    running event loop, the check before an attempt is recorded, and closing.

    A subclass sets ``_clients``, ``_name``, ``_vendor`` and ``_stream`` in
    its ``__init__``, declares its ``features`` and ``check_request``, and
    supplies ``_params``, ``_send_plain`` and ``_send_streaming``: `send` is the same for every
    such provider (the running loop's client, then the request, streamed
    when its caller reads the text or the provider was built to stream).
    """

    _clients: ClientPerLoop[C] | BoundClient[C]
    _name: str
    _vendor: str
    _stream: bool
    _idle: float
    _route: str | None

    def _settings(self, stream: bool, stream_idle_timeout: float, route: str | None) -> None:
        """Check and keep the settings every such provider takes (a bad one is a
        `ConfigError` naming it); `_name_route` names the route once the
        vendor is known."""
        _validate.boolean("stream", stream)
        if route is not None:
            _validate.text("route", route)
        self._idle = _validate.required_seconds("stream_idle_timeout", stream_idle_timeout)
        self._stream = stream
        self._route = route

    def _name_route(self, vendor: str, default: str | None = None) -> None:
        """Keep ``vendor``, and the route: the ``route`` given, else ``default``
        (the vendor when None)."""
        self._vendor = vendor
        self._name = self._route if self._route is not None else default or vendor

    @property
    def client(self) -> C:
        """The SDK client requests go through (``max_retries=0``).

        For a provider built from keywords (without ``http_client``): the
        running event loop's client once it has sent, else the client the
        next asyncio loop to send will use (a trio loop builds its own).
        """
        return self._clients.current()

    def check_ready(self) -> None:
        """Before an attempt is recorded: refuse a given client on another event loop.

        Raises:
            ConfigError: the client (or ``http_client``) given to the provider
                was first used on another event loop than the running one.
        """
        self._clients.check_ready()

    @property
    def name(self) -> str:
        """The route: the vendor (`vendor`) unless ``route`` named another."""
        return self._name

    @property
    def vendor(self) -> str:
        """Whose API the requests reach; ``served_by`` and prices name it."""
        return self._vendor

    genai_operation = "chat"
    """What its requests are, as the OpenTelemetry GenAI conventions name the
    operation (`Provider.genai_operation`): ``chat``, a chat API's."""

    @property
    def streaming(self) -> bool:
        """True: a request whose caller reads the text (``on_text``) is streamed,
        whatever ``stream`` says."""
        return True

    @property
    def inference_geo(self) -> str | None:
        """None: its replies are priced at the vendor's list rates, or say
        themselves where they were served (`Provider.inference_geo`)."""
        return None

    def billing(self, model: str, features: Features) -> Billing:
        """``Billing()``: its requests are billed as their usage says
        (`Provider.billing`)."""
        return DEFAULT_BILLING

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self._name!r}, stream={self._stream})"

    async def send(self, request: ProviderRequest, *,
                   on_text: TextCallback | None = None) -> ProviderResponse:
        """Make one request within ``request.timeout``.

        It is streamed when ``on_text`` is given (the caller reads the text
        as it arrives) or the provider was built with ``stream=True``; else
        its response is read whole, as JSON.

        Raises:
            ProviderFault: the request failed; every SDK error is classified.
            ConfigError: the client given to the provider belongs to another
                event loop than the running one; nothing was sent.
        """
        client = await self._clients.get()
        stream = self._stream or on_text is not None
        params = self._params(request, stream=stream)
        if stream:
            return await self._send_streaming(client, params, on_text)
        return await self._send_plain(client, params)

    def _params(self, request: ProviderRequest, *, stream: bool) -> dict[str, Any]:
        """The SDK call's keyword arguments for ``request``, streamed or not."""
        raise NotImplementedError

    async def _send_plain(self, client: C, params: dict[str, Any]) -> ProviderResponse:
        """One request whose response is read as JSON."""
        raise NotImplementedError

    async def _send_streaming(
        self, client: C, params: dict[str, Any], on_text: TextCallback | None
    ) -> ProviderResponse:
        """One streamed request, its text deltas handed to ``on_text``."""
        raise NotImplementedError

    async def aclose(self) -> None:
        """Close the client the provider built for the running event loop.

        A provider built from keywords closes the running loop's client, and
        the one `client` gives before any loop has sent (a later request
        builds another); one built on an ``http_client`` closes that client.
        A ``client`` passed in is left open.
        """
        await self._clients.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
