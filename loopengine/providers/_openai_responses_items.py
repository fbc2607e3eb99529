"""Responses API items <-> the engine's Anthropic shapes, for `OpenAIResponsesProvider`.

The engine's transcript stays Anthropic-shaped; this module translates at its
boundary, both ways (`responses_params`, `content_from_response`,
`StreamedResponse`):

* ``system`` blocks become ``instructions``; a user message's ``tool_result``
  blocks become ``function_call_output`` items (an ``is_error`` result's
  text starts with ``Error:``), its text and images one ``user`` message;
  an assistant's text becomes an ``assistant`` message and its ``tool_use``
  blocks ``function_call`` items, in the order of its blocks; tools become
  ``function`` tools (``strict`` false: the engine validates the input;
  their schemas as Chat Completions sends them, `openai_function`);
  ``cache_control`` markers and another vendor's ``thinking`` (or a Chat
  Completions server's ``reasoning_content`` or ``reasoning_details``) have
  no equivalent and are dropped.
* A reply's ``output_text`` and ``refusal`` parts become text blocks, its
  ``function_call`` items ``tool_use`` blocks (the ``call_id`` is the block's
  ``id``). Every other output item (a ``reasoning`` item, a
  ``web_search_call``...) is kept in the transcript as a block of its own
  type, as the API sent it, and goes back as the same item on the next
  request: a ``reasoning`` item with its ``encrypted_content`` (``store`` is
  false, so the server keeps nothing to refer to; asked for whenever the
  request sets ``reasoning.effort`` or goes to a reasoning model), or not at
  all without it
  or without an item after it (a response cut after its reasoning); the
  output items after a reasoning item that is not sent (a web search call)
  are not sent either, since the API takes them only with their ids and
  refuses those ids without their reasoning item.
  The API pairs a reasoning item with the item that followed it by that
  item's id (``fc_...``, ``msg_...``), and refuses either sent without the
  other: the reasoning block keeps that id (``next_item_id``), and the item
  goes back with it only right after its reasoning item.
* The status becomes the engine's stop reason: ``completed`` -> ``end_turn``
  (``tool_use`` with function calls, ``refusal`` with a refusal part);
  ``incomplete`` -> ``max_tokens`` (``incomplete``: a cut-off answer is never
  accepted, whatever the reason) or, for ``content_filter``, ``refusal``.
* Usage: ``input_tokens`` holds ``input_tokens_details.cached_tokens`` and
  ``cache_write_tokens``, as Chat Completions' ``prompt_tokens`` does
  (`openai_usage`); ``output_tokens_details.reasoning_tokens`` is inside
  ``output_tokens``; web searches are ``tool_usage.web_search.num_requests``,
  or, in a reply without ``tool_usage``, its ``web_search_call`` items that
  searched.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from loopengine._usage import Usage
from loopengine._validate import _block_types
from loopengine.providers._base import ProviderRequest, text_or_none, token_count
from loopengine.providers._openai_chat import (
    TOOL_MODES,
    arguments,
    call_arguments,
    check_functions,
    image_url,
    openai_function,
    openai_usage,
    result_text,
    system_text,
    tool_params,
    user_kind,
    user_turn,
)
from loopengine.providers._translate import (
    check_blocks,
    message_role,
    tool_choice,
    untranslatable,
)

__all__ = [
    "ENCRYPTED_REASONING",
    "PREVIEW_SEARCH",
    "StreamedResponse",
    "check_translatable",
    "content_from_response",
    "WEB_SEARCH_TYPES",
    "reasoning_model",
    "responses_input",
    "responses_params",
    "stop_reason",
    "usage_from_response",
]

API = "Responses API"

ENCRYPTED_REASONING = "reasoning.encrypted_content"
"""The ``include`` value that asks for reasoning items' ``encrypted_content``."""

_REASONING_MODELS = re.compile(r"o\d|gpt-5(?![\w.]*-chat)|codex-mini")
"""The start of the names of OpenAI's reasoning models (the o-series, the gpt-5
family but its chat models, ``gpt-5-chat-latest``, ``gpt-5.1-chat-latest``...,
``codex-mini``): they reason unless told
not to, and take ``include=["reasoning.encrypted_content"]``, which a model
that does not reason refuses ("Encrypted content is not supported with this
model")."""


def reasoning_model(model: str) -> bool:
    """Whether ``model`` is one of OpenAI's reasoning models (by its name): those
    reason whether or not a request sets ``reasoning.effort``."""
    return _REASONING_MODELS.match(model) is not None

_DROPPED = frozenset({"thinking", "redacted_thinking", "reasoning_content",
                      "reasoning_details"})


WEB_SEARCH_TYPES = frozenset({"web_search", "web_search_2025_08_26", "web_search_preview",
                              "web_search_preview_2025_03_11"})
"""The Responses API's web search tool types: the server tools this route sends."""

PREVIEW_SEARCH = "web_search_preview"
"""The type (and the prefix of the dated types) of the web search preview tool, whose
searches on a non-reasoning model OpenAI bills a fee of their own
(`OpenAIResponsesProvider.billing`)."""


def _assistant_kind(block: Mapping[str, Any]) -> str:
    """``text``, ``tool_use``, dropped (``thinking``), or an output item's type;
    a Messages API block the Responses API cannot take is refused. A type the
    Messages API does not declare (`_block_types`, cached) came from a Responses
    reply (an output item) and goes back as it is."""
    kind = str(block.get("type"))
    if kind in ("text", "tool_use") or kind in _DROPPED or kind not in _block_types():
        return kind
    raise untranslatable(f"an assistant {kind!r} block", API)


# A user block's kind, checked as Chat Completions checks it, its faults naming this API.
_user_kind = functools.partial(user_kind, api=API)


def _check_server_tools(request: ProviderRequest) -> None:
    for tool in request.features.server_tools:
        if tool.type not in WEB_SEARCH_TYPES:
            raise untranslatable(f"server tool {tool.name!r} of type {tool.type!r} (only the "
                                 "web search tools are sent)", API)


def check_translatable(request: ProviderRequest) -> None:
    """Raise what `responses_params` would raise for ``request``, without translating it,
    and refuse a tool whose schema the API refuses (`check_functions`).

    Raises:
        ProviderFault: ``bad_request`` (``untranslatable``) for a block, a role,
            a ``tool_choice`` or a server tool the Responses API has no
            equivalent for; (``invalid_function_parameters``) for such a tool.
    """
    check_blocks(request, _assistant_kind, _user_kind, API)
    if request.tools:
        _tool_choice(request.tool_choice)
    _check_server_tools(request)
    check_functions(request.tools, API)


def responses_params(request: ProviderRequest, *, stream: bool) -> dict[str, Any]:
    """The SDK call's keyword arguments for ``request`` (streamed or not).

    ``store`` is false and no ``previous_response_id`` is sent: every request
    carries the whole transcript, reasoning included: a request that sets
    ``reasoning.effort``, or to a reasoning model (`reasoning_model`), asks for
    its reasoning items' encrypted content, without which they cannot go back.
    """
    params: dict[str, Any] = {
        "model": request.model,
        "input": responses_input(request.messages),
        "max_output_tokens": request.max_tokens,
        "store": False,
        "timeout": request.timeout,
    }
    if request.system:
        params["instructions"] = system_text(request.system)
    tools: list[dict[str, Any]] = [{"type": "function", **openai_function(tool), "strict": False}
                                   for tool in request.tools]
    if request.tools:
        tool_params(params, request, _tool_choice)
    features = request.features
    _check_server_tools(request)
    for server_tool in features.server_tools:
        tools.append({"type": server_tool.type, **json.loads(json.dumps(
            dict(server_tool.params)))})
    uses = [tool.max_uses for tool in features.server_tools]
    if uses and all(use is not None for use in uses):
        # The API caps built-in tool calls per response, across its tools: the
        # sum keeps each tool's published worst case (the estimate's) a bound.
        params["max_tool_calls"] = sum(use for use in uses if use is not None)
    if tools:
        params["tools"] = tools
    if features.reasoning_effort is not None:
        params["reasoning"] = {"effort": features.reasoning_effort}
    if features.reasoning_effort is not None or reasoning_model(request.model):
        # With store false, a reasoning item goes back only with its encrypted
        # content, which the API sends only when asked: a reasoning model asked
        # nothing would have its reasoning dropped from every later request.
        params["include"] = [ENCRYPTED_REASONING]
    if features.service_tier is not None:
        params["service_tier"] = features.service_tier
    if stream:
        params["stream"] = True
    return params


def _tool_choice(choice: Mapping[str, Any] | None) -> str | dict[str, Any] | None:
    # As Chat Completions', but the function named at the top level.
    return tool_choice(choice, TOOL_MODES, lambda name: {"type": "function", "name": name}, API)


def responses_input(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The Responses ``input`` items of Anthropic-shaped ``messages``.

    Raises:
        ProviderFault: ``bad_request`` (``untranslatable``) for a block that has
            no Responses equivalent (a document, a Messages API server tool).
    """
    out: list[dict[str, Any]] = []
    for message in messages:
        content = message.get("content")
        if message_role(message, API) == "assistant":
            out.extend(_assistant_items(content))
        else:
            out.extend(_user_items(content))
    return out


def _assistant_items(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "assistant", "content": content}] if content else []
    items: list[dict[str, Any]] = []
    texts: list[str] = []
    paired: str | None = None  # the id of the item that followed the reasoning just sent
    # Whether the last reasoning item stayed home: an output item after it cannot
    # go back, since the API takes it only with its id and that id only with it.
    unsent = False

    def add(item: dict[str, Any]) -> None:
        nonlocal paired
        if paired is not None:
            item["id"], paired = paired, None
        items.append(item)

    def flush() -> None:
        if texts:
            text = "".join(texts)
            texts.clear()
            if paired is None:
                items.append({"role": "assistant", "content": text})
            else:  # the output message form: the only one that takes an id
                add({"type": "message", "role": "assistant", "status": "completed",
                     "content": [{"type": "output_text", "text": text, "annotations": []}]})

    for block in content or ():
        kind = _assistant_kind(block)
        if kind == "text":
            texts.append(str(block.get("text", "")))
            continue
        flush()
        if kind == "tool_use":
            add({"type": "function_call", "call_id": block.get("id"),
                 "name": block.get("name"), "arguments": call_arguments(block)})
        elif kind == "reasoning":
            # Without the item that followed it (its response was cut after
            # its reasoning), the API refuses it: it is not sent back.
            unsent = not (block.get("encrypted_content") and block.get("next_item_id"))
            if not unsent:
                items.append({"type": "reasoning", "id": block.get("id"),
                              "summary": list(block.get("summary") or ()),
                              "encrypted_content": block["encrypted_content"]})
                paired = block.get("next_item_id")
        elif kind not in _DROPPED and not unsent:
            items.append(dict(block))  # an output item as it came, with its own id
            paired = None
    flush()
    return items


def _user_items(content: Any) -> list[dict[str, Any]]:
    return user_turn(
        content, _user_kind,
        result=lambda block: {"type": "function_call_output",
                              "call_id": block.get("tool_use_id"),
                              "output": result_text(block, API)},
        text_part=lambda text: {"type": "input_text", "text": text},
        image_part=lambda block: {"type": "input_image", "image_url": image_url(block, API),
                                  "detail": "auto"})


# -- the reply ---------------------------------------------------------------------------


def content_from_response(response: Mapping[str, Any]) -> tuple[list[dict[str, Any]], str | None]:
    """Anthropic content blocks and the stop reason of a Responses ``response`` (a
    dict whose status is ``completed`` or ``incomplete``)."""
    content: list[dict[str, Any]] = []
    calls = refused = False
    reasoning: dict[str, Any] | None = None
    for item in response.get("output") or ():
        if not isinstance(item, Mapping):
            continue
        kind = item.get("type")
        if reasoning is not None:
            # The item the API pairs with the reasoning item before it.
            if item.get("id"):
                reasoning["next_item_id"] = item.get("id")
            reasoning = None
        if kind == "message":
            for part in item.get("content") or ():
                if not isinstance(part, Mapping):
                    continue
                if part.get("type") == "output_text" and part.get("text"):
                    content.append({"type": "text", "text": str(part["text"])})
                elif part.get("type") == "refusal" and part.get("refusal"):
                    content.append({"type": "text", "text": str(part["refusal"])})
                    refused = True
        elif kind == "function_call":
            calls = True
            content.append({"type": "tool_use", "id": item.get("call_id"),
                            "name": item.get("name"), "input": arguments(item.get("arguments"))})
        elif isinstance(kind, str) and kind:
            content.append(dict(item))
            if kind == "reasoning":
                reasoning = content[-1]
    return content, stop_reason(response, calls=calls, refused=refused)


def stop_reason(response: Mapping[str, Any], *, calls: bool, refused: bool) -> str:
    """The engine's stop reason of a finished response."""
    if response.get("status") == "incomplete":
        details = response.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, Mapping) else None
        return "refusal" if reason == "content_filter" else "max_tokens"
    if refused:
        return "refusal"
    return "tool_use" if calls else "end_turn"


def usage_from_response(response: Mapping[str, Any]) -> Usage | None:
    """The `Usage` of a Responses ``response`` (a dict), None when it reports none."""
    raw = response.get("usage")
    if not isinstance(raw, Mapping):
        return None
    return openai_usage(raw.get("input_tokens"), raw.get("input_tokens_details"),
                        raw.get("output_tokens"), raw.get("output_tokens_details"),
                        response.get("service_tier"),
                        web_search_requests=_web_searches(response))


def _web_searches(response: Mapping[str, Any]) -> int:
    tool_usage = response.get("tool_usage")
    if isinstance(tool_usage, Mapping):
        search = tool_usage.get("web_search")
        if isinstance(search, Mapping):
            return token_count(search.get("num_requests"))
    count = 0
    for item in response.get("output") or ():
        if isinstance(item, Mapping) and item.get("type") == "web_search_call":
            action = item.get("action")
            # Opening a page or finding in it is not a billed search.
            kind = action.get("type") if isinstance(action, Mapping) else None
            count += kind in (None, "search")
    return count


class StreamedResponse:
    """A streamed response, put together event by event."""

    def __init__(self) -> None:
        self.response_id: str | None = None
        self.items: dict[int, dict[str, Any]] = {}
        self.final: dict[str, Any] | None = None
        """The response of ``response.completed`` / ``response.incomplete`` /
        ``response.failed``: the stream's end."""
        self.error: dict[str, Any] | None = None
        """An ``error`` event's fields, when the stream sent one."""

    def add(self, event: Any) -> str:
        """Take one event; return its text delta."""
        kind = getattr(event, "type", None)
        if kind == "response.output_text.delta":
            return str(getattr(event, "delta", "") or "")
        if kind in ("response.created", "response.in_progress"):
            response = getattr(event, "response", None)
            self.response_id = self.response_id or text_or_none(getattr(response, "id", None))
        elif kind == "response.output_item.done":
            item = getattr(event, "item", None)
            if item is not None:
                self.items[int(getattr(event, "output_index", len(self.items)))] = \
                    item.to_dict()
        elif kind in ("response.completed", "response.incomplete", "response.failed"):
            self.final = event.response.to_dict()
            self.response_id = text_or_none(self.final.get("id")) or self.response_id
        elif kind == "error":
            self.error = {"code": getattr(event, "code", None),
                          "message": getattr(event, "message", None)}
        return ""

    def response(self) -> dict[str, Any]:
        """The finished response: the final event's, its output assembled from the
        items the stream finished when the final event carries none."""
        assert self.final is not None
        if not self.final.get("output") and self.items:
            return {**self.final, "output": [self.items[i] for i in sorted(self.items)]}
        return self.final
