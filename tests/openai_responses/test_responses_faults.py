"""The fault table on the Responses route, row by row, on the wire.

The HTTP errors are the Chat route's (the same SDK and error bodies, one
classifier): its table runs here too. Then what only this API sends after a
200: an ``error`` event, ``response.failed`` (in a stream or as a JSON body),
and a stream that ends without ``response.completed`` / ``response.incomplete``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

import loopengine as le
from loopengine.testing import (
    CutStream,
    ErrorReply,
    FakeClock,
    FakeOpenAIServer,
    RecordedRequest,
    Reply,
)

from .. import rule_scenarios as scenarios
from ..adapter.conftest import STREAMING
from ..openai.test_openai_faults import (
    CASES,
    MATRIX,
    SDK_ITERATORS_ON_TRIO,
    TIMEOUTS,
    run_case,
)
from .conftest import ResponsesHarness, openai_operation
from .test_responses_rules import ROUTE


@pytest.mark.parametrize(("name", "stream"), MATRIX)
async def test_fault_matrix_kind_retry_and_outcome_responses(
    wire: ResponsesHarness, name: str, stream: bool
) -> None:
    """Each row of the OpenAI fault table: the right kind, retried or not, the right
    outcome, through responses.create."""
    await run_case(wire, name, stream)
    assert all(r.path == "/v1/responses" for r in wire.requests)


@SDK_ITERATORS_ON_TRIO
@pytest.mark.parametrize(("name", "stream"), TIMEOUTS)
def test_fault_matrix_timeout_rows_on_the_mock_clock_responses(
    fake_openai_server: FakeOpenAIServer, name: str, stream: bool
) -> None:
    """The OpenAI table's timeout rows (the SDK's timeout, an idle stream) through
    responses.create, on trio's MockClock: the right kind, retried, in no real time."""
    wire = ResponsesHarness(fake_openai_server, FakeClock())  # type: ignore[arg-type]
    scenarios.timeout_case(wire, ROUTE, CASES[name], stream)
    assert all(r.path == "/v1/responses" for r in wire.requests)


def _sse(*events: dict[str, Any]) -> str:
    return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events)


def _failed_body(code: str, *, usage: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": "resp_failed", "object": "response", "status": "failed", "model": "m",
            "output": [], "usage": usage,
            "error": {"code": code, "message": f"scripted {code}"}}


def failed(code: str) -> Any:
    """A response that failed after a 200: ``response.failed`` in a stream, a JSON
    body whose status is ``failed`` otherwise."""

    def answer(request: RecordedRequest) -> ErrorReply:
        body = _failed_body(code)
        if request.stream:
            created = {**body, "status": "in_progress", "error": None}
            return ErrorReply(status=200, body=_sse(
                {"type": "response.created", "sequence_number": 0, "response": created},
                {"type": "response.failed", "sequence_number": 1, "response": body}))
        return ErrorReply(status=200, body=body)

    return answer


@STREAMING
@pytest.mark.parametrize(("code", "kind", "retried"), [
    ("server_error", "server_error", True),
    ("rate_limit_exceeded", "rate_limited", True),
    ("vector_store_timeout", "timeout", True),
    ("invalid_prompt", "bad_request", False),
    ("image_too_large", "bad_request", False),
    ("insufficient_quota", "credit_exhausted", False),
])
async def test_a_failed_response_is_classified_by_its_error_code(
    wire: ResponsesHarness, stream: bool, code: str, kind: str, retried: bool
) -> None:
    """status failed (response.failed) after a 200: the error's code decides the kind."""
    engine, _ = wire.engine(failed(code), Reply.text("recovered"), stream=stream)
    result = await engine.run(openai_operation(), "go")
    first = result.attempt_log[0].settle
    assert first is not None
    assert (first.fault, first.http_status, first.response_id) == (kind, 200, "resp_failed")
    assert (result.outcome is le.Outcome.COMPLETED) is retried
    assert len(wire.requests) == (2 if retried else 1)


async def test_an_error_event_mid_stream_is_classified_and_keeps_the_response_id(
    wire: ResponsesHarness,
) -> None:
    """An ``error`` event after some events: classified by its code, the attempt keeps
    the response id the stream announced; the retry completes."""
    from loopengine.testing import StreamErrorEvent

    engine, _ = wire.engine(
        StreamErrorEvent(reply=Reply.text("half an answer"), after=4, type="server_error",
                         message="The server had an error"),
        Reply.text("ok"), stream=True)
    result = await engine.run(openai_operation(), "go")
    assert result.outcome is le.Outcome.COMPLETED
    failed_attempt = result.attempt_log[0].settle
    assert failed_attempt is not None
    assert (failed_attempt.fault, failed_attempt.http_status, failed_attempt.response_id,
            failed_attempt.request_id) == ("server_error", 200, "resp_fake_0001",
                                           "req_fake_0001")


@pytest.mark.parametrize("after", [1, 5, 9])
async def test_a_stream_without_its_final_event_is_aborted_with_unknown_usage(
    wire: ResponsesHarness, after: int
) -> None:
    """A stream that ends before response.completed (whatever it had sent: only the
    created event, part of the text, every item done) is an aborted attempt with
    no usage, retried; the server counted none for it."""
    reply = Reply.text("a long answer", usage=le.Usage(input_tokens=50, output_tokens=5))
    engine, ledger = wire.engine(CutStream(reply=reply, after=after), Reply.text("ok"),
                                 stream=True)
    result = await engine.run(openai_operation(), "go")
    assert result.outcome is le.Outcome.COMPLETED
    aborted = result.attempt_log[0].settle
    assert aborted is not None
    assert (aborted.outcome, aborted.fault, aborted.usage) == ("aborted", "aborted", None)
    assert aborted.response_id == "resp_fake_0001"
    assert result.attempts.usage_complete is False
    assert wire.server.usage_served == result.usage == le.Usage(input_tokens=100,
                                                                output_tokens=20)


async def test_a_stream_cut_before_any_usage_has_unknown_usage_not_a_floor_responses(
        wire: ResponsesHarness) -> None:
    """A stream cut before its first event: aborted, usage unknown, not flagged a floor."""
    await scenarios.cut_before_any_usage(wire, ROUTE)


async def test_a_body_that_is_not_a_response_is_a_server_error(wire: ResponsesHarness) -> None:
    """A 200 whose JSON is not a response object is the server's failure, retried."""
    engine, _ = wire.engine(ErrorReply(status=200, body={"object": "x"}), Reply.text("ok"))
    result = await engine.run(openai_operation(), "go")
    assert result.outcome is le.Outcome.COMPLETED
    first = result.attempt_log[0].settle
    assert first is not None and first.fault == "server_error"


@STREAMING
async def test_a_failed_response_keeps_the_usage_it_reports_whole(
    wire: ResponsesHarness, stream: bool
) -> None:
    """A failed response that reports usage: the attempt records it (what the provider
    may bill), not as a floor, and does not charge it (S01)."""
    usage = {"input_tokens": 40, "output_tokens": 5,
             "input_tokens_details": {"cached_tokens": 10},
             "output_tokens_details": {"reasoning_tokens": 0}}
    body = _failed_body("server_error", usage=usage)

    def answer(request: RecordedRequest) -> ErrorReply:
        if request.stream:
            return ErrorReply(status=200, body=_sse(
                {"type": "response.failed", "sequence_number": 0, "response": body}))
        return ErrorReply(status=200, body=body)

    engine, ledger = wire.engine(answer, Reply.text("ok"), stream=stream)
    result = await engine.run(openai_operation(), "go")
    assert result.outcome is le.Outcome.COMPLETED
    first = result.attempt_log[0].settle
    assert first is not None
    assert first.usage == le.Usage(input_tokens=30, cache_read_tokens=10, output_tokens=5)
    assert (first.usage_approx, first.charged, first.outcome) == (False, False, "error")


def nested_error(error_type: str, code: str) -> Any:
    """The ``error`` event as the API sends it in production: its fields nested under
    ``error`` (not flat, as its reference shows), after ``response.created``."""
    created = {**_failed_body("x"), "id": "resp_nested", "status": "in_progress",
               "error": None}
    return ErrorReply(status=200, body=_sse(
        {"type": "response.created", "sequence_number": 0, "response": created},
        {"type": "error", "sequence_number": 1,
         "error": {"type": error_type, "code": code, "message": f"scripted {code}",
                   "param": None}}))


@pytest.mark.parametrize(("error_type", "code", "kind", "retried"), [
    ("too_many_requests", "too_many_requests", "rate_limited", True),
    ("tokens", "rate_limit_exceeded", "rate_limited", True),
    ("insufficient_quota", "credit_balance_exhausted", "credit_exhausted", False),
    ("server_error", None, "server_error", True),
])
async def test_a_nested_error_event_is_classified_by_its_type_and_code(
    wire: ResponsesHarness, error_type: str, code: str, kind: str, retried: bool
) -> None:
    """The production shape of a mid-stream ``error`` event (``{"type": "error",
    "error": {...}}``): a rate limit (``too_many_requests`` too) is retried as
    one, depleted credits end the run at once (R06)."""
    engine, _ = wire.engine(nested_error(error_type, code), Reply.text("recovered"),
                            stream=True)
    result = await engine.run(openai_operation(), "go")
    first = result.attempt_log[0].settle
    assert first is not None
    assert (first.fault, first.http_status, first.response_id) == (kind, 200, "resp_nested")
    assert (result.outcome is le.Outcome.COMPLETED) is retried
    if not retried:
        assert result.outcome is le.Outcome.CREDIT_EXHAUSTED
    assert len(wire.requests) == (2 if retried else 1)


async def test_r06_a_200_body_that_is_an_error_is_classified_by_it_responses(
    wire: ResponsesHarness,
) -> None:
    """A whole (JSON) 200 whose body is ``{"error": {...}}`` and no response (a
    gateway's answer when its upstream failed): classified by that error, here
    depleted credits, which end the run at once (R06)."""
    engine, _ = wire.engine(ErrorReply(status=200, body={
        "error": {"code": 402, "message": "Insufficient credits"}}), Reply.text("never"))
    result = await engine.run(openai_operation(), "go")
    assert result.outcome is le.Outcome.CREDIT_EXHAUSTED, result.detail
    first = result.attempt_log[0].settle
    assert first is not None
    assert (first.fault, first.http_status, first.error_code) == ("credit_exhausted", 200, "402")
    assert len(wire.requests) == 1
