"""What a request is made of is proven encodable as UTF-8 JSON before anything is
recorded: input the shape checks pass but JSON cannot carry (a lone surrogate, a
NaN, a key that is not a string, a 5,000-deep tool input) is a ConfigError naming
its path, and the ledger gets no row for a request that could never be sent."""

from __future__ import annotations

import sqlite3
from decimal import Decimal
from enum import IntEnum, StrEnum
from pathlib import Path
from typing import Any

import pydantic
import pytest

import loopengine as le
from loopengine import _validate
from loopengine._engine import normalize_messages
from loopengine._jsonschema import schema_errors
from loopengine._tools import render_tool_output
from loopengine.persistence import MemoryLedger, SQLiteLedger
from loopengine.providers import AnthropicProvider, Reply, ScriptedProvider
from loopengine.testing import FakeAnthropicServer
from loopengine.testing import Reply as WireReply

OPERATION = le.Operation(name="encoding.test", provider="anthropic",
                         model="claude-encoding-test", max_output_tokens=64)
LONE = "bad \ud800 text"


def user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


def assistant(content: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": content}


def tool_turn(tool_input: Any, name: str = "lookup") -> list[dict[str, Any]]:
    """A history whose assistant turn called a tool with ``tool_input``, answered."""
    return [
        user("q"),
        assistant([{"type": "tool_use", "id": "t1", "name": name, "input": tool_input}]),
        user([{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]),
    ]


def deep(levels: int) -> Any:
    value: Any = "leaf"
    for _ in range(levels):
        value = {"a": value}
    return value


UNSENDABLE: list[tuple[str, Any, Any, str]] = [
    # (id, messages, system, the field named)
    ("surrogate-in-string-content", [user(LONE)], None, "messages[0].content"),
    ("surrogate-in-text-block", [user([{"type": "text", "text": LONE}])], None,
     "messages[0].content[0].text"),
    ("surrogate-in-tool-input", tool_turn({"q": LONE}), None, "messages[1].content[0].input.q"),
    ("surrogate-in-tool-input-key", tool_turn({"q\udfff": 1}), None,
     "messages[1].content[0].input key"),
    ("surrogate-in-tool-name", tool_turn({}, name="look\ud800"), None,
     "messages[1].content[0].name"),
    ("surrogate-in-tool-result", [*tool_turn({})[:2], user([
        {"type": "tool_result", "tool_use_id": "t1", "content": LONE}])], None,
     "messages[2].content[0].content"),
    ("nan-in-tool-input", tool_turn({"x": float("nan")}), None,
     "messages[1].content[0].input.x"),
    ("infinity-in-tool-input", tool_turn({"x": [1.0, float("-inf")]}), None,
     "messages[1].content[0].input.x[1]"),
    ("int-key-in-tool-input", tool_turn({1: "one"}), None, "messages[1].content[0].input"),
    ("decimal-in-tool-input", tool_turn({"price": Decimal("1.5")}), None,
     "messages[1].content[0].input.price"),
    ("endless-int-in-tool-input", tool_turn({"n": 10 ** 5000}), None,
     "messages[1].content[0].input.n"),
    ("5000-deep-tool-input", tool_turn(deep(5000)), None,
     "messages[1].content[0].input" + ".a" * (_validate.MAX_JSON_DEPTH - 3)),
    ("surrogate-in-system-string", "q", LONE, "system"),
    ("surrogate-in-system-block", "q", [{"type": "text", "text": LONE}], "system[0].text"),
]


@pytest.mark.parametrize(("messages", "system", "field"),
                         [pytest.param(m, s, f, id=i) for i, m, s, f in UNSENDABLE])
async def test_an_unsendable_request_is_a_config_error_with_no_ledger_row(
    messages: Any, system: Any, field: str
) -> None:
    """Through the real SDK: a ConfigError naming the path, nothing on the wire, no
    invocation row and no attempt row (the ledger never claims a request was sent)."""
    ledger = MemoryLedger()
    with FakeAnthropicServer([WireReply.text("never served")]) as server:
        async with AnthropicProvider(api_key="test", base_url=server.url) as provider:
            engine = le.Engine(provider, ledger=ledger)
            with pytest.raises(le.ConfigError) as caught:
                await engine.run(OPERATION, messages, system=system)
            assert caught.value.field == field
            with pytest.raises(le.ConfigError) as called:
                await engine.call(OPERATION, messages, system=system, output=Answer)
            assert called.value.field == field
    assert server.requests == []
    assert ledger.invocations == {} and ledger.attempts == {}


class Answer(pydantic.BaseModel):
    text: str


async def test_no_row_reaches_a_sqlite_ledger_for_any_unsendable_request(
    tmp_path: Path
) -> None:
    """The same on a durable ledger: after every shape above, the file has no
    invocation and no attempt (no ``dispatched`` row among them)."""
    path = tmp_path / "ledger.db"
    with FakeAnthropicServer([WireReply.text("never served")]) as server:
        async with AnthropicProvider(api_key="test", base_url=server.url) as provider:
            with SQLiteLedger(path) as ledger:
                engine = le.Engine(provider, ledger=ledger)
                for _, messages, system, field in UNSENDABLE:
                    with pytest.raises(le.ConfigError) as caught:
                        await engine.run(OPERATION, messages, system=system)
                    assert caught.value.field == field
    assert server.requests == []
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT count(*) FROM invocations").fetchone() == (0,)
        assert db.execute("SELECT count(*) FROM attempts").fetchone() == (0,)


def test_the_copy_sent_is_plain_json_equal_to_the_input() -> None:
    """What passes is copied as plain JSON types: tuples become lists, enum members
    their values, and the copy is not the caller's object."""

    class Colour(StrEnum):
        RED = "red"

    class Size(IntEnum):
        BIG = 3

    given = tool_turn({"colour": Colour.RED, "size": Size.BIG, "path": ("a", 1.5, None, True),
                       "text": "naïve ☃ 𝄞"})
    copied = normalize_messages(given)
    tool_input = copied[1]["content"][0]["input"]
    assert tool_input == {"colour": "red", "size": 3, "path": ["a", 1.5, None, True],
                          "text": "naïve ☃ 𝄞"}
    assert type(tool_input["colour"]) is str and type(tool_input["size"]) is int
    assert tool_input is not given[1]["content"][0]["input"]


def test_a_tool_input_at_the_depth_limit_passes() -> None:
    """The limit refuses runaway nesting, not deep but reasonable input."""
    levels = _validate.MAX_JSON_DEPTH - 3  # message > content > block > input
    normalize_messages(tool_turn(deep(levels)))
    with pytest.raises(le.ConfigError, match="nested more than"):
        normalize_messages(tool_turn(deep(levels + 1)))


def test_the_message_never_echoes_the_value() -> None:
    """A refused string is named by position and code point, not shown."""
    with pytest.raises(le.ConfigError) as caught:
        normalize_messages([user("secret words \udc80")])
    assert "secret" not in str(caught.value)
    assert "character 13" in str(caught.value) and "U+DC80" in str(caught.value)


# -- tools and operations -------------------------------------------------------------


async def _noop(**_: Any) -> str:
    return ""


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"description": LONE}, "description"),
    ({"input_schema": {"type": "object", "description": LONE}}, "input_schema.description"),
    ({"input_schema": {"type": "object", "properties": {"x": {"default": float("nan")}}}},
     "input_schema.properties.x.default"),
    ({"input_schema": {"type": "object", "properties": {1: {}}}}, "input_schema.properties"),
    ({"input_schema": {"type": "object", "properties": [{"type": "string"}]}},
     "input_schema.properties"),
    ({"input_schema": {"type": "object", "required": "x"}}, "input_schema.required"),
    ({"input_schema": {"type": "object", "properties": {"x": {"minimum": "1"}}}},
     "input_schema.properties.x.minimum"),
    ({"input_schema": {"type": "object", "items": 3}}, "input_schema.items"),
    ({"input_schema": {"type": "object", "$ref": "#/$defs/a",
                       "$defs": {"a": {"$ref": "#/$defs/a"}}}}, "input_schema"),
    ({"input_schema": {"type": "object", "anyOf": [{"$ref": "#/$defs/a"}],
                       "$defs": {"a": {"allOf": [{"not": {"$ref": "#/$defs/b"}}]},
                                 "b": {"oneOf": [{"$ref": "#/$defs/a"}]}}}}, "input_schema"),
])
def test_a_tool_that_could_not_be_sent_or_checked_is_refused_when_defined(
    kwargs: dict[str, Any], field: str
) -> None:
    """A tool definition goes into every request: it is proven encodable, and its
    schema readable by the input check (no ``$ref`` loop), when the tool is built."""
    arguments: dict[str, Any] = {"description": "d", "input_schema": {"type": "object"},
                                 "handler": _noop, **kwargs}
    with pytest.raises(le.ConfigError) as caught:
        le.Tool("t", **arguments)
    assert caught.value.field == field


def test_a_recursive_schema_through_properties_is_a_tree_and_passes() -> None:
    """A schema that recurses through ``properties`` descends into the input, so it
    ends: allowed, and an input nested past the check's depth is an error line."""
    schema = {"type": "object", "properties": {"child": {"$ref": "#/$defs/node"}},
              "$defs": {"node": {"type": "object",
                                 "properties": {"child": {"$ref": "#/$defs/node"}}}}}
    tool = le.Tool("tree", "a tree", schema, _noop)
    assert tool.validate({"child": {"child": {}}}) == {"child": {"child": {}}}
    nested: Any = {}
    for _ in range(2000):
        nested = {"child": nested}
    assert any("nested too deep" in line for line in schema_errors(schema, nested))


@pytest.mark.parametrize("name", ["final\ud800", "final answer", "answer\n", "", "x" * 65])
async def test_a_terminal_tool_name_the_api_would_refuse_is_a_config_error(name: str) -> None:
    """``final_tool`` becomes a tool's name on the wire: it follows the tool-name rule."""
    ledger = MemoryLedger()
    engine = le.Engine(ScriptedProvider([Reply.final({"text": "x"})]), ledger=ledger)
    with pytest.raises(le.ConfigError) as caught:
        await engine.run(OPERATION, "q", output=Answer, final_tool=name)
    assert caught.value.field == "final_tool"
    assert ledger.invocations == {}


def test_a_tool_name_with_a_trailing_newline_is_refused() -> None:
    """The whole name must match (``$`` alone would let ``"name\\n"`` through)."""
    with pytest.raises(le.ConfigError) as caught:
        le.Tool("lookup\n", "d", {"type": "object"}, _noop)
    assert caught.value.field == "name"


async def test_a_rejection_whose_feedback_cannot_be_sent_becomes_the_generic_one() -> None:
    """``Reject`` feedback goes to the model: a lone surrogate in it is a ConfigError
    inside the judge, which rejects; the repair turn is sent with encodable text."""
    with pytest.raises(le.ConfigError) as caught:
        le.Reject(LONE)
    assert caught.value.field == "feedback"
    with FakeAnthropicServer([WireReply.text("first"), WireReply.text("second")]) as server:
        async with AnthropicProvider(api_key="test", base_url=server.url) as provider:
            engine = le.Engine(provider)
            result = await engine.run(
                OPERATION, "q", accept=lambda answer: answer == "second" or le.Reject(LONE))
    assert result.outcome is le.Outcome.COMPLETED and len(server.requests) == 2


def test_an_operation_whose_model_name_cannot_be_sent_is_refused() -> None:
    """The model name goes on the wire: a lone surrogate in it is a ConfigError."""
    with pytest.raises(le.ConfigError) as caught:
        le.Operation(name="x", provider="anthropic", model="claude\ud800", max_output_tokens=8)
    assert caught.value.field == "model"


def test_what_a_handler_returns_is_made_sendable() -> None:
    """A handler's result goes back to the model in the next request: lone
    surrogates become U+FFFD, and blocks JSON cannot carry are sent as text."""
    assert render_tool_output("a\ud800b") == "a\ufffdb"
    assert render_tool_output([{"type": "text", "text": "x\udc00"}]) == [
        {"type": "text", "text": "x\ufffd"}]
    assert render_tool_output({"k": "\ud800"}) == '{"k": "\ufffd"}'
    as_text = render_tool_output([{"type": "text", "text": float("nan")}])
    assert as_text == '[{"type": "text", "text": NaN}]'


async def test_a_terminal_tool_named_without_an_output_model_is_a_config_error() -> None:
    """``final_tool`` names the answer tool of a structured run: given to a run with
    no ``output`` it would do nothing, so it is refused before anything is recorded."""
    ledger = MemoryLedger()
    engine = le.Engine(ScriptedProvider([Reply.text("x")]), ledger=ledger)
    with pytest.raises(le.ConfigError, match="give output= too") as caught:
        await engine.run(OPERATION, "q", final_tool="submit")
    assert caught.value.field == "final_tool"
    assert ledger.invocations == {}
    result = await engine.run(OPERATION, "q", final_tool="final_answer")
    assert result.outcome is le.Outcome.COMPLETED
