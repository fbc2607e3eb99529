"""A Chat Completions search model (``gpt-4o-search-preview``...) searches the web
before every answer and is billed a web search fee that its ``usage`` does not
count: each of its requests counts one web search in its usage vector, priced
at the book's ``web_search_per_k``, else unpriced (docs/pricing.md). Through
the real ``openai`` SDK and FakeOpenAIServer, streamed and not."""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

import loopengine as le
from loopengine import events
from loopengine._features import Features, features_from_table, features_table
from loopengine.persistence import SQLiteLedger
from loopengine.providers import (
    AnthropicProvider,
    Billing,
    OpenAIProvider,
    OpenAIResponsesProvider,
)
from loopengine.providers._openai_chat import search_model
from loopengine.testing import Reply

from ..test_accounts import ACME
from .conftest import MODEL, PRICES, OpenAIHarness

SEARCH_MODEL = "gpt-4o-search-preview"
USAGE = le.Usage(input_tokens=1_000, output_tokens=200)
"""What the fake server reports: tokens only, as the API does for a search model."""


def book(model: str) -> le.PriceBook:
    """$2.50 / $10 per million tokens and $25 per 1,000 web searches on ``model``."""
    return le.PriceBook([le.ModelPrice(
        provider="openai", model=model, input_per_mtok=Decimal("2.5"),
        output_per_mtok=Decimal(10), web_search_per_k=Decimal(25))],
        credits_per_usd=Decimal(1_000_000))


def searching(model: str = SEARCH_MODEL, **limits: object) -> le.Operation:
    """An operation on a search model."""
    return le.Operation(name="news.answer", provider="openai", model=model,
                        max_output_tokens=1024, limits=le.Limits(**limits))  # type: ignore[arg-type]


@pytest.mark.parametrize("model", [
    "gpt-4o-search-preview", "gpt-4o-mini-search-preview", "gpt-5-search-api",
    "gpt-4o-search-preview-2025-03-11", "gpt-4o-mini-search-preview-2025-03-11",
    "gpt-5-search-api-2025-10-14", "openai/gpt-4o-search-preview",
    "openai/gpt-4o-mini-search-preview:nitro"])
def test_a_search_model_is_known_by_its_name(model: str) -> None:
    """OpenAI's search models, dated or under OpenRouter's prefix, search on every request."""
    assert search_model(model)
    assert OpenAIProvider(api_key="k").billing(model, Features()) == Billing(
        searches_per_request=1)


@pytest.mark.parametrize("model", [
    "gpt-4o", "gpt-4o-mini", "gpt-5", "gpt-4o-realtime-preview", "openai/gpt-4o",
    "gpt-4o-search-preview-x", "search-preview", "a/b/gpt-4o-search-preview"])
def test_another_model_is_not_a_search_model(model: str) -> None:
    assert not search_model(model)
    assert OpenAIProvider(api_key="k").billing(model, Features()) == Billing()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("model", ["gpt-4o-search-preview-2025-03-11",
                                   "openai/gpt-4o-search-preview"])
async def test_r07_a_search_model_request_is_charged_its_web_search(
    wire: OpenAIHarness, stream: bool, model: str, tmp_path: Path,
) -> None:
    """The reply counts no search, yet the request ran one: the ledger row counts one
    web search and charges its fee at the book's $25 per 1,000, to the nano-dollar:
    1,000 in at $2.50 + 200 out at $10 per million + $0.025 = $0.0295. The credit
    hold is accepted, since the fee has a price. Its replay is charged the same."""
    recording = tmp_path / "run.jsonl"
    engine, ledger = wire.engine(Reply.text("It rained.", usage=USAGE), prices=book(model),
                                 stream=stream, record=recording)
    result = await engine.run(searching(model, credit_hold=1_000_000), "news?")
    assert result.outcome is le.Outcome.COMPLETED and not result.unpriced
    assert wire.requests[0].body["model"] == model and wire.server.usage_served == USAGE
    assert result.usage.web_search_requests == 1
    (row,) = ledger.attempts.values()
    assert (row["web_search_requests"], row["fee_nanousd"], row["cost_nanousd"]) == (
        1, 25_000_000, 2_500_000 + 2_000_000 + 25_000_000)
    assert result.cost_usd == Decimal("0.0295") and result.credits == 29_500
    (invocation,) = ledger.invocations.values()
    assert invocation["web_search_requests"] == 1
    replay, replayed = wire.replay(recording, prices=book(model))
    again = await replay.run(searching(model, credit_hold=1_000_000), "news?")
    assert (again.outcome, again.usage, again.cost_usd) == (
        result.outcome, result.usage, result.cost_usd)
    assert [(r["web_search_requests"], r["fee_nanousd"], r["cost_nanousd"])
            for r in replayed.attempts.values()] == [(1, 25_000_000, 29_500_000)]


@pytest.mark.parametrize("stream", [False, True])
async def test_r07_a_search_model_without_a_fee_is_unpriced(
    wire: OpenAIHarness, stream: bool, tmp_path: Path,
) -> None:
    """genai-prices has the model's tokens and no search fee: a credit hold cannot be
    enforced, so it is refused before anything is sent or recorded, saying how to
    give the price; without a hold the attempt is recorded with its search and no
    cost (unpriced), never a silent zero. A replay of the run refuses the credit
    hold as well (it took the recording's searches for none) and records the
    same unpriced attempt."""
    recording = tmp_path / "run.jsonl"
    engine, ledger = wire.engine(Reply.text("It rained.", usage=USAGE), prices=le.PriceBook(),
                                 stream=stream, record=recording)
    refusal = (r"'gpt-4o-search-preview' searches the web on every request: no web search "
               r"fee \(give its ModelPrice a web_search_per_k\)")
    with pytest.raises(le.ConfigError, match=refusal) as refused:
        await engine.run(searching(credit_hold=1_000_000), "news?")
    assert refused.value.field == "prices"
    assert wire.requests == [] and ledger.attempts == {} and ledger.invocations == {}
    result = await engine.run(searching(), "news?")
    assert result.outcome is le.Outcome.COMPLETED and result.unpriced
    assert result.usage.web_search_requests == 1
    (row,) = ledger.attempts.values()
    assert (row["web_search_requests"], row["cost_nanousd"], row["fee_nanousd"]) == (
        1, None, None)
    replay, replayed = wire.replay(recording, prices=le.PriceBook())
    with pytest.raises(le.ConfigError, match=refusal):
        await replay.run(searching(credit_hold=1_000_000), "news?")
    assert replayed.invocations == {}
    again = await replay.run(searching(), "news?")
    assert (again.outcome, again.unpriced, again.usage) == (
        result.outcome, result.unpriced, result.usage)
    assert [(r["web_search_requests"], r["cost_nanousd"], r["fee_nanousd"])
            for r in replayed.attempts.values()] == [(1, None, None)]


@pytest.mark.parametrize("stream", [False, True])
async def test_r07_another_model_is_priced_on_its_tokens_alone(
    wire: OpenAIHarness, stream: bool,
) -> None:
    """A model that is not a search model counts no search: a book without a search fee
    prices it, credit hold and all (100 in and 20 out at $1 per million)."""
    engine, ledger = wire.engine(Reply.text("hi"), prices=PRICES, stream=stream)
    result = await engine.run(le.Operation(name="t", provider="openai", model=MODEL,
                                           limits=le.Limits(credit_hold=1_000)), "go")
    assert result.outcome is le.Outcome.COMPLETED and result.usage.web_search_requests == 0
    (row,) = ledger.attempts.values()
    assert (row["web_search_requests"], row["fee_nanousd"], row["cost_nanousd"]) == (
        0, 0, 120_000)


async def test_the_estimate_and_an_account_count_a_search_model_s_searches(
    wire: OpenAIHarness, tmp_path: Path,
) -> None:
    """Each turn's worst case holds the search every request runs: the estimate's fee is
    one search per turn, and a run on an account reserves its hold plus one search
    (25,000 credits at $25 per 1,000). Its replay's estimate and reservation
    count the search as well."""
    recording = tmp_path / "run.jsonl"

    async def on_account(
        database: str, engine_on: Callable[..., Any],
    ) -> tuple[le.Estimate, list[int], le.RunResult]:
        with SQLiteLedger(tmp_path / database) as ledger:
            accounts = le.CreditAccounts(ledger)
            await accounts.grant("acme", 1_000_000)
            seen: list[int] = []

            async def watch(event: events.Event) -> None:
                if isinstance(event, events.AttemptStarted):
                    seen.append((await accounts.balance("acme")).reserved)

            engine, _ = engine_on(prices=book(SEARCH_MODEL), ledger=ledger, accounts=accounts,
                                  observers=[watch])
            estimate = engine.estimate(searching(credit_hold=100_000, max_turns=3), "news?")
            result = await engine.run(searching(credit_hold=100_000), "news?", attribution=ACME)
        return estimate, seen, result

    recorded = await on_account("live.db", lambda **kwargs: wire.engine(
        Reply.text("It rained.", usage=USAGE), record=recording, **kwargs))
    replayed = await on_account("replay.db", lambda **kwargs: wire.replay(recording, **kwargs))
    for estimate, seen, result in (recorded, replayed):
        assert estimate.fee_usd == Decimal("0.075")  # 3 turns x $0.025
        assert seen == [100_000 + 25_000]
        assert result.outcome is le.Outcome.COMPLETED and result.credits == 29_500


OPTIONS = {"search_context_size": "low",
           "user_location": {"type": "approximate", "approximate": {"country": "GB"}}}
"""A search model's ``web_search_options``."""


@pytest.mark.parametrize("stream", [False, True])
async def test_web_search_options_go_to_a_search_model_as_published(
    wire: OpenAIHarness, stream: bool,
) -> None:
    """An operation's web_search_options are the request's, JSON and streamed; a run
    that turns them off (features=) sends none, and its model searches all the same."""
    engine, ledger = wire.engine(*[Reply.text("It rained.", usage=USAGE)] * 2,
                                 prices=book(SEARCH_MODEL), stream=stream)
    published = le.Operation(name="news.answer", provider="openai", model=SEARCH_MODEL,
                             web_search_options=OPTIONS)
    await engine.run(published, "news?")
    await engine.run(published, "news?", features={"web_search_options": None})
    assert wire.requests[0].body["web_search_options"] == OPTIONS
    assert "web_search_options" not in wire.requests[1].body
    assert [row["web_search_requests"] for row in ledger.attempts.values()] == [1, 1]
    with pytest.raises(le.ConfigError) as raised:
        await engine.run(published, "news?", features={
            "web_search_options": {"search_context_size": "high"}})
    assert raised.value.field == "web_search_options" and len(wire.requests) == 2


async def test_web_search_options_to_another_model_are_refused_before_the_wire(
    wire: OpenAIHarness,
) -> None:
    """The API refuses web_search_options for a model that does not search: the request
    is refused before its attempt is recorded, nothing sent, not retried."""
    engine, ledger = wire.engine(Reply.text("hi"))
    result = await engine.run(le.Operation(name="t", provider="openai", model=MODEL,
                                           web_search_options=OPTIONS), "go")
    assert result.outcome is le.Outcome.PROVIDER_ERROR and result.fault is not None
    assert result.fault.error_code == "untranslatable"
    assert "not a search model" in result.fault.message
    assert wire.requests == [] and ledger.attempts == {}


def test_web_search_options_are_a_chat_completions_feature(tmp_path: Path) -> None:
    """A JSON object, read from a catalogue and kept through a run state's table; a
    route that cannot send it (the Responses API, Anthropic) refuses it before
    anything is recorded."""
    with pytest.raises(le.ConfigError) as bad:
        le.Operation(name="t", provider="openai", model=SEARCH_MODEL,
                     web_search_options=["low"])  # type: ignore[arg-type]
    assert bad.value.field == "web_search_options"
    catalogue = tmp_path / "ops.toml"
    catalogue.write_text('[operations."news"]\nprovider = "openai"\n'
                         'model = "gpt-4o-search-preview"\n'
                         'web_search_options = { search_context_size = "low" }\n')
    (news,) = le.load_operations(catalogue).values()
    assert news.web_search_options == {"search_context_size": "low"}
    assert features_from_table(features_table(news.features)) == news.features
    for provider in (OpenAIResponsesProvider(api_key="k"), AnthropicProvider(api_key="k")):
        op = le.Operation(name="t", provider=provider.name, model=SEARCH_MODEL,
                          web_search_options=OPTIONS)
        with pytest.raises(le.ConfigError) as refused:
            le.Engine(provider).run_sync(op, "go")
        assert refused.value.field == "web_search_options"
