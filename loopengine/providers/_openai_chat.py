"""Chat Completions <-> the engine's Anthropic shapes, for `OpenAIProvider`.

The engine's transcript stays Anthropic-shaped; this module translates at
its boundary, both ways (`chat_messages`, `chat_tools`, `chat_tool_choice`,
`content_from_message`):

* ``system`` blocks become one ``system`` message; a user message's
  ``tool_result`` blocks become one ``tool`` message each, in order (an
  ``is_error`` result's text starts with ``Error:``, so the model reads it as
  a failure; an image or a document in it, which a ``tool`` message cannot
  carry, becomes a note saying what it was, ``[image: image/png, 68 bytes,
  not shown]``, beside the result's text); ``tool_use`` blocks become the
  assistant's ``tool_calls``; ``thinking`` blocks and ``cache_control``
  markers have no equivalent and are dropped (OpenAI caches prompt prefixes on its own);
* tools become ``function`` tools with the JSON schema as ``parameters``
  (an array schema without ``items``, a tuple's, given ``"items": {}``,
  which means the same: the API refuses an array schema without it);
  ``tool_choice`` ``auto`` / ``none`` / ``any`` / a named tool become
  ``auto`` / ``none`` / ``required`` / that function;
* the reply's text and ``refusal`` become text blocks, its tool calls
  ``tool_use`` blocks, all of one turn in one batch. Arguments that are not
  a JSON object are kept as the string the model sent: the tool's input
  validation then gives the model a recoverable error result (R15). A tool
  call's ``extra_content`` (Gemini's OpenAI-compatible endpoint puts the
  model's thought signature there, ``{"google": {"thought_signature": ...}}``,
  and refuses the next request without it) is kept on its ``tool_use`` block
  and sent back on the same call. A message's ``reasoning_content`` (a
  thinking server's reasoning: DeepSeek's, which refuses a tool-call turn
  sent back without it, even an empty one) is kept as a ``reasoning_content`` block before the
  reply's text and sent back on the assistant message of a tool-call turn;
  its ``reasoning_details`` (OpenRouter's structured reasoning, which it asks
  back with the tool calls of a reasoning model, signatures included) likewise,
  as a ``reasoning_details`` block (a streamed one put together by each
  detail's ``index``).

``finish_reason`` becomes the engine's stop reason: ``stop`` -> ``end_turn``,
``tool_calls`` -> ``tool_use``, ``length`` -> ``max_tokens`` (``incomplete``),
``content_filter`` (or a ``refusal``) -> ``refusal`` (``refused``), with the
compatible servers' names for these (`FINISH_REASONS`); a reply without one,
or with any other, is not an answer (``_openai_faults.check_finish``). Usage:
``prompt_tokens`` includes ``prompt_tokens_details.cached_tokens``, so the
uncached input is the difference and the cached part is the cache read;
reasoning tokens are inside ``completion_tokens``. A search model
(`search_model`: ``gpt-4o-search-preview``...) searches the web before every
answer and is billed a web search fee for it, which its ``usage`` does not
count: the usage of each of its requests counts one web search.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from loopengine._jsonschema import subschemas
from loopengine._usage import Usage
from loopengine.providers._base import (
    ProviderRequest,
    media_note,
    priced_tier,
    reported_usage,
    text_or_none,
    token_count,
)
from loopengine.providers._faults import FaultKind, ProviderFault
from loopengine.providers._translate import (
    block_kind,
    check_blocks,
    function_tool,
    message_role,
    result_kind,
    tool_choice,
    untranslatable,
)

__all__ = [
    "TOOL_MODES",
    "StreamedCompletion",
    "arguments",
    "ROOT_KEYWORDS",
    "arrays_without_items",
    "call_arguments",
    "chat_messages",
    "chat_params",
    "chat_tool_choice",
    "chat_tools",
    "check_functions",
    "check_translatable",
    "FINISH_REASONS",
    "content_from_message",
    "first_choice",
    "image_source",
    "image_url",
    "openai_function",
    "openai_usage",
    "result_blocks",
    "result_text",
    "root_keyword",
    "search_model",
    "stop_reason",
    "system_text",
    "text_of",
    "tool_params",
    "user_kind",
    "user_turn",
    "usage_from_api",
]

API = "Chat Completions"

_SEARCH_MODELS = re.compile(
    r"(?:[\w.-]+/)?gpt-[\w.]+?(?:-mini)?-search-(?:preview|api)(?:-\d{4}-\d{2}-\d{2})?"
    r"(?::[\w-]+)?")
"""The names of OpenAI's Chat Completions search models: ``gpt-4o-search-preview``,
``gpt-4o-mini-search-preview``, ``gpt-5-search-api``, their dated names
(``gpt-4o-search-preview-2025-03-11``), under a compatible server's vendor
prefix (OpenRouter's ``openai/gpt-4o-search-preview``) and with its variant
suffix (``:nitro``)."""


def search_model(model: str) -> bool:
    """Whether ``model`` is one of OpenAI's Chat Completions search models (by its
    name, `_SEARCH_MODELS`): those search the web before every answer, and each
    request is billed a web search fee that its ``usage`` does not count."""
    return _SEARCH_MODELS.fullmatch(model) is not None

REASONING_CONTENT = "reasoning_content"
"""A thinking server's reasoning field (DeepSeek's), kept as a block of this type."""

REASONING_DETAILS = "reasoning_details"
"""OpenRouter's structured reasoning (a list of ``reasoning.text``,
``reasoning.summary``, ``reasoning.encrypted`` details), kept as a block of
this type."""

# The text fields of a reasoning detail that a stream sends in pieces.
_DETAIL_TEXTS = ("text", "summary", "data", "signature")

FINISH_REASONS = {
    "stop": "end_turn",
    # Compatible servers' names of a natural end: Together's ``eos``, Hugging
    # Face TGI's ``eos_token`` and ``stop_sequence``.
    "eos": "end_turn",
    "eos_token": "end_turn",
    "stop_sequence": "end_turn",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "length": "max_tokens",
    # Mistral's: the model's context window filled.
    "model_length": "max_tokens",
    "content_filter": "refusal",
}
"""The ``finish_reason`` values (lower-cased) read as a stop reason; any other one
(vLLM's ``abort``, ``error``...) is a fault (``_openai_faults.check_finish``)."""


def chat_params(request: ProviderRequest, *, stream: bool) -> dict[str, Any]:
    """The SDK call's keyword arguments for ``request`` (streamed or not)."""
    params: dict[str, Any] = {
        "model": request.model,
        "messages": chat_messages(request.system, request.messages),
        "max_completion_tokens": request.max_tokens,
        "timeout": request.timeout,
    }
    if request.tools:
        params["tools"] = chat_tools(request.tools)
        tool_params(params, request, chat_tool_choice)
    if request.features.reasoning_effort is not None:
        params["reasoning_effort"] = request.features.reasoning_effort
    if request.features.service_tier is not None:
        params["service_tier"] = request.features.service_tier
    if request.features.web_search_options is not None:
        params["web_search_options"] = dict(request.features.web_search_options)
    if stream:
        params["stream"] = True
        params["stream_options"] = {"include_usage": True}
    return params


def tool_params(params: dict[str, Any], request: ProviderRequest,
                choose: Callable[[Mapping[str, Any] | None], object]) -> None:
    """Put a request's ``tool_choice`` (as ``choose`` translates it; none for the
    default) and its ``disable_parallel_tool_use`` (``parallel_tool_calls``
    false) in ``params``, as both OpenAI APIs take them."""
    choice = choose(request.tool_choice)
    if choice is not None:
        params["tool_choice"] = choice
    if request.tool_choice is not None and request.tool_choice.get(
            "disable_parallel_tool_use") is True:
        params["parallel_tool_calls"] = False


def first_choice(body: object) -> Mapping[str, Any] | None:
    """The first choice of a completion body, or None when it has none."""
    if not isinstance(body, Mapping):
        return None
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        return None
    return choices[0]


class StreamedCompletion:
    """A streamed completion, put together chunk by chunk.

    Args:
        web_searches: The web searches its request ran that the usage does
            not count (a search model's one, `search_model`): its usage counts them.
    """

    def __init__(self, *, web_searches: int = 0) -> None:
        self.web_searches = web_searches
        self.response_id: str | None = None
        self.model: str | None = None
        self.text: list[str] = []
        self.refusal: list[str] = []
        self.reasoning: list[str] = []
        """A thinking server's ``reasoning_content`` deltas (DeepSeek's), empty
        ones too: a tool-call turn it reasoned nothing for is asked back with an
        empty one."""
        self.details: dict[int, dict[str, Any]] = {}
        """OpenRouter's ``reasoning_details`` so far, by each detail's ``index``."""
        self.calls: dict[tuple[int, int], dict[str, Any]] = {}
        """The tool calls by their place: ``(0, index)`` for a delta that names its
        ``index``, ``(1, n)`` for the n-th call of a server that names none."""
        self._last_call: tuple[int, int] | None = None
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.service_tier: object = None
        self.error: object = None
        """The ``error`` object of an error chunk, once one came (the stream failed)."""
        self.error_usage = False
        """Whether that error chunk carried the usage itself (OpenRouter does)."""

    def add(self, chunk: Any) -> str:
        """Take one chunk; return its text delta. An error chunk (``{"error": ...}``,
        with the usage and id some servers add) is kept in `error`."""
        # The first id a chunk names: Azure's first chunk (its prompt filter
        # results) names none, its ``id`` and ``model`` empty.
        self.response_id = self.response_id or text_or_none(getattr(chunk, "id", None)) or None
        self.model = self.model or text_or_none(getattr(chunk, "model", None)) or None
        # Every chunk names the tier; the usage chunk may come last.
        self.service_tier = getattr(chunk, "service_tier", None) or self.service_tier
        usage = getattr(chunk, "usage", None)
        if usage is not None:
            self.usage = usage_from_api(usage if isinstance(usage, Mapping) else usage.to_dict(),
                                        self.service_tier, web_searches=self.web_searches)
        error = getattr(chunk, "error", None)
        if error:
            self.error = error
            self.error_usage = usage is not None and self.usage is not None
        text = ""
        for choice in getattr(chunk, "choices", None) or ():
            if getattr(choice, "index", 0) != 0:
                continue
            delta = choice.delta
            if delta is not None:
                if delta.content:
                    text += text_of(delta.content)
                if delta.refusal:
                    self.refusal.append(delta.refusal)
                reasoning = getattr(delta, "reasoning_content", None)
                if isinstance(reasoning, str):
                    self.reasoning.append(reasoning)
                for detail in getattr(delta, REASONING_DETAILS, None) or ():
                    if isinstance(detail, Mapping):
                        self._detail(detail)
                for call in delta.tool_calls or ():
                    entry = self._call(call)
                    if call.id:
                        entry["id"] = call.id
                    extra = getattr(call, "extra_content", None)
                    if isinstance(extra, Mapping) and extra:
                        entry["extra_content"] = _merged(entry.get("extra_content"), extra)
                    if call.function is not None:
                        if call.function.name:
                            entry["name"] += call.function.name
                        if call.function.arguments:
                            entry["arguments"].append(call.function.arguments)
            if choice.finish_reason is not None:
                self.finish_reason = choice.finish_reason
        if text:
            self.text.append(text)
        return text

    def _detail(self, piece: Mapping[str, Any]) -> None:
        """Add a streamed ``reasoning_details`` entry to the detail of its
        ``index`` (a new one without an index): its text fields joined, the
        others as the latest piece names them."""
        index = piece.get("index")
        if not isinstance(index, int) or isinstance(index, bool):
            index = len(self.details)
        detail = self.details.setdefault(index, {})
        for key, value in piece.items():
            if key in _DETAIL_TEXTS and isinstance(value, str):
                detail[key] = str(detail.get(key) or "") + value
            elif value is not None or key not in detail:
                detail[key] = value

    def _call(self, call: Any) -> dict[str, Any]:
        """The tool call a ``tool_calls`` delta adds to: the one at its ``index``.
        A delta without one (Gemini's compatible endpoint sends none, each call
        whole) starts a call when it names an id the last call does not have,
        else goes on with the last call."""
        index = getattr(call, "index", None)
        if isinstance(index, int) and not isinstance(index, bool):
            key = (0, index)
        else:
            last = self.calls.get(self._last_call) if self._last_call is not None else None
            if last is not None and (not call.id or last["id"] in (None, call.id)):
                key = self._last_call  # type: ignore[assignment]
            else:
                key = (1, sum(1 for place, _ in self.calls if place == 1))
        self._last_call = key
        return self.calls.setdefault(key, {"id": None, "name": "", "arguments": []})

    def content(self) -> tuple[list[dict[str, Any]], str | None]:
        """The reply's content blocks and stop reason."""
        message: dict[str, Any] = {
            "content": "".join(self.text) or None,
            "refusal": "".join(self.refusal) or None,
            "reasoning_content": "".join(self.reasoning) if self.reasoning else None,
            REASONING_DETAILS: [detail for _, detail in sorted(self.details.items())],
            "tool_calls": [
                {"id": call["id"], "type": "function",
                 "function": {"name": call["name"], "arguments": "".join(call["arguments"])},
                 **({"extra_content": call["extra_content"]} if "extra_content" in call else {})}
                for _, call in sorted(self.calls.items())
            ],
        }
        return content_from_message(message, self.finish_reason)


# What the translation can send, checked in one place: `check_translatable`
# (before the attempt is recorded) and the translation itself (in `send`)
# ask the same questions below, so they cannot disagree.

# Sent (text, tool_use, a thinking server's reasoning_content or
# reasoning_details), or dropped
# (another vendor's reasoning).
_ASSISTANT_KINDS = frozenset({"text", "tool_use", REASONING_CONTENT, REASONING_DETAILS,
                              "thinking",
                              "redacted_thinking", "reasoning"})
_USER_SENT = frozenset({"tool_result", "text", "image"})


def _assistant_kind(block: Mapping[str, Any]) -> str:
    """An assistant block's kind: sent (``text``, ``tool_use``) or dropped
    (another vendor's reasoning, nothing to send it as)."""
    return block_kind(block, _ASSISTANT_KINDS, "an assistant {!r} block", API)


def user_kind(block: Mapping[str, Any], api: str = API) -> str:
    """A user block's kind, once what it holds is known to translate (what
    `result_text` and `image_url` would refuse), without translating it: a
    tool result of text, images and documents, an image of base64 data or a URL."""
    kind = block_kind(block, _USER_SENT, "a user {!r} block", api)
    if kind == "tool_result":
        result_blocks(block.get("content"), api)
    elif kind == "image":
        image_source(block, api)
    return str(kind)


def result_blocks(content: Any, api: str = API) -> Sequence[Mapping[str, Any]]:
    """A tool result's blocks (none for a string or no content): text, and images
    and documents, which a ``tool`` message (a ``function_call_output``) carries
    as text saying what they were (`result_text`)."""
    if content is None or isinstance(content, str):
        return ()
    for block in content:
        result_kind(block, api)
    return content  # type: ignore[no-any-return]


def image_source(block: Mapping[str, Any], api: str = API) -> Mapping[str, Any]:
    """An image block's source, when it is base64 data or a URL."""
    source = block.get("source")
    if isinstance(source, Mapping) and source.get("type") in ("base64", "url"):
        return source
    raise untranslatable("an image that is neither base64 data nor a URL", api)


def check_translatable(request: ProviderRequest, *, openai_rules: bool = True) -> None:
    """Raise what `chat_params` would raise for ``request``, without translating it,
    and, with ``openai_rules`` (the server is OpenAI's own API or Azure's, not
    another server that speaks its wire format), refuse a tool whose schema
    the API refuses (`check_functions`).

    Raises:
        ProviderFault: ``bad_request`` (``untranslatable``) for a block, a role
            or a ``tool_choice`` that has no Chat Completions equivalent, or
            ``web_search_options`` for a model that is not a search model
            (`search_model`), which the API refuses;
            (``invalid_function_parameters``) for such a tool.
    """
    if request.features.web_search_options is not None and not search_model(request.model):
        raise untranslatable(f"web_search_options for {request.model!r}, which is not a "
                             "search model,", API)
    check_blocks(request, _assistant_kind, user_kind, API)
    if request.tools:
        chat_tool_choice(request.tool_choice)
    if openai_rules:
        check_functions(request.tools, API)


ROOT_KEYWORDS = ("oneOf", "anyOf", "allOf", "enum", "not")
"""The keywords both OpenAI APIs refuse at the root of a function's parameters
("schema must have type 'object' and not have ... at the top level")."""


def root_keyword(schema: object) -> str | None:
    """The first of `ROOT_KEYWORDS` at the root of ``schema``, or None."""
    if not isinstance(schema, Mapping):
        return None
    return next((key for key in ROOT_KEYWORDS if key in schema), None)


def check_functions(tools: Sequence[Mapping[str, Any]], api: str) -> None:
    """Refuse, before the wire, a tool both OpenAI APIs refuse for its schema: one
    with a `ROOT_KEYWORDS` keyword at its root (a raw or MCP tool's "one of
    these fields" rule). The Messages API refuses most of these too.

    Raises:
        ProviderFault: ``bad_request`` (``invalid_function_parameters``).
    """
    for tool in tools:
        key = root_keyword(tool.get("input_schema"))
        if key is not None:
            raise ProviderFault(
                FaultKind.BAD_REQUEST,
                f"tool {tool.get('name')!r}: its input schema has {key!r} at its root, which "
                f"the {api} refuses (a function's parameters must be an object's schema "
                f"without {'/'.join(ROOT_KEYWORDS)} at the top level)",
                error_code="invalid_function_parameters")


def chat_messages(
    system: Sequence[Mapping[str, Any]] | None, messages: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """The Chat Completions ``messages`` for an Anthropic ``system`` and ``messages``.

    Raises:
        ProviderFault: ``bad_request`` (``untranslatable``) for a block that
            has no Chat Completions equivalent (a document, a server tool).
    """
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": system_text(system)})
    for message in messages:
        content = message.get("content")
        if message_role(message, API) == "assistant":
            out.append(_assistant_message(content))
        else:
            out.extend(_user_messages(content))
    return out


def system_text(system: Sequence[Mapping[str, Any]]) -> str:
    """The text of Anthropic ``system`` blocks, as the one system message (or the
    ``instructions``) both OpenAI APIs take."""
    return "\n\n".join(str(block.get("text", "")) for block in system)


def call_arguments(block: Mapping[str, Any]) -> str:
    """A ``tool_use`` block's ``input`` as the ``arguments`` string both OpenAI APIs
    take: JSON, or, for arguments the model sent malformed, the text as it came."""
    tool_input = block.get("input", {})
    return tool_input if isinstance(tool_input, str) else json.dumps(tool_input)


def _assistant_message(content: Any) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    details: list[Any] = []
    for block in content or ():
        kind = _assistant_kind(block)
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == REASONING_CONTENT:
            reasoning.append(str(block.get(REASONING_CONTENT, "")))
        elif kind == REASONING_DETAILS and isinstance(block.get(REASONING_DETAILS), list):
            details.extend(block[REASONING_DETAILS])
        elif kind == "tool_use":
            call: dict[str, Any] = {"id": block.get("id"), "type": "function",
                                    "function": {"name": block.get("name"),
                                                 "arguments": call_arguments(block)}}
            if isinstance(block.get("extra_content"), Mapping):
                call["extra_content"] = block["extra_content"]
            calls.append(call)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        message["tool_calls"] = calls
        if reasoning:
            # A thinking server (DeepSeek) refuses a tool-call turn without it.
            message[REASONING_CONTENT] = "".join(reasoning)
        if details:
            # OpenRouter asks a reasoning model's details back with its tool calls.
            message[REASONING_DETAILS] = details
    elif message["content"] is None:
        message["content"] = ""
    return message


def _user_messages(content: Any) -> list[dict[str, Any]]:
    return user_turn(
        content, user_kind,
        result=lambda block: {"role": "tool", "tool_call_id": block.get("tool_use_id"),
                              "content": result_text(block)},
        text_part=lambda text: {"type": "text", "text": text},
        image_part=lambda block: {"type": "image_url", "image_url": {"url": image_url(block)}})


def user_turn(
    content: Any,
    kind_of: Callable[[Mapping[str, Any]], str],
    *,
    result: Callable[[Mapping[str, Any]], dict[str, Any]],
    text_part: Callable[[str], dict[str, Any]],
    image_part: Callable[[Mapping[str, Any]], dict[str, Any]],
) -> list[dict[str, Any]]:
    """A user message as either OpenAI API takes it: its tool results first (each
    ``result(block)``, in order: the APIs want each call's result right after
    the assistant's calls), then the rest of the message as one ``user``
    message, a plain string when it is all text, else its parts
    (``text_part``, ``image_part``). ``kind_of`` checks each block and names
    its kind (``tool_result``, ``text``, ``image``)."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out: list[dict[str, Any]] = []
    texts: list[str | None] = []
    parts: list[dict[str, Any]] = []
    for block in content or ():
        kind = kind_of(block)
        if kind == "tool_result":
            out.append(result(block))
        elif kind == "text":
            text = str(block.get("text", ""))
            texts.append(text)
            parts.append(text_part(text))
        else:
            texts.append(None)
            parts.append(image_part(block))
    if parts:
        if all(text is not None for text in texts):
            out.append({"role": "user", "content": "\n\n".join(t or "" for t in texts)})
        else:
            out.append({"role": "user", "content": parts})
    return out


def result_text(block: Mapping[str, Any], api: str = API) -> str:
    """A ``tool_result`` block's text, ``Error: ``-prefixed when it is an error
    (neither API has an error flag, so the model reads it as a failure)."""
    content = block.get("content")
    if isinstance(content, str):
        text = content
    else:
        text = "\n\n".join(_result_part(part) for part in result_blocks(content, api))
    return f"Error: {text}" if block.get("is_error") is True else text


def _result_part(block: Mapping[str, Any]) -> str:
    """One block of a tool result as the text of a ``tool`` message: a text block's
    text; for an image or a document, which a ``tool`` message cannot carry, the
    note the model reads in its place (`media_note`)."""
    if block.get("type") == "text":
        return str(block.get("text", ""))
    return media_note(block)


def image_url(block: Mapping[str, Any], api: str = API) -> str:
    """An image block as the URL both APIs take (a ``data:`` URL for base64 data)."""
    source = image_source(block, api)
    if source.get("type") == "base64":
        return f"data:{source.get('media_type')};base64,{source.get('data')}"
    return str(source.get("url"))


def chat_tools(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Chat Completions ``function`` tools for Anthropic tool definitions."""
    return [{"type": "function", "function": openai_function(tool)} for tool in tools]


def openai_function(tool: Mapping[str, Any]) -> dict[str, Any]:
    """An Anthropic tool definition as both OpenAI APIs' function: `function_tool`,
    with ``items`` given to each array schema that has none (`arrays_without_items`)."""
    function = function_tool(tool)
    if next(arrays_without_items(function["parameters"]), None) is not None:
        parameters = copy.deepcopy(function["parameters"])
        for _, node in subschemas(parameters):
            if _array_without_items(node):
                # What JSON Schema means without it (any further item), in the
                # form the API takes: a tuple's prefixItems and bounds still hold.
                node["items"] = {}  # type: ignore[index]
        function["parameters"] = parameters
    return function


def arrays_without_items(schema: object) -> Iterator[tuple[str, ...]]:
    """The paths in ``schema`` of the array schemas without ``items`` (a tuple's
    ``prefixItems`` alone, a bare ``{"type": "array"}``): both OpenAI APIs
    refuse a function whose parameters hold one ("array schema missing
    items"), strict or not."""
    for path, node in subschemas(schema):
        if _array_without_items(node):
            yield path


def _array_without_items(node: Mapping[str, Any]) -> bool:
    kind = node.get("type")
    return "items" not in node and (kind == "array" or (isinstance(kind, list)
                                                         and "array" in kind))


TOOL_MODES: Mapping[str, str | dict[str, Any]] = {"auto": "auto", "none": "none",
                                                  "any": "required"}
"""Anthropic's ``tool_choice`` kinds as both OpenAI APIs name them."""


def chat_tool_choice(choice: Mapping[str, Any] | None) -> str | dict[str, Any] | None:
    """The Chat Completions ``tool_choice`` for an Anthropic one (None: the default);
    a kind it has no equivalent for is refused (`tool_choice`)."""
    return tool_choice(choice, TOOL_MODES,
                       lambda name: {"type": "function", "function": {"name": name}}, API)


def text_of(content: object) -> str:
    """The text of a message's (or a delta's) ``content``: a string, or, from
    compatible servers, a list of parts (Mistral's ``{"type": "text", "text":
    ...}`` beside its ``{"type": "thinking", ...}``), whose text parts are
    joined; thinking has no place in the engine's transcript and is dropped,
    as an Anthropic ``thinking`` block is when sent (the translation table)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    return "".join(part["text"] for part in content
                   if isinstance(part, Mapping) and part.get("type") == "text"
                   and isinstance(part.get("text"), str))


def content_from_message(
    message: Mapping[str, Any], finish_reason: object
) -> tuple[list[dict[str, Any]], str | None]:
    """Anthropic content blocks and stop reason for a Chat Completions ``message``.

    A ``refusal`` is text whose stop reason is ``refusal``; each tool call is
    a ``tool_use`` block whose ``input`` is the parsed arguments, or the
    arguments as sent when they are not a JSON object (the loop's input
    validation then answers the model with an error result, R15).
    """
    content: list[dict[str, Any]] = []
    reasoning = message.get(REASONING_CONTENT)
    if isinstance(reasoning, str):
        # A thinking server's reasoning (DeepSeek's), which it requires back
        # with the tool calls it led to, even when it is empty.
        content.append({"type": REASONING_CONTENT, REASONING_CONTENT: reasoning})
    details = message.get(REASONING_DETAILS)
    if isinstance(details, list) and details:
        # OpenRouter's structured reasoning, asked back with the tool calls.
        content.append({"type": REASONING_DETAILS, REASONING_DETAILS: list(details)})
    text = text_of(message.get("content"))
    if text:
        content.append({"type": "text", "text": text})
    refusal = message.get("refusal")
    if isinstance(refusal, str) and refusal:
        content.append({"type": "text", "text": refusal})
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        block = {"type": "tool_use", "id": call.get("id"), "name": function.get("name"),
                 "input": arguments(function.get("arguments"))}
        extra = call.get("extra_content")
        if isinstance(extra, Mapping) and extra:
            # Gemini's thought signature (``{"google": {"thought_signature": ...}}``),
            # which must go back on the same call.
            block["extra_content"] = dict(extra)
        content.append(block)
    stop = stop_reason(finish_reason)
    if isinstance(refusal, str) and refusal:
        stop = "refusal"
    return content, stop


def _merged(given: object, more: Mapping[str, Any]) -> dict[str, Any]:
    """A call's ``extra_content`` so far with a later delta's, merged one level down
    (its vendors' objects, ``google``...)."""
    merged = dict(given) if isinstance(given, Mapping) else {}
    for vendor, fields in more.items():
        before = merged.get(vendor)
        merged[vendor] = ({**before, **fields} if isinstance(before, Mapping)
                          and isinstance(fields, Mapping) else fields)
    return merged


def arguments(raw: object) -> Any:
    """A call's ``arguments`` as a tool input: the parsed JSON object, else the
    string as the model sent it (the loop answers it as invalid input, R15)."""
    if raw is None or raw == "":
        return {}
    if not isinstance(raw, str):
        return raw
    try:
        parsed = json.loads(raw)
    except ValueError:
        return raw
    return parsed if isinstance(parsed, dict) else raw


def stop_reason(finish_reason: object) -> str | None:
    """The engine's stop reason for a ``finish_reason`` (`FINISH_REASONS`): ``stop``
    -> ``end_turn``, ``tool_calls`` -> ``tool_use``, ``length`` -> ``max_tokens``,
    ``content_filter`` -> ``refusal``; None for any other (the provider raises
    its fault before asking)."""
    if not isinstance(finish_reason, str):
        return None
    return FINISH_REASONS.get(finish_reason.lower())


def usage_from_api(raw: object, service_tier: object = None, *,
                   web_searches: int = 0) -> Usage | None:
    """Map a Chat Completions ``usage`` object (a dict) to `Usage`.

    ``prompt_tokens`` counts the cached and the cache-written tokens too:
    ``input_tokens`` is ``prompt_tokens - prompt_tokens_details.cached_tokens -
    prompt_tokens_details.cache_write_tokens``, ``cache_read_tokens`` the
    cached ones and ``cache_write_tokens`` the written ones; ``output_tokens``
    is ``completion_tokens``, of which
    ``completion_tokens_details.reasoning_tokens`` are ``reasoning_tokens``.
    ``service_tier`` is the completion's own (a top-level field, not the
    usage's), kept when it changes the price (`priced_tier`). ``web_searches``
    are the searches the request ran that the usage does not count (a search
    model's one: `search_model`), its ``web_search_requests``. Missing or null
    counts are 0; a missing usage object is None.
    """
    if not isinstance(raw, Mapping):
        return None
    return openai_usage(raw.get("prompt_tokens"), raw.get("prompt_tokens_details"),
                        raw.get("completion_tokens"), raw.get("completion_tokens_details"),
                        service_tier, web_search_requests=web_searches)


@reported_usage
def openai_usage(prompt_tokens: object, prompt_details: object, output_tokens: object,
                 output_details: object, service_tier: object = None, *,
                 web_search_requests: int = 0) -> Usage:
    """The `Usage` of OpenAI's counts, for both of its APIs (Chat Completions'
    ``prompt_tokens`` / ``prompt_tokens_details`` / ``completion_tokens`` /
    ``completion_tokens_details``, the Responses API's ``input_tokens`` /
    ``input_tokens_details`` / ``output_tokens`` / ``output_tokens_details``):
    the prompt count holds the cached and the cache-written tokens, so the
    uncached input is what is left of it; the output details' reasoning tokens
    are inside the output count. Missing or null counts are 0; no part exceeds
    its whole."""
    prompt = token_count(prompt_tokens)
    output = token_count(output_tokens)
    cached = written = 0
    if isinstance(prompt_details, Mapping):
        cached = min(prompt, token_count(prompt_details.get("cached_tokens")))
        written = min(prompt - cached, token_count(prompt_details.get("cache_write_tokens")))
    reasoning = (output_details.get("reasoning_tokens") if isinstance(output_details, Mapping)
                 else 0)
    return Usage(input_tokens=prompt - cached - written, output_tokens=output,
                 cache_read_tokens=cached, cache_write_tokens=written,
                 reasoning_tokens=min(output, token_count(reasoning)),
                 web_search_requests=web_search_requests,
                 service_tier=priced_tier(service_tier))
