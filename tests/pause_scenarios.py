"""Pause and resume scenarios, defined once and run through each shipped route
(tests/adapter/test_anthropic_pause.py, tests/openai/test_openai_pause.py,
tests/openai_responses/test_responses_pause.py, tests/gemini/test_gemini_pause.py,
tests/bedrock_vertex/test_platform_pause.py).

Each scenario scripts the provider's loopback fake, pauses a run on a tool that
needs approval, resumes it, and asserts what holds whatever the vendor: the
outcome, the requests the server received, the handlers that ran, the ledger's
rows and the account's journal.
"""

from __future__ import annotations

import json
import sqlite3
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import anyio
import pytest

import loopengine as le
from loopengine import events
from loopengine.persistence import SQLiteLedger
from loopengine.testing import FakeClock, Reply

from .rule_scenarios import Counter, Route, Wire, lookup

ROOT = Path(__file__).parent.parent
"""Where ``python -m tests.pause_child`` runs (as a module: the script's own folder
on sys.path would shadow the ``openai`` SDK with tests/openai)."""


class Sender:
    """The tool ``send``, which needs approval; its handler records each call."""

    def __init__(self) -> None:
        self.sent: list[str] = []

        @le.tool(approval=True)
        def send(to: str) -> str:
            """Send the message to someone."""
            self.sent.append(to)
            return f"sent to {to}"

        self.tool = send


class HookedStore(le.RunStore):
    """A run store that calls `before` and `after` around each checkpoint with
    what it writes (``create``, ``state``, ``results``, ``paused``, ``calls``,
    or only ``lease``): a test counts the writes there, or lets a stand-in for
    a death or a takeover land at one (never a race with real time)."""

    async def before(self, invocation_id: str, wrote: tuple[str, ...]) -> None:
        """Called before the checkpoint is written; nothing by default."""

    async def after(self, invocation_id: str, wrote: tuple[str, ...]) -> None:
        """Called once the checkpoint is written; nothing by default."""

    async def checkpoint(self, invocation_id: str, owner: str, *, now: datetime,
                         state: bytes | None = None, results: bytes | None = None,
                         expires_at: datetime | None = None, paused: bool = False,
                         calls: Any = (), create: bool = False) -> None:
        """Checkpoint, between `before` and `after`."""
        wrote = tuple(name for name, given in (
            ("create", create), ("state", state is not None), ("results", results is not None),
            ("paused", paused), ("calls", bool(calls))) if given) or ("lease",)
        await self.before(invocation_id, wrote)
        await super().checkpoint(invocation_id, owner, now=now, state=state, results=results,
                                 expires_at=expires_at, paused=paused, calls=calls,
                                 create=create)
        await self.after(invocation_id, wrote)


def send(to: str = "bob") -> tuple[str, dict[str, Any]]:
    """A call of the `Sender` tool."""
    return ("send", {"to": to})


def tool_result_blocks(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every tool_result block of a transcript (Anthropic-shaped, whatever the vendor)."""
    return [b for m in messages if isinstance(m.get("content"), list)
            for b in m["content"] if b.get("type") == "tool_result"]


async def approval_round_trip_in_another_process(
        wire: Wire, route: Route, tmp_path: Path, vendor: str, url: str,
        asks: Reply | None = None) -> None:
    """The run pauses before the approved tool runs; a second process resumes it
    from ``state.dumps()`` on the same SQLite ledger file: the tool runs there,
    once, and the invocation goes on with the same id and dense ordinals.

    ``asks`` is the reply that calls ``send("bob")`` (by default, the call
    alone): one that carries what the vendor's API requires back (a thought
    signature, a reasoning) must reach the resumed request through the state,
    or the fake refuses it as the API would."""
    path = tmp_path / "ledger.db"
    log = tmp_path / "sent.txt"
    sender = Sender()
    with SQLiteLedger(path) as ledger:
        engine, _ = wire.engine(asks or Reply.tool_calls(send("bob")),
                                Reply.text("It is sent."), ledger=ledger)
        paused = await engine.run(route.operation(), "Tell bob", tools=[sender.tool])
    assert paused.outcome is le.Outcome.PAUSED
    assert [(c.tool, c.input, c.reason) for c in paused.pending] == [
        ("send", {"to": "bob"}, "approval")]
    assert sender.sent == [] and len(wire.requests) == 1
    assert paused.state is not None and paused.state.invocation_id == paused.invocation_id
    row = _invocation(path, paused.invocation_id)
    assert (row["outcome"], row["turns"], row["attempt_count"]) == ("paused", 1, 1)

    state_file = tmp_path / "state.json"
    state_file.write_bytes(paused.state.dumps())
    assert b"test-key" not in paused.state.dumps()  # the provider's key stays out
    decisions = json.dumps({paused.pending[0].id: ["approve"]})
    child = await anyio.run_process(
        [sys.executable, "-m", "tests.pause_child", vendor, str(path), url, str(state_file),
         decisions, str(log)], check=False, cwd=ROOT)
    assert child.returncode == 0, child.stderr.decode()
    done = json.loads(child.stdout.decode().strip().splitlines()[-1])
    assert done == {"outcome": "completed", "invocation_id": paused.invocation_id,
                    "turns": 2, "tool_calls": 1, "attempts": 2, "credits": 240,
                    "answer": "It is sent.", "pending": []}
    assert log.read_text() == "bob\n"  # run once, in the resuming process
    assert len(wire.requests) == 2
    row = _invocation(path, paused.invocation_id)
    assert (row["outcome"], row["turns"], row["tool_calls"], row["attempt_count"],
            row["credits"]) == ("completed", 2, 1, 2, 240)
    conn = sqlite3.connect(path)
    ordinals = [o for (o,) in conn.execute("SELECT ordinal FROM attempts ORDER BY ordinal")]
    conn.close()
    assert ordinals == [1, 2]


async def denied_call_the_model_recovers_from(wire: Wire, route: Route) -> le.RunResult:
    """A denied call never runs: the model gets an is_error result with the reason,
    the call uses tool budget, and the model answers on the next turn."""
    sender = Sender()
    engine, ledger = wire.engine(Reply.tool_calls(send("bob")),
                                 Reply.text("I was not allowed to send it."))
    paused = await engine.run(route.operation(), "Tell bob", tools=[sender.tool])
    assert paused.outcome is le.Outcome.PAUSED and paused.state is not None
    result = await engine.resume(
        paused.state, decisions={paused.pending[0].id: le.Deny("bob opted out")},
        tools=[sender.tool])
    assert result.outcome is le.Outcome.COMPLETED
    assert result.answer == "I was not allowed to send it."
    assert sender.sent == []
    assert result.tool_calls == 1 and result.turns == 2
    denied = tool_result_blocks(result.messages)
    assert len(denied) == 1 and denied[0]["is_error"] is True
    assert "bob opted out" in denied[0]["content"]
    assert len(wire.requests) == 2
    assert result.invocation_id == paused.invocation_id
    assert ledger.invocations[result.invocation_id]["outcome"] == "completed"
    return result


async def budgets_across_a_pause(wire: Wire, route: Route) -> None:
    """A run that used 3 of max_turns=4 before pausing gets exactly one more turn
    after resuming, although its state's counters were edited to zero: the
    resume reads the budgets from the ledger."""
    sender, counter = Sender(), Counter()
    script = [Reply.tool_calls(lookup("a")), Reply.tool_calls(lookup("b")),
              Reply.tool_calls(send("bob")), *[Reply.tool_calls(lookup("c")) for _ in range(4)]]
    engine, ledger = wire.engine(*script)
    paused = await engine.run(route.operation(max_turns=4), "go",
                              tools=[sender.tool, counter.tool])
    assert paused.outcome is le.Outcome.PAUSED and paused.turns == 3
    assert paused.state is not None
    edited = json.loads(paused.state.dumps())
    edited["progress"].update(turns=0, tool_calls=0, credits=0, attempts=0, cost_nanousd=0)
    state = le.RunState.loads(json.dumps(edited).encode())
    assert state.progress.turns == 0
    result = await engine.resume(state, decisions={paused.pending[0].id: le.Approve()},
                                 tools=[sender.tool, counter.tool])
    assert result.outcome is le.Outcome.TURN_LIMIT
    assert result.turns == 4 and len(wire.requests) == 4
    assert result.tool_calls == 4  # a, b, send, c
    assert sender.sent == ["bob"] and counter.calls == ["a", "b", "c"]
    ordinals = sorted(o for (i, o) in ledger.attempts if i == paused.invocation_id)
    assert ordinals == [1, 2, 3, 4]
    row = ledger.invocations[paused.invocation_id]
    assert (row["turns"], row["attempt_count"], row["credits"]) == (4, 4, 480)


async def pause_timeout_ends_time_limit(wire: Wire, route: Route, clock: FakeClock) -> None:
    """A resume after the operation's pause_timeout is refused before anything is
    sent, and the invocation ends time_limit."""
    sender = Sender()
    engine, ledger = wire.engine(Reply.tool_calls(send("bob")), Reply.text("never sent"))
    paused = await engine.run(route.operation(pause_timeout=60), "Tell bob",
                              tools=[sender.tool])
    assert paused.state is not None
    clock.advance(61)
    with pytest.raises(le.ConfigError, match="pause_timeout"):
        await engine.resume(paused.state, decisions={paused.pending[0].id: le.Approve()},
                            tools=[sender.tool])
    assert len(wire.requests) == 1 and sender.sent == []
    assert ledger.invocations[paused.invocation_id]["outcome"] == "time_limit"
    with pytest.raises(le.ConfigError, match="not paused"):
        await engine.resume(paused.state, decisions={paused.pending[0].id: le.Approve()},
                            tools=[sender.tool])


async def accounts_across_a_pause(wire: Wire, route: Route, tmp_path: Path) -> None:
    """Pausing settles what the run spent and releases the rest of its hold (one
    transaction); resuming reserves what the hold leaves; the journal adds up and
    `audit reconcile` finds nothing."""
    path = tmp_path / "ledger.db"
    sender = Sender()
    seen: list[events.Event] = []
    with SQLiteLedger(path) as ledger:
        accounts = le.CreditAccounts(ledger)
        await accounts.grant("acme", 1000)
        engine, _ = wire.engine(Reply.tool_calls(send("bob")), Reply.text("done"),
                                ledger=ledger, accounts=accounts, observers=[seen.append])
        who = le.Attribution(tenant="acme")
        paused = await engine.run(route.operation(credit_hold=500), "Tell bob",
                                  tools=[sender.tool], attribution=who)
        assert paused.outcome is le.Outcome.PAUSED and paused.credits == 120
        assert await accounts.balance("acme") == le.AccountBalance("acme", 1000, 120, 0, 880)
        assert paused.state is not None
        result = await engine.resume(paused.state, decisions={paused.pending[0].id: le.Approve()},
                                     tools=[sender.tool])
        assert result.outcome is le.Outcome.COMPLETED and result.credits == 240
        assert await accounts.balance("acme") == le.AccountBalance("acme", 1000, 240, 0, 760)
    conn = sqlite3.connect(path)
    entries = [(k, c) for k, c in conn.execute(
        "SELECT kind, credits FROM account_entries WHERE invocation_id IS NOT NULL ORDER BY id")]
    conn.close()
    # The resume reserves what the hold leaves: 500 - 120 already settled.
    assert entries == [("reserve", 500), ("settle", 120), ("release", 500),
                       ("reserve", 380), ("settle", 120), ("release", 380)]
    assert [type(e).__name__ for e in seen if isinstance(
        e, events.RunStarted | events.RunPaused | events.RunResumed | events.RunEnded)] == [
        "RunStarted", "RunPaused", "RunResumed", "RunEnded"]
    from click.testing import CliRunner

    from loopengine.cli import main

    checked = CliRunner().invoke(main, ["audit", "reconcile", "--db", str(path), "--json"])
    assert '"accounts": []' in checked.output, checked.output


def _invocation(path: Path, invocation_id: str) -> dict[str, Any]:
    conn = sqlite3.connect(path)
    conn.row_factory = sqlite3.Row
    row = dict(conn.execute("SELECT * FROM invocations WHERE id = ?",
                            (invocation_id,)).fetchone())
    conn.close()
    return row

