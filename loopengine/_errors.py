"""The one exception tree of loopengine.

Every exception the library raises on purpose derives from `LoopEngineError`:

* LoopEngineError
  * ConfigError (also a `ValueError`): a bad value in configuration or input,
    raised before anything is sent; `.field` names the offending key.
  * LedgerError: the attempt ledger could not be opened, migrated or written.
  * ProviderFault: one failed provider request, classified by `FaultKind`.
    Provider adapters raise it; the engine's retry loop consumes it.
  * OutcomeError: a run or call ended without an accepted answer and the
    caller asked for an exception (`RunResult.raise_for_outcome()`,
    `Engine.call`). Carries `.outcome` and `.attempts`.
    * ProviderError: the ending was a provider fault (`provider_error`,
      `credit_exhausted`); carries the `ProviderFault` as `.fault`. Defined
      beside `ProviderFault` (`providers._faults`), so that this module
      imports nothing of the library's.
  * ReplayMismatchError: a replayed request differs from the recording.

The caller's own cancellation is never turned into any of these: it
propagates as the async backend's cancellation exception.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ConfigError",
    "LedgerError",
    "LoopEngineError",
    "OutcomeError",
    "ReplayMismatchError",
]


class LoopEngineError(Exception):
    """The root of every exception loopengine raises on purpose.

    Attributes:
        attempts: When a run or call raised it: how many provider requests
            that run or call had made (None otherwise).
    """

    attempts: int | None = None


class ConfigError(LoopEngineError, ValueError):
    """A configuration value or an input is invalid.

    Raised when a configuration object is built, an operation is loaded, or a
    run starts, always before any request is sent.

    Attributes:
        field: The dotted name of the offending key, e.g. ``"max_turns"`` or
            ``"retry.max_attempts"``.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.field, self.message))

    def with_prefix(self, prefix: str) -> ConfigError:
        """Return the same error with its field name prefixed (``prefix.field``)."""
        return ConfigError(f"{prefix}.{self.field}", self.message)


class LedgerError(LoopEngineError):
    """The attempt ledger could not be opened, migrated or written."""


class OutcomeError(LoopEngineError):
    """A run or call ended with an outcome other than ``completed``.

    Attributes:
        outcome: The `Outcome` the run or call ended with.
        attempts: How many provider requests it made.
        result: The `RunResult` when the error comes from a run, else None.
    """

    def __init__(
        self, message: str, *, outcome: str, attempts: int, result: Any = None
    ) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.attempts = attempts
        self.result = result

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.args, self.__dict__))


class ReplayMismatchError(LoopEngineError):
    """A request sent to a `ReplayProvider` differs from the recorded one."""


def _rebuild(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error
