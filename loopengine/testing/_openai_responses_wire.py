"""The Responses API's shapes of `FakeOpenAIServer` (``POST /v1/responses``).

A `Reply` becomes one ``response`` object:

* its text blocks one ``message`` item of ``output_text`` parts (``refusal``
  parts when its stop reason is ``refusal``), its ``tool_use`` blocks
  ``function_call`` items (``call_id`` the block's id; an ``input`` given as
  a string is sent verbatim, to script malformed arguments), and any other
  block (``reasoning``, ``web_search_call``...) the output item it is, in
  order. A ``reasoning`` item carries its ``encrypted_content`` only when the
  request's ``include`` asked for ``reasoning.encrypted_content``, as the API
  does (and a model that does not reason refuses that ``include``, and
  ``reasoning.effort``, `reasoning_problem`);
* its stop reason the ``status``: ``end_turn``, ``tool_use``, ``refusal``
  -> ``completed``; ``max_tokens`` -> ``incomplete`` (``max_output_tokens``);
  any other value -> ``incomplete`` with that reason (``content_filter``);
* its usage ``usage`` (``input_tokens`` holding the cache reads and writes,
  ``input_tokens_details``, ``output_tokens_details.reasoning_tokens``) and
  ``tool_usage.web_search.num_requests``; the ``service_tier`` the usage's
  (``default`` when it has none).

A stream is the API's events, each ``event: <type>`` with its JSON:
``response.created``, ``response.in_progress``, per item
``response.output_item.added``, its parts' and deltas' events
(``response.content_part.added``, ``response.output_text.delta`` word by
word, ``response.refusal.delta``, ``response.function_call_arguments.delta``
in two halves, the ``.done`` events) and ``response.output_item.done``, then
``response.completed`` or ``response.incomplete``, which alone carries the
usage. A `StreamErrorEvent` is an ``error`` event (``code`` its type), its
fields nested under ``error`` as the API sends them (and flat beside them).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from loopengine._usage import Usage
from loopengine.providers._base import priced_tier
from loopengine.providers._scripted import Reply
from loopengine.testing._loopback import Frame, RecordedRequest

__all__ = ["PATH", "error_event", "input_problem", "reasoned_items", "reasoning_problem",
           "response_body", "response_frames", "served_usage"]

PATH = "/v1/responses"
"""The Responses API's path."""

_WORDS = re.compile(r"\s*\S+\s*|\s+")
_COMPLETED = frozenset({"end_turn", "stop_sequence", "tool_use", "refusal", None})


def response_body(reply: Reply, request: RecordedRequest, number: int) -> dict[str, Any]:
    """The ``response`` object of ``reply``."""
    body = request.body if isinstance(request.body, Mapping) else {}
    include = body.get("include") or ()
    refusal = reply.stop_reason == "refusal"
    output: list[dict[str, Any]] = []
    message: dict[str, Any] | None = None
    for index, block in enumerate(reply.content):
        kind = block.get("type")
        if kind == "text":
            if message is None:
                message = {"id": f"msg_fake_{number:04d}", "type": "message",
                           "status": "completed", "role": "assistant", "content": []}
                output.append(message)
            text = str(block.get("text", ""))
            message["content"].append(
                {"type": "refusal", "refusal": text} if refusal else
                {"type": "output_text", "text": text, "annotations": [], "logprobs": []})
        elif kind == "tool_use":
            tool_input = block.get("input")
            output.append({"id": f"fc_fake_{number:04d}_{index}", "type": "function_call",
                           "status": "completed", "call_id": block.get("id"),
                           "name": block.get("name"),
                           "arguments": tool_input if isinstance(tool_input, str)
                           else json.dumps(tool_input or {})})
        else:
            item = dict(block)
            if kind == "reasoning":
                item.setdefault("summary", [])
                if "reasoning.encrypted_content" not in include:
                    item["encrypted_content"] = None
            output.append(item)
    stop = reply.stop_reason
    status = "completed" if stop in _COMPLETED else "incomplete"
    reason = "max_output_tokens" if stop == "max_tokens" else stop
    usage = reply.usage
    response: dict[str, Any] = {
        "id": reply.response_id or f"resp_fake_{number:04d}",
        "object": "response",
        "created_at": 1_700_000_000 + number,
        "status": status,
        "error": None,
        "incomplete_details": None if status == "completed" else {"reason": reason},
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": body.get("model") or "gpt-fake",
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": None,
        "reasoning": {"effort": (body.get("reasoning") or {}).get("effort"), "summary": None},
        "service_tier": (usage.service_tier if usage else None) or "default",
        "store": body.get("store", True),
        "temperature": 1.0,
        "text": {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools", []),
        "top_p": 1.0,
        "truncation": "disabled",
        "usage": _usage_json(usage),
        "metadata": {},
    }
    if usage is not None:
        response["tool_usage"] = {
            "image_gen": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0,
                          "input_tokens_details": {"image_tokens": 0, "text_tokens": 0}},
            "web_search": {"num_requests": usage.web_search_requests}}
    return response


def _usage_json(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    total = usage.total_input_tokens
    return {"input_tokens": total,
            "input_tokens_details": {"cached_tokens": usage.cache_read_tokens,
                                     "cache_write_tokens": usage.cache_write_tokens},
            "output_tokens": usage.output_tokens,
            "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
            "total_tokens": total + usage.output_tokens}


def served_usage(usage: Usage | None, *, web_searches: bool = True) -> Usage | None:
    """The usage a client of either OpenAI API reads from a reply scripted with
    ``usage``: no one-hour cache writes nor iterations, web searches only where
    the API reports them (``web_searches``); a standard tier is not kept."""
    if usage is None:
        return None
    return Usage(input_tokens=usage.input_tokens, output_tokens=usage.output_tokens,
                 cache_read_tokens=usage.cache_read_tokens,
                 cache_write_tokens=usage.cache_write_tokens,
                 reasoning_tokens=usage.reasoning_tokens,
                 web_search_requests=usage.web_search_requests if web_searches else 0,
                 service_tier=priced_tier(usage.service_tier))


def _event(kind: str, sequence: int, **fields: Any) -> bytes:
    payload = {"type": kind, "sequence_number": sequence, **fields}
    return f"event: {kind}\ndata: {json.dumps(payload)}\n\n".encode()


def response_frames(response: dict[str, Any], reply: Reply) -> list[Frame]:
    """The server-sent events of ``response``, in order; only the last one carries
    the usage."""
    events: list[tuple[str, dict[str, Any]]] = []
    started = {**response, "status": "in_progress", "output": [], "usage": None,
               "incomplete_details": None}
    started.pop("tool_usage", None)
    events.append(("response.created", {"response": started}))
    events.append(("response.in_progress", {"response": started}))
    for index, item in enumerate(response["output"]):
        events.extend(_item_events(index, item))
    final = "response.completed" if response["status"] == "completed" else \
        "response.incomplete"
    events.append((final, {"response": response}))
    frames = [Frame(_event(kind, number, **fields), None)
              for number, (kind, fields) in enumerate(events)]
    frames[-1] = Frame(frames[-1].data, served_usage(reply.usage))
    return frames


def _item_events(index: int, item: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    where = {"output_index": index}
    kind = item.get("type")
    if kind == "message":
        events: list[tuple[str, dict[str, Any]]] = [
            ("response.output_item.added", {**where, "item": {**item, "status": "in_progress",
                                                               "content": []}})]
        for part_index, part in enumerate(item["content"]):
            at = {**where, "item_id": item["id"], "content_index": part_index}
            refusal = part["type"] == "refusal"
            empty = {**part, "refusal": ""} if refusal else {**part, "text": ""}
            events.append(("response.content_part.added", {**at, "part": empty}))
            text = part["refusal"] if refusal else part["text"]
            for piece in _WORDS.findall(text):
                if refusal:
                    events.append(("response.refusal.delta", {**at, "delta": piece}))
                else:
                    events.append(("response.output_text.delta",
                                   {**at, "delta": piece, "logprobs": []}))
            if refusal:
                events.append(("response.refusal.done", {**at, "refusal": text}))
            else:
                events.append(("response.output_text.done", {**at, "text": text,
                                                             "logprobs": []}))
            events.append(("response.content_part.done", {**at, "part": part}))
    elif kind == "function_call":
        events = [("response.output_item.added",
                   {**where, "item": {**item, "status": "in_progress", "arguments": ""}})]
        arguments = item["arguments"]
        at = {**where, "item_id": item["id"]}
        # In two pieces, as the API streams them: the client joins them.
        for part in (arguments[: len(arguments) // 2], arguments[len(arguments) // 2:]):
            if part:
                events.append(("response.function_call_arguments.delta", {**at, "delta": part}))
        events.append(("response.function_call_arguments.done",
                       {**at, "name": item["name"], "arguments": arguments}))
    else:
        events = [("response.output_item.added", {**where, "item": item})]
    events.append(("response.output_item.done", {**where, "item": item}))
    return events


def error_event(error_type: str, message: str) -> bytes:
    """An ``error`` event inside a stream, its ``code`` the scripted type: its fields
    nested under ``error`` as the API sends them, and flat beside them as its
    reference shows them."""
    return _event("error", 0, code=error_type, message=message, param=None,
                  error={"type": error_type, "code": error_type, "message": message,
                         "param": None})


def reasoned_items(response: Mapping[str, Any]) -> dict[str, str]:
    """The ids of a response's output items that came after a reasoning item,
    each with the id of the last reasoning item before it: the reasoning the
    API requires back with the item when the item goes back with its id."""
    reasoned: dict[str, str] = {}
    reasoning: str | None = None
    for item in response.get("output") or ():
        if item.get("type") == "reasoning":
            reasoning = str(item.get("id"))
        elif reasoning is not None and item.get("id"):
            reasoned[str(item["id"])] = reasoning
    return reasoned


_UNREASONING = re.compile(r"gpt-4|gpt-3\.5|chatgpt-|gpt-5[\w.]*-chat")
"""The starts of the names of OpenAI's models that do not reason (the gpt-5
family's chat models of every version among them), and so refuse reasoning
parameters (any other model name is served as one that reasons)."""


def reasoning_problem(body: Any) -> str | None:
    """Why the Responses API would refuse ``body``'s reasoning parameters, or None:
    a model that does not reason (`_UNREASONING`) refuses ``reasoning.effort``
    and an ``include`` of ``reasoning.encrypted_content``, in the API's words."""
    if not isinstance(body, Mapping) or not _UNREASONING.match(str(body.get("model"))):
        return None
    reasoning = body.get("reasoning")
    if isinstance(reasoning, Mapping) and reasoning.get("effort") is not None:
        return "Unsupported parameter: 'reasoning.effort' is not supported with this model."
    if "reasoning.encrypted_content" in (body.get("include") or ()):
        return "Encrypted content is not supported with this model."
    return None


def input_problem(body: Any, reasoned: Mapping[str, str] | None = None) -> str | None:
    """Why the Responses API would refuse ``body``'s ``input``, or None.

    Each ``function_call_output`` must answer a ``function_call`` before it
    (by ``call_id``) and each call must be answered; a ``reasoning`` item sent
    with ``store`` false must carry its ``encrypted_content`` (the server kept
    nothing to find it by), and the item right after it must carry the id
    the server gave it (the API pairs the two by it); an item sent with an id
    that ``reasoned`` (`reasoned_items` of the responses served) maps to a
    reasoning item must come after that reasoning item.
    """
    if not isinstance(body, Mapping):
        return "the body is not a JSON object"
    items = body.get("input")
    if isinstance(items, str) and items:
        return None
    if not isinstance(items, list) or not items:
        return "input: a non-empty string or array is required"
    calls: set[str] = set()
    answered: set[str] = set()
    sent_reasoning: set[str] = set()
    for index, item in enumerate(items):
        if not isinstance(item, Mapping):
            return f"input[{index}]: an item must be an object"
        kind = item.get("type", "message")
        required = (reasoned or {}).get(str(item.get("id")))
        if required is not None and required not in sent_reasoning:
            return (f"input[{index}]: Item {item.get('id')!r} of type {kind!r} was provided "
                    f"without its required 'reasoning' item: {required!r}.")
        if kind == "reasoning":
            sent_reasoning.add(str(item.get("id")))
        before = items[index - 1] if index else None
        if (isinstance(before, Mapping) and before.get("type") == "reasoning"
                and not item.get("id")):
            return (f"input[{index - 1}]: Item {before.get('id')!r} of type 'reasoning' was "
                    "provided without its required following item.")
        if kind == "function_call":
            calls.add(str(item.get("call_id")))
        elif kind == "function_call_output":
            call_id = str(item.get("call_id"))
            if call_id not in calls:
                return (f"input[{index}]: No tool call found for function call output with "
                        f"call_id {call_id}.")
            answered.add(call_id)
        elif kind == "reasoning" and body.get("store") is False and not item.get(
                "encrypted_content"):
            return (f"input[{index}]: Item with id {item.get('id')!r} not found. Items are not "
                    "persisted when `store` is set to false.")
        elif kind == "message" and item.get("role") not in ("user", "assistant", "system",
                                                            "developer"):
            return f"input[{index}]: unknown role {item.get('role')!r}"
    missing = sorted(calls - answered)
    if missing:
        return f"input: No tool output found for function call {missing[0]}."
    return None
