"""The ``loopengine`` command itself: its help costs no more than click, and each
subcommand imports what it needs when it runs."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys
from loopengine.cli import main
try:
    main(sys.argv[1:])
except SystemExit as stop:
    code = stop.code
print(json.dumps({"code": code, "loaded": sorted(m for m in sys.modules if m in WATCHED)}))
"""

WATCHED = ("loopengine._audit_cli", "loopengine.persistence._audit", "loopengine._demo",
           "psycopg", "openai")


def loaded_after(*args: str) -> tuple[int, list[str]]:
    """The exit code of ``loopengine ARGS`` in a fresh interpreter, and which of
    `WATCHED` it had imported by then."""
    done = subprocess.run([sys.executable, "-c", f"WATCHED = {WATCHED!r}\n{PROBE}", *args],
                          capture_output=True, text=True, timeout=120, check=True)
    report = json.loads(done.stdout.splitlines()[-1])
    return report["code"], report["loaded"]


def test_help_imports_no_subcommand_and_no_optional_sdk() -> None:
    """`loopengine --help` imports neither the audit's queries, the demo, psycopg nor
    openai; `loopengine audit --help` imports the audit commands, still without psycopg."""
    assert loaded_after("--help") == (0, [])
    code, loaded = loaded_after("audit", "--help")
    assert code == 0
    assert "loopengine._audit_cli" in loaded and "psycopg" not in loaded
    assert "loopengine._demo" not in loaded
