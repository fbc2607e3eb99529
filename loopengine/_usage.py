"""`Usage`: what one or more provider requests served, all of it.

A `Usage` is created for every attempt, on the hot path: it is a slotted,
frozen dataclass whose common case (no iterations) costs no more than the
token counts it holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Final

from loopengine import _validate
from loopengine._errors import ConfigError

__all__ = ["Usage", "UsageIteration", "sum_past_limit", "usage_from_json", "usage_json"]

_TOKENS: Final = (
    "input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens",
    "cache_write_1h_tokens",
)
_MAX_COUNT: Final = _validate.MAX_INTEGER
_COUNTS: Final = _TOKENS + ("web_search_requests", "web_fetch_requests", "reasoning_tokens")


def _check_counts(usage: Usage | UsageIteration, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(usage, name)
        # The common case inline (a usage is built per attempt); `_validate`
        # words the error (below 0, or beyond the ledger's 64-bit columns).
        # ``type() is int`` also refuses bools.
        if type(value) is not int or value < 0 or value > _MAX_COUNT:
            _validate.integer(name, value, minimum=0)


def _check_cache_split(usage: Usage | UsageIteration) -> None:
    if usage.cache_write_1h_tokens > usage.cache_write_tokens:
        raise ConfigError(
            "cache_write_1h_tokens",
            f"cannot exceed cache_write_tokens ({usage.cache_write_1h_tokens} > "
            f"{usage.cache_write_tokens})",
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class UsageIteration:
    """One sampling iteration inside one request (Anthropic's ``usage.iterations``).

    A request with server-side compaction, an advisor or a server tool loop
    samples more than once; each entry reports its own tokens, in the same
    convention as `Usage` (``input_tokens`` without cache tokens).
    """

    UNREPORTED: ClassVar[str] = "unreported"
    """The type of the iteration that stands, in a sum of usages (a run's), for a
    request that reported no iterations: its tokens, as one pass. The ledger
    does not count it (`Usage.reported_iterations`)."""

    type: str
    """The iteration's type as the API reports it: ``message`` (the requested model
    sampling), ``compaction`` (the summarising pass, on the requested model),
    ``advisor_message`` (the advisor, on its own model), ``fallback_message``, or
    any other type the API adds (carried through); in a sum, `UNREPORTED` for a
    request that reported none."""
    model: str | None = None
    """The model that served it when it differs from the attempt's (an advisor's);
    None: the attempt's model. Each iteration is priced at its own model."""
    input_tokens: int = 0
    """Uncached input tokens."""
    output_tokens: int = 0
    """Output tokens."""
    cache_read_tokens: int = 0
    """Input tokens read from the prompt cache."""
    cache_write_tokens: int = 0
    """Input tokens written to the prompt cache (all lifetimes)."""
    cache_write_1h_tokens: int = 0
    """The part of ``cache_write_tokens`` written with the one-hour lifetime."""

    def __post_init__(self) -> None:
        _validate.text("type", self.type)
        _validate.text("model", self.model, optional=True)
        _check_counts(self, _TOKENS)
        _check_cache_split(self)

    @property
    def cache_write_5m_tokens(self) -> int:
        """The part of ``cache_write_tokens`` written with the five-minute lifetime."""
        return self.cache_write_tokens - self.cache_write_1h_tokens

    def tokens(self) -> Usage:
        """This iteration's tokens as a `Usage` without iterations (to price it)."""
        return Usage(
            input_tokens=self.input_tokens, output_tokens=self.output_tokens,
            cache_read_tokens=self.cache_read_tokens,
            cache_write_tokens=self.cache_write_tokens,
            cache_write_1h_tokens=self.cache_write_1h_tokens,
        )


@dataclass(frozen=True, slots=True)
class Usage:
    """What a provider served, in the Anthropic convention.

    ``input_tokens`` counts only the uncached input: cache reads and cache
    writes are counted separately and are not part of it. (OpenTelemetry's
    ``gen_ai.usage.input_tokens`` and genai-prices count them inside the input;
    `total_input_tokens` gives that figure.) OpenAI's ``prompt_tokens`` holds
    cached and written tokens: ``input_tokens = prompt_tokens - cached_tokens -
    cache_write_tokens``.

    The token fields are what was billed. When the request sampled more than
    once (``iterations`` is not empty) they are the sums over its iterations,
    and each iteration is priced at its own model. Anthropic's top-level
    ``usage`` is not that sum: its ``input_tokens``/``output_tokens`` leave out
    ``compaction`` and ``advisor_message`` iterations, and its input counts only
    the first executor iteration, while every iteration is billed. So when a
    reply has ``usage.iterations``, build its `Usage` with `from_iterations`
    and ignore the top-level token counts; without iterations the top level
    is the bill.

    Adding two usages sums every field. If either has iterations, the sum's
    iterations are both lists, one without iterations counting as a single
    iteration of type `UsageIteration.UNREPORTED` holding its tokens (when it
    has any), so that the token fields stay the sums of the iterations;
    `reported_iterations` counts the others, as the ledger does. The sum's
    ``service_tier`` is the one its parts reported, None if they differ.
    """

    input_tokens: int = 0
    """Uncached input tokens."""
    output_tokens: int = 0
    """Output tokens (reasoning and thinking tokens included)."""
    cache_read_tokens: int = 0
    """Input tokens read from the prompt cache."""
    cache_write_tokens: int = 0
    """Input tokens written to the prompt cache (all lifetimes)."""
    cache_write_1h_tokens: int = 0
    """The part of ``cache_write_tokens`` written with the one-hour lifetime."""
    web_search_requests: int = 0
    """Web searches the provider ran (Anthropic ``server_tool_use.web_search_requests``,
    OpenAI web search calls); each is billed a fee."""
    web_fetch_requests: int = 0
    """Web fetches the provider ran (``server_tool_use.web_fetch_requests``)."""
    reasoning_tokens: int = 0
    """The part of ``output_tokens`` spent reasoning, where the provider reports it
    (OpenAI ``completion_tokens_details.reasoning_tokens``, Anthropic
    ``output_tokens_details.thinking_tokens``); noted, priced as output."""
    iterations: tuple[UsageIteration, ...] = ()
    """Each sampling iteration's tokens (Anthropic ``usage.iterations``); empty when
    the reply reported none. The token fields are their sums."""
    service_tier: str | None = None
    """The service tier that served the request, as the reply reports it (OpenAI
    ``service_tier``, Anthropic ``usage.service_tier``, Vertex AI's Gemini
    ``trafficType``); None: a standard tier, or not reported. Tokens are
    priced at that tier's rates (docs/pricing.md). A sum keeps the tier its
    parts reported, or None if they reported different tiers."""
    inference_geo: str | None = None
    """Where inference ran when that changes the price (Anthropic
    ``usage.inference_geo``: ``us``; the region a Vertex regional endpoint's
    provider declares: ``us-east5``); None for the default ``global`` (or
    ``not_available``: a model without data residency), or not
    reported. Kept in a sum as ``service_tier`` is."""
    speed: str | None = None
    """The inference speed when it changes the price (Anthropic ``usage.speed``:
    ``fast``); None for ``standard``, or not reported. Kept in a sum as
    ``service_tier`` is."""

    def __post_init__(self) -> None:
        _check_counts(self, _COUNTS)
        _check_cache_split(self)
        if self.service_tier is not None or self.inference_geo is not None \
                or self.speed is not None:
            for name in ("service_tier", "inference_geo", "speed"):
                _validate.text(name, getattr(self, name), optional=True)
        if self.reasoning_tokens > self.output_tokens:
            raise ConfigError("reasoning_tokens", "cannot exceed output_tokens "
                              f"({self.reasoning_tokens} > {self.output_tokens})")
        if self.iterations:
            self._check_iterations()

    def _check_iterations(self) -> None:
        if not isinstance(self.iterations, tuple):
            raise ConfigError("iterations", "must be a tuple of UsageIteration")
        for i, iteration in enumerate(self.iterations):
            if not isinstance(iteration, UsageIteration):
                raise ConfigError(f"iterations[{i}]", f"must be a UsageIteration, got "
                                                      f"{_validate.shown(iteration)}")
        for name in _TOKENS:
            total = sum(getattr(iteration, name) for iteration in self.iterations)
            if getattr(self, name) != total:
                raise ConfigError(name, f"must be the sum over iterations ({total}), got "
                                        f"{getattr(self, name)}; build it with "
                                        "Usage.from_iterations")

    @classmethod
    def from_iterations(
        cls,
        iterations: tuple[UsageIteration, ...],
        *,
        web_search_requests: int = 0,
        web_fetch_requests: int = 0,
        reasoning_tokens: int = 0,
        service_tier: str | None = None,
        inference_geo: str | None = None,
        speed: str | None = None,
    ) -> Usage:
        """The usage of a reply that reported ``iterations``: its tokens are their sums."""
        iterations = tuple(iterations)
        sums = {name: sum(getattr(i, name) for i in iterations) for name in _TOKENS}
        return cls(**sums, web_search_requests=web_search_requests,
                   web_fetch_requests=web_fetch_requests, reasoning_tokens=reasoning_tokens,
                   iterations=iterations, service_tier=service_tier,
                   inference_geo=inference_geo, speed=speed)

    @property
    def reported_iterations(self) -> int:
        """How many sampling iterations the replies reported (``usage.iterations``):
        the entries of `iterations` but those a sum added for a request that
        reported none (`UsageIteration.UNREPORTED`). What the ledger's
        ``iterations`` columns count: an attempt's, and summed, a run's."""
        return sum(1 for i in self.iterations if i.type != UsageIteration.UNREPORTED)

    @property
    def total_input_tokens(self) -> int:
        """All input tokens: uncached, cache reads and cache writes."""
        return self.input_tokens + self.cache_read_tokens + self.cache_write_tokens

    @property
    def cache_write_5m_tokens(self) -> int:
        """The part of ``cache_write_tokens`` written with the five-minute lifetime."""
        return self.cache_write_tokens - self.cache_write_1h_tokens

    def served_in(self, geo: str | None) -> Usage:
        """This usage, served in ``geo`` where it names no geo of its own: what a
        provider declares of every reply (`Provider.inference_geo`, a Vertex
        regional endpoint's region) when the reply does not say."""
        if geo is None or self.inference_geo is not None:
            return self
        return replace(self, inference_geo=geo)

    def _as_iterations(self) -> tuple[UsageIteration, ...]:
        if self.iterations:
            return self.iterations
        if not (self.input_tokens or self.output_tokens or self.cache_read_tokens
                or self.cache_write_tokens):
            return ()
        return (UsageIteration(
            type=UsageIteration.UNREPORTED, input_tokens=self.input_tokens,
            output_tokens=self.output_tokens,
            cache_read_tokens=self.cache_read_tokens, cache_write_tokens=self.cache_write_tokens,
            cache_write_1h_tokens=self.cache_write_1h_tokens),)

    def __add__(self, other: Usage) -> Usage:
        if not isinstance(other, Usage):
            return NotImplemented
        iterations = (self._as_iterations() + other._as_iterations()
                      if self.iterations or other.iterations else ())
        # Positional: this runs once per attempt, and keywords cost more.
        return Usage(
            self.input_tokens + other.input_tokens,
            self.output_tokens + other.output_tokens,
            self.cache_read_tokens + other.cache_read_tokens,
            self.cache_write_tokens + other.cache_write_tokens,
            self.cache_write_1h_tokens + other.cache_write_1h_tokens,
            self.web_search_requests + other.web_search_requests,
            self.web_fetch_requests + other.web_fetch_requests,
            self.reasoning_tokens + other.reasoning_tokens,
            iterations,
            _sum_tier(self.service_tier, other.service_tier),
            _sum_tier(self.inference_geo, other.inference_geo),
            _sum_tier(self.speed, other.speed),
        )


def sum_past_limit(a: Usage, b: Usage) -> str | None:
    """The first count of ``a + b`` past `MAX_INTEGER` (2**63 - 1), which no
    `Usage` holds and no ledger column stores, or None when the sum is a usage."""
    for name in _COUNTS:
        if getattr(a, name) + getattr(b, name) > _MAX_COUNT:
            return name
    return None


def _sum_tier(a: str | None, b: str | None) -> str | None:
    """The tier of a sum: the one reported (by both, or by either), None if they differ."""
    if a is None or a == b:
        return b
    return a if b is None else None


def usage_json(usage: Usage) -> dict[str, Any]:
    """``usage`` as JSON values, its iterations included: what `usage_from_json`
    reads back (a paused run's state, a recording)."""
    return {**_validate.field_values(usage),
            "iterations": [_validate.field_values(i) for i in usage.iterations]}


def usage_from_json(data: Mapping[str, Any]) -> Usage:
    """The `Usage` that `usage_json` wrote: equal to the one it was written from."""
    values = dict(data)
    iterations = tuple(UsageIteration(**i) for i in values.pop("iterations", None) or ())
    return Usage(**values, iterations=iterations)
