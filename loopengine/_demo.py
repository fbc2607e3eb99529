"""`loopengine demo`: one teammate conversation, end to end, with its ledger.

Offline (the default), a loopback `FakeAnthropicServer` plays the model
through the real ``anthropic`` SDK: its first request is overloaded (and
retried), then it asks for two tools in two turns, offers an answer the judge
rejects, and repairs it. With ``live=True`` the same conversation goes to the
real Messages API. Either way every attempt lands in a SQLite ledger, which
is read back to print the attempts.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

import loopengine as le
from loopengine._usage import Usage
from loopengine.persistence import SQLiteLedger, _audit

__all__ = ["DemoUnavailable", "demo_script", "run_demo"]

HELP_LINK = "https://help.example.com/reset-password"

OPERATION = le.Operation(
    name="teammate.answer", provider="anthropic", model="claude-sonnet-4-5",
    max_output_tokens=1024,
    limits=le.Limits(max_turns=6, max_tool_calls=8, total_time=120.0, attempt_timeout=60.0),
    retry=le.RetryPolicy(max_attempts=3, initial_wait=0.2, max_wait=1.0),
)
SYSTEM = ("You are the product's support teammate. Use the tools to look things up, "
          "answer in two or three sentences, and always link the help article you used.")
QUESTION = "How do I reset my password? My account is sam@example.com."


class DemoUnavailable(Exception):
    """The demo cannot run as asked (``--live`` without ``ANTHROPIC_API_KEY``)."""


@le.tool
async def search_docs(query: str) -> str:
    """Search the product documentation; returns matching articles with their links.

    Args:
        query: What to look for.
    """
    return (f"Article 'Reset your password' ({HELP_LINK}): open Settings > Security, choose "
            "'Reset password' and follow the email. Links expire after 30 minutes.")


@le.tool
async def lookup_account(email: str) -> str:
    """Look up an account's sign-in settings.

    Args:
        email: The account's email address.
    """
    return f"{email}: active, single sign-on off, two-factor authentication on."


def judge(answer: str) -> le.Accept | le.Reject:
    """The consuming feature's check: the answer must link the help article."""
    if HELP_LINK in answer:
        return le.Accept()
    return le.Reject(f"Link the help article ({HELP_LINK}) so the user can follow the steps.")


def demo_script() -> list[Any]:
    """What the fake server answers, request by request."""
    from loopengine.testing import ErrorReply, Reply

    return [
        ErrorReply.overloaded(),
        Reply.tool_calls(("search_docs", {"query": "reset password"}),
                         text="Let me check the documentation.",
                         usage=Usage(input_tokens=412, output_tokens=38, cache_write_tokens=1210)),
        Reply.tool_calls(("lookup_account", {"email": "sam@example.com"}),
                         usage=Usage(input_tokens=530, output_tokens=41, cache_read_tokens=1210)),
        Reply.text("Open Settings > Security and choose 'Reset password'; you will get an "
                   "email with a link that is valid for 30 minutes.",
                   usage=Usage(input_tokens=611, output_tokens=52, cache_read_tokens=1210)),
        Reply.text("Open Settings > Security, choose 'Reset password' and follow the email "
                   "within 30 minutes; your two-factor code will be asked for again. Steps: "
                   f"{HELP_LINK}",
                   usage=Usage(input_tokens=702, output_tokens=61, cache_read_tokens=1210)),
    ]


def run_demo(
    db: Path, *, live: bool = False, echo: Callable[[str], object] = print
) -> le.RunResult:
    """Run the demo conversation, record it in ``db`` and print what happened.

    Raises:
        DemoUnavailable: ``live`` without ``ANTHROPIC_API_KEY``.
        LedgerError: ``db`` cannot hold a ledger.
    """
    if live and not os.environ.get("ANTHROPIC_API_KEY"):
        raise DemoUnavailable("--live talks to the real Anthropic API: set ANTHROPIC_API_KEY")
    result: le.RunResult = anyio.run(_converse, db, live)
    # Read the attempts back from the file: what is printed is what was recorded.
    conn = _audit.open_ledger(db)
    try:
        invocation, attempts = _audit.show(conn, result.invocation_id)
    finally:
        conn.close()
    from loopengine.cli import attempts_table

    where = "the real Anthropic API" if live else "a loopback fake of the Messages API"
    echo(f"Ran {OPERATION.name} against {where}, through the anthropic SDK.")
    echo(f"Question: {QUESTION}")
    echo(f"Outcome:  {result.outcome.value} after {result.turns} turns, {result.tool_calls} "
         f"tool calls and {result.attempts.count} attempts")
    echo(f"Answer:   {result.answer}" if result.completed else f"Why:      {result.detail}")
    echo(f"Charged:  USD {result.cost_usd} ({result.credits} credits); the provider may bill "
         f"USD {result.provider_cost_usd}")
    echo("")
    echo(f"Attempts recorded in {db}:")
    echo(attempts_table(attempts))
    echo("")
    echo(f"Invocation {invocation['id']} ({invocation['outcome']}). Look closer with:")
    echo(f"  loopengine audit show --db {db} {invocation['id']}")
    echo(f"  loopengine audit reconcile --db {db}")
    return result


async def _converse(db: Path, live: bool) -> le.RunResult:
    from loopengine.providers import AnthropicProvider

    with SQLiteLedger(db) as ledger:
        if live:
            async with AnthropicProvider(api_key=os.environ["ANTHROPIC_API_KEY"]) as provider:
                return await _run(provider, ledger)
        import httpx2

        from loopengine.testing import FakeAnthropicServer

        with FakeAnthropicServer(demo_script()) as server:
            # Plain HTTP on loopback: a client that loads no certificates.
            client = httpx2.AsyncClient(verify=False)
            try:
                async with AnthropicProvider(api_key="demo-key", base_url=server.url,
                                             http_client=client) as provider:
                    return await _run(provider, ledger)
            finally:
                await client.aclose()


async def _run(provider: Any, ledger: SQLiteLedger) -> le.RunResult:
    engine = le.Engine(provider, ledger=ledger)
    return await engine.run(
        OPERATION, QUESTION, system=SYSTEM, tools=[search_docs, lookup_account], accept=judge,
        attribution=le.Attribution(tenant="demo", feature="help-center", user_id="sam"),
    )
