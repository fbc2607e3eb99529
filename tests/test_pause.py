"""Pause and resume, the loop's logic on the scripted provider (docs/pause-and-resume.md).

The same rules through both shipped providers' wires: tests/pause_scenarios.py.
"""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest

import loopengine as le
from loopengine import events
from loopengine._runstate import Progress
from loopengine.persistence import InvocationEnd, MemoryLedger
from loopengine.providers import Reply
from loopengine.testing import FakeClock

from .conftest import EngineFactory, operation
from .pause_scenarios import Sender, send, tool_result_blocks
from .rule_scenarios import Counter, lookup


async def paused_run(make_engine: EngineFactory, *script: Any, tools: Any = None,
                     **kwargs: Any) -> tuple[le.Engine, Any, MemoryLedger, le.RunResult, Sender]:
    sender = Sender()
    engine, provider, ledger = make_engine(*script, **kwargs)
    result = await engine.run(operation(), "go", tools=tools or [sender.tool])
    return engine, provider, ledger, result, sender


async def test_a_call_that_needs_approval_pauses_its_whole_batch(
        make_engine: EngineFactory) -> None:
    """No handler of the batch runs, the one without approval neither; only the
    call that needs approval is pending; the ledger says paused."""
    sender, counter = Sender(), Counter()
    engine, provider, ledger = make_engine(Reply.tool_calls(lookup("a"), send("bob")))
    result = await engine.run(operation(), "go", tools=[sender.tool, counter.tool])
    assert result.outcome is le.Outcome.PAUSED
    assert sender.sent == [] and counter.calls == []
    assert [c.tool for c in result.pending] == ["send"]
    assert result.state is not None and result.state.batch == tuple(
        b["id"] for b in result.messages[-1]["content"] if b["type"] == "tool_use")
    assert ledger.invocations[result.invocation_id]["outcome"] == "paused"
    assert result.tool_calls == 0 and result.turns == 1


async def test_an_approval_callable_decides_per_call(make_engine: EngineFactory) -> None:
    """``approval=callable`` asks only for the calls it says; others run at once."""
    sent: list[str] = []

    @le.tool(approval=lambda call: call.input["to"] != "me")
    def mail(to: str) -> str:
        """Mail someone."""
        sent.append(to)
        return "ok"

    engine, _, _ = make_engine(Reply.tool_calls(("mail", {"to": "me"})),
                               Reply.tool_calls(("mail", {"to": "boss"})), Reply.text("done"))
    result = await engine.run(operation(), "go", tools=[mail])
    assert result.outcome is le.Outcome.PAUSED and sent == ["me"]
    assert [c.input for c in result.pending] == [{"to": "boss"}]


@pytest.mark.parametrize("answer", [None, "no", 0, RuntimeError("down")],
                         ids=["none", "text", "int", "raises"])
async def test_an_approval_callable_that_does_not_answer_a_bool_asks(
        make_engine: EngineFactory, answer: object, caplog: pytest.LogCaptureFixture) -> None:
    """A check that raises, or answers None (a missing ``return``), text or a
    number, counts as asking: the call waits for approval, never runs unasked."""
    sent: list[str] = []

    def check(call: le.PendingCall) -> Any:
        if isinstance(answer, Exception):
            raise answer
        return answer

    @le.tool(approval=check)
    def mail(to: str) -> str:
        """Mail someone."""
        sent.append(to)
        return "ok"

    engine, _, _ = make_engine(Reply.tool_calls(("mail", {"to": "me"})))
    result = await engine.run(operation(), "go", tools=[mail])
    assert result.outcome is le.Outcome.PAUSED and sent == []
    assert [c.tool for c in result.pending] == ["mail"]
    assert "waits for approval" in caplog.text


async def test_r02_refuses_a_batch_before_it_could_pause(make_engine: EngineFactory) -> None:
    """An oversized batch ends tool_batch_limit as before: checkpoint 3 comes first."""
    sender = Sender()
    engine, _, _ = make_engine(Reply.tool_calls(send("a"), send("b"), send("c")))
    result = await engine.run(operation(max_tool_batch=2), "go", tools=[sender.tool])
    assert result.outcome is le.Outcome.TOOL_BATCH_LIMIT
    assert result.pending == () and result.state is None and sender.sent == []


async def test_resume_runs_approved_denies_and_supplies_each_using_tool_budget(
        make_engine: EngineFactory) -> None:
    """Approve runs the handler, Deny gives is_error with the reason, Supply gives
    the text; three units of tool budget; the loop goes on."""
    engine, provider, _, paused, sender = await paused_run(
        make_engine, Reply.tool_calls(send("a"), send("b"), send("c")), Reply.text("done"))
    a, b, c = (call.id for call in paused.pending)
    assert paused.state is not None
    result = await engine.resume(paused.state, decisions={
        a: le.Approve(), b: le.Deny("not b"), c: le.Supply("pretend c")}, tools=[sender.tool])
    assert result.outcome is le.Outcome.COMPLETED and result.tool_calls == 3
    assert sender.sent == ["a"]
    results = {r["tool_use_id"]: r for r in tool_result_blocks(result.messages)}
    assert results[a]["content"] == "sent to a" and "is_error" not in results[a]
    assert results[b]["is_error"] is True and "not b" in results[b]["content"]
    assert results[c]["content"] == "pretend c" and "is_error" not in results[c]
    # The resumed request carries the three results, in the calls' order.
    assert [r["tool_use_id"] for r in provider.requests[-1].messages[-1]["content"]] == [a, b, c]


async def test_a_call_of_a_tool_added_at_resume_is_not_run_unasked(
        make_engine: EngineFactory) -> None:
    """The paused batch holds a call of ``wipe``, a tool the run did not have (the
    model made the name up): nobody was asked about it. A resume given a
    ``wipe`` that needs approval answers it as the unknown tool's call it was,
    never running the new handler unapproved; the approved call runs."""
    wiped: list[str] = []

    @le.tool(approval=True)
    def wipe(what: str) -> str:
        """Wipe something."""
        wiped.append(what)
        return "wiped"

    engine, provider, _, paused, sender = await paused_run(
        make_engine, Reply.tool_calls(send("a"), ("wipe", {"what": "db"})), Reply.text("done"))
    (pending,) = paused.pending
    assert paused.state is not None and pending.tool == "send"
    result = await engine.resume(paused.state, decisions={pending.id: le.Approve()},
                                 tools=[sender.tool, wipe])
    assert result.outcome is le.Outcome.COMPLETED and result.tool_calls == 2
    assert sender.sent == ["a"] and wiped == []
    sent, unknown = provider.requests[-1].messages[-1]["content"]
    assert sent["content"] == "sent to a"
    assert unknown["is_error"] and "no tool named 'wipe'" in unknown["content"]


async def test_a_call_whose_tool_asks_for_approval_at_resume_is_asked_about(
        make_engine: EngineFactory) -> None:
    """``lookup`` needed no approval when the run paused on ``send``; the resume
    gives a ``lookup`` that asks for it (its approval callable says so now).
    The call is never run unasked: the resume pauses again, listing ``send``
    and ``lookup``, with nothing run; a resume deciding both runs both."""
    counter = Counter()
    asking = le.tool(counter.tool.handler, name="lookup", description="Look a key up.",
                     approval=lambda call: call.input["key"] == "k")
    sender = Sender()
    engine, _, _ = make_engine(Reply.tool_calls(send("a"), lookup("k")), Reply.text("done"))
    paused = await engine.run(operation(), "go", tools=[sender.tool, counter.tool])
    (call,) = paused.pending
    assert paused.state is not None
    again = await engine.resume(paused.state, decisions={call.id: le.Approve()},
                                tools=[sender.tool, asking])
    assert again.outcome is le.Outcome.PAUSED and again.state is not None
    assert [c.tool for c in again.pending] == ["send", "lookup"]
    assert sender.sent == [] and counter.calls == []
    done = await engine.resume(again.state, tools=[sender.tool, asking],
                               decisions={c.id: le.Approve() for c in again.pending})
    assert done.outcome is le.Outcome.COMPLETED and done.tool_calls == 2
    assert sender.sent == ["a"] and counter.calls == ["k"]


@pytest.mark.parametrize("decisions", [{}, {"toolu_nope": le.Approve()}, "extra"])
async def test_a_missing_or_unknown_decision_is_a_config_error_before_anything_is_sent(
        make_engine: EngineFactory, decisions: Any) -> None:
    """Every pending call needs a decision, and a decision must name a pending call."""
    engine, provider, ledger, paused, sender = await paused_run(
        make_engine, Reply.tool_calls(send("a")), Reply.text("done"))
    assert paused.state is not None
    if decisions == "extra":
        decisions = {paused.pending[0].id: le.Approve(), "toolu_other": le.Deny()}
    with pytest.raises(le.ConfigError):
        await engine.resume(paused.state, decisions=decisions, tools=[sender.tool])
    assert len(provider.requests) == 1 and sender.sent == []
    assert ledger.invocations[paused.invocation_id]["outcome"] == "paused"


async def test_a_resume_is_the_same_invocation_with_dense_ordinals(
        make_engine: EngineFactory) -> None:
    """Same id; attempt ordinals continue; turns, tool calls, credits and cost go on."""
    engine, _, ledger, paused, sender = await paused_run(
        make_engine, Reply.tool_calls(send("a")), Reply.tool_calls(send("b")),
        Reply.text("done"))
    assert paused.state is not None
    second = await engine.resume(paused.state, decisions={paused.pending[0].id: le.Approve()},
                                 tools=[sender.tool])
    assert second.outcome is le.Outcome.PAUSED and second.invocation_id == paused.invocation_id
    assert second.state is not None
    third = await engine.resume(second.state.dumps(),
                                decisions={second.pending[0].id: le.Approve()},
                                tools=[sender.tool])
    assert third.outcome is le.Outcome.COMPLETED
    assert (third.turns, third.tool_calls, third.credits, third.attempts.count) == (3, 2, 360, 3)
    assert third.cost_usd == paused.cost_usd * 3
    assert sorted(o for (_, o) in ledger.attempts) == [1, 2, 3]
    assert ledger.invocations[paused.invocation_id]["outcome"] == "completed"
    assert [r.dispatch.ordinal for r in third.attempt_log] == [3]


async def test_without_a_ledger_a_resume_trusts_the_state(make_engine: EngineFactory) -> None:
    """No ledger to read back: the state's counts are the budgets (documented)."""
    sender = Sender()
    engine, provider, _ = make_engine(
        Reply.tool_calls(lookup("a")), Reply.tool_calls(send("b")),
        *[Reply.tool_calls(lookup("c")) for _ in range(5)], ledger=None)
    counter = Counter()
    paused = await engine.run(operation(max_turns=3), "go", tools=[sender.tool, counter.tool])
    assert paused.state is not None and paused.turns == 2
    edited = json.loads(paused.state.dumps())
    edited["progress"]["turns"] = 0
    result = await engine.resume(le.RunState.loads(json.dumps(edited)),
                                 decisions={paused.pending[0].id: le.Approve()},
                                 tools=[sender.tool, counter.tool])
    assert result.outcome is le.Outcome.TURN_LIMIT and result.turns == 3
    assert len(provider.requests) == 5  # the edit bought two turns: nothing to check it against


async def test_total_time_counts_running_time_only(make_engine: EngineFactory,
                                                    clock: FakeClock) -> None:
    """A pause longer than total_time does not use it up: the resumed run has the
    time it had left."""
    sender = Sender()
    engine, _, _ = make_engine(Reply.tool_calls(send("a"), delay=4.0), Reply.text("done"))
    paused = await engine.run(operation(total_time=10.0), "go", tools=[sender.tool])
    assert paused.state is not None and paused.state.progress.running_seconds == 4.0
    clock.advance(3600)
    result = await engine.resume(paused.state, decisions={paused.pending[0].id: le.Approve()},
                                 tools=[sender.tool])
    assert result.outcome is le.Outcome.COMPLETED


async def test_a_pause_within_pause_timeout_resumes(make_engine: EngineFactory,
                                                    clock: FakeClock) -> None:
    """Exactly pause_timeout seconds paused still resumes."""
    sender = Sender()
    engine, provider, _ = make_engine(Reply.tool_calls(send("a")), Reply.text("done"))
    paused = await engine.run(operation(pause_timeout=60), "go", tools=[sender.tool])
    clock.advance(60)
    assert paused.state is not None
    result = await engine.resume(paused.state, decisions={paused.pending[0].id: le.Approve()},
                                 tools=[sender.tool])
    assert result.outcome is le.Outcome.COMPLETED


async def test_run_paused_and_run_resumed_are_emitted_once_each(
        make_engine: EngineFactory) -> None:
    """RunStarted, RunPaused (no RunEnded), then RunResumed and RunEnded."""
    seen: list[events.Event] = []
    engine, _, _, paused, sender = await paused_run(
        make_engine, Reply.tool_calls(send("a")), Reply.text("done"), observers=[seen.append])
    assert paused.state is not None
    await engine.resume(paused.state, decisions={paused.pending[0].id: le.Approve()},
                        tools=[sender.tool])
    lifecycle = [e for e in seen if isinstance(
        e, events.RunStarted | events.RunPaused | events.RunResumed | events.RunEnded)]
    assert [type(e).__name__ for e in lifecycle] == [
        "RunStarted", "RunPaused", "RunResumed", "RunEnded"]
    assert all(e.run_id == paused.invocation_id for e in lifecycle)
    pause, resume, end = lifecycle[1:]
    assert isinstance(pause, events.RunPaused) and pause.pending == 1 and pause.turns == 1
    assert isinstance(resume, events.RunResumed) and resume.turns == 1 and resume.attempts == 1
    assert isinstance(end, events.RunEnded) and end.attempts == 2


async def test_a_state_that_is_not_ours_is_a_config_error() -> None:
    """Garbage, another format, a newer version or a damaged field never loads."""
    for data in (b"\x00\xff", b"[]", b'{"format": "x"}',
                 b'{"format": "loopengine.run_state", "version": 99}',
                 b'{"format": "loopengine.run_state", "version": 1}'):
        with pytest.raises(le.ConfigError):
            le.RunState.loads(data)


@pytest.mark.parametrize(("path", "value"), [
    (("progress", "turns"), None), (("progress", "credits"), "x"),
    (("progress", "tool_calls"), -1), (("progress", "cost_nanousd"), 1.5),
    (("progress", "running_seconds"), "x"), (("progress", "descendant_credits"), None),
    (("messages", 0), None), (("messages", 1), {}), (("messages", 1, "role"), "system"),
    (("messages", 1, "content"), "text, not the reply's calls"),
    (("messages", 1, "content", 0), "x"), (("results",), [1]), (("system",), ["x"]),
], ids=lambda value: repr(value))
async def test_a_state_damaged_in_its_counts_or_transcript_never_loads(
        make_engine: EngineFactory, path: tuple[Any, ...], value: Any) -> None:
    """A count that is not a non-negative integer (or seconds), or a transcript
    that is not messages of blocks ending with the reply whose calls wait, is a
    ConfigError at loads, never a TypeError deep in a resume that trusts it."""
    _, _, _, paused, _ = await paused_run(make_engine, Reply.tool_calls(send("a")))
    assert paused.state is not None
    damaged = json.loads(paused.state.dumps())
    at = damaged
    for key in path[:-1]:
        at = at[key]
    at[path[-1]] = value
    with pytest.raises(le.ConfigError, match="state"):
        le.RunState.loads(json.dumps(damaged))


async def test_a_state_round_trips_through_dumps_and_loads(make_engine: EngineFactory) -> None:
    """loads(dumps(state)) is the same state."""
    _, _, _, paused, _ = await paused_run(make_engine, Reply.tool_calls(send("a")))
    assert paused.state is not None
    data = paused.state.dumps()
    assert le.RunState.loads(data) == paused.state


async def test_resuming_a_run_that_is_not_paused_is_a_config_error(
        make_engine: EngineFactory) -> None:
    """A state resumed twice: the second resume finds the invocation ended."""
    engine, provider, _, paused, sender = await paused_run(
        make_engine, Reply.tool_calls(send("a")), Reply.text("done"), Reply.text("again"))
    assert paused.state is not None
    decisions = {paused.pending[0].id: le.Approve()}
    await engine.resume(paused.state, decisions=decisions, tools=[sender.tool])
    with pytest.raises(le.ConfigError, match="not paused"):
        await engine.resume(paused.state, decisions=decisions, tools=[sender.tool])
    assert sender.sent == ["a"] and len(provider.requests) == 2


def test_resume_sync_resumes_from_plain_code(make_engine: EngineFactory) -> None:
    """`Engine.resume_sync` is resume for code without an event loop."""
    sender = Sender()
    engine, _, _ = make_engine(Reply.tool_calls(send("a")), Reply.text("done"))
    paused = engine.run_sync(operation(), "go", tools=[sender.tool])
    assert paused.state is not None
    result = engine.resume_sync(paused.state, decisions={paused.pending[0].id: le.Approve()},
                                tools=[sender.tool])
    assert result.outcome is le.Outcome.COMPLETED and sender.sent == ["a"]


async def test_a_paused_run_gives_one_span_per_running_segment_linked(
        make_engine: EngineFactory) -> None:
    """The OpenTelemetry observer ends the run span at the pause (not an error) and
    starts the resumed segment's span, linked to the first."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import StatusCode

    from loopengine.otel import OpenTelemetryObserver

    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    engine, _, _, paused, sender = await paused_run(
        make_engine, Reply.tool_calls(send("a")), Reply.text("done"),
        observers=[OpenTelemetryObserver(tracer_provider)])
    assert paused.state is not None
    await engine.resume(paused.state, decisions={paused.pending[0].id: le.Approve()},
                        tools=[sender.tool])
    runs = [s for s in exporter.get_finished_spans() if s.name.startswith("invoke_agent")]
    assert len(runs) == 2
    first, second = runs
    assert first.attributes is not None and second.attributes is not None
    assert first.attributes["loopengine.outcome"] == "paused"
    assert first.status.status_code is not StatusCode.ERROR
    assert second.attributes["loopengine.run.resumed"] is True
    assert second.attributes["loopengine.outcome"] == "completed"
    assert first.attributes["loopengine.run.id"] == second.attributes["loopengine.run.id"]
    assert [link.context.span_id for link in second.links] == [first.context.span_id]


async def test_a_published_operation_caps_the_limits_of_a_resumed_run(
        make_engine: EngineFactory) -> None:
    """``resume(operation=...)``: the published limits are the ceiling, whatever
    limits the state carries; another operation is refused; a state whose
    limits were edited is refused before anything is sent."""
    counter = Counter()
    sender = Sender()
    engine, provider, _ = make_engine(Reply.tool_calls(send("a")),
                                      *[Reply.tool_calls(lookup("c")) for _ in range(6)])
    paused = await engine.run(operation(max_turns=50), "go", tools=[sender.tool, counter.tool])
    assert paused.state is not None
    decisions = {paused.pending[0].id: le.Approve()}
    edited = json.loads(paused.state.dumps())
    edited["operation"]["limits"]["max_turns"] = 500
    edited["limits"]["max_turns"] = 500
    with pytest.raises(le.ConfigError, match="latest pause"):
        await engine.resume(le.RunState.loads(json.dumps(edited)), decisions=decisions,
                            tools=[sender.tool, counter.tool])
    with pytest.raises(le.ConfigError, match="operation"):
        await engine.resume(paused.state, decisions=decisions, operation=le.Operation(
            name="another", provider="anthropic", model="claude-sonnet-4-5"),
            tools=[sender.tool, counter.tool])
    # The same name on another version, route or model: the ledger row names the run's.
    for other in ({"version": "2"}, {"model": "claude-haiku-4-5"},
                  {"provider": "openai", "model": "gpt-4o-mini"}):
        with pytest.raises(le.ConfigError, match="must be the run's operation, 'test.op'"):
            await engine.resume(paused.state, decisions=decisions,
                                operation=replace(operation(max_turns=3), **other),
                                tools=[sender.tool, counter.tool])
    assert len(provider.requests) == 1 and sender.sent == []
    result = await engine.resume(paused.state, decisions=decisions,
                                 operation=operation(max_turns=3),
                                 tools=[sender.tool, counter.tool])
    assert result.outcome is le.Outcome.TURN_LIMIT and result.turns == 3
    assert len(provider.requests) == 3


@pytest.mark.parametrize(("narrowed", "outcome"), [
    ({"max_tool_calls": 2}, le.Outcome.TOOL_LIMIT),
    ({"max_tool_batch": 2}, le.Outcome.TOOL_BATCH_LIMIT),
    ({"credit_hold": 100}, le.Outcome.CREDIT_LIMIT)])
async def test_r02_a_paused_batch_is_checked_again_under_the_resumed_limits(
        make_engine: EngineFactory, narrowed: dict[str, int], outcome: le.Outcome) -> None:
    """Three approved calls, resumed with a published operation whose limits
    allow only two (or hold fewer credits than the paused turn spent, R03):
    the batch is refused as any batch is, none of its calls runs (it ran all
    three, past the published ceiling), and each gets a "Not run" result."""
    engine, provider, _, paused, sender = await paused_run(
        make_engine, Reply.tool_calls(send("a"), send("b"), send("c")), Reply.text("done"))
    assert paused.state is not None
    result = await engine.resume(paused.state, tools=[sender.tool],
                                 decisions={call.id: le.Approve() for call in paused.pending},
                                 operation=operation(**narrowed))
    assert result.outcome is outcome and result.tool_calls == 0
    assert sender.sent == [] and len(provider.requests) == 1
    closed = result.messages[-1]["content"]
    assert [r["tool_use_id"] for r in closed] == [call.id for call in paused.pending]
    assert all(r["is_error"] and r["content"].startswith("Not run") for r in closed)


async def test_a_state_keeps_the_usage_iterations_of_its_progress(
        make_engine: EngineFactory) -> None:
    """A paused run's usage keeps its per-iteration tokens (compaction, advisor)
    through `dumps` and `loads`, so a resumed run's totals carry them on."""
    from dataclasses import replace

    _, _, _, paused, _ = await paused_run(make_engine, Reply.tool_calls(send("a")))
    assert paused.state is not None
    usage = le.Usage.from_iterations((
        le.UsageIteration(type="compaction", input_tokens=55_196, output_tokens=125),
        le.UsageIteration(type="message", input_tokens=220, output_tokens=8),
    ))
    state = replace(paused.state, progress=replace(paused.state.progress, usage=usage))
    again = le.RunState.loads(state.dumps())
    assert again.progress.usage == usage
    assert again.progress.usage.iterations[0].type == "compaction"


@pytest.mark.parametrize("build", [lambda: le.Deny(None), lambda: le.Deny(""),
                                   lambda: le.Supply(5), lambda: le.Supply("\ud800")])
def test_a_bad_decision_is_a_config_error(build: Any) -> None:
    """A decision that could not be sent to the model is refused when it is made."""
    with pytest.raises(le.ConfigError):
        build()


def test_a_state_whose_pause_time_has_no_utc_offset_is_a_config_error() -> None:
    """A hand-made state with a naive ``paused_at`` is refused when it loads,
    not by a TypeError at its resume."""
    state = json.loads(le.RunState(
        invocation_id="inv", operation=operation(), limits=le.Limits(), retry=le.RetryPolicy(),
        attribution=le.Attribution(), system=None, messages=[{"role": "user", "content": "go"}],
        given=1, final_tool="final_answer", structured=False, output_digest=None, tools=(),
        features=None, pending=(), batch=(), results=[], repair=False, answered_calls={},
        progress=Progress(turns=0, tool_calls=0, credits=0, attempts=0, cost_nanousd=0,
                          provider_cost_nanousd=0, usage=le.Usage(), running_seconds=0.0),
        paused_at=datetime(2026, 1, 1, tzinfo=UTC)).dumps())
    state["paused_at"] = "2026-01-01T00:00:00"
    with pytest.raises(le.ConfigError, match="UTC offset"):
        le.RunState.loads(json.dumps(state))


async def test_calls_run_on_resume_carry_the_accounting_of_the_turn_that_asked(
        make_engine: EngineFactory) -> None:
    """The approved call's events, in the resumed segment, carry the asking
    turn's usage and charge (sent before the pause), read back from the
    encoded state as from the ledger's row of that turn."""
    asked = le.Usage(input_tokens=100, output_tokens=20, cache_read_tokens=30)
    seen: list[events.Event] = []
    engine, _, ledger, result, sender = await paused_run(
        make_engine, Reply.tool_calls(send("bob"), usage=asked), Reply.text("sent"),
        observers=[seen.append])
    assert result.state is not None
    state = le.RunState.loads(result.state.dumps())
    done = await engine.resume(state, decisions={result.pending[0].id: le.Approve()},
                               tools=[sender.tool])
    assert done.outcome is le.Outcome.COMPLETED and sender.sent == ["bob"]
    (row,) = [a for (run, _), a in ledger.attempts.items()
              if run == result.invocation_id and a["turn"] == 1]
    calls = [e for e in seen if isinstance(e, events.ToolCallEvent)]
    assert [c.status for c in calls] == ["started", "succeeded"]
    for call in calls:
        assert call.turn == 1
        assert (call.input_tokens, call.output_tokens) == (130, 20)
        assert call.token_cost == 150
        assert call.spend_usd == result.cost_usd > 0
        assert call.spend_usd * 10**9 == row["cost_nanousd"]


class PauseRefusingLedger(MemoryLedger):
    """A memory ledger that cannot write a run's pause (its ends it writes)."""

    async def end_invocation(self, record: InvocationEnd) -> None:
        if record.outcome == "paused":
            raise le.LedgerError("cannot write the pause")
        await super().end_invocation(record)


async def test_a_pause_the_ledger_refuses_ends_the_run_failed_and_announces_it(
        make_engine: EngineFactory) -> None:
    """The run did not pause: the LedgerError reaches the caller, the ledger
    records the run ``failed`` (it still can), and observers get `RunEnded`
    (``failed``) last, no `RunPaused`, so that no observer holds the run open."""
    seen: list[events.Event] = []
    ledger = PauseRefusingLedger()
    sender = Sender()
    engine, _, _ = make_engine(Reply.tool_calls(send("bob")), ledger=ledger,
                               observers=[seen.append])
    with pytest.raises(le.LedgerError, match="cannot write the pause"):
        await engine.run(operation(), "go", tools=[sender.tool])
    assert sender.sent == []
    (row,) = ledger.invocations.values()
    assert row["outcome"] == "failed"
    assert not any(isinstance(e, events.RunPaused) for e in seen)
    ended = seen[-1]
    assert isinstance(ended, events.RunEnded)
    assert (ended.outcome, ended.turns, ended.attempts) == ("failed", 1, 1)
    assert sum(isinstance(e, events.RunEnded) for e in seen) == 1
