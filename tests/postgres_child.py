"""A child process for the PostgreSQL process tests (run as a script, not collected).

``python postgres_child.py DSN SCHEMA N TAG GO``: open a PostgresLedger on
``SCHEMA``, print ``READY``, wait until the file ``GO`` exists (so that every
child writes at once), make N concurrent runs on it (each: an overload that is
retried, a tool turn, an answer) and print ``DONE`` with the commit count and
the input and output tokens its provider served.
"""

from __future__ import annotations

import os
import random
import sys
import time

import anyio

import loopengine as le
from loopengine.persistence import PostgresLedger
from loopengine.providers import FaultKind, ProviderFault, Reply, ScriptedProvider

OPERATION = le.Operation(name="child.op", provider="anthropic", model="claude-sonnet-4-5",
                         max_output_tokens=256,
                         retry=le.RetryPolicy(initial_wait=0.001, max_wait=0.002))
PRICES = le.PriceBook([le.ModelPrice(provider="anthropic", model="claude-sonnet-4-5",
                                     input_per_mtok=1, output_per_mtok=1)],
                      credits_per_usd=1_000_000)


@le.tool
async def lookup(key: str) -> str:
    """Look a key up."""
    return key.upper()


async def runs(ledger: PostgresLedger, count: int, tag: str) -> None:
    async with ledger:
        served = [0, 0]

        async def one(n: int) -> None:
            provider = ScriptedProvider([
                ProviderFault(FaultKind.OVERLOADED, "busy", http_status=529),
                Reply.tool_calls(("lookup", {"key": f"{tag}-{n}"}),
                                 usage=le.Usage(100 + n, 20)),
                Reply.text("answer", usage=le.Usage(50, 10 + n)),
            ])
            engine = le.Engine(provider, ledger=ledger, prices=PRICES, rng=random.Random(n))
            result = await engine.run(OPERATION, "go", tools=[lookup],
                                      attribution=le.Attribution(tenant=tag))
            assert result.outcome is le.Outcome.COMPLETED, result.detail
            served[0] += 150 + n
            served[1] += 30 + n

        async with anyio.create_task_group() as group:
            for n in range(count):
                group.start_soon(one, n)
        print("DONE", ledger.commits, *served, flush=True)


if __name__ == "__main__":
    dsn, schema, count, tag, go = sys.argv[1:6]
    opened = PostgresLedger(dsn, schema=schema)
    anyio.run(opened.open)  # every child migrates (once between them), then waits
    print("READY", flush=True)
    while not os.path.exists(go):
        time.sleep(0.005)
    anyio.run(runs, opened, int(count), tag)
