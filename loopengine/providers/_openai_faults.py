"""The faults of `OpenAIProvider`: every ``openai`` SDK (and transport) error
becomes one `ProviderFault` here, and only here.


=====================  ===========================================================
fault kind             from
=====================  ===========================================================
``credit_exhausted``   ``insufficient_quota`` (as ``type`` or ``code``),
                       ``billing_hard_limit_reached``, ``billing_not_active``,
                       ``credit_balance_exhausted``, ``*_spend_limit_exceeded``,
                       whatever the status; 402
``rate_limited``       any other 429 (``retry-after-ms`` / ``retry-after`` honoured,
                       else OpenRouter's ``X-RateLimit-Reset`` among its error's
                       ``metadata.headers``, else a wait the message names:
                       "Please try again in 6.57s");
                       an error inside a stream of type ``requests``, ``tokens``,
                       ``rate_limit_exceeded`` or ``too_many_requests``
``timeout``            408, the SDK's timeout
``server_error``       409, 5xx, a body that is not a completion; an error
                       object inside a stream (or a 200 body that is one) whose
                       type and code name no other kind (it is otherwise read
                       as in an error body: an ``invalid_request_error`` is
                       ``bad_request``; a code that is an HTTP status, as
                       OpenRouter's are, is that status's kind)
                       ; a reply whose ``finish_reason`` is missing (a whole
                       reply that never finished: ``invalid_response``),
                       ``error``, or any value the translation does not read
                       (``error_code`` the value)
``connection``         refused, reset or closed before a response
``aborted``            the body or stream cut after the response began, a stream
                       that ended before its ``finish_reason`` or its usage
                       chunk, an idle stream; a reply whose ``finish_reason``
                       is ``abort`` (vLLM's: the server aborted the generation)
``unauthorized``       401, 403
``bad_request``        400, 404, 413, 422, other 4xx; a transcript block that has
                       no Chat Completions equivalent; the client failing on its
                       own state (``client_state``)
=====================  ===========================================================

The ``openai`` SDK is imported on first use (`import_openai`), never when
``loopengine`` is.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import httpx2

from loopengine._usage import Usage
from loopengine.providers._base import text_or_none as _text
from loopengine.providers._faults import (
    FaultKind,
    ProviderFault,
    SDKErrors,
    check_end,
    classify_sdk_error,
    is_credit_code,
    response_fault,
    status_kind,
)
from loopengine.providers._openai_chat import FINISH_REASONS
from loopengine.providers._sdk import import_sdk

__all__ = ["body_fault", "classify_error", "event_fault", "check_finish", "failures",
           "import_openai", "read_failures"]

_TYPE_KINDS = {
    "invalid_request_error": FaultKind.BAD_REQUEST,
    "authentication_error": FaultKind.UNAUTHORIZED,
    "permission_error": FaultKind.UNAUTHORIZED,
    "rate_limit_error": FaultKind.RATE_LIMITED,
    "rate_limit_exceeded": FaultKind.RATE_LIMITED,
    "requests": FaultKind.RATE_LIMITED,
    "tokens": FaultKind.RATE_LIMITED,
    # A Responses stream's rate limit, as its ``error`` event names it.
    "too_many_requests": FaultKind.RATE_LIMITED,
    "timeout": FaultKind.TIMEOUT,
    "timeout_error": FaultKind.TIMEOUT,
    "overloaded_error": FaultKind.OVERLOADED,
    "server_error": FaultKind.SERVER_ERROR,
    "api_error": FaultKind.SERVER_ERROR,
    # The Responses API's codes of a response that failed after a 200
    # (``response.failed``): the request's own content is not retried.
    "context_length_exceeded": FaultKind.BAD_REQUEST,
    "invalid_prompt": FaultKind.BAD_REQUEST,
    "data_residency_mismatch": FaultKind.BAD_REQUEST,
    "bio_policy": FaultKind.BAD_REQUEST,
    "misalignment_policy_violation": FaultKind.BAD_REQUEST,
    "vector_store_timeout": FaultKind.TIMEOUT,
}
# Its image codes (``invalid_image``, ``image_too_large``...) are the request's too.
_REQUEST_CODE_PREFIXES = ("invalid_image", "invalid_base64_image", "image_", "empty_image",
                          "failed_to_download_image", "unsupported_image")


def import_openai(provider: str = "OpenAIProvider") -> Any:
    """The ``openai`` module, imported on first use (`import_sdk`); ``provider``
    is the class being built (``OpenAIResponsesProvider`` too), which a missing
    extra's message names."""
    return import_sdk("openai", "openai", provider=provider, extra="openai")


@functools.cache
def failures() -> tuple[type[BaseException], ...]:
    """What the SDK raises for a request that failed: its own errors and the
    transport's (never the caller's cancellation, which propagates as it is)."""
    return (import_openai().OpenAIError, httpx2.HTTPError, httpx2.StreamError)


@functools.cache
def read_failures() -> tuple[type[BaseException], ...]:
    """What reading a stream may raise: `failures`, and the SDK's own
    ``ValueError`` / ``RuntimeError`` for a body that is not a stream of chunks."""
    return (*failures(), ValueError, RuntimeError)


@functools.cache
def _sdk() -> SDKErrors:
    openai = import_openai()
    return SDKErrors(status=openai.APIStatusError, timeout=openai.APITimeoutError,
                     connection=openai.APIConnectionError, base=openai.APIError,
                     validation=openai.APIResponseValidationError)


def _error_fields(error: Any) -> tuple[str | None, str | None, str]:
    """``(type, code, message)`` of an SDK error: its type and code (the SDK's
    ``APIError`` reads them from its body, the code as a string), and its
    body's message, else its own."""
    body = error.body if isinstance(error.body, Mapping) else {}
    return _text(error.type), _text(error.code), _text(body.get("message")) or error.message


def _status_fault(
    error: Any, *, usage: Usage | None, response_id: str | None
) -> ProviderFault:
    error_type, code, message = _error_fields(error)
    headers = {**_relayed_headers(error.body),
               **{key.lower(): value for key, value in error.response.headers.items()}}
    return response_fault(_kind(error.status_code, error_type, code), error.status_code,
                          headers, label=error_type, code=code, message=message,
                          request_id=error.request_id, usage=usage, response_id=response_id)


def _stream_fault(
    error: Any, *, request_id: str | None, usage: Usage | None, response_id: str | None
) -> ProviderFault:
    """An error object inside a stream: the SDK raises it without a status."""
    error_type, code, message = _error_fields(error)
    body = error.body if isinstance(error.body, Mapping) else {}
    return event_fault({"type": error_type, "code": code, "message": message,
                        "metadata": body.get("metadata")},
                       request_id=request_id, usage=usage, response_id=response_id)


def event_fault(
    error: object, *, request_id: str | None, usage: Usage | None, response_id: str | None,
    usage_approx: bool | None = None,
) -> ProviderFault:
    """The fault of an error object that came after a 200: inside a Chat
    Completions stream, a Responses ``error`` event, or the ``error`` of a
    response whose status is ``failed`` (``response.failed``, or such a JSON
    body). Only its type or code tell what went wrong; an unknown one is the
    server's failure (retried). ``usage`` is a floor (``usage_approx``, by
    default whenever there is one) unless it is a failed response's own."""
    fields = error if isinstance(error, Mapping) else {}
    code: object = fields.get("code")
    # A number is an HTTP status (OpenRouter's codes), read as the SDK reads it.
    code = str(code) if isinstance(code, int) and not isinstance(code, bool) else _text(code)
    error_type = _text(fields.get("type"))
    return response_fault(_kind(200, error_type, code), 200, _relayed_headers(fields),
                          label=code or error_type,
                          code=code, message=_text(fields.get("message")) or "",
                          request_id=request_id, usage=usage, response_id=response_id,
                          usage_approx=usage_approx)


def _relayed_headers(error: object) -> dict[str, str]:
    """The headers an error object relays (OpenRouter's ``metadata.headers``: the
    upstream's ``Retry-After`` or its own ``X-RateLimit-Reset``), lower-cased; an
    error inside a stream or a 200 body has no others."""
    metadata = error.get("metadata") if isinstance(error, Mapping) else None
    headers = metadata.get("headers") if isinstance(metadata, Mapping) else None
    if not isinstance(headers, Mapping):
        return {}
    return {str(key).lower(): str(value) for key, value in headers.items()
            if isinstance(value, str | int | float) and not isinstance(value, bool)}


def body_fault(body: Mapping[str, Any], *, request_id: str | None,
               usage: Usage | None) -> ProviderFault:
    """The fault of a 200 whose JSON body is an ``error`` object instead of a reply:
    OpenRouter answers so when the upstream provider failed after the request was
    accepted (``{"error": {"code": 429, "message": ...}}``). Read as an error
    inside a stream (`event_fault`); the usage the body reports is the server's
    own count, not a floor."""
    return event_fault(body.get("error"), request_id=request_id, usage=usage,
                       response_id=_text(body.get("id")), usage_approx=False)


def _kind(status: int, error_type: str | None, code: str | None) -> FaultKind:
    """The fault kind of an error response (or of an error inside a stream, status 200)."""
    if is_credit_code(code) or is_credit_code(error_type):
        return FaultKind.CREDIT_EXHAUSTED
    if status == 200 and error_type is None and code is not None and code.isdigit():
        # OpenRouter's errors after a 200 name the HTTP status the failure
        # stands for as their code (402: no credits left, 429: rate limited).
        named = int(code)
        return status_kind(named) if 400 <= named <= 599 else FaultKind.SERVER_ERROR
    if status == 200 or (status >= 500 and error_type == "overloaded_error"):
        # After a 200 only the error's type (or code) tells what went wrong;
        # an unknown one is the server's failure.
        if code is not None and code.startswith(_REQUEST_CODE_PREFIXES):
            return FaultKind.BAD_REQUEST
        return _TYPE_KINDS.get(code or "", _TYPE_KINDS.get(error_type or "",
                                                           FaultKind.SERVER_ERROR))
    return status_kind(status)


def classify_error(error: BaseException, *, request_id: str | None = None,
                   in_body: bool = False, usage: Usage | None = None,
                   response_id: str | None = None) -> ProviderFault:
    """Classify an ``openai`` SDK or transport error as one `ProviderFault` (the table
    in docs/providers.md; the arguments are `classify_sdk_error`'s)."""
    return classify_sdk_error(error, _sdk(), status_fault=_status_fault, api_fault=_stream_fault,
                              request_id=request_id, in_body=in_body, usage=usage,
                              response_id=response_id)


# Finish reasons that are faults of their own kind (any other unread one is a
# server_error named after itself).
_FINISH_FAULTS = {"abort": (FaultKind.ABORTED, "abort")}


def check_finish(finish_reason: object, *, http_status: int, request_id: str | None,
                 usage: Usage | None, response_id: str | None) -> None:
    """Raise the fault of a whole reply (a JSON body, or a stream that ended) whose
    ``finish_reason`` is not one the translation reads (``FINISH_REASONS``, in any
    case; `check_end`). Missing, the reply never finished: ``server_error``
    ``invalid_response`` (as a stream ended before it is ``aborted``); ``abort``
    (vLLM: the server aborted the generation) is ``aborted``; any other
    (``error``, a value no table here knows) is a ``server_error`` named after
    it. Each is retried; none is accepted as an answer."""
    check_end(finish_reason, FINISH_REASONS, what="finish_reason", kinds=_FINISH_FAULTS,
              fold_case=True, http_status=http_status, request_id=request_id, usage=usage,
              response_id=response_id)
