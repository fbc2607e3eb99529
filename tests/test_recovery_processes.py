"""Crash recovery across real processes, through the real SDKs against the
loopback fakes, on SQLite and PostgreSQL (docs/pause-and-resume.md).

Children are forked by one helper process (tests/recovery_child.py) that has
imported everything once, so each kill or race costs tens of milliseconds.
A child is killed with SIGKILL inside its tool handlers, at a random moment,
or around the wire (its request held by the server; its reply settled, its
checkpoint not yet written); this process, another one, resumes the run from
the run store alone.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from decimal import Decimal
from itertools import count
from pathlib import Path
from typing import Any

import anyio
import pytest

import loopengine as le
from loopengine import audit
from loopengine.persistence import PostgresLedger, SQLiteLedger
from loopengine.providers import AnthropicProvider, OpenAIProvider, Provider
from loopengine.testing import FakeAnthropicServer, FakeOpenAIServer, Reply

from .postgres_support import PostgresServer, fresh_schema
from .test_audit_postgres import url_of

ROOT = Path(__file__).parent.parent
KILLS = 20
"""Kills per store."""
RACES = 50
"""Races of two resuming processes per store."""
RACE_BATCH = 25
"""Races run at once (each on its own run)."""
MODELS = {"anthropic": "claude-sonnet-4-5", "openai": "gpt-4o-mini"}


class Forker:
    """The helper process: `send` a command, `expect` its children's lines."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.recovery_child"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT)
        self.tags = count()
        self.lines: list[str] = []
        self.pending = b""
        self.expect("helper", "ready")

    def send(self, **command: Any) -> str:
        tag = f"c{next(self.tags)}"
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({**command, "tag": tag}) + "\n").encode())
        self.proc.stdin.flush()
        return tag

    def expect(self, tag: str, *kinds: str, timeout: float = 30.0) -> tuple[str, str]:
        """The next line of command ``tag`` whose kind is one of ``kinds``:
        ``(kind, rest)``. A child's ``error`` line fails the test."""
        return self.expect_any([tag], *kinds, timeout=timeout)[1:]

    def expect_any(self, tags: list[str], *kinds: str,
                   timeout: float = 30.0) -> tuple[str, str, str]:
        """The next line of any command of ``tags`` whose kind is one of ``kinds``:
        ``(tag, kind, rest)``. A child's ``error`` line fails the test."""
        give_up = time.monotonic() + timeout
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while True:
            for index, line in enumerate(self.lines):
                found_tag, kind, *rest = line.split(" ", 2)
                if found_tag not in tags:
                    continue
                if kind == "error":
                    raise AssertionError(f"child {found_tag} failed: {rest}")
                if kind in kinds:
                    del self.lines[index]
                    return found_tag, kind, rest[0] if rest else ""
            left = give_up - time.monotonic()
            assert left > 0, f"no {kinds} from {tags} within {timeout}s"
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                assert chunk, "the helper process exited"
                self.pending += chunk
                *complete, self.pending = self.pending.split(b"\n")
                self.lines += [c.decode() for c in complete]

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def forker() -> Iterator[Forker]:
    helper = Forker()
    try:
        yield helper
    finally:
        helper.close()


@pytest.fixture(params=["sqlite", "postgres"])
async def store(request: pytest.FixtureRequest,
                tmp_path: Path) -> AsyncIterator[tuple[dict[str, str], Any]]:
    """``(db, ledger)``: how a child opens the database, and this process's ledger on it."""
    if request.param == "sqlite":
        path = tmp_path / "ledger.db"
        with SQLiteLedger(path) as ledger:
            yield {"sqlite": str(path)}, ledger
    else:
        server: PostgresServer = request.getfixturevalue("postgres_server")
        schema = fresh_schema()
        async with PostgresLedger(server.dsn(), schema=schema) as ledger:
            yield {"postgres": server.dsn(), "schema": schema}, ledger


def prices(vendor: str) -> le.PriceBook:
    return le.PriceBook([le.ModelPrice(provider=vendor, model=MODELS[vendor],
                                       input_per_mtok=Decimal(1), output_per_mtok=Decimal(1))],
                        credits_per_usd=Decimal(1_000_000))


def operation(vendor: str) -> le.Operation:
    return le.Operation(name="recovery.op", provider=vendor, model=MODELS[vendor],
                        max_output_tokens=256, limits=le.Limits(total_time=300.0))


async def rows(ledger: Any, sql: str) -> list[tuple[Any, ...]]:
    """Rows of a query on the ledger's database, once its writes are committed."""
    await ledger.flush()
    if isinstance(ledger, SQLiteLedger):
        with sqlite3.connect(ledger.path) as conn:
            return [tuple(r) for r in conn.execute(sql)]
    found = await ledger._transact_qmark(lambda conn: conn.execute(sql).fetchall(), "read")
    return [tuple(r) for r in found]


async def check_ledger_against_the_server(ledger: Any, requests: int) -> None:
    """Every attempt settled ok (none lost), attempt sums equal the invocation
    totals, and the server answered exactly the ledger's attempts."""
    outcomes = await rows(ledger, "SELECT outcome, COUNT(*) FROM attempts GROUP BY outcome")
    assert [(o, int(n)) for o, n in outcomes] == [("ok", requests)]
    totals = await rows(ledger, "SELECT SUM(attempt_count), SUM(input_tokens), "
                                "SUM(output_tokens), SUM(cost_nanousd) FROM invocations")
    sums = await rows(ledger, "SELECT COUNT(*), SUM(input_tokens), SUM(output_tokens), "
                              "SUM(cost_nanousd) FROM attempts")
    assert [int(v) for v in totals[0]] == [int(v) for v in sums[0]]
    assert int(totals[0][0]) == requests
    assert int(sums[0][1]) > 0  # the replies' usage is there


def wait_gone(pid: int) -> None:
    """Return once the killed process is gone (its parent reaps it at once)."""
    give_up = time.monotonic() + 10
    while time.monotonic() < give_up:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} did not die")


def provider_for(vendor: str, url: str) -> Provider:
    if vendor == "anthropic":
        return AnthropicProvider(api_key="test-key", base_url=url)
    return OpenAIProvider(api_key="test-key", base_url=url)


async def test_sigkill_in_handlers_never_runs_a_call_twice_and_loses_no_usage(
        forker: Forker, store: tuple[dict[str, str], Any],
        fake_anthropic_server: FakeAnthropicServer, tmp_path: Path) -> None:
    """20 children killed at random moments inside their batch's handlers
    (charge: not idempotent; lookup: idempotent), each run resumed here from the
    run store: charge is in doubt and takes effect exactly once (Supply when it
    had, Approve when it had not), lookup runs again, every served reply's usage
    is in the ledger, attempt sums equal the totals, and the server answered
    exactly the ledger's attempts."""
    db, ledger = store
    server = fake_anthropic_server
    log = tmp_path / "calls.log"

    def note(line: str) -> None:
        with open(log, "a", encoding="utf-8") as out:
            out.write(line + "\n")

    @le.tool
    def charge(card: str, ctx: le.ToolContext) -> str:
        """Charge a card."""
        note(f"start charge {ctx.invocation_id}")
        note(f"effect charge {ctx.invocation_id}")
        return f"charged {card}"

    @le.tool(idempotent=True)
    def lookup(card: str, ctx: le.ToolContext) -> str:
        """Look a card up."""
        note(f"start lookup {ctx.invocation_id}")
        note(f"effect lookup {ctx.invocation_id}")
        return f"{card} is valid"

    provider = provider_for("anthropic", server.url)
    engine = le.Engine(provider, ledger=ledger, prices=prices("anthropic"),
                       run_store=le.RunStore(ledger))
    rng = random.Random(20)
    server.add(*[Reply.tool_calls(("charge", {"card": f"c{i}"}), ("lookup", {"card": f"c{i}"}))
                 for i in range(KILLS)])
    # All children at once: each is killed at a random moment after both its
    # handlers started (some before charge took effect, some after).
    tags = [forker.send(op="crash", vendor="anthropic", url=server.url, db=db, log=str(log))
            for _ in range(KILLS)]
    pids = {tag: int(forker.expect(tag, "pid")[1]) for tag in tags}
    kills: list[tuple[float, str]] = []
    runs: dict[str, str] = {}
    for tag in tags:
        runs[tag] = forker.expect(tag, "started")[1].split()[1]
        forker.expect(tag, "started")  # both handlers run
        kills.append((time.monotonic() + rng.uniform(0.0, 0.015), tag))
    for at, tag in sorted(kills):
        await anyio.sleep(max(0.0, at - time.monotonic()))
        os.kill(pids[tag], signal.SIGKILL)
    for pid in pids.values():
        wait_gone(pid)
    server.add(*[Reply.text("Paid.") for _ in range(KILLS)])
    supplied = 0

    async def recover(run_id: str) -> None:
        nonlocal supplied
        paused = await engine.resume(run_id, tools=[charge, lookup], force=True)
        assert paused.outcome is le.Outcome.PAUSED, paused.detail
        assert [(p.tool, p.reason) for p in paused.pending] == [("charge", "in_doubt")]
        took_effect = f"effect charge {run_id}" in log.read_text().splitlines()
        decision: le.Supply | le.Approve = le.Supply("charged") if took_effect else le.Approve()
        supplied += took_effect
        done = await engine.resume(run_id, tools=[charge, lookup],
                                   decisions={paused.pending[0].id: decision})
        assert done.outcome is le.Outcome.COMPLETED and done.answer == "Paid."
        assert (done.turns, done.tool_calls) == (2, 2)

    try:
        async with anyio.create_task_group() as group:
            for run_id in runs.values():
                group.start_soon(recover, run_id)
    finally:
        await provider.aclose()  # type: ignore[attr-defined]
    lines = log.read_text().splitlines()
    for run_id in runs.values():
        assert lines.count(f"effect charge {run_id}") == 1  # never twice, never lost
        assert lines.count(f"start lookup {run_id}") == 2  # idempotent: run again
    assert len(set(runs.values())) == KILLS
    await check_ledger_against_the_server(ledger, len(server.requests))
    assert len(server.requests) == 2 * KILLS
    assert await rows(ledger, "SELECT COUNT(*) FROM run_states") in ([(0,)], [(0,)])
    statuses = await rows(ledger, "SELECT tool, status, COUNT(*) FROM tool_calls "
                                  "GROUP BY tool, status ORDER BY tool, status")
    assert {(t, s, int(n)) for t, s, n in statuses} == {
        ("charge", "supplied", supplied), ("charge", "succeeded", KILLS - supplied),
        ("lookup", "succeeded", KILLS)} - {("charge", "supplied", 0),
                                          ("charge", "succeeded", 0)}


WIRE_KILLS = 5
"""Kills per store and moment of `test_sigkill_around_the_wire...`."""


async def test_sigkill_around_the_wire_loses_no_billed_reply_and_runs_no_call_twice(
        forker: Forker, store: tuple[dict[str, str], Any],
        fake_anthropic_server: FakeAnthropicServer, tmp_path: Path) -> None:
    """Children killed at the two moments around a request, one after another,
    each run resumed here from the run store alone:

    * while the server holds the reply of turn 1 (its row written, its
      request out): the attempt stays ``dispatched`` in the ledger, the turn
      goes again as attempt 2;
    * once turn 1's reply (asking for ``charge``) is settled, before the
      run's checkpoint: the turn goes again as attempt 2, and its credits
      charge both replies (R03): nothing billed is left out of the run's
      credits or usage.

    ``charge`` takes effect exactly once per run, the server answered exactly
    the ledger's attempts, attempt sums equal the invocation totals."""
    db, ledger = store
    server = fake_anthropic_server
    log = tmp_path / "calls.log"

    @le.tool
    def charge(card: str, ctx: le.ToolContext) -> str:
        """Charge a card."""
        with open(log, "a", encoding="utf-8") as out:
            out.write(f"effect charge {ctx.invocation_id}\n")
        return f"charged {card}"

    runs: dict[str, str] = {}
    for mode in ("request", "settled") * WIRE_KILLS:
        served = len(server.requests)
        server.add(Reply.text("held", delay=30) if mode == "request"
                   else Reply.tool_calls(("charge", {"card": "c"})))
        tag = forker.send(op="wire", mode=mode, vendor="anthropic", url=server.url, db=db,
                          log=str(log))
        pid = int(forker.expect(tag, "pid")[1])
        run_id = forker.expect(tag, "sent" if mode == "request" else "settled")[1]
        if mode == "request":
            give_up = time.monotonic() + 30
            while len(server.requests) == served:  # the request reached the server
                assert time.monotonic() < give_up, "the request never arrived"
                await anyio.sleep(0.001)
        os.kill(pid, signal.SIGKILL)
        wait_gone(pid)
        runs[run_id] = mode
    provider = provider_for("anthropic", server.url)
    engine = le.Engine(provider, ledger=ledger, prices=prices("anthropic"),
                       run_store=le.RunStore(ledger))
    try:
        for run_id, mode in runs.items():
            server.add(Reply.tool_calls(("charge", {"card": "c"})), Reply.text("Paid."))
            done = await engine.resume(run_id, tools=[charge], force=True)
            assert done.outcome is le.Outcome.COMPLETED and done.answer == "Paid.", done.detail
            assert (done.turns, done.tool_calls) == (2, 1)
            attempts = await rows(ledger, "SELECT turn, attempt, outcome, input_tokens, "
                                          "output_tokens FROM attempts WHERE invocation_id = "
                                          f"'{run_id}' ORDER BY ordinal")
            served_first = "dispatched" if mode == "request" else "ok"
            assert [(int(t), int(a), o) for t, a, o, _, _ in attempts] == [
                (1, 1, served_first), (1, 2, "ok"), (2, 1, "ok")]
            # One token is one credit here: the run's credits are every
            # settled reply's tokens, the one its dead process settled included.
            tokens = sum(int(i) + int(o) for _, _, out, i, o in attempts if out == "ok")
            assert done.credits == tokens
            assert done.usage.input_tokens == sum(int(i) for _, _, out, i, _ in attempts
                                                  if out == "ok")
    finally:
        await provider.aclose()  # type: ignore[attr-defined]
    lines = log.read_text().splitlines()
    for run_id in runs:
        assert lines.count(f"effect charge {run_id}") == 1
    assert len(server.requests) == 3 * len(runs)
    totals = await rows(ledger, "SELECT SUM(attempt_count), SUM(input_tokens), "
                                "SUM(cost_nanousd) FROM invocations")
    sums = await rows(ledger, "SELECT COUNT(*), SUM(input_tokens), SUM(cost_nanousd) "
                              "FROM attempts")
    assert [int(v) for v in totals[0]] == [int(v) for v in sums[0]]
    assert int(totals[0][0]) == len(server.requests)


async def test_two_processes_resuming_one_run_never_both_proceed(
        forker: Forker, store: tuple[dict[str, str], Any],
        fake_anthropic_server: FakeAnthropicServer, tmp_path: Path) -> None:
    """50 times, two processes resume the same paused run at the same moment:
    one completes it, the other raises RunBusyError having sent nothing; the
    approved call runs once."""
    db, ledger = store
    server = fake_anthropic_server
    log = tmp_path / "sent.log"

    @le.tool(approval=True)
    def send(to: str) -> str:
        """Send the message to someone."""
        raise AssertionError("runs only in the resuming processes")

    provider = provider_for("anthropic", server.url)
    engine = le.Engine(provider, ledger=ledger, prices=prices("anthropic"),
                       run_store=le.RunStore(ledger))
    server.add(*[Reply.tool_calls(("send", {"to": "bob"})) for _ in range(RACES)])
    runs: list[le.RunResult] = []

    async def pause() -> None:
        runs.append(await engine.run(operation("anthropic"), "Tell bob", tools=[send]))

    try:
        async with anyio.create_task_group() as group:
            for _ in range(RACES):
                group.start_soon(pause)
    finally:
        await provider.aclose()  # type: ignore[attr-defined]
    assert {r.outcome for r in runs} == {le.Outcome.PAUSED}
    # The winner's next reply is held until the loser of every pair of its
    # batch has reported: the run is still held when the other resume
    # arrives, however late a loaded machine lets it start. The busy resumes
    # send nothing, so the winners' requests take the items in batch order.
    releases = [threading.Event() for _ in range(0, RACES, RACE_BATCH)]

    def held(release: threading.Event) -> Callable[[Any], Reply]:
        def reply(request: Any) -> Reply:
            assert release.wait(60), "the test never released the reply"
            return Reply.text("Sent.")
        return reply

    server.add(*[held(releases[n // RACE_BATCH]) for n in range(RACES)])
    for batch in range(0, RACES, RACE_BATCH):
        go = tmp_path / f"go{batch}"
        pairs = [[forker.send(op="resume", vendor="anthropic", url=server.url, db=db,
                              log=str(log), run=paused.invocation_id,
                              decisions=[paused.pending[0].id], go=str(go))
                  for _ in range(2)] for paused in runs[batch:batch + RACE_BATCH]]
        for pair in pairs:
            for tag in pair:
                forker.expect(tag, "ready")
        go.touch()
        # No result can come before the release: each pair's first word is busy.
        losers = [forker.expect_any(pair, "busy")[0] for pair in pairs]
        releases[batch // RACE_BATCH].set()
        for pair, loser in zip(pairs, losers, strict=True):
            [winner] = [tag for tag in pair if tag != loser]
            forker.expect(winner, "result")
    lines = log.read_text().splitlines()
    # Each run's call ran once, in the process that won.
    assert sorted(lines) == sorted(f"send {run.invocation_id}" for run in runs)
    assert len(server.requests) == 2 * RACES  # the busy resumes sent nothing
    await check_ledger_against_the_server(ledger, len(server.requests))


@pytest.mark.parametrize("vendor", ["anthropic", "openai"])
async def test_approval_round_trip_resumes_in_another_process_from_the_run_store_alone(
        vendor: str, forker: Forker, store: tuple[dict[str, str], Any],
        fake_anthropic_server: FakeAnthropicServer, fake_openai_server: FakeOpenAIServer,
        tmp_path: Path) -> None:
    """Paused here; another process given only the invocation id resumes it from
    the run store: the approved call runs there once, the run completes as the
    same invocation, and the store forgets it."""
    db, ledger = store
    server: Any = fake_anthropic_server if vendor == "anthropic" else fake_openai_server
    log = tmp_path / "sent.log"

    @le.tool(approval=True)
    def send(to: str) -> str:
        """Send the message to someone."""
        raise AssertionError("runs only in the resuming process")

    server.add(Reply.tool_calls(("send", {"to": "bob"})), Reply.text("It is sent."))
    url = server.url if vendor == "anthropic" else server.base_url
    provider = provider_for(vendor, url)
    store_ = le.RunStore(ledger)
    engine = le.Engine(provider, ledger=ledger, prices=prices(vendor), run_store=store_)
    try:
        paused = await engine.run(operation(vendor), "Tell bob", tools=[send])
    finally:
        await provider.aclose()  # type: ignore[attr-defined]
    assert paused.outcome is le.Outcome.PAUSED
    stored = await store_.load(paused.invocation_id)
    assert stored is not None and b"bob" in stored.state and b"test-key" not in stored.state
    tag = forker.send(op="resume", vendor=vendor, url=url, db=db, log=str(log),
                      run=paused.invocation_id, decisions=[paused.pending[0].id])
    kind, rest = forker.expect(tag, "result", "busy")
    assert kind == "result"
    assert json.loads(rest) == {"outcome": "completed", "invocation_id": paused.invocation_id,
                                "turns": 2, "tool_calls": 1, "attempts": 2,
                                "answer": "It is sent."}
    assert log.read_text().splitlines() == [f"send {paused.invocation_id}"]
    assert await store_.load(paused.invocation_id) is None
    assert await store_.tool_calls(paused.invocation_id) == {paused.pending[0].id: "succeeded"}
    await check_ledger_against_the_server(ledger, len(server.requests))


@pytest.mark.parametrize("vendor", ["anthropic", "openai"])
async def test_sigkill_in_a_grandchilds_tool_ends_the_dead_sub_agents_when_recovered(
        vendor: str, forker: Forker, store: tuple[dict[str, str], Any],
        fake_anthropic_server: FakeAnthropicServer, fake_openai_server: FakeOpenAIServer,
        request: pytest.FixtureRequest) -> None:
    """A process killed in a grandchild's tool (parent -> helper -> inner ->
    dig) leaves the three rows running. Recovered here by its id, the run ends
    helper's and inner's rows ``failed`` (their attempts as recorded, their
    credits their settled turns': 200 and 300), pauses on helper's call in
    doubt, and completes once it is decided; the run's total, its account and
    `audit reconcile` agree, and nothing is left running."""
    db, ledger = store
    server: Any = fake_anthropic_server if vendor == "anthropic" else fake_openai_server
    url = server.url if vendor == "anthropic" else server.base_url
    accounts = le.CreditAccounts(ledger)
    await accounts.grant("acme", 10_000)

    def usage(credits: int) -> le.Usage:  # one credit per token on these prices
        return le.Usage(input_tokens=credits - 10, output_tokens=10)

    server.add(Reply.tool_calls(("helper", {"task": "research"}), usage=usage(100)),
               Reply.tool_calls(("inner", {"task": "dig"}), usage=usage(200)),
               Reply.tool_calls(("dig", {"key": "k"}), usage=usage(300)))
    tag = forker.send(op="delegate", vendor=vendor, url=url, db=db)
    pid = int(forker.expect(tag, "pid")[1])
    grandchild = forker.expect(tag, "started")[1].strip()
    os.kill(pid, signal.SIGKILL)
    wait_gone(pid)
    assert [tuple(r) for r in await rows(ledger, "SELECT outcome, COUNT(*) FROM invocations "
                                                 "GROUP BY outcome")] == [("running", 3)]
    [(run_id,)] = await rows(ledger, "SELECT id FROM invocations "
                                     "WHERE parent_invocation_id IS NULL")

    def named(name: str, **limits: Any) -> le.Operation:
        base = operation(vendor)
        return le.Operation(name=name, provider=vendor, model=MODELS[vendor],
                            max_output_tokens=base.max_output_tokens,
                            limits=le.Limits(total_time=300.0, **limits))

    provider = provider_for(vendor, url)
    engine = le.Engine(provider, ledger=ledger, prices=prices(vendor),
                       run_store=le.RunStore(ledger), accounts=accounts)
    helper = le.agent_tool(engine, named("child.op"), name="helper", description="Helps.")
    server.add(Reply.text("Found.", usage=usage(40)))
    try:
        paused = await engine.resume(run_id, tools=[helper], force=True)
        assert [(p.tool, p.reason) for p in paused.pending] == [("helper", "in_doubt")]
        ended = await rows(ledger, "SELECT operation, outcome, turns, tool_calls, credits, "
                                   "attempt_count, id FROM invocations "
                                   "WHERE parent_invocation_id IS NOT NULL ORDER BY operation")
        assert [tuple(r[:6]) for r in ended] == [("child.op", "failed", 1, 0, 200, 1),
                                                 ("grandchild.op", "failed", 1, 0, 300, 1)]
        assert ended[1][6] == grandchild
        done = await engine.resume(run_id, tools=[helper],
                                   decisions={paused.pending[0].id: le.Supply("nothing")})
    finally:
        await provider.aclose()  # type: ignore[attr-defined]
    assert done.outcome is le.Outcome.COMPLETED and done.answer == "Found."
    assert (done.credits, done.credits_total) == (140, 640)
    balance = await accounts.balance("acme")
    assert (balance.spent, balance.reserved) == (640, 0)
    await ledger.flush()
    if "sqlite" in db:
        target, schema = db["sqlite"], None
    else:
        postgres: PostgresServer = request.getfixturevalue("postgres_server")
        target, schema = url_of(postgres, "postgres"), db["schema"]
    conn = audit.open_ledger(target, schema=schema)
    try:
        found = audit.reconcile(conn)
    finally:
        conn.close()
    assert found.mismatches == [] and found.accounts == []
    assert found.running == [] and found.abandoned == []
    # Their process died in them: their segments stay open, listed for a look.
    dead = {(str(r["invocation_id"]), r["ordinal"]) for r in found.dead_segments}
    assert {(grandchild, 1), (str(ended[0][6]), 1)} <= dead
