"""Fixtures for the tests that go through AnthropicProvider on Amazon Bedrock and
Google Vertex AI: `AnthropicProvider.bedrock` / `.vertex`, the real SDK
platform clients (``AsyncAnthropicBedrock`` signing with fake AWS keys,
``AsyncAnthropicVertex`` with an access token, so no credential is looked up)
and the loopback FakeBedrockServer / FakeVertexServer (nothing in between is
faked or patched).

Every test that takes the ``platform`` fixture runs once per platform; the
harness is the Anthropic adapter tests' `Harness` with the provider swapped,
so a shared scenario reads the same on every route.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import pytest

import loopengine as le
from loopengine.providers import AnthropicProvider
from loopengine.testing import (
    ErrorReply,
    FakeAnthropicServer,
    FakeBedrockServer,
    FakeClock,
    FakeVertexServer,
)
from loopengine.testing._platform_servers import model_of

from .. import rule_scenarios as scenarios
from ..adapter.conftest import Harness
from ..conftest import operation

BEDROCK_MODEL = "us.anthropic.claude-sonnet-4-5-20250929-v1:0"
"""A Bedrock cross-region (US) inference profile: priced at genai-prices' regional rate."""
VERTEX_MODEL = "claude-sonnet-4-5@20250929"
"""A Vertex model id."""


@dataclass(frozen=True)
class Platform:
    """One platform a test runs on: its fake, its provider, its route."""

    name: str
    """``bedrock`` or ``vertex`` (the test id)."""
    route: str
    """The provider's vendor and default route."""
    model: str
    """The operation's model."""
    server: type[FakeAnthropicServer]
    """The fake's class."""
    build: Callable[..., AnthropicProvider]
    """Builds a provider on a started fake, from extra keywords."""
    transient: Callable[[], ErrorReply]
    """A retried fault in the platform's own shape."""
    malformed: Callable[[], ErrorReply]
    """A 400 in the platform's shape."""
    denied: Callable[[], ErrorReply]
    """A 403 in the platform's shape."""

    @property
    def prices(self) -> le.PriceBook:
        """One USD per million tokens in and out on this route, one credit per micro-dollar."""
        return le.PriceBook(
            [le.ModelPrice(provider=self.route, model=self.model, input_per_mtok=Decimal(1),
                           output_per_mtok=Decimal(1))],
            credits_per_usd=Decimal(1_000_000))

    def operation(self, **limits: Any) -> le.Operation:
        """The tests' operation (tests/conftest.py), published on this route."""
        return dataclasses.replace(operation(**limits), provider=self.route, model=self.model)

    @property
    def scenario_route(self) -> scenarios.Route:
        """This route for tests/rule_scenarios.py."""
        return scenarios.Route(operation=self.operation, prices=self.prices, model_of=model_of)


def _bedrock(server: FakeAnthropicServer, **kwargs: Any) -> AnthropicProvider:
    kwargs.setdefault("aws_region", "us-east-1")
    return AnthropicProvider.bedrock(base_url=server.url, aws_access_key="AKIDEXAMPLE",
                                     aws_secret_key="secret", **kwargs)


def _vertex(server: FakeAnthropicServer, **kwargs: Any) -> AnthropicProvider:
    assert isinstance(server, FakeVertexServer)
    kwargs.setdefault("region", "global")  # list rates (a region is priced apart)
    return AnthropicProvider.vertex(base_url=server.base_url, project_id="test-project",
                                    access_token="test-token", **kwargs)


BEDROCK = Platform(
    name="bedrock", route="aws-bedrock", model=BEDROCK_MODEL, server=FakeBedrockServer,
    build=_bedrock,
    transient=lambda: ErrorReply(status=503, type="ServiceUnavailableException",
                                 message="Bedrock is unable to process your request."),
    malformed=lambda: ErrorReply(status=400, type="ValidationException",
                                 message="max_tokens: Input should be greater than 0"),
    denied=lambda: ErrorReply(status=403, type="AccessDeniedException",
                              message="You don't have access to the model with the "
                                      "specified model ID."),
)
VERTEX = Platform(
    name="vertex", route="google-vertex", model=VERTEX_MODEL, server=FakeVertexServer,
    build=_vertex,
    # Vertex relays the model's own overload in the Messages API's shape.
    transient=ErrorReply.overloaded,
    malformed=lambda: ErrorReply(status=400, type="INVALID_ARGUMENT",
                                 message="Request contains an invalid argument."),
    denied=lambda: ErrorReply(status=403, type="PERMISSION_DENIED",
                              message="Permission 'aiplatform.endpoints.predict' denied."),
)


class PlatformHarness(Harness):
    """An engine on an AnthropicProvider of one platform, pointed at its fake."""

    def __init__(self, server: FakeAnthropicServer, clock: Any, platform: Platform) -> None:
        super().__init__(server, clock)
        self.platform = platform

    def provider(self, *, stream: bool = False, **kwargs: Any) -> AnthropicProvider:
        """A provider on the server; closed when the test ends."""
        provider = self.platform.build(self.server, stream=stream, **kwargs)
        self._providers.append(provider)
        return provider

    def engine(self, *script: Any, **kwargs: Any) -> Any:
        """An engine whose provider will be served ``script`` (priced as the
        platform's `Platform.prices`)."""
        kwargs.setdefault("prices", self.platform.prices)
        return super().engine(*script, **kwargs)


@pytest.fixture(params=[BEDROCK, VERTEX], ids=["bedrock", "vertex"])
def platform(request: pytest.FixtureRequest) -> Platform:
    """Each platform in turn."""
    chosen: Platform = request.param
    return chosen


@pytest.fixture
def platform_server(platform: Platform,
                    monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeAnthropicServer]:
    """The platform's fake, started; the environment holds no platform credentials
    or endpoints of its own."""
    for name in ("AWS_BEARER_TOKEN_BEDROCK", "ANTHROPIC_BEDROCK_BASE_URL",
                 "ANTHROPIC_VERTEX_BASE_URL", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    with platform.server() as server:
        yield server


@pytest.fixture
async def wire(platform_server: FakeAnthropicServer, clock: FakeClock,
               platform: Platform) -> AsyncIterator[PlatformHarness]:
    """An engine factory on the platform's fake, with the fake clock."""
    h = PlatformHarness(platform_server, clock, platform)
    try:
        yield h
    finally:
        await h.aclose()
