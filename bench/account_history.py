"""Benchmark: what an account's transactions cost as its history grows.

Run with::

    python bench/account_history.py                     # SQLite, and a throwaway PostgreSQL
    python bench/account_history.py --histories 100,10000,50000 --rounds 5 --calls 40
    python bench/account_history.py --postgres "host=/tmp/pg user=postgres dbname=postgres"
    python bench/account_history.py --no-postgres

Each history size has a ledger of its own (a fresh SQLite file; a fresh
schema on the server) whose account ``acme`` has that many past settled runs
in its journal (a ``reserve``, a ``settle`` and a ``release`` each, written
in bulk as `CreditAccounts` writes them) and 20 runs in flight (reserved
through `CreditAccounts`, not expired). A round times ``--calls``
`CreditAccounts.balance` calls and ``--calls`` admissions on each ledger:
a new run's ``reserve`` (what `Engine.run` does before its first request),
then its ``settle``. The ledgers take turns call by call, their order
turning round to round, so a slow moment of the machine hits every size.
Each figure is the median over the rounds of a round's mean per call;
``x`` is the ratio to the smallest history. Every one of these transactions
first settles the account's expired reservations, and they queue on the
account: their cost should not grow with the runs it has had.

Without ``--postgres``, a throwaway server is started from the system's
binaries as the tests start theirs (tests/postgres_support.py: a unix socket
in a temporary directory, nothing on the network) and removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio

import loopengine as le
from loopengine.persistence import PostgresLedger, SQLiteLedger
from loopengine.persistence._qmark import percent_s
from loopengine.persistence._schema import format_time

ROOT = Path(__file__).resolve().parent.parent
RATE = Decimal(1000)
HOLD = 100
CHARGE = 7
IN_FLIGHT = 20
ENTRY = ("INSERT INTO account_entries (account, at, kind, credits, invocation_id, note, "
         "expires_at, credits_per_usd, credit_quantum) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)")


def past_runs(history: int) -> Iterator[tuple[Any, ...]]:
    """The journal entries of ``history`` settled runs, a day ago, as the accounts
    write them: reserved, charged, released."""
    start = datetime.now(UTC) - timedelta(days=1)
    for n in range(history):
        at = format_time(start + timedelta(milliseconds=n))
        expires = format_time(start + timedelta(milliseconds=n, minutes=11))
        run = f"past-{n:08d}"
        yield ("acme", at, "reserve", HOLD, run, None, expires, str(RATE), 1)
        yield ("acme", at, "settle", CHARGE, run, None, None, None, None)
        yield ("acme", at, "release", HOLD, run, None, None, None, None)


def fill_sqlite(path: Path, history: int) -> None:
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(ENTRY, past_runs(history))
        conn.execute("UPDATE accounts SET spent = spent + ? WHERE account = 'acme'",
                     (history * CHARGE,))
        conn.execute("COMMIT")


def fill_postgres(dsn: str, schema: str, history: int) -> None:
    import psycopg

    with psycopg.connect(dsn, options=f"-c search_path={schema}") as conn:
        with conn.cursor() as cursor:
            cursor.executemany(percent_s(ENTRY), list(past_runs(history)))
            cursor.execute("UPDATE accounts SET spent = spent + %s WHERE account = 'acme'",
                           (history * CHARGE,))
        conn.commit()


async def prepare(ledger: Any, fill: Any, history: int) -> le.CreditAccounts:
    """``acme`` with ``history`` past runs and `IN_FLIGHT` runs holding a reservation."""
    accounts = le.CreditAccounts(ledger)
    await accounts.grant("acme", 10**15)
    await ledger.flush()
    await anyio.to_thread.run_sync(fill, history)
    for n in range(IN_FLIGHT):
        await reserve(accounts, f"flying-{n}")
    return accounts


async def reserve(accounts: le.CreditAccounts, run: str) -> Any:
    return await accounts.reserve("acme", run, HOLD, expires_at=accounts.expiry(600),
                                  credits_per_usd=RATE, credit_quantum=1)


async def balance(accounts: le.CreditAccounts) -> float:
    """Seconds for one `CreditAccounts.balance`."""
    began = time.perf_counter()
    await accounts.balance("acme")
    return time.perf_counter() - began


async def admission(accounts: le.CreditAccounts) -> float:
    """Seconds for one run's transactions on the account: reserve, then settle."""
    began = time.perf_counter()
    reservation = await reserve(accounts, uuid.uuid4().hex)
    await accounts.settle(reservation, CHARGE)
    return time.perf_counter() - began


async def one_round(ledgers: dict[int, le.CreditAccounts], order: list[int],
                    calls: int) -> dict[int, tuple[float, float]]:
    """Mean seconds per ``balance`` and per admission on each ledger, their calls
    interleaved (one on each ledger in ``order``, then the next)."""
    spent = {size: [0.0, 0.0] for size in order}
    for _ in range(calls):
        for size in order:
            spent[size][0] += await balance(ledgers[size])
        for size in order:
            spent[size][1] += await admission(ledgers[size])
    return {size: (b / calls, a / calls) for size, (b, a) in spent.items()}


async def measure(store: str, ledgers: dict[int, le.CreditAccounts], rounds: int,
                  calls: int) -> None:
    sizes = sorted(ledgers)
    seen: dict[int, list[tuple[float, float]]] = {size: [] for size in sizes}
    await one_round(ledgers, sizes, 3)  # warm: statements prepared, pages cached
    for n in range(rounds):
        order = sizes[n % len(sizes):] + sizes[:n % len(sizes)]
        for size, means in (await one_round(ledgers, order, calls)).items():
            seen[size].append(means)
    base_balance = base_admission = 0.0
    for size in sizes:
        took = statistics.median(b for b, _ in seen[size])
        admitted = statistics.median(a for _, a in seen[size])
        if size == sizes[0]:
            base_balance, base_admission = took, admitted
        print(f"{store:<16} {size:>10,} {took * 1e3:>11.2f} ms {took / base_balance:>6.2f}x"
              f" {admitted * 1e3:>13.2f} ms {admitted / base_admission:>6.2f}x")


async def on_sqlite(args: argparse.Namespace, directory: Path) -> None:
    ledgers: dict[int, le.CreditAccounts] = {}
    async with contextlib.AsyncExitStack() as stack:
        for size in args.histories:
            path = directory / f"history-{size}.db"
            ledger = await stack.enter_async_context(SQLiteLedger(path))
            ledgers[size] = await prepare(ledger, lambda h, p=path: fill_sqlite(p, h), size)
        await measure("SQLiteLedger", ledgers, args.rounds, args.calls)


async def on_postgres(args: argparse.Namespace, dsn: str) -> None:
    ledgers: dict[int, le.CreditAccounts] = {}
    async with contextlib.AsyncExitStack() as stack:
        for size in args.histories:
            schema = f"bench_{uuid.uuid4().hex[:8]}"
            ledger = await stack.enter_async_context(PostgresLedger(dsn, schema=schema))
            ledgers[size] = await prepare(
                ledger, lambda h, s=schema: fill_postgres(dsn, s, h), size)
        await measure("PostgresLedger", ledgers, args.rounds, args.calls)


@contextlib.contextmanager
def throwaway_server() -> Iterator[str]:
    """A PostgreSQL server of the system's binaries, as the tests start one."""
    sys.path.insert(0, str(ROOT))
    from tests.postgres_support import start_server

    server = start_server()
    try:
        yield server.dsn()
    finally:
        server.stop()


async def main(args: argparse.Namespace) -> None:
    print(f"loopengine {le.__version__} ({Path(le.__file__).parent}) / Python "
          f"{platform.python_version()} on {platform.machine()}; {IN_FLIGHT} runs in flight; "
          f"medians of {args.rounds} interleaved rounds of {args.calls} calls")
    print(f"command: python bench/account_history.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"\n{'store':<16} {'past runs':>10} {'balance()':>14} {'x':>7} "
          f"{'reserve+settle':>16} {'x':>7}")
    with tempfile.TemporaryDirectory() as tmp:
        await on_sqlite(args, Path(tmp))
    if args.no_postgres:
        return
    if args.postgres:
        await on_postgres(args, args.postgres)
        return
    with throwaway_server() as dsn:
        await on_postgres(args, dsn)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--histories", type=lambda s: [int(n) for n in s.split(",")],
                        default=[100, 10_000, 50_000],
                        help="past settled runs of the account, one ledger each")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=40, help="calls of each kind a round")
    parser.add_argument("--postgres", default=None,
                        help="a PostgreSQL DSN (default: start a throwaway server)")
    parser.add_argument("--no-postgres", action="store_true", help="SQLite only")
    anyio.run(main, parser.parse_args())
