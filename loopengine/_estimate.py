"""Pre-run estimates: what a run of an operation can cost at most, before it starts.

`Engine.estimate` counts the first request's input with tiktoken's
``cl100k_base`` (the hash-verified copy shipped in the package, see
`loopengine._tokenizer`), scales it to Claude's tokenizer, and takes the
worst case the operation's limits allow:

* every one of ``max_turns`` turns is sent, and each writes
  ``max_output_tokens`` (the operation's output ceiling);
* each turn re-sends the whole conversation so far, so turn *k*'s input is
  the first turn's input plus the output of the *k - 1* turns before it:
  ``input_k = input_1 + (k - 1) * max_output_tokens``;
* each turn is priced on its own, at the engine's current time, as uncached
  input and output (no cache discount is assumed), and rounded up to the credit
  quantum before it accumulates, as real turn charges are (R03);
* each turn uses every server tool the operation publishes up to its
  ``max_uses`` and pays its per-request fee (web search, web fetch) that
  many times, and a search model's one web search (a request to it searches
  whatever it asks, `Provider.billing`). A tool with a fee and
  no ``max_uses`` has no worst case: the estimate then has no cost
  (``cost_usd`` and ``credits`` are None, as for an unpriced model, and
  ``unbounded_tools`` names it).

What the estimate cannot know is left out and said so: tool results and judge
feedback added during the run (their size depends on the tools), retries (a
failed attempt is never charged, S01), cache-write premiums, and the tokens
of compaction passes and advisor calls.

It is synchronous and does no I/O beyond reading the tokenizer file once per
process.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from decimal import ROUND_CEILING, Decimal
from typing import Any

import pydantic

from loopengine import _validate
from loopengine._errors import ConfigError
from loopengine._operation import Operation
from loopengine._pricing import Billing, PriceBook, nanousd_to_usd
from loopengine._run import check_unique_tools, final_tool_definition
from loopengine._tokenizer import cl100k
from loopengine._tools import Tool
from loopengine._usage import Usage
from loopengine.guards._credits import turn_credits
from loopengine.guards._limits import Limits

__all__ = [
    "CLAUDE_CALIBRATION",
    "IMAGE_TOKENS",
    "MESSAGE_OVERHEAD_TOKENS",
    "TOOL_PROMPT_TOKENS",
    "Estimate",
    "count_input",
    "estimate_run",
]

CLAUDE_CALIBRATION = Decimal("1.3")
"""Claude tokens per ``cl100k_base`` token.

Claude's tokenizer is not published. Side-by-side counts of the same text
(Anthropic's ``count_tokens`` against cl100k) put Claude 10-30% above cl100k
on English prose and source code, so 1.3 keeps those estimates at or above
the real count. Text in other scripts can exceed it.
"""

MESSAGE_OVERHEAD_TOKENS = 4
"""Claude tokens added per message for its role and turn markers (not calibrated)."""

TOOL_PROMPT_TOKENS = 346
"""The tool-use system prompt Anthropic adds when a request has tools: the
largest figure its pricing page lists for current models (not calibrated)."""

IMAGE_TOKENS = 1600
"""Claude tokens counted per image block: images are resized to stay near
1.15 megapixels, about 1,600 tokens at ``width * height / 750``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Estimate:
    """The worst case of one run of an operation, computed before it starts.

    Returned by `Engine.estimate`. Token counts are Claude tokens unless the
    field says otherwise.
    """

    operation: str
    """The operation's name."""
    route: str
    """``provider:model``."""
    counted_tokens: int
    """The first request's text (messages, system prompt, tool definitions) in
    ``cl100k_base`` tokens, before calibration."""
    calibration: Decimal
    """The factor applied to ``counted_tokens`` (`CLAUDE_CALIBRATION`)."""
    framing_tokens: int
    """Fixed additions: per-message markers, the tool-use prompt, images."""
    input_tokens: int
    """The first request's input: ``ceil(counted_tokens * calibration) + framing_tokens``."""
    turns: int
    """The most turns the run may send (``max_turns``)."""
    max_output_tokens: int
    """The most output tokens one turn may write (the operation's ceiling)."""
    output_tokens: int
    """Worst-case output over the run: ``turns * max_output_tokens``."""
    turn_input_tokens: tuple[int, ...]
    """Each turn's worst-case input: ``input_tokens + (k - 1) * max_output_tokens``."""
    total_input_tokens: int
    """The sum of ``turn_input_tokens``."""
    cost_usd: Decimal | None
    """Worst-case charged cost (the sum of the turns' prices, each rounded up to
    a nano-USD as real attempts are); None when the model has no price."""
    credits: int | None
    """Worst-case credits, each turn rounded up to the credit quantum before it
    accumulates; None when the model has no price."""
    fee_usd: Decimal | None
    """The part of ``cost_usd`` that is server-tool fees (every turn using each
    tool ``max_uses`` times); None when ``cost_usd`` is."""
    unbounded_tools: tuple[str, ...]
    """Server tools with a per-request fee and no ``max_uses``: while any is
    listed the worst case is unbounded and ``cost_usd`` is None."""
    price_ref: str | None
    """Where the price came from (as in the ledger's ``price_ref``), or None."""
    priced_at: datetime
    """The moment the prices were taken for."""


def estimate_run(
    operation: Operation,
    messages: Sequence[Mapping[str, Any]],
    *,
    system: Sequence[Mapping[str, Any]] | None = None,
    tools: Iterable[Tool] = (),
    places: Sequence[tuple[str, str]] | None = None,
    output: type[pydantic.BaseModel] | None = None,
    limits: Limits | Mapping[str, object] | None = None,
    prices: PriceBook,
    at: datetime,
    final_tool: str = "final_answer",
    vendor: str | None = None,
    geo: str | None = None,
    billing: Billing,
) -> Estimate:
    """The worst case of a run (see the module docstring for the model).

    Args:
        operation: The published operation.
        messages: Anthropic-shaped messages, already checked (`Engine.estimate`
            checks and normalizes them as `Engine.run` does).
        system: The system prompt's text blocks, already checked, or None.
        tools: As for `Engine.run`, each source's tools in place (`expand_tools`).
        places: Where the caller put each tool, which an error names
            (`ExpandedTools.places`); default each tool's position in ``tools``.
        output: As for `Engine.run`: the terminal tool's definition is counted.
        limits: Narrows the operation's limits, as for `Engine.run`.
        prices: The price book to price with.
        at: The moment to take prices for.
        final_tool: The terminal tool's name in structured mode.
        vendor: Whose prices apply (the route's provider's vendor; default:
            the operation's route name).
        geo: Where the route's provider serves every request, when that
            changes the price (its `Provider.inference_geo`).
        billing: How the route's provider bills its requests beyond their
            usage (its `Provider.billing`: a search model's web search in
            each turn's fees, its own web search fee, whether long-context
            rates apply).

    Raises:
        ConfigError: bad input, as `Engine.run` would raise it.
        LoopEngineError: the shipped tokenizer file is damaged.
    """
    if not isinstance(operation, Operation):
        raise ConfigError("operation", f"must be an Operation, got {operation!r}")
    if output is not None:
        _validate.model_schema("output", output)
    tool_list = tuple(tools)
    check_unique_tools(tool_list, final_tool, structured=output is not None, places=places)
    definitions = [t.definition for t in tool_list]
    if output is not None:
        definitions.append(final_tool_definition(output, final_tool))
    counted, framing = count_input(messages, system, definitions)
    run_limits = operation.limits.narrow(limits)

    calibrated = Decimal(counted) * CLAUDE_CALIBRATION
    first = int(calibrated.to_integral_value(rounding=ROUND_CEILING)) + framing
    per_turn_output = operation.output_ceiling
    turns = run_limits.max_turns
    turn_inputs = tuple(first + k * per_turn_output for k in range(turns))

    route = vendor or operation.provider
    fees = prices.turn_fees(route, operation.model, operation.server_tools, at, billing=billing)
    searches, fetches, unbounded = (fees.web_search_requests, fees.web_fetch_requests,
                                    fees.unbounded)
    cost_nanousd: int | None = 0
    fee_nanousd: int | None = 0
    credits: int | None = 0
    price_ref: str | None = None
    for turn_input in turn_inputs:
        priced = None if unbounded else prices.price(
            route, operation.model,
            Usage(input_tokens=turn_input, output_tokens=per_turn_output,
                  web_search_requests=searches, web_fetch_requests=fetches,
                  inference_geo=geo), at, billing=billing,
        )
        if priced is None:
            cost_nanousd = fee_nanousd = credits = price_ref = None
            break
        assert cost_nanousd is not None and credits is not None and fee_nanousd is not None
        price_ref = price_ref or priced.price_ref
        cost_nanousd += priced.cost_nanousd
        fee_nanousd += priced.fee_nanousd
        credits += turn_credits(priced.cost_nanousd, prices.credits_per_usd,
                                prices.credit_quantum)

    return Estimate(
        operation=operation.name,
        route=operation.route,
        counted_tokens=counted,
        calibration=CLAUDE_CALIBRATION,
        framing_tokens=framing,
        input_tokens=first,
        turns=turns,
        max_output_tokens=per_turn_output,
        output_tokens=turns * per_turn_output,
        turn_input_tokens=turn_inputs,
        total_input_tokens=sum(turn_inputs),
        cost_usd=None if cost_nanousd is None else nanousd_to_usd(cost_nanousd),
        credits=credits,
        fee_usd=None if fee_nanousd is None else nanousd_to_usd(fee_nanousd),
        unbounded_tools=unbounded,
        price_ref=price_ref,
        priced_at=at,
    )


def count_input(
    messages: Sequence[Mapping[str, Any]],
    system: Sequence[Mapping[str, Any]] | None,
    tools: Sequence[Mapping[str, Any]],
) -> tuple[int, int]:
    """Count one request's input.

    Returns:
        ``(cl100k tokens of its text, fixed framing tokens)``. Text is the
        system prompt's text, each message's text, tool calls' names and JSON
        inputs, tool results' text, and each tool definition as compact JSON;
        blocks of other types are counted as their JSON (an over-count for
        binary payloads, which keeps the estimate on the high side), except
        images, which add `IMAGE_TOKENS` each.
    """
    encoding = cl100k()
    texts: list[str] = []
    images = 0

    def content(value: Any) -> None:
        nonlocal images
        if isinstance(value, str):
            texts.append(value)
            return
        if not isinstance(value, Sequence):
            texts.append(_json(value))
            return
        for block in value:
            if not isinstance(block, Mapping):
                texts.append(_json(block))
                continue
            kind = block.get("type")
            if kind == "text":
                texts.append(str(block.get("text", "")))
            elif kind in ("tool_use", "server_tool_use"):
                texts.append(str(block.get("name", "")))
                texts.append(_json(block.get("input", {})))
            elif kind == "tool_result":
                content(block.get("content", ""))
            elif kind == "thinking":
                texts.append(str(block.get("thinking", "")))
            elif kind == "image":
                images += 1
            elif kind == "document" and isinstance(block.get("source"), Mapping) and (
                block["source"].get("type") == "text"
            ):
                texts.append(str(block["source"].get("data", "")))
            else:
                # cache_control is an instruction to the API, not input text.
                texts.append(_json({k: v for k, v in block.items() if k != "cache_control"}))

    if system:
        content(system)
    for message in messages:
        content(message.get("content", ""))
    for definition in tools:
        texts.append(_json(definition))

    counted = sum(len(encoding.encode_ordinary(text)) for text in texts if text)
    framing = (
        MESSAGE_OVERHEAD_TOKENS * len(messages)
        + (TOOL_PROMPT_TOKENS if tools else 0)
        + IMAGE_TOKENS * images
    )
    return counted, framing


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str)
