"""A resume takes the pause its ledger holds, once (docs/pause-and-resume.md,
"What a resume checks").

The ledger keeps the seal of the state each pause returned (`RunState.seal`):
a resume must hand back that state (its counts aside, which the ledger keeps
itself), and recording the run ``running`` again is a compare-and-set on the
seal, so an earlier pause's state, another run's, an edited one, or a second
resume of the same pause runs nothing.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import pytest

import loopengine as le
from loopengine._runstate import Progress
from loopengine.persistence import MemoryLedger, PostgresLedger, SQLiteLedger
from loopengine.persistence._records import InvocationEnd, InvocationStart
from loopengine.providers import Reply
from loopengine.testing import FakeClock

from .conftest import EngineFactory, operation
from .pause_scenarios import Sender, send
from .postgres_support import PostgresServer, fresh_schema
from .rule_scenarios import Counter, lookup

AT = datetime(2026, 1, 1, tzinfo=UTC)


def _start(invocation_id: str) -> InvocationStart:
    return InvocationStart(id=invocation_id, operation="op", operation_version="1",
                           provider="anthropic", model="m", tenant=None, user_id=None,
                           feature=None, correlation_id=None, started_at=AT)


def _end(invocation_id: str, outcome: str, **seals: str | None) -> InvocationEnd:
    return InvocationEnd(id=invocation_id, ended_at=AT if outcome != "running" else None,
                         outcome=outcome, turns=1, tool_calls=0, credits=0, at=AT, **seals)


@pytest.fixture(params=["memory", "sqlite", "postgres"])
async def two_handles(request: pytest.FixtureRequest,
                      tmp_path: Path) -> Any:
    """Two ledgers on one database, as two processes would hold it (the memory
    ledger: one, twice)."""
    if request.param == "memory":
        memory = MemoryLedger()
        yield memory, memory
    elif request.param == "sqlite":
        with SQLiteLedger(tmp_path / "l.db") as one, SQLiteLedger(tmp_path / "l.db") as two:
            yield one, two
    else:
        server: PostgresServer = request.getfixturevalue("postgres_server")
        schema = fresh_schema()
        async with PostgresLedger(server.dsn(), schema=schema) as one, \
                PostgresLedger(server.dsn(), schema=schema) as two:
            yield one, two


async def test_a_ledger_keeps_a_pauses_seal_and_lets_one_resume_take_it(
        two_handles: tuple[Any, Any]) -> None:
    """The seal is read back while paused; a resume expecting another seal is
    refused; of two resumes expecting it, through two connections, the first
    takes the pause and the second is refused; running and ended rows have none."""
    one, two = two_handles
    await one.start_invocation(_start("inv-1"))
    await one.end_invocation(_end("inv-1", "paused", seal="s1"))
    progress = await two.read_progress("inv-1")
    assert (progress.outcome, progress.seal) == ("paused", "s1")
    with pytest.raises(le.LedgerError):
        await two.end_invocation(_end("inv-1", "running", expect_seal="s0"))
    assert (await one.read_progress("inv-1")).outcome == "paused"
    await two.end_invocation(_end("inv-1", "running", expect_seal="s1"))
    with pytest.raises(le.LedgerError):
        await one.end_invocation(_end("inv-1", "running", expect_seal="s1"))
    progress = await one.read_progress("inv-1")
    assert (progress.outcome, progress.seal) == ("running", None)
    await two.end_invocation(_end("inv-1", "completed"))
    progress = await one.read_progress("inv-1")
    assert (progress.outcome, progress.seal) == ("completed", None)


def test_a_states_seal_survives_its_encoding_and_ignores_the_counts_a_ledger_keeps() -> None:
    """`dumps`/`loads` keep the seal; the counts, the pause's time and ``extra``
    do not change it; the transcript, the running time and who pays do."""
    state = _a_state()
    assert le.RunState.loads(state.dumps()).seal() == state.seal()
    counted = json.loads(state.dumps())
    counted["progress"].update(turns=0, tool_calls=0, credits=0, attempts=0, cost_nanousd=0)
    counted["paused_at"] = "2030-01-01T00:00:00+00:00"
    counted["extra"] = {"note": "kept"}
    assert le.RunState.loads(json.dumps(counted)).seal() == state.seal()
    for edit in EDITS.values():
        edited = json.loads(state.dumps())
        edit(edited)
        assert le.RunState.loads(json.dumps(edited)).seal() != state.seal()


def _a_state() -> le.RunState:
    return le.RunState(
        invocation_id="inv", operation=operation(), limits=le.Limits(max_turns=4),
        retry=le.RetryPolicy(), attribution=le.Attribution(tenant="acme"), system=None,
        messages=[{"role": "user", "content": "go"},
                  {"role": "assistant", "content": [
                      {"type": "tool_use", "id": "toolu_1", "name": "send",
                       "input": {"to": "bob"}}]}],
        given=1, final_tool="final_answer", structured=False, output_digest=None,
        tools=("send", "lookup"),
        pending=(le.PendingCall("toolu_1", "send", {"to": "bob"}),), batch=("toolu_1",),
        results=[], repair=False, answered_calls={"lookup": 1},
        progress=Progress(turns=1, tool_calls=1, credits=120, attempts=1, cost_nanousd=1,
                             provider_cost_nanousd=1, usage=le.Usage(), running_seconds=3.5),
        paused_at=AT)


def _add_calls(state: dict[str, Any]) -> None:
    """Five more calls in the paused batch (past its tool budget, none asked)."""
    blocks = state["messages"][-1]["content"]
    for n in range(5):
        blocks.append({"type": "tool_use", "id": f"toolu_x{n}", "name": "send",
                       "input": {"to": f"eve{n}"}})
        state["batch"].append(f"toolu_x{n}")


EDITS: dict[str, Callable[[dict[str, Any]], None]] = {
    "calls added to the batch": _add_calls,
    "its pending call dropped": lambda s: s.update(pending=[]),
    "its running time changed": lambda s: s["progress"].update(
        running_seconds=s["progress"]["running_seconds"] + 5.0),
    "its tools' call counts changed": lambda s: s.update(
        answered_calls={**s["answered_calls"], "lookup": 0, "send": 0}),
    "another tenant to pay": lambda s: s["attribution"].update(tenant="victim"),
    "its input changed": lambda s: s["messages"][-1]["content"][-1]["input"].update(to="eve"),
    "its tools dropped": lambda s: s.update(tools=["lookup"]),
}


@pytest.mark.parametrize("edit", list(EDITS), ids=list(EDITS))
async def test_a_state_edited_in_more_than_its_counts_is_refused_before_anything_is_sent(
        make_engine: EngineFactory, edit: str) -> None:
    """What a ledger cannot check from its rows is sealed: a resume of an edited
    state raises ConfigError, sends and runs nothing, and leaves the run paused
    for the state its pause returned."""
    sender, counter = Sender(), Counter()
    engine, provider, ledger = make_engine(Reply.tool_calls(lookup("a")),
                                           Reply.tool_calls(send("bob")), Reply.text("done"))
    paused = await engine.run(operation(), "go", tools=[sender.tool, counter.tool])
    assert paused.state is not None and paused.outcome is le.Outcome.PAUSED
    edited = json.loads(paused.state.dumps())
    EDITS[edit](edited)
    with pytest.raises(le.ConfigError, match="latest pause"):
        await engine.resume(json.dumps(edited),
                            decisions={call[0]: le.Approve() for call in edited["pending"]},
                            tools=[sender.tool, counter.tool])
    assert len(provider.requests) == 2 and sender.sent == []
    assert ledger.invocations[paused.invocation_id]["outcome"] == "paused"
    done = await engine.resume(paused.state, decisions={paused.pending[0].id: le.Approve()},
                               tools=[sender.tool, counter.tool])
    assert done.outcome is le.Outcome.COMPLETED and sender.sent == ["bob"]


@pytest.mark.parametrize("stored", [False, True], ids=["state", "run-store"])
async def test_an_earlier_pauses_state_is_refused_and_no_approved_call_runs_twice(
        tmp_path: Path, clock: FakeClock, make_engine: EngineFactory, stored: bool) -> None:
    """Paused, approved, paused again: the first pause's state (approved once
    already) is refused, so its call does not run again; the second pause's
    state resumes."""
    sender = Sender()
    with SQLiteLedger(tmp_path / "l.db") as ledger:
        engine, provider, _ = make_engine(
            Reply.tool_calls(send("alice")), Reply.tool_calls(send("bob")), Reply.text("done"),
            ledger=ledger, **({"run_store": le.RunStore(ledger)} if stored else {}))
        first = await engine.run(operation(), "go", tools=[sender.tool])
        assert first.state is not None
        second = await engine.resume(first.state, decisions={first.pending[0].id: le.Approve()},
                                     tools=[sender.tool])
        assert second.outcome is le.Outcome.PAUSED and second.state is not None
        with pytest.raises(le.ConfigError, match="latest pause"):
            await engine.resume(first.state, decisions={first.pending[0].id: le.Approve()},
                                tools=[sender.tool])
        assert sender.sent == ["alice"] and len(provider.requests) == 2
        done = await engine.resume(second.state,
                                   decisions={second.pending[0].id: le.Approve()},
                                   tools=[sender.tool])
    assert done.outcome is le.Outcome.COMPLETED and sender.sent == ["alice", "bob"]


async def test_another_runs_state_under_this_runs_id_is_refused(
        make_engine: EngineFactory) -> None:
    """Run A's state given B's invocation id: refused; neither A's call nor B's runs."""
    sender = Sender()
    engine, provider, ledger = make_engine(Reply.tool_calls(send("a")),
                                           Reply.tool_calls(send("b")))
    a = await engine.run(operation(), "go", tools=[sender.tool])
    b = await engine.run(operation(), "go", tools=[sender.tool])
    assert a.state is not None and b.state is not None
    forged = json.loads(a.state.dumps())
    forged["invocation_id"] = b.invocation_id
    with pytest.raises(le.ConfigError, match="latest pause"):
        await engine.resume(json.dumps(forged), decisions={a.pending[0].id: le.Approve()},
                            tools=[sender.tool])
    assert sender.sent == [] and len(provider.requests) == 2
    assert {ledger.invocations[r.invocation_id]["outcome"] for r in (a, b)} == {"paused"}


@pytest.mark.parametrize("store", ["sqlite", "postgres"])
async def test_two_resumes_of_one_pause_without_a_run_store_run_its_call_once(
        request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock,
        make_engine: EngineFactory, store: str) -> None:
    """Two engines, each on its own connection to one database (as two
    processes), resume the same state at once, many times over: exactly one
    proceeds, the other raises RunBusyError having recorded nothing (or, come
    after the run ended, ConfigError), and the approved call runs once."""
    opened: list[Any] = []

    async def open_two() -> tuple[Any, Any]:
        if store == "sqlite":
            path = tmp_path / f"l{len(opened)}.db"
            pair = SQLiteLedger(path), SQLiteLedger(path)
        else:
            server: PostgresServer = request.getfixturevalue("postgres_server")
            schema = fresh_schema()
            pair = (PostgresLedger(server.dsn(), schema=schema),
                    PostgresLedger(server.dsn(), schema=schema))
            for ledger in pair:
                await ledger.open()
        opened.extend(pair)
        return pair

    try:
        for _ in range(10):
            one, two = await open_two()
            sender = Sender()
            first, _, _ = make_engine(Reply.tool_calls(send("bob")), Reply.text("done"),
                                      ledger=one)
            second, _, _ = make_engine(Reply.text("done"), ledger=two)
            paused = await first.run(operation(), "go", tools=[sender.tool])
            assert paused.state is not None
            decisions = {paused.pending[0].id: le.Approve()}
            outcomes: list[object] = []

            async def resume(engine: le.Engine, outcomes: list[object] = outcomes,
                             state: le.RunState = paused.state,
                             decisions: dict[str, le.Decision] = decisions,
                             sender: Sender = sender) -> None:
                try:
                    result = await engine.resume(state, decisions=decisions,
                                                 tools=[sender.tool])
                    outcomes.append(result.outcome)
                except le.RunBusyError as busy:
                    outcomes.append(busy)  # it took the pause second
                except le.ConfigError as late:
                    assert "is not paused: it is completed" in str(late)
                    outcomes.append(late)  # it came once the other had ended the run

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(resume, first)
                tasks.start_soon(resume, second)
            refused = [o for o in outcomes if isinstance(o, le.LoopEngineError)]
            assert len(refused) == 1 and outcomes.count(le.Outcome.COMPLETED) == 1
            assert sender.sent == ["bob"]
            progress = await one.read_progress(paused.invocation_id)
            assert progress.outcome == "completed" and progress.turns == 2
    finally:
        for ledger in opened:
            ledger.close()
