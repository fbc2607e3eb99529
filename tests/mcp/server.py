"""An MCP server built with the ``mcp`` SDK's own `MCPServer` class, for the tests.

Run as ``python server.py stdio``, ``python server.py legacy`` (stdio, the
2025 handshake era only), ``python server.py http [PORT]`` (prints
the port it listens on, 127.0.0.1, then serves ``/mcp``, and ``/legacy/mcp`` in
the handshake era only, behind a gateway: `GATEWAY`) or ``python
server.py exit`` (a server that exits before it answers anything) or ``python
server.py mute`` (one that reads its input but never answers) or ``python
server.py odd`` (stdio, on the SDK's low-level server class: results the
high-level one would refuse, and a call always under way) or ``python
server.py garbled`` (stdio, JSON-RPC lines written by hand, handshake era:
its ``garbled`` tool answers with a result no SDK server would send, text
content without its text; ``pid`` answers soundly).
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import sys
from collections.abc import Callable
from typing import Any

import anyio
import mcp_types
import uvicorn
from mcp.server.lowlevel import Server as LowLevelServer
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.subscriptions import InMemorySubscriptionBus, ListenHandler

# A 1x1 transparent PNG.
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
)

class Server(MCPServer):
    """The SDK's server, telling a waiting tool when a client lists the tools."""

    listed: anyio.Event | None = None
    failing = 0
    """How many of the next listings fail."""

    async def list_tools(self) -> list[mcp_types.Tool]:
        if self.failing:
            self.failing -= 1
            tools = None
        else:
            tools = await super().list_tools()
        if self.listed is not None:
            self.listed.set()
        if tools is None:
            raise RuntimeError("the tools cannot be listed now")
        return tools


bus = InMemorySubscriptionBus()
server = Server("loopengine-test", subscriptions=bus)
# The SDK's own listen handler, held here so that `end_listens` can close its streams.
listens = ListenHandler(bus)
server._lowlevel_server.add_request_handler(
    "subscriptions/listen", mcp_types.SubscriptionsListenRequestParams, listens)


def _added(name: str) -> Callable[[str], str]:
    def added(text: str) -> str:
        return f"{name} heard {text}"

    return added


@server.tool()
async def change(ctx: Context, add: str = "", drop: str = "", require: str = "",
                 fail: int = 0) -> str:
    """Change this server's tools: add a tool named ``add`` (input ``text``), drop the
    tool ``drop``, and make ``echo`` require the property ``require`` too; make the
    next ``fail`` listings fail; announce the change, and answer once the client
    has listed the tools again (or tried to)."""
    if add:
        server.add_tool(_added(add), name=add, description=f"The {add} tool.")
    if drop:
        server.remove_tool(drop)
    if require:
        server.remove_tool("echo")

        def echo(text: str, extra: str) -> str:
            return text + extra

        server.add_tool(echo, name="echo", description="Say the text back, and more.")
    server.failing = fail
    server.listed = anyio.Event()
    # The 2026 protocol announces it on the client's listen stream; the handshake
    # era on the session (each is a no-op on the other's connections).
    await ctx.notify_tools_changed()
    await ctx.session.send_tool_list_changed()
    with anyio.fail_after(30):
        await server.listed.wait()
    return "changed"


@server.tool()
async def end_listens() -> str:
    """End every client's listen stream, as a server does on its own, and answer once
    a client has listed the tools again (which a client that listens again does)."""
    server.listed = anyio.Event()
    listens.close()
    with anyio.fail_after(30):
        await server.listed.wait()
    return "ended"


@server.tool()
def echo(text: str) -> str:
    """Say the text back."""
    return text


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def picture() -> list[mcp_types.TextContent | mcp_types.ImageContent]:
    """A caption and a tiny PNG."""
    return [mcp_types.TextContent(text="a dot"),
            mcp_types.ImageContent(data=base64.b64encode(PNG).decode(), mime_type="image/png")]


@server.tool()
def kinds() -> mcp_types.CallToolResult:
    """One of each other kind of content."""
    pdf = base64.b64encode(b"%PDF-1.4 tiny").decode()
    return mcp_types.CallToolResult(content=[
        mcp_types.AudioContent(data=base64.b64encode(b"RIFF0000").decode(),
                               mime_type="audio/wav"),
        mcp_types.ResourceLink(uri="file:///notes.txt", name="notes", description="the notes"),
        mcp_types.EmbeddedResource(resource=mcp_types.TextResourceContents(
            uri="file:///a.txt", text="embedded text")),
        mcp_types.EmbeddedResource(resource=mcp_types.BlobResourceContents(
            uri="file:///a.pdf", blob=pdf, mime_type="application/pdf")),
        mcp_types.ImageContent(data=base64.b64encode(b"BM12").decode(), mime_type="image/bmp"),
    ])


@server.tool()
def structured() -> mcp_types.CallToolResult:
    """Structured content and nothing else."""
    return mcp_types.CallToolResult(content=[], structured_content={"total": 3, "unit": "kg"})


@server.tool()
def fail(message: str) -> str:
    """Fail with the message."""
    raise ToolError(message)


@server.tool()
async def hang() -> str:
    """Never answer."""
    await anyio.sleep_forever()
    raise AssertionError("unreachable")


@server.tool()
def crash() -> str:
    """Kill this server's own process in the middle of the call."""
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable")


@server.tool()
def pid() -> int:
    """This server's process id."""
    return os.getpid()


@server.tool()
def header(name: str, ctx: Context) -> str:
    """The value of one header of this call's HTTP request (empty over stdio)."""
    request = ctx.request_context.request
    return "" if request is None else str(request.headers.get(name, ""))


# A server on the SDK's low-level class, whose results its high-level one would
# not let out: structured content its output schema refuses, an image whose
# data is not base64.
async def _odd_list(ctx: Any, params: Any) -> mcp_types.ListToolsResult:
    return mcp_types.ListToolsResult(tools=[
        mcp_types.Tool(name="mismatched", description="A total, misreported.",
                       input_schema={"type": "object"},
                       output_schema={"type": "object", "properties": {"n": {"type": "integer"}},
                                      "required": ["n"]}),
        mcp_types.Tool(name="garbled", description="An image that is not base64.",
                       input_schema={"type": "object"}),
        mcp_types.Tool(name="pid", description="This server's process id.",
                       input_schema={"type": "object"}),
        mcp_types.Tool(name="working", description="Still working, every time it is asked.",
                       input_schema={"type": "object"}),
    ])


async def _odd_call(ctx: Any, params: Any,
                    ) -> mcp_types.CallToolResult | mcp_types.InputRequiredResult:
    if params.name == "working":
        # A call under way: the client is to ask again, with the state, later.
        return mcp_types.InputRequiredResult(request_state="under way")
    if params.name == "mismatched":
        return mcp_types.CallToolResult(content=[mcp_types.TextContent(text='{"n": "three"}')],
                                        structured_content={"n": "three"})
    if params.name == "garbled":
        return mcp_types.CallToolResult(content=[
            mcp_types.ImageContent(data="not base64!", mime_type="image/png"),
            mcp_types.EmbeddedResource(resource=mcp_types.BlobResourceContents(
                uri="file:///a.pdf", blob="%PDF raw", mime_type="application/pdf"))])
    return mcp_types.CallToolResult(content=[mcp_types.TextContent(text=str(os.getpid()))])


odd = LowLevelServer("loopengine-odd", on_list_tools=_odd_list, on_call_tool=_odd_call)


# A process started while the file named by LOOPENGINE_TEST_MARKER exists has one
# more tool (a server started again with other tools).
if os.path.exists(os.environ.get("LOOPENGINE_TEST_MARKER", "\0")):
    server.add_tool(_added("reborn"), name="reborn", description="Only in a later process.")


gateway_calls = 0
"""Calls of ``gated`` this process ran."""


@server.tool()
def gated(reply: str) -> str:
    """Run, behind a gateway that answers the client as ``reply`` names (`GATEWAY`)."""
    global gateway_calls
    gateway_calls += 1
    return "ran"


@server.tool()
def gateway_count() -> int:
    """How many calls of ``gated`` this process ran."""
    return gateway_calls


GATEWAY: dict[str, tuple[bool, int, list[tuple[bytes, bytes]], bytes]] = {
    # A gateway that stopped waiting: an error status, no JSON-RPC body.
    "504": (True, 504, [(b"content-type", b"text/plain")], b"gateway timeout"),
    # One that queued the call.
    "202": (True, 202, [(b"content-type", b"text/plain")], b""),
    # A reply cut short or mangled on its way: a body that is not JSON, an event
    # stream whose message is not JSON, a page of another kind.
    "json": (True, 200, [(b"content-type", b"application/json")], b'{"jsonrpc": "2.0", "id'),
    "sse": (True, 200, [(b"content-type", b"text/event-stream")],
            b"event: message\ndata: {not json\n\n"),
    "html": (True, 200, [(b"content-type", b"text/html")], b"<p>accepted</p>"),
    # See Other: the request was processed, its outcome is elsewhere.
    "303": (True, 303, [(b"content-type", b"text/plain"),
                        (b"location", b"http://outcome.invalid/calls/1")], b""),
    # A 404 in plain text, the request never passed on (on a session: the
    # session is gone).
    "404": (False, 404, [(b"content-type", b"text/plain")], b"not found"),
}
"""How the gateway in front of the HTTP server (`_gateway`) answers a ``tools/call`` of
``gated``, by its ``reply``: whether it passes the call on to the server (which runs
it), then the status, headers and body it answers the client with."""


def _gateway(app: Any) -> Any:
    """``app`` behind a gateway that, for a ``tools/call`` of ``gated``, answers as
    `GATEWAY` says (after letting the server run it, or not), and that serves the
    handshake era only at ``/legacy/mcp`` (it refuses the 2026 protocol's
    ``server/discover`` there, as a server that predates it does, so the client
    opens a session with ``initialize``); every other request passes through."""

    async def gateway(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/legacy/"):
            scope = dict(scope, path=scope["path"][len("/legacy"):],
                         raw_path=scope["raw_path"][len(b"/legacy"):])
            legacy = True
        else:
            legacy = False
        if scope["type"] != "http" or scope["method"] != "POST":
            await app(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        request = json.loads(body)
        if not isinstance(request, dict):
            request = {}
        params = request.get("params") or {}
        if legacy and request.get("method") == "server/discover":
            answer: tuple[bool, int, list[tuple[bytes, bytes]], bytes] | None = \
                (False, 404, [(b"content-type", b"text/plain")], b"not found")
        elif request.get("method") == "tools/call" and params.get("name") == "gated":
            answer = GATEWAY[params["arguments"]["reply"]]
        else:
            answer = None
        if answer is None:
            await app(scope, replay, send)
            return
        passed_on, status, headers, reply = answer

        async def dropped(message: Any) -> None:
            pass

        if passed_on:
            await app(scope, replay, dropped)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": reply})

    return gateway


http_server: uvicorn.Server | None = None
"""The HTTP server serving this process (``http`` mode), for ``vanish``."""


@server.tool()
async def vanish(ctx: Context) -> str | mcp_types.InputRequiredResult:
    """Ask for the call again later ("input required", with only a state), having
    first stopped taking connections (over HTTP: no new ones are accepted, idle
    ones are closed, this one closes after its answer), so that the next round
    cannot connect; a round that reaches it anyway answers "asked again"."""
    if ctx.request_state is not None:
        return "asked again"
    if http_server is not None:
        for listening in http_server.servers:
            listening.close()
        for connection in list(http_server.server_state.connections):
            connection.shutdown()
    return mcp_types.InputRequiredResult(request_state="asked")


def serve_http(port: int) -> None:
    global http_server
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # A restarted server takes the port back at once (tests/mcp's reconnection).
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(512)
    print(listener.getsockname()[1], flush=True)
    config = uvicorn.Config(_gateway(server.streamable_http_app()), log_level="warning")
    http_server = served = uvicorn.Server(config)
    anyio.run(lambda: served.serve(sockets=[listener]))


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "stdio":
        server.run("stdio")
    elif mode == "http":
        serve_http(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
    elif mode == "legacy":
        # The handshake era only (2025 protocol): a change is announced on the session.
        from mcp.server.lowlevel.server import NotificationOptions
        from mcp.server.runner import serve_loop
        from mcp.server.stdio import stdio_server

        async def legacy() -> None:
            lowlevel = server._lowlevel_server
            options = lowlevel.create_initialization_options(
                NotificationOptions(tools_changed=True))
            async with stdio_server() as (read, write), lowlevel.lifespan(lowlevel) as state:
                await serve_loop(lowlevel, read, write, lifespan_state=state,
                                 init_options=options)

        anyio.run(legacy)
    elif mode == "odd":
        from mcp.server.stdio import stdio_server

        async def serve_odd() -> None:
            async with stdio_server() as (read, write):
                await odd.run(read, write, odd.create_initialization_options())

        anyio.run(serve_odd)
    elif mode == "garbled":
        # The SDK's servers check their own results, so this one writes the wire
        # format itself; the SDK's client falls back to the handshake era when
        # its discovery request gets an error.
        def answer(ident: object, result: object) -> None:
            print(json.dumps({"jsonrpc": "2.0", "id": ident, "result": result}), flush=True)

        for line in sys.stdin:
            request = json.loads(line)
            ident, method = request.get("id"), request.get("method")
            if ident is None:
                continue
            if method == "initialize":
                answer(ident, {"protocolVersion": request["params"]["protocolVersion"],
                               "capabilities": {"tools": {}},
                               "serverInfo": {"name": "loopengine-garbled", "version": "1"}})
            elif method == "tools/list":
                answer(ident, {"tools": [
                    {"name": name, "description": f"The {name} tool.",
                     "inputSchema": {"type": "object"}} for name in ("garbled", "pid")]})
            elif method == "tools/call" and request["params"]["name"] == "garbled":
                answer(ident, {"content": [{"type": "text"}]})
            elif method == "tools/call":
                answer(ident, {"content": [{"type": "text", "text": str(os.getpid())}]})
            else:
                print(json.dumps({"jsonrpc": "2.0", "id": ident, "error": {
                    "code": mcp_types.METHOD_NOT_FOUND, "message": method}}), flush=True)
    elif mode == "mute":
        # Started, reads every request, never answers; gone once its input closes
        # (the SDK's shutdown then waits on nothing).
        sys.stdin.buffer.read()
    else:
        sys.exit(3)
