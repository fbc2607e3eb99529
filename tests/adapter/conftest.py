"""Fixtures for the tests that go through AnthropicProvider, the real SDK and the
loopback FakeAnthropicServer (nothing in between is faked or patched)."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

import loopengine as le
from loopengine.persistence import MemoryLedger
from loopengine.providers import AnthropicProvider, Provider, RecordingProvider, ReplayProvider
from loopengine.providers._cache import cache_markers
from loopengine.testing import FakeAnthropicServer, FakeClock, RecordedRequest, ServerItem

from ..conftest import PRICES

FAST_RETRY = le.RetryPolicy(initial_wait=0.01, max_wait=0.02)
"""Real waits short enough for tests that run on the real clock."""

STREAMING = pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
"""Run a test once with JSON responses and once with server-sent events."""


class Harness:
    """An engine on an AnthropicProvider pointed at one FakeAnthropicServer."""

    def __init__(self, server: FakeAnthropicServer, clock: Any) -> None:
        self.server = server
        self.clock = clock
        self._providers: list[AnthropicProvider] = []

    def provider(self, *, stream: bool = False, **kwargs: Any) -> AnthropicProvider:
        """A provider on the server; closed when the test ends."""
        kwargs.setdefault("base_url", self.server.url)
        # Built from keywords, as a user builds it: the requests go through the
        # client a provider makes itself (on asyncio, the SDK's aiohttp one).
        provider = AnthropicProvider(api_key="test-key", stream=stream, **kwargs)
        self._providers.append(provider)
        return provider

    def engine(
        self, *script: ServerItem, stream: bool = False, provider_kwargs: Any = None,
        record: Path | None = None, **kwargs: Any,
    ) -> tuple[le.Engine, MemoryLedger]:
        """An engine whose provider will be served ``script``; its requests recorded
        at ``record`` (`RecordingProvider`), if given."""
        self.server.add(*script)
        provider: Provider = self.provider(stream=stream, **(provider_kwargs or {}))
        return self._engine(provider if record is None else RecordingProvider(provider, record),
                            **kwargs)

    def replay(self, recording: Path, **kwargs: Any) -> tuple[le.Engine, MemoryLedger]:
        """An engine on a `ReplayProvider` of ``recording``, as `engine` builds one."""
        return self._engine(ReplayProvider(recording), **kwargs)

    def _engine(self, provider: Provider, **kwargs: Any) -> tuple[le.Engine, MemoryLedger]:
        ledger = kwargs.pop("ledger", MemoryLedger())
        kwargs.setdefault("prices", PRICES)
        kwargs.setdefault("clock", self.clock)
        kwargs.setdefault("rng", random.Random(7))
        return le.Engine(provider, ledger=ledger, **kwargs), ledger

    @property
    def requests(self) -> list[RecordedRequest]:
        """What the server received."""
        return self.server.requests

    async def aclose(self) -> None:
        for provider in self._providers:
            await provider.aclose()


@asynccontextmanager
async def harness(server: FakeAnthropicServer, clock: Any) -> AsyncIterator[Harness]:
    """A `Harness` whose providers are closed afterwards."""
    h = Harness(server, clock)
    try:
        yield h
    finally:
        await h.aclose()


@pytest.fixture
async def wire(fake_anthropic_server: FakeAnthropicServer,
               clock: FakeClock) -> AsyncIterator[Harness]:
    """An engine factory on the fake server, with the fake clock."""
    async with harness(fake_anthropic_server, clock) as h:
        yield h


def markers_on_the_wire(request: RecordedRequest) -> int:
    """``cache_control`` markers in a request body."""
    return len(cache_markers(request.body))


def tool_results(request: RecordedRequest) -> list[dict[str, Any]]:
    """The tool_result blocks of the request's last message."""
    content = request.messages[-1]["content"]
    return [b for b in content if isinstance(b, dict) and b.get("type") == "tool_result"]


Factory = Callable[..., tuple[le.Engine, MemoryLedger]]
