"""Fixtures for the MCP tests: real MCP servers (the ``mcp-server-time`` package
over stdio, and tests/mcp/server.py, built on the ``mcp`` SDK's own server
classes, over stdio or streamable HTTP on 127.0.0.1), and engines on the fake
Anthropic and OpenAI servers through the real provider SDKs."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from loopengine.mcp import MCPServer
from loopengine.testing import FakeAnthropicServer, FakeOpenAIServer

from ..adapter.conftest import Harness, harness
from ..openai.conftest import OpenAIHarness

SCRIPT = str(Path(__file__).with_name("server.py"))
"""The test MCP server (see its docstring)."""


def time_server(**kwargs: object) -> MCPServer:
    """The ``mcp-server-time`` package over stdio, on this interpreter."""
    return MCPServer.stdio(sys.executable, ["-m", "mcp_server_time", "--local-timezone", "UTC"],
                           **kwargs)  # type: ignore[arg-type]


def script_server(**kwargs: object) -> MCPServer:
    """tests/mcp/server.py over stdio."""
    return MCPServer.stdio(sys.executable, [SCRIPT, "stdio"], **kwargs)  # type: ignore[arg-type]


class HttpServer:
    """tests/mcp/server.py serving streamable HTTP in a subprocess this test started."""

    def __init__(self) -> None:
        self.port = 0
        self.process: subprocess.Popen[str] | None = None

    def start(self) -> HttpServer:
        """Start it (on the port it had, after a `kill`) and wait until it listens."""
        self.process = subprocess.Popen(
            [sys.executable, SCRIPT, "http", str(self.port)], stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        # The script prints its port once its socket listens: no polling.
        self.port = int(self.process.stdout.readline())
        return self

    @property
    def url(self) -> str:
        """The MCP endpoint."""
        return f"http://127.0.0.1:{self.port}/mcp"

    def kill(self) -> None:
        """Kill the process and reap it."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
        if self.process is not None:
            self.process.wait(timeout=10)
            if self.process.stdout is not None:
                self.process.stdout.close()


@pytest.fixture
def http_server() -> Iterator[HttpServer]:
    """A started streamable HTTP MCP server on 127.0.0.1, killed after the test."""
    server = HttpServer().start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
async def anthropic(fake_anthropic_server: FakeAnthropicServer) -> AsyncIterator[Harness]:
    """An engine factory on AnthropicProvider and the fake Messages API, on the real clock
    (a tool's timeout only expires on it)."""
    async with harness(fake_anthropic_server, None) as h:
        yield h


@pytest.fixture
async def openai(fake_openai_server: FakeOpenAIServer) -> AsyncIterator[OpenAIHarness]:
    """The same on OpenAIProvider and the fake Chat Completions API."""
    h = OpenAIHarness(fake_openai_server, None)  # type: ignore[arg-type]
    try:
        yield h
    finally:
        await h.aclose()
