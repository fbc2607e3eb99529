"""Unit tests of `classify_error`, `retry_after` and `usage_from_api`.

The errors classified are the ones the real SDK raises: each test makes the
SDK answer a request through an ``httpx2.MockTransport`` (the transport seam)
and classifies what came out. Nothing in the SDK is patched.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import anthropic
import httpx2
import pytest

from loopengine import Usage
from loopengine.providers import FaultKind
from loopengine.providers._anthropic import classify_error, retry_after, usage_from_api

MODEL = "claude-sonnet-4-5"
Handler = Callable[[httpx2.Request], httpx2.Response]


def error_response(status: int, error_type: str | None = None, message: str = "x",
                   code: str | None = None, headers: dict[str, str] | None = None,
                   body: Any = None) -> Handler:
    if body is None:
        error: dict[str, Any] = {"type": error_type, "message": message}
        if code is not None:
            error["details"] = {"error_code": code}
        body = {"type": "error", "error": error}
    payload = body if isinstance(body, str) else json.dumps(body)

    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(status, content=payload.encode(),
                               headers={"request-id": "req_1", **(headers or {})})

    return handler


async def sdk_error(handler: Handler, *, stream: bool = False) -> Exception:
    """What the SDK raises when the transport answers with ``handler``."""
    client = anthropic.AsyncAnthropic(
        api_key="k", base_url="http://fake.invalid", max_retries=0,
        http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(handler)),
    )
    try:
        if stream:
            async with client.messages.stream(model=MODEL, max_tokens=10,
                                              messages=[{"role": "user", "content": "hi"}]) as s:
                async for _ in s:
                    pass
        else:
            await client.messages.create(model=MODEL, max_tokens=10,
                                         messages=[{"role": "user", "content": "hi"}])
    except Exception as error:  # the SDK's own exception is what we classify
        return error
    finally:
        await client.close()
    raise AssertionError("the SDK raised nothing")


@pytest.mark.parametrize(
    ("status", "error_type", "message", "code", "kind"),
    [
        (400, "invalid_request_error", "messages: Field required", None, FaultKind.BAD_REQUEST),
        (404, "not_found_error", "model: not found", None, FaultKind.BAD_REQUEST),
        (413, "request_too_large", "too large", None, FaultKind.BAD_REQUEST),
        (422, "invalid_request_error", "bad", None, FaultKind.BAD_REQUEST),
        (431, "invalid_request_error", "headers", None, FaultKind.BAD_REQUEST),
        (401, "authentication_error", "invalid x-api-key", None, FaultKind.UNAUTHORIZED),
        (403, "permission_error", "no access", None, FaultKind.UNAUTHORIZED),
        (408, "timeout_error", "timed out", None, FaultKind.TIMEOUT),
        (409, "conflict_error", "lock timeout", None, FaultKind.SERVER_ERROR),
        (429, "rate_limit_error", "slow down", None, FaultKind.RATE_LIMITED),
        (429, "rate_limit_error", "ramp", "ramp_limit_exceeded", FaultKind.RATE_LIMITED),
        (500, "api_error", "internal", None, FaultKind.SERVER_ERROR),
        (502, "api_error", "bad gateway", None, FaultKind.SERVER_ERROR),
        (503, "api_error", "unavailable", None, FaultKind.SERVER_ERROR),
        (504, "timeout_error", "gateway timeout", None, FaultKind.SERVER_ERROR),
        (500, "overloaded_error", "Overloaded", None, FaultKind.OVERLOADED),
        (529, "overloaded_error", "Overloaded", None, FaultKind.OVERLOADED),
        (529, None, "", None, FaultKind.OVERLOADED),
        (599, None, "", None, FaultKind.SERVER_ERROR),
        # Credit exhaustion, whatever the status (R06).
        (400, "invalid_request_error", "Your credit balance is too low to access the "
         "Anthropic API.", None, FaultKind.CREDIT_EXHAUSTED),
        (400, "invalid_request_error", "You have reached your specified API usage limits.",
         None, FaultKind.CREDIT_EXHAUSTED),
        (402, "billing_error", "payment required", None, FaultKind.CREDIT_EXHAUSTED),
        (402, "billing_error", "x", "linked_organization_spend_limit_reached",
         FaultKind.CREDIT_EXHAUSTED),
        (429, "rate_limit_error", "spend", "enforced_spend_limit_reached",
         FaultKind.CREDIT_EXHAUSTED),
        (429, "rate_limit_error", "spend", "contract_spend_limit_reached",
         FaultKind.CREDIT_EXHAUSTED),
        (429, "rate_limit_error", "Your credit balance is too low", None,
         FaultKind.CREDIT_EXHAUSTED),
    ],
)
async def test_status_errors_are_classified_by_the_fault_table(
    status: int, error_type: str | None, message: str, code: str | None, kind: FaultKind
) -> None:
    """Each status / error type / error code maps to its row of the fault table
    (docs/architecture.md, "Providers and faults")."""
    error = await sdk_error(error_response(status, error_type, message, code))
    assert isinstance(error, anthropic.APIStatusError)
    fault = classify_error(error)
    assert fault.kind is kind
    assert fault.http_status == status
    assert fault.request_id == "req_1"
    assert fault.error_code == (code or error_type)
    assert fault.retryable is kind.retryable


async def test_openai_style_quota_codes_are_credit_exhaustion() -> None:
    """A 429 ``insufficient_quota`` (error.code, not details) is credit exhaustion."""
    body = {"error": {"type": "insufficient_quota", "code": "insufficient_quota",
                      "message": "You exceeded your current quota"}}
    fault = classify_error(await sdk_error(error_response(429, body=body)))
    assert fault.kind is FaultKind.CREDIT_EXHAUSTED
    body = {"error": {"type": "x", "code": "project_spend_limit_exceeded", "message": "m"}}
    fault = classify_error(await sdk_error(error_response(429, body=body)))
    assert fault.kind is FaultKind.CREDIT_EXHAUSTED


async def test_a_body_that_is_not_json_still_classifies_by_status() -> None:
    """A proxy's HTML 502 is a server error."""
    fault = classify_error(await sdk_error(error_response(502, body="<h1>Bad gateway</h1>")))
    assert fault.kind is FaultKind.SERVER_ERROR and fault.http_status == 502


@pytest.mark.parametrize(("header", "expected"), [("true", True), ("false", False),
                                                  (None, None), ("maybe", None)])
async def test_x_should_retry_is_carried(header: str | None, expected: bool | None) -> None:
    """The server's retry advice becomes should_retry; false makes the fault final."""
    headers = {"x-should-retry": header} if header is not None else {}
    fault = classify_error(await sdk_error(
        error_response(529, "overloaded_error", headers=headers)))
    assert fault.should_retry is expected
    assert fault.retryable is (expected is not False)


async def test_retry_after_headers_reach_the_fault() -> None:
    """retry-after-ms is preferred to retry-after; both are seconds on the fault."""
    fault = classify_error(await sdk_error(error_response(
        429, "rate_limit_error", headers={"retry-after-ms": "250", "retry-after": "7"})))
    assert fault.retry_after == 0.25
    fault = classify_error(await sdk_error(error_response(
        429, "rate_limit_error", headers={"retry-after": "7"})))
    assert fault.retry_after == 7.0


def test_retry_after_parses_seconds_milliseconds_and_http_dates() -> None:
    """Seconds, milliseconds and an HTTP date (relative to now); junk is ignored."""
    now = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
    assert retry_after({"retry-after": "3"}) == 3.0
    assert retry_after({"retry-after": "1.5"}) == 1.5
    assert retry_after({"retry-after-ms": "20"}) == 0.02
    assert retry_after({"retry-after": "Thu, 01 Jan 2026 12:00:30 GMT"}, now=now) == 30.0
    assert retry_after({"retry-after": "Thu, 01 Jan 2026 11:00:00 GMT"}, now=now) == 0.0
    assert retry_after({"retry-after": "soon"}) is None
    assert retry_after({"retry-after": "-4"}) is None
    assert retry_after({"retry-after-ms": "nan", "retry-after": "2"}) == 2.0
    assert retry_after({}) is None


@pytest.mark.parametrize(
    ("raised", "kind"),
    [
        (httpx2.ReadTimeout("slow"), FaultKind.TIMEOUT),
        (httpx2.ConnectTimeout("slow"), FaultKind.TIMEOUT),
        (httpx2.ConnectError("refused"), FaultKind.CONNECTION),
        (httpx2.ReadError("reset"), FaultKind.CONNECTION),
        (httpx2.RemoteProtocolError("closed"), FaultKind.CONNECTION),
    ],
)
async def test_transport_failures_before_a_response(raised: Exception, kind: FaultKind) -> None:
    """The SDK's timeout and connection errors map to timeout and connection."""

    def handler(request: httpx2.Request) -> httpx2.Response:
        raise raised

    error = await sdk_error(handler)
    assert isinstance(error, anthropic.APIConnectionError)
    fault = classify_error(error)
    assert fault.kind is kind and fault.http_status is None


def sse(*events: tuple[str, dict[str, Any]]) -> Handler:
    payload = "".join(f"event: {name}\ndata: {json.dumps(data)}\n\n" for name, data in events)

    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, content=payload.encode(),
                               headers={"content-type": "text/event-stream",
                                        "request-id": "req_s"})

    return handler


START = ("message_start", {"type": "message_start", "message": {
    "id": "msg_1", "type": "message", "role": "assistant", "model": MODEL, "content": [],
    "stop_reason": None, "usage": {"input_tokens": 12, "output_tokens": 1}}})


@pytest.mark.parametrize(
    ("error_type", "kind"),
    [("overloaded_error", FaultKind.OVERLOADED), ("api_error", FaultKind.SERVER_ERROR),
     ("rate_limit_error", FaultKind.RATE_LIMITED), ("timeout_error", FaultKind.TIMEOUT),
     ("invalid_request_error", FaultKind.BAD_REQUEST),
     ("billing_error", FaultKind.CREDIT_EXHAUSTED), ("something_new", FaultKind.SERVER_ERROR)],
)
async def test_mid_stream_error_events_classify_by_type(error_type: str,
                                                        kind: FaultKind) -> None:
    """After a 200 only error.type tells what went wrong."""
    error = await sdk_error(sse(START, ("error", {"type": "error", "error": {
        "type": error_type, "message": "m"}})), stream=True)
    assert isinstance(error, anthropic.APIStatusError) and error.status_code == 200
    floor = Usage(input_tokens=12, output_tokens=1)
    fault = classify_error(error, usage=floor, response_id="msg_1")
    assert fault.kind is kind and fault.http_status == 200
    assert (fault.usage, fault.usage_approx, fault.response_id) == (floor, True, "msg_1")
    assert "mid-stream" in fault.message


def test_errors_read_from_a_started_body_are_aborts() -> None:
    """A transport failure while the body is read cuts the stream: aborted, usage a floor."""
    floor = Usage(input_tokens=5)
    fault = classify_error(httpx2.RemoteProtocolError("peer closed"), in_body=True,
                           usage=floor, request_id="req_9")
    assert fault.kind is FaultKind.ABORTED and fault.retryable
    assert (fault.usage, fault.usage_approx, fault.request_id) == (floor, True, "req_9")
    assert classify_error(httpx2.ReadTimeout("idle"), in_body=True).kind is FaultKind.TIMEOUT


def test_other_sdk_errors_are_permanent() -> None:
    """An SDK error that says our request or setup is wrong is not retried."""
    fault = classify_error(anthropic.CredentialsError("no credentials"))
    assert fault.kind is FaultKind.BAD_REQUEST and not fault.retryable


def test_usage_maps_cache_reads_writes_and_the_one_hour_split() -> None:
    """Anthropic's input_tokens stays uncached; cache creation is the write, with
    its one-hour part."""
    usage = usage_from_api({
        "input_tokens": 10, "output_tokens": 7, "cache_read_input_tokens": 300,
        "cache_creation_input_tokens": 50,
        "cache_creation": {"ephemeral_5m_input_tokens": 20, "ephemeral_1h_input_tokens": 30},
    })
    assert usage == Usage(input_tokens=10, output_tokens=7, cache_read_tokens=300,
                          cache_write_tokens=50, cache_write_1h_tokens=30)
    assert usage.cache_write_5m_tokens == 20 and usage.total_input_tokens == 360


def test_usage_tolerates_missing_and_null_counts() -> None:
    """Null or absent counts are zero; the split alone gives the write total."""
    assert usage_from_api({"input_tokens": 3, "output_tokens": None,
                           "cache_read_input_tokens": None}) == Usage(input_tokens=3)
    assert usage_from_api({"input_tokens": 1, "output_tokens": 1, "cache_creation": {
        "ephemeral_5m_input_tokens": 4, "ephemeral_1h_input_tokens": 6}}) == Usage(
        input_tokens=1, output_tokens=1, cache_write_tokens=10, cache_write_1h_tokens=6)
    assert usage_from_api(None) is None
    assert usage_from_api({"input_tokens": -1, "output_tokens": True}) == Usage()
