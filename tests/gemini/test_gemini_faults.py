"""The Gemini rows of the fault table (docs/providers.md, "The Gemini provider"), row
by row, on the wire.

Each case scripts one fault on the FakeGeminiServer, followed by a good reply,
and runs a conversation through GeminiProvider and the real ``google-genai``
SDK, with JSON responses and with server-sent events. A retried fault
completes on the second request; a permanent one ends the run after the first.
"""

from __future__ import annotations

import dataclasses
import socket

import pytest

import loopengine as le
from loopengine.providers import FaultKind
from loopengine.testing import (
    CutStream,
    DropConnection,
    ErrorReply,
    FakeClock,
    FakeGeminiServer,
    Reply,
    StallStream,
    StreamErrorEvent,
)

from .. import rule_scenarios as scenarios
from ..adapter.conftest import STREAMING
from ..adapter.test_anthropic_faults import NEVER, Case, matrix
from .conftest import GeminiHarness, gemini_operation
from .test_gemini_rules import ROUTE


def error(status: int, name: str, message: str = "x", reason: str | None = None) -> ErrorReply:
    """A Gemini error body with this code, canonical status and ErrorInfo reason."""
    return ErrorReply(status=status, type=name, message=message, error_code=reason)


CASES = {
    # credit_exhausted (R06): whatever the status
    "429-prepayment-credits-depleted": Case(FakeGeminiServer.credits_depleted(),
                                            FaultKind.CREDIT_EXHAUSTED, False),
    "403-billing-disabled": Case(FakeGeminiServer.billing_disabled(),
                                 FaultKind.CREDIT_EXHAUSTED, False),
    "400-billing-disabled-reason": Case(error(400, "FAILED_PRECONDITION",
                                              reason="BILLING_DISABLED"),
                                        FaultKind.CREDIT_EXHAUSTED, False),
    "402": Case(ErrorReply(status=402), FaultKind.CREDIT_EXHAUSTED, False),
    # rate_limited: a per-minute or per-day quota
    "429-quota": Case(FakeGeminiServer.quota_exceeded("1s"), FaultKind.RATE_LIMITED, True),
    "429": Case(ErrorReply(status=429), FaultKind.RATE_LIMITED, True),
    "mid-stream-resource-exhausted": Case(
        StreamErrorEvent(reply=Reply.text("half an answer"), after=2,
                         type="RESOURCE_EXHAUSTED", message="quota"),
        FaultKind.RATE_LIMITED, True),
    # overloaded: a 503 that says so
    "503-overloaded": Case(error(503, "UNAVAILABLE",
                                 "The model is overloaded. Please try again later."),
                           FaultKind.OVERLOADED, True),
    "mid-stream-overloaded": Case(StreamErrorEvent(reply=Reply.text("half an answer"),
                                                   after=2),
                                  FaultKind.OVERLOADED, True),
    # server_error
    "500": Case(ErrorReply(status=500), FaultKind.SERVER_ERROR, True),
    "502-html": Case(ErrorReply(status=502, body="<html>bad gateway</html>"),
                     FaultKind.SERVER_ERROR, True),
    "503": Case(ErrorReply(status=503), FaultKind.SERVER_ERROR, True),
    "504": Case(ErrorReply(status=504), FaultKind.SERVER_ERROR, True),
    "mid-stream-internal": Case(
        StreamErrorEvent(reply=Reply.text("half an answer"), after=3, type="INTERNAL",
                         message="An internal error has occurred."),
        FaultKind.SERVER_ERROR, True),
    "200-not-a-response": Case(lambda request: ErrorReply(status=200, body="not json"),
                               FaultKind.SERVER_ERROR, True),
    # timeout
    "408": Case(ErrorReply(status=408), FaultKind.TIMEOUT, True),
    "sdk-timeout": Case(Reply.text("late", delay=NEVER), FaultKind.TIMEOUT, True,
                        attempt_timeout=1.0, mock_clock=True),
    # connection
    "reset": Case(DropConnection(), FaultKind.CONNECTION, True),
    "closed-before-response": Case(DropConnection(reset=False), FaultKind.CONNECTION, True),
    # The SDK reads a whole (JSON) response in one call: cut short, it failed
    # like a connection (retried all the same).
    "json-body-cut": Case(CutStream(reply=Reply.text("a long answer"), how="drop"),
                          FaultKind.CONNECTION, True),
    # aborted
    "stream-ends-before-finish-reason": Case(
        CutStream(reply=Reply.text("a long answer"), after=3), FaultKind.ABORTED, True,
        "aborted", streaming_only=True),
    "stream-cut-mid-body": Case(
        CutStream(reply=Reply.text("a long answer"), after=2, how="drop"), FaultKind.ABORTED,
        True, "aborted", streaming_only=True),
    # Quiet after the first word's chunk (the idle limit counts from there).
    "idle-stream": Case(StallStream(reply=Reply.text("a b c"), after=2, seconds=NEVER),
                        FaultKind.ABORTED, True, "aborted", streaming_only=True,
                        idle_timeout=1.0, mock_clock=True),
    # bad_request
    "400-invalid-argument": Case(error(400, "INVALID_ARGUMENT", "Request contains an invalid "
                                       "argument."), FaultKind.BAD_REQUEST, False),
    "404": Case(error(404, "NOT_FOUND", "models/gemini-0 is not found"),
                FaultKind.BAD_REQUEST, False),
    "mid-stream-invalid-argument": Case(
        StreamErrorEvent(reply=Reply.text("half an answer"), after=1,
                         type="INVALID_ARGUMENT", message="bad"),
        FaultKind.BAD_REQUEST, False),
    # unauthorized
    "401": Case(error(401, "UNAUTHENTICATED"), FaultKind.UNAUTHORIZED, False),
    "403": Case(error(403, "PERMISSION_DENIED", "Method doesn't allow unregistered callers",
                      reason="API_KEY_INVALID"), FaultKind.UNAUTHORIZED, False),
    # x-should-retry: false is obeyed even for a transient kind
    "503-should-retry-false": Case(ErrorReply(status=503, headers={"x-should-retry": "false"}),
                                   FaultKind.SERVER_ERROR, False),
}

# Only a stream can end early or go idle: those rows run once; a body that is
# not JSON is one only a whole response can have.
JSON_ONLY = frozenset({"200-not-a-response", "json-body-cut"})
MATRIX = matrix(CASES, mock_clock=False, json_only=JSON_ONLY)
TIMEOUTS = matrix(CASES, mock_clock=True, json_only=JSON_ONLY)


@pytest.mark.parametrize(("name", "stream"), MATRIX)
async def test_fault_matrix_kind_retry_and_outcome_gemini(
    wire: GeminiHarness, name: str, stream: bool
) -> None:
    """Each Gemini row of the fault table: the right kind, retried or not, the right
    outcome; every attempt is one request (the SDK never retries)."""
    await scenarios.fault_case(wire, ROUTE, CASES[name], stream)


@pytest.mark.parametrize(("name", "stream"), TIMEOUTS)
def test_fault_matrix_timeout_rows_on_the_mock_clock_gemini(
    fake_gemini_server: FakeGeminiServer, name: str, stream: bool
) -> None:
    """The timeout rows (the SDK's timeout, an idle stream) against a server that
    never answers, on trio's MockClock: the right kind, retried, in no real time."""
    scenarios.timeout_case(GeminiHarness(fake_gemini_server, FakeClock()),  # type: ignore[arg-type]
                           ROUTE, CASES[name], stream)


async def test_a_stream_cut_before_any_usage_has_unknown_usage_not_a_floor_gemini(
        wire: GeminiHarness) -> None:
    """A stream cut before its first chunk: aborted, usage unknown, not flagged a floor."""
    await scenarios.cut_before_any_usage(wire, ROUTE)


@STREAMING
async def test_retry_info_delay_is_the_wait_slept_gemini(
    wire: GeminiHarness, stream: bool
) -> None:
    """A quota 429's RetryInfo.retryDelay is the wait before the next attempt (it wins
    over a retry-after header); without it, retry-after is honoured."""
    quota = FakeGeminiServer.quota_exceeded("7.5s", headers={"retry-after": "1"})
    engine, _ = wire.engine(quota, ErrorReply(status=503, headers={"retry-after": "2"}),
                            Reply.text("ok"), stream=stream)
    result = await engine.run(gemini_operation(retry=le.RetryPolicy(max_attempts=3)), "go")
    assert result.outcome is le.Outcome.COMPLETED
    assert wire.clock.sleeps == [7.5, 2.0]
    first = result.attempt_log[0].settle
    assert first is not None and (first.fault, first.error_code) == (
        "rate_limited", "RESOURCE_EXHAUSTED")


@STREAMING
async def test_a_retry_delay_beyond_the_deadline_ends_the_run_gemini(
    wire: GeminiHarness, stream: bool
) -> None:
    """A per-day quota's long retryDelay is not slept past the run's deadline (R04)."""
    engine, _ = wire.engine(FakeGeminiServer.quota_exceeded("3600s"), Reply.text("never"),
                            stream=stream)
    result = await engine.run(gemini_operation(total_time=60.0), "go")
    assert result.outcome is not le.Outcome.COMPLETED
    assert len(wire.requests) == 1 and wire.clock.sleeps == []


async def test_a_stream_cut_keeps_the_usage_served_so_far_gemini(
    wire: GeminiHarness,
) -> None:
    """A stream cut before its finishReason is aborted and retried; its usage is the
    last chunk's cumulative counts (a floor), as the server counted it."""
    reply = Reply.text("a long answer", usage=le.Usage(input_tokens=50, output_tokens=8))
    engine, _ = wire.engine(CutStream(reply=reply, after=2), Reply.text("ok"), stream=True)
    result = await engine.run(gemini_operation(), "go")
    assert result.outcome is le.Outcome.COMPLETED
    aborted = result.attempt_log[0].settle
    assert aborted is not None and aborted.outcome == "aborted"
    assert aborted.response_id == "resp-fake-0001"
    # Two of the four chunks (three words and the finish chunk): 2/4 of 8 output tokens.
    assert aborted.usage == le.Usage(input_tokens=50, output_tokens=4)
    assert wire.server.usage_served == result.usage == le.Usage(input_tokens=150,
                                                                output_tokens=24)


@STREAMING
async def test_connection_refused_is_retried_then_ends_provider_error_gemini(
    wire: GeminiHarness, stream: bool
) -> None:
    """Nothing listening: a connection fault on every attempt, three attempts, no more
    (the SDK's own retry of a failed connection is off)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    engine, _ = wire.engine(stream=stream, provider_kwargs={
        "http_options": {"base_url": f"http://127.0.0.1:{port}"}})
    result = await engine.run(gemini_operation(), "go")
    assert result.outcome is le.Outcome.PROVIDER_ERROR
    assert [a.settle.fault for a in result.attempt_log if a.settle] == ["connection"] * 3
    assert wire.requests == []


@STREAMING
async def test_a_request_the_sdk_refuses_to_build_is_a_bad_request_not_retried_gemini(
    wire: GeminiHarness, stream: bool
) -> None:
    """The SDK refuses a model name it cannot put in a path (``ValueError``) before
    anything is sent: the request's fault (``bad_request``), not a reply it could
    not read, so it is not retried three times."""
    engine, _ = wire.engine(Reply.text("never"), stream=stream)
    result = await engine.run(dataclasses.replace(gemini_operation(), model="a/b/c?d"), "go")
    assert result.outcome is le.Outcome.PROVIDER_ERROR
    settled = [a.settle for a in result.attempt_log if a.settle]
    assert [(s.fault, s.http_status) for s in settled] == [("bad_request", None)]
    assert "invalid model parameter" in (result.detail or "")
    assert wire.requests == []


@pytest.mark.parametrize("error", [
    ValueError("Could not resolve project using application default credentials."),
    RuntimeError("Could not resolve API token from the environment"),
], ids=["value-error", "runtime-error"])
def test_an_sdk_error_raised_before_a_reply_is_not_an_invalid_response_gemini(
    error: Exception,
) -> None:
    """What the SDK raises of itself before any reply (no project, no token) is the
    request's fault; raised while a body was read, the same classes are the body's."""
    from loopengine.providers._gemini_faults import classify_error

    before = classify_error(error)
    assert (before.kind, before.error_code) == (FaultKind.BAD_REQUEST, None)
    during = classify_error(error, in_body=True)
    assert (during.kind, during.error_code, during.http_status) == (
        FaultKind.SERVER_ERROR, "invalid_response", 200)


def _unfinished(candidates: list[dict[str, object]] | None) -> ErrorReply:
    """A 200 whose body names no finished candidate and no blocked prompt, with the
    prompt's usage."""
    body: dict[str, object] = {
        "usageMetadata": {"promptTokenCount": 8, "totalTokenCount": 8},
        "modelVersion": "gemini-2.5-flash", "responseId": "resp-unfinished"}
    if candidates is not None:
        body["candidates"] = candidates
    return ErrorReply(status=200, body=body)


@pytest.mark.parametrize("candidates", [
    None, [], [{"index": 0}],
    [{"content": {"parts": [{"text": "half an ans"}], "role": "model"}, "index": 0}],
], ids=["no-candidates", "empty-candidates", "empty-candidate", "unfinished-candidate"])
async def test_a_json_reply_that_answers_nothing_is_an_invalid_response_gemini(
    wire: GeminiHarness, candidates: list[dict[str, object]] | None
) -> None:
    """A whole (JSON) reply whose candidates are missing, empty or unfinished, and
    whose prompt was not blocked, answered nothing: not an empty answer accepted
    as completed, but the server's failure (as the same stream would be cut),
    retried; the prompt it reports is recorded, not charged."""
    engine, _ = wire.engine(_unfinished(candidates), Reply.text("the answer"))
    result = await engine.run(gemini_operation(), "go")
    assert result.outcome is le.Outcome.COMPLETED, result.detail
    assert result.answer == "the answer"
    first = result.attempt_log[0].settle
    assert first is not None
    assert (first.outcome, first.fault, first.error_code, first.response_id) == (
        "error", "server_error", "invalid_response", "resp-unfinished")
    assert first.usage == le.Usage(input_tokens=8) and first.charged is False
    assert len(wire.requests) == 2
