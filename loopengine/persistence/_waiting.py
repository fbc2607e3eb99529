"""Calls waiting for their ledger writes to be committed, woken in their own loops.

Shared by `SQLiteLedger` and `PostgresLedger` (`_threaded`): a call that must
wait for a durable write parks a `Waiter` in a heap keyed by the write's
number; the writer thread calls `release` once writes up to a number are
committed (or all of them when it breaks), and each waiter is completed in
its own event loop (asyncio's, or trio's through its token) without the
writer waiting for that loop.
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel

__all__ = ["Waiter", "release", "wake_all"]


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # not asyncio (anyio's trio backend)
        return None


@dataclass(slots=True)
class Waiter:
    """One call waiting for its write, made in the caller's event loop and
    completed in it."""

    loop: asyncio.AbstractEventLoop | None = field(default_factory=_running_loop)
    future: asyncio.Future[None] | None = None
    event: anyio.Event | None = None
    token: Any = None
    gone: bool = False
    """The call stopped waiting (completed or cancelled)."""
    refused: str | None = None
    """Why its write was refused (set before it is woken), or None: committed."""

    def __post_init__(self) -> None:
        if self.loop is not None:
            self.future = self.loop.create_future()
        else:
            # Not asyncio (anyio's trio backend): an event set through the loop's token.
            self.event = anyio.Event()
            self.token = anyio.lowlevel.current_token()

    async def wait(self) -> None:
        if self.future is not None:
            await self.future
        else:
            assert self.event is not None
            await self.event.wait()


WAKE_BATCH = 16
"""Waiters woken per pass of an asyncio loop. One commit can release hundreds
of runs at once; each then builds its next request or reads its reply, a few
milliseconds of work. Woken all at once, they would all run in one pass of the
loop, and every other task (a health check, a stream's next chunk) would wait
for all of them; woken a batch per pass, the loop gets to its other work
between batches, and the runs go on in the order they were committed."""


def _wake(waiters: list[Waiter], start: int = 0) -> None:
    end = len(waiters)
    first = waiters[start] if start < end else None
    if first is not None and first.loop is not None and end - start > WAKE_BATCH:
        end = start + WAKE_BATCH
        # The rest once the runs woken now have had their pass.
        first.loop.call_soon(_wake, waiters, end)
    for waiter in waiters[start:end]:
        if waiter.future is not None:
            if not waiter.future.done():  # done: its call was cancelled
                waiter.future.set_result(None)
        elif waiter.event is not None:
            waiter.event.set()


def wake_all(waiters: list[Waiter]) -> None:
    """Complete each waiter in its own event loop, without waiting for that loop."""
    running = _running_loop()
    groups: dict[int, list[Waiter]] = {}
    for waiter in waiters:
        key = id(waiter.loop) if waiter.loop is not None else id(waiter.token.native_token)
        groups.setdefault(key, []).append(waiter)
    for group in groups.values():
        first = group[0]
        try:
            if first.loop is not None:
                if first.loop is running:
                    _wake(group)
                else:
                    first.loop.call_soon_threadsafe(_wake, group)
            else:
                first.token.backend_class.run_sync_soon(_wake, (group,), first.token.native_token)
        except Exception:  # the loop has finished: nobody is waiting any more
            pass


def release(waiters: list[tuple[int, Waiter]], done: int | None,
            refused: Mapping[int, str] | None = None) -> None:
    """Pop and wake the waiters of writes numbered up to ``done`` (every one when
    None), each told why its write was refused if ``refused`` names its number;
    a waiter whose call stopped waiting is dropped, and the refusal with it
    (nobody is left to raise it). Called holding the store's lock."""
    ready: list[Waiter] = []
    while waiters and (done is None or waiters[0][0] <= done):
        number, waiter = heapq.heappop(waiters)
        if not waiter.gone:
            if refused:
                waiter.refused = refused.get(number)
            ready.append(waiter)
    if ready:
        wake_all(ready)

