"""The five-turn tool conversation every benchmark plays, and the floors' loops.

The model asks for the ``lookup`` tool four times, then answers in text; its
usage grows turn by turn, as a real conversation's does (so no price is ever
computed twice for the same counts). Its replies are here in the shapes of
the Messages API (`messages`, which Bedrock's ``invoke`` returns too), the
Responses API (`responses`) and the Gemini API (`gemini_responses`); the
floors are hand-written loops on each SDK's call (`bare_run`,
`bare_responses_run`, `bare_gemini_run`). Standard
library only, so the loopback server's process imports no SDK.
"""

from __future__ import annotations

import json
from typing import Any

MODEL = "claude-sonnet-4-5"
OPENAI_MODEL = "gpt-4.1-mini"
GEMINI_MODEL = "gemini-2.5-flash"
BEDROCK_MODEL = "global.anthropic.claude-sonnet-4-5-20250929-v1:0"
"""Claude on Amazon Bedrock: the inference profile is the model, in the request's path."""
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


async def bare_run(client: Any, model: str = MODEL) -> str:
    """The floor: one conversation as a careful hand-written loop on an
    ``anthropic.AsyncAnthropic`` client (or ``AsyncAnthropicBedrock``, with
    ``model`` its Bedrock id) plays it; returns the answer."""
    history: list[Any] = [{"role": "user", "content": QUESTION}]
    while True:
        response = await client.messages.create(model=model, max_tokens=1024,
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


# -- Chat Completions ---------------------------------------------------------------------------

CHAT_TOOLS: list[Any] = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a key up.", "parameters": TOOL_SCHEMA}}]
"""The tool as Chat Completions takes it."""


def chat_completions() -> list[dict[str, Any]]:
    """The model's five replies, as Chat Completions returns them."""
    out = []
    for turn in range(TURNS):
        message: dict[str, Any] = {"role": "assistant", "refusal": None}
        if turn < TOOL_TURNS:
            message["content"] = "Let me look that up."
            message["tool_calls"] = [{
                "id": f"call_{turn:04d}", "type": "function",
                "function": {"name": "lookup", "arguments": json.dumps({"key": "abcd"[turn]})}}]
            finish = "tool_calls"
        else:
            message["content"], finish = ANSWER, "stop"
        counts = usage(turn)
        out.append({
            "id": f"chatcmpl-{turn:04d}", "object": "chat.completion", "created": 1700000000,
            "model": OPENAI_MODEL, "choices": [{"index": 0, "message": message,
                                                "finish_reason": finish, "logprobs": None}],
            "usage": {"prompt_tokens": counts["input_tokens"], "completion_tokens": OUTPUT_TOKENS,
                      "total_tokens": counts["input_tokens"] + OUTPUT_TOKENS}})
    return out


async def bare_chat_run(client: Any) -> str:
    """The floor on Chat Completions: the same loop on an ``openai.AsyncOpenAI``
    client's ``chat.completions.create``; returns the answer."""
    history: list[Any] = [{"role": "user", "content": QUESTION}]
    while True:
        response = await client.chat.completions.create(
            model=OPENAI_MODEL, max_completion_tokens=1024, messages=history, tools=CHAT_TOOLS)
        message = response.choices[0].message
        history.append(message.model_dump(exclude_none=True))
        if response.choices[0].finish_reason != "tool_calls":
            return message.content or ""
        for call in message.tool_calls or ():
            history.append({"role": "tool", "tool_call_id": call.id,
                            "content": await lookup(**json.loads(call.function.arguments))})


# -- the Responses API --------------------------------------------------------------------------

RESPONSES_TOOLS: list[Any] = [{"type": "function", "name": "lookup",
                               "description": "Look a key up.", "parameters": TOOL_SCHEMA,
                               "strict": False}]
"""The tool as the Responses API takes it."""


def responses() -> list[dict[str, Any]]:
    """The model's five replies, as the Responses API returns them (``store`` false)."""
    out = []
    for turn in range(TURNS):
        text = "Let me look that up." if turn < TOOL_TURNS else ANSWER
        output: list[dict[str, Any]] = [{
            "id": f"msg_{turn:04d}", "type": "message", "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}]
        if turn < TOOL_TURNS:
            output.append({"id": f"fc_{turn:04d}", "type": "function_call",
                           "status": "completed", "call_id": f"call_{turn:04d}",
                           "name": "lookup", "arguments": json.dumps({"key": "abcd"[turn]})})
        counts = usage(turn)
        total = counts["input_tokens"] + counts["cache_read_input_tokens"]
        out.append({
            "id": f"resp_{turn:04d}", "object": "response", "created_at": 1700000000,
            "status": "completed", "error": None, "incomplete_details": None,
            "instructions": None, "max_output_tokens": 1024, "model": OPENAI_MODEL,
            "output": output, "parallel_tool_calls": True, "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None}, "service_tier": "default",
            "store": False, "temperature": 1.0, "text": {"format": {"type": "text"}},
            "tool_choice": "auto", "tools": RESPONSES_TOOLS, "top_p": 1.0,
            "truncation": "disabled", "metadata": {},
            "usage": {"input_tokens": total,
                      "input_tokens_details": {"cached_tokens": counts["cache_read_input_tokens"]},
                      "output_tokens": OUTPUT_TOKENS,
                      "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": total + OUTPUT_TOKENS}})
    return out


async def bare_responses_run(client: Any) -> str:
    """The floor on the Responses API: one conversation as a careful hand-written
    loop on an ``openai.AsyncOpenAI`` client's ``responses.create`` plays it
    (every request carries the whole transcript, as loopengine's do, in the
    same items: the model's text as an assistant message, its function calls;
    handing ``response.output`` back as it is makes the SDK's request
    transform, most of a turn's cost, walk every field of every item); returns
    the answer."""
    items: list[Any] = [{"role": "user", "content": QUESTION}]
    while True:
        response = await client.responses.create(model=OPENAI_MODEL, max_output_tokens=1024,
                                                 input=items, tools=RESPONSES_TOOLS,
                                                 store=False)
        text = response.output_text
        if text:
            items.append({"role": "assistant", "content": text})
        calls = [item for item in response.output if item.type == "function_call"]
        if not calls:
            return str(text)
        for call in calls:
            items.append({"type": "function_call", "call_id": call.call_id,
                          "name": call.name, "arguments": call.arguments})
            items.append({"type": "function_call_output", "call_id": call.call_id,
                          "output": await lookup(**json.loads(call.arguments))})


# -- the Gemini API -----------------------------------------------------------------------------

GEMINI_TOOLS: list[Any] = [{"function_declarations": [{
    "name": "lookup", "description": "Look a key up.", "parameters_json_schema": TOOL_SCHEMA}]}]
"""The tool as the ``google-genai`` SDK takes it."""


def gemini_responses() -> list[dict[str, Any]]:
    """The model's five replies, as the Gemini API's ``generateContent`` returns them."""
    out = []
    for turn in range(TURNS):
        parts: list[dict[str, Any]]
        if turn < TOOL_TURNS:
            parts = [{"text": "Let me look that up."},
                     {"functionCall": {"id": f"call_{turn:04d}", "name": "lookup",
                                       "args": {"key": "abcd"[turn]}}}]
        else:
            parts = [{"text": ANSWER}]
        counts = usage(turn)
        total = counts["input_tokens"] + counts["cache_read_input_tokens"]
        out.append({
            "candidates": [{"content": {"role": "model", "parts": parts},
                            "finishReason": "STOP", "index": 0}],
            "usageMetadata": {"promptTokenCount": total,
                              "cachedContentTokenCount": counts["cache_read_input_tokens"],
                              "candidatesTokenCount": OUTPUT_TOKENS,
                              "totalTokenCount": total + OUTPUT_TOKENS},
            "modelVersion": GEMINI_MODEL, "responseId": f"resp_{turn:04d}"})
    return out


async def bare_gemini_run(client: Any) -> str:
    """The floor on the Gemini API: one conversation as a careful hand-written loop
    on a ``google.genai.Client``'s ``aio.models.generate_content`` plays it (the
    SDK's automatic function calling off, as loopengine's is); returns the answer."""
    contents: list[Any] = [{"role": "user", "parts": [{"text": QUESTION}]}]
    config = {"max_output_tokens": 1024, "tools": GEMINI_TOOLS,
              "automatic_function_calling": {"disable": True}}
    while True:
        response = await client.aio.models.generate_content(
            model=GEMINI_MODEL, contents=contents, config=config)
        contents.append(response.candidates[0].content)
        calls = response.function_calls
        if not calls:
            return str(response.text)
        contents.append({"role": "user", "parts": [
            {"function_response": {"id": call.id, "name": call.name,
                                   "response": {"result": await lookup(**call.args)}}}
            for call in calls]})
