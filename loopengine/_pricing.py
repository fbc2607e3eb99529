"""Prices: `PriceBook` entries first, then genai-prices, at the attempt's start time.

Every attempt is priced on its own (R07), with the price in force when it
started: a `ModelPrice` with ``effective_from`` applies from that moment on,
the latest applicable entry wins, and models the book does not list fall back
to genai-prices' historical data for that timestamp.

The Anthropic convention (``input_tokens`` excludes cache tokens) is converted
to genai-prices' (cache tokens counted inside ``input_tokens``) here and only
here, in `_genai_usage`.

An attempt's price is its tokens plus its per-request fees:

* tokens: when the reply reported sampling ``iterations`` (compaction, an
  advisor, a server tool loop), each iteration is priced on its own at its own
  model (an advisor iteration at the advisor model's rates, with that
  iteration's own long-context tier) and the parts are summed; otherwise the
  usage's tokens at the attempt's model.
* fees: ``web_search_requests`` and ``web_fetch_requests`` times the fee per
  1,000 at the attempt's model: a `ModelPrice`'s ``web_search_per_k`` /
  ``web_fetch_per_k``, else genai-prices' ``web_searches_kcount``, else a fee
  the vendor documents and genai-prices does not carry (`DOCUMENTED_FEES`).
  A fee nobody knows makes the attempt unpriced (never a silent zero).

The sum is rounded up to a nano-USD once; `Priced.fee_nanousd` is the fee
part, rounded up on its own (so it never exceeds the total).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from decimal import ROUND_CEILING, Decimal
from typing import TYPE_CHECKING, Any, Final

from loopengine import _validate
from loopengine._errors import ConfigError
from loopengine._features import is_web_search
from loopengine._usage import Usage
from loopengine.guards._credits import turn_credits

if TYPE_CHECKING:
    from genai_prices import Usage as GenaiUsage
    from genai_prices.types import ModelPrice as GenaiModelPrice

    from loopengine._features import Features, ServerTool

__all__ = ["DEFAULT_BILLING", "DOCUMENTED_FEES", "DOCUMENTED_GEO_MULTIPLIERS",
           "LARGEST_REPLY_REQUESTS",
           "LARGEST_REPLY_TOKENS", "STANDARD_GEOS", "Billing",
           "STANDARD_SPEEDS", "STANDARD_TIERS", "TOKEN_ONLY_TOOLS", "ModelPrice", "PriceBook",
           "Priced", "TurnFees"]

_MTOK = Decimal(1_000_000)
_NANO = Decimal(1_000_000_000)
_K = Decimal(1000)

STANDARD_TIERS: Final = frozenset({"auto", "default", "standard"})
"""Service tiers priced at a model's list rates (OpenAI ``default``, Anthropic
``standard``; ``auto`` is a request's, resolved to the project's tier)."""

STANDARD_GEOS: Final = frozenset({"global", "not_available"})
"""Inference geos priced at a model's list rates: Anthropic's default ``global``, and
``not_available``, which a reply reports on a model that takes no ``inference_geo``
(it ran wherever the list rates apply)."""

STANDARD_SPEEDS: Final = frozenset({"standard"})
"""Inference speeds priced at a model's list rates (Anthropic ``standard``)."""

DOCUMENTED_GEO_MULTIPLIERS: Final = {("anthropic", "us"): Decimal("1.1")}
"""Token-price multipliers by ``(vendor, inference_geo)`` that a vendor documents
and genai-prices does not carry: Anthropic's US-only inference (``inference_geo:
"us"``, on the models that accept it) is 1.1x every token price."""

DOCUMENTED_FEES: Final = {("anthropic", "web_fetch"): Decimal(0),
                          ("openai", "web_search_preview"): Decimal(25)}
"""Per-1,000-request fees a vendor documents that genai-prices does not carry,
by ``(vendor, unit)``: Anthropic's web fetch has "no additional charges beyond
standard token costs"; OpenAI's web search preview tool (``web_search_preview``)
on a non-reasoning model (``gpt-4o``, ``gpt-4.1``...) is $25 per 1,000 calls
(its search content tokens free), where genai-prices carries the $10 of the
web search tool (and of the preview tool on a reasoning model): a provider
declares it for the requests it bills (`Billing.web_search_per_k`)."""

TOKEN_ONLY_TOOLS: Final = ("bash_", "text_editor_", "memory_", "computer_",
                            "tool_search_tool_")
"""Server tool types (by prefix) billed only through the tokens they add:
Anthropic-defined tools the client runs, and tool search."""

LARGEST_REPLY_TOKENS: Final = 10**8
"""More tokens than one reply is ever served (input, cache and output together,
its iterations included; the largest context windows hold about 10**7). A
price at which a reply this large would cost more than a ledger column holds
(2**63 - 1 nano-USD, or credits) is refused when it is given: a reply of a
real size could then be unstorable, and a retry, priced the same, could not
help. Within it, a reply that passes a column reports an impossible usage: a
retried ``invalid_response`` (docs/providers.md)."""

LARGEST_REPLY_REQUESTS: Final = 10**6
"""More web searches, and more web fetches, than one reply is ever served: the
fees' counterpart of `LARGEST_REPLY_TOKENS`."""

_TOKEN_RATES: Final = ("input_per_mtok", "output_per_mtok", "cache_read_per_mtok",
                       "cache_write_per_mtok", "cache_write_1h_per_mtok")
"""`ModelPrice`'s per-token rates (USD per million), the two required ones first."""

_FEES: Final = ("web_search_per_k", "web_fetch_per_k")
"""`ModelPrice`'s per-request fees (USD per 1,000)."""

_MULTIPLIED: Final = (("service_tier", STANDARD_TIERS, "service_tier_multipliers"),
                      ("inference_geo", STANDARD_GEOS, "inference_geo_multipliers"),
                      ("speed", STANDARD_SPEEDS, "speed_multipliers"))
"""What multiplies `ModelPrice`'s token rates: the `Usage` field a reply reports
it in, the values priced at list rates, and the multipliers' field."""

# genai-prices knows some providers under other ids.
_GENAI_PROVIDER_IDS = {"bedrock": "aws", "vertex": "google", "aws-bedrock": "aws",
                       "google-vertex": "google"}


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelPrice:
    """The price of one model on one route, from a moment on.

    Prices are USD per million tokens, as `Decimal` (or int / numeric string;
    floats are refused because they cannot hold a price exactly).
    """

    provider: str
    """The route (``anthropic``...)."""
    model: str
    """The model id, exactly as the operation names it."""
    input_per_mtok: Decimal
    """Uncached input tokens."""
    output_per_mtok: Decimal
    """Output tokens."""
    cache_read_per_mtok: Decimal | None = None
    """Cache reads; defaults to the input price."""
    cache_write_per_mtok: Decimal | None = None
    """Five-minute cache writes; defaults to the input price."""
    cache_write_1h_per_mtok: Decimal | None = None
    """One-hour cache writes; defaults to the five-minute write price."""
    effective_from: datetime | None = None
    """The first moment (timezone-aware) the price applies; None: always."""
    web_search_per_k: Decimal | None = None
    """USD per 1,000 web searches (Anthropic and OpenAI: $10); None: this entry
    does not price web searches, and a reply that ran any is unpriced."""
    web_fetch_per_k: Decimal | None = None
    """USD per 1,000 web fetches; None: the vendor's documented fee
    (`DOCUMENTED_FEES`: Anthropic charges none), else unpriced."""
    service_tier_multipliers: Mapping[str, Decimal] = field(default_factory=dict)
    """Token-price multipliers by the service tier a reply reports, e.g.
    ``{"flex": Decimal("0.5"), "priority": Decimal(2)}``; standard tiers
    (`STANDARD_TIERS`) are 1, and a tier not listed leaves the attempt unpriced.
    Fees are not multiplied."""
    inference_geo_multipliers: Mapping[str, Decimal] = field(default_factory=dict)
    """Token-price multipliers by the ``inference_geo`` a reply reports, e.g.
    ``{"us": Decimal("1.1")}`` (Anthropic's US-only inference); ``global`` is 1,
    and a geo not listed leaves the attempt unpriced. Fees are not multiplied."""
    speed_multipliers: Mapping[str, Decimal] = field(default_factory=dict)
    """Token-price multipliers by the ``speed`` a reply reports, e.g. ``{"fast":
    Decimal(6)}`` (Anthropic's fast mode); ``standard`` is 1, and a speed not
    listed leaves the attempt unpriced. Fees are not multiplied."""
    _largest_reply_usd: Decimal = field(init=False, repr=False, compare=False)
    """What the price may charge the largest reply (`_dearest_reply`'s total):
    the book's bound in credits is checked against it."""

    def __post_init__(self) -> None:
        _validate.text("provider", self.provider)
        _validate.text("model", self.model)
        for name in (*_TOKEN_RATES, *_FEES):
            value = _validate.decimal(name, getattr(self, name),
                                      optional=name not in _TOKEN_RATES[:2])
            object.__setattr__(self, name, value)
        for _, _, name in _MULTIPLIED:
            object.__setattr__(self, name, _multipliers(name, getattr(self, name)))
        _validate.moment("effective_from", self.effective_from, optional=True)
        steps = _dearest_reply(self)
        for name, usd in steps:
            if to_nanousd(usd) > _validate.MAX_INTEGER:
                raise ConfigError(name, f"at this price a reply of {LARGEST_REPLY_TOKENS:,} "
                                        f"tokens (and {LARGEST_REPLY_REQUESTS:,} of each "
                                        f"server tool request) may cost {usd:.3e} USD, past "
                                        "what a ledger column holds (2**63 - 1 nano-USD)")
        object.__setattr__(self, "_largest_reply_usd", steps[-1][1])

    def multiplier(self, served: Usage) -> Decimal | None:
        """The product of the multipliers of what ``served`` reports (its service
        tier, inference geo and speed; standard ones are 1), or None when one
        is not listed."""
        total = Decimal(1)
        if served.service_tier is None and served.inference_geo is None and served.speed is None:
            return total  # the common case: list rates
        for reported, standard, name in _MULTIPLIED:
            value = getattr(served, reported)
            if value is not None and value not in standard:
                factor = getattr(self, name).get(value)
                if factor is None:
                    return None
                total *= factor
        return total

    def __hash__(self) -> int:
        # The multipliers are a dict; leaving them out keeps equal prices' hashes equal.
        return hash((self.provider, self.model, self.input_per_mtok, self.output_per_mtok,
                     self.effective_from))

    def cost(self, usage: Usage) -> Decimal:
        """The USD cost of ``usage``'s tokens at this price (iterations and fees are
        priced by `PriceBook.price`)."""
        read = _or(self.cache_read_per_mtok, self.input_per_mtok)
        write = _or(self.cache_write_per_mtok, self.input_per_mtok)
        write_1h = _or(self.cache_write_1h_per_mtok, write)
        total = (
            usage.input_tokens * self.input_per_mtok
            + usage.output_tokens * self.output_per_mtok
            + usage.cache_read_tokens * read
            + usage.cache_write_5m_tokens * write
            + usage.cache_write_1h_tokens * write_1h
        )
        return total / _MTOK


@dataclass(frozen=True, slots=True, kw_only=True)
class Billing:
    """How a route bills its requests to one model with one set of request
    features beyond what their usage reports (`loopengine.providers.Provider.billing`).

    The defaults describe a request billed as its usage says: every price
    is read from the usage and the price book. A provider declares the rest:
    the engine reads it once per run and uses it for the run's credit-hold
    check, its account's reservations, its estimate and every attempt's price.

    Raises:
        ConfigError: a field is not of its type, or out of its range.
    """

    searches_per_request: int = 0
    """The web searches every request runs whatever it asks, billed a fee per
    search that the API's usage does not count: OpenAI's Chat Completions
    search models (``gpt-4o-search-preview``...) search before every answer
    (1). The provider counts them in each reply's usage
    (`loopengine.Usage.web_search_requests`) itself; the engine reads them
    before a run, so that a ``credit_hold`` run is refused before anything is
    recorded where the web search fee has no price, and an account reserves
    them with a turn's fees. At most `LARGEST_REPLY_REQUESTS`."""
    long_context: bool = True
    """Whether the requests can be billed a model's long-context rates (the
    dearer ones past an input threshold, such as Claude Sonnet 4.5's past
    200,000 tokens). False where they cannot use the long context window at
    all: an Anthropic request without the 1M context beta, each of whose
    sampling passes is within the standard window, though a server tool
    loop's usage adds the passes up past the threshold. Their attempts are
    then priced at the standard rates however many input tokens their usage
    reports. True: the threshold is read from the usage."""
    web_search_per_k: Decimal | None = None
    """The fee in USD per 1,000 web searches the requests are billed, where the
    vendor bills the search tool they use a fee of its own rather than the
    model's list fee (genai-prices'): OpenAI's web search preview tool on a
    non-reasoning model, $25 where the list has $10 (`DOCUMENTED_FEES`). A
    book entry's ``web_search_per_k`` still decides for the models it lists.
    None: the model's fee."""

    def __post_init__(self) -> None:
        _validate.integer("searches_per_request", self.searches_per_request, minimum=0,
                          maximum=LARGEST_REPLY_REQUESTS)
        _validate.boolean("long_context", self.long_context)
        object.__setattr__(self, "web_search_per_k", _validate.decimal(
            "web_search_per_k", self.web_search_per_k, optional=True))


DEFAULT_BILLING: Final = Billing()
"""A request billed as its usage says: what pricing assumes when given no `Billing`,
and the one value every run billed so shares (`loopengine.Engine` keeps no
object of its own for it on each of thousands of runs alive at once)."""


@dataclass(frozen=True, slots=True)
class Priced:
    """One attempt's price."""

    cost_nanousd: int
    """The whole cost (tokens and fees) in 1e-9 USD, rounded up."""
    price_ref: str
    """Where the price came from: ``book:<provider>/<model>@<from>`` or
    ``genai-prices:<version>:<provider>/<model>``; iterations on other models
    add their own, joined by ``"; "``."""
    fee_nanousd: int = 0
    """The part of ``cost_nanousd`` that is per-request fees (web searches,
    web fetches) rather than tokens, rounded up."""


@dataclass(frozen=True, slots=True)
class TurnFees:
    """The worst case of one turn's server-tool fees (`PriceBook.turn_fees`)."""

    web_search_requests: int
    """The most web searches one turn may run: the web search tools' ``max_uses``."""
    web_fetch_requests: int
    """The most web fetches one turn may run."""
    unbounded: tuple[str, ...]
    """Tools with a fee and no ``max_uses``: while any is listed there is no worst case."""
    usd: Decimal | None
    """Those requests' fees in USD; None when a fee is unknown or a tool unbounded."""


class PriceBook:
    """Prices the engine uses, and the exchange rate to credits.

    Args:
        prices: `ModelPrice` entries; a model they do not list is priced by
            genai-prices. One route's model has at most one entry per
            ``effective_from``.
        credits_per_usd: Credits one USD buys.
        credit_quantum: Turn charges are rounded up to a multiple of this (>= 1).
        fallback: Use genai-prices for models the book does not list.

    Raises:
        ConfigError: an entry that is not a `ModelPrice`, two entries for one
            provider and model from the same ``effective_from`` (``.field``
            names the second), or a bad ``credits_per_usd`` / ``credit_quantum``.
    """

    def __init__(
        self,
        prices: Iterable[ModelPrice] = (),
        *,
        credits_per_usd: Decimal | int | str = Decimal("1000"),
        credit_quantum: int = 1,
        fallback: bool = True,
    ) -> None:
        self.prices: tuple[ModelPrice, ...] = tuple(_validate.items("prices", prices))
        starts: dict[tuple[str, str, float], int] = {}
        for i, price in enumerate(self.prices):
            if not isinstance(price, ModelPrice):
                raise ConfigError(f"prices[{i}]",
                                  f"must be a ModelPrice, got {_validate.shown(price)}")
            # Two entries from one moment leave nothing to choose between them
            # (the same instant in any timezone is the same start).
            earlier = starts.setdefault((price.provider, price.model, _start(price)), i)
            if earlier != i:
                since = (price.effective_from.isoformat() if price.effective_from
                         else "always (no effective_from)")
                raise ConfigError(f"prices[{i}]",
                                  f"{price.provider}/{price.model} from {since} is already "
                                  f"priced by prices[{earlier}]")
        checked = _validate.decimal("credits_per_usd", credits_per_usd, positive=True)
        assert checked is not None
        self.credits_per_usd: Decimal = checked
        self.credit_quantum: int = _validate.required_integer(
            "credit_quantum", credit_quantum, minimum=1
        )
        self.fallback = _validate.boolean("fallback", fallback)
        for i, price in enumerate(self.prices):
            if turn_credits(to_nanousd(price._largest_reply_usd), self.credits_per_usd,
                            self.credit_quantum) > _validate.MAX_INTEGER:
                raise ConfigError("credits_per_usd", (
                    f"at {self.credits_per_usd} credits per USD, a reply of "
                    f"{LARGEST_REPLY_TOKENS:,} tokens at prices[{i}] ({price.provider}/"
                    f"{price.model}) may cost more credits than a ledger column holds "
                    "(2**63 - 1)"))

    def __repr__(self) -> str:
        return (f"PriceBook({len(self.prices)} prices, credits_per_usd={self.credits_per_usd}, "
                f"credit_quantum={self.credit_quantum})")

    def entry(self, provider: str, model: str, at: datetime) -> ModelPrice | None:
        """The book's entry in force for ``provider``/``model`` at ``at``, if any.

        Every question the book answers as of a time reads its entry here.

        Raises:
            ConfigError: ``at`` is not a timezone-aware datetime (a naive one
                failed only where an entry has an ``effective_from``).
        """
        _validate.moment("at", at)
        best: ModelPrice | None = None
        for price in self.prices:
            if price.provider != provider or price.model != model:
                continue
            if price.effective_from is not None and price.effective_from > at:
                continue
            if best is None or _start(price) >= _start(best):
                best = price
        if best is None and (named := _named_model(provider, model)) != model:
            # A Bedrock ARN the book does not list is priced as the model it names.
            return self.entry(provider, named, at)
        return best

    def price(self, provider: str, model: str, usage: Usage, at: datetime, *,
              billing: Billing = DEFAULT_BILLING) -> Priced | None:
        """Price one attempt's ``usage`` as of ``at`` (see the module docstring);
        None when a price it needs (a model's, an iteration model's, a fee) is unknown.

        ``billing``: how the provider bills the request beyond its usage
        (`loopengine.providers.Provider.billing`): without the long context
        window no long-context rate applies, however many input tokens the
        usage adds up (a server tool loop's, summed over its sampling
        passes); its web search fee stands for the model's where the book
        does not list the model.

        Raises:
            ConfigError: ``usage`` is not a `Usage`, or ``at`` not a
                timezone-aware datetime.
        """
        if not isinstance(usage, Usage):
            raise ConfigError("usage", f"must be a Usage, got {_validate.shown(usage)}")
        if usage.iterations:
            total = Decimal(0)
            refs: list[str] = []
            for iteration in usage.iterations:
                part = self._tokens(provider, iteration.model or model, iteration.tokens(), at,
                                    usage, billing)
                if part is None:
                    return None
                total += part[0]
                if part[1] not in refs:
                    refs.append(part[1])
            tokens: tuple[Decimal, str] | None = (total, "; ".join(refs))
        else:
            tokens = self._tokens(provider, model, usage, at, usage, billing)
        if tokens is None:
            return None
        if not (usage.web_search_requests or usage.web_fetch_requests):
            return Priced(to_nanousd(tokens[0]), tokens[1])
        fee = self._fee(provider, model, usage, at, billing)
        if fee is None:
            return None
        return Priced(to_nanousd(tokens[0] + fee), tokens[1], to_nanousd(fee))

    def knows(self, provider: str, model: str, at: datetime) -> bool:
        """True when ``model`` on ``provider`` has a price at ``at``."""
        return self.price(provider, model, Usage(), at) is not None

    def fees(
        self, provider: str, model: str, at: datetime, *, billing: Billing = DEFAULT_BILLING
    ) -> tuple[Decimal | None, Decimal | None]:
        """``(web search, web fetch)`` fees in USD per 1,000 requests at ``model``'s
        price in force at ``at``; None where nobody knows the fee. ``billing``'s
        web search fee, where the vendor bills the request's tool one of its
        own (`Billing.web_search_per_k`), stands in place of genai-prices' for
        the model; a book entry's decides all the same."""
        entry = self.entry(provider, model, at)
        if entry is not None:
            search, fetch = entry.web_search_per_k, entry.web_fetch_per_k
        elif self.fallback:
            search, fetch = _genai_fees(provider, model, at)
            if billing.web_search_per_k is not None:
                search = billing.web_search_per_k
        else:
            return None, None
        if fetch is None:
            fetch = DOCUMENTED_FEES.get((provider, "web_fetch"))
        return search, fetch

    def turn_fees(self, provider: str, model: str, server_tools: Iterable[ServerTool],
                  at: datetime, *, billing: Billing = DEFAULT_BILLING) -> TurnFees:
        """The worst case of one turn's fees at ``model``'s price in force at ``at``:
        every web search and web fetch tool used ``max_uses`` times, and the
        web searches every request runs whatever it asks (a search model's,
        `Billing.searches_per_request`). A tool with a fee and no ``max_uses``
        has no worst case (listed in ``unbounded``); one whose fee is zero
        needs no bound. ``billing`` as for `fees`."""
        fees = dict(zip(_FEE_UNITS, self.fees(provider, model, at, billing=billing),
                        strict=True))
        uses = dict.fromkeys(_FEE_UNITS, 0)
        uses["web search"] = billing.searches_per_request
        unbounded: list[str] = []
        for tool in server_tools:
            unit = _fee_of(tool.type)
            if unit is None:
                continue
            if tool.max_uses is None:
                if fees[unit] != 0:
                    unbounded.append(tool.name)
            else:
                uses[unit] += tool.max_uses
        searches, fetches = uses["web search"], uses["web fetch"]
        usd = None if unbounded else self._fee(
            provider, model, Usage(web_search_requests=searches, web_fetch_requests=fetches), at,
            billing)
        return TurnFees(searches, fetches, tuple(unbounded), usd)

    def unpriced_features(self, provider: str, model: str, features: Features,
                          at: datetime, geo: str | None = None, *,
                          billing: Billing = DEFAULT_BILLING) -> tuple[str, ...]:
        """The enabled features of an operation this book cannot price at ``at``
        (empty: all of them can be). The engine refuses a ``credit_hold`` on an
        operation with any, as on an unpriced model.

        Thinking, betas, context management (compaction is billed as tokens of
        the same model) and reasoning effort are billed as tokens. A server
        tool is priceable when its fee is known (web search, web fetch), when
        it is billed only as tokens (``bash_``, ``text_editor_``, ``memory_``,
        ``computer_``, ``tool_search_tool_`` types), or, for an advisor, when
        the model its ``params`` name has a price. Code execution is billed by
        container time, which no reply reports, and any other type is unknown:
        both are unpriceable. A ``service_tier`` needs its rates (`knows_tier`),
        and so does ``geo``, where the provider serves every request
        (`loopengine.providers.Provider.inference_geo`: `knows_geo`). A model
        whose every request runs web searches (a search model, ``billing``'s
        `Billing.searches_per_request`) needs the web search fee, as
        ``billing`` bills it (`fees`).
        """
        missing: list[str] = []
        fees = dict(zip(_FEE_UNITS, self.fees(provider, model, at, billing=billing),
                        strict=True))
        if billing.searches_per_request and fees["web search"] is None:
            missing.append(f"model {model!r} searches the web on every request: no web "
                           f"search fee (give its ModelPrice a web_search_per_k)")
        for tool in features.server_tools:
            label = f"server tool {tool.name!r} ({tool.type})"
            unit = _fee_of(tool.type)
            if unit is not None:
                if fees[unit] is None:
                    missing.append(f"{label}: no {unit} fee")
            elif tool.type.startswith("advisor_"):
                advisor = tool.params.get("model")
                if not isinstance(advisor, str) or not self.knows(provider, advisor, at):
                    missing.append(f"{label}: advisor model {advisor!r} has no price")
            elif tool.type.startswith("code_execution_"):
                missing.append(f"{label}: container time is billed outside the reply")
            elif not tool.type.startswith(TOKEN_ONLY_TOOLS):
                missing.append(f"{label}: unknown server tool type")
        if not self.knows_tier(provider, model, features.service_tier, at):
            missing.append(f"service_tier {features.service_tier!r}: no rates for that tier")
        if not self.knows_geo(provider, model, geo, at):
            missing.append(f"inference geo {geo!r} (where the provider's endpoint serves): "
                           "no inference_geo_multipliers entry for it")
        return tuple(missing)

    def knows_geo(self, provider: str, model: str, geo: str | None, at: datetime) -> bool:
        """True when ``model``'s tokens can be priced served in ``geo`` at ``at``:
        the default (None, ``global``), a geo the book entry has a multiplier
        for, or, for models the book does not list, a geo the vendor documents
        (`DOCUMENTED_GEO_MULTIPLIERS`)."""
        if geo is None or geo in STANDARD_GEOS:
            return True
        entry = self.entry(provider, model, at)
        if entry is not None:
            return geo in entry.inference_geo_multipliers
        return self.fallback and (provider, geo) in DOCUMENTED_GEO_MULTIPLIERS

    def knows_tier(self, provider: str, model: str, tier: str | None, at: datetime) -> bool:
        """True when ``model``'s tokens can be priced on service tier ``tier`` at ``at``:
        a standard tier (None, ``auto``, ``default``, ``standard``), a tier the book
        entry has a multiplier for, or, for models the book does not list, a tier
        genai-prices has rates for."""
        if tier is None or tier in STANDARD_TIERS:
            return True
        entry = self.entry(provider, model, at)
        if entry is not None:
            return tier in entry.service_tier_multipliers
        return self.fallback and _genai_tier(provider, model, tier, at)

    def _tokens(self, provider: str, model: str, usage: Usage, at: datetime,
                served: Usage, billing: Billing) -> tuple[Decimal, str] | None:
        """The USD cost of ``usage``'s tokens (iterations ignored) at ``model``, at
        the rates of the tier, geo and speed ``served`` reports (and at the
        standard ones, not a long-context tier, unless ``billing`` can be
        billed them: `Billing.long_context`)."""
        entry = self.entry(provider, model, at)
        if entry is not None:
            since = entry.effective_from.isoformat() if entry.effective_from else "always"
            multiplier = entry.multiplier(served)
            if multiplier is None:
                return None
            cost = entry.cost(usage)
            if multiplier != 1:
                cost *= multiplier
            return cost, f"book:{provider}/{entry.model}@{since}"
        if not self.fallback:
            return None
        return _genai_tokens(provider, model, usage, at, served, billing.long_context)

    def _fee(self, provider: str, model: str, usage: Usage, at: datetime,
             billing: Billing) -> Decimal | None:
        search, fetch = self.fees(provider, model, at, billing=billing)
        total = Decimal(0)
        for count, rate in ((usage.web_search_requests, search),
                            (usage.web_fetch_requests, fetch)):
            if count:
                if rate is None:
                    return None
                total += count * rate / _K
        return total


@functools.cache
def _genai() -> tuple[type[GenaiUsage], type[Any]]:
    """genai-prices' usage and tiered-price classes, imported on first use: the
    package loads its whole price snapshot (about 0.1 s), which `import
    loopengine` and the CLI's ``--help`` should not pay for."""
    from genai_prices import Usage as genai_usage
    from genai_prices.types import TieredPrices

    return genai_usage, TieredPrices


def _multipliers(field: str, value: object) -> dict[str, Decimal]:
    """A checked copy of a `ModelPrice` multiplier mapping (name -> positive Decimal)."""
    if not isinstance(value, Mapping):
        raise ConfigError(field, "must be a mapping of name to Decimal")
    multipliers: dict[str, Decimal] = {}
    for name, factor in value.items():
        _validate.text(field, name)
        checked = _validate.decimal(f"{field}.{name}", factor, positive=True)
        assert checked is not None
        multipliers[name] = checked
    return multipliers


def _dearest_reply(price: ModelPrice) -> list[tuple[str, Decimal]]:
    """What ``price`` may charge a reply of `LARGEST_REPLY_TOKENS` tokens, all of its
    dearest kind, at its largest multipliers, with `LARGEST_REPLY_REQUESTS` of each
    fee, in USD: the running total after each field that adds to it, by name."""
    rates = {name: getattr(price, name) for name in _TOKEN_RATES}
    dearest = max((name for name in rates if rates[name] is not None),
                  key=lambda name: rates[name])
    usd = LARGEST_REPLY_TOKENS * rates[dearest] / _MTOK
    steps = [(dearest, usd)]
    for _, _, name in _MULTIPLIED:
        factor = max((Decimal(1), *getattr(price, name).values()))
        if factor > 1:
            usd *= factor
            steps.append((name, usd))
    for name in _FEES:
        fee = getattr(price, name)
        if fee:
            usd += LARGEST_REPLY_REQUESTS * fee / _K
            steps.append((name, usd))
    return steps


_FEE_UNITS: Final = ("web search", "web fetch")
"""What a server tool may be billed by per request, in `PriceBook.fees`' order."""


def _fee_of(tool_type: str) -> str | None:
    """What a server tool of ``tool_type`` is billed by per request (of
    `_FEE_UNITS`): a web search (`is_web_search`), a web fetch
    (``web_fetch_...``), or None for a tool billed otherwise."""
    if is_web_search(tool_type):
        return "web search"
    if tool_type.startswith("web_fetch_"):
        return "web fetch"
    return None


def _or(value: Decimal | None, default: Decimal) -> Decimal:
    return default if value is None else value


def _start(price: ModelPrice) -> float:
    return price.effective_from.timestamp() if price.effective_from else float("-inf")


def to_nanousd(usd: Decimal) -> int:
    """USD to integer nano-USD, rounded up (a bill never rounds in our favour)."""
    return int((usd * _NANO).to_integral_value(rounding=ROUND_CEILING))


def nanousd_to_usd(nanousd: int) -> Decimal:
    """Integer nano-USD to an exact `Decimal` USD."""
    return Decimal(nanousd) / _NANO


def _genai_usage(usage: Usage) -> GenaiUsage:
    """Our usage in genai-prices' convention: cache tokens *inside* input_tokens."""

    return _genai()[0](
        input_tokens=usage.total_input_tokens,
        output_tokens=usage.output_tokens,
        cache_read_tokens=usage.cache_read_tokens,
        cache_write_tokens=usage.cache_write_tokens,
        cache_write_1h_tokens=usage.cache_write_1h_tokens,
        cache_write_5m_tokens=usage.cache_write_5m_tokens,
    )


@functools.lru_cache(maxsize=1)
def _genai_version() -> str:
    from importlib.metadata import version

    return version("genai-prices")


# The per-token prices the fast path computes itself, and the price keys of
# units it does not price as tokens: web searches (a fee, priced by
# `_genai_fees`) and usage this library never reports (always zero).
_TOKEN_PRICE_KEYS = frozenset(
    {"input_mtok", "output_mtok", "cache_read_mtok", "cache_write_mtok", "cache_write_1h_mtok"}
)
_UNREPORTED_PRICE_KEYS = frozenset({
    "web_searches_kcount", "storage_searches_kcount", "input_audio_mtok", "output_audio_mtok",
    "cache_audio_read_mtok", "input_image_mtok", "output_image_mtok", "cache_image_read_mtok",
    "input_video_mtok", "output_video_mtok", "audio_hours", "input_audio_hours",
    "input_document_kpages", "input_annotated_document_kpages",
})


# A Bedrock model ARN that names a model (``foundation-model/``) or a system-defined
# inference profile (``inference-profile/``): priced as the id it names. An
# application inference profile's ARN names no model and stays unpriced.
_BEDROCK_ARN: Final = re.compile(
    r"arn:aws[\w-]*:bedrock:[\w-]*:\d*:(?:foundation-model|inference-profile)/(?P<id>.+)")


def _named_model(provider: str, model: str) -> str:
    """The model id ``model`` names for ``provider``'s prices: a Bedrock ARN's
    model (`_BEDROCK_ARN`), else ``model`` itself."""
    arn = _BEDROCK_ARN.fullmatch(model) if _GENAI_PROVIDER_IDS.get(
        provider, provider) == "aws" else None
    return model if arn is None else arn.group("id")


def _genai_model(provider: str, model: str) -> tuple[Any, Any] | None:
    from genai_prices import data_snapshot

    provider_id = _GENAI_PROVIDER_IDS.get(provider, provider)
    model = _named_model(provider, model)
    try:
        return data_snapshot.get_snapshot().find_provider_model(model, None, provider_id, None)
    except LookupError:
        return None


def _genai_tokens(provider: str, model: str, usage: Usage, at: datetime,
                  served: Usage, long_context: bool) -> tuple[Decimal, str] | None:
    found = _genai_model(provider, model)
    if found is None:
        return None
    found_provider, info = found
    context: dict[str, str] = {}
    for key, value, standard in (("service_tier", served.service_tier, STANDARD_TIERS),
                                 ("speed", served.speed, STANDARD_SPEEDS)):
        if value is not None and value not in standard:
            if not _genai_variant(provider, model, key, value, at):
                return None
            context[key] = value
    geo = Decimal(1)
    if served.inference_geo is not None and served.inference_geo not in STANDARD_GEOS:
        documented = DOCUMENTED_GEO_MULTIPLIERS.get((provider, served.inference_geo))
        if documented is None:
            return None
        geo = documented
    found_cost = _genai_context_tokens(found_provider, info, usage, at, context or None,
                                       long_context)
    return found_cost * geo, f"genai-prices:{_genai_version()}:{found_provider.id}/{info.id}"


def _genai_context_tokens(found_provider: Any, info: Any, usage: Usage, at: datetime,
                          context: dict[str, str] | None, long_context: bool) -> Decimal:
    """genai-prices' cost of ``usage``'s tokens on ``info`` at ``at``, in ``context``;
    at each price's base rate, below every tier, unless ``long_context``."""
    model_price = info.get_prices(at, context)
    if not long_context:
        tiered = _genai()[1]
        if any(isinstance(v, tiered) for v in vars(model_price).values()):
            flat = type(model_price)(**{k: v.base if isinstance(v, tiered) else v
                                        for k, v in vars(model_price).items()})
            cost = _token_cost(flat, usage)
            return Decimal(cost if cost is not None
                           else flat.calc_price(_genai_usage(usage))["total_price"])
    cost = _token_cost(model_price, usage)
    if cost is None:
        cost = info.calc_price(
            _genai_usage(usage), found_provider, genai_request_timestamp=at,
            price_context=context,
        ).total_price
    return Decimal(cost)


def _genai_tier(provider: str, model: str, tier: str, at: datetime) -> bool:
    """True when genai-prices has rates of its own for ``tier`` on ``model`` at ``at``."""
    return _genai_variant(provider, model, "service_tier", tier, at)


def _genai_variant(provider: str, model: str, key: str, value: str, at: datetime) -> bool:
    """True when genai-prices has rates of its own for ``key`` = ``value`` (a service
    tier, a speed) on ``model`` at ``at``."""
    found = _genai_model(provider, model)
    if found is None:
        return False
    return any(
        variant.when == {key: value}
        and (variant.constraint is None or variant.constraint.active(at))
        for variant in found[1].price_variants or ()
    )


def _genai_fees(provider: str, model: str, at: datetime) -> tuple[Decimal | None, None]:
    """genai-prices' web search fee per 1,000 for ``model`` (it has no web fetch unit)."""
    found = _genai_model(provider, model)
    if found is None:
        return None, None
    rate = getattr(found[1].get_prices(at), "web_searches_kcount", None)
    if isinstance(rate, _genai()[1]):
        # Tiers follow a request's input tokens; no search fee varies with them.
        rate = rate.base
    return rate, None


def _token_cost(model_price: GenaiModelPrice, usage: Usage) -> Decimal | None:
    """genai-prices' own arithmetic for plain token prices, or None to use its calculator.

    genai-prices' general calculator validates and decomposes every usage unit
    on each call, which costs more than the rest of a turn's bookkeeping; for
    the text-token prices a model on our routes has, the price is a sum of
    count x price per million, each price chosen by genai-prices' "cliff" tier
    rule (the whole request at the tier its total input exceeds). Any price
    this does not cover, or a token kind without its own price, falls back to
    the calculator (tests/test_pricing.py checks the two agree).
    """
    prices = {k: v for k, v in vars(model_price).items() if v is not None}
    for key in prices:
        if key not in _TOKEN_PRICE_KEYS and key not in _UNREPORTED_PRICE_KEYS:
            return None
    needed = (
        ("input_mtok", usage.input_tokens),
        ("output_mtok", usage.output_tokens),
        ("cache_read_mtok", usage.cache_read_tokens),
        ("cache_write_mtok", usage.cache_write_5m_tokens),
        ("cache_write_1h_mtok", usage.cache_write_1h_tokens),
    )
    threshold = usage.total_input_tokens
    total = Decimal(0)
    for key, count in needed:
        price = prices.get(key)
        if price is None:
            if count or key in ("input_mtok", "output_mtok"):
                return None
            continue
        if isinstance(price, _genai()[1]):
            rate = price.base
            for tier in reversed(price.tiers):
                if threshold > tier.start:
                    rate = tier.price
                    break
        else:
            rate = price
        total += rate * count / _MTOK
    return total
