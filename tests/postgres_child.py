"""A child process for the PostgreSQL process tests (run as a script, not collected).

``python postgres_child.py DSN SCHEMA N TAG GO``: open a PostgresLedger on
``SCHEMA``, print ``READY``, wait until the file ``GO`` exists (so that every
child writes at once), make N concurrent runs on it through the ``anthropic``
SDK against a `FakeAnthropicServer` of its own (each run: an overload that is
retried, a tool turn, an answer) and print ``DONE`` with the commit count and
the input and output tokens the server put on the wire.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
from typing import Any

import anyio

import loopengine as le
from loopengine.persistence import PostgresLedger
from loopengine.providers import AnthropicProvider, Reply
from loopengine.testing import ErrorReply, FakeAnthropicServer, RecordedRequest

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


class Replies:
    """Each run's replies, whatever order the runs' requests arrive in: run ``n``
    (its prompt says ``go n``) is overloaded once, then asked for a tool, then
    answered."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._overloaded: set[int] = set()

    def __call__(self, request: RecordedRequest) -> Any:
        messages = request.messages
        content = messages[0]["content"]
        text = content if isinstance(content, str) else content[0]["text"]
        n = int(text.split()[-1])
        if len(messages) > 1:
            return Reply.text("answer", usage=le.Usage(50, 10 + n))
        with self._lock:
            first = n not in self._overloaded
            self._overloaded.add(n)
        if first:
            return ErrorReply.overloaded()
        return Reply.tool_calls(("lookup", {"key": f"k{n}"}), usage=le.Usage(100 + n, 20))


async def runs(ledger: PostgresLedger, count: int, tag: str) -> None:
    replies = Replies()
    with FakeAnthropicServer([replies] * (3 * count)) as server:
        provider = AnthropicProvider(api_key="k", base_url=server.url)
        async with ledger:
            engine = le.Engine(provider, ledger=ledger, prices=PRICES, rng=random.Random(tag))

            async def one(n: int) -> None:
                result = await engine.run(OPERATION, f"go {n}", tools=[lookup],
                                          attribution=le.Attribution(tenant=tag))
                assert result.outcome is le.Outcome.COMPLETED, result.detail
                assert result.attempts.count == 3, result.detail

            async with anyio.create_task_group() as group:
                for n in range(count):
                    group.start_soon(one, n)
            await provider.aclose()
            served = server.usage_served
            print("DONE", ledger.commits, served.input_tokens, served.output_tokens, flush=True)


if __name__ == "__main__":
    dsn, schema, count, tag, go = sys.argv[1:6]
    opened = PostgresLedger(dsn, schema=schema)
    anyio.run(opened.open)  # every child migrates (once between them), then waits
    print("READY", flush=True)
    while not os.path.exists(go):
        time.sleep(0.005)
    anyio.run(runs, opened, int(count), tag)
