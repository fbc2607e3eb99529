"""A run recovered after its process died ends, in the ledger, the sub-agents that
death cut short (docs/pause-and-resume.md): each ``failed``, its counts as the
ledger has them, its credits what the recovery counted for it, so the audit's
sums, its reconciliation and the credit accounts agree, on every ledger store
(a `MemoryLedger`, whose runs outlive no process, within one: it has no audit
or accounts, so its rows are read as the others' are), through either
provider's real SDK."""

from __future__ import annotations

import contextlib
import dataclasses
import sqlite3
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

import loopengine as le
from loopengine import audit, events
from loopengine.persistence import MemoryLedger, PostgresLedger, SQLiteLedger
from loopengine.testing import Reply

from ..postgres_support import PostgresServer, fresh_schema
from ..test_audit_postgres import url_of
from .conftest import Route
from .test_subagents import ACME, spend


class Crash(BaseException):
    """Stands in for the death of the process (nothing catches it)."""


@le.tool
def explode(key: str) -> str:
    """Die."""
    raise Crash


async def funded(ledger: Any) -> le.CreditAccounts | None:
    """The ledger's credit accounts, ``acme`` granted 10,000 credits (none on a
    `MemoryLedger`, which keeps no accounts)."""
    if isinstance(ledger, MemoryLedger):
        return None
    accounts = le.CreditAccounts(ledger)
    await accounts.grant("acme", 10_000)
    return accounts


@contextlib.contextmanager
def dies() -> Iterator[None]:
    """Expect the process's stand-in death (maybe inside exception groups)."""

    def crashed(error: BaseException) -> bool:
        if isinstance(error, BaseExceptionGroup):
            return any(crashed(e) for e in error.exceptions)
        return isinstance(error, Crash)

    with pytest.raises(BaseException) as died:  # noqa: B017 - checked below
        yield
    assert crashed(died.value), died.value


@dataclasses.dataclass
class Store:
    """A ledger, and how the audit opens its database."""

    ledger: Any
    target: str | None
    """How the audit opens its database (None: a `MemoryLedger`'s rows)."""
    schema: str | None = None

    def rows(self, sql: str) -> list[tuple[Any, ...]]:
        """The rows of ``sql`` on the ledger's database, read as the audit reads it
        (a `MemoryLedger`'s: on a SQLite copy of its rows)."""
        conn = (audit.open_ledger(self.target, schema=self.schema) if self.target is not None
                else memory_copy(self.ledger))
        try:
            return [tuple(r) for r in conn.execute(sql).fetchall()]
        finally:
            conn.close()

    def reconcile(self) -> audit.Reconciliation:
        """``loopengine audit reconcile``'s findings."""
        assert self.target is not None  # a MemoryLedger has no audit
        conn = audit.open_ledger(self.target, schema=self.schema)
        try:
            return audit.reconcile(conn)
        finally:
            conn.close()

    def running(self) -> list[str]:
        """The operations of the runs the ledger holds ``running``."""
        return sorted(str(r[0]) for r in self.rows(
            "SELECT operation FROM invocations WHERE outcome = 'running'"))


def memory_copy(ledger: MemoryLedger) -> sqlite3.Connection:
    """A SQLite database holding a `MemoryLedger`'s rows, in tables of its names."""
    conn = sqlite3.connect(":memory:")
    for table, rows in (("invocations", ledger.invocations), ("attempts", ledger.attempts),
                        ("segments", ledger.segments)):
        found = list(rows.values())
        columns = list(found[0])
        conn.execute(f"CREATE TABLE {table} ({', '.join(columns)})")
        conn.executemany(f"INSERT INTO {table} VALUES ({', '.join('?' * len(columns))})",
                         [tuple(row[c] for c in columns) for row in found])
    return conn


async def flush(ledger: Any) -> None:
    """Wait for the ledger's queued writes (a `MemoryLedger` queues none)."""
    if not isinstance(ledger, MemoryLedger):
        await ledger.flush()


@pytest.fixture(params=["memory", "sqlite", "postgres"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    """A memory ledger, a SQLite ledger file, then a PostgreSQL ledger in a schema
    of its own."""
    if request.param == "memory":
        yield Store(MemoryLedger(), None)
        return
    if request.param == "sqlite":
        path = tmp_path / "ledger.db"
        with SQLiteLedger(path) as ledger:
            yield Store(ledger, str(path))
        return
    server: PostgresServer = request.getfixturevalue("postgres_server")
    schema = fresh_schema()
    async with PostgresLedger(server.dsn(), schema=schema) as ledger:
        yield Store(ledger, url_of(server, "postgres"), schema)


def by_operation(store: Store) -> dict[str, list[tuple[Any, ...]]]:
    """Each operation's invocations, sorted: ``(outcome, turns, tool_calls, credits,
    attempt_count, ended_at)``."""
    found: dict[str, list[tuple[Any, ...]]] = {}
    for operation, *rest in store.rows(
            "SELECT operation, outcome, turns, tool_calls, credits, attempt_count, ended_at "
            "FROM invocations"):
        found.setdefault(str(operation), []).append(tuple(rest))
    return {operation: sorted(rows, key=repr) for operation, rows in found.items()}


def assert_agrees(store: Store) -> None:
    """The audit finds nothing running, nothing mismatched, no account off (a
    `MemoryLedger`, without an audit: it holds nothing running)."""
    if store.target is None:
        assert store.running() == []
        return
    found = store.reconcile()
    assert found.mismatches == [] and found.accounts == []
    assert found.running == [] and found.abandoned == []


async def crashed_run(route: Route, store: Store, engine: le.Engine, helper: le.Tool, *,
                      hold: int) -> str:
    """Run ``parent.op`` with ``helper`` until its process's stand-in death; its id."""
    with dies():
        await engine.run(route.named("parent.op", credit_hold=hold, total_time=600.0),
                         "go", tools=[helper], attribution=ACME)
    await flush(store.ledger)
    [(run_id,)] = store.rows("SELECT id FROM invocations WHERE parent_invocation_id IS NULL")
    return str(run_id)


async def test_a_recovery_ends_the_sub_agents_and_grandchildren_its_dead_process_left_running(
        route: Route, store: Store) -> None:
    """The process dies in a grandchild's tool (parent -> helper -> inner ->
    explode), each reply settled. The recovery by id ends helper's and inner's
    rows ``failed``, their attempts as recorded, their turns those their attempts
    were sent in, their credits their settled turns' (100, 200), their segments
    left open (their process died),
    and emits the `RunEnded` each could not; the run goes on, and its total,
    its account and the audit agree on 330."""
    ledger = store.ledger
    seen: list[events.Event] = []
    accounts = await funded(ledger)
    engine, _ = route.wire.engine(
        Reply.tool_calls(("helper", {"task": "research"}), usage=spend(10)),
        Reply.tool_calls(("inner", {"task": "dig"}), usage=spend(100)),
        Reply.tool_calls(("explode", {"key": "k"}), usage=spend(200)),
        Reply.text("done", usage=spend(20)),
        ledger=ledger, accounts=accounts, run_store=le.RunStore(ledger),
        observers=[seen.append])
    inner = le.agent_tool(engine, route.named("grandchild.op"), name="inner",
                          description="Digs.", tools=[explode])
    helper = le.agent_tool(engine, route.named("child.op"), name="helper",
                           description="Helps.", tools=[inner])
    run_id = await crashed_run(route, store, engine, helper, hold=1000)
    assert {op: [r[0] for r in rows] for op, rows in by_operation(store).items()} == {
        "parent.op": ["running"], "child.op": ["running"], "grandchild.op": ["running"]}
    assert store.running() == ["child.op", "grandchild.op", "parent.op"]

    paused = await engine.resume(run_id, tools=[helper], force=True)
    assert [c.reason for c in paused.pending] == ["in_doubt"]
    ended = sorted(((e.outcome, e.turns, e.tool_calls, e.attempts, e.credits, e.usage)
                    for e in seen if isinstance(e, events.RunEnded)), key=repr)
    assert ended == [("failed", 1, 0, 1, 100, spend(100)), ("failed", 1, 0, 1, 200, spend(200))]
    await flush(ledger)
    rows = by_operation(store)
    # Ended failed: the turn their one attempt each was sent in (R01), no tool
    # call recorded (a run writes those when it ends), their charge.
    assert [r[:5] for r in rows["child.op"]] == [("failed", 1, 0, 100, 1)]
    assert [r[:5] for r in rows["grandchild.op"]] == [("failed", 1, 0, 200, 1)]
    assert all(r[5] is not None for r in rows["child.op"] + rows["grandchild.op"])
    # Their segments stay open: their process died there (`audit reconcile` lists them).
    dead = {str(r[0]) for r in store.rows(
        "SELECT i.operation FROM segments AS s JOIN invocations AS i "
        "ON i.id = s.invocation_id WHERE s.ended_at IS NULL")}
    assert {"child.op", "grandchild.op"} <= dead
    assert_agrees(store)

    done = await engine.resume(run_id, tools=[helper],
                               decisions={paused.pending[0].id: le.Supply("found it")})
    assert (done.outcome, done.credits, done.credits_total) == (le.Outcome.COMPLETED, 30, 330)
    if accounts is not None:
        balance = await accounts.balance("acme")
        assert (balance.spent, balance.reserved) == (330, 0)
    await flush(ledger)
    assert [r[:5] for r in by_operation(store)["child.op"]] == [("failed", 1, 0, 100, 1)]
    assert_agrees(store)


async def test_a_recovery_recovered_again_ends_each_dead_sub_agent_once(
        route: Route, store: Store) -> None:
    """The sub-agent's tool is idempotent, so each recovery runs it again; the
    first recovery dies in it too. The second recovery ends only the sub-agent
    that first recovery started: the one the first ended keeps its end and its
    credits, nothing is charged twice, and the audit agrees with the account."""
    ledger = store.ledger
    deaths = iter([True, True, False])
    seen: list[events.Event] = []

    @le.tool
    def explode_twice(key: str) -> str:
        """Die, twice."""
        if next(deaths):
            raise Crash
        return "ok"

    accounts = await funded(ledger)
    engine, _ = route.wire.engine(
        Reply.tool_calls(("helper", {"task": "research"}), usage=spend(10)),
        Reply.tool_calls(("explode_twice", {"key": "k"}), usage=spend(100)),
        # The first recovery: helper runs again, and its process dies again.
        Reply.tool_calls(("explode_twice", {"key": "k"}), usage=spend(200)),
        # The second: helper runs again and answers.
        Reply.tool_calls(("explode_twice", {"key": "k"}), usage=spend(300)),
        Reply.text("found", usage=spend(10)),
        Reply.text("done", usage=spend(20)),
        ledger=ledger, accounts=accounts, run_store=le.RunStore(ledger),
        observers=[seen.append])

    @le.tool(idempotent=True)
    async def helper(task: str, ctx: le.ToolContext) -> str:
        """Helps (a sub-agent; run again after a crash)."""
        result = await ctx.run(route.named("child.op"), task, tools=[explode_twice])
        return result.answer or ""

    run_id = await crashed_run(route, store, engine, helper, hold=2000)
    with dies():
        await engine.resume(run_id, tools=[helper], force=True)
    await flush(ledger)
    first = by_operation(store)["child.op"]
    assert [r[:5] for r in first] == [("failed", 1, 0, 100, 1), ("running", 0, 0, 0, 1)]

    done = await engine.resume(run_id, tools=[helper], force=True)
    assert done.outcome is le.Outcome.COMPLETED
    await flush(ledger)
    rows = by_operation(store)["child.op"]
    assert first[0] in rows  # ended once: the second recovery left it as it was
    assert [r[:5] for r in rows] == [("completed", 2, 1, 310, 2), ("failed", 1, 0, 100, 1),
                                     ("failed", 1, 0, 200, 1)]
    assert done.credits_total == 30 + 100 + 200 + 310
    if accounts is not None:
        balance = await accounts.balance("acme")
        assert (balance.spent, balance.reserved) == (done.credits_total, 0)
    assert_agrees(store)
    # Every run, the dead ones included, ended once for the observers.
    ends = [e.run_id for e in seen if isinstance(e, events.RunEnded)]
    starts = [e.run_id for e in seen if isinstance(e, events.RunStarted)]
    assert sorted(ends) == sorted(starts) and len(set(ends)) == 4


async def test_two_recoveries_at_once_end_the_dead_sub_agent_once(
        route: Route, store: Store) -> None:
    """Two recoveries of one run whose process died in its sub-agent: one takes
    the run (the other raises `RunBusyError` having written nothing), and the
    sub-agent is ended once, with its charge once on the account."""
    import anyio

    ledger = store.ledger
    accounts = await funded(ledger)
    engine, _ = route.wire.engine(
        Reply.tool_calls(("helper", {"task": "research"}), usage=spend(10)),
        Reply.tool_calls(("explode", {"key": "k"}), usage=spend(100)),
        ledger=ledger, accounts=accounts, run_store=le.RunStore(ledger))
    helper = le.agent_tool(engine, route.named("child.op"), name="helper",
                           description="Helps.", tools=[explode])
    run_id = await crashed_run(route, store, engine, helper, hold=1000)
    outcomes: list[str] = []

    async def recover() -> None:
        try:
            result = await engine.resume(run_id, tools=[helper], force=True)
        except le.RunBusyError:
            outcomes.append("busy")
        else:
            outcomes.append(result.outcome.value)

    async with anyio.create_task_group() as group:
        group.start_soon(recover)
        group.start_soon(recover)
    assert sorted(outcomes) == ["busy", "paused"]
    await flush(ledger)
    assert [r[:5] for r in by_operation(store)["child.op"]] == [("failed", 1, 0, 100, 1)]
    if accounts is not None:
        balance = await accounts.balance("acme")
        assert (balance.spent, balance.reserved) == (110, 0)
    assert_agrees(store)
