"""A PostgreSQL ledger under load while its server misbehaves the way production
servers do: sessions terminated, a fast restart, an immediate (crash) restart.

200 conversations run at once through the real ``anthropic`` SDK against a
`FakeAnthropicServer`, on a `PostgresLedger` of a server this test starts for
itself (the restarts would disturb the shared one). Nothing is lost: every
request the server received has its row, every reply it served is settled
with its usage, no invocation stays ``running``, and ``loopengine audit
reconcile`` finds everything reconciled.
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest

import loopengine as le
from loopengine.persistence import PostgresLedger
from loopengine.persistence._postgres import APPLICATION_NAME
from loopengine.providers import AnthropicProvider, Reply
from loopengine.testing import FakeAnthropicServer, RecordedRequest

from .clock_support import ExpiringClock
from .conftest import PRICES
from .ledger_support import start
from .postgres_support import PostgresServer, require_module, start_server

psycopg = require_module("psycopg")

pytestmark = pytest.mark.slow

RUNS = 200
TURNS = 3
"""Each conversation: two tool turns, then an answer."""

OPERATION = le.Operation(
    name="failover.op", provider="anthropic", model="claude-sonnet-4-5", max_output_tokens=64,
    # Generous: the outages below last a few seconds at most on a busy machine.
    limits=le.Limits(total_time=45.0, attempt_timeout=40.0))


@le.tool
async def lookup(key: str) -> str:
    """Look a key up."""
    return key.upper()


class Replies:
    """Conversation ``n`` (its prompt says ``go n``): tool turns, then an answer, each
    with usage of its own so a lost or doubled settle shows in the sums. Counts
    the requests answered: `after` waits for a number of them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._answered = 0
        self._marks: dict[int, threading.Event] = {}

    def after(self, count: int) -> threading.Event:
        """Set once ``count`` requests have been answered."""
        with self._lock:
            mark = self._marks.setdefault(count, threading.Event())
            if self._answered >= count:
                mark.set()
        return mark

    def __call__(self, request: RecordedRequest) -> Any:
        with self._lock:
            self._answered += 1
            mark = self._marks.get(self._answered)
        if mark is not None:
            mark.set()
        return reply(request)


def reply(request: RecordedRequest) -> Any:
    """The reply to one request of conversation ``n``."""
    messages = request.messages
    content = messages[0]["content"]
    n = int((content if isinstance(content, str) else content[0]["text"]).split()[-1])
    turn = (len(messages) + 1) // 2
    usage = le.Usage(100 + n, 10 * turn + n % 7)
    if turn < TURNS:
        return Reply.tool_calls(("lookup", {"key": f"k{n}-{turn}"}), usage=usage)
    return Reply.text("answer", usage=usage)


@pytest.fixture
def own_server() -> Iterator[PostgresServer]:
    """A PostgreSQL server of this test's own."""
    server = start_server()
    try:
        yield server
    finally:
        server.stop()


def restart(server: PostgresServer, mode: str) -> None:
    """``pg_ctl restart -m mode`` (as the server's user), waiting until it accepts
    connections again."""
    server._run("pg_ctl", "-D", str(server.directory / "data"), "-m", mode, "-w", "-s",
                "-t", "60", "-l", str(server.directory / "server.log"), "restart")


def terminate(server: PostgresServer) -> int:
    """Terminate the ledger's sessions, once there is one (between a session lost
    and the next one there may be none)."""
    while True:
        killed = server.terminate(APPLICATION_NAME)
        if killed:
            return killed
        time.sleep(0.01)


def audit_reconcile(url: str) -> subprocess.CompletedProcess[str]:
    """``loopengine audit reconcile --db URL``, the installed command."""
    command = Path(sys.executable).with_name("loopengine")
    return subprocess.run([str(command), "audit", "reconcile", "--db", url],
                          capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


async def test_terminated_sessions_and_restarts_lose_nothing(own_server: PostgresServer) -> None:
    """200 concurrent conversations; meanwhile the ledger's sessions are terminated
    twice and the server restarted fast and immediately. Every run completes (its
    deadline allowed the outages), and the ledger holds exactly what the provider's
    server saw and served."""
    dsn = own_server.create_database()
    replies = Replies()
    server = FakeAnthropicServer([replies] * (RUNS * TURNS))
    disruptions: list[str] = []
    with server:
        provider = AnthropicProvider(api_key="k", base_url=server.url)
        ledger = PostgresLedger(dsn, connect_timeout=10)
        async with ledger:
            engine = le.Engine(provider, ledger=ledger, prices=PRICES, rng=random.Random(7))
            results: list[le.RunResult] = []

            async def one(n: int) -> None:
                results.append(await engine.run(OPERATION, f"go {n}", tools=[lookup]))

            async def disrupt() -> None:
                # Each disruption once the runs have made some progress, so that
                # all of them strike while writes are under way.
                steps = [("terminate", lambda: terminate(own_server)),
                         ("restart fast", lambda: restart(own_server, "fast")),
                         ("terminate", lambda: terminate(own_server)),
                         ("restart immediate", lambda: restart(own_server, "immediate"))]
                for index, (name, action) in enumerate(steps):
                    threshold = (index + 1) * RUNS * TURNS // (len(steps) + 2)
                    await anyio.to_thread.run_sync(replies.after(threshold).wait)
                    done = await anyio.to_thread.run_sync(action)
                    disruptions.append(f"{name}: {done}")

            with anyio.fail_after(120):
                async with anyio.create_task_group() as group:
                    group.start_soon(disrupt)
                    for n in range(RUNS):
                        group.start_soon(one, n)
            await provider.aclose()
        reconnects = ledger.reconnects
        requests = len(server.requests)
        served = server.usage_served

    # Both terminations found the ledger's session.
    assert [d for d in disruptions if d.startswith("terminate")] == ["terminate: 1"] * 2
    assert len(disruptions) == 4
    # Each restart ended the session the next write needed (a terminated idle
    # session may be found closed before it is used, and replaced unseen).
    assert reconnects >= 2
    assert sorted(r.outcome.value for r in results) == ["completed"] * RUNS
    assert requests == RUNS * TURNS
    with psycopg.connect(dsn, autocommit=True) as conn:
        invocations = conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE outcome = 'running'), "
            "count(*) FILTER (WHERE outcome = 'completed' AND attempt_count = %s), "
            "sum(input_tokens), sum(output_tokens) FROM invocations", (TURNS,)).fetchone()
        attempts = conn.execute(
            "SELECT count(*), count(DISTINCT (invocation_id, ordinal)), "
            "count(*) FILTER (WHERE outcome = 'ok'), sum(input_tokens), sum(output_tokens) "
            "FROM attempts").fetchone()
    # Every request the server received has its row, settled with what it served.
    assert attempts == (requests, requests, requests, served.input_tokens,
                        served.output_tokens)
    assert invocations == (RUNS, 0, RUNS, served.input_tokens, served.output_tokens)
    dbname = dsn.rsplit("dbname=", 1)[1]
    checked = audit_reconcile(f"postgresql:///{dbname}?host={own_server.directory}&port=5432"
                              f"&user={own_server.user}")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "Everything reconciles." in checked.stdout


def test_closing_while_the_server_is_down_gives_up_after_connect_timeout(
    own_server: PostgresServer, caplog: pytest.LogCaptureFixture,
) -> None:
    """The server stops for good with a write queued: `close` waits no longer than
    ``connect_timeout`` for it, then gives up with a logged error instead of hanging."""
    dsn = own_server.create_database()
    ledger = PostgresLedger(dsn, connect_timeout=1)
    anyio.run(ledger.open)
    own_server._run("pg_ctl", "-D", str(own_server.directory / "data"), "-m", "fast", "-w",
                    "-s", "stop")
    anyio.run(ledger.start_invocation, start())
    closing = threading.Thread(target=ledger.close)
    closing.start()
    closing.join(60)
    assert not closing.is_alive()
    assert "could not be reached within 1s of closing the ledger" in caplog.text


class SettleWatch(PostgresLedger):
    """A `PostgresLedger` that says when a run has asked it to settle an attempt."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.settling = anyio.Event()

    async def settle_attempt(self, record: Any) -> None:
        self.settling.set()
        await super().settle_attempt(record)


async def test_a_reply_served_while_the_database_is_away_is_recorded_when_it_returns(
    own_server: PostgresServer,
) -> None:
    """The database stops accepting the ledger's connections while the provider
    answers: the run cannot record the reply by its deadline and ends
    ``time_limit``, but the settle and the end stay queued and are written once
    the database is back, so the served usage is in the ledger and the
    invocation is not left running. The deadline passes on a clock the test
    moves once the run waits on the settle (with real seconds, a busy machine
    could spend them before the reply came, and the attempt was then cut on the
    wire); past it, each write's grace passes at once: the database stays away."""
    dsn = own_server.create_database()
    dbname = dsn.rsplit("dbname=", 1)[1]

    def away(request: RecordedRequest) -> Any:
        # The ledger's session ends and no new one is let in, before the reply.
        with own_server.connect() as conn:
            conn.execute(f"ALTER DATABASE {dbname} ALLOW_CONNECTIONS false")
        terminate(own_server)
        return Reply.text("served", usage=le.Usage(123, 45))

    total = 5.0
    operation = le.Operation(name="away.op", provider="anthropic", model="claude-sonnet-4-5",
                             max_output_tokens=64, limits=le.Limits(total_time=total))
    clock = ExpiringClock()
    with FakeAnthropicServer([away]) as server:
        provider = AnthropicProvider(api_key="k", base_url=server.url)
        async with SettleWatch(dsn) as ledger:
            engine = le.Engine(provider, ledger=ledger, prices=PRICES, clock=clock)
            ended: list[le.RunResult] = []

            async with anyio.create_task_group() as group:

                async def run() -> None:
                    ended.append(await engine.run(operation, "go"))
                    group.cancel_scope.cancel()  # the time it passes is no longer needed

                group.start_soon(run)
                await ledger.settling.wait()
                handled = len(clock.asked)
                clock.advance(total)
                while True:  # each grace the run then waits (a cancel scope) passes too
                    await clock.asked_for(handled + 1)
                    clock.advance(clock.asked[handled])
                    handled += 1
            (result,) = ended
            assert result.outcome is le.Outcome.TIME_LIMIT
            # The run's deadline cut its wait for the settle: the reply is not acted on.
            assert result.answer is None and "total_time" in result.detail
            await provider.aclose()
            with own_server.connect() as conn:
                conn.execute(f"ALTER DATABASE {dbname} ALLOW_CONNECTIONS true")
            with anyio.fail_after(60):
                await ledger.flush()
        served = server.usage_served
    with psycopg.connect(dsn, autocommit=True) as conn:
        attempts = conn.execute("SELECT outcome, input_tokens, output_tokens FROM attempts"
                                ).fetchall()
        invocations = conn.execute("SELECT outcome, input_tokens FROM invocations").fetchall()
    assert attempts == [("ok", served.input_tokens, served.output_tokens)] == [("ok", 123, 45)]
    assert len(invocations) == 1 and invocations[0][0] != "running"
    assert invocations[0][1] == 123
