"""The fault table of docs/providers.md ("The OpenAI-compatible provider"), row by
row, on the wire.

Each case scripts one fault on the FakeOpenAIServer, followed by a good reply,
and runs a conversation through OpenAIProvider and the real ``openai`` SDK,
with JSON responses and with server-sent events. A retried fault completes on
the second request; a permanent one ends the run after the first.
"""

from __future__ import annotations

import email.utils
import socket
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

import loopengine as le
from loopengine.providers import FaultKind
from loopengine.testing import (
    CutStream,
    DropConnection,
    ErrorReply,
    FakeClock,
    FakeOpenAIServer,
    Reply,
    StallStream,
    StreamErrorEvent,
)

from .. import rule_scenarios as scenarios
from ..adapter.conftest import STREAMING
from ..adapter.test_anthropic_faults import NEVER, Case, matrix
from .conftest import OpenAIHarness, openai_operation
from .test_openai_rules import ROUTE


def quota(status: int, error_type: str, code: str | None) -> ErrorReply:
    """An OpenAI error body with this type and code."""
    return ErrorReply(status=status, body={"error": {"message": "x", "type": error_type,
                                                     "param": None, "code": code}})


CASES = {
    # credit_exhausted (R06), by type or by code, whatever the status
    "429-insufficient-quota": Case(ErrorReply.insufficient_quota(), FaultKind.CREDIT_EXHAUSTED,
                                   False),
    "429-insufficient-quota-type-only": Case(quota(429, "insufficient_quota", None),
                                             FaultKind.CREDIT_EXHAUSTED, False),
    "429-insufficient-quota-code-only": Case(quota(429, "requests", "insufficient_quota"),
                                             FaultKind.CREDIT_EXHAUSTED, False),
    "429-billing-hard-limit": Case(quota(429, "requests", "billing_hard_limit_reached"),
                                   FaultKind.CREDIT_EXHAUSTED, False),
    "403-billing-not-active": Case(quota(403, "invalid_request_error", "billing_not_active"),
                                   FaultKind.CREDIT_EXHAUSTED, False),
    "429-credit-balance-exhausted": Case(quota(429, "requests", "credit_balance_exhausted"),
                                         FaultKind.CREDIT_EXHAUSTED, False),
    "429-monthly-spend-limit-exceeded": Case(
        quota(429, "requests", "monthly_spend_limit_exceeded"), FaultKind.CREDIT_EXHAUSTED,
        False),
    "402-insufficient-credits": Case(ErrorReply(status=402, message="Insufficient credits"),
                                     FaultKind.CREDIT_EXHAUSTED, False),
    "mid-stream-insufficient-quota": Case(
        StreamErrorEvent(reply=Reply.text("half"), after=2, type="insufficient_quota",
                         message="quota"), FaultKind.CREDIT_EXHAUSTED, False),
    # rate_limited
    "429": Case(ErrorReply.rate_limited(), FaultKind.RATE_LIMITED, True),
    "429-tokens": Case(quota(429, "tokens", "rate_limit_exceeded"), FaultKind.RATE_LIMITED,
                       True),
    "mid-stream-rate-limit": Case(
        StreamErrorEvent(reply=Reply.text("half"), after=2, type="requests",
                         message="Rate limit reached"), FaultKind.RATE_LIMITED, True),
    # timeout
    "408": Case(ErrorReply(status=408), FaultKind.TIMEOUT, True),
    "sdk-timeout": Case(Reply.text("late", delay=NEVER), FaultKind.TIMEOUT, True,
                        attempt_timeout=1.0, mock_clock=True),
    # server_error
    "409": Case(ErrorReply(status=409), FaultKind.SERVER_ERROR, True),
    "500": Case(ErrorReply(status=500), FaultKind.SERVER_ERROR, True),
    "502-html": Case(ErrorReply(status=502, body="<html>bad gateway</html>"),
                     FaultKind.SERVER_ERROR, True),
    "503": Case(ErrorReply(status=503), FaultKind.SERVER_ERROR, True),
    "504": Case(ErrorReply(status=504), FaultKind.SERVER_ERROR, True),
    "mid-stream-server-error": Case(
        StreamErrorEvent(reply=Reply.text("half an answer"), after=3, type="server_error",
                         message="The server had an error"), FaultKind.SERVER_ERROR, True),
    "200-not-a-completion": Case(lambda request: ErrorReply(status=200, body={"object": "x"}),
                                 FaultKind.SERVER_ERROR, True),
    # connection
    "reset": Case(DropConnection(), FaultKind.CONNECTION, True),
    "closed-before-response": Case(DropConnection(reset=False), FaultKind.CONNECTION, True),
    # aborted
    "cut-mid-body": Case(CutStream(reply=Reply.text("a long answer"), after=3, how="drop"),
                         FaultKind.ABORTED, True, "aborted"),
    "stream-ends-before-finish-reason": Case(
        CutStream(reply=Reply.text("a long answer"), after=3), FaultKind.ABORTED, True,
        "aborted", streaming_only=True),
    # "a long answer" is 4 chunks and the finish chunk: cut before the usage chunk.
    "stream-ends-before-usage-chunk": Case(
        CutStream(reply=Reply.text("a long answer"), after=5), FaultKind.ABORTED, True,
        "aborted", streaming_only=True),
    # Quiet after some text (the idle limit counts from there): the words' chunks
    # and the finish chunk through chat.completions, the first word's delta
    # through responses.create (after its created, in_progress and added events).
    "idle-stream": Case(StallStream(reply=Reply.text("a b c"), after=5, seconds=NEVER),
                        FaultKind.ABORTED, True, "aborted", streaming_only=True,
                        idle_timeout=1.0, mock_clock=True),
    # bad_request
    "400": Case(ErrorReply(status=400, message="messages: field required"),
                FaultKind.BAD_REQUEST, False),
    "404": Case(ErrorReply(status=404, message="The model does not exist"),
                FaultKind.BAD_REQUEST, False),
    "413": Case(ErrorReply(status=413), FaultKind.BAD_REQUEST, False),
    "422": Case(ErrorReply(status=422), FaultKind.BAD_REQUEST, False),
    "mid-stream-invalid-request": Case(
        StreamErrorEvent(reply=Reply.text("x"), after=1, type="invalid_request_error",
                         message="bad"), FaultKind.BAD_REQUEST, False),
    # unauthorized
    "401": Case(ErrorReply(status=401, error_code="invalid_api_key"), FaultKind.UNAUTHORIZED,
                False),
    "403": Case(ErrorReply(status=403), FaultKind.UNAUTHORIZED, False),
    # x-should-retry: false is obeyed even for a transient kind
    "503-should-retry-false": Case(ErrorReply(status=503, headers={"x-should-retry": "false"}),
                                   FaultKind.SERVER_ERROR, False),
}

# Only a stream can end early or go idle: those rows run once. A JSON body
# answering a stream request is a stream without chunks (aborted, above).
JSON_ONLY = frozenset({"200-not-a-completion"})
MATRIX = matrix(CASES, mock_clock=False, json_only=JSON_ONLY)
TIMEOUTS = matrix(CASES, mock_clock=True, json_only=JSON_ONLY)


async def run_case(wire: OpenAIHarness, name: str, stream: bool) -> Any:
    """Run the fault case ``name`` on ``wire``'s provider and check its row of the
    table: the right kind, retried or not, the right outcome. Returns the ledger."""
    return await scenarios.fault_case(wire, ROUTE, CASES[name], stream)


async def test_a_stream_cut_before_any_usage_has_unknown_usage_not_a_floor_openai(
        wire: OpenAIHarness) -> None:
    """A stream cut before its first chunk: aborted, usage unknown, not flagged a floor."""
    await scenarios.cut_before_any_usage(wire, ROUTE)


@pytest.mark.parametrize(("name", "stream"), MATRIX)
async def test_fault_matrix_kind_retry_and_outcome_openai(
    wire: OpenAIHarness, name: str, stream: bool
) -> None:
    """Each row of the fault table: the right kind, retried or not, the right outcome."""
    await run_case(wire, name, stream)


SDK_ITERATORS_ON_TRIO = pytest.mark.filterwarnings(
    "ignore:Exception ignored in. <async_generator object "
    "(Response.aiter_bytes|SSEDecoder.aiter_bytes|AsyncStream._iter_events) "
    ":pytest.PytestUnraisableExceptionWarning")
"""On trio, the openai SDK's stream leaves its event iterators unfinished once the
response ends (asyncio's loop closes them quietly as it shuts down; trio warns
when they are collected): the SDK's own, not a connection the provider keeps."""


@SDK_ITERATORS_ON_TRIO
@pytest.mark.parametrize(("name", "stream"), TIMEOUTS)
def test_fault_matrix_timeout_rows_on_the_mock_clock_openai(
    fake_openai_server: FakeOpenAIServer, name: str, stream: bool
) -> None:
    """The timeout rows (the SDK's timeout, an idle stream) against a server that
    never answers, on trio's MockClock: the right kind, retried, in no real time."""
    scenarios.timeout_case(OpenAIHarness(fake_openai_server, FakeClock()),  # type: ignore[arg-type]
                           ROUTE, CASES[name], stream)


@STREAMING
async def test_a_stream_cut_before_its_usage_chunk_has_unknown_usage_openai(
    wire: OpenAIHarness, stream: bool
) -> None:
    """Cut after the answer but before the usage chunk: the attempt is aborted with
    no usage (the run's usage is incomplete), and retried; the server counted none."""
    reply = Reply.text("a long answer", usage=le.Usage(input_tokens=50, output_tokens=5))
    engine, ledger = wire.engine(CutStream(reply=reply, after=5), Reply.text("ok"),
                                 stream=True)
    result = await engine.run(openai_operation(), "go")
    assert result.outcome is le.Outcome.COMPLETED
    aborted = result.attempt_log[0].settle
    assert aborted is not None and (aborted.outcome, aborted.usage) == ("aborted", None)
    assert aborted.response_id == "chatcmpl-fake-0001" and aborted.request_id == "req_fake_0001"
    assert result.attempts.usage_complete is False
    assert wire.server.usage_served == result.usage == le.Usage(input_tokens=100,
                                                                output_tokens=20)


@STREAMING
async def test_every_attempt_records_the_ids_it_was_given_openai(
    wire: OpenAIHarness, stream: bool
) -> None:
    """The x-request-id of every answered attempt and the completion id of every
    completion that began: a mid-stream fault keeps both, a success too."""
    engine, ledger = wire.engine(
        StreamErrorEvent(reply=Reply.text("half an answer"), after=3, type="server_error"),
        Reply.text("ok"), stream=stream)
    result = await engine.run(openai_operation(), "go")
    assert result.outcome is le.Outcome.COMPLETED
    failed, ok = (a.settle for a in result.attempt_log)
    assert failed is not None and ok is not None
    assert (failed.request_id, failed.response_id) == (
        "req_fake_0001", "chatcmpl-fake-0001" if stream else None)
    assert (ok.request_id, ok.response_id) == ("req_fake_0002", "chatcmpl-fake-0002")
    rows = [(r["request_id"], r["response_id"]) for r in ledger.attempts.values()]
    assert rows == [(failed.request_id, failed.response_id), (ok.request_id, ok.response_id)]


@STREAMING
async def test_connection_refused_is_retried_then_ends_provider_error_openai(
    wire: OpenAIHarness, stream: bool
) -> None:
    """Nothing listening: a connection fault on every attempt, three attempts, no more."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    engine, _ = wire.engine(stream=stream,
                            provider_kwargs={"base_url": f"http://127.0.0.1:{port}/v1"})
    result = await engine.run(openai_operation(), "go")
    assert result.outcome is le.Outcome.PROVIDER_ERROR
    assert [a.settle.fault for a in result.attempt_log if a.settle] == ["connection"] * 3
    assert wire.requests == []


@STREAMING
async def test_retry_after_headers_are_the_waits_slept_openai(
    wire: OpenAIHarness, stream: bool
) -> None:
    """retry-after-ms wins over retry-after; retry-after in seconds and as an HTTP
    date is honoured."""
    # An hour ahead on the real wall clock: a busy machine's delay cannot eat the
    # wait (ten minutes allowed); the fake clock sleeps it at once.
    until = email.utils.format_datetime(datetime.now(UTC) + timedelta(seconds=3600),
                                        usegmt=True)
    engine, _ = wire.engine(
        ErrorReply(status=429, headers={"retry-after-ms": "1500", "retry-after": "9"}),
        ErrorReply(status=503, headers={"retry-after": "2"}),
        ErrorReply(status=500, headers={"retry-after": until}),
        Reply.text("ok"), stream=stream,
    )
    result = await engine.run(openai_operation(total_time=None,
                                               retry=le.RetryPolicy(max_attempts=4)), "go")
    assert result.outcome is le.Outcome.COMPLETED
    first, second, third = wire.clock.sleeps
    assert (first, second) == (1.5, 2.0) and 3000.0 <= third <= 3600.0
    assert [a.dispatch.wait_ms for a in result.attempt_log][:3] == [0, 1500, 2000]


async def test_a_fake_server_without_the_extra_path_is_a_bad_request_openai(
    fake_openai_server: FakeOpenAIServer, wire: OpenAIHarness
) -> None:
    """A base_url without /v1 reaches a path the server does not serve: a 404, not retried."""
    engine, _ = wire.engine(Reply.text("never"),
                            provider_kwargs={"base_url": fake_openai_server.url})
    result = await engine.run(openai_operation(), "go")
    assert result.outcome is le.Outcome.PROVIDER_ERROR
    assert result.fault is not None and result.fault.http_status == 404
    assert len(wire.requests) == 1
