"""An error chunk inside a Chat Completions stream that also carries ``usage`` and the
response id (OpenRouter sends ``{"id": ..., "error": {...}, "usage": {...}}`` mid-stream
or after the finish chunk) settles its attempt with that usage and id, not NULL usage:
through the real ``openai`` SDK and FakeOpenAIServer's raw error event."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

import loopengine as le
from loopengine.providers import FaultKind
from loopengine.testing import ErrorReply, Reply, StreamErrorEvent

from .conftest import OpenAIHarness, openai_operation

SERVED = le.Usage(input_tokens=1_000, output_tokens=40, cache_read_tokens=200)
"""What the error chunk reports: 1,200 prompt tokens of which 200 cached, 40 out."""


def openrouter_error(response_id: str, *, code: object = 502,
                     message: str = "Provider returned error") -> dict[str, Any]:
    """An error chunk as OpenRouter streams it: the generation's id and model, the
    error, a choice finishing ``error``, and the usage billed so far."""
    return {
        "id": response_id, "object": "chat.completion.chunk", "created": 1_700_000_000,
        "model": "gpt-fake", "provider": "Anthropic",
        "error": {"code": code, "message": message},
        "choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "error"}],
        "usage": {"prompt_tokens": 1_200, "completion_tokens": 40, "total_tokens": 1_240,
                  "prompt_tokens_details": {"cached_tokens": 200}},
    }


def partial(response_id: str) -> Reply:
    """The reply the stream began (its chunks carry ``response_id``, as OpenRouter's do)."""
    return dataclasses.replace(Reply.text("a partial answer"), response_id=response_id)


@pytest.mark.parametrize(("after", "where"), [(0, "first-chunk"), (3, "mid-stream"),
                                              (5, "after-finish")])
async def test_an_error_chunk_with_usage_settles_with_that_usage_and_id(
    wire: OpenAIHarness, after: int, where: str,
) -> None:
    """The failed attempt's row has the chunk's tokens, its cost, the response id and
    exact usage (the server's count, not a floor); the retry answers."""
    engine, ledger = wire.engine(
        StreamErrorEvent(reply=partial("gen-77"),
                         after=after, data=openrouter_error("gen-77"), usage=SERVED),
        Reply.text("the whole answer"), stream=True)
    result = await engine.run(openai_operation(), "go")
    assert result.outcome is le.Outcome.COMPLETED and result.answer == "the whole answer"
    failed, ok = sorted(ledger.attempts.values(), key=lambda row: row["attempt"])
    assert (failed["outcome"], ok["outcome"]) == ("error", "ok")
    assert (failed["fault"], failed["error_code"]) == ("server_error", "502")
    assert failed["response_id"] == "gen-77"
    assert (failed["input_tokens"], failed["output_tokens"], failed["cache_read_tokens"]) == (
        1_000, 40, 200)
    assert failed["usage_approx"] in (0, False)
    assert failed["cost_nanousd"] == 1_240_000  # 1,240 tokens at $1 per million
    assert result.attempt_log[0].settle is not None
    assert result.attempt_log[0].settle.usage == SERVED
    assert wire.server.usage_served.input_tokens >= 1_000


async def test_an_error_chunk_without_usage_keeps_the_floor_it_had(
    wire: OpenAIHarness,
) -> None:
    """The same error chunk without usage: the attempt keeps the id and no usage (the
    stream sent none before it); the fault is classified by its error as before."""
    chunk = openrouter_error("gen-78", code="rate_limit_exceeded", message="slow down")
    del chunk["usage"]
    engine, ledger = wire.engine(
        StreamErrorEvent(reply=partial("gen-78"), after=2, data=chunk),
        Reply.text("done"), stream=True)
    result = await engine.run(openai_operation(), "go")
    assert result.outcome is le.Outcome.COMPLETED
    failed = min(ledger.attempts.values(), key=lambda row: row["attempt"])
    fault = result.attempt_log[0].settle
    assert fault is not None and fault.usage is None
    assert failed["response_id"] == "gen-78" and failed["input_tokens"] is None
    assert failed["error_code"] == "rate_limit_exceeded"


async def test_an_error_chunk_that_is_a_credit_error_is_not_retried(
    wire: OpenAIHarness,
) -> None:
    """An error chunk naming an exhausted quota is credit_exhausted (R06): the run ends
    on it, its usage and id recorded."""
    chunk = openrouter_error("gen-79", code="insufficient_quota", message="no credits")
    engine, ledger = wire.engine(
        StreamErrorEvent(reply=partial("gen-79"), after=2, data=chunk, usage=SERVED),
        stream=True)
    result = await engine.run(openai_operation(), "go")
    assert result.fault is not None and result.fault.kind is FaultKind.CREDIT_EXHAUSTED
    (row,) = ledger.attempts.values()
    assert (row["response_id"], row["input_tokens"], row["cost_nanousd"]) == (
        "gen-79", 1_000, 1_240_000)


@pytest.mark.parametrize(("code", "kind", "retried"), [
    (429, FaultKind.RATE_LIMITED, True),
    (402, FaultKind.CREDIT_EXHAUSTED, False),
    (400, FaultKind.BAD_REQUEST, False),
])
async def test_r06_an_error_chunk_whose_code_is_an_http_status_is_that_status_fault(
    wire: OpenAIHarness, code: int, kind: FaultKind, retried: bool,
) -> None:
    """OpenRouter's error codes are HTTP statuses: mid-stream, 429 is a rate limit
    (retried), 402 depleted credits (R06: the run ends on it)."""
    chunk = openrouter_error("gen-80", code=code, message="upstream said no")
    engine, ledger = wire.engine(
        StreamErrorEvent(reply=partial("gen-80"), after=2, data=chunk, usage=SERVED),
        Reply.text("done"), stream=True)
    result = await engine.run(openai_operation(), "go")
    first = result.attempt_log[0].settle
    assert first is not None and (first.fault, first.error_code) == (kind.value, str(code))
    assert (result.outcome is le.Outcome.COMPLETED) is retried
    assert len(ledger.attempts) == (2 if retried else 1)


def error_body(code: int, message: str) -> ErrorReply:
    """A 200 whose JSON body is an error object, as OpenRouter answers a request
    (streamed or not) whose upstream provider failed after accepting it."""
    return ErrorReply(status=200, body={
        "error": {"code": code, "message": message,
                  "metadata": {"provider_name": "Google AI Studio"}},
        "user_id": "user_1"})


@pytest.mark.parametrize(("code", "kind", "outcome"), [
    (429, FaultKind.RATE_LIMITED, le.Outcome.COMPLETED),
    (502, FaultKind.SERVER_ERROR, le.Outcome.COMPLETED),
    (402, FaultKind.CREDIT_EXHAUSTED, le.Outcome.CREDIT_EXHAUSTED),
])
async def test_r06_a_200_body_that_is_an_error_is_classified_by_it(
    wire: OpenAIHarness, code: int, kind: FaultKind, outcome: le.Outcome,
) -> None:
    """A whole (JSON) 200 whose body is ``{"error": {...}}``: classified by that error,
    as the same error inside a stream is, not as an unreadable body: a rate limit
    is retried, depleted credits end the run at once."""
    engine, ledger = wire.engine(error_body(code, "Rate limit exceeded: free-models-per-day"),
                                 Reply.text("done"))
    result = await engine.run(openai_operation(), "go")
    assert result.outcome is outcome, result.detail
    first = result.attempt_log[0].settle
    assert first is not None
    assert (first.fault, first.http_status, first.error_code) == (kind.value, 200, str(code))
    assert len(ledger.attempts) == (1 if outcome is le.Outcome.CREDIT_EXHAUSTED else 2)
