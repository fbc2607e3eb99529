"""Bad input is caught before a request is opened: messages and
system blocks are checked against the shapes the `anthropic` SDK declares, tools
against what `Engine.run` and `le.tool` accept; each gets a ConfigError naming the
field, and nothing is sent or recorded."""

from __future__ import annotations

import functools
import logging
import time
import timeit
from typing import Any

import pydantic
import pytest

import loopengine as le
from loopengine import _validate
from loopengine._engine import normalize_messages, normalize_system
from loopengine.persistence import MemoryLedger
from loopengine.providers import AnthropicProvider, Reply, ScriptedProvider
from loopengine.testing import FakeAnthropicServer
from loopengine.testing import Reply as WireReply

OPERATION = le.Operation(name="validation.test", provider="anthropic",
                         model="claude-validation-test", max_output_tokens=64)


class Answer(pydantic.BaseModel):
    text: str


def user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


def assistant(content: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": content}


TOOL_TURN = [
    user("Look it up."),
    assistant([{"type": "tool_use", "id": "t1", "name": "lookup", "input": {"key": "k"}}]),
]

BAD_MESSAGES = [
    # the example: a content block without a type
    ([user("q"), assistant([{"text": "no type"}])], "messages[1].content[0].type"),
    ([user([{"type": "", "text": "x"}])], "messages[0].content[0].type"),
    ([user([{"type": 3, "text": "x"}])], "messages[0].content[0].type"),
    ([user([{"type": "text"}])], "messages[0].content[0].text"),
    ([user([{"type": "text", "text": 3}])], "messages[0].content[0].text"),
    ([user([{"type": "image", "source": {"type": "url"}}])],
     "messages[0].content[0].source.url"),
    ([user([{"type": "image", "source": {"type": "base64", "media_type": "image/png"}}])],
     "messages[0].content[0].source.data"),
    ([user([{"type": "image", "source": {"type": "ftp", "url": "x"}}])],
     "messages[0].content[0].source.type"),
    ([user([{"type": "text", "text": "x", "cache_control": {"type": "ephemeral",
                                                            "ttl": "5h"}}])],
     "messages[0].content[0].cache_control.ttl"),
    ([*TOOL_TURN, user([{"type": "tool_result", "tool_use_id": "t1",
                         "content": [{"type": "text", "text": "ok"}, {"type": "text"}]}])],
     "messages[2].content[0].content[1].text"),
    ([*TOOL_TURN, user([{"type": "tool_result", "tool_use_id": "t1", "is_error": "yes"}])],
     "messages[2].content[0].is_error"),
    ([*TOOL_TURN, user([{"type": "tool_result", "content": "ok"}])],
     "messages[2].content[0].tool_use_id"),
    ([user("q"), assistant([{"type": "tool_use", "id": "t1", "name": "f", "input": [1]}])],
     "messages[1].content[0].input"),
    ([user("q"), "not a dict"], "messages[1]"),
    ([user(["not a block"])], "messages[0].content[0]"),
    ([user(3)], "messages[0].content"),
    ([user("")], "messages[0].content"),
    ([user([])], "messages[0].content"),
    ([user("q"), assistant(""), user("again")], "messages[1].content"),
    # the example: a conversation that starts with the assistant
    ([assistant("Hello"), user("q")], "messages[0].role"),
    ([{"role": "system", "content": "rules"}, user("q")], "messages[0].role"),
    ([user("q"), {"role": "tool", "content": "x"}], "messages[1].role"),
    ([{"role": "user", "content": "q", "name": "sam"}], "messages[0].name"),
    ([], "messages"),
    ("", "messages"),
    # what the API refuses with a 400: no non-whitespace text in a user message
    (" \n\t", "messages"),
    ([user("  ")], "messages[0].content"),
    ([user([{"type": "text", "text": ""}])], "messages[0].content[0].text"),
    ([user([{"type": "text", "text": "x"}, {"type": "text", "text": ""}])],
     "messages[0].content[1].text"),
    ([user([{"type": "text", "text": " "}, {"type": "text", "text": "\n"}])],
     "messages[0].content[0].text"),
]


@pytest.mark.parametrize(("messages", "field"), BAD_MESSAGES)
async def test_bad_messages_are_refused_naming_the_path_before_anything_is_sent(
    messages: Any, field: str
) -> None:
    """Each malformed message or block is a ConfigError whose field is its path; the
    provider gets no request and the ledger no row."""
    provider = ScriptedProvider([Reply.text("x")])
    ledger = MemoryLedger()
    engine = le.Engine(provider, ledger=ledger)
    with pytest.raises(le.ConfigError) as caught:
        await engine.run(OPERATION, messages)
    assert caught.value.field == field
    assert provider.requests == []
    assert ledger.invocations == {}


@pytest.mark.parametrize(("messages", "field"), BAD_MESSAGES[:3])
async def test_calls_and_estimates_refuse_the_same_messages(messages: Any, field: str) -> None:
    """Engine.call and Engine.estimate check messages as Engine.run does."""
    provider = ScriptedProvider([Reply.text("x")])
    engine = le.Engine(provider)
    with pytest.raises(le.ConfigError) as caught:
        await engine.call(OPERATION, messages, output=Answer)
    assert caught.value.field == field
    with pytest.raises(le.ConfigError) as caught:
        engine.estimate(OPERATION, messages)
    assert caught.value.field == field
    assert provider.requests == []


@pytest.mark.parametrize(("system", "field", "says"), [
    ([{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "2h"}}],
     "system[0].cache_control.ttl", "'5m' or '1h'"),
    ([{"type": "text"}], "system[0].text", "is required"),
    ([{"type": "text", "text": "x"}, {"type": "image"}], "system[1]", "text block"),
])
async def test_bad_system_blocks_are_refused_naming_the_path(
    system: Any, field: str, says: str
) -> None:
    """System blocks are the SDK's TextBlockParam: a bad marker or a missing text is named."""
    engine = le.Engine(ScriptedProvider([Reply.text("x")]))
    with pytest.raises(le.ConfigError, match=says) as caught:
        await engine.run(OPERATION, "q", system=system)
    assert caught.value.field == field


def test_messages_of_every_common_shape_pass_unchanged() -> None:
    """Valid input of the shapes the SDK declares passes, and the copy equals it."""
    messages = [
        user([
            {"type": "text", "text": "Look at these.", "cache_control": {"type": "ephemeral",
                                                                         "ttl": "1h"}},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "aGVsbG8="}},
            {"type": "image", "source": {"type": "url", "url": "https://example.test/a.png"}},
            {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                            "data": "plain"}, "title": "notes"},
        ]),
        assistant([
            {"type": "thinking", "thinking": "hmm", "signature": "sig"},
            {"type": "text", "text": "Checking.", "citations": None},
            {"type": "tool_use", "id": "t1", "name": "lookup", "input": {"key": [1, {"a": 2}]}},
        ]),
        user([{"type": "tool_result", "tool_use_id": "t1", "is_error": False, "content": [
            {"type": "text", "text": "found"},
            {"type": "search_result", "source": "s", "title": "t",
             "content": [{"type": "text", "text": "body"}]},
        ]}]),
        assistant("Here it is."),
        user("Thanks."),
        assistant(""),  # a final assistant message may be empty: a prefill
    ]
    assert normalize_messages(messages) == messages


async def test_a_scripted_provider_answers_a_prefill_with_thinking() -> None:
    """A final assistant message while thinking is on is a rule of the Messages API,
    which `AnthropicProvider` applies before the wire: the engine leaves it to the
    provider, and a scripted one answers whatever it is sent."""
    provider = ScriptedProvider([Reply.text(" blue")])
    engine = le.Engine(provider)
    thinking = le.Operation(name="t", provider="anthropic", model="claude-sonnet-4-5",
                            thinking=le.Thinking(budget_tokens=1024), max_output_tokens=4096)
    prefill = [user("Name a colour."), assistant("The colour is")]
    result = await engine.run(thinking, prefill)
    assert result.outcome is le.Outcome.COMPLETED, result.fault
    (request,) = provider.requests
    assert request.features.thinking is not None and request.messages[-1] == prefill[-1]


async def test_a_transcript_the_api_returned_can_be_continued() -> None:
    """result.messages of a run over the real SDK (tool use, tool result, answer) passes
    the check when sent again with a new user message: no false alarm on the API's own
    blocks."""

    @le.tool
    async def lookup(key: str) -> str:
        """Look a key up."""
        return f"value of {key}"

    with FakeAnthropicServer([
        WireReply.tool_calls(("lookup", {"key": "k"}), text="Let me look."),
        WireReply.text("It is the value of k."),
        WireReply.text("You are welcome."),
    ]) as server:
        async with AnthropicProvider(api_key="test", base_url=server.url) as provider:
            engine = le.Engine(provider)
            first = await engine.run(OPERATION, "What is k?", tools=[lookup])
            again = await engine.run(OPERATION, [*first.messages, user("Thanks!")],
                                     tools=[lookup])
    assert (first.outcome, again.outcome) == (le.Outcome.COMPLETED, le.Outcome.COMPLETED)
    assert len(server.requests) == 3


def test_a_bad_block_message_never_echoes_long_content() -> None:
    """A type not allowed here is shown only when short; the error lists the allowed ones."""
    with pytest.raises(le.ConfigError) as caught:
        normalize_system([{"type": "text", "text": "ok"}, {"type": "x" * 1000, "text": "secret"}])
    with pytest.raises(le.ConfigError) as caught:
        _validate.content_block("system[1]", {"type": "x" * 1000, "text": "secret"},
                                kinds=("text",))
    assert "x" * 100 not in str(caught.value)
    assert "secret" not in str(caught.value)
    assert "expected one of text" in str(caught.value)


def test_the_block_types_come_from_the_installed_sdk() -> None:
    """The known types are read from anthropic.types.MessageParam, not a list of our own."""
    assert {"text", "image", "document", "tool_use", "tool_result", "thinking",
            "redacted_thinking", "search_result"} <= set(_validate.block_types())


def test_a_50_message_transcript_validates_well_under_a_millisecond() -> None:
    """The check runs on every run: 50 messages (75 blocks, tool results included)
    validate in a fraction of a millisecond of CPU (this process's CPU time, best of
    several, so other processes' load does not count; the bound is generous: about
    0.3 ms measured)."""
    messages: list[dict[str, Any]] = [user("first question")]
    for i in range(24):
        messages.append(assistant([
            {"type": "text", "text": "thinking about it " * 10},
            {"type": "tool_use", "id": f"t{i}", "name": "lookup", "input": {"key": "k"}}]))
        messages.append(user([{"type": "tool_result", "tool_use_id": f"t{i}",
                               "content": [{"type": "text", "text": "result " * 30}]}]))
    messages.append(assistant("done"))
    assert len(messages) == 50

    def check() -> None:
        for i, message in enumerate(messages):
            if isinstance(message["content"], list):
                for j, block in enumerate(message["content"]):
                    _validate.content_block(f"messages[{i}].content[{j}]", block)

    check()  # builds the adapters once
    best = min(timeit.repeat(check, number=20, repeat=5, timer=time.process_time)) / 20
    assert best < 0.003


# -- tools -----------------------------------------------------------------------------


@le.tool
async def search(query: str) -> str:
    """Search the documentation."""
    return query


@pytest.mark.parametrize(("tools", "says"), [
    (search, "single tool 'search'"),        # the tools=single_tool
    ("search", "got str"),
    ({"search": search}, "got dict"),
    (42, "got int"),
])
async def test_tools_that_are_not_a_list_of_tools_are_refused(tools: Any, says: str) -> None:
    """tools= takes a list of tools: one Tool, a string, a mapping or a number is a
    ConfigError on ``tools``, not a TypeError."""
    provider = ScriptedProvider([Reply.text("x")])
    engine = le.Engine(provider)
    with pytest.raises(le.ConfigError, match=says) as caught:
        await engine.run(OPERATION, "q", tools=tools)
    assert caught.value.field == "tools"
    with pytest.raises(le.ConfigError, match=says):
        engine.estimate(OPERATION, "q", tools=tools)
    assert provider.requests == []


def test_a_partial_becomes_a_tool_named_and_described_by_its_function() -> None:
    """le.tool(functools.partial(f, ...)) (an AttributeError before) takes the wrapped
    function's name and docstring, and the partial's remaining parameters."""

    def lookup(table: str, key: str) -> str:
        """Look a key up.

        Args:
            key: The key.
        """
        return f"{table}:{key}"

    built = le.tool(functools.partial(lookup, "users"))
    assert built.definition == {
        "name": "lookup",
        "description": "Look a key up.",
        "input_schema": {"type": "object", "required": ["key"], "properties": {
            "key": {"type": "string", "title": "Key", "description": "The key."}}},
    }
    assert le.tool(name="users")(functools.partial(lookup, "users")).name == "users"


def test_a_callable_without_a_name_needs_one() -> None:
    """A callable object has no __name__: le.tool asks for name=, on the field ``name``."""

    class Lookup:
        """Look a key up."""

        def __call__(self, key: str) -> str:
            return key

    with pytest.raises(le.ConfigError, match=r"give tool\(name=\.\.\.\)") as caught:
        le.tool(Lookup())
    assert caught.value.field == "name"
    assert le.tool(name="lookup")(Lookup()).description == "Look a key up."


def test_something_not_callable_is_not_a_tool() -> None:
    """le.tool of a non-callable is a ConfigError on ``handler``."""
    with pytest.raises(le.ConfigError) as caught:
        le.tool(42)  # type: ignore[call-overload]
    assert caught.value.field == "handler"


async def test_a_tool_without_a_description_logs_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A tool with no description logs a WARNING once, when it is defined; running it
    again and again adds none."""
    with caplog.at_level(logging.WARNING, logger="loopengine"):
        @le.tool
        async def undocumented(key: str) -> str:
            return key

        bare = le.Tool("bare", "  ", {"type": "object"}, lambda _: "x")
        engine = le.Engine(ScriptedProvider([Reply.text("a"), Reply.text("b")]))
        for _ in range(2):
            await engine.run(OPERATION, "q", tools=[undocumented, bare])
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING
                and "has no description" in r.getMessage()]
    assert [r.getMessage().split(" has")[0] for r in warnings] == [
        "tool undocumented", "tool bare"]


def test_a_described_tool_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """A docstring is a description: no warning."""
    with caplog.at_level(logging.WARNING, logger="loopengine"):
        le.tool(search.handler)
    assert not [r for r in caplog.records if "has no description" in r.getMessage()]


@pytest.mark.parametrize("method", ["run", "call"])
async def test_a_one_string_message_with_a_lone_surrogate_is_refused_before_an_attempt(
    method: str,
) -> None:
    """``run(op, "a\\ud800")`` is a ConfigError on ``messages`` (as the same text in a
    list of messages is), not an attempt recorded and then failed by the SDK's encoder:
    through the real SDK and a loopback server, nothing is sent or recorded."""
    ledger = MemoryLedger()
    with FakeAnthropicServer([WireReply.text("x")]) as server:
        async with AnthropicProvider(api_key="test", base_url=server.url) as provider:
            engine = le.Engine(provider, ledger=ledger)
            with pytest.raises(le.ConfigError, match="surrogate") as caught:
                if method == "run":
                    await engine.run(OPERATION, "a\ud800")
                else:
                    await engine.call(OPERATION, "a\ud800", output=Answer)
        assert server.requests == []
    assert caught.value.field == "messages"
    assert ledger.invocations == {}


def test_user_text_the_api_accepts_passes() -> None:
    """Blank text beside real text, or beside another block, is what the API accepts;
    an assistant's whitespace is its own history and is kept as it wrote it."""
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "aGk="}}
    for messages in (
        [user([{"type": "text", "text": " "}, {"type": "text", "text": "real"}])],
        [user([{"type": "text", "text": " "}, image])],
        [user("q"), assistant([{"type": "text", "text": "\n\n"}]), user("again")],
    ):
        assert normalize_messages(messages) == messages
