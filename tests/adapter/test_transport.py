"""PooledTransport and its FlatPool: httpcore's pool semantics at O(1) work per request.

Every test sends over real sockets to a loopback HTTP/1.1 keep-alive server
that counts the connections it accepts and holds open, through
``httpx2.AsyncClient`` or the real ``anthropic`` SDK, on asyncio and on trio.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import AsyncIterable, Awaitable, Callable, Iterator
from typing import Any

import anthropic
import anyio
import httpcore2
import httpx2
import pytest

from loopengine.providers._transport import FlatPool, PooledTransport, flat_http_client
from loopengine.testing import FakeAnthropicServer, Reply

BACKENDS = pytest.mark.parametrize("backend", ["asyncio", "trio"])
"""Run a test once on each event loop anyio drives."""

HELLO: list[anthropic.types.MessageParam] = [{"role": "user", "content": "hello"}]

MESSAGE = json.dumps({
    "id": "msg_1", "type": "message", "role": "assistant", "model": "m",
    "content": [{"type": "text", "text": "hi"}], "stop_reason": "end_turn",
    "stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1},
}).encode()


class Server:
    """An HTTP/1.1 keep-alive server on 127.0.0.1 that counts its connections.

    Paths: ``/`` answers at once; ``/pause`` after 10 ms; ``/hold`` once
    `release` is set; ``/drip`` sends the head and part of the body, then
    waits for the client to go; ``/v1/messages`` answers an Anthropic message.
    On ``/bye`` the server closes the connection after answering, with
    ``?bye`` once `hang_up` is set, without saying so in the response.
    """

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=512)
        self._listener.settimeout(0.01)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.release = threading.Event()
        self.hang_up = threading.Event()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sockets: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self.accepted = 0
        self.open = 0
        self.max_open = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.targets: list[str] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    def close(self) -> None:
        self._stop.set()
        self.release.set()
        self.hang_up.set()
        self._accepting.join()
        self._listener.close()
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in self._threads:
            thread.join()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self.accepted += 1
                self.open += 1
                self.max_open = max(self.max_open, self.open)
                self._sockets.add(sock)
            thread = threading.Thread(target=self._serve, args=(sock,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, sock: socket.socket) -> None:
        reader = sock.makefile("rb")
        try:
            while True:
                line = reader.readline()
                if not line:
                    return
                target = line.split()[1].decode()
                length = 0
                while (header := reader.readline()) not in (b"\r\n", b""):
                    name, _, value = header.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                reader.read(length)
                with self._lock:
                    self.targets.append(target)
                    self.in_flight += 1
                    self.max_in_flight = max(self.max_in_flight, self.in_flight)
                try:
                    path, _, query = target.partition("?")
                    keep_open = self._answer(sock, path)
                    if query == "bye":
                        self.hang_up.wait(5)
                        keep_open = False
                finally:
                    with self._lock:
                        self.in_flight -= 1
                if not keep_open:
                    return
        except OSError:
            pass
        finally:
            with self._lock:
                self.open -= 1
                self._sockets.discard(sock)
            reader.close()
            sock.close()

    def _answer(self, sock: socket.socket, path: str) -> bool:
        if path == "/pause":
            time.sleep(0.01)
        elif path == "/hold":
            self.release.wait(5)
        elif path == "/drip":
            sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 100000\r\n\r\n" + b"x" * 10)
            sock.settimeout(5)
            sock.recv(1)  # b"" once the client closes
            return False
        body, kind = (MESSAGE, b"application/json") if path == "/v1/messages" else (
            b"ok", b"text/plain")
        sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: " + kind + b"\r\ncontent-length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        return path != "/bye"


@pytest.fixture
def servers() -> Iterator[Callable[[], Server]]:
    """Start loopback servers on demand; all closed after the test."""
    started: list[Server] = []

    def start() -> Server:
        started.append(Server())
        return started[-1]

    yield start
    for server in started:
        server.close()


@pytest.fixture
def server(servers: Callable[[], Server]) -> Server:
    """One started loopback server."""
    return servers()


@pytest.fixture
def no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """An environment without proxy settings."""
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)


def transport(max_connections: int | None = 10, max_keepalive: int | None = None,
              keepalive_expiry: float | None = 5.0) -> PooledTransport:
    """A transport without certificate loading (the server speaks plain HTTP)."""
    return PooledTransport(verify=False, limits=httpx2.Limits(
        max_connections=max_connections, max_keepalive_connections=max_keepalive,
        keepalive_expiry=keepalive_expiry))


def client(server: Server, sender: PooledTransport, pool: float = 2.0) -> httpx2.AsyncClient:
    """An httpx2 client on ``sender`` with a short pool timeout."""
    return httpx2.AsyncClient(transport=sender, base_url=server.url,
                              timeout=httpx2.Timeout(5.0, pool=pool))


async def eventually(check: Callable[[], bool]) -> None:
    """Wait until ``check()`` holds (server threads and sockets settle asynchronously)."""
    with anyio.fail_after(3):
        while not check():  # noqa: ASYNC110 - the server's threads set no event to await
            await anyio.sleep(0.002)


def run(backend: str, main: Callable[[], Awaitable[None]]) -> None:
    """``main()`` on a fresh event loop of ``backend``."""
    anyio.run(main, backend=backend)


# -- keep-alive and limits ---------------------------------------------------------------


@BACKENDS
def test_sequential_requests_reuse_one_connection(backend: str, server: Server) -> None:
    """Ten requests one after another travel on one kept-alive connection."""

    async def main() -> None:
        sender = transport()
        async with client(server, sender) as http:
            for _ in range(10):
                response = await http.get("/")
                assert response.status_code == 200 and response.text == "ok"
            assert server.accepted == 1
            assert len(sender.pool.connections) == 1 and sender.pool.idle_count == 1

    run(backend, main)


@BACKENDS
def test_max_connections_holds_under_concurrency(backend: str, server: Server) -> None:
    """Twenty concurrent requests on a limit of three: all succeed, and the server
    never has more than three connections open."""
    statuses: list[int] = []

    async def main() -> None:
        async with client(server, transport(max_connections=3)) as http:

            async def one() -> None:
                statuses.append((await http.get("/pause")).status_code)

            async with anyio.create_task_group() as tg:
                for _ in range(20):
                    tg.start_soon(one)

    run(backend, main)
    assert statuses == [200] * 20
    assert server.max_open == 3 and server.accepted == 3 and server.max_in_flight == 3


@BACKENDS
def test_waiters_are_served_first_come_first_served(backend: str, server: Server) -> None:
    """On a full pool, queued requests get the connection in the order they asked."""

    async def main() -> None:
        sender = transport(max_connections=1)
        async with client(server, sender) as http, anyio.create_task_group() as tg:
            tg.start_soon(http.get, "/hold")
            await eventually(lambda: server.in_flight == 1)

            def queued(count: int) -> Callable[[], bool]:
                return lambda: sender.pool.waiting_count == count

            for n in range(5):
                tg.start_soon(http.get, f"/?n={n}")
                await eventually(queued(n + 1))
            server.release.set()

    run(backend, main)
    assert server.targets == ["/hold"] + [f"/?n={n}" for n in range(5)]
    assert server.accepted == 1


@BACKENDS
def test_pool_timeout_raises_httpx_pool_timeout(backend: str, server: Server) -> None:
    """With the only connection busy, a request gives up after its pool timeout
    with ``httpx2.PoolTimeout``; the pool serves the next request normally."""

    async def main() -> None:
        sender = transport(max_connections=1)
        async with client(server, sender, pool=0.05) as http:
            async with anyio.create_task_group() as tg:
                tg.start_soon(http.get, "/hold")
                await eventually(lambda: server.in_flight == 1)
                with pytest.raises(httpx2.PoolTimeout):
                    await http.get("/")
                assert sender.pool.waiting_count == 0
                server.release.set()
            assert (await http.get("/")).status_code == 200
            assert server.accepted == 1 and len(sender.pool.connections) == 1

    run(backend, main)


@BACKENDS
def test_a_connection_the_server_closed_is_replaced(backend: str, server: Server) -> None:
    """An idle connection the server has closed is dropped, and the next request
    goes out on a new one without an error."""

    async def main() -> None:
        sender = transport(max_connections=1)
        async with client(server, sender) as http:
            assert (await http.get("/bye")).text == "ok"
            await eventually(lambda: server.open == 0)
            assert (await http.get("/")).text == "ok"
            assert server.accepted == 2 and len(sender.pool.connections) == 1

    run(backend, main)


@BACKENDS
def test_a_dead_connection_on_top_of_the_idle_stack_is_skipped(
    backend: str, server: Server
) -> None:
    """The most recently used idle connection, closed by the server, is dropped,
    and the request goes out on the next idle one down the stack."""

    async def main() -> None:
        sender = transport(max_connections=2)
        async with client(server, sender) as http:
            async with anyio.create_task_group() as tg:
                tg.start_soon(http.get, "/hold?bye")
                await eventually(lambda: server.in_flight == 1)
                await http.get("/")  # a second connection, idle first: the bottom
                server.release.set()
            assert sender.pool.idle_count == 2
            server.hang_up.set()
            await eventually(lambda: server.open == 1)
            assert (await http.get("/")).text == "ok"
            assert server.accepted == 2 and len(sender.pool.connections) == 1

    run(backend, main)


@BACKENDS
def test_max_keepalive_connections_caps_idle_connections(backend: str, server: Server) -> None:
    """Five connections busy at once on a keep-alive cap of two: once they are
    done, two stay open and the other three are closed."""

    async def main() -> None:
        sender = transport(max_connections=5, max_keepalive=2)
        async with client(server, sender) as http:
            async with anyio.create_task_group() as tg:
                for _ in range(5):
                    tg.start_soon(http.get, "/hold")
                await eventually(lambda: server.in_flight == 5)
                server.release.set()
            assert sender.pool.idle_count == 2 and len(sender.pool.connections) == 2
            await eventually(lambda: server.open == 2)

    run(backend, main)


@pytest.mark.realtime
@BACKENDS
def test_an_expired_idle_connection_is_not_reused(backend: str, server: Server) -> None:
    """Past ``keepalive_expiry`` an idle connection is closed, not reused (50 ms)."""

    async def main() -> None:
        sender = transport(keepalive_expiry=0.05)
        async with client(server, sender) as http:
            await http.get("/")
            await anyio.sleep(0.08)
            await http.get("/")
            assert server.accepted == 2 and len(sender.pool.connections) == 1
            await eventually(lambda: server.open == 1)

    run(backend, main)


@BACKENDS
def test_a_full_pool_of_idle_connections_yields_to_another_origin(
    backend: str, servers: Callable[[], Server]
) -> None:
    """With the only slot held by an idle connection to one origin, a request to
    another origin closes it and connects, instead of waiting for the timeout."""
    first, second = servers(), servers()

    async def main() -> None:
        sender = transport(max_connections=1)
        async with httpx2.AsyncClient(transport=sender,
                                      timeout=httpx2.Timeout(5.0, pool=0.2)) as http:
            assert (await http.get(f"{first.url}/")).text == "ok"
            assert (await http.get(f"{second.url}/")).text == "ok"
            assert len(sender.pool.connections) == 1
            await eventually(lambda: first.open == 0 and second.open == 1)

    run(backend, main)


@BACKENDS
def test_a_released_connection_yields_its_slot_to_a_waiter_for_another_origin(
    backend: str, servers: Callable[[], Server]
) -> None:
    """A request to another origin waiting on a full pool gets the slot of the
    connection that comes free: that connection is closed, a new one opened."""
    first, second = servers(), servers()

    async def main() -> None:
        sender = transport(max_connections=1)
        async with httpx2.AsyncClient(transport=sender, timeout=httpx2.Timeout(5.0)) as http:
            busy = await http.send(http.build_request("GET", f"{first.url}/"), stream=True)
            async with anyio.create_task_group() as tg:
                tg.start_soon(http.get, f"{second.url}/")
                await eventually(lambda: sender.pool.waiting_count == 1)
                await busy.aread()
                await busy.aclose()
            assert len(sender.pool.connections) == 1
            await eventually(lambda: first.open == 0 and second.open == 1)

    run(backend, main)


# -- cancellation never leaks a slot -------------------------------------------------------


@BACKENDS
def test_requests_cancelled_while_waiting_leak_no_slot(backend: str, server: Server) -> None:
    """Eighty requests cancelled in the queue and three timed out there:
    afterwards the limit's full count of requests still runs at once."""

    async def main() -> None:
        sender = transport(max_connections=2)
        async with client(server, sender, pool=0.03) as http:
            async with anyio.create_task_group() as holders:
                for _ in range(2):
                    holders.start_soon(http.get, "/hold")
                await eventually(lambda: server.in_flight == 2)
                async with anyio.create_task_group() as waiters:
                    for _ in range(80):
                        waiters.start_soon(lambda: http.get("/", timeout=5.0))
                    await eventually(lambda: sender.pool.waiting_count == 80)
                    waiters.cancel_scope.cancel()
                for _ in range(3):
                    with pytest.raises(httpx2.PoolTimeout):
                        await http.get("/")
                assert sender.pool.waiting_count == 0
                server.release.set()

            server.release.clear()
            async with anyio.create_task_group() as again:
                for _ in range(2):
                    again.start_soon(http.get, "/hold")
                await eventually(lambda: server.in_flight == 2)
                server.release.set()
            assert len(sender.pool.connections) == 2 and server.accepted == 2

    run(backend, main)


@BACKENDS
@pytest.mark.parametrize("cancel_first", [False, True], ids=["woken-then-cancelled",
                                                             "cancelled-then-woken"])
@pytest.mark.parametrize("reusable", [True, False], ids=["connection", "slot"])
def test_a_waiter_handed_the_connection_and_cancelled_passes_it_on(
    backend: str, server: Server, cancel_first: bool, reusable: bool
) -> None:
    """The first waiter is handed the connection (or, the response being closed
    unread, the slot of the closed connection) and cancelled in the same step,
    before or after the hand-off: the second waiter gets it instead of it being
    lost, and the first never sends."""
    second: list[int] = []

    async def main() -> None:
        sender = transport(max_connections=1)
        async with client(server, sender) as http:
            busy = await http.send(http.build_request("GET", "/"), stream=True)
            first_scope = anyio.CancelScope()

            async def first() -> None:
                with first_scope:
                    await http.get("/?first")

            async def then() -> None:
                second.append((await http.get("/?second")).status_code)

            async with anyio.create_task_group() as tg:
                tg.start_soon(first)
                await eventually(lambda: sender.pool.waiting_count == 1)
                tg.start_soon(then)
                await eventually(lambda: sender.pool.waiting_count == 2)
                # No checkpoint between the two: the first waiter cannot run in between.
                if cancel_first:
                    first_scope.cancel()
                if reusable:
                    await busy.aread()  # read to its end: hands the connection on
                else:
                    await busy.aclose()  # unread: the connection closes, its slot moves
                first_scope.cancel()
            assert sender.pool.waiting_count == 0 and len(sender.pool.connections) == 1
            assert (await http.get("/")).status_code == 200

    run(backend, main)
    assert second == [200]
    assert "/?first" not in server.targets and server.accepted == (1 if reusable else 2)


@BACKENDS
def test_requests_cancelled_mid_response_leak_no_slot(backend: str, server: Server) -> None:
    """A request cancelled while its body streams in, and one cancelled while the
    server has not answered yet: each connection is closed and its slot freed."""

    async def main() -> None:
        sender = transport(max_connections=1)
        async with client(server, sender, pool=0.5) as http:
            with anyio.CancelScope() as scope:
                async with http.stream("GET", "/drip") as response:
                    async for _ in response.aiter_raw():
                        scope.cancel()
            assert scope.cancelled_caught and sender.pool.connections == []
            await eventually(lambda: server.open == 0)

            async with anyio.create_task_group() as tg:
                tg.start_soon(http.get, "/hold")
                await eventually(lambda: server.in_flight == 1)
                tg.cancel_scope.cancel()
            assert sender.pool.connections == []

            server.release.set()
            assert (await http.get("/")).status_code == 200
            assert server.accepted == 3 and len(sender.pool.connections) == 1

    run(backend, main)


# -- closing --------------------------------------------------------------------------------


@BACKENDS
def test_aclose_closes_idle_and_busy_connections(backend: str, server: Server) -> None:
    """Closing the client closes every connection, including one whose response is
    still open; closing that response afterwards is harmless."""

    async def main() -> None:
        sender = transport()
        http = client(server, sender)
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(http.get, "/pause")
        busy = await http.send(http.build_request("GET", "/drip"), stream=True)
        held = sender.pool.connections
        assert len(held) == 3 and sender.pool.idle_count == 2
        await http.aclose()
        assert sender.pool.connections == [] and all(c.is_closed() for c in held)
        await eventually(lambda: server.open == 0)
        await busy.aclose()
        assert sender.pool.connections == []

    run(backend, main)


# -- the work per request ------------------------------------------------------------------


class Counting(httpcore2.AsyncConnectionInterface):
    """A connection that counts how often the pool looks at it."""

    def __init__(self, inner: httpcore2.AsyncConnectionInterface, looks: list[int]) -> None:
        self._inner = inner
        self._looks = looks

    def _look(self) -> None:
        self._looks[0] += 1

    async def handle_async_request(self, request: httpcore2.Request) -> httpcore2.Response:
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()

    def info(self) -> str:
        return self._inner.info()

    def can_handle_request(self, origin: httpcore2.Origin) -> bool:
        self._look()
        return self._inner.can_handle_request(origin)

    def is_connected(self) -> bool:
        self._look()
        return self._inner.is_connected()

    def is_available(self) -> bool:
        self._look()
        return self._inner.is_available()

    def has_expired(self) -> bool:
        self._look()
        return self._inner.has_expired()

    def is_idle(self) -> bool:
        self._look()
        return self._inner.is_idle()

    def can_multiplex(self) -> bool:
        self._look()
        return self._inner.can_multiplex()

    def is_closed(self) -> bool:
        self._look()
        return self._inner.is_closed()


class CountingFlatPool(FlatPool):
    """A FlatPool whose connections count the pool's looks."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.looks = [0]

    def create_connection(self, origin: httpcore2.Origin) -> httpcore2.AsyncConnectionInterface:
        return Counting(super().create_connection(origin), self.looks)


class CountingHttpcorePool(httpcore2.AsyncConnectionPool):
    """httpcore's own pool, its connections counting the same way, for contrast."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.looks = [0]

    def create_connection(self, origin: httpcore2.Origin) -> httpcore2.AsyncConnectionInterface:
        return Counting(super().create_connection(origin), self.looks)


async def looks_per_request(pool: CountingFlatPool | CountingHttpcorePool, url: str,
                            requests: int) -> float:
    """Send ``requests`` requests at once through ``pool``; the pool's looks at its
    connections per request."""

    async def one() -> None:
        request = httpcore2.Request(b"GET", url, headers=[(b"host", b"127.0.0.1")])
        response = await pool.handle_async_request(request)
        assert isinstance(response.stream, AsyncIterable)
        async for _ in response.stream:
            pass
        await response.aclose()

    async with pool, anyio.create_task_group() as tg:
        for _ in range(requests):
            tg.start_soon(one)
    return pool.looks[0] / requests


def test_pool_work_per_request_grows_with_neither_waiters_nor_connections(
    server: Server,
) -> None:
    """The pool looks at a bounded number of connections per request whether 8 or
    150 requests queue, on 2 connections or on 40; httpcore's pool, counted the
    same way, looks at every connection on every request."""
    url = f"{server.url}/"
    looks: dict[tuple[str, int, int], float] = {}

    async def main() -> None:
        for connections, requests in [(2, 10), (2, 150), (40, 80)]:
            looks["flat", connections, requests] = await looks_per_request(
                CountingFlatPool(max_connections=connections), url, requests)
        for connections, requests in [(2, 10), (40, 80)]:
            looks["httpcore", connections, requests] = await looks_per_request(
                CountingHttpcorePool(max_connections=connections), url, requests)

    run("asyncio", main)
    flat = [v for k, v in looks.items() if k[0] == "flat"]
    assert max(flat) <= 6, looks
    assert max(flat) - min(flat) <= 1, looks
    assert looks["httpcore", 40, 80] > 5 * looks["httpcore", 2, 10], looks
    assert looks["httpcore", 40, 80] > 5 * looks["flat", 40, 80], looks


# -- the SDK, and the client the SDK gets -------------------------------------------------


@BACKENDS
def test_the_anthropic_sdk_sends_through_flat_http_client(
    backend: str, server: Server, no_proxy: None
) -> None:
    """``anthropic.AsyncAnthropic`` on `flat_http_client`: five messages on one
    connection, then twenty at once within a limit of three."""

    async def main() -> None:
        tls = httpx2.create_ssl_context(verify=False)
        http = flat_http_client(tls)
        assert http is not None and http.follow_redirects
        sdk = anthropic.AsyncAnthropic(api_key="k", base_url=server.url, max_retries=0,
                                       http_client=http)
        for _ in range(5):
            message = await sdk.messages.create(model="m", max_tokens=5, messages=HELLO)
            assert message.content[0].type == "text" and message.content[0].text == "hi"
        assert server.accepted == 1
        await sdk.close()
        await eventually(lambda: server.open == 0)

        narrow = flat_http_client(tls, limits=httpx2.Limits(max_connections=3))
        sdk = anthropic.AsyncAnthropic(api_key="k", base_url=server.url, max_retries=0,
                                       http_client=narrow)
        async with anyio.create_task_group() as tg:
            for _ in range(20):
                tg.start_soon(lambda: sdk.messages.create(model="m", max_tokens=5,
                                                          messages=HELLO))
        await sdk.close()

    run(backend, main)
    assert server.accepted == 4 and server.max_open == 3
    assert server.targets.count("/v1/messages") == 25


@BACKENDS
def test_sdk_streams_give_their_connection_back(
    backend: str, fake_anthropic_server: FakeAnthropicServer
) -> None:
    """Three streamed messages in a row on a one-connection pool: each stream hands
    the connection back when it ends (else the next would time out in the pool)."""
    fake_anthropic_server.add(Reply.text("one"), Reply.text("two"), Reply.text("three"))
    texts: list[str] = []

    async def main() -> None:
        sender = transport(max_connections=1)
        http = httpx2.AsyncClient(transport=sender, timeout=httpx2.Timeout(5.0, pool=0.5))
        sdk = anthropic.AsyncAnthropic(api_key="k", base_url=fake_anthropic_server.url,
                                       max_retries=0, http_client=http)
        for _ in range(3):
            async with sdk.messages.stream(model="m", max_tokens=5, messages=HELLO) as stream:
                texts.append(await stream.get_final_text())
        assert len(sender.pool.connections) == 1 and sender.pool.idle_count == 1
        await sdk.close()
        assert sender.pool.connections == []

    run(backend, main)
    assert texts == ["one", "two", "three"]


def test_flat_http_client_steps_aside_for_a_proxy(monkeypatch: pytest.MonkeyPatch,
                                                  no_proxy: None) -> None:
    """With a proxy in the environment there is no flat client (the caller uses the
    SDK's own); ``NO_PROXY`` alone configures no proxy."""
    tls = httpx2.create_ssl_context(verify=False)
    monkeypatch.setenv("NO_PROXY", "example.com")
    assert isinstance(flat_http_client(tls), httpx2.AsyncClient)
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    assert flat_http_client(tls) is None


def test_the_transport_refuses_http2_and_proxies() -> None:
    """HTTP/2 and proxies are httpcore's pool's job: asking for them is an error."""
    with pytest.raises(ValueError, match="HTTP/1.1"):
        PooledTransport(verify=False, http2=True)
    with pytest.raises(ValueError, match="proxy"):
        PooledTransport(verify=False, proxy="http://127.0.0.1:9")
    with pytest.raises(ValueError, match="max_connections"):
        FlatPool(max_connections=0)
