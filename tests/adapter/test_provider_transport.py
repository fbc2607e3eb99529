"""The client a provider builds from keywords: the SDK's aiohttp client on asyncio,
the SDK's own httpx client on trio and behind a proxy, each with the
``max_connections`` limit, on both SDK providers."""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import httpx2
import pytest

import loopengine as le
from loopengine.providers import AnthropicProvider, OpenAIProvider
from loopengine.providers._clients import DEFAULT_MAX_CONNECTIONS
from loopengine.testing import FakeAnthropicServer, Reply

PROVIDERS = pytest.mark.parametrize("make", [
    lambda **kw: AnthropicProvider(api_key="k", base_url="http://127.0.0.1:9", **kw),
    lambda **kw: OpenAIProvider(api_key="k", base_url="http://127.0.0.1:9/v1", **kw),
], ids=["anthropic", "openai"])


def http_of(provider_or_client: Any) -> httpx2.AsyncClient:
    """The httpx2 client under a provider's SDK client (or under an SDK client)."""
    sdk = getattr(provider_or_client, "client", provider_or_client)
    client = sdk._client
    assert isinstance(client, httpx2.AsyncClient)
    return client


def transport_on(provider: Any, backend: str) -> Any:
    """The transport of the client ``provider`` sends through on a loop of ``backend``."""
    seen: list[Any] = []

    async def main() -> None:
        # The loop's client is closed as the loop shuts down.
        seen.append(http_of(await provider._clients.get())._transport)

    anyio.run(main, backend=backend)
    return seen[0]


@PROVIDERS
def test_on_asyncio_a_keyword_built_client_sends_through_the_sdks_aiohttp_client(
        make: Any) -> None:
    transport = transport_on(make(), "asyncio")
    assert type(transport).__name__ == "AiohttpTransport"
    assert transport.limits.max_connections == DEFAULT_MAX_CONNECTIONS == 1000


@PROVIDERS
def test_on_trio_a_keyword_built_client_sends_through_the_sdks_httpx_client(make: Any) -> None:
    transport = transport_on(make(), "trio")
    assert type(transport).__name__ == "AsyncHTTPTransport"
    assert transport._pool._max_connections == DEFAULT_MAX_CONNECTIONS
    assert transport._pool._max_keepalive_connections == DEFAULT_MAX_CONNECTIONS


@PROVIDERS
def test_max_connections_sets_the_limit_on_both_loops_and_keeps_every_connection_alive(
        make: Any) -> None:
    provider = make(max_connections=5000)
    assert transport_on(provider, "asyncio").limits.max_connections == 5000
    pool = transport_on(provider, "trio")._pool
    assert (pool._max_connections, pool._max_keepalive_connections) == (5000, 5000)


@PROVIDERS
def test_one_provider_keeps_the_asyncio_client_it_built_first_for_asyncio(make: Any) -> None:
    """The client built with the provider (for asyncio) is not spent on a trio run:
    trio gets an httpx client of its own, and the next asyncio run the first."""
    provider = make()
    spare = provider.client
    assert type(transport_on(provider, "trio")).__name__ == "AsyncHTTPTransport"
    assert provider.client is spare
    assert transport_on(provider, "asyncio") is http_of(spare)._transport


@PROVIDERS
def test_a_configured_proxy_falls_back_to_the_sdk_transport_with_the_same_limits(
        make: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    client = http_of(make(max_connections=7))
    assert type(client._transport).__name__ == "AsyncHTTPTransport"
    # The SDK's own client mounts its proxy transports; each has our limits.
    pools = [t._pool for t in client._mounts.values() if t is not None]  # type: ignore[attr-defined]
    assert pools and all(p._max_connections == 7 for p in pools)


@pytest.mark.parametrize("value", [0, -1, True, 2.5, "10"])
@PROVIDERS
def test_a_bad_max_connections_is_refused(make: Any, value: Any) -> None:
    with pytest.raises(le.ConfigError) as error:
        make(max_connections=value)
    assert error.value.field == "max_connections"


def test_max_connections_with_a_client_or_http_client_is_refused() -> None:
    import anthropic
    import openai

    with pytest.raises(le.ConfigError, match="client given brings its own"):
        AnthropicProvider(anthropic.AsyncAnthropic(api_key="k"), max_connections=10)
    with pytest.raises(le.ConfigError, match="http_client given brings its own"):
        AnthropicProvider(api_key="k", http_client=httpx2.AsyncClient(), max_connections=10)
    with pytest.raises(le.ConfigError, match="client given brings its own"):
        OpenAIProvider(openai.AsyncOpenAI(api_key="k"), max_connections=10)
    with pytest.raises(le.ConfigError, match="http_client given brings its own"):
        OpenAIProvider(api_key="k", http_client=httpx2.AsyncClient(), max_connections=10)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_runs_beyond_max_connections_wait_for_a_connection_and_all_complete(
        backend: str) -> None:
    """Twelve runs at once on a provider limited to three connections: every run
    completes on its first attempt, over at most three connections."""
    script = [Reply.text(f"answer {n}") for n in range(12)]
    operation = le.Operation(name="t.pool", provider="anthropic", model="claude-sonnet-4-5")
    results: list[le.RunResult] = []
    with FakeAnthropicServer(script) as server:

        async def main() -> None:
            async with AnthropicProvider(api_key="k", base_url=server.url,
                                         max_connections=3) as provider:
                engine = le.Engine(provider)

                async def one(n: int) -> None:
                    results.append(await engine.run(operation, f"question {n}"))

                async with anyio.create_task_group() as group:
                    for n in range(12):
                        group.start_soon(one, n)
                transport: Any = http_of(provider)._transport
                if backend == "trio":
                    assert len(transport._pool.connections) <= 3
                else:
                    assert transport.client.connector.limit == 3

        anyio.run(main, backend=backend)
        assert len(server.requests) == 12
    assert [r.outcome for r in results] == [le.Outcome.COMPLETED] * 12
    assert all(r.attempts.count == 1 for r in results)


def test_aclose_closes_the_spare_client_code_sent_through_directly() -> None:
    """``provider.client`` outside a run is the spare client no loop has claimed;
    a request sent through it directly opens its connections, and `aclose`
    closes them (aiohttp warns about a session left open); the provider then
    serves the next run on a client of its own."""
    operation = le.Operation(name="t.spare", provider="anthropic", model="claude-sonnet-4-5")
    with FakeAnthropicServer([Reply.text("direct"), Reply.text("run")]) as server:
        provider = AnthropicProvider(api_key="k", base_url=server.url)
        spare = provider.client

        async def direct() -> str:
            message = await spare.messages.create(
                model="claude-sonnet-4-5", max_tokens=10,
                messages=[{"role": "user", "content": "hi"}])
            await provider.aclose()
            return message.content[0].text  # type: ignore[union-attr]

        assert asyncio.run(direct()) == "direct"
        assert spare.is_closed()

        async def run() -> le.RunResult:
            return await le.Engine(provider).run(operation, "hi")

        result = asyncio.run(run())
        assert result.outcome is le.Outcome.COMPLETED and result.answer == "run"
        assert provider.client is not spare
