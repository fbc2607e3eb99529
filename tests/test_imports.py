"""Importing loopengine, and running its CLI, imports no provider SDK: the SDKs
load when a provider is built."""

from __future__ import annotations

import json
import subprocess
import sys

SDKS = ("anthropic", "openai", "google")

PROGRAM = """
import json, sys
import loopengine, loopengine.guards, loopengine.persistence, loopengine.providers
import loopengine.testing, loopengine.cli
from click.testing import CliRunner
assert CliRunner().invoke(loopengine.cli.main, ["--help"]).exit_code == 0
before = sorted(m for m in sys.modules if m.split(".")[0] in {sdks})
from loopengine.providers import AnthropicProvider
AnthropicProvider(api_key="k")
after = sorted(m for m in sys.modules if m.split(".")[0] in {sdks})
print(json.dumps([before, after]))
""".format(sdks=repr(set(SDKS)))


def test_import_loopengine_and_its_cli_load_no_provider_sdk() -> None:
    """In a fresh interpreter, ``import loopengine`` (every subpackage) and
    ``loopengine --help`` leave no ``anthropic``, ``openai`` or ``google`` (the
    ``google-genai`` SDK) module loaded;
    building an `AnthropicProvider` loads its SDK."""
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True,
                          timeout=120, check=True)
    before, after = json.loads(done.stdout)
    assert before == []
    assert "anthropic" in after


def test_import_loopengine_loads_no_price_snapshot() -> None:
    """genai-prices (its whole price snapshot, about 0.1 s) loads when an attempt
    is first priced, not at ``import loopengine``; pricing then works."""
    program = (
        "import sys, loopengine as le\n"
        "before = 'genai_prices' in sys.modules\n"
        "from datetime import datetime, timezone\n"
        "priced = le.PriceBook().price('anthropic', 'claude-sonnet-4-5', le.Usage(1000, 100),\n"
        "                              datetime(2026, 1, 1, tzinfo=timezone.utc))\n"
        "print(before, priced is not None and priced.cost_nanousd > 0)\n")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.split() == ["False", "True"]


def test_import_loopengine_and_cli_help_load_no_engine() -> None:
    """``import loopengine`` and ``loopengine --help`` load neither the engine nor
    pydantic: the public names load on first use, so a script's start and the
    CLI's help stay quick; using a name loads it."""
    program = (
        "import sys, loopengine, loopengine.cli\n"
        "from click.testing import CliRunner\n"
        "assert CliRunner().invoke(loopengine.cli.main, ['--help']).exit_code == 0\n"
        "before = sorted(m for m in ('pydantic', 'loopengine._engine') if m in sys.modules)\n"
        "loopengine.Engine\n"
        "print(before, 'loopengine._engine' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.split() == ["[]", "True"]
