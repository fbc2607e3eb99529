"""The usage vector in the ledger (docs/ledger.md), on SQLite and PostgreSQL: each
attempt's server tool requests, reasoning tokens, iterations and fee, their
invocation totals (attempt sums equal them), the audit's spend, show, export
and reconcile, and an answered attempt whose usage is unknown."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import loopengine as le
from loopengine._pricing import to_nanousd
from loopengine.cli import main
from loopengine.persistence import PostgresLedger, SQLiteLedger
from loopengine.providers import (
    AnthropicProvider,
    FaultKind,
    ProviderFault,
    Reply,
    ScriptedProvider,
)
from loopengine.testing import CutStream, FakeAnthropicServer, FakeClock

from .postgres_support import PostgresServer

AT = datetime(2026, 11, 1, tzinfo=UTC)
MODEL = "claude-sonnet-4-5"
# A book price: $3 / $15 per MTok, web search $10 per 1,000.
BOOK = le.PriceBook([le.ModelPrice(provider="anthropic", model=MODEL, input_per_mtok=3,
                                   output_per_mtok=15, web_search_per_k=10)])
SEARCHED = le.Usage.from_iterations((
    le.UsageIteration(type="compaction", input_tokens=5_000, output_tokens=100),
    le.UsageIteration(type="message", input_tokens=200, output_tokens=50),
), web_search_requests=3, web_fetch_requests=2)
REASONED = le.Usage(input_tokens=300, output_tokens=80, reasoning_tokens=60)
FEE = to_nanousd(3 * Decimal(10) / 1000)


def audit(*args: str) -> Any:
    return CliRunner().invoke(main, ["audit", *args])


@asynccontextmanager
async def ledger_of(store: str, tmp_path: Path, request: pytest.FixtureRequest,
                    ) -> AsyncIterator[tuple[Any, str]]:
    """A ledger of ``store`` and the ``--db`` the audit reads it with."""
    if store == "sqlite":
        path = tmp_path / "ledger.db"
        with SQLiteLedger(path) as lite:
            yield lite, str(path)
        return
    server: PostgresServer = request.getfixturevalue("postgres_server")
    dsn = server.create_database()
    dbname = dsn.rsplit("dbname=", 1)[1]
    async with PostgresLedger(dsn) as pg:
        yield pg, (f"postgresql:///{dbname}?host={server.directory}&port=5432"
                   f"&user={server.user}")


async def record(ledger: Any, *script: Reply) -> le.RunResult:
    @le.tool
    async def lookup(q: str) -> str:
        """Look something up."""
        return "found"

    clock = FakeClock(wall_start=AT)
    engine = le.Engine(ScriptedProvider(list(script), clock=clock), ledger=ledger, prices=BOOK,
                       clock=clock, rng=random.Random(1))
    operation = le.Operation(name="research", provider="anthropic", model=MODEL)
    return await engine.run(operation, "go", tools=[lookup])


@pytest.mark.parametrize("store", ["sqlite", "postgres"])
async def test_the_usage_vector_is_recorded_summed_and_audited(
    store: str, tmp_path: Path, request: pytest.FixtureRequest,
) -> None:
    async with ledger_of(store, tmp_path, request) as (ledger, db):
        result = await record(ledger, Reply.tool_calls(("lookup", {"q": "x"}), usage=SEARCHED),
                              Reply.text("done", usage=REASONED))
    assert result.outcome is le.Outcome.COMPLETED
    shown = audit("show", result.invocation_id, "--db", db, "--json")
    assert shown.exit_code == 0, shown.output
    data = json.loads(shown.output)
    attempts, invocation = data["attempts"], data["invocation"]
    assert [(a["web_search_requests"], a["web_fetch_requests"], a["reasoning_tokens"],
             a["iterations"], a["fee_nanousd"]) for a in attempts] == [
        (3, 2, 0, 2, FEE), (0, 0, 60, 0, 0)]
    assert (invocation["web_search_requests"], invocation["web_fetch_requests"],
            invocation["reasoning_tokens"], invocation["iterations"],
            invocation["fee_nanousd"]) == (3, 2, 60, 2, FEE)
    assert invocation["cost_nanousd"] == sum(a["cost_nanousd"] for a in attempts)
    text = audit("show", result.invocation_id, "--db", db)
    assert "fee_usd" in text.output and "web_search_requests" in text.output

    spend = audit("spend", "--db", db, "--json")
    assert spend.exit_code == 0, spend.output
    (row,) = json.loads(spend.output)
    assert (row["web_search_requests"], row["web_fetch_requests"], row["reasoning_tokens"],
            row["iterations"], row["fee_nanousd"], row["usage_unknown"]) == (3, 2, 60, 2, FEE, 0)
    assert "fees USD" in audit("spend", "--db", db).output

    exported = audit("export", "--db", db, "--format", "jsonl")
    assert exported.exit_code == 0, exported.output
    rows = [json.loads(line) for line in exported.output.splitlines() if line.strip()]
    assert [r["fee_nanousd"] for r in rows] == [FEE, 0]
    assert [r["iterations"] for r in rows] == [2, 0]

    reconciled = audit("reconcile", "--db", db)
    assert reconciled.exit_code == 0, reconciled.output


@pytest.mark.parametrize("store", ["sqlite", "postgres"])
async def test_an_answered_attempt_without_usage_is_flagged(
    store: str, tmp_path: Path, request: pytest.FixtureRequest,
) -> None:
    """A reply with a response id and no usage: counted by spend ("usage unknown"),
    listed by reconcile, which exits non-zero; never shown as $0 silently."""
    async with ledger_of(store, tmp_path, request) as (ledger, db):
        result = await record(ledger, Reply.text("done", usage=None))
    assert result.outcome is le.Outcome.COMPLETED
    (row,) = json.loads(audit("spend", "--db", db, "--json").output)
    assert row["usage_unknown"] == 1
    assert "reported no usage" in audit("spend", "--db", db).output
    reconciled = audit("reconcile", "--db", db)
    assert reconciled.exit_code == 1
    assert "Usage unknown" in reconciled.output
    assert "1 attempt with usage unknown" in reconciled.output
    as_json = json.loads(audit("reconcile", "--db", db, "--json").output)
    assert as_json["ok"] is False
    assert [u["ordinal"] for u in as_json["usage_unknown"]] == [1]


@pytest.mark.parametrize("store", ["sqlite", "postgres"])
async def test_a_reply_whose_body_was_cut_before_its_id_and_usage_is_usage_unknown(
    store: str, tmp_path: Path, request: pytest.FixtureRequest,
    fake_anthropic_server: FakeAnthropicServer,
) -> None:
    """A Messages reply (no streaming) whose body is cut: the server answered 200
    and may bill the whole reply, yet the attempt has neither a response id nor
    usage. Spend counts it and reconcile lists it as usage unknown (exit 1),
    never a quiet $0."""
    fake_anthropic_server.add(CutStream(reply=Reply.text("half", usage=REASONED), after=4),
                              Reply.text("whole", usage=REASONED))
    provider = AnthropicProvider(api_key="test-key", base_url=fake_anthropic_server.url)
    async with ledger_of(store, tmp_path, request) as (ledger, db):
        clock = FakeClock(wall_start=AT)
        engine = le.Engine(provider, ledger=ledger, prices=BOOK, clock=clock,
                           rng=random.Random(1))
        try:
            result = await engine.run(
                le.Operation(name="research", provider="anthropic", model=MODEL), "go")
        finally:
            await provider.aclose()
    assert result.outcome is le.Outcome.COMPLETED
    shown = json.loads(audit("show", result.invocation_id, "--db", db, "--json").output)
    cut = shown["attempts"][0]
    assert (cut["outcome"], cut["http_status"], cut["response_id"], cut["input_tokens"]) == (
        "aborted", 200, None, None)
    (row,) = json.loads(audit("spend", "--db", db, "--json").output)
    assert row["usage_unknown"] == 1
    reconciled = audit("reconcile", "--db", db, "--json")
    assert reconciled.exit_code == 1
    assert [(u["ordinal"], u["response_id"]) for u in
            json.loads(reconciled.output)["usage_unknown"]] == [(1, None)]


@pytest.mark.parametrize("store", ["sqlite", "postgres"])
async def test_an_attempt_whose_usage_is_a_floor_is_listed_without_failing(
    store: str, tmp_path: Path, request: pytest.FixtureRequest,
) -> None:
    """A stream cut before its end keeps what had arrived (``usage_approx``): spend
    counts it ("usage floor"), reconcile lists it in its text and JSON, and the
    check still passes (exit 0): the totals hold what arrived."""
    cut = ProviderFault(FaultKind.ABORTED, "stream cut", http_status=200,
                        usage=le.Usage(50, 7), usage_approx=True, response_id="msg_cut")
    async with ledger_of(store, tmp_path, request) as (ledger, db):
        result = await record(ledger, cut, Reply.text("done", usage=REASONED))
    assert result.outcome is le.Outcome.COMPLETED
    (row,) = json.loads(audit("spend", "--db", db, "--json").output)
    assert (row["usage_floor"], row["usage_unknown"]) == (1, 0)
    assert "their usage is a floor" in audit("spend", "--db", db).output
    reconciled = audit("reconcile", "--db", db)
    assert reconciled.exit_code == 0, reconciled.output
    assert "Usage floors" in reconciled.output and "msg_cut" in reconciled.output
    assert reconciled.output.rstrip().endswith(
        "Everything reconciles. Listed without failing: 1 attempt whose usage is a floor.")
    as_json = json.loads(audit("reconcile", "--db", db, "--json").output)
    assert as_json["ok"] is True
    assert [(u["ordinal"], u["input_tokens"], u["output_tokens"], u["response_id"])
            for u in as_json["usage_floor"]] == [(1, 50, 7, "msg_cut")]
    assert as_json["usage_unknown"] == []


@pytest.mark.parametrize("store", ["sqlite", "postgres"])
async def test_runs_names_what_a_runs_cost_does_not_hold_instead_of_a_quiet_zero(
    store: str, tmp_path: Path, request: pytest.FixtureRequest,
) -> None:
    """`audit runs` counts each run's unpriced, usage-unknown and floor attempts (in
    its table and its JSON): a run of an unpriced model is not listed as $0 alone."""
    cut = ProviderFault(FaultKind.ABORTED, "stream cut", http_status=200,
                        usage=le.Usage(50, 7), usage_approx=True, response_id="msg_cut")
    async with ledger_of(store, tmp_path, request) as (ledger, db):
        flagged = await record(ledger, cut, Reply.text("done", usage=None))
        clock = FakeClock(wall_start=AT)
        engine = le.Engine(ScriptedProvider([Reply.text("hi")], clock=clock), ledger=ledger,
                           prices=BOOK, clock=clock, rng=random.Random(1))
        unpriced = await engine.run(le.Operation(name="research", provider="anthropic",
                                                 model="no-such-model-anywhere"), "go")
    listed = json.loads(audit("runs", "--db", db, "--json").output)
    counts = {r["id"]: (r["cost_nanousd"], r["unpriced_attempts"], r["usage_unknown"],
                        r["usage_floor"]) for r in listed}
    assert counts == {flagged.invocation_id: (0, 0, 1, 1),
                      unpriced.invocation_id: (0, 1, 0, 0)}
    text = audit("runs", "--db", db)
    assert text.exit_code == 0, text.output
    lines = {line.split()[0]: line for line in text.output.splitlines() if line}
    assert lines[flagged.invocation_id].endswith("1 usage unknown, 1 floor")
    assert lines[unpriced.invocation_id].endswith("1 unpriced")
    assert "`not in USD` counts attempts" in text.output


async def test_a_ledger_of_the_previous_version_gains_the_usage_columns(tmp_path: Path) -> None:
    """Migration 7 on a ledger with rows: old attempts' usage counts are NULL (not
    reported then), old invocations' totals 0, and everything still reconciles."""
    import sqlite3

    from loopengine.persistence._schema import MIGRATIONS, USAGE_COLUMNS, migrate

    path = tmp_path / "ledger.db"
    conn = sqlite3.connect(path, isolation_level=None)
    migrate(conn, migrations=MIGRATIONS[:5])
    conn.execute("INSERT INTO invocations (id, operation, operation_version, provider, model, "
                 "started_at, outcome, ended_at, attempt_count, attempts_retained, "
                 "input_tokens, cost_nanousd, provider_cost_nanousd) VALUES ('inv-1', 'op', "
                 "'1', 'anthropic', 'm', '2026-01-01', 'completed', '2026-01-01', 1, 1, 7, 21, "
                 "21)")
    conn.execute("INSERT INTO attempts (invocation_id, ordinal, turn, attempt, phase, "
                 "served_by, started_at, outcome, input_tokens, cost_nanousd, charged, "
                 "response_id, max_tokens, timeout_ms, wait_ms) VALUES ('inv-1', 1, 1, 1, "
                 "'turn', 'anthropic:m', '2026-01-01', 'ok', 7, 21, 1, 'msg_1', 64, 1000, 0)")
    conn.close()
    with SQLiteLedger(path):
        pass
    conn = sqlite3.connect(path)
    columns = ", ".join(USAGE_COLUMNS)
    assert conn.execute(f"SELECT {columns} FROM attempts").fetchall() == [(None,) * 5]
    assert conn.execute(f"SELECT {columns} FROM invocations").fetchall() == [(0,) * 5]
    conn.close()
    assert audit("reconcile", "--db", str(path)).exit_code == 0
