"""`FaultKind` and `ProviderFault`: every failed provider request, classified once.

Each adapter maps its SDK's errors to a `ProviderFault` at exactly one place
(its ``classify_error``); from there on the engine reasons only about the
`FaultKind`. See the fault table in docs/architecture.md.

The pieces of that mapping that do not depend on the vendor live here, once:
the credit-exhaustion codes (R06), the ``retry-after`` / ``x-should-retry``
headers, the details of Google's error shape (``google.rpc.RetryInfo``'s
``retryDelay``, read for Gemini and for Claude on Vertex AI alike), and
`classify_sdk_error`, the skeleton both Stainless SDKs (``anthropic``,
``openai``) share for timeouts, connections, cut bodies and the client's own
state; each adapter supplies only how its status errors
(and its errors inside a stream) read.
"""

from __future__ import annotations

import email.utils
import functools
import math
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Protocol

import httpx2

from loopengine import _validate
from loopengine._errors import ConfigError, LoopEngineError, ProviderError
from loopengine._usage import Usage

__all__ = [
    "BILLING_REASONS",
    "CLIENT_STATE",
    "FaultKind",
    "ProviderError",
    "ProviderFault",
    "Classifier",
    "SDKErrors",
    "STATUS_KINDS",
    "classify_sdk_error",
    "check_end",
    "google_detail",
    "google_details",
    "response_fault",
    "is_credit_code",
    "message_wait",
    "retry_after",
    "retry_info_delay",
    "should_retry",
    "status_kind",
    "timed_out",
]


class FaultKind(StrEnum):
    """The class of a provider fault, which decides whether it is retried."""

    TIMEOUT = "timeout"
    """The attempt timed out (our timeout, HTTP 408, an SDK timeout). Retried."""
    RATE_LIMITED = "rate_limited"
    """A 429 that is not credit exhaustion. Retried, honouring ``retry-after``."""
    OVERLOADED = "overloaded"
    """529, ``overloaded_error``, a mid-stream overload event. Retried."""
    SERVER_ERROR = "server_error"
    """500, 502, 503, 504, ``api_error``, 409. Retried."""
    CONNECTION = "connection"
    """Refused, reset, closed before a response. Retried."""
    ABORTED = "aborted"
    """The provider or the transport cut the stream. Retried."""
    BAD_REQUEST = "bad_request"
    """400 ``invalid_request_error``, 404, 413, 422: the request is wrong. Not retried."""
    UNAUTHORIZED = "unauthorized"
    """401, 403. Not retried."""
    CREDIT_EXHAUSTED = "credit_exhausted"
    """A depleted balance or a spend limit, whatever the status. Not retried (R06)."""

    @property
    def retryable(self) -> bool:
        """True for the transient kinds (R05)."""
        return self in _RETRYABLE


_RETRYABLE = frozenset(
    {
        FaultKind.TIMEOUT,
        FaultKind.RATE_LIMITED,
        FaultKind.OVERLOADED,
        FaultKind.SERVER_ERROR,
        FaultKind.CONNECTION,
        FaultKind.ABORTED,
    }
)


_KINDS = tuple(k.value for k in FaultKind)


class ProviderFault(LoopEngineError):
    """One provider request that failed, classified.

    Args:
        kind: The `FaultKind`.
        message: What happened, for people (never conversation text).
        http_status: The HTTP status, when there was a response (200 for a
            mid-stream error event, or a body or stream that could not be read).
        error_code: The provider's error type or code (``overloaded_error``,
            ``enforced_spend_limit_reached``...).
        retry_after: Seconds the provider asked us to wait, if it did.
        should_retry: The provider's explicit retry advice (``x-should-retry``),
            or None when it gave none. ``False`` is always obeyed.
        request_id: The provider's request id, when it sent one.
        response_id: The provider's response (message) id, when it sent one.
        usage: Usage the provider reported before failing (a cut stream).
        usage_approx: True when ``usage`` is a floor (the stream was cut).
        aborted_reason: For aborted attempts: ``external``, ``deadline``,
            ``idle`` or ``budget``.

    Raises:
        ConfigError: a ``kind`` that is not a `FaultKind` (or its value), a
            ``message`` that is not text, a ``usage`` that is not a `Usage`,
            a ``retry_after`` that is not a number of seconds of at least
            0, an ``http_status`` that is not an integer, a ``should_retry``
            or ``usage_approx`` that is not a bool, or an id, code or reason
            that is not text: a custom provider's or a script's fault is
            refused where it is built, not mid-run by the retry loop or the
            ledger (``should_retry="false"`` would have been retried).
    """

    def __init__(
        self,
        kind: FaultKind | str,
        message: str,
        *,
        http_status: int | None = None,
        error_code: str | None = None,
        retry_after: float | None = None,
        should_retry: bool | None = None,
        request_id: str | None = None,
        response_id: str | None = None,
        usage: Usage | None = None,
        usage_approx: bool = False,
        aborted_reason: str | None = None,
    ) -> None:
        super().__init__(message)
        if not isinstance(kind, str) or kind not in _KINDS:
            raise ConfigError("kind", f"must be a FaultKind (one of {', '.join(_KINDS)}), got "
                                      f"{_validate.shown(kind)}")
        if not isinstance(message, str):
            raise ConfigError("message", f"must be text, got {_validate.shown(message)}")
        if usage is not None and not isinstance(usage, Usage):
            raise ConfigError("usage", f"must be a Usage or None, got {_validate.shown(usage)}")
        if retry_after is not None and (
                isinstance(retry_after, bool) or not isinstance(retry_after, int | float)
                or not retry_after >= 0):  # NaN too; a huge wait is the provider's to ask
            raise ConfigError("retry_after", "must be a number of seconds of at least 0 or "
                                             f"None, got {_validate.shown(retry_after)}")
        if http_status is not None and (isinstance(http_status, bool)
                                        or not isinstance(http_status, int)):
            raise ConfigError("http_status", "must be an integer or None, got "
                                             f"{_validate.shown(http_status)}")
        for field, flag in (("should_retry", should_retry), ("usage_approx", usage_approx)):
            if not isinstance(flag, bool) and not (flag is None and field == "should_retry"):
                raise ConfigError(field, f"must be a bool, got {_validate.shown(flag)}")
        for field, text in (("error_code", error_code), ("request_id", request_id),
                            ("response_id", response_id), ("aborted_reason", aborted_reason)):
            if text is not None and not isinstance(text, str):
                raise ConfigError(field, f"must be text or None, got {_validate.shown(text)}")
        self.kind = FaultKind(kind)
        self.message = message
        self.http_status = http_status
        self.error_code = error_code
        self.retry_after = retry_after
        self.should_retry = should_retry
        self.request_id = request_id
        self.response_id = response_id
        self.usage = usage
        self.usage_approx = usage_approx
        self.aborted_reason = aborted_reason

    @property
    def retryable(self) -> bool:
        """Whether the retry loop may try again: the kind allows it and the
        provider did not say ``x-should-retry: false``."""
        return self.kind.retryable and self.should_retry is not False

    def __reduce__(self) -> tuple[Any, ...]:
        state = dict(self.__dict__)
        args = (state.pop("kind"), state.pop("message"))
        return (functools.partial(ProviderFault, **state), args)

    def __repr__(self) -> str:
        status = f", http_status={self.http_status}" if self.http_status is not None else ""
        return f"ProviderFault({self.kind.value!r}, {self.message!r}{status})"


# -- what every adapter reads the same way ---------------------------------------------

_CREDIT_CODES = frozenset({
    "insufficient_quota",
    "credit_balance_exhausted",
    "billing_hard_limit_reached",
    "billing_not_active",
    "linked_organization_billing_unavailable",
})
_CREDIT_CODE_SUFFIXES = ("_spend_limit_reached", "_spend_limit_exceeded")


STATUS_KINDS: dict[int, FaultKind] = {
    401: FaultKind.UNAUTHORIZED,
    402: FaultKind.CREDIT_EXHAUSTED,
    403: FaultKind.UNAUTHORIZED,
    408: FaultKind.TIMEOUT,
    # A conflict is transient (Anthropic's lock timeout): the SDKs themselves
    # would retry it.
    409: FaultKind.SERVER_ERROR,
    429: FaultKind.RATE_LIMITED,
}
"""The fault of an HTTP status whose body names no more specific one, for every
adapter (an adapter adds its vendor's own statuses, e.g. Anthropic's 529)."""


def timed_out(seconds: float) -> ProviderFault:
    """The fault of an attempt that had no response within its timeout of
    ``seconds``: the engine's, when its timeout cancels the request, and a
    script's or a replay's that stands for it."""
    return ProviderFault(FaultKind.TIMEOUT, f"no response within {seconds:.3f}s")


def status_kind(status: int, kinds: Mapping[int, FaultKind] = STATUS_KINDS) -> FaultKind:
    """The fault of an HTTP status whose body names no more specific one: its entry
    in ``kinds`` (`STATUS_KINDS`, or an adapter's table of it with its vendor's own
    statuses), else ``server_error`` for any other 5xx and ``bad_request`` for any
    other status."""
    if status in kinds:
        return kinds[status]
    return FaultKind.SERVER_ERROR if status >= 500 else FaultKind.BAD_REQUEST


def is_credit_code(code: str | None) -> bool:
    """Whether an error ``code`` (or ``type``) says a balance is depleted or a spend
    limit is reached: ``insufficient_quota``, ``credit_balance_exhausted``,
    ``billing_hard_limit_reached``, ``billing_not_active``, any
    ``*_spend_limit_reached`` / ``*_spend_limit_exceeded`` (R06)."""
    return code is not None and (code in _CREDIT_CODES or code.endswith(_CREDIT_CODE_SUFFIXES))


def retry_after(headers: Mapping[str, str], *, now: datetime | None = None) -> float | None:
    """Seconds a response asks the client to wait, or None.

    ``retry-after-ms`` (milliseconds) wins over ``retry-after``, which is
    seconds or an HTTP date; without either, ``x-ratelimit-reset`` (OpenRouter's,
    also inside its error's ``metadata.headers``) is the time the limit resets:
    epoch milliseconds or seconds, or seconds from now for a small number.
    Negative or unparseable values are None.
    """
    milliseconds = _number(headers.get("retry-after-ms"))
    if milliseconds is not None:
        return milliseconds / 1000.0
    value = headers.get("retry-after")
    if value is None:
        return _reset_wait(headers.get("x-ratelimit-reset"), now)
    seconds = _number(value)
    if seconds is not None:
        return seconds
    try:
        at = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if at.tzinfo is None:
        at = at.replace(tzinfo=UTC)
    return max(0.0, (at - (now or datetime.now(UTC))).total_seconds())


def _reset_wait(value: object, now: datetime | None) -> float | None:
    """Seconds until an ``x-ratelimit-reset`` time: epoch milliseconds (above
    10**12) or seconds (above 10**9), else seconds from now."""
    seconds = _number(str(value)) if isinstance(value, str | int | float) else None
    if seconds is None:
        return None
    if seconds < 1e9:
        return seconds
    at = seconds / 1000.0 if seconds >= 1e12 else seconds
    return max(0.0, at - (now or datetime.now(UTC)).timestamp())


# "Please try again in 6.57s" / "in 120ms" / "in 1m30s" (OpenAI's and Azure's
# rate-limit messages, also inside a stream), "Please retry in 37.4s" (Gemini's),
# "Please retry after 6 seconds" (Azure's).
_TRY_AGAIN = re.compile(
    r"\b(?:try again|retry)\s+(?:in|after)\s+"
    r"(?:(?P<go>(?:\d+(?:\.\d+)?(?:ms|h|m|s))+)"
    r"|(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>milliseconds?|seconds?|secs?|minutes?|mins?))"
    r"\b", re.IGNORECASE)
_GO_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)", re.IGNORECASE)
_UNIT_SECONDS = {"ms": 0.001, "milli": 0.001, "h": 3600.0, "m": 60.0, "min": 60.0, "s": 1.0,
                 "sec": 1.0}


def message_wait(message: str) -> float | None:
    """The wait an error's message names ("Please try again in 6.57s", "retry after
    6 seconds"), in seconds, or None when it names none: for a fault whose
    response carries no ``retry-after`` (an error event inside a stream has no
    headers of its own)."""
    match = _TRY_AGAIN.search(message)
    if match is None:
        return None
    if match.group("go") is not None:
        return sum(float(number) * _UNIT_SECONDS[unit.lower()]
                   for number, unit in _GO_PART.findall(match.group("go")))
    unit = match.group("unit").lower()
    scale = next(_UNIT_SECONDS[key] for key in ("milli", "min", "sec")
                 if unit.startswith(key))
    return float(match.group("number")) * scale


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)s\s*$")

BILLING_REASONS = frozenset({"BILLING_DISABLED"})
"""Google's ``google.rpc.ErrorInfo`` reasons that say the project cannot be billed
(the Gemini API, Claude on Vertex AI): permanent."""


def google_details(body: object) -> list[Mapping[str, Any]]:
    """The typed ``error.details`` of an error body in Google's shape (``{"error":
    {"code", "message", "status", "details": [...]}}``, sometimes inside a
    one-element list), as the Gemini API and Vertex AI send it; none for
    another body."""
    if isinstance(body, list) and len(body) == 1:
        body = body[0]
    inner = body.get("error", body) if isinstance(body, Mapping) else None
    details = inner.get("details") if isinstance(inner, Mapping) else None
    return [d for d in details if isinstance(d, Mapping)] if isinstance(details, list) else []


def google_detail(details: list[Mapping[str, Any]], kind: str) -> Mapping[str, Any] | None:
    """The first of ``details`` whose ``@type`` is ``google.rpc.<kind>``
    (``ErrorInfo``, ``RetryInfo``...), or None."""
    for detail in details:
        if str(detail.get("@type", "")).endswith(f"google.rpc.{kind}"):
            return detail
    return None


def retry_info_delay(details: list[Mapping[str, Any]]) -> float | None:
    """The wait a Google error asks for: its ``google.rpc.RetryInfo`` detail's
    ``retryDelay`` (a duration such as ``"45s"`` or ``"1.5s"``) in seconds, or
    None when it has none (or an unreadable one)."""
    info = google_detail(details, "RetryInfo")
    delay = info.get("retryDelay") if info is not None else None
    match = _DURATION.match(delay) if isinstance(delay, str) else None
    return float(match.group(1)) if match is not None else None


def _number(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    if math.isnan(number) or math.isinf(number) or number < 0:
        return None
    return number


def should_retry(headers: Mapping[str, str]) -> bool | None:
    """A server's explicit retry advice (``x-should-retry``), or None when it gave none."""
    value = headers.get("x-should-retry")
    return True if value == "true" else False if value == "false" else None


CLIENT_STATE = "client_state"
"""The error code of a failure of the client's own state (an event loop that
ended, a closed client), not of the connection."""

# Lowercased fragments of the RuntimeErrors asyncio, anyio and trio raise for
# a resource used on an event loop it does not belong to (or after its loop
# ended); the SDKs' own RuntimeErrors (an unexpected event order) never say so.
_LOOP_STATE = ("event loop", "different loop", "async context")


@dataclass(frozen=True, slots=True)
class SDKErrors:
    """The exception classes of one Stainless-generated SDK, and how it reads
    the errors that carry a response."""

    status: type[BaseException]
    """``APIStatusError``: an error status (or an error event inside a stream)."""
    timeout: type[BaseException]
    """``APITimeoutError``: the SDK's request timeout."""
    connection: type[BaseException]
    """``APIConnectionError``: whatever the HTTP client raised, wrapped."""
    base: type[BaseException]
    """``APIError``: the root of the errors that came with (or instead of) a response."""
    validation: type[BaseException]
    """``APIResponseValidationError``: a body that is not what the SDK expected."""
    unreadable: Callable[[BaseException], bool] | None = None
    """Whether an error (of any class) is the SDK failing to read a reply's body,
    for an SDK that raises its parser's own errors (a ``TypeError`` from a
    field of the wrong type...): None when it wraps them all in ``validation``.
    Given, it is the only judge of an error raised before the body was read:
    a ``ValueError`` or ``RuntimeError`` it does not own (the SDK refusing to
    build the request, or finding no credentials) is the request's fault."""


def classify_sdk_error(
    error: BaseException,
    sdk: SDKErrors,
    *,
    status_fault: Callable[..., ProviderFault],
    api_fault: Callable[..., ProviderFault] | None = None,
    request_id: str | None = None,
    in_body: bool = False,
    usage: Usage | None = None,
    response_id: str | None = None,
) -> ProviderFault:
    """Classify what a Stainless SDK (or the HTTP transport under it) raised.

    Args:
        error: What the SDK raised.
        sdk: Its exception classes.
        status_fault: The adapter's reading of a status error (``sdk.status``),
            called as ``status_fault(error, usage=, response_id=)``.
        api_fault: The adapter's reading of another ``sdk.base`` error that
            is not a connection or validation error (an error object inside a
            stream, which some SDKs raise without a status), called as
            ``api_fault(error, request_id=, usage=, response_id=)``, or None.
        request_id: The request id, when the response had begun.
        in_body: The error came while the body or stream was being read, after
            a response began: a transport failure there cuts the stream
            (``aborted``) rather than failing to connect.
        usage: Usage reported before the failure (a stream's floor).
        response_id: The response id, when the stream had announced one.

    Returns:
        The fault; it is never raised here.
    """
    approx = usage is not None
    # A fault that keeps what the attempt had received (its usage a floor).
    served = functools.partial(ProviderFault, request_id=request_id, usage=usage,
                               usage_approx=approx, response_id=response_id)
    if isinstance(error, sdk.status):
        return status_fault(error, usage=usage, response_id=response_id)
    if isinstance(error, sdk.timeout | httpx2.TimeoutException):
        return served(FaultKind.TIMEOUT, "the SDK's request timed out")
    own = _own_failure(error, sdk.connection)
    if own is not None:
        # Not the connection: the request may well have reached the server
        # (and be billed), so it is not retried, nor recorded as a
        # connection that failed.
        return served(FaultKind.BAD_REQUEST,
                      f"the client failed on its own state, not on the connection "
                      f"({type(own).__name__}: {own}); the request may have reached "
                      "the server, so it is not retried", error_code=CLIENT_STATE)
    if isinstance(error, sdk.connection | httpx2.HTTPError | httpx2.StreamError):
        # Some SDKs wrap a transport error read from a stream as their
        # connection error too: after the response began, it cut the stream.
        kind = FaultKind.ABORTED if in_body else FaultKind.CONNECTION
        what = (f"connection failed: {_cause(error)}" if isinstance(error, sdk.connection)
                else f"the transport failed: {type(error).__name__}: {error}")
        return ProviderFault(kind, what, http_status=200 if in_body else None,
                             request_id=request_id, usage=usage if in_body else None,
                             usage_approx=approx and in_body,
                             response_id=response_id if in_body else None)
    if api_fault is not None and isinstance(error, sdk.base) and not isinstance(
            error, sdk.validation):
        return api_fault(error, request_id=request_id, usage=usage, response_id=response_id)
    unreadable = sdk.unreadable is not None and sdk.unreadable(error)
    if unreadable or isinstance(error, sdk.validation) or isinstance(
            error, ValueError | RuntimeError) and (in_body or sdk.unreadable is None):
        # Read from a body the server answered with success (the SDKs raise an
        # error status before reading): that status is the attempt's.
        status = getattr(error, "status_code", None)
        return served(FaultKind.SERVER_ERROR,
                      f"the response is not a valid message: {type(error).__name__}",
                      http_status=status if isinstance(status, int)
                      else 200 if in_body or unreadable else None,
                      error_code="invalid_response")
    # Any other SDK error (missing credentials, a bad argument) is our
    # request's fault and will not improve on retry.
    return ProviderFault(FaultKind.BAD_REQUEST, f"{type(error).__name__}: {error}",
                         request_id=request_id)


def response_fault(
    kind: FaultKind, status: int | None, headers: Mapping[str, str], *, label: str | None,
    code: str | None, message: str, request_id: str | None, usage: Usage | None,
    response_id: str | None, details: list[Mapping[str, Any]] | None = None,
    usage_approx: bool | None = None,
) -> ProviderFault:
    """The fault of an error response (or of an error inside a stream, ``status``
    200) that its adapter read as ``kind``, ``label`` (its error type or status),
    ``code`` and ``message``: its status, request id and ``x-should-retry``
    kept, and the wait it asks for (a ``google.rpc.RetryInfo`` among Google's
    error ``details``, else `retry_after`'s headers, else the wait its message
    names, `message_wait`). ``usage`` is a floor (``usage_approx``, by default
    whenever there is one)."""
    where = "mid-stream " if status == 200 else ""
    delay = retry_info_delay(details or [])
    if delay is None:
        delay = retry_after(headers)
    if delay is None:
        delay = message_wait(message)
    return ProviderFault(
        kind,
        f"HTTP {status} {where}{label or 'error'}: {message}".rstrip(": "),
        http_status=status,
        # Read from the reply's JSON: text only, whatever a server or proxy sent.
        error_code=next((name for name in (code, label) if isinstance(name, str) and name),
                        None),
        retry_after=delay,
        should_retry=should_retry(headers),
        request_id=request_id,
        response_id=response_id,
        usage=usage,
        usage_approx=usage is not None if usage_approx is None else usage_approx,
    )


def check_end(
    end: object, read: Collection[str], *, what: str,
    kinds: Mapping[str, tuple[FaultKind, str]] | None = None, fold_case: bool = False,
    http_status: int | None, request_id: str | None, usage: Usage | None,
    response_id: str | None, usage_approx: bool = False,
) -> None:
    """Raise the fault of a whole reply (a JSON body, or a stream that ended) whose
    end (its ``what``: ``stop_reason``, ``finish_reason``, ``finishReason``) is not
    one its adapter reads (``read``). Missing, the reply never finished:
    ``server_error`` ``invalid_response``; one of ``kinds`` is that fault kind and
    error code; any other (a value newer than the adapter) is a ``server_error``
    whose ``error_code`` is the value. Never an answer: the reply may be cut or
    broken, and retrying is what the server's other failures get. ``usage`` is
    the server's count for the reply (a floor with ``usage_approx``)."""
    if not isinstance(end, str) or not end:
        raise ProviderFault(FaultKind.SERVER_ERROR, f"the response is not an answer: it has "
                            f"no {what}", http_status=http_status,
                            error_code="invalid_response", request_id=request_id,
                            usage=usage, usage_approx=usage_approx, response_id=response_id)
    key = end.lower() if fold_case else end
    if key in read:
        return
    kind, code = (kinds or {}).get(key, (FaultKind.SERVER_ERROR, end))
    raise ProviderFault(kind, f"the response is not an answer: {what} {end!r}",
                        http_status=http_status, error_code=code, request_id=request_id,
                        usage=usage, usage_approx=usage_approx, response_id=response_id)


class Classifier(Protocol):
    """An adapter's ``classify_error``: what its SDK (or the HTTP transport under
    it) raised, as one `ProviderFault`; never raised there. The arguments are
    `classify_sdk_error`'s."""

    def __call__(self, error: BaseException, *, request_id: str | None = None,
                 in_body: bool = False, usage: Usage | None = None,
                 response_id: str | None = None) -> ProviderFault:
        """Classify ``error``."""
        ...


def _own_failure(error: BaseException, connection: type[BaseException]) -> BaseException | None:
    """The error of the client's own state behind ``error``, or None.

    The SDK reports whatever its HTTP client raised as its ``connection``
    error, but only a transport error (httpx2's, or an ``OSError``) means the
    connection failed. Anything else is the client's own state: a connection
    pooled on an event loop that has ended answers ``RuntimeError: Event loop
    is closed`` after its request was written. Read from a stream, such an
    error comes as it is.
    """
    if isinstance(error, connection):
        cause = error.__cause__
        if cause is None or isinstance(cause, httpx2.HTTPError | httpx2.StreamError | OSError):
            return None
        return cause
    if isinstance(error, RuntimeError) and any(
            fragment in str(error).lower() for fragment in _LOOP_STATE):
        return error
    return None


def _cause(error: BaseException) -> str:
    cause = error.__cause__
    if cause is None:
        return str(error)
    return f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
