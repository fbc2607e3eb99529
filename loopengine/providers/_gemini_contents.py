"""Gemini ``contents`` <-> the engine's Anthropic shapes, for `GeminiProvider`.

The engine's transcript stays Anthropic-shaped; this module translates at
its boundary, both ways:

* ``system`` blocks become the ``systemInstruction``; user text becomes
  ``text`` parts, base64 images and PDFs ``inlineData`` parts; each
  ``tool_result`` becomes a ``functionResponse`` part (``{"result": text}``,
  or ``{"error": text}`` for an ``is_error`` result) named after the call it
  answers, placed first in its ``user`` content, its base64 images and
  documents the function response's own ``parts`` (``inlineData``) and any
  other image or document the note the model reads in its place; ``tool_use`` blocks become
  the model's ``functionCall`` parts (with their ids); ``cache_control``
  markers have no equivalent and are dropped (Gemini caches implicitly);
* thought signatures: a part the API sent with a ``thoughtSignature`` is kept
  as a ``thinking`` block just before the part's own block (``thinking`` empty,
  ``signature`` the signature in base64), and a thought summary (a part with
  ``thought: true``) as a ``thinking`` block with its text. Sent back, a
  signature block's signature goes on the next part of the same message (on
  an empty text part when none follows), so every signature returns on the
  part it came with, as the API requires across turns;
* a malformed function call (finish reason ``MALFORMED_FUNCTION_CALL`` or
  ``UNEXPECTED_TOOL_CALL``) becomes a ``tool_use`` block whose ``input`` is
  the API's ``finishMessage`` when the SDK hands it over (Vertex AI), else a
  placeholder: a string, so the loop's input check gives it a recoverable
  error result (R15) that uses a unit of the tool budget. Sent back, the call
  is the model's text and its result the user's text (`MALFORMED_FEEDBACK`),
  since there is no function call to answer;
* tools become one ``functionDeclarations`` tool with each JSON schema as
  ``parametersJsonSchema``; ``tool_choice`` ``auto`` / ``none`` / ``any`` / a
  named tool become the ``functionCallingConfig`` modes ``AUTO`` / ``NONE`` /
  ``ANY`` / ``ANY`` limited to that name.

``finishReason`` becomes the engine's stop reason: ``STOP`` -> ``end_turn``
(``tool_use`` when the reply calls functions), ``MAX_TOKENS``,
``CONTINUATION`` and ``TOO_MANY_TOOL_CALLS`` -> ``max_tokens``
(``incomplete``), the reasons of `REFUSED` and a prompt blocked by
``promptFeedback.blockReason`` -> ``refusal`` (``refused``). Any other
finish reason (`ANSWERED` lists the ones read here) is not an answer: the
provider raises its fault (``_gemini_faults.check_finish``).
``FINISH_REASON_UNSPECIFIED`` is the enum's unset value: no finish reason;
likewise ``BLOCKED_REASON_UNSPECIFIED`` blocks nothing.
"""

from __future__ import annotations

import base64
import binascii
import functools
import re
from collections.abc import Mapping, Sequence
from typing import Any

from loopengine._usage import Usage
from loopengine.providers._base import (
    ProviderRequest,
    media_note,
    new_call_id,
    priced_tier,
    reported_usage,
    text_or_none,
    token_count,
)
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
    "MALFORMED_CALL",
    "MALFORMED_FEEDBACK",
    "MALFORMED_PLACEHOLDER",
    "ANSWERED",
    "REFUSED",
    "TRAFFIC_TIERS",
    "StreamedReply",
    "check_translatable",
    "gemini_config",
    "gemini_contents",
    "usage_from_api",
]

REFUSED = frozenset({"SAFETY", "PROHIBITED_CONTENT", "BLOCKLIST", "SPII", "RECITATION",
                     "IMAGE_SAFETY", "IMAGE_PROHIBITED_CONTENT", "IMAGE_RECITATION",
                     "MODEL_ARMOR", "ESCALATION", "LANGUAGE"})
"""Finish reasons that mean the answer was withheld by the API's policy (its
content filters, recitation checks, blocklists, Model Armor, an escalation
rule, a language it does not serve): the run ends ``refused``."""

MALFORMED_CALL = frozenset({"MALFORMED_FUNCTION_CALL", "UNEXPECTED_TOOL_CALL"})
"""Finish reasons of a function call the API could not hand over: the model is told."""

MALFORMED_FEEDBACK = ("Your last function call could not be parsed, so it was not run. Call "
                      "the function again with valid arguments.")
"""What the model is told, as the user's text, of a malformed function call."""

MALFORMED_PLACEHOLDER = "(a function call that could not be parsed)"
"""The model's turn of a malformed function call when the API's ``finishMessage``
did not come through (the SDK drops it in the Gemini Developer API mode)."""

# An answer cut short: the output cap, the per-request token limit, or the
# API's server-side tool loop stopping before the model's final answer.
_CUT = frozenset({"MAX_TOKENS", "CONTINUATION", "TOO_MANY_TOOL_CALLS"})

ANSWERED = frozenset({"STOP", *_CUT, *REFUSED, *MALFORMED_CALL})
"""The finish reasons `StreamedReply.content` reads as a stop reason; any other is a fault."""

_UNSET = "FINISH_REASON_UNSPECIFIED"
_UNBLOCKED = "BLOCKED_REASON_UNSPECIFIED"
# The function a malformed call's message names: the API writes the call as code,
# often printed (``print(default_api.lookup(key=...``), so a ``print(`` around
# it is not the callee.
_CALLED = re.compile(r"(?:\bprint\s*\(\s*)?([A-Za-z_][\w.-]*)\s*\(")




API = "Gemini"

# The fault of a request holding what the Gemini API has no equivalent for.
_untranslatable = functools.partial(untranslatable, api=API)


# -- the request ------------------------------------------------------------------------

_ASSISTANT = frozenset({"text", "tool_use", "thinking", "redacted_thinking"})
_USER = frozenset({"text", "image", "document", "tool_result"})


# What the translation can send, checked in one place: `check_translatable`
# (before the attempt is recorded) and the translation itself (in `send`) ask
# the same questions below, in the same order, so they cannot disagree.


def _model_kind(block: Mapping[str, Any]) -> str:
    """An assistant block's kind, when the translation has one for it."""
    return block_kind(block, _ASSISTANT, "an assistant {!r} block", API)


def _user_kind(block: Mapping[str, Any]) -> str:
    """A user block's kind, when the translation has one for it."""
    return block_kind(block, _USER, "a user {!r} block", API)


def _base64(block: Mapping[str, Any]) -> bool:
    """Whether an image or document block holds base64 data."""
    source = block.get("source")
    return isinstance(source, Mapping) and source.get("type") == "base64"


def _data(block: Mapping[str, Any]) -> bytes:
    """An image or document block's base64 data, decoded."""
    if not _base64(block):
        raise _untranslatable(f"a {block.get('type')!r} block that is not base64 data")
    try:
        return base64.b64decode(str(block["source"].get("data", "")), validate=True)
    except (binascii.Error, ValueError):
        raise _untranslatable(f"a {block.get('type')!r} block whose data is not base64") \
            from None


def _inline(block: Mapping[str, Any]) -> dict[str, Any]:
    """An image or document of base64 data as an ``inline_data`` part."""
    data = _data(block)
    return {"inline_data": {"mime_type": str(block["source"].get("media_type")), "data": data}}


def _signature(value: object) -> bytes | None:
    """A thought signature kept in base64 (standard or URL-safe), as bytes."""
    if not isinstance(value, str) or not value:
        return None
    try:
        return base64.b64decode(value.replace("-", "+").replace("_", "/"), validate=True)
    except (binascii.Error, ValueError):
        raise _untranslatable("a thinking block whose signature is not base64") from None


def _result(block: Mapping[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """A ``tool_result``'s text and its media: the text of its text blocks (and of
    text documents), and each base64 image or document as a ``FunctionResponse``
    part (``inline_data``) beside the JSON ``response``. An image or document the
    API cannot take there (a URL) is the note `media_note` makes for it, read in
    its place."""
    content = block.get("content")
    if content is None or isinstance(content, str):
        return content or "", []
    texts: list[str] = []
    media: list[dict[str, Any]] = []
    for part in content:
        if result_kind(part, API) == "text":
            texts.append(str(part.get("text", "")))
        elif _base64(part):
            media.append(_inline(part))
        else:
            texts.append(media_note(part))
    return "\n\n".join(texts), media


def check_translatable(request: ProviderRequest) -> None:
    """Raise what `gemini_contents` would raise for ``request``, without
    translating it: the translation's own checks, block by block, in its order.

    Raises:
        ProviderFault: ``bad_request`` (``untranslatable``) for a block, a role or
            a ``tool_choice`` that has no Gemini equivalent.
    """
    check_blocks(request, _model_check, _user_check, API)
    if request.tools:
        _tool_config(request.tool_choice)


def _model_check(block: Mapping[str, Any]) -> None:
    """Refuse an assistant block the translation has no part for (`_model_kind`),
    or a ``thinking`` block whose signature is not base64."""
    if _model_kind(block) == "thinking":
        _signature(block.get("signature"))


def _user_check(block: Mapping[str, Any]) -> None:
    """Refuse a user block the translation has no part for (`_user_kind`), or
    whose data (or a tool result's media) is not base64."""
    kind = _user_kind(block)
    if kind == "tool_result":
        result = block.get("content")
        for part in () if result is None or isinstance(result, str) else result:
            if result_kind(part, API) != "text" and _base64(part):
                _data(part)
    elif kind != "text":
        _data(block)


def gemini_contents(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The ``contents`` (SDK dicts, snake_case) for Anthropic ``messages``.

    Raises:
        ProviderFault: ``bad_request`` (``untranslatable``) for what has no
            Gemini equivalent (a URL image, a server tool block...).
    """
    names: dict[str, str] = {}
    malformed: set[str] = set()
    out: list[dict[str, Any]] = []
    for message in messages:
        content = message.get("content")
        if message_role(message, API) == "assistant":
            parts = _model_parts(content, names, malformed)
            if parts:
                out.append({"role": "model", "parts": parts})
        else:
            out.append({"role": "user", "parts": _user_parts(content, names, malformed)})
    return out


def _model_parts(content: Any, names: dict[str, str], malformed: set[str]) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"text": content}] if content else []
    parts: list[dict[str, Any]] = []
    pending: bytes | None = None
    for block in content or ():
        kind = _model_kind(block)
        part: dict[str, Any]
        if kind == "redacted_thinking":
            continue  # another vendor's reasoning: nothing to send it as
        if kind == "thinking":
            thought = str(block.get("thinking") or "")
            signature = _signature(block.get("signature"))
            if not thought:
                pending = signature or pending
                continue
            part = {"text": thought, "thought": True}
            if signature is not None:
                part["thought_signature"] = signature
            parts.append(part)
            continue
        if kind == "text":
            part = {"text": str(block.get("text", ""))}
        else:
            call_id = str(block.get("id"))
            names[call_id] = str(block.get("name"))
            tool_input = block.get("input")
            if isinstance(tool_input, Mapping):
                part = {"function_call": {"id": call_id, "name": str(block.get("name")),
                                          "args": dict(tool_input)}}
            else:
                # A call the API could not parse: the model's own (malformed) text.
                malformed.add(call_id)
                part = {"text": str(tool_input)}
        if pending is not None:
            part["thought_signature"] = pending
            pending = None
        parts.append(part)
    if pending is not None:
        parts.append({"text": "", "thought_signature": pending})
    return parts


def _user_parts(content: Any, names: Mapping[str, str],
                malformed: set[str]) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"text": content}]
    responses: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for block in content or ():
        kind = _user_kind(block)
        if kind == "tool_result":
            call_id = str(block.get("tool_use_id"))
            text, media = _result(block)
            if call_id in malformed:
                parts.append({"text": MALFORMED_FEEDBACK})
                continue
            key = "error" if block.get("is_error") is True else "result"
            response: dict[str, Any] = {"id": call_id, "name": names.get(call_id, ""),
                                        "response": {key: text}}
            if media:
                response["parts"] = media
            responses.append({"function_response": response})
        elif kind == "text":
            parts.append({"text": str(block.get("text", ""))})
        else:
            parts.append(_inline(block))
    return [*responses, *parts] or [{"text": ""}]


_MODES: dict[str, dict[str, Any]] = {"auto": {"mode": "AUTO"}, "none": {"mode": "NONE"},
                                     "any": {"mode": "ANY"}}


def _tool_config(choice: Mapping[str, Any] | None) -> dict[str, Any] | None:
    calling = tool_choice(choice, _MODES,
                          lambda name: {"mode": "ANY", "allowed_function_names": [name]}, API)
    # A copy: the request's config must not share the table's dicts.
    return None if calling is None else {"function_calling_config": dict(calling)}


def gemini_config(request: ProviderRequest, http_options: dict[str, Any]) -> dict[str, Any]:
    """The ``GenerateContentConfig`` (SDK dict) of ``request``: its output cap,
    system instruction, tools, thinking, and the per-request ``http_options``;
    the SDK's own loops (automatic function calling, automatic continuation)
    off, so one call is one request."""
    config: dict[str, Any] = {
        "max_output_tokens": request.max_tokens,
        "automatic_function_calling": {"disable": True},
        "automatic_continuation": False,
        "http_options": http_options,
    }
    if request.system:
        config["system_instruction"] = {"parts": [{"text": str(block.get("text", ""))}
                                                  for block in request.system]}
    if request.tools:
        config["tools"] = [{"function_declarations": [
            function_tool(tool, "parameters_json_schema") for tool in request.tools]}]
        tool_config = _tool_config(request.tool_choice)
        if tool_config is not None:
            config["tool_config"] = tool_config
    thinking = request.features.thinking
    if thinking is not None:
        if thinking.adaptive and thinking.effort is not None:
            config["thinking_config"] = {"thinking_level": thinking.effort.upper()}
        else:
            # -1: the model decides how much to think (dynamic thinking).
            config["thinking_config"] = {
                "thinking_budget": -1 if thinking.adaptive else thinking.budget_tokens}
    return config


# -- the reply -----------------------------------------------------------------------------


def _encoded(signature: object) -> str | None:
    if isinstance(signature, bytes) and signature:
        return base64.b64encode(signature).decode("ascii")
    return None


class StreamedReply:
    """A reply put together from its parts, whole (one response) or chunk by chunk
    (a stream: text parts are joined, the last chunk's usage and finish reason
    kept)."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self.finish_reason: str | None = None
        self.finish_message: str | None = None
        self.block_reason: str | None = None
        self.usage: Usage | None = None
        self.response_id: str | None = None
        self.model: str | None = None
        self._joinable = False

    def add(self, response: Any) -> str:
        """Take one response (or stream chunk) of the SDK; return its text."""
        self.response_id = self.response_id or text_or_none(response.response_id)
        self.model = self.model or text_or_none(response.model_version)
        if response.usage_metadata is not None:
            # Streamed usage is cumulative: each chunk's counts replace the last.
            self.usage = usage_from_api(response.usage_metadata)
        feedback = response.prompt_feedback
        if feedback is not None and feedback.block_reason is not None and _name(
                feedback.block_reason) != _UNBLOCKED:
            # The enum's unset value blocks nothing.
            self.block_reason = _name(feedback.block_reason)
        text = ""
        for candidate in (response.candidates or ())[:1]:
            if candidate.finish_reason is not None and _name(candidate.finish_reason) != _UNSET:
                # The enum's unset value says the candidate has not finished.
                self.finish_reason = _name(candidate.finish_reason)
                self.finish_message = candidate.finish_message
            parts = candidate.content.parts if candidate.content is not None else None
            for part in parts or ():
                text += self._part(part)
        return text

    def _part(self, part: Any) -> str:
        signature = _encoded(part.thought_signature)
        if part.thought:
            self.blocks.append({"type": "thinking", "thinking": part.text or "",
                                "signature": signature or ""})
            self._joinable = False
            return ""
        if signature is not None:
            self.blocks.append({"type": "thinking", "thinking": "", "signature": signature})
            self._joinable = False
        if part.function_call is not None:
            call = part.function_call
            self.blocks.append({"type": "tool_use", "id": call.id or new_call_id(),
                                "name": call.name or "", "input": dict(call.args or {})})
            self._joinable = False
            return ""
        if part.text:
            if self._joinable:
                self.blocks[-1]["text"] += part.text
            else:
                self.blocks.append({"type": "text", "text": part.text})
                self._joinable = True
            return str(part.text)
        return ""

    @property
    def ended(self) -> bool:
        """Whether the reply is whole: its candidate finished (a ``finishReason``),
        or the prompt was blocked (``promptFeedback.blockReason``)."""
        return self.finish_reason is not None or self.block_reason is not None

    def content(self) -> tuple[list[dict[str, Any]], str]:
        """The reply's content blocks and the engine's stop reason (the table in the
        module docstring), once it is an answer: its prompt blocked (a refusal,
        whatever its candidate says), or its finish reason one of `ANSWERED` (the
        provider raises the fault of any other)."""
        blocks, finish = self.blocks, self.finish_reason
        if self.block_reason is not None:
            # Nothing was generated for a blocked prompt, whatever a candidate says.
            return blocks, "refusal"
        if finish in MALFORMED_CALL:
            said = self.finish_message or MALFORMED_PLACEHOLDER
            called = _CALLED.search(said.partition(":")[2] or said)
            name = called.group(1).rpartition(".")[2] if called is not None else ""
            return [*blocks, {"type": "tool_use", "id": new_call_id(),
                              "name": name, "input": said}], "tool_use"
        if finish in REFUSED:
            return blocks, "refusal"
        if finish in _CUT:
            return blocks, "max_tokens"
        calls = any(block["type"] == "tool_use" for block in blocks)  # STOP
        return blocks, "tool_use" if calls else "end_turn"


def _name(value: Any) -> str:
    """An SDK enum's (or a string's) value."""
    return str(getattr(value, "value", value))


@reported_usage
def usage_from_api(raw: Any) -> Usage:
    """Map Gemini's ``usageMetadata`` (the SDK's object) to `Usage`.

    ``promptTokenCount`` counts the cached tokens too, and the prompt of
    server-side tool use comes apart: ``input_tokens = promptTokenCount +
    toolUsePromptTokenCount - cachedContentTokenCount``, ``cache_read_tokens =
    cachedContentTokenCount``; the thinking is billed as output:
    ``output_tokens = candidatesTokenCount + thoughtsTokenCount``, of which
    ``thoughtsTokenCount`` are ``reasoning_tokens``. Missing counts are 0.
    Vertex AI's ``trafficType`` is the tier that served the request
    (`TRAFFIC_TIERS`), kept when it changes the price (`priced_tier`).
    """
    prompt = token_count(raw.prompt_token_count) + token_count(raw.tool_use_prompt_token_count)
    cached = min(prompt, token_count(raw.cached_content_token_count))
    thoughts = token_count(raw.thoughts_token_count)
    output = token_count(raw.candidates_token_count) + thoughts
    traffic = raw.traffic_type
    return Usage(input_tokens=prompt - cached, output_tokens=output,
                 cache_read_tokens=cached, reasoning_tokens=thoughts,
                 service_tier=None if traffic is None else priced_tier(
                     TRAFFIC_TIERS.get(_name(traffic), _name(traffic).lower())))


TRAFFIC_TIERS = {"TRAFFIC_TYPE_UNSPECIFIED": "standard", "ON_DEMAND": "standard",
                 "ON_DEMAND_PRIORITY": "priority", "ON_DEMAND_FLEX": "flex",
                 "ON_DEMAND_OFFPEAK": "offpeak",
                 "PROVISIONED_THROUGHPUT": "provisioned_throughput"}
"""Vertex AI's ``usageMetadata.trafficType`` as a service tier: pay-as-you-go
(``ON_DEMAND``) is the list rates; Priority, Flex and Off-Peak pay-as-you-go are
priced apart; Provisioned Throughput is paid for by subscription, not per token.
Any other type is kept lower-cased."""
