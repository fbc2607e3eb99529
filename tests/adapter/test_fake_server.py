"""FakeAnthropicServer itself: what it records, what it serves, what it counts.

The server is a witness for other tests, so its own behaviour is checked with
the plain ``anthropic`` SDK (no loopengine in between) where that is enough.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx2
import pytest

import loopengine as le
import loopengine.testing
from loopengine.providers import AnthropicProvider
from loopengine.testing import (
    CutStream,
    DropConnection,
    ErrorReply,
    FakeAnthropicServer,
    RecordedRequest,
    Reply,
    StallStream,
    StreamErrorEvent,
)

MODEL = "claude-sonnet-4-5"
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture
async def client(fake_anthropic_server: FakeAnthropicServer) -> AsyncIterator[
        anthropic.AsyncAnthropic]:
    sdk = anthropic.AsyncAnthropic(api_key="k", base_url=fake_anthropic_server.url,
                                   max_retries=0, http_client=httpx2.AsyncClient(verify=False))
    yield sdk
    await sdk.close()


async def test_replies_are_served_in_order_and_requests_recorded(
    fake_anthropic_server: FakeAnthropicServer, client: anthropic.AsyncAnthropic
) -> None:
    """Each request takes the next reply; the server keeps the body and headers."""
    fake_anthropic_server.add(Reply.text("one"), Reply.tool_calls(("t", {"a": 1})))
    first = await client.messages.create(model=MODEL, max_tokens=5, messages=HELLO,
                                         system="sys", extra_headers={"X-Trace": "abc"})
    second = await client.messages.create(model=MODEL, max_tokens=5, messages=HELLO)
    assert first.content[0].type == "text" and first.content[0].text == "one"
    assert first.model == MODEL and first.id == "msg_fake_0001"
    assert second.stop_reason == "tool_use" and second.content[0].type == "tool_use"
    recorded = fake_anthropic_server.requests
    assert [r.path for r in recorded] == ["/v1/messages", "/v1/messages"]
    assert recorded[0].body["system"] == "sys" and recorded[0].messages == HELLO
    assert recorded[0].headers["x-trace"] == "abc"
    assert recorded[0].stream is False


async def test_a_streamed_reply_is_the_same_message(
    fake_anthropic_server: FakeAnthropicServer, client: anthropic.AsyncAnthropic
) -> None:
    """The SSE form accumulates (in the SDK's own stream helper) to the JSON form."""
    usage = le.Usage(input_tokens=7, output_tokens=9, cache_read_tokens=3,
                     cache_write_tokens=2, cache_write_1h_tokens=1)
    reply = Reply(content=[{"type": "thinking", "thinking": "hmm", "signature": "sig"},
                           {"type": "text", "text": "Hi there."},
                           {"type": "tool_use", "id": "toolu_1", "name": "t",
                            "input": {"q": [1, 2]}}],
                  stop_reason="tool_use", usage=usage)
    fake_anthropic_server.add(reply, reply)
    plain = await client.messages.create(model=MODEL, max_tokens=5, messages=HELLO)
    async with client.messages.stream(model=MODEL, max_tokens=5, messages=HELLO) as stream:
        texts = [t async for t in stream.text_stream]
        streamed = await stream.get_final_message()
    assert texts == ["Hi ", "there."]
    assert [b.to_dict() for b in streamed.content] == [b.to_dict() for b in plain.content]
    assert streamed.stop_reason == plain.stop_reason == "tool_use"
    assert streamed.usage.output_tokens == plain.usage.output_tokens == 9
    assert streamed.usage.cache_read_input_tokens == 3
    assert fake_anthropic_server.requests[1].stream is True
    assert fake_anthropic_server.usage_served == usage + usage


async def test_errors_carry_status_body_and_headers(
    fake_anthropic_server: FakeAnthropicServer, client: anthropic.AsyncAnthropic
) -> None:
    """An ErrorReply is the SDK's typed error, with the scripted details."""
    fake_anthropic_server.add(ErrorReply.spend_limit(headers={"retry-after": "3"}),
                              ErrorReply(status=418, body="teapot"))
    with pytest.raises(anthropic.RateLimitError) as info:
        await client.messages.create(model=MODEL, max_tokens=5, messages=HELLO)
    assert info.value.error_code == "enforced_spend_limit_reached"
    assert info.value.type == "rate_limit_error"
    assert info.value.response.headers["retry-after"] == "3"
    assert info.value.request_id == "req_fake_0001"
    with pytest.raises(anthropic.APIStatusError) as raw:
        await client.messages.create(model=MODEL, max_tokens=5, messages=HELLO)
    assert raw.value.status_code == 418 and raw.value.body == "teapot"
    assert fake_anthropic_server.usage_served == le.Usage()


async def test_markers_the_api_refuses_are_refused(
    fake_anthropic_server: FakeAnthropicServer, client: anthropic.AsyncAnthropic
) -> None:
    """More than four cache markers, or a one-hour marker after a five-minute one,
    get the API's 400 before the script is touched; the request is still recorded."""
    five, hour = {"type": "ephemeral"}, {"type": "ephemeral", "ttl": "1h"}
    fake_anthropic_server.add(Reply.text("ok"))
    five_markers: Any = [{"type": "text", "text": f"s{i}", "cache_control": five}
                         for i in range(5)]
    with pytest.raises(anthropic.BadRequestError, match="maximum of 4 blocks") as many:
        await client.messages.create(model=MODEL, max_tokens=5, messages=HELLO,
                                     system=five_markers)
    assert many.value.type == "invalid_request_error"
    late_hour: Any = [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "text", "text": "x", "cache_control": hour}]}]}]
    with pytest.raises(anthropic.BadRequestError, match="ttl='1h'"):
        await client.messages.create(model=MODEL, max_tokens=5, messages=late_hour,
                                     system=five_markers[:1])
    reply = await client.messages.create(model=MODEL, max_tokens=5, messages=HELLO,
                                         system=five_markers[:4])
    assert reply.content[0].type == "text" and reply.content[0].text == "ok"
    assert len(fake_anthropic_server.requests) == 3


async def test_dropped_connections_and_mid_stream_errors(
    fake_anthropic_server: FakeAnthropicServer, client: anthropic.AsyncAnthropic
) -> None:
    """A drop is a connection error; a stream error event arrives after a 200."""
    fake_anthropic_server.add(DropConnection(), DropConnection(reset=False),
                              StreamErrorEvent(reply=Reply.text("x y"), after=2))
    for _ in range(2):
        with pytest.raises(anthropic.APIConnectionError):
            await client.messages.create(model=MODEL, max_tokens=5, messages=HELLO)
    with pytest.raises(anthropic.APIStatusError) as info:
        async with client.messages.stream(model=MODEL, max_tokens=5, messages=HELLO) as s:
            async for _ in s:
                pass
    assert info.value.status_code == 200 and info.value.type == "overloaded_error"
    # The interrupted stream had announced its input tokens and one output token.
    assert fake_anthropic_server.usage_served == le.Usage(input_tokens=100, output_tokens=1)


async def test_a_stream_cut_cleanly_has_no_message_stop(
    fake_anthropic_server: FakeAnthropicServer, client: anthropic.AsyncAnthropic
) -> None:
    """CutStream(how="end"): the body ends without message_stop and the SDK does not
    raise; the snapshot has no stop reason."""
    fake_anthropic_server.add(CutStream(reply=Reply.text("a b c d"), after=4))
    async with client.messages.stream(model=MODEL, max_tokens=5, messages=HELLO) as stream:
        types = [event.type async for event in stream]
    assert "message_stop" not in types and types[0] == "message_start"
    assert stream.current_message_snapshot.stop_reason is None


async def test_a_stall_pauses_the_stream(fake_anthropic_server: FakeAnthropicServer,
                                         client: anthropic.AsyncAnthropic) -> None:
    """A StallStream that the client waits out still delivers the whole reply."""
    fake_anthropic_server.add(StallStream(reply=Reply.text("late"), after=2, seconds=0.1))
    async with client.messages.stream(model=MODEL, max_tokens=5, messages=HELLO) as stream:
        message = await stream.get_final_message()
    assert message.stop_reason == "end_turn"
    assert fake_anthropic_server.usage_served == le.Usage(input_tokens=100, output_tokens=20)


async def test_callables_see_the_request(fake_anthropic_server: FakeAnthropicServer,
                                         client: anthropic.AsyncAnthropic) -> None:
    """A callable item answers from the request it receives."""

    def echo(request: RecordedRequest) -> Reply:
        return Reply.text(f"you said {request.messages[-1]['content']}")

    fake_anthropic_server.add(echo)
    message = await client.messages.create(model=MODEL, max_tokens=5, messages=HELLO)
    assert message.content[0].type == "text" and message.content[0].text == "you said hello"


async def test_a_script_function_that_raises_or_gives_junk_is_a_permanent_error_naming_it(
    fake_anthropic_server: FakeAnthropicServer,
) -> None:
    """A script function is the test's own code: when it raises, or returns something
    that is not a script item, the run ends at once with a 400 that says so, instead of
    a dropped connection retried into the next item (or into "no reply")."""

    def broken(request: RecordedRequest) -> Reply:
        raise KeyError("no such order")

    def failed(request: RecordedRequest) -> Reply:
        pytest.fail("an assertion of the test's own")

    fake_anthropic_server.add(broken, lambda request: "junk", failed, Reply.text("never"))
    operation = le.Operation(name="fake.functions", provider="anthropic", model=MODEL,
                             max_output_tokens=20)
    async with AnthropicProvider(api_key="k", base_url=fake_anthropic_server.url) as provider:
        engine = le.Engine(provider, clock=le.testing.FakeClock())
        raised = await engine.run(operation, "hello")
        junk = await engine.run(operation, "hello")
        failed_ = await engine.run(operation, "hello")
    results = (raised, junk, failed_)
    assert [r.outcome for r in results] == [le.Outcome.PROVIDER_ERROR] * 3
    assert [r.attempts.count for r in results] == [1, 1, 1]
    assert raised.fault is not None and junk.fault is not None and failed_.fault is not None
    assert "the script's function for request 1 raised KeyError: 'no such order'" in (
        raised.fault.message)
    assert "the script's function for request 2 returned 'junk', not a script item" in (
        junk.fault.message)
    assert "request 3 raised Failed: an assertion of the test's own" in failed_.fault.message
    assert len(fake_anthropic_server.requests) == 3


async def test_an_exhausted_script_and_unknown_paths_are_permanent_errors(
    fake_anthropic_server: FakeAnthropicServer, client: anthropic.AsyncAnthropic
) -> None:
    """Past the script: 400 saying so. Other endpoints: 404, without using the script."""
    with pytest.raises(anthropic.BadRequestError) as info:
        await client.messages.create(model=MODEL, max_tokens=5, messages=HELLO)
    assert "no reply for request 1" in str(info.value)
    fake_anthropic_server.add(Reply.text("kept"))
    with pytest.raises(anthropic.NotFoundError):
        await client.models.list()
    message = await client.messages.create(model=MODEL, max_tokens=5, messages=HELLO)
    assert message.content[0].type == "text" and message.content[0].text == "kept"


def test_the_server_starts_on_an_ephemeral_loopback_port_and_stops_cleanly() -> None:
    """url is 127.0.0.1 on a port of its own; close joins every handler thread."""
    before = threading.active_count()
    with FakeAnthropicServer([Reply.text("x")]) as one, FakeAnthropicServer() as two:
        assert one.url.startswith("http://127.0.0.1:") and one.url != two.url
    assert threading.active_count() == before
    with pytest.raises(RuntimeError):
        _ = one.url
    one.close()  # closing twice is harmless


async def test_close_wakes_a_delayed_reply(client: anthropic.AsyncAnthropic) -> None:
    """A server stopped while a reply is delayed (an hour: longer than any test may
    run) drops it at once instead of waiting: the call fails and the test ends."""
    import anyio

    arrived = threading.Event()

    def late(request: RecordedRequest) -> Reply:
        arrived.set()
        return Reply.text("late", delay=3600.0)

    server = FakeAnthropicServer([late]).start()
    sdk = client.with_options(base_url=server.url)
    async with anyio.create_task_group() as group:
        async def call() -> None:
            with pytest.raises(anthropic.APIConnectionError):
                await sdk.messages.create(model=MODEL, max_tokens=5, messages=HELLO)

        group.start_soon(call)
        # The request is in the server, its reply delayed: now close.
        await anyio.to_thread.run_sync(arrived.wait)
        await anyio.to_thread.run_sync(server.close)


async def test_the_fake_signs_the_thinking_it_serves_and_refuses_any_other(
    fake_anthropic_server: FakeAnthropicServer, client: anthropic.AsyncAnthropic
) -> None:
    """As the API does: a thinking block goes back only with the signature the
    server issued for its text, and redacted thinking only with the data it
    issued; a signature from elsewhere, altered text or foreign data is the
    API's 400 ``invalid_request_error`` naming the block, before any script item
    is taken."""
    server = fake_anthropic_server
    server.add(Reply(content=[{"type": "thinking", "thinking": "Weigh it."},
                              {"type": "redacted_thinking"},
                              {"type": "text", "text": "Yes."}]), Reply.text("again"))
    served = await client.messages.create(model=MODEL, max_tokens=5, messages=HELLO)
    thought, redacted = (block.to_dict() for block in served.content[:2])
    assert thought["signature"] == server.thinking_signature("Weigh it.")
    assert redacted["data"] and redacted["data"] != server.redacted_data()

    def sent(*blocks: dict[str, Any]) -> list[Any]:
        return [*HELLO, {"role": "assistant", "content": [*blocks, {"type": "text",
                                                                    "text": "Yes."}]},
                {"role": "user", "content": "and?"}]

    refused = [
        (sent({**thought, "signature": "c2lnbmF0dXJl"}, redacted), "0", "signature",
         "thinking"),
        (sent({**thought, "thinking": "Weigh it again."}, redacted), "0", "signature",
         "thinking"),
        (sent(thought, {**redacted, "data": "RW1vS0FoZ0JFZ3kzdmEz"}), "1", "data",
         "redacted_thinking"),
    ]
    for messages, index, field, kind in refused:
        with pytest.raises(anthropic.BadRequestError) as caught:
            await client.messages.create(model=MODEL, max_tokens=5, messages=messages)
        assert caught.value.status_code == 400
        assert caught.value.body == {"type": "error", "error": {
            "type": "invalid_request_error",
            "message": f"messages.1.content.{index}: Invalid `{field}` in `{kind}` block"}}
    again = await client.messages.create(model=MODEL, max_tokens=5,
                                         messages=sent(thought, redacted))
    assert again.content[0].to_dict() == {"type": "text", "text": "again"}
    # Another server (another key) takes none of them; one with the same key does.
    with FakeAnthropicServer([Reply.text("x")]) as other:
        assert other.thinking_signature("Weigh it.") != thought["signature"]
    shared = FakeAnthropicServer(signing_key=b"k")
    assert FakeAnthropicServer(signing_key=b"k").thinking_signature("a") == \
        shared.thinking_signature("a")
    with pytest.raises(le.ConfigError) as caught:
        FakeAnthropicServer(signing_key="k")  # type: ignore[arg-type]
    assert caught.value.field == "signing_key"
    # A signature that is not ASCII is refused like any other, not a crash.
    with pytest.raises(anthropic.BadRequestError, match="Invalid `signature`"):
        await client.messages.create(model=MODEL, max_tokens=5, messages=sent(
            {**thought, "signature": "sïgnature"}, redacted))


@pytest.mark.parametrize(("messages", "refusal"), [
    ([{"role": "user", "content": "go"},
      {"role": "assistant", "content": [
          {"type": "tool_use", "id": "toolu_a", "name": "f", "input": {}},
          {"type": "tool_use", "id": "toolu_b", "name": "f", "input": {}}]},
      {"role": "user", "content": [
          {"type": "tool_result", "tool_use_id": "toolu_a", "content": "1"}]}],
     r"messages\.1: `tool_use` ids were found without `tool_result` blocks immediately "
     r"after: toolu_b\."),
    ([{"role": "user", "content": "go"},
      {"role": "assistant", "content": [
          {"type": "tool_use", "id": "toolu_a", "name": "f", "input": {}}]},
      {"role": "user", "content": [
          {"type": "tool_result", "tool_use_id": "toolu_a", "content": "1"},
          {"type": "tool_result", "tool_use_id": "toolu_x", "content": "2"}]}],
     r"messages\.2\.content\.1: unexpected `tool_use_id` found in `tool_result` blocks: "
     r"toolu_x\."),
    ([{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_a", "content": "1"}]}],
     r"messages\.0\.content\.0: unexpected `tool_use_id`"),
], ids=["unanswered", "unasked", "first"])
async def test_the_fake_refuses_calls_and_results_that_do_not_pair(
    fake_anthropic_server: FakeAnthropicServer, client: anthropic.AsyncAnthropic,
    messages: Any, refusal: str
) -> None:
    """As the API does: every call of an assistant message is answered by a
    tool_result of the next message, and every tool_result answers a call of
    the previous one; anything else is its 400, in its words."""
    fake_anthropic_server.add(Reply.text("ok"))
    tools: Any = [{"name": "f", "input_schema": {"type": "object"}}]
    with pytest.raises(anthropic.BadRequestError, match=refusal) as refused:
        await client.messages.create(model=MODEL, max_tokens=5, messages=messages, tools=tools)
    assert refused.value.type == "invalid_request_error"
    paired = [*messages[:2], {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": b["id"], "content": "1"}
        for b in messages[1]["content"] if b["type"] == "tool_use"]}] \
        if len(messages) > 1 else HELLO
    reply = await client.messages.create(model=MODEL, max_tokens=5, messages=paired,
                                         tools=tools)
    assert reply.content[0].type == "text" and reply.content[0].text == "ok"
