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
import sqlite3
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

import loopengine as le
from loopengine._runstate import Progress
from loopengine.persistence import MemoryLedger, PostgresLedger, SQLiteLedger
from loopengine.persistence._records import InvocationEnd, InvocationStart
from loopengine.providers import Reply, ScriptedProvider
from loopengine.testing import FakeClock

from .conftest import PRICES, EngineFactory, operation
from .pause_scenarios import Sender, send
from .postgres_support import PostgresServer, fresh_schema
from .rule_scenarios import Counter, lookup
from .test_recovery import MeetingLedger

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
        tools=("send", "lookup"), features=None,
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


async def _race(one: le.Engine, two: le.Engine, state: Any, decisions: dict[str, Any],
                tools: list[le.Tool]) -> list[object]:
    """Both resumes at once; what each gave: an outcome or the error it raised."""
    outcomes: list[object] = []

    async def resume(engine: le.Engine) -> None:
        try:
            outcomes.append((await engine.resume(state, decisions=decisions,
                                                 tools=tools)).outcome)
        except le.LoopEngineError as error:
            outcomes.append(error)

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(resume, one)
        tasks.start_soon(resume, two)
    return outcomes


@pytest.mark.parametrize("sealed", [True, False], ids=["sealed", "recorded-before-seals"])
async def test_two_resumes_that_both_found_the_pause_take_it_once(
        tmp_path: Path, clock: FakeClock, sealed: bool) -> None:
    """Both read the run paused before either takes it: the ledger's
    compare-and-set lets one in, the other raises RunBusyError having sent and
    recorded nothing, the approved call runs once. So too for a pause recorded
    before the ledger kept seals (its seal NULL)."""
    sender = Sender()
    seen: list[object] = []
    with MeetingLedger(tmp_path / "l.db") as ledger:
        provider = ScriptedProvider([Reply.tool_calls(send("a")), Reply.text("done"),
                                     Reply.text("done twice")], clock=clock)
        engines = [le.Engine(provider, ledger=ledger, clock=clock, prices=PRICES,
                             observers=[seen.append]) for _ in range(2)]
        paused = await engines[0].run(operation(), "go", tools=[sender.tool])
        assert paused.state is not None
        if not sealed:
            await ledger.flush()
            with sqlite3.connect(ledger.path) as conn:
                conn.execute("UPDATE invocations SET pause_seal = NULL")
        ledger.meet = 2
        outcomes = await _race(*engines, paused.state, {paused.pending[0].id: le.Approve()},
                               [sender.tool])
        ledger.meet = 0
        busy = [o for o in outcomes if isinstance(o, le.RunBusyError)]
        assert len(busy) == 1 and le.Outcome.COMPLETED in outcomes
        assert sender.sent == ["a"] and len(provider.requests) == 2
        assert [type(e).__name__ for e in seen if type(e).__name__ in
                ("RunResumed", "RunEnded")] == ["RunResumed", "RunEnded"]
        progress = await ledger.read_progress(paused.invocation_id)
        assert (progress.outcome, progress.turns, progress.tool_calls) == ("completed", 2, 1)


async def test_a_resume_past_its_pause_timeout_ends_the_run_only_if_no_resume_took_it(
        tmp_path: Path) -> None:
    """Two hosts resume one pause, one's clock 1 s inside pause_timeout and the
    other's 1 s past it, both having read it paused: exactly one takes it. The
    other raises RunBusyError and records nothing: either the run went on and
    its call ran once, or it ended time_limit and its call never ran."""
    seen = set()
    for round_ in range(6):
        sender = Sender()
        early, late = FakeClock(), FakeClock()
        with MeetingLedger(tmp_path / f"l{round_}.db") as ledger:
            provider = ScriptedProvider([Reply.tool_calls(send("a")), Reply.text("done")],
                                        clock=early)
            on_time = le.Engine(provider, ledger=ledger, clock=early, prices=PRICES)
            too_late = le.Engine(provider, ledger=ledger, clock=late, prices=PRICES)
            paused = await on_time.run(operation(pause_timeout=100), "go", tools=[sender.tool])
            assert paused.state is not None
            early.advance(99)
            late.advance(101)
            ledger.meet = 2
            engines = (on_time, too_late) if round_ % 2 else (too_late, on_time)
            outcomes = await _race(*engines, paused.state,
                                   {paused.pending[0].id: le.Approve()}, [sender.tool])
            ledger.meet = 0
            progress = await ledger.read_progress(paused.invocation_id)
        assert len([o for o in outcomes if isinstance(o, le.RunBusyError)]) == 1, outcomes
        seen.add(progress.outcome)
        if progress.outcome == "completed":
            assert le.Outcome.COMPLETED in outcomes and sender.sent == ["a"]
        else:
            assert progress.outcome == "time_limit" and sender.sent == []
            assert any(isinstance(o, le.ConfigError) for o in outcomes)
    assert seen <= {"completed", "time_limit"}


async def test_a_pause_whose_transcript_holds_a_lone_surrogate_resumes(
        tmp_path: Path, clock: FakeClock, make_engine: EngineFactory) -> None:
    """A model's reply may carry a lone surrogate (escaped in its JSON): the run
    still pauses (its state encodes it escaped, its seal is computed), and the
    state resumes, from bytes and by id from a run store."""
    sender = Sender()
    with SQLiteLedger(tmp_path / "l.db") as ledger:
        engine, _, _ = make_engine(
            Reply.tool_calls(("send", {"to": "bo\ud800b"})), Reply.text("done"),
            ledger=ledger, run_store=le.RunStore(ledger))
        paused = await engine.run(operation(), "go", tools=[sender.tool])
        assert paused.outcome is le.Outcome.PAUSED and paused.state is not None
        again = le.RunState.loads(paused.state.dumps())
        assert again.seal() == paused.state.seal() and again.pending == paused.state.pending
        done = await engine.resume(paused.invocation_id,
                                   decisions={paused.pending[0].id: le.Approve()},
                                   tools=[sender.tool])
    assert done.outcome is le.Outcome.COMPLETED and sender.sent == ["bo\ud800b"]


@pytest.mark.parametrize("how", ["state", "bytes", "id"])
async def test_r13_a_resumed_run_sends_the_features_it_ran_with(
        tmp_path: Path, make_engine: EngineFactory, how: str) -> None:
    """The operation's request features, as the run narrowed them, travel in
    the state: the resumed requests send them again (never the operation's
    wider ones, never none)."""
    published = le.Operation(name="test.op", provider="anthropic",
                             model="claude-sonnet-4-5", max_output_tokens=4096,
                             thinking=le.Thinking(budget_tokens=2048), betas=("b1", "b2"))
    sender = Sender()
    with SQLiteLedger(tmp_path / "l.db") as ledger:
        engine, provider, _ = make_engine(Reply.tool_calls(send("a")), Reply.text("done"),
                                          ledger=ledger, run_store=le.RunStore(ledger))
        paused = await engine.run(published, "go", tools=[sender.tool],
                                  features={"betas": ("b1",)})
        assert paused.state is not None
        state: Any = {"state": paused.state, "bytes": paused.state.dumps(),
                      "id": paused.invocation_id}[how]
        await engine.resume(state, decisions={paused.pending[0].id: le.Approve()},
                            tools=[sender.tool])
    sent = [(r.features.thinking, r.features.betas) for r in provider.requests]
    assert sent == [(le.Thinking(budget_tokens=2048), ("b1",))] * 2


async def given_back_then_resumed(engine: le.Engine, store: le.RunStore,
                                  paused: le.RunResult, sender: Sender) -> None:
    """The run is paused in its store again, held by nobody, its call not run,
    and the next resume completes it."""
    stored = await store.load(paused.invocation_id)
    assert stored is not None and stored.paused_at is not None
    assert stored.lease_owner is None and sender.sent == []
    done = await engine.resume(paused.invocation_id, tools=[sender.tool],
                               decisions={paused.pending[0].id: le.Approve()})
    assert done.outcome is le.Outcome.COMPLETED and sender.sent == ["a"]


class FlakyLedger(SQLiteLedger):
    """A SQLite ledger whose next ``read_progress`` fails once ``fail`` is set."""

    fail = False

    async def read_progress(self, invocation_id: str) -> Any:
        if self.fail:
            self.fail = False
            raise le.LedgerError("the connection was reset")
        return await super().read_progress(invocation_id)


async def test_a_resume_that_fails_before_it_begins_leaves_the_run_store_as_it_found_it(
        tmp_path: Path, make_engine: EngineFactory) -> None:
    """A resume whose ledger read fails after its run store claim gives the run
    back: it is paused again at once (not held until its lease expires), and
    the next resume completes it."""
    sender = Sender()
    with FlakyLedger(tmp_path / "l.db") as ledger:
        store = le.RunStore(ledger)
        engine, _, _ = make_engine(Reply.tool_calls(send("a")), Reply.text("done"),
                                   ledger=ledger, run_store=store)
        paused = await engine.run(operation(), "go", tools=[sender.tool])
        decisions = {paused.pending[0].id: le.Approve()}
        ledger.fail = True
        with pytest.raises(le.LedgerError, match="reset"):
            await engine.resume(paused.invocation_id, decisions=decisions, tools=[sender.tool])
        await given_back_then_resumed(engine, store, paused, sender)


async def test_a_run_taken_from_its_pause_by_a_process_that_died_still_has_its_pause_timeout(
        tmp_path: Path, clock: FakeClock, make_engine: EngineFactory) -> None:
    """A process claimed the paused run and died before it took the ledger's
    pause: recovered past pause_timeout, the run ends time_limit, its call
    never run."""
    sender = Sender()
    with SQLiteLedger(tmp_path / "l.db") as ledger:
        store = le.RunStore(ledger)
        engine, provider, _ = make_engine(Reply.tool_calls(send("a")), Reply.text("done"),
                                          ledger=ledger, run_store=store)
        paused = await engine.run(operation(pause_timeout=10), "go", tools=[sender.tool])
        stored = await store.load(paused.invocation_id)
        assert stored is not None
        await store.claim(paused.invocation_id, "dead-host:1:x", version=stored.version,
                          expires_at=clock.wall(), now=clock.wall(), force=False)
        clock.advance(1000)
        with pytest.raises(le.ConfigError, match="pause_timeout"):
            await engine.resume(paused.invocation_id,
                                decisions={paused.pending[0].id: le.Approve()},
                                tools=[sender.tool], force=True)
        assert (await ledger.read_progress(paused.invocation_id)).outcome == "time_limit"
        assert await store.load(paused.invocation_id) is None
    assert sender.sent == [] and len(provider.requests) == 1


class CancelledAfterClaim(le.RunStore):
    """A run store whose next claim commits, then its caller is cancelled."""

    cancel: Callable[[], None] | None = None

    async def claim(self, *args: Any, **kwargs: Any) -> None:
        await super().claim(*args, **kwargs)
        if self.cancel is not None:
            self.cancel()
            self.cancel = None
            await anyio.lowlevel.checkpoint()


async def test_a_resume_cancelled_as_it_claims_the_run_gives_the_claim_back(
        tmp_path: Path, make_engine: EngineFactory) -> None:
    """Cancelled once its claim committed, before it began: the run is paused
    in its store again at once, and the next resume completes it."""
    sender = Sender()
    with SQLiteLedger(tmp_path / "l.db") as ledger:
        store = CancelledAfterClaim(ledger)
        engine, _, _ = make_engine(Reply.tool_calls(send("a")), Reply.text("done"),
                                   ledger=ledger, run_store=store)
        paused = await engine.run(operation(), "go", tools=[sender.tool])
        decisions = {paused.pending[0].id: le.Approve()}
        with anyio.CancelScope() as scope:
            store.cancel = scope.cancel
            await engine.resume(paused.invocation_id, decisions=decisions, tools=[sender.tool])
        assert scope.cancelled_caught
        await given_back_then_resumed(engine, store, paused, sender)
