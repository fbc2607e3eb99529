"""Cache markers: where ``cache_control`` goes, and never more than four (R12).

Anthropic accepts at most four ``cache_control`` markers on one request. The
policy asks for markers on the system prompt, the tool definitions and the
newest message; the caller may have marked blocks of their own (content
blocks, tool definitions, system blocks, and nested blocks: those inside a
``tool_result`` or a search result, a document's own text blocks, the
document of a web fetch result, the tool references of a tool search
result). A
``cache_control`` of None is no marker. When more than four are asked for,
markers are kept in this priority and the rest are dropped:

1. the conversation marker (the newest message's last cacheable block),
2. the tool-definitions marker (the last tool),
3. the system-prompt marker (the last system block),
4. the caller's own markers, latest in the prompt first (messages from the
   newest back, then system blocks from the last back, then tools; a block
   ends after the blocks nested in it, so its own marker comes first).

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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from loopengine import _validate
from loopengine._errors import ConfigError

__all__ = ["MAX_CACHE_MARKERS", "CachePolicy", "place_cache_markers"]

MAX_CACHE_MARKERS = 4
"""The most ``cache_control`` markers one Anthropic request may carry."""

_UNCACHEABLE = frozenset({"thinking", "redacted_thinking", "fallback", "mcp_tool_listing"})
"""The block types that cannot carry ``cache_control`` (the SDK's block params
without it): the conversation marker goes on the newest message's last block
of another type, or nowhere."""


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
            raise ConfigError("ttl", f"must be '5m' or '1h', got {_validate.shown(self.ttl)}")

    @property
    def marker(self) -> dict[str, str]:
        """The ``cache_control`` value the policy places."""
        if self.ttl == "5m":
            return {"type": "ephemeral"}
        return {"type": "ephemeral", "ttl": self.ttl}


Path = tuple[Any, ...]
"""Where a block sits inside one message: its index in the content, then, for
each level down, the key of the nested block or list and, in a list, the
index, e.g. ``(2, "content", 0)`` for the first block inside the third
block's content, ``(1, "content", "content")`` for a web fetch result's
document."""

# The fields through which a block holds other blocks (`_children`): a
# tool_result's, search result's or MCP result's ``content`` list, a
# document's ``source`` (whose ``content`` lists its blocks), a web fetch
# result's ``content`` (a web_fetch_result, whose ``content`` is a document),
# a tool search result's ``content`` and its ``tool_references``. Never a tool
# call's ``input``: that is the model's data, whatever keys it has.
_NESTING = ("content", "source", "tool_references")


@dataclass(frozen=True, slots=True)
class _Slot:
    """One place a marker could go: a tool, a system block, or a block of a message."""

    part: Literal["system", "tools", "messages"]
    index: int
    path: Path = ()


def _children(block: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """The fields of ``block`` holding blocks (`_NESTING`): a list of blocks, or
    one block (a mapping)."""
    for key in _NESTING:
        inner = block.get(key)
        if isinstance(inner, list | Mapping):
            yield key, inner


def _walk(blocks: Sequence[Any], prefix: Path = ()) -> Iterator[tuple[Path, Mapping[str, Any]]]:
    """Every block, nested ones included, in prompt order: a block comes after the
    blocks inside it (its end is where a marker on it closes the prefix)."""
    for j, block in enumerate(blocks):
        if isinstance(block, Mapping):
            yield from _block((*prefix, j), block)


def _block(path: Path, block: Mapping[str, Any]) -> Iterator[tuple[Path, Mapping[str, Any]]]:
    """``block`` (at ``path``) after the blocks nested in it."""
    for key, inner in _children(block):
        if isinstance(inner, list):
            yield from _walk(inner, (*path, key))
        else:
            yield from _block((*path, key), inner)
    yield path, block


def _has_marker(blocks: Sequence[Any]) -> bool:
    """Whether any block, nested ones included, has a ``cache_control`` key."""
    # Plain dicts checked first: this runs over every block of every request.
    for block in blocks:
        if (type(block) is dict or isinstance(block, Mapping)) and _marked(block):
            return True
    return False


def _marked(block: Mapping[str, Any]) -> bool:
    """Whether ``block`` or a block nested in it has a ``cache_control`` key."""
    if "cache_control" in block:
        return True
    for key in _NESTING:
        inner = block.get(key)
        if inner is None or type(inner) is str:
            continue
        if isinstance(inner, list):
            if _has_marker(inner):
                return True
        elif isinstance(inner, Mapping) and _marked(inner):
            return True
    return False


def _edit(blocks: list[Any], path: Path) -> dict[str, Any]:
    """The block at ``path``, copied (with every list and block above it) so that
    changing it leaves the caller's objects alone."""
    node: Any = blocks
    for step in path:
        child = node[step]
        child = list(child) if isinstance(child, list) else dict(child)
        node[step] = child
        node = child
    assert isinstance(node, dict)
    return node


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

    The policy's markers and the caller's own (on nested blocks too, such as
    those inside a ``tool_result``) are kept in this priority while there is
    room: the conversation marker, the tool-definitions marker, the
    system-prompt marker, then the caller's markers latest in the prompt
    first. A kept one-hour marker after a five-minute one is sent as a
    five-minute marker, as Anthropic requires; ``cache_control: None`` is no
    marker and is left out. The inputs are not modified. String message
    contents that need a marker become one text block.
    """
    system_out = [dict(b) for b in system] if system is not None else None
    tools_out = [dict(t) for t in tools]
    messages_out = [dict(m) for m in messages]

    # Where each slot that matters sits in the prompt (tools, then system, then
    # messages), and the caller's markers, taken off the copies. Only messages
    # with a marker somewhere, and the newest one, are walked.
    position: dict[_Slot, tuple[int, int, int]] = {}
    caller: dict[_Slot, Any] = {}
    parts: dict[Literal["tools", "system"], list[dict[str, Any]]] = {
        "tools": tools_out, "system": system_out or []}
    for rank, (part, blocks) in enumerate(parts.items()):
        for i, block in enumerate(blocks):
            position[_Slot(part, i)] = (rank, i, 0)
            marker = block.pop("cache_control", None)
            if marker is not None:
                caller[_Slot(part, i)] = marker
    last = len(messages_out) - 1
    for i, message in enumerate(messages_out):
        content = message.get("content")
        if isinstance(content, str):
            position[_Slot("messages", i, (0,))] = (2, i, 0)
            continue
        if not isinstance(content, list) or not (i == last or _has_marker(content)):
            continue
        content = message["content"] = list(content)
        for ordinal, (path, nested) in enumerate(_walk(content)):
            slot = _Slot("messages", i, path)
            position[slot] = (2, i, ordinal)
            if "cache_control" in nested:
                marker = _edit(content, path).pop("cache_control")
                if marker is not None:
                    caller[slot] = marker

    wanted: list[tuple[_Slot, Any]] = []
    if policy.conversation and messages_out:
        content = messages_out[last].get("content")
        candidates = (
            [0] if isinstance(content, str) and content else
            [j for j, b in enumerate(content or ()) if isinstance(b, Mapping) and _cacheable(b)]
        )
        if candidates:
            wanted.append((_Slot("messages", last, (candidates[-1],)), policy.marker))
    if policy.tools and tools_out:
        wanted.append((_Slot("tools", len(tools_out) - 1), policy.marker))
    if policy.system and system_out:
        wanted.append((_Slot("system", len(system_out) - 1), policy.marker))
    # The caller's: latest in the prompt first.
    wanted.extend(sorted(caller.items(), key=lambda item: position[item[0]], reverse=True))

    kept: dict[_Slot, Any] = {}
    for slot, marker in wanted:
        if len(kept) == MAX_CACHE_MARKERS:
            break
        kept.setdefault(slot, marker)

    short_before = False
    for slot in sorted(kept, key=position.__getitem__):
        asked = kept[slot]
        marker = dict(asked) if isinstance(asked, Mapping) else copy.deepcopy(asked)
        if short_before and _ttl(marker) == "1h":
            del marker["ttl"]  # the five-minute default
        short_before = short_before or _ttl(marker) == "5m"
        if slot.part == "tools":
            tools_out[slot.index]["cache_control"] = marker
        elif slot.part == "system":
            assert system_out is not None
            system_out[slot.index]["cache_control"] = marker
        else:
            message = messages_out[slot.index]
            content = message.get("content")
            # A fresh list: the caller's message must not change.
            message["content"] = blocks = (
                [{"type": "text", "text": content}] if isinstance(content, str)
                else list(content or ()))
            _edit(blocks, slot.path)["cache_control"] = marker
    return system_out, tools_out, messages_out


def cache_markers(body: Mapping[str, Any]) -> list[Any]:
    """The ``cache_control`` markers of a request body in prompt order: its
    ``tools``, its ``system`` blocks, then its ``messages`` (a block after the
    blocks nested inside it); a part that is not a list has none. A
    ``cache_control`` of None is no marker."""
    found: list[Any] = []
    for part in ("tools", "system"):
        blocks = body.get(part)
        found += [b["cache_control"] for b in blocks if isinstance(b, Mapping)
                  and b.get("cache_control") is not None] if isinstance(blocks, list) else []
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list):
            found += [block["cache_control"] for _, block in _walk(content)
                      if block.get("cache_control") is not None]
    return found


def marker_lifetimes(body: Mapping[str, Any]) -> frozenset[str]:
    """The lifetimes (``5m``, ``1h``) of a request body's ``cache_control`` markers:
    what its cache writes can have been."""
    return frozenset(_ttl(marker) for marker in cache_markers(body))


def cache_marker_problem(body: Any) -> str | None:
    """Why Anthropic would refuse the markers of a request body, or None: more
    than four, a one-hour marker after a five-minute one, or one on a block
    that cannot carry it (`_UNCACHEABLE`)."""
    if not isinstance(body, Mapping):
        return None
    messages = body.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        content = message.get("content") if isinstance(message, Mapping) else None
        for path, block in _walk(content) if isinstance(content, list) else ():
            if block.get("cache_control") is not None and block.get("type") in _UNCACHEABLE:
                where = ".".join(str(step) for step in ("messages", i, "content", *path))
                return f"{where}.{block['type']}.cache_control: Extra inputs are not permitted"
    markers = cache_markers(body)
    if len(markers) > MAX_CACHE_MARKERS:
        return (f"A maximum of {MAX_CACHE_MARKERS} blocks with cache_control may be "
                f"provided. Found {len(markers)}.")
    short_before = False
    for marker in markers:
        ttl = _ttl(marker)
        if ttl == "1h" and short_before:
            return ("a ttl='1h' cache_control block must not come after a ttl='5m' "
                    "cache_control block. Note that blocks are processed in the following "
                    "order: `tools`, `system`, `messages`.")
        short_before = short_before or ttl == "5m"
    return None


def _ttl(marker: Any) -> str:
    """A marker's lifetime as the API reads it (five minutes unless it says)."""
    return str(marker.get("ttl", "5m")) if isinstance(marker, Mapping) else "5m"

