"""Fixtures for the tests that go through OpenAIResponsesProvider, the real ``openai``
SDK's ``responses.create`` and the loopback FakeOpenAIServer's ``/v1/responses``
(nothing in between is faked or patched).

The harness is the Chat route's with the provider swapped, so a scenario reads
the same through every provider.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from loopengine.providers import OpenAIResponsesProvider
from loopengine.testing import FakeClock, FakeOpenAIServer, RecordedRequest

from ..openai.conftest import MODEL, PRICES, OpenAIHarness, openai_operation

__all__ = ["MODEL", "PRICES", "ResponsesHarness", "function_outputs", "items",
           "openai_operation"]


class ResponsesHarness(OpenAIHarness):
    """An engine on an OpenAIResponsesProvider pointed at one FakeOpenAIServer."""

    provider_class = OpenAIResponsesProvider


@pytest.fixture
async def wire(fake_openai_server: FakeOpenAIServer,
               clock: FakeClock) -> AsyncIterator[ResponsesHarness]:
    """An engine factory on the fake server's Responses API, with the fake clock."""
    h = ResponsesHarness(fake_openai_server, clock)  # type: ignore[arg-type]
    try:
        yield h
    finally:
        await h.aclose()


def items(request: RecordedRequest) -> list[dict[str, Any]]:
    """The ``input`` items of a request."""
    return list(request.body["input"])


def function_outputs(request: RecordedRequest) -> list[dict[str, Any]]:
    """The ``function_call_output`` items of a request, in order."""
    return [i for i in items(request) if i.get("type") == "function_call_output"]
