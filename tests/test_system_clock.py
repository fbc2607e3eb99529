"""`SystemClock.now` and the providers' running loop read the asyncio loop directly
where anyio would run on asyncio, and ask anyio everywhere else: the answers
are anyio's own, on asyncio, on trio (its MockClock) and outside any task."""

from __future__ import annotations

import asyncio

import anyio
import anyio.lowlevel
import pytest
import sniffio
import trio
import trio.testing

from loopengine._clock import SystemClock, asyncio_loop
from loopengine.providers._clients import running_loop


def test_on_asyncio_the_running_loop_and_its_clock() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        assert asyncio_loop() is loop
        assert running_loop() is loop is anyio.lowlevel.current_token().native_token
        before = anyio.current_time()
        now = SystemClock().now()
        after = anyio.current_time()
        assert before <= now <= after

    asyncio.run(main())


def test_outside_a_task_anyio_answers() -> None:
    """A loop callback is not a task: sniffio finds no library, and neither do we."""
    seen: list[object] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def callback() -> None:
            seen.append(asyncio_loop())
            with pytest.raises(anyio.NoEventLoopError):
                SystemClock().now()
            done.set_result(None)

        loop.call_soon(callback)
        await done

    asyncio.run(main())
    assert seen == [None]


def test_a_library_named_to_sniffio_is_asked_of_anyio() -> None:
    async def main() -> None:
        token = sniffio.current_async_library_cvar.set("asyncio")
        try:
            assert asyncio_loop() is None
            assert SystemClock().now() <= anyio.current_time()
        finally:
            sniffio.current_async_library_cvar.reset(token)

    asyncio.run(main())


def test_on_trio_the_mock_clock() -> None:
    async def main() -> None:
        assert asyncio_loop() is None
        start = SystemClock().now()
        assert start == trio.current_time()
        await trio.sleep(30)
        assert SystemClock().now() == start + 30
        assert running_loop() is trio.lowlevel.current_trio_token()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_without_a_loop_none() -> None:
    assert asyncio_loop() is None
