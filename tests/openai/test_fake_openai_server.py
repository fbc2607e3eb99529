"""FakeOpenAIServer itself: what it records, serves and counts, checked with the plain
``openai`` SDK (no loopengine in between)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx2
import openai
import pytest

import loopengine as le
from loopengine.testing import (
    CutStream,
    DropConnection,
    ErrorReply,
    FakeOpenAIServer,
    Reply,
    StreamErrorEvent,
)

MODEL = "gpt-4o-mini"
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture
async def client(fake_openai_server: FakeOpenAIServer) -> AsyncIterator[openai.AsyncOpenAI]:
    sdk = openai.AsyncOpenAI(api_key="k", base_url=fake_openai_server.base_url, max_retries=0,
                             http_client=httpx2.AsyncClient(verify=False))
    yield sdk
    await sdk.close()


async def test_replies_are_served_in_order_and_requests_recorded(
    fake_openai_server: FakeOpenAIServer, client: openai.AsyncOpenAI
) -> None:
    """Each request takes the next reply, as a chat.completion; the server keeps the
    body and headers, and counts the usage with the cached tokens inside the prompt."""
    usage = le.Usage(input_tokens=30, output_tokens=7, cache_read_tokens=64)
    fake_openai_server.add(Reply.text("one", usage=usage),
                           Reply.tool_calls(("t", {"a": 1}), text="calling"))
    first = await client.chat.completions.create(model=MODEL, messages=HELLO,  # type: ignore[arg-type]
                                                 extra_headers={"X-Trace": "abc"})
    second = await client.chat.completions.create(model=MODEL, messages=HELLO)  # type: ignore[arg-type]
    assert first.choices[0].message.content == "one" and first.model == MODEL
    assert first.id == "chatcmpl-fake-0001" and first.choices[0].finish_reason == "stop"
    assert first.usage is not None and first.usage.prompt_tokens == 94
    assert first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 64
    (call,) = second.choices[0].message.tool_calls or []
    assert second.choices[0].finish_reason == "tool_calls"
    assert (call.function.name, json.loads(call.function.arguments)) == ("t", {"a": 1})  # type: ignore[union-attr]
    recorded = fake_openai_server.requests
    assert [r.path for r in recorded] == ["/v1/chat/completions"] * 2
    assert recorded[0].messages == HELLO and recorded[0].headers["x-trace"] == "abc"
    assert fake_openai_server.usage_served == usage + le.Usage(input_tokens=100,
                                                               output_tokens=20)


async def test_a_streamed_reply_is_the_same_completion(
    fake_openai_server: FakeOpenAIServer, client: openai.AsyncOpenAI
) -> None:
    """Streamed chunks put together give the same text, tool calls, finish reason and
    (asked for) usage; without include_usage no usage is sent, or counted."""
    fake_openai_server.add(Reply.tool_calls(("t", {"a": 1}), ("u", {}), text="a b"),
                           Reply.text("plain"))
    stream = await client.chat.completions.create(
        model=MODEL, messages=HELLO, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True})
    text, calls, finish, usage = "", {}, None, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for call in choice.delta.tool_calls or ():
                entry = calls.setdefault(call.index, ["", ""])
                entry[0] += (call.function.name or "") if call.function else ""
                entry[1] += (call.function.arguments or "") if call.function else ""
    assert (text, finish) == ("a b", "tool_calls")
    assert {i: (n, json.loads(a)) for i, (n, a) in calls.items()} == {0: ("t", {"a": 1}),
                                                                       1: ("u", {})}
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (100, 20)
    quiet = await client.chat.completions.create(model=MODEL, messages=HELLO,  # type: ignore[arg-type]
                                                 stream=True)
    assert [c.usage async for c in quiet if c.usage is not None] == []
    assert fake_openai_server.usage_served == le.Usage(input_tokens=100, output_tokens=20)
    assert fake_openai_server.responses_served == 1


async def test_errors_have_the_openai_shape_and_their_headers(
    fake_openai_server: FakeOpenAIServer, client: openai.AsyncOpenAI
) -> None:
    """An ErrorReply is {"error": {message, type, param, code}} with its headers; the
    request id is x-request-id."""
    fake_openai_server.add(ErrorReply.insufficient_quota(headers={"retry-after": "3"}))
    with pytest.raises(openai.RateLimitError) as info:
        await client.chat.completions.create(model=MODEL, messages=HELLO)  # type: ignore[arg-type]
    error = info.value
    assert (error.type, error.code) == ("insufficient_quota", "insufficient_quota")
    assert error.request_id == "req_fake_0001"
    assert error.response.headers["retry-after"] == "3"


async def test_a_stream_error_event_is_an_error_inside_the_stream(
    fake_openai_server: FakeOpenAIServer, client: openai.AsyncOpenAI
) -> None:
    """After some chunks the stream carries an error object, which the SDK raises."""
    fake_openai_server.add(StreamErrorEvent(reply=Reply.text("one two three"), after=2,
                                            type="server_error", message="boom"))
    stream = await client.chat.completions.create(model=MODEL, messages=HELLO,  # type: ignore[arg-type]
                                                  stream=True)
    seen: list[Any] = []
    with pytest.raises(openai.APIError, match="boom") as info:
        async for chunk in stream:
            seen.append(chunk)
    assert len(seen) == 2 and not isinstance(info.value, openai.APIStatusError)


async def test_transcripts_the_api_refuses_are_refused_before_the_script(
    fake_openai_server: FakeOpenAIServer, client: openai.AsyncOpenAI
) -> None:
    """An unanswered tool call, or a tool message answering nothing, gets a 400
    without taking a script item."""
    fake_openai_server.add(Reply.text("served"))
    calls = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "t", "arguments": "{}"}}]}
    for messages in ([*HELLO, calls], [*HELLO, {"role": "tool", "tool_call_id": "x",
                                                "content": "?"}],
                     [*HELLO, calls, *HELLO]):
        with pytest.raises(openai.BadRequestError, match="tool"):
            await client.chat.completions.create(model=MODEL, messages=messages)  # type: ignore[arg-type]
    answered = [*HELLO, calls, {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    done = await client.chat.completions.create(model=MODEL, messages=answered)  # type: ignore[arg-type]
    assert done.choices[0].message.content == "served"


async def test_cut_and_dropped_replies_count_what_reached_the_wire(
    fake_openai_server: FakeOpenAIServer, client: openai.AsyncOpenAI
) -> None:
    """A stream cut before its usage chunk and a dropped connection count nothing."""
    fake_openai_server.add(CutStream(reply=Reply.text("a b c"), after=4), DropConnection())
    stream = await client.chat.completions.create(
        model=MODEL, messages=HELLO, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True})
    assert [c async for c in stream if c.usage is not None] == []
    with pytest.raises(openai.APIConnectionError):
        await client.chat.completions.create(model=MODEL, messages=HELLO)  # type: ignore[arg-type]
    assert fake_openai_server.usage_served == le.Usage()
    assert fake_openai_server.responses_served == 0


async def test_a_call_of_the_current_turn_sent_back_without_its_signature_is_refused(
    fake_openai_server: FakeOpenAIServer, client: openai.AsyncOpenAI
) -> None:
    """As Gemini's OpenAI-compatible endpoint does: a tool call it served with a
    thought signature (``extra_content.google.thought_signature``) must go back
    with it while its turn goes on; a new user message ends that turn."""
    extra = {"google": {"thought_signature": "c2lnLW9uZQ=="}}
    fake_openai_server.add(Reply(content=[{"type": "tool_use", "id": "call_1", "name": "send",
                                           "input": {"to": "bob"}, "extra_content": extra}],
                                 stop_reason="tool_use"),
                           Reply.text("sent"), Reply.text("hello again"))
    first = await client.chat.completions.create(model=MODEL, messages=HELLO)  # type: ignore[arg-type]
    served = first.choices[0].message.model_dump(exclude_none=True)
    assert served["tool_calls"][0]["extra_content"] == extra
    unsigned = {**served, "tool_calls": [{k: v for k, v in served["tool_calls"][0].items()
                                          if k != "extra_content"}]}
    result = {"role": "tool", "tool_call_id": "call_1", "content": "ok"}
    with pytest.raises(openai.BadRequestError, match="missing a thought_signature"):
        await client.chat.completions.create(model=MODEL, messages=[*HELLO, unsigned, result])  # type: ignore[list-item]
    reply = await client.chat.completions.create(model=MODEL, messages=[*HELLO, served, result])  # type: ignore[list-item]
    assert reply.choices[0].message.content == "sent"
    later = {"role": "user", "content": "And now?"}
    reply = await client.chat.completions.create(
        model=MODEL, messages=[*HELLO, unsigned, result, later])  # type: ignore[list-item]
    assert reply.choices[0].message.content == "hello again"


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning_details"])
async def test_a_tool_call_turn_sent_back_without_the_reasoning_it_was_served_with_is_refused(
    fake_openai_server: FakeOpenAIServer, client: openai.AsyncOpenAI, field: str
) -> None:
    """As DeepSeek's thinking mode (``reasoning_content``) and a thinking model
    behind OpenRouter (``reasoning_details``) do: an assistant message whose tool
    call was served with reasoning must carry that field back, in any turn; the
    field the server did not serve is not asked for."""
    thought = ({"type": field, field: "Look it up."} if field == "reasoning_content" else
               {"type": field, field: [{"type": "reasoning.text", "text": "Look it up."}]})
    fake_openai_server.add(Reply(content=[thought, {"type": "tool_use", "id": "call_1",
                                                    "name": "send", "input": {}}],
                                 stop_reason="tool_use"), Reply.text("sent"))
    first = await client.chat.completions.create(model=MODEL, messages=HELLO)  # type: ignore[arg-type]
    served = first.choices[0].message.model_dump(exclude_none=True)
    assert field in served
    bare = {k: v for k, v in served.items() if k not in ("reasoning_content",
                                                          "reasoning_details")}
    result = {"role": "tool", "tool_call_id": "call_1", "content": "ok"}
    later = [{"role": "user", "content": "And now?"}]
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model=MODEL, messages=[*HELLO, bare, result, *later])  # type: ignore[list-item]
    assert caught.value.body["message"] == (  # type: ignore[index]
        f"Missing {field} field in the assistant message at message index 1.")
    reply = await client.chat.completions.create(model=MODEL,
                                                 messages=[*HELLO, served, result, *later])  # type: ignore[list-item]
    assert reply.choices[0].message.content == "sent"
