"""Running segments on every ledger store (docs/pause-and-resume.md, docs/ledger.md):
a run that pauses and resumes, or whose process died and was recovered, runs in
segments, each a row of ``segments`` that `audit show` lists; a recovered run's
account holds only its new segment's reservation; and a turn sent again after a
crash goes on numbering its attempts.

A dead process is stood in for by a handler or observer raising a
`BaseException` no run catches, as in tests/test_recovery.py.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
from click.testing import CliRunner

import loopengine as le
from loopengine import events
from loopengine.cli import main
from loopengine.persistence import MemoryLedger, PostgresLedger, SQLiteLedger, _audit
from loopengine.persistence._audit_open import open_ledger
from loopengine.persistence._schema import MIGRATIONS, migrate
from loopengine.providers import Reply, ScriptedProvider
from loopengine.testing import FakeClock

from .conftest import PRICES, operation
from .pause_scenarios import Sender, send
from .postgres_support import PostgresServer, fresh_schema
from .test_pause_stores import paused_on
from .test_recovery import (
    Charger,
    Crash,
    crashed,
    crashed_between_turns,
    crashed_in_charge,
    engine_on,
    the_run_id,
)


@pytest.fixture
def ledger(each_ledger: Any) -> Any:
    """Each store in turn (`each_ledger`)."""
    return each_ledger


def audit_url(ledger: PostgresLedger) -> str:
    """A ``postgresql://`` URL of the ledger's database, for the audit."""
    from psycopg.conninfo import conninfo_to_dict

    params = conninfo_to_dict(ledger.dsn)
    dbname = params.pop("dbname", "postgres")
    return f"postgresql:///{dbname}?{urlencode({k: str(v) for k, v in params.items()})}"


async def segments_of(ledger: Any, invocation_id: str) -> list[tuple[Any, ...]]:
    """The invocation's segments as ``(ordinal, started_at, ended_at, outcome)``,
    times as datetimes: read by the audit on SQLite and PostgreSQL."""
    if isinstance(ledger, MemoryLedger):
        rows = [ledger.segments[key] for key in sorted(ledger.segments)
                if key[0] == invocation_id]
    else:
        await ledger.flush()
        conn = (open_ledger(ledger.path) if isinstance(ledger, SQLiteLedger)
                else open_ledger(audit_url(ledger), schema=ledger.schema))
        try:
            rows = _audit.segments(conn, invocation_id)
        finally:
            conn.close()

    def at(value: Any) -> datetime | None:
        return datetime.fromisoformat(value) if isinstance(value, str) else value

    return [(int(r["ordinal"]), at(r["started_at"]), at(r["ended_at"]), r["outcome"])
            for r in rows]


async def test_a_run_that_never_pauses_has_one_segment_closed_with_its_outcome(
        ledger: Any, clock: FakeClock) -> None:
    """One segment, from the invocation's start to its end, ended ``completed``."""
    provider = ScriptedProvider([Reply.text("done")], clock=clock)
    engine = le.Engine(provider, ledger=ledger, clock=clock, prices=PRICES)
    start = clock.wall()
    result = await engine.run(operation(), "go")
    [(ordinal, started, ended, outcome)] = await segments_of(ledger, result.invocation_id)
    assert (ordinal, started, outcome) == (1, start, "completed")
    assert ended is not None and ended >= started


async def test_a_paused_and_resumed_run_lists_two_segments(ledger: Any,
                                                          clock: FakeClock) -> None:
    """Paused: segment 1 ends ``paused`` at the pause; the resume opens segment 2
    when it begins, which ends with the run's outcome."""
    engine, sender, paused = await paused_on(ledger, clock)
    [first] = await segments_of(ledger, paused.invocation_id)
    assert first[2:] == (paused.state.paused_at, "paused")
    clock.advance(300.0)
    resumed_at = clock.wall()
    done = await engine.resume(paused.state, decisions={paused.pending[0].id: le.Approve()},
                               tools=[sender.tool])
    assert done.outcome is le.Outcome.COMPLETED
    segments = await segments_of(ledger, paused.invocation_id)
    assert [(s[0], s[3]) for s in segments] == [(1, "paused"), (2, "completed")]
    assert segments[0] == first
    assert segments[1][1] == resumed_at and segments[1][2] is not None


async def test_a_recovered_run_leaves_its_dead_segment_open_and_continues_attempts(
        ledger: Any, clock: FakeClock) -> None:
    """Killed as its second turn was sent: segment 1 stays open (its process died),
    segment 2 completes; the turn sent again is that turn's attempt 2."""
    _, charger, run_id = await crashed_between_turns(ledger, clock)
    seen: list[events.AttemptStarted] = []
    engine2, _, _ = engine_on(ledger, clock, Reply.text("done"),
                              observers=[lambda e: seen.append(e)
                                         if isinstance(e, events.AttemptStarted) else None])
    done = await engine2.resume(run_id, tools=charger.tools, force=True)
    assert done.outcome is le.Outcome.COMPLETED
    segments = await segments_of(ledger, run_id)
    assert [(s[0], s[2], s[3]) for s in segments] == [(1, None, None)] + [
        (2, segments[1][2], "completed")]
    assert segments[1][2] is not None
    # (turn, attempt) stays unique: turn 2's cut attempt was 1, its resend is 2.
    progress = await ledger.read_progress(run_id)
    assert progress.attempt_count == 3
    assert [(e.ordinal, e.turn, e.attempt) for e in seen] == [(3, 2, 2)]
    assert [(a.dispatch.turn, a.dispatch.attempt) for a in done.attempt_log] == [(2, 2)]


async def test_a_recovery_that_pauses_at_once_leaves_its_dead_segment_open(
        ledger: Any, clock: FakeClock) -> None:
    """Killed in charge's handler (not idempotent): the recovery pauses at once
    on the call in doubt, in a segment of its own (2, ended ``paused``); the
    dead process's segment 1 stays open, as for any recovery, and the decided
    resume opens segment 3."""
    engine, _, _, charger, run_id = await crashed_in_charge(ledger, clock)
    paused = await engine.resume(run_id, tools=charger.tools, force=True)
    assert paused.outcome is le.Outcome.PAUSED
    assert [c.reason for c in paused.pending] == ["in_doubt"]
    segments = await segments_of(ledger, run_id)
    assert [(s[0], s[2], s[3]) for s in segments] == [(1, None, None), (
        2, segments[1][2], "paused")]
    assert segments[1][2] is not None
    done = await engine.resume(run_id, tools=charger.tools,
                               decisions={paused.pending[0].id: le.Supply("charged")})
    assert done.outcome is le.Outcome.COMPLETED and charger.runs == [("charge", "4242")]
    segments = await segments_of(ledger, run_id)
    assert [(s[0], s[3]) for s in segments] == [(1, None), (2, "paused"), (3, "completed")]

async def test_audit_show_lists_the_segments(tmp_path: Path, clock: FakeClock) -> None:
    """`audit show` prints the segments, the dead one as such, and ``--json`` has
    them; `audit reconcile` lists the dead one without failing."""
    path = tmp_path / "ledger.db"
    charger = Charger()
    charger.crash_on = "lookup"
    with SQLiteLedger(path) as ledger:
        engine, _, store = engine_on(
            ledger, clock, Reply.tool_calls(("lookup", {"card": "1"})), Reply.text("done"))
        await crashed(engine, charger)
        run_id = await the_run_id(store, ledger)
        done = await engine.resume(run_id, tools=charger.tools, force=True)
        assert done.outcome is le.Outcome.COMPLETED
    runner = CliRunner()
    shown = runner.invoke(main, ["audit", "show", "--db", str(path), run_id],
                          catch_exceptions=False)
    assert shown.exit_code == 0, shown.output
    assert "Running segments: 2" in shown.output
    assert "its process died" in shown.output and "completed" in shown.output
    data = json.loads(runner.invoke(main, ["audit", "show", "--db", str(path), run_id,
                                           "--json"], catch_exceptions=False).output)
    assert [(s["ordinal"], s["outcome"]) for s in data["segments"]] == [(1, None),
                                                                        (2, "completed")]
    # reconcile names the dead segment, for a look: the recovered run is sound.
    checked = runner.invoke(main, ["audit", "reconcile", "--db", str(path)],
                            catch_exceptions=False)
    assert checked.exit_code == 0, checked.output
    assert "Running segments whose process died" in checked.output
    found = json.loads(runner.invoke(main, ["audit", "reconcile", "--db", str(path), "--json"],
                                     catch_exceptions=False).output)
    assert [(g["invocation_id"], g["ordinal"]) for g in found["dead_segments"]] == [(run_id, 1)]


async def test_a_ledger_older_than_segments_is_still_audited(tmp_path: Path) -> None:
    """A ledger at schema 8 (no segments table): show answers, with no segments."""
    import sqlite3

    path = tmp_path / "old.db"
    conn = sqlite3.connect(path, isolation_level=None)
    migrate(conn, migrations=MIGRATIONS[:8])
    conn.execute("INSERT INTO invocations (id, operation, operation_version, provider, model, "
                 "started_at) VALUES ('old-1', 'op', '1', 'p', 'm', "
                 "'2026-01-01T00:00:00.000000+00:00')")
    conn.close()
    runner = CliRunner()
    shown = runner.invoke(main, ["audit", "show", "--db", str(path), "old-1", "--json"],
                          catch_exceptions=False)
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output)["segments"] == []


async def test_a_run_started_before_segments_resumes_without_any(tmp_path: Path,
                                                                 clock: FakeClock) -> None:
    """Paused on a ledger older than segments, resumed after the upgrade: no
    segment row is made up for it (its numbering would be wrong)."""
    path = tmp_path / "ledger.db"
    sender = Sender()
    with SQLiteLedger(path) as ledger:
        provider = ScriptedProvider([Reply.tool_calls(send("a")), Reply.text("done")],
                                    clock=clock)
        engine = le.Engine(provider, ledger=ledger, clock=clock, prices=PRICES)
        paused = await engine.run(operation(), "go", tools=[sender.tool])
        assert paused.state is not None
        await ledger.flush()
    import sqlite3

    # As if it had paused before the upgrade: no segment rows.
    with sqlite3.connect(path) as conn:
        conn.execute("DELETE FROM segments")
    with SQLiteLedger(path) as ledger:
        engine = le.Engine(ScriptedProvider([Reply.text("done")], clock=clock), ledger=ledger,
                           clock=clock, prices=PRICES)
        done = await engine.resume(paused.state, decisions={paused.pending[0].id: le.Approve()},
                                   tools=[sender.tool])
        assert done.outcome is le.Outcome.COMPLETED
        assert await segments_of(ledger, paused.invocation_id) == []


# -- a recovered run's account ---------------------------------------------------------------


async def crashed_on_account(store: Any, clock: FakeClock, *,
                             settled_turn: int | None = None, granted: int = 1000) -> tuple[
        le.CreditAccounts, Charger, str]:
    """A run on account ``acme`` (``granted``, hold 500) killed in lookup's
    handler, after its first turn was charged (120 credits); or, with
    ``settled_turn``, once that turn's reply was settled, before its checkpoint."""
    # The accounts' clock is the run's: its reservation is not past its expiry.
    accounts = le.CreditAccounts(store, clock=clock)
    await accounts.grant("acme", granted)
    charger = Charger()

    def crash_once_settled(event: object) -> None:
        if isinstance(event, events.AttemptSettled) and event.turn == settled_turn:
            raise Crash

    if settled_turn is None:
        charger.crash_on = "lookup"
    engine, _, run_store = engine_on(
        store, clock, Reply.tool_calls(("lookup", {"card": "1"})), Reply.text("done"),
        accounts=accounts, observers=[crash_once_settled])
    with pytest.raises(BaseException):  # noqa: B017 - the stand-in for a dead process
        await engine.run(operation(total_time=600.0, credit_hold=500), "pay",
                         tools=charger.tools, attribution=le.Attribution(tenant="acme"))
    return accounts, charger, await the_run_id(run_store, store)


async def resumed_on_account(store: Any, clock: FakeClock, accounts: le.CreditAccounts,
                             charger: Charger, run_id: str) -> tuple[
        list[le.AccountBalance], le.RunResult]:
    """Resume the crashed run to its end: the account's balance as each attempt
    went out, and the result."""
    held: list[le.AccountBalance] = []

    async def look(event: object) -> None:
        if isinstance(event, events.AttemptStarted):
            held.append(await accounts.balance("acme"))

    engine, _, _ = engine_on(store, clock, Reply.text("done"), accounts=accounts,
                             observers=[look])
    done = await engine.resume(run_id, tools=charger.tools, force=True)
    assert done.outcome is le.Outcome.COMPLETED
    return held, done


async def recovered_holds_only_its_new_reservation(store: Any, clock: FakeClock) -> None:
    accounts, charger, run_id = await crashed_on_account(store, clock)
    # The dead segment still holds its 500 (its expiry is far off).
    assert await accounts.balance("acme") == le.AccountBalance("acme", 1000, 0, 500, 500)
    held, done = await resumed_on_account(store, clock, accounts, charger, run_id)
    # While it ran again: the dead segment's 120 charged, its hold released;
    # reserved is the new segment's alone (what the hold leaves).
    assert held == [le.AccountBalance("acme", 1000, 120, 380, 500)]
    progress = await store.read_progress(run_id)
    assert progress.credits == done.credits_total == 240
    assert await accounts.balance("acme") == le.AccountBalance("acme", 1000, 240, 0, 760)


async def test_a_recovered_run_settles_its_dead_segment_before_reserving_on_sqlite(
        tmp_path: Path, clock: FakeClock) -> None:
    """SQLite: after a crash and a resume, the account holds only the new
    segment's reservation, and charges what the ledger says."""
    with SQLiteLedger(tmp_path / "ledger.db") as store:
        await recovered_holds_only_its_new_reservation(store, clock)


async def test_a_recovered_run_settles_its_dead_segment_before_reserving_on_postgres(
        postgres_server: PostgresServer, clock: FakeClock) -> None:
    """PostgreSQL: the same."""
    async with PostgresLedger(postgres_server.dsn(), schema=fresh_schema()) as store:
        await recovered_holds_only_its_new_reservation(store, clock)


async def test_r03_a_recovered_run_reserves_what_its_hold_leaves_after_a_settled_reply(
        tmp_path: Path, clock: FakeClock) -> None:
    """Killed once turn 2's reply was settled, before its checkpoint (hold 500,
    120 credits a reply): the recovery charges the dead segment's 240 and
    reserves the 260 the hold leaves (not 380: the checkpoint's 120 alone),
    so the account never holds more than the hold; the turn sent again adds
    its 120 (360 in all), which the run and its account agree on."""
    with SQLiteLedger(tmp_path / "ledger.db") as store:
        accounts, charger, run_id = await crashed_on_account(store, clock, settled_turn=2)
        held, done = await resumed_on_account(store, clock, accounts, charger, run_id)
        assert held == [le.AccountBalance("acme", 1000, 240, 260, 500)]
        assert done.credits == 360
        assert await accounts.balance("acme") == le.AccountBalance("acme", 1000, 360, 0, 640)


async def test_a_recovered_run_that_pauses_on_a_call_in_doubt_holds_nothing_while_it_waits(
        tmp_path: Path, clock: FakeClock) -> None:
    """Killed in charge's handler (not idempotent): its recovery pauses at once
    on the call in doubt, and that pause settles the dead segment's 120 and
    releases its hold, as any pause does; the decided resume reserves again."""
    with SQLiteLedger(tmp_path / "ledger.db") as store:
        accounts = le.CreditAccounts(store, clock=clock)
        await accounts.grant("acme", 1000)
        charger = Charger()
        charger.crash_on = "charge"
        engine, _, run_store = engine_on(
            store, clock, Reply.tool_calls(("charge", {"card": "1"})), Reply.text("done"),
            accounts=accounts)
        with pytest.raises(BaseException):  # noqa: B017 - the stand-in for a dead process
            await engine.run(operation(total_time=600.0, credit_hold=500), "pay",
                             tools=charger.tools, attribution=le.Attribution(tenant="acme"))
        run_id = await the_run_id(run_store, store)
        assert (await accounts.balance("acme")).reserved == 500
        paused = await engine.resume(run_id, tools=charger.tools, force=True)
        assert paused.outcome is le.Outcome.PAUSED
        assert [c.reason for c in paused.pending] == ["in_doubt"]
        assert await accounts.balance("acme") == le.AccountBalance("acme", 1000, 120, 0, 880)
        done = await engine.resume(run_id, tools=charger.tools,
                                   decisions={paused.pending[0].id: le.Supply("charged 1")})
        assert done.outcome is le.Outcome.COMPLETED and charger.runs == [("charge", "1")]
        balance = await accounts.balance("acme")
    assert (balance.spent, balance.reserved) == (done.credits_total, 0)


async def test_r03_a_recovery_its_account_cannot_admit_keeps_the_turn_its_process_was_served(
        tmp_path: Path, clock: FakeClock) -> None:
    """Killed once turn 2's reply (120) was settled, before its checkpoint, on an
    account of 240: the recovery settles the dead segment's 240, has nothing
    left, and pauses admission_denied; that pause records the 240 (turn 2's
    reply is billed though its turn is sent again), so after a top-up the run
    ends with 360 in its row, its result and its account alike."""
    with SQLiteLedger(tmp_path / "ledger.db") as store:
        accounts, charger, run_id = await crashed_on_account(store, clock, settled_turn=2,
                                                             granted=240)
        engine, _, _ = engine_on(store, clock, Reply.text("done"), accounts=accounts)
        denied = await engine.resume(run_id, tools=charger.tools, force=True)
        assert denied.outcome is le.Outcome.ADMISSION_DENIED
        assert (await store.read_progress(run_id)).credits == 240
        await accounts.grant("acme", 1000)
        done = await engine.resume(run_id, tools=charger.tools)
        assert done.outcome is le.Outcome.COMPLETED
        assert (done.credits, (await store.read_progress(run_id)).credits) == (360, 360)
        balance = await accounts.balance("acme")
    assert (balance.spent, balance.reserved) == (360, 0)


def test_segments_are_kept_without_a_run_store_too() -> None:
    """Segments are the ledger's: a MemoryLedger records them for any run."""
    ledger = MemoryLedger()
    clock = FakeClock()
    engine = le.Engine(ScriptedProvider([Reply.text("done")], clock=clock), ledger=ledger,
                       clock=clock, prices=PRICES)
    result = engine.run_sync(operation(), "go")
    [(key, row)] = ledger.segments.items()
    assert key == (result.invocation_id, 1) and row["outcome"] == "completed"
    assert timedelta(0) <= datetime.fromisoformat(row["ended_at"]) - datetime.fromisoformat(
        row["started_at"])
