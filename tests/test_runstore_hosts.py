"""Runs shared by several hosts on one PostgreSQL run store and ledger
(docs/pause-and-resume.md, "Crash recovery: the run store"): the run store's
transactions that one host's writer queues together never deadlock with
another host's."""

from __future__ import annotations

import random
import threading
from datetime import timedelta
from typing import Any

import anyio

import loopengine as le
from loopengine._runstore import new_owner
from loopengine.persistence import PostgresLedger
from loopengine.providers import Reply, ScriptedProvider
from loopengine.testing import FakeClock

from .conftest import PRICES, operation
from .ledger_support import queued
from .pause_scenarios import Sender, send
from .postgres_support import PostgresServer, waits_for_a_lock


async def test_one_transactions_runs_are_locked_in_one_order(
    postgres_server: PostgresServer, clock: FakeClock,
) -> None:
    """The run store's transactions queued together share one transaction, and
    each holds its run's row lock until it commits: two resumes queued as the
    later run id then the earlier, while another host holds the earlier run's
    row and then asks for the later one's (it resumes or takes over the same
    two runs the other way round), once locked the later run's row, waited for
    the earlier's, and the server broke the deadlock by failing both resumes'
    claims with a LedgerError. The calls of a transaction lock their runs in
    the runs' order, as every host's do: the earlier first, so the other host
    takes the later, commits, and both claims go through."""
    import psycopg

    dsn = postgres_server.create_database()
    dbname = dsn.rsplit("dbname=", 1)[1]
    sender = Sender()
    async with PostgresLedger(dsn) as ledger:
        store = le.RunStore(ledger)
        provider = ScriptedProvider([Reply.tool_calls(send("a")), Reply.tool_calls(send("b"))],
                                    clock=clock)
        engine = le.Engine(provider, ledger=ledger, clock=clock, prices=PRICES,
                           rng=random.Random(5), run_store=store)
        ids = sorted([(await engine.run(operation(), "go", tools=[sender.tool])).invocation_id
                      for _ in range(2)])
        versions = {}
        for run_id in ids:
            stored = await store.load(run_id)
            assert stored is not None and stored.paused_at is not None
            versions[run_id] = stored.version
        first, last = ids
        with psycopg.connect(dsn) as other:  # its locks held until it commits
            # The ledger's session is the one that looks for a deadlock (at 1 s).
            other.execute("SET deadlock_timeout = '10min'")
            other.execute("SELECT 1 FROM run_states WHERE invocation_id = %s FOR UPDATE",
                          (first,))
            held, gate = threading.Event(), threading.Event()

            def hold(conn: Any) -> None:
                held.set()
                gate.wait()

            claimed: dict[str, BaseException | None] = {}

            async def claim(run_id: str) -> None:
                try:
                    await store.claim(run_id, new_owner(), version=versions[run_id],
                                      expires_at=clock.wall() + timedelta(hours=1),
                                      now=clock.wall(), force=False)
                except le.LoopEngineError as error:
                    claimed[run_id] = error
                else:
                    claimed[run_id] = None

            async with anyio.create_task_group() as group:
                # The writer is held until both claims are queued behind it.
                group.start_soon(ledger._transact_qmark, hold, "held")
                await anyio.to_thread.run_sync(held.wait)
                for count, run_id in enumerate((last, first), start=1):
                    group.start_soon(claim, run_id)
                    await anyio.to_thread.run_sync(queued, ledger, count)
                gate.set()
                await anyio.to_thread.run_sync(waits_for_a_lock, postgres_server, dbname)
                await anyio.to_thread.run_sync(
                    other.execute, "SELECT 1 FROM run_states WHERE invocation_id = %s "
                    "FOR UPDATE", (last,))
                other.commit()
        assert claimed == {first: None, last: None}
        for run_id in ids:
            stored = await store.load(run_id)
            assert stored is not None and stored.paused_at is None
            assert stored.version == versions[run_id] + 1
