"""The faults of `GeminiProvider`: every ``google-genai`` SDK (and transport) error
becomes one `ProviderFault` here, and only here.

The SDK raises one error class for every error response (``errors.APIError``,
with ``ClientError`` for 4xx and ``ServerError`` for 5xx); it carries the
HTTP status (``code``), the API's canonical ``status`` (``RESOURCE_EXHAUSTED``,
``PERMISSION_DENIED``...), the ``message`` and the whole error body
(``details``), whose ``error.details`` list holds the typed details this
module reads: ``google.rpc.RetryInfo`` (``retryDelay``) and
``google.rpc.ErrorInfo`` (``reason``).

=====================  ===========================================================
fault kind             from
=====================  ===========================================================
``credit_exhausted``   an ``ErrorInfo`` whose ``reason`` is ``BILLING_DISABLED``
                       (a 403 ``PERMISSION_DENIED``), or a ``message`` saying the
                       prepayment credits are depleted ("Your prepayment credits
                       are depleted...", a 429 ``RESOURCE_EXHAUSTED``) or asking
                       to enable billing ("...free tier is not available in your
                       country. Please enable billing...", a 400
                       ``FAILED_PRECONDITION``), whatever the status; 402
``rate_limited``       any other 429 ``RESOURCE_EXHAUSTED`` (a per-minute or
                       per-day quota), waiting the ``RetryInfo.retryDelay`` it
                       names (else ``retry-after``)
``overloaded``         503 ``UNAVAILABLE`` whose message says the model is
                       overloaded
``server_error``       500 ``INTERNAL``, other 503s, 502, 504 and other 5xx, 409;
                       a body (or stream event) that is not a response, however
                       the SDK fails to read it (``http_status`` 200); a whole (JSON) reply with
                       no finished candidate and no blocked prompt
                       (`check_finish`, with the usage it reports)
``timeout``            408, the transport's timeout
``connection``         refused, reset or closed before a response; a whole (JSON)
                       response cut short (the SDK reads it in one call)
``aborted``            the stream cut after the response began, a stream that
                       ended before its ``finishReason``, an idle stream
``unauthorized``       401 ``UNAUTHENTICATED``, 403 ``PERMISSION_DENIED`` (other
                       reasons)
``bad_request``        400 ``INVALID_ARGUMENT`` / ``FAILED_PRECONDITION``, 404,
                       other 4xx; a request the SDK refuses to build; the client
                       failing on its own state (``client_state``)
=====================  ===========================================================

An error inside a stream (``data: {"error": {...}}`` after a 200) is read the
same way from its ``code`` and ``status``. A reply whose ``finishReason`` is
not one the translation reads as a stop reason (``_gemini_contents.ANSWERED``)
is a fault too (`check_finish`), its usage kept: ``MALFORMED_RESPONSE`` is
``server_error`` ``invalid_response``; ``MISSING_THOUGHT_SIGNATURE`` (the
request lacked a signature the API wanted back, so sending it again cannot
help) ``bad_request``; ``PUP_LIMITED_DISABLED`` (the account is limited or
disabled for Prohibited Use Policy violations: every request will fail the
same way) ``unauthorized``; any other (``OTHER``, ``NO_IMAGE``,
``IMAGE_OTHER``, a value newer than this table) ``server_error`` whose
``error_code`` is the finish reason: the reply stopped for a reason nobody
can read as an answer, so it is retried within the retry policy, never
accepted. The ``google-genai`` SDK is
imported on first use (by `GeminiProvider`), never when ``loopengine`` is.
"""

from __future__ import annotations

import functools
import json
import traceback
from collections.abc import Mapping
from typing import Any

import httpx2

from loopengine._usage import Usage
from loopengine.providers._base import text_or_none as _text
from loopengine.providers._faults import (
    BILLING_REASONS,
    FaultKind,
    ProviderFault,
    SDKErrors,
    check_end,
    classify_sdk_error,
    google_detail,
    google_details,
    response_fault,
    status_kind,
)
from loopengine.providers._gemini_contents import ANSWERED

__all__ = ["BILLING_REASONS", "check_finish", "classify_error", "read_failures"]

# Lowercased fragments of the message of depleted prepaid credits, and of the
# 400 FAILED_PRECONDITION of a project that must have billing on to be served
# ("Gemini API free tier is not available in your country. Please enable
# billing on your project...").
_CREDIT_MESSAGES = ("prepayment credits are depleted", "prepayment credits have been depleted",
                    "enable billing")


@functools.cache
def read_failures() -> tuple[type[BaseException], ...]:
    """What a request and the reading of its reply may raise: the SDK's error
    responses and the transport's errors (never the caller's cancellation,
    which propagates), ``ValueError`` / ``RuntimeError`` for a body that is
    not a response (a JSON or validation error), and the ``TypeError`` /
    ``AttributeError`` / ``KeyError`` the SDK's reading of a field of the wrong
    type raises (an error of these classes that did not come from reading a
    body is classified ``bad_request``, not retried)."""
    from google.genai import errors

    return (errors.APIError, httpx2.HTTPError, httpx2.StreamError, ValueError, RuntimeError,
            TypeError, AttributeError, KeyError)


class _NeverRaised(Exception):
    """Stands for the connection error class the SDK does not have: it wraps no
    transport error, so httpx2's come through as they are (and are read as such)."""


@functools.cache
def _sdk() -> SDKErrors:
    from google.genai import errors

    return SDKErrors(status=errors.APIError, timeout=httpx2.TimeoutException,
                     connection=_NeverRaised, base=errors.APIError,
                     validation=errors.UnknownApiResponseError, unreadable=_unreadable_body)


def _kind(code: int, reason: str | None, message: str) -> FaultKind:
    """The fault kind of a Gemini error of HTTP status ``code`` (an error inside a
    stream has its own), its ``ErrorInfo`` ``reason`` and its message."""
    lowered = message.lower()
    if code == 402 or reason in BILLING_REASONS or any(
            fragment in lowered for fragment in _CREDIT_MESSAGES):
        return FaultKind.CREDIT_EXHAUSTED
    if code == 503 and "overloaded" in lowered:
        return FaultKind.OVERLOADED
    return status_kind(code)


def _status_fault(error: Any, *, usage: Usage | None, response_id: str | None,
                  in_stream: bool = False) -> ProviderFault:
    response = getattr(error, "response", None)
    headers = getattr(response, "headers", None) or {}
    code = int(error.code) if isinstance(error.code, int) else 0
    message = _text(error.message) or ""
    details = google_details(error.details)
    info = google_detail(details, "ErrorInfo")
    reason = _text(info.get("reason")) if info is not None else None
    # An error event inside a stream comes with its own code; the response was a 200.
    return response_fault(
        _kind(code, reason, message),
        200 if in_stream else code or getattr(response, "status_code", None),
        {k.lower(): v for k, v in headers.items()} if isinstance(headers, Mapping) else {},
        # Recorded: its ErrorInfo reason, else its canonical status.
        label=error.status, code=reason or _text(error.status), message=message,
        request_id=None, usage=usage, response_id=response_id, details=details)


# The SDK's models of a reply: a validation error of one is a body it could not read.
_REPLY_MODELS = frozenset({"GenerateContentResponse"})
# The SDK's functions that turn a reply's JSON into its model: what they raise
# (a TypeError, an AttributeError of a field of the wrong type) is the body's.
_REPLY_READERS = ("_GenerateContentResponse_from_", "_from_response")


def _unreadable_body(error: BaseException) -> bool:
    """Whether ``error`` is the SDK failing to read a reply's body: its JSON, the
    reply's model, or an error raised while the SDK built that model (never a
    request it refused to build)."""
    if isinstance(error, json.JSONDecodeError):
        return True
    from pydantic import ValidationError

    if isinstance(error, ValidationError):
        return error.title in _REPLY_MODELS
    return isinstance(error, TypeError | AttributeError | KeyError | ValueError) and any(
        frame.f_code.co_name.startswith(_REPLY_READERS)
        for frame, _ in traceback.walk_tb(error.__traceback__))


def classify_error(error: BaseException, *, request_id: str | None = None,
                   in_body: bool = False, usage: Usage | None = None,
                   response_id: str | None = None) -> ProviderFault:
    """Classify a ``google-genai`` SDK or transport error as one `ProviderFault` (the
    table above). ``in_body``: the error came while a reply was being read (as a
    body the SDK could not parse did: it raises an error status before)."""
    return classify_sdk_error(
        error, _sdk(), status_fault=functools.partial(_status_fault, in_stream=in_body),
        request_id=request_id, in_body=in_body, usage=usage, response_id=response_id)



# Finish reasons that are faults of their own kind (any other unread one is a
# server_error named after itself).
_FINISH_FAULTS = {
    "MALFORMED_RESPONSE": (FaultKind.SERVER_ERROR, "invalid_response"),
    "MISSING_THOUGHT_SIGNATURE": (FaultKind.BAD_REQUEST, "MISSING_THOUGHT_SIGNATURE"),
    "PUP_LIMITED_DISABLED": (FaultKind.UNAUTHORIZED, "PUP_LIMITED_DISABLED"),
}


def check_finish(finish_reason: str | None, *, usage: Usage | None,
                 response_id: str | None) -> None:
    """Raise the fault of a whole reply whose ``finishReason`` is missing (no
    candidate finished: ``server_error`` ``invalid_response``) or is not an answer, a
    refusal, a cut-off answer or a malformed call (``ANSWERED``; the table above,
    `check_end`). The usage is the server's whole count for the reply."""
    check_end(finish_reason, ANSWERED, what="finishReason", kinds=_FINISH_FAULTS,
              http_status=200, request_id=None, usage=usage, response_id=response_id)
