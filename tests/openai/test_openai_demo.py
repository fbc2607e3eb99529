"""`loopengine demo --provider openai`: the demo conversation on the Chat Completions
API (FakeOpenAIServer through the real openai SDK), as a user runs it."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from loopengine.cli import main
from loopengine.persistence import _audit


def test_demo_runs_offline_on_the_openai_provider(tmp_path: Path) -> None:
    """The same conversation completes after an overload, two tool turns and a repair,
    recorded openai:<model> and priced by genai-prices, in a ledger that reconciles."""
    db = tmp_path / "demo.db"
    result = CliRunner().invoke(main, ["demo", "--provider", "openai", "--db", str(db)])
    assert result.exit_code == 0, result.output
    assert "through the openai SDK" in result.output
    assert "Outcome:  completed after 4 turns, 3 tool calls and 5 attempts" in result.output
    conn = _audit.open_ledger(db)
    try:
        assert _audit.reconcile(conn).ok
        rows = conn.execute("SELECT served_by, fault, charged FROM attempts "
                            "ORDER BY ordinal").fetchall()
    finally:
        conn.close()
    assert {row["served_by"] for row in rows} == {"openai:gpt-4o-mini"}
    assert [(row["fault"], row["charged"]) for row in rows] == [
        ("server_error", 0), (None, 1), (None, 1), (None, 1), (None, 1)]


def test_demo_live_on_openai_needs_its_key(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """--live --provider openai without OPENAI_API_KEY exits 2 naming it, writing nothing."""
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["demo", "--provider", "openai", "--live"])
    assert result.exit_code == 2 and "OPENAI_API_KEY" in result.output
    assert not (tmp_path / "loopengine-demo.db").exists()
