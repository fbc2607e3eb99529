"""A child process that resumes a paused run (run as a script, not collected).

``python -m tests.pause_child VENDOR DB URL STATE DECISIONS LOG``: load the
`RunState` in the file STATE, resume it through VENDOR's provider (``anthropic``,
``openai``, ``openai-responses`` for OpenAI's Responses API, ``gemini``, or
Claude on ``aws-bedrock`` / ``google-vertex``) against the fake server at URL,
with the SQLiteLedger DB, the decisions given as JSON
(``{call_id: ["approve"] | ["deny", why] | ["supply", text]}``), and the tool
``send`` (approval needed), which appends its input to the file LOG. Prints
the result's facts as one JSON line, its pending calls' ids among them; a
result paused again writes its state to STATE.

DECISIONS ``run`` starts a run of the route's operation ("Tell bob", the tool
``send``) instead of resuming one.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path

import anyio

import loopengine as le
from loopengine.persistence import SQLiteLedger
from loopengine.providers import (
    AnthropicProvider,
    GeminiProvider,
    OpenAIProvider,
    OpenAIResponsesProvider,
    Provider,
)

MODELS = {"anthropic": "claude-sonnet-4-5", "openai": "gpt-4o-mini",
          "openai-responses": "gpt-4o-mini", "gemini": "gemini-2.5-flash",
          "aws-bedrock": "us.anthropic.claude-sonnet-4-5-20250929-v1:0",
          "google-vertex": "claude-sonnet-4-5@20250929"}

# The routes whose attempts are priced as another vendor's.
PRICED_AS = {"openai-responses": "openai", "gemini": "google"}

# The providers built otherwise than on an API key and a base_url: as the
# route's tests build them (tests/gemini, tests/bedrock_vertex).
BUILT: dict[str, Callable[[str], Provider]] = {
    "gemini": lambda url: GeminiProvider(api_key="test-key", http_options={"base_url": url}),
    "aws-bedrock": lambda url: AnthropicProvider.bedrock(
        base_url=url, aws_region="us-east-1", aws_access_key="AKIDEXAMPLE",
        aws_secret_key="secret"),
    "google-vertex": lambda url: AnthropicProvider.vertex(
        base_url=url, region="global", project_id="test-project",
        access_token="test-token"),
}


async def main(vendor: str, db: str, url: str, state: bytes | None, decided: str,
               log: str) -> bytes | None:
    """Run or resume; print the result's facts; return its state (paused) or None."""

    @le.tool(approval=True)
    def send(to: str) -> str:
        """Send the message to someone."""
        with open(log, "a", encoding="utf-8") as out:
            out.write(to + "\n")
        return f"sent to {to}"

    decisions: dict[str, le.Approve | le.Deny | le.Supply] = {}
    for call_id, (kind, *rest) in ({} if decided == "run" else json.loads(decided)).items():
        decisions[call_id] = {"approve": le.Approve, "deny": le.Deny,
                              "supply": le.Supply}[kind](*rest)
    # The Responses API is OpenAI's, Gemini Google's: attempts are priced as the vendor's.
    prices = le.PriceBook([le.ModelPrice(provider=PRICED_AS.get(vendor, vendor),
                                         model=MODELS[vendor],
                                         input_per_mtok=Decimal(1), output_per_mtok=Decimal(1))],
                          credits_per_usd=Decimal(1_000_000))
    provider: Provider = (BUILT[vendor](url) if vendor in BUILT
                          else AnthropicProvider(api_key="test-key", base_url=url)
                          if vendor == "anthropic"
                          else OpenAIResponsesProvider(api_key="test-key", base_url=url)
                          if vendor == "openai-responses"
                          else OpenAIProvider(api_key="test-key", base_url=url))
    with SQLiteLedger(db) as ledger:
        engine = le.Engine(provider, ledger=ledger, prices=prices)
        if decided == "run":
            operation = le.Operation(name="test.op", provider=vendor, model=MODELS[vendor],
                                     max_output_tokens=512)
            result = await engine.run(operation, "Tell bob", tools=[send])
        else:
            assert state is not None
            result = await engine.resume(state, decisions=decisions, tools=[send])
    await provider.aclose()  # type: ignore[attr-defined]
    print(json.dumps({"outcome": result.outcome.value, "invocation_id": result.invocation_id,
                      "turns": result.turns, "tool_calls": result.tool_calls,
                      "attempts": result.attempts.count, "credits": result.credits,
                      "answer": result.answer,
                      "pending": [call.id for call in result.pending]}))
    return None if result.state is None else result.state.dumps()


if __name__ == "__main__":
    vendor, db, url, state_file, decided, log = sys.argv[1:]
    given = None if decided == "run" else Path(state_file).read_bytes()
    paused = anyio.run(main, vendor, db, url, given, decided, log)
    if paused is not None:
        Path(state_file).write_bytes(paused)
