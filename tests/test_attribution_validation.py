"""`Attribution` refuses values that could attack whoever reads the ledger: control,
format and separator characters, and unbounded length."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import loopengine as le

FIELDS = ("tenant", "user_id", "feature", "correlation_id")


@pytest.mark.parametrize("name", FIELDS)
def test_a_100_kb_value_is_refused_naming_the_field(name: str) -> None:
    """A 100 KB value is a ConfigError whose field is attribution.<name>, without the value."""
    with pytest.raises(le.ConfigError) as caught:
        le.Attribution(**{name: "x" * 100_000})
    assert caught.value.field == f"attribution.{name}"
    assert "at most 256 characters, got 100000" in str(caught.value)
    assert "xxxxxxxxxx" not in str(caught.value)


def test_256_characters_pass_and_257_do_not() -> None:
    """The bound is 256 characters (code points, not bytes): "é" counts once."""
    assert le.Attribution(correlation_id="é" * 256).correlation_id == "é" * 256
    with pytest.raises(le.ConfigError, match="at most 256"):
        le.Attribution(correlation_id="a" * 257)


@pytest.mark.parametrize(("char", "category"), [
    ("\x1b", "Cc"),      # ESC: the start of a terminal escape sequence
    ("\n", "Cc"),        # a newline forges a second log or table line
    ("\t", "Cc"),
    ("\x00", "Cc"),
    ("\x7f", "Cc"),      # DEL
    ("\x9b", "Cc"),      # C1 CSI: an escape sequence in one character
    ("\u200b", "Cf"),    # zero-width space: two ids that look the same
    ("\u202e", "Cf"),    # right-to-left override: text displayed in another order
    ("\u2028", "Zl"),
    ("\u2029", "Zp"),
    ("\u00a0", "Zs"),    # a space that is not U+0020
    ("\ud800", "Cs"),    # a lone surrogate, which UTF-8 cannot store
    ("\ue000", "Co"),
])
def test_unprintable_characters_are_refused_by_code_point(char: str, category: str) -> None:
    """Each refused character is named by index, code point and category, never echoed raw."""
    with pytest.raises(le.ConfigError) as caught:
        le.Attribution(tenant=f"acme{char}corp")
    error = caught.value
    assert error.field == "attribution.tenant"
    assert f"character 4 is U+{ord(char):04X} (category {category})" in str(error)
    assert char not in str(error)


def test_a_terminal_escape_sequence_is_refused() -> None:
    """The issue's example: a tenant that would clear an auditor's screen."""
    with pytest.raises(le.ConfigError, match=r"U\+001B"):
        le.Attribution(tenant="\x1b[2J")


@pytest.mark.parametrize("value", ["acme", "Ünïcödé-Tenant", "租户-42", "user@example.test",
                                   "a b", "=HYPERLINK(x)", "🙂"])
def test_printable_text_of_any_script_passes(value: str) -> None:
    """Letters, digits, marks, symbols and U+0020 of any script are accepted as they are.

    (A leading ``=`` is harmless here: neutralising formula prefixes is the CSV
    export's job, not the attribution's.)"""
    assert le.Attribution(feature=value).feature == value


@pytest.mark.parametrize("value", ["", "   "])
def test_empty_or_blank_values_are_refused(value: str) -> None:
    """An empty or blank id is a mistake, not an id: None says "not given"."""
    with pytest.raises(le.ConfigError, match="empty or blank"):
        le.Attribution(user_id=value)


@pytest.mark.parametrize("value", [42, b"acme", ["acme"]])
def test_non_strings_are_refused_by_type_name(value: object) -> None:
    """A non-string is refused; the message gives its type, not its (possibly huge) repr."""
    with pytest.raises(le.ConfigError, match="must be a string, got") as caught:
        le.Attribution(tenant=value)  # type: ignore[arg-type]
    assert caught.value.field == "attribution.tenant"


def test_every_field_may_be_omitted() -> None:
    """None means not given, for every field."""
    assert le.Attribution() == le.Attribution(tenant=None, user_id=None, feature=None,
                                              correlation_id=None)


def test_the_error_pickles_with_its_field() -> None:
    """The ConfigError survives a process boundary with its field."""
    with pytest.raises(le.ConfigError) as caught:
        le.Attribution(correlation_id="\x1b")
    copy = pickle.loads(pickle.dumps(caught.value))
    assert copy.field == "attribution.correlation_id"


# No deadline: hypothesis's default fails an example that takes 200 ms of real
# time, which a loaded machine can spend on a trivial one.
@settings(deadline=None)
@given(st.text(max_size=300))
def test_whatever_is_accepted_is_printable_and_bounded(value: str) -> None:
    """Any text: either refused with a ConfigError, or printable, non-blank and at most 256."""
    try:
        attribution = le.Attribution(correlation_id=value)
    except le.ConfigError as error:
        assert error.field == "attribution.correlation_id"
    else:
        assert attribution.correlation_id is not None
        assert attribution.correlation_id.isprintable()
        assert 0 < len(attribution.correlation_id.strip()) <= len(value) <= 256
