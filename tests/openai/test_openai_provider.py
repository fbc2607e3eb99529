"""OpenAIProvider itself: translation at the boundary both ways, its settings, its
clients on event loops, usage and prices, and streaming to on_text; through the
real ``openai`` SDK and FakeOpenAIServer wherever a wire is involved."""

from __future__ import annotations

import asyncio
import sqlite3
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import httpx2
import openai
import pydantic
import pytest

import loopengine as le
from loopengine.persistence import MemoryLedger, SQLiteLedger
from loopengine.providers import FaultKind, OpenAIProvider, ProviderFault
from loopengine.providers._openai_chat import (
    chat_messages,
    chat_tool_choice,
    chat_tools,
    content_from_message,
    stop_reason,
    usage_from_api,
)
from loopengine.providers._openai_faults import classify_error
from loopengine.testing import CutStream, FakeOpenAIServer, Reply

from ..adapter.test_event_loops import assert_nothing_left_open, run_on_trio
from .conftest import MODEL, PRICES, OpenAIHarness, openai_operation, tool_messages

# -- translation: the engine's transcript -> Chat Completions -------------------------


def test_system_blocks_become_one_system_message() -> None:
    """Anthropic system text blocks (with their cache markers) become one system message."""
    system = [{"type": "text", "text": "one", "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": "two"}]
    assert chat_messages(system, [{"role": "user", "content": "hi"}]) == [
        {"role": "system", "content": "one\n\ntwo"}, {"role": "user", "content": "hi"}]


def test_a_tool_turn_becomes_tool_calls_and_one_tool_message_per_result() -> None:
    """tool_use blocks become the assistant's tool_calls; each tool_result a tool
    message, before the user's own text; an is_error result reads as an error."""
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hmm", "signature": "s"},
            {"type": "text", "text": "Looking."},
            {"type": "tool_use", "id": "c1", "name": "lookup", "input": {"key": "a"}},
            {"type": "tool_use", "id": "c2", "name": "lookup", "input": '{"key": '}]},
        {"role": "user", "content": [
            {"type": "text", "text": "and hurry"},
            {"type": "tool_result", "tool_use_id": "c1",
             "content": [{"type": "text", "text": "value"}]},
            {"type": "tool_result", "tool_use_id": "c2", "content": "bad input",
             "is_error": True}]},
    ]
    assert chat_messages(None, messages) == [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "lookup", "arguments": '{"key": "a"}'}},
            {"id": "c2", "type": "function",
             "function": {"name": "lookup", "arguments": '{"key": '}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "value"},
        {"role": "tool", "tool_call_id": "c2", "content": "Error: bad input"},
        {"role": "user", "content": "and hurry"},
    ]


def test_images_become_image_url_parts() -> None:
    """A base64 image and a URL image become image_url parts beside the text."""
    content = [{"type": "text", "text": "what is this?"},
               {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                            "data": "AAAA"}},
               {"type": "image", "source": {"type": "url", "url": "https://x.test/a.png"}}]
    (message,) = chat_messages(None, [{"role": "user", "content": content}])
    assert message["content"] == [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "image_url", "image_url": {"url": "https://x.test/a.png"}}]


@pytest.mark.parametrize("message", [
    {"role": "user", "content": [{"type": "document", "source": {}}]},
    {"role": "assistant", "content": [{"type": "server_tool_use", "id": "s", "name": "web"}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c",
                                  "content": [{"type": "search_result", "source": "s"}]}]},
], ids=["document", "server-tool", "search-result-in-tool-result"])
def test_a_block_without_an_equivalent_is_a_bad_request_not_sent(
    message: dict[str, Any],
) -> None:
    """A block Chat Completions cannot carry is a permanent bad_request fault."""
    with pytest.raises(ProviderFault) as info:
        chat_messages(None, [message])
    assert info.value.kind is FaultKind.BAD_REQUEST
    assert info.value.error_code == "untranslatable"


def test_tools_and_tool_choice_translate() -> None:
    """Tool definitions become function tools with their schema as parameters;
    tool_choice auto / none / any / a named tool become auto / none / required /
    that function."""
    schema = {"type": "object", "properties": {"key": {"type": "string"}}}
    assert chat_tools([{"name": "lookup", "description": "Look up.", "input_schema": schema}]) \
        == [{"type": "function", "function": {"name": "lookup", "description": "Look up.",
                                               "parameters": schema}}]
    assert [chat_tool_choice(c) for c in (None, {"type": "auto"}, {"type": "none"},
                                          {"type": "any"})] == [None, "auto", "none",
                                                                "required"]
    assert chat_tool_choice({"type": "tool", "name": "final_answer"}) == {
        "type": "function", "function": {"name": "final_answer"}}


# -- translation: the reply -> content blocks -------------------------------------------


def test_a_reply_becomes_text_and_tool_use_blocks() -> None:
    """Text, then one tool_use per call with parsed arguments; empty arguments are {}
    and arguments that are not a JSON object stay the string the model sent."""
    message = {"content": "Let me look.", "tool_calls": [
        {"id": "c1", "function": {"name": "lookup", "arguments": '{"key": "a"}'}},
        {"id": "c2", "function": {"name": "now", "arguments": ""}},
        {"id": "c3", "function": {"name": "lookup", "arguments": "[1, 2]"}},
        {"id": "c4", "function": {"name": "lookup", "arguments": "{oops"}}]}
    content, stop = content_from_message(message, "tool_calls")
    assert stop == "tool_use"
    assert content == [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "c1", "name": "lookup", "input": {"key": "a"}},
        {"type": "tool_use", "id": "c2", "name": "now", "input": {}},
        {"type": "tool_use", "id": "c3", "name": "lookup", "input": "[1, 2]"},
        {"type": "tool_use", "id": "c4", "name": "lookup", "input": "{oops"}]


def test_finish_reasons_become_stop_reasons_and_a_refusal_refuses() -> None:
    """stop, tool_calls, length, content_filter (and compatible servers' names for
    them) map to end_turn, tool_use, max_tokens, refusal; no other value is a stop
    reason (the provider raises its fault); a message refusal is a refusal
    whatever the finish reason."""
    assert [stop_reason(r) for r in ("stop", "tool_calls", "length", "content_filter",
                                     "eos", "model_length", "abort", None)] == [
        "end_turn", "tool_use", "max_tokens", "refusal", "end_turn", "max_tokens", None,
        None]
    content, stop = content_from_message({"content": None, "refusal": "I can't help."},
                                         "stop")
    assert (content, stop) == ([{"type": "text", "text": "I can't help."}], "refusal")


def test_usage_takes_the_cached_tokens_out_of_the_prompt() -> None:
    """prompt_tokens includes cached_tokens: input is the difference, the cached part
    is the cache read; reasoning tokens stay inside completion_tokens (and are noted);
    cache writes are taken out too, and only a tier that changes the price is kept."""
    raw = {"prompt_tokens": 3000, "completion_tokens": 700, "total_tokens": 3700,
           "prompt_tokens_details": {"cached_tokens": 2048},
           "completion_tokens_details": {"reasoning_tokens": 500}}
    assert usage_from_api(raw) == le.Usage(input_tokens=952, output_tokens=700,
                                           cache_read_tokens=2048, reasoning_tokens=500)
    written = {"prompt_tokens": 5000, "completion_tokens": 10,
               "prompt_tokens_details": {"cached_tokens": 1000, "cache_write_tokens": 3000}}
    assert usage_from_api(written, "flex") == le.Usage(
        input_tokens=1000, output_tokens=10, cache_read_tokens=1000, cache_write_tokens=3000,
        service_tier="flex")
    assert usage_from_api(written, "default") == usage_from_api(written)
    assert usage_from_api({"prompt_tokens": 10, "completion_tokens": None}) == le.Usage(
        input_tokens=10)
    assert usage_from_api(None) is None



@pytest.mark.parametrize("raw", [
    {"prompt_tokens": 2**63, "completion_tokens": 1},
    {"prompt_tokens": 1, "completion_tokens": 2**70},
])
def test_usage_reporting_an_impossible_count_is_an_invalid_response(raw: dict[str, Any]) -> None:
    """A count no ledger column can hold is the reply's fault, not a ConfigError."""
    with pytest.raises(ProviderFault) as info:
        usage_from_api(raw)
    assert (info.value.kind, info.value.error_code) == (FaultKind.SERVER_ERROR,
                                                        "invalid_response")


async def test_usage_with_cached_tokens_is_priced_by_genai_prices(wire: OpenAIHarness) -> None:
    """gpt-4o at genai-prices' published rates ($2.50 input, $1.25 cached input, $10
    output per million tokens): 1000 uncached + 2000 cached + 500 output cost $0.01."""
    usage = le.Usage(input_tokens=1000, cache_read_tokens=2000, output_tokens=500)
    engine, ledger = wire.engine(Reply.text("hi", usage=usage), prices=le.PriceBook())
    op = le.Operation(name="t", provider="openai", model="gpt-4o")
    result = await engine.run(op, "go")
    assert result.usage == usage and wire.server.usage_served == usage
    assert (wire.requests[0].body["model"], result.cost_usd) == ("gpt-4o", Decimal("0.01"))
    (row,) = ledger.attempts.values()
    assert row["price_ref"].startswith("genai-prices:") and row["price_ref"].endswith(
        "openai/gpt-4o")


async def test_a_model_no_price_source_knows_is_unpriced(wire: OpenAIHarness) -> None:
    """A compatible server's local model (no price anywhere) is recorded unpriced."""
    engine, ledger = wire.engine(Reply.text("hi"), prices=le.PriceBook())
    result = await engine.run(le.Operation(name="t", provider="openai", model="llama3.1:8b"),
                              "go")
    assert result.outcome is le.Outcome.COMPLETED and result.unpriced
    (row,) = ledger.attempts.values()
    assert (row["cost_nanousd"], row["served_by"]) == (None, "openai:llama3.1:8b")


# -- the request on the wire ---------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_the_request_carries_the_operation_and_nothing_invented(
    wire: OpenAIHarness, stream: bool
) -> None:
    """Model, max_completion_tokens, the messages, the key; streams ask for usage."""
    engine, _ = wire.engine(Reply.text("ok"), stream=stream)
    await engine.run(openai_operation(), "hi", system="be brief")
    (sent,) = wire.requests
    assert sent.path == "/v1/chat/completions"
    assert sent.body["model"] == MODEL and sent.body["max_completion_tokens"] == 512
    assert sent.messages == [{"role": "system", "content": "be brief"},
                             {"role": "user", "content": "hi"}]
    assert "tools" not in sent.body and "tool_choice" not in sent.body
    assert sent.stream is stream
    assert (sent.body.get("stream_options") == {"include_usage": True}) is stream
    assert sent.headers["authorization"] == "Bearer test-key"


class City(pydantic.BaseModel):
    name: str


async def test_a_structured_call_forces_its_answer_function(wire: OpenAIHarness) -> None:
    """Engine.call forces the answer tool: tool_choice names that function."""
    engine, _ = wire.engine(Reply.tool_calls(("final_answer", {"name": "Oslo"})))
    result = await engine.call(openai_operation(), "capital of Norway?", output=City)
    assert result.data == City(name="Oslo")
    (sent,) = wire.requests
    (tool,) = sent.body["tools"]
    assert sent.body["tool_choice"] == {"type": "function",
                                        "function": {"name": tool["function"]["name"]}}


# -- streaming --------------------------------------------------------------------------


async def test_streamed_text_reaches_on_text_and_streamed_calls_are_joined(
    wire: OpenAIHarness,
) -> None:
    """Text deltas reach an async on_text as they arrive; tool calls streamed in
    pieces (arguments split across chunks) become whole tool_use blocks, one batch."""
    seen: list[str] = []

    async def sink(text: str) -> None:
        await anyio.lowlevel.checkpoint()
        seen.append(text)

    calls = Reply.tool_calls(("lookup", {"key": "a"}), ("lookup", {"key": "b"}),
                             text="Looking both up.")
    engine, _ = wire.engine(calls, Reply.text("The quick brown fox"), stream=True)
    answered: list[str] = []

    @le.tool
    async def lookup(key: str) -> str:
        """Look a key up."""
        answered.append(key)
        return key.upper()

    result = await engine.run(openai_operation(), "go", tools=[lookup], on_text=sink)
    assert result.answer == "The quick brown fox"
    assert seen == ["Looking ", "both ", "up.", "The ", "quick ", "brown ", "fox"]
    assert answered == ["a", "b"] and result.tool_calls == 2
    assistant = result.messages[1]["content"]
    assert [(b["type"], b.get("input")) for b in assistant] == [
        ("text", None), ("tool_use", {"key": "a"}), ("tool_use", {"key": "b"})]


async def test_a_run_that_reads_the_text_streams_on_a_plain_provider_openai(
    wire: OpenAIHarness,
) -> None:
    """An OpenAIProvider built without ``stream=True`` streams (usage included) the
    requests of a run that reads the text (on_text, engine.stream), and reads the
    others whole."""
    engine, ledger = wire.engine(Reply.text("The quick brown fox"),
                                 Reply.text("Slow and steady"), Reply.text("Plain"))
    seen: list[str] = []
    result = await engine.run(openai_operation(), "go", on_text=seen.append)
    assert (result.answer, seen) == ("The quick brown fox", ["The ", "quick ", "brown ", "fox"])
    async with engine.stream(openai_operation(), "go") as run:
        deltas = [(event.attempt, event.text) async for event in run
                  if isinstance(event, le.events.TextDelta)]
    assert run.result.answer == "Slow and steady" and run.result.attempts.usage_complete
    assert deltas == [(1, "Slow "), (1, "and "), (1, "steady")]
    assert (await engine.run(openai_operation(), "go")).answer == "Plain"
    assert [(r.body.get("stream"), r.body.get("stream_options")) for r in wire.requests] == [
        (True, {"include_usage": True}), (True, {"include_usage": True}), (None, None)]
    assert all(row["outcome"] == "ok" and row["output_tokens"] is not None
               for row in ledger.attempts.values())


async def test_a_stream_without_its_usage_chunk_is_aborted_unless_usage_is_optional(
    wire: OpenAIHarness, caplog: pytest.LogCaptureFixture, tmp_path: Path,
) -> None:
    """A server that sends no usage in streams (finish_reason and [DONE], no usage
    chunk): by default each attempt is aborted and retried to the policy's end;
    with ``stream_usage="optional"`` the one attempt is ok, its usage unknown: no
    tokens and no cost in its ledger row, usage_complete false, a warning."""
    wire.server.stream_usage = False
    engine, ledger = wire.engine(*[Reply.text("Whole answer")] * 3, stream=True)
    result = await engine.run(openai_operation(), "go")
    assert result.outcome is le.Outcome.PROVIDER_ERROR
    assert [(row["outcome"], row["fault"]) for row in ledger.attempts.values()] == [
        ("aborted", "aborted")] * 3
    assert wire.server.requests[0].body["stream_options"] == {"include_usage": True}

    with SQLiteLedger(tmp_path / "ledger.db") as sqlite_ledger:
        engine, _ = wire.engine(Reply.text("Whole answer"), stream=True, ledger=sqlite_ledger,
                                provider_kwargs={"stream_usage": "optional"})
        with caplog.at_level("WARNING", logger="loopengine"):
            result = await engine.run(openai_operation(), "go")
    assert (result.outcome, result.answer) == (le.Outcome.COMPLETED, "Whole answer")
    assert not result.attempts.usage_complete and result.usage == le.Usage()
    with sqlite3.connect(tmp_path / "ledger.db") as db:
        (row,) = db.execute(
            "SELECT outcome, fault, charged, input_tokens, output_tokens, cost_nanousd, "
            "response_id, stop_reason FROM attempts").fetchall()
    assert row[:6] == ("ok", None, 0, None, None, None)
    assert row[6] is not None and row[7] == "end_turn"
    assert "without its usage chunk" in caplog.text
    # The server kept its word: no usage went on the wire.
    assert wire.server.usage_served == le.Usage()


async def test_optional_stream_usage_still_refuses_a_stream_cut_before_its_end(
    wire: OpenAIHarness,
) -> None:
    """With ``stream_usage="optional"`` a stream that ends before its finish_reason
    is still aborted and retried; a stream that carries its usage is priced."""
    engine, ledger = wire.engine(CutStream(reply=Reply.text("a b c d e"), after=3),
                                 Reply.text("whole"), stream=True,
                                 provider_kwargs={"stream_usage": "optional"})
    result = await engine.run(openai_operation(), "go")
    assert (result.answer, result.attempts.usage_complete) == ("whole", False)
    rows = list(ledger.attempts.values())
    assert [row["outcome"] for row in rows] == ["aborted", "ok"]
    assert rows[1]["output_tokens"] == 20 and rows[1]["cost_nanousd"] is not None


def test_stream_usage_takes_required_or_optional() -> None:
    """Any other stream_usage is a ConfigError naming it."""
    with pytest.raises(le.ConfigError) as info:
        OpenAIProvider(api_key="k", stream_usage="sometimes")  # type: ignore[arg-type]
    assert info.value.field == "stream_usage"


class CallbackBroke(Exception):
    """The caller's own bug."""


async def test_an_on_text_callback_that_raises_reaches_the_caller_and_is_no_fault_openai(
    wire: OpenAIHarness,
) -> None:
    """``on_text`` raises: the provider stops reading and raises an aborted fault with
    the ids so far, from the callback's error; the caller gets the callback's own
    exception, nothing is retried, the attempt carries no fault."""

    def on_text(text: str) -> None:
        raise CallbackBroke(f"cannot show {text!r}")

    ledger = MemoryLedger()
    engine, _ = wire.engine(Reply.text("hello there"), Reply.text("not asked for"),
                            stream=True, ledger=ledger)
    with pytest.raises(CallbackBroke, match="cannot show"):
        await engine.run(openai_operation(), "go", on_text=on_text)
    (attempt,) = ledger.attempts.values()
    assert attempt["fault"] is None
    assert (attempt["outcome"], attempt["aborted_reason"]) == ("aborted", "external")
    assert attempt["request_id"] == "req_fake_0001"
    assert [r["outcome"] for r in ledger.invocations.values()] == ["failed"]
    assert len(wire.requests) == 1


async def test_the_callbacks_fault_carries_the_ids_and_its_cause(
    fake_openai_server: FakeOpenAIServer,
) -> None:
    """At the seam: the aborted fault names the request and the completion, and is
    raised from the callback's exception."""
    fake_openai_server.add(Reply.text("hello there"))
    provider = OpenAIProvider(api_key="k", base_url=fake_openai_server.base_url, stream=True,
                              http_client=httpx2.AsyncClient(verify=False))
    broke = CallbackBroke("no")

    def on_text(text: str) -> None:
        raise broke

    request = le.providers.ProviderRequest(model=MODEL, max_tokens=16,
                                           messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(ProviderFault) as info:
        await provider.send(request, on_text=on_text)
    await provider.aclose()
    fault = info.value
    assert fault.kind is FaultKind.ABORTED and fault.__cause__ is broke
    assert (fault.request_id, fault.response_id) == ("req_fake_0001", "chatcmpl-fake-0001")


# -- settings -------------------------------------------------------------------------


def test_settings_the_provider_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    """max_retries other than 0, a client and keywords, a sync client, missing
    credentials: each a ConfigError naming the field."""
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(le.ConfigError) as info:
        OpenAIProvider(api_key="k", max_retries=2)
    assert info.value.field == "max_retries"
    client = openai.AsyncOpenAI(api_key="k")
    with pytest.raises(le.ConfigError) as info:
        OpenAIProvider(client, api_key="k")
    assert info.value.field == "client"
    with pytest.raises(le.ConfigError) as info:
        OpenAIProvider(openai.OpenAI(api_key="k"))  # type: ignore[arg-type]
    assert info.value.field == "client"
    with pytest.raises(le.ConfigError, match="api_key") as info:
        OpenAIProvider()
    assert info.value.field == "client"
    with pytest.raises(le.ConfigError) as info:
        OpenAIProvider(api_key="k", route="")
    assert info.value.field == "route"


def test_routes_and_vendors() -> None:
    """The route defaults to the vendor (openai, azure for an Azure client, built or
    given); a named route is the provider's name; the SDK never retries."""
    plain = OpenAIProvider(api_key="k")
    azure = OpenAIProvider(api_key="k", azure_endpoint="https://x.openai.azure.com",
                           api_version="2024-10-21")
    given = OpenAIProvider(openai.AsyncAzureOpenAI(api_key="k", api_version="2024-10-21",
                                                   azure_endpoint="https://y.openai.azure.com"))
    named = OpenAIProvider(api_key="k", route="openai-eu")
    assert [(p.name, p.vendor) for p in (plain, azure, given, named)] == [
        ("openai", "openai"), ("azure", "azure"), ("azure", "azure"), ("openai-eu", "openai")]
    assert isinstance(azure.client, openai.AsyncAzureOpenAI)
    assert all(p.client.max_retries == 0 for p in (plain, azure, given, named))
    assert all(p.features == {"reasoning_effort", "service_tier", "web_search_options"}
               and p.streaming for p in (plain, azure, given, named))


async def test_an_azure_route_is_recorded_azure(fake_openai_server: FakeOpenAIServer) -> None:
    """An Azure client's attempts are served_by azure:<deployment>, priced under azure."""
    fake_openai_server.add(Reply.text("hi"))
    client = openai.AsyncAzureOpenAI(api_key="k", api_version="2024-10-21",
                                     base_url=f"{fake_openai_server.url}/openai",
                                     http_client=httpx2.AsyncClient(verify=False))
    provider = OpenAIProvider(client)
    ledger = MemoryLedger()
    engine = le.Engine(provider, ledger=ledger)
    result = await engine.run(le.Operation(name="t", provider="azure", model="gpt-4o"), "go")
    await client.close()
    assert result.outcome is le.Outcome.COMPLETED, result.detail
    (row,) = ledger.attempts.values()
    assert row["served_by"] == "azure:gpt-4o" and row["cost_nanousd"] is not None


# -- event loops ----------------------------------------------------------------------


def test_one_provider_serves_consecutive_event_loops_each_on_its_own_client(
    fake_openai_server: FakeOpenAIServer,
) -> None:
    """asyncio, trio, asyncio on one engine built from keywords: each run completes
    on its first attempt, on a client of its loop, closed as that loop shuts down."""
    fake_openai_server.add(*(Reply.text(f"answer {n}") for n in range(3)))
    provider = OpenAIProvider(api_key="k", base_url=fake_openai_server.base_url)
    engine = le.Engine(provider, prices=PRICES)
    used: list[Any] = []

    async def one() -> le.RunResult:
        result = await engine.run(openai_operation(), "hi")
        used.append(provider.client)
        return result

    results = [asyncio.run(one()), run_on_trio(one), asyncio.run(one())]
    assert [(r.outcome, r.attempts.count) for r in results] == [(le.Outcome.COMPLETED, 1)] * 3
    assert len({id(c) for c in used}) == 3
    assert all(c.is_closed() for c in used)
    assert_nothing_left_open()


def test_a_given_client_is_refused_on_another_event_loop_before_anything_is_sent(
    fake_openai_server: FakeOpenAIServer,
) -> None:
    """A client the caller gave works on its first loop; on another the run raises
    ConfigError naming it, recording no attempt, and the server receives nothing."""
    fake_openai_server.add(Reply.text("one"), Reply.text("two"))
    client = openai.AsyncOpenAI(api_key="k", base_url=fake_openai_server.base_url,
                                http_client=httpx2.AsyncClient(verify=False))
    ledger = MemoryLedger()
    engine = le.Engine(OpenAIProvider(client), ledger=ledger, prices=PRICES)
    with asyncio.Runner() as first:
        assert first.run(engine.run(openai_operation(), "hi")).outcome is le.Outcome.COMPLETED
        with pytest.raises(le.ConfigError, match="OpenAIProvider was first used on another "
                                                 "event loop, which is still open") as info:
            asyncio.run(engine.run(openai_operation(), "on another loop"))
        assert info.value.field == "client"
        first.run(client.close())
    assert len(fake_openai_server.requests) == 1
    assert [row["outcome"] for row in ledger.attempts.values()] == ["ok"]
    assert_nothing_left_open()


# -- classification at the seam -------------------------------------------------------


def test_a_plain_sdk_error_is_a_bad_request() -> None:
    """An SDK error with no response (a bad argument) is not retried."""
    fault = classify_error(openai.OpenAIError("The api_key client option must be set"))
    assert fault.kind is FaultKind.BAD_REQUEST and not fault.retryable


async def test_engine_stream_yields_the_text_deltas_of_a_streamed_reply(
    wire: OpenAIHarness,
) -> None:
    """`Engine.stream` through OpenAIProvider(stream=True): the deltas make the answer."""
    from loopengine import events
    from loopengine.testing import Reply

    from .conftest import openai_operation

    engine, _ = wire.engine(Reply.text("streamed through chat completions"), stream=True)
    async with engine.stream(openai_operation(), "go") as run:
        deltas = [e for e in [event async for event in run] if isinstance(e, events.TextDelta)]
    assert run.result.outcome is le.Outcome.COMPLETED
    assert "".join(d.text for d in deltas) == "streamed through chat completions"
    assert {(d.turn, d.attempt) for d in deltas} == {(1, 1)}


async def test_a_structured_call_answers_each_of_parallel_calls_for_itself(
    wire: OpenAIHarness,
) -> None:
    """A reply with parallel calls of the answer function has only its first checked
    (as a run does); the repair tells that call its own error and the others
    that they were not checked, never another call's error as theirs."""
    engine, ledger = wire.engine(
        Reply.tool_calls(("final_answer", {"nom": "Oslo"}), ("final_answer", {"name": "Oslo"})),
        Reply.tool_calls(("final_answer", {"name": "Oslo"})))
    result = await engine.call(openai_operation(), "capital of Norway?", output=City)
    assert result.data == City(name="Oslo") and result.attempts.count == 2
    first, second = (m["content"] for m in tool_messages(wire.requests[1]))
    assert "name: Field required" in first
    assert "Field required" not in second and "Not checked" in second
