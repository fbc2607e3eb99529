"""Configuration objects are frozen and validated when built: never a silent default."""

from __future__ import annotations

import dataclasses
import math
import pickle
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest

import loopengine as le
from loopengine.providers import CachePolicy


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_turns": 0}, "max_turns"),
        ({"max_turns": 2.0}, "max_turns"),
        ({"max_turns": "3"}, "max_turns"),
        ({"max_turns": True}, "max_turns"),
        ({"max_turns": None}, "max_turns"),
        ({"max_tool_batch": 0}, "max_tool_batch"),
        ({"max_tool_calls": -1}, "max_tool_calls"),
        ({"total_time": -1}, "total_time"),
        ({"total_time": 0}, "total_time"),
        ({"total_time": math.nan}, "total_time"),
        ({"total_time": math.inf}, "total_time"),
        ({"attempt_timeout": math.nan}, "attempt_timeout"),
        ({"attempt_timeout": None}, "attempt_timeout"),
        ({"credit_hold": -5}, "credit_hold"),
        ({"credit_hold": 1.5}, "credit_hold"),
    ],
)
def test_bad_limits_raise_config_error_naming_the_field(kwargs: dict[str, Any], field: str) -> None:
    """Each bad value is refused with ConfigError (a ValueError) naming its field."""
    with pytest.raises(le.ConfigError) as info:
        le.Limits(**kwargs)
    assert info.value.field == field
    assert isinstance(info.value, ValueError)


def test_limits_defaults_match_the_contract() -> None:
    """The documented defaults."""
    limits = le.Limits()
    assert (limits.max_turns, limits.max_tool_batch, limits.max_tool_calls, limits.total_time,
            limits.attempt_timeout, limits.credit_hold) == (10, 8, 32, 120.0, 60.0, None)


def test_config_objects_are_frozen() -> None:
    """No configuration object can be changed after it is built."""
    for obj, name in ((le.Limits(), "max_turns"), (le.RetryPolicy(), "max_attempts"),
                      (CachePolicy(), "system"),
                      (le.Operation(name="a", provider="p", model="m"), "model")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, 1)


@pytest.mark.parametrize("value", [0, 17, 2.5, "3", -1, None, True])
def test_retry_policy_max_attempts_must_be_1_to_16(value: Any) -> None:
    """max_attempts is an integer 1..16; anything else names max_attempts."""
    with pytest.raises(le.ConfigError) as info:
        le.RetryPolicy(max_attempts=value)
    assert info.value.field == "max_attempts"


def test_retry_policy_waits_validated() -> None:
    """Waits are finite, non-negative and max_wait covers initial_wait."""
    for kwargs, field in (({"initial_wait": -1}, "initial_wait"),
                          ({"max_wait": math.nan}, "max_wait"),
                          ({"initial_wait": 5.0, "max_wait": 1.0}, "max_wait"),
                          ({"grow_max_tokens": 1}, "grow_max_tokens")):
        with pytest.raises(le.ConfigError) as info:
            le.RetryPolicy(**kwargs)
        assert info.value.field == field


@pytest.mark.parametrize("value", [0, 17, 2.5, "3", -1])
def test_retry_override_fields_are_prefixed(value: Any) -> None:
    """A malformed override names retry.max_attempts, given as a dict."""
    with pytest.raises(le.ConfigError) as info:
        le.RetryPolicy().narrow({"max_attempts": value})
    assert info.value.field == "retry.max_attempts"


def test_retry_override_narrows_never_widens() -> None:
    """max_attempts is clamped, grow_max_tokens only turns off, waits only grow."""
    published = le.RetryPolicy(max_attempts=4, initial_wait=1.0, max_wait=4.0)
    assert published.narrow({"max_attempts": 16}).max_attempts == 4
    assert published.narrow({"max_attempts": 1}).max_attempts == 1
    assert published.narrow({"grow_max_tokens": False}).grow_max_tokens is False
    assert le.RetryPolicy(grow_max_tokens=False).narrow(
        {"grow_max_tokens": True}).grow_max_tokens is False
    assert published.narrow({"initial_wait": 0.0}).initial_wait == 1.0
    with pytest.raises(le.ConfigError) as info:
        published.narrow({"attempts": 2})
    assert info.value.field == "retry.attempts"


def test_limits_override_narrows_and_validates() -> None:
    """An override clamps to the published value; a bad one names limits.<field>."""
    published = le.Limits(max_turns=5, total_time=None, credit_hold=100)
    narrowed = published.narrow({"max_turns": 50, "total_time": 3.0, "credit_hold": 10})
    assert (narrowed.max_turns, narrowed.total_time, narrowed.credit_hold) == (5, 3.0, 10)
    for bad, field in (({"max_turns": 0}, "limits.max_turns"), ({"turns": 1}, "limits.turns")):
        with pytest.raises(le.ConfigError) as info:
            published.narrow(bad)
        assert info.value.field == field


def test_operation_validation() -> None:
    """Operations need a name, a route and sane ceilings."""
    for kwargs, field in (({"name": ""}, "name"), ({"provider": ""}, "provider"),
                          ({"max_output_tokens": 0}, "max_output_tokens"),
                          ({"limits": {"max_turns": 1}}, "limits")):
        args: dict[str, Any] = {"name": "a", "provider": "p", "model": "m", **kwargs}
        with pytest.raises(le.ConfigError) as info:
            le.Operation(**args)
        assert info.value.field == field


def test_prices_refuse_floats_and_naive_dates() -> None:
    """Prices are exact decimals; effective dates carry a timezone."""
    with pytest.raises(le.ConfigError) as info:
        le.ModelPrice(provider="p", model="m", input_per_mtok=3.0,  # type: ignore[arg-type]
                      output_per_mtok=Decimal(1))
    assert info.value.field == "input_per_mtok"
    with pytest.raises(le.ConfigError) as info:
        le.ModelPrice(provider="p", model="m", input_per_mtok=Decimal(1),
                      output_per_mtok=Decimal(1), effective_from=datetime(2025, 1, 1))
    assert info.value.field == "effective_from"
    with pytest.raises(le.ConfigError) as info:
        le.PriceBook(credit_quantum=0)
    assert info.value.field == "credit_quantum"
    with pytest.raises(le.ConfigError) as info:
        le.PriceBook(credits_per_usd="NaN")
    assert info.value.field == "credits_per_usd"
    assert le.ModelPrice(provider="p", model="m", input_per_mtok="3",  # type: ignore[arg-type]
                         output_per_mtok=15).input_per_mtok == Decimal(3)  # type: ignore[arg-type]
    assert le.ModelPrice(provider="p", model="m", input_per_mtok=Decimal(1),
                         output_per_mtok=Decimal(1),
                         effective_from=datetime(2025, 1, 1, tzinfo=UTC)).effective_from


def test_cache_policy_ttl() -> None:
    """Only the two Anthropic lifetimes are accepted."""
    assert CachePolicy(ttl="1h").marker == {"type": "ephemeral", "ttl": "1h"}
    with pytest.raises(le.ConfigError) as info:
        CachePolicy(ttl="10m")  # type: ignore[arg-type]
    assert info.value.field == "ttl"


def test_reject_needs_feedback() -> None:
    """A rejection without feedback would tell the model nothing."""
    with pytest.raises(le.ConfigError):
        le.Reject("")


def test_errors_pickle_with_their_fields() -> None:
    """Errors cross process boundaries intact."""
    error = pickle.loads(pickle.dumps(le.ConfigError("retry.max_attempts", "must be 1..16")))
    assert isinstance(error, le.ConfigError) and error.field == "retry.max_attempts"
    fault = pickle.loads(pickle.dumps(le.ProviderFault("overloaded", "busy", http_status=529)))
    assert fault.kind is le.FaultKind.OVERLOADED and fault.http_status == 529
    outcome = pickle.loads(pickle.dumps(le.ProviderError("x", fault=fault, outcome="provider_error",
                                                         attempts=3)))
    assert outcome.attempts == 3 and outcome.fault.kind is le.FaultKind.OVERLOADED


def test_error_tree_has_one_root() -> None:
    """Every library error derives from LoopEngineError."""
    for cls in (le.ConfigError, le.LedgerError, le.OutcomeError, le.ProviderError,
                le.ProviderFault, le.ReplayMismatchError):
        assert issubclass(cls, le.LoopEngineError)
    assert issubclass(le.ProviderError, le.OutcomeError)
