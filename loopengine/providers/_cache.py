"""Cache markers: where ``cache_control`` goes, and never more than four (R12).

Anthropic accepts at most four ``cache_control`` markers on one request. The
policy asks for markers on the system prompt, the tool definitions and the
newest message; the caller may have marked blocks of their own (content
blocks, tool definitions, system blocks, and the blocks inside a
``tool_result``). When more than four are asked for, markers are kept in this
priority and the rest are dropped:

1. the conversation marker (the newest message's last cacheable block),
2. the tool-definitions marker (the last tool),
3. the system-prompt marker (the last system block),
4. the caller's own markers, latest in the prompt first (messages from the
   newest back, then system blocks from the last back, then tools).

Markers later in the prompt cover a longer prefix, which is why, among equals,
the later one wins.

Anthropic also refuses a one-hour marker after a five-minute one (the prompt
runs tools, then system, then messages). Of the markers kept, one that comes
after a five-minute marker is therefore sent as a five-minute marker too:
shortening never makes a cache write dearer, where lengthening the earlier
one would.
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
    """Which parts of a request get prompt-cache markers.

    Whatever is asked for, a request carries at most four markers; see
    `place_cache_markers` for which are kept.
    """

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
    """One place a marker could go: (part, index, block index, index of a block
    inside that block's ``content``, as in a ``tool_result``)."""

    part: Literal["system", "tools", "messages"]
    index: int
    block: int | None
    inner: int | None = None

    def prompt_order(self) -> tuple[int, int, int, int]:
        """Where the slot sits in the prompt (tools, then system, then messages);
        a block's own marker comes after the markers inside it."""
        part = {"tools": 0, "system": 1, "messages": 2}[self.part]
        inner = _END if self.inner is None else self.inner
        return part, self.index, -1 if self.block is None else self.block, inner


_END = 1 << 30


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

    The policy's markers and the caller's own (inside ``tool_result`` blocks
    too) are kept in this priority while there is room: the conversation
    marker, the tool-definitions marker, the system-prompt marker, then the
    caller's markers latest in the prompt first. A kept one-hour marker after
    a five-minute one is sent as a five-minute marker, as Anthropic requires.
    The inputs are not modified. String message contents that need a marker
    become one text block.
    """
    system_out = [dict(b) for b in system] if system is not None else None
    tools_out = [dict(t) for t in tools]
    messages_out = [dict(m) for m in messages]

    caller: dict[_Slot, Any] = {}

    def blocks_of(message: dict[str, Any]) -> list[dict[str, Any]]:
        # Fresh blocks (and a fresh list) in place of the caller's.
        content = message.get("content")
        if isinstance(content, str):
            blocks = [{"type": "text", "text": content}]
        else:
            blocks = [dict(b) for b in content or ()]
        message["content"] = blocks
        return blocks

    def inner_of(block: dict[str, Any]) -> list[dict[str, Any]]:
        inner = [dict(b) for b in block["content"]]
        block["content"] = inner
        return inner

    # Take every existing marker off, remembering where the caller put it.
    for i, tool in enumerate(tools_out):
        if "cache_control" in tool:
            caller[_Slot("tools", i, None)] = tool.pop("cache_control")
    for i, block in enumerate(system_out or ()):
        if "cache_control" in block:
            caller[_Slot("system", i, None)] = block.pop("cache_control")
    for i, message in enumerate(messages_out):
        content = message.get("content")
        if not (isinstance(content, list) and any(_marked(b) for b in content)):
            continue
        for j, block in enumerate(blocks_of(message)):
            if "cache_control" in block:
                caller[_Slot("messages", i, j)] = block.pop("cache_control")
            if _marked_inside(block):
                for k, inner in enumerate(inner_of(block)):
                    if "cache_control" in inner:
                        caller[_Slot("messages", i, j, k)] = inner.pop("cache_control")

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
    for slot in sorted(caller, key=lambda s: (order[s.part], [-n for n in s.prompt_order()[1:]])):
        wanted.append((slot, caller[slot]))

    kept: dict[_Slot, Any] = {}
    for slot, marker in wanted:
        if len(kept) == MAX_CACHE_MARKERS:
            break
        kept.setdefault(slot, marker)

    short_before = False
    for slot in sorted(kept, key=_Slot.prompt_order):
        marker = copy.deepcopy(kept[slot])
        if isinstance(marker, dict):
            if short_before and marker.get("ttl") == "1h":
                del marker["ttl"]  # the five-minute default
            short_before = short_before or marker.get("ttl", "5m") == "5m"
        if slot.part == "tools":
            tools_out[slot.index]["cache_control"] = marker
        elif slot.part == "system":
            assert system_out is not None
            system_out[slot.index]["cache_control"] = marker
        else:
            # A fresh list of fresh blocks: the caller's message must not change.
            blocks = blocks_of(messages_out[slot.index])
            assert slot.block is not None
            if slot.inner is None:
                blocks[slot.block]["cache_control"] = marker
            else:
                inner_of(blocks[slot.block])[slot.inner]["cache_control"] = marker
    return system_out, tools_out, messages_out


def _marked_inside(block: Mapping[str, Any]) -> bool:
    """Whether blocks inside ``block`` (a ``tool_result``'s content) carry markers."""
    inner = block.get("content")
    return isinstance(inner, list) and any(_marked(b) for b in inner)


def _marked(block: Any) -> bool:
    return isinstance(block, Mapping) and ("cache_control" in block or _marked_inside(block))


def cache_markers(
    *,
    system: Sequence[Mapping[str, Any]] | str | None,
    tools: Sequence[Mapping[str, Any]],
    messages: Sequence[Mapping[str, Any]],
) -> list[Any]:
    """The ``cache_control`` markers of a request body, in prompt order (tools,
    system, messages, and the blocks inside a ``tool_result`` before its own)."""
    found = [t["cache_control"] for t in tools if "cache_control" in t]
    if not isinstance(system, str):
        found += [b["cache_control"] for b in system or () if "cache_control" in b]
    for message in messages:
        content = message.get("content")
        for block in content if isinstance(content, list) else ():
            if not isinstance(block, Mapping):
                continue
            inner = block.get("content")
            for nested in inner if isinstance(inner, list) else ():
                if isinstance(nested, Mapping) and "cache_control" in nested:
                    found.append(nested["cache_control"])
            if "cache_control" in block:
                found.append(block["cache_control"])
    return found


def cache_marker_problem(body: Any) -> str | None:
    """Why Anthropic would refuse the markers of a request body, or None: more
    than four, or a one-hour marker after a five-minute one."""
    if not isinstance(body, Mapping):
        return None
    system = body.get("system")
    tools = body.get("tools")
    messages = body.get("messages")
    markers = cache_markers(
        system=system if isinstance(system, (str, list)) else None,
        tools=tools if isinstance(tools, list) else [],
        messages=messages if isinstance(messages, list) else [],
    )
    if len(markers) > MAX_CACHE_MARKERS:
        return (f"A maximum of {MAX_CACHE_MARKERS} blocks with cache_control may be "
                f"provided. Found {len(markers)}.")
    short_before = False
    for marker in markers:
        ttl = marker.get("ttl", "5m") if isinstance(marker, Mapping) else "5m"
        if ttl == "1h" and short_before:
            return ("a ttl='1h' cache_control block must not come after a ttl='5m' "
                    "cache_control block. Note that blocks are processed in the following "
                    "order: `tools`, `system`, `messages`.")
        short_before = short_before or ttl == "5m"
    return None


def count_cache_markers(
    *,
    system: Sequence[Mapping[str, Any]] | str | None,
    tools: Sequence[Mapping[str, Any]],
    messages: Sequence[Mapping[str, Any]],
) -> int:
    """Count the ``cache_control`` markers in a request body (for tests and checks)."""
    return len(cache_markers(system=system, tools=tools, messages=messages))
