"""`Limits` and `RetryPolicy` remember the fields their caller named, so that an
override narrows only those (docs/guards.md); equality, repr, hashing, `from_mapping`,
`dataclasses.replace`, copying and pickling keep working."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from collections.abc import Callable
from typing import Any

import pytest

import loopengine as le
from loopengine._named import named_fields

PUBLISHED = le.Limits(max_turns=20, max_tool_batch=16, max_tool_calls=64, total_time=900.0,
                      attempt_timeout=300.0, credit_hold=50_000)
PUBLISHED_RETRY = le.RetryPolicy(max_attempts=5, initial_wait=0.01, max_wait=0.02)


def test_a_limits_override_narrows_only_the_fields_passed() -> None:
    """Limits(credit_hold=10) narrows the hold; every other field keeps the published value."""
    narrowed = PUBLISHED.narrow(le.Limits(credit_hold=10))
    assert narrowed == dataclasses.replace(PUBLISHED, credit_hold=10)


def test_a_field_passed_with_its_default_value_still_narrows() -> None:
    """Limits(max_turns=10) names max_turns, although 10 is its class default."""
    assert PUBLISHED.narrow(le.Limits(max_turns=10)).max_turns == 10
    assert PUBLISHED.narrow(le.Limits()) == PUBLISHED


def test_a_named_field_is_still_clamped_never_widened() -> None:
    """Naming a field above the published value changes nothing (R13)."""
    assert PUBLISHED.narrow(le.Limits(max_turns=99, attempt_timeout=5.0)) == (
        dataclasses.replace(PUBLISHED, attempt_timeout=5.0))


def test_named_fields_take_no_part_in_equality_repr_or_hash() -> None:
    """Two limits with equal values are equal, print alike and hash alike."""
    named, unnamed = le.Limits(max_turns=10, attempt_timeout=60), le.Limits()
    assert named_fields(named) == {"max_turns", "attempt_timeout"}
    assert named_fields(unnamed) == frozenset()
    assert named == unnamed and repr(named) == repr(unnamed) and hash(named) == hash(unnamed)
    assert [f.name for f in dataclasses.fields(le.Limits)] == [
        "max_turns", "max_tool_batch", "max_tool_calls", "total_time", "attempt_timeout",
        "credit_hold", "wrap_up", "pause_timeout"]


def test_from_mapping_names_the_mapping_keys() -> None:
    """Limits.from_mapping({...}) names exactly its keys; the internal _origin is no limit."""
    built = le.Limits.from_mapping({"max_turns": 3, "credit_hold": 7})
    assert named_fields(built) == {"max_turns", "credit_hold"}
    assert PUBLISHED.narrow(built) == dataclasses.replace(PUBLISHED, max_turns=3, credit_hold=7)
    with pytest.raises(le.ConfigError) as info:
        le.Limits.from_mapping({"_origin": None})
    assert info.value.field == "_origin"


def test_replace_names_the_originals_fields_and_the_changed_ones() -> None:
    """dataclasses.replace keeps the original's names and adds each field it changes."""
    replaced = dataclasses.replace(le.Limits(credit_hold=10), max_turns=3)
    assert named_fields(replaced) == {"credit_hold", "max_turns"}
    assert PUBLISHED.narrow(replaced) == dataclasses.replace(PUBLISHED, max_turns=3,
                                                             credit_hold=10)
    # The original is unchanged, and a replace that changes nothing adds nothing.
    assert named_fields(dataclasses.replace(replaced)) == {"credit_hold", "max_turns"}


def test_replace_cannot_tell_a_field_replaced_by_its_own_value() -> None:
    """replace passes every field to the constructor, so replacing a field with the
    value it already had is not told apart from leaving it: it stays unnamed."""
    same = dataclasses.replace(le.Limits(credit_hold=10), max_turns=10)
    assert named_fields(same) == {"credit_hold"}
    assert PUBLISHED.narrow(same).max_turns == 20


def test_replace_still_validates() -> None:
    """A replaced value is checked like a constructed one."""
    with pytest.raises(le.ConfigError) as info:
        dataclasses.replace(le.Limits(), max_turns=0)
    assert info.value.field == "max_turns"


@pytest.mark.parametrize("clone", [copy.copy, copy.deepcopy,
                                   lambda x: pickle.loads(pickle.dumps(x))],
                         ids=["copy", "deepcopy", "pickle"])
def test_copies_and_pickles_keep_the_named_fields(clone: Callable[[Any], Any]) -> None:
    """A copied or unpickled override narrows exactly as the original."""
    for original in (le.Limits(credit_hold=10, total_time=5), le.RetryPolicy(max_attempts=2)):
        cloned = clone(original)
        assert cloned == original and type(cloned) is type(original)
        assert named_fields(cloned) == named_fields(original)


def test_an_operation_pickles_with_its_limits() -> None:
    """An Operation (its Limits and RetryPolicy inside) survives pickling."""
    op = le.Operation(name="a", provider="anthropic", model="m", limits=PUBLISHED,
                      retry=PUBLISHED_RETRY)
    assert pickle.loads(pickle.dumps(op)) == op


def test_a_retry_override_narrows_only_the_fields_passed() -> None:
    """RetryPolicy(grow_max_tokens=False) keeps the published attempts and waits."""
    narrowed = PUBLISHED_RETRY.narrow(le.RetryPolicy(grow_max_tokens=False))
    assert (narrowed.max_attempts, narrowed.initial_wait, narrowed.max_wait,
            narrowed.grow_max_tokens) == (5, 0.01, 0.02, False)
    # A named field still narrows (attempts) or only grows (waits).
    assert PUBLISHED_RETRY.narrow(le.RetryPolicy(max_attempts=2)).max_attempts == 2
    assert PUBLISHED_RETRY.narrow(le.RetryPolicy(max_attempts=3)).max_attempts == 3
    slower = PUBLISHED_RETRY.narrow(le.RetryPolicy(initial_wait=0.5, max_wait=1.0))
    assert (slower.initial_wait, slower.max_wait, slower.max_attempts) == (0.5, 1.0, 5)


def test_a_replaced_retry_override_names_the_changed_field() -> None:
    """dataclasses.replace of a RetryPolicy adds the field it changed."""
    replaced = dataclasses.replace(le.RetryPolicy(grow_max_tokens=False), max_attempts=2)
    assert named_fields(replaced) == {"grow_max_tokens", "max_attempts"}
    assert PUBLISHED_RETRY.narrow(replaced).max_wait == 0.02
