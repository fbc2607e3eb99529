"""The OpenTelemetry observer: span names, parents, times and GenAI attributes,
checked with the SDK's in-memory exporter."""

from __future__ import annotations

import ast
import random
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

import loopengine as le
from loopengine import events, otel
from loopengine.otel import OpenTelemetryObserver, provider_name
from loopengine.providers import FaultKind, ProviderFault, Reply, ScriptedProvider
from loopengine.testing import FakeClock

MODEL = "claude-otel-test"
CANARY = "CANARY-0tel"
START = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
PRICES = le.PriceBook([le.ModelPrice(provider="anthropic", model=MODEL,
                                     input_per_mtok=Decimal(3), output_per_mtok=Decimal(15))])
OPERATION = le.Operation(name="otel.test", provider="anthropic", model=MODEL,
                         max_output_tokens=300, version="4")
USAGE = le.Usage(input_tokens=100, output_tokens=20, cache_read_tokens=30, cache_write_tokens=10)


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


def ns(at: datetime) -> int:
    return (at - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(microseconds=1) * 1000


async def traced_run(
    tracer_provider: TracerProvider, script: list[Any], **run: Any
) -> tuple[le.RunResult, list[events.Event]]:
    clock = FakeClock(wall_start=START)

    @le.tool(name="lookup", description="Look a key up.")
    async def lookup(key: str) -> str:
        await clock.sleep(0.5)
        return f"value {CANARY}"

    seen: list[events.Event] = []
    engine = le.Engine(ScriptedProvider(script, clock=clock), prices=PRICES, clock=clock,
                       rng=random.Random(5),
                       observers=[OpenTelemetryObserver(tracer_provider), seen.append])
    result = await engine.run(OPERATION, f"question {CANARY}", system=f"system {CANARY}",
                              tools=[lookup], **run)
    return result, seen


def by_name(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


SCRIPT = [
    ProviderFault(FaultKind.RATE_LIMITED, "slow down", http_status=429,
                  error_code="rate_limit_error", retry_after=2.0),
    Reply(content=[{"type": "text", "text": f"let me look {CANARY}"},
                   {"type": "tool_use", "id": "toolu_1", "name": "lookup",
                    "input": {"key": CANARY}},
                   {"type": "tool_use", "id": "toolu_2", "name": "nope", "input": {}}],
          stop_reason="tool_use", usage=USAGE, response_id="msg_1"),
    Reply.text(f"the answer {CANARY}", usage=le.Usage(input_tokens=200, output_tokens=40)),
]


async def test_spans_are_named_and_parented_after_the_conventions(
    tracer_provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """One invoke_agent span; chat spans per attempt and execute_tool spans under it."""
    result, _ = await traced_run(tracer_provider, list(SCRIPT))
    assert result.outcome is le.Outcome.COMPLETED
    spans = exporter.get_finished_spans()
    assert sorted(s.name for s in spans) == sorted([
        "invoke_agent otel.test", f"chat {MODEL}", f"chat {MODEL}", f"chat {MODEL}",
        "execute_tool lookup", "execute_tool nope",
    ])
    (run,) = by_name(spans, "invoke_agent otel.test")
    assert run.parent is None
    assert run.kind is SpanKind.INTERNAL
    for span in spans:
        if span is not run:
            assert span.parent is not None
            assert span.parent.span_id == run.context.span_id
            assert span.context.trace_id == run.context.trace_id
    assert all(s.kind is SpanKind.CLIENT for s in by_name(spans, f"chat {MODEL}"))
    assert all(s.kind is SpanKind.INTERNAL for s in spans if s.name.startswith("execute_tool"))


async def test_run_span_attributes(
    tracer_provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """The run span names the agent and sums the usage, cached tokens inside the input."""
    result, seen = await traced_run(tracer_provider, list(SCRIPT))
    (run,) = by_name(exporter.get_finished_spans(), "invoke_agent otel.test")
    assert dict(run.attributes or {}) == {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.agent.name": "otel.test",
        "gen_ai.agent.version": "4",
        "gen_ai.provider.name": "anthropic",
        "gen_ai.request.model": MODEL,
        "loopengine.run.id": result.invocation_id,
        "gen_ai.conversation.id": result.invocation_id,
        "loopengine.run.kind": "run",
        "loopengine.outcome": "completed",
        "loopengine.turns": 2,
        "loopengine.tool_calls": 2,
        "loopengine.attempts": 3,
        "loopengine.cost_usd": float(result.cost_usd),
        "loopengine.credits": result.credits,
        "gen_ai.usage.input_tokens": 140 + 200,
        "gen_ai.usage.output_tokens": 60,
        "gen_ai.usage.cache_read.input_tokens": 30,
        "gen_ai.usage.cache_creation.input_tokens": 10,
    }
    assert run.status.status_code is StatusCode.UNSET
    assert (run.start_time, run.end_time) == (ns(seen[0].at), ns(seen[-1].at))


async def test_attempt_span_attributes_and_times(
    tracer_provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """Each chat span has the request, response and usage attributes, and error.type on faults."""
    _, seen = await traced_run(tracer_provider, list(SCRIPT))
    chats = sorted(by_name(exporter.get_finished_spans(), f"chat {MODEL}"),
                   key=lambda s: s.attributes["loopengine.attempt.ordinal"])  # type: ignore[index]
    faulted, ok, last = chats
    common = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "anthropic",
        "gen_ai.request.model": MODEL,
        "gen_ai.request.max_tokens": 300,
    }
    assert dict(faulted.attributes or {}).items() >= {
        **common,
        "error.type": "rate_limited",
        "http.response.status_code": 429,
        "loopengine.error.code": "rate_limit_error",
        "loopengine.attempt.outcome": "error",
        "loopengine.attempt.turn": 1,
        "loopengine.attempt.number": 1,
    }.items()
    assert faulted.status.status_code is StatusCode.ERROR
    assert "gen_ai.usage.input_tokens" not in (faulted.attributes or {})

    assert dict(ok.attributes or {}).items() >= {
        **common,
        "gen_ai.response.id": "msg_1",
        "gen_ai.response.finish_reasons": ("tool_use",),
        "gen_ai.usage.input_tokens": 140,  # 100 uncached + 30 read + 10 written
        "gen_ai.usage.output_tokens": 20,
        "gen_ai.usage.cache_read.input_tokens": 30,
        "gen_ai.usage.cache_creation.input_tokens": 10,
        "loopengine.attempt.turn": 1,
        "loopengine.attempt.number": 2,
        "loopengine.attempt.wait_ms": 2000,  # the provider's retry-after
        "loopengine.attempt.outcome": "ok",
        "loopengine.attempt.charged": True,
    }.items()
    assert "error.type" not in (ok.attributes or {})
    assert ok.status.status_code is StatusCode.UNSET
    assert (last.attributes or {})["gen_ai.response.finish_reasons"] == ("end_turn",)
    assert (last.attributes or {})["loopengine.attempt.turn"] == 2

    started = [e for e in seen if isinstance(e, events.AttemptStarted)]
    settled = [e for e in seen if isinstance(e, events.AttemptSettled)]
    assert [(s.start_time, s.end_time) for s in chats] == [
        (ns(a.at), ns(b.at)) for a, b in zip(started, settled, strict=True)]
    assert ok.start_time - faulted.end_time == 2_000_000_000  # the retry wait, on the clock


async def test_tool_spans(tracer_provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    """execute_tool spans carry the tool's name and call id; a failed call has error.type."""
    await traced_run(tracer_provider, list(SCRIPT))
    spans = exporter.get_finished_spans()
    (lookup,) = by_name(spans, "execute_tool lookup")
    (nope,) = by_name(spans, "execute_tool nope")
    assert dict(lookup.attributes or {}).items() >= {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": "lookup",
        "gen_ai.tool.call.id": "toolu_1",
        "gen_ai.tool.type": "function",
        "loopengine.tool.status": "succeeded",
    }.items()
    assert lookup.end_time - lookup.start_time == 500_000_000  # the handler's half second
    assert lookup.status.status_code is StatusCode.UNSET
    assert (nope.attributes or {})["error.type"] == "unknown tool"
    assert nope.status.status_code is StatusCode.ERROR


async def test_calls_that_share_an_id_each_get_their_own_tool_span(
    tracer_provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """A reply that repeats a call id (as some servers do) still gives every call
    its own execute_tool span, ended with that call's own status, and named by
    the id each call was given (the first keeps the server's)."""
    calls = [{"type": "tool_use", "id": "call_0", "name": name, "input": tool_input}
             for name, tool_input in (("lookup", {"key": "a"}), ("nope", {}),
                                      ("lookup", {"key": "b"}))]
    result, seen = await traced_run(tracer_provider, [
        Reply(content=calls, stop_reason="tool_use", usage=USAGE), Reply.text("done")])
    assert result.outcome is le.Outcome.COMPLETED
    assert sum(isinstance(e, events.ToolCallEvent) and e.status == "started" for e in seen) == 3
    spans = exporter.get_finished_spans()
    lookups = by_name(spans, "execute_tool lookup")
    (nope,) = by_name(spans, "execute_tool nope")
    assert [(s.attributes or {})["loopengine.tool.status"] for s in lookups] == [
        "succeeded", "succeeded"]
    assert (nope.attributes or {})["error.type"] == "unknown tool"
    ids = [(s.attributes or {})["gen_ai.tool.call.id"] for s in [*lookups, nope]]
    assert "call_0" in ids and len(set(ids)) == 3


async def test_no_content_reaches_any_span(
    tracer_provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """Prompts, answers, tool inputs and outputs appear in no attribute or span event."""
    await traced_run(tracer_provider, list(SCRIPT))
    spans = exporter.get_finished_spans()
    assert spans
    for span in spans:
        values = [*dict(span.attributes or {}).values(), span.name]
        for event in span.events:
            values.extend([event.name, *dict(event.attributes or {}).values()])
        assert all(CANARY not in str(v) for v in values)


async def test_guard_trip_is_a_span_event_and_the_run_an_error(
    tracer_provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """A run a guard ends has error.type set to its outcome and the trip as a span event."""
    script = [Reply(content=[{"type": "tool_use", "id": f"t{i}", "name": "lookup",
                              "input": {"key": "k"}}], stop_reason="tool_use")
              for i in range(3)]
    result, seen = await traced_run(tracer_provider, script, limits={"max_turns": 1})
    assert result.outcome is le.Outcome.TURN_LIMIT
    (run,) = by_name(exporter.get_finished_spans(), "invoke_agent otel.test")
    assert (run.attributes or {})["error.type"] == "turn_limit"
    assert run.status.status_code is StatusCode.ERROR
    (event,) = run.events
    assert event.name == "loopengine.guard_tripped"
    assert dict(event.attributes or {}) == {
        "loopengine.guard.name": "max_turns",
        "loopengine.guard.observed": 1,
        "loopengine.guard.limit": 1,
        "loopengine.outcome": "turn_limit",
    }
    trip = next(e for e in seen if isinstance(e, events.GuardTripped))
    assert event.timestamp == ns(trip.at)


async def test_run_span_joins_the_callers_trace(
    tracer_provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """A run started inside a span becomes that span's child."""
    tracer = tracer_provider.get_tracer("caller")
    with tracer.start_as_current_span("request") as parent:
        await traced_run(tracer_provider, [Reply.text("hi")])
    (run,) = by_name(exporter.get_finished_spans(), "invoke_agent otel.test")
    assert run.parent is not None
    assert run.parent.span_id == parent.get_span_context().span_id


async def test_a_delegated_run_s_span_is_its_parent_run_s_child(
    tracer_provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """RunStarted names a delegated run's parent, and its span is the parent run's
    span's child, in the parent's trace, with loopengine.run.parent_id."""
    clock = FakeClock(wall_start=START)
    seen: list[events.Event] = []
    engine = le.Engine(ScriptedProvider([
        Reply.tool_calls(("helper", {"task": "look"})), Reply.text("found"),
        Reply.text("done")], clock=clock), prices=PRICES, clock=clock,
        observers=[OpenTelemetryObserver(tracer_provider), seen.append])
    child_op = le.Operation(name="otel.child", provider="anthropic", model=MODEL,
                            max_output_tokens=300)
    helper = le.agent_tool(engine, child_op, name="helper", description="Looks.")
    result = await engine.run(OPERATION, "go", tools=[helper])
    assert result.completed
    started = {e.operation: e for e in seen if isinstance(e, events.RunStarted)}
    assert started["otel.test"].parent_invocation_id is None
    child_id = started["otel.child"].run_id
    assert started["otel.child"].parent_invocation_id == result.invocation_id != child_id
    spans = exporter.get_finished_spans()
    (parent,) = by_name(spans, "invoke_agent otel.test")
    (child,) = by_name(spans, "invoke_agent otel.child")
    assert child.parent is not None and child.parent.span_id == parent.context.span_id
    assert child.context.trace_id == parent.context.trace_id
    assert child.attributes is not None and parent.attributes is not None
    assert child.attributes["loopengine.run.parent_id"] == result.invocation_id
    assert "loopengine.run.parent_id" not in parent.attributes


def test_provider_names_follow_the_conventions() -> None:
    """Routes map onto the well-known gen_ai.provider.name values."""
    assert [provider_name(r) for r in ("anthropic", "bedrock", "vertex", "other")] == [
        "anthropic", "aws.bedrock", "gcp.vertex_ai", "other"]


def test_only_the_otel_module_imports_opentelemetry() -> None:
    """No other loopengine module imports OpenTelemetry, so `import loopengine` never needs it."""
    package = Path(le.__file__).parent
    importers = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "opentelemetry" or n.startswith("opentelemetry.") for n in names):
                importers.add(path.relative_to(package).as_posix())
    assert importers == {"otel.py"}


# The anthropic SDK imports opentelemetry-api itself, so the blocker goes in
# after `import loopengine` and unloads what the SDK loaded.
MISSING_OTEL = """
import sys
import loopengine
for name in [m for m in sys.modules if m == "opentelemetry" or m.startswith("opentelemetry.")]:
    del sys.modules[name]
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ModuleNotFoundError("No module named " + repr(name))
sys.meta_path.insert(0, Block())
try:
    import loopengine.otel
except ImportError as error:
    print(error)
else:
    raise SystemExit("loopengine.otel imported without opentelemetry")
"""


def test_otel_module_says_how_to_install_the_extra() -> None:
    """Without OpenTelemetry, importing loopengine.otel fails with the pip command to fix it."""
    done = subprocess.run([sys.executable, "-c", MISSING_OTEL], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "pip install 'loopengine-core[otel]'" in done.stdout


@pytest.mark.parametrize(("arguments", "field"), [
    ({"tracer_provider": 3}, "tracer_provider"),
    ({"providers": 3}, "providers"),
    ({"providers": [3]}, "providers"),
    ({"providers": {"anthropic": "not a provider"}}, "providers['anthropic']"),
])
def test_an_observer_given_no_tracer_provider_or_providers_names_the_argument(
    arguments: dict[str, Any], field: str
) -> None:
    """``OpenTelemetryObserver(tracer_provider=3)`` was an AttributeError from inside
    OpenTelemetry, ``providers=3`` a TypeError; each is a ConfigError naming it."""
    with pytest.raises(le.ConfigError) as caught:
        OpenTelemetryObserver(**arguments)
    assert caught.value.field == field
    OpenTelemetryObserver(TracerProvider(), providers=[ScriptedProvider([])])  # the valid form


async def test_a_tool_span_cut_by_the_callers_cancellation_ends_with_its_call(
    tracer_provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    """A run cancelled while a handler runs: the call's `ToolCallEvent` ``failed``
    (``cancelled``) ends its execute_tool span, with error.type ``cancelled``,
    at that event's time."""
    import anyio

    entered = anyio.Event()

    @le.tool(name="slow", description="Take forever.")
    async def slow(key: str) -> str:
        entered.set()
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    clock = FakeClock(wall_start=START)
    seen: list[events.Event] = []
    script = [Reply.tool_calls(("slow", {"key": "k"}), usage=USAGE)]
    engine = le.Engine(ScriptedProvider(script, clock=clock), prices=PRICES, clock=clock,
                       observers=[OpenTelemetryObserver(tracer_provider), seen.append])
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as group:
            group.start_soon(lambda: engine.run(OPERATION, "go", tools=[slow]))
            await entered.wait()
            clock.advance(1.5)
            scope.cancel()
    (span,) = by_name(exporter.get_finished_spans(), "execute_tool slow")
    (ended,) = [e for e in seen if isinstance(e, events.ToolCallEvent) and e.status == "failed"]
    assert ended.error == "cancelled" and ended.latency_ms == 1500
    assert span.attributes is not None
    assert span.attributes["loopengine.tool.status"] == "failed"
    assert span.attributes["error.type"] == "cancelled"
    assert span.status.status_code is StatusCode.ERROR
    assert span.end_time == ns(ended.at)


async def test_an_observer_remembers_only_the_latest_pauses_to_link_resumes_to(
    tracer_provider: TracerProvider, exporter: InMemorySpanExporter,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Runs resumed elsewhere, or never, do not grow the observer for its lifetime:
    past its limit the oldest pause is forgotten, and its resume's span has no link,
    while a recent pause's resume still links to the segment before."""
    monkeypatch.setattr(otel, "_PAUSED_LINKS", 2)

    @le.tool(approval=True)
    async def refund(order_id: str) -> str:
        """Refund an order."""
        return "refunded"

    clock = FakeClock(wall_start=START)
    observer = OpenTelemetryObserver(tracer_provider)
    engine = le.Engine(ScriptedProvider(
        [Reply.tool_calls(("refund", {"order_id": str(n)})) for n in range(3)]
        + [Reply.text("done")] * 2, clock=clock), prices=PRICES, clock=clock,
        observers=[observer])
    paused = [await engine.run(OPERATION, "refund", tools=[refund]) for _ in range(3)]
    assert all(p.outcome is le.Outcome.PAUSED for p in paused)
    assert list(observer._paused) == [p.invocation_id for p in paused[1:]]

    for result in (paused[0], paused[2]):
        assert result.state is not None
        await engine.resume(result.state, decisions={result.pending[0].id: le.Approve()},
                            tools=[refund])
    resumed = {s.attributes["loopengine.run.id"]: s for s in exporter.get_finished_spans()
               if s.attributes and s.attributes.get("loopengine.run.resumed")}
    assert resumed[paused[0].invocation_id].links == ()
    assert len(resumed[paused[2].invocation_id].links) == 1
    assert list(observer._paused) == [paused[1].invocation_id]
