"""The SDK clients a provider sends through: one per event loop.

Shared by every provider built on a Stainless-generated SDK (``anthropic``,
``openai``): their clients have the same shape (``with_options``, an async
``close``), and the same rules hold for each.

A connection belongs to the event loop that opened it. A provider built from
keywords keeps one SDK client per event loop that sends through it
(`ClientPerLoop`), and closes each as its loop shuts down, so one provider
serves consecutive ``asyncio.run`` calls (a sync web handler, a Celery task).
A client (or an ``http_client``) the caller gave is used on the first loop
that sends only (`BoundClient`); on another loop, its ``check_ready`` (and
``get``) raise `ConfigError` before anything is sent.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import inspect
import logging
import ssl
import threading
import urllib.request
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from types import TracebackType
from typing import Any, Generic, Protocol, Self, TypeVar, cast

import anyio
import anyio.lowlevel
import httpx2

from loopengine import _validate
from loopengine._errors import ConfigError
from loopengine.providers._base import ProviderRequest, ProviderResponse, TextCallback
from loopengine.providers._faults import ProviderFault

__all__ = [
    "DEFAULT_MAX_CONNECTIONS",
    "BoundClient",
    "ClientPerLoop",
    "SDKClient",
    "SDKProvider",
    "http_client",
    "provider_clients",
    "read_stream",
    "running_loop",
    "sdk_keywords",
]

logger = logging.getLogger("loopengine")


class SDKClient(Protocol):
    """What the provider needs of an SDK client it manages: a way to close it."""

    async def close(self) -> None:
        """Close the client's connections."""
        ...


C = TypeVar("C", bound=SDKClient)
E = TypeVar("E")


def _shared_tls() -> Callable[[], ssl.SSLContext]:
    """A getter of one TLS context, loaded on first use and then shared.

    The SDKs' default verification (the system's certificates) costs tens of
    milliseconds to load; it holds no connection, so every client a provider
    builds can share it.
    """
    tls: list[ssl.SSLContext] = []
    lock = threading.Lock()

    def get() -> ssl.SSLContext:
        with lock:
            if not tls:
                tls.append(httpx2.create_ssl_context())
            return tls[0]

    return get


# -- event loops: a client's connections belong to the loop that opened them ---------------


def running_loop() -> object:
    """The running event loop, as anyio sees it: the asyncio loop, or the native
    token of anyio's other backend (trio's ``TrioToken``), which is as unique
    to its run (and right for a trio run started from an asyncio loop's thread).

    Raises:
        RuntimeError: no event loop is running (anyio's ``NoEventLoopError``).
    """
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


class ClientPerLoop(Generic[C]):
    """One SDK client for each event loop that sends, closed as its loop shuts down.

    A pooled connection belongs to the event loop that opened it: on the next
    loop its socket is still open and a request written on it reaches the
    server, but reading the answer fails (``RuntimeError: Event loop is
    closed``). So each loop gets a client of its own, built from the same
    keywords, for its kind of loop (``build(True)`` for asyncio, whose client
    may use an asyncio-only transport, ``build(False)`` for trio).

    A client is closed on its own loop, as that loop shuts down: each client
    comes with an async generator started on its loop, and the loop closes
    the async generators still open when it shuts down (``asyncio.run``,
    ``asyncio.Runner``, ``trio.run`` and ``anyio.run`` all do), which runs the
    close while the loop can still run it. A loop closed without that step
    (``loop.close()`` alone) cannot run anything again: its client is dropped
    when another loop first sends, and its sockets are left to the garbage
    collector.

    Args:
        owner: The provider's name, for the log.
        build: Builds one client, for an asyncio loop (True) or another (False).
    """

    def __init__(self, owner: str, build: Callable[[bool], C]) -> None:
        self._build = build
        self._owner = owner
        self._lock = threading.Lock()
        # Built at once (for asyncio, the usual loop), so that a bad keyword
        # fails when the provider is built; the next asyncio loop that sends
        # claims it. The spare is always an asyncio loop's client.
        self._spare: C | None = build(True)
        self._clients: dict[object, tuple[C, AsyncGenerator[None, None]]] = {}

    def current(self) -> C:
        """The running loop's client if it has one, else the one the next loop
        that sends will use (a client no loop has used yet, built for asyncio)."""
        try:
            entry = self._clients.get(running_loop())
        except RuntimeError:  # no event loop is running
            entry = None
        if entry is not None:
            return entry[0]
        with self._lock:
            if self._spare is None:
                self._spare = self._build(True)
            return self._spare

    def check_ready(self) -> None:
        """Always ready: a loop that has no client yet gets one."""

    async def get(self) -> C:
        """The running loop's client, built for it on its first request."""
        loop = running_loop()
        entry = self._clients.get(loop)
        if entry is not None:
            return entry[0]
        on_asyncio = isinstance(loop, asyncio.AbstractEventLoop)
        with self._lock:
            client: C | None = None
            if on_asyncio:
                client, self._spare = self._spare, None
        if client is None:
            # No spare left, or a trio loop: the asyncio spare (which has
            # opened nothing) stays for the next asyncio loop.
            client = self._build(on_asyncio)
        closer = self._close_with_loop(loop, client)
        with self._lock:
            self._clients[loop] = (client, closer)
        self._forget_ended()
        # Its first step registers the generator with this loop; it never
        # suspends, so no other task can see the entry before it is armed.
        await closer.asend(None)
        return client

    async def aclose(self) -> None:
        """Close the running loop's client, and the spare one no loop has claimed
        (`current` hands it out, and code may have sent through it directly);
        the next request builds another."""
        with self._lock:
            entry = self._clients.pop(running_loop(), None)
            spare, self._spare = self._spare, None
        if entry is not None:
            await entry[1].aclose()
        if spare is not None:
            with anyio.CancelScope(shield=True):
                try:
                    await spare.close()
                except Exception:
                    logger.warning("could not close the %s spare client", self._owner,
                                   exc_info=True)
        self._forget_ended()

    def _forget_ended(self) -> None:
        # Clients of loops that ended without shutting down their async
        # generators: no loop can close them now, and keeping them would leak.
        with self._lock:
            for loop in [loop for loop in self._clients if _ended(loop)]:
                del self._clients[loop]

    async def _close_with_loop(self, loop: object, client: C) -> AsyncGenerator[None]:
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
                    logger.warning("could not close the %s client of an event loop "
                                   "that shut down", self._owner, exc_info=True)


class BoundClient(Generic[C]):
    """One client of the caller's making (a ``client``, or one built on the
    caller's ``http_client``), usable on the first event loop that sends
    through it only: its pooled connections belong to that loop.

    Args:
        owner: The provider's class name, for messages.
        client: The client.
        given_as: What the caller gave: ``client`` or ``http_client`` (the
            `ConfigError`'s field).
        owned: Whether `aclose` closes it (built on the caller's
            ``http_client``, not given whole).
    """

    def __init__(self, owner: str, client: C, *, given_as: str = "client",
                 owned: bool = False) -> None:
        self._owner = owner
        self._bound = client
        self._bound_as = given_as
        self._owned = owned
        self._home: Callable[[], object | None] | None = None
        self._lock = threading.Lock()

    def current(self) -> C:
        """The client."""
        return self._bound

    async def get(self) -> C:
        """The client, on the event loop it was first used on.

        Raises:
            ConfigError: the client belongs to another event loop.
        """
        return self._on_home()

    def check_ready(self) -> None:
        """Refuse the client on another event loop than its first.

        Raises:
            ConfigError: the client (or ``http_client``) given to the provider
                was first used on another event loop than the running one.
        """
        self._on_home()

    async def aclose(self) -> None:
        """Close the client if the provider built it."""
        if self._owned:
            await self._bound.close()

    def _on_home(self) -> C:
        """The bound client, if the running loop is the one it was first used on."""
        loop = running_loop()
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
        raise ConfigError(self._bound_as, f"the {self._bound_as} given to {self._owner} was "
                          f"first used on another event loop, {state}: its pooled connections "
                          "belong to that loop and cannot be used on this one, so nothing was "
                          "sent. Build the provider from keywords without an http_client (it "
                          "keeps a client per event loop), or give it a client made for this "
                          "loop")


DEFAULT_MAX_CONNECTIONS = 1000
"""The connections a provider's own client opens at most (the SDKs' own limit).

Over HTTP/1.1 a request in flight holds a connection of its own: beyond this
many at once, requests wait in the pool (the wait counts against the attempt's
timeout). A process serving more conversations at once raises it (and its
open-file limit with it)."""


def _max_connections(value: int | None, client: object | None,
                    client_kwargs: dict[str, Any]) -> int:
    """A provider's ``max_connections``: the default when not given.

    Raises:
        ConfigError: not a positive integer, or given with a ``client`` or an
            ``http_client`` (whose pool is the caller's).
    """
    if value is None:
        return DEFAULT_MAX_CONNECTIONS
    _validate.integer("max_connections", value, minimum=1)
    if client is not None or client_kwargs.get("http_client") is not None:
        given = "client" if client is not None else "http_client"
        raise ConfigError("max_connections", f"applies to the client the provider builds; "
                                             f"the {given} given brings its own connection pool")
    return value


@functools.cache
def _aiohttp_installed() -> bool:
    """Whether ``aiohttp`` (a dependency, installed unless told otherwise) is there."""
    return importlib.util.find_spec("aiohttp") is not None


def _proxy_configured() -> bool:
    """Whether the environment sends http(s) through a proxy, as httpx2 reads it."""
    proxies = urllib.request.getproxies()
    return any(proxies.get(scheme) for scheme in ("http", "https", "all"))


def http_client(verify: ssl.SSLContext, connections: int, *, on_asyncio: bool,
                sdk_default: Callable[..., httpx2.AsyncClient]) -> httpx2.AsyncClient:
    """The HTTP client a provider builds for one event loop.

    On asyncio, the ``anthropic`` SDK's aiohttp client (``DefaultAioHttpClient``,
    an ``httpx2`` client, which the ``openai`` SDK takes as well): the cheapest
    per turn of the transports measured (docs/performance.md). It is the
    ``anthropic`` one for both SDKs because the ``openai`` SDK's copy of that
    transport maps every aiohttp connection error to a connect *timeout* (a
    refused or reset connection would be classified ``timeout``), where the
    ``anthropic`` copy maps them to ``httpx2.ConnectError``. On another loop
    (trio, which aiohttp does not run on), without ``aiohttp`` installed, or
    where the environment configures a proxy (which aiohttp is not given),
    the SDK's default httpx client (its timeout, redirects, TCP keep-alive).
    Either opens up to ``connections`` connections and keeps them alive
    between requests, so a conversation's next turn reuses one.
    """
    limits = httpx2.Limits(max_connections=connections, max_keepalive_connections=connections)
    if on_asyncio and _aiohttp_installed() and not _proxy_configured():
        import anthropic

        aiohttp_client: httpx2.AsyncClient = anthropic.DefaultAioHttpClient(
            verify=verify, limits=limits)
        return aiohttp_client
    return sdk_default(verify=verify, limits=limits)


async def read_stream(
    events: AsyncIterator[E],
    *,
    idle: float,
    failures: tuple[type[BaseException], ...],
    failed: Callable[[BaseException], ProviderFault],
    cut: Callable[[str, str | None], ProviderFault],
    take: Callable[[E], str | None],
    on_text: TextCallback | None,
    close: Callable[[], Awaitable[None]],
) -> None:
    """Read a streamed reply to its end, the same way for every SDK provider.

    Each event goes to ``take``, which returns its text, if any, for
    ``on_text``. A stream quiet for ``idle`` seconds is cut (``cut(message,
    "idle")``); an error among ``failures`` while reading is classified by
    ``failed``; an ``on_text`` that raises stops the reading with
    ``cut(message, None)`` raised from its exception (the engine raises the
    callback's own exception to its caller; the fault carries what was
    served). ``close`` runs however the reading ends: it releases the
    connection, even while the caller's cancellation (or the attempt
    timeout) unwinds.
    """
    try:
        while True:
            with anyio.move_on_after(idle) as quiet:
                try:
                    event = await events.__anext__()
                except StopAsyncIteration:
                    return
                except failures as error:
                    raise failed(error) from error
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
    finally:
        with anyio.CancelScope(shield=True):
            await close()


def sdk_keywords(client: object | None, client_kwargs: dict[str, Any]) -> None:
    """Check a provider's client keywords, in place: ``max_retries`` may only be
    0 (and is dropped: the provider always sets it), and a ``client`` comes
    without keywords.

    Raises:
        ConfigError: ``max_retries`` other than 0, or both a client and keywords.
    """
    if client_kwargs.get("max_retries", 0) != 0:
        raise ConfigError("max_retries", "the SDK must not retry on its own: every wire "
                                         "request is an attempt the engine counts; set the "
                                         "operation's RetryPolicy instead")
    client_kwargs.pop("max_retries", None)
    if client is not None and client_kwargs:
        raise ConfigError("client", "give a client or the keywords to build one, not "
                                    f"both (got {', '.join(sorted(client_kwargs))})")


def provider_clients(
    owner: str,
    client: C | None,
    client_kwargs: dict[str, Any],
    *,
    max_connections: int | None,
    accepts: type[Any] | tuple[type[Any], ...],
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
        client_kwargs: The keywords to build one (checked by `sdk_keywords`).
        max_connections: The provider's ``max_connections``.
        accepts: The SDK client classes ``client`` may be.
        build: The SDK client class to build from the keywords.
        sdk_default: The SDK's default httpx client class.

    Raises:
        ConfigError: a bad ``max_connections``, ``max_retries`` other than 0,
            both a client and keywords, or a client that is not ``accepts``.
    """
    connections = _max_connections(max_connections, client, client_kwargs)
    sdk_keywords(client, client_kwargs)
    if client is not None:
        if not isinstance(client, accepts):
            names = " or ".join(kind.__name__ for kind in (
                accepts if isinstance(accepts, tuple) else (accepts,)))
            raise ConfigError("client", f"must be an async SDK client ({names}), got "
                                        f"{type(client).__name__}")
        copy: C = cast(Any, client).with_options(max_retries=0)
        return BoundClient(owner, copy)
    if client_kwargs.get("http_client") is not None:
        return BoundClient(owner, build(max_retries=0, **client_kwargs),
                           given_as="http_client", owned=True)
    client_kwargs.pop("http_client", None)
    tls = _shared_tls()

    def per_loop(on_asyncio: bool) -> C:
        return build(max_retries=0, http_client=http_client(
            tls(), connections, on_asyncio=on_asyncio, sdk_default=sdk_default),
            **client_kwargs)

    return ClientPerLoop(owner, per_loop)


class SDKProvider(Generic[C]):
    """What every provider on a managed SDK client shares: the client of the
    running event loop, the check before an attempt is recorded, and closing.

    A subclass sets ``_clients``, ``_name``, ``_vendor`` and ``_stream`` in
    its ``__init__``, declares its ``features``, and supplies ``_params``,
    ``_send_plain`` and ``_send_streaming``: `send` is the same for every
    such provider (the running loop's client, then the request).
    """

    _clients: ClientPerLoop[C] | BoundClient[C]
    _name: str
    _vendor: str
    _stream: bool

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

    @property
    def streaming(self) -> bool:
        """Whether responses are streamed, their text handed to ``on_text``."""
        return self._stream

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self._name!r}, stream={self._stream})"

    async def send(self, request: ProviderRequest, *,
                   on_text: TextCallback | None = None) -> ProviderResponse:
        """Make one request within ``request.timeout``.

        Raises:
            ProviderFault: the request failed; every SDK error is classified.
            ConfigError: the client given to the provider belongs to another
                event loop than the running one; nothing was sent.
        """
        client = await self._clients.get()
        params = self._params(request)
        if self._stream:
            return await self._send_streaming(client, params, on_text)
        return await self._send_plain(client, params)

    def _params(self, request: ProviderRequest) -> dict[str, Any]:
        """The SDK call's keyword arguments for ``request``."""
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
