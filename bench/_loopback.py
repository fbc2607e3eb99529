"""A fast loopback model server for bench/concurrency.py, run in a process of its own.

``python bench/_loopback.py [--delay S] [--prompt K] [--seed N]`` listens on 127.0.0.1 (a
free port), prints ``http://127.0.0.1:<port>``, and serves both wire formats
until standard input ends; then it prints one JSON line of what it did
(requests, most connections open at once, its own CPU seconds and wall
seconds).

It answers the five-turn tool conversation of bench/_conversation.py: the
model asks for the ``lookup`` tool four times, then answers in text. It speaks
the wire format its request's path names: the Messages API (``/v1/messages``),
the Messages API as Amazon Bedrock serves it (``/model/{modelId}/invoke``: the
same bodies, the model in the path; the AWS signature is not checked),
Chat Completions (``/chat/completions``), the Responses API (``/v1/responses``)
and the Gemini API (``models/{model}:generateContent``), all in JSON (no
streams). Which turn a request is on is read off its body by counting the
tool results it carries (``"tool_use_id"`` for the Messages API and Bedrock,
``"tool_call_id"`` for Chat Completions, ``"function_call_output"`` for the
Responses API, ``"functionResponse"`` for Gemini), so the server keeps no
state per conversation and any number of conversations share it. Every reply
is prebuilt bytes.

It is an ``asyncio.Protocol`` (no HTTP framework): HTTP/1.1 with keep-alive,
``Content-Length`` bodies, no pipelining needed. ``--delay S`` holds each
reply for a time drawn uniformly from [S/2, 3S/2] (a model's latency, so
that conversations wait on the wire as they do in production, and their
replies arrive spread out rather than in lock-step); the first ``--prompt K``
requests are answered at once (a client's warm-up), and with ``--hold-turn T``
so are the requests of every turn before turn T (counted from 0), so that
the held conversations wait on a reply with a transcript of T turns.
``GET /held`` answers with the number of replies held at that moment (the
requests the server has read whole and not answered yet): a client that sees
N there knows its N conversations are all waiting on the server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _conversation import (  # noqa: E402
    TOOL_TURNS,
    chat_completions,
    gemini_responses,
    messages,
    responses,
)


def anthropic_bodies() -> list[bytes]:
    """The five Messages API replies, turn by turn."""
    return [json.dumps(m).encode() for m in messages()]


def _response(body: bytes,
              ids: bytes = b"request-id: req_bench\r\nx-request-id: req_bench\r\n") -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n" + ids
            + b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


ANTHROPIC = [_response(b) for b in anthropic_bodies()]
BEDROCK = [_response(b, b"x-amzn-requestid: req_bench\r\n") for b in anthropic_bodies()]
OPENAI = [_response(json.dumps(r).encode()) for r in chat_completions()]
RESPONSES = [_response(json.dumps(r).encode()) for r in responses()]
GEMINI = [_response(json.dumps(r).encode()) for r in gemini_responses()]
NOT_FOUND = b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"


class Stats:
    """What the server did, for its closing line."""

    def __init__(self) -> None:
        self.requests = 0
        self.open = 0
        self.most_open = 0
        self.connections = 0
        self.held = 0


class Connection(asyncio.Protocol):
    """One client connection: parse requests off the buffer, answer each."""

    def __init__(self, stats: Stats, delay: float, prompt: int, rng: random.Random,
                 hold_turn: int = 0) -> None:
        self.stats = stats
        self.prompt = prompt
        self.hold_turn = hold_turn
        self.delay = delay
        self.rng = rng
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.loop = asyncio.get_running_loop()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.stats.connections += 1
        self.stats.open += 1
        self.stats.most_open = max(self.stats.most_open, self.stats.open)

    def connection_lost(self, exc: Exception | None) -> None:
        self.stats.open -= 1
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buffer[:end]).lower()
            at = head.find(b"content-length:")
            length = 0
            if at >= 0:
                stop = head.find(b"\r\n", at)
                length = int(head[at + 15:stop if stop >= 0 else len(head)])
            if len(self.buffer) < end + 4 + length:
                return
            body = bytes(self.buffer[end + 4:end + 4 + length])
            del self.buffer[:end + 4 + length]
            self.answer(head[:head.find(b"\r\n")], body)

    def answer(self, line: bytes, body: bytes) -> None:
        if line.startswith(b"get /held "):
            held = str(self.stats.held).encode()
            self.write(b"HTTP/1.1 200 OK\r\ncontent-length: " + str(len(held)).encode()
                       + b"\r\n\r\n" + held)
            return
        self.stats.requests += 1
        turn = 0
        if b"/chat/completions" in line:
            turn = min(body.count(b'"tool_call_id"'), TOOL_TURNS)
            reply = OPENAI[turn]
        elif b"/v1/messages" in line:
            turn = min(body.count(b'"tool_use_id"'), TOOL_TURNS)
            reply = ANTHROPIC[turn]
        elif b"/invoke " in line:  # Bedrock's InvokeModel: /model/{modelId}/invoke
            turn = min(body.count(b'"tool_use_id"'), TOOL_TURNS)
            reply = BEDROCK[turn]
        elif b"/v1/responses" in line:
            turn = min(body.count(b'"function_call_output"'), TOOL_TURNS)
            reply = RESPONSES[turn]
        elif b":generatecontent" in line:  # the request line, lowercased with the head
            turn = min(body.count(b'"functionResponse"'), TOOL_TURNS)
            reply = GEMINI[turn]
        else:
            reply = NOT_FOUND
        if self.delay > 0 and self.stats.requests > self.prompt and turn >= self.hold_turn:
            self.stats.held += 1
            self.loop.call_later(self.delay * (0.5 + self.rng.random()), self.release, reply)
        else:
            self.write(reply)

    def release(self, reply: bytes) -> None:
        self.stats.held -= 1
        self.write(reply)

    def write(self, reply: bytes) -> None:
        if self.transport is not None:
            self.transport.write(reply)


async def serve(delay: float, prompt: int, seed: int, hold_turn: int = 0) -> None:
    stats = Stats()
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Connection(stats, delay, prompt, rng, hold_turn),
                                      "127.0.0.1", 0, backlog=16384)
    port = server.sockets[0].getsockname()[1]
    print(f"http://127.0.0.1:{port}", flush=True)
    cpu, wall = time.process_time(), time.perf_counter()
    await loop.run_in_executor(None, sys.stdin.read)
    server.close()
    print(json.dumps({"requests": stats.requests, "connections": stats.connections,
                      "most_open": stats.most_open, "cpu": time.process_time() - cpu,
                      "wall": time.perf_counter() - wall}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--prompt", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hold-turn", type=int, default=0)
    args = parser.parse_args()
    asyncio.run(serve(args.delay, args.prompt, args.seed, args.hold_turn))


if __name__ == "__main__":
    main()
