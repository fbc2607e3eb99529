"""Bedrock's and Vertex's errors, as their endpoints send them, classified at the
one place (AnthropicProvider's classify_error) into docs/architecture.md's fault
table: through the SDK's platform clients and the loopback fakes, in error
responses and inside streams."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

import loopengine as le
from loopengine.providers import FaultKind
from loopengine.testing import (
    CutStream,
    DropConnection,
    ErrorReply,
    FakeBedrockServer,
    FakeClock,
    FakeVertexServer,
    Reply,
    StreamErrorEvent,
)

from ..adapter.conftest import STREAMING
from .conftest import BEDROCK, VERTEX, PlatformHarness

TWO = le.RetryPolicy(max_attempts=2, initial_wait=0.001, max_wait=0.002)

BEDROCK_ERRORS = [
    (429, "ThrottlingException", FaultKind.RATE_LIMITED),
    (400, "ServiceQuotaExceededException", FaultKind.RATE_LIMITED),
    (503, "ServiceUnavailableException", FaultKind.OVERLOADED),
    (429, "ModelNotReadyException", FaultKind.SERVER_ERROR),
    (500, "InternalServerException", FaultKind.SERVER_ERROR),
    (424, "ModelErrorException", FaultKind.SERVER_ERROR),
    (408, "ModelTimeoutException", FaultKind.TIMEOUT),
    (400, "ValidationException", FaultKind.BAD_REQUEST),
    (404, "ResourceNotFoundException", FaultKind.BAD_REQUEST),
    (403, "AccessDeniedException", FaultKind.UNAUTHORIZED),
    (403, "UnrecognizedClientException", FaultKind.UNAUTHORIZED),
]

VERTEX_ERRORS = [
    (429, "RESOURCE_EXHAUSTED", FaultKind.RATE_LIMITED),
    (403, "PERMISSION_DENIED", FaultKind.UNAUTHORIZED),
    (401, "UNAUTHENTICATED", FaultKind.UNAUTHORIZED),
    (400, "INVALID_ARGUMENT", FaultKind.BAD_REQUEST),
    (404, "NOT_FOUND", FaultKind.BAD_REQUEST),
    (503, "UNAVAILABLE", FaultKind.SERVER_ERROR),
    (504, "DEADLINE_EXCEEDED", FaultKind.TIMEOUT),
]


async def _first_fault(wire: PlatformHarness, item: object, *, stream: bool) -> le.RunResult:
    """Run with two attempts: a retried fault is followed by the scripted answer."""
    engine, _ = wire.engine(item, Reply.text("recovered"), stream=stream)
    return await engine.run(wire.platform.operation(retry=TWO), "go")


def _check(result: le.RunResult, wire: PlatformHarness, status: int, name: str,
           kind: FaultKind) -> None:
    first = result.attempt_log[0].settle
    assert first is not None
    assert (first.fault, first.http_status, first.error_code) == (kind.value, status, name)
    if kind.retryable:
        assert result.outcome is le.Outcome.COMPLETED and result.answer == "recovered"
        assert len(wire.requests) == 2
    else:
        assert result.outcome is le.Outcome.PROVIDER_ERROR and len(wire.requests) == 1


@pytest.mark.parametrize("platform", [BEDROCK], ids=["bedrock"])
@pytest.mark.parametrize(("status", "name", "kind"), BEDROCK_ERRORS,
                         ids=[name for _, name, _ in BEDROCK_ERRORS])
@STREAMING
async def test_bedrock_exceptions_by_x_amzn_errortype(
    wire: PlatformHarness, status: int, name: str, kind: FaultKind, stream: bool
) -> None:
    """Each Bedrock exception (named in x-amzn-errortype, the body only
    {"message": ...}) is its fault kind; the transient ones are retried."""
    item = ErrorReply(status=status, type=name, message=f"{name} from the fake")
    result = await _first_fault(wire, item, stream=stream)
    _check(result, wire, status, name, kind)
    assert wire.requests[0].path.endswith("/invoke-with-response-stream" if stream
                                          else "/invoke")


@pytest.mark.parametrize("platform", [VERTEX], ids=["vertex"])
@pytest.mark.parametrize(("status", "name", "kind"), VERTEX_ERRORS,
                         ids=[name for _, name, _ in VERTEX_ERRORS])
@STREAMING
async def test_vertex_google_errors_by_status(
    wire: PlatformHarness, status: int, name: str, kind: FaultKind, stream: bool
) -> None:
    """Each Google error status Vertex answers with ({"error": {"code", "status",
    "message"}}) is its fault kind; the transient ones are retried."""
    item = ErrorReply(status=status, type=name, message=f"{name} from the fake")
    result = await _first_fault(wire, item, stream=stream)
    _check(result, wire, status, name, kind)


@pytest.mark.parametrize("platform", [VERTEX], ids=["vertex"])
@STREAMING
async def test_vertex_relays_the_models_overload_and_rate_limit(
    wire: PlatformHarness, stream: bool
) -> None:
    """A Messages API error Vertex relays (529 overloaded_error, 429
    rate_limit_error with retry-after) reads as it does from Anthropic."""
    engine, _ = wire.engine(ErrorReply.overloaded(), ErrorReply.rate_limited(retry_after=2),
                            Reply.text("ok"), stream=stream)
    result = await engine.run(wire.platform.operation(), "go")
    assert result.outcome is le.Outcome.COMPLETED
    first, second, _ = (a.settle for a in result.attempt_log)
    assert first is not None and second is not None
    assert (first.fault, first.http_status) == ("overloaded", 529)
    assert (second.fault, second.http_status) == ("rate_limited", 429)
    assert wire.clock.sleeps[-1] == 2.0


@pytest.mark.parametrize("platform", [VERTEX], ids=["vertex"])
@STREAMING
async def test_vertex_quota_retry_info_delay_is_the_wait_slept(
    wire: PlatformHarness, stream: bool
) -> None:
    """Vertex's own quota 429 names its wait in a google.rpc.RetryInfo detail, read
    as on the Gemini route: its retryDelay is slept (winning over retry-after)."""
    quota = FakeVertexServer.quota_exceeded("7.5s", headers={"retry-after": "1"})
    engine, _ = wire.engine(quota, Reply.text("ok"), stream=stream)
    result = await engine.run(wire.platform.operation(), "go")
    assert result.outcome is le.Outcome.COMPLETED and result.answer == "ok"
    assert wire.clock.sleeps == [7.5] and len(wire.requests) == 2
    first = result.attempt_log[0].settle
    assert first is not None and (first.fault, first.http_status, first.error_code) == (
        "rate_limited", 429, "RESOURCE_EXHAUSTED")


@pytest.mark.parametrize("platform", [VERTEX], ids=["vertex"])
async def test_vertex_retry_info_beyond_the_deadline_ends_the_run(
    wire: PlatformHarness,
) -> None:
    """A per-day quota's long retryDelay is not slept past the run's deadline (R04)."""
    engine, _ = wire.engine(FakeVertexServer.quota_exceeded("3600s"), Reply.text("never"))
    result = await engine.run(wire.platform.operation(total_time=60.0), "go")
    assert result.outcome is not le.Outcome.COMPLETED
    assert len(wire.requests) == 1 and wire.clock.sleeps == []


@pytest.mark.parametrize("platform", [BEDROCK], ids=["bedrock"])
@pytest.mark.parametrize(("frame", "kind"), [
    ("throttlingException", FaultKind.RATE_LIMITED),
    ("serviceUnavailableException", FaultKind.OVERLOADED),
    ("modelStreamErrorException", FaultKind.SERVER_ERROR),
    ("internalServerException", FaultKind.SERVER_ERROR),
    ("modelTimeoutException", FaultKind.TIMEOUT),
    ("validationException", FaultKind.BAD_REQUEST),
])
async def test_bedrock_exception_frames_inside_a_stream(
    wire: PlatformHarness, frame: str, kind: FaultKind
) -> None:
    """An exception frame after some chunks of the event stream (status 200) is
    classified by its :exception-type; the usage seen before it is a floor."""
    engine, _ = wire.engine(
        StreamErrorEvent(reply=Reply.text("one two three four",
                                          usage=le.Usage(input_tokens=100, output_tokens=20)),
                         after=3, type=frame, message="interrupted"),
        Reply.text("recovered"), stream=True)
    result = await engine.run(wire.platform.operation(retry=TWO), "go")
    first = result.attempt_log[0].settle
    assert first is not None
    assert (first.fault, first.http_status, first.error_code) == (kind.value, 200, frame)
    assert first.response_id == "msg_fake_0001"
    assert first.usage is not None and first.usage.input_tokens == 100 and first.usage_approx
    if kind.retryable:
        assert result.outcome is le.Outcome.COMPLETED and len(wire.requests) == 2
    else:
        assert result.outcome is le.Outcome.PROVIDER_ERROR and len(wire.requests) == 1


@STREAMING
async def test_the_models_mid_stream_overload_is_retried_on_both_platforms(
    wire: PlatformHarness, stream: bool
) -> None:
    """The model overloading mid-answer (Bedrock: a modelStreamErrorException frame;
    Vertex: the Messages API's error event) is retried; a JSON request gets the
    platform's overload status instead, also retried."""
    engine, _ = wire.engine(StreamErrorEvent(reply=Reply.text("partial answer")),
                            Reply.text("whole answer"), stream=stream)
    result = await engine.run(wire.platform.operation(), "go")
    assert result.outcome is le.Outcome.COMPLETED and result.answer == "whole answer"
    first = result.attempt_log[0].settle
    assert first is not None and first.fault in ("overloaded", "server_error")
    assert len(wire.requests) == 2


@pytest.mark.parametrize("how", ["end", "drop"])
async def test_a_cut_stream_is_aborted_with_its_usage_as_a_floor(
    wire: PlatformHarness, how: str
) -> None:
    """A stream (Bedrock's event stream, Vertex's server-sent events) that stops
    before message_stop, cleanly or by a dropped connection, is an aborted
    attempt carrying the usage it had reported; it is retried."""
    engine, _ = wire.engine(
        CutStream(reply=Reply.text("a long answer cut short",
                                   usage=le.Usage(input_tokens=100, output_tokens=20)),
                  after=3, how=how),
        Reply.text("whole"), stream=True)
    result = await engine.run(wire.platform.operation(), "go")
    assert result.outcome is le.Outcome.COMPLETED and result.answer == "whole"
    first = result.attempt_log[0].settle
    assert first is not None and first.fault == "aborted"
    assert first.usage is not None and first.usage.input_tokens == 100 and first.usage_approx
    assert first.response_id == "msg_fake_0001"


async def test_a_dropped_connection_is_a_connection_fault(wire: PlatformHarness) -> None:
    """A connection reset before any response is a connection fault, retried."""
    engine, _ = wire.engine(DropConnection(), Reply.text("after the drop"))
    result = await engine.run(wire.platform.operation(), "go")
    assert result.answer == "after the drop"
    first = result.attempt_log[0].settle
    assert first is not None and first.fault == "connection"


class _CorruptFrameBedrock(FakeBedrockServer):
    """Bedrock whose fourth event-stream frame served arrives with its message
    checksum broken (as a damaged connection or proxy would deliver it)."""

    frames = 0

    def _event(self, name: str, data: Mapping[str, Any]) -> bytes:
        frame = super()._event(name, data)
        self.frames += 1
        return frame[:-1] + bytes([frame[-1] ^ 0xFF]) if self.frames == 4 else frame


async def test_a_bedrock_frame_that_does_not_decode_is_an_invalid_response(
    clock: FakeClock,
) -> None:
    """An event-stream frame whose checksum does not add up is the attempt's
    ``server_error`` (``invalid_response``, status 200), retried, keeping the
    request id, the response id and the usage served before it as a floor."""
    with _CorruptFrameBedrock([
            Reply.text("one two three four", usage=le.Usage(input_tokens=100, output_tokens=20)),
            Reply.text("recovered")]) as server:
        h = PlatformHarness(server, clock, BEDROCK)
        try:
            engine, _ = h.engine(stream=True)
            result = await engine.run(BEDROCK.operation(retry=TWO), "go")
        finally:
            await h.aclose()
    assert result.outcome is le.Outcome.COMPLETED and result.answer == "recovered"
    first = result.attempt_log[0].settle
    assert first is not None
    assert (first.fault, first.http_status, first.error_code) == (
        "server_error", 200, "invalid_response")
    assert first.response_id == "msg_fake_0001" and first.request_id is not None
    assert first.usage is not None and first.usage.input_tokens == 100 and first.usage_approx
