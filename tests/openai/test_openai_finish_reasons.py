"""The end of a Chat Completions reply through OpenAIProvider, the real ``openai``
SDK and FakeOpenAIServer, JSON and streamed alike: a reply is an answer only
when its ``finish_reason`` says it ended (docs/providers.md)."""

from __future__ import annotations

import pytest

import loopengine as le
from loopengine.testing import ErrorReply, Reply

from ..adapter.conftest import STREAMING
from .conftest import OpenAIHarness, openai_operation

USAGE = le.Usage(input_tokens=10, output_tokens=4)


def unfinished(stop_reason: str | None) -> Reply:
    """Half an answer ending with this ``finish_reason`` (None: null)."""
    return Reply(content=[{"type": "text", "text": "half an"}], stop_reason=stop_reason,
                 usage=USAGE)


@pytest.mark.parametrize(("finish", "fault", "code"), [
    ("abort", "aborted", "abort"),
    ("error", "server_error", "error"),
    ("insufficient_system_resource", "server_error", "insufficient_system_resource"),
])
@STREAMING
async def test_r05_a_reply_the_server_gave_up_on_is_retried_not_accepted(
    wire: OpenAIHarness, stream: bool, finish: str, fault: str, code: str
) -> None:
    """vLLM's ``abort``, ``error`` and any finish reason no table reads: the reply is
    not an answer, retried; the attempt keeps the server's usage and status."""
    engine, _ = wire.engine(unfinished(finish), Reply.text("the answer"), stream=stream)
    result = await engine.run(openai_operation(), "go", accept=lambda _: True)
    assert result.outcome is le.Outcome.COMPLETED and result.answer == "the answer"
    first = result.attempt_log[0].settle
    assert first is not None
    assert (first.fault, first.error_code, first.http_status) == (fault, code, 200)
    assert first.usage == USAGE and first.charged is False
    assert len(wire.requests) == 2


@STREAMING
async def test_a_reply_without_a_finish_reason_is_never_an_answer(
    wire: OpenAIHarness, stream: bool
) -> None:
    """``finish_reason: null``: a stream that ended so was cut (``aborted``), and the
    same reply whole never finished (``invalid_response``); both retried."""
    engine, _ = wire.engine(unfinished(None), Reply.text("the answer"), stream=stream)
    result = await engine.run(openai_operation(), "go", accept=lambda _: True)
    assert result.outcome is le.Outcome.COMPLETED and result.answer == "the answer"
    first = result.attempt_log[0].settle
    assert first is not None
    assert (first.fault, first.error_code) == (("aborted", None) if stream
                                               else ("server_error", "invalid_response"))
    assert len(wire.requests) == 2


@pytest.mark.parametrize(("finish", "outcome"), [
    ("eos", le.Outcome.COMPLETED), ("STOP", le.Outcome.COMPLETED),
    ("model_length", le.Outcome.INCOMPLETE),
])
@STREAMING
async def test_compatible_servers_names_for_an_end_are_read(
    wire: OpenAIHarness, stream: bool, finish: str, outcome: le.Outcome
) -> None:
    """Together's ``eos``, an upper-cased ``STOP`` and Mistral's ``model_length``."""
    engine, _ = wire.engine(Reply.text("Paris", stop_reason=finish), stream=stream)
    result = await engine.run(openai_operation(), "go", accept=lambda _: True)
    assert result.outcome is outcome and len(wire.requests) == 1


async def test_a_stream_of_unreadable_events_records_the_status_the_server_sent(
    wire: OpenAIHarness,
) -> None:
    """A 200 whose server-sent events are not JSON: an invalid response, retried,
    whose attempt records the 200 the server answered."""
    garbage = ErrorReply(status=200, body="data: {not json\n\n")
    engine, ledger = wire.engine(garbage, Reply.text("the answer"), stream=True)
    result = await engine.run(openai_operation(), "go")
    assert result.outcome is le.Outcome.COMPLETED
    first = min(ledger.attempts.values(), key=lambda row: row["ordinal"])
    assert (first["fault"], first["error_code"], first["http_status"]) == (
        "server_error", "invalid_response", 200)
