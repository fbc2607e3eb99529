"""Fixtures for the tests that go through GeminiProvider, the real ``google-genai``
SDK and the loopback FakeGeminiServer (nothing in between is faked or patched).

The harness is the Anthropic adapter tests' `Harness` with the provider
swapped, so a scenario reads the same through either provider.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from decimal import Decimal
from typing import Any

import pytest

import loopengine as le
from loopengine.providers import GeminiProvider
from loopengine.testing import FakeClock, FakeGeminiServer, RecordedRequest

from .. import rule_scenarios
from ..adapter.conftest import Harness
from ..conftest import operation

MODEL = "gemini-2.5-flash"

# The Anthropic tests' prices on this route: one USD per million tokens in and
# out, one credit per micro-dollar, so a reply of 100 in / 20 out is 120 credits.
# The price is the vendor's (google), whatever the route is called.
PRICES = le.PriceBook(
    [le.ModelPrice(provider="google", model=MODEL, input_per_mtok=Decimal(1),
                   output_per_mtok=Decimal(1))],
    credits_per_usd=Decimal(1_000_000),
)


def gemini_operation(**limits: Any) -> le.Operation:
    """The tests' operation (tests/conftest.py), published on the ``gemini`` route."""
    return dataclasses.replace(operation(**limits), provider="gemini", model=MODEL)


def model_in_path(request: RecordedRequest) -> str:
    """The model a Gemini request names: in its path, not its body."""
    return request.path.split("?")[0].rpartition("/models/")[2].partition(":")[0]


ROUTE = rule_scenarios.Route(operation=gemini_operation, prices=PRICES,
                             model_of=model_in_path, request_ids=False)
"""The Gemini route of the shared scenarios (tests/rule_scenarios.py,
tests/pause_scenarios.py)."""


class GeminiHarness(Harness):
    """An engine on a GeminiProvider pointed at one FakeGeminiServer."""

    def provider(self, *, stream: bool = False, **kwargs: Any) -> GeminiProvider:  # type: ignore[override]
        """A provider on the server; closed when the test ends."""
        options = dict(kwargs.pop("http_options", {}))
        options.setdefault("base_url", self.server.url)
        # Built from keywords, as a user builds it: the requests go through the
        # client a provider makes itself.
        provider = GeminiProvider(api_key="test-key", stream=stream, http_options=options,
                                  **kwargs)
        self._providers.append(provider)  # type: ignore[arg-type]
        return provider

    def engine(self, *script: Any, **kwargs: Any) -> Any:
        """An engine whose provider will be served ``script`` (priced as `PRICES`)."""
        kwargs.setdefault("prices", PRICES)
        return super().engine(*script, **kwargs)


@pytest.fixture
async def wire(fake_gemini_server: FakeGeminiServer,
               clock: FakeClock) -> AsyncIterator[GeminiHarness]:
    """An engine factory on the fake Gemini server, with the fake clock."""
    h = GeminiHarness(fake_gemini_server, clock)  # type: ignore[arg-type]
    try:
        yield h
    finally:
        await h.aclose()


def contents(request: RecordedRequest) -> list[dict[str, Any]]:
    """The ``contents`` a request sent."""
    return list(request.body["contents"])


def function_responses(request: RecordedRequest) -> list[dict[str, Any]]:
    """The ``functionResponse`` parts of a request's last content, in order."""
    return [part["functionResponse"] for part in contents(request)[-1]["parts"]
            if "functionResponse" in part]


def function_calls(request: RecordedRequest) -> list[dict[str, Any]]:
    """The ``functionCall`` parts of a request's last model content, in order."""
    model = [c for c in contents(request) if c["role"] == "model"][-1]
    return [part["functionCall"] for part in model["parts"] if "functionCall" in part]
