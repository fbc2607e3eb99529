"""The five-turn tool conversation every benchmark plays, and the floor's loop.

The model asks for the ``lookup`` tool four times, then answers in text; its
usage grows turn by turn, as a real conversation's does (so no price is ever
computed twice for the same counts). Standard library only, so the loopback
server's process imports no SDK.
"""

from __future__ import annotations

from typing import Any

MODEL = "claude-sonnet-4-5"
OPENAI_MODEL = "gpt-4.1-mini"
QUESTION = "What are the values of keys a, b, c and d?"
TURNS = 5
TOOL_TURNS = TURNS - 1
ANSWER = "The values are 1, 2, 3 and 4."
OUTPUT_TOKENS = 30
TOOL_SCHEMA = {"type": "object", "properties": {"key": {"type": "string"}},
               "required": ["key"]}
TOOLS: list[Any] = [{"name": "lookup", "description": "Look a key up.",
                     "input_schema": TOOL_SCHEMA}]
"""The tool as the Messages API takes it."""


def usage(turn: int) -> dict[str, int]:
    """The Messages API usage of ``turn``."""
    return {"input_tokens": 40 + 80 * turn, "output_tokens": OUTPUT_TOKENS,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 1000 * turn}


def messages() -> list[dict[str, Any]]:
    """The model's five messages, as the Messages API returns them."""
    out = []
    for turn in range(TURNS):
        if turn < TOOL_TURNS:
            content: list[dict[str, Any]] = [
                {"type": "text", "text": "Let me look that up."},
                {"type": "tool_use", "id": f"toolu_{turn:04d}", "name": "lookup",
                 "input": {"key": "abcd"[turn]}},
            ]
            stop = "tool_use"
        else:
            content, stop = [{"type": "text", "text": ANSWER}], "end_turn"
        out.append({
            "id": f"msg_{turn:04d}", "type": "message", "role": "assistant", "model": MODEL,
            "content": content, "stop_reason": stop, "stop_sequence": None, "usage": usage(turn),
        })
    return out


async def lookup(key: str) -> str:
    """Look a key up."""
    return str("abcd".index(key) + 1)


async def bare_run(client: Any) -> str:
    """The floor: one conversation as a careful hand-written loop on an
    ``anthropic.AsyncAnthropic`` client plays it; returns the answer."""
    history: list[Any] = [{"role": "user", "content": QUESTION}]
    while True:
        response = await client.messages.create(model=MODEL, max_tokens=1024,
                                                messages=history, tools=TOOLS)
        history.append({"role": "assistant", "content": response.content})
        if response.stop_reason != "tool_use":
            return "".join(b.text for b in response.content if b.type == "text")
        results = []
        for block in response.content:
            if block.type == "tool_use":
                results.append({"type": "tool_result", "tool_use_id": block.id,
                                "content": await lookup(**block.input)})
        history.append({"role": "user", "content": results})
