"""A child process for the ledger's process tests (run as a script, not collected).

``python ledger_child.py crash DB``: start a run whose request never returns,
print ``ON THE WIRE`` and the ledger's writer process id once it is sent, and
wait to be killed.

``python ledger_child.py runs DB N TAG``: open a SQLiteLedger, print ``READY``,
wait until the file ``DB.go`` exists (so that every child writes at once),
make N concurrent runs on it (each: an overload that is retried, a tool turn,
an answer) and print ``DONE`` with the commit count.
"""

from __future__ import annotations

import os
import random
import sys
import time
from decimal import Decimal

import anyio

import loopengine as le
from loopengine.persistence import SQLiteLedger
from loopengine.providers import (
    FaultKind,
    Provider,
    ProviderFault,
    ProviderRequest,
    ProviderResponse,
    Reply,
    ScriptedProvider,
    TextCallback,
)

PRICES = le.PriceBook(
    [le.ModelPrice(provider="anthropic", model="claude-sonnet-4-5",
                   input_per_mtok=Decimal(1), output_per_mtok=Decimal(1))],
    credits_per_usd=Decimal(1_000_000),
)
OPERATION = le.Operation(name="child.op", provider="anthropic", model="claude-sonnet-4-5",
                         max_output_tokens=256,
                         retry=le.RetryPolicy(initial_wait=0.001, max_wait=0.002))


@le.tool
async def lookup(key: str) -> str:
    """Look a key up."""
    return key.upper()


class OnTheWire(Provider):
    """A provider whose request never comes back."""

    name = "anthropic"

    def __init__(self, ledger: SQLiteLedger) -> None:
        self.ledger = ledger

    async def send(self, request: ProviderRequest, *,
                   on_text: TextCallback | None = None) -> ProviderResponse:
        print("ON THE WIRE", flush=True)
        await anyio.sleep_forever()
        raise AssertionError("unreachable")


async def crash(path: str) -> None:
    with SQLiteLedger(path) as ledger:
        engine = le.Engine(OnTheWire(ledger), ledger=ledger, prices=PRICES)
        await engine.run(OPERATION, "go", attribution=le.Attribution(tenant="crash"))


async def runs(ledger: SQLiteLedger, count: int, tag: str) -> None:
    with ledger:

        async def one(n: int) -> None:
            provider = ScriptedProvider([
                ProviderFault(FaultKind.OVERLOADED, "busy", http_status=529),
                Reply.tool_calls(("lookup", {"key": f"{tag}-{n}"})),
                Reply.text("answer"),
            ])
            engine = le.Engine(provider, ledger=ledger, prices=PRICES, rng=random.Random(n))
            result = await engine.run(OPERATION, "go", tools=[lookup],
                                      attribution=le.Attribution(tenant=tag))
            assert result.outcome is le.Outcome.COMPLETED, result.detail

        async with anyio.create_task_group() as group:
            for n in range(count):
                group.start_soon(one, n)
        print("DONE", ledger.commits, flush=True)


if __name__ == "__main__":
    mode, db = sys.argv[1], sys.argv[2]
    if mode == "crash":
        anyio.run(crash, db)
    else:
        opened = SQLiteLedger(db)
        print("READY", flush=True)
        while not os.path.exists(db + ".go"):
            time.sleep(0.005)
        anyio.run(runs, opened, int(sys.argv[3]), sys.argv[4])
