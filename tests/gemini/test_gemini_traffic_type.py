"""Vertex AI reports the tier that served a Gemini request as
``usageMetadata.trafficType``: pay-as-you-go (``ON_DEMAND``) is the list price,
Priority and Flex pay-as-you-go are priced apart, and Provisioned Throughput is
not billed per token. The attempt is priced at that tier's rates, or left
unpriced where the prices have none: never priced at the list rates in silence.

Through GeminiProvider, the real ``google-genai`` SDK and a FakeGeminiServer whose
replies carry the ``trafficType`` Vertex AI sends.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest

import loopengine as le
from loopengine._pricing import to_nanousd
from loopengine.providers import GeminiProvider
from loopengine.testing import FakeGeminiServer, RecordedRequest, Reply

from ..pricing_support import priced_run

MODEL = "gemini-2.5-flash"
AT = datetime(2026, 11, 1, tzinfo=UTC)
MTOK = Decimal(1_000_000)
# genai-prices, Gemini 2.5 Flash (text): input $0.30, cached input $0.03, output $2.50
# per MTok; it has no Priority or Flex rates.
LIST_USD = (600 * Decimal("0.30") + 400 * Decimal("0.03") + 300 * Decimal("2.50")) / MTOK
SERVED = le.Usage(input_tokens=600, cache_read_tokens=400, output_tokens=300,
                  reasoning_tokens=100)
BOOK = le.PriceBook([le.ModelPrice(
    provider="google", model=MODEL, input_per_mtok="0.30", output_per_mtok="2.50",
    cache_read_per_mtok="0.03", service_tier_multipliers={"flex": Decimal("0.5")})])


class VertexUsageServer(FakeGeminiServer):
    """A FakeGeminiServer whose every ``usageMetadata`` names a ``trafficType``."""

    def __init__(self, traffic_type: str) -> None:
        super().__init__()
        self.traffic_type = traffic_type

    def _message(self, reply: Reply, request: RecordedRequest, number: int) -> dict[str, Any]:
        message = super()._message(reply, request, number)
        message["usageMetadata"]["trafficType"] = self.traffic_type
        return message


async def run(traffic_type: str, prices: le.PriceBook, stream: bool
              ) -> tuple[le.RunResult, dict[str, Any]]:
    with VertexUsageServer(traffic_type) as server:
        server.add(Reply.text("hello world", usage=SERVED))
        async with GeminiProvider(api_key="test-key", stream=stream,
                                  http_options={"base_url": server.url}) as provider:
            return await priced_run(provider, prices, le.Operation(
                name="op", provider="gemini", model=MODEL), AT)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("traffic_type", ["ON_DEMAND", "TRAFFIC_TYPE_UNSPECIFIED"])
async def test_pay_as_you_go_traffic_is_priced_at_list_rates(traffic_type: str,
                                                             stream: bool) -> None:
    """``ON_DEMAND`` (and an unspecified type) is the standard tier: list rates."""
    result, row = await run(traffic_type, le.PriceBook(), stream)
    assert result.usage.service_tier is None and not result.unpriced
    assert row["cost_nanousd"] == to_nanousd(LIST_USD) == 942_000


@pytest.mark.parametrize("stream", [False, True])
async def test_flex_traffic_is_priced_at_the_flex_rates_of_the_book(stream: bool) -> None:
    """``ON_DEMAND_FLEX`` is the ``flex`` tier: the book's multiplier prices it."""
    result, row = await run("ON_DEMAND_FLEX", BOOK, stream)
    assert result.usage.service_tier == "flex"
    assert row["cost_nanousd"] == to_nanousd(LIST_USD / 2) == 471_000


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("traffic_type", "tier"), [
    ("ON_DEMAND_PRIORITY", "priority"), ("ON_DEMAND_FLEX", "flex"),
    ("PROVISIONED_THROUGHPUT", "provisioned_throughput")])
async def test_a_tier_without_rates_is_unpriced_not_priced_at_list_rates(
    traffic_type: str, tier: str, stream: bool,
) -> None:
    """genai-prices has no Gemini Priority, Flex or Provisioned Throughput rates: the
    attempt keeps its tokens and is unpriced, as for an unknown model."""
    result, row = await run(traffic_type, le.PriceBook(), stream)
    assert result.usage.service_tier == tier
    assert result.unpriced and row["cost_nanousd"] is None
    assert row["input_tokens"] == 600 and result.cost_usd == 0
