"""A segment whose run another process took over ends and pauses nothing of it,
on every ledger store (docs/pause-and-resume.md): its end or pause is a
compare-and-set on the run still being its own, so a takeover landing after
its last checkpoint is refused there (no further write checks its lease
first), and a slow segment cancelled after the takeover records no
``cancelled`` over the new owner's run.

The takeover is driven from the slow segment's observer, once its last reply
is settled (never by racing real time).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import anyio
import pytest

import loopengine as le
from loopengine import events
from loopengine.persistence import MemoryLedger
from loopengine.providers import Reply, ScriptedProvider
from loopengine.testing import FakeClock

from .conftest import PRICES, operation
from .ledger_support import overloaded
from .pause_scenarios import HookedStore, Sender, send
from .test_recovery import Charger, HeldProvider


@pytest.fixture
def ledger(each_ledger: Any) -> Any:
    """Each store in turn (`each_ledger`)."""
    return each_ledger


class TakeoverAt:
    """An observer that runs ``takeover`` once the segment's second attempt is
    settled: after its last checkpoint, before it writes its end or pause."""

    def __init__(self) -> None:
        self.takeover: Callable[[], Awaitable[None]] | None = None

    async def __call__(self, event: events.Event) -> None:
        """Let the takeover land after the second reply's settle."""
        if (isinstance(event, events.AttemptSettled) and event.ordinal == 2
                and self.takeover is not None):
            takeover, self.takeover = self.takeover, None
            await takeover()


class CountingStore(HookedStore):
    """A run store that keeps what each checkpoint wrote."""

    def __init__(self, ledger: Any) -> None:
        super().__init__(ledger)
        self.writes: list[str] = []

    async def after(self, invocation_id: str, wrote: tuple[str, ...]) -> None:
        """Note what it wrote."""
        self.writes.append("+".join(wrote))


def engine(ledger: Any, clock: FakeClock, provider: ScriptedProvider, store: le.RunStore,
           accounts: le.CreditAccounts | None, seen: list[Any],
           *observers: Callable[[Any], Any]) -> le.Engine:
    """A process's engine on the shared ledger, its events kept in ``seen``."""
    return le.Engine(provider, ledger=ledger, clock=clock, prices=PRICES, rng=random.Random(3),
                     run_store=store, accounts=accounts, observers=[seen.append, *observers])


ACME = le.Attribution(tenant="acme")


async def accounts_on(ledger: Any) -> le.CreditAccounts | None:
    """Credit accounts with credits to spare, on a store that keeps them (not memory)."""
    if isinstance(ledger, MemoryLedger):
        return None
    accounts = le.CreditAccounts(ledger)
    await accounts.grant("acme", 100_000)
    return accounts


async def account_is_square(accounts: le.CreditAccounts | None, ledger: Any,
                            run_id: str) -> None:
    """Nothing held on the account, and it charged what the ledger says the run did."""
    if accounts is None:
        return
    balance = await accounts.balance("acme")
    progress = await ledger.read_progress(run_id)
    assert (balance.reserved, balance.spent) == (0, progress.credits)


async def pause_stands_and_resumes(process_b: le.Engine, store_b: le.RunStore,
                                   accounts: le.CreditAccounts | None, ledger: Any,
                                   paused: le.RunResult, tools: list[le.Tool],
                                   sender: Sender) -> None:
    """B's pause is as B left it (its stored state, the account), and resumes to
    B's end, which sends the call B's run asked for."""
    run_id = paused.invocation_id
    stored = await store_b.load(run_id)
    assert stored is not None and stored.paused_at is not None
    await account_is_square(accounts, ledger, run_id)
    done = await process_b.resume(run_id, tools=tools,
                                  decisions={paused.pending[0].id: le.Approve()})
    assert done.outcome is le.Outcome.COMPLETED and done.answer == "done by B"
    assert sender.sent == ["bob"]


def ends_of(seen: list[Any]) -> list[Any]:
    """The ends and pauses an engine's observers saw."""
    return [e for e in seen if isinstance(e, events.RunEnded | events.RunPaused)]


@pytest.mark.parametrize("a_would", ["end", "trip", "pause"])
async def test_a_takeover_after_the_last_checkpoint_leaves_the_run_to_its_new_owner(
        ledger: Any, clock: FakeClock, a_would: str) -> None:
    """A's last reply is settled after its last checkpoint; B takes the run over
    (force) before A writes its end (or its refusal's end, or its pause) and
    pauses on a call that needs approval. A's end is refused: A raises
    RunBusyError, emits no GuardTripped, RunEnded or RunPaused, and leaves B's
    pause, B's stored state and the account as B made them; B's pause resumes
    to its end."""
    charger, sender = Charger(), Sender()
    accounts = await accounts_on(ledger)
    second = {"end": Reply.text("done by A"),
              "trip": Reply.text("I will not", stop_reason="refusal"),
              "pause": Reply.tool_calls(send("eve"))}[a_would]
    provider_a = ScriptedProvider([Reply.tool_calls(("lookup", {"card": "4242"})), second],
                                  clock=clock)
    seen_a: list[Any] = []
    at_settle = TakeoverAt()
    process_a = engine(ledger, clock, provider_a, le.RunStore(ledger), accounts, seen_a,
                       at_settle)
    provider_b = ScriptedProvider([Reply.tool_calls(send("bob")), Reply.text("done by B")],
                                  clock=clock)
    store_b = le.RunStore(ledger)
    seen_b: list[Any] = []
    process_b = engine(ledger, clock, provider_b, store_b, accounts, seen_b)
    tools = [*charger.tools, sender.tool]
    taken: list[le.RunResult] = []

    async def take_over() -> None:
        (started,) = [e for e in seen_a if isinstance(e, events.RunStarted)]
        taken.append(await process_b.resume(started.run_id, tools=tools, force=True))

    at_settle.takeover = take_over
    with pytest.raises(le.RunBusyError):
        await process_a.run(operation(total_time=600.0, credit_hold=5_000), "pay",
                            tools=tools, attribution=ACME)
    (paused,) = taken
    run_id = paused.invocation_id
    assert paused.outcome is le.Outcome.PAUSED
    assert ends_of(seen_a) == []
    assert [e for e in seen_a if isinstance(e, events.GuardTripped)] == []
    progress = await ledger.read_progress(run_id)
    assert (progress.outcome, progress.turns) == ("paused", paused.turns)
    assert paused.state is not None and progress.seal == paused.state.seal()
    await pause_stands_and_resumes(process_b, store_b, accounts, ledger, paused, tools, sender)
    assert (await ledger.read_progress(run_id)).outcome == "completed"
    assert await store_b.load(run_id) is None
    await account_is_square(accounts, ledger, run_id)


@pytest.mark.parametrize("then", ["end", "trip", "pause"])
async def test_an_end_or_a_pause_writes_no_checkpoint_of_its_own(
        ledger: Any, clock: FakeClock, then: str) -> None:
    """A run store's run checkpoints its batch (its start, its call's start and
    end, after it), and its end or pause writes nothing more to the store
    than the pause itself (no lease check first: the ledger's compare-and-set
    is the check); a trip's GuardTripped still comes just before RunEnded."""
    charger = Charger()
    last = {"end": Reply.text("done"), "trip": Reply.text("no", stop_reason="refusal"),
            "pause": Reply.tool_calls(send("eve"))}[then]
    store = CountingStore(ledger)
    seen: list[Any] = []
    result = await engine(ledger, clock, ScriptedProvider(
        [Reply.tool_calls(("lookup", {"card": "4242"})), last], clock=clock), store, None,
        seen).run(operation(total_time=600.0), "pay", tools=[*charger.tools, Sender().tool])
    batch = ["create+state", "state+calls", "calls", "results+calls", "state"]
    assert store.writes == batch + (["state+paused+calls"] if then == "pause" else [])
    assert result.outcome is {"end": le.Outcome.COMPLETED, "trip": le.Outcome.REFUSED,
                              "pause": le.Outcome.PAUSED}[then]
    tail = [type(e).__name__ for e in seen[-2:]]
    assert tail == {"end": ["AttemptSettled", "RunEnded"],
                    "trip": ["GuardTripped", "RunEnded"],
                    "pause": ["AttemptSettled", "RunPaused"]}[then]


@pytest.mark.parametrize("b_does", ["pause", "complete"])
async def test_a_slow_segment_cancelled_after_a_takeover_records_nothing(
        ledger: Any, clock: FakeClock, b_does: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """A is slow on its second turn's request; B takes the run over (force) and
    pauses (or completes). A's caller then cancels it: A records no
    ``cancelled`` over B's run, deletes none of B's stored state, settles
    nothing and emits no RunEnded; its cancellation propagates as ever."""
    charger, sender = Charger(), Sender()
    accounts = await accounts_on(ledger)
    slow = HeldProvider([Reply.tool_calls(("lookup", {"card": "4242"})),
                         Reply.text("done by A")], clock=clock)
    seen_a: list[Any] = []
    process_a = engine(ledger, clock, slow, le.RunStore(ledger), accounts, seen_a)
    script_b = ([Reply.tool_calls(send("bob")), Reply.text("done by B")] if b_does == "pause"
                else [Reply.text("done by B")])
    store_b = le.RunStore(ledger)
    process_b = engine(ledger, clock, ScriptedProvider(script_b, clock=clock), store_b,
                       accounts, [])
    tools = [*charger.tools, sender.tool]
    reached: list[str] = []

    async def run_a(scope: anyio.CancelScope) -> None:
        with scope:
            await process_a.run(operation(total_time=600.0, credit_hold=5_000), "pay",
                                tools=tools, attribution=ACME)
            reached.append("returned")
        reached.append("cancelled" if scope.cancelled_caught else "not cancelled")

    scope = anyio.CancelScope()
    with caplog.at_level(logging.WARNING, logger="loopengine"):
        async with anyio.create_task_group() as group:
            group.start_soon(run_a, scope)
            await slow.arrived.wait()
            (started,) = [e for e in seen_a if isinstance(e, events.RunStarted)]
            run_id = started.run_id
            taken = await process_b.resume(run_id, tools=tools, force=True)
            scope.cancel()
    assert reached == ["cancelled"]
    assert ends_of(seen_a) == []
    assert "another process took the run over" in caplog.text
    progress = await ledger.read_progress(run_id)
    if b_does == "pause":
        assert taken.outcome is le.Outcome.PAUSED
        assert progress.outcome == "paused"
        await pause_stands_and_resumes(process_b, store_b, accounts, ledger, taken, tools,
                                       sender)
    else:
        assert taken.outcome is le.Outcome.COMPLETED and taken.answer == "done by B"
        assert (progress.outcome, progress.turns) == ("completed", taken.turns)
        assert await store_b.load(run_id) is None
    await account_is_square(accounts, ledger, run_id)


async def test_a_run_store_deletes_only_a_row_its_segment_holds(
        ledger: Any, clock: FakeClock) -> None:
    """The deletion of an ended run's stored state takes only a row its segment
    holds: a paused row (held by nobody) or one another process holds stays."""
    sender = Sender()
    provider = ScriptedProvider([Reply.tool_calls(send("a"))], clock=clock)
    store = le.RunStore(ledger)
    paused = await le.Engine(provider, ledger=ledger, clock=clock, prices=PRICES,
                             run_store=store).run(operation(), "go", tools=[sender.tool])
    run_id = paused.invocation_id
    await store.drop(run_id, "a-process-that-held-it-once")
    assert await store.load(run_id) is not None
    stored = await store.load(run_id)
    assert stored is not None
    await store.claim(run_id, "its-new-owner", version=stored.version,
                      expires_at=clock.wall(), now=clock.wall(), force=False)
    await store.drop(run_id, "a-process-that-held-it-once")
    assert await store.load(run_id) is not None
    await store.drop(run_id, "its-new-owner")
    assert await store.load(run_id) is None


async def test_a_request_the_taken_over_segment_sends_never_fails_its_new_owners(
        ledger: Any, clock: FakeClock) -> None:
    """A host whose clock runs two hours ahead of A's finds A's lease expired and
    takes A's live run over, no force, while A waits to retry its first request
    (overloaded). A's retry is dispatched after B read the run's attempts and
    before B sends the turn again, so it takes attempt 2, the number B was about
    to use. B's dispatch was once refused (a LedgerError) and the run ended
    ``failed``; B now numbers its request after the one A took, and completes
    the run. A, whose run was taken over, records nothing of it."""
    ahead = FakeClock(wall_start=clock.wall() + timedelta(hours=2))
    a_sent, b_resumed = anyio.Event(), anyio.Event()
    charger = Charger()
    seen_a: list[Any] = []
    outcome: dict[str, Any] = {}

    async def b_waits_for_a(event: events.Event) -> None:
        if isinstance(event, events.RunResumed):
            b_resumed.set()
            await a_sent.wait()  # B has read the run's attempts: A's retry goes first

    provider_b = ScriptedProvider([Reply.text("done by B")], clock=ahead)
    process_b = engine(ledger, ahead, provider_b, le.RunStore(ledger), None, [], b_waits_for_a)

    async def take_over(run_id: str) -> None:
        outcome["b"] = await process_b.resume(run_id, tools=charger.tools)

    async with anyio.create_task_group() as group:

        async def a_retries_once_b_took_it(event: events.Event) -> None:
            if isinstance(event, events.AttemptSettled) and event.ordinal == 1:
                group.start_soon(take_over, event.run_id)
                await b_resumed.wait()
            if isinstance(event, events.AttemptStarted) and event.ordinal == 2:
                a_sent.set()

        provider_a = ScriptedProvider([overloaded(), Reply.text("done by A")], clock=clock)
        process_a = engine(ledger, clock, provider_a, le.RunStore(ledger), None, seen_a,
                           a_retries_once_b_took_it)
        with pytest.raises(le.RunBusyError):
            await process_a.run(operation(total_time=300.0), "pay", tools=charger.tools)
    done = outcome["b"]
    assert done.outcome is le.Outcome.COMPLETED and done.answer == "done by B"
    assert ends_of(seen_a) == []
    progress = await ledger.read_progress(done.invocation_id)
    assert (progress.outcome, progress.attempt_count) == ("completed", 3)
    assert done.attempts.count == 3
