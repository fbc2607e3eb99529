"""Where and how fast a reply ran changes its price (docs/pricing.md): Anthropic reports
``usage.inference_geo`` (``us``: US-only inference, 1.1x every token price) and
``usage.speed`` (``fast``: fast mode, the model's fast rates). A `ModelPrice`
multiplies its token prices by its ``inference_geo_multipliers`` and
``speed_multipliers`` as it does by its ``service_tier_multipliers``; genai-prices
has fast rates of its own; the US-only multiplier is the vendor's documented one.

Every expected price is computed here from the rates, to the nano-USD.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest

import loopengine as le
from loopengine._pricing import to_nanousd
from loopengine.providers import AnthropicProvider
from loopengine.providers._base import priced_geo, priced_speed
from loopengine.testing import FakeAnthropicServer, FakeVertexServer, Reply

from .pricing_support import priced_run

AT = datetime(2026, 11, 1, tzinfo=UTC)
MTOK = Decimal(1_000_000)

# A book entry: $3 in, $15 out, $0.30 cache reads per MTok, $10 per 1,000 searches.
BOOK = le.PriceBook([le.ModelPrice(
    provider="anthropic", model="claude-opus-4-6", input_per_mtok=3, output_per_mtok=15,
    cache_read_per_mtok="0.30", web_search_per_k=10,
    service_tier_multipliers={"priority": 2},
    inference_geo_multipliers={"us": "1.1"}, speed_multipliers={"fast": 6})])

GENAI = le.PriceBook()
# genai-prices: Claude Opus 4.8 $5 / $25 per MTok, fast mode $10 / $50;
# Claude Opus 4.6 $5 / $25. Anthropic's US-only inference: 1.1x.
OPUS48_FAST_IN, OPUS48_FAST_OUT = Decimal(10), Decimal(50)
OPUS_IN, OPUS_OUT = Decimal(5), Decimal(25)
US = Decimal("1.1")


def usage(**served: Any) -> le.Usage:
    return le.Usage(input_tokens=1_000, output_tokens=200, cache_read_tokens=500,
                    web_search_requests=2, **served)


def tokens_usd() -> Decimal:
    """The book's tokens of `usage` at list rates: $0.00615."""
    return (1_000 * Decimal(3) + 200 * Decimal(15) + 500 * Decimal("0.30")) / MTOK


@pytest.mark.parametrize(("served", "factor"), [
    ({}, Decimal(1)),
    ({"inference_geo": "us"}, US),
    ({"speed": "fast"}, Decimal(6)),
    ({"inference_geo": "us", "speed": "fast"}, US * 6),
    ({"inference_geo": "us", "speed": "fast", "service_tier": "priority"}, US * 12),
])
def test_a_book_entry_multiplies_tokens_not_fees(served: dict[str, str], factor: Decimal,
                                                 ) -> None:
    """Each multiplier applies to every token price; the web search fee is not
    multiplied; the fee part is the fee alone."""
    priced = BOOK.price("anthropic", "claude-opus-4-6", usage(**served), AT)
    assert priced is not None
    fee = 2 * Decimal(10) / 1000
    assert priced.cost_nanousd == to_nanousd(tokens_usd() * factor + fee)
    assert priced.fee_nanousd == to_nanousd(fee) == 20_000_000
    if factor == US * 6:
        assert priced.cost_nanousd == 60_590_000  # $0.04059 of tokens + $0.02 of searches


@pytest.mark.parametrize("served", [{"inference_geo": "eu"}, {"speed": "turbo"}])
def test_a_geo_or_speed_the_entry_does_not_list_is_unpriced(served: dict[str, str]) -> None:
    """Never a silent list price: an attempt the entry has no rates for is unpriced."""
    assert BOOK.price("anthropic", "claude-opus-4-6", usage(**served), AT) is None


def test_genai_prices_fast_rates_and_the_documented_us_multiplier() -> None:
    """Models the book does not list: fast mode at genai-prices' own fast rates, US-only
    inference at 1.1x (Anthropic documents it; genai-prices has no such unit), both
    together multiplied; a speed genai-prices has no rates for is unpriced."""
    plain = le.Usage(input_tokens=10_000, output_tokens=2_000)
    fast = GENAI.price("anthropic", "claude-opus-4-8",
                       le.Usage(input_tokens=10_000, output_tokens=2_000, speed="fast"), AT)
    assert fast is not None
    fast_usd = (10_000 * OPUS48_FAST_IN + 2_000 * OPUS48_FAST_OUT) / MTOK
    assert fast.cost_nanousd == to_nanousd(fast_usd) == 200_000_000
    us = GENAI.price("anthropic", "claude-opus-4-6",
                     le.Usage(input_tokens=10_000, output_tokens=2_000, inference_geo="us"), AT)
    assert us is not None
    assert us.cost_nanousd == to_nanousd((10_000 * OPUS_IN + 2_000 * OPUS_OUT) / MTOK * US) \
        == 110_000_000
    both = GENAI.price("anthropic", "claude-opus-4-8", le.Usage(
        input_tokens=10_000, output_tokens=2_000, speed="fast", inference_geo="us"), AT)
    assert both is not None and both.cost_nanousd == to_nanousd(fast_usd * US)
    assert GENAI.price("anthropic", "claude-opus-4-6", le.Usage(
        input_tokens=1, speed="fast"), AT) is None  # no fast rates for Opus 4.6 there
    standard = GENAI.price("anthropic", "claude-opus-4-8", plain, AT)
    assert standard is not None and standard.cost_nanousd == 100_000_000


def test_standard_values_are_not_kept_and_sums_keep_what_their_parts_report() -> None:
    """``global`` and ``standard`` are the list rates: a reply naming them keeps None;
    a sum keeps a geo or speed its parts agree on, None when they differ."""
    assert (priced_geo("global"), priced_geo("us"), priced_geo(None)) == (None, "us", None)
    assert (priced_speed("standard"), priced_speed("fast")) == (None, "fast")
    us_fast = le.Usage(input_tokens=1, inference_geo="us", speed="fast")
    assert (us_fast + us_fast).inference_geo == "us"
    assert (us_fast + le.Usage(input_tokens=1)).speed == "fast"
    assert (us_fast + le.Usage(input_tokens=1, speed="slow")).speed is None
    with pytest.raises(le.ConfigError) as raised:
        le.Usage(speed="")
    assert raised.value.field == "speed"
    with pytest.raises(le.ConfigError) as raised:
        le.ModelPrice(provider="anthropic", model="m", input_per_mtok=1, output_per_mtok=1,
                      speed_multipliers={"fast": 6.0})  # type: ignore[dict-item]
    assert raised.value.field == "speed_multipliers.fast"


async def run_served(server: FakeAnthropicServer, served: le.Usage, prices: le.PriceBook,
                     model: str, *, stream: bool) -> tuple[le.RunResult, dict[str, Any]]:
    """One completed run on ``model`` whose reply reports ``served``, through the real
    anthropic SDK on ``server``: its result and its one attempt row."""
    server.add(Reply.text("served", usage=served))
    async with AnthropicProvider(api_key="test", base_url=server.url,
                                 stream=stream) as provider:
        return await priced_run(provider, prices, le.Operation(
            name="op", provider="anthropic", model=model), AT)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_reply_s_geo_and_speed_reach_the_ledger_s_cost_through_the_sdk(
    fake_anthropic_server: FakeAnthropicServer, stream: bool,
) -> None:
    """The fake Messages API reports ``inference_geo: us`` and ``speed: fast`` in the
    reply's usage (as the API does); through the real anthropic SDK the attempt is
    priced at 1.1 x 6 the list rates, to the nano-USD, and the run's usage keeps them."""
    served = le.Usage(input_tokens=1_000, output_tokens=200, inference_geo="us",
                      speed="fast")
    result, row = await run_served(fake_anthropic_server, served, BOOK, "claude-opus-4-6",
                                   stream=stream)
    assert (result.usage.inference_geo, result.usage.speed) == ("us", "fast")
    expected = to_nanousd((1_000 * Decimal(3) + 200 * Decimal(15)) / MTOK * US * 6)
    assert row["cost_nanousd"] == expected == 39_600_000


@pytest.mark.parametrize("stream", [False, True])
async def test_a_reply_whose_geo_is_not_available_is_priced_at_list_rates(
    fake_anthropic_server: FakeAnthropicServer, stream: bool,
) -> None:
    """Real Messages replies on a model that takes no ``inference_geo`` report
    ``"inference_geo": "not_available"``: that is the list price, not an unknown geo,
    so the attempt is priced (by genai-prices, and by a book entry without geo
    multipliers) instead of being left unpriced."""
    served = le.Usage(input_tokens=2, output_tokens=301, cache_read_tokens=14_265,
                      cache_write_tokens=10_408, cache_write_1h_tokens=10_000,
                      inference_geo="not_available")
    plain_book = le.PriceBook([le.ModelPrice(
        provider="anthropic", model="claude-opus-4-6", input_per_mtok=3, output_per_mtok=15,
        cache_read_per_mtok="0.30")])
    # genai-prices, Claude Sonnet 4.5: $3 in, $15 out, $0.30 cache read, $3.75 5-minute
    # and $6 one-hour cache writes per MTok.
    sonnet_usd = (2 * Decimal(3) + 301 * Decimal(15) + 14_265 * Decimal("0.30")
                  + 408 * Decimal("3.75") + 10_000 * Decimal(6)) / MTOK
    # The book entry prices cache writes as input.
    book_usd = (2 * Decimal(3) + 301 * Decimal(15) + 14_265 * Decimal("0.30")
                + 10_408 * Decimal(3)) / MTOK
    for prices, model, usd in ((GENAI, "claude-sonnet-4-5", sonnet_usd),
                               (plain_book, "claude-opus-4-6", book_usd)):
        result, row = await run_served(fake_anthropic_server, served, prices, model,
                                       stream=stream)
        assert not result.unpriced and result.usage.inference_geo is None
        assert row["cost_nanousd"] == to_nanousd(usd)
        assert result.cost_usd == Decimal(to_nanousd(usd)) / 10**9
    assert to_nanousd(sonnet_usd) == 70_330_500


@pytest.mark.parametrize("stream", [False, True])
async def test_a_vertex_region_prices_a_reply_whose_geo_is_not_available(stream: bool) -> None:
    """A Vertex regional endpoint decides the price (docs/providers.md): a reply there
    that says ``not_available`` is served in the endpoint's region, priced at its
    multiplier, not left unpriced nor priced at the global rate."""
    model = "claude-sonnet-4-5@20250929"
    book = le.PriceBook([le.ModelPrice(
        provider="google-vertex", model=model, input_per_mtok=3, output_per_mtok=15,
        inference_geo_multipliers={"us-east5": Decimal("1.1")})])
    with FakeVertexServer() as server:
        server.add(Reply.text("regional", usage=le.Usage(
            input_tokens=1_000, output_tokens=200, inference_geo="not_available")))
        async with AnthropicProvider.vertex(base_url=server.base_url, region="us-east5",
                                            project_id="p", access_token="t",
                                            stream=stream) as provider:
            result, row = await priced_run(provider, book, le.Operation(
                name="op", provider="google-vertex", model=model), AT)
    assert result.usage.inference_geo == "us-east5" and not result.unpriced
    assert row["cost_nanousd"] == to_nanousd(tokens_at(1_000, 200) * US) == 6_600_000


def tokens_at(input_tokens: int, output_tokens: int) -> Decimal:
    """USD of tokens at $3 in / $15 out per MTok."""
    return (input_tokens * Decimal(3) + output_tokens * Decimal(15)) / MTOK
