"""AnthropicProvider on Bedrock and Vertex: construction, routes and ledger
columns, prices from genai-prices' aws and google data to the nano-dollar, the
request features each platform takes or refuses, and the fakes' wire."""

from __future__ import annotations

import dataclasses
from decimal import Decimal

import anthropic
import pytest

import loopengine as le
from loopengine.persistence import MemoryLedger
from loopengine.providers import AnthropicProvider
from loopengine.testing import FakeBedrockServer, FakeVertexServer, Reply
from loopengine.testing._platform_servers import event_stream_message

from .conftest import BEDROCK, VERTEX, Platform, PlatformHarness

SERVED = le.Usage(input_tokens=100, output_tokens=20, cache_read_tokens=1000,
                  cache_write_tokens=200)
"""A reply's usage with every token kind, to price against the vendor's rates."""


def _nano(tokens: int, usd_per_mtok: str) -> Decimal:
    return tokens * Decimal(usd_per_mtok) * 1000


def test_the_constructors_build_the_platform_clients() -> None:
    """`bedrock()` and `vertex()` build the SDK's platform clients with
    max_retries=0; their vendor is the default route, which ``route`` renames."""
    bedrock = AnthropicProvider.bedrock(aws_region="eu-west-1", aws_access_key="a",
                                        aws_secret_key="b")
    vertex = AnthropicProvider.vertex(region="global", project_id="p", access_token="t",
                                      route="vertex-global")
    assert isinstance(bedrock.client, anthropic.AsyncAnthropicBedrock)
    assert isinstance(vertex.client, anthropic.AsyncAnthropicVertex)
    assert (bedrock.client.aws_region, bedrock.client.max_retries) == ("eu-west-1", 0)
    assert str(vertex.client.base_url) == "https://aiplatform.googleapis.com/v1/"
    assert (bedrock.name, bedrock.vendor) == ("aws-bedrock", "aws-bedrock")
    assert (vertex.name, vertex.vendor) == ("vertex-global", "google-vertex")


async def test_a_platform_client_given_whole_names_its_vendor() -> None:
    """A caller's AsyncAnthropicBedrock / AsyncAnthropicVertex makes the provider
    aws-bedrock / google-vertex."""
    bedrock = anthropic.AsyncAnthropicBedrock(aws_region="us-east-1", api_key="bedrock-key")
    vertex = anthropic.AsyncAnthropicVertex(region="us-east5", project_id="p",
                                            access_token="t")
    assert AnthropicProvider(bedrock).vendor == "aws-bedrock"
    assert AnthropicProvider(vertex).vendor == "google-vertex"
    await bedrock.close()
    await vertex.close()


def test_bad_platform_arguments_are_config_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    """A missing region, or an API key together with AWS keys, is a ConfigError
    when the provider is built, not a failure at the first request."""
    for name in ("CLOUD_ML_REGION", "AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(le.ConfigError) as info:
        AnthropicProvider.vertex(project_id="p", access_token="t")
    assert info.value.field == "client" and "region" in str(info.value)
    with pytest.raises(le.ConfigError, match="api_key"):
        AnthropicProvider.bedrock(aws_region="us-east-1", api_key="k", aws_access_key="a")
    with pytest.raises(le.ConfigError) as info:
        AnthropicProvider.bedrock(aws_region="us-east-1", max_retries=2)
    assert info.value.field == "max_retries"


@pytest.mark.parametrize(("platform", "model", "rates"), [
    # genai-prices' aws data: a regional (us.) profile at its regional rates,
    # a global one at the list rates.
    (BEDROCK, "us.anthropic.claude-sonnet-4-5-20250929-v1:0", ("3.3", "16.5", "0.33", "4.125")),
    (BEDROCK, "global.anthropic.claude-sonnet-4-5-20250929-v1:0", ("3", "15", "0.3", "3.75")),
    # A base model's ARN is the in-region model it names: the regional rates.
    (BEDROCK, "arn:aws:bedrock:us-east-1::foundation-model/"
              "anthropic.claude-sonnet-4-5-20250929-v1:0", ("3.3", "16.5", "0.33", "4.125")),
    # genai-prices' google data for Claude on Vertex.
    (VERTEX, "claude-sonnet-4-5@20250929", ("3", "15", "0.3", "3.75")),
], ids=["bedrock-regional", "bedrock-global", "bedrock-model-arn", "vertex"])
async def test_attempts_are_priced_at_the_platforms_rates_to_the_nano_dollar(
    wire: PlatformHarness, platform: Platform, model: str, rates: tuple[str, str, str, str],
) -> None:
    """Without a PriceBook entry, an attempt is priced from genai-prices as that
    vendor (not as anthropic), cache reads and writes at their own rates; the
    row names the vendor in served_by and the route in invocations.provider."""
    ledger = MemoryLedger()
    wire.server.add(Reply.text("priced", usage=SERVED))
    engine = le.Engine(wire.provider(), ledger=ledger, clock=wire.clock)
    op = le.Operation(name="priced", provider=platform.route, model=model,
                      limits=le.Limits(credit_hold=10_000))
    result = await engine.run(op, "go")
    assert result.outcome is le.Outcome.COMPLETED and not result.unpriced
    inp, out, read, write = rates
    expected = (_nano(100, inp) + _nano(20, out) + _nano(1000, read) + _nano(200, write))
    (attempt,) = ledger.attempts.values()
    assert attempt["cost_nanousd"] == int(expected)
    assert attempt["served_by"] == f"{platform.route}:{model}"
    source = "aws" if platform is BEDROCK else "google"
    assert attempt["price_ref"].split(":")[2].startswith(f"{source}/")
    (invocation,) = ledger.invocations.values()
    assert invocation["provider"] == platform.route
    assert invocation["cost_nanousd"] == int(expected)


async def test_a_named_route_keeps_the_vendor_in_served_by(wire: PlatformHarness,
                                                           platform: Platform) -> None:
    """A second route of a platform (another region) is the invocation's provider;
    served_by and the price stay the vendor's (on Vertex, with the vendor entry's
    multiplier for that region)."""
    ledger = MemoryLedger()
    wire.server.add(Reply.text("hi"))
    region = {"bedrock": {"aws_region": "eu-west-1"}, "vertex": {"region": "europe-west1"}}
    provider = wire.provider(route=f"{platform.route}-eu", **region[platform.name])
    prices = le.PriceBook([le.ModelPrice(
        provider=platform.route, model=platform.model, input_per_mtok=Decimal(1),
        output_per_mtok=Decimal(1), inference_geo_multipliers={"europe-west1": Decimal("1.1")})])
    engine = le.Engine(provider, ledger=ledger, prices=prices)
    op = le.Operation(name="eu", provider=f"{platform.route}-eu", model=platform.model)
    result = await engine.run(op, "hi")
    assert result.cost_usd == (Decimal("0.000132") if platform is VERTEX
                               else Decimal("0.00012"))
    (row,) = ledger.invocations.values()
    assert row["provider"] == f"{platform.route}-eu"
    assert {a["served_by"] for a in ledger.attempts.values()} == {
        f"{platform.route}:{platform.model}"}


@pytest.mark.parametrize("platform", [BEDROCK], ids=["bedrock"])
async def test_r07_a_model_arn_is_priced_at_the_book_entry_of_the_model_it_names(
    wire: PlatformHarness,
) -> None:
    """A foundation-model ARN the book does not list is priced at the book's entry
    for the model it names, as genai-prices' price is: it was priced at
    genai-prices' list rates, the caller's own price passed over."""
    ledger = MemoryLedger()
    wire.server.add(Reply.text("priced", usage=SERVED))
    model = "anthropic.claude-sonnet-4-5-20250929-v1:0"
    prices = le.PriceBook([le.ModelPrice(provider="aws-bedrock", model=model,
                                         input_per_mtok=Decimal(1), output_per_mtok=Decimal(1))])
    engine = le.Engine(wire.provider(), ledger=ledger, prices=prices, clock=wire.clock)
    op = le.Operation(name="arn", provider="aws-bedrock",
                      model=f"arn:aws:bedrock:us-east-1::foundation-model/{model}",
                      limits=le.Limits(credit_hold=10_000))
    result = await engine.run(op, "go")
    (attempt,) = ledger.attempts.values()
    assert result.outcome is le.Outcome.COMPLETED
    booked = prices.price("aws-bedrock", model, SERVED, wire.clock.wall())
    assert booked is not None and attempt["price_ref"] == booked.price_ref
    # The book's $1 a million for every token, not genai-prices' $3.30 input.
    assert attempt["cost_nanousd"] == booked.cost_nanousd == 1_320_000


@pytest.mark.parametrize("platform", [BEDROCK], ids=["bedrock"])
async def test_bedrock_refuses_anthropics_hosted_tools_before_anything_is_recorded(
    wire: PlatformHarness,
) -> None:
    """Bedrock serves the tools the client runs, not Anthropic's hosted ones: web
    search is refused with a ConfigError naming it, nothing recorded or sent;
    the text editor tool goes on the wire."""
    ledger = MemoryLedger()
    engine = le.Engine(wire.provider(), ledger=ledger, prices=wire.platform.prices)
    search = le.Operation(name="s", provider="aws-bedrock", model=wire.platform.model,
                          server_tools=(le.ServerTool(type="web_search_20250305",
                                                      name="web_search", max_uses=3),))
    with pytest.raises(le.ConfigError) as info:
        await engine.run(search, "go")
    assert info.value.field == "server_tools[0].type" and "web_search" in str(info.value)
    assert ledger.invocations == {} and ledger.attempts == {} and wire.requests == []
    editor = le.Operation(name="e", provider="aws-bedrock", model=wire.platform.model,
                          server_tools=(le.ServerTool(type="text_editor_20250728",
                                                      name="str_replace_based_edit_tool"),))
    wire.server.add(Reply.text("edited"))
    assert (await engine.run(editor, "go")).answer == "edited"
    assert wire.requests[0].body["tools"][0]["type"] == "text_editor_20250728"


@pytest.mark.parametrize("platform", [VERTEX], ids=["vertex"])
async def test_vertex_takes_web_search_and_refuses_code_execution(
    wire: PlatformHarness,
) -> None:
    """Vertex serves web search, not code execution: one is sent, the other refused
    before anything is recorded."""
    ledger = MemoryLedger()
    engine = le.Engine(wire.provider(), ledger=ledger)
    code = le.Operation(name="c", provider="google-vertex", model=VERTEX.model,
                        server_tools=(le.ServerTool(type="code_execution_20250825",
                                                    name="code_execution"),))
    with pytest.raises(le.ConfigError, match="code_execution"):
        await engine.run(code, "go")
    assert ledger.invocations == {} and wire.requests == []
    search = le.Operation(name="s", provider="google-vertex", model=VERTEX.model,
                          server_tools=(le.ServerTool(type="web_search_20250305",
                                                      name="web_search", max_uses=2),))
    wire.server.add(Reply.text("found"))
    assert (await engine.run(search, "go")).answer == "found"
    assert wire.requests[0].body["tools"][0] == {"type": "web_search_20250305",
                                                 "name": "web_search", "max_uses": 2}


async def test_thinking_and_betas_reach_each_platform_as_it_takes_them(
    wire: PlatformHarness, platform: Platform,
) -> None:
    """Thinking is in the body on both; betas are the anthropic-beta header on
    Vertex and the body's anthropic_beta list on Bedrock (the SDK's Bedrock
    client moves them there)."""
    op = le.Operation(name="t", provider=platform.route, model=platform.model,
                      max_output_tokens=4096, thinking=le.Thinking(budget_tokens=2048),
                      betas=("context-1m-2025-08-07", "interleaved-thinking-2025-05-14"))
    engine, _ = wire.engine(Reply.text("thought"))
    assert (await engine.run(op, "go")).answer == "thought"
    (request,) = wire.requests
    assert request.body["thinking"] == {"type": "enabled", "budget_tokens": 2048}
    assert request.headers["anthropic-beta"] == (
        "context-1m-2025-08-07,interleaved-thinking-2025-05-14")
    if platform is BEDROCK:
        assert request.body["anthropic_beta"] == ["context-1m-2025-08-07",
                                                  "interleaved-thinking-2025-05-14"]
        assert request.headers["authorization"].startswith("AWS4-HMAC-SHA256 Credential=AKID")
    else:
        assert request.headers["authorization"] == "Bearer test-token"
    assert "model" not in request.body and "anthropic_version" in request.body


async def test_a_prefill_with_thinking_is_refused_on_each_platform(
    wire: PlatformHarness, platform: Platform,
) -> None:
    """Bedrock and Vertex serve the Messages API, whose refusal of a prefill while
    thinking is on the provider applies before the wire there too: the run ends
    provider_error, nothing sent or recorded as an attempt."""
    op = le.Operation(name="t", provider=platform.route, model=platform.model,
                      max_output_tokens=4096, thinking=le.Thinking(budget_tokens=2048))
    engine, ledger = wire.engine(Reply.text(" blue"))
    result = await engine.run(op, [{"role": "user", "content": "Name a colour."},
                                   {"role": "assistant", "content": "The colour is"}])
    assert result.outcome is le.Outcome.PROVIDER_ERROR and "prefill" in str(result.fault)
    assert wire.requests == [] and not ledger.attempts


def test_the_event_stream_encoder_reads_back_through_botocore() -> None:
    """A message the fake encodes is decoded by botocore (the SDK's decoder):
    headers, payload and both CRC32s check out."""
    from botocore.eventstream import EventStreamBuffer

    encoded = event_stream_message({":event-type": "chunk", ":message-type": "event"},
                                   b'{"bytes": "e30="}')
    buffer = EventStreamBuffer()
    buffer.add_data(encoded[:7])
    assert list(buffer) == []
    buffer.add_data(encoded[7:])
    (message,) = list(buffer)
    assert message.headers == {":event-type": "chunk", ":message-type": "event"}
    assert message.payload == b'{"bytes": "e30="}'


def test_the_fakes_serve_only_their_platforms_paths() -> None:
    """A request to the first-party path gets a 404 from either fake."""
    import httpx2

    for fake in (FakeBedrockServer(), FakeVertexServer()):
        with fake as server:
            response = httpx2.post(f"{server.url}/v1/messages", json={"model": "m"})
            assert response.status_code == 404
            assert server.requests[0].path == "/v1/messages"


async def test_spans_name_the_platform_as_the_conventions_do(
    wire: PlatformHarness, platform: Platform,
) -> None:
    """OpenTelemetry's gen_ai.provider.name is aws.bedrock / gcp.vertex_ai for a run
    of the platform, whatever its route is called."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from loopengine.otel import OpenTelemetryObserver

    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    wire.server.add(Reply.text("hi"))
    engine = le.Engine(wire.provider(route="platform-eu"), prices=platform.prices,
                       observers=[OpenTelemetryObserver(tracer_provider)])
    await engine.run(le.Operation(name="eu", provider="platform-eu", model=platform.model),
                     "hi")
    expected = {"bedrock": "aws.bedrock", "vertex": "gcp.vertex_ai"}[platform.name]
    spans = exporter.get_finished_spans()
    assert spans and {(s.attributes or {})["gen_ai.provider.name"] for s in spans} == {
        expected}


@pytest.mark.parametrize("platform", [VERTEX], ids=["vertex"])
async def test_vertex_web_search_is_priced_by_a_book_entry_only(
    wire: PlatformHarness,
) -> None:
    """genai-prices has no Vertex web search fee for the model: a credit_hold run
    with web search is refused until a PriceBook entry gives one, which then
    prices the searches as fees."""
    search = le.Operation(name="s", provider="google-vertex", model=VERTEX.model,
                          limits=le.Limits(credit_hold=100_000),
                          server_tools=(le.ServerTool(type="web_search_20250305",
                                                      name="web_search", max_uses=2),))
    with pytest.raises(le.ConfigError) as info:
        await le.Engine(wire.provider()).run(search, "go")
    assert info.value.field == "prices" and wire.requests == []
    book = le.PriceBook([le.ModelPrice(provider="google-vertex", model=VERTEX.model,
                                       input_per_mtok=3, output_per_mtok=15,
                                       web_search_per_k=10)])
    ledger = MemoryLedger()
    wire.server.add(Reply.text("found", usage=le.Usage(input_tokens=100, output_tokens=20,
                                                      web_search_requests=2)))
    result = await le.Engine(wire.provider(), prices=book, ledger=ledger).run(search, "go")
    assert result.answer == "found"
    (attempt,) = ledger.attempts.values()
    assert (attempt["fee_nanousd"], attempt["cost_nanousd"]) == (
        20_000_000, 20_000_000 + 300_000 + 300_000)


def test_a_missing_platform_package_is_named_when_the_provider_is_built() -> None:
    """Without botocore (or, lacking a token, google-auth) the provider refuses to be
    built, naming the extra to install; Vertex with an access token needs nothing.
    Run in a child interpreter where those packages cannot be imported."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent('''
        import sys
        for name in ("botocore", "boto3", "google"):
            sys.modules[name] = None  # "import name" now fails, as when not installed
        import loopengine as le
        from loopengine.providers import AnthropicProvider
        for build, keywords in (
                (AnthropicProvider.bedrock, dict(aws_region="us-east-1", api_key="k")),
                (AnthropicProvider.vertex, dict(region="global", project_id="p"))):
            try:
                build(**keywords)
            except le.ConfigError as error:
                print(error.field, "|", str(error))
        AnthropicProvider.vertex(region="global", project_id="p", access_token="t")
        print("token ok")
    ''')
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stdout.splitlines() == [
        "client | client: Claude on aws-bedrock needs botocore: "
        "pip install 'loopengine-core[bedrock]'",
        "client | client: Claude on google-vertex needs google-auth: "
        "pip install 'loopengine-core[vertex]'",
        "token ok"]


@pytest.mark.parametrize("platform", [BEDROCK], ids=["bedrock"])
async def test_a_bedrock_api_key_is_sent_as_a_bearer_token(wire: PlatformHarness) -> None:
    """With a Bedrock API key the request is not signed: the key is the bearer token."""
    wire.server.add(Reply.text("keyed"))
    provider = AnthropicProvider.bedrock(base_url=wire.server.url, aws_region="us-east-1",
                                         api_key="bedrock-api-key")
    async with provider:
        result = await le.Engine(provider).run(BEDROCK.operation(), "go")
    assert result.answer == "keyed"
    assert wire.requests[0].headers["authorization"] == "Bearer bedrock-api-key"


@pytest.mark.parametrize("platform", [VERTEX], ids=["vertex"])
async def test_a_regional_vertex_endpoint_is_priced_apart_from_the_global_one(
    wire: PlatformHarness,
) -> None:
    """Google prices Vertex's regional and multi-region endpoints apart from the
    global one (the list rates genai-prices carries), and a reply does not say
    which it reached: the provider declares its region as the inference geo,
    each reply's usage carries it, and an attempt is priced only where the
    prices have a multiplier for it. Without one, a credit_hold run is refused
    before anything is recorded or sent, and any other run is unpriced (never
    priced low in silence)."""
    regional = wire.provider(region="us-east5")
    assert regional.inference_geo == "us-east5"
    assert wire.provider().inference_geo is None  # region="global"
    built = anthropic.AsyncAnthropicVertex(region="eu", project_id="p", access_token="t")
    assert AnthropicProvider(built).inference_geo == "eu"
    await built.close()
    assert AnthropicProvider.bedrock(aws_region="us-east-1", api_key="k").inference_geo is None
    model = VERTEX.model
    held = le.Operation(name="regional", provider="google-vertex", model=model,
                        limits=le.Limits(credit_hold=10_000))

    # genai-prices' Vertex rates are the global endpoint's: no rate for us-east5.
    with pytest.raises(le.ConfigError) as info:
        await le.Engine(regional).run(held, "go")
    assert info.value.field == "prices" and "inference geo 'us-east5'" in str(info.value)
    assert wire.requests == []
    assert le.Engine(regional).estimate(held, "go").cost_usd is None
    ledger = MemoryLedger()
    wire.server.add(Reply.text("unpriced", usage=SERVED))
    result = await le.Engine(regional, ledger=ledger).run(
        dataclasses.replace(held, limits=le.Limits()), "go")
    assert result.outcome is le.Outcome.COMPLETED and result.unpriced
    assert result.usage.inference_geo == "us-east5"
    (attempt,) = ledger.attempts.values()
    assert attempt["cost_nanousd"] is None

    # A PriceBook entry with the region's multiplier prices it.
    book = le.PriceBook([le.ModelPrice(
        provider="google-vertex", model=model, input_per_mtok=Decimal(3),
        output_per_mtok=Decimal(15), cache_read_per_mtok=Decimal("0.3"),
        cache_write_per_mtok=Decimal("3.75"),
        inference_geo_multipliers={"us-east5": Decimal("1.1")})])
    ledger = MemoryLedger()
    wire.server.add(Reply.text("priced", usage=SERVED))
    result = await le.Engine(regional, ledger=ledger, prices=book).run(held, "go")
    assert result.outcome is le.Outcome.COMPLETED and not result.unpriced
    listed = _nano(100, "3") + _nano(20, "15") + _nano(1000, "0.3") + _nano(200, "3.75")
    (attempt,) = ledger.attempts.values()
    assert attempt["cost_nanousd"] == int(listed * Decimal("1.1"))
