"""Programming errors in the caller's code are loud, and still follow the rules,
through AnthropicProvider -> the real ``anthropic`` SDK -> FakeAnthropicServer.

A judge that raises, or returns something that is not a verdict, still counts
as a rejection (R10) and is logged at ERROR under ``loopengine``, with the
traceback of what it raised. A tool handler that raises still gives the model
an error result with its message (R09) and is logged at WARNING with its
traceback: raising is also how a handler reports an ordinary failure. The
exception's message is withheld from the log (it may hold conversation
content; logs never carry content), its type, traceback and chain are kept.
"""

from __future__ import annotations

import logging
import traceback
from typing import Any

import pydantic
import pytest

import loopengine as le
from loopengine.testing import Reply

from ..conftest import operation
from .conftest import Harness, tool_results

CANARY = "CANARY-51d0e2"
"""Put into every exception message; it must reach no log record."""


def rendered(record: logging.LogRecord) -> str:
    """Everything a handler could print for the record, traceback included."""
    text = record.getMessage()
    if record.exc_info:
        text += logging.Formatter().formatException(record.exc_info)
    return text


def frames(record: logging.LogRecord) -> list[str]:
    """The function names of the record's traceback."""
    assert record.exc_info is not None
    return [frame.name for frame in traceback.extract_tb(record.exc_info[2])]


def engine_records(caplog: pytest.LogCaptureFixture, level: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "loopengine" and r.levelno == level]


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
async def test_r10_a_raising_judge_rejects_and_is_logged_at_error_with_its_traceback(
    wire: Harness, caplog: pytest.LogCaptureFixture, asynchronous: bool
) -> None:
    """The judge's exception is a rejection that consumes tool budget and goes back for
    repair; an ERROR record carries its traceback, not its message."""
    verdicts = iter([True])

    def check(answer: str) -> bool:
        if answer == "first":
            raise ValueError(f"judge bug on {CANARY}")
        return next(verdicts)

    async def async_judge(answer: str) -> bool:
        return check(answer)

    engine, _ = wire.engine(Reply.text("first"), Reply.text("second"))
    with caplog.at_level(logging.DEBUG, logger="loopengine"):
        result = await engine.run(operation(), "go",
                                  accept=async_judge if asynchronous else check)
    assert result.outcome is le.Outcome.COMPLETED and result.answer == "second"
    assert result.tool_calls == 1  # the rejection consumed one unit of tool budget (R10)
    repair = wire.requests[1].messages[-1]
    assert repair["role"] == "user" and "could not be checked" in repair["content"]

    (record,) = engine_records(caplog, logging.ERROR)
    assert "the judge raised ValueError" in record.getMessage()
    assert record.exc_info is not None and "check" in frames(record)
    assert "builtins.ValueError (message withheld)" in rendered(record)
    assert all(CANARY not in rendered(r) for r in caplog.records)


@pytest.mark.parametrize("verdict", [None, "yes", 1, le.Accept],
                         ids=["None", "str", "int", "the-Accept-class"])
async def test_r10_a_judge_returning_no_verdict_rejects_and_is_logged_at_error(
    wire: Harness, caplog: pytest.LogCaptureFixture, verdict: Any
) -> None:
    """None, a string, an int or the Accept class itself is no verdict: a rejection,
    and an ERROR record naming what the judge returned."""
    answers = iter([verdict, le.Accept()])
    engine, _ = wire.engine(Reply.text("first"), Reply.text("second"))
    with caplog.at_level(logging.DEBUG, logger="loopengine"):
        result = await engine.run(operation(), "go", accept=lambda _: next(answers))
    assert result.outcome is le.Outcome.COMPLETED and result.answer == "second"
    assert result.tool_calls == 1
    (record,) = engine_records(caplog, logging.ERROR)
    assert f"the judge returned {type(verdict).__name__}" in record.getMessage()
    assert "counts as rejected" in record.getMessage()


async def test_r10_a_structured_judge_that_raises_is_logged_and_returned_as_an_error_result(
    wire: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """In structured mode the raising judge's rejection is the final_answer's is_error
    result; the ERROR record is the same."""

    class City(pydantic.BaseModel):
        city: str

    def judge(answer: City) -> bool:
        if answer.city == "Atlantis":
            raise LookupError(f"no atlas for {CANARY}")
        return True

    engine, _ = wire.engine(Reply.final({"city": "Atlantis"}), Reply.final({"city": "Oslo"}))
    with caplog.at_level(logging.DEBUG, logger="loopengine"):
        result = await engine.run(operation(), "Which city?", output=City, accept=judge)
    assert result.answer == City(city="Oslo")
    (returned,) = tool_results(wire.requests[1])
    assert returned["is_error"] is True and "could not be checked" in returned["content"]
    (record,) = engine_records(caplog, logging.ERROR)
    assert record.exc_info is not None and "judge" in frames(record)
    assert all(CANARY not in rendered(r) for r in caplog.records)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
async def test_r09_a_raising_handler_is_logged_at_warning_with_its_traceback(
    wire: Harness, caplog: pytest.LogCaptureFixture, asynchronous: bool
) -> None:
    """The model still gets the exception's message as an is_error result (R09); the
    WARNING record carries the handler's traceback (a worker thread's for a sync one)."""

    def explode(key: str) -> str:
        raise RuntimeError(f"no such key: {key}")

    async def explode_async(key: str) -> str:
        return explode(key)

    handler = explode_async if asynchronous else explode
    broken = le.tool(name="broken", description="Always fails.")(handler)
    engine, _ = wire.engine(Reply.tool_calls(("broken", {"key": CANARY})), Reply.text("sorry"))
    with caplog.at_level(logging.DEBUG, logger="loopengine"):
        result = await engine.run(operation(), "go", tools=[broken])
    assert result.outcome is le.Outcome.COMPLETED
    (error,) = tool_results(wire.requests[1])
    assert error["is_error"] is True and error["content"] == f"no such key: {CANARY}"

    (record,) = engine_records(caplog, logging.WARNING)
    assert "tool broken raised RuntimeError" in record.getMessage()
    assert record.exc_info is not None and "explode" in frames(record)
    assert engine_records(caplog, logging.ERROR) == []
    assert all(CANARY not in rendered(r) for r in caplog.records)


async def test_a_logged_handler_error_keeps_its_chain_without_the_messages(
    wire: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """``raise ... from`` keeps both exceptions' types and tracebacks in the record."""

    @le.tool
    async def lookup(key: str) -> str:
        """Look a key up."""
        try:
            return {"a": "1"}[key]
        except KeyError as missing:
            raise ValueError(f"unknown key {key}") from missing

    engine, _ = wire.engine(Reply.tool_calls(("lookup", {"key": CANARY})), Reply.text("ok"))
    with caplog.at_level(logging.DEBUG, logger="loopengine"):
        await engine.run(operation(), "go", tools=[lookup])
    (record,) = engine_records(caplog, logging.WARNING)
    text = rendered(record)
    assert "builtins.KeyError (message withheld)" in text
    assert "direct cause of the following exception" in text
    assert "builtins.ValueError (message withheld)" in text
    assert CANARY not in text
