"""The wrap-up turn (docs/guards.md): the last turn a run may send goes out with
tools disabled and the operation's wrap-up text, so a run that would end
``turn_limit`` can answer from what it gathered. Through AnthropicProvider, the
real SDK and the loopback server."""

from __future__ import annotations

from pathlib import Path

import loopengine as le
from loopengine.persistence import SQLiteLedger
from loopengine.testing import Reply

from ..conftest import operation
from ..ledger_support import lookup, read_db
from .conftest import Harness

WRAP = le.Operation(name="test.op", provider="anthropic", model="claude-sonnet-4-5").wrap_up_text


def asks(n: int) -> list[Reply]:
    return [Reply.tool_calls(("lookup", {"key": str(i)})) for i in range(n)]


def last_text(request: object) -> str:
    content = request.messages[-1]["content"]  # type: ignore[attr-defined]
    return "".join(b.get("text", "") for b in content if isinstance(b, dict))


async def test_the_last_turn_wraps_up_and_the_run_completes(wire: Harness) -> None:
    """``max_turns=3`` and a model that keeps asking for tools: the third request
    carries ``tool_choice`` none (the tools still defined) and the wrap-up text,
    and the run ends ``completed`` in 3 turns."""
    engine, ledger = wire.engine(*asks(2), Reply.text("from what I gathered"))
    result = await engine.run(operation(max_turns=3, wrap_up=True), "go", tools=[lookup])
    assert result.outcome is le.Outcome.COMPLETED and result.turns == 3
    assert result.answer == "from what I gathered"
    first, second, third = wire.requests
    assert "tool_choice" not in first.body and "tool_choice" not in second.body
    assert third.body["tool_choice"] == {"type": "none"}
    assert [t["name"] for t in third.body["tools"]] == ["lookup"]
    assert last_text(third).endswith(WRAP)
    phases = [row["phase"] for row in ledger.attempts.values()]
    assert phases == ["turn", "turn", "wrap_up"]


async def test_without_wrap_up_the_same_script_ends_turn_limit(wire: Harness) -> None:
    engine, _ = wire.engine(*asks(3))
    result = await engine.run(operation(max_turns=3), "go", tools=[lookup])
    assert result.outcome is le.Outcome.TURN_LIMIT and result.turns == 3
    assert all("tool_choice" not in r.body for r in wire.requests)


async def test_a_wrap_up_reply_that_still_asks_for_tools_ends_turn_limit(wire: Harness) -> None:
    """The model asks for a tool despite ``tool_choice`` none: nothing runs, the
    run ends ``turn_limit`` as it would have, and its history stays valid."""
    ran: list[str] = []

    @le.tool
    def probe(key: str) -> str:
        """Record a call."""
        ran.append(key)
        return key

    engine, _ = wire.engine(*[Reply.tool_calls(("probe", {"key": str(i)})) for i in range(3)])
    result = await engine.run(operation(max_turns=3, wrap_up=True), "go", tools=[probe])
    assert result.outcome is le.Outcome.TURN_LIMIT and result.turns == 3
    assert ran == ["0", "1"]
    last = result.messages[-1]
    assert last["role"] == "user" and all(b.get("is_error") for b in last["content"])


async def test_a_spent_tool_budget_wraps_up_the_next_turn(wire: Harness) -> None:
    """``max_tool_calls=2``: after two answered calls the next turn wraps up and
    the run completes instead of ending ``tool_limit``."""
    engine, _ = wire.engine(*asks(2), Reply.text("done"))
    result = await engine.run(operation(max_tool_calls=2, wrap_up=True), "go",
                              tools=[lookup])
    assert result.outcome is le.Outcome.COMPLETED and result.tool_calls == 2
    assert wire.requests[2].body["tool_choice"] == {"type": "none"}


async def test_a_structured_wrap_up_forces_the_answer_tool(wire: Harness) -> None:
    import pydantic

    class Answer(pydantic.BaseModel):
        value: str

    engine, _ = wire.engine(*asks(1), Reply.final({"value": "v"}))
    result = await engine.run(operation(max_turns=2, wrap_up=True), "go", tools=[lookup],
                              output=Answer)
    assert result.outcome is le.Outcome.COMPLETED and result.answer == Answer(value="v")
    assert wire.requests[1].body["tool_choice"] == {"type": "tool", "name": "final_answer"}


async def test_an_override_can_turn_wrap_up_off_but_not_on(wire: Harness) -> None:
    """``wrap_up`` narrows like every limit (R13): a published off stays off."""
    published_off = operation(max_turns=2)
    assert published_off.limits.narrow(le.Limits(wrap_up=True)).wrap_up is False
    published_on = operation(max_turns=2, wrap_up=True)
    assert published_on.limits.narrow(le.Limits(wrap_up=False)).wrap_up is False
    assert published_on.limits.narrow(le.Limits(max_turns=1)).wrap_up is True
    engine, _ = wire.engine(*asks(2))
    result = await engine.run(published_off, "go", tools=[lookup], limits={"wrap_up": True})
    assert result.outcome is le.Outcome.TURN_LIMIT


async def test_the_sqlite_ledger_records_the_wrap_up_phase(wire: Harness, tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as ledger:
        engine, _ = wire.engine(*asks(1), Reply.text("done"), ledger=ledger)
        result = await engine.run(operation(max_turns=2, wrap_up=True), "go", tools=[lookup])
    assert result.outcome is le.Outcome.COMPLETED
    _, attempts = read_db(path)
    assert [a["phase"] for a in attempts.values()] == ["turn", "wrap_up"]
