"""Checks shared by every configuration object.

Each check raises `ConfigError` naming the field; none of them coerces a value
of the wrong type (``"3"`` is not 3, ``2.0`` is not an integer, ``True`` is
not a number), because a silently coerced limit is a limit nobody set.
"""

from __future__ import annotations

import math
import unicodedata
from decimal import Decimal, InvalidOperation

from loopengine._errors import ConfigError


def integer(
    field: str,
    value: object,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    optional: bool = False,
) -> int | None:
    """Return ``value`` if it is an int within the bounds, else raise `ConfigError`."""
    if value is None:
        if optional:
            return None
        raise ConfigError(field, "is required (got None)")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(field, f"must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(field, f"must be at least {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ConfigError(field, f"must be at most {maximum}, got {value!r}")
    return value


def required_integer(
    field: str, value: object, *, minimum: int | None = None, maximum: int | None = None
) -> int:
    """Like `integer` but never None."""
    checked = integer(field, value, minimum=minimum, maximum=maximum)
    assert checked is not None
    return checked


def seconds(
    field: str,
    value: object,
    *,
    positive: bool = True,
    optional: bool = False,
) -> float | None:
    """Return a finite, non-negative (or positive) number of seconds as float."""
    if value is None:
        if optional:
            return None
        raise ConfigError(field, "is required (got None)")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(field, f"must be a number of seconds, got {value!r}")
    number = float(value)
    if math.isnan(number) or math.isinf(number):
        raise ConfigError(field, f"must be a finite number of seconds, got {value!r}")
    if number < 0 or (positive and number == 0):
        bound = "greater than 0" if positive else "at least 0"
        raise ConfigError(field, f"must be {bound}, got {value!r}")
    return number


def required_seconds(field: str, value: object, *, positive: bool = True) -> float:
    """Like `seconds` but never None."""
    checked = seconds(field, value, positive=positive)
    assert checked is not None
    return checked


def boolean(field: str, value: object) -> bool:
    """Return ``value`` if it is a bool, else raise `ConfigError`."""
    if not isinstance(value, bool):
        raise ConfigError(field, f"must be true or false, got {value!r}")
    return value


def text(field: str, value: object, *, optional: bool = False) -> str | None:
    """Return a non-empty string, else raise `ConfigError`."""
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(field, f"must be a non-empty string, got {value!r}")
    return value


def identifier(field: str, value: object, *, max_length: int = 256) -> str | None:
    """Return ``value`` if it is None or a printable, non-blank string of at most
    ``max_length`` characters, else raise `ConfigError`.

    For ids that are stored and later printed (a ledger's tenant, a correlation
    id): "printable" is `str.isprintable`, which refuses every control
    character (C0 with tab and newline, DEL, C1: category Cc), format
    characters (Cf: zero-width characters, bidirectional overrides that make
    text display in another order), line and paragraph separators (Zl, Zp),
    spaces other than U+0020 (Zs), surrogates (Cs, which UTF-8 cannot store),
    private-use (Co) and unassigned (Cn) code points. Letters, digits, marks
    and symbols of every script pass. The length is counted in characters
    (code points). The message names the first offending character by code
    point and category, never echoing the value itself.
    """
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigError(field, f"must be a string, got {type(value).__name__}")
    if len(value) > max_length:
        raise ConfigError(field, f"must be at most {max_length} characters, got {len(value)}")
    if not value.isprintable():
        index, char = next((i, c) for i, c in enumerate(value) if not c.isprintable())
        raise ConfigError(
            field, f"must be printable: character {index} is U+{ord(char):04X} "
                   f"(category {unicodedata.category(char)})")
    if not value.strip():
        raise ConfigError(field, "must not be empty or blank")
    return value


def decimal(
    field: str, value: object, *, optional: bool = False, positive: bool = False
) -> Decimal | None:
    """Return a finite, non-negative `Decimal` from a Decimal, int or numeric string.

    Floats are refused: a price given as a float has already lost its exact
    value.
    """
    if value is None:
        if optional:
            return None
        raise ConfigError(field, "is required (got None)")
    if isinstance(value, bool) or isinstance(value, float):
        raise ConfigError(field, f"must be a Decimal, an int or a numeric string, got {value!r}")
    try:
        number = value if isinstance(value, Decimal) else Decimal(str(value))
    except (InvalidOperation, ValueError):
        raise ConfigError(field, f"must be a decimal number, got {value!r}") from None
    if not number.is_finite():
        raise ConfigError(field, f"must be finite, got {value!r}")
    if number < 0 or (positive and number == 0):
        bound = "positive" if positive else "non-negative"
        raise ConfigError(field, f"must be {bound}, got {value!r}")
    return number
