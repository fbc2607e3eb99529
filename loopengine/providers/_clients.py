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
import datetime
import functools
import importlib
import importlib.util
import inspect
import logging
import ssl
import threading
import urllib.request
import weakref
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import Any, Generic, Protocol, TypeVar

import anyio
import anyio.lowlevel
import httpx2

from loopengine import _validate
from loopengine._clock import asyncio_loop
from loopengine._errors import ConfigError

__all__ = [
    "DEFAULT_MAX_CONNECTIONS",
    "BoundClient",
    "C",
    "ClientPerLoop",
    "SDKClient",
    "client_or_keywords",
    "client_keywords",
    "connection_limit",
    "http_client",
    "running_loop",
    "shared_tls",
]

logger = logging.getLogger("loopengine")


class SDKClient(Protocol):
    """What the provider needs of an SDK client it manages: a way to close it."""

    async def close(self) -> None:
        """Close the client's connections."""
        ...


C = TypeVar("C", bound=SDKClient)


def shared_tls() -> Callable[[], ssl.SSLContext]:
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
    loop = asyncio_loop()
    return loop if loop is not None else anyio.lowlevel.current_token().native_token


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
            await _close(spare, f"{self._owner} spare client")
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
            await _close(client, f"{self._owner} client of an event loop that shut down")


async def _close(client: SDKClient, what: str) -> None:
    """Close ``client`` (``what``, for the log), even while a cancellation unwinds;
    a failure to close is logged, not raised."""
    # trio cancels async work while it finalises async generators;
    # closing sockets is exactly the work that must still happen.
    with anyio.CancelScope(shield=True):
        try:
            await client.close()
        except Exception:
            logger.warning("could not close the %s", what, exc_info=True)


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


def connection_limit(value: int | None, client: object | None,
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


def client_or_keywords(client: object | None, client_kwargs: Mapping[str, Any]) -> None:
    """Refuse a ``client`` given with keywords to build one.

    Raises:
        ConfigError: ``.field`` ``client``: both a client and keywords.
    """
    if client is not None and client_kwargs:
        raise ConfigError("client", "give a client or the keywords to build one, not "
                                    f"both (got {', '.join(sorted(client_kwargs))})")


def client_keywords(build: Callable[..., object], client_kwargs: Mapping[str, Any]) -> None:
    """Check the keywords a provider builds its SDK client from, before the SDK
    sees them: each must be a keyword of ``build`` (the SDK client class), and
    the ones every SDK client shares must be of their type.

    Checked: ``api_key`` and ``auth_token`` (a non-empty string, or None to
    read the environment; ``api_key`` also a callable where the SDK takes one),
    ``base_url`` (a non-empty string or an ``httpx2.URL``, or None),
    ``http_client`` (an ``httpx2.AsyncClient``, or None), ``timeout`` (seconds,
    an ``httpx2.Timeout``, or None) and ``default_headers`` / ``default_query``
    (mappings with string keys; header values strings, query values what the
    SDK's query string takes: `_mapping_values`). The SDK checks the rest when
    it builds.

    Raises:
        ConfigError: a keyword ``build`` does not take, or one of the above of
            another type; ``.field`` is the keyword. The SDK would raise its own
            TypeError or AttributeError, or, for some, fail the first request.
    """
    parameters = _keywords_of(build)
    for key, value in client_kwargs.items():
        if key not in parameters:
            known = ", ".join(sorted(name for name in parameters if not name.startswith("_")))
            raise ConfigError(key, f"is not a keyword of {_name_of(build)} (known: {known})")
        if value is None:
            continue
        if key in ("api_key", "auth_token"):
            if key == "api_key" and callable(value) and \
                    "Callable" in str(parameters[key].annotation):
                continue
            _validate.text(key, value)
        elif key == "base_url":
            if isinstance(value, httpx2.URL):
                continue
            _validate.text(key, value)
        elif key == "http_client":
            if not isinstance(value, httpx2.AsyncClient):
                raise ConfigError(key, "must be an httpx2.AsyncClient (the SDK's async "
                                       f"HTTP client), got {_validate.shown(value)}")
        elif key == "timeout":
            if not isinstance(value, httpx2.Timeout):
                _validate.seconds(key, value)
        elif key in ("default_headers", "default_query"):
            if not isinstance(value, Mapping) or not all(isinstance(name, str)
                                                         for name in value):
                raise ConfigError(key, "must be a mapping with string keys, got "
                                       f"{_validate.shown(value)}")
            _mapping_values(build, key, value)


def _mapping_values(build: Callable[..., object], key: str, value: Mapping[str, Any]) -> None:
    """Check the values of ``default_headers`` (strings, or the SDK's ``Omit()``,
    which removes a header the client would send) or ``default_query`` (what
    the SDK writes into a query string: strings, numbers, booleans, None
    (left out), dates, and lists, tuples and string-keyed mappings of them).
    Anything else the SDK would fail on at each request (a header that is not
    a string), or send as its ``repr`` (a query value it does not know).

    Raises:
        ConfigError: ``.field`` ``key``; the message names the entry.
    """
    if key == "default_headers":
        omit = getattr(importlib.import_module(build.__module__.partition(".")[0]), "Omit", None)
        for name, header in value.items():
            if not isinstance(header, str) and not (omit is not None and isinstance(header, omit)):
                raise ConfigError(key, f"header {name!r} must be a string (or the SDK's "
                                       f"Omit() to remove it), got {_validate.shown(header)}")
        return
    for name, item in value.items():
        if not _query_value(item):
            raise ConfigError(key, f"parameter {name!r} must be a string, a number, a "
                                   "boolean, None, a date, or a list or string-keyed mapping "
                                   f"of those, got {_validate.shown(item)}")


def _query_value(value: object, depth: int = 0) -> bool:
    """True when the SDK's query string writes ``value`` as a value (nested no
    deeper than any query needs: a list that holds itself is refused, not a
    RecursionError)."""
    if value is None or isinstance(value, str | int | float | datetime.date):
        return True
    if depth >= 16:
        return False
    if isinstance(value, list | tuple):
        return all(_query_value(item, depth + 1) for item in value)
    if isinstance(value, Mapping):
        return all(isinstance(name, str) and _query_value(item, depth + 1)
                   for name, item in value.items())
    return False


@functools.cache
def _keywords_of(build: Callable[..., object]) -> Mapping[str, inspect.Parameter]:
    """The keyword parameters of an SDK client class (its ``__init__``'s)."""
    return {name: parameter for name, parameter in inspect.signature(build).parameters.items()
            if parameter.kind in (inspect.Parameter.KEYWORD_ONLY,
                                  inspect.Parameter.POSITIONAL_OR_KEYWORD)}


def _name_of(build: Callable[..., object]) -> str:
    return getattr(build, "__qualname__", None) or type(build).__name__


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
