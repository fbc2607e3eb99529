"""Checks shared by every configuration object.

Each check raises `ConfigError` naming the field; none of them coerces a value
of the wrong type (``"3"`` is not 3, ``2.0`` is not an integer, ``True`` is
not a number), because a silently coerced limit is a limit nobody set.
"""

from __future__ import annotations

import math
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
