"""A child process for the credit-account tests (run as a script, not collected).

``python accounts_child.py race DB N``: open the ledger and its accounts,
print ``READY``, wait for ``DB.go``, make N concurrent runs on account
``acme`` (hold 120, each charged 120) and print one line per run: its outcome.

``python accounts_child.py race-pg DSN N``: the same race on a PostgresLedger
(the DSN's database already holds the ledger and the grant).

``python accounts_child.py crash DB``: a run on account ``acme`` whose tool
handler SIGKILLs the process after the first reply (charged 120).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from decimal import Decimal
from typing import Any

import anyio

import loopengine as le
from loopengine.persistence import SQLiteLedger
from loopengine.providers import Reply, ScriptedProvider

PRICES = le.PriceBook(
    [le.ModelPrice(provider="anthropic", model="claude-sonnet-4-5",
                   input_per_mtok=Decimal(1), output_per_mtok=Decimal(1))],
    credits_per_usd=Decimal(1_000_000),
)
OPERATION = le.Operation(name="child.op", provider="anthropic", model="claude-sonnet-4-5",
                         max_output_tokens=256,
                         limits=le.Limits(credit_hold=120, total_time=60.0))
ACME = le.Attribution(tenant="acme")


@le.tool
def die() -> str:
    """Kill this process."""
    os.kill(os.getpid(), signal.SIGKILL)
    return "unreachable"


async def race(ledger: Any, count: int) -> None:
    async with ledger:
        accounts = le.CreditAccounts(ledger)
        outcomes: list[str] = []

        async def one() -> None:
            engine = le.Engine(ScriptedProvider([Reply.text("answer")]), ledger=ledger,
                               prices=PRICES, accounts=accounts)
            # The published 60 s: admissions queue on the account under the race.
            result = await engine.run(OPERATION, "go", attribution=ACME)
            outcomes.append(result.outcome.value)

        async with anyio.create_task_group() as group:
            for _ in range(count):
                group.start_soon(one)
        for outcome in outcomes:
            print(outcome, flush=True)


async def crash(path: str) -> None:
    with SQLiteLedger(path) as ledger:
        accounts = le.CreditAccounts(ledger, expiry_grace=0)
        engine = le.Engine(ScriptedProvider([Reply.tool_calls(("die", {})), Reply.text("no")]),
                           ledger=ledger, prices=PRICES, accounts=accounts)
        # The published 60 s: its reservation expires a minute after the start, long
        # before the parent's clock an hour on, and long after a busy machine has
        # come to the tool (a deadline of seconds could end the run before it).
        await engine.run(OPERATION, "go", tools=[die], attribution=ACME)


if __name__ == "__main__":
    mode, db = sys.argv[1], sys.argv[2]
    if mode == "crash":
        anyio.run(crash, db)
    elif mode == "race-pg":
        from loopengine.persistence import PostgresLedger

        print("READY", flush=True)
        while not os.path.exists(sys.argv[4]):
            time.sleep(0.005)
        anyio.run(race, PostgresLedger(db), int(sys.argv[3]))
    else:
        opened = SQLiteLedger(db)
        print("READY", flush=True)
        while not os.path.exists(db + ".go"):
            time.sleep(0.005)
        anyio.run(race, opened, int(sys.argv[3]))
