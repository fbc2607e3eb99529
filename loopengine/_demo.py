"""`loopengine demo`: one teammate conversation, end to end, with its ledger.

Offline (the default), a loopback fake of the provider's API plays the model
through its real SDK: `FakeAnthropicServer` and the ``anthropic`` SDK; with
``provider="openai"`` (Chat Completions) or ``"openai-responses"`` (the
Responses API), `FakeOpenAIServer` and the ``openai`` SDK (the extra
``openai``); with ``provider="gemini"``, `FakeGeminiServer` and the
``google-genai`` SDK (the extra ``gemini``). Its first request fails with an
overload (and is retried),
then it asks for two tools in two turns, offers an answer the judge rejects,
and repairs it. With ``live=True`` the same conversation goes to the real
API. Either way every attempt lands in a SQLite ledger, which is read back
to print the attempts.

The demo prints through the callables it is given (``echo``, and
``attempts_table`` to render the attempt rows), so it depends on no command
line: ``loopengine.cli`` calls it, never the other way round.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio

import loopengine as le
from loopengine._short import key_variables
from loopengine._usage import Usage
from loopengine.persistence import SQLiteLedger, _audit
from loopengine.persistence._audit_postgres import display_name, is_postgres_url

__all__ = ["PROVIDERS", "DemoUnavailable", "demo_script", "run_demo"]

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


@dataclasses.dataclass(frozen=True, slots=True)
class _Vendor:
    """What differs between the demo's providers."""

    operation: le.Operation
    api: str
    """The API's name, without an article ("Messages API")."""
    sdk: str
    """The SDK's distribution name, as the output names it."""
    module: str
    """The module the SDK is imported as (its absence is `DemoUnavailable`)."""
    extra: str | None
    """The package extra that installs it (None: a dependency of the core)."""


PROVIDERS = {
    "anthropic": _Vendor(OPERATION, "Messages API", "anthropic", "anthropic", None),
    "openai": _Vendor(dataclasses.replace(OPERATION, provider="openai", model="gpt-4o-mini"),
                      "Chat Completions API", "openai", "openai", "openai"),
    "openai-responses": _Vendor(
        dataclasses.replace(OPERATION, provider="openai", model="gpt-4.1-mini"),
        "Responses API", "openai", "openai", "openai"),
    "gemini": _Vendor(dataclasses.replace(OPERATION, provider="gemini",
                                          model="gemini-2.5-flash"),
                      "Gemini API", "google-genai", "google.genai", "gemini"),
}
"""The providers the demo runs on, by name (the routes of a model string: live, each
reads its credential from the environment as `Engine.from_model` does)."""

AttemptsTable = Callable[[Sequence[dict[str, Any]]], str]
"""Renders attempt rows (as `loopengine.persistence._audit.show` reads them) as text."""


class DemoUnavailable(Exception):
    """The demo cannot run as asked (``--live`` without the API key, an unknown
    provider, the provider's SDK missing: the ``openai`` or ``gemini`` extra)."""


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


def demo_script(provider: str = "anthropic") -> list[Any]:
    """What the fake server answers, request by request: an overload (Anthropic's
    529; a 503 on OpenAI's APIs, which have no overload status of their own, and
    Gemini's 503 ``UNAVAILABLE``), two tool turns, a rejected answer and its
    repair."""
    from loopengine.testing import ErrorReply, Reply

    overload = (
        ErrorReply.overloaded() if provider == "anthropic"
        else ErrorReply(status=503, message="The model is overloaded. Please try again later.")
        if provider == "gemini"
        else ErrorReply(status=503, message="The server is overloaded or not ready yet."))
    return [
        overload,
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
    db: Path | str,
    *,
    attempts_table: AttemptsTable,
    provider: str = "anthropic",
    live: bool = False,
    echo: Callable[[str], object] = print,
) -> le.RunResult:
    """Run the demo conversation, record it in ``db`` and print what happened.

    Args:
        db: The SQLite ledger to write, or a ``postgresql://`` URL (a
            `PostgresLedger`, with the ``postgres`` extra).
        attempts_table: Renders the attempt rows read back from ``db``.
        provider: ``anthropic``, ``openai`` (Chat Completions),
            ``openai-responses`` (the Responses API) or ``gemini``.
        live: Talk to the real API (its key in the environment) instead of
            the loopback fake.
        echo: Prints one line.

    Raises:
        DemoUnavailable: an unknown provider, ``live`` without the provider's
            API key, or the provider's SDK not installed (the ``openai`` extra
            for both OpenAI APIs, ``gemini`` for Gemini).
        LedgerError: ``db`` cannot hold a ledger.
    """
    vendor = PROVIDERS.get(provider)
    if vendor is None:
        raise DemoUnavailable(f"no demo provider {provider!r} (known: {', '.join(PROVIDERS)})")
    keys = key_variables(provider)
    if live and not any(os.environ.get(name) for name in keys):
        raise DemoUnavailable(f"--live talks to the real {vendor.api}: set "
                              f"{' or '.join(keys)}")
    if vendor.extra is not None:
        try:
            importlib.import_module(vendor.module)  # only whether it is installed
        except ImportError:
            raise DemoUnavailable(f"--provider {provider} needs the {vendor.sdk} SDK (the "
                                  f"{vendor.extra} extra): pip install "
                                  f"'loopengine-core[{vendor.extra}]'") from None
    result: le.RunResult = anyio.run(_converse, db, provider, live)
    # Read the attempts back from the file: what is printed is what was recorded.
    conn = _audit.open_ledger(db)
    try:
        invocation, attempts = _audit.show(conn, result.invocation_id)
    finally:
        conn.close()
    where = f"the real {vendor.api}" if live else f"a loopback fake of the {vendor.api}"
    echo(f"Ran {vendor.operation.name} against {where}, through the {vendor.sdk} SDK.")
    echo(f"Question: {QUESTION}")
    echo(f"Outcome:  {result.outcome.value} after {result.turns} turns, {result.tool_calls} "
         f"tool calls and {result.attempts.count} attempts")
    echo(f"Answer:   {result.answer}" if result.completed else f"Why:      {result.detail}")
    echo(f"Charged:  USD {result.cost_usd} ({result.credits} credits); the provider may bill "
         f"USD {result.provider_cost_usd}")
    echo("")
    shown = display_name(db)
    echo(f"Attempts recorded in {shown}:")
    echo(attempts_table(attempts))
    echo("")
    echo(f"Invocation {invocation['id']} ({invocation['outcome']}). Look closer with:")
    where = "'<the same URL>'" if is_postgres_url(db) else str(db)
    echo(f"  loopengine audit show --db {where} {invocation['id']}")
    echo(f"  loopengine audit reconcile --db {where}")
    echo(f"  loopengine audit runs --db {where}      # every run in the ledger, newest first")
    return result


def _ledger(db: Path | str) -> Any:
    """The demo's ledger: a SQLite file, or a PostgreSQL ledger for a URL."""
    if is_postgres_url(db):
        from loopengine.persistence import PostgresLedger

        return PostgresLedger(str(db))
    return SQLiteLedger(db)


def _provider(provider: str, key: str | None, url: str | None, client: Any) -> Any:
    """The demo's provider on the real API (``url`` None) or on the fake at ``url``,
    sending through ``client`` (an ``httpx2.AsyncClient``) where it takes one; its
    key is ``key``, or (None) the one its SDK reads from the environment."""
    from loopengine import providers

    where: dict[str, Any] = {} if key is None else {"api_key": key}
    if provider == "anthropic":
        if url is not None:
            where |= {"base_url": url, "http_client": client}
        return providers.AnthropicProvider(**where)
    if provider == "gemini":
        if url is not None:
            # Its HTTP clients are the provider's own (one per event loop).
            where |= {"http_options": {"base_url": url}}
        return providers.GeminiProvider(**where)
    if url is not None:
        where |= {"base_url": f"{url}/v1", "http_client": client}
    kind = providers.OpenAIProvider if provider == "openai" else providers.OpenAIResponsesProvider
    return kind(**where)


async def _converse(db: Path | str, provider: str, live: bool) -> le.RunResult:
    import httpx2

    from loopengine import testing

    vendor = PROVIDERS[provider]
    async with _ledger(db) as ledger:
        if live:
            async with _provider(provider, None, None, None) as real:
                return await _run(real, vendor.operation, ledger)
        server = (testing.FakeAnthropicServer if provider == "anthropic"
                  else testing.FakeGeminiServer if provider == "gemini"
                  else testing.FakeOpenAIServer)(demo_script(provider))
        with server:
            # Plain HTTP on loopback: a client that loads no certificates.
            client = httpx2.AsyncClient(verify=False)
            try:
                async with _provider(provider, "demo-key", server.url, client) as fake:
                    return await _run(fake, vendor.operation, ledger)
            finally:
                await client.aclose()


async def _run(provider: Any, operation: le.Operation, ledger: Any) -> le.RunResult:
    engine = le.Engine(provider, ledger=ledger)
    return await engine.run(
        operation, QUESTION, system=SYSTEM, tools=[search_docs, lookup_account], accept=judge,
        attribution=le.Attribution(tenant="demo", feature="help-center", user_id="sam"),
    )
