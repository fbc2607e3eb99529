"""Logging under the ``loopengine`` logger: one DEBUG line per attempt, one INFO line
per run, and never any message content."""

from __future__ import annotations

import logging
import random
from decimal import Decimal

import pytest

import loopengine as le
from loopengine.providers import FaultKind, ProviderFault, Reply, ScriptedProvider
from loopengine.testing import FakeClock

CANARY = "CANARY-7f3a9c"
"""Put into every piece of conversation content; it must reach no log record."""

MODEL = "claude-logging-test"
PRICES = le.PriceBook([le.ModelPrice(provider="anthropic", model=MODEL,
                                     input_per_mtok=Decimal(3), output_per_mtok=Decimal(15))])
OPERATION = le.Operation(name="logging.test", provider="anthropic", model=MODEL,
                         max_output_tokens=128)


def rendered(record: logging.LogRecord) -> str:
    """Everything a handler could print for the record, traceback included."""
    text = record.getMessage()
    if record.exc_info:
        text += logging.Formatter().formatException(record.exc_info)
    return text


async def test_log_lines_per_attempt_and_run_never_carry_content(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Content in the prompt, system, tools, answers and errors never reaches a log record."""
    clock = FakeClock()

    @le.tool(name="lookup", description=f"Look a key up. {CANARY}")
    async def lookup(key: str) -> str:
        return f"the value is {CANARY}"

    @le.tool(name="broken", description="Fails.")
    async def broken(key: str) -> str:
        raise ValueError(f"handler failed on {CANARY}")

    provider = ScriptedProvider([
        ProviderFault(FaultKind.SERVER_ERROR, "internal error", http_status=500),
        Reply.tool_calls(("lookup", {"key": CANARY}), ("broken", {"key": CANARY}),
                         text=f"thinking about {CANARY}"),
        Reply.text(f"first answer {CANARY}"),
        Reply.text(f"final answer {CANARY}"),
    ], clock=clock)
    verdicts = iter([le.Reject(f"not good enough {CANARY}"), le.Accept()])
    engine = le.Engine(provider, prices=PRICES, clock=clock, rng=random.Random(1))
    with caplog.at_level(logging.DEBUG, logger="loopengine"):
        result = await engine.run(
            OPERATION, f"question {CANARY}", system=f"system {CANARY}",
            tools=[lookup, broken], accept=lambda answer: next(verdicts),
        )
    assert result.outcome is le.Outcome.COMPLETED
    assert CANARY in str(result.messages)  # the content really went through the run

    records = [r for r in caplog.records if r.name.startswith("loopengine")]
    assert records
    for record in records:
        assert CANARY not in rendered(record)

    attempt_lines = [r for r in records if r.levelno == logging.DEBUG
                     and r.getMessage().startswith("attempt ")]
    assert len(attempt_lines) == result.attempts.count == 4
    assert "outcome=error fault=server_error status=500" in attempt_lines[0].getMessage()
    assert all(result.invocation_id in r.getMessage() for r in attempt_lines)

    run_lines = [r for r in records if r.levelno == logging.INFO]
    assert len(run_lines) == 1
    line = run_lines[0].getMessage()
    assert line.startswith(f"run {result.invocation_id} ended completed")
    assert "operation=logging.test turns=3 tool_calls=3 attempts=4" in line


async def test_an_observer_failure_is_logged_at_error_without_content(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A failing observer is an ERROR record with its traceback, and still no content."""
    clock = FakeClock()
    provider = ScriptedProvider([Reply.text(f"answer {CANARY}")], clock=clock)

    def observer(event: object) -> None:
        raise RuntimeError("observer bug")

    engine = le.Engine(provider, prices=PRICES, clock=clock, observers=[observer])
    with caplog.at_level(logging.DEBUG, logger="loopengine"):
        result = await engine.run(OPERATION, f"question {CANARY}")
    assert result.outcome is le.Outcome.COMPLETED
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 5  # RunStarted, TurnStarted, AttemptStarted/Settled, RunEnded
    assert all("observer bug" in rendered(r) for r in errors)
    assert all(CANARY not in rendered(r) for r in caplog.records)
