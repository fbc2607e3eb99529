"""Fixtures for the tests that go through OpenAIProvider, the real ``openai`` SDK and
the loopback FakeOpenAIServer (nothing in between is faked or patched).

The harness is the Anthropic adapter tests' `Harness` with the provider
swapped, so a scenario reads the same through either provider.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from decimal import Decimal
from typing import Any

import pytest

import loopengine as le
from loopengine.providers import OpenAIProvider
from loopengine.testing import FakeClock, FakeOpenAIServer, RecordedRequest

from ..adapter.conftest import Harness
from ..conftest import operation

MODEL = "gpt-4o-mini"

# The Anthropic tests' prices on this route: one USD per million tokens in and
# out, one credit per micro-dollar, so a reply of 100 in / 20 out is 120 credits.
PRICES = le.PriceBook(
    [le.ModelPrice(provider="openai", model=MODEL, input_per_mtok=Decimal(1),
                   output_per_mtok=Decimal(1))],
    credits_per_usd=Decimal(1_000_000),
)


def openai_operation(**limits: Any) -> le.Operation:
    """The tests' operation (tests/conftest.py), published on the ``openai`` route."""
    return dataclasses.replace(operation(**limits), provider="openai", model=MODEL)


class OpenAIHarness(Harness):
    """An engine on an OpenAIProvider pointed at one FakeOpenAIServer."""

    provider_class: Any = OpenAIProvider
    """The provider class built on the server (the Responses route's harness
    builds `OpenAIResponsesProvider`)."""

    def provider(self, *, stream: bool = False, **kwargs: Any) -> Any:
        """A provider on the server; closed when the test ends."""
        kwargs.setdefault("base_url", self.server.base_url)
        # Built from keywords, as a user builds it: the requests go through the
        # client a provider makes itself (on asyncio, the SDK's aiohttp one).
        provider = self.provider_class(api_key="test-key", stream=stream, **kwargs)
        self._providers.append(provider)  # type: ignore[arg-type]
        return provider

    def _engine(self, provider: Any, **kwargs: Any) -> Any:
        """An engine on ``provider``, priced as `PRICES` unless told."""
        kwargs.setdefault("prices", PRICES)
        return super()._engine(provider, **kwargs)


@pytest.fixture
async def wire(fake_openai_server: FakeOpenAIServer,
               clock: FakeClock) -> AsyncIterator[OpenAIHarness]:
    """An engine factory on the fake Chat Completions server, with the fake clock."""
    h = OpenAIHarness(fake_openai_server, clock)  # type: ignore[arg-type]
    try:
        yield h
    finally:
        await h.aclose()


def tool_messages(request: RecordedRequest) -> list[dict[str, Any]]:
    """The ``tool`` messages at the end of a request's messages, in order."""
    messages = request.messages
    end = len(messages)
    start = end
    while start > 0 and messages[start - 1]["role"] == "tool":
        start -= 1
    return messages[start:end]


def calls_asked(request: RecordedRequest) -> list[dict[str, Any]]:
    """The ``tool_calls`` of the last assistant message of a request."""
    assistant = [m for m in request.messages if m["role"] == "assistant"][-1]
    return [{"id": c["id"], "name": c["function"]["name"],
             "input": json.loads(c["function"]["arguments"])} for c in assistant["tool_calls"]]
