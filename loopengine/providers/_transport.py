"""An HTTP/1.1 transport whose connection pool does O(1) work per request.

The SDKs (``anthropic``, ``openai``) send through ``httpx2.AsyncHTTPTransport``,
whose ``httpcore2.AsyncConnectionPool`` re-plans the whole pool every time a
request arrives or a response closes: ``_assign_requests_to_connections``
walks every connection (closed? expired? idle?) and every queued request (the
set of reserved connections, then the queue). With a thousand conversations in
flight in one process, the CPU spent per request grows with the number in
flight (quadratic in all), and the event loop stalls for seconds at a time.

`FlatPool` keeps the same state in structures that need no walk:

* a stack of idle connections per origin (the most recently used on top), so
  a request reuses a warm connection in O(1); the oldest idle connection of
  any origin is at the front of one ordered map, so an expired one is swept
  and a full pool can give up an idle connection to another origin in O(1);
* a count of open connections against ``max_connections``;
* a FIFO queue of waiters, each woken by a hand-off: a response that closes
  gives its connection (or its slot, if the connection cannot be reused)
  straight to the first waiter, so no other request can overtake it; a waiter
  cancelled or timed out once handed something passes it on, and one that
  gives up before stays queued, marked, until it reaches the front.

What it keeps of httpcore's pool: ``max_connections``,
``max_keepalive_connections``, ``keepalive_expiry`` (and dropping an idle
connection the server has closed), the ``pool`` timeout (raising
``httpcore2.PoolTimeout``), connection retries, ``local_address``, ``uds``,
socket options. `PooledTransport` is ``httpx2.AsyncHTTPTransport`` with only
its pool replaced, so the request and response mapping and the exceptions (all
mapped to ``httpx2``'s by ``map_httpcore_exceptions``) are httpx2's own.

What it does not do: HTTP/2 and proxies. `PooledTransport` refuses both, and
`flat_http_client` returns None when the environment configures a proxy, so a
caller falls back to the SDK's default client, which handles both.

A pool belongs to one event loop (it runs on asyncio or trio, through anyio);
like httpcore's async pool, it takes no thread lock.
"""

from __future__ import annotations

import socket
import ssl
import sys
import types
import urllib.request
from collections import OrderedDict, deque
from collections.abc import AsyncGenerator, AsyncIterable, Iterable
from contextlib import aclosing
from typing import Self

import anyio
import anyio.lowlevel
import httpcore2
import httpx2

__all__ = ["SDK_LIMITS", "SDK_TIMEOUT", "FlatPool", "PooledTransport", "flat_http_client",
           "proxy_configured"]

_Key = tuple[bytes, bytes, int]
"""An origin as a dict key: ``httpcore2.Origin`` defines ``__eq__`` without ``__hash__``."""

_HTTPX_DEFAULT_LIMITS = httpx2.Limits(max_connections=100, max_keepalive_connections=20)
"""``httpx2.AsyncHTTPTransport``'s default limits."""

SDK_TIMEOUT = httpx2.Timeout(timeout=600, connect=5.0)
"""The SDKs' default timeout (``anthropic`` and ``openai`` alike)."""

SDK_LIMITS = httpx2.Limits(max_connections=1000, max_keepalive_connections=100)
"""The SDKs' default connection limits (``anthropic`` and ``openai`` alike)."""


def _key(origin: httpcore2.Origin) -> _Key:
    return (origin.scheme, origin.host, origin.port)


class _Waiter:
    """A request waiting for a connection: granted either an idle connection of its
    origin or a slot to open one in."""

    __slots__ = ("abandoned", "connection", "event", "granted", "key")

    def __init__(self, key: _Key) -> None:
        self.key = key
        self.event = anyio.Event()
        self.granted = False
        self.connection: httpcore2.AsyncConnectionInterface | None = None
        self.abandoned = False

    def grant(self, connection: httpcore2.AsyncConnectionInterface | None) -> None:
        self.granted = True
        self.connection = connection
        self.event.set()


class FlatPool:
    """An HTTP/1.1 connection pool whose bookkeeping is O(1) per request.

    It offers what ``httpx2.AsyncHTTPTransport`` calls on its pool
    (`handle_async_request`, `aclose`, ``async with``) with the semantics of
    ``httpcore2.AsyncConnectionPool`` for HTTP/1.1 without a proxy; see the
    module docstring for how it differs inside.

    Args:
        ssl_context: The TLS context for ``https`` origins; httpcore's
            default context when None.
        max_connections: The most connections open at once (None: no limit).
            A request that finds none free waits, first come first served.
        max_keepalive_connections: The most idle connections kept open (None:
            as many as ``max_connections``).
        keepalive_expiry: Seconds an idle connection is kept (None: no expiry).
        retries: Retries of a failed connect, as httpcore's.
        local_address: The local address to connect from.
        uds: A Unix domain socket to connect to instead of TCP.
        socket_options: Options set on each new socket.
        network_backend: The network backend; httpcore's automatic one (asyncio
            or trio) when None.

    Raises:
        ValueError: ``max_connections`` below 1 or ``max_keepalive_connections``
            below 0.
    """

    def __init__(
        self,
        ssl_context: ssl.SSLContext | None = None,
        max_connections: int | None = 10,
        max_keepalive_connections: int | None = None,
        keepalive_expiry: float | None = None,
        retries: int = 0,
        local_address: str | None = None,
        uds: str | None = None,
        socket_options: Iterable[httpcore2.SOCKET_OPTION] | None = None,
        network_backend: httpcore2.AsyncNetworkBackend | None = None,
    ) -> None:
        if max_connections is not None and max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections=}")
        if max_keepalive_connections is not None and max_keepalive_connections < 0:
            raise ValueError("max_keepalive_connections must not be negative, got "
                             f"{max_keepalive_connections=}")
        self._ssl_context = ssl_context
        self._max_connections = sys.maxsize if max_connections is None else max_connections
        self._max_keepalive = min(self._max_connections, sys.maxsize
                                  if max_keepalive_connections is None
                                  else max_keepalive_connections)
        self._keepalive_expiry = keepalive_expiry
        self._retries = retries
        self._local_address = local_address
        self._uds = uds
        self._socket_options = None if socket_options is None else list(socket_options)
        self._network_backend = network_backend

        # Every connection the pool answers for (idle, busy or connecting), by origin.
        self._origins: dict[httpcore2.AsyncConnectionInterface, _Key] = {}
        # Slots in use: the connections above plus slots granted to waiters that
        # have not opened their connection yet. Never more than max_connections.
        self._slots = 0
        # Idle connections: a stack per origin (top = most recently used), and
        # all of them oldest first, for the expiry sweep and for eviction.
        self._idle: dict[_Key, OrderedDict[httpcore2.AsyncConnectionInterface, None]] = {}
        self._idle_by_age: OrderedDict[httpcore2.AsyncConnectionInterface, None] = OrderedDict()
        # Requests waiting for a slot, first come first served. A waiter that
        # gives up stays queued, marked, until it reaches the front (or the
        # queue is compacted): removing it from the middle would be O(n).
        self._waiters: deque[_Waiter] = deque()
        self._abandoned = 0

    # -- introspection -----------------------------------------------------------------

    @property
    def max_connections(self) -> int:
        """The most connections open at once (``sys.maxsize``: no limit)."""
        return self._max_connections

    @property
    def max_keepalive_connections(self) -> int:
        """The most idle connections kept open."""
        return self._max_keepalive

    @property
    def connections(self) -> list[httpcore2.AsyncConnectionInterface]:
        """The connections the pool holds (idle, busy or connecting); a copy."""
        return list(self._origins)

    @property
    def idle_count(self) -> int:
        """How many connections are idle, kept for reuse."""
        return len(self._idle_by_age)

    @property
    def waiting_count(self) -> int:
        """How many requests are waiting for a connection."""
        return len(self._waiters) - self._abandoned

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} [{len(self._origins)} connections, "
                f"{self.idle_count} idle, {self.waiting_count} waiting]>")

    # -- the pool's interface ----------------------------------------------------------

    def create_connection(self, origin: httpcore2.Origin) -> httpcore2.AsyncConnectionInterface:
        """A new, unconnected HTTP/1.1 connection to ``origin`` (it connects on its
        first request)."""
        return httpcore2.AsyncHTTPConnection(
            origin=origin,
            ssl_context=self._ssl_context,
            keepalive_expiry=self._keepalive_expiry,
            http1=True,
            http2=False,
            retries=self._retries,
            local_address=self._local_address,
            uds=self._uds,
            network_backend=self._network_backend,
            socket_options=self._socket_options,
        )

    async def handle_async_request(self, request: httpcore2.Request) -> httpcore2.Response:
        """Send ``request`` on a pooled connection and return its response.

        The connection goes back to the pool when the response's stream is
        closed or read to its end.

        Raises:
            httpcore2.UnsupportedProtocol: the URL's scheme is not http(s) or ws(s).
            httpcore2.PoolTimeout: no connection came free within the request's
                ``pool`` timeout.
        """
        scheme = request.url.scheme.decode()
        if scheme == "":
            raise httpcore2.UnsupportedProtocol(
                "Request URL is missing an 'http://' or 'https://' protocol.")
        if scheme not in ("http", "https", "ws", "wss"):
            raise httpcore2.UnsupportedProtocol(
                f"Request URL has an unsupported protocol '{scheme}://'.")
        origin = request.url.origin
        key = _key(origin)
        pool_timeout = request.extensions.get("timeout", {}).get("pool", None)

        while True:
            connection = await self._acquire(key, origin, pool_timeout)
            try:
                response = await connection.handle_async_request(request)
            except httpcore2.ConnectionNotAvailable:
                # It went unusable between being chosen and being sent on.
                await self._discard(connection)
                continue
            except BaseException:
                await self._release(connection)
                raise
            break

        assert isinstance(response.stream, AsyncIterable)
        return httpcore2.Response(
            status=response.status,
            headers=response.headers,
            content=_PooledStream(response.stream, self, connection),
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        """Close every connection, idle or busy (a response still being read on one
        fails). Waiting requests are given the freed slots; the pool stays usable."""
        closing = list(self._origins)
        self._origins.clear()
        self._idle.clear()
        self._idle_by_age.clear()
        for _ in closing:
            self._free_slot()
        await self._close(closing)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None = None,
        exc_value: BaseException | None = None,
        traceback: types.TracebackType | None = None,
    ) -> None:
        await self.aclose()

    # -- acquiring ---------------------------------------------------------------------

    async def _acquire(self, key: _Key, origin: httpcore2.Origin,
                       pool_timeout: float | None) -> httpcore2.AsyncConnectionInterface:
        """A connection to send on: an idle one of the origin, a new one, or, the
        pool being full, the one a closing response hands over."""
        closing: list[httpcore2.AsyncConnectionInterface] = []
        connection = self._take(key, origin, closing)
        if closing:
            try:
                await self._close(closing)
            except BaseException:
                if connection is not None:
                    await self._release(connection)
                raise
        if connection is not None:
            return connection
        return await self._wait(key, origin, pool_timeout)

    def _take(self, key: _Key, origin: httpcore2.Origin,
              closing: list[httpcore2.AsyncConnectionInterface],
              ) -> httpcore2.AsyncConnectionInterface | None:
        """Without waiting: an idle connection of the origin, or a new one if a
        slot is free (or an idle connection of another origin can give up its
        slot); None if the pool is full. Connections to close go to ``closing``."""
        self._sweep(closing)
        stack = self._idle.get(key)
        found = None
        while stack:
            connection, _ = stack.popitem()
            del self._idle_by_age[connection]
            if connection.is_closed():
                self._drop(connection)
            elif connection.has_expired() or not connection.is_idle():
                self._drop(connection)
                closing.append(connection)
            else:
                found = connection
                break
        if stack is not None and not stack:
            del self._idle[key]
        if found is not None:
            # Dropping dead connections above may have freed slots.
            self._grant_free_slots()
            return found
        if self._slots < self._max_connections:
            self._slots += 1
            return self._open(key, origin)
        if self._idle_by_age:
            # Full of idle connections to other origins: the oldest gives way.
            oldest, _ = self._idle_by_age.popitem(last=False)
            self._unstack(oldest)
            self._origins.pop(oldest, None)
            closing.append(oldest)
            return self._open(key, origin)
        return None

    async def _wait(self, key: _Key, origin: httpcore2.Origin,
                    pool_timeout: float | None) -> httpcore2.AsyncConnectionInterface:
        """Queue for the next connection (or slot) a closing response hands over."""
        waiter = _Waiter(key)
        self._waiters.append(waiter)
        try:
            with anyio.move_on_after(pool_timeout):
                await waiter.event.wait()
            # A waiter cancelled as it was woken gives the connection on intact:
            # cancelled inside the connection's first write, it would close it.
            await anyio.lowlevel.checkpoint_if_cancelled()
        except BaseException:
            await self._abandon(waiter)
            raise
        if not waiter.granted:
            await self._abandon(waiter)
            raise httpcore2.PoolTimeout("timed out waiting for a connection from the pool")
        if waiter.connection is not None:
            return waiter.connection
        return self._open(key, origin)

    async def _abandon(self, waiter: _Waiter) -> None:
        """A waiter gives up: whatever it was granted goes to the next one."""
        if waiter.granted:
            if waiter.connection is not None:
                await self._release(waiter.connection)
            else:
                self._free_slot()
        elif not waiter.abandoned:
            waiter.abandoned = True
            self._abandoned += 1
            if self._abandoned > 64 and 2 * self._abandoned > len(self._waiters):
                # Keeps the queue from filling with the dead when nothing is
                # released for a while; amortised O(1) per abandoned waiter.
                self._waiters = deque(w for w in self._waiters if not w.abandoned)
                self._abandoned = 0

    def _next_waiter(self) -> _Waiter | None:
        """The first waiter still waiting, taken off the queue."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.abandoned:
                return waiter
            self._abandoned -= 1
        return None

    # -- releasing ---------------------------------------------------------------------

    async def _release(self, connection: httpcore2.AsyncConnectionInterface) -> None:
        """Take back a connection a request is done with: to the first waiter, onto
        its origin's stack, or closed (its slot to the first waiter)."""
        closing: list[httpcore2.AsyncConnectionInterface] = []
        key = self._origins.get(connection)
        if key is None:
            # The pool was closed while the connection was busy.
            if not connection.is_closed():
                closing.append(connection)
        elif connection.is_closed():
            self._forget(connection)
        elif not connection.is_idle() or connection.has_expired():
            self._forget(connection)
            closing.append(connection)
        else:
            waiter = self._next_waiter()
            if waiter is not None and waiter.key == key:
                waiter.grant(connection)
            elif waiter is not None:
                # Its slot passes to a waiter for another origin.
                del self._origins[connection]
                waiter.grant(None)
                closing.append(connection)
            elif len(self._idle_by_age) < self._max_keepalive:
                self._idle.setdefault(key, OrderedDict())[connection] = None
                self._idle_by_age[connection] = None
            else:
                self._forget(connection)
                closing.append(connection)
        self._sweep(closing)
        await self._close(closing)

    async def _discard(self, connection: httpcore2.AsyncConnectionInterface) -> None:
        """Close a connection and give its slot away."""
        self._forget(connection)
        await self._close([connection])

    # -- bookkeeping (no awaits: each step is atomic on the event loop) ----------------

    def _open(self, key: _Key, origin: httpcore2.Origin) -> httpcore2.AsyncConnectionInterface:
        """A new connection in a slot already counted."""
        connection = self.create_connection(origin)
        self._origins[connection] = key
        return connection

    def _drop(self, connection: httpcore2.AsyncConnectionInterface) -> None:
        """Forget a connection and free its slot without handing it on."""
        if self._origins.pop(connection, None) is not None:
            self._slots -= 1

    def _forget(self, connection: httpcore2.AsyncConnectionInterface) -> None:
        """Forget a connection; its slot goes to the first waiter, if any."""
        if self._origins.pop(connection, None) is not None:
            self._free_slot()

    def _free_slot(self) -> None:
        waiter = self._next_waiter()
        if waiter is not None:
            waiter.grant(None)
        else:
            self._slots -= 1

    def _grant_free_slots(self) -> None:
        while self._slots < self._max_connections:
            waiter = self._next_waiter()
            if waiter is None:
                return
            self._slots += 1
            waiter.grant(None)

    def _unstack(self, connection: httpcore2.AsyncConnectionInterface) -> None:
        """Take an idle connection off its origin's stack."""
        key = self._origins[connection]
        stack = self._idle[key]
        del stack[connection]
        if not stack:
            del self._idle[key]

    def _sweep(self, closing: list[httpcore2.AsyncConnectionInterface]) -> None:
        """Retire idle connections from the oldest while they have expired.

        Each connection is swept once at most, so this is amortised O(1); it
        keeps connections at the bottom of a stack from outliving their expiry
        (httpcore's walk does the same for every connection, every time)."""
        while self._idle_by_age:
            oldest = next(iter(self._idle_by_age))
            if not (oldest.is_closed() or oldest.has_expired()):
                return
            del self._idle_by_age[oldest]
            self._unstack(oldest)
            if not oldest.is_closed():
                closing.append(oldest)
            self._forget(oldest)

    @staticmethod
    async def _close(connections: list[httpcore2.AsyncConnectionInterface]) -> None:
        # A connection taken out of the pool is closed even if the task is
        # being cancelled: the pool has already stopped counting it.
        with anyio.CancelScope(shield=True):
            for connection in connections:
                await connection.aclose()


class _PooledStream:
    """A response body that hands its connection back to the pool once it is
    closed, read to its end, or abandoned by an error or a cancellation."""

    def __init__(self, stream: AsyncIterable[bytes], pool: FlatPool,
                 connection: httpcore2.AsyncConnectionInterface) -> None:
        self._stream = stream
        self._pool = pool
        self._connection = connection
        self._closed = False

    async def __aiter__(self) -> AsyncGenerator[bytes]:
        try:
            iterator = aiter(self._stream)
            if isinstance(iterator, AsyncGenerator):
                async with aclosing(iterator) as chunks:
                    async for chunk in chunks:
                        yield chunk
            else:
                async for chunk in iterator:
                    yield chunk
        except BaseException:
            await self.aclose()
            raise
        await self.aclose()

    async def aclose(self) -> None:
        """Close the body (the connection is reusable only if it was read to the
        end) and give the connection back."""
        if self._closed:
            return
        self._closed = True
        try:
            close = getattr(self._stream, "aclose", None)
            if close is not None:
                with anyio.CancelScope(shield=True):
                    await close()
        finally:
            await self._pool._release(self._connection)


class PooledTransport(httpx2.AsyncHTTPTransport):
    """``httpx2.AsyncHTTPTransport`` sending through a `FlatPool`.

    Takes ``httpx2.AsyncHTTPTransport``'s keyword arguments; everything but
    the pool (request and response mapping, exception mapping) is httpx2's.

    Args:
        verify: An ``ssl.SSLContext``, or True (the system's certificates),
            False (no verification), or a CA bundle path, as httpx2's.
        cert: A client certificate (deprecated by httpx2 in favour of
            ``verify=<context>``).
        trust_env: Whether httpx2 may read TLS settings from the environment
            (``SSL_CERT_FILE``, ``SSL_CERT_DIR``).
        http1: Must be True.
        http2: Must be False.
        limits: ``max_connections``, ``max_keepalive_connections``,
            ``keepalive_expiry``.
        proxy: Must be None.
        uds: A Unix domain socket to connect to instead of TCP.
        local_address: The local address to connect from.
        retries: Retries of a failed connect.
        socket_options: Options set on each new socket.

    Raises:
        ValueError: HTTP/2, no HTTP/1.1, or a proxy was asked for: use
            ``httpx2.AsyncHTTPTransport`` for those.
    """

    def __init__(
        self,
        verify: ssl.SSLContext | str | bool = True,
        cert: str | tuple[str, str] | tuple[str, str, str] | None = None,
        trust_env: bool = True,
        http1: bool = True,
        http2: bool = False,
        limits: httpx2.Limits = _HTTPX_DEFAULT_LIMITS,
        proxy: httpx2.Proxy | httpx2.URL | str | None = None,
        uds: str | None = None,
        local_address: str | None = None,
        retries: int = 0,
        socket_options: Iterable[httpcore2.SOCKET_OPTION] | None = None,
    ) -> None:
        if http2 or not http1:
            raise ValueError(f"PooledTransport speaks HTTP/1.1 only, got {http1=}, {http2=}")
        if proxy is not None:
            raise ValueError(f"PooledTransport does not go through a proxy, got {proxy=}")
        # Built once here and handed to httpx2 as a context, so that its own
        # (unused) pool does not load the certificates a second time.
        ssl_context = httpx2.create_ssl_context(verify=verify, cert=cert, trust_env=trust_env)
        options = None if socket_options is None else list(socket_options)
        super().__init__(verify=ssl_context, trust_env=trust_env, limits=limits, uds=uds,
                         local_address=local_address, retries=retries, socket_options=options)
        self._flat_pool = FlatPool(
            ssl_context=ssl_context,
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            retries=retries,
            local_address=local_address,
            uds=uds,
            socket_options=options,
        )
        # httpx2 declares its pool as httpcore2.AsyncConnectionPool but calls
        # only handle_async_request, aclose, __aenter__ and __aexit__ on it.
        self._pool = self._flat_pool  # type: ignore[assignment]

    @property
    def pool(self) -> FlatPool:
        """The connection pool requests go through."""
        return self._flat_pool


def _tcp_keepalive() -> list[httpcore2.SOCKET_OPTION]:
    """The TCP keep-alive options the SDKs' default clients set on their sockets."""
    options: list[httpcore2.SOCKET_OPTION] = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    interval = getattr(socket, "TCP_KEEPINTVL", None)
    if interval is not None:
        options.append((socket.IPPROTO_TCP, interval, 60))
    elif sys.platform == "darwin":
        options.append((socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPALIVE", 0x10), 60))
    count = getattr(socket, "TCP_KEEPCNT", None)
    if count is not None:
        options.append((socket.IPPROTO_TCP, count, 5))
    idle = getattr(socket, "TCP_KEEPIDLE", None)
    if idle is not None:
        options.append((socket.IPPROTO_TCP, idle, 60))
    return options


def proxy_configured() -> bool:
    """Whether the environment sends http(s) through a proxy, as httpx2 reads it."""
    proxies = urllib.request.getproxies()
    return any(proxies.get(scheme) for scheme in ("http", "https", "all"))


def flat_http_client(
    verify: ssl.SSLContext,
    *,
    timeout: httpx2.Timeout = SDK_TIMEOUT,
    limits: httpx2.Limits = SDK_LIMITS,
) -> httpx2.AsyncClient | None:
    """An SDK's default async HTTP client, sending through a `PooledTransport`.

    What ``anthropic.DefaultAsyncHttpxClient`` builds (the SDK's timeout and
    limits, redirects followed, TCP keep-alive on every socket), with the flat
    pool in place of httpcore's. Give it to ``anthropic.AsyncAnthropic`` or
    ``openai.AsyncOpenAI`` as ``http_client``.

    Args:
        verify: The TLS context connections verify with (shared across clients
            is fine: it holds no connection).
        timeout: The client's default timeout; the SDK's by default.
        limits: The pool's limits; the SDK's by default.

    Returns:
        The client, or None when the environment configures a proxy
        (``HTTP_PROXY``, ``HTTPS_PROXY``, ``ALL_PROXY``, or the platform's
        settings): the transport does not speak to proxies, so the caller
        should build the SDK's default client instead.
    """
    if proxy_configured():
        return None
    transport = PooledTransport(verify=verify, limits=limits, socket_options=_tcp_keepalive())
    return httpx2.AsyncClient(transport=transport, timeout=timeout, follow_redirects=True)
