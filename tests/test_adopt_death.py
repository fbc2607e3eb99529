"""A resume that adopts a run paused without a run store, and whose process
dies as it adopts it, leaves the run recoverable (docs/pause-and-resume.md):
the resume inserts the run's row, leased, before it takes the pause, so a
death before the insert leaves the run paused as it was, and one after it
leaves a row a recovery takes, on every ledger store.

The death is a stand-in raised by the adopting engine's run store (nothing
catches it), never a race with real time.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import pytest

import loopengine as le
from loopengine._runstore import take_token, taken_without_store
from loopengine.persistence import InvocationEnd
from loopengine.providers import Reply, ScriptedProvider
from loopengine.testing import FakeClock

from .conftest import PRICES, operation
from .pause_scenarios import HookedStore, Sender, send


class Died(BaseException):
    """Stands in for the death of the process (nothing catches it)."""


class DyingStore(HookedStore):
    """A run store whose process dies at the insert of an adopted run's row:
    ``instead`` of it, or just ``after`` it committed; or once the resume took
    the pause (``taken``), before anything more is written to the row."""

    def __init__(self, ledger: Any, when: str) -> None:
        super().__init__(ledger)
        self.when = when

    async def before(self, invocation_id: str, wrote: tuple[str, ...]) -> None:
        """Die instead of an insert, or of the first write after it."""
        if "create" in wrote and self.when == "instead":
            raise Died
        if "create" not in wrote and self.when == "taken":
            raise Died

    async def after(self, invocation_id: str, wrote: tuple[str, ...]) -> None:
        """Die once an insert committed."""
        if "create" in wrote and self.when == "after":
            raise Died


async def died_adopting(ledger: Any, clock: FakeClock, store: le.RunStore,
                        more: Sequence[le.Tool] = ()
                        ) -> tuple[Sender, ScriptedProvider, le.RunResult,
                                   dict[str, le.Decision]]:
    """A run paused on an engine without a run store, then a resume approving its
    call on an engine with ``store`` (given the tools ``more`` too), whose
    process dies (`Died`) as it adopts the run: the sender, the provider, the
    paused result and the decisions."""
    sender = Sender()
    provider = ScriptedProvider([Reply.tool_calls(send("a")), Reply.text("done")], clock=clock)
    plain = le.Engine(provider, ledger=ledger, clock=clock, prices=PRICES,
                      rng=random.Random(3))
    paused = await plain.run(operation(total_time=600.0), "go", tools=[sender.tool])
    assert paused.outcome is le.Outcome.PAUSED and paused.state is not None
    approve: dict[str, le.Decision] = {paused.pending[0].id: le.Approve()}
    dying = le.Engine(provider, ledger=ledger, clock=clock, prices=PRICES, run_store=store)
    with pytest.raises(Died):
        await dying.resume(paused.state.dumps(), decisions=approve,
                           tools=[sender.tool, *more])
    assert sender.sent == [] and len(provider.requests) == 1
    return sender, provider, paused, approve


@pytest.mark.parametrize("when", ["instead", "after", "taken"])
async def test_a_resume_that_dies_adopting_a_run_leaves_it_recoverable(
        each_ledger: Any, clock: FakeClock, when: str) -> None:
    """Paused without a run store; a resume with one dies as it adopts the run
    (instead of inserting its row, once it did, or once it also took the
    pause): nothing was sent or run, and the ledger holds the run paused, or
    taken by the dead resume whose row holds it, so it is not left ``running``
    with nothing to recover it from. A resume with a run store then takes it
    (past the dead resume's lease: ``force``) and completes it, the approved
    call run once."""
    ledger = each_ledger
    sender, provider, paused, approve = await died_adopting(
        ledger, clock, DyingStore(ledger, when))
    assert paused.state is not None
    stored, run_id = paused.state.dumps(), paused.invocation_id
    taken = "running" if when == "taken" else "paused"
    assert (await ledger.read_progress(run_id)).outcome == taken
    store = le.RunStore(ledger)
    row = await store.load(run_id)
    if when == "instead":
        assert row is None  # as it was: any resume adopts it
    else:
        # Held by the dead resume's lease: a recovery takes it once it expires.
        assert row is not None and row.lease_owner is not None and row.paused_at is None
        assert row.unsettled_take(le.RunState.loads(row.state))

    engine = le.Engine(provider, ledger=ledger, clock=clock, prices=PRICES, run_store=store)
    done = await engine.resume(stored, decisions=approve, tools=[sender.tool], force=True)
    assert done.outcome is le.Outcome.COMPLETED and done.invocation_id == run_id
    assert sender.sent == ["a"] and len(provider.requests) == 2
    assert (done.turns, done.tool_calls) == (2, 1)
    progress = await ledger.read_progress(run_id)
    assert (progress.outcome, progress.turns, progress.attempt_count) == ("completed", 2, 2)
    assert await store.load(run_id) is None


class OvertakenStore(HookedStore):
    """A run store on which, just after an adopted run's row is inserted,
    another resume (on an engine without a run store, which found no row
    before it) takes the run's pause."""

    async def after(self, invocation_id: str, wrote: tuple[str, ...]) -> None:
        """After an insert, take the pause as another resume would."""
        if "create" in wrote:
            await take_as_another(self.ledger, invocation_id)


async def take_as_another(ledger: Any, invocation_id: str) -> None:
    """Take the run's pause as a resume on an engine without a run store would:
    the ledger's compare-and-set on the pause's seal, its token `take_token`'s."""
    found = await ledger.read_progress(invocation_id)
    assert found is not None and found.outcome == "paused" and found.seal is not None
    await ledger.end_invocation(InvocationEnd(
        id=invocation_id, ended_at=None, outcome="running", turns=found.turns,
        tool_calls=found.tool_calls, credits=found.credits,
        at=datetime.now(UTC), seal=take_token(None), expect_seal=found.seal))


async def test_an_adopting_resume_overtaken_at_its_take_deletes_the_row_it_inserted(
        each_ledger: Any, clock: FakeClock) -> None:
    """Another resume takes the pause between the adopting resume's insert and
    its take: the take is refused (RunBusyError, nothing sent or run), and the
    row it inserted is deleted, so no recovery takes the run from the resume
    that holds it."""
    ledger = each_ledger
    sender = Sender()
    provider = ScriptedProvider([Reply.tool_calls(send("a"))], clock=clock)
    plain = le.Engine(provider, ledger=ledger, clock=clock, prices=PRICES)
    paused = await plain.run(operation(total_time=600.0), "go", tools=[sender.tool])
    assert paused.state is not None
    store = OvertakenStore(ledger)
    engine = le.Engine(provider, ledger=ledger, clock=clock, prices=PRICES, run_store=store)
    with pytest.raises(le.RunBusyError, match="another resume took its pause"):
        await engine.resume(paused.state, tools=[sender.tool],
                            decisions={paused.pending[0].id: le.Approve()})
    assert sender.sent == [] and len(provider.requests) == 1
    progress = await ledger.read_progress(paused.invocation_id)
    assert progress.outcome == "running" and taken_without_store(progress.seal)
    assert await store.load(paused.invocation_id) is None


class OvertakenDyingStore(OvertakenStore):
    """An `OvertakenStore` whose process dies as the adopting resume deletes the
    row it inserted, its take refused: the row stays, held by a dead lease."""

    async def drop(self, invocation_id: str, owner: str | None, *,
                   version: int | None = None) -> None:
        raise Died


async def test_a_row_left_by_an_overtaken_adopting_resume_that_died_takes_nothing(
        each_ledger: Any, clock: FakeClock) -> None:
    """Another resume takes the pause between the adopting resume's insert and its
    take, and the adopting resume dies before it deletes its row. Once the dead
    lease expires, a recovery of the run from that row takes nothing from the
    resume that holds it: RunBusyError, nothing sent or run, the ledger's row
    still that resume's; and the row is gone, so no later recovery tries again
    (a resume of the paused state is refused as any resume of a taken pause)."""
    ledger = each_ledger
    sender, provider, paused, approve = await died_adopting(
        ledger, clock, OvertakenDyingStore(ledger))
    run_id = paused.invocation_id
    store = le.RunStore(ledger)
    row = await store.load(run_id)
    assert row is not None and row.lease_owner is not None  # left behind, leased
    clock.advance(3600.0)  # the dead resume's lease has expired

    engine = le.Engine(provider, ledger=ledger, clock=clock, prices=PRICES, run_store=store)
    # By its id (the row), then by the state the pause returned (no row left).
    for state, given in ((run_id, {}), (paused.state, approve)):
        with pytest.raises(le.RunBusyError, match="another resume took its pause"):
            await engine.resume(state, tools=[sender.tool], decisions=given)
        assert sender.sent == [] and len(provider.requests) == 1
        progress = await ledger.read_progress(run_id)
        assert progress.outcome == "running" and taken_without_store(progress.seal)
        assert await store.load(run_id) is None


class ClaimOvertakenStore(le.RunStore):
    """A run store on which, just after a resume claims a run's row, another
    resume (on an engine without a run store) takes the run's pause."""

    async def claim(self, invocation_id: str, owner: str, **kwargs: Any) -> None:
        """Claim, then take the pause as another resume would."""
        await super().claim(invocation_id, owner, **kwargs)
        await take_as_another(self.ledger, invocation_id)


@pytest.mark.parametrize("decided", [True, False])
async def test_a_recovery_of_a_run_still_paused_takes_its_pause_only_if_nobody_did(
        each_ledger: Any, clock: FakeClock, decided: bool) -> None:
    """An adopting resume died once it inserted the run's row, before its take: the
    ledger still holds the pause. A recovery claims the row, and another resume
    takes the pause before the recovery's take: the recovery's take, a
    compare-and-set on the pause's seal, is refused (RunBusyError, nothing sent
    or run) and the row deleted; the run is the other resume's. So too for a
    recovery given no decisions, which would only take the run to pause it
    again: a row it left claimed would have a later recovery take the run
    from the other resume, the call run twice."""
    ledger = each_ledger
    sender, provider, paused, approve = await died_adopting(
        ledger, clock, DyingStore(ledger, "after"))
    run_id = paused.invocation_id
    clock.advance(3600.0)  # the dead resume's lease has expired

    store = ClaimOvertakenStore(ledger)
    engine = le.Engine(provider, ledger=ledger, clock=clock, prices=PRICES, run_store=store)
    with pytest.raises(le.RunBusyError, match="another resume took"):
        await engine.resume(run_id, decisions=approve if decided else None,
                            tools=[sender.tool])
    assert sender.sent == [] and len(provider.requests) == 1
    progress = await ledger.read_progress(run_id)
    assert progress.outcome == "running" and taken_without_store(progress.seal)
    assert await store.load(run_id) is None


@le.tool
def lookup(key: str) -> str:
    """Look a key up."""
    return key


async def test_the_row_of_an_adopting_resume_keeps_the_seal_of_the_pause_it_resumes(
        each_ledger: Any, clock: FakeClock) -> None:
    """An adopting resume given a tool more than the run had (which a resume
    may be) dies once it inserted the run's row, before its take: the row's
    state is the pause's, its seal the one the ledger holds, so a recovery
    of the row (its lease expired) finds the pause nobody took and takes it,
    rather than taking it for another resume's and deleting the row; the
    approved call runs once."""
    ledger = each_ledger
    sender, provider, paused, approve = await died_adopting(
        ledger, clock, DyingStore(ledger, "after"), more=[lookup])
    assert paused.state is not None
    run_id = paused.invocation_id
    store = le.RunStore(ledger)
    row = await store.load(run_id)
    assert row is not None and row.unsettled_take(le.RunState.loads(row.state))
    assert le.RunState.loads(row.state).seal() == paused.state.seal()
    clock.advance(3600.0)  # the dead resume's lease has expired

    engine = le.Engine(provider, ledger=ledger, clock=clock, prices=PRICES, run_store=store)
    done = await engine.resume(run_id, decisions=approve, tools=[sender.tool, lookup])
    assert done.outcome is le.Outcome.COMPLETED and sender.sent == ["a"]
    assert len(provider.requests) == 2 and await store.load(run_id) is None


class ClaimingThenGone(le.RunStore):
    """A run store whose recovery claims the run's row and is then gone before its
    take: it ``failed`` (an error once the claim committed, and the row is given
    back) or ``died`` (the giving back dies too, and the row stays claimed)."""

    def __init__(self, ledger: Any, how: str) -> None:
        super().__init__(ledger)
        self.how = how

    async def claim(self, invocation_id: str, owner: str, **kwargs: Any) -> None:
        """Claim, then fail or die."""
        await super().claim(invocation_id, owner, **kwargs)
        raise RuntimeError("failed after its claim") if self.how == "failed" else Died

    async def release(self, invocation_id: str, owner: str, *,
                      paused_at: datetime | None) -> None:
        """Give the row back, unless the process died."""
        if self.how == "died":
            raise Died
        await super().release(invocation_id, owner, paused_at=paused_at)


@pytest.mark.parametrize("how", ["failed", "died"])
async def test_a_row_a_recovery_claimed_before_its_take_takes_nothing_from_another_resume(
        each_ledger: Any, clock: FakeClock, how: str) -> None:
    """An adopting resume died once it inserted the run's row; a recovery claimed
    the row and failed or died before its take; then a resume on an engine
    without a run store took the pause. The next recovery of the row (still
    holding the paused state, whatever its version or owner) reads whose take
    the ledger holds: it takes nothing (RunBusyError, nothing sent or run) and
    deletes the row, so the run stays the other resume's, its call run once."""
    ledger = each_ledger
    sender, provider, paused, approve = await died_adopting(
        ledger, clock, DyingStore(ledger, "after"))
    run_id = paused.invocation_id
    clock.advance(3600.0)  # the dead resume's lease has expired
    gone = le.Engine(provider, ledger=ledger, clock=clock, prices=PRICES,
                     run_store=ClaimingThenGone(ledger, how))
    with pytest.raises(RuntimeError if how == "failed" else Died):
        await gone.resume(run_id, decisions=approve, tools=[sender.tool])
    store = le.RunStore(ledger)
    row = await store.load(run_id)
    assert row is not None and row.version > 1 and row.unsettled_take(le.RunState.loads(row.state))
    assert (row.lease_owner is None) == (how == "failed")
    await take_as_another(ledger, run_id)
    clock.advance(3600.0)  # the dead recovery's lease has expired too

    engine = le.Engine(provider, ledger=ledger, clock=clock, prices=PRICES, run_store=store)
    with pytest.raises(le.RunBusyError, match="another resume took its pause"):
        await engine.resume(run_id, decisions=approve, tools=[sender.tool])
    assert sender.sent == [] and len(provider.requests) == 1
    progress = await ledger.read_progress(run_id)
    assert progress.outcome == "running" and taken_without_store(progress.seal)
    assert await store.load(run_id) is None


async def test_a_take_written_by_earlier_versions_lets_the_recovery_go_on(
        each_ledger: Any, clock: FakeClock) -> None:
    """Versions before the take tokens wrote ``resumed:`` and 32 hex digits for
    every take, a run store's too. A row such a resume left once it took the
    pause is recovered as those versions did: the recovery goes on and
    completes the run, the approved call run once, rather than taking the
    token for a resume's without a run store and leaving the run with no row."""
    ledger = each_ledger
    sender, provider, paused, approve = await died_adopting(
        ledger, clock, DyingStore(ledger, "after"))
    run_id = paused.invocation_id
    found = await ledger.read_progress(run_id)
    await ledger.end_invocation(InvocationEnd(
        id=run_id, ended_at=None, outcome="running", turns=found.turns,
        tool_calls=found.tool_calls, credits=found.credits, at=datetime.now(UTC),
        seal=f"resumed:{'ab' * 16}", expect_seal=found.seal))
    clock.advance(3600.0)  # the dead resume's lease has expired
    store = le.RunStore(ledger)
    engine = le.Engine(provider, ledger=ledger, clock=clock, prices=PRICES, run_store=store)
    done = await engine.resume(run_id, decisions=approve, tools=[sender.tool])
    assert done.outcome is le.Outcome.COMPLETED and sender.sent == ["a"]
    assert len(provider.requests) == 2 and await store.load(run_id) is None
