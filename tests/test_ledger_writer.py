"""Where `SQLiteLedger` writes from: one writer thread per ledger.

These tests hold the file's write lock from another connection (the writer
then waits in ``BEGIN IMMEDIATE``), fail the writer, fork the process that
owns it, close it from two threads and run the engine on trio, and check that
no write is lost, no call hangs, writes queued meanwhile share a commit, and
no request goes on the wire before its row is on disk.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest

import loopengine as le
from loopengine.persistence import SQLiteLedger, _planner
from loopengine.providers import AnthropicProvider, Reply, ScriptedProvider
from loopengine.testing import FakeAnthropicServer

from .conftest import PRICES, operation
from .ledger_support import dispatch, end, lookup, read_db, start


def writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("loopengine-writer")]


@contextmanager
def write_lock_held(path: Path) -> Iterator[None]:
    """Another connection holds the file's write lock for the duration of the block:
    the ledger's writer waits for it in ``BEGIN IMMEDIATE`` (its busy timeout)."""
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    try:
        yield
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()


class WarningSeen(logging.Handler):
    """A log handler that says when a record containing ``text`` was logged (from
    any thread: the ledger's writer logs from its own)."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.WARNING)
        self.text = text
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.seen.set()


# -- its home --------------------------------------------------------------------------------


def test_the_writer_is_a_thread_that_ends_with_the_ledger(tmp_path: Path) -> None:
    """A ledger writes from one thread of this process; closing it ends the thread,
    and a second close is harmless."""
    before = writer_threads()
    ledger = SQLiteLedger(tmp_path / "ledger.db")
    (thread,) = [t for t in writer_threads() if t not in before]
    assert thread.daemon and str(tmp_path) in thread.name
    ledger.close()
    assert not thread.is_alive() and ledger.closed
    ledger.close()


async def test_a_refused_dispatch_raises_and_the_ledger_goes_on(tmp_path: Path) -> None:
    """A dispatch the writer refuses raises LedgerError from its call; the ledger
    goes on for other invocations."""
    with SQLiteLedger(tmp_path / "ledger.db") as ledger:
        with pytest.raises(le.LedgerError, match="no invocation ghost"):
            await ledger.dispatch_attempt(dispatch(1, "ghost"))
        await ledger.start_invocation(start())
        await ledger.dispatch_attempt(dispatch(1))
    assert list(read_db(tmp_path / "ledger.db")[1]) == [("inv-1", 1)]


async def test_writes_queued_during_a_commit_share_the_next_one(tmp_path: Path) -> None:
    """While the writer waits for the write lock, 200 dispatches queue without
    blocking the event loop; once it has the lock, they take at most two
    commits (group commit) and every one lands."""
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as ledger:
        for n in range(200):
            await ledger.start_invocation(start(f"inv-{n}"))
        commits = ledger.commits
        async with anyio.create_task_group() as group:
            with write_lock_held(path):
                for n in range(200):
                    group.start_soon(ledger.dispatch_attempt, dispatch(1, f"inv-{n}"))
                await anyio.wait_all_tasks_blocked()  # every one queued, none committed
                assert read_db(path) == ({}, {})
        assert ledger.commits - commits <= 2
    invocations, attempts = read_db(path)
    assert len(invocations) == 200 and len(attempts) == 200


async def test_a_writer_that_fails_once_is_restarted_and_its_batch_replayed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug in the writer (an unexpected exception): the thread replaces it by a new
    one on the same file and replays the batch, so the call waiting for it returns
    as if nothing happened; the row is written once and the ledger stays open."""
    with SQLiteLedger(tmp_path / "ledger.db") as ledger:
        await ledger.start_invocation(start())
        await ledger.dispatch_attempt(dispatch(1))
        writer = ledger._writer
        assert writer is not None
        commits = ledger.commits

        def broken(ops: Any) -> Any:
            raise RuntimeError("a bug")

        monkeypatch.setattr(writer.planner, "commit", broken)
        with anyio.fail_after(10):
            await ledger.dispatch_attempt(dispatch(2))
        assert ledger._writer is not writer and not ledger.closed
        assert ledger.commits == commits + 1  # the counts survive the restart
        await ledger.dispatch_attempt(dispatch(3))
    assert list(read_db(tmp_path / "ledger.db")[1]) == [("inv-1", 1), ("inv-1", 2), ("inv-1", 3)]


async def test_a_writer_that_keeps_failing_refuses_the_batch_and_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug that the restarted writer hits again: the waiting call raises LedgerError
    saying the writer failed (never waits forever), and once the bug is gone the
    ledger writes again; what was committed before stays."""
    with SQLiteLedger(tmp_path / "ledger.db") as ledger:
        await ledger.start_invocation(start())
        await ledger.dispatch_attempt(dispatch(1))

        def broken(self: Any, ops: Any) -> Any:
            raise RuntimeError("a bug")

        with monkeypatch.context() as patched:
            patched.setattr(_planner.Planner, "commit", broken)
            with anyio.fail_after(10), pytest.raises(le.LedgerError, match="writer failed"):
                await ledger.dispatch_attempt(dispatch(2))
        assert not ledger.closed
        await ledger.dispatch_attempt(dispatch(3))
    assert list(read_db(tmp_path / "ledger.db")[1]) == [("inv-1", 1), ("inv-1", 3)]


def test_a_forked_process_cannot_use_the_ledger(tmp_path: Path) -> None:
    """A child forked after the ledger opened gets LedgerError from it (writing or
    reading its counters) and leaves the parent's writer alone: the parent goes
    on writing and closes it."""
    read_end, write_end = os.pipe()
    ledger = SQLiteLedger(tmp_path / "ledger.db")
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
        ledger.close()
        os.write(write_end, verdict)
        os._exit(0)
    os.close(write_end)
    try:
        assert os.read(read_end, 16) == b"refused"
    finally:
        os.waitpid(child, 0)
        os.close(read_end)

    async def write() -> None:
        await ledger.start_invocation(start())
        await ledger.end_invocation(end())

    anyio.run(write)
    ledger.close()
    assert read_db(tmp_path / "ledger.db")[0]["inv-1"]["outcome"] == "completed"


def test_a_ledger_left_open_commits_at_interpreter_exit(tmp_path: Path) -> None:
    """A process that never closes its ledger still commits what it queued (a
    deferred start that would otherwise linger for 30 s) when it exits."""
    import subprocess
    import sys

    path = tmp_path / "ledger.db"
    script = (
        "import anyio, sys\n"
        "from loopengine.persistence import SQLiteLedger, _writer\n"
        "from tests.ledger_support import start\n"
        "ledger = SQLiteLedger(sys.argv[1], linger=30)\n"
        "anyio.run(ledger.start_invocation, start())\n"
    )
    subprocess.run([sys.executable, "-c", script, str(path)], check=True, timeout=60,
                   cwd=Path(__file__).parent.parent)
    assert read_db(path)[0]["inv-1"]["outcome"] == "running"


# -- the dispatch and the request ----------------------------------------------------------


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


async def test_a_dispatch_held_by_a_locked_file_sends_nothing_until_it_is_written(
    tmp_path: Path,
) -> None:
    """Another connection holds the write lock past the busy timeout: the dispatch
    waits in the writer, retried, and the server receives no request meanwhile;
    once the lock is released the row is written and the run completes with one
    request. The lock is released once the writer has said it cannot reach the
    file (it has waited the busy timeout out), not after some real time."""
    path = tmp_path / "ledger.db"
    retrying = WarningSeen("the database cannot be reached")
    logging.getLogger("loopengine").addHandler(retrying)
    with FakeAnthropicServer([Reply.text("fine")]) as server, \
            SQLiteLedger(path, busy_timeout=0.02) as ledger:
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        provider = AnthropicProvider(api_key="k", base_url=server.url,
                                     http_client=httpx2.AsyncClient())
        engine = le.Engine(provider, ledger=ledger, prices=PRICES)
        results: list[le.RunResult] = []

        async def run() -> None:
            results.append(await engine.run(operation(), "go"))

        try:
            async with anyio.create_task_group() as group:
                group.start_soon(run)
                assert await anyio.to_thread.run_sync(retrying.seen.wait, 60)
                assert server.requests == []
                assert read_db(path) == ({}, {})
                blocker.execute("ROLLBACK")
        finally:
            blocker.close()
            logging.getLogger("loopengine").removeHandler(retrying)
            await provider.aclose()
        assert [r.outcome for r in results] == [le.Outcome.COMPLETED]
        assert len(server.requests) == 1
    invocations, attempts = read_db(path)
    assert [a["outcome"] for a in attempts.values()] == ["ok"]


def test_runs_on_trio_share_the_ledger(tmp_path: Path) -> None:
    """On anyio's trio backend (its waiters woken through trio's token), fifty
    concurrent runs complete and every row lands."""
    path = tmp_path / "ledger.db"

    async def main() -> None:
        with SQLiteLedger(path) as ledger:
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


async def test_writes_with_odd_values_fail_alone(tmp_path: Path) -> None:
    """An enum member is recorded as its value; a value that cannot be recorded (a
    Decimal) and an integer past 64 bits fail their own invocation's writes only,
    and the writes sharing their commit still land."""
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as ledger:
        await ledger.start_invocation(dataclasses.replace(start("enum"), tenant=Tenant.ACME))
        await ledger.start_invocation(
            dataclasses.replace(start("decimal"), user_id=Decimal(1)))  # type: ignore[arg-type]
        await ledger.start_invocation(start("big"))
        with pytest.raises(le.LedgerError, match="starting invocation decimal failed"):
            await ledger.dispatch_attempt(dispatch(1, "decimal"))
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
    """Two threads close the ledger at once (the user's close beside the exit hook's)
    while the writer waits for the write lock: neither returns before what was
    queued is committed."""
    path = tmp_path / "ledger.db"
    ledger = SQLiteLedger(path, linger=30)
    await ledger.start_invocation(start())
    seen: list[dict[str, Any]] = []

    def close() -> None:
        ledger.close()
        seen.append(read_db(path)[0])  # what is committed when close returns

    closers = [threading.Thread(target=close) for _ in range(2)]
    with write_lock_held(path):
        for closer in closers:
            closer.start()
        assert seen == []
    for closer in closers:
        await anyio.to_thread.run_sync(closer.join)
    assert [list(committed) for committed in seen] == [["inv-1"], ["inv-1"]]


def test_closing_while_the_file_stays_locked_gives_up_after_busy_timeout(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """Another connection keeps the write lock: `close` waits about busy_timeout for
    it, then gives up on what is queued with a logged error instead of hanging,
    and the rows stay as they were."""
    path = tmp_path / "ledger.db"
    ledger = SQLiteLedger(path, busy_timeout=0.05, linger=0)
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    try:
        anyio.run(ledger.start_invocation, start())
        closing = threading.Thread(target=ledger.close)
        closing.start()
        closing.join(60)
        assert not closing.is_alive()
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert "could not be reached within 0.05s of closing the ledger" in caplog.text
    assert read_db(path) == ({}, {})
