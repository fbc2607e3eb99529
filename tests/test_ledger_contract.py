"""The `Ledger` contract, proved on every store through the real engine.

Every test here runs on `MemoryLedger`, on `SQLiteLedger` and on
`PostgresLedger` against a real server (the same rules, the planner's, on
each), and one test checks that they keep identical rows for the same
conversation.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import loopengine as le
from loopengine.persistence import Ledger, MemoryLedger, PostgresLedger, SQLiteLedger
from loopengine.providers import (
    Provider,
    ProviderRequest,
    ProviderResponse,
    Reply,
    ScriptedProvider,
    TextCallback,
)
from loopengine.testing import FakeClock

from .conftest import PRICES, EngineFactory, operation
from .ledger_support import judge, lookup, overloaded, read_rows, teammate_script
from .postgres_support import PostgresServer, fresh_schema

FAST = le.RetryPolicy(max_attempts=7, initial_wait=0.001, max_wait=0.001)

STORES = ["memory", "sqlite", "postgres"]
"""MemoryLedger, SQLiteLedger, PostgresLedger."""


def open_store(request: pytest.FixtureRequest, store: str, tmp_path: Path) -> Ledger:
    """A new, empty ledger of ``store`` (closed by the test's teardown)."""
    if store == "memory":
        return MemoryLedger()
    if store == "postgres":
        server: PostgresServer = request.getfixturevalue("postgres_server")
        postgres = PostgresLedger(server.dsn(), schema=fresh_schema())
        request.addfinalizer(postgres.close)
        return postgres
    sqlite_ledger = SQLiteLedger(tmp_path / "ledger.db")
    request.addfinalizer(sqlite_ledger.close)
    return sqlite_ledger


@pytest.fixture(params=STORES)
def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Ledger]:
    """Each ledger implementation in turn."""
    yield open_store(request, request.param, tmp_path)


async def test_r07_seventy_attempts_keep_sixty_four_rows(
    ledger: Ledger, make_engine: EngineFactory
) -> None:
    """70 attempts in one run: 64 rows retained, attempt_count 70, incomplete 1, and the
    totals still count every attempt (R07)."""
    script: list[Any] = []
    for turn in range(1, 11):
        script += [overloaded() for _ in range(6)]
        script.append(Reply.tool_calls(("lookup", {"key": str(turn)})) if turn < 10
                      else Reply.text("done"))
    engine, _, _ = make_engine(*script, ledger=ledger)
    result = await engine.run(operation(max_turns=10, retry=FAST), "go", tools=[lookup])

    assert result.outcome is le.Outcome.COMPLETED
    assert result.attempts.count == 70
    assert (result.attempts.retained, result.attempts.incomplete) == (64, True)
    invocations, attempts = await read_rows(ledger)
    (row,) = invocations.values()
    assert (row["attempt_count"], row["attempts_retained"], row["incomplete"]) == (70, 64, 1)
    assert len(attempts) == 64
    assert sorted(ordinal for _, ordinal in attempts) == list(range(1, 65))
    # Ten successful replies of 100 in / 20 out: the totals include the six
    # attempts that have no row, the charge only the successful ones.
    assert (row["input_tokens"], row["output_tokens"]) == (1000, 200)
    assert row["cost_nanousd"] == row["provider_cost_nanousd"] == 10 * 120_000
    assert row["credits"] == result.credits == 10 * 120


async def test_r07_each_attempt_records_turn_retry_usage_timing_and_price(
    ledger: Ledger, make_engine: EngineFactory
) -> None:
    """Attempts record their turn, try number, phase, usage, timing and their own price (R07)."""
    engine, _, _ = make_engine(*teammate_script(), ledger=ledger)
    result = await engine.run(operation(retry=FAST), "go", tools=[lookup], accept=judge)
    assert result.outcome is le.Outcome.COMPLETED
    _, attempts = await read_rows(ledger)
    rows = [attempts[(result.invocation_id, n)] for n in range(1, 7)]
    assert [(r["turn"], r["attempt"], r["phase"], r["outcome"]) for r in rows] == [
        (1, 1, "turn", "error"), (1, 2, "turn", "ok"),
        (2, 1, "turn", "aborted"), (2, 2, "turn", "ok"),
        (3, 1, "turn", "ok"), (4, 1, "repair", "ok"),
    ]
    assert [r["input_tokens"] for r in rows] == [None, 120, 50, 200, 300, 320]
    assert [r["usage_approx"] for r in rows] == [0, 0, 1, 0, 0, 0]
    assert [r["charged"] for r in rows] == [0, 1, 0, 1, 1, 1]
    # Priced one by one at 1 USD/Mtok in and out (cache tokens at the input price).
    assert [r["cost_nanousd"] for r in rows] == [None, 165_000, 57_000, 340_000, 360_000,
                                                 390_000]
    assert all(r["price_ref"] for r in rows[1:]) and rows[0]["price_ref"] is None
    assert rows[0]["fault"] == "overloaded" and rows[0]["http_status"] == 529
    assert rows[1]["wait_ms"] == 1 and rows[0]["wait_ms"] == 0
    assert all(r["served_by"] == "anthropic:claude-sonnet-4-5" for r in rows)
    assert all(r["max_tokens"] == 512 and r["timeout_ms"] == 60_000 for r in rows)


async def test_s01_totals_charge_successful_attempts_and_count_every_usage(
    ledger: Ledger, make_engine: EngineFactory
) -> None:
    """Invocation totals equal the attempt sums: tokens over every attempt that reported
    usage, cost_nanousd over the charged ones, provider_cost_nanousd over every priced
    one (S01)."""
    engine, _, _ = make_engine(*teammate_script(), ledger=ledger)
    result = await engine.run(operation(retry=FAST), "go", tools=[lookup], accept=judge)
    invocations, attempts = await read_rows(ledger)
    row = invocations[result.invocation_id]
    rows = list(attempts.values())
    for column in ("input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens"):
        assert row[column] == sum(r[column] or 0 for r in rows), column
    assert row["cost_nanousd"] == sum(r["cost_nanousd"] for r in rows if r["charged"])
    assert row["provider_cost_nanousd"] == sum(r["cost_nanousd"] or 0 for r in rows)
    assert row["cost_nanousd"] < row["provider_cost_nanousd"]
    assert row["cost_nanousd"] == int(result.cost_usd * 10**9)
    assert row["provider_cost_nanousd"] == int(result.provider_cost_usd * 10**9)
    assert (row["outcome"], row["turns"], row["tool_calls"]) == ("completed", 4, 3)
    assert row["attempt_count"] == row["attempts_retained"] == 6 and row["incomplete"] == 0


async def test_a_pre_wire_refusal_writes_no_attempt_row(
    ledger: Ledger, make_engine: EngineFactory
) -> None:
    """A turn the time guard refuses before sending leaves no attempt row."""
    engine, provider, _ = make_engine(
        Reply.tool_calls(("lookup", {"key": "k"}), delay=5.0), ledger=ledger)
    result = await engine.run(operation(total_time=5.0), "go", tools=[lookup])
    assert result.outcome is le.Outcome.TIME_LIMIT
    invocations, attempts = await read_rows(ledger)
    assert len(provider.requests) == 1 and len(attempts) == 1
    (row,) = invocations.values()
    assert (row["outcome"], row["attempt_count"], row["turns"]) == ("time_limit", 1, 1)


class Hanging(Provider):
    """A provider whose request never comes back (until cancelled)."""

    name = "anthropic"

    def __init__(self) -> None:
        self.on_the_wire = anyio.Event()

    async def send(self, request: ProviderRequest, *,
                   on_text: TextCallback | None = None) -> ProviderResponse:
        self.on_the_wire.set()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")


async def test_cancellation_settles_aborted_external_and_propagates(ledger: Ledger) -> None:
    """The caller cancels while a request is on the wire: the attempt is settled
    aborted/external and the invocation cancelled, and the cancellation propagates."""
    provider = Hanging()
    engine = le.Engine(provider, ledger=ledger, prices=PRICES)
    after_run: list[str] = []
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as group:
            async def run() -> None:
                await engine.run(operation(), "go")
                after_run.append("the run returned")

            group.start_soon(run)
            await provider.on_the_wire.wait()
            scope.cancel()
    assert scope.cancelled_caught and after_run == []
    invocations, attempts = await read_rows(ledger)
    (row,) = invocations.values()
    assert row["outcome"] == "cancelled" and row["ended_at"] is not None
    (attempt,) = attempts.values()
    assert (attempt["outcome"], attempt["aborted_reason"]) == ("aborted", "external")
    assert attempt["latency_ms"] is not None


@pytest.mark.parametrize("store", STORES[1:])
async def test_every_store_keeps_the_same_rows(
    request: pytest.FixtureRequest, tmp_path: Path, store: str
) -> None:
    """The same conversation leaves identical rows in MemoryLedger and in SQLiteLedger
    and PostgresLedger."""
    attribution = le.Attribution(tenant="acme", user_id="u1", feature="help",
                                 correlation_id="c1")

    async def converse(ledger: Ledger) -> None:
        clock = FakeClock()
        engine = le.Engine(ScriptedProvider(teammate_script(), clock=clock), ledger=ledger,
                           prices=PRICES, clock=clock, rng=random.Random(7))
        await engine.run(operation(retry=FAST), "go", tools=[lookup], accept=judge,
                         attribution=attribution)

    memory = MemoryLedger()
    await converse(memory)
    memory_rows = await read_rows(memory)
    other = open_store(request, store, tmp_path)
    await converse(other)
    other_rows = await read_rows(other)

    def comparable(rows: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        invocations, attempts = rows
        drop = {"id", "invocation_id"}
        return ([{k: v for k, v in r.items() if k not in drop} for r in invocations.values()],
                [{k: v for k, v in r.items() if k not in drop}
                 for _, r in sorted(attempts.items())])

    memory_inv, memory_att = comparable(memory_rows)
    other_inv, other_att = comparable(other_rows)
    # A store's rows may carry more columns than the reference; none may differ.
    assert len(other_att) == len(memory_att) == 6
    for mem, row in zip([*memory_inv, *memory_att], [*other_inv, *other_att], strict=True):
        assert {k: row.get(k) for k in mem} == mem
