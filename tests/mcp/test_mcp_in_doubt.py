"""How a run store records an MCP call (docs/tools.md, docs/pause-and-resume.md):
a call whose server died during it, or that ran past its timeout, has no known
result and may have done its work, so it is recorded ``in_doubt`` and `audit
reconcile` lists it; a tool's own error is ``failed``. Real servers
(tests/mcp/server.py on the ``mcp`` SDK's server class, over stdio), the real
Anthropic SDK on its loopback fake, a SQLite ledger."""

from __future__ import annotations

from pathlib import Path

import pytest

import loopengine as le
from loopengine import audit
from loopengine.persistence import SQLiteLedger
from loopengine.testing import Reply

from ..adapter.conftest import Harness, tool_results
from ..conftest import operation
from .conftest import script_server
from .test_mcp import by_name, content_text

pytestmark = [pytest.mark.slow, pytest.mark.realtime]


def audited_in_doubt(path: Path) -> list[tuple[str, str]]:
    """``audit reconcile``'s calls in doubt: ``(tool, status)``."""
    conn = audit.open_ledger(path)
    try:
        return [(c["tool"], c["status"]) for c in audit.reconcile(conn).in_doubt]
    finally:
        conn.close()


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


async def test_a_call_past_its_timeout_is_in_doubt(anthropic: Harness, tmp_path: Path) -> None:
    """A server that never answers: the call ends at its tool's timeout, its
    result not known, recorded ``in_doubt``; the next call is answered on a new
    session and recorded ``succeeded``."""
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
            result = await engine.run(operation(total_time=60), "go", tools=[hang, echo])
        statuses = await store.tool_calls(result.invocation_id)
    assert result.outcome is le.Outcome.COMPLETED
    assert sorted(statuses.values()) == ["in_doubt", "succeeded"]
    assert audited_in_doubt(path) == [("hang", "in_doubt")]
