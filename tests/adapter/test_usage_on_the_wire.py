"""The whole usage vector read from real reply shapes, JSON and SSE, through the SDKs.

The documented shapes (the Messages API's ``usage`` with ``iterations``,
``server_tool_use`` and ``service_tier``; Chat Completions' ``usage`` with
``prompt_tokens_details.cache_write_tokens`` and
``completion_tokens_details.reasoning_tokens``) are written out below as the
APIs send them; the runs go through `FakeAnthropicServer` / `FakeOpenAIServer`
and the real SDKs, and each ledger row's tokens and nano-dollars are compared
to a bill computed here from the published rates.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest

import loopengine as le
from loopengine._pricing import nanousd_to_usd, to_nanousd
from loopengine.persistence import MemoryLedger
from loopengine.providers import AnthropicProvider, Reply
from loopengine.providers._anthropic import usage_from_api
from loopengine.testing import FakeAnthropicServer, FakeClock, FakeOpenAIServer, RecordedRequest
from loopengine.testing._anthropic_server import _events as anthropic_events
from loopengine.testing._loopback import Frame

from .conftest import STREAMING, Harness, harness

AT = datetime(2026, 11, 1, tzinfo=UTC)
MTOK = Decimal(1_000_000)

# Published rates. Claude Sonnet 4.6: $3 / $15 per MTok in / out, cache reads
# $0.30. Claude Opus 4.6: $5 / $25. Anthropic web search: $10 per 1,000
# searches; web fetch: no charge beyond tokens.
SONNET_IN, SONNET_OUT, SONNET_READ = Decimal(3), Decimal(15), Decimal("0.30")
OPUS_IN, OPUS_OUT = Decimal(5), Decimal(25)
SEARCH_PER_K = Decimal(10)
# OpenAI gpt-5.6-sol (below its 272k tier): $4 in, $5 cache write, $0.40 cache
# read, $20 out per MTok.
SOL_IN, SOL_WRITE, SOL_READ, SOL_OUT = Decimal(4), Decimal(5), Decimal("0.40"), Decimal(20)

# A compaction reply's usage as the Messages API sends it (in the final
# message_delta of a stream, or the message's usage): the top level holds the
# message iteration only, the compaction pass is in ``iterations``.
COMPACTION_USAGE: dict[str, Any] = {
    "input_tokens": 181, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
    "output_tokens": 8,
    "iterations": [
        {"input_tokens": 100, "output_tokens": 83, "cache_read_input_tokens": 55_096,
         "cache_creation_input_tokens": 0,
         "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0},
         "type": "compaction"},
        {"input_tokens": 181, "output_tokens": 8, "cache_read_input_tokens": 0,
         "cache_creation_input_tokens": 0,
         "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0},
         "type": "message"},
    ],
}

# A web search reply's usage (the web search tool page's example).
WEB_SEARCH_USAGE: dict[str, Any] = {
    "input_tokens": 105, "output_tokens": 6039, "cache_read_input_tokens": 7123,
    "cache_creation_input_tokens": 7345, "server_tool_use": {"web_search_requests": 1},
    "service_tier": "standard",
}

# An advisor reply: the executor's iterations, and the advisor's on its own model.
ADVISOR_USAGE: dict[str, Any] = {
    "input_tokens": 412, "output_tokens": 89, "service_tier": "standard",
    "iterations": [
        {"type": "message", "input_tokens": 412, "output_tokens": 52},
        {"type": "advisor_message", "model": "claude-opus-4-6", "input_tokens": 823,
         "output_tokens": 1612},
        {"type": "message", "input_tokens": 1_301, "output_tokens": 37},
    ],
}


def usd(tokens: int, rate: Decimal) -> Decimal:
    return tokens * rate / MTOK


@pytest.fixture
async def wire(fake_anthropic_server: FakeAnthropicServer) -> AsyncIterator[Harness]:
    """An engine factory on the fake server, its clock at `AT` (prices of that day)."""
    async with harness(fake_anthropic_server, FakeClock(wall_start=AT)) as h:
        yield h


def test_documented_usage_shapes_are_read_whole() -> None:
    """Iterations are the bill (the top level leaves the compaction pass out);
    server tool counts and a tier that changes the price are kept; an advisor
    iteration keeps its model, an iteration on the reply's own model does not."""
    compaction = usage_from_api(COMPACTION_USAGE)
    assert compaction is not None
    assert (compaction.input_tokens, compaction.output_tokens, compaction.cache_read_tokens) == (
        281, 91, 55_096)
    assert [i.type for i in compaction.iterations] == ["compaction", "message"]
    search = usage_from_api(WEB_SEARCH_USAGE)
    assert search == le.Usage(input_tokens=105, output_tokens=6039, cache_read_tokens=7123,
                              cache_write_tokens=7345, web_search_requests=1)
    fetch = usage_from_api({"input_tokens": 1, "output_tokens": 1, "service_tier": "priority",
                            "server_tool_use": {"web_search_requests": 0,
                                                "web_fetch_requests": 3}})
    assert fetch is not None
    assert (fetch.web_fetch_requests, fetch.service_tier) == (3, "priority")
    advisor = usage_from_api(ADVISOR_USAGE, model="claude-sonnet-4-6")
    assert advisor is not None
    assert [i.model for i in advisor.iterations] == [None, "claude-opus-4-6", None]
    same = usage_from_api(ADVISOR_USAGE, model="claude-opus-4-6")
    assert same is not None and [i.model for i in same.iterations] == [None, None, None]


SEARCH_THEN_CALL = [
        {"type": "server_tool_use", "id": "srvtoolu_01", "name": "web_search",
         "input": {"query": "loopengine"}},
        {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_01", "content": []},
        {"type": "tool_use", "id": "toolu_01", "name": "lookup", "input": {"q": "x"}},
]
"""A reply's web search (its call and result), then a call of `lookup`."""


@le.tool
async def lookup(q: str) -> str:
    """Look something up."""
    return "found"


@STREAMING
async def test_web_search_thinking_and_compaction_are_billed_to_the_nano_dollar(
    wire: Harness, stream: bool,
) -> None:
    """A run with web search, thinking and compaction enabled: the first reply ran
    ten searches and a compaction pass, the second was advised by Opus. Each
    ledger row's tokens and cost, and the run's cost, equal the bill computed
    from the published rates, fees and every iteration included."""
    first = le.Usage.from_iterations((
        le.UsageIteration(type="compaction", input_tokens=100, cache_read_tokens=55_096,
                          output_tokens=83),
        le.UsageIteration(type="message", input_tokens=220, output_tokens=8),
    ), web_search_requests=10)
    second = le.Usage.from_iterations((
        le.UsageIteration(type="message", input_tokens=412, output_tokens=89),
        le.UsageIteration(type="advisor_message", model="claude-opus-4-6", input_tokens=823,
                          output_tokens=1_612),
    ))
    searched = [{"type": "thinking", "thinking": "Search first."},  # the fake signs it
                *SEARCH_THEN_CALL]
    engine, ledger = wire.engine(
        Reply(content=searched, stop_reason="tool_use", usage=first),
        Reply.text("done", usage=second), stream=stream, prices=le.PriceBook())

    published = le.Operation(
        name="research", provider="anthropic", model="claude-sonnet-4-6",
        max_output_tokens=4096, thinking=le.Thinking(budget_tokens=2048),
        server_tools=(le.ServerTool(type="web_search_20250305", name="web_search",
                                    max_uses=10),),
        betas=("compact-2026-01-12",),
        context_management={"edits": [{"type": "compact_20260112"}]},
        limits=le.Limits(credit_hold=10**9))
    result = await engine.run(published, "go", tools=[lookup])
    assert result.outcome is le.Outcome.COMPLETED, result.outcome

    bill_1 = (usd(100 + 220, SONNET_IN) + usd(55_096, SONNET_READ) + usd(83 + 8, SONNET_OUT)
              + 10 * SEARCH_PER_K / 1000)
    bill_2 = usd(412, SONNET_IN) + usd(89, SONNET_OUT) + usd(823, OPUS_IN) + usd(1_612, OPUS_OUT)
    rows = list(ledger.attempts.values())
    assert [(r["input_tokens"], r["output_tokens"], r["cache_read_tokens"]) for r in rows] == [
        (320, 91, 55_096), (1_235, 1_701, 0)]
    assert [r["cost_nanousd"] for r in rows] == [to_nanousd(bill_1), to_nanousd(bill_2)]
    assert result.cost_usd == nanousd_to_usd(to_nanousd(bill_1) + to_nanousd(bill_2))
    assert result.usage.web_search_requests == 10
    assert len(result.usage.iterations) == 4
    assert wire.server.usage_served == result.usage
    # The features went on the wire as the Messages API takes them.
    sent = wire.requests[0]
    assert sent.body["thinking"] == {"type": "enabled", "budget_tokens": 2048}
    assert sent.body["tools"][0] == {"type": "web_search_20250305", "name": "web_search",
                                     "max_uses": 10}
    assert [t["name"] for t in sent.body["tools"]] == ["web_search", "lookup"]
    assert sent.body["context_management"] == {"edits": [{"type": "compact_20260112"}]}
    assert sent.headers["anthropic-beta"] == "compact-2026-01-12"


@STREAMING
async def test_r07_a_runs_iterations_are_the_ledgers_with_server_tools_and_compaction(
    wire: Harness, stream: bool,
) -> None:
    """A run whose first reply ran web searches and reported no iterations, whose
    second was compacted (a compaction pass and the message) and continued, and
    whose last reported one message iteration: the result reports the
    iterations the ledger counts (each attempt's row, and their sum on the
    invocation), and its iterations tuple stands for the first request, which
    reported none, with one iteration of type `unreported` that neither counts."""
    searched = le.Usage(input_tokens=100, output_tokens=20, web_search_requests=2)
    compacted = le.Usage.from_iterations((
        le.UsageIteration(type="compaction", input_tokens=5_000, output_tokens=100),
        le.UsageIteration(type="message", input_tokens=200, output_tokens=50)))
    answered = le.Usage.from_iterations((
        le.UsageIteration(type="message", input_tokens=300, output_tokens=5),))
    engine, ledger = wire.engine(
        Reply(content=SEARCH_THEN_CALL, stop_reason="tool_use", usage=searched),
        Reply(content=[{"type": "compaction", "content": "Earlier: a search."}],
              stop_reason="compaction", usage=compacted),
        Reply.text("done", usage=answered), stream=stream, prices=le.PriceBook())

    published = le.Operation(
        name="research", provider="anthropic", model="claude-sonnet-4-6",
        server_tools=(le.ServerTool(type="web_search_20250305", name="web_search"),),
        betas=("compact-2026-01-12",),
        context_management={"edits": [{"type": "compact_20260112"}]})
    result = await engine.run(published, "go", tools=[lookup])
    assert result.outcome is le.Outcome.COMPLETED, result.detail
    rows = list(ledger.attempts.values())
    (invocation,) = ledger.invocations.values()
    assert [(r["phase"], r["iterations"], r["web_search_requests"]) for r in rows] == [
        ("turn", 0, 2), ("turn", 2, 0), ("continuation", 1, 0)]
    assert result.usage.reported_iterations == invocation["iterations"] == 3
    assert [i.type for i in result.usage.iterations] == [
        le.UsageIteration.UNREPORTED, "compaction", "message", "message"]
    assert result.usage.web_search_requests == invocation["web_search_requests"] == 2
    assert [s.usage.reported_iterations for s in (r.settle for r in result.attempt_log)
            if s is not None and s.usage is not None] == [0, 2, 1]
    assert (result.usage.input_tokens, result.usage.output_tokens) == (
        invocation["input_tokens"], invocation["output_tokens"])


@STREAMING
async def test_openai_cache_writes_and_reasoning_are_read_and_priced(
    fake_openai_server: FakeOpenAIServer, stream: bool,
) -> None:
    """``prompt_tokens`` holds the cached and the written tokens: the written ones are
    priced as cache writes, not as input; reasoning tokens are noted inside output."""
    from loopengine.providers import OpenAIProvider

    usage = le.Usage(input_tokens=1_000, cache_read_tokens=2_000, cache_write_tokens=3_000,
                     output_tokens=500, reasoning_tokens=320)
    fake_openai_server.add(Reply.text("ok", usage=usage))
    provider = OpenAIProvider(api_key="test-key", base_url=fake_openai_server.base_url,
                              stream=stream)
    ledger = MemoryLedger()
    engine = le.Engine(provider, ledger=ledger, prices=le.PriceBook(),
                       clock=FakeClock(wall_start=AT))
    try:
        result = await engine.run(le.Operation(name="ask", provider="openai",
                                               model="gpt-5.6-sol"), "go")
    finally:
        await provider.aclose()
    assert result.usage == usage
    body = fake_openai_server.requests[0].body
    assert body["model"] == "gpt-5.6-sol"
    (row,) = ledger.attempts.values()
    assert (row["input_tokens"], row["cache_read_tokens"], row["cache_write_tokens"],
            row["output_tokens"]) == (1_000, 2_000, 3_000, 500)
    bill = (usd(1_000, SOL_IN) + usd(2_000, SOL_READ) + usd(3_000, SOL_WRITE)
            + usd(500, SOL_OUT))
    assert row["cost_nanousd"] == to_nanousd(bill)


@STREAMING
async def test_openai_a_flex_reply_is_priced_at_the_flex_rates(
    fake_openai_server: FakeOpenAIServer, stream: bool,
) -> None:
    """The completion's ``service_tier`` is read (JSON and every chunk of a stream)
    and its tokens priced at that tier: half the list rates for flex."""
    from loopengine.providers import OpenAIProvider

    usage = le.Usage(input_tokens=10_000, output_tokens=1_000, service_tier="flex")
    fake_openai_server.add(Reply.text("ok", usage=usage))
    provider = OpenAIProvider(api_key="test-key", base_url=fake_openai_server.base_url,
                              stream=stream)
    ledger = MemoryLedger()
    book = le.PriceBook([le.ModelPrice(provider="openai", model="gpt-x", input_per_mtok=2,
                                       output_per_mtok=8,
                                       service_tier_multipliers={"flex": Decimal("0.5")})])
    engine = le.Engine(provider, ledger=ledger, prices=book, clock=FakeClock(wall_start=AT))
    try:
        result = await engine.run(le.Operation(name="ask", provider="openai", model="gpt-x"),
                                  "go")
    finally:
        await provider.aclose()
    assert result.usage.service_tier == "flex"
    (row,) = ledger.attempts.values()
    assert row["cost_nanousd"] == to_nanousd((usd(10_000, Decimal(2)) + usd(1_000, Decimal(8)))
                                             / 2)


@STREAMING
async def test_an_mcp_tool_use_keeps_its_input(wire: Harness, stream: bool) -> None:
    """A streamed ``mcp_tool_use`` block's input arrives as ``input_json_delta``
    events, which the SDK's accumulator leaves out for that type: the provider
    joins them, so the block in ``result.messages`` has its input either way."""
    called = {"type": "mcp_tool_use", "id": "mcptoolu_01", "name": "echo",
              "server_name": "tools", "input": {"text": "hi", "n": 2}}
    answered = {"type": "mcp_tool_result", "tool_use_id": "mcptoolu_01", "is_error": False,
                "content": [{"type": "text", "text": "hi hi"}]}
    engine, _ = wire.engine(
        Reply(content=[called, answered, {"type": "text", "text": "done"}]), stream=stream)
    result = await engine.run(le.Operation(name="ask", provider="anthropic",
                                           model="claude-sonnet-4-6"), "go")
    assert result.outcome is le.Outcome.COMPLETED
    assert result.messages[-1]["content"][0] == called


class ThinkingTokensServer(FakeAnthropicServer):
    """The Messages API as it reports thinking now: ``usage.output_tokens_details.
    thinking_tokens`` in the message's usage, and in the stream's ``message_delta``
    (where the final output count arrives)."""

    thinking_tokens = 0

    def _message(self, reply: Reply, request: RecordedRequest, number: int) -> dict[str, Any]:
        message = super()._message(reply, request, number)
        message["usage"]["output_tokens_details"] = {"thinking_tokens": self.thinking_tokens}
        return message

    def _frames(self, message: dict[str, Any], reply: Reply,
                request: RecordedRequest) -> list[Frame]:
        events = anthropic_events(message, reply.usage)
        for name, data in events:
            if name == "message_delta":
                data["usage"]["output_tokens_details"] = dict(
                    message["usage"]["output_tokens_details"])
        return [Frame(self._event(name, data), None) for name, data in events]


@STREAMING
async def test_thinking_tokens_are_the_reasoning_tokens_of_a_messages_reply(
    stream: bool,
) -> None:
    """``output_tokens_details.thinking_tokens`` is the part of the output spent
    thinking: the ledger's ``reasoning_tokens``, priced as the output it is part of."""
    with ThinkingTokensServer() as server:
        server.thinking_tokens = 1_472
        served = le.Usage(input_tokens=2_000, output_tokens=1_800)
        server.add(Reply.text("thought it through", usage=served))
        ledger = MemoryLedger()
        async with AnthropicProvider(api_key="test", base_url=server.url,
                                     stream=stream) as provider:
            engine = le.Engine(provider, ledger=ledger, prices=le.PriceBook(),
                               clock=FakeClock(wall_start=AT))
            result = await engine.run(le.Operation(name="op", provider="anthropic",
                                                   model="claude-sonnet-4-6"), "go")
    assert result.outcome is le.Outcome.COMPLETED
    assert result.usage.reasoning_tokens == 1_472 and result.usage.output_tokens == 1_800
    (row,) = ledger.attempts.values()
    assert row["reasoning_tokens"] == 1_472
    assert row["cost_nanousd"] == to_nanousd(usd(2_000, SONNET_IN) + usd(1_800, SONNET_OUT))


def test_thinking_tokens_of_a_reply_with_iterations_are_kept_within_its_output() -> None:
    """With iterations the reasoning count is the reply's, capped at the output the
    iterations sum to (it is part of it)."""
    usage = usage_from_api({**COMPACTION_USAGE,
                            "output_tokens_details": {"thinking_tokens": 50}})
    assert usage is not None and (usage.reasoning_tokens, usage.output_tokens) == (50, 91)
    usage = usage_from_api({"input_tokens": 1, "output_tokens": 3,
                            "output_tokens_details": {"thinking_tokens": 9}})
    assert usage is not None and usage.reasoning_tokens == 3
