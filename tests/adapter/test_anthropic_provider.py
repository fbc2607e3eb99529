"""AnthropicProvider's own behaviour: construction, streaming, usage, pauses and
cancellation, through the real SDK against the loopback FakeAnthropicServer."""

from __future__ import annotations

import threading
from decimal import Decimal
from typing import Any

import anthropic
import anyio
import pydantic
import pytest

import loopengine as le
from loopengine import events
from loopengine.providers import AnthropicProvider, FaultKind, ProviderFault, ProviderRequest
from loopengine.testing import (
    CutStream,
    ErrorReply,
    FakeAnthropicServer,
    FakeClock,
    RecordedRequest,
    Reply,
    StallStream,
)

from ..conftest import MODEL, operation
from .conftest import STREAMING, Harness


def request(**kwargs: Any) -> ProviderRequest:
    kwargs.setdefault("messages", [{"role": "user", "content": "hi"}])
    return ProviderRequest(model=MODEL, max_tokens=64, **kwargs)


# -- construction ------------------------------------------------------------------


async def test_the_sdk_never_retries_on_its_own(fake_anthropic_server: FakeAnthropicServer) -> None:
    """A client built with retries is used with max_retries=0: one 529, one request."""
    client = anthropic.AsyncAnthropic(api_key="k", base_url=fake_anthropic_server.url,
                                      max_retries=5)
    provider = AnthropicProvider(client)
    assert provider.client.max_retries == 0
    fake_anthropic_server.add(ErrorReply.overloaded(), Reply.text("not reached"))
    with pytest.raises(ProviderFault) as info:
        await provider.send(request())
    assert info.value.kind is FaultKind.OVERLOADED
    assert len(fake_anthropic_server.requests) == 1
    # The caller's client is theirs: closing the provider leaves it open.
    await provider.aclose()
    assert not client.is_closed()
    await client.close()


@STREAMING
async def test_the_provider_declares_what_it_can_do(wire: Harness, stream: bool) -> None:
    """Its vendor, that it can stream (whatever ``stream`` says), its request
    features and its readiness are declarations the engine reads; the caller's
    client keeps its class."""
    provider = wire.provider(stream=stream)
    assert isinstance(provider, le.providers.Provider)
    assert (provider.vendor, provider.streaming) == ("anthropic", True)
    assert "thinking" in provider.features and "service_tier" not in provider.features
    provider.check_ready()
    client = anthropic.AsyncAnthropic(api_key="k", base_url=wire.server.url)
    AnthropicProvider(client)
    assert type(client) is anthropic.AsyncAnthropic
    await client.close()


def test_retries_in_the_sdk_are_refused() -> None:
    """Asking the provider to build a retrying client is a configuration error."""
    with pytest.raises(le.ConfigError) as info:
        AnthropicProvider(api_key="k", max_retries=2)
    assert info.value.field == "max_retries"


def test_bad_construction_is_a_config_error() -> None:
    """A client and keywords, a sync client, or a bad idle limit are refused."""
    client = anthropic.AsyncAnthropic(api_key="k")
    with pytest.raises(le.ConfigError) as info:
        AnthropicProvider(client, api_key="other")
    assert info.value.field == "client"
    sync = anthropic.Anthropic(api_key="k")
    with pytest.raises(le.ConfigError) as info:
        AnthropicProvider(sync)  # type: ignore[arg-type]
    assert info.value.field == "client"
    sync.close()
    for bad in (0, -1.0, float("nan"), "5"):
        with pytest.raises(le.ConfigError) as info:
            AnthropicProvider(client, stream_idle_timeout=bad)  # type: ignore[arg-type]
        assert info.value.field == "stream_idle_timeout"


_AUTH_ENVIRONMENT = ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "ANTHROPIC_PROFILE",
                     "ANTHROPIC_CONFIG_DIR", "ANTHROPIC_IDENTITY_TOKEN",
                     "ANTHROPIC_IDENTITY_TOKEN_FILE", "ANTHROPIC_FEDERATION_RULE_ID",
                     "ANTHROPIC_ORGANIZATION_ID")


@pytest.fixture
def no_anthropic_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """An environment without any Anthropic credential: no key, no token, no
    federation, and a home without a configuration directory."""
    for name in _AUTH_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))


@pytest.mark.usefixtures("no_anthropic_credentials")
def test_without_any_key_the_provider_is_refused_when_built() -> None:
    """No api_key, auth_token or credentials, given or in the environment: a
    ConfigError naming api_key when the provider is built (the SDK would build
    the client and fail every request with a TypeError), for a client built
    from keywords or given."""
    with pytest.raises(le.ConfigError, match="ANTHROPIC_API_KEY") as info:
        AnthropicProvider()
    assert info.value.field == "api_key"
    with pytest.raises(le.ConfigError) as info:
        AnthropicProvider(anthropic.AsyncAnthropic())
    assert info.value.field == "api_key"


async def test_header_and_query_values_the_sdk_sends_are_accepted(wire: Harness) -> None:
    """A header the SDK's ``Omit()`` removes, and query values its query string
    writes (numbers, booleans, lists), are taken and reach the wire as the SDK
    sends them; a value it cannot send is refused when the provider is built
    (tests/test_public_api_robust.py)."""
    provider = wire.provider(default_headers={"x-team": "blue", "x-stainless-os": anthropic.Omit()},
                             default_query={"page": 2, "beta": True, "ids": [1, 2]})
    wire.server.add(Reply.text("ok"))
    await provider.send(request())
    (sent,) = wire.requests
    assert sent.headers["x-team"] == "blue" and "x-stainless-os" not in sent.headers
    assert sent.path.startswith("/v1/messages?") and "page=2" in sent.path
    assert "beta=true" in sent.path


@pytest.mark.usefixtures("no_anthropic_credentials")
def test_a_key_from_any_source_the_sdk_reads_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    """A token, a key header of the caller's, or a key in the environment will do."""
    assert AnthropicProvider(auth_token="t").name == "anthropic"
    assert AnthropicProvider(default_headers={"X-Api-Key": "k"}).name == "anthropic"
    monkeypatch.setenv("ANTHROPIC_AUTH_TOKEN", "t")
    assert AnthropicProvider().name == "anthropic"


@pytest.mark.usefixtures("no_anthropic_credentials")
def test_a_credentials_configuration_the_sdk_cannot_load_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """A configuration directory without the profile's file: the SDK's
    CredentialsError, as a ConfigError when the provider is built."""
    monkeypatch.setenv("ANTHROPIC_CONFIG_DIR", str(tmp_path))
    with pytest.raises(le.ConfigError, match="refused the client settings") as info:
        AnthropicProvider()
    assert info.value.field == "client"


async def test_the_route_name_follows_the_client() -> None:
    """anthropic for the first-party API, aws-bedrock and google-vertex for those clients."""
    async with AnthropicProvider(api_key="k") as first_party:
        assert first_party.name == "anthropic"
    bedrock = anthropic.AsyncAnthropicBedrock(aws_region="us-east-1", aws_access_key="a",
                                              aws_secret_key="b")
    assert AnthropicProvider(bedrock).name == "aws-bedrock"
    vertex = anthropic.AsyncAnthropicVertex(region="us-east5", project_id="p",
                                            access_token="t")
    assert AnthropicProvider(vertex).name == "google-vertex"
    await bedrock.close()
    await vertex.close()


async def test_served_by_names_the_route_and_model(wire: Harness) -> None:
    """Every attempt row says anthropic:<model>."""
    engine, ledger = wire.engine(Reply.text("hi"))
    result = await engine.run(operation(), "go")
    assert [a.dispatch.served_by for a in result.attempt_log] == [f"anthropic:{MODEL}"]


# -- what goes on the wire ---------------------------------------------------------------


@STREAMING
async def test_the_request_body_is_the_conversation(wire: Harness, stream: bool) -> None:
    """Model, max_tokens, system, tools and tool_choice go out; metadata does not."""
    provider = wire.provider(stream=stream)
    wire.server.add(Reply.text("ok"))
    tools = [{"name": "t", "description": "d", "input_schema": {"type": "object"}}]
    await provider.send(request(system=[{"type": "text", "text": "be brief"}], tools=tools,
                                tool_choice={"type": "any"}, metadata={"turn": 1},
                                timeout=12.5))
    (sent,) = wire.requests
    assert sent.body["model"] == MODEL and sent.body["max_tokens"] == 64
    assert sent.body["system"] == [{"type": "text", "text": "be brief"}]
    assert sent.body["tools"] == tools and sent.body["tool_choice"] == {"type": "any"}
    assert "metadata" not in sent.body
    assert sent.stream is stream
    assert sent.timeout == 12.5
    credentials = sent.headers.get("x-api-key", "") + sent.headers.get("authorization", "")
    assert "test-key" in credentials


# -- streaming ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_text_deltas_reach_on_text(wire: Harness, kind: str) -> None:
    """Streamed text arrives delta by delta, through a sync or an async callback."""
    seen: list[str] = []

    async def async_sink(text: str) -> None:
        await anyio.lowlevel.checkpoint()
        seen.append(text)

    sink = seen.append if kind == "sync" else async_sink
    engine, _ = wire.engine(Reply.text("The quick brown fox"), stream=True)
    result = await engine.run(operation(), "go", on_text=sink)
    assert result.answer == "The quick brown fox"
    assert seen == ["The ", "quick ", "brown ", "fox"]


async def test_a_run_that_reads_the_text_streams_on_a_plain_provider(wire: Harness) -> None:
    """A provider built without ``stream=True`` streams the requests of a run that
    reads the text (on_text, engine.stream), and reads the others whole."""
    engine, _ = wire.engine(Reply.text("The quick brown fox"), Reply.text("Slow and steady"),
                            Reply.text("Plain"))
    seen: list[str] = []
    result = await engine.run(operation(), "go", on_text=seen.append)
    assert (result.answer, seen) == ("The quick brown fox", ["The ", "quick ", "brown ", "fox"])
    async with engine.stream(operation(), "go") as run:
        deltas = [(event.attempt, event.text) async for event in run
                  if isinstance(event, events.TextDelta)]
    assert run.result.answer == "Slow and steady"
    assert deltas == [(1, "Slow "), (1, "and "), (1, "steady")]
    assert (await engine.run(operation(), "go")).answer == "Plain"
    # The independent witness: what went on the wire.
    assert [request.body.get("stream") for request in wire.requests] == [True, True, None]


async def test_text_of_a_failed_attempt_is_bracketed_by_its_attempt_events(
    wire: Harness,
) -> None:
    """A stream cut after some text has already delivered it; the retry's text
    follows. AttemptStarted and AttemptSettled bracket each attempt's deltas, so
    a live view can drop the text of an attempt that settled other than ok."""
    log: list[tuple[str, Any]] = []

    def observe(event: events.Event) -> None:
        if isinstance(event, events.AttemptStarted):
            log.append(("started", event.attempt))
        elif isinstance(event, events.AttemptSettled):
            log.append(("settled", event.outcome))

    engine, _ = wire.engine(CutStream(reply=Reply.text("Half an answer"), after=4),
                            Reply.text("The whole answer"), stream=True,
                            observers=[observe])
    result = await engine.run(operation(), "go", on_text=lambda text: log.append(("text", text)))
    assert result.answer == "The whole answer"
    assert log == [("started", 1), ("text", "Half "), ("text", "an "), ("settled", "aborted"),
                   ("started", 2), ("text", "The "), ("text", "whole "), ("text", "answer"),
                   ("settled", "ok")]


async def test_a_cut_stream_is_an_aborted_attempt_with_a_usage_floor(wire: Harness) -> None:
    """A stream ending without message_stop is aborted, retried, and its partial usage
    is kept as a floor that matches what the server served."""
    usage = le.Usage(input_tokens=40, output_tokens=30, cache_read_tokens=8)
    engine, ledger = wire.engine(CutStream(reply=Reply.text("a b c d e", usage=usage), after=4),
                                 Reply.text("whole", usage=usage), stream=True)
    result = await engine.run(operation(), "go")
    assert result.outcome is le.Outcome.COMPLETED and result.answer == "whole"
    cut = result.attempt_log[0].settle
    assert cut is not None
    assert (cut.outcome, cut.fault, cut.usage_approx) == ("aborted", "aborted", True)
    assert cut.usage == le.Usage(input_tokens=40, output_tokens=1, cache_read_tokens=8)
    assert cut.response_id == "msg_fake_0001" and not cut.charged
    # The totals hold a floor of what the cut attempt was served.
    assert result.attempts.usage_complete is False
    # The independent witness: what the ledger counted is what was served.
    (row,) = ledger.invocations.values()
    served = wire.server.usage_served
    assert (row["input_tokens"], row["output_tokens"], row["cache_read_tokens"]) == (
        served.input_tokens, served.output_tokens, served.cache_read_tokens)
    assert served == usage + le.Usage(input_tokens=40, output_tokens=1, cache_read_tokens=8)


async def test_an_idle_stream_is_aborted_with_reason_idle(wire: Harness) -> None:
    """No event for stream_idle_timeout: the attempt is aborted (idle) and retried."""
    # The stall never ends (the server's wait ends when it closes); the idle
    # limit is a second so that the retry's reply is not cut on a busy machine.
    engine, ledger = wire.engine(StallStream(reply=Reply.text("a b c"), after=2, seconds=3600),
                                 Reply.text("ok"), stream=True,
                                 provider_kwargs={"stream_idle_timeout": 1.0})
    result = await engine.run(operation(), "go")
    assert result.outcome is le.Outcome.COMPLETED
    first = result.attempt_log[0].settle
    assert first is not None
    assert (first.outcome, first.aborted_reason, first.usage_approx) == ("aborted", "idle", True)
    assert ledger.attempts[(result.invocation_id, 1)]["aborted_reason"] == "idle"


@STREAMING
async def test_tool_use_blocks_survive_the_round_trip(wire: Harness, stream: bool) -> None:
    """Tool inputs streamed as JSON deltas arrive whole; the blocks go back verbatim."""
    calls: list[dict[str, Any]] = []

    @le.tool
    async def search(query: str, limit: int = 5) -> str:
        """Search."""
        calls.append({"query": query, "limit": limit})
        return "found"

    engine, _ = wire.engine(Reply.tool_calls(("search", {"query": "café ☕", "limit": 2}),
                                             text="Let me look."),
                            Reply.text("done"), stream=stream)
    result = await engine.run(operation(), "go", tools=[search])
    assert calls == [{"query": "café ☕", "limit": 2}]
    assistant = wire.requests[1].messages[1]
    assert assistant["role"] == "assistant"
    kinds = [(b["type"], b.get("text") or b.get("input")) for b in assistant["content"]]
    assert kinds == [("text", "Let me look."), ("tool_use", {"query": "café ☕", "limit": 2})]
    assert result.outcome is le.Outcome.COMPLETED


# -- stop reasons and usage -------------------------------------------------------------------


PAUSES = {
    # A server tool loop that paused: its server_tool_use goes back.
    "pause_turn": [{"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search",
                    "input": {"query": "news"}}],
    # A compaction with pause_after_compaction: the reply holds only the compaction
    # block, never an empty answer; it goes back and the turn goes on after it.
    # Streamed, its summary comes in a compaction_delta, which the SDK's
    # accumulator drops: it goes back all the same.
    "compaction": [{"type": "compaction", "content": "Summary: the user asked for the news.",
                    "encrypted_content": "RW5jcnlwdGVkIHN1bW1hcnk="}],
}


@pytest.mark.parametrize("stop_reason", sorted(PAUSES))
@STREAMING
async def test_a_paused_turn_is_continued_within_the_same_turn(
    wire: Harness, stream: bool, stop_reason: str
) -> None:
    """``pause_turn`` and ``compaction``: the paused content goes back and the turn
    goes on (phase continuation)."""
    paused = PAUSES[stop_reason]
    engine, _ = wire.engine(Reply(content=paused, stop_reason=stop_reason),
                            Reply.text("Here is the news."), stream=stream)
    result = await engine.run(operation(max_turns=1), "go")
    assert result.outcome is le.Outcome.COMPLETED and result.answer == "Here is the news."
    assert result.turns == 1
    assert [(a.dispatch.turn, a.dispatch.phase) for a in result.attempt_log] == [
        (1, "turn"), (1, "continuation")]
    second = wire.requests[1].messages
    assert second[-1]["role"] == "assistant"
    assert second[-1]["content"] == paused


@STREAMING
async def test_an_empty_reply_is_left_out_of_the_next_request(
    wire: Harness, stream: bool
) -> None:
    """Claude sometimes answers a tool result with nothing (end_turn, no content);
    the Messages API refuses a message with empty content anywhere but last, so
    the empty reply stays in the transcript but is not sent: the feedback on the
    rejected empty answer, in a plain and in a structured run, goes through."""
    engine, _ = wire.engine(
        Reply.tool_calls(("lookup", {"q": "x"})), Reply(content=[], stop_reason="end_turn"),
        Reply.text("Found it."),
        Reply(content=[], stop_reason="end_turn"), Reply.final({"q": "y"}), stream=stream)

    @le.tool
    def lookup(q: str) -> str:
        """Look something up."""
        return q

    class Found(pydantic.BaseModel):
        q: str

    result = await engine.run(operation(), "go", tools=[lookup], accept=lambda answer: (
        le.Accept() if answer else le.Reject("Say what you found.")))
    structured = await engine.run(operation(), "go", output=Found)
    assert result.outcome is le.Outcome.COMPLETED and result.answer == "Found it."
    assert structured.outcome is le.Outcome.COMPLETED and structured.answer == Found(q="y")
    assert result.messages[3] == {"role": "assistant", "content": []}
    after_tools, after_empty = wire.requests[2].messages, wire.requests[4].messages
    assert [m["role"] for m in after_tools] == ["user", "assistant", "user", "user"]
    assert [m["role"] for m in after_empty] == ["user", "user"]
    assert all(m["content"] for m in [*after_tools, *after_empty])


@STREAMING
async def test_cache_usage_is_mapped_and_priced_at_its_own_rates(
    wire: Harness, stream: bool
) -> None:
    """Cache reads, 5-minute and 1-hour writes are counted apart from the input and
    priced at their own prices."""
    prices = le.PriceBook([le.ModelPrice(
        provider="anthropic", model=MODEL, input_per_mtok=Decimal(3), output_per_mtok=Decimal(15),
        cache_read_per_mtok=Decimal("0.3"), cache_write_per_mtok=Decimal("3.75"),
        cache_write_1h_per_mtok=Decimal(6))], credits_per_usd=Decimal(1000))
    usage = le.Usage(input_tokens=1000, output_tokens=100, cache_read_tokens=20_000,
                     cache_write_tokens=3000, cache_write_1h_tokens=1000)
    engine, ledger = wire.engine(Reply.text("ok", usage=usage), stream=stream, prices=prices)
    result = await engine.run(operation(), "go")
    assert result.usage == usage == wire.server.usage_served
    expected = (Decimal(1000) * 3 + Decimal(100) * 15 + Decimal(20_000) * Decimal("0.3")
                + Decimal(2000) * Decimal("3.75") + Decimal(1000) * 6) / Decimal(1_000_000)
    assert result.cost_usd == expected
    (row,) = ledger.invocations.values()
    assert (row["input_tokens"], row["cache_read_tokens"], row["cache_write_tokens"]) == (
        1000, 20_000, 3000)


async def test_a_reply_without_a_message_body_is_a_server_error(wire: Harness) -> None:
    """A 200 whose body is not a message is a retried server error."""
    engine, _ = wire.engine(ErrorReply(status=200, body={"hello": "world"}), Reply.text("ok"))
    result = await engine.run(operation(), "go")
    assert result.outcome is le.Outcome.COMPLETED
    first = result.attempt_log[0].settle
    assert first is not None and (first.fault, first.error_code) == ("server_error",
                                                                     "invalid_response")



@pytest.mark.parametrize("usage", [
    {"input_tokens": 2**63, "output_tokens": 1},
    {"input_tokens": 1, "output_tokens": 1,
     "iterations": [{"type": "message", "input_tokens": 2**62, "output_tokens": 1},
                    {"type": "compaction", "input_tokens": 2**62, "output_tokens": 1}]},
])
async def test_a_reply_reporting_an_impossible_count_is_an_invalid_response(
    wire: Harness, usage: dict[str, Any]
) -> None:
    """A count beyond what a ledger column holds (alone, or summed over the
    reply's iterations) is that attempt's invalid_response fault, retried; the
    run never fails at the ledger write nor raises a ConfigError."""
    body = {"id": "msg_1", "type": "message", "role": "assistant", "model": MODEL,
            "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn",
            "stop_sequence": None, "usage": usage}
    engine, _ = wire.engine(ErrorReply(status=200, body=body), Reply.text("ok"))
    result = await engine.run(operation(), "go")
    assert result.outcome is le.Outcome.COMPLETED
    first = result.attempt_log[0].settle
    assert first is not None and (first.fault, first.error_code) == ("server_error",
                                                                     "invalid_response")
    assert len(result.attempt_log) == 2


# -- cancellation ---------------------------------------------------------------------------------


@STREAMING
async def test_the_callers_cancellation_propagates_and_is_recorded(
    wire: Harness, stream: bool
) -> None:
    """Cancelling a run mid-request raises the cancellation (no outcome); the ledger
    records the attempt aborted (external) and the invocation cancelled."""
    item = (StallStream(reply=Reply.text("a b c"), after=2, seconds=3600) if stream
            else Reply.text("slow", delay=3600))
    on_the_wire = anyio.Event()

    def watch(event: events.Event) -> None:
        if isinstance(event, events.AttemptStarted):
            on_the_wire.set()

    engine, ledger = wire.engine(item, stream=stream, observers=[watch])
    finished: list[le.RunResult] = []
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as group:
            async def run() -> None:
                finished.append(await engine.run(operation(), "go"))

            group.start_soon(run)
            await on_the_wire.wait()  # cancelled once its request is out, not at a time
            scope.cancel()
    assert scope.cancelled_caught and finished == []
    (invocation,) = ledger.invocations.values()
    assert invocation["outcome"] == "cancelled"
    (attempt,) = ledger.attempts.values()
    assert (attempt["outcome"], attempt["aborted_reason"]) == ("aborted", "external")


async def test_cancellation_is_never_turned_into_a_fault(wire: Harness) -> None:
    """At the provider seam, a cancelled send raises the backend's cancellation. It
    is cancelled once the server holds its request (after a real time, a busy
    machine could still be connecting)."""
    provider = wire.provider(stream=True)
    arrived = threading.Event()

    def stall(request: RecordedRequest) -> StallStream:
        arrived.set()
        return StallStream(reply=Reply.text("a b"), after=1, seconds=3600)

    wire.server.add(stall)
    raised: list[BaseException] = []
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as group:

            async def send() -> None:
                try:
                    await provider.send(request())
                except BaseException as error:  # record what escaped, then let it go on
                    raised.append(error)
                    raise

            group.start_soon(send)
            assert await anyio.to_thread.run_sync(arrived.wait, 60)
            scope.cancel()
    assert scope.cancelled_caught
    assert len(raised) == 1 and isinstance(raised[0], anyio.get_cancelled_exc_class())


async def test_fake_clock_waits_are_not_slept_on_the_wire(wire: Harness, clock: FakeClock) -> None:
    """With a FakeClock the retry waits of real HTTP attempts take no real time."""
    engine, _ = wire.engine(ErrorReply.rate_limited(retry_after=60), Reply.text("ok"))
    started = anyio.current_time()
    result = await engine.run(operation(), "go")
    assert result.outcome is le.Outcome.COMPLETED
    assert clock.sleeps == [60.0] and anyio.current_time() - started < 5.0
