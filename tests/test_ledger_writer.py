"""Where `SQLiteLedger` writes from, and the dispatch that overlaps the request.

The writer is a child process by default (a thread on request): these tests
stop, kill and signal that process, fill its pipe, fork the process that owns
it, and run the engine on trio, and check that no write is lost, no call
hangs, and no request goes on the wire before its row is on disk.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import os
import signal
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import httpx2
import pytest

import loopengine as le
from loopengine.persistence import EarlyDispatchLedger, SQLiteLedger, _writer
from loopengine.persistence import _sqlite as sqlite_module
from loopengine.providers import AnthropicProvider, Reply, ScriptedProvider
from loopengine.testing import FakeAnthropicServer

from .conftest import PRICES, operation
from .ledger_support import dispatch, end, lookup, read_db, settle, start

pytestmark = [pytest.mark.skipif(os.name != "posix", reason="the writer process needs POSIX"),
              pytest.mark.realtime]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def gone_within(pid: int, seconds: float) -> bool:
    give_up = time.monotonic() + seconds
    while time.monotonic() < give_up:
        if not alive(pid):
            return True
        time.sleep(0.01)
    return False


@contextmanager
def stopped(ledger: SQLiteLedger) -> Iterator[int]:
    """The writer process frozen (SIGSTOP) for the duration of the block."""
    pid = ledger.writer_pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        yield pid
    finally:
        os.kill(pid, signal.SIGCONT)


# -- its home --------------------------------------------------------------------------------


def test_the_writer_is_a_child_process_that_ends_with_the_ledger(tmp_path: Path) -> None:
    """By default a child process writes; closing the ledger ends it; a thread is
    the writer on request, and an unknown writer is refused."""
    ledger = SQLiteLedger(tmp_path / "ledger.db")
    pid = ledger.writer_pid
    assert ledger.writer == "process" and pid is not None and pid != os.getpid()
    assert alive(pid) and isinstance(ledger, EarlyDispatchLedger)
    ledger.close()
    assert not alive(pid)
    with SQLiteLedger(tmp_path / "ledger.db", writer="thread") as threaded:
        assert threaded.writer == "thread" and threaded.writer_pid is None


def test_a_writer_process_that_cannot_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A writer process that exits before it is ready: ``writer="process"`` raises
    LedgerError; the default falls back to a thread and says so in the log."""
    broken = tmp_path / "broken_writer.py"
    broken.write_text("import sys\nsys.exit(3)\n")
    monkeypatch.setattr(sqlite_module, "_WRITER_FILE", str(broken))
    with pytest.raises(le.LedgerError, match="exited with code 3"):
        SQLiteLedger(tmp_path / "ledger.db", writer="process")
    with SQLiteLedger(tmp_path / "ledger.db") as ledger:
        assert ledger.writer == "thread"
    assert "writing from a thread instead" in caplog.text


async def test_begin_dispatch_returns_before_the_row_is_durable(tmp_path: Path) -> None:
    """begin_dispatch returns at once; its receipt's wait returns only once the row is
    on disk (here: not while the writer is frozen), and waiting again is harmless."""
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as ledger:
        await ledger.start_invocation(start())
        with stopped(ledger):
            receipt = ledger.begin_dispatch(dispatch(1))
            with anyio.move_on_after(0.3) as waited:
                await receipt.wait()
            assert waited.cancelled_caught
            assert read_db(path) == ({}, {})
        await receipt.wait()
        _, attempts = read_db(path)
        assert attempts[("inv-1", 1)]["outcome"] == "dispatched"
        await receipt.wait()


async def test_a_refused_dispatch_raises_from_its_receipt(tmp_path: Path) -> None:
    """A dispatch the writer refuses raises LedgerError from the receipt's wait, every
    time it is awaited; the ledger goes on for other invocations."""
    with SQLiteLedger(tmp_path / "ledger.db") as ledger:
        receipt = ledger.begin_dispatch(dispatch(1, "ghost"))
        for _ in range(2):
            with pytest.raises(le.LedgerError, match="no invocation ghost"):
                await receipt.wait()
        await ledger.start_invocation(start())
        await ledger.begin_dispatch(dispatch(1)).wait()


async def test_a_full_pipe_holds_writes_back_without_blocking(tmp_path: Path) -> None:
    """With the writer frozen, 2,000 writes (more than its pipe holds) are queued
    without blocking the event loop; once it runs again every one is committed."""
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as ledger:
        async with anyio.create_task_group() as settles:
            with stopped(ledger):
                began = time.monotonic()
                receipts = []
                for n in range(500):
                    await ledger.start_invocation(start(f"inv-{n}"))
                    receipts += [ledger.begin_dispatch(dispatch(o, f"inv-{n}"))
                                 for o in (1, 2, 3)]
                    # A served settle waits for its commit: each in a task of its own.
                    settles.start_soon(ledger.settle_attempt, settle(1, f"inv-{n}"))
                    await anyio.lowlevel.checkpoint()
                assert time.monotonic() - began < 5.0
                await anyio.sleep(0.05)  # the helper thread meets the full pipe too
        for receipt in receipts:
            await receipt.wait()
        await ledger.flush()
    invocations, attempts = read_db(path)
    assert len(invocations) == 500 and len(attempts) == 1500
    assert sum(a["outcome"] == "ok" for a in attempts.values()) == 500


async def test_a_killed_writer_fails_calls_instead_of_hanging(tmp_path: Path) -> None:
    """SIGKILL the writer: a call waiting for it and every later call raise
    LedgerError saying the writer process is gone; closing still works."""
    with SQLiteLedger(tmp_path / "ledger.db") as ledger:
        await ledger.start_invocation(start())
        await ledger.dispatch_attempt(dispatch(1))
        pid = ledger.writer_pid
        assert pid is not None
        with stopped(ledger):
            receipt = ledger.begin_dispatch(dispatch(2))
            os.kill(pid, signal.SIGKILL)
        with anyio.fail_after(10), pytest.raises(le.LedgerError, match="writer process"):
            await receipt.wait()
        with pytest.raises(le.LedgerError, match="writer process"):
            await ledger.dispatch_attempt(dispatch(3))
        assert ledger.closed
    assert read_db(tmp_path / "ledger.db")[1][("inv-1", 1)]["outcome"] == "dispatched"


def test_op_frames_out_of_sequence_are_a_corrupt_stream() -> None:
    """Ops are numbered one by one: a header with another id than the one due (a
    torn write) stops the reading there, keeping the good ops before it."""
    first = _writer.op_frame(7, _writer.encode_op([_writer.FLUSH, 0]))
    second = _writer.op_frame(8, _writer.encode_op([_writer.FLUSH, 0]))
    buffer = bytearray(first + second[:5])
    assert [op[1] for op in _writer.unframe_ops(buffer, 7)] == [7]
    assert buffer == second[:5]  # a partial header waits for the rest
    buffer += second[5:] + first
    with pytest.raises(_writer.StreamError, match="op 7 arrived where op 9 was due") as caught:
        _writer.unframe_ops(buffer, 8)
    assert [op[1] for op in caught.value.ops] == [8]
    assert buffer == first


@pytest.mark.parametrize("writer", ["process", "thread"])
async def test_a_torn_op_stream_fails_calls_instead_of_hanging(
    tmp_path: Path, writer: Any,
) -> None:
    """Bytes that are not the next op (what a write torn by a signal would leave)
    break the ledger: a call waiting behind them raises LedgerError instead of
    waiting forever, and what was committed before stays."""
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path, writer=writer) as ledger:
        await ledger.start_invocation(start())
        await ledger.dispatch_attempt(dispatch(1))
        with ledger._lock:
            ledger._channel.send(b"\xff" * 40)
        with anyio.fail_after(10), pytest.raises(le.LedgerError, match="corrupt"):
            await ledger.dispatch_attempt(dispatch(2))
        with pytest.raises(le.LedgerError, match="corrupt"):
            await ledger.flush()
    invocations, attempts = read_db(path)
    assert list(invocations) == ["inv-1"] and list(attempts) == [("inv-1", 1)]
    if writer == "process":
        assert ledger.writer_pid is not None and gone_within(ledger.writer_pid, 10)


async def test_the_writer_outlives_terminal_signals(tmp_path: Path) -> None:
    """SIGINT, SIGTERM and SIGHUP (sent to a whole process group by a terminal or a
    supervisor) leave the writer running, so the ledger can still commit and close."""
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path, linger=30) as ledger:
        pid = ledger.writer_pid
        assert pid is not None
        await ledger.start_invocation(start())
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            os.kill(pid, sig)
        await anyio.sleep(0.05)
        await ledger.dispatch_attempt(dispatch(1))
        await ledger.settle_attempt(settle(1))
        await ledger.end_invocation(end())
    assert read_db(path)[0]["inv-1"]["outcome"] == "completed"
    assert not alive(pid)


def test_a_forked_process_cannot_write_and_does_not_keep_the_writer(tmp_path: Path) -> None:
    """A child forked after the ledger opened gets LedgerError from it (writing or
    reading its counters), and does not
    hold the writer's input open: closing the ledger ends the writer while the
    forked child still lives."""
    read_end, write_end = os.pipe()
    ledger = SQLiteLedger(tmp_path / "ledger.db")
    writer = ledger.writer_pid
    assert writer is not None
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the forked child
        verdict = b"refused"
        for attempt in (lambda: asyncio.run(ledger.start_invocation(start())),
                        lambda: ledger.commits):
            try:
                attempt()
                verdict = b"wrote"
            except le.LedgerError as error:
                if b"forked" not in str(error).encode():
                    verdict = b"other"
        os.write(write_end, verdict)
        time.sleep(30)
        os._exit(0)
    try:
        os.close(write_end)
        assert os.read(read_end, 16) == b"refused"
        ledger.close()
        assert gone_within(writer, 10)
        assert alive(child)
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        os.close(read_end)


# -- the dispatch overlapped with the request ----------------------------------------------


async def test_the_row_is_on_disk_when_the_request_reaches_the_server(tmp_path: Path) -> None:
    """Through the SDK: when each request reaches the loopback server, its attempt
    row is already in the file as dispatched (the previous one settled)."""
    path = tmp_path / "ledger.db"
    seen: list[list[tuple[int, str]]] = []

    def witness(reply: Reply) -> Any:
        def look(request: Any) -> Reply:
            conn = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True)
            seen.append([tuple(r) for r in conn.execute(
                "SELECT ordinal, outcome FROM attempts ORDER BY ordinal")])
            conn.close()
            return reply
        return look

    with FakeAnthropicServer([witness(Reply.tool_calls(("lookup", {"key": "a"}))),
                              witness(Reply.text("done"))]) as server, \
            SQLiteLedger(path, linger=30) as ledger:
        provider = AnthropicProvider(api_key="k", base_url=server.url,
                                     http_client=httpx2.AsyncClient())
        engine = le.Engine(provider, ledger=ledger, prices=PRICES)
        result = await engine.run(operation(), "go", tools=[lookup])
        await provider.aclose()
    assert result.outcome is le.Outcome.COMPLETED
    assert seen == [[(1, "dispatched")], [(1, "ok"), (2, "dispatched")]]


async def test_a_dispatch_that_cannot_be_written_sends_nothing(tmp_path: Path) -> None:
    """Another connection holds the write lock past the busy timeout: the run raises
    LedgerError and the server receives no request at all."""
    path = tmp_path / "ledger.db"
    with FakeAnthropicServer([Reply.text("never")]) as server, \
            SQLiteLedger(path, busy_timeout=0.2) as ledger:
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        provider = AnthropicProvider(api_key="k", base_url=server.url,
                                     http_client=httpx2.AsyncClient())
        engine = le.Engine(provider, ledger=ledger, prices=PRICES)
        try:
            with pytest.raises(le.LedgerError, match="locked"):
                await engine.run(operation(), "go")
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
            await provider.aclose()
        assert server.requests == []


@pytest.mark.parametrize("writer", ["process", "thread"])
def test_runs_on_trio_share_the_ledger(tmp_path: Path, writer: Any) -> None:
    """On anyio's trio backend (no asyncio loop to watch the writer's pipe), fifty
    concurrent runs complete and every row lands."""
    path = tmp_path / "ledger.db"

    async def main() -> None:
        with SQLiteLedger(path, writer=writer) as ledger:
            async def one(n: int) -> None:
                provider = ScriptedProvider([Reply.tool_calls(("lookup", {"key": str(n)})),
                                             Reply.text("a")])
                engine = le.Engine(provider, ledger=ledger, prices=PRICES)
                result = await engine.run(operation(), "go", tools=[lookup])
                assert result.outcome is le.Outcome.COMPLETED

            async with anyio.create_task_group() as group:
                for n in range(50):
                    group.start_soon(one, n)

    anyio.run(main, backend="trio")
    invocations, attempts = read_db(path)
    assert len(invocations) == 50 and len(attempts) == 100
    assert all(r["outcome"] == "completed" for r in invocations.values())


# -- values, and closing -------------------------------------------------------------------


class Tenant(enum.StrEnum):
    ACME = "acme"


@pytest.mark.parametrize("writer", ["process", "thread"])
async def test_writes_with_odd_values_fail_alone(tmp_path: Path, writer: Any) -> None:
    """An enum member is recorded as its value; a value that cannot be recorded (a
    Decimal) and an integer past 64 bits raise LedgerError for their own call only,
    and the writes sharing their commit still land."""
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path, writer=writer) as ledger:
        await ledger.start_invocation(dataclasses.replace(start("enum"), tenant=Tenant.ACME))
        with pytest.raises(le.LedgerError, match="cannot be recorded"):
            await ledger.start_invocation(
                dataclasses.replace(start("decimal"), user_id=Decimal(1)))  # type: ignore[arg-type]
        await ledger.start_invocation(start("big"))
        await ledger.flush()
        huge = dataclasses.replace(dispatch(1, "big"), max_tokens=2**63)
        results = await asyncio.gather(ledger.dispatch_attempt(dispatch(1, "enum")),
                                       ledger.dispatch_attempt(huge), return_exceptions=True)
        assert results[0] is None
        assert isinstance(results[1], le.LedgerError) and "too large" in str(results[1])
        await ledger.dispatch_attempt(dispatch(2, "enum"))
    invocations, attempts = read_db(path)
    assert sorted(invocations) == ["big", "enum"] and invocations["enum"]["tenant"] == "acme"
    assert sorted(attempts) == [("enum", 1), ("enum", 2)]


async def test_a_second_close_waits_for_the_first(tmp_path: Path) -> None:
    """Two threads close the ledger at once (the user's close beside the exit hook's):
    neither returns before everything queued is committed."""
    path = tmp_path / "ledger.db"
    ledger = SQLiteLedger(path, linger=30)
    await ledger.start_invocation(start())
    with stopped(ledger):
        closers = [threading.Thread(target=ledger.close) for _ in range(2)]
        for closer in closers:
            closer.start()
        await anyio.sleep(0.3)
        assert all(closer.is_alive() for closer in closers)
    for closer in closers:
        await anyio.to_thread.run_sync(closer.join)
    assert read_db(path)[0]["inv-1"]["outcome"] == "running"


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
async def test_closing_while_a_call_waits_leaves_no_open_file(tmp_path: Path) -> None:
    """A ledger closed while a call still waits for its write (its event loop watching
    the writer's pipe) closes every descriptor once that call returns."""
    def descriptors() -> int:
        return len(os.listdir("/proc/self/fd"))

    async def cycle(n: int) -> None:
        ledger = SQLiteLedger(tmp_path / "ledger.db")
        await ledger.start_invocation(start(f"inv-{n}"))
        with stopped(ledger):
            receipt = ledger.begin_dispatch(dispatch(1, f"inv-{n}"))
            waiting = asyncio.ensure_future(receipt.wait())
            await asyncio.sleep(0.01)  # it watches the pipe now
        ledger.close()
        await waiting

    await cycle(0)
    before = descriptors()
    for n in range(1, 6):
        await cycle(n)
    assert descriptors() == before
