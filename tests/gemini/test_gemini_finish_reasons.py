"""Every Gemini ``finishReason`` the installed ``google-genai`` SDK knows, and one it
does not, through GeminiProvider, the real SDK and FakeGeminiServer (JSON and SSE):
an answer, a refusal, a cut-off answer, a malformed call, or a fault, never a
reply of unknown standing accepted as an answer (docs/providers.md, "Stop
reasons")."""

from __future__ import annotations

import json
from typing import Any

import pytest
from google.genai import types

import loopengine as le
from loopengine.providers._gemini_contents import ANSWERED
from loopengine.testing import ErrorReply, Reply, StreamErrorEvent

from ..adapter.conftest import STREAMING
from .conftest import GeminiHarness, gemini_operation

REFUSED = ["SAFETY", "PROHIBITED_CONTENT", "BLOCKLIST", "SPII", "RECITATION", "IMAGE_SAFETY",
           "IMAGE_PROHIBITED_CONTENT", "IMAGE_RECITATION", "MODEL_ARMOR", "ESCALATION",
           "LANGUAGE"]
CUT = ["MAX_TOKENS", "CONTINUATION", "TOO_MANY_TOOL_CALLS"]
# Retried, then answered: the first attempt's fault and error code.
RETRIED = {"MALFORMED_RESPONSE": "invalid_response", "OTHER": "OTHER",
           "NO_IMAGE": "NO_IMAGE", "IMAGE_OTHER": "IMAGE_OTHER"}
# Never retried: the fault kind and error code.
PERMANENT = {"MISSING_THOUGHT_SIGNATURE": ("bad_request", "MISSING_THOUGHT_SIGNATURE"),
             "PUP_LIMITED_DISABLED": ("unauthorized", "PUP_LIMITED_DISABLED")}
# FINISH_REASON_UNSPECIFIED is the enum's unset value, so its reply never finished.
UNSET = "FINISH_REASON_UNSPECIFIED"


def test_every_finish_reason_of_the_sdk_has_a_decided_reading() -> None:
    """A finish reason the SDK adds is decided on here, not passed through."""
    decided = {"STOP", "MALFORMED_FUNCTION_CALL", "UNEXPECTED_TOOL_CALL", UNSET, *REFUSED,
               *CUT, *RETRIED, *PERMANENT}
    assert {reason.value for reason in types.FinishReason} <= decided
    assert ANSWERED == {"STOP", "MALFORMED_FUNCTION_CALL", "UNEXPECTED_TOOL_CALL",
                        *REFUSED, *CUT}


@pytest.mark.parametrize("reason", REFUSED)
@STREAMING
async def test_r11_a_withheld_answer_ends_refused_gemini(
    wire: GeminiHarness, stream: bool, reason: str
) -> None:
    """A finish reason of the API's policy ends refused after one request, its text
    never accepted."""
    engine, ledger = wire.engine(Reply.text("partial", stop_reason=reason), stream=stream)
    result = await engine.run(gemini_operation(), "go", accept=lambda _: True)
    assert result.outcome is le.Outcome.REFUSED and result.answer is None
    (row,) = ledger.attempts.values()
    assert (row["outcome"], row["stop_reason"]) == ("ok", "refusal")


@pytest.mark.parametrize("reason", CUT)
@STREAMING
async def test_r11_a_cut_off_answer_ends_incomplete_gemini(
    wire: GeminiHarness, stream: bool, reason: str
) -> None:
    """TOO_MANY_TOOL_CALLS (the API's tool loop stopped before the final answer) is
    cut off like MAX_TOKENS: incomplete, one request."""
    engine, _ = wire.engine(Reply.text("Paris is the", stop_reason=reason), Reply.text("x"),
                            stream=stream)
    result = await engine.run(gemini_operation(), "go", accept=lambda _: True)
    assert result.outcome is le.Outcome.INCOMPLETE and result.answer is None
    assert len(wire.requests) == 1


@pytest.mark.parametrize("reason", [*RETRIED, "SOME_FUTURE_REASON"])
@STREAMING
@pytest.mark.filterwarnings("ignore:SOME_FUTURE_REASON is not a valid FinishReason")
async def test_r05_an_unreadable_finish_is_a_server_error_retried_gemini(
    wire: GeminiHarness, stream: bool, reason: str
) -> None:
    """MALFORMED_RESPONSE, OTHER, the image reasons of a text request, and a value
    newer than the SDK: not an answer but the server's failure, retried; the
    first attempt keeps its usage (recorded, not charged) and names the reason."""
    usage = le.Usage(input_tokens=10, output_tokens=4)
    engine, _ = wire.engine(Reply.text("half an", stop_reason=reason, usage=usage),
                            Reply.text("the answer"), stream=stream)
    result = await engine.run(gemini_operation(), "go", accept=lambda _: True)
    assert result.outcome is le.Outcome.COMPLETED and result.answer == "the answer"
    first = result.attempt_log[0].settle
    assert first is not None
    assert (first.outcome, first.fault, first.error_code, first.http_status) == (
        "error", "server_error", RETRIED.get(reason, reason), 200)
    assert first.usage == usage and first.charged is False
    assert len(wire.requests) == 2


@pytest.mark.parametrize("reason", sorted(PERMANENT))
@STREAMING
async def test_a_finish_that_no_retry_mends_ends_provider_error_gemini(
    wire: GeminiHarness, stream: bool, reason: str
) -> None:
    """A missing thought signature (the request's fault) and an account limited for
    policy violations are not retried."""
    engine, _ = wire.engine(Reply.text("", stop_reason=reason), Reply.text("never"),
                            stream=stream)
    result = await engine.run(gemini_operation(), "go", accept=lambda _: True)
    assert result.outcome is le.Outcome.PROVIDER_ERROR
    (attempt,) = result.attempt_log
    assert attempt.settle is not None
    assert (attempt.settle.fault, attempt.settle.error_code) == PERMANENT[reason]
    assert len(wire.requests) == 1


@STREAMING
async def test_an_unset_finish_reason_is_no_finish_gemini(
    wire: GeminiHarness, stream: bool
) -> None:
    """FINISH_REASON_UNSPECIFIED is the unset value: a reply that never finished (a
    JSON reply answered nothing, a stream was cut), retried."""
    engine, _ = wire.engine(Reply.text("half an", stop_reason=UNSET),
                            Reply.text("the answer"), stream=stream)
    result = await engine.run(gemini_operation(), "go", accept=lambda _: True)
    assert result.outcome is le.Outcome.COMPLETED and result.answer == "the answer"
    first = result.attempt_log[0].settle
    assert first is not None
    assert (first.outcome, first.fault) == (("aborted", "aborted") if stream
                                            else ("error", "server_error"))


@STREAMING
async def test_an_unset_block_reason_blocks_nothing_gemini(
    wire: GeminiHarness, stream: bool
) -> None:
    """BLOCKED_REASON_UNSPECIFIED is the unset value of ``promptFeedback.blockReason``:
    a reply with it and no candidate answered nothing (retried), never a refusal."""
    engine, _ = wire.engine(Reply.text("", stop_reason="blocked:BLOCKED_REASON_UNSPECIFIED"),
                            Reply.text("the answer"), stream=stream)
    result = await engine.run(gemini_operation(), "go", accept=lambda _: True)
    assert result.outcome is le.Outcome.COMPLETED and result.answer == "the answer"
    first = result.attempt_log[0].settle
    assert first is not None
    assert (first.outcome, first.fault) == (("aborted", "aborted") if stream
                                            else ("error", "server_error"))


BLOCKED_BUT_ANSWERED = json.dumps({
    "promptFeedback": {"blockReason": "PROHIBITED_CONTENT"},
    "candidates": [{"content": {"parts": [{"text": "an answer"}], "role": "model"},
                    "finishReason": "STOP", "index": 0}],
    "usageMetadata": {"promptTokenCount": 10, "totalTokenCount": 10}})


@STREAMING
async def test_r11_a_blocked_prompt_is_refused_whatever_its_candidate_says_gemini(
    wire: GeminiHarness, stream: bool
) -> None:
    """A reply whose ``promptFeedback.blockReason`` blocked the prompt ends refused
    even beside a candidate that finished ``STOP``: its text is never accepted."""
    item: Any = (StreamErrorEvent(reply=Reply.text(""), after=0, data=BLOCKED_BUT_ANSWERED)
                 if stream else ErrorReply(status=200, body=BLOCKED_BUT_ANSWERED))
    engine, ledger = wire.engine(item, stream=stream)
    result = await engine.run(gemini_operation(), "go", accept=lambda _: True)
    assert result.outcome is le.Outcome.REFUSED and result.answer is None
    (row,) = ledger.attempts.values()
    assert (row["outcome"], row["stop_reason"]) == ("ok", "refusal")


UNREADABLE = {
    "not-json": "not json",
    "not-a-response": '{"usageMetadata": {"promptTokenCount": "many"}}',
    # Fields of the wrong type the SDK's reading fails on with a TypeError and
    # an AttributeError of its own, not a validation error.
    "candidates-not-a-list": '{"candidates": 5}',
    "finish-reason-a-number": '{"candidates": [{"finishReason": 7}]}',
}


@pytest.mark.parametrize("name", sorted(UNREADABLE))
@STREAMING
async def test_an_unreadable_body_records_the_status_the_server_sent_gemini(
    wire: GeminiHarness, stream: bool, name: str
) -> None:
    """A 200 whose body (or stream event) the SDK cannot read: an invalid response,
    retried, whose attempt records the 200 the server answered; never an error
    out of the run."""
    body = UNREADABLE[name]
    item: Any = (StreamErrorEvent(reply=Reply.text("half an answer"), after=1, data=body)
                 if stream else ErrorReply(status=200, body=body))
    engine, ledger = wire.engine(item, Reply.text("the answer"), stream=stream)
    result = await engine.run(gemini_operation(), "go")
    assert result.outcome is le.Outcome.COMPLETED
    first = min(ledger.attempts.values(), key=lambda row: row["ordinal"])
    assert (first["fault"], first["error_code"], first["http_status"]) == (
        "server_error", "invalid_response", 200)
