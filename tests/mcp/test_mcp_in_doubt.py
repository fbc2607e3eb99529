"""How a run store records an MCP call (docs/tools.md, docs/pause-and-resume.md):
a call whose server died during it has no known result and may have done its
work, so it is recorded ``in_doubt`` and `audit reconcile` lists it; a tool's
own error is ``failed`` (a call past its timeout: tests/mcp/test_mcp.py). Real
servers (tests/mcp/server.py on the ``mcp`` SDK's server class, over stdio),
the real Anthropic SDK on its loopback fake, a SQLite ledger."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

import loopengine as le
from loopengine.mcp import MCPServer
from loopengine.persistence import SQLiteLedger
from loopengine.testing import Reply

from ..adapter.conftest import Harness, tool_results
from ..conftest import operation
from .conftest import SCRIPT, HttpServer, script_server
from .test_mcp import audited_in_doubt, by_name, content_text

pytestmark = [pytest.mark.slow, pytest.mark.realtime]


async def test_a_call_whose_server_died_during_it_is_in_doubt_and_a_tool_error_failed(
        anthropic: Harness, tmp_path: Path) -> None:
    """``fail`` answers isError: the model gets its text, the call is ``failed``.
    ``crash`` kills its server mid-call: the model gets an error saying the
    result is not known, and the call, which may have done its work, is
    ``in_doubt``, listed by the audit; the run goes on and completes."""
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as ledger:
        store = le.RunStore(ledger)
        async with script_server(allow={"fail", "crash"}) as test:
            engine, _ = anthropic.engine(
                Reply.tool_calls(("fail", {"message": "no such card"})),
                Reply.tool_calls(("crash", {})), Reply.text("done"),
                ledger=ledger, run_store=store)
            result = await engine.run(operation(total_time=60), "go", tools=test.tools)
        statuses = await store.tool_calls(result.invocation_id)
    assert result.outcome is le.Outcome.COMPLETED
    (failed,) = tool_results(anthropic.requests[1])
    (lost,) = tool_results(anthropic.requests[2])
    assert failed["is_error"] is True and "no such card" in content_text(failed)
    assert lost["is_error"] is True and "result is not known" in content_text(lost)
    assert sorted(statuses.values()) == ["failed", "in_doubt"]
    assert audited_in_doubt(path) == [("crash", "in_doubt")]


@pytest.mark.parametrize(("mode", "refusal"), [
    ("odd", "mismatched: its result was refused"),
    ("garbled", "garbled: its result was refused: it is not a valid MCP tool result ("),
], ids=["output-schema", "not-a-result"])
async def test_a_result_that_is_refused_is_a_failed_call_on_a_kept_session(
        anthropic: Harness, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        mode: str, refusal: str) -> None:
    """The server answers with a result the SDK refuses: ``mismatched``, structured
    content its declared output schema refuses; ``garbled``, text content that
    lacks its text, which the SDK's types refuse. The call ran once and was
    answered, so it is ``failed``, not in doubt (no person need check whether
    it ran), the model gets a short error saying the result was refused, and
    the session is kept: the next call is answered by the same process, not a
    new one."""
    tool = refusal.split(":", 1)[0]
    caplog.set_level(logging.INFO, logger="loopengine")
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as ledger:
        store = le.RunStore(ledger)
        async with MCPServer.stdio(sys.executable, [SCRIPT, mode]) as server:
            pid = by_name(server)["pid"]
            before = await pid.invoke({})
            engine, _ = anthropic.engine(
                Reply.tool_calls((tool, {})), Reply.text("done"),
                ledger=ledger, run_store=store)
            result = await engine.run(operation(total_time=60), "go", tools=server.tools)
            after = await pid.invoke({})
        statuses = await store.tool_calls(result.invocation_id)
    assert result.outcome is le.Outcome.COMPLETED
    (refused,) = tool_results(anthropic.requests[1])
    assert refused["is_error"] is True
    assert content_text(refused).startswith(refusal)
    assert "result is not known" not in content_text(refused)
    assert list(statuses.values()) == ["failed"]
    assert audited_in_doubt(path) == []
    assert before == after and "opening a new session" not in caplog.text


@pytest.mark.parametrize("era", ["2026", "handshake"])
@pytest.mark.parametrize(("reply", "said"), [
    ("504", "(Server returned an error response)"),
    ("202", "(server answered a request with 202 Accepted)"),
    ("json", "(Failed to parse JSON response)"),
    ("sse", "(Failed to parse SSE message)"),
    ("html", "(Unexpected content type: text/html)"),
    ("303", "(Redirect to http://outcome.invalid/calls/1 not followed"),
])
async def test_a_call_a_gateway_answered_with_no_result_after_the_server_ran_it_is_in_doubt(
        http_server: HttpServer, anthropic: Harness, tmp_path: Path, era: str, reply: str,
        said: str) -> None:
    """Over HTTP, a gateway lets the server run the call but answers the client
    with no JSON-RPC answer: 504 in plain text, 202 Accepted, 200 with JSON cut
    short, 200 with an event whose message is not JSON, 200 with an HTML page, or
    303 See Other (the SDK makes each up into a JSON-RPC error of its own). The
    call ran, so its result is not known: the model is told so (in a line, not
    a parser's account of the body), the call is ``in_doubt`` (listed by the
    audit), not ``failed``, which would let a resume or a person take it for a
    call that did nothing; a session (the handshake era's) or none (2026)."""
    url = http_server.url if era == "2026" else http_server.url.replace("/mcp", "/legacy/mcp")
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as ledger:
        store = le.RunStore(ledger)
        async with MCPServer.http(url, allow={"gated", "gateway_count"}) as server:
            engine, _ = anthropic.engine(
                Reply.tool_calls(("gated", {"reply": reply})), Reply.text("done"),
                ledger=ledger, run_store=store)
            result = await engine.run(operation(total_time=60), "go", tools=server.tools)
            ran = await by_name(server)["gateway_count"].invoke({})
        statuses = await store.tool_calls(result.invocation_id)
    assert result.outcome is le.Outcome.COMPLETED
    assert ran == "1"
    (lost,) = tool_results(anthropic.requests[1])
    assert lost["is_error"] is True
    assert content_text(lost).startswith(f"the MCP server's HTTP answer held no result {said}")
    assert content_text(lost).endswith("; the result is not known")
    assert "\n" not in content_text(lost)
    assert list(statuses.values()) == ["in_doubt"]
    assert audited_in_doubt(path) == [("gated", "in_doubt")]


@pytest.mark.parametrize(("era", "said"), [("2026", "Not Found"),
                                           ("handshake", "Session terminated")])
async def test_a_call_a_gateway_answered_404_without_passing_it_on_failed(
        http_server: HttpServer, anthropic: Harness, tmp_path: Path, era: str,
        said: str) -> None:
    """A 404 in plain text answers the call, which the server never got: on the
    handshake era's session the SDK makes it up into "Session terminated", on
    the 2026 protocol's sessionless requests into "Not Found". The call did not
    run, so it is ``failed``, not in doubt (nothing for a person to check), and
    the model is told it did not run; the next call is answered."""
    url = http_server.url if era == "2026" else http_server.url.replace("/mcp", "/legacy/mcp")
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as ledger:
        store = le.RunStore(ledger)
        async with MCPServer.http(url, allow={"gated", "gateway_count"}) as server:
            engine, _ = anthropic.engine(
                Reply.tool_calls(("gated", {"reply": "404"})),
                Reply.tool_calls(("gateway_count", {})), Reply.text("done"),
                ledger=ledger, run_store=store)
            result = await engine.run(operation(total_time=60), "go", tools=server.tools)
        statuses = await store.tool_calls(result.invocation_id)
    assert result.outcome is le.Outcome.COMPLETED
    (refused,) = tool_results(anthropic.requests[1])
    (count,) = tool_results(anthropic.requests[2])
    assert refused["is_error"] is True
    assert content_text(refused) == \
        f"the MCP server's HTTP answer was 404 ({said}); the call did not run"
    assert content_text(count) == "0"
    assert sorted(statuses.values()) == ["failed", "succeeded"]
    assert audited_in_doubt(path) == []


async def test_a_call_that_could_not_connect_to_its_http_server_failed(
        http_server: HttpServer, anthropic: Harness, tmp_path: Path) -> None:
    """The HTTP server is stopped between calls, its session still open (the
    handshake era's, whose stream of server messages retries on its own): the
    next call's request cannot connect, so it never reached the server. It is
    ``failed``, not in doubt, and the model is told it was not sent; once the
    server is back, the call after it opens a new session and is answered."""
    url = http_server.url.replace("/mcp", "/legacy/mcp")
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as ledger:
        store = le.RunStore(ledger)
        async with MCPServer.http(url, allow={"echo"}) as server:
            http_server.kill()
            engine, _ = anthropic.engine(
                Reply.tool_calls(("echo", {"text": "down"})), Reply.text("done"),
                ledger=ledger, run_store=store)
            result = await engine.run(operation(total_time=60), "go", tools=server.tools)
            http_server.start()
            back = await by_name(server)["echo"].invoke({"text": "back"})
        statuses = await store.tool_calls(result.invocation_id)
    assert result.outcome is le.Outcome.COMPLETED
    (down,) = tool_results(anthropic.requests[1])
    assert down["is_error"] is True
    assert content_text(down).startswith("the MCP server could not be reached (")
    assert content_text(down).endswith("); the call was not sent")
    assert list(statuses.values()) == ["failed"]
    assert audited_in_doubt(path) == []
    assert back == "back"


async def test_a_call_the_server_was_still_working_on_when_the_sdk_stopped_asking_is_in_doubt(
        anthropic: Harness, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``working`` answers every round "input required" with only its state (the
    2026 protocol's way of saying the call is under way: ask again later); the
    SDK asks again a set number of times (about two seconds), then gives up.
    The call may finish on the server after that, so it is ``in_doubt``, and
    the model is told the result is not known (not the SDK's advice to its
    programmer); the session, which answered every time, is kept."""
    caplog.set_level(logging.INFO, logger="loopengine")
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as ledger:
        store = le.RunStore(ledger)
        async with MCPServer.stdio(sys.executable, [SCRIPT, "odd"]) as server:
            pid = by_name(server)["pid"]
            before = await pid.invoke({})
            engine, _ = anthropic.engine(
                Reply.tool_calls(("working", {})), Reply.text("done"),
                ledger=ledger, run_store=store)
            result = await engine.run(operation(total_time=60), "go", tools=server.tools)
            after = await pid.invoke({})
        statuses = await store.tool_calls(result.invocation_id)
    assert result.outcome is le.Outcome.COMPLETED
    (pending,) = tool_results(anthropic.requests[1])
    assert pending["is_error"] is True
    assert content_text(pending) == ("the MCP server was still working on the call when "
                                     "its client stopped asking; the result is not known")
    assert list(statuses.values()) == ["in_doubt"]
    assert audited_in_doubt(path) == [("working", "in_doubt")]
    assert before == after and "opening a new session" not in caplog.text


async def test_a_call_whose_later_round_could_not_connect_after_one_reached_the_server_is_in_doubt(
        http_server: HttpServer, anthropic: Harness, tmp_path: Path) -> None:
    """Over HTTP (2026 protocol), ``vanish`` answers its first round "input
    required" (ask again later), after making its server take no more
    connections: the SDK's next round of the call cannot connect. The first
    round reached the server, which may have acted on it, so the call is not
    one that was never sent: the model is told the result is not known, and
    the call is ``in_doubt`` (listed by the audit), not ``failed``."""
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as ledger:
        store = le.RunStore(ledger)
        async with MCPServer.http(http_server.url, allow={"vanish"}) as server:
            engine, _ = anthropic.engine(
                Reply.tool_calls(("vanish", {})), Reply.text("done"),
                ledger=ledger, run_store=store)
            result = await engine.run(operation(total_time=60), "go", tools=server.tools)
        statuses = await store.tool_calls(result.invocation_id)
    assert result.outcome is le.Outcome.COMPLETED
    (lost,) = tool_results(anthropic.requests[1])
    assert lost["is_error"] is True
    assert "the call was not sent" not in content_text(lost)
    assert content_text(lost).endswith("the result is not known")
    assert list(statuses.values()) == ["in_doubt"]
    assert audited_in_doubt(path) == [("vanish", "in_doubt")]
