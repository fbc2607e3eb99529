"""The run store on every ledger store (memory, SQLite, PostgreSQL): checkpoints,
leases, in-doubt calls and resumes by invocation id (docs/pause-and-resume.md).

A process that dies is stood in for, here, by a handler raising a
`BaseException` no run catches (`Crash`): nothing after it runs, as after a
kill. tests/test_recovery_processes.py kills real processes.
"""

from __future__ import annotations

import random
import sqlite3
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import pytest

import loopengine as le
from loopengine import events
from loopengine.persistence import MemoryLedger, SQLiteLedger
from loopengine.providers import Reply, ScriptedProvider
from loopengine.testing import FakeClock

from .conftest import PRICES, operation
from .pause_scenarios import Sender, send


class Crash(BaseException):
    """Stands in for the death of the process (nothing catches it)."""


@pytest.fixture
def ledger(each_ledger: Any) -> Any:
    """Each store in turn (`each_ledger`)."""
    return each_ledger


class Charger:
    """``charge`` (not idempotent) and ``lookup`` (idempotent): each records its
    runs; ``crash_on`` makes the next run of that tool die mid-handler."""

    def __init__(self) -> None:
        self.runs: list[tuple[str, str]] = []
        self.keys: list[str] = []
        self.crash_on: str | None = None
        # Called (in the handler's worker thread) just before a crash.
        self.before_crash: Callable[[], None] | None = None

        @le.tool
        def charge(card: str, ctx: le.ToolContext) -> str:
            """Charge a card."""
            self.runs.append(("charge", card))
            self.keys.append(ctx.idempotency_key)
            if self.crash_on == "charge":
                self.crash_on = None
                raise Crash
            return f"charged {card}"

        @le.tool(idempotent=True)
        def lookup(card: str) -> str:
            """Look a card up."""
            self.runs.append(("lookup", card))
            if self.crash_on == "lookup":
                self.crash_on = None
                if self.before_crash is not None:
                    self.before_crash()
                raise Crash
            return f"{card} is valid"

        self.tools = [charge, lookup]


def engine_on(ledger: Any, clock: FakeClock, *script: Reply,
              **kwargs: Any) -> tuple[le.Engine, ScriptedProvider, le.RunStore]:
    provider = ScriptedProvider(list(script), clock=clock)
    store = le.RunStore(ledger)
    engine = le.Engine(provider, ledger=ledger, clock=clock, prices=PRICES,
                       rng=random.Random(3), run_store=store, **kwargs)
    return engine, provider, store


async def crashed(engine: le.Engine, charger: Charger) -> None:
    with pytest.raises(BaseException) as caught:
        await engine.run(operation(total_time=600.0), "pay", tools=charger.tools)
    assert caught.group_contains(Crash) if isinstance(caught.value, BaseExceptionGroup) \
        else isinstance(caught.value, Crash)


async def crashed_in_charge(ledger: Any, clock: FakeClock) -> tuple[
        le.Engine, ScriptedProvider, le.RunStore, Charger, str]:
    """A run killed in charge's handler (its reply asked for charge, then says
    ``done``): its engine, provider, store, tools and invocation id."""
    charger = Charger()
    charger.crash_on = "charge"
    engine, provider, store = engine_on(
        ledger, clock, Reply.tool_calls(("charge", {"card": "4242"})), Reply.text("done"))
    await crashed(engine, charger)
    return engine, provider, store, charger, await the_run_id(store, ledger)


async def the_run_id(store: le.RunStore, ledger: Any) -> str:
    """The one invocation of the ledger (the crashed run returned nothing)."""
    ids = await invocation_ids(ledger)
    assert len(ids) == 1
    return ids[0]


async def invocation_ids(ledger: Any) -> list[str]:
    if isinstance(ledger, MemoryLedger):
        return list(ledger.invocations)
    if isinstance(ledger, SQLiteLedger):
        await ledger.flush()
        with sqlite3.connect(ledger.path) as conn:
            return [r[0] for r in conn.execute("SELECT id FROM invocations")]
    return [r[0] for r in await ledger._transact_qmark(
        lambda conn: conn.execute("SELECT id FROM invocations").fetchall(), "read")]


async def test_an_ended_run_leaves_no_state_and_each_call_its_status(
        ledger: Any, clock: FakeClock) -> None:
    """The run store keeps a run only while it has not ended; its calls' statuses stay."""
    charger = Charger()
    engine, _, store = engine_on(ledger, clock, Reply.tool_calls(("charge", {"card": "4242"}),
                                                                  ("lookup", {"card": "1"})),
                                 Reply.text("done"))
    result = await engine.run(operation(), "pay", tools=charger.tools)
    assert result.outcome is le.Outcome.COMPLETED
    assert await store.load(result.invocation_id) is None
    statuses = await store.tool_calls(result.invocation_id)
    assert sorted(statuses.values()) == ["succeeded", "succeeded"]


async def test_a_paused_run_resumes_by_its_invocation_id_alone(
        ledger: Any, clock: FakeClock) -> None:
    """Paused: its state is in the store; `resume(invocation_id)` needs nothing else."""
    sender = Sender()
    engine, provider, store = engine_on(ledger, clock, Reply.tool_calls(send("a")),
                                        Reply.text("done"))
    paused = await engine.run(operation(), "go", tools=[sender.tool])
    assert paused.outcome is le.Outcome.PAUSED
    stored = await store.load(paused.invocation_id)
    assert stored is not None and stored.paused_at is not None and stored.lease_owner is None
    assert (await store.tool_calls(paused.invocation_id)) == {paused.pending[0].id: "requested"}
    done = await engine.resume(paused.invocation_id, tools=[sender.tool],
                               decisions={paused.pending[0].id: le.Approve()})
    assert done.outcome is le.Outcome.COMPLETED and sender.sent == ["a"]
    assert done.invocation_id == paused.invocation_id
    assert await store.load(paused.invocation_id) is None
    with pytest.raises(le.ConfigError, match="holds no run"):
        await engine.resume(paused.invocation_id, tools=[sender.tool])


async def test_a_second_resume_of_a_paused_run_is_busy(ledger: Any, clock: FakeClock) -> None:
    """Once a resume has taken the run, another resume of the same stored
    version raises RunBusyError and sends nothing."""
    sender = Sender()
    engine, provider, store = engine_on(ledger, clock, Reply.tool_calls(send("a")),
                                        Reply.text("done"))
    paused = await engine.run(operation(), "go", tools=[sender.tool])
    stored = await store.load(paused.invocation_id)
    assert stored is not None
    await store.claim(paused.invocation_id, "someone-else", version=stored.version,
                      expires_at=clock.wall() + timedelta(hours=1), now=clock.wall(),
                      force=False)
    sent = len(provider.requests)
    with pytest.raises(le.RunBusyError):
        await engine.resume(paused.state or b"", tools=[sender.tool],
                            decisions={paused.pending[0].id: le.Approve()})
    assert len(provider.requests) == sent and sender.sent == []


async def test_a_run_paused_without_a_run_store_is_adopted_by_a_resume_with_one(
        ledger: Any, clock: FakeClock) -> None:
    """Paused on an engine without a run store, resumed on one with a store on the
    same ledger: the resume's first checkpoint inserts the run's row, leased, so
    the run goes on under the store (its handler finds it there; a crash from
    then on is recovered by id); it completes and its row is deleted."""
    rows: list[Any] = []

    @le.tool(name="send", approval=True)
    async def send_tool(to: str, ctx: le.ToolContext) -> str:
        """Send the message to someone."""
        rows.append(await store.load(ctx.invocation_id))
        return f"sent to {to}"

    provider = ScriptedProvider([Reply.tool_calls(send("a")), Reply.text("done")], clock=clock)
    plain = le.Engine(provider, ledger=ledger, clock=clock, prices=PRICES,
                      rng=random.Random(3))
    paused = await plain.run(operation(), "go", tools=[send_tool])
    assert paused.outcome is le.Outcome.PAUSED and paused.state is not None
    store = le.RunStore(ledger)
    assert await store.load(paused.invocation_id) is None
    engine = le.Engine(provider, ledger=ledger, clock=clock, prices=PRICES, run_store=store)
    (call,) = paused.pending
    done = await engine.resume(paused.state, decisions={call.id: le.Approve()},
                               tools=[send_tool])
    assert done.outcome is le.Outcome.COMPLETED and done.invocation_id == paused.invocation_id
    [row] = rows
    assert row is not None and row.lease_owner is not None and row.paused_at is None
    kept = le.RunState.loads(row.state)
    assert (kept.invocation_id, kept.batch) == (paused.invocation_id, (call.id,))
    assert kept.progress.turns == 1 and kept.progress.attempts == 1
    assert await store.load(paused.invocation_id) is None
    assert await store.tool_calls(paused.invocation_id) == {call.id: "succeeded"}
    assert (await ledger.read_progress(paused.invocation_id)).outcome == "completed"


class MeetingLedger(SQLiteLedger):
    """A SQLite ledger whose ``read_progress`` waits, once ``meet`` is set, until
    that many callers have read: two resumes both find the run paused before
    either goes on."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.meet = 0
        self._readers = 0
        self._met = anyio.Event()

    async def read_progress(self, invocation_id: str) -> Any:
        progress = await super().read_progress(invocation_id)
        if self.meet:
            self._readers += 1
            if self._readers >= self.meet:
                self._met.set()
            await self._met.wait()
        return progress


async def test_of_two_resumes_adopting_one_paused_run_one_wins_and_the_other_records_nothing(
        tmp_path: Path, clock: FakeClock) -> None:
    """Two engines with run stores resume at once a run paused without one, both
    past the ledger's check: the row's key lets one insert it; the other gets
    RunBusyError, sends nothing, emits nothing and reserves nothing."""
    with MeetingLedger(tmp_path / "ledger.db") as ledger:
        await two_adopting_resumes(ledger, clock)


async def two_adopting_resumes(ledger: MeetingLedger, clock: FakeClock) -> None:
    sender = Sender()
    accounts = le.CreditAccounts(ledger)
    await accounts.grant("acme", 1000)
    provider = ScriptedProvider([Reply.tool_calls(send("a")), Reply.text("done"),
                                 Reply.text("done twice")], clock=clock)
    plain = le.Engine(provider, ledger=ledger, clock=clock, prices=PRICES, accounts=accounts)
    paused = await plain.run(operation(credit_hold=500), "go", tools=[sender.tool],
                             attribution=le.Attribution(tenant="acme"))
    assert paused.state is not None
    stored = paused.state.dumps()
    seen: list[object] = []
    engines = [le.Engine(provider, ledger=ledger, clock=clock, prices=PRICES,
                         accounts=accounts, run_store=le.RunStore(ledger),
                         observers=[seen.append]) for _ in range(2)]
    outcomes: list[object] = []

    async def resume(engine: le.Engine) -> None:
        try:
            done = await engine.resume(stored, tools=[sender.tool],
                                       decisions={paused.pending[0].id: le.Approve()})
            outcomes.append(done.outcome)
        except le.RunBusyError as error:
            outcomes.append(error)

    ledger.meet = 2
    async with anyio.create_task_group() as group:
        for engine in engines:
            group.start_soon(resume, engine)
    assert le.Outcome.COMPLETED in outcomes and len(outcomes) == 2
    assert any(isinstance(o, le.RunBusyError) for o in outcomes)
    assert sender.sent == ["a"] and len(provider.requests) == 2
    assert [type(e).__name__ for e in seen
            if isinstance(e, events.RunResumed | events.RunEnded)] == ["RunResumed", "RunEnded"]
    assert (await ledger.read_progress(paused.invocation_id)).outcome == "completed"
    assert await le.RunStore(ledger).load(paused.invocation_id) is None
    assert await accounts.balance("acme") == le.AccountBalance("acme", 1000, 240, 0, 760)


async def test_a_run_paused_in_a_run_store_is_refused_by_an_engine_without_one(
        ledger: Any, clock: FakeClock) -> None:
    """Its state is kept in the store: an engine without one would leave the row
    (transcript included) behind and skip its lease, so it refuses the resume
    with a ConfigError before anything is sent or recorded; an engine with the
    store then resumes it."""
    sender = Sender()
    engine, provider, store = engine_on(ledger, clock, Reply.tool_calls(send("a")),
                                        Reply.text("done"))
    paused = await engine.run(operation(), "go", tools=[sender.tool])
    assert paused.state is not None
    decisions: dict[str, le.Decision] = {paused.pending[0].id: le.Approve()}
    plain = le.Engine(provider, ledger=ledger, clock=clock, prices=PRICES)
    with pytest.raises(le.ConfigError, match=r"run store: resume it on an engine with "
                                             r"run_store=RunStore\(ledger\)"):
        await plain.resume(paused.state, decisions=decisions, tools=[sender.tool])
    assert sender.sent == [] and len(provider.requests) == 1
    assert (await ledger.read_progress(paused.invocation_id)).outcome == "paused"
    stored = await store.load(paused.invocation_id)
    assert stored is not None and stored.paused_at is not None
    done = await engine.resume(paused.invocation_id, decisions=decisions, tools=[sender.tool])
    assert done.outcome is le.Outcome.COMPLETED and sender.sent == ["a"]
    assert await store.load(paused.invocation_id) is None


async def test_a_non_idempotent_call_cut_by_a_crash_is_in_doubt_never_run_again(
        ledger: Any, clock: FakeClock) -> None:
    """Killed in charge's handler: the lease holds off a resume until it expires
    (or force); the resume pauses with the call in doubt, and Supply gives its
    output without running it again."""
    engine, provider, store, charger, run_id = await crashed_in_charge(ledger, clock)
    assert list((await store.tool_calls(run_id)).values()) == ["started"]
    with pytest.raises(le.RunBusyError, match="lease"):
        await engine.resume(run_id, tools=charger.tools)
    clock.advance(600.0 + 61.0)  # past its deadline and the lease's grace
    paused = await engine.resume(run_id, tools=charger.tools)
    assert paused.outcome is le.Outcome.PAUSED
    assert [(p.tool, p.reason) for p in paused.pending] == [("charge", "in_doubt")]
    assert list((await store.tool_calls(run_id)).values()) == ["in_doubt"]
    done = await engine.resume(run_id, tools=charger.tools,
                               decisions={paused.pending[0].id: le.Supply("charged 4242")})
    assert done.outcome is le.Outcome.COMPLETED
    assert charger.runs == [("charge", "4242")]  # once, never again
    assert list((await store.tool_calls(run_id)).values()) == ["supplied"]
    progress = await ledger.read_progress(run_id)
    assert progress.attempt_count == 2 == len(provider.requests)


async def test_approving_an_in_doubt_call_runs_it_again_with_the_same_key(
        ledger: Any, clock: FakeClock) -> None:
    """Approve() on an in-doubt call runs it again; its idempotency key is the same."""
    engine, _, store, charger, run_id = await crashed_in_charge(ledger, clock)
    paused = await engine.resume(run_id, tools=charger.tools, force=True)
    assert paused.outcome is le.Outcome.PAUSED
    done = await engine.resume(run_id, tools=charger.tools,
                               decisions={paused.pending[0].id: le.Approve()})
    assert done.outcome is le.Outcome.COMPLETED
    assert charger.runs == [("charge", "4242"), ("charge", "4242")]
    assert charger.keys[0] == charger.keys[1]


async def test_an_idempotent_call_cut_by_a_crash_runs_again_and_finished_calls_do_not(
        ledger: Any, clock: FakeClock) -> None:
    """Killed in lookup's handler (the second turn): charge, which had finished,
    keeps its result; lookup (idempotent) runs again; one resume completes it."""
    charger = Charger()
    engine, provider, store = engine_on(
        ledger, clock, Reply.tool_calls(("charge", {"card": "4242"})),
        Reply.tool_calls(("lookup", {"card": "1"})), Reply.text("done"))

    charger.crash_on = "lookup"  # the second turn's call
    original = charger.tools[1]
    await crashed(engine, charger)
    run_id = await the_run_id(store, ledger)
    done = await engine.resume(run_id, tools=charger.tools, force=True)
    assert done.outcome is le.Outcome.COMPLETED, done.detail
    assert charger.runs == [("charge", "4242"), ("lookup", "1"), ("lookup", "1")]
    assert done.tool_calls == 2
    assert original.idempotent
    progress = await ledger.read_progress(run_id)
    assert progress.attempt_count == len(provider.requests) == 3
    assert (progress.turns, progress.tool_calls) == (3, 2)


async def test_a_tools_cap_counts_the_calls_a_crashed_batch_ran_before_it_died(
        ledger: Any, clock: FakeClock) -> None:
    """``max_calls=1``: the batch's first ``pay`` ran and its second was refused
    by the cap before the process died in ``settle``; the recovery answers
    only ``settle`` again, and the cap still counts the ``pay`` that ran, so
    the next turn's ``pay`` is refused: the handler ran once in the run."""
    paid: list[str] = []
    dying = [True]
    store = le.RunStore(ledger)

    @le.tool(max_calls=1)
    async def pay(key: str) -> str:
        """Pay."""
        paid.append(key)
        return f"paid {key}"

    @le.tool(idempotent=True)
    async def settle(ctx: le.ToolContext) -> str:
        """Settle."""
        if dying:
            dying.clear()
            # Until both calls of pay have their ends recorded, then the death.
            while sorted(status for call_id, status in (
                    await store.tool_calls(ctx.invocation_id)).items()
                    if call_id != ctx.call_id) != ["failed", "succeeded"]:
                await anyio.lowlevel.checkpoint()
            raise Crash
        return "settled"

    provider = ScriptedProvider([
        Reply.tool_calls(("pay", {"key": "a"}), ("pay", {"key": "b"}), ("settle", {})),
        Reply.tool_calls(("pay", {"key": "c"})), Reply.text("done")], clock=clock)
    engine = le.Engine(provider, ledger=ledger, clock=clock, prices=PRICES,
                       rng=random.Random(3), run_store=store)
    with pytest.raises(BaseException) as caught:
        await engine.run(operation(total_time=600.0), "pay", tools=[pay, settle])
    assert caught.group_contains(Crash) if isinstance(caught.value, BaseExceptionGroup) \
        else isinstance(caught.value, Crash)
    run_id = await the_run_id(store, ledger)
    done = await engine.resume(run_id, tools=[pay, settle], force=True)
    assert done.outcome is le.Outcome.COMPLETED, done.detail
    assert paid == ["a"]
    (refused,) = provider.requests[-1].messages[-1]["content"]
    assert refused["is_error"] and "at most 1 times" in refused["content"]


async def test_a_tools_cap_counts_an_in_doubt_call_whatever_its_decision(
        ledger: Any, clock: FakeClock) -> None:
    """``max_calls=1``: the process died in ``pay``'s handler; the recovery asks
    about the call in doubt, and ``Supply`` says it ran. It did: the cap
    counts it, so the model's next ``pay`` is refused, never a second run."""
    paid: list[str] = []

    @le.tool(max_calls=1)
    def pay(key: str) -> str:
        """Pay."""
        paid.append(key)
        if len(paid) == 1:
            raise Crash
        return f"paid {key}"

    engine, provider, store = engine_on(
        ledger, clock, Reply.tool_calls(("pay", {"key": "a"})),
        Reply.tool_calls(("pay", {"key": "b"})), Reply.text("done"))
    with pytest.raises(BaseException) as caught:
        await engine.run(operation(total_time=600.0), "pay", tools=[pay])
    assert caught.group_contains(Crash) if isinstance(caught.value, BaseExceptionGroup) \
        else isinstance(caught.value, Crash)
    run_id = await the_run_id(store, ledger)
    paused = await engine.resume(run_id, tools=[pay], force=True)
    (call,) = paused.pending
    assert call.reason == "in_doubt"
    done = await engine.resume(run_id, tools=[pay], decisions={call.id: le.Supply("paid a")})
    assert done.outcome is le.Outcome.COMPLETED, done.detail
    assert paid == ["a"]
    (refused,) = provider.requests[-1].messages[-1]["content"]
    assert refused["is_error"] and "at most 1 times" in refused["content"]


async def test_a_calls_end_writes_the_batchs_results_not_the_transcript(
        clock: FakeClock) -> None:
    """A batch of charge and lookup, killed in lookup's handler once charge had
    ended: the stored state is still the one written before the batch (its
    transcript is not written again at each call's end), the call's result is
    in the row's results beside it, and the resume reads both: charge is not
    run again, lookup (idempotent) is."""
    import json

    ledger = MemoryLedger()
    charger = Charger()
    charger.crash_on = "lookup"
    engine, _, store = engine_on(
        ledger, clock, Reply.tool_calls(("charge", {"card": "4242"}), ("lookup", {"card": "1"})),
        Reply.text("done"))

    async def charge_ended() -> None:
        # The two handlers run at once in worker threads: lookup dies only once
        # charge's end is durable, whichever of them started first.
        run_id = await the_run_id(store, ledger)
        while True:
            if "succeeded" in (await store.tool_calls(run_id)).values():
                return
            await anyio.lowlevel.checkpoint()

    charger.before_crash = lambda: anyio.from_thread.run(charge_ended)
    await crashed(engine, charger)
    run_id = await the_run_id(store, ledger)
    state, results = store._memory.execute(  # type: ignore[union-attr]
        "SELECT state, results FROM run_states WHERE invocation_id = ?", (run_id,)).fetchone()
    assert json.loads(state)["results"] == []
    assert [r["content"] for r in json.loads(results)] == ["charged 4242"]
    assert (await store.load(run_id)).state == replace(  # type: ignore[union-attr]
        le.RunState.loads(state), results=json.loads(results)).dumps()
    done = await engine.resume(run_id, tools=charger.tools, force=True)
    assert done.outcome is le.Outcome.COMPLETED and done.tool_calls == 2
    assert sorted(charger.runs) == [("charge", "4242"), ("lookup", "1"), ("lookup", "1")]


async def crashed_between_turns(ledger: Any, clock: FakeClock) -> tuple[
        ScriptedProvider, Charger, str]:
    """A run killed as its second turn's first attempt went out (after lookup's
    batch was checkpointed): its provider, tools and invocation id."""
    charger = Charger()

    def crash_observer(event: object) -> None:
        if isinstance(event, events.AttemptStarted) and event.ordinal == 2:
            raise Crash

    engine, provider, store = engine_on(
        ledger, clock, Reply.tool_calls(("lookup", {"card": "1"})), Reply.text("done"),
        observers=[crash_observer])
    with pytest.raises(Crash):
        await engine.run(operation(total_time=600.0), "pay", tools=charger.tools)
    return provider, charger, await the_run_id(store, ledger)


async def test_a_crash_between_turns_sends_the_turn_again(ledger: Any, clock: FakeClock) -> None:
    """Killed after the batch's checkpoint: the next turn is sent as a new
    attempt, ordinals dense; no call runs again."""
    provider, charger, run_id = await crashed_between_turns(ledger, clock)
    engine2, provider2, _ = engine_on(ledger, clock, Reply.text("done"))
    done = await engine2.resume(run_id, tools=charger.tools, force=True)
    assert done.outcome is le.Outcome.COMPLETED
    assert charger.runs == [("lookup", "1")]
    progress = await ledger.read_progress(run_id)
    assert progress.turns == 2 and progress.tool_calls == 1
    # The attempt the crash cut stays dispatched (it was never sent here); the
    # turn went again as attempt 3.
    assert progress.attempt_count == 3 == len(provider.requests) + len(provider2.requests) + 1


async def test_a_crash_during_the_first_request_sends_it_again(ledger: Any,
                                                              clock: FakeClock) -> None:
    """Killed as its first request went out (only the start checkpoint was
    written, the transcript a single user message): the resume sends turn 1
    again as its attempt 2 and the run completes."""
    charger = Charger()

    def crash_on_first(event: object) -> None:
        if isinstance(event, events.AttemptStarted):
            raise Crash

    engine, _, store = engine_on(ledger, clock, Reply.text("done"), observers=[crash_on_first])
    with pytest.raises(Crash):
        await engine.run(operation(total_time=600.0), "pay", tools=charger.tools)
    run_id = await the_run_id(store, ledger)
    seen: list[events.AttemptStarted] = []
    engine2, _, _ = engine_on(
        ledger, clock, Reply.text("done"),
        observers=[lambda e: seen.append(e) if isinstance(e, events.AttemptStarted) else None])
    done = await engine2.resume(run_id, tools=charger.tools, force=True)
    assert done.outcome is le.Outcome.COMPLETED and done.answer == "done"
    assert [(e.ordinal, e.turn, e.attempt) for e in seen] == [(2, 1, 2)]
    assert done.turns == 1 and charger.runs == []


async def test_r03_a_reply_settled_just_before_a_crash_counts_against_the_hold(
        ledger: Any, clock: FakeClock) -> None:
    """Killed once turn 2's reply was settled, before its checkpoint: the turn is
    sent again as its attempt 2, and its charge is both replies' (R03), so the
    hold sees what the dead process was billed: 120 + 240 credits pass the
    hold of 300 and the run stops before turn 2's batch. Its usage has all
    three replies."""
    charger = Charger()

    def crash_once_settled(event: object) -> None:
        if isinstance(event, events.AttemptSettled) and event.turn == 2:
            raise Crash

    engine, _, store = engine_on(
        ledger, clock, Reply.tool_calls(("lookup", {"card": "1"})),
        Reply.tool_calls(("lookup", {"card": "2"})), observers=[crash_once_settled])
    with pytest.raises(Crash):
        await engine.run(operation(total_time=600.0, credit_hold=300), "pay",
                         tools=charger.tools)
    run_id = await the_run_id(store, ledger)
    seen: list[events.AttemptStarted] = []
    engine2, _, _ = engine_on(
        ledger, clock, Reply.tool_calls(("lookup", {"card": "2"})), Reply.text("done"),
        observers=[lambda e: seen.append(e) if isinstance(e, events.AttemptStarted) else None])
    done = await engine2.resume(run_id, tools=charger.tools, force=True)
    assert done.outcome is le.Outcome.CREDIT_LIMIT
    assert charger.runs == [("lookup", "1")]
    assert [(e.ordinal, e.turn, e.attempt) for e in seen] == [(3, 2, 2)]
    assert done.credits == 360
    assert (done.usage.input_tokens, done.usage.output_tokens) == (300, 60)
    progress = await ledger.read_progress(run_id)
    assert (progress.turns, progress.credits, progress.attempt_count) == (2, 360, 3)
    assert progress.usage.input_tokens == 300


def test_r04_a_call_the_deadline_cut_is_recorded_in_doubt_when_the_run_ends() -> None:
    """A handler still running at the run's deadline: the run ends time_limit and
    its call, started and never ended, is recorded ``in_doubt`` (it may have
    done its work); the call that finished keeps ``succeeded``. On trio's
    MockClock: the deadline comes without waiting for it."""
    import trio
    import trio.testing

    from .test_deadline import quick, stuck

    ledger = MemoryLedger()
    store = le.RunStore(ledger)
    engine = le.Engine(ScriptedProvider([Reply.tool_calls(("quick", {"key": "a"}),
                                                          ("stuck", {"key": "b"}))]),
                       ledger=ledger, prices=PRICES, run_store=store)
    seen: list[tuple[le.RunResult, dict[str, str]]] = []

    async def main() -> None:
        result = await engine.run(operation(total_time=2.0), "go", tools=[quick, stuck])
        seen.append((result, await store.tool_calls(result.invocation_id)))

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    result, statuses = seen[0]
    assert result.outcome is le.Outcome.TIME_LIMIT
    quick_id, stuck_id = (b["tool_use_id"] for b in result.messages[-1]["content"])
    assert statuses == {quick_id: "succeeded", stuck_id: "in_doubt"}


async def test_a_resume_refused_for_its_pause_timeout_emits_run_ended(
        ledger: Any, clock: FakeClock) -> None:
    """Past pause_timeout: ConfigError, the ledger says time_limit, observers get
    RunEnded(time_limit), and the store forgets the run."""
    sender = Sender()
    seen: list[object] = []
    engine, _, store = engine_on(ledger, clock, Reply.tool_calls(send("a")),
                                 Reply.text("done"), observers=[seen.append])
    paused = await engine.run(operation(pause_timeout=60.0), "go", tools=[sender.tool])
    clock.advance(61.0)
    with pytest.raises(le.ConfigError, match="pause_timeout"):
        await engine.resume(paused.invocation_id, tools=[sender.tool],
                            decisions={paused.pending[0].id: le.Approve()})
    ended = [e for e in seen if isinstance(e, events.RunEnded)]
    assert [e.outcome for e in ended] == ["time_limit"]
    assert (await ledger.read_progress(paused.invocation_id)).outcome == "time_limit"
    assert await store.load(paused.invocation_id) is None
    assert sender.sent == []


async def test_an_engine_refuses_a_run_store_of_another_ledger(clock: FakeClock) -> None:
    """The store must be on the engine's ledger; resume by id needs a store."""
    with pytest.raises(le.ConfigError, match="run_store"):
        le.Engine(ScriptedProvider([]), ledger=MemoryLedger(),
                  run_store=le.RunStore(MemoryLedger()))
    with pytest.raises(le.ConfigError, match="RunStore"):
        le.Engine(ScriptedProvider([]), ledger=MemoryLedger(), run_store="x")  # type: ignore[arg-type]
    with pytest.raises(le.ConfigError, match="ledger"):
        le.RunStore(object())
    engine = le.Engine(ScriptedProvider([]), ledger=MemoryLedger())
    with pytest.raises(le.ConfigError, match="run_store"):
        await engine.resume("some-invocation-id")


async def test_an_admission_denied_resume_does_not_restart_the_pause_clock(
        tmp_path: Path, clock: FakeClock) -> None:
    """A resume its account cannot admit stays the same pause: its state and the
    ledger keep the first pause's time, so pause_timeout counts from it."""
    sender = Sender()
    with SQLiteLedger(tmp_path / "ledger.db") as ledger:
        accounts = le.CreditAccounts(ledger)
        await accounts.grant("acme", 120)  # the first turn spends it all
        provider = ScriptedProvider([Reply.tool_calls(send("a"))], clock=clock)
        engine = le.Engine(provider, ledger=ledger, clock=clock, prices=PRICES,
                           accounts=accounts)
        paused = await engine.run(operation(credit_hold=500, pause_timeout=60.0), "go",
                                  tools=[sender.tool], attribution=le.Attribution(tenant="acme"))
        assert paused.outcome is le.Outcome.PAUSED and paused.state is not None
        first = paused.state.paused_at
        clock.advance(40.0)
        denied = await engine.resume(paused.state, tools=[sender.tool],
                                     decisions={paused.pending[0].id: le.Approve()})
        assert denied.outcome is le.Outcome.ADMISSION_DENIED and denied.state is not None
        assert denied.state.paused_at == first
        assert (await ledger.read_progress(paused.invocation_id)).ended_at == first
        clock.advance(30.0)  # 70s since the pause, past a 60s pause_timeout
        with pytest.raises(le.ConfigError, match="pause_timeout"):
            await engine.resume(denied.state, tools=[sender.tool],
                                decisions={paused.pending[0].id: le.Approve()})
        assert sender.sent == []


async def test_a_sqlite_ledger_with_a_run_store_stays_readable_by_its_owner_only(
        tmp_path: Path, clock: FakeClock) -> None:
    """The transcript lives in the ledger file: it stays 0600."""
    sender = Sender()
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as ledger:
        engine, _, store = engine_on(ledger, clock, Reply.tool_calls(send("a")))
        paused = await engine.run(operation(), "go", tools=[sender.tool])
        assert await store.load(paused.invocation_id) is not None
    assert path.stat().st_mode & 0o777 == 0o600


async def test_a_sqlite_ledger_zeroes_an_ended_runs_transcript_in_its_file(
        tmp_path: Path, clock: FakeClock) -> None:
    """The transcript's row is deleted when its run ends, and its pages are
    zeroed (SQLite's ``secure_delete``, which the ledger's writer turns on
    whatever the build's default): after a checkpoint the database file holds
    no byte of it."""
    sender = Sender()
    path = tmp_path / "ledger.db"
    marker = "zq-transcript-marker-" + "7" * 200
    with SQLiteLedger(path) as ledger:
        engine, _, store = engine_on(ledger, clock, Reply.tool_calls(send("a")),
                                     Reply.text("sent"))
        paused = await engine.run(operation(), marker, tools=[sender.tool])
        assert marker.encode() in path.read_bytes() + path.with_name(
            "ledger.db-wal").read_bytes()
        done = await engine.resume(paused.invocation_id, decisions={
            paused.pending[0].id: le.Approve()}, tools=[sender.tool])
        assert done.outcome is le.Outcome.COMPLETED
        assert await store.load(paused.invocation_id) is None
    checkpointed = sqlite3.connect(path)
    checkpointed.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    checkpointed.close()
    assert marker.encode() not in path.read_bytes()


async def test_a_process_whose_run_was_taken_over_gets_run_busy_and_records_nothing(
        ledger: Any, clock: FakeClock) -> None:
    """Run A is slow in charge's handler; B takes the run over (force) and finds
    the call in doubt. When A's handler returns, A's next checkpoint raises
    RunBusyError: A records nothing, and the run stays B's (paused)."""
    entered, release = anyio.Event(), anyio.Event()
    run_ids: list[str] = []

    @le.tool
    async def charge(card: str, ctx: le.ToolContext) -> str:
        """Charge a card."""
        run_ids.append(ctx.invocation_id)
        entered.set()
        await release.wait()
        return f"charged {card}"

    engine, provider, store = engine_on(
        ledger, clock, Reply.tool_calls(("charge", {"card": "4242"})), Reply.text("done"))
    outcome: list[BaseException] = []

    async def process_a() -> None:
        try:
            await engine.run(operation(total_time=600.0), "pay", tools=[charge])
        except le.RunBusyError as error:
            outcome.append(error)

    async with anyio.create_task_group() as group:
        group.start_soon(process_a)
        await entered.wait()
        taken = await engine.resume(run_ids[0], tools=[charge], force=True)
        assert taken.outcome is le.Outcome.PAUSED
        assert [p.reason for p in taken.pending] == ["in_doubt"]
        release.set()
    assert len(outcome) == 1 and isinstance(outcome[0], le.RunBusyError)
    assert (await ledger.read_progress(run_ids[0])).outcome == "paused"
    stored = await store.load(run_ids[0])
    assert stored is not None and stored.paused_at is not None
    assert list((await store.tool_calls(run_ids[0])).values()) == ["in_doubt"]
    assert len(provider.requests) == 1


class HeldProvider(ScriptedProvider):
    """A script whose second request waits, once it has arrived (``arrived``),
    until ``release`` is set: a process slow on the wire."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.arrived, self.release = anyio.Event(), anyio.Event()

    async def send(self, request: Any, **kwargs: Any) -> Any:
        """Serve the next item; the second request only once released."""
        if len(self.requests) == 1:
            self.arrived.set()
            await self.release.wait()
        return await super().send(request, **kwargs)


@pytest.mark.parametrize("a_would", ["end", "pause"])
async def test_a_process_whose_run_was_taken_over_ends_nothing_of_it(
        ledger: Any, clock: FakeClock, a_would: str) -> None:
    """Run A is slow on its second turn's request; B takes the run over (force),
    sends the turn again and pauses on a call that needs approval. A's reply
    then answers (or asks for a call that needs approval): A raises
    RunBusyError before its end (or pause), so it neither ends nor pauses the
    invocation over B's pause nor deletes B's stored state, and B's pause
    resumes to its end."""
    charger, sender = Charger(), Sender()
    second = Reply.text("done by A") if a_would == "end" else Reply.tool_calls(send("eve"))
    slow = HeldProvider([Reply.tool_calls(("lookup", {"card": "4242"})), second], clock=clock)
    store = le.RunStore(ledger)
    started: list[str] = []
    process_a = le.Engine(slow, ledger=ledger, clock=clock, prices=PRICES, run_store=store,
                          observers=[lambda event: started.append(event.run_id) if isinstance(
                              event, events.RunStarted) else None])
    process_b, provider_b, _ = engine_on(ledger, clock, Reply.tool_calls(send("bob")),
                                         Reply.text("done by B"))
    tools = [*charger.tools, sender.tool]
    outcome: list[BaseException] = []

    async def run_a() -> None:
        try:
            await process_a.run(operation(total_time=600.0), "pay", tools=tools)
        except le.RunBusyError as error:
            outcome.append(error)

    async with anyio.create_task_group() as group:
        group.start_soon(run_a)
        await slow.arrived.wait()
        (run_id,) = started
        taken = await process_b.resume(run_id, tools=tools, force=True)
        assert taken.outcome is le.Outcome.PAUSED
        slow.release.set()
    assert len(outcome) == 1 and isinstance(outcome[0], le.RunBusyError)
    assert (await ledger.read_progress(run_id)).outcome == "paused"
    stored = await store.load(run_id)
    assert stored is not None and stored.paused_at is not None
    done = await process_b.resume(run_id, tools=tools,
                                  decisions={taken.pending[0].id: le.Approve()})
    assert done.outcome is le.Outcome.COMPLETED and done.answer == "done by B"
    assert sender.sent == ["bob"] and charger.runs == [("lookup", "4242")]
    assert (await ledger.read_progress(run_id)).outcome == "completed"


async def test_a_stale_state_of_an_ended_run_is_forgotten_by_the_resume_that_finds_it(
        ledger: Any, clock: FakeClock) -> None:
    """The run ended, but its process died before deleting its stored state: a
    resume says it ended (ConfigError) and the store forgets it."""
    saved: list[bytes] = []

    @le.tool(idempotent=True)
    async def lookup(card: str, ctx: le.ToolContext) -> str:
        """Look a card up."""
        stored = await store.load(ctx.invocation_id)
        assert stored is not None
        saved.append(stored.state)
        return "valid"

    engine, _, store = engine_on(ledger, clock, Reply.tool_calls(("lookup", {"card": "1"})),
                                 Reply.text("done"))
    done = await engine.run(operation(), "pay", tools=[lookup])
    assert done.outcome is le.Outcome.COMPLETED
    assert await store.load(done.invocation_id) is None
    # Put back what a kill between the end and the deletion would have left.
    await store.checkpoint(done.invocation_id, "dead-process", now=clock.wall(),
                           state=saved[0], expires_at=clock.wall(), create=True)
    with pytest.raises(le.ConfigError, match="completed"):
        await engine.resume(done.invocation_id, tools=[lookup])
    assert await store.load(done.invocation_id) is None


# -- a crash at every event ------------------------------------------------------------------


def three_turns(request: Any) -> Reply:
    """The conversation a request is in, read off its tool results: charge 1 and
    lookup 1, then charge 2, then ``done`` (the same reply however often a turn
    is sent again)."""
    results = sum(1 for m in request.messages if isinstance(m.get("content"), list)
                  for b in m["content"] if b.get("type") == "tool_result")
    if results == 0:
        return Reply(content=[{"type": "tool_use", "id": "t1_charge", "name": "charge",
                               "input": {"card": "1"}},
                              {"type": "tool_use", "id": "t1_lookup", "name": "lookup",
                               "input": {"card": "1"}}], stop_reason="tool_use")
    if results == 2:
        return Reply(content=[{"type": "tool_use", "id": "t2_charge", "name": "charge",
                               "input": {"card": "2"}}], stop_reason="tool_use")
    return Reply.text("done")


async def crash_at(ledger: Any, clock: FakeClock, at: int | None) -> tuple[
        int, str, le.RunResult | None, Charger]:
    """Run `three_turns`, killed at its ``at``-th event (None: never); then, if
    killed, resume it until it ends, deciding each in-doubt charge by whether it
    took effect. Returns the events seen, the run's id, its result (None: it
    could not be resumed) and its tools."""
    charger = Charger()
    seen: list[object] = []

    def die(event: object) -> None:
        seen.append(event)
        if len(seen) == at:
            raise Crash

    store = le.RunStore(ledger)
    engine = le.Engine(ScriptedProvider([three_turns] * 12, clock=clock), ledger=ledger,
                       clock=clock, prices=PRICES, run_store=store, observers=[die])
    try:
        done = await engine.run(operation(total_time=600.0), "pay", tools=charger.tools)
        return len(seen), done.invocation_id, done, charger
    except* Crash:  # alone, or from a tool batch's task group
        pass
    run_id = next(e.run_id for e in seen if isinstance(e, events.RunStarted))
    engine2 = le.Engine(ScriptedProvider([three_turns] * 12, clock=clock), ledger=ledger,
                        clock=clock, prices=PRICES, run_store=store)
    try:
        result = await engine2.resume(run_id, tools=charger.tools, force=True)
    except le.ConfigError:
        return len(seen), run_id, None, charger
    while result.outcome is le.Outcome.PAUSED:
        assert {p.reason for p in result.pending} == {"in_doubt"}
        result = await engine2.resume(run_id, tools=charger.tools, decisions={
            p.id: le.Supply("charged") if ("charge", p.input["card"]) in charger.runs
            else le.Approve() for p in result.pending})
    return len(seen), run_id, result, charger


async def test_a_crash_at_any_event_of_a_run_is_recovered_with_each_effect_once(
        ledger: Any, clock: FakeClock, tmp_path: Path) -> None:
    """A three-turn run (charge and lookup, then charge, then an answer) killed at
    each of its events in turn, on a ledger of its own, then resumed to its end:
    it completes with three turns and three tool calls, each charge took effect
    exactly once, and the ledger's credits are the result's. Only the first event
    (RunStarted: its row not stored yet, nothing sent) and the last (RunEnded:
    it had ended) leave nothing to resume."""
    total, _, _, _ = await crash_at(MemoryLedger(), clock, None)
    assert total > 10
    for at in range(1, total + 1):
        own: Any = MemoryLedger()
        if isinstance(ledger, SQLiteLedger):
            own = SQLiteLedger(tmp_path / f"ledger-{at}.db")
        elif not isinstance(ledger, MemoryLedger):
            own = type(ledger)(ledger.dsn, schema=f"{ledger.schema}_{at}")
        try:
            _, run_id, result, charger = await crash_at(own, clock, at)
            progress = await own.read_progress(run_id)
        finally:
            if isinstance(own, SQLiteLedger):
                own.close()
            elif not isinstance(own, MemoryLedger):
                await own.aclose()
        if result is None:
            assert at in (1, total), at
            if at == 1:  # its start may not be written yet (a queued write dies with it)
                assert progress is None or (progress.outcome, progress.attempt_count) == (
                    "running", 0)
            else:
                assert (progress.outcome, progress.attempt_count) == ("completed", 3)
            continue
        assert result.outcome is le.Outcome.COMPLETED and result.answer == "done", at
        assert (result.turns, result.tool_calls) == (3, 3), at
        charges = [run for run in charger.runs if run[0] == "charge"]
        assert sorted(charges) == [("charge", "1"), ("charge", "2")], (at, charger.runs)
        assert (progress.outcome, progress.credits) == ("completed", result.credits), at


async def test_a_job_delivered_again_never_runs_a_call_in_doubt_on_its_old_decisions(
        ledger: Any, clock: FakeClock) -> None:
    """A queue's job resumes a paused run with Approve(), and its worker dies in
    the approved handler; the job is delivered again with the same decisions.
    Those were made for the call's approval, not for it in doubt: the run
    pauses and asks, and the call has run once."""
    runs: list[str] = []

    @le.tool(approval=True)
    def charge(card: str) -> str:
        """Charge a card (not idempotent)."""
        runs.append(card)
        if len(runs) == 1:
            raise Crash
        return f"charged {card}"

    engine, provider, store = engine_on(ledger, clock, Reply.tool_calls(("charge", {"card": "9"})),
                                        Reply.text("done"))
    paused = await engine.run(operation(total_time=600.0), "pay", tools=[charge])
    job = {paused.pending[0].id: le.Approve()}
    with pytest.raises(BaseException):  # noqa: B017 - the stand-in for a dead process
        await engine.resume(paused.invocation_id, decisions=job, tools=[charge])
    again = await engine.resume(paused.invocation_id, decisions=job, tools=[charge], force=True)
    assert again.outcome is le.Outcome.PAUSED and runs == ["9"]
    assert [(c.id, c.reason) for c in again.pending] == [(paused.pending[0].id, "in_doubt")]
    done = await engine.resume(paused.invocation_id, tools=[charge],
                               decisions={paused.pending[0].id: le.Supply("charged 9")})
    assert done.outcome is le.Outcome.COMPLETED and runs == ["9"]
    assert len(provider.requests) == 2


async def test_a_job_delivered_again_after_its_approved_call_ran_finishes_the_run(
        ledger: Any, clock: FakeClock) -> None:
    """The worker died after its approved call had run and ended, before the
    next turn; the job is delivered again with the same Approve(): that
    decision is stale (its call is not pending), not an error, and the run
    goes on to its end without running the call again."""
    runs: list[str] = []

    @le.tool(approval=True)
    def charge(card: str) -> str:
        """Charge a card (not idempotent)."""
        runs.append(card)
        return f"charged {card}"

    def die_before_the_next_turn(event: object) -> None:
        if isinstance(event, events.AttemptStarted) and event.turn == 2 and runs:
            raise Crash

    engine, provider, _ = engine_on(ledger, clock, Reply.tool_calls(("charge", {"card": "7"})),
                                    Reply.text("done"), observers=[die_before_the_next_turn])
    paused = await engine.run(operation(total_time=600.0), "pay", tools=[charge])
    job = {paused.pending[0].id: le.Approve()}
    with pytest.raises(BaseException):  # noqa: B017 - the stand-in for a dead process
        await engine.resume(paused.invocation_id, decisions=job, tools=[charge])
    again, _, _ = engine_on(ledger, clock, Reply.text("done"))
    done = await again.resume(paused.invocation_id, decisions=job, tools=[charge], force=True)
    assert done.outcome is le.Outcome.COMPLETED and runs == ["7"]
