"""The ledger across processes: a process killed mid-request, and four processes
writing one file at once."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from loopengine.cli import main
from loopengine.persistence import _audit

from .ledger_support import read_db

CHILD = Path(__file__).with_name("ledger_child.py")

pytestmark = pytest.mark.slow


def spawn(*args: str) -> subprocess.Popen[str]:
    # -P: the script's directory (tests/) must not shadow installed packages.
    return subprocess.Popen([sys.executable, "-P", str(CHILD), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_a_process_killed_mid_request_leaves_a_dispatched_row(tmp_path: Path) -> None:
    """SIGKILL while the request is on the wire: the attempt row is there, dispatched,
    the invocation running; the file is intact and `audit reconcile` reports both."""
    path = tmp_path / "ledger.db"
    child = spawn("crash", str(path))
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line.startswith("ON THE WIRE"), child.stderr.read() if child.stderr else line
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=30)
        if child.stdout:
            child.stdout.close()
        if child.stderr:
            child.stderr.close()
    assert child.returncode == -signal.SIGKILL

    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()
    invocations, attempts = read_db(path)
    (invocation,) = invocations.values()
    assert (invocation["outcome"], invocation["attempt_count"], invocation["tenant"]) == (
        "running", 1, "crash")
    (attempt,) = attempts.values()
    assert attempt["outcome"] == "dispatched" and attempt["latency_ms"] is None

    result = CliRunner().invoke(main, ["audit", "reconcile", "--db", str(path)])
    assert result.exit_code == 1
    assert "Attempts still dispatched (in flight, or their process died): 1" in result.output
    assert "Invocations still running (or their process died): 1" in result.output
    assert invocation["id"] in result.output


def test_four_processes_write_one_file(tmp_path: Path) -> None:
    """4 processes x 50 concurrent runs on one new file: no "database is locked", no
    lost row, every invocation reconciles."""
    path = tmp_path / "ledger.db"
    children = [spawn("runs", str(path), "50", f"p{n}") for n in range(4)]
    for child in children:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "READY"
    path.with_name("ledger.db.go").touch()  # every child starts writing now
    outputs = [child.communicate(timeout=120) for child in children]
    for child, (out, err) in zip(children, outputs, strict=True):
        assert child.returncode == 0, err
        assert "locked" not in err and out.startswith("DONE"), (out, err)
    invocations, attempts = read_db(path)
    assert len(invocations) == 200 and len(attempts) == 600
    assert {r["tenant"] for r in invocations.values()} == {"p0", "p1", "p2", "p3"}
    assert all(r["outcome"] == "completed" and r["attempt_count"] == 3
               for r in invocations.values())
    assert {a["outcome"] for a in attempts.values()} == {"error", "ok"}
    conn = _audit.open_ledger(path)
    report = _audit.reconcile(conn)
    conn.close()
    assert report.ok and (report.invocations, report.attempts) == (200, 600)
