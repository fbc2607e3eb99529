"""``connect_timeout`` passes on the server's clock (``clock=``), as its other
waits do: a server that never answers at start, one that never lists its tools
and a new listing that never ends each time out when that clock says, never
on real time. The servers are real: tests/mcp/server.py over stdio (``mute``:
it reads its input and never answers) and a server on the ``mcp`` SDK's own
class in this process (tests/mcp/test_mcp_following.py)."""

from __future__ import annotations

import logging
import sys

import anyio
import anyio.lowlevel
import pytest
import trio
import trio.testing

from loopengine.mcp import CONNECT_TIMEOUT, MCPServer, MCPServerError

from ..clock_support import ExpiringClock
from .conftest import SCRIPT
from .test_mcp_following import Server, Watch, in_process, listening

pytestmark = [pytest.mark.slow]


async def idle(turns: int = 50) -> None:
    """Let every other task run that can (nothing it waits for comes from time)."""
    for _ in range(turns):
        await anyio.lowlevel.checkpoint()


async def test_a_server_that_never_answers_at_start_times_out_on_its_clock() -> None:
    """``async with`` a server that never answers waits until the server's clock has
    moved ``connect_timeout`` (30 s by default), not a second less, then raises
    MCPServerError naming the server and the timeout."""
    clock = ExpiringClock()
    failed: list[MCPServerError] = []

    async def enter() -> None:
        with pytest.raises(MCPServerError) as raised:
            async with MCPServer.stdio(sys.executable, [SCRIPT, "mute"], clock=clock):
                pass
        failed.append(raised.value)

    async with anyio.create_task_group() as group:
        group.start_soon(enter)
        await clock.asked_for(1)
        assert clock.asked == [CONNECT_TIMEOUT]
        clock.advance(CONNECT_TIMEOUT - 1)
        await idle()
        assert not failed
        clock.advance(1)
    (error,) = failed
    assert "server.py mute" in str(error)
    assert "did not connect within 30s" in str(error)


def test_on_trio_a_server_given_no_clock_times_out_on_trios_clock() -> None:
    """Given no clock, ``connect_timeout`` is anyio's time, which on trio is trio's:
    under its MockClock (autojump) a server that never answers fails ``async with``
    after exactly 5 s of that clock, without real waiting."""

    async def main() -> tuple[float, str]:
        began = trio.current_time()
        with pytest.raises(MCPServerError) as raised:
            async with MCPServer.stdio(sys.executable, [SCRIPT, "mute"], connect_timeout=5):
                pass
        return trio.current_time() - began, str(raised.value)

    took, error = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert "did not connect within 5s" in error
    # The SDK's own shutdown of the process waits on the same clock after it.
    assert 5 <= took < 5 + 10


async def test_a_server_that_never_lists_its_tools_times_out_on_its_clock() -> None:
    """A server that connects but never answers ``tools/list``: ``async with`` raises
    MCPServerError once the server's clock has moved ``connect_timeout`` past the
    start of the listing."""
    clock = ExpiringClock()
    sdk = Server(Watch())
    sdk.hold = anyio.Event()
    failed: list[MCPServerError] = []

    async def enter() -> None:
        with pytest.raises(MCPServerError) as raised:
            async with in_process(sdk, clock=clock, connect_timeout=12):
                pass
        failed.append(raised.value)

    async with anyio.create_task_group() as group:
        group.start_soon(enter)
        await sdk.held.wait()  # connected (one scope), listing (the second)
        await clock.asked_for(2)
        clock.advance(11)
        await idle()
        assert not failed
        clock.advance(1)
    sdk.hold.set()
    (error,) = failed
    assert str(error) == ("MCP server in-process did not start or list its tools: "
                          "listing the tools took longer than 12s")


async def test_a_new_listing_that_never_ends_keeps_the_tools_and_a_run_waits_no_longer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The server says its tools changed, then never answers the new listing: a
    reader of the tools waits for it until the server's clock has moved
    ``connect_timeout``, then gets the tools as they were; the listing's failure
    is in the log, and the tools stay as they were."""
    caplog.set_level(logging.WARNING, logger="loopengine")
    clock = ExpiringClock()
    sdk = Server(Watch())
    async with in_process(sdk, clock=clock, connect_timeout=12) as server:
        await listening(server)
        before = server.tools
        clock.advance(5.0)
        sdk.hold = anyio.Event()
        sdk.add("late")
        await sdk.changed()
        await sdk.held.wait()
        read: list[tuple[object, ...]] = []

        async def reader() -> None:
            read.append(await server.current_tools())

        async with anyio.create_task_group() as group:
            group.start_soon(reader)
            asked = len(clock.asked)
            await clock.asked_for(asked + 1)  # the reader's wait has begun
            clock.advance(11)
            await idle()
            assert not read
            clock.advance(1)
        assert read == [before]
        await idle()
        assert server.tools == before
        sdk.hold.set()
    assert "listing the tools took longer than 12s" in caplog.text
    assert "they stay as they were" in caplog.text
