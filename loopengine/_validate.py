"""Checks shared by every configuration object.

Each check raises `ConfigError` naming the field; none of them coerces a value
of the wrong type (``"3"`` is not 3, ``2.0`` is not an integer, ``True`` is
not a number), because a silently coerced limit is a limit nobody set.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import inspect
import math
import os
import reprlib
import typing
import unicodedata
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from decimal import Decimal, InvalidOperation
from typing import Any

import pydantic
import typing_extensions

from loopengine._errors import ConfigError

_SHOWN = reprlib.Repr()
# (set after construction: Repr takes these as keywords only from Python 3.12)
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlong = 2, 40, 40, 40
_SHOWN.maxlist = _SHOWN.maxdict = _SHOWN.maxtuple = _SHOWN.maxset = 4


def shown(value: object) -> str:
    """``value`` as an error message shows it: a short repr, whatever it is.

    A plain ``{shown(value)}`` of caller input can recurse without end (a
    5,000-deep list raises ``RecursionError``), raise (a ``__repr__`` that
    fails) or print megabytes; this is bounded in depth and length and never
    raises.
    """
    try:
        return _SHOWN.repr(value)
    except Exception:  # a broken __repr__ of the caller's object
        return f"a {type(value).__name__}"


MAX_INTEGER = 2**63 - 1
"""The largest integer a setting may hold: a ledger column is a signed 64-bit int."""

MAX_SECONDS = 10 * 366 * 86400
"""The longest duration a setting may hold: ten years. Durations are added to the
wall clock (a run's deadline, a reservation's expiry, a lease), which ends at
the year 9999; far longer overflowed that arithmetic mid-run, and is a typo."""

MAX_DECIMAL_EXPONENT = 15
"""A price or rate is below 10**16: larger is a typo, and far larger would overflow
`decimal` arithmetic when an attempt is priced, mid-run."""


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
        raise ConfigError(field, f"must be an integer, got {shown(value)}")
    if maximum is None or maximum > MAX_INTEGER:
        # Every count is stored in a signed 64-bit column, on both stores.
        maximum = MAX_INTEGER
    if minimum is not None and value < minimum:
        raise ConfigError(field, f"must be at least {minimum}, got {shown(value)}")
    if maximum is not None and value > maximum:
        raise ConfigError(field, f"must be at most {maximum}, got {shown(value)}")
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
        raise ConfigError(field, f"must be a number of seconds, got {shown(value)}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond any float
        raise ConfigError(field, f"must be a finite number of seconds, got {shown(value)}") \
            from None
    if math.isnan(number) or math.isinf(number):
        raise ConfigError(field, f"must be a finite number of seconds, got {shown(value)}")
    if number < 0 or (positive and number == 0):
        bound = "greater than 0" if positive else "at least 0"
        raise ConfigError(field, f"must be {bound}, got {shown(value)}")
    if number > MAX_SECONDS:
        raise ConfigError(field, f"must be at most {MAX_SECONDS} seconds (ten years), "
                                 f"got {shown(value)}")
    return number


def required_seconds(field: str, value: object, *, positive: bool = True) -> float:
    """Like `seconds` but never None."""
    checked = seconds(field, value, positive=positive)
    assert checked is not None
    return checked


def items(field: str, value: object) -> list[Any]:
    """The items of a sequence argument (a list, a tuple, any iterable but text
    or a mapping), as a list; what they are is the caller's check.

    Raises:
        ConfigError: None, a string, a mapping, or something that cannot be
            iterated (``PriceBook(prices=None)``, ``Engine(observers=None)``).
    """
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        raise ConfigError(field, f"must be a list, got {shown(value)}")
    return list(value)


def known_keys(field: str, values: object, known: Iterable[str], what: str) -> None:
    """Check that ``values`` is a mapping whose keys all name a setting in ``known``.

    Args:
        field: The mapping's own name, for the error when it is not one.
        values: The mapping (a TOML table, a keyword mapping).
        known: The setting names it may hold.
        what: What a key names, for the message (``"a limit"``).

    Raises:
        ConfigError: ``values`` is not a mapping (``field``), or a key names no
            setting (the field is the key).
    """
    if not isinstance(values, Mapping):
        raise ConfigError(field, f"must be a mapping of settings, got {shown(values)}")
    names = set(known)
    for key in values:
        if key not in names:
            raise ConfigError(key if isinstance(key, str) else shown(key),
                              f"is not {what} (known: {', '.join(sorted(names))})")


def boolean(field: str, value: object) -> bool:
    """Return ``value`` if it is a bool, else raise `ConfigError`."""
    if not isinstance(value, bool):
        raise ConfigError(field, f"must be true or false, got {shown(value)}")
    return value


def text(field: str, value: object, *, optional: bool = False) -> str | None:
    """Return a non-empty string, else raise `ConfigError`."""
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(field, f"must be a non-empty string, got {shown(value)}")
    _utf8(field, value)
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


def model_schema(field: str, model: object) -> dict[str, Any]:
    """The JSON schema, without its title, of a pydantic model class that is a
    tool's input (a run's or call's ``output=``, a `Tool`'s ``input_model=``).

    Checked when the model is given, so that a model no tool can carry is
    refused before anything is sent or recorded, not mid-run: pydantic must
    generate the schema, it must describe a JSON object, and it must encode as
    JSON. A recursive model's schema, which pydantic gives as a bare ``$ref``
    to its own definition, has that definition at its root: the APIs refuse a
    tool whose input schema does not say ``"type": "object"`` there.

    Raises:
        ConfigError: ``model`` is not a subclass of ``pydantic.BaseModel``
            (or is ``BaseModel`` itself); pydantic cannot generate its schema
            (a field of an arbitrary class); the schema is not an object's (a
            ``RootModel`` of a list); or it holds what JSON cannot carry (a
            NaN default).
    """
    if not (isinstance(model, type) and issubclass(model, pydantic.BaseModel)) \
            or model is pydantic.BaseModel:
        raise ConfigError(field, "must be a pydantic model class (a subclass of BaseModel), "
                                 f"got {shown(model)}")
    try:
        schema = model.model_json_schema()
    except Exception as error:  # pydantic's refusal, whichever of its classes it raises
        reason = str(error).strip().splitlines()[0] if str(error).strip() else \
            type(error).__name__
        raise ConfigError(field, f"{model.__name__} has no JSON schema to send as a "
                                 f"tool's input: {reason}") from None
    schema.pop("title", None)
    ref = schema.get("$ref")
    if _bare_ref(schema):
        # A recursive model's schema is only a reference to its own definition;
        # every API wants a tool's input schema to say ``"type": "object"`` at
        # its root, so the definition is put there (still in ``$defs`` for the
        # references inside it).
        assert isinstance(ref, str)
        top = (schema.get("$defs") or {}).get(ref.removeprefix("#/$defs/"))
        if isinstance(top, Mapping):
            schema = {key: value for key, value in top.items() if key != "title"} | {
                "$defs": schema["$defs"]}
    kind = schema.get("type")
    if kind != "object":
        raise ConfigError(field, f"{model.__name__}'s JSON schema is of type {shown(kind)}, "
                                 "not 'object': a tool's input is a JSON object (make the "
                                 "value a field of a model)")
    copied: dict[str, Any] = json_copy(field, schema)
    return copied


def _bare_ref(schema: Mapping[str, Any]) -> bool:
    """Whether a model's schema (its title removed) is pydantic's bare ``$ref`` to
    the model's own definition in ``$defs``, as a recursive model's is."""
    ref = schema.get("$ref")
    return isinstance(ref, str) and ref.startswith("#/$defs/") \
        and set(schema) <= {"$ref", "$defs"}


def earlier_model_schema(model: type[pydantic.BaseModel]) -> dict[str, Any] | None:
    """The schema `model_schema` gave a recursive model before its definition was
    put at the root: pydantic's bare ``$ref`` (with its ``$defs``, without its
    title), which a run paused then keeps the digest of. None for a model whose
    schema was the same then (``model`` is one `model_schema` accepted)."""
    schema = model.model_json_schema()
    schema.pop("title", None)
    return schema if _bare_ref(schema) else None


def file_path(field: str, value: object) -> str:
    """``value``, a str or an ``os.PathLike`` of str, as the path's text.

    Raises:
        ConfigError: not such a path (None, bytes, a number); empty or only
            whitespace (an unset or mistyped setting: ``open`` would make a
            file named ``' '``, SQLite a private temporary database for
            ``''``); or it contains a NUL byte, which no file name can hold
            (``open`` would raise a ValueError).
    """
    try:
        path = os.fspath(value)  # type: ignore[call-overload]
    except TypeError:
        path = None
    if not isinstance(path, str):
        raise ConfigError(field, f"must be a str or an os.PathLike of str, got {shown(value)}")
    if not path.strip():
        raise ConfigError(field, "needs a file path, and the path is "
                                 f"{'empty' if not path else f'only whitespace ({path!r})'}")
    if "\0" in path:
        raise ConfigError(field, f"{shown(path)} cannot name a file: the path contains a NUL "
                                 "byte")
    return path


def moment(field: str, value: object, *, optional: bool = False) -> datetime | None:
    """Return ``value`` if it is a timezone-aware `datetime` (or None, when
    ``optional``), else raise `ConfigError`.

    Every moment the library compares (a price's start, the wall clock, a
    pause) is aware: a naive one would fail the first comparison mid-run
    with a TypeError.
    """
    if value is None and optional:
        return None
    if not isinstance(value, datetime) or value.utcoffset() is None:
        raise ConfigError(field, "must be a timezone-aware datetime"
                                 f"{' or None' if optional else ''}, got {shown(value)}")
    return value


def implements(value: object, protocol: type) -> bool:
    """Whether ``value`` is an object implementing ``protocol`` (a runtime-checkable
    `typing.Protocol`, such as `Provider`, `Ledger` or `Clock`).

    A class is not, though it passes the protocol's ``isinstance`` check (its
    methods are attributes): ``Engine(ScriptedProvider)`` or ``clock=FakeClock``
    without the call would fail only mid-run, calling a method without its
    ``self``.
    """
    return not isinstance(value, type) and isinstance(value, protocol)


def clock(field: str, value: object) -> None:
    """Check that ``value`` is None or a `Clock` whose wall time is
    timezone-aware (read once, here).

    Raises:
        ConfigError: not a Clock, or its ``wall()`` is naive: every moment a
            run compares (a price's start, an account's expiry) is aware, and
            the first comparison would fail mid-run with a TypeError.
    """
    from loopengine._clock import Clock  # the protocol, imported where it is checked

    if value is None:
        return
    if not implements(value, Clock):
        raise ConfigError(field, "must be a Clock (now, wall, sleep, cancel_scope), "
                                 f"got {shown(value)}")
    moment(f"{field}.wall()", typing.cast(Clock, value).wall())


def is_async(fn: object) -> bool:
    """Whether calling ``fn`` gives a coroutine: an ``async def`` function (or a
    partial of one), or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - a callable object's async __call__
    )


def sync_callable(field: str, value: object, shape: str) -> None:
    """Check that ``value`` is a callable the library calls and uses the result of
    at once, without awaiting it (a tool's ``approval`` check, an account key).

    Args:
        field: The argument's name.
        value: What was given.
        shape: Its signature, for the message (``"(call) -> bool"``).

    Raises:
        ConfigError: not callable, or an ``async def`` function: its call would
            give a coroutine, never the answer, and be refused only mid-run.
    """
    if not callable(value):
        raise ConfigError(field, f"must be a callable {shape}, got {shown(value)}")
    if is_async(value):
        raise ConfigError(field, f"must be a plain (not async) function {shape}: its "
                                 "result is used as it is returned, and an async "
                                 "function's is a coroutine")


def recorded_name(field: str, value: object, *, max_length: int = 256) -> str:
    """Return ``value`` if it can be a name the ledger records and the audit
    prints (an operation's name, route, model and version; a credit account):
    a non-empty string, printable (`identifier`: no NUL, which PostgreSQL text
    cannot hold, nor any other control character), of at most ``max_length``
    characters.

    Raises:
        ConfigError: anything else, before a row could fail to be written
            (a `LedgerError` is the ledger's failure, never a bad argument's).
    """
    checked = text(field, value)
    assert checked is not None
    identifier(field, checked, max_length=max_length)
    return checked


def recorded_text(field: str, value: object) -> str | None:
    """Return ``value`` if it is None or free text the ledger can record (a
    grant's note): a string without NUL (PostgreSQL text cannot hold it) or a
    lone surrogate (UTF-8 cannot encode it); line breaks are fine.

    Raises:
        ConfigError: anything else.
    """
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigError(field, f"must be text, got {shown(value)}")
    if "\x00" in value:
        raise ConfigError(field, f"must not hold a NUL character (character "
                                 f"{value.index(chr(0))}): the ledger cannot record it")
    _utf8(field, value)
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
        raise ConfigError(field, "must be a Decimal, an int or a numeric string, "
                                 f"got {shown(value)}")
    if not isinstance(value, Decimal | int | str):
        raise ConfigError(field, "must be a Decimal, an int or a numeric string, "
                                 f"got {shown(value)}")
    try:
        number = value if isinstance(value, Decimal) else Decimal(value)
    except (InvalidOperation, ValueError):
        raise ConfigError(field, f"must be a decimal number, got {shown(value)}") from None
    if not number.is_finite():
        raise ConfigError(field, f"must be finite, got {shown(value)}")
    if number and number.adjusted() > MAX_DECIMAL_EXPONENT:
        raise ConfigError(field, f"must be below 10**{MAX_DECIMAL_EXPONENT + 1}, "
                                 f"got {shown(value)}")
    if number < 0 or (positive and number == 0):
        bound = "positive" if positive else "non-negative"
        raise ConfigError(field, f"must be {bound}, got {shown(value)}")
    return number


# -- what JSON can carry ------------------------------------------------------------
#
# A request is sent as UTF-8 JSON. A value that passed every other check but
# cannot be encoded (a lone surrogate, a NaN, a key that is not a string, a
# nesting deeper than the encoders recurse) would fail inside the provider's
# SDK after the attempt's ledger row was written, recording a request that
# never went on the wire. So everything the caller gives for a request is
# proven encodable here, while it is copied.

MAX_JSON_DEPTH = 128
"""The deepest nesting of lists and objects accepted in a request's content.

The SDKs and the JSON encoders recurse once (or more) per level; far below
the interpreter's recursion limit, far above any tool input or schema seen.
"""

# The longest int `json` encodes: `int.__str__` refuses more digits
# (`sys.get_int_max_str_digits`, 4,300 by default); checked by bit length.
_INT_BITS = 14_000


def json_copy(field: str, value: object) -> Any:
    """A copy of ``value`` made of plain JSON types, proven encodable as UTF-8 JSON.

    Mappings become dicts and tuples lists; strings, finite floats, ints,
    bools and None are kept.

    Args:
        field: The value's path, e.g. ``"messages[2]"``; problems are named
            below it (``"messages[2].content[0].text"``).
        value: The value to copy.

    Raises:
        ConfigError: a string holds a lone surrogate (UTF-8 cannot encode it),
            a float is not finite, a mapping key is not a string, a value is
            not a JSON type, or the nesting is deeper than `MAX_JSON_DEPTH`.
            The message never echoes the value.
    """
    try:
        return _json_copy(value, 0)
    except _NotJSON as problem:
        # The path is assembled only for the one value refused: the copy of
        # every value that passes builds no field names.
        raise ConfigError(field + "".join(reversed(problem.path)), problem.message) from None


class _NotJSON(Exception):
    """A value JSON cannot carry; ``path`` grows (innermost first) as it unwinds."""

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.path = [path] if path else []


def _json_copy(value: object, depth: int) -> Any:
    kind = type(value)
    if kind is str:
        assert isinstance(value, str)
        if not value.isascii():
            _utf8_problem(value)
        return value
    if kind is dict or isinstance(value, Mapping):
        assert isinstance(value, Mapping)
        if depth >= MAX_JSON_DEPTH:
            raise _NotJSON(f"is nested more than {MAX_JSON_DEPTH} levels deep")
        out: dict[str, Any] = {}
        for key, item in value.items():
            if type(key) is not str:
                raise _NotJSON(f"has a key that is not a string (a {type(key).__name__}): "
                               "JSON keys are strings")
            if not key.isascii():
                try:
                    _utf8_problem(key)
                except _NotJSON as problem:
                    problem.path.append(" key")
                    raise
            try:
                out[key] = _json_copy(item, depth + 1)
            except _NotJSON as problem:
                problem.path.append(f".{key}")
                raise
        return out
    if kind is list or kind is tuple:
        assert isinstance(value, list | tuple)
        if depth >= MAX_JSON_DEPTH:
            raise _NotJSON(f"is nested more than {MAX_JSON_DEPTH} levels deep")
        copied = []
        for index, item in enumerate(value):
            try:
                copied.append(_json_copy(item, depth + 1))
            except _NotJSON as problem:
                problem.path.append(f"[{index}]")
                raise
        return copied
    if value is None or kind is bool:
        return value
    if kind is int:
        assert isinstance(value, int)
        if value.bit_length() > _INT_BITS:
            raise _NotJSON(f"is an integer too long to encode ({value.bit_length()} bits)")
        return value
    if kind is float:
        assert isinstance(value, float)
        if not math.isfinite(value):
            raise _NotJSON(f"must be a finite number (JSON has no {shown(value)})")
        return value
    # Subclasses (a StrEnum, an IntEnum) encode as their base value: kept as it.
    # (``str.__str__``, not ``str()``: a mixed-in ``Enum`` prints its name.)
    if isinstance(value, str):
        return _json_copy(str.__str__(value), depth)
    if isinstance(value, int | float):
        return _json_copy((float if isinstance(value, float) else int)(value), depth)
    raise _NotJSON("must be a JSON value (a string, number, bool, None, list or dict), "
                   f"got a {kind.__name__}")


def _utf8_problem(value: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise _NotJSON(f"must be valid Unicode: character {error.start} is a lone "
                       f"surrogate U+{ord(value[error.start]):04X}, which UTF-8 cannot "
                       "encode") from None


def _utf8(field: str, value: str) -> None:
    """Raise `ConfigError` if ``value`` holds a lone surrogate (not encodable as UTF-8)."""
    try:
        _utf8_problem(value)
    except _NotJSON as problem:
        raise ConfigError(field, problem.message) from None


# -- Anthropic message shapes --------------------------------------------------------
#
# Messages are checked against the types the installed ``anthropic`` SDK declares
# for them (``anthropic.types.MessageParam`` and the content-block TypedDicts it
# names), so that a malformed block is a `ConfigError` naming its path before
# anything is sent, instead of a 400 after an attempt row. Validating the whole
# ``MessageParam`` union with one pydantic ``TypeAdapter`` is not usable: it takes
# seconds to build, tries every one of ~17 block types on each block (so a bad
# block gets dozens of errors, one per union member), and its ``Iterable`` fields
# are only validated when iterated. Instead each block is dispatched on its
# ``type`` to an adapter of that one TypedDict (built on first use, a few
# milliseconds each), validated strictly (no coercion: ``"yes"`` is not a bool),
# and its lazily validated iterables are drained. Extra keys are not refused:
# the SDK's TypedDicts do not say the API refuses them, and blocks the API
# returned carry response-only fields that it accepts back.
#
# Only the block types the engine itself reads (text, tool calls and their
# results) or that callers write by hand (images, documents, search results)
# are checked so. Every other block (thinking, server tools and their results,
# MCP, compaction, fallback, container uploads, and types no SDK knows yet)
# comes from the API and goes back to it as it came: the SDK's types trail
# the API (an advisor's ``server_tool_use`` fails its ``name`` literal), so it
# is carried through unchanged, its ``type`` a string, its content only
# proven encodable (`json_copy`).

CHECKED_KINDS = frozenset({"text", "image", "document", "search_result", "tool_use",
                           "tool_result"})
"""The block types checked against the SDK's declaration; others are carried through."""


class _NestedError(Exception):
    """A lazily validated iterable failed: where it is and what it held."""

    def __init__(self, path: tuple[str | int, ...], given: object,
                 error: pydantic.ValidationError) -> None:
        super().__init__(path)
        self.path, self.given, self.error = path, given, error


def _literal_values(hint: object) -> list[str]:
    if typing.get_origin(hint) is typing.Literal:
        return [v for v in typing.get_args(hint) if isinstance(v, str)]
    return [v for arg in typing.get_args(hint) for v in _literal_values(arg)]


@functools.cache
def _block_types() -> dict[str, object]:
    """Each block ``type`` the SDK declares for message content, to its type."""
    from anthropic.types import MessageParam  # the SDK's own declaration

    found: dict[str, object] = {}
    seen: set[int] = set()

    def visit(hint: object) -> None:
        if id(hint) in seen:
            return
        seen.add(id(hint))
        if typing_extensions.is_typeddict(hint):
            hints = typing_extensions.get_type_hints(hint, include_extras=True)
            for value in _literal_values(hints.get("type")):
                found.setdefault(value, hint)
            return
        if isinstance(hint, type) and issubclass(hint, pydantic.BaseModel):
            # The response blocks the SDK also accepts back (message content
            # may be ``ContentBlock`` models); TypedDicts of the same type win.
            type_field = hint.model_fields.get("type")
            if type_field is not None:
                for value in _literal_values(type_field.annotation):
                    found.setdefault(value, hint)
            return
        for arg in typing.get_args(hint):
            visit(arg)

    members = typing.get_args(MessageParam) or (MessageParam,)
    for member in members:
        hints = typing_extensions.get_type_hints(member, include_extras=True)
        if "user" in _literal_values(hints.get("role")):
            visit(hints.get("content"))
    for member in members:  # assistant content, when it differs
        visit(typing_extensions.get_type_hints(member, include_extras=True).get("content"))
    return found


@functools.cache
def _block_adapter(kind: str) -> pydantic.TypeAdapter[Any] | None:
    global _LAZY, _CONTAINERS
    declared: Any = _block_types().get(kind)
    if declared is None:
        return None
    if _LAZY is None:
        _LAZY = type(pydantic.TypeAdapter(Iterable[int]).validate_python(()))
        _CONTAINERS = frozenset({dict, list, _LAZY})
    return pydantic.TypeAdapter(declared)


def block_types() -> list[str]:
    """The content block types the installed anthropic SDK declares, sorted."""
    return sorted(_block_types())


def content_block(field: str, block: object, *, kinds: Iterable[str] | None = None) -> None:
    """Check one content block against the anthropic SDK's type for its ``type``.

    Args:
        field: The block's path, e.g. ``"messages[1].content[0]"``.
        block: The block.
        kinds: The block types allowed here (default: any type; those in
            `CHECKED_KINDS` are checked, the rest carried through).

    Raises:
        ConfigError: the block is not a dict, has no ``type`` string, is not
            of a type allowed here, or does not match its type; ``.field`` is
            the offending path, e.g. ``"messages[1].content[0].source.data"``.
    """
    if not isinstance(block, Mapping):
        raise ConfigError(field, f"must be a dict (a content block), got {type(block).__name__}")
    kind = block.get("type")
    if kind is None:
        raise ConfigError(f"{field}.type", "is required (every content block has a type)")
    if not isinstance(kind, str) or not kind:
        raise ConfigError(f"{field}.type",
                          f"must be a non-empty string, got {_short(kind)}")
    if kinds is None and kind not in CHECKED_KINDS:
        return  # a block the engine does not read: carried through as it came
    if kind == "tool_use" and isinstance(block.get("input"), str):
        # A model's malformed arguments, kept as the string it sent (R15): the
        # run answered them as invalid input, so a history holding them stays
        # one to continue from; the rest of the block must still be well-formed.
        block = {**block, "input": {}}
    adapter = _block_adapter(kind) if kinds is None or kind in kinds else None
    if adapter is None:
        allowed = sorted(kinds if kinds is not None else CHECKED_KINDS)
        raise ConfigError(f"{field}.type", f"{_short(kind)} is not a block type allowed "
                                           f"here; expected one of {', '.join(allowed)}")
    try:
        _drain(adapter.validate_python(block, strict=True), block, ())
    except pydantic.ValidationError as error:
        path, message = _problem(error, block)
    except _NestedError as nested:
        inner, message = _problem(nested.error, nested.given)
        path = nested.path + inner
    else:
        return
    raise ConfigError(field + _render(path), message)


def _drain(checked: object, given: object, path: tuple[str | int, ...]) -> None:
    """Iterate what pydantic left lazy (``Iterable`` fields), so it is validated.

    Only containers are walked (the exact types pydantic returns, checked by
    type for speed); a value passed through unvalidated (``object`` fields,
    e.g. a tool call's input) is the caller's own object and holds nothing lazy.
    """
    kind = type(checked)
    if kind is dict:
        assert isinstance(checked, dict)
        mapping = given if isinstance(given, Mapping) else {}
        for key, value in checked.items():
            if type(value) in _CONTAINERS:
                inner = mapping.get(key)
                if value is not inner:
                    _drain(value, inner, (*path, key))
    elif kind is list:
        assert isinstance(checked, list)
        for index, value in enumerate(checked):
            if type(value) in _CONTAINERS:
                _drain(value, _item(given, index), (*path, index))
    elif kind is _LAZY:
        assert isinstance(checked, Iterator)
        try:
            for index, value in enumerate(checked):
                if type(value) in _CONTAINERS:
                    _drain(value, _item(given, index), (*path, index))
        except pydantic.ValidationError as error:
            raise _NestedError(path, given, error) from None


# The type pydantic validates ``Iterable`` fields into, which it leaves lazy;
# learnt with the first block adapter (building a TypeAdapter at import would
# cost every importer pydantic's schema warm-up).
_LAZY: type | None = None
_CONTAINERS: frozenset[type] = frozenset({dict, list})


def _item(given: object, index: int) -> object:
    if isinstance(given, Sequence) and not isinstance(given, str | bytes) and index < len(given):
        return given[index]
    return None


def _problem(error: pydantic.ValidationError, given: object) -> tuple[tuple[str | int, ...], str]:
    """The one problem to report: its path in ``given`` and what is wrong.

    Union members show up in pydantic's locations as extra segments (the
    member's class name): they are dropped from the path. Members whose own
    ``type`` does not match the input's are left out, so an image source
    ``{"type": "url"}`` without ``url`` is told about ``url``, not about the
    base64 member's ``data``; when no member's ``type`` matches, that is the
    problem.
    """
    located = []
    for item in error.errors(include_url=False, include_input=False):
        path, tags = _locate(item["loc"], item["type"], given)
        located.append((path, tags, item))
    mismatched = [tags for path, tags, item in located
                  if item["type"] == "literal_error" and path[-1:] == ("type",)]
    eligible = [(path, item) for path, tags, item in located
                if not any(tags[:len(m)] == m for m in mismatched)]
    if not eligible:
        first = next(path for path, tags, item in located
                     if item["type"] == "literal_error" and path[-1:] == ("type",))
        expected = []
        for path, _, item in located:
            if path == first and item["type"] == "literal_error":
                wanted = str((item.get("ctx") or {}).get("expected", ""))
                if wanted and wanted not in expected:
                    expected.append(wanted)
        got = _at(given, first)
        return first, f"must be one of {', '.join(expected)}, got {_short(got)}"
    where = eligible[0][0]
    messages: list[str] = []
    for path, item in eligible:
        text = "is required" if item["type"] == "missing" else _lower_first(str(item["msg"]))
        if path == where and text not in messages:
            messages.append(text)
    return where, " or ".join(messages)


def _locate(
    loc: tuple[str | int, ...], kind: str, given: object
) -> tuple[tuple[str | int, ...], tuple[tuple[int, str | int], ...]]:
    """Split a pydantic location into the path in ``given`` and union-member tags."""
    path: list[str | int] = []
    tags: list[tuple[int, str | int]] = []
    value = given
    for i, segment in enumerate(loc):
        if isinstance(segment, int) and isinstance(value, Sequence) and not isinstance(
            value, str | bytes
        ) and 0 <= segment < len(value):
            path.append(segment)
            value = value[segment]
        elif isinstance(segment, str) and isinstance(value, Mapping) and segment in value:
            path.append(segment)
            value = value[segment]
        elif isinstance(segment, str) and i == len(loc) - 1 and kind == "missing":
            path.append(segment)
        else:
            tags.append((len(path), segment))
    return tuple(path), tuple(tags)


def _at(given: object, path: tuple[str | int, ...]) -> object:
    for segment in path:
        given = given[segment] if isinstance(given, Mapping | Sequence) else None  # type: ignore[index]
    return given


def _render(path: tuple[str | int, ...]) -> str:
    return "".join(f"[{s}]" if isinstance(s, int) else f".{s}" for s in path)


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]


def _short(value: object) -> str:
    # Input values are caller content: show only short strings, never the rest.
    if isinstance(value, str):
        return repr(value) if len(value) <= 40 else repr(value[:40] + "...")
    return f"a {type(value).__name__}"


def decoded_size(data: object) -> int | None:
    """How many bytes ``data``'s base64 decodes to (None: it is not base64)."""
    try:
        return len(base64.b64decode(str(data), validate=True))
    except (binascii.Error, ValueError):
        return None


def binary_note(what: str, mime: object, data: object) -> str:
    """The text standing for binary content a message cannot carry, read by the
    model in its place: ``[image: image/png, 68 bytes, not shown]`` (the size
    decoded from ``data``'s base64, or ``undecodable base64``)."""
    size = decoded_size(data)
    shown = "undecodable base64" if size is None else f"{size} bytes"
    return f"[{what}: {mime}, {shown}, not shown]"


def field_values(value: Any) -> dict[str, Any]:
    """Every field of the dataclass instance ``value``, by name (what a
    ``from_mapping``, or its class called with them, reads back)."""
    return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
