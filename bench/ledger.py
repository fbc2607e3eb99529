"""Benchmark: SQLiteLedger (and PostgresLedger) throughput, next to the same machine's
plain executemany (and COPY).

Run with::

    python bench/ledger.py                 # defaults: 1,000 runs x 20 attempts
    python bench/ledger.py --runs 1000 --attempts 20 --repeat 5
    python bench/ledger.py --postgres "host=/tmp/pg user=postgres dbname=postgres"

Every figure is measured on a fresh file in one directory (``--dir``, a
temporary one by default) with WAL and ``synchronous=FULL``:

* ceiling: one ``executemany`` inserting as many complete attempt rows as the
  concurrent case writes, in one transaction, into a table shaped like
  ``attempts``: what SQLite alone does on this disk, with nothing to wait for;
* sequential: one invocation making its attempts one after another, each
  dispatch awaited (durable) before the settle: the path of one run, where a
  settle shares the commit of the next dispatch;
* concurrent: ``--runs`` invocations at once, each doing the same: the writer
  groups everyone's writes into shared commits;
* engine: the same concurrency through `Engine.run` on `ScriptedProvider`
  (every turn an attempt, the last one answering), once on SQLiteLedger and
  once on MemoryLedger, to show what the file costs inside whole runs.

With ``--postgres DSN`` the same cases run on `PostgresLedger` (each on a
fresh schema of that server, ``synchronous_commit`` on), next to the server's
own ceiling: one ``COPY`` of as many complete attempt rows in one transaction.
Its CPU column is this process's (the server's backends are not counted).

An attempt is one dispatch plus its settle; each invocation also has a start
and an end. "commits/attempt" is the ledger's own commit count divided by the
attempts; "CPU/attempt" is the CPU time of the process (every thread, the
ledger's writer thread and its fsyncs' system time included) divided by the
attempts, a median. Best and median of ``--repeat`` runs; the machine's load matters
(the ledger's writer shares the cores with the event loop), so compare the
figures of one run with each other.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shlex
import sqlite3
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio

import loopengine as le
from loopengine.persistence import (
    AttemptDispatch,
    AttemptSettle,
    InvocationEnd,
    InvocationStart,
    MemoryLedger,
    PostgresLedger,
    SQLiteLedger,
)
from loopengine.persistence._schema import MIGRATIONS
from loopengine.providers import Reply, ScriptedProvider

TARGET = 20_000
"""Attempts per second the concurrent case must reach."""
POSTGRES_AIM = 8_000
"""Settled attempts per second PostgresLedger aims at under 1,000 concurrent runs."""

NOW = datetime(2026, 1, 1, tzinfo=UTC)
USAGE = le.Usage(input_tokens=1200, output_tokens=80, cache_read_tokens=4000)


def fresh(directory: Path, name: str) -> Path:
    path = directory / name
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    return path


def ceiling(directory: Path, rows: int) -> float:
    """Rows per second of one plain executemany of whole attempt rows."""
    path = fresh(directory, "ceiling.db")
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = FULL")
    create = next(s for s in MIGRATIONS[0].statements if "TABLE attempts" in s)
    conn.execute(create.replace(" REFERENCES invocations (id)", ""))
    values = [(f"{n % 1000:036d}", n // 1000 + 1, 1, 1, "turn", "anthropic:claude-sonnet-4-5",
               "2026-01-01T00:00:00.000000+00:00", 900, "ok", None, None, 200, None, 1200, 80,
               4000, 0, 0, 0, 1_560_000, 1, "bench", f"msg_{n:020d}", f"req_{n:020d}",
               "end_turn", 1024, 60_000, 0) for n in range(rows)]
    sql = f"INSERT INTO attempts VALUES ({', '.join('?' * len(values[0]))})"
    started = time.perf_counter()
    conn.execute("BEGIN IMMEDIATE")
    conn.executemany(sql, values)
    conn.execute("COMMIT")
    elapsed = time.perf_counter() - started
    conn.close()
    return rows / elapsed


def postgres_ceiling(dsn: str, rows: int) -> float:
    """Rows per second of one plain COPY of whole attempt rows, committed."""
    import psycopg

    from loopengine.persistence._postgres_schema import MIGRATIONS as PG_MIGRATIONS

    create = next(s for s in PG_MIGRATIONS[0].statements if "TABLE attempts" in s)
    values = [(f"{n % 1000:036d}", n // 1000 + 1, 1, 1, "turn", "anthropic:claude-sonnet-4-5",
               NOW, 900, "ok", None, None, 200, None, 1200, 80, 4000, 0, 0, 0, 1_560_000, 1,
               "bench", f"msg_{n:020d}", f"req_{n:020d}", "end_turn", 1024, 60_000, 0)
              for n in range(rows)]
    schema = f"bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn) as conn:
        conn.execute("SET synchronous_commit = on")
        conn.execute(f"CREATE SCHEMA {schema}")
        conn.execute(f"SET search_path = {schema}")
        conn.execute(create.replace(" REFERENCES invocations (id)", ""))
        conn.commit()
        started = time.perf_counter()
        with conn.cursor().copy("COPY attempts FROM STDIN") as copy:
            for row in values:
                copy.write_row(row)
        conn.commit()
        elapsed = time.perf_counter() - started
        conn.execute(f"DROP SCHEMA {schema} CASCADE")
        conn.commit()
    return rows / elapsed


async def invocation(ledger: Any, key: str, attempts: int) -> None:
    """One invocation's writes, in the engine's order."""
    await ledger.start_invocation(InvocationStart(
        id=key, operation="bench", operation_version="1", provider="anthropic",
        model="claude-sonnet-4-5", tenant="bench", user_id=None, feature=None,
        correlation_id=None, started_at=NOW))
    for ordinal in range(1, attempts + 1):
        await ledger.dispatch_attempt(AttemptDispatch(
            invocation_id=key, ordinal=ordinal, turn=ordinal, attempt=1, phase="turn",
            served_by="anthropic:claude-sonnet-4-5", started_at=NOW, max_tokens=1024,
            timeout_ms=60_000, wait_ms=0))
        await ledger.settle_attempt(AttemptSettle(
            invocation_id=key, ordinal=ordinal, outcome="ok", latency_ms=900, usage=USAGE,
            cost_nanousd=1_560_000, charged=True, price_ref="bench",
            response_id=f"msg_{ordinal}", stop_reason="end_turn"))
    await ledger.end_invocation(InvocationEnd(id=key, ended_at=NOW, outcome="completed",
                                              turns=attempts, tool_calls=0, credits=2))


def open_ledger(where: Path | str | None) -> Any:
    """The ledger a case runs on, as an async context manager: SQLite at a path,
    PostgreSQL (a fresh schema) for a DSN, MemoryLedger for None."""
    if isinstance(where, Path):
        return SQLiteLedger(where, max_retained_attempts=1_000_000)
    if isinstance(where, str):
        return PostgresLedger(where, schema=f"bench_{uuid.uuid4().hex[:8]}",
                              max_retained_attempts=1_000_000)
    return contextlib.nullcontext(MemoryLedger(max_retained_attempts=1_000_000))


async def timed(where: Path | str | None, runs: int,
                body: Callable[[Any, int], Awaitable[None]]) -> tuple[float, int, float]:
    """Seconds for ``runs`` concurrent bodies (started together), the commits made
    (`open_ledger` says on which ledger) and the process's CPU seconds."""
    async with open_ledger(where) as ledger:
        if isinstance(ledger, PostgresLedger):
            await ledger.open()  # connecting and migrating are not timed
        gate = anyio.Event()

        async def one(n: int) -> None:
            await gate.wait()
            await body(ledger, n)

        async with anyio.create_task_group() as group:
            for n in range(runs):
                group.start_soon(one, n)
            await anyio.sleep(0.05)  # every task parked at the gate: spawning is not timed
            started, cpu = time.perf_counter(), time.process_time()
            gate.set()
        elapsed = time.perf_counter() - started
        cpu = time.process_time() - cpu
        return elapsed, getattr(ledger, "commits", 0), cpu


PRICES = le.PriceBook([le.ModelPrice(provider="anthropic", model="claude-sonnet-4-5",
                                     input_per_mtok=Decimal(3), output_per_mtok=Decimal(15))])
OPERATION = le.Operation(name="bench", provider="anthropic", model="claude-sonnet-4-5",
                         max_output_tokens=1024, limits=le.Limits(max_turns=100))


async def engine_run(ledger: Any, n: int, attempts: int) -> None:
    """One Engine.run whose turns are all attempts: text the judge rejects, then accepts."""
    replies = [Reply.text("draft", usage=USAGE)] * (attempts - 1) + [Reply.text("final",
                                                                              usage=USAGE)]
    engine = le.Engine(ScriptedProvider(replies), ledger=ledger, prices=PRICES,
                       rng=random.Random(n))
    result = await engine.run(OPERATION, "go", accept=lambda answer: answer == "final",
                              limits={"max_tool_calls": attempts})
    assert result.attempts.count == attempts, result.detail


def report(label: str, attempts: int, samples: list[tuple[float, int, float]],
           ) -> dict[str, float]:
    rates = [attempts / seconds for seconds, _, _ in samples]
    commits = statistics.median(c for _, c, _ in samples) / attempts
    cpu = statistics.median(c for _, _, c in samples) / attempts
    print(f"{label:<34} {max(rates):>10,.0f} {statistics.median(rates):>10,.0f} "
          f"{commits:>16.3f} {cpu * 1e6:>9.0f}µs")
    return {"best": max(rates), "median": statistics.median(rates)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=1000, help="concurrent invocations")
    parser.add_argument("--attempts", type=int, default=20, help="attempts per invocation")
    parser.add_argument("--sequential", type=int, default=500, help="attempts of the one run")
    parser.add_argument("--repeat", type=int, default=3, help="measurements of each case")
    parser.add_argument("--dir", type=Path, default=None, help="where to put the files")
    parser.add_argument("--postgres", metavar="DSN", default=None,
                        help="also run the cases on PostgresLedger on this server")
    args = parser.parse_args()
    total = args.runs * args.attempts
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        directory = Path(tmp)
        print(f"$ python {' '.join(shlex.quote(a) for a in sys.argv)}")
        print(f"SQLite {sqlite3.sqlite_version}, Python {sys.version.split()[0]}, "
              f"{os.cpu_count()} CPUs, files in {directory}")
        print(f"{'case':<34} {'best/s':>10} {'median/s':>10} {'commits/attempt':>16} "
              f"{'CPU/attempt':>11}")
        rows = [ceiling(directory, total) for _ in range(args.repeat)]
        print(f"{'ceiling: plain executemany rows':<34} {max(rows):>10,.0f} "
              f"{statistics.median(rows):>10,.0f} {'(1 commit)':>16}")

        def sequential(ledger: Any, n: int) -> Awaitable[None]:
            return invocation(ledger, f"seq-{n}", args.sequential)

        def concurrent(ledger: Any, n: int) -> Awaitable[None]:
            return invocation(ledger, f"inv-{n}", args.attempts)

        def engine(ledger: Any, n: int) -> Awaitable[None]:
            return engine_run(ledger, n, args.attempts)

        seq = [anyio.run(timed, fresh(directory, "sequential.db"), 1, sequential)
               for _ in range(args.repeat)]
        report(f"sequential: 1 run x {args.sequential}", args.sequential, seq)
        conc = [anyio.run(timed, fresh(directory, "concurrent.db"), args.runs, concurrent)
                for _ in range(args.repeat)]
        result = report(f"concurrent: {args.runs} runs x {args.attempts}", total, conc)
        eng = [anyio.run(timed, fresh(directory, "engine.db"), args.runs, engine)
               for _ in range(args.repeat)]
        report(f"engine: {args.runs} Engine.run x {args.attempts}", total, eng)
        mem = [anyio.run(timed, None, args.runs, engine) for _ in range(args.repeat)]
        report("  the same on MemoryLedger", total, mem)
        if args.postgres is not None:
            dsn = args.postgres
            copied = [postgres_ceiling(dsn, total) for _ in range(args.repeat)]
            print(f"{'PostgreSQL ceiling: plain COPY rows':<34} {max(copied):>10,.0f} "
                  f"{statistics.median(copied):>10,.0f} {'(1 commit)':>16}")
            seq = [anyio.run(timed, dsn, 1, sequential) for _ in range(args.repeat)]
            report(f"PostgreSQL sequential: 1 x {args.sequential}", args.sequential, seq)
            conc = [anyio.run(timed, dsn, args.runs, concurrent) for _ in range(args.repeat)]
            pg = report(f"PostgreSQL concurrent: {args.runs} x {args.attempts}", total, conc)
            eng = [anyio.run(timed, dsn, args.runs, engine) for _ in range(args.repeat)]
            report(f"PostgreSQL engine: {args.runs} x {args.attempts}", total, eng)
            verdict = "meets" if pg["median"] >= POSTGRES_AIM else "misses"
            print(f"PostgreSQL concurrent: best {pg['best']:,.0f}, median "
                  f"{pg['median']:,.0f} attempts/s: the median {verdict} the aim of "
                  f"{POSTGRES_AIM:,} and is {pg['median'] / statistics.median(copied):.1%} "
                  "of the median COPY ceiling.")
    verdict = "meets" if result["best"] >= TARGET else "misses"
    print(f"The concurrent case {verdict} the target of {TARGET:,} attempts/s "
          f"(best {result['best']:,.0f}, {result['best'] / statistics.median(rows):.0%} of "
          "the executemany ceiling).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
