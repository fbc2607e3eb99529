"""The client a provider builds from keywords: the flat pool, its limits, and the
``max_connections`` keyword, on both SDK providers."""

from __future__ import annotations

from typing import Any

import anyio
import httpx2
import pytest

import loopengine as le
from loopengine.providers import AnthropicProvider, OpenAIProvider, PooledTransport
from loopengine.providers._clients import DEFAULT_MAX_CONNECTIONS
from loopengine.testing import FakeAnthropicServer, Reply

PROVIDERS = pytest.mark.parametrize("make", [
    lambda **kw: AnthropicProvider(api_key="k", base_url="http://127.0.0.1:9", **kw),
    lambda **kw: OpenAIProvider(api_key="k", base_url="http://127.0.0.1:9/v1", **kw),
], ids=["anthropic", "openai"])


def http_of(provider: Any) -> httpx2.AsyncClient:
    """The httpx2 client under the provider's SDK client."""
    client = provider.client._client
    assert isinstance(client, httpx2.AsyncClient)
    return client


@PROVIDERS
def test_a_keyword_built_client_sends_through_the_flat_pool(make: Any) -> None:
    transport = http_of(make())._transport
    assert isinstance(transport, PooledTransport)
    assert transport.pool.max_connections == DEFAULT_MAX_CONNECTIONS == 1000
    assert transport.pool.max_keepalive_connections == DEFAULT_MAX_CONNECTIONS


@PROVIDERS
def test_max_connections_sets_the_pool_limit_and_keeps_every_connection_alive(make: Any) -> None:
    pool = http_of(make(max_connections=5000))._transport.pool  # type: ignore[attr-defined]
    assert (pool.max_connections, pool.max_keepalive_connections) == (5000, 5000)


@PROVIDERS
def test_a_configured_proxy_falls_back_to_the_sdk_transport_with_the_same_limits(
        make: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    client = http_of(make(max_connections=7))
    assert not isinstance(client._transport, PooledTransport)
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


def test_runs_beyond_max_connections_wait_for_a_connection_and_all_complete() -> None:
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
                pool = http_of(provider)._transport.pool  # type: ignore[attr-defined]
                assert len(pool.connections) <= 3

        anyio.run(main)
        assert len(server.requests) == 12
    assert [r.outcome for r in results] == [le.Outcome.COMPLETED] * 12
    assert all(r.attempts.count == 1 for r in results)
