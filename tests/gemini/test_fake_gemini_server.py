"""FakeGeminiServer itself: what it records, serves and counts, checked with the plain
``google-genai`` SDK (no loopengine in between)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx2
import pytest
from google import genai
from google.genai import errors, types

import loopengine as le
from loopengine.testing import ErrorReply, FakeGeminiServer, Reply, StreamErrorEvent

MODEL = "gemini-2.5-flash"


@pytest.fixture
async def client(fake_gemini_server: FakeGeminiServer) -> AsyncIterator[genai.Client]:
    http = httpx2.AsyncClient()
    sdk = genai.Client(api_key="k", http_options={
        "base_url": fake_gemini_server.url, "api_version": "v1beta",
        "httpx_async_client": http})
    yield sdk
    await http.aclose()


async def test_replies_are_served_in_order_and_requests_recorded(
    fake_gemini_server: FakeGeminiServer, client: genai.Client
) -> None:
    """Each request takes the next reply, as a GenerateContentResponse in camelCase; the
    server keeps the path, headers and body, and counts the usage as a client reads it."""
    usage = le.Usage(input_tokens=30, output_tokens=7, cache_read_tokens=64,
                     reasoning_tokens=2)
    fake_gemini_server.add(Reply.text("one", usage=usage),
                           Reply.tool_calls(("t", {"a": 1}), text="calling"))
    first = await client.aio.models.generate_content(model=MODEL, contents="hello")
    second = await client.aio.models.generate_content(model=MODEL, contents="hello")
    assert first.text == "one" and first.model_version == MODEL
    assert first.response_id == "resp-fake-0001"
    assert first.candidates is not None
    assert first.candidates[0].finish_reason is types.FinishReason.STOP
    meta = first.usage_metadata
    assert meta is not None
    assert (meta.prompt_token_count, meta.cached_content_token_count,
            meta.candidates_token_count, meta.thoughts_token_count) == (94, 64, 5, 2)
    (call,) = second.function_calls or []
    assert (call.name, call.args) == ("t", {"a": 1})
    recorded = fake_gemini_server.requests
    assert [r.path for r in recorded] == [f"/v1beta/models/{MODEL}:generateContent"] * 2
    assert recorded[0].body["contents"] == [{"parts": [{"text": "hello"}], "role": "user"}]
    assert recorded[0].headers["x-goog-api-key"] == "k"
    assert "request-id" not in repr(recorded[0].headers)
    assert fake_gemini_server.usage_served == usage + le.Usage(input_tokens=100,
                                                               output_tokens=20)


async def test_a_stream_is_whole_responses_with_cumulative_usage(
    fake_gemini_server: FakeGeminiServer, client: genai.Client
) -> None:
    """streamGenerateContent?alt=sse: a response per event, the text in pieces, the
    usage so far in each, the finishReason in the last."""
    fake_gemini_server.add(Reply.text("a b c d", usage=le.Usage(input_tokens=10,
                                                                output_tokens=10)))
    stream = await client.aio.models.generate_content_stream(model=MODEL, contents="hi")
    chunks = [chunk async for chunk in stream]
    assert "".join(chunk.text or "" for chunk in chunks) == "a b c d"
    counts = [c.usage_metadata.candidates_token_count for c in chunks
              if c.usage_metadata is not None]
    assert counts == sorted(counts) and counts[-1] == 10 and len(counts) == len(chunks)
    finishes = [c.candidates[0].finish_reason for c in chunks if c.candidates]
    assert finishes[-1] is types.FinishReason.STOP and set(finishes[:-1]) == {None}
    assert fake_gemini_server.requests[0].path.endswith(":streamGenerateContent?alt=sse")


async def test_errors_are_the_apis_shapes(
    fake_gemini_server: FakeGeminiServer, client: genai.Client
) -> None:
    """An ErrorReply is {"error": {code, message, status, details}}; a stream error is
    an error event after some chunks, which the SDK raises with its code."""
    fake_gemini_server.add(ErrorReply(status=403, error_code="BILLING_DISABLED"),
                           FakeGeminiServer.quota_exceeded("12s"),
                           StreamErrorEvent(reply=Reply.text("a b c"), after=1))
    with pytest.raises(errors.ClientError) as denied:
        await client.aio.models.generate_content(model=MODEL, contents="hi")
    assert (denied.value.code, denied.value.status) == (403, "PERMISSION_DENIED")
    assert denied.value.details["error"]["details"][0]["reason"] == "BILLING_DISABLED"
    with pytest.raises(errors.ClientError) as quota:
        await client.aio.models.generate_content(model=MODEL, contents="hi")
    assert quota.value.status == "RESOURCE_EXHAUSTED"
    assert quota.value.details["error"]["details"][-1]["retryDelay"] == "12s"
    stream = await client.aio.models.generate_content_stream(model=MODEL, contents="hi")
    with pytest.raises(errors.ServerError) as overloaded:
        async for _ in stream:
            pass
    assert (overloaded.value.code, overloaded.value.status) == (503, "UNAVAILABLE")


async def test_unanswered_function_calls_are_refused_before_the_script(
    fake_gemini_server: FakeGeminiServer, client: genai.Client
) -> None:
    """Function responses must answer the calls of the model turn before them, one
    for one: otherwise the API's 400, and no script item is used."""
    fake_gemini_server.add(Reply.text("ok"))
    history = [
        types.Content(role="user", parts=[types.Part(text="go")]),
        types.Content(role="model", parts=[types.Part(function_call=types.FunctionCall(
            name="a", args={})), types.Part(function_call=types.FunctionCall(
                name="b", args={}))]),
        types.Content(role="user", parts=[types.Part(function_response=types.FunctionResponse(
            name="a", response={"result": "1"}))]),
    ]
    with pytest.raises(errors.ClientError) as refused:
        await client.aio.models.generate_content(model=MODEL, contents=history)
    assert refused.value.code == 400 and "function response parts" in str(refused.value)
    answered = await client.aio.models.generate_content(model=MODEL, contents=history[:2] + [
        types.Content(role="user", parts=[types.Part(function_response=types.FunctionResponse(
            name=name, response={"result": "1"})) for name in ("b", "a")])])
    assert answered.text == "ok"


async def test_another_path_is_a_404(fake_gemini_server: FakeGeminiServer) -> None:
    """Only the generateContent methods are served."""
    async with httpx2.AsyncClient() as http:
        response = await http.post(f"{fake_gemini_server.url}/v1beta/models/x:countTokens",
                                   json={})
    assert response.status_code == 404
    assert response.json()["error"]["status"] == "NOT_FOUND"


async def test_a_call_of_the_current_turn_sent_back_without_its_signature_is_refused(
    fake_gemini_server: FakeGeminiServer, client: genai.Client
) -> None:
    """As the API does (Gemini 3's strict validation): a function call of the
    current turn that the server sent with a thought signature must go back
    with that signature; once a new user message opens another turn, the old
    calls are no longer checked."""
    fake_gemini_server.add(Reply(content=[
        {"type": "thinking", "thinking": "", "signature": "c2lnLW9uZQ=="},
        {"type": "tool_use", "name": "send", "input": {"to": "bob"}}], stop_reason="tool_use"),
        Reply.text("sent"), Reply.text("hello again"))
    first = await client.aio.models.generate_content(model=MODEL, contents="Tell bob")
    call = first.candidates[0].content.parts[0]
    assert call.thought_signature == b"sig-one"
    answer = types.Content(role="user", parts=[types.Part.from_function_response(
        name="send", response={"result": "ok"})])
    asked = types.Content(role="user", parts=[types.Part.from_text(text="Tell bob")])
    unsigned = types.Content(role="model", parts=[types.Part(function_call=call.function_call)])
    with pytest.raises(errors.ClientError, match="missing a thought_signature"):
        await client.aio.models.generate_content(model=MODEL,
                                                 contents=[asked, unsigned, answer])
    signed = types.Content(role="model", parts=[call])
    reply = await client.aio.models.generate_content(model=MODEL,
                                                     contents=[asked, signed, answer])
    assert reply.text == "sent"
    later = types.Content(role="user", parts=[types.Part.from_text(text="And now?")])
    reply = await client.aio.models.generate_content(
        model=MODEL, contents=[asked, unsigned, answer, later])
    assert reply.text == "hello again"
