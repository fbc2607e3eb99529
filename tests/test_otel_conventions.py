"""The OpenTelemetry spans are complete and every name is a semantic convention:
gen_ai.response.model, server.address / server.port,
gen_ai.conversation.id, gen_ai.output.type, and a low-cardinality error.type,
each checked against the `opentelemetry-semantic-conventions` package."""

from __future__ import annotations

import contextlib
import dataclasses
import random
import warnings
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import pydantic
import pytest
from google.oauth2.credentials import Credentials
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes
from opentelemetry.semconv.attributes import (
    error_attributes,
    http_attributes,
    server_attributes,
)

import loopengine as le
from loopengine import events, otel
from loopengine.otel import OpenTelemetryObserver
from loopengine.providers import (
    AnthropicProvider,
    FaultKind,
    GeminiProvider,
    OpenAIProvider,
    OpenAIResponsesProvider,
    Provider,
    ProviderFault,
    RecordingProvider,
    ReplayProvider,
    Reply,
    ScriptedProvider,
)
from loopengine.testing import (
    FakeAnthropicServer,
    FakeBedrockServer,
    FakeClock,
    FakeGeminiServer,
    FakeOpenAIServer,
    FakeVertexServer,
)
from loopengine.testing import Reply as WireReply

MODEL = "claude-otel-conventions"
START = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
PRICES = le.PriceBook([le.ModelPrice(provider="anthropic", model=MODEL,
                                     input_per_mtok=Decimal(3), output_per_mtok=Decimal(15))])
OPERATION = le.Operation(name="otel.conventions", provider="anthropic", model=MODEL,
                         max_output_tokens=300)


class Scene(pydantic.BaseModel):
    scene: str


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    yield exporter
    exporter.clear()


@pytest.fixture
def tracer_provider(exporter: InMemorySpanExporter) -> TracerProvider:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def named(spans: tuple[ReadableSpan, ...], prefix: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name.startswith(prefix)]


def declared(*modules: ModuleType) -> set[str]:
    """Every attribute name the conventions' modules declare (their UPPER_CASE strings)."""
    return {value for module in modules for name, value in vars(module).items()
            if name.isupper() and isinstance(value, str)}


def values(enum_name: str) -> set[str]:
    # The GenAI enums are marked deprecated in this package (the GenAI
    # conventions moved to their own repository); reading them warns.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return {member.value for member in getattr(gen_ai_attributes, enum_name)}


def boom_tool() -> le.Tool:
    @le.tool(name="boom", description="Always fails.")
    async def boom(key: str) -> str:
        raise ValueError(f"free text the span must not carry: {key} 12345")

    return boom


async def traced(tracer_provider: TracerProvider, **kwargs: Any) -> tuple[TracerProvider, str]:
    """A run with a retried fault, a failing tool, an unknown tool and a guard trip."""
    clock = FakeClock(wall_start=START)
    provider = ScriptedProvider([
        ProviderFault(FaultKind.OVERLOADED, "busy", http_status=529),
        Reply.tool_calls(("boom", {"key": "k"}), ("missing", {})),
        Reply.tool_calls(("boom", {"key": "k"})),
    ], clock=clock)
    engine = le.Engine(provider, prices=PRICES, clock=clock, rng=random.Random(3),
                       observers=[OpenTelemetryObserver(tracer_provider)])
    result = await engine.run(OPERATION, "q", tools=[boom_tool()], limits={"max_turns": 2},
                              **kwargs)
    assert result.outcome is le.Outcome.TURN_LIMIT
    return tracer_provider, result.invocation_id


async def test_every_attribute_name_is_a_semantic_convention_or_loopengines_own(
    tracer_provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """Each attribute on any span (and span event) is either declared by the
    opentelemetry-semantic-conventions package or in the loopengine.* namespace."""
    await traced(tracer_provider)
    with FakeAnthropicServer([WireReply.text("hi")]) as server:
        async with AnthropicProvider(api_key="test", base_url=server.url) as provider:
            engine = le.Engine(provider, prices=PRICES, observers=[
                OpenTelemetryObserver(tracer_provider, providers=[provider])])
            await engine.run(OPERATION, "q")
    known = declared(gen_ai_attributes, error_attributes, server_attributes, http_attributes)
    names = set()
    for span in exporter.get_finished_spans():
        names |= set(attrs(span))
        for event in span.events:
            names |= set(dict(event.attributes or {}))
    foreign = {n for n in names if not n.startswith("loopengine.")}
    assert {"server.address", "server.port", "error.type"} <= foreign
    assert foreign <= known, foreign - known


def test_the_names_spelled_out_in_otel_are_the_conventions_own() -> None:
    """The GenAI names otel.py spells out equal the package's constants, and the
    stable ones it imports are what the issue names."""
    assert otel.GEN_AI_CONVERSATION_ID == gen_ai_attributes.GEN_AI_CONVERSATION_ID
    assert otel.GEN_AI_OUTPUT_TYPE == gen_ai_attributes.GEN_AI_OUTPUT_TYPE
    assert otel.GEN_AI_RESPONSE_MODEL == gen_ai_attributes.GEN_AI_RESPONSE_MODEL
    assert (otel.ERROR_TYPE, otel.SERVER_ADDRESS, otel.SERVER_PORT) == (
        "error.type", "server.address", "server.port")


async def test_well_known_values_are_the_conventions_values(
    tracer_provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """gen_ai.operation.name, gen_ai.provider.name and gen_ai.output.type take values the
    conventions list."""
    clock = FakeClock(wall_start=START)
    engine = le.Engine(ScriptedProvider([Reply.final({"scene": "s"})], clock=clock),
                       prices=PRICES, clock=clock, observers=[OpenTelemetryObserver(
                           tracer_provider)])
    await engine.call(OPERATION, "Write.", output=Scene)
    await traced(tracer_provider)
    spans = exporter.get_finished_spans()
    assert {attrs(s)["gen_ai.operation.name"] for s in spans} <= values(
        "GenAiOperationNameValues")
    assert {attrs(s)["gen_ai.provider.name"] for s in spans if "gen_ai.provider.name" in
            attrs(s)} <= values("GenAiProviderNameValues")
    assert {attrs(s)[otel.GEN_AI_OUTPUT_TYPE] for s in spans if otel.GEN_AI_OUTPUT_TYPE in
            attrs(s)} == {"json"} <= values("GenAiOutputTypeValues")
    assert {otel.provider_name(r) for r in ("anthropic", "bedrock", "vertex", "openai",
                                             "azure", "aws-bedrock", "google-vertex",
                                             "google")} <= values("GenAiProviderNameValues")


async def test_attempt_spans_carry_the_server_address_and_port_of_the_base_url(
    tracer_provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """With the providers given, each chat span says which server it went to (the SDK
    client's base_url); the in-process run span does not."""
    with FakeAnthropicServer([WireReply.text("hi")]) as server:
        url = urlsplit(server.url)
        async with AnthropicProvider(api_key="test", base_url=server.url) as provider:
            engine = le.Engine(provider, prices=PRICES, observers=[
                OpenTelemetryObserver(tracer_provider, providers=[provider])])
            await engine.run(OPERATION, "q")
    spans = exporter.get_finished_spans()
    (chat,) = named(spans, "chat ")
    assert (attrs(chat)["server.address"], attrs(chat)["server.port"]) == (url.hostname, url.port)
    (run,) = named(spans, "invoke_agent ")
    assert "server.address" not in attrs(run)


def test_a_base_url_without_a_port_gives_the_schemes_default() -> None:
    """https://host is port 443; a mapping of routes is read per route; a provider with no
    SDK client (ScriptedProvider) adds nothing."""
    provider = AnthropicProvider(api_key="test", base_url="https://api.example.test")
    assert otel._server_attributes(provider) == {"server.address": "api.example.test",
                                                 "server.port": 443}
    plain = AnthropicProvider(api_key="test", base_url="http://10.0.0.7")
    observer = OpenTelemetryObserver(providers={"anthropic": provider, "anthropic-eu": plain})
    assert observer._servers == {
        "anthropic": {"server.address": "api.example.test", "server.port": 443},
        "anthropic-eu": {"server.address": "10.0.0.7", "server.port": 80},
    }
    assert otel._server_attributes(ScriptedProvider([])) == {}
    assert OpenTelemetryObserver(providers=ScriptedProvider([]))._servers == {"anthropic": {}}


async def test_a_structured_calls_spans_say_json_and_a_runs_say_nothing(
    tracer_provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """gen_ai.output.type is json on a structured call's run and chat spans; a run's spans
    leave it unset (its events do not say whether it answers text or a tool call)."""
    clock = FakeClock(wall_start=START)
    engine = le.Engine(ScriptedProvider([Reply.final({"scene": "s"}), Reply.text("t")],
                                        clock=clock),
                       prices=PRICES, clock=clock,
                       observers=[OpenTelemetryObserver(tracer_provider)])
    called = await engine.call(OPERATION, "Write.", output=Scene)
    ran = await engine.run(OPERATION, "Say something.")
    spans = exporter.get_finished_spans()
    by_run: dict[str, list[str | None]] = {}
    for span in spans:
        by_run.setdefault(attrs(span)["loopengine.run.id"], []).append(
            attrs(span).get(otel.GEN_AI_OUTPUT_TYPE))
    assert by_run[called.invocation_id] == ["json", "json"]  # chat and invoke_agent
    assert by_run[ran.invocation_id] == [None, None]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RunStartedWithConversation(events.RunStarted):
    """RunStarted as it reads once it carries the attribution's correlation id."""

    correlation_id: str | None = None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SettledWithModel(events.AttemptSettled):
    """AttemptSettled as it reads once it carries the response's model."""

    response_model: str | None = None


def started(**extra: Any) -> dict[str, Any]:
    return dict(run_id="run-1", at=START, operation="op", operation_version="1",
                provider="anthropic", model=MODEL, kind="run", **extra)


def settled(**extra: Any) -> dict[str, Any]:
    return dict(run_id="run-1", at=START, ordinal=1, turn=1, attempt=1, phase="turn",
                served_by=f"anthropic:{MODEL}", provider="anthropic", model=MODEL,
                max_tokens=10, outcome="ok", latency_ms=5, fault=None, http_status=200,
                error_code=None, aborted_reason=None, usage=None, usage_approx=False,
                cost_usd=None, charged=True, response_id="msg_1", request_id=None,
                stop_reason="end_turn", **extra)


def ended() -> events.RunEnded:
    return events.RunEnded(run_id="run-1", at=START, outcome="completed", turns=1,
                           tool_calls=0, attempts=1, usage=le.Usage(), cost_usd=Decimal(0),
                           credits=0)


def attempt_started() -> events.AttemptStarted:
    return events.AttemptStarted(run_id="run-1", at=START, ordinal=1, turn=1, attempt=1,
                                 phase="turn", served_by=f"anthropic:{MODEL}",
                                 provider="anthropic", model=MODEL, max_tokens=10,
                                 timeout_ms=1000, wait_ms=0)


def tool_call(status: str) -> events.ToolCallEvent:
    return events.ToolCallEvent(
        run_id="run-1", at=START, tool_name="t", status=status,  # type: ignore[arg-type]
        latency_ms=0, token_cost=0, input_tokens=0, output_tokens=0, model_id=MODEL,
        provider="anthropic", spend_usd=Decimal(0), tool_use_id="tu1", turn=1)


def test_the_conversation_id_is_the_callers_correlation_id_on_every_span(
    tracer_provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """gen_ai.conversation.id is the attribution's correlation id (the application's own
    conversation or request id), on the run, chat and tool spans alike."""
    observer = OpenTelemetryObserver(tracer_provider)
    for event in [RunStartedWithConversation(**started(correlation_id="conv-42")),
                  attempt_started(), SettledWithModel(**settled()),
                  tool_call("started"), tool_call("succeeded"), ended()]:
        observer(event)
    spans = exporter.get_finished_spans()
    assert len(spans) == 3
    assert {attrs(s)[otel.GEN_AI_CONVERSATION_ID] for s in spans} == {"conv-42"}


async def test_without_a_correlation_id_the_conversation_id_is_the_invocation_id(
    tracer_provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """No correlation id: gen_ai.conversation.id is the invocation id, the run's
    durable id in the ledger (no id is minted for telemetry)."""
    _, run_id = await traced(tracer_provider)
    spans = exporter.get_finished_spans()
    assert {attrs(s)[otel.GEN_AI_CONVERSATION_ID] for s in spans} == {run_id}
    assert {attrs(s)["loopengine.run.id"] for s in spans} == {run_id}


def test_the_response_model_is_the_one_the_provider_named(
    tracer_provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """gen_ai.response.model is the model the response says served it (an alias resolves
    to a snapshot), set when the attempt settles; without one it is left unset."""
    observer = OpenTelemetryObserver(tracer_provider)
    observer(events.RunStarted(**started()))
    observer(attempt_started())
    observer(SettledWithModel(**settled(response_model=f"{MODEL}-20260301")))
    observer(ended())
    (chat,) = named(exporter.get_finished_spans(), "chat ")
    assert attrs(chat)[otel.GEN_AI_RESPONSE_MODEL] == f"{MODEL}-20260301"
    assert attrs(chat)["gen_ai.request.model"] == MODEL
    exporter.clear()
    observer(events.RunStarted(**started()))
    observer(attempt_started())
    observer(events.AttemptSettled(**settled()))
    observer(ended())
    (chat,) = named(exporter.get_finished_spans(), "chat ")
    assert otel.GEN_AI_RESPONSE_MODEL not in attrs(chat)


async def test_error_type_is_low_cardinality_never_free_text(
    tracer_provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """error.type is the outcome (run), the fault kind (attempt), or for a tool the fixed
    reason or the raised exception's class: never the exception's message."""
    await traced(tracer_provider)
    spans = exporter.get_finished_spans()
    types = {s.name: attrs(s).get("error.type") for s in spans if "error.type" in attrs(s)}
    assert types[f"invoke_agent {OPERATION.name}"] == "turn_limit"
    assert types[f"chat {MODEL}"] == "overloaded"
    assert {attrs(s).get("error.type") for s in named(spans, "execute_tool boom")} == {
        "ValueError"}
    (missing,) = named(spans, "execute_tool missing")
    assert attrs(missing)["error.type"] == "unknown tool"
    for span in spans:
        texts = [*attrs(span).values(), span.status.description or ""]
        assert all("12345" not in str(t) for t in texts)
    allowed = ({o.value for o in le.Outcome} | {k.value for k in FaultKind}
               | {"unknown tool", "invalid input", "deadline", "duplicate", "max_calls",
                  "timeout", "aborted", "ValueError"})
    assert set(types.values()) <= allowed


@pytest.mark.parametrize(("error", "kind"), [
    ("unknown tool", "unknown tool"), ("invalid input", "invalid input"),
    ("deadline", "deadline"), ("duplicate", "duplicate"), ("max_calls", "max_calls"),
    ("timeout", "timeout"), ("cancelled", "cancelled"), ("invalid output", "invalid output"),
    ("handler raised KeyError", "KeyError"),
    ("handler raised not a class name!", "_OTHER"),
    ("the handler said: disk /home/sam full", "_OTHER"), (None, "_OTHER"),
])
def test_tool_errors_map_onto_a_closed_set(error: str | None, kind: str) -> None:
    """A tool error the observer does not know becomes _OTHER (the conventions' fallback)."""
    assert otel._tool_error_type(error) == kind


@contextlib.asynccontextmanager
async def _route(route: str) -> AsyncIterator[tuple[Provider, str, str]]:
    """A real provider of ``route`` on its loopback fake, with the route and a model."""
    script = [WireReply.text("hi")]
    if route == "gemini":
        with FakeGeminiServer(script) as gemini:
            provider: Provider = GeminiProvider(api_key="test",
                                                http_options={"base_url": gemini.url})
            try:
                yield provider, "gemini", "gemini-2.5-flash"
            finally:
                await provider.aclose()
    elif route == "gemini-vertex":
        with FakeGeminiServer(script) as gemini:
            provider = GeminiProvider(vertexai=True, project="p", location="us-central1",
                                      credentials=Credentials(token="token"),
                                      http_options={"base_url": gemini.url})
            try:
                yield provider, route, "gemini-2.5-flash"
            finally:
                await provider.aclose()
    elif route in ("openai", "openai-responses"):
        with FakeOpenAIServer(script) as openai_fake:
            kind = OpenAIProvider if route == "openai" else OpenAIResponsesProvider
            async with kind(api_key="test", base_url=openai_fake.base_url) as provider:
                yield provider, "openai", "gpt-4.1"
    elif route == "aws-bedrock":
        with FakeBedrockServer(script) as bedrock:
            provider = AnthropicProvider.bedrock(aws_region="us-east-1",
                                                 aws_access_key="AKIDEXAMPLE",
                                                 aws_secret_key="secret", base_url=bedrock.url)
            try:
                yield provider, route, "anthropic.claude-sonnet-4-5-20250929-v1:0"
            finally:
                await provider.aclose()
    elif route == "google-vertex":
        with FakeVertexServer(script) as vertex:
            provider = AnthropicProvider.vertex(region="global", project_id="p",
                                                access_token="token", base_url=vertex.base_url)
            try:
                yield provider, route, "claude-sonnet-4-5@20250929"
            finally:
                await provider.aclose()
    else:
        with FakeAnthropicServer(script) as anthropic_fake:
            async with AnthropicProvider(api_key="test", base_url=anthropic_fake.url) as provider:
                yield provider, "anthropic", MODEL


@pytest.mark.parametrize(("route", "expected"), [
    ("anthropic", "anthropic"), ("openai", "openai"), ("openai-responses", "openai"),
    ("gemini", "gcp.gemini"), ("gemini-vertex", "gcp.vertex_ai"),
    ("aws-bedrock", "aws.bedrock"), ("google-vertex", "gcp.vertex_ai")])
async def test_every_shipped_provider_is_named_by_a_well_known_provider_name(
    tracer_provider: TracerProvider, exporter: InMemorySpanExporter, route: str, expected: str
) -> None:
    """A run on each shipped provider, through its real SDK, puts the conventions'
    well-known gen_ai.provider.name for that provider on its run and attempt spans
    (the Gemini API's vendor, ``google``, is ``gcp.gemini``; Gemini and Claude on
    Vertex AI are ``gcp.vertex_ai``), and names its attempt spans by the
    operation the conventions give the API it speaks (``generate_content`` for
    Gemini's, on the Gemini API or Vertex AI; ``chat`` for the others: Claude on
    Vertex AI too)."""
    async with _route(route) as (provider, name, model):
        engine = le.Engine(provider, observers=[OpenTelemetryObserver(tracer_provider)])
        result = await engine.run(le.Operation(name="otel.route", provider=name, model=model,
                                               max_output_tokens=50), "q")
    assert result.outcome is le.Outcome.COMPLETED
    spans = exporter.get_finished_spans()
    operation = "generate_content" if route.startswith("gemini") else "chat"
    assert [s.name for s in spans] == [f"{operation} {model}", "invoke_agent otel.route"]
    assert attrs(spans[0])["gen_ai.operation.name"] == operation
    assert operation in values("GenAiOperationNameValues")
    assert {attrs(s)["gen_ai.provider.name"] for s in spans} == {expected}
    assert expected in values("GenAiProviderNameValues")


@pytest.mark.parametrize(("name", "operation"), [
    ("gemini", "generate_content"), ("gemini-vertex", "generate_content"),
    ("google", "generate_content"), ("google-vertex", "chat"), ("anthropic", "chat")])
async def test_a_script_or_a_replay_names_its_attempt_spans_by_the_route_it_stands_in_for(
    tracer_provider: TracerProvider, exporter: InMemorySpanExporter, name: str, operation: str,
    tmp_path: Path) -> None:
    """A `ScriptedProvider` named after a route knows no more of its requests
    than the name: one named for Gemini (its routes ``gemini`` and
    ``gemini-vertex``, its vendor ``google``) names its attempt spans
    ``generate_content``, as a Gemini run's are; any other (Vertex AI's vendor
    serves Claude too) ``chat``. The replay of its recording names them alike."""
    op = le.Operation(name="otel.script", provider=name, model="m", max_output_tokens=50)
    script = ScriptedProvider([Reply.text("hi")], name=name)
    recording = RecordingProvider(script, tmp_path / "run.jsonl")
    engine = le.Engine(recording, observers=[OpenTelemetryObserver(tracer_provider)])
    assert (await engine.run(op, "q")).outcome is le.Outcome.COMPLETED
    replay = ReplayProvider(tmp_path / "run.jsonl")
    engine = le.Engine(replay, observers=[OpenTelemetryObserver(tracer_provider)])
    assert (await engine.run(op, "q")).outcome is le.Outcome.COMPLETED
    attempts = [s for s in exporter.get_finished_spans() if not s.name.startswith("invoke")]
    assert [s.name for s in attempts] == [f"{operation} m"] * 2
    assert {attrs(s)["gen_ai.operation.name"] for s in attempts} == {operation}
