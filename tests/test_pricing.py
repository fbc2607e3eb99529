"""Prices: book entries by effective date, genai-prices fallback, cache conversion."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import genai_prices
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import loopengine as le
from loopengine._pricing import _genai_usage, nanousd_to_usd, to_nanousd
from loopengine.persistence import MemoryLedger
from loopengine.providers import Billing, Reply, ScriptedProvider

from .conftest import MODEL, PRICES, EngineFactory, operation

JAN = datetime(2025, 1, 1, tzinfo=UTC)
JUN = datetime(2025, 6, 1, tzinfo=UTC)


def price(input_price: str, *, since: datetime | None = None) -> le.ModelPrice:
    return le.ModelPrice(provider="anthropic", model="m", input_per_mtok=Decimal(input_price),
                         output_per_mtok=Decimal(0), effective_from=since)


def test_latest_effective_entry_wins_and_history_prices_old_attempts() -> None:
    """An attempt is priced with the entry in force at its start time."""
    book = le.PriceBook([price("1"), price("2", since=JAN), price("3", since=JUN)], fallback=False)
    usage = le.Usage(input_tokens=1_000_000)
    assert book.price("anthropic", "m", usage, datetime(2024, 5, 1, tzinfo=UTC)).cost_nanousd \
        == 1_000_000_000  # type: ignore[union-attr]
    assert book.price("anthropic", "m", usage, JAN).cost_nanousd == 2_000_000_000  # type: ignore[union-attr]
    march = book.price("anthropic", "m", usage, datetime(2025, 3, 1, tzinfo=UTC))
    assert march is not None and march.price_ref.startswith("book:anthropic/m@2025-01-01")
    assert book.price("anthropic", "m", usage, JUN).cost_nanousd == 3_000_000_000  # type: ignore[union-attr]
    assert book.price("anthropic", "other", usage, JUN) is None


@pytest.mark.parametrize("first, second", [
    (JAN, JAN),
    (None, None),
    # The same instant in another timezone is the same start.
    (JUN, datetime(2025, 6, 1, 2, tzinfo=timezone(timedelta(hours=2)))),
])
def test_two_entries_from_one_moment_are_a_config_error(
    first: datetime | None, second: datetime | None
) -> None:
    """Two entries for one model from the same effective_from leave nothing to
    choose between them: refused, naming the second, the model and the date."""
    with pytest.raises(le.ConfigError) as info:
        le.PriceBook([price("1", since=first), price("9", since=datetime(2001, 1, 1, tzinfo=UTC)),
                      price("2", since=second)])
    assert info.value.field == "prices[2]"
    assert "anthropic/m" in str(info.value) and "prices[0]" in str(info.value)
    if first is not None:
        assert first.isoformat()[:10] in str(info.value)
    # Other models, other routes and other moments are distinct entries.
    other = le.ModelPrice(provider="openai", model="m", input_per_mtok=1, output_per_mtok=1,
                          effective_from=first)
    le.PriceBook([price("1", since=first), other, price("2", since=datetime(2030, 1, 1,
                                                                             tzinfo=UTC))])


def test_cache_prices_default_sensibly() -> None:
    """Cache reads/writes at their own prices; 1h writes default to the 5m price."""
    entry = le.ModelPrice(provider="p", model="m", input_per_mtok=Decimal(3),
                          output_per_mtok=Decimal(15), cache_read_per_mtok=Decimal("0.3"),
                          cache_write_per_mtok=Decimal("3.75"))
    usage = le.Usage(input_tokens=1000, output_tokens=100, cache_read_tokens=2000,
                     cache_write_tokens=400, cache_write_1h_tokens=100)
    expected = (1000 * 3 + 100 * 15 + 2000 * Decimal("0.3") + 400 * Decimal("3.75")) / 10**6
    assert entry.cost(usage) == expected


def test_anthropic_convention_converted_for_genai_prices() -> None:
    """Anthropic's input excludes cache tokens; genai-prices counts them inside."""
    converted = _genai_usage(le.Usage(input_tokens=1000, cache_read_tokens=200,
                                      cache_write_tokens=300, cache_write_1h_tokens=100))
    assert converted.input_tokens == 1500
    assert (converted.cache_read_tokens, converted.cache_write_tokens) == (200, 300)
    assert (converted.cache_write_1h_tokens, converted.cache_write_5m_tokens) == (100, 200)


def test_genai_prices_fallback_prices_cache_tokens_right() -> None:
    """The fallback agrees with genai-prices' own sums over the same usage."""
    book = le.PriceBook()
    usage = le.Usage(input_tokens=1000, output_tokens=500, cache_read_tokens=200,
                     cache_write_tokens=300)
    priced = book.price("anthropic", "claude-sonnet-4-5", usage, JUN)
    assert priced is not None and priced.price_ref.startswith("genai-prices:")
    # Sonnet 4.5: $3 in, $15 out, $0.30 cache read, $3.75 cache write per MTok.
    expected = (Decimal(1000 * 3) + 500 * 15 + 200 * Decimal("0.3") + 300 * Decimal("3.75"))
    assert priced.cost_nanousd == to_nanousd(expected / 10**6)
    direct = genai_prices.calc_price(genai_prices.Usage(input_tokens=1500, output_tokens=500,
                                                        cache_read_tokens=200,
                                                        cache_write_tokens=300),
                                     "claude-sonnet-4-5", provider_id="anthropic")
    assert nanousd_to_usd(priced.cost_nanousd) == direct.total_price


def test_unknown_models_are_unpriced() -> None:
    """No entry and no genai-prices model: None, never a guess."""
    assert le.PriceBook().price("anthropic", "no-such-model", le.Usage(), JUN) is None
    assert not le.PriceBook().knows("nowhere", "x", JUN)


async def test_unpriced_attempts_are_recorded_with_null_cost(make_engine: EngineFactory) -> None:
    """Without a credit hold an unpriced model runs; its attempts have no cost."""
    engine, _, ledger = make_engine(Reply.text("hi"), prices=le.PriceBook(fallback=False))
    result = await engine.run(operation(), "go")
    assert result.outcome is le.Outcome.COMPLETED and result.unpriced
    assert result.cost_usd == 0 and result.credits == 0
    (row,) = ledger.attempts.values()
    assert row["cost_nanousd"] is None and row["price_ref"] is None and row["charged"] == 0


async def test_attempts_priced_at_their_own_start_time() -> None:
    """A price change during a run prices each attempt by its own start time."""
    import random

    from loopengine.persistence import MemoryLedger
    from loopengine.providers import ScriptedProvider
    from loopengine.testing import FakeClock

    clock = FakeClock(wall_start=datetime(2025, 5, 31, 23, 59, 59, tzinfo=UTC))
    book = le.PriceBook([le.ModelPrice(provider="anthropic", model=MODEL,
                                       input_per_mtok=Decimal(p), output_per_mtok=Decimal(0),
                                       effective_from=since)
                         for p, since in (("1", None), ("2", JUN))], fallback=False)
    provider = ScriptedProvider([
        le.ProviderFault("overloaded", "busy", usage=le.Usage(input_tokens=1000)),
        Reply.text("hi", usage=le.Usage(input_tokens=1000)),
    ], clock=clock)
    ledger = MemoryLedger()
    engine = le.Engine(provider, ledger=ledger, prices=book, clock=clock, rng=random.Random(0))
    await engine.run(operation(retry=le.RetryPolicy(initial_wait=2.0, max_wait=2.0)), "go")
    assert clock.sleeps and clock.sleeps[0] >= 1.0  # the retry starts after midnight
    costs = [row["cost_nanousd"] for row in ledger.attempts.values()]
    assert costs == [1_000_000, 2_000_000]  # 1000 tokens at $1, then $2 per MTok


def _fast_models() -> list[tuple[Any, Any]]:
    """Every genai-prices model whose current prices the fast path handles."""
    from genai_prices import data_snapshot

    from loopengine._pricing import _token_cost

    found = []
    for provider in data_snapshot.get_snapshot().providers:
        for model in provider.models:
            try:
                prices = model.get_prices(JUN)
            except LookupError:
                continue
            if _token_cost(prices, le.Usage()) is not None:
                found.append((provider, model))
    return found


FAST_MODELS = _fast_models()


@st.composite
def usages(draw: st.DrawFn) -> le.Usage:
    """Usages across the 200k-token tier, with and without cache reads and writes."""
    writes = draw(st.sampled_from([0, 0, draw(st.integers(0, 300_000))]))
    return le.Usage(
        input_tokens=draw(st.integers(0, 400_000)),
        output_tokens=draw(st.integers(0, 70_000)),
        cache_read_tokens=draw(st.sampled_from([0, draw(st.integers(0, 300_000))])),
        cache_write_tokens=writes,
        cache_write_1h_tokens=draw(st.sampled_from([0, draw(st.integers(0, writes))])),
    )


@settings(max_examples=400, deadline=None)
@given(
    pick=st.sampled_from(FAST_MODELS),
    usage=usages(),
    at=st.datetimes(min_value=datetime(2023, 1, 1), max_value=datetime(2027, 1, 1),
                    timezones=st.just(UTC)),
)
def test_token_fast_path_equals_genai_prices_calculator(
    pick: tuple[Any, Any], usage: le.Usage, at: datetime
) -> None:
    """Wherever the fast path prices, it gives genai-prices' own total to the digit;
    where it cannot (a token kind without a price of its own), it declines."""
    from loopengine._pricing import _token_cost

    provider, model = pick
    try:
        model_price = model.get_prices(at)
    except LookupError:
        return
    full = model.calc_price(_genai_usage(usage), provider, genai_request_timestamp=at).total_price
    fast = _token_cost(model_price, usage)
    assert fast is None or fast == full


def test_fast_path_covers_many_models() -> None:
    """The equivalence test has real ground to cover."""
    assert len(FAST_MODELS) > 200
@pytest.mark.parametrize("model", ["claude-sonnet-4-5", "claude-haiku-4-5", "claude-opus-4-1",
                                   "claude-3-5-haiku-20241022", "claude-sonnet-4-20250514"])
def test_claude_models_take_the_fast_path(model: str) -> None:
    """The models of our route are priced without the general calculator, correctly."""
    from genai_prices import data_snapshot

    from loopengine._pricing import _token_cost

    provider, info = data_snapshot.get_snapshot().find_provider_model(model, None, "anthropic",
                                                                      None)
    usage = le.Usage(input_tokens=210_000, output_tokens=900, cache_read_tokens=7,
                     cache_write_tokens=30, cache_write_1h_tokens=11)
    fast = _token_cost(info.get_prices(JUN), usage)
    assert fast is not None
    assert fast == info.calc_price(_genai_usage(usage), provider,
                                   genai_request_timestamp=JUN).total_price


@pytest.mark.parametrize(("vendor", "model"), [
    ("anthropic", "claude-sonnet-4-5"),
    ("aws-bedrock", "global.anthropic.claude-sonnet-4-5-20250929-v1:0"),
    ("aws-bedrock", "us.anthropic.claude-sonnet-4-5-20250929-v1:0"),
    ("google-vertex", "claude-sonnet-4-5@20250929"),
    ("google-vertex", "gemini-2.5-pro"),
    ("google", "gemini-2.5-flash"),
    ("openai", "gpt-4o"),
    ("azure", "gpt-4o"),
])
@pytest.mark.parametrize("usage", [
    le.Usage(input_tokens=1000, output_tokens=500),
    le.Usage(input_tokens=250_000, output_tokens=500, cache_read_tokens=10_000,
             cache_write_tokens=5000, cache_write_1h_tokens=2000),
])
def test_every_route_is_priced_as_genai_prices_prices_it(vendor: str, model: str,
                                                         usage: le.Usage) -> None:
    """Each vendor a provider names (``aws-bedrock``, ``google-vertex``...) finds the
    model genai-prices finds under its own provider id, at its total to the digit
    (rounded up to a nano-dollar)."""
    from loopengine._pricing import _GENAI_PROVIDER_IDS

    at = datetime(2026, 1, 15, tzinfo=UTC)
    ours = le.PriceBook().price(vendor, model, usage, at)
    theirs = genai_prices.calc_price(_genai_usage(usage), model,
                                     provider_id=_GENAI_PROVIDER_IDS.get(vendor, vendor),
                                     genai_request_timestamp=at)
    assert ours is not None and ours.cost_nanousd == to_nanousd(theirs.total_price)
    assert ours.price_ref.endswith(f"{theirs.provider.id}/{theirs.model.id}")


@pytest.mark.parametrize("extra, field", [
    ({"output_per_mtok": Decimal("9.3e7")}, "output_per_mtok"),
    ({"cache_write_1h_per_mtok": 10**9}, "cache_write_1h_per_mtok"),
    ({"output_per_mtok": 9 * 10**7, "speed_multipliers": {"fast": Decimal(6)}},
     "speed_multipliers"),
    ({"web_search_per_k": 10**10}, "web_search_per_k"),
])
def test_a_price_no_ledger_could_store_a_large_reply_of_is_refused(
    extra: dict[str, Any], field: str
) -> None:
    """A price at which a reply of LARGEST_REPLY_TOKENS tokens (at its dearest
    rate and multipliers, with LARGEST_REPLY_REQUESTS of each fee) would cost more
    than 2**63 - 1 nano-USD is a ConfigError when it is given, naming the field
    that takes it past: at run time each reply would be refused and retried at
    the same price, which no retry could change."""
    with pytest.raises(le.ConfigError) as info:
        le.ModelPrice(provider="anthropic", model="m", **{
            "input_per_mtok": 1, "output_per_mtok": 1, **extra})
    assert info.value.field == field and "2**63 - 1" in str(info.value)


def test_a_credit_rate_no_ledger_could_store_a_large_reply_of_is_refused() -> None:
    """The same bound in credits: a rate at which a book entry's largest reply
    would be charged more than 2**63 - 1 credits is refused with the book."""
    dear = le.ModelPrice(provider="anthropic", model="m", input_per_mtok=1,
                         output_per_mtok=10**5)
    with pytest.raises(le.ConfigError) as info:
        le.PriceBook([dear], credits_per_usd=10**15)
    assert info.value.field == "credits_per_usd" and "prices[0]" in str(info.value)
    assert le.PriceBook([dear], credits_per_usd=10**10).credits_per_usd == 10**10


async def test_the_dearest_accepted_price_charges_a_large_reply_on_the_first_attempt(
    make_engine: EngineFactory,
) -> None:
    """At the dearest price the bound accepts, a reply of a million tokens is
    priced, stored and charged as it came: no attempt is refused or retried."""
    dearest = le.ModelPrice(provider="anthropic", model=MODEL, input_per_mtok=9 * 10**7,
                            output_per_mtok=9 * 10**7)
    engine, _, ledger = make_engine(
        Reply.text("dear", usage=le.Usage(input_tokens=10**6, output_tokens=10)),
        prices=le.PriceBook([dearest], credits_per_usd=1))
    result = await engine.run(operation(), "go")
    assert result.outcome is le.Outcome.COMPLETED and result.attempts.count == 1
    assert result.cost_usd == Decimal(9 * 10**7) * (10**6 + 10) / 10**6
    (row,) = ledger.attempts.values()
    assert row["outcome"] == "ok" and row["cost_nanousd"] == to_nanousd(result.cost_usd)
    assert result.credits == math.ceil(result.cost_usd)


@pytest.mark.parametrize(("fields", "field"), [
    ({"searches_per_request": -1}, "searches_per_request"),
    ({"searches_per_request": True}, "searches_per_request"),
    ({"searches_per_request": 10**6 + 1}, "searches_per_request"),
    ({"long_context": 1}, "long_context"),
    ({"web_search_per_k": 2.5}, "web_search_per_k"),
    ({"web_search_per_k": -1}, "web_search_per_k"),
])
def test_a_billing_out_of_its_range_is_refused_naming_its_field(
        fields: dict[str, Any], field: str) -> None:
    """A provider's `Billing` is checked when it is made: a float fee (not exact), a
    negative count or a count no reply reaches, a long-context flag that is not
    a bool."""
    with pytest.raises(le.ConfigError) as info:
        Billing(**fields)
    assert info.value.field == field
    assert Billing(web_search_per_k="25").web_search_per_k == Decimal(25)  # type: ignore[arg-type]


def test_a_provider_whose_billing_is_not_a_billing_is_refused_before_anything_is_recorded(
) -> None:
    """The engine asks a provider's billing once, before the run: an answer that is
    not a `Billing` is a ConfigError then, not an AttributeError when its first
    attempt is priced."""

    class Odd(ScriptedProvider):
        def billing(self, model: str, features: Any) -> Any:
            return {"searches_per_request": 1}

    ledger = MemoryLedger()
    engine = le.Engine(Odd([Reply.text("hi")]), ledger=ledger, prices=PRICES)
    with pytest.raises(le.ConfigError, match="billing\\(\\) must return a Billing") as info:
        engine.run_sync(operation(), "hi")
    assert info.value.field == "provider" and ledger.attempts == {}
    with pytest.raises(le.ConfigError):
        engine.estimate(operation(), "hi")
