"""MCP servers' tools in runs: through the real ``mcp`` SDK, against real servers
(``mcp-server-time`` over stdio; tests/mcp/server.py, on the SDK's own server
classes, over stdio and streamable HTTP), on both providers' wire formats.

Timeouts here are a tool that never answers, bounded by the tool's timeout or
the run's deadline on the real clock (the engine's only clock that expires).
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client, StdioServerParameters

import loopengine as le
from loopengine import audit, events
from loopengine.mcp import MCPServer, MCPServerError
from loopengine.persistence import SQLiteLedger
from loopengine.providers import ScriptedProvider
from loopengine.testing import RecordedRequest, Reply

from ..adapter.conftest import Harness, tool_results
from ..clock_support import ExpiringClock
from ..conftest import PRICES, operation
from ..openai.conftest import OpenAIHarness, openai_operation, tool_messages
from .conftest import SCRIPT, HttpServer, script_server, time_server

pytestmark = [pytest.mark.slow, pytest.mark.realtime]


def content_text(result: dict[str, Any]) -> str:
    """A tool_result block's text, whether its content is a string or blocks."""
    content = result["content"]
    if isinstance(content, str):
        return content
    return "\n".join(b["text"] for b in content if b["type"] == "text")


def by_name(server: MCPServer) -> dict[str, le.Tool]:
    return {t.name: t for t in server.tools}


def audited_in_doubt(path: Path) -> list[tuple[str, str]]:
    """``audit reconcile``'s tool calls in doubt in the ledger file: ``(tool, status)``."""
    conn = audit.open_ledger(path)
    try:
        return [(c["tool"], c["status"]) for c in audit.reconcile(conn).in_doubt]
    finally:
        conn.close()


async def test_tools_are_listed_as_the_server_publishes_them() -> None:
    """Name, description and input schema are the server's own, read through the SDK."""
    parameters = StdioServerParameters(
        command=sys.executable, args=["-m", "mcp_server_time", "--local-timezone", "UTC"])
    async with Client(parameters, cache=None) as client:
        published = (await client.list_tools()).tools
    async with time_server() as server:
        assert [(t.name, t.description, t.input_schema) for t in server.tools] == [
            (t.name, t.description, t.input_schema) for t in published]
        assert {t.name for t in server.tools} == {"get_current_time", "convert_time"}
        assert all(t.timeout is None and t.max_calls is None for t in server.tools)


async def test_a_run_calls_the_time_server_through_anthropic(anthropic: Harness) -> None:
    """The model's call reaches the server and its answer comes back as the tool result."""
    async with time_server() as server:
        engine, _ = anthropic.engine(
            Reply.tool_calls(("get_current_time", {"timezone": "Asia/Tokyo"})),
            Reply.text("It is late in Tokyo."))
        result = await engine.run(operation(), "Time in Tokyo?", tools=server.tools)
    assert result.outcome is le.Outcome.COMPLETED
    assert {t["name"] for t in anthropic.requests[0].body["tools"]} == {
        "get_current_time", "convert_time"}
    (answer,) = tool_results(anthropic.requests[1])
    assert "is_error" not in answer
    assert json.loads(content_text(answer))["timezone"] == "Asia/Tokyo"


async def test_a_run_calls_the_time_server_through_openai(openai: OpenAIHarness) -> None:
    """The same through OpenAIProvider: the feature does not depend on the provider."""
    async with time_server() as server:
        engine, _ = openai.engine(
            Reply.tool_calls(("convert_time", {"source_timezone": "UTC", "time": "12:00",
                                               "target_timezone": "Europe/Paris"})),
            Reply.text("13:00 in Paris."))
        result = await engine.run(openai_operation(), "Noon UTC in Paris?", tools=server.tools)
    assert result.outcome is le.Outcome.COMPLETED
    sent = [t["function"]["name"] for t in openai.requests[0].body["tools"]]
    assert sorted(sent) == ["convert_time", "get_current_time"]
    (answer,) = tool_messages(openai.requests[1])
    converted = json.loads(answer["content"])
    assert converted["target"]["timezone"] == "Europe/Paris"
    assert converted["target"]["datetime"].endswith("+01:00") or \
        converted["target"]["datetime"].endswith("+02:00")


async def test_prefix_and_allow_list(http_server: HttpServer, anthropic: Harness) -> None:
    """Two servers, prefixed, one narrowed to an allow-list: each call goes to its server."""
    async with time_server(prefix="clock_") as clock, \
            MCPServer.http(http_server.url, prefix="test_", allow={"echo", "add"}) as test:
        assert {t.name for t in clock.tools} == {"clock_get_current_time", "clock_convert_time"}
        assert {t.name for t in test.tools} == {"test_echo", "test_add"}
        engine, _ = anthropic.engine(
            Reply.tool_calls(("clock_get_current_time", {"timezone": "UTC"}),
                             ("test_add", {"a": 2, "b": 3}), ("test_pid", {})),
            Reply.text("done"))
        result = await engine.run(operation(), "go", tools=[*clock.tools, *test.tools])
    assert result.outcome is le.Outcome.COMPLETED
    now, total, unknown = tool_results(anthropic.requests[1])
    assert json.loads(content_text(now))["timezone"] == "UTC"
    assert content_text(total) == "5"
    assert unknown["is_error"] is True and "There is no tool named 'test_pid'" in \
        content_text(unknown)


async def test_http_headers_go_with_every_call(http_server: HttpServer) -> None:
    """``headers=`` reach the server on each call (an Authorization header, say)."""
    async with MCPServer.http(http_server.url, headers={"Authorization": "Bearer t0k3n"},
                              allow={"header"}) as server:
        (header,) = server.tools
        assert await header.invoke({"name": "authorization"}) == "Bearer t0k3n"


async def test_an_allow_list_naming_a_missing_tool_is_a_config_error() -> None:
    """A typo in ``allow`` is caught at ``async with``, not at the model's first call."""
    with pytest.raises(le.ConfigError, match="has no tool nope"):
        async with time_server(allow={"get_current_time", "nope"}):
            pass


async def test_is_error_becomes_an_is_error_result(anthropic: Harness) -> None:
    """An MCP result with isError is an is_error tool result with its text; the run goes on."""
    async with time_server() as server, script_server() as test:
        engine, _ = anthropic.engine(
            Reply.tool_calls(("get_current_time", {"timezone": "Mars/Olympus"}),
                             ("fail", {"message": "the disk is full"})),
            Reply.text("Sorry."))
        result = await engine.run(operation(), "go", tools=[*server.tools, *test.tools])
    assert result.outcome is le.Outcome.COMPLETED
    zone, failed = tool_results(anthropic.requests[1])
    assert zone["is_error"] is True and "Mars/Olympus" in content_text(zone)
    assert failed["is_error"] is True
    assert content_text(failed) == "Error executing tool fail: the disk is full"


async def test_images_and_structured_content_map_to_blocks(anthropic: Harness) -> None:
    """Text and an image become text and image blocks; structured content that the
    server mirrors as text is given once."""
    async with script_server() as test:
        engine, _ = anthropic.engine(
            Reply.tool_calls(("picture", {}), ("add", {"a": 1, "b": 1})), Reply.text("ok"))
        result = await engine.run(operation(), "go", tools=test.tools)
    assert result.outcome is le.Outcome.COMPLETED
    picture, total = tool_results(anthropic.requests[1])
    text, image = picture["content"]
    assert text == {"type": "text", "text": "a dot"}
    assert image["type"] == "image" and image["source"]["media_type"] == "image/png"
    assert total["content"] == "2"


async def test_an_image_result_on_the_openai_route_is_a_note_beside_its_text(
    openai: OpenAIHarness,
) -> None:
    """Chat Completions tool messages carry text only: the MCP result's caption is
    kept and its PNG becomes a note naming its type and size; the run completes."""
    async with script_server(allow={"picture"}) as test:
        engine, _ = openai.engine(Reply.tool_calls(("picture", {})), Reply.text("A dot."))
        result = await engine.run(openai_operation(), "go", tools=test.tools)
    assert result.outcome is le.Outcome.COMPLETED
    (answer,) = tool_messages(openai.requests[1])
    assert answer["content"] == "a dot\n\n[image: image/png, 70 bytes, not shown]"


async def test_other_content_kinds_map_to_documents_or_described_text(
    anthropic: Harness,
) -> None:
    """A PDF becomes a document block, embedded text its text; audio, links and images
    the API cannot show become text saying what they were; structured content alone
    becomes its JSON."""
    async with script_server() as test:
        engine, _ = anthropic.engine(Reply.tool_calls(("kinds", {}), ("structured", {})),
                                     Reply.text("ok"))
        result = await engine.run(operation(), "go", tools=test.tools)
    assert result.outcome is le.Outcome.COMPLETED
    kinds, structured = tool_results(anthropic.requests[1])
    audio, link, text, pdf, bmp = kinds["content"]
    assert audio == {"type": "text", "text": "[audio: audio/wav, 8 bytes, not shown]"}
    assert link == {"type": "text",
                    "text": "[resource link file:///notes.txt (notes): the notes]"}
    assert text == {"type": "text", "text": "embedded text"}
    assert pdf["type"] == "document" and pdf["source"]["media_type"] == "application/pdf"
    assert bmp == {"type": "text", "text": "[image: image/bmp, 4 bytes, not shown]"}
    assert json.loads(structured["content"]) == {"total": 3, "unit": "kg"}


async def test_binary_content_that_is_not_base64_is_a_note_not_a_block(
    anthropic: Harness,
) -> None:
    """An image, or an embedded PDF, whose data is not base64 would make the API
    refuse the whole next request (ending the run): the model reads a note in its
    place, and the run completes."""
    async with MCPServer.stdio(sys.executable, [SCRIPT, "odd"], allow={"garbled"}) as odd:
        engine, _ = anthropic.engine(Reply.tool_calls(("garbled", {})), Reply.text("ok"))
        result = await engine.run(operation(), "go", tools=odd.tools)
    assert result.outcome is le.Outcome.COMPLETED
    (garbled,) = tool_results(anthropic.requests[1])
    assert garbled["content"] == [
        {"type": "text", "text": "[image: image/png, undecodable base64, not shown]"},
        {"type": "text",
         "text": "[resource file:///a.pdf: application/pdf, undecodable base64, not shown]"}]


async def test_max_calls_and_the_tool_budget_apply(anthropic: Harness) -> None:
    """A Tool built from an MCP tool takes a per-tool cap; the run's tool budget counts
    MCP calls like any others."""
    async with script_server() as test:
        echo = by_name(test)["echo"]
        capped = le.Tool(echo.name, echo.description, echo.input_schema, echo.handler,
                         max_calls=1)
        engine, _ = anthropic.engine(
            Reply.tool_calls(("echo", {"text": "one"}), ("echo", {"text": "two"})),
            Reply.tool_calls(("add", {"a": 1, "b": 2})), Reply.text("never sent"))
        result = await engine.run(operation(max_tool_calls=2), "go",
                                  tools=[capped, by_name(test)["add"]])
    assert result.outcome is le.Outcome.TOOL_LIMIT
    one, two = tool_results(anthropic.requests[1])
    assert content_text(one) == "one"
    assert two["is_error"] is True and "at most 1 times" in content_text(two)
    assert len(anthropic.requests) == 2


async def test_a_server_killed_mid_call_gives_an_error_and_the_next_call_reconnects(
    anthropic: Harness, caplog: pytest.LogCaptureFixture,
) -> None:
    """The call in flight gets an is_error result at once; the next call opens a new
    session (a new process) and is answered."""
    caplog.set_level(logging.INFO, logger="loopengine")
    async with script_server() as test:
        engine, _ = anthropic.engine(
            Reply.tool_calls(("pid", {})), Reply.tool_calls(("crash", {})),
            Reply.tool_calls(("pid", {})), Reply.text("done"))
        result = await engine.run(operation(), "go", tools=test.tools)
    assert result.outcome is le.Outcome.COMPLETED
    (first,) = tool_results(anthropic.requests[1])
    (crashed,) = tool_results(anthropic.requests[2])
    (second,) = tool_results(anthropic.requests[3])
    assert crashed["is_error"] is True
    assert "closed the connection during the call" in content_text(crashed)
    assert int(content_text(first)) != int(content_text(second))
    assert caplog.text.count("opening a new session") == 1
    with pytest.raises(ProcessLookupError):
        os.kill(int(content_text(first)), 0)


async def test_a_hanging_tool_ends_at_its_timeout_and_the_run_goes_on(
    anthropic: Harness, tmp_path: Path,
) -> None:
    """A call that never answers gets an is_error result at the tool's timeout; the next
    call is answered on a new session (the echo tool has no timeout of its own, so
    starting the server again is bounded by the run's deadline, not by 2 s). With a
    run store the call cut, whose result is not known, is recorded ``in_doubt``
    (`audit reconcile` lists it), the next ``succeeded``."""
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as ledger:
        store = le.RunStore(ledger)
        async with script_server(allow={"hang", "echo"}) as test:
            hang, echo = by_name(test)["hang"], by_name(test)["echo"]
            hang = le.Tool(hang.name, hang.description, hang.input_schema, hang.handler,
                           timeout=2)
            engine, _ = anthropic.engine(
                Reply.tool_calls(("hang", {})), Reply.tool_calls(("echo", {"text": "back"})),
                Reply.text("done"), ledger=ledger, run_store=store)
            began = time.monotonic()
            result = await engine.run(operation(total_time=60), "go", tools=[hang, echo])
            took = time.monotonic() - began
        statuses = await store.tool_calls(result.invocation_id)
    assert result.outcome is le.Outcome.COMPLETED
    assert sorted(statuses.values()) == ["in_doubt", "succeeded"]
    assert audited_in_doubt(path) == [("hang", "in_doubt")]
    (hung,) = tool_results(anthropic.requests[1])
    assert hung["is_error"] is True
    assert "did not finish within its timeout of 2s" in content_text(hung)
    (echoed,) = tool_results(anthropic.requests[2])
    assert content_text(echoed) == "back"
    assert 2 <= took < 60


async def test_a_hanging_tool_without_a_timeout_ends_at_the_run_deadline(
    openai: OpenAIHarness,
) -> None:
    """With no tool timeout, the run's deadline bounds the call: the run ends time_limit.
    The deadline passes on a clock the test moves once the call hangs (on the
    real clock, a busy machine could spend the run's seconds before it)."""
    clock = ExpiringClock()
    started = anyio.Event()

    def call_started(event: events.Event) -> None:
        if isinstance(event, events.ToolCallEvent) and event.status == "started":
            started.set()

    async with script_server() as test:
        engine, _ = openai.engine(Reply.tool_calls(("hang", {})), Reply.text("never sent"),
                                  clock=clock, observers=[call_started])
        ended: list[le.RunResult] = []

        async def run() -> None:
            ended.append(await engine.run(openai_operation(total_time=4), "go",
                                          tools=test.tools))

        async with anyio.create_task_group() as group:
            group.start_soon(run)
            await started.wait()  # the run is in the call (this task runs once it waits)
            clock.advance(4)
    (result,) = ended
    assert result.outcome is le.Outcome.TIME_LIMIT
    assert len(openai.requests) == 1


async def test_a_server_that_exits_at_start_is_a_clear_error() -> None:
    """``async with`` raises MCPServerError naming the server; nothing is left running."""
    server = MCPServer.stdio(sys.executable, [SCRIPT, "exit"])
    with pytest.raises(MCPServerError, match="server.py exit"):
        async with server:
            pass
    with pytest.raises(RuntimeError, match="inside `async with server:`"):
        _ = server.tools


async def test_tools_used_after_the_block_give_an_error_result(anthropic: Harness) -> None:
    """A tool kept past ``async with`` is answered with an error, not a hang."""
    async with script_server() as test:
        tools = test.tools
    engine, _ = anthropic.engine(Reply.tool_calls(("echo", {"text": "late"})),
                                 Reply.text("done"))
    result = await engine.run(operation(), "go", tools=tools)
    assert result.outcome is le.Outcome.COMPLETED
    (late,) = tool_results(anthropic.requests[1])
    assert late["is_error"] is True
    assert content_text(late) == "the MCP server could not be reached: it is closed"


async def test_an_http_server_killed_mid_call_then_restarted(
    http_server: HttpServer, anthropic: Harness,
) -> None:
    """Over HTTP too: the call in flight fails, a call while the server is down fails
    fast, and once it is back the next call reconnects."""
    async with MCPServer.http(http_server.url) as test:
        tools = test.tools
        engine, _ = anthropic.engine(Reply.tool_calls(("crash", {})),
                                     Reply.tool_calls(("echo", {"text": "up"})),
                                     Reply.text("done"))
        result = await engine.run(operation(), "go", tools=tools)
        assert result.outcome is le.Outcome.COMPLETED
        (crashed,) = tool_results(anthropic.requests[1])
        (echoed,) = tool_results(anthropic.requests[2])
        assert crashed["is_error"] is True and "the result is not known" in \
            content_text(crashed)
        assert echoed["is_error"] is True
        http_server.kill()
        http_server.start()
        engine, _ = anthropic.engine(Reply.tool_calls(("echo", {"text": "back"})),
                                     Reply.text("done"))
        result = await engine.run(operation(), "go", tools=tools)
    (back,) = tool_results(anthropic.requests[4])
    assert content_text(back) == "back"


async def test_200_concurrent_runs_share_one_http_server(
    http_server: HttpServer, anthropic: Harness, caplog: pytest.LogCaptureFixture,
) -> None:
    """One MCPServer, one session, 200 runs calling it at once: every call is answered
    with its own run's input."""

    def respond(request: RecordedRequest) -> Reply:
        last = request.messages[-1]["content"]
        if isinstance(last, str):
            return Reply.tool_calls(("echo", {"text": last}))
        (result,) = [b for b in last if b.get("type") == "tool_result"]
        return Reply.text(f"heard {content_text(result)}")

    caplog.set_level(logging.INFO, logger="loopengine")
    async with MCPServer.http(http_server.url, allow={"echo"}, timeout=30) as test:
        engine, _ = anthropic.engine(*[respond] * 400)
        outcomes: dict[int, le.RunResult] = {}

        async def one(n: int) -> None:
            outcomes[n] = await engine.run(operation(), f"run-{n}", tools=test.tools)

        began = time.monotonic()
        with anyio.fail_after(60):
            async with anyio.create_task_group() as group:
                for n in range(200):
                    group.start_soon(one, n)
        took = time.monotonic() - began
    assert len(outcomes) == 200
    assert "opening a new session" not in caplog.text  # one session served them all
    assert all(r.outcome is le.Outcome.COMPLETED for r in outcomes.values())
    assert sorted(r.answer for r in outcomes.values()) == sorted(
        f"heard run-{n}" for n in range(200))
    print(f"200 concurrent runs on one MCP HTTP server: {took:.2f}s")


async def test_closing_after_a_run_cancelled_mid_call_stops_the_process(
    anthropic: Harness,
) -> None:
    """A run cancelled while its call hangs on the server, then the server closed: the
    run's cancellation propagates, and the server's process is gone. The caller
    cancels once the call has started (after a real second, a busy machine could
    still be on the first request)."""
    scope = anyio.CancelScope()

    def cancel_once_hanging(event: events.Event) -> None:
        if isinstance(event, events.ToolCallEvent) and event.status == "started":
            scope.cancel()

    async with script_server() as test:
        pid = int(await by_name(test)["pid"].invoke({}))
        engine, _ = anthropic.engine(Reply.tool_calls(("hang", {})), Reply.text("never"),
                                     observers=[cancel_once_hanging])
        with scope:
            await engine.run(operation(), "go", tools=test.tools)
        assert scope.cancelled_caught
        assert len(anthropic.requests) == 1  # cut in the call: nothing sent after it
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_run_on_trio_calls_the_time_server() -> None:
    """The session and its calls work on trio as on asyncio (the SDK is on anyio)."""

    async def main() -> le.RunResult:
        provider = ScriptedProvider([
            Reply.tool_calls(("get_current_time", {"timezone": "Europe/Berlin"})),
            Reply.text("done")])
        async with time_server(timeout=10) as server:
            result = await le.Engine(provider, prices=PRICES).run(
                operation(), "go", tools=server.tools)
        (answer,) = provider.requests[1].messages[-1]["content"]
        assert json.loads(answer["content"])["timezone"] == "Europe/Berlin"
        return result

    assert anyio.run(main, backend="trio").outcome is le.Outcome.COMPLETED


def test_the_module_exports_exactly_its_public_names() -> None:
    """``loopengine.mcp.__all__`` is its public names, each documented."""
    module = importlib.import_module("loopengine.mcp")
    public = {name for name, value in vars(module).items()
              if not name.startswith("_") and not inspect.ismodule(value)
              and getattr(value, "__module__", "loopengine.mcp") == "loopengine.mcp"}
    # Its errors are the error tree's (loopengine._errors), re-exported here.
    assert set(module.__all__) == public - {"annotations", "logger"} | {
        "MCPServerError", "MCPToolError"}
    assert module.MCPServerError is le.MCPServerError
    for name in module.__all__:
        value = getattr(module, name)
        if inspect.isclass(value):
            assert (value.__doc__ or "").strip(), name


@pytest.mark.parametrize("build", [
    lambda: MCPServer.stdio(None),  # type: ignore[arg-type]
    lambda: MCPServer.stdio("python", [1]),  # type: ignore[list-item]
    lambda: MCPServer.stdio("python", env={"A": 1}),  # type: ignore[dict-item]
    lambda: MCPServer.http(5),  # type: ignore[arg-type]
    lambda: MCPServer.http("ftp://example.invalid/mcp"),
    lambda: MCPServer.http("http://127.0.0.1:1/mcp", headers=[("a", "b")]),  # type: ignore[arg-type]
])
def test_a_bad_server_argument_is_a_config_error(build: Any) -> None:
    """A server's bad arguments are a ConfigError naming the argument, never the
    SDK's own validation error."""
    with pytest.raises(le.ConfigError) as raised:
        build()
    assert raised.value.field


@pytest.mark.parametrize(("build", "field"), [
    (lambda: MCPServer.stdio("python", allow=3), "allow"),  # type: ignore[arg-type]
    (lambda: MCPServer.stdio("python", allow=[3]), "allow[0]"),  # type: ignore[list-item]
    (lambda: MCPServer.stdio("python", prefix="a b"), "prefix"),
    (lambda: MCPServer.stdio("python", prefix="x" * 65), "prefix"),
    (lambda: MCPServer.stdio("python", prefx="a_"), "prefx"),  # type: ignore[call-arg]
    (lambda: MCPServer.http("http://127.0.0.1:1/mcp", timout=3), "timout"),  # type: ignore[call-arg]
    (lambda: MCPServer(3, label="x"), "transport"),  # type: ignore[arg-type]
    (lambda: MCPServer(script_server()._transport, label=""), "label"),
])
def test_a_server_argument_no_tool_list_could_use_is_refused_before_it_starts(
    build: Any, field: str
) -> None:
    """``allow=3`` (a TypeError), ``allow=[3]`` and a prefix no tool name can start
    with (refused only at ``async with``, once the server had started), a misspelt
    setting given to ``stdio``/``http`` (a bare TypeError), a transport that cannot
    be called and an empty label are ConfigErrors when the server is built."""
    with pytest.raises(le.ConfigError) as raised:
        build()
    assert raised.value.field == field
