"""The five-minute / one-hour split of a reply's cache writes, priced honestly,
through the real SDK against a loopback Messages API.

A streamed reply reports the split (``usage.cache_creation``) in
``message_start`` only; ``message_delta`` has the cumulative
``cache_creation_input_tokens`` alone (the SDK's ``MessageDeltaUsage`` has no
split). In a server tool loop (web search, web fetch, code execution, MCP)
the model samples more than once and ``message_delta``'s counts are the sums
of every pass, while ``message_start``'s are the first pass's (a recorded web
search stream of the API: ``input_tokens`` 2068 at the start, 22397 at the
end). The writes past the split take the lifetime of the request's markers;
with markers of both lifetimes their split is unknown, so they are priced as
five-minute writes and the attempt's usage is flagged a floor.
"""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator, Mapping
from decimal import Decimal
from typing import Any

import pytest

import loopengine as le
from loopengine.persistence import MemoryLedger
from loopengine.providers import AnthropicProvider
from loopengine.testing import FakeAnthropicServer, FakeClock, RecordedRequest, Reply
from loopengine.testing._anthropic_server import _sse
from loopengine.testing._loopback import Frame

from ..conftest import MODEL

PRICES = le.PriceBook([le.ModelPrice(
    provider="anthropic", model=MODEL, input_per_mtok=Decimal(3), output_per_mtok=Decimal(15),
    cache_read_per_mtok=Decimal("0.3"), cache_write_per_mtok=Decimal("3.75"),
    cache_write_1h_per_mtok=Decimal(6), web_search_per_k=Decimal(10))],
    credits_per_usd=Decimal(1000))

# The whole reply: what message_delta reports, summed over its passes.
WHOLE = le.Usage(input_tokens=22_397, output_tokens=637, cache_read_tokens=4000,
                 cache_write_tokens=3000, web_search_requests=2)


class ServerToolLoop(FakeAnthropicServer):
    """Streams a reply as the API streams a server tool loop: ``message_start``
    carries the first pass's input and cache counts (``first``, with its split),
    ``message_delta`` the cumulative counts of every pass, without a split."""

    def __init__(self, first: Mapping[str, Any]) -> None:
        super().__init__()
        self.first = dict(first)

    def _frames(self, message: dict[str, Any], reply: Reply,
                request: RecordedRequest) -> list[Frame]:
        frames = super()._frames(message, reply, request)
        start = json.loads(frames[0].data.decode().split("data: ", 1)[1])
        start["message"]["usage"].update(self.first)
        delta_at = next(i for i, frame in enumerate(frames)
                        if frame.data.startswith(b"event: message_delta"))
        delta = json.loads(frames[delta_at].data.decode().split("data: ", 1)[1])
        delta["usage"]["input_tokens"] = reply.usage.input_tokens if reply.usage else 0
        assert "cache_creation" not in delta["usage"]
        frames[0] = Frame(_sse("message_start", start), frames[0].usage)
        frames[delta_at] = Frame(_sse("message_delta", delta), frames[delta_at].usage)
        return frames


def first_pass(five_minutes: int, one_hour: int) -> dict[str, Any]:
    return {"input_tokens": 2068, "cache_read_input_tokens": 0,
            "cache_creation_input_tokens": five_minutes + one_hour,
            "cache_creation": {"ephemeral_5m_input_tokens": five_minutes,
                               "ephemeral_1h_input_tokens": one_hour}}


@pytest.fixture
async def run() -> AsyncIterator[Any]:
    providers: list[AnthropicProvider] = []

    async def served(first: Mapping[str, Any], cache: le.CachePolicy,
                     system: Any = "Be brief.") -> tuple[le.RunResult, MemoryLedger]:
        with ServerToolLoop(first) as server:
            server.add(Reply.text("It is sunny.", usage=WHOLE))
            provider = AnthropicProvider(api_key="k", base_url=server.url, stream=True)
            providers.append(provider)
            ledger = MemoryLedger()
            engine = le.Engine(provider, ledger=ledger, prices=PRICES, clock=FakeClock(),
                               rng=random.Random(7))
            operation = le.Operation(name="t", provider="anthropic", model=MODEL,
                                     max_output_tokens=1024, cache=cache)
            result = await engine.run(operation, "Weather in San Francisco?", system=system)
        return result, ledger

    yield served
    for provider in providers:
        await provider.aclose()


def cost(five_minutes: int, one_hour: int) -> Decimal:
    tokens = (Decimal(22_397) * 3 + Decimal(637) * 15 + Decimal(4000) * Decimal("0.3")
              + Decimal(five_minutes) * Decimal("3.75") + Decimal(one_hour) * 6)
    return tokens / 1_000_000 + Decimal(2) * 10 / 1000


async def test_writes_past_the_split_of_one_hour_markers_are_one_hour_writes(run: Any) -> None:
    """Every marker of the request lives an hour: so does every write."""
    result, _ = await run(first_pass(0, 1000), le.CachePolicy(system=True, conversation=True,
                                                                 ttl="1h"))
    assert (result.usage.cache_write_tokens, result.usage.cache_write_1h_tokens) == (3000, 3000)
    assert result.usage.input_tokens == 22_397 and result.attempts.usage_complete
    assert result.cost_usd == cost(0, 3000)


async def test_writes_past_the_split_of_five_minute_markers_are_five_minute_writes(
    run: Any
) -> None:
    """Every marker lives five minutes: the excess is five-minute writes, exactly."""
    result, ledger = await run(first_pass(1000, 0), le.CachePolicy(system=True,
                                                                   conversation=True))
    assert (result.usage.cache_write_tokens, result.usage.cache_write_1h_tokens) == (3000, 0)
    assert result.attempts.usage_complete
    (row,) = ledger.attempts.values()
    assert row["usage_approx"] == 0
    assert result.cost_usd == cost(3000, 0)


async def test_writes_past_the_split_of_mixed_markers_are_a_flagged_floor(run: Any) -> None:
    """A one-hour marker of the caller's on the system prompt and the policy's
    five-minute one on the conversation: the 2,000 writes past the split may
    be either, so they are priced at the cheaper rate and the attempt's usage
    is a floor, in the result and the ledger."""
    system = [{"type": "text", "text": "Be brief.",
               "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    result, ledger = await run(first_pass(500, 500), le.CachePolicy(conversation=True),
                               system=system)
    assert (result.usage.cache_write_tokens, result.usage.cache_write_1h_tokens) == (3000, 500)
    assert not result.attempts.usage_complete
    settle = result.attempt_log[0].settle
    assert settle is not None and settle.outcome == "ok" and settle.usage_approx
    (row,) = ledger.attempts.values()
    assert row["usage_approx"] == 1
    assert result.cost_usd == cost(2500, 500)


async def test_a_stream_whose_split_covers_its_writes_is_exact(run: Any) -> None:
    """The common shape (one pass, or a loop whose later passes wrote nothing):
    the split of message_start is the whole, mixed markers or not."""
    system = [{"type": "text", "text": "Be brief.",
               "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    result, _ = await run(first_pass(1000, 2000), le.CachePolicy(conversation=True),
                          system=system)
    assert (result.usage.cache_write_tokens, result.usage.cache_write_1h_tokens) == (3000, 2000)
    assert result.attempts.usage_complete
    assert result.cost_usd == cost(1000, 2000)


class NoSplit(FakeAnthropicServer):
    """Answers in JSON with ``cache_creation_input_tokens`` and no
    ``cache_creation`` split, as replies did before the API reported one (and
    as a relay that drops unknown fields may)."""

    def _message(self, reply: Reply, request: RecordedRequest, number: int) -> dict[str, Any]:
        message = super()._message(reply, request, number)
        message["usage"].pop("cache_creation")
        return message


@pytest.mark.parametrize(("markers", "one_hour", "floor"), [
    (("1h", "1h"), 3000, False), (("5m", "5m"), 0, False), (("1h", "5m"), 0, True)])
async def test_a_reply_without_a_split_takes_its_markers_lifetime(
    markers: tuple[str, str], one_hour: int, floor: bool
) -> None:
    """Without a split the writes are of the lifetime of the request's markers;
    of both lifetimes, priced as five-minute writes and flagged a floor."""
    system = [{"type": "text", "text": "Be brief.",
               "cache_control": {"type": "ephemeral", "ttl": markers[0]}}]
    with NoSplit() as server:
        server.add(Reply.text("ok", usage=le.Usage(input_tokens=10, output_tokens=1,
                                                   cache_write_tokens=3000,
                                                   cache_write_1h_tokens=3000)))
        provider = AnthropicProvider(api_key="k", base_url=server.url)
        try:
            engine = le.Engine(provider, prices=PRICES, clock=FakeClock())
            operation = le.Operation(name="t", provider="anthropic", model=MODEL,
                                     max_output_tokens=64,
                                     cache=le.CachePolicy(conversation=True, ttl=markers[1]))
            result = await engine.run(operation, "go", system=system)
        finally:
            await provider.aclose()
    assert (result.usage.cache_write_tokens, result.usage.cache_write_1h_tokens) == (3000,
                                                                                     one_hour)
    assert result.attempts.usage_complete is not floor


def test_the_sdks_message_delta_usage_has_no_split() -> None:
    """The shape the rule rests on: the SDK's ``MessageDeltaUsage`` carries the
    cumulative ``cache_creation_input_tokens`` and no ``cache_creation`` split
    (the message's ``Usage`` has both). Should a split arrive there, the
    streamed usage can take it instead of the markers' lifetime."""
    from anthropic.types import MessageDeltaUsage
    from anthropic.types import Usage as MessageUsage

    assert "cache_creation_input_tokens" in MessageDeltaUsage.model_fields
    assert "cache_creation" not in MessageDeltaUsage.model_fields
    assert "cache_creation" in MessageUsage.model_fields
