"""A rule of the Messages API that `AnthropicProvider` applies before the wire
and `loopengine.testing.FakeAnthropicServer` applies as the API does."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["TOOL_BLOCKS_WITHOUT_TOOLS", "tool_blocks_without_tools"]

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
