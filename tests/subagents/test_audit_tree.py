"""The audit of delegated runs (docs/tools.md), on SQLite and on PostgreSQL: `show` lists
a run's children with their costs, `spend --roll-up` sums each tree into its root,
and `reconcile` checks a root's account charge against its whole tree."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import loopengine as le
from loopengine.cli import main
from loopengine.persistence import PostgresLedger, SQLiteLedger
from loopengine.providers import Reply, ScriptedProvider

from ..conftest import PRICES, operation
from ..postgres_support import PostgresServer


def audit(*args: str) -> Any:
    return CliRunner().invoke(main, ["audit", *args])


def named(name: str, **limits: Any) -> le.Operation:
    return dataclasses.replace(operation(**limits), name=name)


@dataclasses.dataclass
class Recorded:
    db: str
    """What ``--db`` takes."""
    parent: le.RunResult
    path: Path | None = None
    """The SQLite file, when it is one."""


async def record_tree(ledger: Any) -> le.RunResult:
    """A parent (120 credits a turn, two turns) whose tool delegates to a child (one
    turn), on an account; and a lone run of another tenant."""
    accounts = le.CreditAccounts(ledger)
    await accounts.grant("acme", 5000)
    engine = le.Engine(ScriptedProvider([
        Reply.tool_calls(("helper", {"task": "find it"})), Reply.text("found"),
        Reply.text("done"), Reply.text("alone")]), ledger=ledger, prices=PRICES,
        accounts=accounts)
    helper = le.agent_tool(engine, named("child.op"), name="helper", description="Finds.")
    parent = await engine.run(named("parent.op", credit_hold=1000), "go", tools=[helper],
                              attribution=le.Attribution(tenant="acme"))
    assert parent.completed and parent.credits_total == 360
    await le.Engine(ScriptedProvider([Reply.text("alone")]), ledger=ledger,
                    prices=PRICES).run(named("lone.op"), "go",
                                       attribution=le.Attribution(tenant="zenith"))
    return parent


@pytest.fixture(params=["sqlite", "postgres"])
async def recorded(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Recorded]:
    """The same runs in a SQLiteLedger or in a PostgresLedger on the suite's server."""
    if request.param == "sqlite":
        path = tmp_path / "ledger.db"
        with SQLiteLedger(path) as lite:
            parent = await record_tree(lite)
        yield Recorded(str(path), parent, path)
        return
    server: PostgresServer = request.getfixturevalue("postgres_server")
    dsn = server.create_database()
    async with PostgresLedger(dsn) as pg:
        parent = await record_tree(pg)
    dbname = dsn.rsplit("dbname=", 1)[1]
    yield Recorded(f"postgresql:///{dbname}?host={server.directory}&port=5432"
                   f"&user={server.user}", parent)


async def test_show_lists_a_run_s_children_with_their_costs(recorded: Recorded) -> None:
    shown = audit("show", recorded.parent.invocation_id, "--db", recorded.db, "--json")
    assert shown.exit_code == 0, shown.output
    [child] = json.loads(shown.output)["children"]
    assert (child["operation"], child["outcome"], child["turns"]) == ("child.op", "completed", 1)
    assert child["credits"] == child["tree_credits"] == 120 and child["cost_nanousd"] > 0
    table = audit("show", recorded.parent.invocation_id, "--db", recorded.db)
    assert "Delegated runs (sub-agents): 1" in table.output and child["id"] in table.output


async def test_spend_roll_up_sums_each_tree_into_its_root(recorded: Recorded) -> None:
    def by_operation(*extra: str) -> dict[str, tuple[int, int]]:
        out = audit("spend", "--by", "operation", "--json", "--db", recorded.db, *extra)
        assert out.exit_code == 0, out.output
        return {r["operation"]: (r["invocations"], r["credits"]) for r in json.loads(out.output)}

    assert by_operation() == {"parent.op": (1, 240), "child.op": (1, 120), "lone.op": (1, 120)}
    assert by_operation("--roll-up") == {"parent.op": (1, 360), "lone.op": (1, 120)}
    by_tenant = audit("spend", "--roll-up", "--json", "--db", recorded.db)
    assert {r["tenant"]: r["invocations"] for r in json.loads(by_tenant.output)} == {
        "acme": 1, "zenith": 1}


async def test_reconcile_checks_a_root_s_charge_against_its_tree(recorded: Recorded) -> None:
    """The root was charged its tree's 360 once: reconcile passes. A charge of its own
    credits alone (240) would be named as the mismatch it is."""
    passed = audit("reconcile", "--db", recorded.db)
    assert passed.exit_code == 0, passed.output
    if recorded.path is None:
        return
    conn = sqlite3.connect(recorded.path)
    conn.execute("UPDATE account_entries SET credits = 240 WHERE kind = 'settle'")
    conn.execute("UPDATE accounts SET spent = 240 WHERE account = 'acme'")
    conn.commit()
    conn.close()
    failed = audit("reconcile", "--json", "--db", recorded.db)
    assert failed.exit_code == 1
    assert json.loads(failed.output)["accounts"] == [{
        "account": "acme", "column": "charged", "recorded": 240, "computed": 360,
        "invocation_id": recorded.parent.invocation_id}]


def test_a_ledger_older_than_delegation_is_audited_as_a_ledger_of_roots(
    tmp_path: Path,
) -> None:
    """A version-5 file (no parent_invocation_id) is read, not refused: no children,
    a roll-up that changes nothing, and a reconciliation of its accounts."""
    from loopengine.persistence._schema import MIGRATIONS, migrate

    path = tmp_path / "old.db"
    conn = sqlite3.connect(path, isolation_level=None)
    migrate(conn, migrations=MIGRATIONS[:5])
    conn.execute("INSERT INTO invocations (id, operation, operation_version, provider, model, "
                 "tenant, started_at, outcome, credits) VALUES ('old-1', 'op', '1', "
                 "'anthropic', 'm', 'acme', '2026-01-01T00:00:00.000000+00:00', "
                 "'completed', 7)")
    conn.close()
    shown = audit("show", "old-1", "--db", str(path), "--json")
    assert shown.exit_code == 0 and json.loads(shown.output)["children"] == []
    rolled = audit("spend", "--roll-up", "--json", "--db", str(path))
    assert rolled.exit_code == 0, rolled.output
    assert [(r["tenant"], r["credits"]) for r in json.loads(rolled.output)] == [("acme", 7)]
    assert audit("reconcile", "--db", str(path)).exit_code == 0


async def test_an_expired_root_reservation_is_charged_its_whole_tree(tmp_path: Path) -> None:
    """A root whose process died: once its reservation expires, the next touch of the
    account charges what the ledger says its tree charged (an ended child's credits
    with the root's own), and releases the hold."""
    from datetime import UTC, datetime, timedelta
    from decimal import Decimal

    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as ledger:
        accounts = le.CreditAccounts(ledger)
        await accounts.grant("acme", 1000)
        await accounts.reserve("acme", "root", 300,
                               expires_at=datetime.now(UTC) - timedelta(seconds=1),
                               credits_per_usd=Decimal(1_000_000), credit_quantum=1)
        conn = sqlite3.connect(path)
        conn.executemany(
            "INSERT INTO invocations (id, operation, operation_version, provider, model, "
            "tenant, started_at, outcome, credits, parent_invocation_id) VALUES "
            "(?, 'op', '1', 'anthropic', 'm', 'acme', '2026-01-01', ?, ?, ?)",
            [("root", "running", 0, None), ("child", "completed", 50, "root"),
             ("grandchild", "credit_limit", 25, "child")])
        conn.commit()
        conn.close()
        balance = await accounts.balance("acme")
    assert (balance.spent, balance.reserved) == (75, 0)
