"""A platform client that cannot sign its request: Bedrock's and Vertex's clients
find their AWS or Google credentials as each request is made, and what botocore
and google-auth raise then is classified at the adapter's one place, before
anything reaches the wire: missing credentials are ``unauthorized`` (not
retried), a token endpoint that cannot be reached is ``connection`` (retried)."""

from __future__ import annotations

import json
import random
import socket
from pathlib import Path

import pytest

import loopengine as le
from loopengine.persistence import MemoryLedger
from loopengine.providers import AnthropicProvider
from loopengine.testing import FakeBedrockServer, FakeClock, FakeVertexServer, Reply

from ..adapter.conftest import STREAMING
from .conftest import BEDROCK, VERTEX

TWO = le.RetryPolicy(max_attempts=2, initial_wait=0.001, max_wait=0.002)


async def _run(provider: AnthropicProvider, route: str, model: str, clock: FakeClock,
               *, stream: bool) -> le.RunResult:
    prices = BEDROCK.prices if route == BEDROCK.route else VERTEX.prices
    engine = le.Engine(provider, ledger=MemoryLedger(), prices=prices, clock=clock,
                       rng=random.Random(7))
    op = le.Operation(name="probe", provider=route, model=model, max_output_tokens=64,
                      retry=TWO)
    try:
        return await engine.run(op, "go", on_text=(lambda _: None) if stream else None)
    finally:
        await provider.aclose()


async def _on_vertex(clock: FakeClock, *, stream: bool) -> le.RunResult:
    """A run on a Vertex provider that finds its own credentials; nothing may
    reach the fake."""
    with FakeVertexServer([Reply.text("never")]) as server:
        provider = AnthropicProvider.vertex(base_url=server.base_url, region="global",
                                            project_id="test-project")
        result = await _run(provider, VERTEX.route, VERTEX.model, clock, stream=stream)
        assert server.requests == []
    return result


@STREAMING
async def test_bedrock_without_aws_credentials_is_unauthorized_before_the_wire(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, clock: FakeClock, stream: bool
) -> None:
    """No AWS credentials anywhere in boto3's chain: the attempt is an
    ``unauthorized`` fault named ``NoCredentialsError``, not retried, nothing sent."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                 "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_BEARER_TOKEN_BEDROCK",
                 "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                 "AWS_CONTAINER_CREDENTIALS_FULL_URI", "ANTHROPIC_BEDROCK_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with FakeBedrockServer([Reply.text("never")]) as server:
        provider = AnthropicProvider.bedrock(base_url=server.url, aws_region="us-east-1")
        result = await _run(provider, BEDROCK.route, BEDROCK.model, clock, stream=stream)
        assert server.requests == []
    assert result.outcome is le.Outcome.PROVIDER_ERROR
    [attempt] = result.attempt_log
    assert attempt.settle is not None
    assert (attempt.settle.fault, attempt.settle.http_status, attempt.settle.error_code) == (
        "unauthorized", None, "NoCredentialsError")


@STREAMING
async def test_vertex_without_google_credentials_is_unauthorized_before_the_wire(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, clock: FakeClock, stream: bool
) -> None:
    """Application Default Credentials that are not there: ``unauthorized``,
    named ``DefaultCredentialsError``, not retried, nothing sent."""
    monkeypatch.delenv("ANTHROPIC_VERTEX_BASE_URL", raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    result = await _on_vertex(clock, stream=stream)
    assert result.outcome is le.Outcome.PROVIDER_ERROR
    [attempt] = result.attempt_log
    assert attempt.settle is not None
    assert (attempt.settle.fault, attempt.settle.error_code) == (
        "unauthorized", "DefaultCredentialsError")


async def test_vertex_token_endpoint_unreachable_is_a_retried_connection_fault(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, clock: FakeClock
) -> None:
    """Credentials whose token endpoint refuses the connection (a loopback port
    nobody listens on): each attempt is a ``connection`` fault, retried."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    adc = tmp_path / "adc.json"
    adc.write_text(json.dumps({
        "type": "authorized_user", "client_id": "id", "client_secret": "secret",
        "refresh_token": "refresh", "token_uri": f"http://127.0.0.1:{port}/token"}))
    monkeypatch.delenv("ANTHROPIC_VERTEX_BASE_URL", raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(adc))
    result = await _on_vertex(clock, stream=False)
    assert result.outcome is le.Outcome.PROVIDER_ERROR
    assert [(a.settle.fault, a.settle.error_code) for a in result.attempt_log
            if a.settle is not None] == [("connection", "TransportError")] * 2
