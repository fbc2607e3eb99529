"""Output models and tool signatures as the APIs receive them and the engine
checks them: a recursive model's schema is an object at its root, through
each provider's real SDK to a fake that refuses what the API refuses."""

from __future__ import annotations

import contextlib
import datetime
import enum
import warnings
from collections.abc import Iterator
from typing import Any

import pydantic
import pytest

import loopengine as le
from loopengine.providers import (
    AnthropicProvider,
    GeminiProvider,
    OpenAIProvider,
    OpenAIResponsesProvider,
    ScriptedProvider,
)
from loopengine.testing import FakeAnthropicServer, FakeGeminiServer, FakeOpenAIServer, Reply

ROUTES = {"anthropic": "claude-sonnet-4-5", "openai": "gpt-4o",
          "openai-responses": "gpt-5", "gemini": "gemini-2.5-flash"}


@contextlib.contextmanager
def served(route: str, *script: Any) -> Iterator[tuple[Any, le.Provider]]:
    """A fake of ``route``'s API serving ``script``, and a provider sending to it."""
    if route == "anthropic":
        with FakeAnthropicServer(script) as server:
            yield server, AnthropicProvider(api_key="test", base_url=server.url)
    elif route == "gemini":
        with FakeGeminiServer(script) as server:
            yield server, GeminiProvider(api_key="test",
                                         http_options={"base_url": server.url})
    else:
        with FakeOpenAIServer(script) as server:
            provider: le.Provider = (
                OpenAIProvider(api_key="sk-test", base_url=server.base_url)
                if route == "openai" else
                OpenAIResponsesProvider(api_key="sk-test", base_url=server.base_url,
                                        route=route))
            yield server, provider


def operation(route: str) -> le.Operation:
    return le.Operation(name="probe", provider=route, model=ROUTES[route],
                        max_output_tokens=256)


def tool_schemas(route: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The input schemas of a request body's function tools, as sent."""
    tools = body["tools"]
    if route == "anthropic":
        return [t["input_schema"] for t in tools]
    if route == "openai":
        return [t["function"]["parameters"] for t in tools]
    if route == "openai-responses":
        return [t["parameters"] for t in tools]
    return [d["parameters_json_schema"] for t in tools for d in t["functionDeclarations"]]


class Node(pydantic.BaseModel):
    value: int
    children: list[Node] = []


TREE = {"value": 1, "children": [{"value": 2, "children": [{"value": 3}]}]}


@pytest.mark.parametrize("route", ROUTES)
async def test_a_recursive_output_model_is_sent_as_an_object(route: str) -> None:
    """pydantic gives a recursive model's schema as a bare ``$ref`` to its own
    definition; the Messages API and OpenAI's refuse a tool whose schema does
    not say ``"type": "object"`` at its root, so the definition is put there."""
    with served(route, Reply.final(TREE), Reply.final(TREE)) as (server, provider):
        async with provider:
            engine = le.Engine(provider)
            result = await engine.run(operation(route), "Build the tree.", output=Node)
            called = await engine.call(operation(route), "Build the tree.", output=Node)
        bodies = [r.body for r in server.requests]

    assert result.outcome is le.Outcome.COMPLETED, result.detail
    assert result.answer == Node.model_validate(TREE)
    assert called.data == Node.model_validate(TREE)
    for body in bodies:
        (schema,) = tool_schemas(route, body)
        assert schema["type"] == "object"
        assert "$ref" not in schema and "title" not in schema
        assert schema["properties"]["children"]["items"] == {"$ref": "#/$defs/Node"}
        assert schema["$defs"]["Node"]["type"] == "object"


@pytest.mark.parametrize("route", ["anthropic", "openai", "openai-responses"])
async def test_the_fakes_refuse_a_tool_schema_that_is_not_an_object(route: str) -> None:
    """The fakes refuse, as the APIs do, a tool whose schema is not an object's
    at its root (a raw ``input_schema`` can still say so only through a ``$ref``)."""
    ref = le.Tool("lookup", "Look up.", {"type": "object"}, lambda _: "ok")
    ref.input_schema = {"$ref": "#/$defs/n", "$defs": {"n": {"type": "object"}}}
    with served(route, Reply.text("never")) as (server, provider):
        async with provider:
            result = await le.Engine(provider).run(operation(route), "Look.", tools=[ref])

    assert result.outcome is le.Outcome.PROVIDER_ERROR
    assert "type" in str(result.detail)
    assert server.responses_served == 0


def lookup(model_config: str, /, _limit: int = 2, *, schema: str = "plain") -> str:
    """Look a setting up.

    Args:
        model_config: The setting's name.
        _limit: How many to show.
        schema: How to show them.
    """
    return f"{model_config}:{_limit}:{schema}"


@pytest.mark.parametrize("route", ROUTES)
async def test_a_tool_s_parameters_keep_their_names_and_kinds(route: str) -> None:
    """A function's parameters are the tool's input whatever their names (one
    pydantic keeps for itself, one with a leading underscore, one shadowing a
    `BaseModel` method) and kinds: a positional-only one is passed by position."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # pydantic's "shadows an attribute" among them
        tool = le.tool(lookup)
    call = Reply.tool_calls(("lookup", {"model_config": "tz", "_limit": 5, "schema": "json"}))
    with served(route, call, Reply.tool_calls(("lookup", {"model_config": 3})),
                Reply.text("Done.")) as (server, provider):
        async with provider:
            result = await le.Engine(provider).run(operation(route), "Look.", tools=[tool])
        (schema,) = tool_schemas(route, server.requests[0].body)

    assert result.outcome is le.Outcome.COMPLETED, result.detail
    assert list(schema["properties"]) == ["model_config", "_limit", "schema"]
    assert schema["required"] == ["model_config"]
    assert schema["properties"]["_limit"]["description"] == "How many to show."
    (first,) = result.messages[2]["content"]
    assert first["content"] == "tz:5:json" and not first.get("is_error")
    (second,) = result.messages[4]["content"]
    assert second["is_error"] is True
    assert second["content"] == ("Invalid input for lookup: model_config: Input should be "
                                 "a valid string")


class Reading(pydantic.BaseModel):
    celsius: float

    @pydantic.field_validator("celsius")
    @classmethod
    def physical(cls, value: float) -> float:
        if value < -273.15:
            # A bug of the model's author: pydantic turns only a ValueError or
            # an AssertionError into a validation error.
            raise TypeError(f"below absolute zero: {value}")
        return value


@pytest.mark.parametrize("route", ROUTES)
async def test_r10_an_answer_whose_validator_raises_is_repaired(
        route: str, caplog: pytest.LogCaptureFixture) -> None:
    """A validator that raises what pydantic does not turn into a validation
    error fails the answer's check (R10): the model is told and answers again;
    the bug is logged at ERROR with its message withheld."""
    with served(route, Reply.final({"celsius": -300}), Reply.final({"celsius": 21.5})
                ) as (_, provider):
        async with provider:
            result = await le.Engine(provider).run(operation(route), "Read it.",
                                                   output=Reading)

    assert result.outcome is le.Outcome.COMPLETED, result.detail
    assert result.answer == Reading(celsius=21.5)
    (feedback,) = result.messages[2]["content"]
    assert feedback["is_error"] is True
    assert feedback["content"] == ("The answer does not match the required schema: "
                                   "a check of the input raised TypeError")
    (record,) = [r for r in caplog.records if "validator" in r.getMessage()]
    assert record.levelname == "ERROR"
    assert "absolute zero: -300" not in caplog.text  # the source line is in the traceback


async def test_a_call_whose_validator_raises_retries_natively_and_in_the_prompt() -> None:
    """The same in `Engine.call`, in both its modes: each failed check is an
    invalid answer, retried within the call's attempts."""
    sp = ScriptedProvider([Reply.final({"celsius": -300}), Reply.text('{"celsius": -301}')])
    op = le.Operation(name="probe", provider=sp.name, model="m", max_output_tokens=64,
                      retry=le.RetryPolicy(max_attempts=3))
    with pytest.raises(le.StructuredOutputError) as failed:
        await le.Engine(sp).call(op, "Read it.", output=Reading, prompt_fallback=True,
                                 retry={"max_attempts": 2})
    assert failed.value.attempts == 2
    assert failed.value.detail == "a check of the input raised TypeError"
    assert [r.metadata["mode"] for r in sp.requests] == ["native", "prompt"]


async def test_r15_a_tool_input_whose_validator_raises_is_an_error_result() -> None:
    @le.tool
    def log_reading(reading: Reading) -> str:
        """Log a reading."""
        return "logged"

    sp = ScriptedProvider([Reply.tool_calls(("log_reading", {"reading": {"celsius": -300}})),
                           Reply.text("Done.")])
    op = le.Operation(name="probe", provider=sp.name, model="m", max_output_tokens=64)
    result = await le.Engine(sp).run(op, "Log it.", tools=[log_reading])

    assert result.outcome is le.Outcome.COMPLETED
    (answer,) = result.messages[2]["content"]
    assert answer == {"type": "tool_result", "tool_use_id": answer["tool_use_id"],
                      "content": "Invalid input for log_reading: a check of the input "
                                 "raised TypeError", "is_error": True}


class Kind(enum.Enum):
    SHORT = "short"
    LONG = "long"


class Booking(pydantic.BaseModel):
    """A strict model: in Python mode it takes only a date, a `Kind`, a tuple."""

    model_config = pydantic.ConfigDict(strict=True)

    day: datetime.date
    kind: Kind
    slot: tuple[int, int]


BOOKING = {"day": "2026-01-02", "kind": "long", "slot": [9, 11]}
BOOKED = Booking(day=datetime.date(2026, 1, 2), kind=Kind.LONG, slot=(9, 11))


@pytest.mark.parametrize("route", ROUTES)
async def test_a_strict_model_takes_the_json_the_model_sent(route: str) -> None:
    """The model's answer (and a tool's input) is JSON, so a strict model checks it
    as JSON: a date as its string, an enum member as its value, a tuple as an array.
    Checked in Python mode, every answer was invalid, whatever the model sent."""
    seen: list[Booking] = []

    @le.tool
    def book(booking: Booking) -> str:
        """Book a slot."""
        seen.append(booking)
        return "booked"

    with served(route, Reply.tool_calls(("book", {"booking": BOOKING})), Reply.final(BOOKING),
                Reply.final(BOOKING)) as (_, provider):
        async with provider:
            engine = le.Engine(provider)
            result = await engine.run(operation(route), "Book it.", output=Booking,
                                      tools=[book])
            called = await engine.call(operation(route), "Book it.", output=Booking,
                                       retry={"max_attempts": 1})

    assert result.outcome is le.Outcome.COMPLETED, result.detail
    assert seen == [BOOKED] and result.answer == BOOKED and called.data == BOOKED
    with pytest.raises(le.StructuredOutputError):  # JSON mode still strict: no "9" for 9
        await le.Engine(ScriptedProvider([Reply.final({**BOOKING, "slot": ["9", "11"]})])).call(
            le.Operation(name="probe", provider="anthropic", model="m", max_output_tokens=64),
            "Book it.", output=Booking, retry={"max_attempts": 1})


@pytest.mark.parametrize("route", ROUTES)
async def test_a_structured_transcript_continued_without_tools(route: str) -> None:
    """A structured run's transcript ends with its terminal tool's call and result.
    Continued by a run given no tools, the Messages API refuses it (tool blocks
    and no tools): AnthropicProvider refuses it before the wire, saying how to
    fix it, and the fake answers it with the API's 400; the other APIs take it."""
    with served(route, Reply.final({"value": 1}), Reply.text("Nothing more."),
                Reply.final({"value": 2})) as (server, provider):
        async with provider:
            engine = le.Engine(provider)
            first = await engine.run(operation(route), "Build the tree.", output=Node)
            history = [*first.messages, {"role": "user", "content": "Anything else?"}]
            continued = await engine.run(operation(route), history)
            sent = len(server.requests)
            if route == "anthropic":  # given its terminal tool again, it is sent
                again = await engine.run(operation(route), history, output=Node)

    assert first.outcome is le.Outcome.COMPLETED
    if route != "anthropic":
        assert continued.outcome is le.Outcome.COMPLETED and continued.answer == "Nothing more."
        return
    assert continued.outcome is le.Outcome.PROVIDER_ERROR
    assert "must define tools" in str(continued.detail)
    assert "give it the tools its transcript calls" in str(continued.detail)
    assert continued.attempts.count == 0 and sent == 1  # refused before the wire
    assert again.outcome is le.Outcome.COMPLETED and again.answer == Node(value=2)


async def test_the_fake_messages_api_refuses_tool_blocks_without_tools() -> None:
    """What production answers, the fake answers: an ``anthropic`` client sending
    a transcript with tool blocks and no tools gets the API's 400."""
    import anthropic

    history = [{"role": "user", "content": "Look."},
               {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                                  "name": "look", "input": {}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                             "content": "found"}]}]
    with FakeAnthropicServer([Reply.text("never")]) as server:
        async with anthropic.AsyncAnthropic(api_key="test", base_url=server.url,
                                            max_retries=0) as client:
            with pytest.raises(anthropic.BadRequestError, match="must define tools"):
                await client.messages.create(model="claude-sonnet-4-5", max_tokens=64,
                                             messages=history)  # type: ignore[arg-type]
        assert server.responses_served == 0


@pytest.mark.parametrize("route", ROUTES)
async def test_a_call_s_prompt_fallback_is_a_request_the_api_takes(route: str) -> None:
    """After native attempts failed validation, the fallback asks for the answer as
    text; its messages hold those attempts' tool calls and error results, so it
    keeps the answer tool defined (``tool_choice`` none), as the Messages API
    requires, and every API takes it."""
    with served(route, Reply.final({"wrong": 1}), Reply.final({"wrong": 2}),
                Reply.text('Here: {"value": 4, "children": []}')) as (server, provider):
        async with provider:
            called = await le.Engine(provider).call(operation(route), "Build the tree.",
                                                    output=Node, prompt_fallback=True)
        fallback = server.requests[-1].body

    assert called.data == Node(value=4)
    assert called.attempts.structured_output == "prompt" and called.attempts.count == 3
    (schema,) = tool_schemas(route, fallback)
    assert schema["type"] == "object"


class Span(pydantic.BaseModel):
    bounds: tuple[int, int]
    labels: tuple[()] | list[str]


@pytest.mark.parametrize("route", ["openai", "openai-responses"])
async def test_a_tuple_is_sent_with_items_as_openai_requires(route: str) -> None:
    """pydantic gives a tuple as ``prefixItems`` and bounds, without ``items``;
    both OpenAI APIs refuse an array schema without ``items`` ("array schema
    missing items"), so it goes with ``"items": {}``, which means the same
    (the fake refuses it without, as the API does)."""
    with served(route, Reply.final({"bounds": [1, 2], "labels": []})) as (server, provider):
        async with provider:
            called = await le.Engine(provider).call(operation(route), "Bound it.", output=Span)
        (schema,) = tool_schemas(route, server.requests[0].body)

    assert called.data == Span(bounds=(1, 2), labels=[])
    bounds = schema["properties"]["bounds"]
    assert bounds["items"] == {} and bounds["maxItems"] == 2 and len(bounds["prefixItems"]) == 2
    assert schema["properties"]["labels"]["anyOf"][0]["items"] == {}


async def test_the_fake_openai_apis_refuse_an_array_schema_without_items() -> None:
    """What production answers, the fake answers: an ``openai`` client sending a
    function whose parameters hold an array schema without ``items`` gets the
    API's 400, naming where it is, from both APIs."""
    import openai

    parameters: dict[str, Any] = {"type": "object", "properties": {"pair": {
        "type": "array", "prefixItems": [{"type": "integer"}, {"type": "integer"}]}}}
    with FakeOpenAIServer([Reply.text("never")]) as server:
        async with openai.AsyncOpenAI(api_key="sk-test", base_url=server.base_url,
                                      max_retries=0) as client:
            with pytest.raises(openai.BadRequestError, match=r"In context=\('properties', "
                               r"'pair'\), array schema missing items"):
                await client.chat.completions.create(
                    model="gpt-4o", messages=[{"role": "user", "content": "Pair?"}],
                    tools=[{"type": "function", "function": {"name": "pair",
                                                             "parameters": parameters}}])
            with pytest.raises(openai.BadRequestError, match="array schema missing items"):
                await client.responses.create(
                    model="gpt-4o", input="Pair?", tools=[
                        {"type": "function", "name": "pair", "parameters": parameters,
                         "strict": False}])
            either = {"type": "object", "properties": {"a": {"type": "string"}},
                      "anyOf": [{"required": ["a"]}]}
            with pytest.raises(openai.BadRequestError, match="not have 'oneOf'/'anyOf'/"
                               "'allOf'/'enum'/'not' at the top level"):
                await client.chat.completions.create(
                    model="gpt-4o", messages=[{"role": "user", "content": "Pair?"}],
                    tools=[{"type": "function", "function": {"name": "pair",
                                                             "parameters": either}}])
        assert server.responses_served == 0


EITHER = le.Tool("find", "Find by name or id.", {
    "type": "object", "properties": {"name": {"type": "string"}, "id": {"type": "string"}},
    "anyOf": [{"required": ["name"]}, {"required": ["id"]}]}, lambda _: "found")
"""A tool whose schema has ``anyOf`` at its root, as an MCP server's "give one of
these" rule is written."""


@pytest.mark.parametrize("route", ["anthropic", "openai-responses"])
async def test_a_tool_with_any_of_at_its_schema_s_root_is_refused_before_the_wire(
    route: str,
) -> None:
    """The Messages API and the Responses API refuse a tool whose schema has
    ``anyOf`` at its root: the run is refused before its attempt is recorded or
    sent, naming the tool, where the fakes (as the APIs) answer with a 400."""
    either = EITHER
    with served(route, Reply.text("never")) as (server, provider):
        async with provider:
            result = await le.Engine(provider).run(operation(route), "Find it.", tools=[either])
        assert server.requests == []

    assert result.outcome is le.Outcome.PROVIDER_ERROR and result.attempts.count == 0
    assert result.fault is not None and "'find'" in result.fault.message
    assert "'anyOf' at its root" in result.fault.message


def test_chat_completions_refuses_such_a_tool_on_openai_s_own_api_only() -> None:
    """OpenAI's Chat Completions API (and Azure's) refuses the tool above, so a
    provider sending to it refuses it before the wire; another server that
    speaks the wire format (vLLM, Ollama, OpenRouter) takes such schemas, so
    a provider sending there leaves it to the server, as it did."""
    from loopengine.providers import ProviderRequest

    request = ProviderRequest(model="gpt-4o", max_tokens=16, messages=[
        {"role": "user", "content": "Find it."}], tools=[EITHER.definition])
    with pytest.raises(le.ProviderFault, match="'find': its input schema has 'anyOf' at "
                                               "its root"):
        OpenAIProvider(api_key="sk-test").check_request(request)
    with pytest.raises(le.ProviderFault, match="'anyOf' at its root"):
        OpenAIProvider(api_key="sk-test", azure_endpoint="https://x.openai.azure.com",
                       api_version="2024-10-21").check_request(request)
    for compatible in ("http://127.0.0.1:8000/v1", "https://openrouter.ai/api/v1"):
        OpenAIProvider(api_key="sk-test", base_url=compatible).check_request(request)


class Contact(pydantic.BaseModel):
    name: str = pydantic.Field(alias="full name")


async def test_a_property_name_the_messages_api_refuses_is_refused_before_the_wire() -> None:
    """The Messages API refuses a tool whose input schema names a property, at its
    root, outside ``^[a-zA-Z0-9_.-]{1,64}$`` (an alias with a space): the call
    is refused before its attempt is recorded or sent, saying what to rename,
    where the fake (as the API) would answer its request with a 400."""
    with served("anthropic", Reply.final({"full name": "Ada"})) as (server, provider):
        async with provider:
            with pytest.raises(le.ProviderError) as raised:
                await le.Engine(provider).call(operation("anthropic"), "Who?", output=Contact)
        assert server.requests == []

    assert raised.value.attempts == 0
    assert raised.value.fault.error_code == "invalid_request_error"
    assert "'full name'" in str(raised.value) and "alias" in str(raised.value)


async def test_the_fake_messages_api_refuses_the_tool_schemas_the_api_refuses() -> None:
    """What production answers, the fake answers: an ``anthropic`` client defining
    a tool with a property named outside the pattern, or with ``anyOf`` at its
    schema's root, gets the API's 400; the pattern holds for the names at the
    schema's root, and ``anyOf`` is taken inside a property."""
    import anthropic

    def tool(name: str) -> Any:
        return {"name": "look", "input_schema": {"type": "object", "properties": {
            name: {"type": "object", "properties": {"any key": {"type": "string"}},
                   "anyOf": [{"required": ["any key"]}]}}}}

    with FakeAnthropicServer([Reply.text("taken")]) as server:
        async with anthropic.AsyncAnthropic(api_key="test", base_url=server.url,
                                            max_retries=0) as client:
            for name in ("full name", "@type", "x" * 65):
                with pytest.raises(anthropic.BadRequestError, match=r"tools\.0\.custom\."
                                   r"input_schema\.properties: Property keys should match"):
                    await client.messages.create(
                        model="claude-sonnet-4-5", max_tokens=64, tools=[tool(name)],
                        messages=[{"role": "user", "content": "Look."}])
            either = tool("key")
            either["input_schema"]["anyOf"] = [{"required": ["key"]}]
            with pytest.raises(anthropic.BadRequestError, match="does not support oneOf, "
                               "allOf, or anyOf at the top level"):
                await client.messages.create(
                    model="claude-sonnet-4-5", max_tokens=64, tools=[either],
                    messages=[{"role": "user", "content": "Look."}])
            taken = await client.messages.create(
                model="claude-sonnet-4-5", max_tokens=64, tools=[tool("a.b-c_" + "x" * 58)],
                messages=[{"role": "user", "content": "Look."}])
        assert taken.content[0].text == "taken"  # type: ignore[union-attr]
        assert server.responses_served == 1
