"""`loopengine audit` on the run store's tables (docs/ledger.md): `show` lists a
run's tool calls with their statuses and its stored state's lease or pause;
`reconcile` reports calls in doubt, runs whose lease expired and paused runs
past their pause_timeout, and fails (exit 1) while any is there."""

from __future__ import annotations

import json
import random
from pathlib import Path

from click.testing import CliRunner, Result

import loopengine as le
from loopengine.cli import main
from loopengine.persistence import SQLiteLedger
from loopengine.providers import Reply, ScriptedProvider
from loopengine.testing import FakeClock

from .conftest import PRICES, operation
from .pause_scenarios import Sender, send
from .test_recovery import Charger, crashed


def cli(*args: str | Path) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


async def test_audit_shows_tool_calls_and_reconcile_reports_the_call_in_doubt(
        tmp_path: Path, clock: FakeClock) -> None:
    """A run killed in charge's handler: show lists the call ``started`` and the
    run's lease; reconcile lists the call in doubt and the expired lease and
    exits 1. Recovered (its output supplied): reconcile is clean."""
    path = tmp_path / "ledger.db"
    charger = Charger()
    charger.crash_on = "charge"
    with SQLiteLedger(path) as ledger:
        store = le.RunStore(ledger)
        provider = ScriptedProvider([Reply.tool_calls(("charge", {"card": "4242"})),
                                     Reply.text("done")], clock=clock)
        engine = le.Engine(provider, ledger=ledger, clock=clock, prices=PRICES,
                           rng=random.Random(1), run_store=store)
        await crashed(engine, charger)
        await ledger.flush()
        run_id = str(json.loads(cli("audit", "runs", "--db", path, "--json").output)[0]["id"])

        shown = cli("audit", "show", "--db", path, run_id)
        assert shown.exit_code == 0, shown.output
        assert "Tool calls: 1" in shown.output and "charge" in shown.output
        assert "started" in shown.output and "Run state: running, leased by" in shown.output
        data = json.loads(cli("audit", "show", "--db", path, run_id, "--json").output)
        assert [(c["tool"], c["status"]) for c in data["tool_calls"]] == [("charge", "started")]
        assert data["run_state"]["paused_at"] is None and "state" not in data["run_state"]

        # The clock's 2026-01-01 lease expired long before the real now.
        checked = cli("audit", "reconcile", "--db", path)
        assert checked.exit_code == 1
        assert "Tool calls in doubt" in checked.output and "1 tool call in doubt" in checked.output
        assert "1 run whose lease expired" in checked.output
        found = json.loads(cli("audit", "reconcile", "--db", path, "--json").output)
        assert [(c["invocation_id"], c["tool"], c["status"]) for c in found["in_doubt"]] == [
            (run_id, "charge", "started")]

        paused = await engine.resume(run_id, tools=charger.tools, force=True)
        assert [p.reason for p in paused.pending] == ["in_doubt"]
        await engine.resume(run_id, tools=charger.tools,
                            decisions={paused.pending[0].id: le.Supply("charged 4242")})
        await ledger.flush()
    clean = cli("audit", "reconcile", "--db", path)
    assert clean.exit_code == 0, clean.output
    data = json.loads(cli("audit", "show", "--db", path, run_id, "--json").output)
    assert [c["status"] for c in data["tool_calls"]] == ["supplied"]
    assert data["run_state"] is None


async def test_reconcile_reports_a_paused_run_past_its_pause_timeout(
        tmp_path: Path, clock: FakeClock) -> None:
    """A run paused on the clock's 2026-01-01 with pause_timeout=60 is past it
    now: reconcile lists it and exits 1; show says it is paused."""
    path = tmp_path / "ledger.db"
    sender = Sender()
    with SQLiteLedger(path) as ledger:
        provider = ScriptedProvider([Reply.tool_calls(send("a"))], clock=clock)
        engine = le.Engine(provider, ledger=ledger, clock=clock, prices=PRICES,
                           run_store=le.RunStore(ledger))
        paused = await engine.run(operation(pause_timeout=60.0), "go", tools=[sender.tool])
    checked = json.loads(cli("audit", "reconcile", "--db", path, "--json").output)
    assert [(r["invocation_id"], r["pause_timeout"]) for r in checked["expired_pauses"]] == [
        (paused.invocation_id, 60.0)]
    assert checked["ok"] is False and checked["in_doubt"] == []
    shown = cli("audit", "show", "--db", path, paused.invocation_id)
    assert "Run state: paused since" in shown.output
    assert "requested" in shown.output
