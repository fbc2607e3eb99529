"""What the caller's code raised (a tool handler, a judge, an observer, a hook,
the ``on_text`` callback, a tool's approval check) or a provider's ``send``:
its own failure, which the run reports and goes on from (or ends on), or what
stops the run.
"""

from __future__ import annotations

import asyncio

import anyio

__all__ = ["own_failure", "stray_cancellation"]


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
