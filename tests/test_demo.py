"""The ledger against an independent witness (the usage FakeAnthropicServer served),
and `loopengine demo` run as a user would."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx2
import pytest
from click.testing import CliRunner

import loopengine as le
from loopengine.cli import main
from loopengine.persistence import SQLiteLedger, _audit
from loopengine.providers import AnthropicProvider
from loopengine.testing import CutStream, ErrorReply, FakeAnthropicServer, Reply, StreamErrorEvent

from .conftest import PRICES, operation
from .ledger_support import judge, lookup, read_db

FAST = le.RetryPolicy(max_attempts=4, initial_wait=0.001, max_wait=0.002)

DEMO_ATTEMPTS = [("1", "turn", "error"), ("2", "turn", "ok"), ("1", "turn", "ok"),
                 ("1", "turn", "ok"), ("1", "repair", "ok")]
"""(attempt, phase, outcome) of the demo's attempts: the overload, its retry, two
tool turns after it, the repair of the rejected answer."""


def attempt_rows(output: str) -> list[tuple[str, str, str]]:
    """(attempt, phase, outcome) of each row of the attempts table the demo printed."""
    table = [line.split() for line in output.splitlines()
             if line[:1].isdigit() and len(line.split()) > 8]
    return [(r[2], r[3], r[4]) for r in table]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_ledger_sums_equal_the_usage_the_server_served(
    tmp_path: Path, stream: bool
) -> None:
    """Through the real SDK, every token the fake server put on the wire (cut and
    interrupted streams included) is in the invocation's totals and its rows."""
    usage = le.Usage(input_tokens=300, output_tokens=40, cache_read_tokens=900,
                     cache_write_tokens=120)
    script = [
        ErrorReply.overloaded(),
        CutStream(reply=Reply.tool_calls(("lookup", {"key": "a"}), usage=usage), after=3),
        StreamErrorEvent(reply=Reply.text("partial", usage=usage), after=3),
        Reply.tool_calls(("lookup", {"key": "a"}), usage=usage),
        Reply.text("draft", usage=le.Usage(350, 20, 900)),
        Reply.text("final answer", usage=le.Usage(360, 25, 900)),
    ]
    path = tmp_path / "ledger.db"
    with FakeAnthropicServer(script) as server:
        provider = AnthropicProvider(api_key="k", base_url=server.url, stream=stream,
                                     http_client=httpx2.AsyncClient(verify=False))
        with SQLiteLedger(path) as ledger:
            engine = le.Engine(provider, ledger=ledger, prices=PRICES)
            result = await engine.run(operation(retry=FAST), "go", tools=[lookup], accept=judge)
        await provider.aclose()
        served = server.usage_served
        requests = len(server.requests)
    assert result.outcome is le.Outcome.COMPLETED
    invocations, attempts = read_db(path)
    row = invocations[result.invocation_id]
    assert row["attempt_count"] == len(attempts) == requests
    assert served.output_tokens > 0 and served.cache_read_tokens > 0
    for column in ("input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens"):
        assert row[column] == getattr(served, column), column
        assert sum(a[column] or 0 for a in attempts.values()) == getattr(served, column)
    assert row["input_tokens"] == result.usage.input_tokens


@pytest.mark.slow
def test_demo_runs_offline_and_writes_its_ledger(tmp_path: Path) -> None:
    """`loopengine demo` (the installed script, in an empty directory) completes after
    an overload, two tool turns and a repair, prints the attempts and leaves a
    ledger that reconciles."""
    script = shutil.which("loopengine", path=str(Path(sys.executable).parent))
    assert script is not None
    env = {k: v for k, v in os.environ.items() if k != "ANTHROPIC_API_KEY"}
    done = subprocess.run([script, "demo"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert "Outcome:  completed after 4 turns, 3 tool calls and 5 attempts" in done.stdout
    assert attempt_rows(done.stdout) == DEMO_ATTEMPTS
    db = tmp_path / "loopengine-demo.db"
    conn = _audit.open_ledger(db)
    assert _audit.reconcile(conn).ok
    (invocation,) = conn.execute("SELECT * FROM invocations").fetchall()
    conn.close()
    assert (invocation["outcome"], invocation["tenant"], invocation["attempt_count"]) == (
        "completed", "demo", 5)
    assert invocation["id"] in done.stdout
    # The commands it suggests run as printed, and `runs` lists the demo's run.
    assert "  loopengine audit runs --db loopengine-demo.db" in done.stdout
    listed = subprocess.run([script, "audit", "runs", "--db", "loopengine-demo.db"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and invocation["id"] in listed.stdout


def test_demo_live_needs_a_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--live without ANTHROPIC_API_KEY exits 2 and says what is missing, writing nothing."""
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["demo", "--live"])
    assert result.exit_code == 2
    assert "--live talks to the real Messages API: set ANTHROPIC_API_KEY" in result.output
    assert not (tmp_path / "loopengine-demo.db").exists()


@pytest.mark.parametrize(("provider", "api", "sdk", "served_by", "fault"), [
    ("openai-responses", "the Responses API", "openai", "openai:gpt-4.1-mini", "server_error"),
    ("gemini", "the Gemini API", "google-genai", "google:gemini-2.5-flash", "overloaded"),
])
def test_demo_runs_on_the_other_routes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, provider: str, api: str, sdk: str,
    served_by: str, fault: str,
) -> None:
    """`loopengine demo --provider` on the Responses API and on Gemini: the same
    conversation through that SDK and its loopback fake (the overload retried, two
    tool turns, the rejected answer repaired), printed and recorded in a ledger that
    reconciles, every attempt served by that route's model."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["demo", "--provider", provider])
    assert result.exit_code == 0, result.output
    assert f"against a loopback fake of {api}, through the {sdk} SDK" in result.output
    assert "Outcome:  completed after 4 turns, 3 tool calls and 5 attempts" in result.output
    assert "https://help.example.com/reset-password" in result.output.partition("Answer:")[2]
    assert attempt_rows(result.output) == DEMO_ATTEMPTS
    conn = _audit.open_ledger(tmp_path / "loopengine-demo.db")
    try:
        assert _audit.reconcile(conn).ok
        rows = conn.execute("SELECT served_by, fault FROM attempts ORDER BY ordinal").fetchall()
    finally:
        conn.close()
    assert [row["served_by"] for row in rows] == [served_by] * 5
    assert [row["fault"] for row in rows] == [fault, None, None, None, None]


@pytest.mark.parametrize(("provider", "module", "extra"), [
    ("openai-responses", "openai", "openai"),
    ("gemini", "google.genai", "gemini"),
])
def test_demo_without_the_sdk_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, provider: str, module: str, extra: str
) -> None:
    """Without the route's SDK (the module made unimportable, as when it is not
    installed) the demo exits 2 naming the extra to install, and writes nothing."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, module, None)
    result = CliRunner().invoke(main, ["demo", "--provider", provider])
    assert result.exit_code == 2
    assert f"pip install 'loopengine-core[{extra}]'" in result.output
    assert not (tmp_path / "loopengine-demo.db").exists()


def test_demo_live_on_gemini_needs_its_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--live --provider gemini with neither GEMINI_API_KEY nor GOOGLE_API_KEY exits
    2 and names both variables."""
    monkeypatch.delenv("GEMINI_API_KEY", raising=False)
    monkeypatch.delenv("GOOGLE_API_KEY", raising=False)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["demo", "--live", "--provider", "gemini"])
    assert result.exit_code == 2
    assert "set GEMINI_API_KEY or GOOGLE_API_KEY" in result.output
    assert not (tmp_path / "loopengine-demo.db").exists()


@pytest.mark.parametrize(("provider", "variables", "header", "sent"), [
    ("anthropic", {"ANTHROPIC_AUTH_TOKEN": "sk-ant-token", "ANTHROPIC_BASE_URL": "{url}"},
     "authorization", "Bearer sk-ant-token"),
    ("gemini", {"GOOGLE_API_KEY": "google-key", "GOOGLE_GEMINI_BASE_URL": "{url}"},
     "x-goog-api-key", "google-key"),
])
def test_demo_live_reads_the_credentials_the_sdk_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, provider: str,
    variables: dict[str, str], header: str, sent: str,
) -> None:
    """--live takes the credential from whichever variable the vendor's SDK reads
    (``ANTHROPIC_AUTH_TOKEN``, ``GOOGLE_API_KEY``), as ``Engine.from_model`` does: it
    was refused unless ``ANTHROPIC_API_KEY`` / ``GEMINI_API_KEY`` was set. The "real"
    API here is a loopback fake named by the SDK's base URL variable."""
    from loopengine._demo import demo_script
    from loopengine.testing import FakeGeminiServer

    for name in ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "GEMINI_API_KEY",
                 "GOOGLE_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    fake = FakeGeminiServer if provider == "gemini" else FakeAnthropicServer
    with fake(demo_script(provider)) as server:
        for name, value in variables.items():
            monkeypatch.setenv(name, value.format(url=server.url))
        result = CliRunner().invoke(main, ["demo", "--live", "--provider", provider])
        requests = server.requests
    assert result.exit_code == 0, result.output
    assert "Outcome:  completed after 4 turns, 3 tool calls and 5 attempts" in result.output
    assert "against the real" in result.output
    assert [r.headers.get(header) for r in requests] == [sent] * 5
