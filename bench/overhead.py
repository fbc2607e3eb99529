"""The per-turn cost of loopengine, side by side with a bare loop and its peers.

One five-turn tool conversation (the model asks for a tool four times, then
answers in text) runs again and again on one in-process transport: an
``httpx2.MockTransport`` under the ``anthropic`` SDK that answers from
prebuilt bytes, so nothing but the client-side code is measured. Each
contender gets its own client on its own copy of that transport:

* ``bare SDK loop``: a hand-written loop on ``client.messages.create`` (the floor);
* ``loopengine``: `Engine.run` on `AnthropicProvider`, no ledger, the model
  priced by a `PriceBook` entry (an operation's published price);
* ``loopengine, genai-prices``: the same, priced by the genai-prices fallback;
* ``loopengine + SQLite``: with a `SQLiteLedger` (if installed) and the entry;
* ``loopengine + PostgreSQL``: with a `PostgresLedger` on ``--postgres DSN``
  (only when given; the server's own CPU is another process's, not counted);
* ``pydantic-ai Agent`` and ``SDK tool_runner``: the peers a user would pick
  instead (``pip install -e '.[bench]'``; skipped when missing);
* ``chat-bare`` and ``chat``: on Chat Completions, a hand-written loop on
  ``client.chat.completions.create`` (its floor) and `Engine.run` on
  `OpenAIProvider`, through the ``openai`` SDK on the same kind of
  ``httpx2.MockTransport`` (the extra ``openai``; skipped when missing);
* ``responses-bare`` and ``responses``: the same on the Responses API, with
  ``client.responses.create`` and `OpenAIResponsesProvider`;
* ``gemini-bare`` and ``gemini``: on the Gemini API, a hand-written loop on
  ``client.aio.models.generate_content`` (its floor) and `Engine.run` on
  `GeminiProvider`, through ``google-genai``, whose ``http_options`` take the
  ``httpx2.AsyncClient`` on that transport as ``httpx_async_client`` (the
  extra ``gemini``; skipped when missing);
* ``bedrock-bare`` and ``bedrock``: Claude on Amazon Bedrock, a hand-written
  loop on ``AsyncAnthropicBedrock.messages.create`` (its floor) and
  `Engine.run` on `AnthropicProvider` over an ``AsyncAnthropicBedrock``
  client, each on its own ``httpx2.MockTransport`` of the Messages API's
  replies (what Bedrock's ``invoke`` returns), every request signed with
  fake AWS keys (SigV4; the extra ``bedrock``; skipped when missing).

Every ratio is to the floor on the contender's own API (``x floor``): the
bare Messages API loop for the Anthropic contenders and the peers, the bare
Bedrock loop for Bedrock's.

Contenders are interleaved round by round; a time is the median over the
rounds and a ratio the median of the ratios within each round, so a slow
moment of the machine hits all of them alike. CPU time is the process's
(every thread, the ledger's writer thread included); the part outside the
event loop's thread is shown apart as "elsewhere". Wall time also holds the ledger's fsyncs
(``synchronous=FULL``), each dispatch awaited before its request is
built, so put ``--ledger-dir`` on the disk you mean to measure.

The sequential cost of durability: a reply's settle is on disk before its
tool handlers run (docs/ledger.md), so on this path every turn costs two
commits of the writer (its dispatch, and its reply's settle) where it cost
one when settles rode the next dispatch. Measured with ``--conversations 20
--rounds 7`` on the 2-core development machine (a temp-dir ledger, the
machine busy), before and after that change: "loopengine + SQLite ledger"
went from 1.67x to 2.17x the bare loop's CPU per turn and from 2.18x to
2.29x its wall time per turn. Under concurrency the settles share commits
with every other run's writes, as the dispatches do (bench/ledger.py).

Run::

    python bench/overhead.py                # defaults: 40 conversations x 15 rounds
    python bench/overhead.py --conversations 300 --rounds 9 --profile loopengine
    python bench/overhead.py --only gemini  # the Gemini pair (and the Messages floor)
    python bench/overhead.py --profile responses
    python bench/overhead.py --only bedrock # the Bedrock pair (and the Messages floor)
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import dataclasses
import functools
import gc
import importlib.util
import json
import platform
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import anthropic
import httpx2
from _conversation import (
    ANSWER,
    BEDROCK_MODEL,
    GEMINI_MODEL,
    MODEL,
    OPENAI_MODEL,
    OUTPUT_TOKENS,
    QUESTION,
    TOOL_TURNS,
    TURNS,
    bare_chat_run,
    bare_gemini_run,
    bare_responses_run,
    bare_run,
    chat_completions,
    gemini_responses,
    lookup,
    messages,
    responses,
)

import loopengine as le
from loopengine.providers import AnthropicProvider


def _sse(message: dict[str, Any]) -> bytes:
    """``message`` as the API streams it (for the peers that always stream)."""
    events: list[dict[str, Any]] = [{"type": "message_start", "message": {
        **message, "content": [], "stop_reason": None,
        "usage": {**message["usage"], "output_tokens": 1}}}]
    for index, block in enumerate(message["content"]):
        if block["type"] == "text":
            events.append({"type": "content_block_start", "index": index,
                           "content_block": {"type": "text", "text": ""}})
            events.append({"type": "content_block_delta", "index": index,
                           "delta": {"type": "text_delta", "text": block["text"]}})
        else:
            events.append({"type": "content_block_start", "index": index,
                           "content_block": {**block, "input": {}}})
            events.append({"type": "content_block_delta", "index": index, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(block["input"])}})
        events.append({"type": "content_block_stop", "index": index})
    events.append({"type": "message_delta", "delta": {"stop_reason": message["stop_reason"],
                                                      "stop_sequence": None},
                   "usage": {"output_tokens": OUTPUT_TOKENS}})
    events.append({"type": "message_stop"})
    return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events).encode()


BODIES = [json.dumps(m).encode() for m in messages()]
STREAMS = [_sse(m) for m in messages()]
HEADERS = {"content-type": "application/json", "request-id": "req_bench"}
SSE_HEADERS = {"content-type": "text/event-stream", "request-id": "req_bench"}


CHAT_BODIES = [json.dumps(r).encode() for r in chat_completions()]
RESPONSES_BODIES = [json.dumps(r).encode() for r in responses()]
GEMINI_BODIES = [json.dumps(r).encode() for r in gemini_responses()]
OPENAI_HEADERS = {"content-type": "application/json", "x-request-id": "req_bench"}
GEMINI_HEADERS = {"content-type": "application/json"}


class ScriptedTransport(httpx2.MockTransport):
    """Answers the five turns of one conversation in order, then starts over:
    from ``bodies`` (JSON), or from `STREAMS` for a request that asks to stream."""

    def __init__(self, bodies: list[bytes] = BODIES,
                 headers: dict[str, str] = HEADERS) -> None:
        self.turn = 0
        self.bodies = bodies
        self.headers = headers
        super().__init__(self._answer)

    def _answer(self, request: httpx2.Request) -> httpx2.Response:
        turn = self.turn % TURNS
        self.turn += 1
        if b'"stream":true' in request.content or b'"stream": true' in request.content:
            return httpx2.Response(200, content=STREAMS[turn], headers=SSE_HEADERS)
        return httpx2.Response(200, content=self.bodies[turn], headers=self.headers)


def make_client() -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(
        api_key="bench", base_url="http://bench.invalid", max_retries=0,
        http_client=httpx2.AsyncClient(transport=ScriptedTransport()),
    )


# -- the contenders ------------------------------------------------------------------------

Conversation = Callable[[], Awaitable[str]]


@dataclass
class Contender:
    name: str
    run: Conversation
    close: Callable[[], Awaitable[None]]
    key: str = ""
    """Its short name (``--profile``, ``--only``): ``bare``, ``responses``..."""
    floor: str = "bare"
    """The key of the floor on its API, whose ratios it is reported with."""
    cpu: list[float] = field(default_factory=list)
    threads: list[float] = field(default_factory=list)
    """The part of `cpu` spent outside the event loop's thread (the ledger's writer)."""
    wall: list[float] = field(default_factory=list)


async def bare_loop() -> Contender:
    """The floor: what a careful hand-written loop on the SDK does per turn."""
    client = make_client()

    async def run() -> str:
        return await bare_run(client)

    return Contender("bare SDK loop (floor)", run, client.close, key="bare")


OPERATION = le.Operation(name="bench.lookup", provider="anthropic", model=MODEL,
                         max_output_tokens=1024, limits=le.Limits(max_turns=TURNS + 1))
TOOL = le.tool(lookup)
# The operation's published price (docs/pricing.md); without it every attempt is
# priced from genai-prices' data, measured as its own row.
PRICE = le.ModelPrice(
    provider="anthropic", model=MODEL, input_per_mtok=Decimal(3), output_per_mtok=Decimal(15),
    cache_read_per_mtok=Decimal("0.30"), cache_write_per_mtok=Decimal("3.75"))
PRICES = le.PriceBook([PRICE])


async def loopengine_run(ledger: Any = None, name: str = "loopengine, no ledger",
                         prices: le.PriceBook | None = PRICES,
                         key: str = "loopengine") -> Contender:
    client = make_client()
    engine = le.Engine(AnthropicProvider(client), ledger=ledger, prices=prices)

    async def run() -> str:
        result = await engine.run(OPERATION, QUESTION, tools=[TOOL])
        if result.outcome is not le.Outcome.COMPLETED or result.turns != TURNS:
            raise RuntimeError(f"loopengine ended {result.outcome}: {result.detail}")
        return str(result.answer)

    async def close() -> None:
        await client.close()
        if ledger is not None:
            await ledger.aclose()

    return Contender(name, run, close, key=key)


async def engine_on(provider: Any, route: str, vendor: str, model: str, name: str, key: str,
                    close: Callable[[], Awaitable[None]]) -> Contender:
    """`Engine.run` on ``provider`` (the route ``route``), no ledger, the model priced
    by a `PriceBook` entry of ``vendor``'s (the same prices as `PRICES`)."""
    prices = le.PriceBook([dataclasses.replace(PRICE, provider=vendor, model=model)])
    engine = le.Engine(provider, prices=prices)
    operation = dataclasses.replace(OPERATION, provider=route, model=model)

    async def run() -> str:
        result = await engine.run(operation, QUESTION, tools=[TOOL])
        if result.outcome is not le.Outcome.COMPLETED or result.turns != TURNS:
            raise RuntimeError(f"loopengine ended {result.outcome}: {result.detail}")
        return str(result.answer)

    return Contender(name, run, close, key=key, floor=f"{key}-bare")


def floor_on(key: str, run: Conversation, close: Callable[[], Awaitable[None]]) -> Contender:
    """The bare SDK loop ``run``: the floor of the route ``key`` (``responses``...)."""
    return Contender(f"{key}-bare SDK loop (floor)", run, close, key=f"{key}-bare",
                     floor=f"{key}-bare")


def openai_client(bodies: list[bytes]) -> Any:
    """An ``openai.AsyncOpenAI`` on its own `ScriptedTransport` of ``bodies``."""
    import openai

    return openai.AsyncOpenAI(
        api_key="bench", base_url="http://bench.invalid/v1", max_retries=0,
        http_client=httpx2.AsyncClient(transport=ScriptedTransport(bodies, OPENAI_HEADERS)))


async def openai_pairs() -> list[Contender | str]:
    """The floors of Chat Completions and the Responses API and loopengine on
    each, or why they cannot run."""
    if importlib.util.find_spec("openai") is None:
        return ["chat-bare, chat, responses-bare, responses: the openai SDK is not installed "
                "(pip install -e '.[openai]')"]
    from loopengine.providers import OpenAIProvider, OpenAIResponsesProvider

    pairs: list[Contender | str] = []
    for key, bodies, bare, provider in (
            ("chat", CHAT_BODIES, bare_chat_run, OpenAIProvider),
            ("responses", RESPONSES_BODIES, bare_responses_run, OpenAIResponsesProvider)):
        client, engine_client = openai_client(bodies), openai_client(bodies)
        pairs += [floor_on(key, functools.partial(bare, client), client.close),
                  await engine_on(provider(engine_client), "openai", "openai", OPENAI_MODEL,
                                  f"{key}: loopengine", key, engine_client.close)]
    return pairs


def gemini_client() -> tuple[Any, httpx2.AsyncClient]:
    """A ``google.genai.Client`` whose async HTTP client is on its own
    `ScriptedTransport` of Gemini API replies, and that HTTP client (the SDK
    leaves a client it was given open)."""
    from google import genai

    http = httpx2.AsyncClient(transport=ScriptedTransport(GEMINI_BODIES, GEMINI_HEADERS))
    return genai.Client(api_key="bench", http_options={
        "base_url": "http://bench.invalid", "httpx_async_client": http}), http


async def gemini_pair() -> list[Contender | str]:
    """The Gemini API's floor and loopengine on it, or why they cannot run."""
    try:
        found = importlib.util.find_spec("google.genai") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        return ["gemini-bare, gemini: the google-genai SDK is not installed "
                "(pip install -e '.[gemini]')"]
    from loopengine.providers import GeminiProvider

    (client, http), (engine_client, engine_http) = gemini_client(), gemini_client()
    return [floor_on("gemini", functools.partial(bare_gemini_run, client), http.aclose),
            await engine_on(GeminiProvider(engine_client), "gemini", "google", GEMINI_MODEL,
                            "gemini: loopengine", "gemini", engine_http.aclose)]


def bedrock_client() -> Any:
    """An ``anthropic.AsyncAnthropicBedrock`` with fake AWS keys (each request is
    signed as a real one is) on its own `ScriptedTransport` of Messages API replies."""
    return anthropic.AsyncAnthropicBedrock(
        aws_region="us-east-1", aws_access_key="AKIDBENCHMARK", aws_secret_key="bench-secret",
        base_url="http://bench.invalid", max_retries=0,
        http_client=httpx2.AsyncClient(transport=ScriptedTransport(
            BODIES, {**HEADERS, "x-amzn-requestid": "req_bench"})))


async def bedrock_pair() -> list[Contender | str]:
    """Amazon Bedrock's floor and loopengine on it, or why they cannot run."""
    if importlib.util.find_spec("botocore") is None:
        return ["bedrock-bare, bedrock: botocore is not installed "
                "(pip install -e '.[bedrock]')"]
    client, engine_client = bedrock_client(), bedrock_client()
    return [floor_on("bedrock", functools.partial(bare_run, client, BEDROCK_MODEL),
                     client.close),
            await engine_on(AnthropicProvider(engine_client), "aws-bedrock", "aws-bedrock",
                            BEDROCK_MODEL, "bedrock: loopengine", "bedrock",
                            engine_client.close)]


async def loopengine_sqlite(directory: Path) -> Contender | str:
    try:
        from loopengine.persistence import SQLiteLedger  # type: ignore[attr-defined]
    except ImportError:
        return "loopengine.persistence.SQLiteLedger is not available"
    ledger = SQLiteLedger(directory / "bench-ledger.db")
    return await loopengine_run(ledger, name="loopengine + SQLite ledger", key="sqlite")


async def loopengine_postgres(dsn: str | None) -> Contender | str:
    if dsn is None:
        return "loopengine + PostgreSQL: no --postgres DSN given"
    from loopengine.persistence import PostgresLedger

    return await loopengine_run(PostgresLedger(dsn), name="loopengine + PostgreSQL ledger",
                                key="postgres")


async def pydantic_ai_agent() -> Contender | str:
    if importlib.util.find_spec("pydantic_ai") is None:
        return "pydantic-ai is not installed (pip install -e '.[bench]')"
    from pydantic_ai import Agent
    from pydantic_ai.models.anthropic import AnthropicModel
    from pydantic_ai.providers.anthropic import AnthropicProvider as PydanticAnthropicProvider

    client = make_client()
    model = AnthropicModel(MODEL, provider=PydanticAnthropicProvider(anthropic_client=client))
    agent = Agent(model, tools=[lookup])

    async def run() -> str:
        result = await agent.run(QUESTION)
        return str(result.output)

    return Contender("pydantic-ai Agent", run, client.close, key="pydantic-ai")


async def sdk_tool_runner() -> Contender | str:
    try:
        from anthropic import beta_async_tool
    except ImportError:
        return "this anthropic SDK has no tool runner"
    client = make_client()
    tool = beta_async_tool(lookup)

    async def run() -> str:
        runner = client.beta.messages.tool_runner(
            model=MODEL, max_tokens=1024, tools=[tool],
            messages=[{"role": "user", "content": QUESTION}])
        message = await runner.until_done()
        return "".join(b.text for b in message.content if b.type == "text")

    return Contender("SDK tool_runner", run, client.close, key="tool-runner")


# -- measuring ---------------------------------------------------------------------------------


async def measure(contender: Contender, conversations: int) -> None:
    gc.collect()
    cpu, own, wall = time.process_time(), time.thread_time(), time.perf_counter()
    for _ in range(conversations):
        answer = await contender.run()
        if answer != ANSWER:
            raise RuntimeError(f"{contender.name} answered {answer!r}")
    turns = conversations * TURNS
    cpu, own = time.process_time() - cpu, time.thread_time() - own
    wall = time.perf_counter() - wall
    contender.cpu.append(cpu / turns)
    contender.threads.append(max(0.0, cpu - own) / turns)
    contender.wall.append(wall / turns)


async def main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(dir=args.ledger_dir) as tmp:
        built = [await bare_loop(), await loopengine_run(),
                 await loopengine_run(name="loopengine, genai-prices", prices=le.PriceBook(),
                                     key="genai-prices"),
                 await loopengine_sqlite(Path(tmp)), await loopengine_postgres(args.postgres),
                 await pydantic_ai_agent(), await sdk_tool_runner(),
                 *await openai_pairs(), *await gemini_pair(), *await bedrock_pair()]
        contenders = [c for c in built if isinstance(c, Contender)]
        skipped = [c for c in built if isinstance(c, str)]
        if args.only:
            chosen = [c for c in contenders if args.only in c.name or args.only == c.key]
            floors = {c.floor for c in chosen} | {"bare"}
            contenders = [c for c in contenders if c in chosen or c.key in floors]
        try:
            for contender in contenders:  # warm up: imports, caches, connection set-up
                for _ in range(args.warmup):
                    await contender.run()
            if args.profile:
                (target,) = ([c for c in contenders if c.key == args.profile]
                             or [c for c in contenders if c.name.startswith(args.profile)])
                profiler = cProfile.Profile()
                profiler.enable()
                for _ in range(args.conversations):
                    await target.run()
                profiler.disable()
                pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)
                return 0
            for _ in range(args.rounds):
                for contender in contenders:
                    await measure(contender, args.conversations)
        finally:
            for contender in contenders:
                await contender.close()
    report(contenders, skipped, args)
    return 0


def ratio(values: list[float], floor: list[float]) -> float:
    """The median over rounds of the ratio to the floor *in the same round*: a
    busy moment of the machine slows a round's contenders alike."""
    return statistics.median(v / f for v, f in zip(values, floor, strict=True))


def report(contenders: list[Contender], skipped: list[str], args: argparse.Namespace) -> None:
    floors = {c.key: c for c in contenders if c.key == c.floor}
    print(f"loopengine {le.__version__} / anthropic {anthropic.__version__} / "
          f"Python {platform.python_version()} on {platform.machine()}")
    print(f"{TURNS}-turn tool conversation ({TOOL_TURNS} tool_use + 1 text) on "
          "httpx2.MockTransport; medians of "
          f"{args.rounds} rounds x {args.conversations} conversations")
    print("command: python bench/overhead.py " + " ".join(sys.argv[1:]))
    print()
    print(f"{'':32} {'CPU/turn':>10} {'x floor':>7} {'wall/turn':>10} {'x floor':>7} "
          f"{'elsewhere':>10}")
    for c in contenders:
        floor = floors[c.floor]
        cpu, wall = statistics.median(c.cpu), statistics.median(c.wall)
        print(f"{c.name:32} {cpu * 1e6:8.0f}µs {ratio(c.cpu, floor.cpu):7.2f} "
              f"{wall * 1e6:8.0f}µs {ratio(c.wall, floor.wall):7.2f} "
              f"{statistics.median(c.threads) * 1e6:8.0f}µs")
    print("x floor: to the bare SDK loop on the same API (chat-*: Chat Completions, "
          "responses-*: the Responses API,\ngemini-*: the Gemini API, bedrock-*: Amazon "
          "Bedrock, the others: the Messages API); elsewhere: the part of "
          "CPU/turn outside the event loop's thread\n(the ledger's writer thread, its fsyncs' "
          "system time)")
    for reason in skipped:
        print(f"skipped: {reason}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=40,
                        help="conversations per contender per round (default 40)")
    parser.add_argument("--rounds", type=int, default=15, help="rounds (default 15)")
    parser.add_argument("--warmup", type=int, default=20,
                        help="unmeasured conversations first (default 20)")
    parser.add_argument("--ledger-dir", default=None,
                        help="where the SQLite ledger file goes (default: the temp dir)")
    parser.add_argument("--postgres", default=None, metavar="DSN",
                        help="also measure a PostgresLedger on this server")
    parser.add_argument("--only", default=None,
                        help="measure only contenders whose name contains this, or whose "
                             "key it is (bare, chat, responses, gemini...), and their floors")
    parser.add_argument("--profile", default=None, metavar="NAME",
                        help="profile the contender whose key is NAME (responses, gemini...) "
                             "or whose name starts with NAME instead")
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse())))
