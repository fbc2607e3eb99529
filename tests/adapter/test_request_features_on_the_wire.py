"""Request features on the wire: what each provider sends, what a run narrows, and
what a provider that cannot send a feature refuses before anything is recorded."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pydantic
import pytest

import loopengine as le
from loopengine.persistence import MemoryLedger
from loopengine.providers import OpenAIProvider, Reply
from loopengine.testing import FakeClock, FakeOpenAIServer

from .conftest import STREAMING, Harness

SEARCH = le.ServerTool(type="web_search_20250305", name="web_search", max_uses=5,
                       params={"allowed_domains": ["example.com"]})
FETCH = le.ServerTool(type="web_fetch_20250910", name="web_fetch", max_uses=3)


def research(**features: Any) -> le.Operation:
    """An Anthropic operation publishing ``features``."""
    return le.Operation(name="research", provider="anthropic", model="claude-sonnet-4-5",
                        **features)


@STREAMING
async def test_a_run_narrows_the_published_features(wire: Harness, stream: bool) -> None:
    """A run may drop a tool, lower a max_uses, lower the thinking budget and drop a
    beta: the request carries exactly the narrowed features."""
    engine, _ = wire.engine(Reply.text("ok"), stream=stream)
    published = research(thinking=le.Thinking(budget_tokens=4096), server_tools=(SEARCH, FETCH),
                         betas=("compact-2026-01-12", "other-2026-01-01"),
                         max_output_tokens=8192)
    narrowed = {
        "server_tools": (le.ServerTool(type="web_search_20250305", name="web_search",
                                       max_uses=2, params={"allowed_domains": ["example.com"]}),),
        "thinking": le.Thinking(budget_tokens=1024),
        "betas": ("other-2026-01-01",),
    }
    result = await engine.run(published, "go", features=narrowed)
    assert result.outcome is le.Outcome.COMPLETED
    body = wire.requests[0].body
    assert body["tools"] == [{"type": "web_search_20250305", "name": "web_search", "max_uses": 2,
                              "allowed_domains": ["example.com"]}]
    assert body["thinking"] == {"type": "enabled", "budget_tokens": 1024}
    assert wire.requests[0].headers["anthropic-beta"] == "other-2026-01-01"
    assert "context_management" not in body


@pytest.mark.parametrize(("budget", "max_tokens", "betas", "sent"), [
    (1024, 1024, (), False),
    (4096, 2048, (), False),
    (1024, 1025, (), True),
    (4096, 2048, ("interleaved-thinking-2025-05-14",), True),
])
async def test_a_thinking_budget_the_api_refuses_is_never_sent(
    wire: Harness, budget: int, max_tokens: int, betas: tuple[str, ...], sent: bool
) -> None:
    """The Messages API refuses a budget_tokens not below max_tokens (unless the
    interleaved-thinking beta spans it over the turn): such a run ends
    provider_error saying so, with nothing recorded or sent."""
    engine, ledger = wire.engine(Reply.text("ok"))
    operation = research(thinking=le.Thinking(budget_tokens=budget), betas=betas,
                         max_output_tokens=max_tokens)
    result = await engine.run(operation, "go")
    if sent:
        assert result.outcome is le.Outcome.COMPLETED and len(wire.requests) == 1
        return
    assert result.outcome is le.Outcome.PROVIDER_ERROR
    assert result.fault is not None and "must be below max_tokens" in str(result.fault)
    assert wire.requests == [] and result.attempt_log == ()
    assert not ledger.attempts


async def test_adaptive_thinking_sends_its_effort(wire: Harness) -> None:
    """Adaptive thinking is ``{"type": "adaptive"}``, its effort in ``output_config``;
    an operation without features sends none of the fields."""
    engine, _ = wire.engine(Reply.text("ok"), Reply.text("ok"))
    await engine.run(research(thinking=le.Thinking(adaptive=True, effort="medium")), "go")
    await engine.run(research(), "go")
    first, plain = (r.body for r in wire.requests)
    assert (first["thinking"], first["output_config"]) == ({"type": "adaptive"},
                                                           {"effort": "medium"})
    assert not {"thinking", "output_config", "tools", "context_management"} & set(plain)
    assert "anthropic-beta" not in wire.requests[1].headers


class Verdict(pydantic.BaseModel):
    """A structured answer."""

    ok: bool


THOUGHT = {"type": "thinking", "thinking": "Weigh it."}
"""A thinking block as scripted: the fake signs it as it serves it."""


@pytest.mark.parametrize("thinking", [le.Thinking(budget_tokens=1024),
                                      le.Thinking(adaptive=True)], ids=["budget", "adaptive"])
@STREAMING
async def test_a_forced_tool_choice_is_left_to_the_model_while_it_thinks(
    wire: Harness, thinking: le.Thinking, stream: bool
) -> None:
    """The Messages API refuses thinking with a tool_choice that forces a tool
    (``any`` or ``tool``): a structured call, and a structured run's wrap-up turn,
    which force the answer tool, send ``auto`` instead while thinking is on, and
    get their answer; without thinking the answer tool is still forced."""
    engine, _ = wire.engine(
        Reply(content=[THOUGHT, {"type": "tool_use", "id": "toolu_a", "name": "final_answer",
                                 "input": {"ok": True}}], stop_reason="tool_use"),
        Reply(content=[THOUGHT, {"type": "tool_use", "id": "toolu_b", "name": "lookup",
                                 "input": {"q": "x"}}], stop_reason="tool_use"),
        Reply(content=[THOUGHT, {"type": "tool_use", "id": "toolu_c", "name": "final_answer",
                                 "input": {"ok": True}}], stop_reason="tool_use"),
        Reply.final({"ok": False}), stream=stream)

    @le.tool
    def lookup(q: str) -> str:
        """Look something up."""
        return q

    thinking_op = research(thinking=thinking, max_output_tokens=4096,
                           limits=le.Limits(max_turns=2, wrap_up=True))
    called = await engine.call(thinking_op, "Is it ok?", output=Verdict)
    run = await engine.run(thinking_op, "Is it ok?", tools=[lookup], output=Verdict)
    plain = await engine.call(research(max_output_tokens=4096), "Is it ok?", output=Verdict)
    assert called.data == Verdict(ok=True) and plain.data == Verdict(ok=False)
    assert run.outcome is le.Outcome.COMPLETED and run.answer == Verdict(ok=True)
    call_body, first_turn, wrap_up, plain_body = (r.body for r in wire.requests)
    assert call_body["tool_choice"] == {"type": "auto"} and "thinking" in call_body
    assert "tool_choice" not in first_turn
    assert wrap_up["tool_choice"] == {"type": "auto"} and "thinking" in wrap_up
    # The thinking of the tool loop goes back with its call, as the API requires.
    assert wrap_up["messages"][1]["content"][0] == {
        **THOUGHT, "signature": wire.server.thinking_signature("Weigh it.")}
    assert plain_body["tool_choice"] == {"type": "tool", "name": "final_answer"}


async def test_widening_a_feature_is_refused_before_anything_is_recorded(wire: Harness) -> None:
    """A raised max_uses or an unpublished tool is a ConfigError naming the field;
    no row is written and nothing is sent."""
    engine, ledger = wire.engine(Reply.text("ok"))
    published = research(server_tools=(SEARCH,))
    with pytest.raises(le.ConfigError) as raised:
        await engine.run(published, "go", features={"server_tools": (
            le.ServerTool(type="web_search_20250305", name="web_search", max_uses=9,
                          params={"allowed_domains": ["example.com"]}),)})
    assert raised.value.field == "server_tools[0].max_uses"
    with pytest.raises(le.ConfigError) as raised:
        await engine.run(published, "go", features={"server_tools": (FETCH,)})
    assert raised.value.field == "server_tools[0].name"
    assert (ledger.invocations, wire.requests) == ({}, [])


@pytest.fixture
async def openai_wire(fake_openai_server: FakeOpenAIServer) -> AsyncIterator[
        tuple[FakeOpenAIServer, le.Engine, MemoryLedger]]:
    provider = OpenAIProvider(api_key="test-key", base_url=fake_openai_server.base_url)
    ledger = MemoryLedger()
    try:
        yield fake_openai_server, le.Engine(provider, ledger=ledger, clock=FakeClock()), ledger
    finally:
        await provider.aclose()


async def test_openai_sends_reasoning_effort_and_service_tier(
    openai_wire: tuple[FakeOpenAIServer, le.Engine, MemoryLedger],
) -> None:
    """reasoning_effort and service_tier are Chat Completions parameters; a run may
    lower the effort."""
    server, engine, _ = openai_wire
    server.add(Reply.text("ok"), Reply.text("ok"))
    published = le.Operation(name="ask", provider="openai", model="gpt-5",
                             reasoning_effort="high", service_tier="flex")
    await engine.run(published, "go")
    await engine.run(published, "go", features={"reasoning_effort": "low"})
    assert [(r.body["reasoning_effort"], r.body["service_tier"]) for r in server.requests] == [
        ("high", "flex"), ("low", "flex")]


@pytest.mark.parametrize(("feature", "value"), [
    ("thinking", le.Thinking(budget_tokens=2048)),
    ("server_tools", (SEARCH,)),
    ("betas", ("compact-2026-01-12",)),
    ("context_management", {"edits": [{"type": "compact_20260112"}]}),
])
async def test_openai_refuses_the_messages_api_features(
    openai_wire: tuple[FakeOpenAIServer, le.Engine, MemoryLedger], feature: str, value: Any,
) -> None:
    """An OpenAI operation enabling an Anthropic-only feature is refused with a
    ConfigError naming it, before any row is written or anything is sent."""
    server, engine, ledger = openai_wire
    server.add(Reply.text("ok"))
    operation = le.Operation(name="ask", provider="openai", model="gpt-5", **{feature: value})
    with pytest.raises(le.ConfigError) as raised:
        await engine.run(operation, "go")
    assert raised.value.field == feature
    assert "cannot send" in str(raised.value)
    with pytest.raises(le.ConfigError):
        await engine.call(operation, "go", output=_Answer)
    assert (ledger.invocations, server.requests) == ({}, [])


async def test_openai_sends_a_prefill_with_reasoning_effort(
    openai_wire: tuple[FakeOpenAIServer, le.Engine, MemoryLedger],
) -> None:
    """The Messages API's refusal of a prefill while thinking is on is not Chat
    Completions': a conversation ending with an assistant message goes out as it
    is with the reasoning effort (thinking itself is a feature the route cannot
    send, refused above whatever the messages)."""
    server, engine, _ = openai_wire
    server.add(Reply.text(" blue"))
    prefill = [{"role": "user", "content": "Name a colour."},
               {"role": "assistant", "content": "The colour is"}]
    reasoning = le.Operation(name="ask", provider="openai", model="gpt-5",
                             reasoning_effort="low")
    result = await engine.run(reasoning, prefill)
    assert result.outcome is le.Outcome.COMPLETED, result.fault
    (sent,) = server.requests
    assert sent.body["reasoning_effort"] == "low"
    assert sent.messages[-1] == {"role": "assistant", "content": "The colour is"}
    thinking = le.Operation(name="ask", provider="openai", model="gpt-5",
                            thinking=le.Thinking(budget_tokens=2048))
    with pytest.raises(le.ConfigError) as raised:
        await engine.run(thinking, prefill)
    assert raised.value.field == "thinking"


async def test_anthropic_refuses_the_chat_completions_features(wire: Harness) -> None:
    """And the other way round: reasoning_effort on an Anthropic route is refused."""
    engine, ledger = wire.engine(Reply.text("ok"))
    with pytest.raises(le.ConfigError) as raised:
        await engine.run(research(reasoning_effort="low"), "go")
    assert raised.value.field == "reasoning_effort"
    assert (ledger.invocations, wire.requests) == ({}, [])


class _Answer(pydantic.BaseModel):
    answer: str
