"""Benchmark: what credit accounts add to a run, under many concurrent runs.

Run with::

    python bench/accounts.py                         # 1,000 runs, 5 rounds
    python bench/accounts.py --runs 1000 --rounds 5
    python bench/accounts.py --postgres "host=/tmp/pg user=postgres dbname=postgres"

``--runs`` one-turn runs start at once on one engine (ScriptedProvider, so
only loopengine and the ledger are measured), on a SQLiteLedger file (and,
with ``--postgres``, on a PostgresLedger), once without accounts and once
with `CreditAccounts` (every run reserving on one account before its first
request and settling at its end). Rounds interleave the two, so a slow
moment of the machine hits both; each figure is the median over the rounds.
It prints wall time per run and the ratio with accounts to without: the
admission plus settlement cost of a run (two more transactions per run, one
account: they queue on it, which is the point).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio

import loopengine as le
from loopengine.persistence import SQLiteLedger
from loopengine.providers import Reply, ScriptedProvider

PRICES = le.PriceBook([le.ModelPrice(provider="anthropic", model="claude-sonnet-4-5",
                                     input_per_mtok=Decimal(1), output_per_mtok=Decimal(1))],
                      credits_per_usd=Decimal(1_000_000))
OPERATION = le.Operation(name="bench.accounts", provider="anthropic",
                         model="claude-sonnet-4-5", max_output_tokens=64,
                         limits=le.Limits(credit_hold=200, total_time=600))


async def one_round(ledger: Any, runs: int, with_accounts: bool) -> float:
    """Seconds for ``runs`` concurrent runs on ``ledger``."""
    accounts = le.CreditAccounts(ledger) if with_accounts else None
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    if accounts is not None:
        await accounts.grant(tenant, runs * 200)

    async def run() -> None:
        engine = le.Engine(ScriptedProvider([Reply.text("ok")]), ledger=ledger, prices=PRICES,
                           accounts=accounts)
        result = await engine.run(OPERATION, "go", attribution=le.Attribution(tenant=tenant))
        assert result.outcome is le.Outcome.COMPLETED, result.detail

    began = time.perf_counter()
    async with anyio.create_task_group() as group:
        for _ in range(runs):
            group.start_soon(run)
    return time.perf_counter() - began


async def measure(ledger: Any, runs: int, rounds: int) -> tuple[float, float]:
    without: list[float] = []
    with_: list[float] = []
    for _ in range(rounds):
        without.append(await one_round(ledger, runs, False))
        with_.append(await one_round(ledger, runs, True))
    return statistics.median(without), statistics.median(with_)


def report(store: str, runs: int, without: float, with_: float) -> None:
    print(f"{store:<22} {without / runs * 1e6:>10.0f}µs {with_ / runs * 1e6:>12.0f}µs "
          f"{with_ / without:>8.2f}x")


async def main(args: argparse.Namespace) -> None:
    print(f"loopengine {le.__version__} / Python {platform.python_version()} on "
          f"{platform.machine()}; {args.runs} concurrent one-turn runs, medians of "
          f"{args.rounds} interleaved rounds")
    print(f"command: python bench/accounts.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"\n{'store':<22} {'wall/run':>12} {'+accounts':>14} {'ratio':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        async with SQLiteLedger(Path(tmp) / "bench-accounts.db") as ledger:
            report("SQLiteLedger", args.runs, *await measure(ledger, args.runs, args.rounds))
    if args.postgres:
        from loopengine.persistence import PostgresLedger

        schema = f"bench_{uuid.uuid4().hex[:8]}"
        async with PostgresLedger(args.postgres, schema=schema) as pg:
            report("PostgresLedger", args.runs, *await measure(pg, args.runs, args.rounds))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--postgres", default=None, help="a PostgreSQL DSN to measure too")
    anyio.run(main, parser.parse_args())
