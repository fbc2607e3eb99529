"""What one request of a run hands the next on the wire, through the real SDK
against the loopback Messages API: the code execution container (across turns,
its expiry and a pause), a prefill the API refuses with thinking on, and the
conversation's cache marker kept off blocks that cannot carry one."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pydantic
import pytest

import loopengine as le
from loopengine.providers import (
    ProviderRequest,
    ProviderResponse,
    RecordingProvider,
    ReplayProvider,
    Reply,
    TextCallback,
)
from loopengine.testing import FakeClock

from ..conftest import MODEL, PRICES
from .conftest import STREAMING, Harness

CODE = le.ServerTool(type="code_execution_20250825", name="code_execution")


def coding(**features: Any) -> le.Operation:
    """An Anthropic operation publishing code execution."""
    return le.Operation(name="coding", provider="anthropic", model=MODEL,
                        server_tools=(CODE,), **features)


def programmatic_call(tool: str, call_id: str, to: str) -> Reply:
    """A reply whose tool call the model made from its code (programmatic tool
    calling): its result must go back to the same container."""
    return Reply(content=[
        {"type": "server_tool_use", "id": "srvtoolu_1", "name": "code_execution",
         "input": {"code": "send()"}},
        {"type": "tool_use", "id": call_id, "name": tool, "input": {"to": to},
         "caller": {"type": "code_execution_20250825", "tool_id": "srvtoolu_1"}},
    ], stop_reason="tool_use")


@le.tool
def send(to: str) -> str:
    """Send the message to someone."""
    return f"sent to {to}"


@STREAMING
async def test_the_container_goes_on_every_later_request(wire: Harness, stream: bool) -> None:
    """The first reply names a container; the next request sends its id (a
    programmatic call's result is refused without it), and so does the one after."""
    engine, ledger = wire.engine(programmatic_call("send", "toolu_1", "ann"),
                                 Reply.tool_calls(("send", {"to": "bob"})),
                                 Reply.text("done"), stream=stream)
    result = await engine.run(coding(), "send it", tools=[send])
    assert result.outcome is le.Outcome.COMPLETED, result.fault
    first, *later = wire.requests
    assert "container" not in first.body
    assert [r.body["container"] for r in later] == ["container_fake_0001"] * 2
    # The id is not conversation text, and none goes to the ledger either way.
    assert "container_fake" not in repr(ledger.attempts) + repr(ledger.invocations)


class Total(pydantic.BaseModel):
    """A structured answer computed in the container."""

    total: int


@STREAMING
async def test_a_calls_repair_goes_to_the_same_container(wire: Harness, stream: bool) -> None:
    """`Engine.call` hands its container on too: the repair after an answer the
    schema refused sends the first reply's container, so the files the model made
    there are still there."""
    engine, ledger = wire.engine(Reply.final({"total": "many"}), Reply.final({"total": 42}),
                                 stream=stream)
    result = await engine.call(coding(), "Add the numbers in data.csv.", output=Total)
    assert result.data == Total(total=42)
    first, repair = wire.requests
    assert "container" not in first.body
    assert repair.body["container"] == "container_fake_0001"
    assert "container_fake" not in repr(ledger.attempts) + repr(ledger.invocations)


@STREAMING
async def test_an_expired_container_is_not_sent(wire: Harness, clock: FakeClock,
                                                stream: bool) -> None:
    """Past the container's expires_at (the run's clock), the next request sends
    none: the API would refuse an expired one, and makes a new one."""
    wire.server.now = clock.wall
    wire.server.container_lifetime = timedelta(seconds=30)

    @le.tool
    def slow(to: str) -> str:
        """Takes a minute."""
        clock.advance(60)
        return "slow"

    engine, _ = wire.engine(Reply.tool_calls(("slow", {"to": "a"})), Reply.text("done"),
                            stream=stream)
    result = await engine.run(coding(), "go", tools=[slow])
    assert result.outcome is le.Outcome.COMPLETED, result.fault
    assert "container" not in wire.requests[1].body
    assert list(wire.server.containers) == ["container_fake_0001", "container_fake_0002"]


@STREAMING
async def test_a_paused_run_keeps_its_container(wire: Harness, stream: bool) -> None:
    """The container is in the paused run's state: the resumed request sends it."""

    @le.tool(approval=True)
    def guarded(to: str) -> str:
        """Needs approval."""
        return "ok"

    engine, _ = wire.engine(programmatic_call("guarded", "toolu_1", "ann"),
                            Reply.text("done"), stream=stream)
    paused = await engine.run(coding(), "go", tools=[guarded])
    assert paused.outcome is le.Outcome.PAUSED and paused.state is not None
    state = le.RunState.loads(paused.state.dumps())
    assert state.container == paused.state.container
    assert state.container is not None and state.container.id == "container_fake_0001"
    assert state.seal() == paused.state.seal()
    result = await engine.resume(state, decisions={"toolu_1": le.Approve()}, tools=[guarded])
    assert result.outcome is le.Outcome.COMPLETED, result.fault
    assert wire.requests[1].body["container"] == "container_fake_0001"


async def test_a_state_without_a_container_keeps_its_encoding(wire: Harness) -> None:
    """A state with no container encodes no ``container`` key, so a state encoded
    before the field existed loads, and its seal is the one its ledger kept."""

    @le.tool(approval=True)
    def guarded(to: str) -> str:
        """Needs approval."""
        return "ok"

    engine, _ = wire.engine(Reply.tool_calls(("guarded", {"to": "a"})))
    paused = await engine.run(le.Operation(name="plain", provider="anthropic", model=MODEL),
                              "go", tools=[guarded])
    assert paused.state is not None and paused.state.container is None
    raw = json.loads(paused.state.dumps())
    assert "container" not in raw
    assert le.RunState.loads(json.dumps(raw)).seal() == paused.state.seal()
    raw["container"] = {"id": "c1", "expires_at": "2026-01-01T00:00:00"}
    with pytest.raises(le.ConfigError, match="UTC offset"):
        le.RunState.loads(json.dumps(raw))


class Colour(pydantic.BaseModel):
    """A structured call's answer."""

    name: str


PREFILL = [{"role": "user", "content": "Name a colour."},
           {"role": "assistant", "content": "The colour is"}]


@pytest.mark.parametrize("thinking", [le.Thinking(budget_tokens=1024),
                                      le.Thinking(adaptive=True)], ids=["budget", "adaptive"])
async def test_a_prefill_with_thinking_is_refused_before_the_wire(
        wire: Harness, thinking: le.Thinking) -> None:
    """The Messages API refuses a final assistant message while thinking is on, so
    the provider refuses it before the attempt is recorded (`check_request`): the
    run ends provider_error with that bad_request, a call raises ProviderError,
    nothing is sent and no attempt row is written."""
    engine, ledger = wire.engine(Reply.text(" blue"))
    operation = le.Operation(name="t", provider="anthropic", model=MODEL, thinking=thinking,
                             max_output_tokens=4096)
    result = await engine.run(operation, PREFILL)
    assert result.outcome is le.Outcome.PROVIDER_ERROR and result.fault is not None
    assert result.fault.kind is le.FaultKind.BAD_REQUEST and "prefill" in str(result.fault)
    assert result.attempt_log == ()

    with pytest.raises(le.ProviderError, match="prefill"):
        await engine.call(operation, PREFILL, output=Colour)
    assert wire.requests == [] and not ledger.attempts
    assert [row["outcome"] for row in ledger.invocations.values()] == ["provider_error"] * 2
    # Without thinking the prefill is sent, as the API takes it.
    plain = le.Operation(name="t", provider="anthropic", model=MODEL, max_output_tokens=4096)
    result = await engine.run(plain, PREFILL)
    assert result.outcome is le.Outcome.COMPLETED
    assert wire.requests[0].body["messages"][-1]["role"] == "assistant"


async def test_a_prefill_that_begins_with_its_thinking_is_sent(wire: Harness) -> None:
    """A final assistant message that begins with the model's own thinking block
    (carried back) is what the API takes while thinking is on: it is sent."""
    engine, _ = wire.engine(Reply.text(" blue"))
    operation = le.Operation(name="t", provider="anthropic", model=MODEL,
                             thinking=le.Thinking(budget_tokens=1024), max_output_tokens=4096)
    thought = [PREFILL[0], {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Pick one.",
         "signature": wire.server.thinking_signature("Pick one.")},
        {"type": "text", "text": "The colour is"}]}]
    result = await engine.run(operation, thought)
    assert result.outcome is le.Outcome.COMPLETED, result.fault
    assert wire.requests[0].body["messages"][-1]["content"][0]["type"] == "thinking"


async def test_the_fake_refuses_a_prefill_with_thinking(wire: Harness) -> None:
    """The loopback API refuses what the API refuses: a final assistant message
    that does not start with a thinking block, while thinking is on."""
    import anthropic

    client = anthropic.AsyncAnthropic(api_key="k", base_url=wire.server.url, max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="must start with a thinking block"):
        await client.messages.create(model=MODEL, max_tokens=2048, messages=PREFILL,
                                     thinking={"type": "enabled", "budget_tokens": 1024})
    await client.close()


async def test_the_fake_refuses_tool_results_answering_a_turn_without_its_thinking(
        wire: Harness) -> None:
    """As the API does: while thinking is on, the assistant message whose calls
    the last user message answers must start with its thinking block (the API
    checks it before the lastmost set of tool_use and tool_result blocks)."""
    import anthropic

    call = {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"q": "x"}}
    thinking = {"type": "thinking", "thinking": "Look it up.",
                "signature": wire.server.thinking_signature("Look it up.")}
    answered: Any = [{"role": "user", "content": "go"},
                     {"role": "assistant", "content": [call]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                   "content": "found"}]}]
    tools: Any = [{"name": "lookup", "description": "Look up.",
                   "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}]
    wire.server.add(Reply.text("done"))
    client = anthropic.AsyncAnthropic(api_key="k", base_url=wire.server.url, max_retries=0)
    on = {"type": "enabled", "budget_tokens": 1024}
    with pytest.raises(anthropic.BadRequestError, match="found `tool_use`"):
        await client.messages.create(model=MODEL, max_tokens=2048, messages=answered,
                                     tools=tools, thinking=on)
    answered[1]["content"] = [thinking, call]
    reply = await client.messages.create(model=MODEL, max_tokens=2048, messages=answered,
                                         tools=tools, thinking=on)
    assert reply.content[0].type == "text"
    await client.close()


@pytest.mark.parametrize("block", [
    {"type": "mcp_tool_listing", "mcp_server_name": "docs", "tools": []},
    {"type": "fallback", "from": {"model": "claude-opus-4-5"}},
], ids=["mcp_tool_listing", "fallback"])
@STREAMING
async def test_r12_the_conversation_marker_skips_a_block_that_cannot_carry_it(
        wire: Harness, block: dict[str, Any], stream: bool) -> None:
    """The newest message ends with a block the API takes no cache_control on:
    the marker goes on the last block that can, and the request is taken."""
    engine, _ = wire.engine(Reply.text(" more"), stream=stream)
    operation = le.Operation(name="c", provider="anthropic", model=MODEL,
                             cache=le.CachePolicy(conversation=True))
    messages = [{"role": "user", "content": "go"},
                {"role": "assistant", "content": [{"type": "text", "text": "so far"}, block]}]
    result = await engine.run(operation, messages)
    assert result.outcome is le.Outcome.COMPLETED, result.fault
    sent = wire.requests[0].body["messages"][-1]["content"]
    assert sent[0]["cache_control"] == {"type": "ephemeral"}
    assert "cache_control" not in sent[1]


class WatchedReplay(ReplayProvider):
    """A replay that notes the container each request of the replayed run sends."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.sent: list[str | None] = []

    async def send(self, request: ProviderRequest, *,
                   on_text: TextCallback | None = None) -> ProviderResponse:
        self.sent.append(request.container)
        return await super().send(request, on_text=on_text)


async def test_a_recording_keeps_the_container_and_its_replay_sends_it_on(
        wire: Harness, tmp_path: Path) -> None:
    """A recorded reply's container is in the recording; replayed, the reply names it
    again, so the replayed run's later requests carry it as the recorded run's did."""
    path = tmp_path / "run.jsonl"
    wire.server.add(programmatic_call("send", "toolu_1", "ann"),
                    Reply.tool_calls(("send", {"to": "bob"})), Reply.text("done"))
    recorder = RecordingProvider(wire.provider(), path)
    recorded = await le.Engine(recorder, prices=PRICES, clock=wire.clock).run(
        coding(), "send it", tools=[send])
    assert recorded.outcome is le.Outcome.COMPLETED, recorded.fault
    assert [r.body.get("container") for r in wire.requests] == [
        None, "container_fake_0001", "container_fake_0001"]
    replay = WatchedReplay(path)
    replayed = await le.Engine(replay, prices=PRICES, clock=wire.clock).run(
        coding(), "send it", tools=[send])
    assert replayed.outcome is le.Outcome.COMPLETED and replay.exhausted
    assert replay.sent == [None, "container_fake_0001", "container_fake_0001"]
    assert len(wire.requests) == 3
