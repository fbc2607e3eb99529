"""GeminiProvider through the real ``google-genai`` SDK and FakeGeminiServer: what goes
on the wire, how the reply comes back (thought signatures, refusals, cut-off
answers, malformed function calls), usage and prices, the Vertex AI mode, and
the provider's own settings."""

from __future__ import annotations

import asyncio
import base64
import re
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from google import genai
from google.genai import types
from google.oauth2.credentials import Credentials

import loopengine as le
from loopengine.persistence import MemoryLedger
from loopengine.providers import FaultKind, GeminiProvider, ProviderFault
from loopengine.providers._gemini_contents import (
    MALFORMED_FEEDBACK,
    MALFORMED_PLACEHOLDER,
    usage_from_api,
)
from loopengine.testing import ErrorReply, FakeGeminiServer, Reply
from loopengine.testing._gemini_server import signature_of

from ..adapter.conftest import STREAMING
from ..rule_scenarios import Counter, lookup
from .conftest import MODEL, GeminiHarness, contents, function_responses, gemini_operation

SIGNATURE = base64.b64encode(b"\x12\xdf\x04opaque-signature\xff").decode()
"""A thought signature as the API sends it (standard base64, with '+' or '/')."""
THOUGHT_SIGNATURE = base64.b64encode(b"thought-summary-signature").decode()

# The published Gemini 2.5 Flash rates (USD per million tokens, standard tier,
# text): input 0.30, cached input 0.03, output (thinking included) 2.50.
INPUT, CACHED, OUTPUT = Decimal("0.30"), Decimal("0.03"), Decimal("2.50")


def nanousd(tokens: int, per_mtok: Decimal) -> Decimal:
    """The exact cost of ``tokens`` at ``per_mtok`` USD per million, in nano-USD."""
    return tokens * per_mtok * 1000


# -- usage and prices -------------------------------------------------------------------


@STREAMING
async def test_usage_maps_cached_and_thinking_tokens_and_prices_to_the_nanodollar(
    wire: GeminiHarness, stream: bool
) -> None:
    """promptTokenCount holds the cached tokens, the thinking is output: the attempt is
    priced at genai-prices' published google rates, to the nano-dollar."""
    served = le.Usage(input_tokens=1000, cache_read_tokens=400, output_tokens=300,
                      reasoning_tokens=100)
    engine, ledger = wire.engine(Reply.text("hello world", usage=served), stream=stream,
                                 prices=le.PriceBook())
    result = await engine.run(gemini_operation(), "go")
    assert result.outcome is le.Outcome.COMPLETED
    assert result.usage == served == wire.server.usage_served
    expected = nanousd(1000, INPUT) + nanousd(400, CACHED) + nanousd(300, OUTPUT)
    assert expected == 1_062_000
    (row,) = ledger.attempts.values()
    assert row["cost_nanousd"] == expected
    assert (row["input_tokens"], row["cache_read_tokens"], row["output_tokens"],
            row["reasoning_tokens"]) == (1000, 400, 300, 100)
    assert row["served_by"] == f"google:{MODEL}"
    assert result.cost_usd == Decimal("0.001062")


def test_usage_adds_the_tool_use_prompt_and_takes_the_cache_out() -> None:
    """input = prompt + toolUsePrompt - cached; output = candidates + thoughts."""
    raw = types.GenerateContentResponseUsageMetadata.model_validate({
        "promptTokenCount": 1200, "toolUsePromptTokenCount": 300,
        "cachedContentTokenCount": 1000, "candidatesTokenCount": 50,
        "thoughtsTokenCount": 70, "totalTokenCount": 1620})
    assert usage_from_api(raw) == le.Usage(input_tokens=500, cache_read_tokens=1000,
                                           output_tokens=120, reasoning_tokens=70)
    empty = types.GenerateContentResponseUsageMetadata.model_validate({})
    assert usage_from_api(empty) == le.Usage()



@pytest.mark.parametrize("counts", [
    {"promptTokenCount": 2**63},
    {"promptTokenCount": 2**62, "toolUsePromptTokenCount": 2**62},
    {"candidatesTokenCount": 2**62, "thoughtsTokenCount": 2**62},
])
def test_usage_reporting_an_impossible_count_is_an_invalid_response(
    counts: dict[str, int]
) -> None:
    """A count, or a sum of counts, beyond what a ledger column holds is the
    reply's fault (invalid_response), not a ConfigError raised mid-run."""
    raw = types.GenerateContentResponseUsageMetadata.model_validate(counts)
    with pytest.raises(ProviderFault) as info:
        usage_from_api(raw)
    assert (info.value.kind, info.value.error_code) == (FaultKind.SERVER_ERROR,
                                                        "invalid_response")


async def test_streamed_usage_is_the_last_chunks_counts(wire: GeminiHarness) -> None:
    """Every chunk carries the usage so far; the reply's usage is the last chunk's,
    not a sum of the chunks'."""
    served = le.Usage(input_tokens=40, output_tokens=12)
    engine, _ = wire.engine(Reply.text("one two three four five", usage=served), stream=True)
    deltas: list[str] = []
    result = await engine.run(gemini_operation(), "go", on_text=deltas.append)
    assert result.usage == served
    assert "".join(deltas) == "one two three four five" and len(deltas) == 5


# -- what goes on the wire -----------------------------------------------------------------


@STREAMING
async def test_request_shape_system_tools_choice_thinking_and_output_cap(
    wire: GeminiHarness, stream: bool
) -> None:
    """The system prompt is the systemInstruction, tools one functionDeclarations tool,
    tool_choice a functionCallingConfig, thinking a thinkingBudget, max_output_tokens
    the maxOutputTokens; the SDK's own loops stay off the wire."""
    counter = Counter()
    op = le.Operation(name="t", provider="gemini", model=MODEL, max_output_tokens=321,
                      thinking=le.Thinking(budget_tokens=1024))
    engine, _ = wire.engine(Reply.text("done"), stream=stream)
    image = base64.b64encode(b"\x89PNG fake").decode()
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "look"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": image}}]}]
    result = await engine.run(op, messages, system="Be brief.", tools=[counter.tool])
    assert result.outcome is le.Outcome.COMPLETED
    body = wire.requests[0].body
    assert body["systemInstruction"] == {"parts": [{"text": "Be brief."}]}
    # The SDK sends the thinking config's fields under their proto names, which
    # the API takes as it takes camelCase.
    assert body["generationConfig"] == {"maxOutputTokens": 321,
                                        "thinkingConfig": {"thinking_budget": 1024}}
    (declaration,) = body["tools"][0]["functionDeclarations"]
    assert declaration["name"] == "lookup" and declaration["description"] == "Look a key up."
    assert contents(wire.requests[0]) == [{"role": "user", "parts": [
        {"text": "look"}, {"inlineData": {"mime_type": "image/png", "data": image}}]}]
    assert set(body) == {"contents", "systemInstruction", "tools", "generationConfig"}


@pytest.mark.parametrize(("thinking", "sent"), [
    (le.Thinking(adaptive=True), {"thinking_budget": -1}),
    (le.Thinking(adaptive=True, effort="low"), {"thinking_level": "LOW"}),
])
async def test_adaptive_thinking_is_dynamic_or_a_thinking_level(
    wire: GeminiHarness, thinking: le.Thinking, sent: dict[str, Any]
) -> None:
    """Adaptive thinking lets the model decide (a budget of -1), or sends its effort
    as the thinkingLevel."""
    engine, _ = wire.engine(Reply.text("done"))
    op = le.Operation(name="t", provider="gemini", model=MODEL, thinking=thinking)
    assert (await engine.run(op, "go")).outcome is le.Outcome.COMPLETED
    assert wire.requests[0].body["generationConfig"]["thinkingConfig"] == sent


@pytest.mark.parametrize("thinking", [le.Thinking(budget_tokens=1024),
                                      le.Thinking(adaptive=True)], ids=["budget", "adaptive"])
async def test_a_prefill_with_thinking_is_sent(wire: GeminiHarness,
                                               thinking: le.Thinking) -> None:
    """The Messages API's refusal of a prefill while thinking is on is Anthropic's
    (the Gemini API documents none): a conversation ending with an assistant
    message goes out as a final model turn, with the thinking config."""
    engine, ledger = wire.engine(Reply.text(" blue"))
    op = le.Operation(name="t", provider="gemini", model=MODEL, thinking=thinking)
    prefill = [{"role": "user", "content": "Name a colour."},
               {"role": "assistant", "content": "The colour is"}]
    result = await engine.run(op, prefill)
    assert result.outcome is le.Outcome.COMPLETED, result.fault
    assert contents(wire.requests[0])[-1] == {"role": "model", "parts": [{"text": "The colour is"}]}
    assert "thinkingConfig" in wire.requests[0].body["generationConfig"]
    assert len(ledger.attempts) == 1


async def test_structured_mode_forces_a_function_call(wire: GeminiHarness) -> None:
    """A structured call's tool_choice becomes mode ANY limited to the terminal tool."""
    from ..rule_scenarios import Answer

    engine, _ = wire.engine(Reply.final({"city": "Oslo", "population": 700_000}))
    result = await engine.call(gemini_operation(), "go", output=Answer)
    assert result.data == Answer(city="Oslo", population=700_000)
    config = wire.requests[0].body["toolConfig"]["functionCallingConfig"]
    assert config == {"mode": "ANY", "allowedFunctionNames": ["final_answer"]}


async def test_an_untranslatable_block_is_refused_before_the_wire(
    wire: GeminiHarness,
) -> None:
    """An image given by URL has no Gemini equivalent: nothing is recorded or sent,
    the run ends provider_error (untranslatable)."""
    engine, ledger = wire.engine(Reply.text("never"))
    messages = [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]
    result = await engine.run(gemini_operation(), messages)
    assert result.outcome is le.Outcome.PROVIDER_ERROR
    assert result.fault is not None and result.fault.error_code == "untranslatable"
    assert wire.requests == [] and ledger.attempts == {}


# -- thought signatures ------------------------------------------------------------------


@STREAMING
async def test_thought_signatures_round_trip_across_turns(
    wire: GeminiHarness, stream: bool
) -> None:
    """A thought summary with its signature, and the signature on the function call,
    are kept in result.messages and sent back on the same parts next turn (and when
    the caller continues the history)."""
    counter = Counter()
    asking = Reply(content=[
        {"type": "thinking", "thinking": "I should look it up.", "signature": THOUGHT_SIGNATURE},
        {"type": "thinking", "thinking": "", "signature": SIGNATURE},
        {"type": "tool_use", "id": "call_1", "name": "lookup", "input": {"key": "a"}}],
        stop_reason="tool_use")
    engine, _ = wire.engine(asking, Reply.text("done"), Reply.text("again"), stream=stream)
    result = await engine.run(gemini_operation(), "go", tools=[counter.tool])
    assert result.outcome is le.Outcome.COMPLETED and counter.calls == ["a"]
    assert result.messages[1]["content"] == [
        {"type": "thinking", "thinking": "I should look it up.", "signature": THOUGHT_SIGNATURE},
        {"type": "thinking", "thinking": "", "signature": SIGNATURE},
        {"type": "tool_use", "id": "call_1", "name": "lookup", "input": {"key": "a"}}]
    again = await engine.run(gemini_operation(), [*result.messages,
                                                  {"role": "user", "content": "more"}],
                             tools=[counter.tool])
    assert again.outcome is le.Outcome.COMPLETED
    for request in (wire.requests[1], wire.requests[2]):
        thought, call = contents(request)[1]["parts"]
        assert (thought["text"], thought["thought"]) == ("I should look it up.", True)
        assert signature_of(thought) == base64.b64decode(THOUGHT_SIGNATURE)
        assert call["functionCall"] == {"id": "call_1", "name": "lookup", "args": {"key": "a"}}
        assert signature_of(call) == base64.b64decode(SIGNATURE)


@STREAMING
async def test_a_closing_signature_on_an_empty_part_goes_back_on_one(
    wire: GeminiHarness, stream: bool
) -> None:
    """A signature the API put on an empty last part (as streams end) is kept and
    returned on an empty text part at the end of the model's content."""
    reply = Reply(content=[{"type": "text", "text": "The answer is 4."},
                           {"type": "thinking", "thinking": "", "signature": SIGNATURE}])
    engine, _ = wire.engine(reply, Reply.text("ok"), stream=stream)
    first = await engine.run(gemini_operation(), "2+2?")
    assert first.answer == "The answer is 4."
    await engine.run(gemini_operation(), [*first.messages, {"role": "user", "content": "and?"}])
    model = contents(wire.requests[1])[1]
    assert model["parts"][0] == {"text": "The answer is 4."}
    assert model["parts"][-1]["text"] == "" and signature_of(model["parts"][-1]) == \
        base64.b64decode(SIGNATURE)


# -- stop reasons -------------------------------------------------------------------------


@pytest.mark.parametrize("reason", ["SAFETY", "PROHIBITED_CONTENT", "BLOCKLIST", "SPII"])
@STREAMING
async def test_withheld_answers_end_refused_after_one_request(
    wire: GeminiHarness, stream: bool, reason: str
) -> None:
    """A finishReason that withholds the answer ends refused; nothing is retried."""
    engine, _ = wire.engine(Reply.text("", stop_reason=reason), stream=stream)
    result = await engine.run(gemini_operation(), "go", accept=lambda _: True)
    assert result.outcome is le.Outcome.REFUSED and result.answer is None
    assert len(wire.requests) == 1


@STREAMING
async def test_a_blocked_prompt_ends_refused_and_its_prompt_is_billed(
    wire: GeminiHarness, stream: bool
) -> None:
    """promptFeedback.blockReason without a candidate: refused; the prompt tokens the
    API counted are recorded and charged."""
    engine, ledger = wire.engine(
        Reply.text("", stop_reason="blocked:PROHIBITED_CONTENT",
                   usage=le.Usage(input_tokens=30, output_tokens=0)), stream=stream)
    result = await engine.run(gemini_operation(), "go")
    assert result.outcome is le.Outcome.REFUSED
    assert result.usage == le.Usage(input_tokens=30)
    (row,) = ledger.attempts.values()
    assert (row["outcome"], row["stop_reason"], row["cost_nanousd"]) == ("ok", "refusal", 30_000)


@pytest.mark.parametrize("reason", ["MAX_TOKENS", "CONTINUATION"])
@STREAMING
async def test_a_cut_off_answer_is_incomplete_and_never_continued(
    wire: GeminiHarness, stream: bool, reason: str
) -> None:
    """MAX_TOKENS (and CONTINUATION, which the SDK would otherwise follow with
    requests of its own) end incomplete after exactly one request."""
    engine, _ = wire.engine(Reply.text("Paris is the", stop_reason=reason), Reply.text("x"),
                            stream=stream)
    result = await engine.run(gemini_operation(), "go", accept=lambda _: True)
    assert result.outcome is le.Outcome.INCOMPLETE and result.answer is None
    assert len(wire.requests) == 1


@STREAMING
async def test_a_malformed_function_call_tells_the_model_and_goes_on(
    wire: GeminiHarness, stream: bool
) -> None:
    """MALFORMED_FUNCTION_CALL: the model is told (as text: there is no call to
    answer) and repairs it; the malformed call used one unit of tool budget."""
    counter = Counter()
    malformed = Reply.text("print(default_api.lookup(key='a'",
                           stop_reason="MALFORMED_FUNCTION_CALL")
    engine, _ = wire.engine(malformed, Reply.tool_calls(lookup("a")), Reply.text("done"),
                            stream=stream)
    result = await engine.run(gemini_operation(), "go", tools=[counter.tool])
    assert result.outcome is le.Outcome.COMPLETED and result.answer == "done"
    assert counter.calls == ["a"] and result.tool_calls == 2
    # The SDK does not hand over the Developer API's finishMessage: the model's
    # turn is a placeholder, and the model is told as the user's text.
    model, told = contents(wire.requests[1])[1:]
    assert model == {"role": "model", "parts": [{"text": MALFORMED_PLACEHOLDER}]}
    assert told == {"role": "user", "parts": [{"text": MALFORMED_FEEDBACK}]}
    assert function_responses(wire.requests[2])[0]["response"] == {"result": "value of a"}


async def test_a_malformed_function_call_stays_within_the_tool_budget(
    wire: GeminiHarness,
) -> None:
    """With no tool budget left, a malformed call ends the run tool_limit, unsent."""
    counter = Counter()
    malformed = Reply.text("lookup(", stop_reason="MALFORMED_FUNCTION_CALL")
    engine, _ = wire.engine(malformed, Reply.text("never"))
    result = await engine.run(gemini_operation(max_tool_calls=0), "go", tools=[counter.tool])
    assert result.outcome is le.Outcome.TOOL_LIMIT
    assert len(wire.requests) == 1 and counter.calls == []


# -- the Vertex AI mode and the provider's settings ------------------------------------------------


# The SDK's default transport for a client of the caller's (aiohttp) subclasses
# aiohttp's session, which aiohttp warns about.
@pytest.mark.filterwarnings("ignore:Inheritance class AiohttpClientSession:DeprecationWarning")
@STREAMING
async def test_a_vertex_client_is_served_as_google_vertex_without_sdk_retries(
    fake_gemini_server: FakeGeminiServer, stream: bool
) -> None:
    """A genai.Client in Vertex AI mode (passed in) reaches the project's model path
    with its credentials; its route is gemini-vertex and its served_by
    google-vertex, priced as google; a 503 is one attempt of the engine's, never
    retried by the SDK."""
    client = genai.Client(vertexai=True, project="proj", location="us-central1",
                          credentials=Credentials(token="vertex-token"),
                          http_options={"base_url": fake_gemini_server.url})
    fake_gemini_server.add(ErrorReply(status=503),
                           Reply.text("hi", usage=le.Usage(input_tokens=1000,
                                                           output_tokens=100)))
    provider = GeminiProvider(client, stream=stream)
    assert (provider.name, provider.vendor) == ("gemini-vertex", "google-vertex")
    ledger = MemoryLedger()
    engine = le.Engine(provider, ledger=ledger)
    fast = le.RetryPolicy(initial_wait=0.001, max_wait=0.002)
    try:
        result = await engine.run(le.Operation(name="v", provider="gemini-vertex",
                                               model=MODEL, retry=fast), "go")
    finally:
        await client.aio.aclose()
    assert result.outcome is le.Outcome.COMPLETED
    first, second = fake_gemini_server.requests
    assert first.path.startswith(f"/v1beta1/projects/proj/locations/us-central1/publishers/"
                                 f"google/models/{MODEL}:")
    assert second.headers["authorization"] == "Bearer vertex-token"
    assert {a.dispatch.served_by for a in result.attempt_log} == {f"google-vertex:{MODEL}"}
    (ok,) = [r for r in ledger.attempts.values() if r["outcome"] == "ok"]
    assert ok["cost_nanousd"] == nanousd(1000, INPUT) + nanousd(100, OUTPUT)


@pytest.mark.filterwarnings("ignore:Inheritance class AiohttpClientSession:DeprecationWarning")
async def test_a_malformed_call_on_vertex_ai_is_named_after_the_function_it_called(
    fake_gemini_server: FakeGeminiServer,
) -> None:
    """Vertex AI hands over the ``finishMessage``, which writes the call as code
    (``print(default_api.lookup(...``): the call is the function's, not ``print``'s,
    and the model's turn on the wire is that message."""
    client = genai.Client(vertexai=True, project="proj", location="us-central1",
                          credentials=Credentials(token="vertex-token"),
                          http_options={"base_url": fake_gemini_server.url})
    counter = Counter()
    fake_gemini_server.add(Reply.text("print(default_api.lookup(key='a'",
                                      stop_reason="MALFORMED_FUNCTION_CALL"),
                           Reply.tool_calls(lookup("a")), Reply.text("done"))
    engine = le.Engine(GeminiProvider(client))
    try:
        result = await engine.run(le.Operation(name="v", provider="gemini-vertex",
                                               model=MODEL), "go", tools=[counter.tool])
    finally:
        await client.aio.aclose()
    assert result.outcome is le.Outcome.COMPLETED and counter.calls == ["a"]
    call = result.messages[1]["content"][-1]
    assert (call["type"], call["name"]) == ("tool_use", "lookup")
    model = contents(fake_gemini_server.requests[1])[1]
    assert model["parts"] == [{"text": "Malformed function call: print(default_api.lookup(key='a'"}]


def test_one_provider_serves_consecutive_event_loops(
    fake_gemini_server: FakeGeminiServer,
) -> None:
    """Built from keywords, the provider keeps a client per event loop: two
    ``run_sync`` calls (two asyncio loops) both complete."""
    fake_gemini_server.add(Reply.text("one"), Reply.text("two"))
    provider = GeminiProvider(api_key="k", http_options={"base_url": fake_gemini_server.url})
    engine = le.Engine(provider)
    answers = [engine.run_sync(gemini_operation(), "go").answer for _ in range(2)]
    assert answers == ["one", "two"]


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"api_key": "k", "http_options": {"retry_options": {"attempts": 3}}}, "http_options"),
    ({"api_key": "k", "http_options": {"async_client_args": {"timeout": 3}}}, "http_options"),
    ({"api_key": "k", "http_options": 7}, "http_options"),
    ({"api_key": "k", "stream_idle_timeout": 0}, "stream_idle_timeout"),
    ({"api_key": "k", "route": 3}, "route"),
    ({"api_key": "k", "max_connections": 0}, "max_connections"),
])
def test_settings_the_provider_refuses(kwargs: dict[str, Any], field: str) -> None:
    """Retries asked of the SDK, HTTP clients in the options, bad values: ConfigError."""
    with pytest.raises(le.ConfigError) as caught:
        GeminiProvider(**kwargs)
    assert caught.value.field == field


def test_a_client_and_keywords_or_another_client_are_refused() -> None:
    """A client comes alone, and is a genai.Client."""
    client = genai.Client(api_key="k")
    with pytest.raises(le.ConfigError, match="not both"):
        GeminiProvider(client, api_key="k")
    with pytest.raises(le.ConfigError, match="genai.Client"):
        GeminiProvider(object())  # type: ignore[arg-type]


def test_without_a_key_the_sdk_refuses_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """No api_key and neither GOOGLE_API_KEY nor GEMINI_API_KEY: ConfigError."""
    for name in ("GOOGLE_API_KEY", "GEMINI_API_KEY", "GOOGLE_GENAI_USE_VERTEXAI",
                 "GOOGLE_GENAI_USE_ENTERPRISE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(le.ConfigError, match="API key"):
        GeminiProvider()


def test_vertex_without_a_project_or_credentials_is_a_config_error(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Vertex AI mode with no project: the SDK looks for Application Default
    Credentials when the client is built, and finds none (a credentials file
    that is not there): a ConfigError naming the client, not google-auth's own
    exception."""
    for name in ("GOOGLE_CLOUD_PROJECT", "GOOGLE_API_KEY", "GEMINI_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    with pytest.raises(le.ConfigError, match="credentials") as caught:
        GeminiProvider(vertexai=True, location="us-central1")
    assert caught.value.field == "client"
    assert "missing.json" in str(caught.value)


def test_a_gemini_model_string_runs_from_the_environment(
    fake_gemini_server: FakeGeminiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``"gemini:<model>"`` builds a GeminiProvider on the route ``gemini``, its key
    and base URL read from the environment as the SDK reads them."""
    for name in ("GOOGLE_API_KEY", "GOOGLE_GENAI_USE_VERTEXAI", "GOOGLE_GENAI_USE_ENTERPRISE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GEMINI_API_KEY", "env-key")
    monkeypatch.setenv("GOOGLE_GEMINI_BASE_URL", fake_gemini_server.url)
    fake_gemini_server.add(Reply.text("hi from the environment"))
    op = le.Operation.from_model(f"gemini:{MODEL}")
    assert (op.provider, op.model) == ("gemini", MODEL)
    result = le.Engine.from_model(op).run_sync(op, "hello")
    assert result.answer == "hi from the environment"
    assert fake_gemini_server.requests[0].headers["x-goog-api-key"] == "env-key"
    monkeypatch.delenv("GEMINI_API_KEY")
    with pytest.raises(le.ConfigError, match="GEMINI_API_KEY or GOOGLE_API_KEY is not set"):
        le.Engine.from_model(f"gemini:{MODEL}")


def test_a_provider_built_from_keywords_runs_on_trio(
    fake_gemini_server: FakeGeminiServer,
) -> None:
    """On trio the provider's client for that loop sends through httpx (aiohttp runs
    on asyncio only), JSON and streamed."""
    import trio

    fake_gemini_server.add(Reply.text("hello trio"), Reply.text("streamed trio"))
    provider = GeminiProvider(api_key="k", http_options={"base_url": fake_gemini_server.url})

    async def main() -> list[Any]:
        engine = le.Engine(provider)
        deltas: list[str] = []
        plain = await engine.run(gemini_operation(), "go")
        streamed = await engine.run(gemini_operation(), "go", on_text=deltas.append)
        await provider.aclose()
        return [plain.answer, streamed.answer, "".join(deltas)]

    assert trio.run(main) == ["hello trio", "streamed trio", "streamed trio"]


def test_a_given_client_is_bound_to_its_first_event_loop(
    fake_gemini_server: FakeGeminiServer,
) -> None:
    """A genai.Client passed in serves the first event loop that sends through it;
    another loop gets a ConfigError before anything is recorded or sent."""
    import httpx2

    fake_gemini_server.add(Reply.text("first"), Reply.text("never"))
    http = httpx2.AsyncClient()
    client = genai.Client(api_key="k", http_options={"base_url": fake_gemini_server.url,
                                                     "httpx_async_client": http})
    engine = le.Engine(GeminiProvider(client))

    async def first() -> Any:
        result = await engine.run(gemini_operation(), "go")
        await http.aclose()  # the caller's client, closed on its own loop
        return result.answer

    assert asyncio.run(first()) == "first"
    with pytest.raises(le.ConfigError) as caught:
        engine.run_sync(gemini_operation(), "go")
    assert caught.value.field == "client" and len(fake_gemini_server.requests) == 1


PNG, PDF = b"\x89PNG\r\n\x1a\nfake", b"%PDF-1.4 fake"


@le.tool
async def snapshot() -> list[dict[str, Any]]:
    """Take a screenshot."""
    return [{"type": "text", "text": "the login page"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(PNG).decode()}},
            {"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                            "data": base64.b64encode(PDF).decode()}},
            {"type": "image", "source": {"type": "url", "url": "https://x.test/b.png"}}]


def camel(value: Any) -> Any:
    """``value`` with its keys in camelCase, as the API reads either spelling."""
    if isinstance(value, dict):
        return {re.sub(r"_(\w)", lambda m: m.group(1).upper(), k): camel(v)
                for k, v in value.items()}
    return [camel(v) for v in value] if isinstance(value, list) else value


def check_snapshot_response(response: dict[str, Any]) -> None:
    """The `snapshot` result as a functionResponse: its text (and the URL image's
    note) as the JSON ``response``, the PNG and the PDF as its ``parts``. The SDK
    sends a function response's keys as given (proto field names, snake_case,
    which the API's JSON reads as it reads camelCase), but for those it writes
    itself in the Vertex AI mode (``inlineData``)."""
    assert response["name"] == "snapshot"
    assert response["response"] == {
        "result": "the login page\n\n[image: https://x.test/b.png, not shown]"}
    parts = camel(response["parts"])
    assert [(p["inlineData"]["mimeType"], base64.b64decode(p["inlineData"]["data"]))
            for p in parts] == [("image/png", PNG), ("application/pdf", PDF)]


@STREAMING
async def test_a_tool_result_image_and_pdf_reach_the_model_in_the_function_response(
    wire: GeminiHarness, stream: bool
) -> None:
    """A tool answers with text, an image, a PDF and an image by URL: the
    functionResponse carries the text as its JSON ``response`` and the base64
    media as its own ``parts`` (inlineData, the bytes as sent); the URL image,
    which the API cannot take there, is the note the other text routes send."""
    engine, ledger = wire.engine(Reply.tool_calls(("snapshot", {})),
                                 Reply.text("It shows the login page."), stream=stream)
    result = await engine.run(gemini_operation(), "look", tools=[snapshot])
    assert result.outcome is le.Outcome.COMPLETED
    assert result.answer == "It shows the login page."
    (response,) = function_responses(wire.requests[1])
    check_snapshot_response(response)
    assert [a["outcome"] for a in ledger.attempts.values()] == ["ok", "ok"]


@pytest.mark.filterwarnings("ignore:Inheritance class AiohttpClientSession:DeprecationWarning")
async def test_a_tool_result_image_reaches_the_model_in_the_vertex_ai_mode_too(
    fake_gemini_server: FakeGeminiServer,
) -> None:
    """In the Vertex AI mode the SDK writes the function response's media parts
    itself (camelCase): the same image and PDF reach the model."""
    client = genai.Client(vertexai=True, project="proj", location="us-central1",
                          credentials=Credentials(token="vertex-token"),
                          http_options={"base_url": fake_gemini_server.url})
    fake_gemini_server.add(Reply.tool_calls(("snapshot", {})), Reply.text("seen"))
    provider = GeminiProvider(client)
    try:
        result = await le.Engine(provider).run(
            le.Operation(name="v", provider="gemini-vertex", model=MODEL), "look",
            tools=[snapshot])
    finally:
        await client.aio.aclose()
    assert result.answer == "seen"
    (response,) = function_responses(fake_gemini_server.requests[1])
    check_snapshot_response(response)


async def test_a_block_of_another_kind_in_a_tool_result_is_refused_before_the_wire(
    wire: GeminiHarness,
) -> None:
    """A tool result may hold text, images and documents; anything else in it (a
    server tool's block) has no Gemini equivalent: refused before anything is
    recorded or sent (untranslatable)."""
    messages = [
        {"role": "user", "content": "search"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "lookup",
                                           "input": {"key": "a"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": [
            {"type": "search_result", "source": "https://x.test", "title": "x",
             "content": [{"type": "text", "text": "found"}]}]}]},
    ]
    engine, ledger = wire.engine(Reply.text("never"))
    result = await engine.run(gemini_operation(), messages, tools=[Counter().tool])
    assert result.outcome is le.Outcome.PROVIDER_ERROR
    assert result.fault is not None and result.fault.error_code == "untranslatable"
    assert wire.requests == [] and ledger.attempts == {}
