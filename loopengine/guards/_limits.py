"""`Limits`: the published bounds of one operation's conversations."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import InitVar, dataclass, fields, replace

from loopengine import _validate
from loopengine._named import NamedFields, given, replaced_from

__all__ = ["Limits"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits(NamedFields):
    """The bounds a conversation is checked against, at fixed checkpoints.

    Every value is validated when the object is built; a bad value raises
    `ConfigError` naming the field. ``None`` means unlimited where a field
    allows it. See docs/guards.md for when each is checked.

    Given as a run's override, a `Limits` narrows only the fields it was
    built with: ``Limits(credit_hold=500)`` narrows the credit hold and keeps
    every other published limit (see `narrow`).
    """

    max_turns: int = 10
    """Turn requests (model requests, retries excluded) a conversation may send (R01). >= 1."""
    max_tool_batch: int | None = 8
    """Tool calls one turn may ask for; a larger batch ends the run before any runs (R02)."""
    max_tool_calls: int | None = 32
    """Tool budget: answered calls plus rejected answers over the whole run (R02, R08, R10)."""
    total_time: float | None = 120.0
    """Seconds from the run's start to its absolute deadline (R04)."""
    attempt_timeout: float = 60.0
    """Seconds one provider request may take; capped by the time that remains (R04)."""
    credit_hold: int | None = None
    """Credits the accumulated rounded turn charges may reach; more ends the run (R03)."""
    wrap_up: bool = False
    """Send the last turn that ``max_turns`` permits (or a turn once the tool budget
    is spent) with tools disabled and `Operation.wrap_up_text`, so the model
    answers from what it gathered (docs/guards.md). An override can turn it off,
    never on against a published off (a narrowing, R13)."""
    pause_timeout: float | None = None
    """Seconds a paused run may wait for its resume (None: no limit); past it a
    resume is refused and the invocation ends ``time_limit``
    (docs/pause-and-resume.md)."""
    _origin: InitVar[Limits | None] = replaced_from()
    """Internal: the instance `dataclasses.replace` copies (see loopengine._named)."""

    def __post_init__(self, _origin: Limits | None) -> None:
        _validate.integer("max_turns", self.max_turns, minimum=1)
        _validate.integer("max_tool_batch", self.max_tool_batch, minimum=1, optional=True)
        _validate.integer("max_tool_calls", self.max_tool_calls, minimum=0, optional=True)
        _validate.seconds("total_time", self.total_time, optional=True)
        _validate.seconds("attempt_timeout", self.attempt_timeout)
        _validate.integer("credit_hold", self.credit_hold, minimum=0, optional=True)
        _validate.boolean("wrap_up", self.wrap_up)
        _validate.seconds("pause_timeout", self.pause_timeout, optional=True)
        # Store seconds as floats so that equal limits compare and print alike.
        if self.total_time is not None:
            object.__setattr__(self, "total_time", float(self.total_time))
        object.__setattr__(self, "attempt_timeout", float(self.attempt_timeout))
        if self.pause_timeout is not None:
            object.__setattr__(self, "pause_timeout", float(self.pause_timeout))

    @classmethod
    def from_mapping(cls, values: Mapping[str, object]) -> Limits:
        """Build `Limits` from a mapping (a TOML table, say); unknown keys are errors."""
        _validate.known_keys("limits", values, (f.name for f in fields(cls)), "a limit")
        return cls(**values)  # type: ignore[arg-type]

    def narrow(self, override: Limits | Mapping[str, object] | None) -> Limits:
        """Return these limits narrowed by ``override``; a wider value is clamped.

        A published limit is a ceiling: a caller may ask for less, never more
        (R13). An override narrows only the fields it names: the keys of a
        mapping, or the fields passed to the `Limits(...)` (a field left to
        its class default is not named, so the published value stands; see
        loopengine._named for `dataclasses.replace`). ``None`` in an override
        means "no narrowing" for that field.

        Raises:
            ConfigError: an override value is invalid or names no limit
                (the field is prefixed ``limits.``).
        """
        if override is None:
            return self
        named = given(override, Limits, field="limits", check=lambda values: Limits.from_mapping(
            {key: value for key, value in values.items() if value is not None}))
        changes: dict[str, object] = {}
        for name, value in named.items():
            if value is None:
                continue
            current = getattr(self, name)
            # For ``wrap_up`` the smaller of two bools is their "and": an
            # override turns it off, never on.
            changes[name] = value if current is None else min(current, value)
        return replace(self, **changes)  # type: ignore[arg-type]
