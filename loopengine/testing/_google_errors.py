"""Errors in Google's shape, as the Gemini API and Vertex AI send them, for the
loopback fakes (`FakeGeminiServer`, `FakeVertexServer`): ``{"error": {"code",
"message", "status", "details"}}``, whose typed details are
``google.rpc.ErrorInfo`` (a ``reason``), ``google.rpc.QuotaFailure`` (the
quota exceeded) and ``google.rpc.RetryInfo`` (the ``retryDelay`` to wait)."""

from __future__ import annotations

from typing import Any

__all__ = ["google_error"]


def google_error(code: int, status: str, message: str, *, reason: str | None = None,
                 quota: tuple[str, str] | None = None,
                 retry_delay: str | None = None) -> dict[str, Any]:
    """The ``error`` object of a Google error body.

    Args:
        code: The HTTP status.
        status: The canonical status (``RESOURCE_EXHAUSTED``...).
        message: ``error.message``.
        reason: An ``ErrorInfo`` detail's ``reason`` (``BILLING_DISABLED``).
        quota: A ``QuotaFailure`` violation's ``quotaMetric`` and ``quotaId``.
        retry_delay: A ``RetryInfo`` detail's ``retryDelay`` (``"45s"``).
    """
    details: list[dict[str, Any]] = []
    if reason is not None:
        details.append({"@type": "type.googleapis.com/google.rpc.ErrorInfo",
                        "reason": reason, "domain": "googleapis.com"})
    if quota is not None:
        details.append({"@type": "type.googleapis.com/google.rpc.QuotaFailure",
                        "violations": [{"quotaMetric": quota[0], "quotaId": quota[1]}]})
    if retry_delay is not None:
        details.append({"@type": "type.googleapis.com/google.rpc.RetryInfo",
                        "retryDelay": retry_delay})
    error: dict[str, Any] = {"code": code, "message": message, "status": status}
    if details:
        error["details"] = details
    return error
