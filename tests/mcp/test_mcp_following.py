"""Following a server's tool list as it changes, on a server built with the ``mcp``
SDK's own server class that runs in this process: the SDK's client and server
speak JSON-RPC over a pair of memory streams (the SDK's own), in the 2026
protocol, so a test sees every ``tools/list`` request the server receives and
announces changes on the server's own subscription bus when it chooses.
The server's waits (before a listen stream is opened again, between listings)
pass on an injected clock: nothing here waits on real time."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import mcp_types
import pytest
import trio
import trio.testing
from mcp.server.mcpserver import MCPServer as SDKServer
from mcp.server.subscriptions import InMemorySubscriptionBus, ListenHandler
from mcp.shared.memory import create_client_server_memory_streams
from mcp.shared.subscriptions import ToolsListChanged

import loopengine as le
from loopengine.mcp import _RETRY_LISTING, MCPServer
from loopengine.testing import FakeClock, Reply

from ..adapter.conftest import Harness, tool_results
from ..conftest import operation
from .test_mcp import content_text
from .test_mcp_changes import offered


class Watch:
    """Wakes a test when something it watches happens (a listing, a sleep)."""

    def __init__(self) -> None:
        self._event = anyio.Event()

    def arm(self) -> anyio.Event:
        """A new event, set by the next `poke`."""
        self._event = anyio.Event()
        return self._event

    def poke(self) -> None:
        self._event.set()


class Bus(InMemorySubscriptionBus):
    """The SDK's bus, saying when a listen stream subscribes to it."""

    def __init__(self) -> None:
        super().__init__()
        self.subscribed = anyio.Event()

    def subscribe(self, listener: Callable[[Any], None]) -> Callable[[], None]:
        unsubscribe = super().subscribe(listener)
        self.subscribed.set()
        return unsubscribe


class Server(SDKServer):
    """The SDK's server, counting the ``tools/list`` requests it receives and how
    many it was answering at once."""

    def __init__(self, watch: Watch) -> None:
        self.bus = Bus()
        super().__init__("loopengine-in-process", subscriptions=self.bus)
        # The SDK's own listen handler, held here so that a test can end its streams.
        self.listens = ListenHandler(self.bus)
        self.listen_gate: anyio.Event | None = None
        """While not None, a listen request waits for this event before the SDK's
        handler subscribes it (a stream that begins late)."""

        async def listen(ctx: Any, params: mcp_types.SubscriptionsListenRequestParams) -> Any:
            if self.listen_gate is not None:
                await self.listen_gate.wait()
            return await self.listens(ctx, params)

        self._lowlevel_server.add_request_handler(
            "subscriptions/listen", mcp_types.SubscriptionsListenRequestParams, listen)
        self.watch = watch
        self.lists = 0
        self.answering = 0
        self.most_at_once = 0
        self.hold: anyio.Event | None = None
        """While not None, a listing reads the tools, then waits for this event to
        answer (a change meanwhile is not in its answer)."""
        self.held = anyio.Event()
        """Set when a listing begins to wait on `hold`."""
        self.failing = 0
        """How many of the next listings fail."""
        for name in ("echo", "add", "other"):
            self.add(name)

    def add(self, name: str) -> None:
        """Add a tool ``name`` (input ``text``)."""
        def tool(text: str) -> str:
            return f"{name} heard {text}"

        self.add_tool(tool, name=name, description=f"The {name} tool.")

    async def list_tools(self) -> list[mcp_types.Tool]:
        self.lists += 1
        self.answering += 1
        self.most_at_once = max(self.most_at_once, self.answering)
        try:
            await anyio.lowlevel.checkpoint()  # a second listing could begin meanwhile
            if self.failing:
                self.failing -= 1
                raise RuntimeError("the tools cannot be listed now")
            tools = await super().list_tools()
            if self.hold is not None:
                self.held.set()
                await self.hold.wait()
            return tools
        finally:
            self.answering -= 1
            self.watch.poke()

    async def changed(self) -> None:
        """Announce a change of the tool list on every listen stream."""
        await self.bus.publish(ToolsListChanged())


class HeldClock:
    """A clock that moves only when the test advances it: a sleep waits for that."""

    def __init__(self, watch: Watch) -> None:
        self._now = 0.0
        self._moved = anyio.Event()
        self.watch = watch
        self.sleeping = 0
        """Sleeps under way."""

    def now(self) -> float:
        return self._now

    def wall(self) -> datetime:
        return datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=self._now)

    async def sleep(self, seconds: float) -> None:
        wake = self._now + seconds
        self.sleeping += 1
        self.watch.poke()
        try:
            while self._now < wake:
                await self._moved.wait()
        finally:
            self.sleeping -= 1

    def advance(self, seconds: float) -> None:
        self._now += seconds
        moved, self._moved = self._moved, anyio.Event()
        moved.set()

    def cancel_scope(self, seconds: float) -> anyio.CancelScope:
        return anyio.CancelScope()

    def deadline_scope(self, at: float) -> anyio.CancelScope:
        return anyio.CancelScope()

    def effective_deadline(self) -> float:
        return math.inf


def in_process(server: Server, **kwargs: Any) -> MCPServer:
    """An `MCPServer` on ``server``, over the SDK's memory streams."""

    @asynccontextmanager
    async def transport() -> AsyncIterator[Any]:
        lowlevel = server._lowlevel_server
        async with create_client_server_memory_streams() as (client, (read, write)), \
                anyio.create_task_group() as group:
            group.start_soon(lambda: lowlevel.run(read, write,
                                                  lowlevel.create_initialization_options()))
            try:
                yield client
            finally:
                group.cancel_scope.cancel()

    return MCPServer(transport, label="in-process", **kwargs)


async def listed(sdk: Server, before: int) -> None:
    """Wait until the server has answered more than ``before`` listings."""
    while sdk.lists <= before:
        event = sdk.watch.arm()
        if sdk.lists > before:
            return
        await event.wait()


async def listening(server: MCPServer) -> None:
    """Wait until the client listens for changes and has listed the tools since the
    stream began (nothing is replayed): from here it lists only when told of a change."""
    session = server._session
    assert session is not None
    while not session.listening:  # the client's own state: the server cannot see it
        await anyio.lowlevel.checkpoint()
    await server.current_tools()


async def relisted(server: MCPServer, sdk: Server) -> set[str]:
    """Announce a change; the client's tool names once it has listed them again."""
    before = sdk.lists
    await sdk.changed()
    await listed(sdk, before)
    return {t.name for t in await server.current_tools()}


async def test_a_listen_stream_that_ends_is_opened_again_after_waits_on_the_clock() -> None:
    """The server ends its listen streams again and again without a change: the
    client opens one again at once, then after 1, 2, 4, 8, 16 s and at most 30 s,
    each wait slept on the server's clock; a change heard of on a stream starts
    the waits over."""
    clock = FakeClock()
    sdk = Server(Watch())
    async with in_process(sdk, clock=clock) as server:
        await listening(server)
        clock.advance(1.0)  # the listing the stream's opening prompted is a second old
        start = len(clock.sleeps)
        waits = [0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
        for n in range(len(waits)):
            before = sdk.lists
            sdk.listens.close()
            await listed(sdk, before)  # listened again, and listed again (nothing replayed)
            assert clock.sleeps[start:] == waits[:n + 1]
        clock.advance(1.0)
        assert await relisted(server, sdk) == {"echo", "add", "other"}
        clock.advance(1.0)
        before = sdk.lists
        sdk.listens.close()
        await listed(sdk, before)
        assert clock.sleeps[start:] == [*waits, 0.0]


def test_on_trio_a_server_given_no_clock_waits_on_trios_clock() -> None:
    """Given no clock, the server waits on anyio's, which on trio is trio's: under
    its MockClock (autojump) a listen stream ended four times is opened again after
    0, 1, 2 and 4 s of that clock, without real waiting."""

    async def main() -> list[float]:
        sdk = Server(Watch())
        async with in_process(sdk) as server:
            await listening(server)
            await trio.sleep(1.0)  # the listing the stream's opening prompted is a second old
            waited = []
            for _ in range(4):
                before, start = sdk.lists, trio.current_time()
                sdk.listens.close()
                await listed(sdk, before)
                waited.append(trio.current_time() - start)
        return waited

    assert trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0)) == [0, 1, 2, 4]


@asynccontextmanager
async def held() -> AsyncIterator[tuple[MCPServer, Server, HeldClock, Watch]]:
    """An `MCPServer` on a new `Server`, its waits on a `HeldClock`: listening, its
    last listing a second old when the block begins."""
    watch = Watch()
    clock = HeldClock(watch)
    sdk = Server(watch)
    async with in_process(sdk, clock=clock) as server:
        await listening(server)
        clock.advance(1.0)
        yield server, sdk, clock, watch


async def test_a_burst_of_change_notices_is_read_by_one_listing_a_second() -> None:
    """The server announces a change fifty times in a row, each time once the
    client has begun a listing or is waiting to: the client has one listing in
    flight at most, lists at most once while its clock stands still, and once
    the clock moves on a second, one listing reads the tools as the burst left
    them."""
    async with held() as (server, sdk, clock, watch):
        base = sdk.lists
        for n in range(50):
            if n == 40:
                sdk.add("late")
            if n == 49:
                sdk.add("last")  # the burst's last notice brings a change too
            before = sdk.lists
            event = watch.arm()
            await sdk.changed()
            while sdk.lists == before and not clock.sleeping:
                await event.wait()
                event = watch.arm()
        # The burst's first notice is listed at once; the rest wait for the clock.
        assert sdk.lists == base + 1 and clock.sleeping == 1
        clock.advance(1.0)
        tools = await server.current_tools()
        assert sdk.lists == base + 2
        assert {t.name for t in tools} == {"echo", "add", "other", "late", "last"}
        for _ in range(20):  # no other listing before the clock moves on again
            await anyio.lowlevel.checkpoint()
        assert sdk.lists == base + 2
        assert sdk.most_at_once == 1


async def test_a_change_announced_during_a_listing_is_read_by_one_more() -> None:
    """A listing is under way, its answer read from the tools before the change, when
    the server adds a tool and says so: the client lists once more, a second after
    the last listing began (a wait on its clock), and reads the new tool: a change
    announced while a listing runs is not lost."""
    clock = FakeClock()
    sdk = Server(Watch())
    async with in_process(sdk, clock=clock) as server:
        await listening(server)
        clock.advance(5.0)
        start, base = len(clock.sleeps), sdk.lists
        release = sdk.hold = anyio.Event()
        sdk.add("first")
        await sdk.changed()
        await sdk.held.wait()  # the listing has read the tools ("first" among them)
        sdk.hold = None
        heard = server._heard
        sdk.add("second")
        await sdk.changed()
        while server._heard == heard:  # the client's own state: the server cannot see it
            await anyio.lowlevel.checkpoint()
        release.set()
        tools = {t.name for t in await server.current_tools()}
        assert tools == {"echo", "add", "other", "first", "second"}
        assert sdk.lists == base + 2
        assert clock.sleeps[start:] == [1.0]


async def test_a_lone_change_after_a_quiet_second_is_listed_at_once() -> None:
    """A change announced more than a second after the last listing began is listed
    at once, with no wait on the clock; one announced a quarter second after a
    listing began waits the three quarters left, then is read."""
    clock = FakeClock()
    sdk = Server(Watch())
    async with in_process(sdk, clock=clock) as server:
        await listening(server)
        clock.advance(5.0)
        start = len(clock.sleeps)
        sdk.add("first")
        assert "first" in await relisted(server, sdk)
        assert clock.sleeps[start:] == []
        clock.advance(0.25)
        sdk.add("second")
        assert "second" in await relisted(server, sdk)
        assert clock.sleeps[start:] == [0.75]
        clock.advance(3.0)
        sdk.add("third")
        assert "third" in await relisted(server, sdk)
        assert clock.sleeps[start:] == [0.75]


async def test_a_second_change_within_the_second_is_not_lost_and_a_run_after_it_reads_it(
) -> None:
    """Two changes a quarter second apart: the first is listed at once; the second
    waits, unlisted, for the second to end (the clock stands still). Meanwhile
    the tools a run starting now reads (`current_tools`) are not returned until
    that listing has read them; once the clock moves on, one listing reads the
    second change and the run sees it."""
    async with held() as (server, sdk, clock, watch):
        base = sdk.lists
        sdk.add("first")
        assert "first" in await relisted(server, sdk)  # at once: the clock stands still
        assert sdk.lists == base + 1
        clock.advance(0.25)
        sdk.add("second")
        event = watch.arm()
        await sdk.changed()
        while not clock.sleeping:
            await event.wait()
            event = watch.arm()
        seen: list[set[str]] = []

        async def run_starts() -> None:
            seen.append({t.name for t in await server.current_tools()})

        async with anyio.create_task_group() as group:
            group.start_soon(run_starts)
            for _ in range(20):
                await anyio.lowlevel.checkpoint()
            assert seen == [] and sdk.lists == base + 1  # waiting for the second to end
            clock.advance(0.75)
        assert seen == [{"echo", "add", "other", "first", "second"}]
        assert sdk.lists == base + 2


async def test_a_change_before_the_listen_stream_began_is_read_after_the_first_listing(
) -> None:
    """The server reads its tools for the first listing, then changes them before the
    client's listen stream has begun (no notice reaches the client: changes are not
    replayed), and answers the listing only once the stream has begun: when
    ``async with`` has built the tools, the client lists them again and reads the
    change."""
    sdk = Server(Watch())
    sdk.hold, sdk.listen_gate = anyio.Event(), anyio.Event()
    mcp = in_process(sdk, clock=FakeClock())

    async def stage() -> None:
        await sdk.held.wait()  # the first listing has read the tools
        sdk.hold = None
        sdk.add("late")
        await sdk.changed()  # no stream is subscribed yet: nobody hears of it
        assert sdk.listen_gate is not None
        sdk.listen_gate.set()
        await sdk.bus.subscribed.wait()
        session = mcp._session
        assert session is not None
        while not session.listening:  # the client's own state: the server cannot see it
            await anyio.lowlevel.checkpoint()
        assert mcp._tools is None  # the first listing is still under way
        release.set()

    release = sdk.hold
    async with anyio.create_task_group() as group:
        group.start_soon(stage)
        async with mcp as server:
            assert "late" not in {t.name for t in server.tools}  # the first listing's answer
            assert "late" in {t.name for t in await server.current_tools()}


async def test_r15_allow_and_settings_follow_the_tool_list_by_name(anthropic: Harness) -> None:
    """``allow={"echo", "add"}``, ``approval={"add"}``. The server drops ``add`` and
    adds ``fresh``: the next turn offers only ``echo``, and calls of ``add`` and
    ``fresh`` are unknown tools' calls. The server adds ``add`` back: it is offered
    again, and its call waits for approval as at first. At the next ``async
    with``, ``allow`` naming a tool the server lacks is a ConfigError again."""
    sdk = Server(Watch())
    mcp = in_process(sdk, allow={"echo", "add"}, approval={"add"}, clock=FakeClock())
    async with mcp as server:
        assert {t.name for t in server.tools} == {"echo", "add"}
        await listening(server)
        sdk.remove_tool("add")
        sdk.add("fresh")
        assert await relisted(server, sdk) == {"echo"}
        engine, _ = anthropic.engine(
            Reply.tool_calls(("add", {"text": "a"}), ("fresh", {"text": "b"}),
                             ("echo", {"text": "c"})),
            Reply.text("done"))
        result = await engine.run(operation(), "go", tools=[server])
        assert result.outcome is le.Outcome.COMPLETED
        assert set(offered(anthropic.requests[0])) == {"echo"}
        add, fresh, echo = tool_results(anthropic.requests[1])
        for gone, name in ((add, "add"), (fresh, "fresh")):
            assert gone["is_error"] is True
            assert f"There is no tool named '{name}'" in content_text(gone)
        assert content_text(echo) == "echo heard c"

        sdk.add("add")
        assert await relisted(server, sdk) == {"echo", "add"}
        engine, _ = anthropic.engine(Reply.tool_calls(("add", {"text": "d"})))
        paused = await engine.run(operation(), "go", tools=[server])
        assert paused.outcome is le.Outcome.PAUSED
        assert set(offered(anthropic.requests[2])) == {"echo", "add"}
        assert [(p.tool, p.reason) for p in paused.pending] == [("add", "approval")]

    sdk.remove_tool("add")
    with pytest.raises(le.ConfigError, match="has no tool add") as raised:
        async with mcp:
            pass
    assert raised.value.field == "allow"


async def test_after_a_failed_listing_readings_serve_the_last_tools_and_retry_after_a_wait(
    anthropic: Harness,
) -> None:
    """The server adds ``extra`` and says so; the listing that prompts fails. A run's
    next two turns (and the batch between them) read the tools without listing
    them again and offer the tools as they were. Until `_RETRY_LISTING` seconds of
    the server's clock have passed since the failure, a reading lists nothing;
    then the first reading lists again without waiting for that listing (which
    the server holds unanswered), and once it is answered the tools have
    ``extra``. A second failure in a row doubles the wait."""
    async with held() as (server, sdk, clock, watch):
        base = sdk.lists
        sdk.failing = 1
        sdk.add("extra")
        await sdk.changed()
        await listed(sdk, base)
        # Waits for the listing the change prompted (it fails): the tools as they were.
        assert "extra" not in {t.name for t in await server.current_tools()}
        clock.advance(1.0)  # past the least time between listings, not past the wait
        engine, _ = anthropic.engine(Reply.tool_calls(("echo", {"text": "a"})),
                                     Reply.text("done"))
        result = await engine.run(operation(), "go", tools=[server])
        assert result.outcome is le.Outcome.COMPLETED
        assert "extra" not in offered(anthropic.requests[0])
        assert "extra" not in offered(anthropic.requests[1])
        assert sdk.lists == base + 1  # no listing during the run

        clock.advance(_RETRY_LISTING - 1.5)
        assert "extra" not in {t.name for t in await server.current_tools()}
        assert sdk.lists == base + 1  # the wait has not passed
        clock.advance(0.5)
        release = sdk.hold = anyio.Event()
        assert "extra" not in {t.name for t in await server.current_tools()}  # no wait
        await sdk.held.wait()  # the reading's listing reached the server
        sdk.hold = None
        release.set()
        while server._listing is not None:  # the client's own state: the server cannot see it
            await anyio.lowlevel.checkpoint()
        assert "extra" in {t.name for t in await server.current_tools()}
        assert sdk.lists == base + 2

        # Two failures in a row: the second waits twice as long.
        sdk.failing = 2
        sdk.add("more")
        clock.advance(1.0)
        await sdk.changed()
        await listed(sdk, base + 2)
        await server.current_tools()  # waits for the listing the change prompted
        clock.advance(_RETRY_LISTING)
        await server.current_tools()  # lists again: fails
        await listed(sdk, base + 3)
        while server._listing is not None:
            await anyio.lowlevel.checkpoint()
        clock.advance(2 * _RETRY_LISTING - 0.5)
        assert "more" not in {t.name for t in await server.current_tools()}
        assert sdk.lists == base + 4
        clock.advance(0.5)
        await server.current_tools()
        await listed(sdk, base + 4)
        while server._listing is not None:
            await anyio.lowlevel.checkpoint()
        assert "more" in {t.name for t in await server.current_tools()}
        assert sdk.lists == base + 5
