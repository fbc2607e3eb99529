"""FakeAnthropicServer under load, and its threads: a witness that drops
connections at 50 concurrent runs would make every test that counts attempts
flaky, and a server left open must never keep a process from exiting."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import anyio
import pytest

import loopengine as le
from loopengine import Usage
from loopengine.persistence import MemoryLedger
from loopengine.providers import AnthropicProvider
from loopengine.testing import FakeAnthropicServer, Reply

from ..conftest import PRICES, operation

RUNS = 200


@pytest.mark.realtime
@pytest.mark.slow
async def test_200_concurrent_runs_all_complete_without_a_connection_fault(
    fake_anthropic_server: FakeAnthropicServer,
) -> None:
    """200 runs started at once on one engine (a connection each): every run
    completes on its first attempt, no attempt is a connection fault, and the
    server saw exactly 200 requests."""
    server = fake_anthropic_server
    server.add(*(Reply.text(f"answer {n}", usage=Usage(input_tokens=10, output_tokens=2))
                 for n in range(RUNS)))
    ledger = MemoryLedger()
    async with AnthropicProvider(api_key="test-key", base_url=server.url) as provider:
        engine = le.Engine(provider, ledger=ledger, prices=PRICES)
        results: list[le.RunResult] = []

        async def one(n: int) -> None:
            results.append(await engine.run(operation(), f"question {n}"))

        with anyio.fail_after(30):
            async with anyio.create_task_group() as group:
                for n in range(RUNS):
                    group.start_soon(one, n)
    assert len(results) == RUNS
    assert all(r.outcome is le.Outcome.COMPLETED for r in results)
    faults = [row["fault"] for row in ledger.attempts.values() if row["outcome"] != "ok"]
    assert faults == []
    assert sorted({row["attempt"] for row in ledger.attempts.values()}) == [1]
    assert len(ledger.attempts) == len(server.requests) == RUNS
    assert server.usage_served == Usage(input_tokens=10 * RUNS, output_tokens=2 * RUNS)


def test_handler_threads_are_daemon(fake_anthropic_server: FakeAnthropicServer) -> None:
    """The thread serving a kept-alive connection is a daemon thread, joined by
    ``close``."""
    fake_anthropic_server.add(Reply.text("hi"))
    host, port = fake_anthropic_server.url.removeprefix("http://").split(":")
    before = set(threading.enumerate())
    connection = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        connection.request("POST", "/v1/messages", body=json.dumps({
            "model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}),
            headers={"content-type": "application/json"})
        assert connection.getresponse().read()
        handlers = [t for t in set(threading.enumerate()) - before if t.is_alive()]
        assert handlers and all(t.daemon for t in handlers)
        fake_anthropic_server.close()
        assert not any(t.is_alive() for t in handlers)
    finally:
        connection.close()


@pytest.mark.slow
def test_a_server_never_closed_does_not_keep_the_process_from_exiting(tmp_path: Path) -> None:
    """A script that starts a server, leaves a kept-alive connection open and
    never calls ``close`` still exits."""
    script = tmp_path / "left_open.py"
    script.write_text(textwrap.dedent("""
        import http.client, json
        from loopengine.testing import FakeAnthropicServer, Reply

        server = FakeAnthropicServer([Reply.text("hi")]).start()
        host, port = server.url.removeprefix("http://").split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=5)
        connection.request("POST", "/v1/messages", body=json.dumps({
            "model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}),
            headers={"content-type": "application/json"})
        assert connection.getresponse().read()
        print("served", flush=True)
        # Neither the connection nor the server is closed.
    """))
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "served"
    assert time.monotonic() - started < 30


@pytest.mark.realtime
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_2000_concurrent_runs_complete_without_a_connection_fault() -> None:
    """2,000 runs at once on one engine against a FakeAnthropicServer in its own
    process: every run completes on its first attempt, none is a connection
    fault, and the server saw exactly 2,000 requests and served what the ledger
    recorded. It takes seconds; its bounds (no run deadline, a request may wait
    four minutes) are for a hang: requests queued behind 2,000 others on a busy
    machine wait long, and a wait is no connection fault."""
    runs = 2000
    child = subprocess.Popen(
        [sys.executable, "-P", str(Path(__file__).with_name("fake_server_child.py")), str(runs)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        url = child.stdout.readline().strip()
        ledger = MemoryLedger()
        results: list[le.RunResult] = []

        async def main() -> None:
            async with AnthropicProvider(api_key="test-key", base_url=url) as provider:
                engine = le.Engine(provider, ledger=ledger, prices=PRICES)

                async def one(n: int) -> None:
                    results.append(await engine.run(
                        operation(total_time=None, attempt_timeout=240.0), f"question {n}"))

                with anyio.fail_after(240):
                    async with anyio.create_task_group() as group:
                        for n in range(runs):
                            group.start_soon(one, n)

        anyio.run(main)
        out, _ = child.communicate("", timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert len(results) == runs
    assert all(r.outcome is le.Outcome.COMPLETED for r in results)
    assert [row["fault"] for row in ledger.attempts.values() if row["outcome"] != "ok"] == []
    assert {row["attempt"] for row in ledger.attempts.values()} == {1}
    served_requests, served_input = (int(v) for v in out.split())
    assert served_requests == len(ledger.attempts) == runs
    assert served_input == sum(row["input_tokens"] for row in ledger.attempts.values())
