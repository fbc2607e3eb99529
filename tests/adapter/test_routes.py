"""Named routes (docs/providers.md): one engine serves several routes of one vendor;
each run is recorded and priced as the vendor's (``anthropic:<model>``), and an
operation runs only on the route it names (R13). Through AnthropicProvider, the
real SDK and the loopback servers."""

from __future__ import annotations

import pytest

import loopengine as le
from loopengine.persistence import MemoryLedger
from loopengine.providers import AnthropicProvider
from loopengine.testing import FakeAnthropicServer, Reply

from ..conftest import MODEL, PRICES


def credential(headers: dict[str, str] | object) -> str:
    """The key a request carried (``x-api-key``, or a bearer token)."""
    assert isinstance(headers, dict)
    return str(headers.get("x-api-key") or headers.get("authorization") or "")


def test_a_route_must_be_a_name() -> None:
    with pytest.raises(le.ConfigError) as info:
        AnthropicProvider(api_key="k", route="")
    assert info.value.field == "route"


async def test_two_routes_of_one_vendor_in_one_engine(
    fake_anthropic_server: FakeAnthropicServer,
) -> None:
    """``anthropic`` and ``anthropic-eu`` on two servers (two keys, two regions):
    each operation reaches its own route's server, both runs are recorded
    ``anthropic:<model>`` and priced at the vendor's price."""
    with FakeAnthropicServer() as eu:
        fake_anthropic_server.add(Reply.text("from us"))
        eu.add(Reply.text("from eu"))
        us_url = fake_anthropic_server.url
        async with AnthropicProvider(api_key="us-key", base_url=us_url) as us_p, \
                AnthropicProvider(api_key="eu-key", base_url=eu.url, route="anthropic-eu",
                                  stream=True) as eu_p:
            assert (us_p.name, us_p.vendor, eu_p.name, eu_p.vendor) == (
                "anthropic", "anthropic", "anthropic-eu", "anthropic")
            ledger = MemoryLedger()
            engine = le.Engine({"anthropic": us_p, "anthropic-eu": eu_p}, ledger=ledger,
                               prices=PRICES)
            us_op = le.Operation(name="a.us", provider="anthropic", model=MODEL,
                                 limits=le.Limits(credit_hold=10_000))
            eu_op = le.Operation(name="a.eu", provider="anthropic-eu", model=MODEL,
                                 limits=le.Limits(credit_hold=10_000))
            us = await engine.run(us_op, "hi")
            eu_result = await engine.run(eu_op, "hi")
    assert (us.answer, eu_result.answer) == ("from us", "from eu")
    assert len(fake_anthropic_server.requests) == len(eu.requests) == 1
    assert "us-key" in credential(fake_anthropic_server.requests[0].headers)
    assert "eu-key" in credential(eu.requests[0].headers)
    assert {row["served_by"] for row in ledger.attempts.values()} == {f"anthropic:{MODEL}"}
    assert us.cost_usd == eu_result.cost_usd > 0 and not us.unpriced and not eu_result.unpriced
    assert {row["provider"] for row in ledger.invocations.values()} == {
        "anthropic", "anthropic-eu"}


async def test_an_operation_never_moves_to_another_route_of_its_vendor(
    fake_anthropic_server: FakeAnthropicServer,
) -> None:
    """R13: an engine serving only ``anthropic-eu`` refuses an ``anthropic`` operation."""
    async with AnthropicProvider(api_key="k", base_url=fake_anthropic_server.url,
                                 route="anthropic-eu") as provider:
        engine = le.Engine(provider, prices=PRICES)
        with pytest.raises(le.ConfigError, match="never substitutes"):
            await engine.run(le.Operation(name="a", provider="anthropic", model=MODEL), "hi")
    assert fake_anthropic_server.requests == []


async def test_a_named_routes_spans_name_the_vendor(
    fake_anthropic_server: FakeAnthropicServer,
) -> None:
    """OpenTelemetry's gen_ai.provider.name is the vendor (``anthropic``) on a run of
    the route ``anthropic-eu``."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from loopengine.otel import OpenTelemetryObserver

    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    fake_anthropic_server.add(Reply.text("hi"))
    async with AnthropicProvider(api_key="k", base_url=fake_anthropic_server.url,
                                 route="anthropic-eu") as provider:
        engine = le.Engine(provider, prices=PRICES,
                           observers=[OpenTelemetryObserver(tracer_provider)])
        await engine.run(le.Operation(name="a.eu", provider="anthropic-eu", model=MODEL), "hi")
    spans = exporter.get_finished_spans()
    assert spans and {(s.attributes or {})["gen_ai.provider.name"] for s in spans} == {
        "anthropic"}
