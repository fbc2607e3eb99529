"""What the caller's code raised (a tool handler, a judge, an observer, a hook,
the ``on_text`` callback, a tool's approval check) or a provider's ``send``:
its own failure, which the run reports and goes on from (or ends on), or what
stops the run.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

import anyio

__all__ = ["WithheldError", "own_failure", "stray_cancellation", "withheld"]


def own_failure(error: BaseException) -> bool:
    """Whether ``error``, raised by the caller's code, is that code's failure.

    An `Exception` is; so is a `GeneratorExit` (it stops no generator of the
    engine's), and a stray cancellation (`stray_cancellation`). The run's own
    cancellation, a KeyboardInterrupt (``cancelled``), a SystemExit
    (``failed``) and any other `BaseException` (untouched, as the process's
    death) stop the run instead. Call it on the running event loop.
    """
    return isinstance(error, Exception | GeneratorExit) or stray_cancellation(error)


def stray_cancellation(error: BaseException) -> bool:
    """Whether ``error`` is an asyncio `CancelledError` that no cancellation of
    the running task raised: the code awaited a future something else
    cancelled (on trio, where it cancels nothing, always). Call it on the
    running event loop."""
    if not isinstance(error, asyncio.CancelledError):
        return False
    if not isinstance(error, anyio.get_cancelled_exc_class()):
        return True
    task = asyncio.current_task()
    return task is not None and task.cancelling() == 0


class WithheldError(Exception):
    """Stands in, in a log record, for an exception raised by the caller's code (a
    tool handler, a judge): same traceback, same chain, but only the type's name.

    The message of such an exception may hold conversation content (a handler's
    message is even sent to the model, R09), and logs never carry content.
    """


def withheld(error: BaseException) -> tuple[type[BaseException], BaseException,
                                             TracebackType | None]:
    """``exc_info`` for ``error`` with its message, and its chain's, withheld."""
    return WithheldError, _withhold(error, set()), error.__traceback__


def _withhold(error: BaseException, seen: set[int]) -> BaseException:
    seen.add(id(error))
    kind = type(error)
    stand_in = WithheldError(f"{kind.__module__}.{kind.__qualname__} (message withheld)")
    stand_in.__traceback__ = error.__traceback__
    if error.__cause__ is not None and id(error.__cause__) not in seen:
        stand_in.__cause__ = _withhold(error.__cause__, seen)
    if error.__context__ is not None and id(error.__context__) not in seen:
        stand_in.__context__ = _withhold(error.__context__, seen)
    # Last: setting __cause__ sets it too.
    stand_in.__suppress_context__ = error.__suppress_context__
    return stand_in
