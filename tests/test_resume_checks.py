"""What a resume checks before anything is sent: the run's tools and its output
model are passed again (docs/pause-and-resume.md); and what a resumed segment that
fails records: never fewer turns than the run had."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pydantic
import pytest

import loopengine as le
from loopengine import events
from loopengine.persistence import AttemptDispatch, MemoryLedger
from loopengine.providers import Reply
from loopengine.testing import FakeClock

from .conftest import EngineFactory, operation
from .pause_scenarios import Sender, send, tool_result_blocks
from .rule_scenarios import Counter, lookup
from .test_pause import paused_run
from .test_recovery import crashed_in_charge, engine_on


def renamed_sender() -> Any:
    @le.tool(name="send_v2", approval=True)
    def send_v2(to: str) -> str:
        """Send the message to someone."""
        return f"sent to {to}"

    return send_v2


def older(state: le.RunState, engine: le.Engine, *keys: str) -> le.RunState:
    """``state`` as encoded before ``keys`` were kept, its pause recorded as it
    was then: with no seal (which `engine`'s memory ledger then forgets)."""
    ledger = engine.ledger
    assert isinstance(ledger, MemoryLedger)
    ledger.invocations[state.invocation_id]["pause_seal"] = None
    data = json.loads(state.dumps())
    for key in keys:
        del data[key]
    return le.RunState.loads(json.dumps(data))


@pytest.mark.parametrize("passed", ["none", "renamed", "one_of_two"])
async def test_a_resume_without_one_of_the_runs_tools_is_a_config_error_before_anything_is_sent(
        make_engine: EngineFactory, passed: str) -> None:
    """No tools, the approved call's tool renamed, or a tool of the run that needs
    no approval left out: refused, naming the missing tool; nothing sent, nothing
    run, the run still paused; resumed with its tools, it completes."""
    sender, counter = Sender(), Counter()
    engine, provider, ledger = make_engine(Reply.tool_calls(send("a")), Reply.text("done"))
    paused = await engine.run(operation(), "go", tools=[sender.tool, counter.tool])
    assert paused.state is not None
    assert paused.state.tools == ("send", "lookup")
    tools, missing = {"none": ([], "'lookup', 'send'"),
                      "renamed": ([renamed_sender(), counter.tool], "'send'"),
                      "one_of_two": ([sender.tool], "'lookup'")}[passed]
    decisions = {paused.pending[0].id: le.Approve()}
    with pytest.raises(le.ConfigError) as refused:
        await engine.resume(paused.state.dumps(), decisions=decisions, tools=tools)
    assert refused.value.field == "tools" and missing in refused.value.message
    assert len(provider.requests) == 1 and sender.sent == []
    assert ledger.invocations[paused.invocation_id]["outcome"] == "paused"
    done = await engine.resume(paused.state, decisions=decisions,
                               tools=[counter.tool, sender.tool])
    assert done.outcome is le.Outcome.COMPLETED and sender.sent == ["a"]
    assert [r["content"] for r in tool_result_blocks(done.messages)] == ["sent to a"]


async def test_a_state_from_before_tools_were_kept_still_needs_each_approved_calls_tool(
        make_engine: EngineFactory) -> None:
    """Without the run's tool names (unknown), an approved call's tool must be
    passed; a denied call needs none."""
    engine, provider, _, paused, sender = await paused_run(
        make_engine, Reply.tool_calls(send("a")), Reply.text("done"))
    assert paused.state is not None
    state = older(paused.state, engine, "tools")
    assert state.tools is None
    call = paused.pending[0].id
    with pytest.raises(le.ConfigError, match="'send'") as refused:
        await engine.resume(state, decisions={call: le.Approve()}, tools=[renamed_sender()])
    assert refused.value.field == "tools" and len(provider.requests) == 1
    denied = await engine.resume(state, decisions={call: le.Deny("no")}, tools=[])
    assert denied.outcome is le.Outcome.COMPLETED and sender.sent == []


def test_resume_sync_refuses_a_missing_tool(make_engine: EngineFactory) -> None:
    """`Engine.resume_sync` checks the same."""
    sender = Sender()
    engine, provider, _ = make_engine(Reply.tool_calls(send("a")), Reply.text("done"))
    paused = engine.run_sync(operation(), "go", tools=[sender.tool])
    assert paused.state is not None
    with pytest.raises(le.ConfigError, match="'send'"):
        engine.resume_sync(paused.state, decisions={paused.pending[0].id: le.Approve()})
    assert len(provider.requests) == 1 and sender.sent == []


async def test_a_resume_by_id_without_the_runs_tools_is_refused_before_the_run_is_taken(
        clock: FakeClock) -> None:
    """By invocation id, paused or recovered after its process died: a missing
    tool is a ConfigError before the run store's row is claimed or anything sent."""
    ledger = MemoryLedger()
    sender = Sender()
    engine, provider, store = engine_on(ledger, clock, Reply.tool_calls(send("a")),
                                        Reply.text("done"))
    paused = await engine.run(operation(), "go", tools=[sender.tool])
    before = await store.load(paused.invocation_id)
    with pytest.raises(le.ConfigError, match="'send'"):
        await engine.resume(paused.invocation_id, decisions={
            paused.pending[0].id: le.Approve()})
    after = await store.load(paused.invocation_id)
    assert before is not None and after is not None and after.version == before.version
    assert len(provider.requests) == 1 and sender.sent == []

    engine, provider, store, charger, run_id = await crashed_in_charge(MemoryLedger(), clock)
    before = await store.load(run_id)
    with pytest.raises(le.ConfigError, match="'charge'"):
        await engine.resume(run_id, tools=charger.tools[1:], force=True)
    after = await store.load(run_id)
    assert before is not None and after is not None
    assert (after.version, after.lease_owner) == (before.version, before.lease_owner)
    assert len(provider.requests) == 1
    recovered = await engine.resume(run_id, tools=charger.tools, force=True)
    assert [(p.tool, p.reason) for p in recovered.pending] == [("charge", "in_doubt")]


class Answer(pydantic.BaseModel):
    """The run's output model."""

    city: str


class Weather(pydantic.BaseModel):
    """Another output model."""

    temperature: float
    unit: str


async def structured_pause(make_engine: EngineFactory) -> tuple[
        le.Engine, Any, le.RunResult, Sender]:
    sender = Sender()
    engine, provider, _ = make_engine(Reply.tool_calls(send("a")),
                                      Reply.tool_calls(("final_answer", {"city": "Oslo"})))
    paused = await engine.run(operation(), "go", tools=[sender.tool], output=Answer)
    assert paused.outcome is le.Outcome.PAUSED and paused.state is not None
    return engine, provider, paused, sender


async def test_another_output_model_is_a_config_error_before_anything_is_sent(
        make_engine: EngineFactory) -> None:
    """A model whose schema is not the run's is refused; the same model, even a
    class defined apart with the same schema (its name aside), resumes to its
    answer."""
    engine, provider, paused, sender = await structured_pause(make_engine)
    assert paused.state is not None
    decisions = {paused.pending[0].id: le.Approve()}
    with pytest.raises(le.ConfigError, match="Weather") as refused:
        await engine.resume(paused.state, decisions=decisions, tools=[sender.tool],
                            output=Weather)
    assert refused.value.field == "output"
    assert len(provider.requests) == 1 and sender.sent == []

    class SameAnswer(pydantic.BaseModel):
        """The run's output model."""  # the schema's description: part of what is sent

        city: str

    done = await engine.resume(paused.state.dumps(), decisions=decisions,
                               tools=[sender.tool], output=SameAnswer)
    assert done.outcome is le.Outcome.COMPLETED
    assert isinstance(done.answer, SameAnswer) and done.answer.city == "Oslo"


async def test_a_state_from_before_the_output_digest_checks_only_that_a_model_is_given(
        make_engine: EngineFactory) -> None:
    """Without the digest, a missing output model is still refused; any model passes."""
    engine, _, paused, sender = await structured_pause(make_engine)
    assert paused.state is not None and paused.state.output_digest is not None
    state = older(paused.state, engine, "output_digest")
    assert state.output_digest is None
    decisions = {paused.pending[0].id: le.Approve()}
    with pytest.raises(le.ConfigError, match="output model"):
        await engine.resume(state, decisions=decisions, tools=[sender.tool])
    done = await engine.resume(state, decisions=decisions, tools=[sender.tool], output=Answer)
    assert done.outcome is le.Outcome.COMPLETED and done.answer == Answer(city="Oslo")


class Node(pydantic.BaseModel):
    """A recursive output model: its schema refers to itself."""

    value: int
    children: list[Node] = []


async def test_a_recursive_output_models_run_paused_as_its_schema_was_sent_then_resumes(
        make_engine: EngineFactory) -> None:
    """A run with a recursive output model paused when its final tool's schema was
    pydantic's bare ``$ref`` (the state's output digest is of that definition,
    its pause sealed with it): resumed with the same model, it completes with
    the model's answer; another model is still refused."""
    sender = Sender()
    tree = {"value": 1, "children": [{"value": 2}]}
    engine, provider, ledger = make_engine(Reply.tool_calls(send("a")),
                                           Reply.tool_calls(("final_answer", tree)))
    paused = await engine.run(operation(), "go", tools=[sender.tool], output=Node)
    assert paused.outcome is le.Outcome.PAUSED and paused.state is not None
    (sent,) = [t for t in provider.requests[0].tools if t["name"] == "final_answer"]
    bare = Node.model_json_schema()
    assert set(bare) == {"$ref", "$defs"}  # what was sent before
    earlier = {**sent, "input_schema": bare}
    data = json.loads(paused.state.dumps())
    data["output_digest"] = hashlib.sha256(json.dumps(
        earlier, separators=(",", ":"), sort_keys=True).encode()).hexdigest()
    state = le.RunState.loads(json.dumps(data))
    ledger.invocations[state.invocation_id]["pause_seal"] = state.seal()
    decisions = {paused.pending[0].id: le.Approve()}
    with pytest.raises(le.ConfigError, match="Answer"):
        await engine.resume(state, decisions=decisions, tools=[sender.tool], output=Answer)
    assert len(provider.requests) == 1 and sender.sent == []
    done = await engine.resume(state.dumps(), decisions=decisions, tools=[sender.tool],
                               output=Node)
    assert done.outcome is le.Outcome.COMPLETED, done.detail
    assert done.answer == Node.model_validate(tree) and sender.sent == ["a"]


class FailingLedger(MemoryLedger):
    """A memory ledger whose attempt dispatches fail once ``fail`` is set."""

    fail = False

    async def dispatch_attempt(self, record: AttemptDispatch) -> None:
        if self.fail:
            raise le.LedgerError("disk full")
        await super().dispatch_attempt(record)


async def test_r01_a_resumed_segment_that_fails_keeps_the_turns_the_run_had(
        make_engine: EngineFactory) -> None:
    """Paused after two turns; the resume's first dispatch cannot be written: the
    invocation ends failed with its two turns (its third was never sent) and the
    decided call counted, in the ledger and in RunEnded alike."""
    seen: list[events.Event] = []
    ledger = FailingLedger()
    sender, counter = Sender(), Counter()
    engine, provider, _ = make_engine(Reply.tool_calls(lookup("k")), Reply.tool_calls(send("a")),
                                      Reply.text("done"), ledger=ledger, observers=[seen.append])
    paused = await engine.run(operation(), "go", tools=[sender.tool, counter.tool])
    assert paused.outcome is le.Outcome.PAUSED and paused.state is not None
    assert (paused.turns, paused.tool_calls) == (2, 1)
    ledger.fail = True
    with pytest.raises(le.LedgerError, match="disk full"):
        await engine.resume(paused.state, decisions={paused.pending[0].id: le.Approve()},
                            tools=[sender.tool, counter.tool])
    assert len(provider.requests) == 2 and sender.sent == ["a"]
    row = ledger.invocations[paused.invocation_id]
    assert (row["outcome"], row["turns"], row["tool_calls"], row["credits"],
            row["attempt_count"]) == ("failed", 2, 2, paused.credits, 2)
    (ended,) = [e for e in seen if isinstance(e, events.RunEnded)]
    assert (ended.outcome, ended.turns, ended.tool_calls) == ("failed", 2, 2)


async def test_a_recovered_run_that_fails_counts_the_turn_its_dead_process_sent(
        clock: FakeClock) -> None:
    """Its process died as turn 1's request went out; the recovery's first
    dispatch cannot be written: ended failed with that one turn (sent, and in
    the ledger as an attempt), not zero."""

    class Crash(BaseException):
        """Stands in for the death of the process."""

    def crash_on_first(event: object) -> None:
        if isinstance(event, events.AttemptStarted):
            raise Crash

    ledger = FailingLedger()
    engine, _, store = engine_on(ledger, clock, Reply.text("done"),
                                 observers=[crash_on_first])
    with pytest.raises(Crash):
        await engine.run(operation(total_time=600.0), "go")
    (run_id,) = ledger.invocations
    ledger.fail = True
    engine2, provider2, _ = engine_on(ledger, clock, Reply.text("done"))
    with pytest.raises(le.LedgerError):
        await engine2.resume(run_id, force=True)
    assert provider2.requests == []
    row = ledger.invocations[run_id]
    assert (row["outcome"], row["turns"], row["attempt_count"]) == ("failed", 1, 1)


@pytest.mark.parametrize("decisions", [[le.Approve()], "approve", 3])
async def test_decisions_that_are_not_a_mapping_are_a_config_error_before_anything_is_sent(
        make_engine: EngineFactory, decisions: Any) -> None:
    """``decisions=[le.Approve()]`` (a list, not ``{call_id: decision}``) was the
    TypeError of building a dict from it; it is a ConfigError on ``decisions``, and
    the run stays paused."""
    sender = Sender()
    engine, provider, ledger = make_engine(Reply.tool_calls(send("a")), Reply.text("done"))
    paused = await engine.run(operation(), "go", tools=[sender.tool])
    assert paused.state is not None
    with pytest.raises(le.ConfigError) as refused:
        await engine.resume(paused.state, decisions=decisions, tools=[sender.tool])
    assert refused.value.field == "decisions"
    assert len(provider.requests) == 1 and sender.sent == []
    assert ledger.invocations[paused.invocation_id]["outcome"] == "paused"
