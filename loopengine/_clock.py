"""Time, injected: the engine never reads the clock or sleeps any other way.

`SystemClock` uses anyio's monotonic clock, sleep and cancel scopes (so on
trio's ``MockClock`` it is the mock time); `FakeClock` (exported from
`loopengine.testing`) advances only when someone sleeps on it, so tests of
retry waits and deadlines take no real time.
"""

from __future__ import annotations

import asyncio
import math
from datetime import UTC, datetime, timedelta
from typing import Protocol, runtime_checkable

import anyio
import anyio.lowlevel

try:
    import sniffio
except ImportError:  # anyio then assumes asyncio wherever a loop runs
    sniffio = None  # type: ignore[assignment]

__all__ = ["Clock", "FakeClock", "SystemClock", "asyncio_loop"]


def asyncio_loop() -> asyncio.AbstractEventLoop | None:
    """The running asyncio loop, when anyio would run the caller on its asyncio
    backend; None otherwise (trio, no loop), where anyio's own calls answer.

    anyio asks sniffio which library runs on every call (`anyio.current_time`,
    `anyio.lowlevel.current_token`), about 1.5 µs each, several times a turn.
    Its answer is asyncio when nothing names another library (sniffio's
    thread-local and context variable, which trio and trio-asyncio set) and
    a task of the running asyncio loop is the caller: the same test, made
    here, costs a third as much, and the loop's own clock and the loop
    itself are then what anyio returns.
    """
    if sniffio is not None and (sniffio.thread_local.name is not None
                                or sniffio.current_async_library_cvar.get() is not None):
        return None
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return None
    if sniffio is not None and asyncio.current_task(loop) is None:
        return None
    return loop


@runtime_checkable
class Clock(Protocol):
    """What the engine needs of time."""

    def now(self) -> float:
        """Monotonic seconds; only differences are meaningful."""
        ...

    def wall(self) -> datetime:
        """The current UTC time, for records and historical prices."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` (cancellable)."""
        ...

    def cancel_scope(self, seconds: float) -> anyio.CancelScope:
        """A cancel scope that expires ``seconds`` from now on this clock."""
        ...

    def deadline_scope(self, at: float) -> anyio.CancelScope:
        """A cancel scope that expires at ``at`` (a reading of `now`): a run's deadline."""
        ...

    def effective_deadline(self) -> float:
        """The earliest deadline of the cancel scopes around the caller, on this
        clock (infinite when none has one)."""
        ...


class SystemClock:
    """The real clock: `anyio.current_time` and `anyio.sleep`."""

    def now(self) -> float:
        """Return anyio's monotonic time."""
        loop = asyncio_loop()
        return loop.time() if loop is not None else anyio.current_time()

    def wall(self) -> datetime:
        """Return the current UTC time."""
        return datetime.now(UTC)

    async def sleep(self, seconds: float) -> None:
        """Sleep for real."""
        await anyio.sleep(seconds)

    def cancel_scope(self, seconds: float) -> anyio.CancelScope:
        """`anyio.move_on_after` on the real clock."""
        return anyio.move_on_after(seconds)

    def deadline_scope(self, at: float) -> anyio.CancelScope:
        """`anyio.CancelScope` with ``deadline=at``."""
        return anyio.CancelScope(deadline=at)

    def effective_deadline(self) -> float:
        """`anyio.current_effective_deadline`: the caller's own deadlines count too."""
        return anyio.current_effective_deadline()


class FakeClock:
    """A clock that moves only when slept on or advanced, for tests.

    Args:
        start: The initial monotonic reading.
        wall_start: The UTC time that ``start`` corresponds to.

    Attributes:
        sleeps: Every duration slept, in order.
    """

    def __init__(self, start: float = 0.0, *, wall_start: datetime | None = None) -> None:
        # Imported here: this module is read by code that must not load pydantic.
        from loopengine import _validate

        # A naive wall_start failed the first comparison of a run (a price's
        # start, an account's expiry) with a TypeError.
        _validate.moment("wall_start", wall_start, optional=True)
        self._now = _validate.required_seconds("start", start, positive=False)
        self._start = self._now
        self._wall_start = wall_start or datetime(2026, 1, 1, tzinfo=UTC)
        self.sleeps: list[float] = []

    def now(self) -> float:
        """Return the fake monotonic time."""
        return self._now

    def wall(self) -> datetime:
        """Return ``wall_start`` plus the fake time elapsed."""
        return self._wall_start + timedelta(seconds=self._now - self._start)

    def advance(self, seconds: float) -> None:
        """Move time forward without sleeping.

        Raises:
            ConfigError: ``seconds`` is negative or not a finite number (a
                monotonic clock never goes back).
        """
        from loopengine import _validate

        self._now += _validate.required_seconds("seconds", seconds, positive=False)

    def cancel_scope(self, seconds: float) -> anyio.CancelScope:
        """A scope that never expires by itself: fake time does not pass while
        code runs, so work under it finishes or fails on its own (scripted
        delays beyond a timeout fail in the provider)."""
        return anyio.CancelScope()

    def deadline_scope(self, at: float) -> anyio.CancelScope:
        """A scope that never expires by itself, as `cancel_scope`: on fake time the
        engine's checkpoints end a run at its deadline."""
        return anyio.CancelScope()

    def effective_deadline(self) -> float:
        """Infinite: no scope expires on fake time."""
        return math.inf

    async def sleep(self, seconds: float) -> None:
        """Record the wait, advance time at once, and yield to the event loop."""
        self.sleeps.append(seconds)
        self._now += max(0.0, seconds)
        await anyio.lowlevel.checkpoint()
