"""A child process whose tool handler kills it (run as a script, not collected).

``python killed_by_its_tool.py DB URL``: run a conversation through
AnthropicProvider against the server at URL, with a SQLiteLedger on DB; the
model asks for the tool ``die``, whose handler prints ``TOOL RUNNING`` and
SIGKILLs its own process.
"""

from __future__ import annotations

import os
import signal
import sys

import anyio
import httpx2

import loopengine as le
from loopengine.persistence import SQLiteLedger
from loopengine.providers import AnthropicProvider


@le.tool
def die() -> str:
    """Kill this process."""
    print("TOOL RUNNING", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    return "unreachable"


async def main(db: str, url: str) -> None:
    operation = le.Operation(name="child.op", provider="anthropic", model="claude-sonnet-4-5",
                             max_output_tokens=256)
    with SQLiteLedger(db) as ledger:
        provider = AnthropicProvider(api_key="test-key", base_url=url,
                                     http_client=httpx2.AsyncClient(verify=False))
        engine = le.Engine(provider, ledger=ledger)
        await engine.run(operation, "go", tools=[die])


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2])
