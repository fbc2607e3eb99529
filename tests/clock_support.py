"""A fake clock for tests whose timeouts must pass inside code the test does not
drive (a tool's timeout, a run's deadline while its handlers run, an MCP
server's waits): they pass when the test moves the clock, never on real time."""

from __future__ import annotations

import anyio
import anyio.lowlevel

from loopengine.testing import FakeClock


class ExpiringClock(FakeClock):
    """A `FakeClock` whose cancel scopes expire once its time reaches their
    deadline, moved by the test (`advance`) or by a sleep on it: a timeout on
    this clock passes only when the test says so. A run's deadline scope
    (`deadline_scope`) expires the same way, so a run on this clock ends at its
    deadline even while a handler it awaits never returns."""

    def __init__(self) -> None:
        super().__init__()
        self._scopes: list[tuple[float, anyio.CancelScope]] = []
        self.asked: list[float] = []
        """The seconds of every cancel scope asked for, in order."""
        self._asked = anyio.Event()

    def cancel_scope(self, seconds: float) -> anyio.CancelScope:
        scope = anyio.CancelScope()
        self._scopes.append((self.now() + seconds, scope))
        self.asked.append(seconds)
        self._asked.set()
        return scope

    def deadline_scope(self, at: float) -> anyio.CancelScope:
        scope = anyio.CancelScope()
        self._scopes.append((at, scope))
        self._expire()
        return scope

    async def asked_for(self, count: int) -> None:
        """Wait until ``count`` cancel scopes have been asked for in all."""
        while len(self.asked) < count:
            self._asked = anyio.Event()
            await self._asked.wait()

    def advance(self, seconds: float) -> None:
        super().advance(seconds)
        self._expire()

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        super().advance(max(0.0, seconds))
        self._expire()
        await anyio.lowlevel.checkpoint()

    def _expire(self) -> None:
        for at, scope in self._scopes:
            if at <= self.now():
                scope.cancel()
        self._scopes = [(at, scope) for at, scope in self._scopes if at > self.now()]
