"""`Usage`: the tokens one or more provider requests reported."""

from __future__ import annotations

from dataclasses import dataclass

from loopengine import _validate
from loopengine._errors import ConfigError

__all__ = ["Usage"]


@dataclass(frozen=True, slots=True)
class Usage:
    """Token usage, in the Anthropic convention.

    ``input_tokens`` counts only the uncached input: cache reads and cache
    writes are counted separately and are not part of it. (OpenTelemetry's
    ``gen_ai.usage.input_tokens`` and genai-prices count them inside the input;
    `total_input_tokens` gives that figure.)
    """

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
        for name in (
            "input_tokens",
            "output_tokens",
            "cache_read_tokens",
            "cache_write_tokens",
            "cache_write_1h_tokens",
        ):
            _validate.integer(name, getattr(self, name), minimum=0)
        if self.cache_write_1h_tokens > self.cache_write_tokens:
            raise ConfigError(
                "cache_write_1h_tokens",
                f"cannot exceed cache_write_tokens ({self.cache_write_1h_tokens} > "
                f"{self.cache_write_tokens})",
            )

    @property
    def total_input_tokens(self) -> int:
        """All input tokens: uncached, cache reads and cache writes."""
        return self.input_tokens + self.cache_read_tokens + self.cache_write_tokens

    @property
    def cache_write_5m_tokens(self) -> int:
        """The part of ``cache_write_tokens`` written with the five-minute lifetime."""
        return self.cache_write_tokens - self.cache_write_1h_tokens

    def __add__(self, other: Usage) -> Usage:
        if not isinstance(other, Usage):
            return NotImplemented
        return Usage(
            input_tokens=self.input_tokens + other.input_tokens,
            output_tokens=self.output_tokens + other.output_tokens,
            cache_read_tokens=self.cache_read_tokens + other.cache_read_tokens,
            cache_write_tokens=self.cache_write_tokens + other.cache_write_tokens,
            cache_write_1h_tokens=self.cache_write_1h_tokens + other.cache_write_1h_tokens,
        )
