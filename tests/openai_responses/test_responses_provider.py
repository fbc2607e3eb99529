"""OpenAIResponsesProvider on the wire: what it sends, how it reads a reply back
(text, calls, reasoning items, web searches), usage and prices to the nano-dollar,
and continuing from ``result.messages``. Everything goes through the real
``openai`` SDK and FakeOpenAIServer's ``/v1/responses``."""

from __future__ import annotations

import dataclasses
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

import loopengine as le
from loopengine._features import Features
from loopengine.providers import OpenAIResponsesProvider, ProviderFault, ProviderRequest
from loopengine.providers._openai_responses_items import reasoning_model
from loopengine.testing import Reply

from ..adapter.conftest import STREAMING
from ..rule_scenarios import Counter, lookup
from .conftest import ResponsesHarness, function_outputs, items, openai_operation

REASONING = {"type": "reasoning", "id": "rs_fake_1",
             "summary": [{"type": "summary_text", "text": "Look it up first."}],
             "encrypted_content": "gAAAA-opaque-reasoning"}

GENAI = le.PriceBook(credits_per_usd=Decimal(1_000_000))
"""genai-prices alone (gpt-5: $1.25 in, $0.125 cached, $10 out per million, $10 per
1,000 web searches), one credit per micro-dollar."""


def gpt5(**fields: Any) -> le.Operation:
    """The test operation on gpt-5, priced by genai-prices."""
    return dataclasses.replace(openai_operation(), model="gpt-5", **fields)


@STREAMING
async def test_usage_maps_to_the_chat_routes_vector_and_is_priced_to_the_nano_dollar(
    wire: ResponsesHarness, stream: bool
) -> None:
    """input_tokens holds the cached and cache-written tokens (taken out, as for Chat
    Completions); reasoning tokens are inside the output; the price is genai-prices'
    gpt-5 rates, exact."""
    served = le.Usage(input_tokens=1000, cache_read_tokens=2000, cache_write_tokens=400,
                      output_tokens=500, reasoning_tokens=300)
    engine, ledger = wire.engine(Reply.text("hi", usage=served), stream=stream, prices=GENAI)
    result = await engine.run(gpt5(), "go")
    assert result.outcome is le.Outcome.COMPLETED
    assert result.usage == served == wire.server.usage_served
    # 1,400 uncached-or-written at $1.25, 2,000 cached at $0.125, 500 out at $10 (per M).
    expected = (1400 * Decimal("1.25") + 2000 * Decimal("0.125") + 500 * 10) * 1000
    (row,) = ledger.attempts.values()
    assert row["cost_nanousd"] == int(expected) == 7_000_000
    assert (row["input_tokens"], row["cache_read_tokens"], row["cache_write_tokens"],
            row["output_tokens"], row["reasoning_tokens"]) == (1000, 2000, 400, 500, 300)
    assert row["price_ref"].startswith("genai-prices:") and row["served_by"] == "openai:gpt-5"


@STREAMING
async def test_web_searches_are_sent_counted_and_charged_their_fee(
    wire: ResponsesHarness, stream: bool
) -> None:
    """An operation publishing the web search tool sends it (max_uses as
    max_tool_calls); the reply's searches are counted and charged $10 per 1,000 on
    top of the tokens; the web_search_call items stay in the transcript and go back."""
    tool = le.ServerTool(type="web_search", name="web_search", max_uses=3,
                         params={"search_context_size": "low"})
    search = {"type": "web_search_call", "id": "ws_1", "status": "completed",
              "action": {"type": "search", "query": "weather Oslo"}}
    reply = Reply(content=[search, {"type": "text", "text": "Sunny."}],
                  usage=le.Usage(input_tokens=100, output_tokens=20, web_search_requests=2))
    engine, ledger = wire.engine(reply, Reply.text("ok"), stream=stream, prices=GENAI)
    op = gpt5(server_tools=(tool,), limits=le.Limits(credit_hold=1_000_000))
    result = await engine.run(op, "weather?")
    assert result.outcome is le.Outcome.COMPLETED and result.answer == "Sunny."
    body = wire.requests[0].body
    assert body["tools"] == [{"type": "web_search", "search_context_size": "low"}]
    assert body["max_tool_calls"] == 3
    (row,) = ledger.attempts.values()
    fee = 2 * 10 * 1_000_000  # two searches at $10 per 1,000, in nano-USD
    tokens = 100 * 1250 + 20 * 10_000
    assert (row["web_search_requests"], row["fee_nanousd"], row["cost_nanousd"]) == (
        2, fee, fee + tokens)
    assert result.messages[-1]["content"][0] == search
    again = await engine.run(op, [*result.messages, {"role": "user", "content": "and now?"}])
    assert again.outcome is le.Outcome.COMPLETED
    assert search in items(wire.requests[1])


@pytest.mark.parametrize(("model", "tool_type", "per_k", "rate_in", "rate_out"), [
    ("gpt-4.1", "web_search_preview", 25, 2, 8),
    ("gpt-4.1", "web_search_preview_2025_03_11", 25, 2, 8),
    ("gpt-4.1", "web_search", 10, 2, 8),
    ("gpt-5", "web_search_preview", 10, Decimal("1.25"), 10),
])
async def test_r07_a_search_of_the_preview_tool_on_a_non_reasoning_model_is_charged_25_per_k(
    wire: ResponsesHarness, model: str, tool_type: str, per_k: int, rate_in: Decimal,
    rate_out: Decimal, tmp_path: Path,
) -> None:
    """OpenAI bills the web search preview tool on a non-reasoning model (gpt-4o,
    gpt-4.1) $25 per 1,000 calls; the web search tool, and the preview tool on a
    reasoning model, $10 (genai-prices' fee for the model). The ledger's attempt,
    the run's credit hold reservation and the estimate charge the tool's fee,
    and so do the replay's.
    gpt-4.1 is $2 in / $8 out per million, gpt-5 $1.25 / $10."""
    recording = tmp_path / "run.jsonl"
    tool = le.ServerTool(type=tool_type, name="web_search", max_uses=2)
    search = {"type": "web_search_call", "id": "ws_1", "status": "completed",
              "action": {"type": "search", "query": "weather Oslo"}}
    reply = Reply(content=[search, {"type": "text", "text": "Sunny."}],
                  usage=le.Usage(input_tokens=1_000, output_tokens=200, web_search_requests=1))
    engine, ledger = wire.engine(reply, prices=GENAI, record=recording)
    op = dataclasses.replace(openai_operation(), model=model, server_tools=(tool,),
                             limits=le.Limits(credit_hold=1_000_000))
    result = await engine.run(op, "weather?")
    assert result.outcome is le.Outcome.COMPLETED
    assert wire.requests[0].body["tools"] == [{"type": tool_type}]
    (row,) = ledger.attempts.values()
    fee = per_k * 1_000_000  # one search, in nano-USD
    tokens = int((1_000 * rate_in + 200 * rate_out) * 1000)
    assert (row["web_search_requests"], row["fee_nanousd"], row["cost_nanousd"]) == (
        1, fee, fee + tokens)
    # Every turn of the estimate's worst case runs the tool's two searches.
    assert engine.estimate(op, "weather?").fee_usd == Decimal(
        op.limits.max_turns * 2 * per_k) / 1000
    replay, replayed = wire.replay(recording, prices=GENAI)
    again = await replay.run(op, "weather?")
    assert (again.outcome, again.cost_usd) == (result.outcome, result.cost_usd)
    assert [(r["web_search_requests"], r["fee_nanousd"], r["cost_nanousd"])
            for r in replayed.attempts.values()] == [(1, fee, fee + tokens)]
    assert replay.estimate(op, "weather?") == engine.estimate(op, "weather?")


async def test_web_searches_are_counted_from_the_items_without_tool_usage(
    wire: ResponsesHarness,
) -> None:
    """A reply without tool_usage: its web_search_call items that searched are the
    count (opening a page is not a billed search)."""
    body = {"id": "resp_x", "object": "response", "status": "completed", "model": "gpt-5",
            "output": [
                {"type": "web_search_call", "id": "ws_1", "status": "completed",
                 "action": {"type": "search", "query": "a"}},
                {"type": "web_search_call", "id": "ws_2", "status": "completed",
                 "action": {"type": "open_page", "url": "https://example.com"}},
                {"type": "web_search_call", "id": "ws_3", "status": "completed",
                 "action": {"type": "search", "query": "b"}},
                {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                 "content": [{"type": "output_text", "text": "done", "annotations": []}]}],
            "usage": {"input_tokens": 10, "output_tokens": 2,
                      "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}}}
    from loopengine.testing import ErrorReply

    engine, _ = wire.engine(ErrorReply(status=200, body=body), prices=GENAI)
    result = await engine.run(gpt5(), "go")
    assert result.outcome is le.Outcome.COMPLETED
    assert result.usage.web_search_requests == 2


@STREAMING
async def test_reasoning_items_round_trip_with_their_encrypted_content(
    wire: ResponsesHarness, stream: bool
) -> None:
    """With reasoning_effort the request asks for the encrypted content; the reasoning
    item is kept in result.messages and sent back with it, store false, no
    previous_response_id; the call and its output follow it, the call with the
    item id the server gave it (the API pairs it with its reasoning by that id,
    and refuses a reasoning item whose following item has none)."""
    counter = Counter()
    engine, _ = wire.engine(
        Reply(content=[REASONING, {"type": "tool_use", "id": "call_1", "name": "lookup",
                                   "input": {"key": "a"}}], stop_reason="tool_use"),
        Reply.text("done"), stream=stream)
    result = await engine.run(gpt5(reasoning_effort="low"), "go", tools=[counter.tool])
    assert result.outcome is le.Outcome.COMPLETED
    first, second = (r.body for r in wire.requests)
    assert first["include"] == ["reasoning.encrypted_content"]
    assert first["reasoning"] == {"effort": "low"}
    assert first["store"] is False and "previous_response_id" not in first
    assert result.messages[1]["content"][0] == {**REASONING, "next_item_id": "fc_fake_0001_1"}
    assert [i.get("type", "message") for i in second["input"]] == [
        "message", "reasoning", "function_call", "function_call_output"]
    assert second["input"][1] == REASONING
    assert second["input"][2]["id"] == "fc_fake_0001_1"
    assert "previous_response_id" not in second


@STREAMING
async def test_a_reasoning_model_keeps_its_reasoning_without_reasoning_effort(
    wire: ResponsesHarness, stream: bool
) -> None:
    """A reasoning model (gpt-5) reasons whether or not reasoning_effort is set: the
    request asks for the reasoning's encrypted content all the same (and sends
    no reasoning effort), so the reasoning item goes back on the next request,
    the call after it with the id that pairs them, instead of being dropped."""
    counter = Counter()
    engine, _ = wire.engine(
        Reply(content=[REASONING, {"type": "tool_use", "id": "call_1", "name": "lookup",
                                   "input": {"key": "a"}}], stop_reason="tool_use"),
        Reply.text("done"), stream=stream)
    result = await engine.run(gpt5(), "go", tools=[counter.tool])
    assert result.outcome is le.Outcome.COMPLETED, result.detail
    first, second = (r.body for r in wire.requests)
    assert first["include"] == ["reasoning.encrypted_content"] and "reasoning" not in first
    assert [i.get("type", "message") for i in second["input"]] == [
        "message", "reasoning", "function_call", "function_call_output"]
    assert second["input"][1] == REASONING
    assert second["input"][2]["id"] == "fc_fake_0001_1"


DEPLOYMENT = "support-assistant"
"""A model name that does not say whether the model reasons (an Azure deployment's)."""


@STREAMING
async def test_without_reasoning_effort_nothing_is_included_and_bare_reasoning_stays_home(
    wire: ResponsesHarness, stream: bool
) -> None:
    """Without reasoning_effort, a model not named as a reasoning model is asked for
    no include (one that does not reason would refuse it); a reasoning item its
    reply then carries has no encrypted content: it is kept in the transcript
    but not sent back (with store false the server could not find it by its
    id)."""
    counter = Counter()
    engine, _ = wire.engine(
        Reply(content=[REASONING, {"type": "tool_use", "id": "call_1", "name": "lookup",
                                   "input": {"key": "a"}}], stop_reason="tool_use"),
        Reply.text("done"), stream=stream)
    op = dataclasses.replace(openai_operation(), model=DEPLOYMENT)
    result = await engine.run(op, "go", tools=[counter.tool])
    assert result.outcome is le.Outcome.COMPLETED
    assert "include" not in wire.requests[0].body and "reasoning" not in wire.requests[0].body
    kept = result.messages[1]["content"][0]
    assert kept["type"] == "reasoning" and kept["encrypted_content"] is None
    assert [i.get("type", "message") for i in items(wire.requests[1])] == [
        "message", "function_call", "function_call_output"]
    # Its reasoning stayed home, so the call goes without the id that pairs them.
    assert "id" not in items(wire.requests[1])[1]


async def test_a_prefill_with_reasoning_effort_is_sent(wire: ResponsesHarness) -> None:
    """The Messages API's refusal of a prefill while thinking is on is not the
    Responses API's: a conversation ending with an assistant message goes out as
    its last input item, with the reasoning effort."""
    engine, _ = wire.engine(Reply.text(" blue"))
    prefill = [{"role": "user", "content": "Name a colour."},
               {"role": "assistant", "content": "The colour is"}]
    result = await engine.run(gpt5(reasoning_effort="low"), prefill)
    assert result.outcome is le.Outcome.COMPLETED, result.fault
    (sent,) = wire.requests
    assert sent.body["reasoning"] == {"effort": "low"}
    assert items(sent)[-1]["role"] == "assistant"


@STREAMING
async def test_a_web_search_whose_reasoning_stays_home_stays_home_too(
    wire: ResponsesHarness, stream: bool
) -> None:
    """The API refuses an output item sent back with its id (a web search call
    cannot go without one) but without the reasoning item before it. Without
    reasoning_effort, on a model not named as a reasoning model, that reasoning
    has no encrypted content and is not sent back, so neither is the web search
    call that followed it; the rest of the
    turn (the call, the answer) goes back without ids, and the run and its
    continuation are served."""
    counter = Counter()
    search = {"type": "web_search_call", "id": "ws_fake_1", "status": "completed",
              "action": {"type": "search", "query": "k"}}
    engine, _ = wire.engine(
        Reply(content=[REASONING, search, {"type": "tool_use", "id": "call_1",
                                           "name": "lookup", "input": {"key": "a"}}],
              stop_reason="tool_use"),
        Reply(content=[REASONING | {"id": "rs_fake_2"}, search | {"id": "ws_fake_2"},
                       {"type": "text", "text": "Found."}]),
        Reply.text("Again."), stream=stream)
    op = dataclasses.replace(openai_operation(), model=DEPLOYMENT, server_tools=(
        le.ServerTool(type="web_search", name="web_search"),))
    first = await engine.run(op, "go", tools=[counter.tool])
    assert first.outcome is le.Outcome.COMPLETED, first.detail
    assert [b["type"] for b in first.messages[1]["content"]] == [
        "reasoning", "web_search_call", "tool_use"]
    again = await engine.run(op, [*first.messages, {"role": "user", "content": "More?"}],
                             tools=[counter.tool])
    assert again.outcome is le.Outcome.COMPLETED, again.detail
    sent = items(wire.requests[2])
    assert [i.get("type", "message") for i in sent] == [
        "message", "function_call", "function_call_output", "message", "message"]
    assert not any("id" in item for item in sent)


@STREAMING
async def test_a_run_cut_after_its_reasoning_continues_from_result_messages(
    wire: ResponsesHarness, stream: bool
) -> None:
    """A response cut after its reasoning (max_output_tokens: nothing followed the
    reasoning item) ends incomplete; continuing from result.messages does not send
    that reasoning item back, which the API refuses without its following item."""
    engine, _ = wire.engine(Reply(content=[REASONING], stop_reason="max_tokens"),
                            Reply.text("done"), stream=stream)
    op = gpt5(reasoning_effort="low")
    first = await engine.run(op, "go")
    assert first.outcome is le.Outcome.INCOMPLETE
    assert first.messages[1]["content"] == [REASONING]
    second = await engine.run(op, [*first.messages, {"role": "user", "content": "go on"}])
    assert second.outcome is le.Outcome.COMPLETED, second.detail
    assert [i.get("type", "message") for i in items(wire.requests[1])] == [
        "message", "message"]


@STREAMING
async def test_a_run_continues_from_result_messages(
    wire: ResponsesHarness, stream: bool
) -> None:
    """result.messages (reasoning, calls, outputs, answer) is a history the caller
    continues: the next request carries all of it, the server accepts it."""
    counter = Counter()
    engine, _ = wire.engine(
        Reply(content=[REASONING, {"type": "tool_use", "id": "call_1", "name": "lookup",
                                   "input": {"key": "a"}}], stop_reason="tool_use"),
        Reply(content=[REASONING | {"id": "rs_fake_2"}, {"type": "text", "text": "A."}]),
        Reply.text("B."), stream=stream)
    op = gpt5(reasoning_effort="medium")
    first = await engine.run(op, "go", tools=[counter.tool], system="Be brief.")
    assert first.outcome is le.Outcome.COMPLETED and first.answer == "A."
    again = await engine.run(op, [*first.messages, {"role": "user", "content": "more"}],
                             tools=[counter.tool], system="Be brief.")
    assert again.outcome is le.Outcome.COMPLETED and again.answer == "B."
    sent = items(wire.requests[2])
    assert [i.get("type", "message") for i in sent] == [
        "message", "reasoning", "function_call", "function_call_output", "reasoning",
        "message", "message"]
    # The answer followed its reasoning: it goes back as the output message,
    # with its id.
    assert sent[-2:] == [{"type": "message", "role": "assistant", "status": "completed",
                          "id": "msg_fake_0002",
                          "content": [{"type": "output_text", "text": "A.",
                                       "annotations": []}]},
                         {"role": "user", "content": "more"}]
    assert function_outputs(wire.requests[2])[0]["output"] == "value of a"


async def test_streamed_text_reaches_on_text_as_the_deltas_arrive(
    wire: ResponsesHarness,
) -> None:
    """response.output_text.delta events reach on_text in order; the answer is their
    join; the streamed calls' argument deltas are joined."""
    seen: list[str] = []
    engine, _ = wire.engine(Reply.tool_calls(lookup("a")),
                            Reply.text("The answer is forty two."))
    counter = Counter()
    result = await engine.run(openai_operation(), "go", tools=[counter.tool],
                              on_text=seen.append)
    assert result.outcome is le.Outcome.COMPLETED
    assert counter.calls == ["a"]
    assert len(seen) == 5 and "".join(seen) == result.answer == "The answer is forty two."
    assert all(r.stream for r in wire.requests)


@STREAMING
async def test_the_request_carries_the_operation_and_nothing_invented(
    wire: ResponsesHarness, stream: bool
) -> None:
    """model, max_output_tokens, instructions, service tier, tool choice none on a
    wrap-up turn: what the operation says, nothing more."""
    counter = Counter()
    engine, _ = wire.engine(Reply.tool_calls(lookup("a")), Reply.text("wrapped"),
                            stream=stream)
    op = dataclasses.replace(openai_operation(max_turns=2, wrap_up=True),
                             service_tier="flex")
    flex = le.PriceBook([dataclasses.replace(p, service_tier_multipliers={"flex": Decimal("0.5")})
                         for p in engine.prices.prices], credits_per_usd=Decimal(1_000_000))
    engine.prices = flex
    result = await engine.run(op, "go", tools=[counter.tool], system="sys")
    assert result.outcome is le.Outcome.COMPLETED
    first, last = (r.body for r in wire.requests)
    assert (first["model"], first["max_output_tokens"], first["instructions"],
            first["service_tier"]) == ("gpt-4o-mini", 512, "sys", "flex")
    assert "tool_choice" not in first and "parallel_tool_calls" not in first
    assert last["tool_choice"] == "none"
    assert set(first) <= {"model", "input", "max_output_tokens", "store", "instructions",
                          "tools", "service_tier", "stream"}


def test_blocks_and_server_tools_without_an_equivalent_are_refused_before_the_wire() -> None:
    """A document, a Messages API server tool block and a server tool other than web
    search are bad requests (untranslatable); an image inside a tool result is sent
    as a note the model can read, as on the Chat route; another vendor's thinking
    is dropped."""
    provider = OpenAIResponsesProvider(api_key="k", base_url="http://127.0.0.1:9/v1")

    def request(messages: list[dict[str, Any]], **features: Any) -> ProviderRequest:
        return ProviderRequest(model="m", max_tokens=10, messages=messages,
                               features=Features(**features))

    bad = [
        [{"role": "user", "content": [{"type": "document", "source": {
            "type": "text", "media_type": "text/plain", "data": "x"}}]}],
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": [
            {"type": "server_tool_use", "id": "s", "name": "web_search", "input": {}}]}],
    ]
    for messages in bad:
        with pytest.raises(ProviderFault) as caught:
            provider.check_request(request(messages))
        assert caught.value.error_code == "untranslatable"
        assert "Responses API" in caught.value.message
    image_result = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                  "content": [{"type": "image", "source": {
                                                      "type": "url",
                                                      "url": "https://x/y.png"}}]}]}]
    provider.check_request(request(image_result))  # sent as "[image: https://x/y.png, ...]"
    code = le.ServerTool(type="code_execution_20250825", name="code")
    with pytest.raises(ProviderFault, match="only the web search tools"):
        provider.check_request(request([{"role": "user", "content": "q"}],
                                       server_tools=(code,)))
    thinking = [{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "hm", "signature": "sig"},
        {"type": "text", "text": "a"}]}, {"role": "user", "content": "q2"}]
    provider.check_request(request(thinking))


def test_routes_vendors_and_features() -> None:
    """The route defaults to the vendor, openai; a named route keeps the vendor for
    served_by and prices; it sends reasoning effort, service tier and web search."""
    plain = OpenAIResponsesProvider(api_key="k")
    named = OpenAIResponsesProvider(api_key="k", route="openai-responses")
    assert (plain.name, plain.vendor, plain.streaming) == ("openai", "openai", True)
    assert (named.name, named.vendor) == ("openai-responses", "openai")
    assert plain.features == {"reasoning_effort", "service_tier", "server_tools"}
    with pytest.raises(le.ConfigError) as caught:
        OpenAIResponsesProvider(api_key="k", max_retries=2)
    assert caught.value.field == "max_retries"


def test_a_model_string_names_the_responses_route(monkeypatch: pytest.MonkeyPatch) -> None:
    """"openai-responses:<model>" builds an operation on that route and its engine an
    OpenAIResponsesProvider serving it, from OPENAI_API_KEY and OPENAI_BASE_URL;
    the attempt is served_by openai:<model>."""
    from loopengine.testing import FakeOpenAIServer

    with FakeOpenAIServer([Reply.text("fine")]) as server:
        monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
        monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
        op = le.Operation.from_model("openai-responses:gpt-5")
        assert (op.provider, op.model) == ("openai-responses", "gpt-5")
        engine = le.Engine.from_model(op)
        assert isinstance(engine.providers["openai-responses"], OpenAIResponsesProvider)
        result = engine.run_sync(op, "ok?")
        assert result.answer == "fine" and server.requests[0].path == "/v1/responses"
        assert result.attempt_log[0].dispatch.served_by == "openai:gpt-5"


def test_the_translation_of_a_transcript_and_its_tools() -> None:
    """User text and images are one user message of parts after the function
    outputs; an error result is marked; tool_choice any is required and a single
    call per turn turns parallel calls off; the named function is top-level."""
    from loopengine.providers._openai_responses_items import responses_params

    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBOR"}}
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "c1", "name": "lookup",
                                           "input": {"key": "a"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "c1", "is_error": True,
             "content": [{"type": "text", "text": "not found"}]},
            {"type": "text", "text": "see this"}, image]},
    ]
    tool = {"name": "lookup", "description": "Look a key up.",
            "input_schema": {"type": "object", "properties": {"key": {"type": "string"}}}}
    params = responses_params(ProviderRequest(
        model="gpt-5", max_tokens=100, messages=messages, tools=[tool],
        tool_choice={"type": "any", "disable_parallel_tool_use": True}), stream=False)
    assert params["input"] == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "Let me look."},
        {"type": "function_call", "call_id": "c1", "name": "lookup",
         "arguments": '{"key": "a"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "Error: not found"},
        {"role": "user", "content": [
            {"type": "input_text", "text": "see this"},
            {"type": "input_image", "image_url": "data:image/png;base64,iVBOR",
             "detail": "auto"}]},
    ]
    assert (params["tool_choice"], params["parallel_tool_calls"]) == ("required", False)
    named = responses_params(ProviderRequest(
        model="gpt-5", max_tokens=100, messages=messages[:1], tools=[tool],
        tool_choice={"type": "tool", "name": "lookup"}), stream=True)
    assert named["tool_choice"] == {"type": "function", "name": "lookup"}
    assert named["stream"] is True


async def test_engine_stream_yields_the_text_deltas_and_a_retry_is_told_apart(
    wire: ResponsesHarness,
) -> None:
    """`Engine.stream` on a plain provider streams each request; a stream cut before
    its final event is retried and its deltas carry attempt 1, the answer's 2."""
    from loopengine import events
    from loopengine.testing import CutStream

    engine, _ = wire.engine(CutStream(reply=Reply.text("lost words here"), after=5),
                            Reply.text("streamed through responses"))
    async with engine.stream(openai_operation(), "go") as run:
        deltas = [e for e in [event async for event in run] if isinstance(e, events.TextDelta)]
    assert run.result.outcome is le.Outcome.COMPLETED
    assert "".join(d.text for d in deltas if d.attempt == 2) == "streamed through responses"
    assert {(d.turn, d.attempt) for d in deltas} == {(1, 1), (1, 2)}


@pytest.mark.parametrize(("model", "reasons"), [
    ("o3", True), ("o4-mini-2025-04-16", True), ("gpt-5", True), ("gpt-5-mini", True),
    ("gpt-5.1", True), ("gpt-5.1-codex", True), ("codex-mini-latest", True),
    ("gpt-5-chat-latest", False), ("gpt-5.1-chat-latest", False), ("gpt-5.2-chat-latest", False),
    ("gpt-4o", False), ("gpt-4.1-mini", False), ("chatgpt-4o-latest", False),
    (DEPLOYMENT, False)])
def test_which_model_names_are_asked_for_their_reasoning(model: str, reasons: bool) -> None:
    """A model is asked for its reasoning's encrypted content unasked only when its
    name says it reasons: a chat model of the gpt-5 family (any version) does
    not, and would refuse it; a name that says nothing is not asked."""
    assert reasoning_model(model) is reasons
