"""FakeOpenAIServer's ``/v1/responses``, checked with the plain ``openai`` SDK (no
loopengine in between): the SDK parses its bodies and events into its own
types, it refuses what the API refuses, and counts the usage it served."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx2
import openai
import pytest

import loopengine as le
from loopengine.testing import FakeOpenAIServer, Reply, StreamErrorEvent

MODEL = "gpt-5"


@pytest.fixture
async def client(fake_openai_server: FakeOpenAIServer) -> AsyncIterator[openai.AsyncOpenAI]:
    sdk = openai.AsyncOpenAI(api_key="k", base_url=fake_openai_server.base_url, max_retries=0,
                             http_client=httpx2.AsyncClient(verify=False))
    yield sdk
    await sdk.close()


async def test_a_reply_is_a_response_the_sdk_reads(
    fake_openai_server: FakeOpenAIServer, client: openai.AsyncOpenAI
) -> None:
    """Text and calls become a message and function_call items; the usage holds the
    cached tokens inside input_tokens; the server counts what it served."""
    usage = le.Usage(input_tokens=30, output_tokens=7, cache_read_tokens=64,
                     reasoning_tokens=3)
    fake_openai_server.add(Reply.tool_calls(("t", {"a": 1}), text="calling", usage=usage))
    response = await client.responses.create(model=MODEL, input="hello")
    assert (response.id, response.status, response.model) == ("resp_fake_0001", "completed",
                                                               MODEL)
    message, call = response.output
    assert message.type == "message" and response.output_text == "calling"
    assert call.type == "function_call" and (call.name, call.arguments) == ("t", '{"a": 1}')
    assert response.usage is not None
    assert (response.usage.input_tokens, response.usage.input_tokens_details.cached_tokens,
            response.usage.output_tokens_details.reasoning_tokens) == (94, 64, 3)
    assert fake_openai_server.requests[0].path == "/v1/responses"
    assert fake_openai_server.usage_served == usage


async def test_a_stream_is_the_apis_events_ending_with_the_response(
    fake_openai_server: FakeOpenAIServer, client: openai.AsyncOpenAI
) -> None:
    """The stream's events carry the API's names, in its order; only the last one,
    response.completed, carries the usage."""
    fake_openai_server.add(Reply.tool_calls(("t", {"a": 1}), text="two words"))
    stream = await client.responses.create(model=MODEL, input="hello", stream=True)
    events = [event async for event in stream]
    kinds = [event.type for event in events]
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.usage is None  # type: ignore[union-attr]
    assert events[-1].response.usage is not None  # type: ignore[union-attr]


async def test_an_error_event_is_an_event_of_type_error(
    fake_openai_server: FakeOpenAIServer, client: openai.AsyncOpenAI
) -> None:
    """A StreamErrorEvent is an ``error`` event whose code is the scripted type, its
    fields nested under ``error`` as the API sends them: the SDK raises it."""
    fake_openai_server.add(StreamErrorEvent(reply=Reply.text("half"), after=2,
                                            type="server_error", message="boom"))
    stream = await client.responses.create(model=MODEL, input="hello", stream=True)
    events: list[Any] = []
    with pytest.raises(openai.APIError) as raised:
        async for event in stream:
            events.append(event)
    assert [e.type for e in events] == ["response.created", "response.in_progress"]
    assert (raised.value.code, raised.value.type, raised.value.message) == (
        "server_error", "server_error", "boom")


@pytest.mark.parametrize(("items", "problem"), [
    ([{"type": "function_call_output", "call_id": "c1", "output": "x"}],
     "No tool call found"),
    ([{"role": "user", "content": "q"},
      {"type": "function_call", "call_id": "c1", "name": "t", "arguments": "{}"}],
     "No tool output found"),
    ([{"role": "user", "content": "q"},
      {"type": "reasoning", "id": "rs_1", "summary": []}], "not persisted"),
])
async def test_an_input_the_api_refuses_is_refused_before_the_script(
    fake_openai_server: FakeOpenAIServer, client: openai.AsyncOpenAI,
    items: list[dict[str, Any]], problem: str
) -> None:
    """An output without its call, a call without its output, and a reasoning item
    without its encrypted content under store=false get the API's 400 and take no
    script item."""
    fake_openai_server.add(Reply.text("kept"))
    with pytest.raises(openai.BadRequestError, match=problem):
        await client.responses.create(model=MODEL, input=items, store=False)  # type: ignore[arg-type]
    response = await client.responses.create(model=MODEL, input="hello")
    assert response.output_text == "kept"


@pytest.mark.parametrize(("model", "asked", "problem"), [
    ("gpt-4o-mini", {"include": ["reasoning.encrypted_content"]},
     "Encrypted content is not supported with this model"),
    ("gpt-4.1", {"reasoning": {"effort": "low"}},
     "'reasoning.effort' is not supported with this model"),
    ("gpt-5-chat-latest", {"include": ["reasoning.encrypted_content"]},
     "Encrypted content is not supported"),
    ("gpt-5.1-chat-latest", {"reasoning": {"effort": "low"}},
     "'reasoning.effort' is not supported with this model"),
])
async def test_a_model_that_does_not_reason_refuses_reasoning_parameters(
    fake_openai_server: FakeOpenAIServer, client: openai.AsyncOpenAI,
    model: str, asked: dict[str, Any], problem: str
) -> None:
    """A model that does not reason refuses reasoning.effort and the include of the
    reasoning's encrypted content with the API's 400, before the script; a
    reasoning model takes both."""
    fake_openai_server.add(Reply.text("kept"))
    with pytest.raises(openai.BadRequestError, match=problem):
        await client.responses.create(model=model, input="hello", **asked)
    response = await client.responses.create(model="o4-mini", input="hello", **asked)
    assert response.output_text == "kept"
