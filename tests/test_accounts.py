"""Credit accounts (docs/accounts.md): a run reserves its hold on its tenant's account
before its first request and settles its real charge at its end, exactly once,
across processes; a crashed run's reservation is settled once it expires."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import pydantic
import pytest

import loopengine as le
from loopengine import events
from loopengine.persistence import PostgresLedger, SQLiteLedger
from loopengine.providers import Reply, ScriptedProvider
from loopengine.testing import FakeClock

from .conftest import PRICES, operation
from .ledger_support import lookup, queued, read_db

CHILD = Path(__file__).with_name("accounts_child.py")
ACME = le.Attribution(tenant="acme")


def journal_matches(path: Path) -> None:
    """``accounts`` equals the sums of ``account_entries``, for every account."""
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute("SELECT account, granted, spent, reserved FROM accounts").fetchall()
        for account, granted, spent, reserved in rows:
            sums = dict(conn.execute(
                "SELECT kind, SUM(credits) FROM account_entries WHERE account = ? "
                "GROUP BY kind", (account,)).fetchall())
            assert granted == sums.get("grant", 0)
            assert spent == sums.get("settle", 0) + sums.get("expire", 0)
            assert reserved == sums.get("reserve", 0) - sums.get("release", 0)
    finally:
        conn.close()


def engine_on(ledger: SQLiteLedger, *script: Any, **kwargs: Any) -> tuple[le.Engine,
                                                                         ScriptedProvider]:
    provider = ScriptedProvider(list(script))
    accounts = kwargs.pop("accounts", None) or le.CreditAccounts(ledger)
    return le.Engine(provider, ledger=ledger, prices=PRICES, accounts=accounts,
                     **kwargs), provider


async def test_grant_and_balance(tmp_path: Path) -> None:
    """A grant adds to granted and available; an unknown account is all zeros."""
    with SQLiteLedger(tmp_path / "ledger.db") as ledger:
        accounts = le.CreditAccounts(ledger)
        assert await accounts.balance("nobody") == le.AccountBalance("nobody", 0, 0, 0, 0)
        await accounts.grant("acme", 500, note="welcome")
        balance = await accounts.grant("acme", 250)
    assert balance == le.AccountBalance("acme", 750, 0, 0, 750)
    journal_matches(tmp_path / "ledger.db")


@pytest.mark.parametrize("bad", [0, -5, 2.5, "10", True])
async def test_a_grant_must_be_a_positive_integer(tmp_path: Path, bad: Any) -> None:
    with SQLiteLedger(tmp_path / "ledger.db") as ledger:
        with pytest.raises(le.ConfigError) as info:
            await le.CreditAccounts(ledger).grant("acme", bad)
    assert info.value.field == "credits"


@pytest.mark.parametrize(("bad", "field"), [
    ({"ledger": le.persistence.MemoryLedger()}, "ledger"), ({"key": "tenant"}, "key"),
    ({"default_hold": 0}, "default_hold"), ({"expiry_grace": float("nan")}, "expiry_grace"),
    ({"clock": "now"}, "clock"),
])
def test_a_bad_argument_is_a_config_error_naming_it(
    tmp_path: Path, bad: dict[str, Any], field: str,
) -> None:
    """Every constructor argument of CreditAccounts is checked: a ConfigError whose
    field names the argument, never a LedgerError."""
    with SQLiteLedger(tmp_path / "ledger.db") as ledger:
        arguments: dict[str, Any] = {"ledger": ledger, **bad}
        with pytest.raises(le.ConfigError) as info:
            le.CreditAccounts(**arguments)
    assert info.value.field == field


async def test_a_run_settles_its_real_charge_and_releases_its_hold(tmp_path: Path) -> None:
    """Reserved while the run runs, then spent = its credits, reserved back to 0."""
    path = tmp_path / "ledger.db"
    seen: list[int] = []
    with SQLiteLedger(path) as ledger:
        accounts = le.CreditAccounts(ledger)
        await accounts.grant("acme", 1000)

        async def watch(event: events.Event) -> None:
            if isinstance(event, events.AttemptStarted):
                seen.append((await accounts.balance("acme")).reserved)

        engine, _ = engine_on(ledger, Reply.tool_calls(("lookup", {"key": "a"})),
                              Reply.text("done"), accounts=accounts, observers=[watch])
        result = await engine.run(operation(credit_hold=500), "go", tools=[lookup],
                                  attribution=ACME)
        balance = await accounts.balance("acme")
    assert result.outcome is le.Outcome.COMPLETED and result.credits == 240
    assert seen == [500, 500]
    assert balance == le.AccountBalance("acme", 1000, 240, 0, 760)
    journal_matches(path)


async def test_admission_denied_sends_nothing_and_writes_no_attempt(tmp_path: Path) -> None:
    """Nothing available: the run ends ``admission_denied`` before any request, no
    attempt row, the invocation recorded with that outcome, the trip announced."""
    path = tmp_path / "ledger.db"
    seen: list[events.Event] = []
    with SQLiteLedger(path) as ledger:
        accounts = le.CreditAccounts(ledger)
        await accounts.grant("acme", 100)
        first, _ = engine_on(ledger, Reply.text("a"), accounts=accounts)
        await first.run(operation(credit_hold=100), "go", attribution=ACME)  # spends 120
        engine, provider = engine_on(ledger, Reply.text("never"), accounts=accounts,
                                     observers=[seen.append])
        result = await engine.run(operation(credit_hold=100), "go", attribution=ACME)
        balance = await accounts.balance("acme")
    assert result.outcome is le.Outcome.ADMISSION_DENIED
    assert result.trip is not None and result.trip.guard == "account"
    assert provider.requests == [] and result.attempts.count == 0
    invocations, attempts = read_db(path)
    assert invocations[result.invocation_id]["outcome"] == "admission_denied"
    assert not [key for key in attempts if key[0] == result.invocation_id]
    assert [type(e).__name__ for e in seen] == ["RunStarted", "GuardTripped", "RunEnded"]
    # The first run's crossing turn is the one bounded overshoot (R03).
    assert balance == le.AccountBalance("acme", 100, 120, 0, -20)
    journal_matches(path)


async def test_a_call_on_an_empty_account_raises_outcome_error(tmp_path: Path) -> None:
    with SQLiteLedger(tmp_path / "ledger.db") as ledger:
        engine, provider = engine_on(ledger, Reply.text("never"))
        with pytest.raises(le.OutcomeError) as info:
            await engine.call(operation(credit_hold=100), "go", output=Answer,
                              attribution=ACME)
    assert info.value.outcome == "admission_denied" and info.value.attempts == 0
    assert provider.requests == []


class Answer(pydantic.BaseModel):
    value: str


async def test_less_available_narrows_the_hold(tmp_path: Path) -> None:
    """150 available under a hold of 500: the run's hold is 150, and it ends
    ``credit_limit`` at the turn that crosses it (that turn stays billed, R03)."""
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as ledger:
        accounts = le.CreditAccounts(ledger)
        await accounts.grant("acme", 150)
        engine, provider = engine_on(
            ledger, *[Reply.tool_calls(("lookup", {"key": str(n)})) for n in range(5)],
            accounts=accounts)
        result = await engine.run(operation(credit_hold=500), "go", tools=[lookup],
                                  attribution=ACME)
        balance = await accounts.balance("acme")
    assert result.outcome is le.Outcome.CREDIT_LIMIT
    assert result.trip is not None and result.trip.limit == 150
    assert result.credits == 240 and len(provider.requests) == 2
    assert balance == le.AccountBalance("acme", 150, 240, 0, -90)
    journal_matches(path)


async def test_a_run_on_an_account_needs_a_hold(tmp_path: Path) -> None:
    """No published hold and no default_hold: a ConfigError before anything; a
    default_hold is used when the operation publishes none."""
    with SQLiteLedger(tmp_path / "ledger.db") as ledger:
        engine, provider = engine_on(ledger, Reply.text("a"))
        with pytest.raises(le.ConfigError) as info:
            await engine.run(operation(), "go", attribution=ACME)
        assert info.value.field == "limits.credit_hold" and provider.requests == []
        accounts = le.CreditAccounts(ledger, default_hold=200)
        await accounts.grant("acme", 1000)
        engine, _ = engine_on(ledger, Reply.text("a"), accounts=accounts)
        seen: list[int] = []

        async def watch(event: events.Event) -> None:
            if isinstance(event, events.AttemptStarted):
                seen.append((await accounts.balance("acme")).reserved)

        engine.observers.append(watch)
        result = await engine.run(operation(), "go", attribution=ACME)
    assert result.outcome is le.Outcome.COMPLETED and seen == [200]


async def test_a_run_without_an_account_key_runs_outside_accounts(tmp_path: Path) -> None:
    with SQLiteLedger(tmp_path / "ledger.db") as ledger:
        engine, _ = engine_on(ledger, Reply.text("a"))
        result = await engine.run(operation(), "go")  # no tenant: no account
    assert result.outcome is le.Outcome.COMPLETED


@pytest.mark.parametrize("end", ["cancelled", "failed"])
async def test_cancelled_and_failed_runs_settle_too(tmp_path: Path, end: str) -> None:
    """A run cancelled in its tool, or failing because its ledger was closed under
    it, still settles what it was charged (its first turn) and releases its
    reservation. The caller cancels once the tool runs (not after some real
    time, which a busy machine could spend before the first turn settled)."""
    path = tmp_path / "ledger.db"
    ledger = SQLiteLedger(path)
    accounts = le.CreditAccounts(ledger)
    await accounts.grant("acme", 1000)
    running = anyio.Event()

    @le.tool
    async def stuck() -> str:
        """Never returns, or closes the ledger under the run."""
        if end == "failed":
            await ledger.aclose()
            return "closed"
        running.set()
        await anyio.sleep_forever()
        return "never"

    engine, _ = engine_on(ledger, Reply.tool_calls(("stuck", {})), Reply.text("a"),
                          accounts=accounts)
    if end == "cancelled":
        scope = anyio.CancelScope()

        async def run() -> None:
            with scope:
                await engine.run(operation(credit_hold=500), "go", tools=[stuck],
                                 attribution=ACME)

        async with anyio.create_task_group() as group:
            group.start_soon(run)
            await running.wait()
            scope.cancel()
        assert scope.cancelled_caught
    else:
        with pytest.raises(le.LedgerError, match="closed"):
            await engine.run(operation(credit_hold=500), "go", tools=[stuck],
                             attribution=ACME)
    balance = await accounts.balance("acme")
    await ledger.aclose()
    assert balance == le.AccountBalance("acme", 1000, 120, 0, 880)
    journal_matches(path)


async def test_a_settlement_on_a_closed_ledger_whose_file_is_locked_raises_ledger_error(
    tmp_path: Path,
) -> None:
    """A ledger closed under a run settles its account on a connection of its own;
    when another process holds the file's write lock past the busy timeout, that
    settlement fails with a LedgerError, as any failed settlement does, logged
    beside the error that ended the run (the closed ledger's), which the caller
    gets. It raised the writer's internal error instead, which replaced the
    run's and which no caller can name. The reservation stays held for its
    expiry to settle."""
    path = tmp_path / "ledger.db"
    ledger = SQLiteLedger(path, busy_timeout=0.05)
    accounts = le.CreditAccounts(ledger)
    await accounts.grant("acme", 1000)
    other = sqlite3.connect(path, isolation_level=None)

    @le.tool
    async def close() -> str:
        """Close the ledger under the run; another process takes the write lock."""
        await ledger.aclose()
        other.execute("BEGIN IMMEDIATE")
        return "closed"

    engine, _ = engine_on(ledger, Reply.tool_calls(("close", {})), Reply.text("a"),
                          accounts=accounts)
    try:
        with pytest.raises(le.LedgerError, match="the ledger is closed"):
            await engine.run(operation(credit_hold=500), "go", tools=[close],
                             attribution=ACME)
    finally:
        other.execute("ROLLBACK")
        other.close()
    with SQLiteLedger(path) as reopened:
        balance = await le.CreditAccounts(reopened).balance("acme")
    assert balance == le.AccountBalance("acme", 1000, 0, 500, 500)


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
async def test_a_run_cancelled_while_its_admission_waits_releases_what_it_reserved(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest,
) -> None:
    """A run cancelled by its caller while its admission waits for the ledger's
    writer (busy with another account's transaction): the reservation lands after
    the run stopped waiting, and the run's end, queued behind it, releases it for
    the nothing the run spent. It stayed held until its expiry (the run's
    deadline and a grace: over an hour for a run without ``total_time``), the
    account denying other runs meanwhile."""
    async with store_of(kind, tmp_path, request) as (ledger, address):
        accounts = le.CreditAccounts(ledger)
        await accounts.grant("acme", 1000)
        engine, provider = engine_on(ledger, Reply.text("a"), accounts=accounts)
        held, gate = threading.Event(), threading.Event()

        def hold(conn: Any) -> None:
            held.set()
            gate.wait()

        scope = anyio.CancelScope()

        async def run() -> None:
            with scope:
                await engine.run(operation(credit_hold=500), "go", attribution=ACME)

        async with anyio.create_task_group() as group:
            group.start_soon(ledger._transact_qmark, hold, "held")
            await anyio.to_thread.run_sync(held.wait)
            group.start_soon(run)
            # The admission waits behind the held transaction.
            await anyio.to_thread.run_sync(queued, ledger, 1)
            scope.cancel()
            gate.set()
        balance = await accounts.balance("acme")
    assert scope.cancelled_caught and provider.requests == []
    assert balance == le.AccountBalance("acme", 1000, 0, 0, 1000)
    checked = audit("reconcile", "--db", address, "--json")
    assert checked.exit_code == 0, checked.output


async def test_settlement_happens_once(tmp_path: Path) -> None:
    """Settling a reservation again changes nothing (idempotent)."""
    from loopengine._accounts import Reservation

    with SQLiteLedger(tmp_path / "ledger.db") as ledger:
        accounts = le.CreditAccounts(ledger)
        await accounts.grant("acme", 1000)
        engine, _ = engine_on(ledger, Reply.text("a"), accounts=accounts)
        result = await engine.run(operation(credit_hold=500), "go", attribution=ACME)
        await accounts.settle(Reservation("acme", result.invocation_id, 500, 1000), 999)
        balance = await accounts.balance("acme")
    assert balance == le.AccountBalance("acme", 1000, 120, 0, 880)


def spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-P", str(CHILD), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_four_processes_never_reserve_more_than_the_account_has(tmp_path: Path) -> None:
    """An account granted exactly 30 runs' holds; 4 processes x 25 runs at once on
    one file: exactly 30 are admitted, the other 70 end ``admission_denied`` with no
    attempt row; spent is what the admitted runs charged, nothing stays reserved,
    and the accounts equal their journal."""
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as ledger:
        anyio.run(le.CreditAccounts(ledger).grant, "acme", 30 * 120)
    children = [spawn("race", str(path), "25") for _ in range(4)]
    for child in children:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "READY"
    path.with_name("ledger.db.go").touch()
    outputs = [child.communicate(timeout=120) for child in children]
    outcomes: Counter[str] = Counter()
    for child, (out, err) in zip(children, outputs, strict=True):
        assert child.returncode == 0, err
        outcomes.update(out.split())
    assert outcomes == {"completed": 30, "admission_denied": 70}
    invocations, attempts = read_db(path)
    admitted = {i for i, r in invocations.items() if r["outcome"] == "completed"}
    assert {key[0] for key in attempts} == admitted
    conn = sqlite3.connect(path)
    (row,) = conn.execute("SELECT granted, spent, reserved FROM accounts").fetchall()
    conn.close()
    assert row == (3600, 3600, 0)
    journal_matches(path)


def test_a_crashed_runs_reservation_is_settled_at_its_charge_once_expired(
    tmp_path: Path,
) -> None:
    """SIGKILL a run mid-conversation (its tool kills its process): its reservation
    stays until it expires; then the next touch of the account settles it at what
    the ledger's settled attempts charged (120), and releases it."""
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as ledger:
        anyio.run(le.CreditAccounts(ledger).grant, "acme", 1000)
    child = spawn("crash", str(path))
    _, err = child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL, err

    async def later() -> tuple[le.AccountBalance, le.AccountBalance]:
        # An hour on: the run's deadline (60 s) and its grace (0) have passed.
        clock = FakeClock(wall_start=datetime.now(UTC) + timedelta(hours=1))
        with SQLiteLedger(path) as ledger:
            accounts = le.CreditAccounts(ledger, expiry_grace=0, clock=clock)
            return await accounts.balance("acme"), await accounts.balance("acme")

    # Read before anything touched the account again: its hold is still reserved.
    conn = sqlite3.connect(path)
    (reserved,) = conn.execute("SELECT reserved FROM accounts").fetchone()
    conn.close()
    assert reserved == 120
    after, again = anyio.run(later)
    assert after == le.AccountBalance("acme", 1000, 120, 0, 880)
    assert again == after  # settled once
    journal_matches(path)
    conn = sqlite3.connect(path)
    kinds = [k for (k,) in conn.execute("SELECT kind FROM account_entries ORDER BY id")]
    conn.close()
    assert kinds == ["grant", "reserve", "expire", "release"]
    # The expired run's charge equals what its settled attempts charged.
    checked = audit("reconcile", "--db", str(path), "--json")
    assert '"accounts": []' in checked.output
    assert os.path.exists(path)


def audit(*args: str) -> Any:
    from click.testing import CliRunner

    from loopengine.cli import main

    return CliRunner().invoke(main, ["audit", *args])


async def test_audit_accounts_lists_balances_and_reconcile_checks_them(tmp_path: Path) -> None:
    """`audit accounts` lists granted, spent, reserved and available; `reconcile`
    passes while the accounts equal their journal and their runs' credits, and
    fails, naming the account, once a balance is altered by hand."""
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as ledger:
        accounts = le.CreditAccounts(ledger)
        await accounts.grant("acme", 1000)
        await accounts.grant("zenith", 50)
        engine, _ = engine_on(ledger, Reply.tool_calls(("lookup", {"key": "a"})),
                              Reply.text("a"), accounts=accounts)
        await engine.run(operation(credit_hold=500), "go", tools=[lookup], attribution=ACME)
    listed = audit("accounts", "--db", str(path))
    assert listed.exit_code == 0, listed.output
    lines = listed.output.splitlines()
    assert lines[0].split()[:5] == ["account", "granted", "spent", "reserved", "available"]
    assert lines[2].split()[:5] == ["acme", "1000", "240", "0", "760"]
    assert lines[3].split()[:5] == ["zenith", "50", "0", "0", "50"]
    as_json = audit("accounts", "--db", str(path), "--json")
    assert '"available": 760' in as_json.output
    assert audit("reconcile", "--db", str(path)).exit_code == 0
    conn = sqlite3.connect(path)
    conn.execute("UPDATE accounts SET spent = spent + 5 WHERE account = 'acme'")
    conn.commit()
    conn.close()
    broken = audit("reconcile", "--db", str(path))
    assert broken.exit_code == 1
    assert "Credit accounts that do not equal" in broken.output and "acme" in broken.output
    assert "1 account figure that does not add up" in broken.output


async def test_reconcile_checks_a_runs_charge_against_its_credits(tmp_path: Path) -> None:
    """A settle entry that does not equal the run's credits is named with the run."""
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as ledger:
        accounts = le.CreditAccounts(ledger)
        await accounts.grant("acme", 1000)
        engine, _ = engine_on(ledger, Reply.text("a"), accounts=accounts)
        result = await engine.run(operation(credit_hold=500), "go", attribution=ACME)
    conn = sqlite3.connect(path)
    conn.execute("UPDATE invocations SET credits = credits + 1")
    conn.commit()
    conn.close()
    broken = audit("reconcile", "--db", str(path), "--json")
    assert broken.exit_code == 1
    assert result.invocation_id in broken.output and '"column": "charged"' in broken.output


@contextlib.asynccontextmanager
async def store_of(kind: str, tmp_path: Path,
                   request: pytest.FixtureRequest) -> AsyncIterator[tuple[Any, str]]:
    """A SQLiteLedger, or a PostgresLedger in a new database on the session's
    server, and the address `loopengine audit` takes for it."""
    if kind == "sqlite":
        with SQLiteLedger(tmp_path / "ledger.db") as ledger:
            yield ledger, str(tmp_path / "ledger.db")
        return
    from .postgres_support import PostgresServer
    from .test_audit_postgres import url_of

    server: PostgresServer = request.getfixturevalue("postgres_server")
    dsn = server.create_database()
    async with PostgresLedger(dsn) as ledger:
        yield ledger, url_of(server, dsn.rsplit("dbname=", 1)[1])


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
async def test_r03_a_run_alive_past_its_reservations_expiry_is_charged_its_whole_credits(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest,
) -> None:
    """A run without ``total_time`` whose reservation expires while it still runs
    (its tool takes two hours; another process reads the balance meanwhile and
    settles the reservation at the one turn charged so far): at its end the run
    settles what it spent since, on top. The account is charged the run's whole
    credits, once, and the audit reconciles."""
    clock = FakeClock()
    async with store_of(kind, tmp_path, request) as (ledger, address):
        accounts = le.CreditAccounts(ledger, clock=clock)
        elsewhere = le.CreditAccounts(ledger, clock=clock)  # another process's
        await accounts.grant("acme", 10_000)
        seen: list[le.AccountBalance] = []

        @le.tool
        async def slow(key: str) -> str:
            """Take two hours."""
            clock.advance(2 * 3600)
            seen.append(await elsewhere.balance("acme"))
            return "ok"

        engine, _ = engine_on(ledger, Reply.tool_calls(("slow", {"key": "a"})),
                              Reply.tool_calls(("slow", {"key": "b"})), Reply.text("done"),
                              accounts=accounts, clock=clock)
        result = await engine.run(operation(credit_hold=1000, total_time=None), "go",
                                  tools=[slow], attribution=ACME)
        balance = await accounts.balance("acme")
        again = await accounts.balance("acme")
    assert result.outcome is le.Outcome.COMPLETED and result.credits == 360
    # Expired at the first tool: charged its first turn, released.
    assert seen[0] == le.AccountBalance("acme", 10_000, 120, 0, 9_880)
    assert balance == again == le.AccountBalance("acme", 10_000, 360, 0, 9_640)
    checked = audit("reconcile", "--db", address, "--json")
    assert checked.exit_code == 0, checked.output
    assert '"accounts": []' in checked.output


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
async def test_a_grant_past_the_largest_stored_count_is_refused_and_changes_nothing(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest,
) -> None:
    """An account granted 2**63 - 1 credits takes no more: a ConfigError naming
    ``credits``, the same on each store, and the account as it was (on SQLite the
    sum was once stored as an inexact real, which the audit then refused as a
    file loopengine had not written)."""
    most = 2**63 - 1
    async with store_of(kind, tmp_path, request) as (ledger, address):
        accounts = le.CreditAccounts(ledger)
        assert await accounts.grant("acme", most - 5) == le.AccountBalance(
            "acme", most - 5, 0, 0, most - 5)
        with pytest.raises(le.ConfigError) as info:
            await accounts.grant("acme", 6)
        assert info.value.field == "credits"
        full = await accounts.grant("acme", 5)
        with pytest.raises(le.ConfigError):
            await accounts.grant("acme", 1)
        balance = await accounts.balance("acme")
    assert full == balance == le.AccountBalance("acme", most, 0, 0, most)
    listed = audit("accounts", "--db", address, "--json")
    assert listed.exit_code == 0, listed.output
    assert f'"granted": {most}' in listed.output
    assert audit("reconcile", "--db", address).exit_code == 0


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
async def test_reconcile_names_a_run_released_without_its_charge(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest,
) -> None:
    """A run whose reservation was released with no charge at all, though it
    charged credits (its settle entry lost, the balance kept equal to the
    journal), is named like a run charged too little: recorded 0, the run says
    120. A run that charged nothing and a run in progress are not."""
    async with store_of(kind, tmp_path, request) as (ledger, address):
        accounts = le.CreditAccounts(ledger)
        await accounts.grant("acme", 1000)
        engine, _ = engine_on(ledger, Reply.text("a"), accounts=accounts)
        result = await engine.run(operation(credit_hold=500), "go", attribution=ACME)
        free = le.PriceBook([le.ModelPrice(provider="anthropic", model="claude-sonnet-4-5",
                                           input_per_mtok=0, output_per_mtok=0)])
        nothing = le.Engine(ScriptedProvider([Reply.text("b")]), ledger=ledger, prices=free,
                            accounts=accounts)
        await nothing.run(operation(credit_hold=500), "go", attribution=ACME)
    assert audit("reconcile", "--db", address).exit_code == 0
    statements = ["DELETE FROM account_entries WHERE kind = 'settle'",
                  "UPDATE accounts SET spent = 0"]
    if kind == "sqlite":
        conn = sqlite3.connect(address)
        for statement in statements:
            conn.execute(statement)
        conn.commit()
        conn.close()
    else:
        import psycopg

        with psycopg.connect(f"postgresql:{address.removeprefix('postgresql:')}",
                             autocommit=True) as pg:
            for statement in statements:
                pg.execute(statement)
    broken = audit("reconcile", "--db", address, "--json")
    assert broken.exit_code == 1, broken.output
    found = json.loads(broken.output)["accounts"]
    assert found == [{"account": "acme", "column": "charged", "recorded": 0, "computed": 120,
                      "invocation_id": result.invocation_id}]


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
async def test_reconcile_checks_a_resumed_runs_charge_only_once_it_is_released(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest,
) -> None:
    """A run whose first segment settled 30 credits at its pause and whose second
    segment still holds its reservation is settled only part-way: reconcile does
    not compare its charge with its credits yet. Once the second segment
    settles, it does (here the ledger holds no invocation that charged them,
    so the 45 settled are named against the 0 it says)."""
    clock = FakeClock()
    async with store_of(kind, tmp_path, request) as (ledger, address):
        accounts = le.CreditAccounts(ledger, clock=clock)
        await accounts.grant("acme", 1000)

        async def segment() -> Any:
            return await accounts.reserve(
                "acme", "resumed", 100, expires_at=clock.wall() + timedelta(hours=1),
                credits_per_usd=Decimal(1000), credit_quantum=1)

        await accounts.settle(await segment(), 30)
        running = await segment()
        in_progress = audit("reconcile", "--db", address, "--json")
        await accounts.settle(running, 45)
    assert in_progress.exit_code == 0, in_progress.output
    assert json.loads(in_progress.output)["accounts"] == []
    settled = audit("reconcile", "--db", address, "--json")
    assert settled.exit_code == 1, settled.output
    assert json.loads(settled.output)["accounts"] == [
        {"account": "acme", "column": "charged", "recorded": 45, "computed": 0,
         "invocation_id": "resumed"}]


class LateSettlement(le.CreditAccounts):
    """Accounts whose settlements are held back until `land` (a settlement not
    confirmed by its run's deadline, which its ledger's writer completes later)."""

    def __init__(self, ledger: Any) -> None:
        super().__init__(ledger)
        self.held: list[tuple[Any, int]] = []

    async def settle(self, reservation: Any, credits: int) -> None:
        self.held.append((reservation, credits))

    async def land(self) -> None:
        for reservation, credits in self.held:
            await super().settle(reservation, credits)


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
async def test_r03_a_late_pause_settlement_leaves_the_resumed_segments_reservation_alone(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest,
) -> None:
    """A run pauses and its settlement lands late, after a resume elsewhere recovered
    its reservation (charging the 120 credits of the pause) and reserved anew: the
    late settlement changes nothing. It once released the resumed segment's
    reservation with its own amount (``reserved`` went to -120), and that
    segment's own settlement then found the run released and charged nothing of
    its turn: the account lost 120 credits, and reconcile said so."""
    async with store_of(kind, tmp_path, request) as (ledger, address):
        pausing = LateSettlement(ledger)
        await pausing.grant("acme", 1000)
        asking = Reply.tool_calls(("refund", {"order": "A-9"}))
        landed: list[le.AccountBalance] = []

        @le.tool(approval=True)
        async def refund(order: str) -> str:
            """Refund an order."""
            await pausing.land()  # while the resumed segment holds its reservation
            landed.append(await pausing.balance("acme"))
            return "refunded"

        first, _ = engine_on(ledger, asking, accounts=pausing)
        paused = await first.run(operation(credit_hold=500, total_time=60), "go",
                                 tools=[refund], attribution=ACME)
        resumer, _ = engine_on(ledger, Reply.text("done"))
        done = await resumer.resume(paused.state, decisions={
            asking.content[0]["id"]: le.Approve()}, tools=[refund])
        balance = await pausing.balance("acme")
    assert paused.outcome is le.Outcome.PAUSED and done.outcome is le.Outcome.COMPLETED
    assert done.credits == 240
    # The resume holds the 380 its hold leaves, the pause's 120 charged.
    assert landed == [le.AccountBalance("acme", 1000, 120, 380, 500)]
    assert balance == le.AccountBalance("acme", 1000, 240, 0, 760)
    checked = audit("reconcile", "--db", address, "--json")
    assert checked.exit_code == 0, checked.output


@pytest.mark.parametrize("kind", ["sqlite", "postgres"])
async def test_a_reservation_expires_on_the_accounts_clock_whatever_the_engines(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest,
) -> None:
    """An engine on a FakeClock (its wall at 2026-01-01) and its accounts on the
    system's: a run's reservation expires by the accounts' clock, the one that
    reads expiries, so a second run admitted while the first still holds the
    whole balance is denied (its expiry, once dated by the engine's clock, was
    long past by the system's: every admission settled the other runs' holds as
    dead ones and admitted past the balance)."""
    clock = FakeClock()
    async with store_of(kind, tmp_path, request) as (ledger, _):
        accounts = le.CreditAccounts(ledger)  # the system's clock
        await accounts.grant("acme", 500)
        holding, release = anyio.Event(), anyio.Event()

        @le.tool
        async def wait() -> str:
            """Wait until told."""
            holding.set()
            await release.wait()
            return "ok"

        first, _ = engine_on(ledger, Reply.tool_calls(("wait", {})), Reply.text("a"),
                             accounts=accounts, clock=clock)
        second, provider = engine_on(ledger, Reply.text("b"), accounts=accounts, clock=clock)
        results: list[le.RunResult] = []
        async with anyio.create_task_group() as group:
            async def run_first() -> None:
                results.append(await first.run(operation(credit_hold=500), "go",
                                               tools=[wait], attribution=ACME))

            group.start_soon(run_first)
            await holding.wait()
            during = await accounts.balance("acme")
            denied = await second.run(operation(credit_hold=500), "go", attribution=ACME)
            release.set()
        balance = await accounts.balance("acme")
    assert during == le.AccountBalance("acme", 500, 0, 500, 0)
    assert denied.outcome is le.Outcome.ADMISSION_DENIED and provider.requests == []
    assert results[0].outcome is le.Outcome.COMPLETED
    assert balance == le.AccountBalance("acme", 500, 240, 0, 260)


class UnsettlingAccounts(le.CreditAccounts):
    """Credit accounts whose settlement fails (their database broke at the run's end)."""

    async def settle(self, reservation: Any, credits: int) -> None:
        raise le.LedgerError("the account could not be settled")


@pytest.mark.parametrize("ends", ["completed", "paused"])
async def test_a_settlement_that_fails_after_the_end_is_written_announces_that_end(
        tmp_path: Path, ends: str) -> None:
    """The run's end (or pause) is recorded, then its account's settlement fails:
    the LedgerError reaches the caller, and observers get the end the ledger
    keeps (`RunEnded` with its outcome, or `RunPaused`), once, not a `failed`
    end nor none."""

    @le.tool(approval=True)
    def send(to: str) -> str:
        """Send the message."""
        return "sent"

    reply = Reply.text("done") if ends == "completed" else Reply.tool_calls(("send", {"to": "b"}))
    seen: list[events.Event] = []
    with SQLiteLedger(tmp_path / "ledger.db") as ledger:
        await le.CreditAccounts(ledger).grant("acme", 5_000)
        engine, _ = engine_on(ledger, reply, accounts=UnsettlingAccounts(ledger),
                              observers=[seen.append])
        with pytest.raises(le.LedgerError, match="could not be settled"):
            await engine.run(operation(credit_hold=1_000), "go", tools=[send],
                             attribution=le.Attribution(tenant="acme"))
        progress = await ledger.read_progress(seen[0].run_id)
    assert progress is not None and progress.outcome == ends
    last = seen[-1]
    assert sum(isinstance(e, events.RunTotals) for e in seen) == 1
    if ends == "paused":
        assert isinstance(last, events.RunPaused)
    else:
        assert isinstance(last, events.RunEnded) and last.outcome == "completed"


class UnreservingAccounts(le.CreditAccounts):
    """Credit accounts whose reservation fails (rolled back: nothing reserved), and
    that note every settlement of a run's stopped admission asked of them."""

    stopped: list[str]

    async def reserve(self, *args: Any, **kwargs: Any) -> Any:
        raise le.LedgerError("the reservation could not be written")

    async def recover(self, account: str, invocation_id: str, *,
                      stopped: bool = False) -> None:
        self.stopped.append(invocation_id)
        await super().recover(account, invocation_id, stopped=stopped)


async def test_an_admission_the_ledger_refused_leaves_its_run_nothing_to_settle(
        tmp_path: Path) -> None:
    """A reservation that failed (a LedgerError: rolled back, nothing reserved) is
    no admission the run stopped waiting for: its end queued a settlement of it
    anyway, one more transaction on a ledger that had just failed, whose own
    error could replace the reservation's."""
    with SQLiteLedger(tmp_path / "ledger.db") as ledger:
        accounts = UnreservingAccounts(ledger)
        accounts.stopped = []
        await accounts.grant("acme", 5_000)
        engine, provider = engine_on(ledger, Reply.text("done"), accounts=accounts)
        with pytest.raises(le.LedgerError, match="the reservation could not be written"):
            await engine.run(operation(credit_hold=1_000), "go",
                             attribution=le.Attribution(tenant="acme"))
    assert accounts.stopped == [] and provider.requests == []
