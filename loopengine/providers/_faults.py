"""`FaultKind` and `ProviderFault`: every failed provider request, classified once.

Each adapter maps its SDK's errors to a `ProviderFault` at exactly one place;
from there on the engine reasons only about the `FaultKind`. See the fault
table in docs/architecture.md (DESIGN.md §3).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from loopengine._errors import LoopEngineError
from loopengine._usage import Usage

__all__ = ["FaultKind", "ProviderFault"]


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


class ProviderFault(LoopEngineError):
    """One provider request that failed, classified.

    Args:
        kind: The `FaultKind`.
        message: What happened, for people (never conversation text).
        http_status: The HTTP status, when there was a response (200 for a
            mid-stream error event).
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
        kind = state.pop("kind")
        message = state.pop("message")
        return (_rebuild_fault, (kind, message, state))

    def __repr__(self) -> str:
        status = f", http_status={self.http_status}" if self.http_status is not None else ""
        return f"ProviderFault({self.kind.value!r}, {self.message!r}{status})"


def _rebuild_fault(kind: FaultKind, message: str, state: dict[str, Any]) -> ProviderFault:
    return ProviderFault(kind, message, **state)
