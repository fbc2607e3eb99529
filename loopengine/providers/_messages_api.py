"""Rules of the Messages API that `AnthropicProvider` applies before the wire
and `loopengine.testing.FakeAnthropicServer` applies as the API does."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

__all__ = ["PROPERTY_KEY_PATTERN", "ROOT_COMPOSITIONS", "TOOL_BLOCKS_WITHOUT_TOOLS",
           "tool_blocks_without_tools", "tool_schema_refusal", "unthought_opening"]

TOOL_BLOCKS_WITHOUT_TOOLS = ("Requests which include `tool_use` or `tool_result` blocks must "
                             "define tools.")
"""The Messages API's words for a request that `tool_blocks_without_tools` finds."""


def tool_blocks_without_tools(messages: object, tools: object) -> bool:
    """Whether a request's ``messages`` hold a ``tool_use`` or ``tool_result``
    block while it defines no ``tools``: the Messages API refuses it (a 400),
    as when a transcript with tool calls is continued by a run given no tools."""
    if tools:
        return False
    if not isinstance(messages, Sequence):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list) and any(
                isinstance(block, Mapping) and block.get("type") in ("tool_use", "tool_result")
                for block in content):
            return True
    return False


def unthought_opening(message: object) -> str | None:
    """The type of the block an assistant ``message`` begins with (``text`` for
    text content) when that is not a thinking block; None for a message that
    begins with one (the model's own, carried back) or is not the assistant's.

    While thinking is on, the Messages API refuses a final assistant message
    that begins otherwise (a 400): a prefill of the reply, or the message whose
    tool calls the last user message answers. Anthropic documents it (prefilling
    is not supported with extended thinking); the Gemini API
    documents no such rule, so a final model turn goes to it as it is, and the
    OpenAI routes take no ``thinking`` (docs/providers.md).
    """
    if not isinstance(message, Mapping) or message.get("role") != "assistant":
        return None
    content = message.get("content")
    first = content[0] if isinstance(content, list) and content else None
    kind = str(first.get("type")) if isinstance(first, Mapping) else "text"
    return None if kind in ("thinking", "redacted_thinking") else kind


PROPERTY_KEY_PATTERN = "^[a-zA-Z0-9_.-]{1,64}$"
"""What the Messages API requires of each property name at the root of a tool's
``input_schema``; it refuses a tool with another (a 400 naming the pattern)."""

_PROPERTY_KEY = re.compile(PROPERTY_KEY_PATTERN.strip("^$"))

ROOT_COMPOSITIONS = ("oneOf", "allOf", "anyOf")
"""The keywords the Messages API refuses at the root of a tool's ``input_schema``
(inside its properties they are taken)."""


def tool_schema_refusal(tools: object) -> tuple[int, str, str] | None:
    """Why the Messages API would refuse one of ``tools`` for its ``input_schema``,
    or None: the first such tool's index, the API's words, and what in the
    schema it is. It refuses a schema with `ROOT_COMPOSITIONS` at its root (a
    raw or MCP tool's "one of these fields" rule), and one naming a property, at
    its root, that `PROPERTY_KEY_PATTERN` does not match (a space, an ``@``, a
    ``$``, a non-ASCII letter, more than 64 characters: a pydantic field's
    alias may be any of these)."""
    for index, tool in enumerate(tools if isinstance(tools, Sequence) else ()):
        schema = tool.get("input_schema") if isinstance(tool, Mapping) else None
        if not isinstance(schema, Mapping):
            continue
        for key in ROOT_COMPOSITIONS:
            if key in schema:
                return (index, f"tools.{index}.custom.input_schema: input_schema does not "
                               "support oneOf, allOf, or anyOf at the top level",
                        f"its input schema has {key!r} at its root")
        properties = schema.get("properties")
        for name in properties if isinstance(properties, Mapping) else ():
            if not (isinstance(name, str) and _PROPERTY_KEY.fullmatch(name)):
                return (index, f"tools.{index}.custom.input_schema.properties: Property keys "
                               f"should match pattern '{PROPERTY_KEY_PATTERN}'",
                        f"its input schema names a property {str(name)[:80]!r} (rename it; for "
                        "a pydantic model, give the field an alias that matches)")
    return None
