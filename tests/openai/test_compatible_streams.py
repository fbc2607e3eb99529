"""Streams of servers that speak Chat Completions their own way, on the wire: Azure's
first chunk (its prompt's filter results, with an empty id), Gemini's
OpenAI-compatible endpoint (tool calls without an ``index``) and DeepSeek's
thinking mode (a ``reasoning_content`` it requires back). Each goes through
OpenAIProvider, the real ``openai`` SDK and FakeOpenAIServer."""

from __future__ import annotations

import json
from typing import Any

import httpx2
import openai
import pytest
from openai._models import construct_type
from openai.types.chat import ChatCompletionChunk

import loopengine as le
from loopengine.persistence import MemoryLedger
from loopengine.providers import OpenAIProvider
from loopengine.providers._openai_chat import StreamedCompletion
from loopengine.testing import FakeOpenAIServer, RecordedRequest, Reply

from .conftest import PRICES, calls_asked, openai_operation, tool_messages


@le.tool
def lookup(key: str) -> str:
    """Look a key up."""
    return f"value of {key}"


async def test_an_azure_stream_records_the_completion_id_not_its_empty_first_chunk() -> None:
    """Azure's stream opens with a chunk of prompt filter results whose ``id`` and
    ``model`` are empty: the attempt records the completion's id from the chunks
    after it."""
    with FakeOpenAIServer([Reply.text("hi there")]) as server:
        client = openai.AsyncAzureOpenAI(api_key="k", api_version="2024-10-21",
                                         base_url=f"{server.url}/openai",
                                         http_client=httpx2.AsyncClient())
        ledger = MemoryLedger()
        engine = le.Engine(OpenAIProvider(client, stream=True), ledger=ledger)
        try:
            result = await engine.run(le.Operation(name="t", provider="azure", model="gpt-4o"),
                                      "go")
        finally:
            await client.close()
        assert server.requests[0].path.startswith("/openai/deployments/gpt-4o/")
    assert result.outcome is le.Outcome.COMPLETED, result.detail
    assert result.answer == "hi there"
    (row,) = ledger.attempts.values()
    assert row["response_id"] == "chatcmpl-fake-0001"
    assert result.attempt_log[0].settle is not None
    assert result.attempt_log[0].settle.response_id == "chatcmpl-fake-0001"


async def two_calls(first_extra: dict[str, Any], *, stream: bool,
                    indexes: bool) -> tuple[le.RunResult, list[RecordedRequest]]:
    """A run whose model calls ``lookup`` twice (the first call's block with
    ``first_extra``), then answers, on a FakeOpenAIServer streaming tool calls with
    or without their ``index``: its result and the requests the server received."""
    calls = Reply(content=[
        {"type": "tool_use", "id": "function-call-1", "name": "lookup", "input": {"key": "a"},
         **first_extra},
        {"type": "tool_use", "id": "function-call-2", "name": "lookup", "input": {"key": "b"}}],
        stop_reason="tool_use")
    return await lookup_run([calls, Reply.text("done")], stream=stream,
                            tool_call_indexes=indexes)


async def lookup_run(script: list[Reply], *, stream: bool, **server: Any
                     ) -> tuple[le.RunResult, list[RecordedRequest]]:
    """One run with the ``lookup`` tool on a FakeOpenAIServer (``server`` its
    keywords) serving ``script``: its result and the requests the server received."""
    with FakeOpenAIServer(script, **server) as fake:
        provider = OpenAIProvider(api_key="k", base_url=fake.base_url, stream=stream)
        engine = le.Engine(provider, ledger=MemoryLedger(), prices=PRICES)
        try:
            result = await engine.run(openai_operation(), "go", tools=[lookup])
        finally:
            await provider.aclose()
        return result, fake.requests


async def test_tool_calls_streamed_without_an_index_stay_apart() -> None:
    """Gemini's OpenAI-compatible endpoint streams each tool call whole, without an
    ``index``: two calls are two calls, each with its id, name and input, run and
    answered one for one."""
    result, requests = await two_calls({}, stream=True, indexes=False)
    second = requests[1]
    assert requests[0].body["stream"] is True
    assert result.outcome is le.Outcome.COMPLETED, result.detail
    assert result.tool_calls == 2
    assert calls_asked(second) == [
        {"id": "function-call-1", "name": "lookup", "input": {"key": "a"}},
        {"id": "function-call-2", "name": "lookup", "input": {"key": "b"}}]
    assert [(m["tool_call_id"], m["content"]) for m in tool_messages(second)] == [
        ("function-call-1", "value of a"), ("function-call-2", "value of b")]


def _chunk(calls: list[dict[str, Any]]) -> Any:
    return construct_type(type_=ChatCompletionChunk, value={
        "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
        "choices": [{"index": 0, "delta": {"tool_calls": calls}, "finish_reason": None}]})


def test_indexless_deltas_go_on_with_the_last_call_and_mix_with_indexed_ones() -> None:
    """A delta without an index and without a new id goes on with the call before
    it (arguments split over deltas); beside calls that name their index, calls
    that name none come after them, in the order they came, and nothing raises."""
    reply = StreamedCompletion()
    reply.add(_chunk([{"id": "c1", "type": "function",
                       "function": {"name": "lookup", "arguments": '{"key"'}}]))
    reply.add(_chunk([{"function": {"arguments": ': "a"}'}}]))
    reply.add(_chunk([{"index": 0, "id": "c0", "type": "function",
                       "function": {"name": "lookup", "arguments": '{"key": "z"}'}}]))
    reply.add(_chunk([{"id": "c2", "type": "function",
                       "function": {"name": "lookup", "arguments": '{"key": "b"}'}}]))
    reply.finish_reason = "tool_calls"
    content, stop = reply.content()
    assert stop == "tool_use"
    assert [(b["id"], b["name"], json.dumps(b["input"])) for b in content] == [
        ("c0", "lookup", '{"key": "z"}'), ("c1", "lookup", '{"key": "a"}'),
        ("c2", "lookup", '{"key": "b"}')]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("indexes", [True, False], ids=["indexed", "indexless"])
async def test_a_thought_signature_on_a_tool_call_goes_back_on_that_call(
    stream: bool, indexes: bool,
) -> None:
    """Gemini's OpenAI-compatible endpoint puts the model's thought signature on each
    tool call (``extra_content.google.thought_signature``) and refuses the next
    request without it: it is kept on the tool_use block and sent back on the
    same call, streamed or not."""
    signed = {"google": {"thought_signature": "c2lnbmF0dXJlLTE="}}
    result, requests = await two_calls({"extra_content": signed}, stream=stream,
                                       indexes=indexes)
    second = requests[1]
    assert result.outcome is le.Outcome.COMPLETED, result.detail
    assistant = [m for m in second.messages if m["role"] == "assistant"][-1]
    assert [call.get("extra_content") for call in assistant["tool_calls"]] == [signed, None]
    assert result.messages[1]["content"][0]["extra_content"] == signed


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_thinking_servers_reasoning_goes_back_with_its_tool_calls(
    stream: bool,
) -> None:
    """DeepSeek's thinking mode sends its reasoning as the message's
    ``reasoning_content`` and refuses a tool-call turn sent back without it
    ("Missing reasoning_content field in the assistant message"): it is kept as a
    ``reasoning_content`` block and sent back on that turn's assistant message,
    streamed or not; the answer's own reasoning is kept and not sent."""
    thought = {"type": "reasoning_content", "reasoning_content": "Look both keys up."}
    calls = Reply(content=[thought, {"type": "tool_use", "id": "call_1", "name": "lookup",
                                     "input": {"key": "a"}}], stop_reason="tool_use")
    answer = Reply(content=[thought | {"reasoning_content": "Done."},
                            {"type": "text", "text": "a is value of a"}])
    with FakeOpenAIServer([calls, answer, Reply.text("ok")]) as server:
        provider = OpenAIProvider(api_key="k", base_url=server.base_url, stream=stream)
        engine = le.Engine(provider, ledger=MemoryLedger(), prices=PRICES)
        try:
            result = await engine.run(openai_operation(), "go", tools=[lookup])
            again = await engine.run(openai_operation(), [
                *result.messages, {"role": "user", "content": "thanks"}], tools=[lookup])
        finally:
            await provider.aclose()
        requests = server.requests
    assert result.outcome is le.Outcome.COMPLETED, result.detail
    assert again.outcome is le.Outcome.COMPLETED, again.detail
    assert result.messages[1]["content"][0] == thought
    assert result.messages[3]["content"][0]["reasoning_content"] == "Done."
    for request in requests[1:]:
        turns = [m for m in request.messages if m["role"] == "assistant"]
        assert turns[0]["reasoning_content"] == "Look both keys up."
        assert all("reasoning_content" not in turn for turn in turns[1:])


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_openrouters_reasoning_details_go_back_with_their_tool_calls(
    stream: bool,
) -> None:
    """OpenRouter sends a reasoning model's reasoning as the message's
    ``reasoning_details`` and asks it back with the tool calls it led to (a
    thinking model behind it refuses the turn without them): kept as a
    ``reasoning_details`` block, a streamed one put together by index, and sent
    back on that turn's assistant message, signatures included."""
    details = [{"type": "reasoning.text", "text": "Look both keys up.",
                "signature": "sig-1", "format": "anthropic-claude-v1", "index": 0},
               {"type": "reasoning.encrypted", "data": "opaque", "format": "anthropic-claude-v1",
                "index": 1}]
    thought = {"type": "reasoning_details", "reasoning_details": details}
    calls = Reply(content=[thought, {"type": "tool_use", "id": "call_1", "name": "lookup",
                                     "input": {"key": "a"}}], stop_reason="tool_use")
    result, requests = await lookup_run([calls, Reply.text("a is value of a")], stream=stream)
    assert result.outcome is le.Outcome.COMPLETED, result.detail
    assert result.messages[1]["content"][0] == thought
    sent = [m for m in requests[1].messages if m["role"] == "assistant"]
    assert sent[0]["reasoning_details"] == details


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_an_empty_reasoning_goes_back_with_its_tool_calls(stream: bool) -> None:
    """A tool-call turn DeepSeek reasoned nothing for comes with an empty
    ``reasoning_content``, and DeepSeek refuses that turn sent back without the
    field: the empty reasoning is kept and sent back, streamed or not."""
    calls = Reply(content=[{"type": "reasoning_content", "reasoning_content": ""},
                           {"type": "tool_use", "id": "call_1", "name": "lookup",
                            "input": {"key": "a"}}], stop_reason="tool_use")
    result, requests = await lookup_run([calls, Reply.text("a is value of a")], stream=stream)
    assert result.outcome is le.Outcome.COMPLETED, result.detail
    (turn,) = [m for m in requests[1].messages if m["role"] == "assistant"]
    assert turn["reasoning_content"] == "" and turn["tool_calls"][0]["id"] == "call_1"
