"""The fault table of docs/architecture.md, row by row, on the wire.

Each case scripts one fault on the FakeAnthropicServer, followed by a good
reply, and runs a conversation through AnthropicProvider and the real SDK,
with JSON responses and with server-sent events. A retried fault completes on
the second request; a permanent one ends the run after the first.
"""

from __future__ import annotations

import email.utils
import socket
import threading
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import pytest

import loopengine as le
from loopengine._clock import SystemClock
from loopengine.providers import FaultKind
from loopengine.testing import (
    CutStream,
    DropConnection,
    ErrorReply,
    FakeAnthropicServer,
    FakeClock,
    RecordedRequest,
    Reply,
    ServerItem,
    StallStream,
    StreamErrorEvent,
)

from .. import rule_scenarios as scenarios
from ..clock_support import ExpiringClock
from ..conftest import operation
from .conftest import FAST_RETRY, STREAMING, Harness, harness
from .test_anthropic_rules import ROUTE


@dataclass(frozen=True)
class Case:
    item: ServerItem
    kind: FaultKind
    retried: bool
    attempt_outcome: str = "error"
    streaming_only: bool = False
    attempt_timeout: float = 60.0
    """The run's attempt timeout: short only where the case is a timeout."""
    idle_timeout: float = 60.0
    """The provider's stream idle limit: short only where the case is an idle stream."""
    mock_clock: bool = False
    """A timeout row: it runs on trio's MockClock (`rule_scenarios.timeout_case`),
    whose time passes only when the test moves it past the timeout."""


NEVER = 3600.0
"""Seconds a server stays silent in the timeout cases: it never answers within
the test (the server's wait ends when it closes), so the timeout fires however
slow the machine is; the timeouts pass on trio's MockClock, in no real time."""


CREDIT_TOO_LOW = ("Your credit balance is too low to access the Anthropic API. Please go to "
                  "Plans & Billing to upgrade or purchase credits.")
USAGE_LIMITS = ("You have reached your specified API usage limits. You will regain access on "
                "2026-12-01 at 00:00 UTC.")

CASES = {
    # timeout
    "http-408": Case(ErrorReply(status=408), FaultKind.TIMEOUT, True),
    "sdk-timeout": Case(Reply.text("late", delay=NEVER), FaultKind.TIMEOUT, True,
                        attempt_timeout=1.0, mock_clock=True),
    "mid-stream-timeout": Case(
        StreamErrorEvent(reply=Reply.text("half"), after=2, type="timeout_error",
                         message="Request timed out"), FaultKind.TIMEOUT, True,
        streaming_only=True),
    # rate_limited
    "429": Case(ErrorReply.rate_limited(), FaultKind.RATE_LIMITED, True),
    "mid-stream-rate-limit": Case(
        StreamErrorEvent(reply=Reply.text("half"), after=2, type="rate_limit_error",
                         message="Number of request tokens has exceeded your rate limit"),
        FaultKind.RATE_LIMITED, True),
    "429-ramp-limit": Case(ErrorReply(status=429, error_code="ramp_limit_exceeded"),
                           FaultKind.RATE_LIMITED, True),
    # overloaded
    "529": Case(ErrorReply.overloaded(), FaultKind.OVERLOADED, True),
    "overloaded-error-on-500": Case(ErrorReply(status=500, type="overloaded_error"),
                                    FaultKind.OVERLOADED, True),
    "mid-stream-overload": Case(StreamErrorEvent(reply=Reply.text("half an answer"), after=3),
                                FaultKind.OVERLOADED, True),
    # server_error
    "409": Case(ErrorReply(status=409), FaultKind.SERVER_ERROR, True),
    "500": Case(ErrorReply(status=500), FaultKind.SERVER_ERROR, True),
    "502": Case(ErrorReply(status=502, body="<html>bad gateway</html>"),
                FaultKind.SERVER_ERROR, True),
    "503": Case(ErrorReply(status=503), FaultKind.SERVER_ERROR, True),
    "504": Case(ErrorReply(status=504), FaultKind.SERVER_ERROR, True),
    "mid-stream-api-error": Case(
        StreamErrorEvent(reply=Reply.text("half"), after=2, type="api_error",
                         message="Internal server error"), FaultKind.SERVER_ERROR, True),
    # connection
    "reset": Case(DropConnection(), FaultKind.CONNECTION, True),
    "closed-before-response": Case(DropConnection(reset=False), FaultKind.CONNECTION, True),
    # aborted
    "cut-mid-body": Case(CutStream(reply=Reply.text("a long answer"), after=3, how="drop"),
                         FaultKind.ABORTED, True, "aborted"),
    "stream-ends-without-message-stop": Case(
        CutStream(reply=Reply.text("a long answer"), after=3), FaultKind.ABORTED, True,
        "aborted", streaming_only=True),
    # Quiet after the first word's delta (the idle limit counts from there).
    "idle-stream": Case(StallStream(reply=Reply.text("a b c"), after=3, seconds=NEVER),
                        FaultKind.ABORTED, True, "aborted", streaming_only=True,
                        idle_timeout=1.0, mock_clock=True),
    # bad_request
    "400": Case(ErrorReply(status=400, message="messages: field required"),
                FaultKind.BAD_REQUEST, False),
    "404": Case(ErrorReply(status=404), FaultKind.BAD_REQUEST, False),
    "413": Case(ErrorReply(status=413), FaultKind.BAD_REQUEST, False),
    "422": Case(ErrorReply(status=422), FaultKind.BAD_REQUEST, False),
    "mid-stream-invalid-request": Case(
        StreamErrorEvent(reply=Reply.text("x"), after=1, type="invalid_request_error",
                         message="bad"), FaultKind.BAD_REQUEST, False),
    # unauthorized
    "401": Case(ErrorReply(status=401), FaultKind.UNAUTHORIZED, False),
    "403": Case(ErrorReply(status=403), FaultKind.UNAUTHORIZED, False),
    # credit_exhausted, whatever the status
    "400-credit-balance-too-low": Case(ErrorReply(status=400, message=CREDIT_TOO_LOW),
                                       FaultKind.CREDIT_EXHAUSTED, False),
    "400-usage-limits": Case(ErrorReply(status=400, message=USAGE_LIMITS),
                             FaultKind.CREDIT_EXHAUSTED, False),
    "402-billing-error": Case(ErrorReply(status=402), FaultKind.CREDIT_EXHAUSTED, False),
    "mid-stream-billing-error": Case(
        StreamErrorEvent(reply=Reply.text("half"), after=2, type="billing_error",
                         message="Your credit balance is too low"),
        FaultKind.CREDIT_EXHAUSTED, False),
    "429-spend-limit": Case(ErrorReply.spend_limit(), FaultKind.CREDIT_EXHAUSTED, False),
    "429-contract-spend-limit": Case(
        ErrorReply(status=429, error_code="contract_spend_limit_reached"),
        FaultKind.CREDIT_EXHAUSTED, False),
    "429-depleted-balance": Case(ErrorReply(status=429, message=CREDIT_TOO_LOW),
                                 FaultKind.CREDIT_EXHAUSTED, False),
    "429-insufficient-quota": Case(
        ErrorReply(status=429, body={"error": {"type": "insufficient_quota", "message": "x",
                                               "code": "insufficient_quota"}}),
        FaultKind.CREDIT_EXHAUSTED, False),
    "429-credit-balance-exhausted-code": Case(
        ErrorReply(status=429, body={"error": {"type": "rate_limit_error", "message": "x",
                                               "code": "credit_balance_exhausted"}}),
        FaultKind.CREDIT_EXHAUSTED, False),
    "429-spend-limit-exceeded-code": Case(
        ErrorReply(status=429, body={"error": {"type": "rate_limit_error", "message": "x",
                                               "code": "monthly_spend_limit_exceeded"}}),
        FaultKind.CREDIT_EXHAUSTED, False),
    # x-should-retry: false is obeyed even for a transient kind
    "529-should-retry-false": Case(ErrorReply(status=529, headers={"x-should-retry": "false"}),
                                   FaultKind.OVERLOADED, False),
}


def matrix(cases: dict[str, Case], *, mock_clock: bool,
           json_only: frozenset[str] = frozenset()) -> list[Any]:
    """The (name, stream) pairs of a fault table's rows that run on trio's MockClock
    (``mock_clock``), or of the others. Only a stream can end early or go idle:
    those rows run once; a ``json_only`` row, only as JSON."""
    return [
        pytest.param(name, stream, id=f"{'sse' if stream else 'json'}-{name}")
        for name in sorted(cases) for stream in (False, True)
        if cases[name].mock_clock is mock_clock
        and (stream or not cases[name].streaming_only) and not (stream and name in json_only)
    ]


MATRIX = matrix(CASES, mock_clock=False)
TIMEOUTS = matrix(CASES, mock_clock=True)


@pytest.mark.parametrize(("name", "stream"), MATRIX)
async def test_fault_matrix_kind_retry_and_outcome(
    fake_anthropic_server: FakeAnthropicServer, clock: FakeClock, name: str, stream: bool
) -> None:
    """Each row of the fault table: the right kind, retried or not, the right outcome."""
    async with harness(fake_anthropic_server, clock) as wire:
        await scenarios.fault_case(wire, ROUTE, CASES[name], stream)


@pytest.mark.parametrize(("name", "stream"), TIMEOUTS)
def test_fault_matrix_timeout_rows_on_the_mock_clock(
    fake_anthropic_server: FakeAnthropicServer, name: str, stream: bool
) -> None:
    """The timeout rows (the SDK's timeout, an idle stream) against a server that
    never answers, on trio's MockClock: the right kind, retried, in no real time."""
    scenarios.timeout_case(Harness(fake_anthropic_server, FakeClock()), ROUTE, CASES[name],
                           stream)


async def test_a_stream_cut_before_any_usage_has_unknown_usage_not_a_floor(
        wire: Harness) -> None:
    """A stream cut before message_start: aborted, usage unknown, not flagged a floor."""
    await scenarios.cut_before_any_usage(wire, ROUTE)


@STREAMING
async def test_every_attempt_records_the_ids_it_was_given(wire: Harness, stream: bool) -> None:
    """The request id of every answered attempt, and the response id of every
    message that was started: a mid-stream fault keeps both, a success too."""
    engine, ledger = wire.engine(StreamErrorEvent(reply=Reply.text("half an answer"), after=3),
                                 Reply.text("ok"), stream=stream)
    result = await engine.run(operation(), "go")
    assert result.outcome is le.Outcome.COMPLETED
    failed, ok = (a.settle for a in result.attempt_log)
    assert failed is not None and ok is not None
    # As JSON the overload is a plain 529: no message was started.
    assert (failed.request_id, failed.response_id) == (
        "req_fake_0001", "msg_fake_0001" if stream else None)
    assert (ok.request_id, ok.response_id) == ("req_fake_0002", "msg_fake_0002")
    rows = [(r["request_id"], r["response_id"]) for r in ledger.attempts.values()]
    assert rows == [(failed.request_id, failed.response_id), (ok.request_id, ok.response_id)]


@STREAMING
async def test_connection_refused_is_retried_then_ends_provider_error(
    fake_anthropic_server: FakeAnthropicServer, clock: FakeClock, stream: bool
) -> None:
    """Nothing listening: a connection fault on every attempt, three attempts, no more."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with harness(fake_anthropic_server, clock) as wire:
        engine, _ = wire.engine(stream=stream,
                                provider_kwargs={"base_url": f"http://127.0.0.1:{port}"})
        result = await engine.run(operation(), "go")
    assert result.outcome is le.Outcome.PROVIDER_ERROR
    assert [a.settle.fault for a in result.attempt_log if a.settle] == ["connection"] * 3
    assert result.fault is not None and result.fault.kind is FaultKind.CONNECTION
    assert fake_anthropic_server.requests == []


@STREAMING
async def test_retry_after_headers_are_the_waits_slept(wire: Harness, clock: FakeClock,
                                                       stream: bool) -> None:
    """retry-after-ms wins over retry-after; retry-after in seconds is honoured."""
    engine, _ = wire.engine(
        ErrorReply(status=429, headers={"retry-after-ms": "1500", "retry-after": "9"}),
        ErrorReply(status=529, headers={"retry-after": "2"}),
        Reply.text("ok"), stream=stream,
    )
    result = await engine.run(operation(), "go")
    assert result.outcome is le.Outcome.COMPLETED
    assert clock.sleeps == [1.5, 2.0]
    assert [a.dispatch.wait_ms for a in result.attempt_log] == [0, 1500, 2000]


async def test_retry_after_as_an_http_date_is_the_wait_slept(wire: Harness,
                                                             clock: FakeClock) -> None:
    """retry-after may be an HTTP date: the wait is the time until then."""
    # An hour ahead on the real wall clock, so that a busy machine's delay before
    # the reply is read cannot eat the wait: the check allows ten minutes (and
    # the date's whole seconds); the fake clock sleeps it at once.
    until = email.utils.format_datetime(
        datetime.now(UTC) + timedelta(seconds=3600), usegmt=True)
    engine, _ = wire.engine(ErrorReply(status=503, headers={"retry-after": until}),
                            Reply.text("ok"))
    result = await engine.run(operation(total_time=None), "go")
    assert result.outcome is le.Outcome.COMPLETED
    (slept,) = clock.sleeps
    assert 3000.0 <= slept <= 3600.0
    assert result.attempt_log[1].dispatch.wait_ms == round(slept * 1000)


async def test_retry_after_beyond_the_deadline_ends_the_run(wire: Harness,
                                                            clock: FakeClock) -> None:
    """A retry-after longer than the time left is not slept: the run ends."""
    engine, _ = wire.engine(ErrorReply.rate_limited(retry_after=30), Reply.text("never"))
    result = await engine.run(operation(total_time=10.0), "go")
    assert result.outcome is le.Outcome.PROVIDER_ERROR
    assert clock.sleeps == [] and len(wire.requests) == 1
    assert "outlast" in result.detail


@pytest.mark.realtime
@STREAMING
async def test_attempt_timeout_on_the_real_clock_is_a_retried_timeout(
    fake_anthropic_server: FakeAnthropicServer, stream: bool
) -> None:
    """The engine's own attempt timeout cuts a request the server never answers, and
    the attempt is retried: both attempts time out, each after the timeout. The
    timeout is a whole second: a busy machine may take a good part of one to get
    a request onto the wire, and a shorter one would race that."""
    async with harness(fake_anthropic_server, SystemClock()) as wire:
        engine, _ = wire.engine(Reply.text("never", delay=NEVER),
                                Reply.text("never", delay=NEVER), stream=stream)
        result = await engine.run(
            operation(attempt_timeout=1.0, retry=le.RetryPolicy(max_attempts=2,
                                                                initial_wait=0, max_wait=0)),
            "go")
    assert result.outcome is le.Outcome.PROVIDER_ERROR
    assert len(result.attempt_log) == 2 and len(wire.requests) == 2
    for attempt in result.attempt_log:
        assert attempt.settle is not None and attempt.settle.fault == "timeout"
        assert attempt.settle.latency_ms >= 900  # cut by the timeout, not before it


@STREAMING
async def test_deadline_cut_attempt_is_aborted_with_reason_deadline(
    fake_anthropic_server: FakeAnthropicServer, stream: bool
) -> None:
    """An attempt still on the wire when the run's time runs out is aborted (deadline).
    The server never answers; the run's deadline passes on a clock the test moves
    once the request is on the server, so however long a busy machine takes to
    send it, the deadline cuts it on the wire (the attempt's own timeout, the
    SDK's, is a minute of real time: it never comes first)."""
    clock = ExpiringClock()
    arrived = threading.Event()

    def never(request: RecordedRequest) -> Reply:
        arrived.set()
        return Reply.text("never", delay=NEVER)

    async with harness(fake_anthropic_server, clock) as wire:
        engine, _ = wire.engine(never, stream=stream)
        ended: list[le.RunResult] = []

        async def run() -> None:
            ended.append(await engine.run(operation(total_time=600.0, retry=FAST_RETRY), "go"))

        async with anyio.create_task_group() as group:
            group.start_soon(run)
            assert await anyio.to_thread.run_sync(arrived.wait, 60)
            clock.advance(600.0)
    (result,) = ended
    assert result.outcome is le.Outcome.TIME_LIMIT
    (attempt,) = result.attempt_log
    assert attempt.settle is not None
    assert (attempt.settle.outcome, attempt.settle.aborted_reason) == ("aborted", "deadline")
    assert len(wire.requests) == 1
