"""Prices for the whole usage vector (docs/pricing.md): per-request fees, iterations at
their own models, OpenAI cache writes, and what cannot be priced.

Every expected price is computed here from the vendors' published rates, written
out below, and compared to the nano-USD exactly.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import pytest

import loopengine as le
from loopengine._features import Features
from loopengine._pricing import nanousd_to_usd, to_nanousd
from loopengine.persistence import MemoryLedger
from loopengine.providers import Reply, ScriptedProvider
from loopengine.testing import FakeClock

AT = datetime(2026, 11, 1, tzinfo=UTC)
MTOK = Decimal(1_000_000)

# Claude Sonnet 4.5 and 4.6: $3 / $15 per MTok in / out; cache writes 1.25x input
# ($3.75), one-hour writes 2x ($6), cache reads 0.1x ($0.30).
SONNET_IN, SONNET_OUT = Decimal(3), Decimal(15)
SONNET_WRITE, SONNET_WRITE_1H, SONNET_READ = Decimal("3.75"), Decimal(6), Decimal("0.30")
# Claude Opus 4.6: $5 / $25 per MTok.
OPUS_IN, OPUS_OUT = Decimal(5), Decimal(25)
# Anthropic web search: $10 per 1,000 searches. Web fetch: no charge beyond tokens.
SEARCH_PER_K = Decimal(10)
# OpenAI gpt-5.6-sol (below its 272k tier): $4 in, $5 cache write, $0.40 cache read,
# $20 out per MTok.
SOL_IN, SOL_WRITE, SOL_READ, SOL_OUT = Decimal(4), Decimal(5), Decimal("0.40"), Decimal(20)

GENAI = le.PriceBook()


def usd(tokens: int, rate: Decimal) -> Decimal:
    return tokens * rate / MTOK


def test_a_reply_with_ten_web_searches_is_charged_the_fee() -> None:
    """The pause_turn case: 10 searches are $0.10 on top of the tokens."""
    usage = le.Usage(input_tokens=2_679, output_tokens=412, cache_read_tokens=1_500,
                     web_search_requests=10)
    priced = GENAI.price("anthropic", "claude-sonnet-4-5", usage, AT)
    fee = 10 * SEARCH_PER_K / 1000
    tokens = usd(2_679, SONNET_IN) + usd(412, SONNET_OUT) + usd(1_500, SONNET_READ)
    assert priced is not None
    assert priced.fee_nanousd == to_nanousd(fee) == 100_000_000
    assert priced.cost_nanousd == to_nanousd(tokens + fee)


def test_a_compaction_reply_is_billed_every_iteration() -> None:
    """Top level 220 in / 8 out; the compaction pass 55,196 in / 125 out is billed too,
    at the requested model."""
    usage = le.Usage.from_iterations((
        le.UsageIteration(type="compaction", input_tokens=55_196, output_tokens=125),
        le.UsageIteration(type="message", input_tokens=220, output_tokens=8),
    ))
    priced = GENAI.price("anthropic", "claude-sonnet-4-5", usage, AT)
    expected = usd(55_196 + 220, SONNET_IN) + usd(125 + 8, SONNET_OUT)
    assert priced is not None and priced.fee_nanousd == 0
    assert priced.cost_nanousd == to_nanousd(expected)
    top_level_only = usd(220, SONNET_IN) + usd(8, SONNET_OUT)
    assert priced.cost_nanousd > 200 * to_nanousd(top_level_only)


def test_an_advisor_iteration_is_priced_at_the_advisor_model() -> None:
    """The advisor docs' reply: executor iterations at Sonnet 4.6 rates, the advisor's
    at Opus 4.6 rates; the price names both sources."""
    usage = le.Usage.from_iterations((
        le.UsageIteration(type="message", input_tokens=412, output_tokens=89),
        le.UsageIteration(type="advisor_message", model="claude-opus-4-6", input_tokens=823,
                          output_tokens=1_612),
        le.UsageIteration(type="message", input_tokens=1_348, cache_read_tokens=412,
                          output_tokens=442),
    ))
    priced = GENAI.price("anthropic", "claude-sonnet-4-6", usage, AT)
    executor = usd(412 + 1_348, SONNET_IN) + usd(412, SONNET_READ) + usd(89 + 442, SONNET_OUT)
    advisor = usd(823, OPUS_IN) + usd(1_612, OPUS_OUT)
    assert priced is not None
    assert priced.cost_nanousd == to_nanousd(executor + advisor)
    assert "anthropic/claude-sonnet-4-6" in priced.price_ref
    assert "anthropic/claude-opus-4-6" in priced.price_ref


def test_an_iteration_on_a_model_without_a_price_leaves_the_attempt_unpriced() -> None:
    """Never a silent zero for the part nobody can price."""
    usage = le.Usage.from_iterations((
        le.UsageIteration(type="message", input_tokens=10, output_tokens=1),
        le.UsageIteration(type="advisor_message", model="no-such-model", input_tokens=5),
    ))
    assert GENAI.price("anthropic", "claude-sonnet-4-5", usage, AT) is None


def test_openai_cache_writes_are_priced_as_writes() -> None:
    """``prompt_tokens`` 10,000 of which 2,000 cached and 4,000 written: the written
    tokens cost the write rate, not the input rate."""
    usage = le.Usage(input_tokens=10_000 - 2_000 - 4_000, cache_read_tokens=2_000,
                     cache_write_tokens=4_000, output_tokens=300)
    priced = GENAI.price("openai", "gpt-5.6-sol", usage, AT)
    expected = (usd(4_000, SOL_IN) + usd(2_000, SOL_READ) + usd(4_000, SOL_WRITE)
                + usd(300, SOL_OUT))
    as_plain_input = usd(8_000, SOL_IN) + usd(2_000, SOL_READ) + usd(300, SOL_OUT)
    assert priced is not None
    assert priced.cost_nanousd == to_nanousd(expected) > to_nanousd(as_plain_input)


def test_a_book_entry_prices_fees_from_its_own_fields() -> None:
    """web_search_per_k / web_fetch_per_k; Anthropic's web fetch is free by default."""
    entry = le.ModelPrice(provider="anthropic", model="m", input_per_mtok=SONNET_IN,
                          output_per_mtok=SONNET_OUT, web_search_per_k=SEARCH_PER_K)
    book = le.PriceBook([entry], fallback=False)
    usage = le.Usage(input_tokens=1_000, output_tokens=10, web_search_requests=3,
                     web_fetch_requests=7)
    priced = book.price("anthropic", "m", usage, AT)
    fee = 3 * SEARCH_PER_K / 1000
    assert priced is not None and priced.fee_nanousd == to_nanousd(fee) == 30_000_000
    assert priced.cost_nanousd == to_nanousd(usd(1_000, SONNET_IN) + usd(10, SONNET_OUT) + fee)
    charged = le.ModelPrice(provider="anthropic", model="m", input_per_mtok=SONNET_IN,
                            output_per_mtok=SONNET_OUT, web_search_per_k=SEARCH_PER_K,
                            web_fetch_per_k=Decimal("0.5"))
    priced = le.PriceBook([charged]).price("anthropic", "m", usage, AT)
    assert priced is not None and priced.fee_nanousd == to_nanousd(fee + 7 * Decimal("0.5") / 1000)


def test_a_fee_nobody_knows_leaves_the_attempt_unpriced() -> None:
    """A book entry without a web search fee; web fetch on a vendor that documents none."""
    entry = le.ModelPrice(provider="openai", model="m", input_per_mtok=SONNET_IN,
                          output_per_mtok=SONNET_OUT)
    book = le.PriceBook([entry], fallback=False)
    assert book.price("openai", "m", le.Usage(input_tokens=1), AT) is not None
    assert book.price("openai", "m", le.Usage(input_tokens=1, web_search_requests=1), AT) is None
    assert book.price("openai", "m", le.Usage(input_tokens=1, web_fetch_requests=1), AT) is None
    assert GENAI.price("openai", "gpt-5", le.Usage(web_fetch_requests=1), AT) is None
    assert GENAI.fees("openai", "gpt-5", AT) == (SEARCH_PER_K, None)
    assert GENAI.fees("anthropic", "claude-sonnet-4-5", AT) == (SEARCH_PER_K, Decimal(0))


def test_model_price_refuses_a_float_fee() -> None:
    """Fees are exact, like token prices."""
    with pytest.raises(le.ConfigError) as caught:
        le.ModelPrice(provider="p", model="m", input_per_mtok=1, output_per_mtok=1,
                      web_search_per_k=10.0)  # type: ignore[arg-type]
    assert caught.value.field == "web_search_per_k"


def test_which_features_can_be_priced() -> None:
    """Token-billed features always; fees when known; code execution and unknown
    tool types never; an advisor when its model has a price."""
    tools = (
        le.ServerTool(type="web_search_20250305", name="web_search", max_uses=5),
        le.ServerTool(type="web_fetch_20250910", name="web_fetch"),
        le.ServerTool(type="advisor_20260301", name="advisor",
                      params={"model": "claude-opus-4-6"}),
        le.ServerTool(type="memory_20250818", name="memory"),
    )
    features = Features(thinking=le.Thinking(budget_tokens=2048), server_tools=tools,
                        betas=("compact-2026-01-12",),
                        context_management={"edits": [{"type": "compact_20260112"}]})
    assert GENAI.unpriced_features("anthropic", "claude-sonnet-4-6", features, AT) == ()
    unpriced = GENAI.unpriced_features("anthropic", "claude-sonnet-4-6", Features(server_tools=(
        le.ServerTool(type="code_execution_20250825", name="code_execution"),
        le.ServerTool(type="future_tool_20990101", name="future"),
        le.ServerTool(type="advisor_20260301", name="advisor"),
    ), service_tier="priority"), AT)
    assert len(unpriced) == 4
    assert "container time" in unpriced[0] and "unknown server tool type" in unpriced[1]
    assert "advisor model None" in unpriced[2] and "service_tier" in unpriced[3]
    book = le.PriceBook([le.ModelPrice(provider="anthropic", model="m", input_per_mtok=1,
                                       output_per_mtok=1)], fallback=False)
    assert book.unpriced_features("anthropic", "m", Features(server_tools=tools), AT) == (
        "server tool 'web_search' (web_search_20250305): no web search fee",
        "server tool 'advisor' (advisor_20260301): advisor model 'claude-opus-4-6' has no price",
    )


def test_each_fee_prices_its_own_tools_worst_case() -> None:
    """Web search tools are bounded by the search fee, web fetch tools by the fetch
    fee: a tool without max_uses has no worst case unless its fee is zero, and a
    fee nobody knows leaves its tools unpriced, named by their fee."""
    search = le.ServerTool(type="web_search_20250305", name="search", max_uses=3)
    fetch = le.ServerTool(type="web_fetch_20250910", name="fetch", max_uses=2)
    book = le.PriceBook([le.ModelPrice(provider="anthropic", model="m", input_per_mtok=1,
                                       output_per_mtok=1, web_search_per_k=10)],
                        fallback=False)
    fees = book.turn_fees("anthropic", "m", (search, fetch), AT)
    assert (fees.web_search_requests, fees.web_fetch_requests, fees.usd) == (
        3, 2, Decimal("0.03"))
    endless_fetch = le.ServerTool(type="web_fetch_20250910", name="fetch")
    assert book.turn_fees("anthropic", "m", (endless_fetch,), AT).unbounded == ()
    endless_search = le.ServerTool(type="web_search_20250305", name="search")
    assert book.turn_fees("anthropic", "m", (endless_search,), AT).unbounded == ("search",)
    other = le.PriceBook([le.ModelPrice(provider="openai", model="m", input_per_mtok=1,
                                        output_per_mtok=1)], fallback=False)
    assert other.unpriced_features("openai", "m", Features(server_tools=(search, fetch)),
                                   AT) == (
        "server tool 'search' (web_search_20250305): no web search fee",
        "server tool 'fetch' (web_fetch_20250910): no web fetch fee")


async def test_the_ledger_charges_fees_and_every_iteration() -> None:
    """A run of an operation with web search, thinking and compaction: two replies, the
    first with 10 searches and a compaction pass, the second advised by Opus 4.6. The
    ledger's attempts and the run's cost equal the bill computed from the rates."""
    first = le.Usage.from_iterations((
        le.UsageIteration(type="compaction", input_tokens=55_196, output_tokens=125),
        le.UsageIteration(type="message", input_tokens=220, output_tokens=8),
    ), web_search_requests=10)
    second = le.Usage.from_iterations((
        le.UsageIteration(type="message", input_tokens=412, output_tokens=89),
        le.UsageIteration(type="advisor_message", model="claude-opus-4-6", input_tokens=823,
                          output_tokens=1_612),
    ))
    clock = FakeClock(wall_start=AT)
    provider = ScriptedProvider([Reply.tool_calls(("lookup", {"q": "x"}), usage=first),
                                 Reply.text("done", usage=second)], clock=clock)
    ledger = MemoryLedger()
    engine = le.Engine(provider, ledger=ledger, prices=le.PriceBook(), clock=clock)

    @le.tool
    async def lookup(q: str) -> str:
        """Look something up."""
        return "found"

    published = le.Operation(
        name="research", provider="anthropic", model="claude-sonnet-4-6",
        thinking=le.Thinking(budget_tokens=2048),
        server_tools=(le.ServerTool(type="web_search_20250305", name="web_search",
                                    max_uses=10),),
        betas=("compact-2026-01-12",), context_management={"edits": [{"type": "compact_20260112"}]},
        limits=le.Limits(credit_hold=10**9))
    result = await engine.run(published, "go", tools=[lookup])
    assert result.outcome is le.Outcome.COMPLETED
    bill_1 = (usd(55_196 + 220, SONNET_IN) + usd(125 + 8, SONNET_OUT)
              + 10 * SEARCH_PER_K / 1000)
    bill_2 = usd(412, SONNET_IN) + usd(89, SONNET_OUT) + usd(823, OPUS_IN) + usd(1_612, OPUS_OUT)
    costs = [row["cost_nanousd"] for row in ledger.attempts.values()]
    assert costs == [to_nanousd(bill_1), to_nanousd(bill_2)]
    assert result.cost_usd == nanousd_to_usd(to_nanousd(bill_1) + to_nanousd(bill_2))
    assert result.usage.web_search_requests == 10
    assert result.usage.input_tokens == 55_196 + 220 + 412 + 823
    assert len(result.usage.iterations) == 4


# OpenAI gpt-5 (genai-prices, from 2026-10-12): default $1.25 / $10 per MTok in / out;
# flex $0.625 / $5; priority $2.50 / $20.
GPT5_IN, GPT5_OUT = Decimal("1.25"), Decimal(10)
GPT5_FLEX_IN, GPT5_FLEX_OUT = Decimal("0.625"), Decimal(5)
GPT5_PRIORITY_IN, GPT5_PRIORITY_OUT = Decimal("2.50"), Decimal(20)


@pytest.mark.parametrize(("tier", "rate_in", "rate_out"), [
    (None, GPT5_IN, GPT5_OUT), ("default", GPT5_IN, GPT5_OUT),
    ("flex", GPT5_FLEX_IN, GPT5_FLEX_OUT), ("priority", GPT5_PRIORITY_IN, GPT5_PRIORITY_OUT),
])
def test_tokens_are_priced_at_the_tier_that_served_them(
    tier: str | None, rate_in: Decimal, rate_out: Decimal
) -> None:
    """The tier the reply reports selects genai-prices' rates for it."""
    usage = le.Usage(input_tokens=10_000, output_tokens=2_000, service_tier=tier)
    priced = GENAI.price("openai", "gpt-5", usage, AT)
    assert priced is not None
    assert priced.cost_nanousd == to_nanousd(usd(10_000, rate_in) + usd(2_000, rate_out))


def test_a_tier_without_rates_leaves_the_attempt_unpriced() -> None:
    """genai-prices has no ``scale`` rates for gpt-5 and no Anthropic priority rates."""
    assert GENAI.price("openai", "gpt-5", le.Usage(input_tokens=1, service_tier="scale"),
                       AT) is None
    assert GENAI.price("anthropic", "claude-sonnet-4-5",
                       le.Usage(input_tokens=1, service_tier="priority"), AT) is None
    assert GENAI.price("anthropic", "claude-sonnet-4-5",
                       le.Usage(input_tokens=1, service_tier="standard"), AT) is not None


def test_a_book_entry_multiplies_tokens_by_its_tier_multiplier() -> None:
    """Tokens at 2x on priority; the web search fee is not multiplied."""
    entry = le.ModelPrice(provider="openai", model="m", input_per_mtok=GPT5_IN,
                          output_per_mtok=GPT5_OUT, web_search_per_k=SEARCH_PER_K,
                          service_tier_multipliers={"priority": 2, "flex": "0.5"})
    book = le.PriceBook([entry], fallback=False)
    usage = le.Usage(input_tokens=10_000, output_tokens=2_000, web_search_requests=1,
                     service_tier="priority")
    priced = book.price("openai", "m", usage, AT)
    fee = SEARCH_PER_K / 1000
    assert priced is not None and priced.fee_nanousd == to_nanousd(fee)
    assert priced.cost_nanousd == to_nanousd(2 * (usd(10_000, GPT5_IN) + usd(2_000, GPT5_OUT))
                                             + fee)
    assert book.price("openai", "m", le.Usage(input_tokens=1, service_tier="scale"), AT) is None
    assert book.knows_tier("openai", "m", "flex", AT)
    assert not book.knows_tier("openai", "m", "scale", AT)
    assert hash(entry) == hash(le.ModelPrice(
        provider="openai", model="m", input_per_mtok=GPT5_IN, output_per_mtok=GPT5_OUT,
        web_search_per_k=SEARCH_PER_K, service_tier_multipliers={"priority": 2, "flex": "0.5"}))
    with pytest.raises(le.ConfigError) as caught:
        le.ModelPrice(provider="p", model="m", input_per_mtok=1, output_per_mtok=1,
                      service_tier_multipliers={"flex": 0.5})  # type: ignore[dict-item]
    assert caught.value.field == "service_tier_multipliers.flex"


def test_a_published_tier_is_priceable_only_with_its_rates() -> None:
    """flex on gpt-5 has genai-prices rates; scale has none, and is refused."""
    assert GENAI.unpriced_features("openai", "gpt-5", Features(service_tier="flex"), AT) == ()
    assert GENAI.unpriced_features("openai", "gpt-5", Features(service_tier="scale"), AT) == (
        "service_tier 'scale': no rates for that tier",)


# Claude Sonnet 4.5 past 200,000 input tokens, with the 1M context window on: $6 in,
# $22.50 out per MTok (genai-prices' tier; Anthropic bills it only with that window).
SONNET_LONG_IN, SONNET_LONG_OUT = Decimal(6), Decimal("22.5")


@pytest.mark.parametrize(("betas", "rate_in", "rate_out"), [
    ((), SONNET_IN, SONNET_OUT),
    (("context-1m-2025-08-07",), SONNET_LONG_IN, SONNET_LONG_OUT),
])
def test_r07_a_search_loop_past_200k_is_billed_long_context_rates_only_with_the_1m_window(
        betas: tuple[str, ...], rate_in: Decimal, rate_out: Decimal, tmp_path: Path) -> None:
    """A streamed web search loop of Claude Sonnet 4.5, as the API reports it: its
    ``message_delta`` adds up every sampling pass (482,529 input tokens, 5
    searches), though no pass of a request without the 1M context beta can pass
    200,000. Driven through the real SDK and the engine, the ledger's attempt
    is billed the standard rates without the beta, the long-context ones with it.
    A replay of the run is estimated and billed as the run was."""
    import anyio

    from loopengine.providers import (
        AnthropicProvider,
        Provider,
        RecordingProvider,
        ReplayProvider,
    )
    from loopengine.testing import FakeAnthropicServer
    from loopengine.testing import Reply as WireReply

    loop = le.Usage(input_tokens=482_529, output_tokens=1_310, reasoning_tokens=261,
                    web_search_requests=5)
    searched = le.Operation(
        name="research", provider="anthropic", model="claude-sonnet-4-5",
        server_tools=(le.ServerTool(type="web_search_20250305", name="web_search",
                                    max_uses=10),),
        betas=betas, max_output_tokens=64_000, limits=le.Limits(max_turns=5))
    ledger, replayed = MemoryLedger(), MemoryLedger()
    estimates: list[le.Estimate] = []
    recording = tmp_path / "run.jsonl"

    async def run(provider: Provider, ledger: MemoryLedger) -> le.RunResult:
        engine = le.Engine(provider, ledger=ledger, prices=GENAI, clock=FakeClock(wall_start=AT))
        estimates.append(engine.estimate(searched, "search"))
        return await engine.run(searched, "search")

    async def main() -> tuple[le.RunResult, le.RunResult]:
        with FakeAnthropicServer([WireReply.text("summary", usage=loop)]) as server:
            async with AnthropicProvider(api_key="test", base_url=server.url,
                                         stream=True) as provider:
                recorded = await run(RecordingProvider(provider, recording), ledger)
        return recorded, await run(ReplayProvider(recording), replayed)

    result, again = anyio.run(main)
    # The estimate prices each turn as its attempt would be: its last turns pass
    # 200,000 input tokens, at the long-context rates only with the beta.
    estimate, replay_estimate = estimates
    assert replay_estimate == estimate
    assert estimate.turn_input_tokens[-1] > 200_000 > estimate.turn_input_tokens[0]
    tier = {True: (rate_in, rate_out), False: (SONNET_IN, SONNET_OUT)}
    assert estimate.cost_usd == sum(
        (nanousd_to_usd(to_nanousd(usd(t, tier[t > 200_000][0])
                                   + usd(64_000, tier[t > 200_000][1]) + 10 * SEARCH_PER_K / 1000))
         for t in estimate.turn_input_tokens), Decimal(0))
    assert result.outcome is le.Outcome.COMPLETED
    (attempt,) = ledger.attempts.values()
    fee = 5 * SEARCH_PER_K / 1000
    bill = usd(482_529, rate_in) + usd(1_310, rate_out) + fee
    assert (attempt["input_tokens"], attempt["output_tokens"], attempt["web_search_requests"]) \
        == (482_529, 1_310, 5)
    assert (attempt["cost_nanousd"], attempt["fee_nanousd"]) == (to_nanousd(bill),
                                                                to_nanousd(fee))
    assert (again.outcome, again.cost_usd) == (result.outcome, result.cost_usd)
    assert [(row["cost_nanousd"], row["fee_nanousd"]) for row in replayed.attempts.values()] \
        == [(attempt["cost_nanousd"], attempt["fee_nanousd"])]
