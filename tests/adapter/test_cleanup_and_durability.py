"""A run's end is recorded however it ends, within its deadline, and nothing the
provider served is lost: cancellation at any point, a stalled ledger writer, a
process killed while tools run, a callback that raises. Each through
AnthropicProvider, the real SDK and the loopback server, with a real ledger."""

from __future__ import annotations

import asyncio
import logging
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path

import anyio
import pytest
import trio
import trio.testing

import loopengine as le
from loopengine import events
from loopengine._clock import SystemClock
from loopengine._invocation import LEDGER_GRACE
from loopengine.persistence import SQLiteLedger
from loopengine.providers import ScriptedProvider
from loopengine.testing import FakeAnthropicServer, Reply

from ..conftest import operation
from ..ledger_support import read_db
from .conftest import harness

CHILD = Path(__file__).with_name("killed_by_its_tool.py")


# -- cancellation -----------------------------------------------------------------


async def test_a_cancel_while_the_run_starts_is_recorded_cancelled(
    fake_anthropic_server: FakeAnthropicServer, tmp_path: Path
) -> None:
    """An async observer is awaiting RunStarted when the caller cancels: the
    invocation is recorded ``cancelled`` (not left ``running``), RunEnded is
    announced once, the cancellation propagates and nothing was sent."""
    seen: list[events.Event] = []
    entered = anyio.Event()

    async def slow_start(event: events.Event) -> None:
        seen.append(event)
        if isinstance(event, events.RunStarted):
            entered.set()
            await anyio.sleep(30)

    path = tmp_path / "ledger.db"
    async with harness(fake_anthropic_server, SystemClock()) as wire:
        with SQLiteLedger(path) as ledger:
            engine, _ = wire.engine(Reply.text("never"), ledger=ledger,
                                    observers=[slow_start])
            finished: list[le.RunResult] = []
            async with anyio.create_task_group() as group:
                async def run() -> None:
                    finished.append(await engine.run(operation(), "go"))

                group.start_soon(run)
                await entered.wait()
                group.cancel_scope.cancel()
    assert finished == []
    invocations, attempts = read_db(path)
    assert [r["outcome"] for r in invocations.values()] == ["cancelled"]
    assert attempts == {}
    assert wire.requests == []
    ended = [e for e in seen if isinstance(e, events.RunEnded)]
    assert [e.outcome for e in ended] == ["cancelled"]


class SlowCleanup:
    """One run's observer: it marks the run's first attempt on the wire and
    makes its cleanup slow (it awaits when the attempt is settled ``external``)."""

    def __init__(self) -> None:
        self.seen: list[events.Event] = []
        self.on_the_wire = anyio.Event()
        self.in_cleanup = anyio.Event()

    async def __call__(self, event: events.Event) -> None:
        self.seen.append(event)
        if isinstance(event, events.AttemptStarted):
            self.on_the_wire.set()
        if isinstance(event, events.AttemptSettled) and event.aborted_reason == "external":
            self.in_cleanup.set()
            await anyio.sleep(0.05)


@pytest.mark.parametrize("how", ["anyio", "native"])
async def test_a_second_cancellation_never_interrupts_the_cleanup(
    fake_anthropic_server: FakeAnthropicServer, tmp_path: Path, how: str
) -> None:
    """Fifty runs, each cancelled while its request is on the wire and again
    while its cleanup runs (anyio cancel scopes, or native asyncio
    ``Task.cancel()`` twice): every invocation is recorded ``cancelled`` with its
    attempt ``aborted``/``external``, and every run announced RunEnded once."""
    runs = 50
    path = tmp_path / "ledger.db"
    observers: list[SlowCleanup] = []
    # The server never answers (its wait ends when it closes): every run is cancelled
    # on the wire, however slow the machine.
    fake_anthropic_server.add(*[Reply.text("slow", delay=3600) for _ in range(runs)])
    cancelled = 0
    async with harness(fake_anthropic_server, SystemClock()) as wire:
        provider = wire.provider()
        with SQLiteLedger(path) as ledger:

            async def one() -> None:
                nonlocal cancelled
                watch = SlowCleanup()
                observers.append(watch)
                engine = le.Engine(provider, ledger=ledger, observers=[watch],
                                   prices=le.PriceBook())
                if how == "native":
                    task = asyncio.ensure_future(engine.run(operation(), "go"))
                    await watch.on_the_wire.wait()
                    task.cancel()
                    await watch.in_cleanup.wait()
                    task.cancel()
                    try:
                        await task
                    except asyncio.CancelledError:
                        cancelled += 1
                    return
                with anyio.CancelScope() as outer:
                    with anyio.CancelScope() as inner:
                        async with anyio.create_task_group() as group:
                            group.start_soon(engine.run, operation(), "go")
                            await watch.on_the_wire.wait()
                            inner.cancel()
                            with anyio.CancelScope(shield=True):
                                await watch.in_cleanup.wait()
                            outer.cancel()
                if inner.cancelled_caught or outer.cancelled_caught:
                    cancelled += 1

            # One at a time, so that each run's cancellations land where intended.
            for _ in range(runs):
                await one()
    assert cancelled == runs
    invocations, attempts = read_db(path)
    assert len(invocations) == runs
    assert Counter(r["outcome"] for r in invocations.values()) == {"cancelled": runs}
    assert len(attempts) == runs
    assert all((a["outcome"], a["aborted_reason"]) == ("aborted", "external")
               for a in attempts.values())
    for watch in observers:
        ended = [e for e in watch.seen if isinstance(e, events.RunEnded)]
        assert [e.outcome for e in ended] == ["cancelled"]


# -- the deadline while the ledger holds the request back --------------------------


@contextmanager
def write_lock_held(path: Path) -> Iterator[None]:
    """Another connection holds the database's write lock."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
    finally:
        conn.execute("ROLLBACK")
        conn.close()


def test_r04_a_stalled_ledger_writer_ends_the_run_at_its_deadline(
    fake_anthropic_server: FakeAnthropicServer, tmp_path: Path
) -> None:
    """With another connection holding the write lock (the writer stalled), a run
    with ``total_time=1.5`` ends ``time_limit`` at its deadline, having sent
    nothing; once the writer runs again the ledger says so. On trio's MockClock:
    the stall lasts the busy timeout (30 s) or for ever, and a run that waited
    for it would hang (the lock is released only once the run returns), while
    one that keeps its deadline returns at its deadline and the grace its end
    is awaited for, exactly, on the mock time, however slow the machine."""
    path = tmp_path / "ledger.db"
    total = 1.5
    measured: list[tuple[le.RunResult, float]] = []

    async def main() -> None:
        async with harness(fake_anthropic_server, SystemClock()) as wire:
            with SQLiteLedger(path, busy_timeout=30) as ledger:
                # The writer is up and known: a run on it that needs no network
                # (a request awaited on the mock clock would be cut at once).
                warm_up = le.Engine(ScriptedProvider([Reply.text("warm")]), ledger=ledger,
                                    prices=le.PriceBook())
                assert (await warm_up.run(operation(total_time=None), "warm up")).answer == "warm"
                engine, _ = wire.engine(Reply.text("never sent"), ledger=ledger)
                with write_lock_held(path):
                    began = trio.current_time()
                    result = await engine.run(operation(total_time=total), "go")
                    measured.append((result, trio.current_time() - began))
                await ledger.flush()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    ((result, elapsed),) = measured
    assert result.outcome is le.Outcome.TIME_LIMIT
    # The deadline, then the grace its end is awaited for: not a moment of the stall.
    assert elapsed == pytest.approx(total + LEDGER_GRACE)
    assert fake_anthropic_server.requests == []
    invocations, attempts = read_db(path)
    row = invocations[result.invocation_id]
    assert row["outcome"] == "time_limit"
    (attempt,) = [a for key, a in attempts.items() if key[0] == result.invocation_id]
    # Nothing was sent: the deadline cut the attempt while its row was queued.
    assert (attempt["outcome"], attempt["aborted_reason"], attempt["http_status"]) == (
        "aborted", "deadline", None)


# -- usage served before tools run is durable -----------------------------------------


def test_a_reply_is_durable_before_its_tools_run(
    fake_anthropic_server: FakeAnthropicServer, tmp_path: Path
) -> None:
    """A child process whose tool handler SIGKILLs the process: the reply that
    asked for the tool is in the ledger, ``ok``, with its usage and response id."""
    path = tmp_path / "ledger.db"
    fake_anthropic_server.add(Reply.tool_calls(("die", {}), usage=le.Usage(123, 45)),
                              Reply.text("never"))
    child = subprocess.run([sys.executable, str(CHILD), str(path), fake_anthropic_server.url],
                           capture_output=True, text=True, timeout=60)
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert "TOOL RUNNING" in child.stdout
    # The writer process outlives its parent only to commit what it received.
    deadline = time.monotonic() + 30  # a bound for a hang, not a measure
    while True:
        invocations, attempts = read_db(path)
        if attempts or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    (attempt,) = attempts.values()
    assert attempt["outcome"] == "ok"
    assert (attempt["input_tokens"], attempt["output_tokens"]) == (123, 45)
    assert attempt["response_id"] and attempt["response_id"].startswith("msg_")
    assert attempt["stop_reason"] == "tool_use"
    (invocation,) = invocations.values()
    assert (invocation["outcome"], invocation["input_tokens"]) == ("running", 123)
    assert len(fake_anthropic_server.requests) == 1


# -- programming errors are loud ------------------------------------------------------


class CallbackBroke(Exception):
    """The caller's own bug."""


async def test_an_on_text_callback_that_raises_reaches_the_caller_and_is_no_fault(
    fake_anthropic_server: FakeAnthropicServer, tmp_path: Path
) -> None:
    """``on_text`` raises: that exception reaches the caller, no provider fault is
    recorded on the attempt the server answered, nothing is retried, and the
    invocation is recorded ``failed``."""
    path = tmp_path / "ledger.db"

    def on_text(text: str) -> None:
        raise CallbackBroke(f"cannot show {text!r}")

    async with harness(fake_anthropic_server, SystemClock()) as wire:
        with SQLiteLedger(path) as ledger:
            engine, _ = wire.engine(Reply.text("hello there"), Reply.text("not asked for"),
                                    stream=True, ledger=ledger)
            with pytest.raises(CallbackBroke, match="cannot show"):
                await engine.run(operation(), "go", on_text=on_text)
    invocations, attempts = read_db(path)
    assert [r["outcome"] for r in invocations.values()] == ["failed"]
    (attempt,) = attempts.values()
    # The caller stopped reading the stream at its first delta: no fault.
    assert attempt["fault"] is None
    assert (attempt["outcome"], attempt["aborted_reason"]) == ("aborted", "external")
    assert attempt["input_tokens"] is not None  # message_start's usage, a floor
    assert len(wire.requests) == 1


async def test_an_unpriced_model_warns_once_per_engine_and_model(
    fake_anthropic_server: FakeAnthropicServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A model no price source knows: one WARNING naming it for the engine's
    first attempt of it, none for later runs; another engine warns again."""
    unknown = le.Operation(name="test.unpriced", provider="anthropic",
                           model="claude-no-such-model-9", max_output_tokens=64)
    async with harness(fake_anthropic_server, SystemClock()) as wire:
        engine, _ = wire.engine(Reply.text("a"), Reply.text("b"),
                                prices=le.PriceBook(credits_per_usd=Decimal(1)))
        other, _ = wire.engine(Reply.text("c"), Reply.text("d"), prices=le.PriceBook())
        with caplog.at_level(logging.WARNING, logger="loopengine"):
            first = await engine.run(unknown, "go")
            second = await engine.run(unknown, "go")
            third = await other.run(unknown, "go")
            priced = await other.run(operation(), "go")
    assert first.unpriced and second.unpriced and third.unpriced
    assert not priced.unpriced
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING
                and "has no price" in r.getMessage()]
    assert len(warnings) == 2
    assert all("anthropic:claude-no-such-model-9" in r.getMessage() for r in warnings)
