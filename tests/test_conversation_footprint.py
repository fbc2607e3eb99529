"""What a conversation waiting on its model reply holds of loopengine's own.

A process serves thousands of conversations at once, nearly all of them
waiting on the model: each one's objects are walked by every full garbage
collection, so they are counted here, deterministically (docs/performance.md).
The provider answers the first turns at once and holds the third turn's
request, so a held conversation has a transcript, an attempt log and an
attempt in flight, as in the middle of a real one.
"""

from __future__ import annotations

import asyncio
import gc
from decimal import Decimal
from types import CoroutineType
from typing import Any

import loopengine as le
from loopengine.providers import (
    Provider,
    ProviderRequest,
    ProviderResponse,
    TextCallback,
)

HELD = 50
"""Conversations held waiting at once: one-off objects are shared among them."""

HELD_TURN = 3

OBJECTS_PER_CONVERSATION = 64
"""What a waiting conversation may hold: 58 measured (loopengine's own, the
transcript of two tool turns, the task and the test provider's coroutine), and
a margin. It held 86 before the coroutines between `Engine.run` and the
provider were flattened."""

LOOPENGINE_COROUTINES = 3
"""`_Loop.run`, `Invocation.request` and `Invocation._attempt`. There were 7
before, and an async generator: the run loop's entry, its ``ending`` context
manager, its turn, and the retry loop with its ``send`` closure."""


class HoldingProvider(Provider):
    """Answers every turn before `HELD_TURN` with a tool call at once; holds the
    request of that turn until `release` is set."""

    name = "anthropic"

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.held = 0
        self.expected = 0
        self.all_held = asyncio.Event()

    async def send(self, request: ProviderRequest, *,
                   on_text: TextCallback | None = None) -> ProviderResponse:
        turn = request.metadata["turn"]
        if turn == HELD_TURN:
            self.held += 1
            if self.held >= self.expected:
                self.all_held.set()
            await self.release.wait()
            return ProviderResponse(content=[{"type": "text", "text": "done"}],
                                    stop_reason="end_turn", usage=le.Usage(10, 5))
        return ProviderResponse(
            content=[{"type": "text", "text": "Let me look."},
                     {"type": "tool_use", "id": f"toolu_{turn}", "name": "lookup",
                      "input": {"key": "abcd"[turn]}}],
            stop_reason="tool_use", usage=le.Usage(10 * turn, 5))


@le.tool
async def lookup(key: str) -> str:
    """Look a key up."""
    return str("abcd".index(key) + 1)


def _engine() -> tuple[le.Engine, HoldingProvider, le.Operation]:
    provider = HoldingProvider()
    prices = le.PriceBook([le.ModelPrice(provider="anthropic", model="claude-sonnet-4-5",
                                         input_per_mtok=Decimal(3),
                                         output_per_mtok=Decimal(15))])
    operation = le.Operation(name="footprint", provider="anthropic",
                             model="claude-sonnet-4-5", max_output_tokens=256,
                             limits=le.Limits(max_turns=6, attempt_timeout=600.0))
    return le.Engine(provider, prices=prices), provider, operation


async def _hold(engine: le.Engine, provider: HoldingProvider, operation: le.Operation,
                count: int) -> list[asyncio.Task[le.RunResult]]:
    provider.held, provider.expected = 0, count
    provider.all_held.clear()
    provider.release.clear()
    tasks = [asyncio.create_task(engine.run(operation, "What are a, b and c?", tools=[lookup]))
             for _ in range(count)]
    await provider.all_held.wait()
    return tasks


async def _finish(provider: HoldingProvider, tasks: list[asyncio.Task[le.RunResult]]) -> None:
    provider.release.set()
    for result in await asyncio.gather(*tasks):
        assert result.outcome is le.Outcome.COMPLETED and result.turns == HELD_TURN


def _tracked() -> int:
    gc.collect()
    return len(gc.get_objects())


async def test_a_waiting_conversation_holds_few_tracked_objects() -> None:
    """At most `OBJECTS_PER_CONVERSATION` objects the collector tracks per
    conversation waiting on its reply, counted over `HELD` of them."""
    engine, provider, operation = _engine()
    # A first conversation loads whatever is loaded on first use.
    await _finish(provider, await _hold(engine, provider, operation, 1))
    before = _tracked()
    tasks = await _hold(engine, provider, operation, HELD)
    per_conversation = (_tracked() - before) / HELD
    await _finish(provider, tasks)
    assert per_conversation <= OBJECTS_PER_CONVERSATION, per_conversation


async def test_a_waiting_conversation_awaits_through_few_loopengine_coroutines() -> None:
    """Between `Engine.run` and the provider's ``send``, a waiting conversation
    awaits through `LOOPENGINE_COROUTINES` coroutines of loopengine's own."""
    engine, provider, operation = _engine()
    tasks = await _hold(engine, provider, operation, 1)
    chain: list[str] = []
    awaited: Any = tasks[0].get_coro()
    while isinstance(awaited, CoroutineType):
        chain.append(awaited.cr_code.co_qualname)
        awaited = awaited.cr_await
    await _finish(provider, tasks)
    assert chain[0] == "Engine.run" and "HoldingProvider.send" in chain, chain
    inner = chain[1:chain.index("HoldingProvider.send")]
    assert len(inner) <= LOOPENGINE_COROUTINES, inner
