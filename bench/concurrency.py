"""Thousands of conversations in one process: CPU per turn, event-loop lag, memory.

N five-turn tool conversations (the model asks for a tool four times, then
answers in text) run on one event loop to their answers, through the real
``anthropic`` (or ``openai``, or ``google-genai``) SDK, against a loopback server in a process of
its own (bench/_loopback.py: prebuilt replies, no framework), so the server's
CPU is not the event loop's. The server holds each reply for a model's
latency, N/``--rate`` seconds (±50%), and the conversations start evenly
over that time, as users arrive: from then on all N are in flight at once,
almost all of the time waiting on a reply, and between them they ask for
``--rate`` turns a second (default 250). A fixed rate keeps the event loop
equally busy at every N, so what grows with N is the cost of N conversations
in flight, not the load. Contenders:

* ``bare``: a hand-written loop on ``client.messages.create`` (the floor);
* ``loopengine``: `Engine.run` on an `AnthropicProvider`, no ledger;
* ``sqlite``: the same with a `SQLiteLedger` (its writer thread's CPU counted);
* ``postgres``: the same with a `PostgresLedger` on ``--postgres DSN`` (its
  writer thread's CPU counted; the server's is not: it is another process);
* ``openai-bare`` and ``openai``: the same two on Chat Completions, through
  the ``openai`` SDK and `OpenAIProvider`;
* ``responses-bare`` and ``responses``: on the Responses API, a hand-written
  loop on ``client.responses.create`` and `OpenAIResponsesProvider`;
* ``gemini-bare`` and ``gemini``: on the Gemini API, a hand-written loop on
  ``client.aio.models.generate_content`` (``google-genai``) and `GeminiProvider`;
* ``bedrock-bare`` and ``bedrock``: Claude on Amazon Bedrock (``InvokeModel``,
  ``POST /model/{modelId}/invoke``: the Messages API's bodies, the model in
  the path), a hand-written loop on ``AsyncAnthropicBedrock.messages.create``
  and `AnthropicProvider.bedrock`, both signing every request with fake AWS
  keys (SigV4, botocore: the extra ``bedrock``), as a client with AWS
  credentials does.

Each contender is measured against the floor on its own API (``FLOOR``): a
route's ratio is loopengine's cost over what that SDK costs anyway. A
contender whose SDK is not installed is skipped, with the reason.

Every contender sends through the same kind of client (``--transport``):
``default`` is the client a provider (`AnthropicProvider`, `OpenAIProvider`...) builds
from keywords (the bare loops take the provider's own client, so the floor
has the same client settings): on asyncio, the SDK's aiohttp client;
``sdk`` is the SDK's own default (what a provider built from keywords uses
on trio)
(``httpx2`` with httpcore's connection pool, its limits but for room for N
connections; for Gemini an ``httpx2.AsyncClient`` with those limits);
``aiohttp`` the SDK's ``DefaultAioHttpClient`` given directly (not for Gemini).
The Bedrock pair takes every transport (the ``anthropic`` SDK's).

Each measurement runs in a fresh process (so peak RSS is its own), after a
warm-up of a few conversations. It reports:

* wall time, and CPU per turn: the process's (every thread, the ledger's
  writer thread included, and any child process but the loopback server),
  over the N conversations;
* event-loop lag: a ticker task sleeps 5 ms again and again and records how
  late it wakes (p50, p99, max), which is how long the loop was busy with
  something else;
* the collector's longest pause (``gc max``, from ``gc.callbacks``): a full
  collection walks every object the process tracks, so it grows with N; and
  how many full collections the run made (``full``) and their median pause
  (``full p50``): the longest of more pauses is longer on a noisy machine;
  and the time spent in every collection of the run, per turn (``gc/turn``,
  in ms, part of CPU per turn): what the objects a turn leaves behind cost;
* memory: peak resident memory over the run (sampled by the ticker) minus
  the resident memory before the conversations started, per conversation.
  Every conversation spends most of its life waiting on its reply, so this is
  the memory of an idle-waiting conversation;
* the server's own CPU share of the wall time (``server busy``): well under
  100% shows the server was never the bottleneck;
* with a ledger, the wait for a durable write: how long each
  ``dispatch_attempt`` (the row written before the request goes out) and
  each ``settle_attempt`` (the reply written before anything acts on it) kept
  its conversation waiting, p50 and p99 over every turn of the run.

Rounds interleave contenders (their order rotated each round); a figure is
the median over rounds, and a ratio the median of the ratios to the bare loop
at the same N within each round, so a slow moment of this noisy machine hits
all contenders alike.

Run::

    python bench/concurrency.py                       # N = 100, 1,000, 5,000; 3 rounds
    python bench/concurrency.py --full                # and 10,000
    python bench/concurrency.py -n 1000 --contenders bare,sqlite,postgres \
        --postgres "host=/tmp/pg user=postgres dbname=postgres"   # the ledgers
    python bench/concurrency.py -n 1000 --contenders bare,loopengine --rounds 5 --freeze
    python bench/concurrency.py -n 1000 --rate 100 \
        --contenders openai-bare,openai,responses-bare,responses,gemini-bare,gemini,\
bedrock-bare,bedrock   # each route on its SDK
    python bench/concurrency.py -n 1000 --rate 100 --rounds 5 --paired \
        --contenders bare,loopengine,gemini-bare,gemini   # each beside its floor
    python bench/concurrency.py -n 1000 --profile loopengine   # cProfile of one run
    python bench/concurrency.py -n 1000 --memory loopengine    # what holds the memory
    python bench/concurrency.py --count -n 1000 --contenders bare,loopengine  # deterministic

``--paired`` runs each contender at the same time as its floor instead of
after it, each process (and its loopback server) pinned to a core of its own,
the two swapping cores each round; a ratio is then taken within its pair. On
a shared virtual machine whose speed drifts from one minute to the next, the
pair shares the drift and the ratio cancels it. It needs two cores, and a
contender with a writer thread has it on its one core too.

``--count`` times nothing: in a fresh process per contender and round, it
holds N conversations waiting on the reply of turn ``--hold-turn`` (default
the third) and prints, per waiting conversation, the objects the collector
tracks, the bytes tracemalloc sees, and by type; with the pause of one full
collection before and after.

A measurement takes about 6 N/rate seconds (a reply delay to start them all,
five to run them), so the default run takes most of an hour; ``-n`` and
``--contenders`` pick what to measure.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import cProfile
import functools
import gc
import importlib.util
import json
import os
import pstats
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _conversation import (  # noqa: E402
    ANSWER,
    BEDROCK_MODEL,
    GEMINI_MODEL,
    MODEL,
    OPENAI_MODEL,
    QUESTION,
    TURNS,
    bare_chat_run,
    bare_gemini_run,
    bare_responses_run,
    bare_run,
    lookup,
)

TICK = 0.005
RATE = 250.0
PROFILE = Path(tempfile.gettempdir()) / "loopengine-concurrency.prof"
WARM_UP = 20
CONTENDERS = ["bare", "loopengine", "sqlite", "postgres", "openai-bare", "openai",
               "responses-bare", "responses", "gemini-bare", "gemini", "bedrock-bare", "bedrock"]
FLOOR = {"bare": "bare", "loopengine": "bare", "sqlite": "bare", "postgres": "bare",
         "openai-bare": "openai-bare", "openai": "openai-bare",
         "responses-bare": "responses-bare", "responses": "responses-bare",
         "gemini-bare": "gemini-bare", "gemini": "gemini-bare",
         "bedrock-bare": "bedrock-bare", "bedrock": "bedrock-bare"}
"""Each contender's floor: the bare SDK loop on the same API."""
SDK = {"openai-bare": "openai", "openai": "openai", "responses-bare": "openai",
       "responses": "openai", "gemini-bare": "google.genai", "gemini": "google.genai",
       "bedrock-bare": "botocore", "bedrock": "botocore"}
"""The module a contender needs beyond the core's (``anthropic``), and so its extra."""
EXTRA = {"openai": "openai", "google.genai": "gemini", "botocore": "bedrock"}


def missing_sdk(name: str) -> str | None:
    """Why contender ``name`` cannot run here (its SDK is not installed), or None."""
    module = SDK.get(name)
    if module is None:
        return None
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package (google) is missing too
        found = False
    if found:
        return None
    return (f"{name}: the {module} SDK is not installed "
            f"(pip install -e '.[{EXTRA[module]}]')")

# -- the contenders (in the measuring process) --------------------------------------------------


@dataclass
class Contender:
    run: Callable[[], Awaitable[str]]
    close: Callable[[], Awaitable[None]]
    waits: dict[str, list[float]] | None = None
    """With a ledger: seconds each durable write kept a conversation waiting."""


class TimedLedger:
    """The ledger the engine is given, timing the durable writes it awaits.

    Everything else is the wrapped ledger's own (attribute lookups fall
    through to it); the two timed calls are the ones a turn waits on.
    """

    def __init__(self, ledger: Any) -> None:
        self._ledger = ledger
        self.waits: dict[str, list[float]] = {"dispatch": [], "settle": []}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ledger, name)

    @property
    def max_retained_attempts(self) -> int:
        return int(self._ledger.max_retained_attempts)

    async def dispatch_attempt(self, record: Any) -> None:
        began = time.perf_counter()
        await self._ledger.dispatch_attempt(record)
        self.waits["dispatch"].append(time.perf_counter() - began)

    async def settle_attempt(self, record: Any) -> None:
        began = time.perf_counter()
        await self._ledger.settle_attempt(record)
        self.waits["settle"].append(time.perf_counter() - began)


def connections(n: int) -> int:
    """Connections a client may open: one per conversation in flight (HTTP/1.1)."""
    return max(1000, n)


def sdk_http_client(sdk: Any, transport: str, n: int) -> Any:
    """The SDK's own default httpx client (its limits: 1,000 connections, 100 kept
    alive), or its aiohttp one, with room for N connections."""
    import httpx2

    if transport == "aiohttp":
        return sdk.DefaultAioHttpClient(limits=httpx2.Limits(
            max_connections=connections(n), max_keepalive_connections=connections(n)))
    return sdk.DefaultAsyncHttpxClient(limits=httpx2.Limits(
        max_connections=connections(n), max_keepalive_connections=100))


def anthropic_client(url: str, transport: str, n: int) -> Any:
    """The SDK client the contenders on the Messages API send through."""
    import anthropic

    from loopengine.providers import AnthropicProvider

    if transport == "default":
        return AnthropicProvider(api_key="bench", base_url=url,
                                 max_connections=connections(n)).client
    return anthropic.AsyncAnthropic(api_key="bench", base_url=url, max_retries=0,
                                    http_client=sdk_http_client(anthropic, transport, n))


BEDROCK_KEYS = {"aws_region": "us-east-1", "aws_access_key": "AKIDBENCHMARK",
                "aws_secret_key": "bench-secret"}
"""Fake AWS credentials: the request is signed as a real one is, and nothing
leaves 127.0.0.1."""


def bedrock_client(url: str, transport: str, n: int) -> Any:
    """The SDK client the contenders on Amazon Bedrock send through."""
    import anthropic

    from loopengine.providers import AnthropicProvider

    if transport == "default":
        return AnthropicProvider.bedrock(base_url=url, max_connections=connections(n),
                                         **BEDROCK_KEYS).client
    return anthropic.AsyncAnthropicBedrock(base_url=url, max_retries=0, **BEDROCK_KEYS,
                                           http_client=sdk_http_client(anthropic, transport, n))


def openai_client(url: str, transport: str, n: int) -> Any:
    """The SDK client the contenders on Chat Completions send through."""
    import openai

    from loopengine.providers import OpenAIProvider

    if transport == "default":
        return OpenAIProvider(api_key="bench", base_url=url + "/v1",
                              max_connections=connections(n)).client
    return openai.AsyncOpenAI(api_key="bench", base_url=url + "/v1", max_retries=0,
                              http_client=sdk_http_client(openai, transport, n))


def gemini_provider(url: str, transport: str, n: int) -> Any:
    """The `GeminiProvider` the contenders on the Gemini API send through: built
    from keywords (``default``), or on a ``genai.Client`` whose async HTTP client
    is an ``httpx2.AsyncClient`` with room for N connections (``sdk``)."""
    from loopengine.providers import GeminiProvider

    if transport == "default":
        return GeminiProvider(api_key="bench", http_options={"base_url": url},
                              max_connections=connections(n))
    if transport != "sdk":
        raise SystemExit(f"the Gemini contenders take --transport default or sdk, "
                         f"not {transport!r}")
    import httpx2
    from google import genai

    http = httpx2.AsyncClient(limits=httpx2.Limits(
        max_connections=connections(n), max_keepalive_connections=connections(n)))
    return GeminiProvider(genai.Client(api_key="bench", http_options={
        "base_url": url, "httpx_async_client": http}))


def bare_anthropic(url: str, transport: str, n: int) -> Contender:
    """The floor: what a careful hand-written loop on the SDK does per turn."""
    client = anthropic_client(url, transport, n)
    return Contender(functools.partial(bare_run, client), client.close)


def bare_bedrock(url: str, transport: str, n: int) -> Contender:
    """The floor on Amazon Bedrock: the Messages API loop on ``AsyncAnthropicBedrock``."""
    client = bedrock_client(url, transport, n)
    return Contender(functools.partial(bare_run, client, BEDROCK_MODEL), client.close)


def bare_openai(url: str, transport: str, n: int) -> Contender:
    """The floor on Chat Completions."""
    client = openai_client(url, transport, n)
    return Contender(functools.partial(bare_chat_run, client), client.close)


def bare_responses(url: str, transport: str, n: int) -> Contender:
    """The floor on the Responses API."""
    client = openai_client(url, transport, n)
    return Contender(functools.partial(bare_responses_run, client), client.close)


def bare_gemini(url: str, transport: str, n: int) -> Contender:
    """The floor on the Gemini API, on the client a `GeminiProvider` sends through."""
    provider = gemini_provider(url, transport, n)
    return Contender(functools.partial(bare_gemini_run, provider.client.client),
                     provider.aclose)


def engine_contender(url: str, transport: str, n: int, api: str,
                     ledger_dir: Path | None, postgres: str | None = None) -> Contender:
    """`Engine.run` on the provider of ``api`` (``anthropic``, ``openai``,
    ``responses``, ``gemini``, ``bedrock``), with a SQLite ledger in ``ledger_dir``, a
    PostgreSQL ledger on the DSN ``postgres``, or none."""
    import loopengine as le
    from loopengine.providers import AnthropicProvider, OpenAIProvider, OpenAIResponsesProvider

    provider: Any
    # The route the operation names, and the vendor whose price it is.
    route, vendor = {"anthropic": ("anthropic", "anthropic"), "openai": ("openai", "openai"),
                     "responses": ("openai", "openai"), "gemini": ("gemini", "google"),
                     "bedrock": ("aws-bedrock", "aws-bedrock")}[api]
    if api == "anthropic":
        provider = (AnthropicProvider(api_key="bench", base_url=url,
                                      max_connections=connections(n))
                    if transport == "default"
                    else AnthropicProvider(anthropic_client(url, transport, n)))
        model = MODEL
    elif api == "gemini":
        provider = gemini_provider(url, transport, n)
        model = GEMINI_MODEL
    elif api == "bedrock":
        provider = (AnthropicProvider.bedrock(base_url=url, max_connections=connections(n),
                                              **BEDROCK_KEYS)
                    if transport == "default"
                    else AnthropicProvider(bedrock_client(url, transport, n)))
        model = BEDROCK_MODEL
    else:
        kind = OpenAIProvider if api == "openai" else OpenAIResponsesProvider
        provider = (kind(api_key="bench", base_url=url + "/v1",
                         max_connections=connections(n))
                    if transport == "default"
                    else kind(openai_client(url, transport, n)))
        model = OPENAI_MODEL
    operation = le.Operation(name="bench.lookup", provider=route, model=model,
                             max_output_tokens=1024,
                             limits=le.Limits(max_turns=TURNS + 1, total_time=None,
                                              attempt_timeout=600.0))
    prices = le.PriceBook([le.ModelPrice(
        provider=vendor, model=model, input_per_mtok=Decimal(3), output_per_mtok=Decimal(15),
        cache_read_per_mtok=Decimal("0.30"), cache_write_per_mtok=Decimal("3.75"))])
    ledger: Any = None
    if postgres is not None:
        from loopengine.persistence import PostgresLedger

        ledger = PostgresLedger(postgres)
    elif ledger_dir is not None:
        from loopengine.persistence import SQLiteLedger

        ledger = SQLiteLedger(ledger_dir / "bench-concurrency.db")
    timed = TimedLedger(ledger) if ledger is not None else None
    engine = le.Engine(provider, ledger=timed, prices=prices)
    tool = le.tool(lookup)

    async def run() -> str:
        result = await engine.run(operation, QUESTION, tools=[tool])
        if result.outcome is not le.Outcome.COMPLETED or result.turns != TURNS:
            raise RuntimeError(f"loopengine ended {result.outcome}: {result.detail}")
        return str(result.answer)

    async def close() -> None:
        await provider.aclose()
        if ledger is not None:
            await ledger.aclose()

    return Contender(run, close, timed.waits if timed is not None else None)


ROUTE = {"loopengine": "anthropic", "openai": "openai", "responses": "responses",
         "gemini": "gemini", "bedrock": "bedrock"}
"""The route `Engine.run` is measured on, for each ledger-less loopengine contender."""


def build(name: str, url: str, transport: str, n: int, ledger_dir: Path,
          postgres: str | None = None) -> Contender:
    bare = {"bare": bare_anthropic, "openai-bare": bare_openai,
            "responses-bare": bare_responses, "gemini-bare": bare_gemini,
            "bedrock-bare": bare_bedrock}.get(name)
    if bare is not None:
        return bare(url, transport, n)
    if name in ROUTE:
        return engine_contender(url, transport, n, ROUTE[name], None)
    if name == "sqlite":
        return engine_contender(url, transport, n, "anthropic", ledger_dir)
    if name == "postgres":
        if postgres is None:
            raise SystemExit("the postgres contender needs --postgres DSN")
        return engine_contender(url, transport, n, "anthropic", None, postgres)
    raise SystemExit(f"unknown contender {name!r}")


# -- one measurement (a process of its own) ----------------------------------------------------


def helpers_cpu() -> float:
    """CPU seconds so far of this process's child processes other than the
    loopback server: a ledger that writes from a process of its own (older
    versions did) has its CPU counted with the conversations'."""
    total = 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    for task in Path("/proc/self/task").iterdir():
        for pid in (task / "children").read_text().split():
            try:
                if b"_loopback.py" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    continue
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # it ended
            total += (int(fields[11]) + int(fields[12])) / ticks
    return total


def rss() -> int:
    """This process's resident memory now, in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextlib.contextmanager
def fresh_database(dsn: str | None) -> Iterator[str | None]:
    """A database of its own on the server at ``dsn`` for one measurement
    (dropped after), so every round starts from empty tables as SQLite's does."""
    if dsn is None:
        yield None
        return
    import psycopg
    from psycopg.conninfo import make_conninfo

    name = f"loopengine_bench_{os.getpid()}"
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {name}")
        admin.execute(f"CREATE DATABASE {name}")
    try:
        yield make_conninfo(dsn, dbname=name)
    finally:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def measure_one(name: str, n: int, transport: str, rate: float, freeze: bool = False,
                profile: bool = False, memory: bool = False,
                postgres: str | None = None) -> dict[str, Any]:
    """One measurement: its own server, then the N conversations on one event loop."""
    server = subprocess.Popen([sys.executable, str(HERE / "_loopback.py"), "--delay",
                               str(n / rate), "--prompt", str(WARM_UP * TURNS)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    try:
        url = server.stdout.readline().strip()
        with fresh_database(postgres if name == "postgres" else None) as dsn:
            result = asyncio.run(conversations(url, name, n, transport, rate, freeze,
                                               profile, memory, dsn))
        served = json.loads(server.communicate("", timeout=60)[0].strip().splitlines()[-1])
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    result.update(server_busy=served["cpu"] / max(served["wall"], 1e-9),
                  server_requests=served["requests"], server_most_open=served["most_open"])
    return result


async def conversations(url: str, name: str, n: int, transport: str, rate: float,
                        freeze: bool, profile: bool, memory: bool,
                        postgres: str | None = None) -> dict[str, Any]:
    delay = n / rate
    with tempfile.TemporaryDirectory(prefix="loopengine-bench-") as ledger_dir:
        contender = build(name, url, transport, n, Path(ledger_dir), postgres)
        # The server answers these at once.
        if set(await asyncio.gather(*(contender.run() for _ in range(WARM_UP)))) != {ANSWER}:
            raise RuntimeError(f"{name} answered wrongly")
        if contender.waits is not None:
            for waits in contender.waits.values():
                waits.clear()  # the warm-up's writes are not the run's
        gc.collect()
        if freeze:
            # What a server does once it has started: what it holds for good
            # (modules, the SDK's types) leaves the collector's full passes.
            gc.freeze()
        lags: list[float] = []
        pauses: list[float] = []
        full: list[float] = []
        collecting = [0.0]

        def on_gc(phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                collecting[0] = time.perf_counter()
            else:
                pauses.append(time.perf_counter() - collecting[0])
                if info["generation"] == 2:
                    full.append(pauses[-1])

        gc.callbacks.append(on_gc)
        if memory:
            tracemalloc.start()
        peak = base = rss()
        running = True
        snapshot: list[tracemalloc.Snapshot] = []
        tracked: collections.Counter[str] = collections.Counter()
        if memory:
            gc.freeze()  # what is tracked before the conversations start, for the count

        async def ticker() -> None:
            nonlocal peak
            ticks = 0
            began = time.perf_counter()
            while running:
                expected = time.perf_counter() + TICK
                await asyncio.sleep(TICK)
                lags.append(max(0.0, time.perf_counter() - expected))
                ticks += 1
                if ticks % 10 == 0:
                    peak = max(peak, rss())
                if memory and not snapshot and time.perf_counter() - began > delay * 1.5:
                    # Every conversation has started and is waiting on a reply.
                    snapshot.append(tracemalloc.take_snapshot())
                    tracked.update(type(o).__qualname__ for o in gc.get_objects())

        async def conversation(start: float) -> None:
            await asyncio.sleep(start)
            answer = await contender.run()
            if answer != ANSWER:
                raise RuntimeError(f"{name} answered {answer!r}")

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(TICK * 2)
        profiler = cProfile.Profile() if profile else None
        cpu, wall = time.process_time() + helpers_cpu(), time.perf_counter()
        if profiler is not None:
            profiler.enable()
        # Users arrive evenly over one reply's delay: from then on the N
        # conversations ask for `rate` turns a second between them.
        await asyncio.gather(*(conversation(i * delay / n) for i in range(n)))
        if profiler is not None:
            profiler.disable()
        wall = time.perf_counter() - wall
        cpu = time.process_time() + helpers_cpu() - cpu
        peak = max(peak, rss())
        running = False
        await tick
        gc.callbacks.remove(on_gc)
        await contender.close()
    if profiler is not None:
        profiler.dump_stats(PROFILE)
        print(f"the whole profile is in {PROFILE}", file=sys.stderr)
        stats = pstats.Stats(profiler, stream=sys.stderr)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats(40)
    if snapshot:
        print(f"\nobjects the collector tracks, per conversation: {tracked.total() / n:.0f}",
              file=sys.stderr)
        for kind, count in tracked.most_common(25):
            print(f"{count / n:>8.1f}  {kind}", file=sys.stderr)
        total = sum(stat.size for stat in snapshot[0].statistics("filename"))
        print(f"traced memory held at the peak, per conversation: {total / n:.0f} B",
              file=sys.stderr)
        for group in ("filename", "lineno"):
            print(f"\nmemory held at the peak, by {group}, per conversation:", file=sys.stderr)
            for stat in snapshot[0].statistics(group)[:40]:
                print(f"{stat.size / n:>9.0f} B  {stat.count / n:>6.1f} blocks  "
                      f"{stat.traceback}", file=sys.stderr)
    lags.sort()
    durable: dict[str, float] = {}
    for kind, waits in (contender.waits or {}).items():
        if not waits:
            continue  # a ledger that writes some other way (an older one's early dispatch)
        waits.sort()
        durable[f"{kind}_p50"] = waits[len(waits) // 2]
        durable[f"{kind}_p99"] = waits[min(len(waits) - 1, len(waits) * 99 // 100)]
    return {
        **durable,
        "name": name, "n": n, "wall": wall, "cpu_per_turn": cpu / (n * TURNS),
        "busy": cpu / wall,
        "lag_p50": lags[len(lags) // 2], "lag_p99": lags[min(len(lags) - 1, len(lags) * 99 // 100)],
        "lag_max": lags[-1], "gc_max": max(pauses, default=0.0),
        "gc_per_turn": sum(pauses) / (n * TURNS),
        "gc_full": len(full), "gc_full_p50": statistics.median(full) if full else 0.0,
        "rss_per_conversation": (peak - base) / n,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


# -- deterministic counts: N conversations held waiting ----------------------------------------


async def held_replies(url: str) -> int:
    """How many replies the loopback server holds now (``GET /held``)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GET /held HTTP/1.1\r\nhost: bench\r\ncontent-length: 0\r\n\r\n")
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    held = int(await reader.readexactly(length))
    writer.close()
    await writer.wait_closed()
    return held


def full_collection() -> float:
    """Seconds one full collection takes now."""
    began = time.perf_counter()
    gc.collect()
    return time.perf_counter() - began


def count_one(name: str, n: int, transport: str, hold_turn: int) -> dict[str, Any]:
    """Hold N conversations waiting on the reply of turn ``hold_turn`` (the server
    answers the turns before it at once), then count what they hold."""
    server = subprocess.Popen([sys.executable, str(HERE / "_loopback.py"), "--delay", "3600",
                               "--prompt", str(WARM_UP * TURNS), "--hold-turn",
                               str(hold_turn)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    try:
        url = server.stdout.readline().strip()
        result = asyncio.run(held_counts(url, name, n, transport))
        server.communicate("", timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    return result


async def held_counts(url: str, name: str, n: int, transport: str) -> dict[str, Any]:
    gc.collect()
    imported = len(gc.get_objects())
    with tempfile.TemporaryDirectory(prefix="loopengine-bench-") as ledger_dir:
        contender = build(name, url, transport, n, Path(ledger_dir))
        if set(await asyncio.gather(*(contender.run() for _ in range(WARM_UP)))) != {ANSWER}:
            raise RuntimeError(f"{name} answered wrongly")
        gc.collect()
        warm = len(gc.get_objects())
        warm_gc = min(full_collection() for _ in range(7))
        # From here on gc.get_objects() lists only what the conversations add.
        gc.freeze()
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        tasks: list[asyncio.Task[str]] = []
        while len(tasks) < n:
            # Started a few at a time, as users arrive: a thousand connects at
            # once can outlast the client's connect timeout on a busy machine.
            tasks += [asyncio.create_task(contender.run())
                      for _ in range(min(50, n - len(tasks)))]
            while await held_replies(url) < len(tasks):
                ended = [task for task in tasks if task.done()]
                if ended:  # a conversation that is not waiting would never be counted
                    raise RuntimeError(f"{len(ended)} conversations ended while the others "
                                       f"were starting: {ended[0].exception()!r}")
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # every request written, every task at its await
        gc.collect()
        objects = gc.get_objects()
        traced = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        kinds = collections.Counter(type(o).__qualname__ for o in objects)
        tracked = len(objects)
        del objects
        # The pause of a full collection over everything (imports included),
        # the least of a few: the machine's noise only ever adds to it.
        gc.unfreeze()
        full = min(full_collection() for _ in range(7))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await contender.close()
    return {"name": name, "n": n, "imported": imported, "warm": warm, "warm_gc": warm_gc,
            "tracked": tracked / n, "bytes": traced / n, "gc": full,
            "kinds": {kind: count / n for kind, count in kinds.most_common(60)}}


def count_report(results: list[dict[str, Any]], names: list[str], n: int,
                 hold_turn: int) -> None:
    print(f"\n{n} conversations held waiting on the reply of turn {hold_turn + 1}; "
          f"medians of {len(results) // max(1, len(names))} processes each, python "
          f"{sys.version.split()[0]}")
    head = (f"{'contender':<12} {'tracked/conv':>12} {'x floor':>7} {'bytes/conv':>10} "
            f"{'x floor':>7} {'imported':>9} {'warm':>9} {'gc warm':>8} {'gc held':>8} "
            f"{'us/conv':>8}")
    print(head)
    print("-" * len(head))
    for name in names:
        mine = [r for r in results if r["name"] == name]
        floor = [r for r in results if r["name"] == FLOOR[name]]
        tracked, traced = (median([r[key] for r in mine]) for key in ("tracked", "bytes"))
        print(f"{name:<12} {tracked:>12.1f} "
              f"{tracked / median([r['tracked'] for r in floor]):>6.2f}x {traced:>10.0f} "
              f"{traced / median([r['bytes'] for r in floor]):>6.2f}x "
              f"{median([r['imported'] for r in mine]):>9.0f} "
              f"{median([r['warm'] for r in mine]):>9.0f} "
              f"{median([r['warm_gc'] for r in mine]) * 1000:>6.1f}ms "
              f"{median([r['gc'] for r in mine]) * 1000:>6.1f}ms "
              f"{median([(r['gc'] - r['warm_gc']) / n for r in mine]) * 1e6:>8.1f}")
    print("\ntracked: objects the collector tracks, per waiting conversation; bytes: "
          "tracemalloc's, per waiting conversation;\nimported / warm: objects the "
          "collector tracks after the imports / after the warm-up, before the N start;\n"
          "gc warm / held: a full collection's pause after the warm-up / with the N "
          "waiting (least of 7); us/conv: their difference per conversation.")
    print("\nper conversation, by type (the last round):")
    last = {r["name"]: r["kinds"] for r in results}
    kinds = sorted({k for name in names for k in last[name]},
                   key=lambda k: -max(last[name].get(k, 0.0) for name in names))
    print(f"{'type':<40}" + "".join(f"{name:>12}" for name in names))
    for kind in kinds[:40]:
        print(f"{kind[:40]:<40}"
              + "".join(f"{last[name].get(kind, 0.0):>12.1f}" for name in names))


# -- the rounds (the parent process) -----------------------------------------------------------


def spawn(name: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    return finish(name, n, start(name, n, args), args)


def paired(name: str, n: int, round_: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """``name`` and its floor measured at once, each on a core of its own (the
    two swap cores from one round to the next): the contender's result, then
    the floor's, each marked with the pair."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    first, second = cores if round_ % 2 == 0 else cores[::-1]
    running = [(name, start(name, n, args, first)),
               (FLOOR[name], start(FLOOR[name], n, args, second))]
    try:
        done = [finish(who, n, process, args) for who, process in running]
    finally:
        for _, process in running:  # the other one, when one failed
            if process.poll() is None:
                process.kill()
                process.wait()
    for result in done:
        result["pair"] = name
    return done


def start(name: str, n: int, args: argparse.Namespace,
          core: int | None = None) -> subprocess.Popen[str]:
    """A measurement's process, started (on ``core`` alone when one is given:
    its loopback server, a child, inherits the pinning)."""
    command = [sys.executable, str(Path(__file__).resolve()), "--one", name, "-n", str(n),
               "--transport", args.transport, "--rate", str(args.rate)] + (
                   ["--freeze"] if args.freeze else []) + (
                   ["--postgres", args.postgres] if args.postgres else [])
    pin = None if core is None else functools.partial(os.sched_setaffinity, 0, {core})
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=pin)


def finish(name: str, n: int, process: subprocess.Popen[str],
           args: argparse.Namespace) -> dict[str, Any]:
    """A started measurement's result, once its process has ended."""
    try:
        stdout, stderr = process.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        raise SystemExit(f"{name} at N={n} took longer than {args.timeout} s") from None
    if process.returncode != 0:
        raise SystemExit(f"{name} at N={n} failed:\n{stderr[-4000:]}")
    result: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    expected = (n + WARM_UP) * TURNS
    if result["server_requests"] != expected:
        raise SystemExit(f"{name} at N={n}: the server saw {result['server_requests']} "
                         f"requests, not {expected}")
    return result


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def report(results: list[dict[str, Any]], names: list[str], sizes: list[int],
           args: argparse.Namespace) -> None:
    pairing = " (each contender paired with its floor)" if args.paired else ""
    print(f"\n{args.rounds} rounds{pairing}, transport "
          f"{args.transport!r}, {args.rate:g} turns/s asked (each reply held N/rate s ±50%), "
          f"{'gc.freeze() after warm-up, ' if args.freeze else ''}"
          f"python {sys.version.split()[0]}, {os.cpu_count()} cores")
    head = (f"{'contender':<12} {'N':>6} {'wall s':>7} {'CPU/turn ms':>11} {'x floor':>7} "
            f"{'lag p50':>8} {'p99':>7} {'max ms':>8} {'gc max':>7} {'full':>5} {'full p50':>8} "
            f"{'gc/turn':>7} {'KB/conv':>8} "
            f"{'server':>7}")
    print(head)
    print("-" * len(head))
    for n in sizes:
        for name in names:
            mine = [r for r in results if r["name"] == name and r["n"] == n]
            if not mine:
                continue
            ratios = []
            for r in mine:
                floor = [f for f in results if f["name"] == FLOOR[name] and f["n"] == n
                         and f["round"] == r["round"] and f.get("pair") == r.get("pair")]
                if floor:
                    ratios.append(r["cpu_per_turn"] / floor[0]["cpu_per_turn"])
            print(f"{name:<12} {n:>6} {median([r['wall'] for r in mine]):>7.2f} "
                  f"{median([r['cpu_per_turn'] for r in mine]) * 1000:>11.3f} "
                  f"{median(ratios):>6.2f}x "
                  f"{median([r['lag_p50'] for r in mine]) * 1000:>8.1f} "
                  f"{median([r['lag_p99'] for r in mine]) * 1000:>7.1f} "
                  f"{median([r['lag_max'] for r in mine]) * 1000:>8.1f} "
                  f"{median([r['gc_max'] for r in mine]) * 1000:>7.1f} "
                  f"{median([r.get('gc_full', 0) for r in mine]):>5.1f} "
                  f"{median([r.get('gc_full_p50', 0.0) for r in mine]) * 1000:>8.1f} "
                  f"{median([r.get('gc_per_turn', 0.0) for r in mine]) * 1000:>7.3f} "
                  f"{median([r['rss_per_conversation'] for r in mine]) / 1024:>8.1f} "
                  f"{median([r['server_busy'] for r in mine]) * 100:>6.0f}%")
    timed = [name for name in names if any("dispatch_p50" in r for r in results
                                            if r["name"] == name)]
    if timed:
        print(f"\n{'durable writes':<12} {'N':>6} {'dispatch p50':>12} {'p99 ms':>7} "
              f"{'settle p50':>10} {'p99 ms':>7}")
        for n in sizes:
            for name in timed:
                mine = [r for r in results if r["name"] == name and r["n"] == n
                        and "dispatch_p50" in r]
                if mine:
                    print(f"{name:<12} {n:>6} "
                          f"{median([r['dispatch_p50'] for r in mine]) * 1000:>12.2f} "
                          f"{median([r['dispatch_p99'] for r in mine]) * 1000:>7.2f} "
                          f"{median([r['settle_p50'] for r in mine]) * 1000:>10.2f} "
                          f"{median([r['settle_p99'] for r in mine]) * 1000:>7.2f}")
    print("\nlag: how late a 5 ms ticker woke; gc/turn: ms spent in the collector per turn (part "
          "of CPU/turn);\nKB/conv: peak RSS over the run minus RSS before it, per "
          "conversation;\nserver: the loopback server's CPU share of its wall time (under "
          "100%: it was never the bottleneck).")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, action="append", help="conversations at once "
                        "(repeatable; default 100, 1000, 5000, and 10000 with --full)")
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--contenders", help="comma-separated (default: every one; "
                        "postgres only with --postgres)")
    parser.add_argument("--transport", choices=["default", "sdk", "aiohttp"],
                        default="default")
    parser.add_argument("--rate", type=float, default=RATE,
                        help="turns per second the N conversations ask for (default "
                             f"{RATE:g}): each reply is held N/rate seconds (±50%%)")
    parser.add_argument("--freeze", action="store_true",
                        help="gc.freeze() after the warm-up, as a server does once started")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--postgres", metavar="DSN",
                        help="the server the postgres contender writes to (each "
                             "measurement in a database of its own, dropped after)")
    parser.add_argument("--json", type=Path, help="also write every measurement here")
    parser.add_argument("--paired", action="store_true",
                        help="run each contender at the same time as its floor, each on a "
                             "core of its own (swapped each round); ratios within the pair")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--profile", metavar="CONTENDER",
                        help="run CONTENDER once at the first N under cProfile")
    parser.add_argument("--memory", metavar="CONTENDER",
                        help="run CONTENDER once at the first N and show what holds its "
                             "memory while every conversation waits (tracemalloc)")
    parser.add_argument("--count", action="store_true",
                        help="deterministic counts instead of timings: in a fresh process "
                             "per contender and round, N conversations held waiting on a "
                             "reply; prints the objects the collector tracks and the bytes "
                             "tracemalloc sees, per waiting conversation")
    parser.add_argument("--hold-turn", type=int, default=2,
                        help="with --count: the turn (from 0) whose reply is held (default "
                             "2, mid-conversation); the turns before it are answered at once")
    args = parser.parse_args(argv)
    sizes = args.n or ([100, 1000, 5000] + ([10000] if args.full else []))
    if args.one and args.count:
        print(json.dumps(count_one(args.one, sizes[0], args.transport, args.hold_turn)))
        return 0
    if args.one or args.profile or args.memory:
        result = measure_one(args.one or args.profile or args.memory, sizes[0],
                             args.transport, args.rate, freeze=args.freeze,
                             profile=bool(args.profile), memory=bool(args.memory),
                             postgres=args.postgres)
        print(json.dumps(result))
        return 0
    names = ([c for c in args.contenders.split(",") if c] if args.contenders else
             [c for c in CONTENDERS if c != "postgres" or args.postgres])
    if "postgres" in names and not args.postgres:
        parser.error("the postgres contender needs --postgres DSN")
    for name in names:
        if name not in CONTENDERS:
            parser.error(f"unknown contender {name!r} (known: {', '.join(CONTENDERS)})")
    skipped = [reason for reason in map(missing_sdk, names) if reason is not None]
    for reason in skipped:
        print(f"skipped {reason}", file=sys.stderr)
    names = [name for name in names if missing_sdk(name) is None]
    if args.count:
        names = [*dict.fromkeys([FLOOR[name] for name in names] + names)]
        counted: list[dict[str, Any]] = []
        for round_ in range(args.rounds):
            order = names[round_ % len(names):] + names[:round_ % len(names)]
            for name in order:
                command = [sys.executable, str(Path(__file__).resolve()), "--one", name,
                           "--count", "-n", str(sizes[0]), "--transport", args.transport,
                           "--hold-turn", str(args.hold_turn)]
                done = subprocess.run(command, capture_output=True, text=True,
                                      timeout=args.timeout)
                if done.returncode != 0:
                    raise SystemExit(f"{name} failed:\n{done.stderr[-4000:]}")
                counted.append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(f"round {round_ + 1} {name:<12} {counted[-1]['tracked']:.1f} tracked, "
                      f"{counted[-1]['bytes']:.0f} B per conversation", file=sys.stderr,
                      flush=True)
        if args.json:
            args.json.write_text(json.dumps(counted, indent=1))
        count_report(counted, names, sizes[0], args.hold_turn)
        return 0
    results: list[dict[str, Any]] = []
    if args.paired and len(os.sched_getaffinity(0)) < 2:
        parser.error("--paired needs two cores")
    # Paired, a round runs each contender beside its floor; else each alone.
    each = [name for name in names if FLOOR[name] != name] if args.paired else names
    for round_ in range(args.rounds):
        for n in sizes:
            for name in each[round_ % len(each):] + each[:round_ % len(each)]:
                measured = paired(name, n, round_, args) if args.paired else [spawn(name, n, args)]
                for result in measured:
                    result["round"] = round_
                    results.append(result)
                print(f"round {round_ + 1} N={n:<6} {name:<12} CPU/turn "
                      f"{measured[0]['cpu_per_turn'] * 1000:.3f} ms, " + (
                          f"its floor {measured[1]['cpu_per_turn'] * 1000:.3f} ms "
                          f"({measured[0]['cpu_per_turn'] / measured[1]['cpu_per_turn']:.2f}x)"
                          if args.paired else
                          f"lag max {measured[0]['lag_max'] * 1000:.0f} ms, "
                          f"{measured[0]['wall']:.1f} s"),
                      file=sys.stderr, flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    report(results, names, sizes, args)
    for reason in skipped:
        print(f"skipped {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
