"""A server whose tools change during a run (``notifications/tools/list_changed``):
tests/mcp/server.py, on the ``mcp`` SDK's own server class, adds, drops and
redefines its tools and announces it, over stdio in the 2026 protocol (a
``subscriptions/listen`` stream) and in the 2025 handshake era (on the session),
and over streamable HTTP; runs given the server itself read its tools again
before each turn and each batch. Its ``change`` tool answers only once the
client has listed the tools again, so nothing here waits on time."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

import loopengine as le
from loopengine.mcp import _RETRY_LISTING, MCPServer
from loopengine.testing import FakeClock, Reply

from ..adapter.conftest import Harness, tool_results
from ..conftest import operation
from .conftest import SCRIPT, HttpServer, script_server
from .test_mcp import by_name, content_text

pytestmark = [pytest.mark.slow, pytest.mark.realtime]


def offered(request: Any) -> dict[str, dict[str, Any]]:
    """The tools a recorded Messages API request offered, by name."""
    return {t["name"]: t for t in request.body["tools"]}


def server_in(mode: str, http_server: HttpServer | None, **kwargs: Any) -> MCPServer:
    """The test server in ``mode``; its waits between listings on a fake clock."""
    kwargs.setdefault("clock", FakeClock())
    if mode == "http":
        assert http_server is not None
        return MCPServer.http(http_server.url, **kwargs)
    return MCPServer.stdio(sys.executable, [SCRIPT, mode], **kwargs)


def changing(**kwargs: Any) -> MCPServer:
    """tests/mcp/server.py over stdio, its waits between listings on a fake clock."""
    return server_in("stdio", None, **kwargs)


@pytest.fixture(params=["stdio", "legacy", "http"])
def mode(request: pytest.FixtureRequest) -> str:
    """stdio in the 2026 protocol, stdio in the 2025 handshake era, streamable HTTP."""
    return str(request.param)


async def test_the_next_turn_offers_the_changed_tools_and_calls_obey_them(
    mode: str, request: pytest.FixtureRequest, anthropic: Harness,
) -> None:
    """A call of ``change`` adds ``extra``, drops ``add`` and gives ``echo`` a second
    required property. The next turn offers exactly the new list; its calls are
    checked against it: ``extra`` runs on the server, ``echo`` without the new
    property is invalid input, ``add`` is an unknown tool. The run completes."""
    http_server = request.getfixturevalue("http_server") if mode == "http" else None
    async with server_in(mode, http_server, allow=None) as server:
        before = {t.name for t in server.tools}
        engine, _ = anthropic.engine(
            Reply.tool_calls(("change", {"add": "extra", "drop": "add", "require": "more"})),
            Reply.tool_calls(("extra", {"text": "hi"}), ("echo", {"text": "a"}),
                             ("add", {"a": 1, "b": 2})),
            Reply.text("done"))
        result = await engine.run(operation(), "go", tools=[server])
        after = {t.name for t in server.tools}
    assert result.outcome is le.Outcome.COMPLETED
    assert after == before - {"add"} | {"extra"}
    first, second = offered(anthropic.requests[0]), offered(anthropic.requests[1])
    assert set(first) == before and set(second) == after
    assert first["echo"]["input_schema"]["required"] == ["text"]
    assert second["echo"]["input_schema"]["required"] == ["text", "extra"]
    (changed,) = tool_results(anthropic.requests[1])
    assert content_text(changed) == "changed"
    extra, echo, add = tool_results(anthropic.requests[2])
    assert content_text(extra) == "extra heard hi" and "is_error" not in extra
    assert echo["is_error"] is True and "Invalid input for echo" in content_text(echo)
    assert add["is_error"] is True and "There is no tool named 'add'" in content_text(add)


async def test_r15_a_tool_dropped_during_a_pause_is_an_unknown_tool_on_resume(
    anthropic: Harness,
) -> None:
    """An ``echo`` call waits for approval; meanwhile the server drops ``echo``. The
    resume, given the server, is not refused for the missing tool: the approved
    call is answered as an unknown tool's (it never reaches the server), and the
    run goes on to complete."""
    async with changing(allow=None, approval={"echo"}) as server:
        engine, _ = anthropic.engine(Reply.tool_calls(("echo", {"text": "hi"})),
                                     Reply.text("It is gone."))
        paused = await engine.run(operation(), "go", tools=[server])
        assert paused.outcome is le.Outcome.PAUSED and paused.state is not None
        (pending,) = paused.pending
        assert await by_name(server)["change"].invoke({"drop": "echo"}) == "changed"
        resumed = await engine.resume(paused.state, decisions={pending.id: le.Approve()},
                                      tools=[server])
    assert resumed.outcome is le.Outcome.COMPLETED
    (gone,) = tool_results(anthropic.requests[1])
    assert gone["is_error"] is True
    assert "There is no tool named 'echo'" in content_text(gone)
    assert "echo" not in offered(anthropic.requests[1])


async def test_a_new_server_tool_named_like_a_local_tool_is_left_out(
    anthropic: Harness, caplog: pytest.LogCaptureFixture,
) -> None:
    """The server adds a tool named like one of the run's own: the run's own keeps
    the name (it answers the call), the server's is left out, said once in the
    log; the run is not ended by the change."""

    @le.tool
    def extra(text: str) -> str:
        """The local tool."""
        return f"local {text}"

    caplog.set_level(logging.WARNING, logger="loopengine")
    async with changing(allow=None) as server:
        engine, _ = anthropic.engine(
            Reply.tool_calls(("change", {"add": "extra"})),
            Reply.tool_calls(("extra", {"text": "hi"})), Reply.text("done"))
        result = await engine.run(operation(), "go", tools=[extra, server])
    assert result.outcome is le.Outcome.COMPLETED
    names = [t["name"] for t in anthropic.requests[2].body["tools"]]
    assert names[0] == "extra" and names.count("extra") == 1 and "change" in names
    (answer,) = tool_results(anthropic.requests[2])
    assert content_text(answer) == "local hi"
    assert caplog.text.count("a name the run's other tools have: it is left out") == 1


async def test_a_server_outside_its_block_is_refused_before_anything_is_sent(
    anthropic: Harness,
) -> None:
    """``tools=[server]`` before ``async with server:`` is a ConfigError naming it."""
    engine, _ = anthropic.engine(Reply.text("never sent"))
    with pytest.raises(le.ConfigError) as raised:
        await engine.run(operation(), "go", tools=[script_server()])
    assert raised.value.field == "tools[0]"
    assert not anthropic.requests


async def test_a_name_clash_names_the_places_the_caller_wrote(anthropic: Harness) -> None:
    """A local tool named like one of the server's is a ConfigError naming the
    positions in ``tools`` as the caller wrote them (and the server), not in the
    list with the server's tools spread out: so for a run, either way round, and
    for an estimate. Nothing is sent."""

    @le.tool
    def echo(text: str) -> str:
        """The local tool."""
        return text

    engine, _ = anthropic.engine(Reply.text("never sent"))
    async with changing(allow=None) as server:
        with pytest.raises(le.ConfigError) as after:
            await engine.run(operation(), "go", tools=[server, echo])
        with pytest.raises(le.ConfigError) as before:
            await engine.run(operation(), "go", tools=[echo, server])
        with pytest.raises(le.ConfigError) as estimated:
            engine.estimate(operation(), "go", tools=[server, echo])
    assert after.value.field == "tools[1]"
    assert after.value.message == \
        f"two tools are named 'echo': tools[0] ({server!r}) and tools[1]"
    assert before.value.field == "tools[1]"
    assert before.value.message == \
        f"two tools are named 'echo': tools[0] and tools[1] ({server!r})"
    assert (estimated.value.field, estimated.value.message) == \
        (after.value.field, after.value.message)
    assert not anthropic.requests


async def test_a_listen_stream_the_server_ends_is_opened_again(anthropic: Harness) -> None:
    """The server ends its listen streams (as an idle HTTP stream ends at its read
    timeout): the client listens again, lists the tools again (changes are not
    replayed; the tools that did not change stay the same objects), and hears of the
    next change, which the next turn offers."""
    async with changing(allow=None) as server:
        tools = by_name(server)
        assert await tools["end_listens"].invoke({}) == "ended"
        # Listed again unchanged: the same Tool objects (built, and logged about, once).
        assert all(a is b for a, b in zip(tools.values(), await server.current_tools(),
                                          strict=True))
        engine, _ = anthropic.engine(Reply.tool_calls(("change", {"add": "extra"})),
                                     Reply.text("done"))
        result = await engine.run(operation(), "go", tools=[server])
    assert result.outcome is le.Outcome.COMPLETED
    assert "extra" not in offered(anthropic.requests[0])
    assert "extra" in offered(anthropic.requests[1])


async def test_a_server_given_alone_is_refused_with_a_hint(anthropic: Harness) -> None:
    """``tools=server`` (not a list) is a ConfigError on ``tools`` saying how to pass it."""
    engine, _ = anthropic.engine(Reply.text("never sent"))
    async with changing(allow={"echo"}) as server:
        with pytest.raises(le.ConfigError,
                           match=r"single source .*pass tools=\[server\]") as raised:
            await engine.run(operation(), "go", tools=server)  # type: ignore[arg-type]
    assert raised.value.field == "tools" and not anthropic.requests


@pytest.mark.parametrize("era", ["stdio", "legacy"])
async def test_a_server_started_again_is_listed_again(
    era: str, anthropic: Harness, tmp_path: Path,
) -> None:
    """The server's process dies; the next call starts it again, and the new process
    has one more tool: it is listed again (whether or not it announces changes on
    a listen stream), and the turn after offers and runs it."""
    marker = tmp_path / "reborn"
    async with server_in(era, None, env={"LOOPENGINE_TEST_MARKER": str(marker)}) as server:
        assert "reborn" not in by_name(server)
        marker.touch()  # for the next process only
        engine, _ = anthropic.engine(
            Reply.tool_calls(("crash", {})), Reply.tool_calls(("pid", {})),
            Reply.tool_calls(("reborn", {"text": "hi"})), Reply.text("done"))
        result = await engine.run(operation(), "go", tools=[server])
    assert result.outcome is le.Outcome.COMPLETED
    assert "reborn" not in offered(anthropic.requests[1])
    assert "reborn" in offered(anthropic.requests[3])
    (answer,) = tool_results(anthropic.requests[3])
    assert content_text(answer) == "reborn heard hi"


async def test_a_change_whose_listing_failed_is_listed_again_by_a_reading_after_a_wait(
    mode: str, request: pytest.FixtureRequest, anthropic: Harness,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The server adds ``extra`` and announces it, but the listing that change
    prompts fails: the tools stay as they were (said in the log), and the change
    stays unread. Readings of the tools before `_RETRY_LISTING` seconds of the
    server's clock have passed list nothing; the first after lists them again,
    with no further notice, without waiting for it; once it is done, a run
    offers ``extra``."""
    caplog.set_level(logging.WARNING, logger="loopengine")
    http_server = request.getfixturevalue("http_server") if mode == "http" else None
    clock = FakeClock()
    async with server_in(mode, http_server, allow=None, clock=clock) as server:
        assert await by_name(server)["change"].invoke({"add": "extra", "fail": 1}) == "changed"
        # Waits for the listing the change prompted, if it is still under way.
        await server.current_tools()
        assert "extra" not in {t.name for t in await server.current_tools()}
        assert server._listing is None  # no listing began
        clock.advance(_RETRY_LISTING)
        assert "extra" not in {t.name for t in await server.current_tools()}  # no wait
        while server._listing is not None:  # the client's own state: the server cannot see it
            await anyio.lowlevel.checkpoint()
        engine, _ = anthropic.engine(Reply.tool_calls(("extra", {"text": "hi"})),
                                     Reply.text("done"))
        result = await engine.run(operation(), "go", tools=[server])
    assert caplog.text.count("listing them again failed") == 1
    assert result.outcome is le.Outcome.COMPLETED
    assert "extra" in offered(anthropic.requests[0])
    (answer,) = tool_results(anthropic.requests[1])
    assert content_text(answer) == "extra heard hi"
