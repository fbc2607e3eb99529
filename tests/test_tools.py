"""Tools: schemas from signatures, validation before handlers, sync handlers in threads."""

from __future__ import annotations

import dataclasses
import enum
import json
import threading
from typing import Annotated, Any, Literal

import pydantic
import pytest

import loopengine as le
from loopengine._jsonschema import schema_errors
from loopengine._tools import ToolInputError, render_tool_output
from loopengine.providers import Reply

from .conftest import EngineFactory, operation


def test_tool_schema_from_signature_and_docstring() -> None:
    """Parameters become the schema; the docstring describes the tool and its arguments."""

    @le.tool
    async def search_docs(query: str, limit: int = 5, scope: Literal["all", "faq"] = "all") -> str:
        """Search the product documentation.

        Args:
            query: What to search for.
            limit: How many results to return.
        """
        return query

    definition = search_docs.definition
    assert definition["name"] == "search_docs"
    assert definition["description"] == "Search the product documentation."
    schema = definition["input_schema"]
    assert schema["type"] == "object" and schema["required"] == ["query"]
    assert schema["properties"]["query"]["description"] == "What to search for."
    assert schema["properties"]["limit"]["default"] == 5
    assert schema["properties"]["scope"]["enum"] == ["all", "faq"]


def test_an_argument_s_description_keeps_its_deeper_lines() -> None:
    """A line indented deeper than the ``Args:`` entries continues the entry
    above it, even one that reads ``word: text`` (a list of choices)."""

    @le.tool
    def pick(mode: str, when: str) -> str:
        """Pick a mode.

        Args:
            mode: The mode, one of:
                fast: quick but rough.
                slow: careful.
            when (str): The time, e.g. 10:30.
        """
        return mode

    described = {name: field["description"]
                 for name, field in pick.input_schema["properties"].items()}
    assert described == {"mode": "The mode, one of: fast: quick but rough. slow: careful.",
                         "when": "The time, e.g. 10:30."}


async def test_a_parameter_s_own_field_is_kept() -> None:
    """A ``pydantic.Field`` as a parameter's default is its field (default and
    bounds), not a value handed to the handler; a description given in a
    ``Field`` (the default, or ``Annotated``) wins over the docstring's."""
    seen: list[tuple[int, int, list[int]]] = []

    @le.tool
    def page(start: Annotated[int, pydantic.Field(ge=0, description="First row.")],
             size: int = pydantic.Field(20, le=100, description="Rows a page."),
             tags: list[int] = pydantic.Field(default_factory=list),  # noqa: B008
             ) -> str:
        """Show a page.

        Args:
            start: Overridden by the field's own description.
            tags: Which tags.
        """
        seen.append((start, size, tags))
        return "shown"

    props = page.input_schema["properties"]
    assert page.input_schema["required"] == ["start"]
    assert (props["start"]["description"], props["start"]["minimum"]) == ("First row.", 0)
    assert (props["size"]["default"], props["size"]["maximum"]) == (20, 100)
    assert props["size"]["description"] == "Rows a page."
    assert props["tags"]["description"] == "Which tags."
    with pytest.raises(ToolInputError, match="size"):
        page.validate({"start": 0, "size": 101})
    await page.invoke(page.validate({"start": 3}))
    assert seen == [(3, 20, [])]


def test_function_tool_validation_is_strict_about_shape() -> None:
    """Missing and wrongly typed arguments are refused before the handler."""

    @le.tool(name="lookup", description="Look up.")
    def lookup(key: str, count: int = 1) -> str:
        return key

    assert lookup.validate({"key": "a"}).key == "a"
    with pytest.raises(ToolInputError, match="key"):
        lookup.validate({})
    with pytest.raises(ToolInputError, match="count"):
        lookup.validate({"key": "a", "count": "many"})


def test_raw_schema_tools_are_validated_with_json_schema() -> None:
    """A Tool given only an input_schema checks input against it."""
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 1},
                       "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["n"],
        "additionalProperties": False,
    }
    tool = le.Tool("count", "Count.", schema, lambda data: data["n"])
    assert tool.validate({"n": 2, "tags": ["a"]}) == {"n": 2, "tags": ["a"]}
    for bad, where in (({}, "input.n"), ({"n": 0}, "input.n"), ({"n": 1, "x": 1}, "input.x"),
                       ({"n": 1, "tags": [1]}, "input.tags[0]"), ({"n": True}, "input.n")):
        with pytest.raises(ToolInputError, match=where.replace("[", r"\[").replace("]", r"\]")):
            tool.validate(bad)


def test_json_schema_subset() -> None:
    """$ref, anyOf, enum, const and nullable types behave as JSON Schema says."""
    schema: dict[str, Any] = {
        "$defs": {"pos": {"type": "integer", "exclusiveMinimum": 0}},
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/pos"}, "b": {"anyOf": [{"type": "string"},
                                                                      {"type": "null"}]},
                       "c": {"enum": ["x", "y"]}, "d": {"const": 3},
                       "e": {"type": ["string", "null"], "maxLength": 2}},
    }
    assert schema_errors(schema, {"a": 1, "b": None, "c": "x", "d": 3, "e": None}) == []
    assert len(schema_errors(schema, {"a": 0, "b": 1, "c": "z", "d": 4, "e": "long"})) == 5


def test_tool_construction_errors() -> None:
    """Bad names, missing handlers and double schemas are ConfigErrors."""
    with pytest.raises(le.ConfigError, match="name"):
        le.Tool("has space", "d", {"type": "object"}, lambda x: x)
    with pytest.raises(le.ConfigError, match="handler"):
        le.Tool("t", "d", {"type": "object"}, None)

    class In(pydantic.BaseModel):
        x: int

    with pytest.raises(le.ConfigError, match="exactly one"):
        le.Tool("t", "d", {"type": "object"}, lambda x: x, input_model=In)
    with pytest.raises(le.ConfigError, match="object"):
        le.Tool("t", "d", {"type": "string"}, lambda x: x)


def test_render_tool_output() -> None:
    """Strings pass through; models and data become JSON; content blocks stay blocks."""

    class Out(pydantic.BaseModel):
        ok: bool

    assert render_tool_output("x") == "x"
    assert render_tool_output(None) == ""
    assert render_tool_output(Out(ok=True)) == '{"ok":true}'
    assert render_tool_output({"a": [1, 2]}) == '{"a": [1, 2]}'
    assert render_tool_output([{"type": "text", "text": "t"}]) == [{"type": "text", "text": "t"}]


async def test_records_that_only_look_like_content_blocks_are_sent_as_json(
        make_engine: EngineFactory) -> None:
    """A handler returning records with a ``type`` of ``text`` or ``image`` that
    are not content blocks (no ``text``, no ``source``) gives them as JSON text:
    as blocks the API would refuse the next request, and ``result.messages``
    would not be a history a run takes. Well-formed blocks stay blocks."""

    @le.tool
    def records(kind: str) -> Any:
        """List the records of a kind."""
        if kind == "blocks":
            return [{"type": "text", "text": "a cat"},
                    {"type": "image", "source": {"type": "url", "url": "https://x/cat.png"}}]
        return [{"type": "text", "value": 3}, {"type": "image", "name": "cat.png"}]

    engine, provider, _ = make_engine(
        Reply.tool_calls(("records", {"kind": "data"}), ("records", {"kind": "blocks"})),
        Reply.text("two records"), Reply.text("again"))
    result = await engine.run(operation(), "go", tools=[records])
    data, blocks = provider.requests[1].messages[-1]["content"]
    assert json.loads(data["content"]) == [{"type": "text", "value": 3},
                                           {"type": "image", "name": "cat.png"}]
    assert [b["type"] for b in blocks["content"]] == ["text", "image"]
    again = await engine.run(operation(), [*result.messages, {"role": "user", "content": "more"}])
    assert again.outcome is le.Outcome.COMPLETED


def test_data_holding_models_is_rendered_as_json() -> None:
    """Models, dataclasses, enum members and sets inside a returned value reach the
    model as JSON, not as their Python reprs ("n=1", "<Kind.A: 'a'>", "{1, 2}")."""

    class Kind(enum.Enum):
        A = "a"

    class Item(pydantic.BaseModel):
        n: int

    @dataclasses.dataclass
    class Row:
        kind: Kind
        tags: set[str]

    assert render_tool_output([Item(n=1), Item(n=2)]) == '[{"n": 1}, {"n": 2}]'
    assert json.loads(render_tool_output({"row": Row(Kind.A, {"x"}), "raw": b"ok"})) == {
        "row": {"kind": "a", "tags": ["x"]}, "raw": "ok"}


async def test_sync_handlers_run_in_a_worker_thread(make_engine: EngineFactory) -> None:
    """A sync handler does not run on the event loop's thread."""
    loop_thread = threading.get_ident()
    seen: list[int] = []

    @le.tool
    def where(key: str) -> str:
        """Report the thread."""
        seen.append(threading.get_ident())
        return "here"

    engine, _, _ = make_engine(Reply.tool_calls(("where", {"key": "k"})), Reply.text("done"))
    result = await engine.run(operation(), "go", tools=[where])
    assert result.outcome is le.Outcome.COMPLETED
    assert seen and seen[0] != loop_thread


async def test_input_model_tools_receive_a_model_instance(make_engine: EngineFactory) -> None:
    """Tool(input_model=...) hands the handler the validated model."""

    class Query(pydantic.BaseModel):
        text: str

    got: list[Query] = []

    async def handle(query: Query) -> str:
        got.append(query)
        return "found"

    search = le.Tool("search", "Search.", handler=handle, input_model=Query)
    engine, _, _ = make_engine(Reply.tool_calls(("search", {"text": "q"})), Reply.text("done"))
    await engine.run(operation(), "go", tools=[search])
    assert got == [Query(text="q")]


async def test_duplicate_tool_names_are_refused(make_engine: EngineFactory) -> None:
    """Two tools with one name, or a tool named like the terminal tool, are ConfigErrors."""
    one = le.Tool("t", "d", {"type": "object"}, lambda x: x)
    engine, provider, _ = make_engine(Reply.text("x"))
    with pytest.raises(le.ConfigError, match="two tools"):
        await engine.run(operation(), "go", tools=[one, one])

    class Out(pydantic.BaseModel):
        x: int

    final = le.Tool("final_answer", "d", {"type": "object"}, lambda x: x)
    with pytest.raises(le.ConfigError, match="terminal"):
        await engine.run(operation(), "go", tools=[final], output=Out)
    assert provider.requests == []


@pytest.mark.parametrize("kind", ["wat", ["string", "strng"], "String"])
def test_a_schema_type_that_json_schema_lacks_is_refused_when_the_tool_is_built(
    kind: Any,
) -> None:
    """``{"type": "wat"}`` let every input pass the check, and the API refuses the
    tool's definition (a 400 after the attempt's row): a ConfigError naming it."""
    schema = {"type": "object", "properties": {"a": {"type": kind}}}
    with pytest.raises(le.ConfigError, match="not a JSON Schema type") as caught:
        le.Tool("t", "d", schema, lambda x: x)
    assert caught.value.field == "input_schema.properties.a.type"
