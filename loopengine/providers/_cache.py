"""Cache markers: where ``cache_control`` goes, and never more than four (R12).

Anthropic accepts at most four ``cache_control`` markers on one request. The
policy asks for markers on the system prompt, the tool definitions and the
newest message; the caller may have marked blocks of their own. When more
than four are asked for, markers are kept in this priority and the rest are
dropped:

1. the conversation marker (the newest message's last cacheable block),
2. the tool-definitions marker (the last tool),
3. the system-prompt marker (the last system block),
4. the caller's own markers, latest in the prompt first (messages from the
   newest back, then system blocks from the last back, then tools).

Markers later in the prompt cover a longer prefix, which is why, among equals,
the later one wins.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from loopengine import _validate
from loopengine._errors import ConfigError

__all__ = ["MAX_CACHE_MARKERS", "CachePolicy", "place_cache_markers"]

MAX_CACHE_MARKERS = 4
"""The most ``cache_control`` markers one Anthropic request may carry."""

_UNCACHEABLE = frozenset({"thinking", "redacted_thinking"})


@dataclass(frozen=True, slots=True, kw_only=True)
class CachePolicy:
    """Which parts of a request get prompt-cache markers."""

    system: bool = False
    """Mark the end of the system prompt (stable instructions)."""
    tools: bool = False
    """Mark the end of the tool definitions."""
    conversation: bool = False
    """Move one marker onto the newest message every turn."""
    ttl: Literal["5m", "1h"] = "5m"
    """The lifetime of the markers the policy places."""

    def __post_init__(self) -> None:
        for name in ("system", "tools", "conversation"):
            _validate.boolean(name, getattr(self, name))
        if self.ttl not in ("5m", "1h"):
            raise ConfigError("ttl", f"must be '5m' or '1h', got {self.ttl!r}")

    @property
    def marker(self) -> dict[str, str]:
        """The ``cache_control`` value the policy places."""
        if self.ttl == "5m":
            return {"type": "ephemeral"}
        return {"type": "ephemeral", "ttl": self.ttl}


@dataclass(frozen=True, slots=True)
class _Slot:
    """One place a marker could go: (part, index, block index)."""

    part: Literal["system", "tools", "messages"]
    index: int
    block: int | None


def _cacheable(block: Mapping[str, Any]) -> bool:
    if block.get("type") in _UNCACHEABLE:
        return False
    return not (block.get("type") == "text" and not block.get("text"))


def place_cache_markers(
    policy: CachePolicy,
    *,
    system: Sequence[Mapping[str, Any]] | None,
    tools: Sequence[Mapping[str, Any]],
    messages: Sequence[Mapping[str, Any]],
) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]], list[dict[str, Any]]]:
    """Return copies of ``system``, ``tools`` and ``messages`` with at most four markers.

    The inputs are not modified. String message contents that need a marker
    become one text block.
    """
    system_out = [dict(b) for b in system] if system is not None else None
    tools_out = [dict(t) for t in tools]
    messages_out = [dict(m) for m in messages]

    caller: dict[_Slot, Any] = {}

    def blocks_of(message: dict[str, Any]) -> list[dict[str, Any]]:
        content = message.get("content")
        if isinstance(content, str):
            blocks = [{"type": "text", "text": content}]
        else:
            blocks = [dict(b) for b in content or ()]
        message["content"] = blocks
        return blocks

    # Take every existing marker off, remembering where the caller put it.
    for i, tool in enumerate(tools_out):
        if "cache_control" in tool:
            caller[_Slot("tools", i, None)] = tool.pop("cache_control")
    for i, block in enumerate(system_out or ()):
        if "cache_control" in block:
            caller[_Slot("system", i, None)] = block.pop("cache_control")
    for i, message in enumerate(messages_out):
        content = message.get("content")
        if isinstance(content, list) and any(
            isinstance(b, Mapping) and "cache_control" in b for b in content
        ):
            for j, block in enumerate(blocks_of(message)):
                if "cache_control" in block:
                    caller[_Slot("messages", i, j)] = block.pop("cache_control")

    wanted: list[tuple[_Slot, Any]] = []
    if policy.conversation and messages_out:
        last = len(messages_out) - 1
        content = messages_out[last].get("content")
        candidates = (
            [0] if isinstance(content, str) and content else
            [j for j, b in enumerate(content or ()) if isinstance(b, Mapping) and _cacheable(b)]
        )
        if candidates:
            wanted.append((_Slot("messages", last, candidates[-1]), policy.marker))
    if policy.tools and tools_out:
        wanted.append((_Slot("tools", len(tools_out) - 1, None), policy.marker))
    if policy.system and system_out:
        wanted.append((_Slot("system", len(system_out) - 1, None), policy.marker))

    order = {"messages": 0, "system": 1, "tools": 2}
    for slot in sorted(caller, key=lambda s: (order[s.part], -s.index, -(s.block or 0))):
        wanted.append((slot, caller[slot]))

    kept: dict[_Slot, Any] = {}
    for slot, marker in wanted:
        if len(kept) == MAX_CACHE_MARKERS:
            break
        kept.setdefault(slot, marker)

    for slot, marker in kept.items():
        if slot.part == "tools":
            tools_out[slot.index]["cache_control"] = copy.deepcopy(marker)
        elif slot.part == "system":
            assert system_out is not None
            system_out[slot.index]["cache_control"] = copy.deepcopy(marker)
        else:
            # A fresh list of fresh blocks: the caller's message must not change.
            blocks = blocks_of(messages_out[slot.index])
            assert slot.block is not None
            blocks[slot.block]["cache_control"] = copy.deepcopy(marker)
    return system_out, tools_out, messages_out


def count_cache_markers(
    *,
    system: Sequence[Mapping[str, Any]] | str | None,
    tools: Sequence[Mapping[str, Any]],
    messages: Sequence[Mapping[str, Any]],
) -> int:
    """Count the ``cache_control`` markers in a request body (for tests and checks)."""
    count = sum(1 for t in tools if "cache_control" in t)
    if not isinstance(system, str):
        count += sum(1 for b in system or () if "cache_control" in b)
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            count += sum(1 for b in content if isinstance(b, Mapping) and "cache_control" in b)
    return count
