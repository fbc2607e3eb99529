"""Configuration objects that remember which fields their caller named.

An override narrows only what it names (docs/guards.md): ``Limits(credit_hold=10)``
says nothing about ``max_turns``, although the object holds a value for it
(the class default). `NamedFields` is the base of the frozen dataclasses that
serve as overrides (`Limits`, `RetryPolicy`); `named_fields` tells which
fields an instance was given:

* built directly, the keywords passed to the constructor (``from_mapping``
  passes the mapping's keys);
* built by `dataclasses.replace`, the original's named fields plus every field
  whose value the replacement changed. ``replace`` passes every field to the
  constructor, so the names it was called with are not known: a field
  replaced by the value it already had is not counted (that value is then the
  class default, or the original named it anyway);
* copied or unpickled, the original's.

The names are not a field: they take no part in equality, hashing or repr,
and `dataclasses.fields` does not list them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import TYPE_CHECKING, Any, Self, cast

from loopengine._errors import ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["NamedFields", "given", "given_values", "named_fields", "replaced_from"]

_ORIGIN = "_origin"
"""The init-only pseudo-field through which `dataclasses.replace` hands over the
instance it copies (see `replaced_from`)."""


class NamedFields:
    """Base of a frozen, slotted dataclass whose instances remember the fields
    their caller named.

    The dataclass declares ``_origin: InitVar[Self | None] = replaced_from()``
    and accepts (and ignores) ``_origin`` in its ``__post_init__``.
    """

    __slots__ = ("_named",)
    _named: frozenset[str]

    def __new__(cls, /, *args: object, **values: object) -> Self:
        # `__new__` sees the constructor's keywords, which the generated
        # `__init__` does not keep: the only place the names can be taken.
        self = super().__new__(cls)
        origin = values.pop(_ORIGIN, None)
        names = frozenset(values)
        if isinstance(origin, NamedFields):
            names = origin._named | {name for name in names
                                     if values[name] != getattr(origin, name, None)}
        object.__setattr__(self, "_named", names)
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        # The dataclass's own pickling knows only its fields; rebuild from
        # them, then restore the names.
        values = {f.name: getattr(self, f.name)
                  for f in fields(cast("DataclassInstance", self))}
        return (_restore, (type(self), values, self._named))


def named_fields(instance: NamedFields) -> frozenset[str]:
    """The fields ``instance`` was given (see the module docstring)."""
    return instance._named


def given_values(instance: NamedFields) -> dict[str, object]:
    """The fields ``instance`` was given, with their values: all that an override
    built from it changes (every other field keeps the published value)."""
    return {name: getattr(instance, name) for name in instance._named}


def given(override: object, cls: type[NamedFields], *, field: str,
          check: Callable[[Mapping[str, object]], object]) -> dict[str, object]:
    """The values an override of ``cls`` names, and only those: the fields given to
    ``cls(...)`` (`given_values`), or the keys of a mapping (checked by ``check``).

    Raises:
        ConfigError: neither an instance nor a mapping (field ``field``), or a
            mapping ``check`` refuses (its field prefixed ``field.``).
    """
    if isinstance(override, cls):
        return given_values(override)
    if not isinstance(override, Mapping):
        raise ConfigError(field, f"must be {cls.__name__} or a mapping, got "
                                 f"{type(override).__name__}")
    try:
        check(override)
    except ConfigError as error:
        raise error.with_prefix(field) from None
    return dict(override)


def replaced_from() -> Any:
    """The default of a `NamedFields` dataclass's ``_origin`` init-only field.

    It is a descriptor (a documented use of dataclass field defaults): read on
    the class it gives None, the default; read on an instance, as
    `dataclasses.replace` reads every init field it was not given, it gives
    the instance itself, so the copy knows what it was copied from.
    """
    return _Origin()


class _Origin:
    def __get__(self, instance: object, owner: type | None = None) -> object:
        return instance


def _restore(cls: type[NamedFields], values: dict[str, Any], named: frozenset[str]) -> Any:
    instance = cls(**values)
    object.__setattr__(instance, "_named", named)
    return instance
