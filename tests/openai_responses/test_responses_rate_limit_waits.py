"""A Responses stream's rate-limit ``error`` event names its wait only in its message
("Please try again in 6.57s"): that wait is honoured as a ``retry-after`` is.
Through the real ``openai`` SDK and FakeOpenAIServer's ``/v1/responses``."""

from __future__ import annotations

import loopengine as le
from loopengine.testing import Reply, StreamErrorEvent

from .conftest import ResponsesHarness, openai_operation


async def test_a_stream_error_events_named_wait_is_honoured(wire: ResponsesHarness) -> None:
    """The event's "try again in 6.57s" is slept, not the backoff's half second."""
    limited = StreamErrorEvent(
        reply=Reply.text("half an answer"), after=3, type="rate_limit_exceeded",
        message="Rate limit reached for gpt-4o-mini on tokens per min (TPM): Limit "
                "30000, Used 29500, Requested 900. Please try again in 6.57s.")
    engine, _ = wire.engine(limited, Reply.text("ok"), stream=True)
    result = await engine.run(openai_operation(), "go")
    assert result.outcome is le.Outcome.COMPLETED
    first = result.attempt_log[0].settle
    assert first is not None and first.fault == "rate_limited"
    assert wire.clock.sleeps == [6.57]
