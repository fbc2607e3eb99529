"""A run that raises instead of reaching an outcome (its ledger fails, its replay
diverges) is recorded ``failed`` where the ledger still can, and its observers
always see it end."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path
from typing import Any

import anyio
import pydantic
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

import loopengine as le
from loopengine.events import (
    AttemptSettled,
    AttemptStarted,
    Event,
    RunEnded,
    RunStarted,
    ToolCallEvent,
)
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

OP = operation()


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


def _raising_tool(error: BaseException, sync: bool) -> le.Tool:
    if sync:
        def handler(key: str) -> str:
            raise error
    else:
        async def handler(key: str) -> str:
            raise error
    return le.Tool(name="boom", description="Raise.", handler=handler,
                   input_schema={"type": "object", "properties": {"key": {"type": "string"}},
                                 "required": ["key"]})


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
@pytest.mark.parametrize("kind", [KeyboardInterrupt, SystemExit])
def test_a_handlers_keyboard_interrupt_or_system_exit_ends_the_run(
        kind: type[BaseException], sync: bool, backend: str) -> None:
    """A handler raising KeyboardInterrupt or SystemExit: not the model's to read.
    It propagates from the run's own task as it was raised (not in an exception
    group, and without ending an asyncio event loop from a tool's task), after
    the call is announced failed, the run recorded (``cancelled`` for a
    KeyboardInterrupt, the caller's Ctrl-C on any loop; ``failed`` for a
    SystemExit) and `RunEnded` emitted; the event loop goes on."""
    ended = "cancelled" if kind is KeyboardInterrupt else "failed"
    ledger = MemoryLedger()
    seen: list[Event] = []
    provider = ScriptedProvider([Reply.tool_calls(("boom", {"key": "k"})), Reply.text("no")])
    engine = le.Engine(provider, ledger=ledger, observers=[seen.append])
    raised = kind("stop")

    async def main() -> le.RunResult:
        with pytest.raises(kind) as caught:
            await engine.run(OP, "go", tools=[_raising_tool(raised, sync)])
        assert caught.value is raised
        # Recorded before it reached here, and the loop still runs.
        assert ledger.invocations[seen[0].run_id]["outcome"] == ended
        again = le.Engine(ScriptedProvider([Reply.text("still here")]))
        return await again.run(OP, "go")

    assert anyio.run(main, backend=backend).answer == "still here"
    (invocation,) = ledger.invocations.values()
    assert invocation["outcome"] == ended and invocation["turns"] == 1
    calls = [(e.status, e.error) for e in seen if isinstance(e, ToolCallEvent)]
    assert calls == [("started", None), ("failed", f"handler raised {kind.__name__}")]
    assert isinstance(seen[-1], RunEnded) and seen[-1].outcome == ended
    assert len(provider.requests) == 1


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_r09_a_handlers_generator_exit_is_an_ordinary_raise(sync: bool, backend: str) -> None:
    """A GeneratorExit a handler raises closes nothing of the run's: the model
    gets an error result (R09) and the run goes on."""
    provider = ScriptedProvider([Reply.tool_calls(("boom", {"key": "k"})), Reply.text("ok")])
    engine = le.Engine(provider)

    async def main() -> le.RunResult:
        return await engine.run(OP, "go",
                                tools=[_raising_tool(GeneratorExit("not a generator"), sync)])

    result = anyio.run(main, backend=backend)
    assert result.outcome is le.Outcome.COMPLETED
    (tool_result,) = result.messages[2]["content"]
    assert tool_result["is_error"] is True and tool_result["content"] == "not a generator"


class _NoText:
    def __str__(self) -> str:
        raise RuntimeError("no text")


def _cycle() -> list[object]:
    looped: list[object] = []
    looped.append(looped)
    return looped


@pytest.mark.parametrize("value", [
    {(1, 2): "a tuple key"}, {object(): 1}, _cycle(), _NoText(), 10 ** 5000,
], ids=["tuple-key", "object-key", "cycle", "str-raises", "huge-int"])
async def test_r09_a_value_json_cannot_carry_is_a_failed_call(value: object) -> None:
    """A handler's return value that cannot become a tool result: the model gets
    an error result saying so, the call is ``failed`` (``invalid output``), and
    the run goes on instead of raising from its task group."""
    seen: list[Event] = []

    @le.tool
    async def odd(key: str) -> object:
        """Return something odd."""
        return value

    provider = ScriptedProvider([Reply.tool_calls(("odd", {"key": "k"})), Reply.text("ok")])
    engine = le.Engine(provider, observers=[seen.append])
    result = await engine.run(OP, "go", tools=[odd])
    assert result.outcome is le.Outcome.COMPLETED
    (tool_result,) = result.messages[2]["content"]
    assert tool_result["is_error"] is True
    assert tool_result["content"].startswith("odd returned a value that cannot be sent")
    ended = [e for e in seen if isinstance(e, ToolCallEvent) and e.status != "started"]
    assert [(e.status, e.error) for e in ended] == [("failed", "invalid output")]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_ledger_error_while_tools_run_is_raised_as_itself(backend: str) -> None:
    """The run store cannot record the calls' ends: the `LedgerError` reaches the
    caller as it was raised (with its attempt count), not in an exception group,
    and the run is recorded ``failed``."""

    class Breaking(le.RunStore):
        async def checkpoint(self, invocation_id: str, owner: str, **kwargs: Any) -> None:
            if any(call[3] == "succeeded" for call in kwargs.get("calls", ())):
                raise le.LedgerError("the disk filled up")
            await super().checkpoint(invocation_id, owner, **kwargs)

    @le.tool
    async def echo(key: str) -> str:
        """Echo."""
        return key

    ledger = MemoryLedger()
    provider = ScriptedProvider([Reply.tool_calls(("echo", {"key": "a"}), ("echo", {"key": "b"})),
                                 Reply.text("no")])
    engine = le.Engine(provider, ledger=ledger, run_store=Breaking(ledger))

    async def main() -> None:
        await engine.run(OP, "go", tools=[echo])

    with pytest.raises(le.LedgerError, match="disk filled") as caught:
        anyio.run(main, backend=backend)
    assert caught.value.attempts == 1
    (invocation,) = ledger.invocations.values()
    assert invocation["outcome"] == "failed"


@pytest.mark.parametrize("kind", ["run", "call"])
async def test_a_judges_system_exit_ends_the_run_failed(kind: str) -> None:
    """A judge (a run's ``accept``, a call's output validator) raising SystemExit,
    not an error of the answer (R10): the run or call is recorded ``failed``,
    `RunEnded` says so, and it propagates."""

    class Answer(pydantic.BaseModel):
        city: str

        @pydantic.field_validator("city")
        @classmethod
        def stop(cls, value: str) -> str:
            raise SystemExit(3)

    def judge(answer: object) -> bool:
        raise SystemExit(3)

    ledger = MemoryLedger()
    seen: list[Event] = []
    reply = (Reply.text("Oslo") if kind == "run"
             else Reply.tool_calls(("final_answer", {"city": "Oslo"})))
    engine = le.Engine(ScriptedProvider([reply]), ledger=ledger, prices=PRICES,
                       observers=[seen.append])
    with pytest.raises(SystemExit):
        if kind == "run":
            await engine.run(OP, "Where?", accept=judge)
        else:
            await engine.call(OP, "Where?", output=Answer)
    (invocation,) = ledger.invocations.values()
    assert invocation["outcome"] == "failed" and invocation["credits"] == 120
    assert isinstance(seen[-1], RunEnded) and seen[-1].outcome == "failed"


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_streamed_runs_system_exit_is_raised_from_the_iteration(backend: str) -> None:
    """`Engine.stream`: a handler's SystemExit ends the run ``failed`` and is raised
    from the caller's iteration (after the events before it), not from the
    stream's own task, which on asyncio would end the event loop."""
    ledger = MemoryLedger()
    provider = ScriptedProvider([Reply.tool_calls(("boom", {"key": "k"})), Reply.text("no")])
    engine = le.Engine(provider, ledger=ledger)
    received: list[Event] = []

    async def main() -> str:
        with pytest.raises(SystemExit):
            async with engine.stream(OP, "go",
                                     tools=[_raising_tool(SystemExit(2), False)]) as run:
                async for event in run:
                    received.append(event)
        again = le.Engine(ScriptedProvider([Reply.text("still here")]))
        return (await again.run(OP, "go")).answer

    assert anyio.run(main, backend=backend) == "still here"
    assert isinstance(received[-1], RunEnded) and received[-1].outcome == "failed"
    (invocation,) = ledger.invocations.values()
    assert invocation["outcome"] == "failed"


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("kind", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_from_on_text_settles_the_attempt_it_cut(
        kind: type[BaseException], backend: str, fake_anthropic_server: Any) -> None:
    """The ``on_text`` callback raises KeyboardInterrupt or SystemExit while the
    real SDK streams the reply: the attempt was sent, so it is settled
    ``aborted``/``external`` (never left ``dispatched``), the run is recorded
    (``cancelled``, ``failed``), and the exception propagates."""
    from loopengine.providers import AnthropicProvider

    fake_anthropic_server.add(Reply.text("a streamed answer in several words"))
    ledger = MemoryLedger()

    def stop(text: str) -> None:
        raise kind("stop")

    async def main() -> None:
        provider = AnthropicProvider(api_key="test-key", base_url=fake_anthropic_server.url,
                                     stream=True)
        engine = le.Engine(provider, ledger=ledger, prices=PRICES)
        with pytest.raises(kind):
            await engine.run(OP, "go", on_text=stop)
        await provider.aclose()

    anyio.run(main, backend=backend)
    (invocation,) = ledger.invocations.values()
    assert invocation["outcome"] == ("cancelled" if kind is KeyboardInterrupt else "failed")
    assert invocation["attempt_count"] == 1 and invocation["turns"] == 1
    (attempt,) = ledger.attempts.values()
    assert (attempt["outcome"], attempt["aborted_reason"]) == ("aborted", "external")


async def test_r09_a_future_cancelled_elsewhere_is_the_handlers_failure() -> None:
    """asyncio: a handler awaiting a future something else cancelled raises
    CancelledError though nothing cancelled the run. That is the handler's
    failure (R09), not the deadline's nor the caller's: the model gets an error
    result, the event says so, and the run goes on."""
    import asyncio

    seen: list[Event] = []

    @le.tool
    async def shared(key: str) -> str:
        """Await a shared future."""
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        future.cancel()
        return await future

    engine = le.Engine(ScriptedProvider([Reply.tool_calls(("shared", {"key": "k"})),
                                         Reply.text("ok")]), observers=[seen.append])
    result = await engine.run(OP, "go", tools=[shared])
    assert result.outcome is le.Outcome.COMPLETED and result.answer == "ok"
    (tool_result,) = result.messages[2]["content"]
    assert tool_result == {"type": "tool_result", "tool_use_id": tool_result["tool_use_id"],
                           "content": "CancelledError", "is_error": True}
    ended = [(e.status, e.error) for e in seen
             if isinstance(e, ToolCallEvent) and e.status != "started"]
    assert ended == [("failed", "handler raised CancelledError")]


@pytest.mark.parametrize("where", ["judge", "observer", "hook"])
async def test_a_cancelled_error_of_the_callers_code_is_its_failure(where: str) -> None:
    """asyncio: a judge, an observer or the tool_error_text hook awaiting a future
    something else cancelled raises CancelledError though nothing cancelled
    the run: the judge's answer counts as rejected (R10), the observer's raise
    is logged, the hook's gives the model the error's type; the run is never
    recorded ``cancelled`` nor raises a cancellation nobody asked for."""
    import asyncio

    async def cancelled_elsewhere() -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        future.cancel()
        await future

    async def judge(answer: str) -> bool:
        if where == "judge" and answer == "first":
            await cancelled_elsewhere()
        return True

    async def observer(event: Event) -> None:
        if where == "observer" and isinstance(event, RunStarted):
            await cancelled_elsewhere()

    async def hook(name: str, error: BaseException) -> str:
        if where == "hook":
            await cancelled_elsewhere()
        return "hidden"

    ledger = MemoryLedger()
    script = [Reply.tool_calls(("boom", {"key": "k"})), Reply.text("first"), Reply.text("second")]
    engine = le.Engine(ScriptedProvider(script), ledger=ledger, observers=[observer],
                       tool_error_text=hook)
    result = await engine.run(OP, "go", tools=[_raising_tool(ValueError("no"), False)],
                              accept=judge)
    assert result.outcome is le.Outcome.COMPLETED
    assert result.answer == ("second" if where == "judge" else "first")
    (tool_result,) = result.messages[2]["content"]
    assert tool_result["content"] == ("boom failed (ValueError)." if where == "hook"
                                      else "hidden")
    (invocation,) = ledger.invocations.values()
    assert invocation["outcome"] == "completed"
