"""Runs released by one commit are woken a batch per pass of their event loop."""

from __future__ import annotations

import asyncio
import threading

from loopengine.persistence._waiting import WAKE_BATCH, Waiter, wake_all


def done(waiters: list[Waiter]) -> int:
    return sum(1 for w in waiters if w.future is not None and w.future.done())


async def test_a_commit_wakes_its_waiters_a_batch_per_pass_of_the_loop() -> None:
    waiters = [Waiter() for _ in range(WAKE_BATCH * 2 + 3)]
    wake_all(waiters)
    assert done(waiters) == WAKE_BATCH
    await asyncio.sleep(0)
    assert done(waiters) == WAKE_BATCH * 2
    await asyncio.sleep(0)
    assert done(waiters) == len(waiters)


async def test_waiters_released_from_another_thread_are_all_woken_in_order() -> None:
    waiters = [Waiter() for _ in range(WAKE_BATCH * 5)]
    order: list[int] = []

    async def wait(n: int) -> None:
        await waiters[n].wait()
        order.append(n)

    tasks = [asyncio.create_task(wait(n)) for n in range(len(waiters))]
    await asyncio.sleep(0)
    # A cancelled call's waiter is skipped, not lost in its batch.
    tasks[3].cancel()
    releaser = threading.Thread(target=wake_all, args=(waiters,))
    releaser.start()
    await asyncio.gather(*tasks, return_exceptions=True)
    releaser.join()
    assert order == [n for n in range(len(waiters)) if n != 3]
