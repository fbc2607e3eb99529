"""The one exception tree of loopengine.

Every exception the library raises on purpose derives from `LoopEngineError`:

* LoopEngineError
  * ConfigError
  * LedgerError
  * ProviderFault
  * OutcomeError
    * ProviderError
    * StructuredOutputError
  * ReplayMismatchError
  * RunBusyError
  * ToolInputError
  * MCPServerError
  * MCPToolError

What each means:

- `ConfigError` (also a `ValueError`): the caller's mistake. A bad value in
  configuration or input, raised before anything is sent (and, but for the
  two cases its docstring names, before anything is recorded);
  ``.field`` names the offending key or path (``"retry.max_attempts"``,
  ``"messages[2].content[0].text"``).
- `LedgerError`: the attempt ledger could not be opened, migrated or written.
- `ProviderFault`: one failed provider request, classified by its
  ``.kind`` (a `FaultKind`). Adapters raise it and the engine's retry loop
  consumes it; it reaches the caller only inside a `ProviderError`. It is
  defined beside `FaultKind` in ``loopengine.providers._faults`` (the fault
  table is one concept with its classification) and drawn here so the tree
  is whole.
- `OutcomeError`: a run or call ended without an accepted answer and the
  caller asked for an exception (`RunResult.raise_for_outcome()`,
  `Engine.call`); ``.outcome`` and ``.attempts`` say how it ended.
- `ProviderError`: the ending was a provider fault (``provider_error``,
  ``credit_exhausted``); ``.fault`` is the last attempt's `ProviderFault`.
- `StructuredOutputError`: a structured call's attempts ran out without a
  valid answer; ``.reason`` is ``invalid`` or ``truncated``.
- `ReplayMismatchError`: a replayed request differs from the recording.
- `RunBusyError`: a resume of a run (`Engine.resume`) found it held by
  another resume, or by its own process whose lease has not expired; nothing
  was sent or recorded. Retry later (or with ``force=True`` once its process
  is known to be dead).
- `ToolInputError`: a tool call's input does not match the tool's schema
  (`Tool.validate`). In a run it never reaches the caller: the model gets a
  recoverable error result instead (R15).

- `MCPServerError`: an MCP server (`loopengine.mcp`) could not be started,
  reached or listed, or a call lost it.
- `MCPToolError`: an MCP tool answered with ``isError``. In a run it never
  reaches the caller: the model gets an ``is_error`` result instead.

The caller's own cancellation is never turned into any of these: it
propagates as the async backend's cancellation exception.

Every class pickles with its fields (``__reduce__``), so an error crosses a
process boundary (a worker pool, a task queue) intact. This module imports
nothing of the library at run time, so that every other module may import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loopengine.providers._faults import ProviderFault

__all__ = [
    "ConfigError",
    "LedgerError",
    "LoopEngineError",
    "MCPServerError",
    "MCPToolError",
    "OutcomeError",
    "ProviderError",
    "ReplayMismatchError",
    "RunBusyError",
    "StructuredOutputError",
    "ToolInputError",
]


class LoopEngineError(Exception):
    """The root of every exception loopengine raises on purpose.

    Attributes:
        attempts: When a run or call raised it: how many provider requests
            that run or call had made (None otherwise).
    """

    attempts: int | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        # Subclasses take keyword-only fields that ``Exception``'s default
        # reduction (``cls(*args)``) would drop or fail on: rebuild without
        # calling ``__init__`` and restore every attribute instead.
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))


class ConfigError(LoopEngineError, ValueError):
    """A configuration value or an input is invalid (the caller's mistake).

    Raised when a configuration object is built, an operation is loaded, or a
    run starts, always before any request is sent and, but for a provider's
    client bound to another event loop or a resume past ``pause_timeout`` (both
    recorded on the invocation), before any ledger row is written.

    Args:
        field: The dotted name or path of the offending key.
        message: What is wrong with it, for people.

    Attributes:
        field: The dotted name or path of the offending key, e.g.
            ``"max_turns"``, ``"retry.max_attempts"`` or
            ``"messages[2].content[0].text"``.
        message: What is wrong with it, without the field name.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def with_prefix(self, prefix: str) -> ConfigError:
        """Return the same error with its field name prefixed (``prefix.field``)."""
        return ConfigError(f"{prefix}.{self.field}", self.message)


class LedgerError(LoopEngineError):
    """The attempt ledger could not be opened, migrated or written."""


class OutcomeError(LoopEngineError):
    """A run or call ended with an outcome other than ``completed``.

    Args:
        message: What happened, for people.
        outcome: The outcome's value.
        attempts: How many provider requests the run or call made.
        result: The `RunResult`, when a run raised it.

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


class ProviderError(OutcomeError):
    """A run or call ended because of a provider fault.

    Args:
        message: What happened, for people.
        fault: The `ProviderFault` of the last attempt.
        outcome: ``provider_error`` or ``credit_exhausted``.
        attempts: How many provider requests the run or call made.
        result: The `RunResult`, when a run raised it.

    Attributes:
        fault: The `ProviderFault` of the last attempt.
    """

    def __init__(
        self,
        message: str,
        *,
        fault: ProviderFault,
        outcome: str,
        attempts: int,
        result: Any = None,
    ) -> None:
        super().__init__(message, outcome=outcome, attempts=attempts, result=result)
        self.fault = fault


class StructuredOutputError(OutcomeError):
    """A call's attempts ran out without a valid structured answer.

    Its outcome is always ``incomplete``.

    Args:
        message: What happened, for people.
        attempts: How many provider requests the call made.
        reason: ``invalid`` or ``truncated``.
        detail: The last validation error.

    Attributes:
        reason: ``invalid`` (the last reply failed validation) or ``truncated``
            (it was cut at ``max_tokens``).
        detail: The last validation error, for people.
    """

    def __init__(self, message: str, *, attempts: int, reason: str, detail: str) -> None:
        # The literal value of ``Outcome.INCOMPLETE``: this module imports
        # nothing of the library (tests/test_errors.py checks they agree).
        super().__init__(message, outcome="incomplete", attempts=attempts)
        self.reason = reason
        self.detail = detail


class ReplayMismatchError(LoopEngineError):
    """A request sent to a `ReplayProvider` differs from the recorded one."""


class RunBusyError(LoopEngineError):
    """Another resume holds the run (or its running process's lease has not
    expired): this resume sent and recorded nothing.

    Attributes:
        invocation_id: The run.
        lease_owner: Who holds it (a process's id), when known.
    """

    def __init__(self, invocation_id: str, lease_owner: str | None = None,
                 detail: str = "") -> None:
        super().__init__(f"run {invocation_id} is held by {lease_owner or 'another resume'}"
                         + (f" ({detail})" if detail else ""))
        self.invocation_id = invocation_id
        self.lease_owner = lease_owner


class ToolInputError(LoopEngineError):
    """A tool call's input does not match the tool's schema; the message says where."""


class MCPServerError(LoopEngineError):
    """An MCP server could not be started, reached or listed, or a call lost it.

    Raised by ``async with server:`` when the server does not start or list
    its tools (the message names the server), and by a tool's handler when
    the connection fails during a call: the model then gets an ``is_error``
    result saying so, which does not name the server's command or URL.

    Args:
        message: What failed.
        result_unknown: The call was sent and its answer lost: it may have
            done its work (a run store records it ``in_doubt``).

    Attributes:
        result_unknown: As given; False when the call never reached the server.
    """

    def __init__(self, message: str, *, result_unknown: bool = False) -> None:
        super().__init__(message)
        self.result_unknown = result_unknown


class MCPToolError(LoopEngineError):
    """An MCP tool answered with ``isError``; the message is the result's text."""


def _rebuild(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error
