"""OpenTelemetry spans from loopengine's events, after the GenAI semantic conventions.

Install the extra (``pip install 'loopengine-core[otel]'``) and pass an observer::

    from loopengine.otel import OpenTelemetryObserver

    engine = Engine(provider, observers=[OpenTelemetryObserver()])

Each run gives one ``invoke_agent {operation}`` span; under it, one
``chat {model}`` span per attempt (``generate_content {model}`` for
Gemini's requests, on the Gemini API or Vertex AI; each wire request,
retries included) and
one ``execute_tool {tool}`` span per tool call. Span times are the events'
times. The run span is a child of whatever span is current where the run was
started, so a run joins the caller's trace. A run that pauses for approval
gives one run span per running segment: the span ends at `RunPaused`
(``loopengine.outcome`` ``paused``, not an error) and its resume starts a new
one at `RunResumed`, with the same ``loopengine.run.id``, linked to the
segment before when this observer saw it.

Give the observer the engine's providers to have ``server.address`` and
``server.port`` (read from each provider's SDK client's ``base_url``)::

    provider = AnthropicProvider(api_key=...)
    engine = Engine(provider, observers=[OpenTelemetryObserver(providers=[provider])])

No message content is ever put on a span: the events carry none (no prompts,
no answers, no tool inputs or outputs), so there is nothing to opt in to.
docs/observability.md lists every attribute.

Importing `loopengine` never needs OpenTelemetry; only this module does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from urllib.parse import urlsplit

try:
    from opentelemetry import trace
    from opentelemetry.context import Context
    from opentelemetry.semconv.attributes.error_attributes import ERROR_TYPE
    from opentelemetry.semconv.attributes.server_attributes import SERVER_ADDRESS, SERVER_PORT
    from opentelemetry.trace import Span, SpanKind, Status, StatusCode, TracerProvider
    from opentelemetry.util.types import AttributeValue
except ImportError as error:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "loopengine.otel needs OpenTelemetry, which is not installed: "
        "pip install 'loopengine-core[otel]'"
    ) from error

from loopengine import __version__, _validate
from loopengine._errors import ConfigError
from loopengine._usage import Usage
from loopengine.events import (
    AttemptSettled,
    AttemptStarted,
    Event,
    GuardTripped,
    RunEnded,
    RunResumed,
    RunSegment,
    RunStarted,
    RunTotals,
    ToolCallEvent,
)
from loopengine.providers._base import Provider, genai_operation_of

__all__ = ["OpenTelemetryObserver", "provider_name"]

# gen_ai.provider.name has well-known values; our route names map onto them.
# GeminiProvider's vendor is ``google`` on the Gemini API (``gcp.gemini``) and
# ``google-vertex`` on Vertex AI, as Claude on Vertex is.
_PROVIDER_NAMES = {"anthropic": "anthropic", "bedrock": "aws.bedrock", "vertex": "gcp.vertex_ai",
                   "aws-bedrock": "aws.bedrock", "google-vertex": "gcp.vertex_ai",
                   "google": "gcp.gemini", "openai": "openai", "azure": "azure.ai.openai"}

# The GenAI names are spelled out rather than imported: the conventions'
# package keeps them in an unstable module that has already moved once (they
# now live in the separate GenAI conventions), while the stable ones above
# (error.type, server.*) are imported. tests/test_otel_conventions.py checks
# every name used here against the package.
GEN_AI_CONVERSATION_ID = "gen_ai.conversation.id"
GEN_AI_OUTPUT_TYPE = "gen_ai.output.type"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"

# error.type of a failed tool call: the event's reason when it is one of these
# fixed ones, the exception's class for a handler that raised, else _OTHER
# (the conventions' fallback), so a span never carries free text.
_TOOL_ERRORS = frozenset({"unknown tool", "invalid input", "invalid output", "deadline",
                          "duplicate", "max_calls", "timeout", "cancelled"})
_OTHER = "_OTHER"
_DEFAULT_PORTS = {"https": 443, "http": 80}

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

_PAUSED_LINKS = 10_000
"""How many paused runs an observer remembers, to link their resumes to: a run
may be resumed in another process, or never, so the oldest are forgotten (their
resumes start an unlinked span) rather than kept for the observer's lifetime."""


def provider_name(route: str) -> str:
    """The ``gen_ai.provider.name`` value for an operation's ``provider`` route.

    ``aws-bedrock`` (or ``bedrock``) is ``aws.bedrock``, ``google-vertex``
    (or ``vertex``) is ``gcp.vertex_ai``, ``google`` (the Gemini API) is
    ``gcp.gemini`` and ``azure`` is ``azure.ai.openai``, as the conventions
    name them; other routes are given as they are.
    """
    return _PROVIDER_NAMES.get(route, route)


def _ns(at: datetime) -> int:
    # Integer arithmetic: a float timestamp would lose the microseconds.
    return (at - _EPOCH) // timedelta(microseconds=1) * 1000


def _tool_error_type(error: str | None) -> str:
    """The low-cardinality ``error.type`` of a failed tool call's ``error``.

    ``unknown tool``, ``invalid input``, ``invalid output``, ``deadline``,
    ``duplicate``, ``max_calls``, ``timeout`` and ``cancelled`` are kept;
    ``handler raised ValueError`` gives the exception's class name
    (``ValueError``); anything else is ``_OTHER``.
    """
    if error in _TOOL_ERRORS:
        assert error is not None
        return error
    if error is not None and error.startswith("handler raised "):
        name = error.removeprefix("handler raised ")
        if name.isidentifier():
            return name
    return _OTHER


def _server_attributes(provider: object) -> dict[str, AttributeValue]:
    """``server.address`` and ``server.port`` of a provider's SDK client, if it has one.

    Read defensively from ``provider.client.base_url`` (the ``anthropic`` and
    ``openai`` clients have one); the port is the URL's, else the scheme's
    default. A provider without a client (`ScriptedProvider`) gives nothing.
    """
    try:
        base_url = getattr(getattr(provider, "client", None), "base_url", None)
        if base_url is None:
            return {}
        parts = urlsplit(str(base_url))
        host, port = parts.hostname, parts.port or _DEFAULT_PORTS.get(parts.scheme)
    except Exception:  # a provider's property must never break tracing
        return {}
    if not host:
        return {}
    attributes: dict[str, AttributeValue] = {SERVER_ADDRESS: host}
    if port is not None:
        attributes[SERVER_PORT] = port
    return attributes


@dataclass(slots=True)
class _RunSpans:
    span: Span
    context: Context
    provider: str
    model: str
    operation: str
    """The attempts' ``gen_ai.operation.name``."""
    common: dict[str, AttributeValue]
    """Attributes every span of the run carries (conversation id, output type)."""
    attempts: dict[int, Span] = field(default_factory=dict)
    tools: dict[tuple[str, str], list[Span]] = field(default_factory=dict)
    """Open tool spans by (call id, tool name), oldest first: a reply may repeat
    a call id, and each of its calls still gets a span of its own."""


class OpenTelemetryObserver:
    """An observer that turns a run's events into OpenTelemetry spans.

    It is synchronous and cheap: each event starts, annotates or ends a span.
    One observer can serve many concurrent runs (spans are kept by run id).

    Args:
        tracer_provider: Where spans go; the global tracer provider by default.
        providers: The engine's providers (one, a list, or the mapping of
            route to provider given to `Engine`), to put ``server.address``
            and ``server.port`` on each attempt span of their route. Read once,
            here; a provider without an SDK client adds nothing.
    """

    def __init__(
        self,
        tracer_provider: TracerProvider | None = None,
        *,
        providers: Provider | Iterable[Provider] | Mapping[str, Provider] | None = None,
    ) -> None:
        if tracer_provider is not None and not callable(
                getattr(tracer_provider, "get_tracer", None)):
            raise ConfigError("tracer_provider", "must be an OpenTelemetry TracerProvider "
                                                 f"or None, got {_validate.shown(tracer_provider)}")
        self._tracer = trace.get_tracer("loopengine", __version__,
                                        tracer_provider=tracer_provider)
        self._runs: dict[str, _RunSpans] = {}
        self._paused: dict[str, trace.SpanContext] = {}
        """The last span of each paused run this observer saw, to link its resume to
        (the latest `_PAUSED_LINKS`, oldest first)."""
        if providers is None:
            routes: dict[str, object] = {}
        elif isinstance(providers, Mapping):
            routes = dict(providers)
        elif _validate.implements(providers, Provider):
            routes = {getattr(providers, "name", ""): providers}
        else:
            routes = {getattr(p, "name", ""): p
                      for p in _validate.items("providers", providers)}
        for route, item in routes.items():
            if not _validate.implements(item, Provider):
                raise ConfigError(f"providers[{route!r}]" if isinstance(providers, Mapping)
                                  else "providers",
                                  f"must hold Providers, got {_validate.shown(item)}")
        self._servers = {route: _server_attributes(p) for route, p in routes.items()}

    def __call__(self, event: Event) -> None:
        """Handle one event (the observer protocol)."""
        if isinstance(event, RunSegment):
            self._run_started(event)
            return
        run = self._runs.get(event.run_id)
        if run is None:
            return  # the run began before this observer saw it
        if isinstance(event, AttemptStarted):
            self._attempt_started(run, event)
        elif isinstance(event, AttemptSettled):
            self._attempt_settled(run, event)
        elif isinstance(event, ToolCallEvent):
            self._tool_call(run, event)
        elif isinstance(event, GuardTripped):
            self._guard_tripped(run, event)
        elif isinstance(event, RunTotals):
            self._run_ended(event)

    # -- runs -------------------------------------------------------------------------

    def _run_started(self, event: RunSegment) -> None:
        # The vendor, not a named route's own name (anthropic-eu is anthropic).
        vendor = getattr(event, "vendor", None)
        provider = provider_name(vendor if isinstance(vendor, str) else event.provider)
        attributes: dict[str, AttributeValue] = {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.agent.name": event.operation,
            "gen_ai.agent.version": event.operation_version,
            "gen_ai.provider.name": provider,
            "gen_ai.request.model": event.model,
            "loopengine.run.id": event.run_id,
            "loopengine.run.kind": event.kind,
        }
        if event.tenant is not None:
            attributes["loopengine.tenant"] = event.tenant
        if event.feature is not None:
            attributes["loopengine.feature"] = event.feature
        common: dict[str, AttributeValue] = {}
        # The conventions want the application's own conversation id, not one
        # minted for telemetry: the attribution's correlation id when the
        # caller gave one (it spans the runs of one chat), else the invocation
        # id, the run's durable id in the ledger (never a new UUID).
        conversation = getattr(event, "correlation_id", None)
        common[GEN_AI_CONVERSATION_ID] = (conversation if isinstance(conversation, str)
                                          else event.run_id)
        if event.kind == "call":
            common[GEN_AI_OUTPUT_TYPE] = "json"  # a structured call asks for JSON
        attributes.update(common)
        links = []
        context: Context | None = None
        if isinstance(event, RunResumed):
            attributes["loopengine.run.resumed"] = True
            before = self._paused.pop(event.run_id, None)
            if before is not None:
                links.append(trace.Link(before))
        elif isinstance(event, RunStarted) and event.parent_invocation_id is not None:
            attributes["loopengine.run.parent_id"] = event.parent_invocation_id
            # A delegated run's span is its parent run's child, when this
            # observer sees the parent (the tool's handler has no current span).
            parent = self._runs.get(event.parent_invocation_id)
            if parent is not None:
                context = parent.context
        # Without a context: the span's parent is the caller's current span.
        span = self._tracer.start_span(
            f"invoke_agent {event.operation}", context=context, kind=SpanKind.INTERNAL,
            attributes=attributes, start_time=_ns(event.at), links=links,
        )
        # gen_ai.operation.name of its attempts: what the run's provider says its
        # requests are (`Provider.genai_operation`), else what its vendor's are.
        operation = event.genai_operation or genai_operation_of(
            vendor if isinstance(vendor, str) else event.provider)
        self._runs[event.run_id] = _RunSpans(
            span=span, context=trace.set_span_in_context(span), provider=provider,
            model=event.model, operation=operation, common=common,
        )

    def _guard_tripped(self, run: _RunSpans, event: GuardTripped) -> None:
        attributes: dict[str, AttributeValue] = {
            "loopengine.guard.name": event.guard,
            "loopengine.guard.observed": event.observed,
            "loopengine.outcome": event.outcome,
        }
        if event.limit is not None:
            attributes["loopengine.guard.limit"] = event.limit
        run.span.add_event("loopengine.guard_tripped", attributes, timestamp=_ns(event.at))

    def _run_ended(self, event: RunTotals) -> None:
        run = self._runs.pop(event.run_id)
        outcome = event.outcome if isinstance(event, RunEnded) else "paused"
        # Tool or attempt spans still open (a cancelled or failed run) end with it.
        cut = "failed" if outcome == "failed" else "cancelled"
        for span in [*run.attempts.values(), *(s for spans in run.tools.values() for s in spans)]:
            span.set_attribute(ERROR_TYPE, cut)
            span.set_status(Status(StatusCode.ERROR, "the run ended first"))
            span.end(end_time=_ns(event.at))
        span = run.span
        span.set_attributes({
            "loopengine.outcome": outcome,
            "loopengine.turns": event.turns,
            "loopengine.tool_calls": event.tool_calls,
            "loopengine.attempts": event.attempts,
            "loopengine.cost_usd": float(event.cost_usd),
            "loopengine.credits": event.credits,
            **_usage_attributes(event.usage),
        })
        if outcome == "paused":
            self._paused.pop(event.run_id, None)
            self._paused[event.run_id] = span.get_span_context()
            while len(self._paused) > _PAUSED_LINKS:
                del self._paused[next(iter(self._paused))]
        elif outcome != "completed":
            span.set_attribute(ERROR_TYPE, outcome)
            span.set_status(Status(StatusCode.ERROR, f"the run ended {outcome}"))
        span.end(end_time=_ns(event.at))

    # -- attempts ---------------------------------------------------------------------

    def _attempt_started(self, run: _RunSpans, event: AttemptStarted) -> None:
        operation = run.operation
        run.attempts[event.ordinal] = self._tracer.start_span(
            f"{operation} {event.model}", context=run.context, kind=SpanKind.CLIENT,
            start_time=_ns(event.at),
            attributes={
                "gen_ai.operation.name": operation,
                "gen_ai.provider.name": run.provider,
                "gen_ai.request.model": event.model,
                "gen_ai.request.max_tokens": event.max_tokens,
                "loopengine.run.id": event.run_id,
                "loopengine.attempt.ordinal": event.ordinal,
                "loopengine.attempt.turn": event.turn,
                "loopengine.attempt.number": event.attempt,
                "loopengine.attempt.phase": event.phase,
                "loopengine.attempt.timeout_ms": event.timeout_ms,
                "loopengine.attempt.wait_ms": event.wait_ms,
                **self._servers.get(event.provider, {}),
                **run.common,
            },
        )

    def _attempt_settled(self, run: _RunSpans, event: AttemptSettled) -> None:
        span = run.attempts.pop(event.ordinal, None)
        if span is None:
            return
        attributes: dict[str, AttributeValue] = {
            "loopengine.attempt.outcome": event.outcome,
            "loopengine.attempt.charged": event.charged,
        }
        if event.response_id is not None:
            attributes["gen_ai.response.id"] = event.response_id
        # The model the provider says answered, when the event carries it.
        response_model = getattr(event, "response_model", None)
        if isinstance(response_model, str):
            attributes[GEN_AI_RESPONSE_MODEL] = response_model
        if event.stop_reason is not None:
            attributes["gen_ai.response.finish_reasons"] = (event.stop_reason,)
        if event.usage is not None:
            attributes.update(_usage_attributes(event.usage))
            attributes["loopengine.usage.approximate"] = event.usage_approx
        if event.http_status is not None:
            attributes["http.response.status_code"] = event.http_status
        if event.request_id is not None:
            attributes["loopengine.request.id"] = event.request_id
        if event.cost_usd is not None:
            attributes["loopengine.cost_usd"] = float(event.cost_usd)
        if event.error_code is not None:
            attributes["loopengine.error.code"] = event.error_code
        if event.aborted_reason is not None:
            attributes["loopengine.attempt.aborted_reason"] = event.aborted_reason
        error = event.fault or ("aborted" if event.outcome == "aborted" else None)
        if error is not None:
            attributes[ERROR_TYPE] = error
            span.set_status(Status(StatusCode.ERROR, f"attempt {event.outcome}: {error}"))
        span.set_attributes(attributes)
        span.end(end_time=_ns(event.at))

    # -- tools ------------------------------------------------------------------------

    def _tool_call(self, run: _RunSpans, event: ToolCallEvent) -> None:
        key = (event.tool_use_id, event.tool_name)
        if event.status == "started":
            run.tools.setdefault(key, []).append(self._tracer.start_span(
                f"execute_tool {event.tool_name}", context=run.context,
                kind=SpanKind.INTERNAL, start_time=_ns(event.at),
                attributes={
                    "gen_ai.operation.name": "execute_tool",
                    "gen_ai.tool.name": event.tool_name,
                    "gen_ai.tool.call.id": event.tool_use_id,
                    "gen_ai.tool.type": "function",
                    "loopengine.run.id": event.run_id,
                    "loopengine.attempt.turn": event.turn,
                    **run.common,
                },
            ))
            return
        open_spans = run.tools.get(key)
        if not open_spans:
            return
        span = open_spans.pop(0)
        if not open_spans:
            del run.tools[key]
        span.set_attribute("loopengine.tool.status", event.status)
        if event.status == "failed":
            kind = _tool_error_type(event.error)
            span.set_attribute(ERROR_TYPE, kind)
            span.set_status(Status(StatusCode.ERROR, f"the tool call failed: {kind}"))
        span.end(end_time=_ns(event.at))


def _usage_attributes(usage: Usage) -> dict[str, AttributeValue]:
    # The conventions count cached tokens inside gen_ai.usage.input_tokens;
    # Usage.input_tokens (Anthropic's convention) excludes them.
    return {
        "gen_ai.usage.input_tokens": usage.total_input_tokens,
        "gen_ai.usage.output_tokens": usage.output_tokens,
        "gen_ai.usage.cache_read.input_tokens": usage.cache_read_tokens,
        "gen_ai.usage.cache_creation.input_tokens": usage.cache_write_tokens,
    }
