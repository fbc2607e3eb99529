"""A run that raises instead of reaching an outcome (its ledger fails, its replay
diverges) is recorded ``failed`` where the ledger still can, and its observers
always see it end."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import anyio
import pydantic
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

import loopengine as le
from loopengine.events import AttemptSettled, AttemptStarted, Event, RunEnded, RunStarted
from loopengine.otel import OpenTelemetryObserver
from loopengine.persistence import AttemptDispatch, MemoryLedger, SQLiteLedger
from loopengine.providers import (
    RecordingProvider,
    ReplayProvider,
    Reply,
    ScriptedProvider,
)
from loopengine.testing import FakeClock

from .conftest import PRICES, operation
from .ledger_support import overloaded


class RefusingLedger(MemoryLedger):
    """A memory ledger that cannot write the dispatch of one ordinal."""

    def __init__(self, refuse: int) -> None:
        super().__init__()
        self.refuse = refuse

    async def dispatch_attempt(self, record: AttemptDispatch) -> None:
        if record.ordinal == self.refuse:
            raise le.LedgerError(f"cannot write attempt {record.ordinal}")
        await super().dispatch_attempt(record)


@le.tool(name="lookup", description="Look a key up.")
async def lookup(key: str) -> str:
    return f"value of {key}"


def script() -> list[Reply]:
    return [Reply.tool_calls(("lookup", {"key": "a"})), Reply.text("done")]


async def test_r01_a_run_whose_dispatch_cannot_be_written_ends_failed() -> None:
    """The LedgerError reaches the caller; the attempt that never went out has no
    row and is not counted; the invocation is recorded ``failed``; observers see
    RunEnded(failed) last."""
    ledger = RefusingLedger(refuse=2)
    events: list[Event] = []
    provider = ScriptedProvider(script())
    engine = le.Engine(provider, ledger=ledger, prices=PRICES, observers=[events.append])
    with pytest.raises(le.LedgerError, match="cannot write attempt 2") as raised:
        await engine.run(operation(), "go", tools=[lookup])
    assert raised.value.attempts == 1

    assert len(provider.requests) == 1  # the second request was never sent
    (invocation,) = ledger.invocations.values()
    # Turn 2's only request was never sent: one turn, as R01 counts them.
    assert (invocation["outcome"], invocation["turns"], invocation["tool_calls"],
            invocation["attempt_count"]) == ("failed", 1, 1, 1)
    assert [row["outcome"] for row in ledger.attempts.values()] == ["ok"]
    assert isinstance(events[0], RunStarted)
    ended = events[-1]
    assert isinstance(ended, RunEnded)
    assert (ended.outcome, ended.attempts, ended.turns) == ("failed", 1, 1)
    assert sum(isinstance(e, RunEnded) for e in events) == 1


async def test_r01_a_retry_that_cannot_be_written_leaves_its_turn_counted() -> None:
    """The unsent attempt was a retry: its turn did send a request, so it counts."""
    ledger = RefusingLedger(refuse=2)
    engine = le.Engine(ScriptedProvider([overloaded(), Reply.text("ok")]), ledger=ledger,
                       prices=PRICES, clock=FakeClock())
    with pytest.raises(le.LedgerError) as raised:
        await engine.run(operation(), "go")
    assert raised.value.attempts == 1
    (invocation,) = ledger.invocations.values()
    assert (invocation["outcome"], invocation["turns"], invocation["attempt_count"]) == (
        "failed", 1, 1)


async def test_a_run_on_a_closed_ledger_raises_before_it_starts(tmp_path: Path) -> None:
    """Nothing recorded, nothing announced, nothing sent: the error says so."""
    ledger = SQLiteLedger(tmp_path / "ledger.db")
    await ledger.aclose()
    events: list[Event] = []
    provider = ScriptedProvider([Reply.text("ok")])
    engine = le.Engine(provider, ledger=ledger, prices=PRICES, observers=[events.append])
    with pytest.raises(le.LedgerError, match="closed") as raised:
        await engine.run(operation(), "go")
    assert raised.value.attempts == 0
    assert events == [] and provider.requests == []


async def test_a_call_whose_dispatch_cannot_be_written_ends_failed() -> None:
    """`Engine.call` the same way: recorded ``failed``, RunEnded(failed)."""

    class Answer(pydantic.BaseModel):
        value: int

    ledger = RefusingLedger(refuse=1)
    events: list[Event] = []
    engine = le.Engine(ScriptedProvider([Reply.final({"value": 1})]), ledger=ledger,
                       prices=PRICES, observers=[events.append])
    with pytest.raises(le.LedgerError) as raised:
        await engine.call(operation(), "go", output=Answer)
    assert raised.value.attempts == 0  # the call throws with its attempt count
    (invocation,) = ledger.invocations.values()
    assert (invocation["outcome"], invocation["attempt_count"]) == ("failed", 0)
    assert ledger.attempts == {}
    ended = events[-1]
    assert isinstance(ended, RunEnded) and (ended.outcome, ended.attempts) == ("failed", 0)


async def test_a_call_that_ends_with_an_outcome_error_is_not_failed() -> None:
    """An OutcomeError comes after its outcome was recorded: it stays that outcome."""

    class Answer(pydantic.BaseModel):
        value: int

    ledger = MemoryLedger()
    events: list[Event] = []
    refusal = Reply.text("no", stop_reason="refusal")
    engine = le.Engine(ScriptedProvider([refusal]), ledger=ledger, prices=PRICES,
                       observers=[events.append])
    with pytest.raises(le.OutcomeError):
        await engine.call(operation(), "go", output=Answer)
    (invocation,) = ledger.invocations.values()
    assert invocation["outcome"] == "refused"
    ended = [e for e in events if isinstance(e, RunEnded)]
    assert [e.outcome for e in ended] == ["refused"]


async def test_a_diverged_replay_ends_failed(tmp_path: Path) -> None:
    """A provider's LoopEngineError (a replay that diverged): the attempt it ended is
    settled, the invocation recorded ``failed``."""
    path = tmp_path / "run.jsonl"
    await le.Engine(RecordingProvider(ScriptedProvider([Reply.text("ok")]), path),
                    prices=PRICES).run(operation(), "Hi")
    ledger = MemoryLedger()
    engine = le.Engine(ReplayProvider(path), ledger=ledger, prices=PRICES)
    with pytest.raises(le.ReplayMismatchError) as raised:
        await engine.run(operation(), "Something else")
    assert raised.value.attempts == 1
    (invocation,) = ledger.invocations.values()
    assert (invocation["outcome"], invocation["attempt_count"]) == ("failed", 1)
    (attempt,) = ledger.attempts.values()
    assert (attempt["outcome"], attempt["fault"]) == ("error", "bad_request")


async def test_a_run_whose_sqlite_ledger_closed_mid_run_ends_for_its_observers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """The SQLite ledger closed under the run: nothing more can be recorded (the
    invocation stays ``running`` in the file, as after a crash, and the failure to
    record is logged), yet the observers see the run end, and its OTel span ends
    with an error instead of staying open."""
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    events: list[Event] = []
    ledger = SQLiteLedger(tmp_path / "ledger.db")

    @le.tool(name="close_ledger", description="Closes the ledger.")
    async def close_ledger() -> str:
        await ledger.aclose()
        return "closed"

    engine = le.Engine(
        ScriptedProvider([Reply.tool_calls(("close_ledger", {})), Reply.text("done")]),
        ledger=ledger, prices=PRICES,
        observers=[OpenTelemetryObserver(tracer_provider), events.append])
    with caplog.at_level(logging.ERROR, logger="loopengine"), \
            pytest.raises(le.LedgerError, match="closed"):
        await engine.run(operation(), "go", tools=[close_ledger])

    assert "could not record its failure" in caplog.text
    ended = events[-1]
    assert isinstance(ended, RunEnded) and ended.outcome == "failed"
    (span,) = [s for s in exporter.get_finished_spans() if s.name.startswith("invoke_agent")]
    assert span.attributes is not None and span.attributes["error.type"] == "failed"
    assert span.status.status_code is StatusCode.ERROR
    with sqlite3.connect(tmp_path / "ledger.db") as conn:
        rows = conn.execute("SELECT outcome, attempt_count FROM invocations").fetchall()
        attempts = conn.execute("SELECT ordinal, outcome FROM attempts").fetchall()
    assert rows == [("running", 1)]
    assert attempts == [(1, "ok")]


class UnconfirmedLedger(MemoryLedger):
    """Keeps each attempt's row but never confirms its dispatch (a stalled writer)."""

    async def dispatch_attempt(self, record: AttemptDispatch) -> None:
        await super().dispatch_attempt(record)
        await anyio.Event().wait()


def test_r04_a_dispatch_not_confirmed_by_the_deadline_sends_nothing() -> None:
    """On trio's MockClock: a row the ledger does not confirm is awaited until the
    run's deadline plus the ledger's grace; nothing is sent, the attempt is settled
    ``aborted``/``deadline`` (with its AttemptStarted), and the run ends
    ``time_limit``."""
    import trio
    import trio.testing

    ledger = UnconfirmedLedger()
    events: list[Event] = []
    provider = ScriptedProvider([Reply.text("never sent")])
    engine = le.Engine(provider, ledger=ledger, prices=PRICES, observers=[events.append])
    seen: list[tuple[le.RunResult, float]] = []

    async def main() -> None:
        began = anyio.current_time()
        result = await engine.run(operation(total_time=2.0), "go")
        seen.append((result, anyio.current_time() - began))

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    ((result, took),) = seen
    assert result.outcome is le.Outcome.TIME_LIMIT and provider.requests == []
    assert took == pytest.approx(2.0)
    (row,) = ledger.attempts.values()
    assert (row["outcome"], row["aborted_reason"], row["http_status"]) == (
        "aborted", "deadline", None)
    started = [e.ordinal for e in events if isinstance(e, AttemptStarted)]
    settled = [e.ordinal for e in events if isinstance(e, AttemptSettled)]
    assert started == settled == [1]
