"""MCP tools that need approval pause the run like any ``le.Tool(approval=True)``:
through real MCP servers (``mcp-server-time`` over stdio, tests/mcp/server.py over
streamable HTTP) and the real provider SDKs on their fake servers."""

from __future__ import annotations

import json
from typing import Any

import pytest

import loopengine as le
from loopengine.mcp import MCPServer
from loopengine.testing import Reply

from ..adapter.conftest import Harness, tool_results
from ..conftest import operation
from .conftest import HttpServer, script_server, time_server
from .test_mcp import by_name, content_text

pytestmark = [pytest.mark.slow, pytest.mark.realtime]


async def test_an_approved_mcp_call_runs_on_the_server_after_the_resume(
    anthropic: Harness,
) -> None:
    """approval=True: the batch pauses before the server is called; Approve runs the
    call on the real server and its answer reaches the model."""
    async with time_server(approval=True) as server:
        assert all(t.approval is True for t in server.tools)
        engine, _ = anthropic.engine(
            Reply.tool_calls(("get_current_time", {"timezone": "Asia/Tokyo"})),
            Reply.text("It is late in Tokyo."))
        paused = await engine.run(operation(), "Time in Tokyo?", tools=server.tools)
        assert paused.outcome is le.Outcome.PAUSED
        (pending,) = paused.pending
        assert (pending.tool, pending.input, pending.reason) == (
            "get_current_time", {"timezone": "Asia/Tokyo"}, "approval")
        assert len(anthropic.requests) == 1
        assert paused.state is not None
        resumed = await engine.resume(paused.state, decisions={pending.id: le.Approve()},
                                      tools=server.tools)
    assert resumed.outcome is le.Outcome.COMPLETED
    assert resumed.answer == "It is late in Tokyo."
    (answer,) = tool_results(anthropic.requests[1])
    assert "is_error" not in answer
    assert json.loads(content_text(answer))["timezone"] == "Asia/Tokyo"


async def test_a_denied_mcp_call_never_reaches_the_server(
    http_server: HttpServer, anthropic: Harness,
) -> None:
    """approval names one tool over HTTP: a batch calling it pauses; Deny gives the
    model an is_error result with the reason, and the server is not called (its
    ``add`` would have answered 5)."""
    async with MCPServer.http(http_server.url, allow={"echo", "add"},
                              approval={"add"}) as server:
        tools = by_name(server)
        assert (tools["add"].approval, tools["echo"].approval) == (True, False)
        engine, _ = anthropic.engine(
            Reply.tool_calls(("echo", {"text": "hi"}), ("add", {"a": 2, "b": 3})),
            Reply.text("Not allowed, then."))
        paused = await engine.run(operation(), "go", tools=server.tools)
        assert paused.outcome is le.Outcome.PAUSED
        (pending,) = paused.pending
        assert pending.tool == "add"
        assert paused.state is not None
        resumed = await engine.resume(paused.state,
                                      decisions={pending.id: le.Deny("no sums today")},
                                      tools=server.tools)
    assert resumed.outcome is le.Outcome.COMPLETED
    echoed, denied = tool_results(anthropic.requests[1])
    assert content_text(echoed) == "hi"
    assert denied["is_error"] is True
    assert "no sums today" in content_text(denied) and "5" not in content_text(denied)


async def test_a_per_call_approval_callable_sees_the_prefixed_call(
    anthropic: Harness,
) -> None:
    """A callable per call (given for one tool by a mapping) decides from the call:
    only the calls it flags pause; the tool's name is the prefixed one."""
    seen: list[Any] = []

    def big_sums(call: Any) -> bool:
        seen.append(call)
        return bool(call.input["a"] > 100)

    async with script_server(prefix="t_", allow={"add", "echo"},
                             approval={"add": big_sums}, idempotent={"echo"}) as server:
        tools = by_name(server)
        assert tools["t_echo"].idempotent is True and tools["t_add"].idempotent is False
        engine, _ = anthropic.engine(
            Reply.tool_calls(("t_add", {"a": 1, "b": 2})),
            Reply.tool_calls(("t_add", {"a": 500, "b": 2})),
            Reply.text("done"))
        paused = await engine.run(operation(), "go", tools=server.tools)
        assert paused.outcome is le.Outcome.PAUSED
        (small,) = tool_results(anthropic.requests[1])
        assert content_text(small) == "3"
        (pending,) = paused.pending
        assert pending.input == {"a": 500, "b": 2}
        assert paused.state is not None
        resumed = await engine.resume(paused.state, decisions={pending.id: le.Approve()},
                                      tools=server.tools)
    assert resumed.outcome is le.Outcome.COMPLETED
    (big,) = tool_results(anthropic.requests[2])
    assert content_text(big) == "502"
    assert [c.tool for c in seen] == ["t_add", "t_add"]


async def test_approval_naming_a_tool_the_server_lacks_is_a_config_error() -> None:
    """A typo in approval= or idempotent= is caught at ``async with``, as allow= is."""
    with pytest.raises(le.ConfigError, match="has no tool get_time") as raised:
        async with time_server(approval={"get_time"}):
            pass
    assert raised.value.field == "approval"
    with pytest.raises(le.ConfigError, match="has no tool nope") as raised:
        async with time_server(idempotent={"nope": True}):
            pass
    assert raised.value.field == "idempotent"


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"approval": "get_current_time"}, "approval"),
    ({"approval": 1}, "approval"),
    ({"approval": {"get_current_time": "yes"}}, "approval['get_current_time']"),
    ({"idempotent": lambda call: True}, "idempotent"),
    ({"idempotent": {"get_current_time": None}}, "idempotent['get_current_time']"),
    ({"approval": {1: True}}, "approval"),
])
def test_a_bad_approval_or_idempotent_setting_is_a_config_error(
    kwargs: dict[str, Any], field: str,
) -> None:
    """Refused when the server is built, naming the argument."""
    with pytest.raises(le.ConfigError) as raised:
        time_server(**kwargs)
    assert raised.value.field == field
