"""`Engine.stream`: a run's events, text deltas included, as an async iterator.

The run goes on in a task of its own; every event its observers get, and a
`TextDelta` for each piece of streamed text (never given to observers), is
put on an unbounded in-memory stream that the caller iterates. The iteration
ends when the run ends; ``run.result`` is then its `RunResult`. Leaving the
``async with`` before the end (a ``break``, an exception) cancels the run,
which is recorded ``cancelled`` as any cancelled run is.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Self

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from loopengine._errors import LoopEngineError
from loopengine._invocation import Invocation
from loopengine._raised import stray_cancellation
from loopengine._result import RunResult
from loopengine._run import RunSpec, run_loop
from loopengine.events import Event, Observer, TextDelta

__all__ = ["RunStream", "stream_run"]

Prepare = Callable[[Sequence[Observer], Callable[[TextDelta], None]], tuple[Invocation, RunSpec]]


class RunStream:
    """The events of one run, in order, from `loopengine.Engine.stream`.

    ``async for event in run`` yields `loopengine.events` events (`TextDelta`
    among them) until the run ends; an error that ended the run without an
    outcome (a `LedgerError`, say) is raised from the iteration once its
    events are consumed.
    """

    def __init__(self, receive: MemoryObjectReceiveStream[Event], run_id: str) -> None:
        self._receive = receive
        self.run_id = run_id
        """The run's invocation id (as in the ledger and every event)."""
        self._result: RunResult | None = None
        self._error: BaseException | None = None
        self._raised = False
        self._left = False
        """The caller left the stream before the run ended, which cancelled it."""

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Event:
        try:
            return await self._receive.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            if self._error is not None and not self._raised:
                self._raised = True
                raise self._error from None
            raise StopAsyncIteration from None

    @property
    def result(self) -> RunResult:
        """The run's `RunResult`, once its events are consumed.

        Raises:
            LoopEngineError: the run has not ended yet, or it was cancelled by
                leaving its stream before the end (no result was made; the
                ledger records it ``cancelled``).
            Exception: the error that ended the run without an outcome.
        """
        if self._error is not None:
            raise self._error
        if self._result is None:
            if self._left:
                raise LoopEngineError(
                    "the run was cancelled: its stream was left before the run ended, so it "
                    "has no result (the ledger records it cancelled, with its attempts)")
            raise LoopEngineError("the run has not ended: iterate its events to the end first")
        return self._result


@contextlib.asynccontextmanager
async def stream_run(prepare: Prepare) -> AsyncIterator[RunStream]:
    """Run the invocation ``prepare`` builds, streaming its events (internal)."""
    send, receive = anyio.create_memory_object_stream[Event](math.inf)

    def deliver(event: Event) -> None:
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
            send.send_nowait(event)

    try:
        inv, spec = prepare((deliver,), deliver)
    except BaseException:
        send.close()
        receive.close()
        raise
    handle = RunStream(receive, inv.id)

    async def run() -> None:
        with send:
            try:
                handle._result = await run_loop(inv, spec)
            # The run recorded its end already (`stop_outcome`); this decides only
            # where what ended it is raised: the task group's cancellation from
            # this task, anything else from the caller's iteration.
            except anyio.get_cancelled_exc_class() as error:
                if not stray_cancellation(error):
                    raise
                handle._error = error  # the on_text callback's, ending the run failed
            except (Exception, KeyboardInterrupt, SystemExit, asyncio.CancelledError) as error:
                # Raised from the caller's iteration, not this task: on asyncio
                # a KeyboardInterrupt or SystemExit leaving a task ends the
                # event loop at once.
                handle._error = error

    raised: list[BaseException] = []
    with receive:
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(run)
                try:
                    yield handle
                except BaseException as error:
                    raised.append(error)
                    raise
                finally:
                    # Left before the end: the run is cancelled (and recorded so).
                    handle._left = True
                    group.cancel_scope.cancel()
        except BaseExceptionGroup as grouped:
            if not raised or list(grouped.exceptions) != raised:
                raise
            # The run's task keeps its own errors (``handle._error``), so the group
            # holds only what the caller's block raised: it propagates as it was
            # raised, not wrapped (a task group wraps even its host's exception).
            own = raised[0]
            context, suppress = own.__context__, own.__suppress_context__
            try:
                raise own
            finally:
                own.__context__, own.__suppress_context__ = context, suppress
