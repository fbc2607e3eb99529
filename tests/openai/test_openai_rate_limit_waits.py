"""Waits a rate limit names without a ``retry-after`` header are honoured as a
``retry-after`` is (bounded by the run's deadline): OpenRouter's
``X-RateLimit-Reset`` relayed in its error's ``metadata.headers`` (inside a
stream, or in a 429 body), and a wait its message names. Through the real
``openai`` SDK and FakeOpenAIServer."""

from __future__ import annotations

import time
from typing import Any

import pytest

import loopengine as le
from loopengine.providers._faults import message_wait
from loopengine.testing import ErrorReply, Reply, StreamErrorEvent

from ..adapter.conftest import STREAMING
from .conftest import OpenAIHarness, openai_operation


def openrouter_limit(reset_in: float) -> dict[str, Any]:
    """OpenRouter's rate-limit error: its code the status, the limit's headers in its
    metadata (``X-RateLimit-Reset`` in epoch milliseconds, ``reset_in`` seconds
    from now on the wall clock, as the server's is)."""
    reset = int((time.time() + reset_in) * 1000)
    return {"code": 429, "message": "Rate limit exceeded: free-models-per-min.",
            "metadata": {"headers": {"X-RateLimit-Limit": "20",
                                     "X-RateLimit-Remaining": "0",
                                     "X-RateLimit-Reset": str(reset)}}}


@pytest.mark.parametrize("where", ["status", "stream"])
async def test_openrouters_rate_limit_reset_is_the_wait(
    wire: OpenAIHarness, where: str
) -> None:
    """The reset time OpenRouter relays is waited for, not the backoff's half second."""
    limit = openrouter_limit(3600.0)
    item: Any = (ErrorReply(status=429, body={"error": limit}) if where == "status" else
                 StreamErrorEvent(reply=Reply.text("half an answer"), after=2,
                                  data={"error": limit}))
    engine, _ = wire.engine(item, Reply.text("ok"), stream=where == "stream")
    result = await engine.run(openai_operation(total_time=None), "go")
    assert result.outcome is le.Outcome.COMPLETED
    first = result.attempt_log[0].settle
    assert first is not None and first.fault == "rate_limited"
    (slept,) = wire.clock.sleeps
    # The reset is on the real wall clock: the request took some of the hour (on a
    # busy machine, seconds; the fake clock sleeps the rest at once), and the
    # backoff's half second is far below it.
    assert 3000.0 < slept <= 3600.0


@STREAMING
async def test_a_wait_the_message_names_is_honoured(wire: OpenAIHarness, stream: bool) -> None:
    """OpenAI's "Please try again in 6.57s" (a 429 without retry-after, or an error
    inside a stream, which has no headers) is the wait."""
    message = ("Rate limit reached for gpt-4o-mini in organization org-x on tokens per min "
               "(TPM): Limit 200000, Used 199000, Requested 1500. Please try again in "
               "6.57s. Visit https://platform.openai.com/account/rate-limits to learn more.")
    item: Any = (StreamErrorEvent(reply=Reply.text("half an answer"), after=2,
                                  type="rate_limit_exceeded", message=message) if stream
                 else ErrorReply(status=429, type="requests", message=message))
    engine, _ = wire.engine(item, Reply.text("ok"), stream=stream)
    result = await engine.run(openai_operation(), "go")
    assert result.outcome is le.Outcome.COMPLETED
    assert wire.clock.sleeps == [6.57]


@STREAMING
async def test_r04_a_named_wait_past_the_deadline_ends_the_run(
    wire: OpenAIHarness, stream: bool
) -> None:
    """A wait longer than the run has left is not slept: the run ends at once."""
    message = "Rate limit reached. Please try again in 1h0m0s."
    item: Any = (StreamErrorEvent(reply=Reply.text("half an answer"), after=2,
                                  type="rate_limit_exceeded", message=message) if stream
                 else ErrorReply(status=429, type="requests", message=message))
    engine, _ = wire.engine(item, Reply.text("never"), stream=stream)
    result = await engine.run(openai_operation(total_time=60.0), "go")
    assert result.outcome is le.Outcome.PROVIDER_ERROR
    assert wire.clock.sleeps == [] and len(wire.requests) == 1


@pytest.mark.parametrize(("message", "wait"), [
    ("Please try again in 6.57s. Visit https://platform.openai.com", 6.57),
    ("Please try again in 120ms.", 0.12),
    ("Please try again in 1m30s.", 90.0),
    ("Please retry after 6 seconds.", 6.0),
    ("Please retry in 37.5s.", 37.5),
    ("Try again in 2 minutes", 120.0),
    ("Please try again later.", None),
    ("Limit 30000, Used 29000, Requested 1500.", None),
])
def test_the_waits_rate_limit_messages_name(message: str, wait: float | None) -> None:
    """OpenAI's Go durations, Azure's seconds, Gemini's; a message naming none."""
    assert message_wait(message) == wait
