"""The whole usage vector as a value (docs/pricing.md): server tool counts, reasoning
tokens and per-iteration usage, validated, summed, and cheap."""

from __future__ import annotations

import pytest

import loopengine as le

COMPACTION = le.UsageIteration(type="compaction", input_tokens=55_196, output_tokens=125)
MESSAGE = le.UsageIteration(type="message", input_tokens=220, output_tokens=8,
                            cache_read_tokens=30, cache_write_tokens=12,
                            cache_write_1h_tokens=2)
ADVISOR = le.UsageIteration(type="advisor_message", model="claude-opus-4-6",
                            input_tokens=823, output_tokens=1612)


def test_new_fields_default_to_zero_and_keep_the_old_behaviour() -> None:
    """A usage built the old way is unchanged: positional tokens, derived totals."""
    usage = le.Usage(100, 20, 30, 10, 4)
    assert (usage.web_search_requests, usage.web_fetch_requests, usage.reasoning_tokens,
            usage.iterations) == (0, 0, 0, ())
    assert usage.total_input_tokens == 140 and usage.cache_write_5m_tokens == 6


@pytest.mark.parametrize(("fields", "field"), [
    ({"web_search_requests": -1}, "web_search_requests"),
    ({"web_fetch_requests": 1.0}, "web_fetch_requests"),
    ({"output_tokens": 10, "reasoning_tokens": 11}, "reasoning_tokens"),
    ({"iterations": [COMPACTION]}, "iterations"),
    ({"iterations": ("compaction",)}, "iterations[0]"),
    ({"iterations": (COMPACTION,)}, "input_tokens"),
])
def test_every_field_is_validated(fields: dict[str, object], field: str) -> None:
    """Counts are non-negative integers, reasoning is inside output, and the token
    fields of a usage with iterations are their sums."""
    with pytest.raises(le.ConfigError) as caught:
        le.Usage(**fields)  # type: ignore[arg-type]
    assert caught.value.field == field


def test_iteration_fields_are_validated() -> None:
    """An iteration names its type; its model is None or a name; tokens as in Usage."""
    for fields, field in (({"type": ""}, "type"),
                          ({"type": "message", "model": ""}, "model"),
                          ({"type": "message", "output_tokens": -1}, "output_tokens"),
                          ({"type": "message", "cache_write_1h_tokens": 1},
                           "cache_write_1h_tokens")):
        with pytest.raises(le.ConfigError) as caught:
            le.UsageIteration(**fields)  # type: ignore[arg-type]
        assert caught.value.field == field


def test_from_iterations_sums_the_tokens_of_every_iteration() -> None:
    """The compaction reply: top level 220 in / 8 out, the compaction pass 55,196 / 125;
    the usage holds the billed sum, not the top level."""
    usage = le.Usage.from_iterations((COMPACTION, MESSAGE), web_search_requests=2)
    assert (usage.input_tokens, usage.output_tokens) == (55_196 + 220, 125 + 8)
    assert (usage.cache_read_tokens, usage.cache_write_tokens, usage.cache_write_1h_tokens) \
        == (30, 12, 2)
    assert usage.iterations == (COMPACTION, MESSAGE) and usage.web_search_requests == 2
    assert MESSAGE.tokens() == le.Usage(input_tokens=220, output_tokens=8, cache_read_tokens=30,
                                        cache_write_tokens=12, cache_write_1h_tokens=2)


def test_addition_sums_every_field() -> None:
    """Counts and tokens add up; usages without iterations add as before."""
    a = le.Usage(input_tokens=10, output_tokens=5, web_search_requests=3, web_fetch_requests=1,
                 reasoning_tokens=2)
    b = le.Usage(input_tokens=1, output_tokens=7, web_search_requests=4, reasoning_tokens=7)
    total = a + b
    assert total == le.Usage(input_tokens=11, output_tokens=12, web_search_requests=7,
                             web_fetch_requests=1, reasoning_tokens=9)
    assert le.Usage() + le.Usage() == le.Usage()


def test_addition_keeps_the_tokens_the_sums_of_the_iterations() -> None:
    """Adding a usage with iterations to one without: the latter counts as one
    ``unreported`` iteration of its tokens, an empty usage as none; only the
    reported ones are counted as the ledger counts them."""
    compacted = le.Usage.from_iterations((COMPACTION, MESSAGE))
    plain = le.Usage(input_tokens=100, output_tokens=20)
    total = le.Usage() + compacted + plain
    assert total.iterations == (COMPACTION, MESSAGE,
                                le.UsageIteration(type=le.UsageIteration.UNREPORTED,
                                                  input_tokens=100, output_tokens=20))
    assert total.input_tokens == 55_196 + 220 + 100
    assert (total.reported_iterations, compacted.reported_iterations,
            plain.reported_iterations) == (2, 2, 0)
    assert (compacted + le.Usage()).iterations == (COMPACTION, MESSAGE)
    advised = le.Usage.from_iterations((MESSAGE, ADVISOR))
    assert (compacted + advised).iterations == (COMPACTION, MESSAGE, MESSAGE, ADVISOR)


def test_usage_stays_cheap() -> None:
    """Slotted and frozen: no per-instance dict on the hot path."""
    usage = le.Usage(input_tokens=1)
    assert not hasattr(usage, "__dict__") and not hasattr(COMPACTION, "__dict__")
    with pytest.raises(AttributeError):
        usage.input_tokens = 2  # type: ignore[misc]


def test_service_tier_is_kept_through_sums_while_the_parts_agree() -> None:
    """The tier reported by the parts (or by either), None when they differ."""
    flex = le.Usage(input_tokens=1, service_tier="flex")
    assert (le.Usage() + flex).service_tier == "flex"
    assert (flex + flex).service_tier == "flex"
    assert (flex + le.Usage(service_tier="priority")).service_tier is None
    with pytest.raises(le.ConfigError) as caught:
        le.Usage(service_tier="")
    assert caught.value.field == "service_tier"
