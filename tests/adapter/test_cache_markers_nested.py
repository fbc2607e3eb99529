"""R12 on histories whose markers sit in blocks nested through a mapping: a web
fetch result's document and a tool search result's tool references (the SDK's
``DocumentBlockParam`` and ``ToolReferenceBlockParam`` each take a
``cache_control``), counted towards the four with every other marker, through
the real SDK against the loopback Messages API."""

from __future__ import annotations

import copy
from typing import Any

import pytest

import loopengine as le
from loopengine.providers._cache import CachePolicy, cache_marker_problem, place_cache_markers
from loopengine.testing import Reply

from ..conftest import MODEL
from .conftest import STREAMING, Harness

MARK = {"type": "ephemeral"}


def every_marker(value: Any, key: str | None = None) -> int:
    """Every ``cache_control`` in a request body, however deep, except inside a
    tool call's ``input`` (the model's data): an independent count of what the
    API would find."""
    if key == "input":
        return 0
    if isinstance(value, dict):
        own = 1 if value.get("cache_control") is not None else 0
        return own + sum(every_marker(v, k) for k, v in value.items())
    if isinstance(value, list):
        return sum(every_marker(v) for v in value)
    return 0


def history() -> list[dict[str, Any]]:
    fetched = {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                              "data": "the page"},
               "cache_control": MARK}
    return [
        {"role": "user", "content": "read the page and find a tool"},
        {"role": "assistant", "content": [
            {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_fetch",
             "input": {"url": "https://example.com", "cache_control": "user data"}},
            {"type": "web_fetch_tool_result", "tool_use_id": "srvtoolu_1",
             "content": {"type": "web_fetch_result", "url": "https://example.com",
                         "content": fetched}},
            {"type": "server_tool_use", "id": "srvtoolu_2", "name": "tool_search",
             "input": {"query": "weather"}},
            {"type": "tool_search_tool_result", "tool_use_id": "srvtoolu_2",
             "content": {"type": "tool_search_tool_search_result", "tool_references": [
                 {"type": "tool_reference", "tool_name": f"tool_{k}", "cache_control": MARK}
                 for k in range(3)]}},
            {"type": "text", "text": "found them"},
        ]},
        {"role": "user", "content": "go on"},
    ]


@STREAMING
async def test_r12_markers_nested_through_mappings_count_on_the_wire_anthropic(
    wire: Harness, stream: bool
) -> None:
    """Four markers in nested mappings plus the system and conversation markers:
    four reach the server, the policy's first, then the caller's latest; a
    ``cache_control`` key in a tool call's input is data and stays; the
    caller's history is not changed."""
    messages = history()
    before = copy.deepcopy(messages)
    op = le.Operation(name="test.cached", provider="anthropic", model=MODEL,
                      cache=CachePolicy(system=True, conversation=True))
    engine, _ = wire.engine(Reply.text("done"), stream=stream)
    result = await engine.run(op, messages, system="Be brief.")
    assert result.outcome is le.Outcome.COMPLETED
    assert messages == before
    (request,) = wire.requests
    assert every_marker(request.body) == 4
    assert request.body["system"][-1]["cache_control"] == MARK
    assert request.body["messages"][-1]["content"][-1]["cache_control"] == MARK
    sent = request.body["messages"][1]["content"]
    assert sent[0]["input"] == {"url": "https://example.com", "cache_control": "user data"}
    assert "cache_control" not in sent[1]["content"]["content"]
    references = sent[3]["content"]["tool_references"]
    assert ["cache_control" in r for r in references] == [False, True, True]


@pytest.mark.parametrize("ttl", ["5m", "1h"])
def test_a_nested_marker_keeps_the_lifetime_order(ttl: str) -> None:
    """A one-hour marker on a web fetch result's document after a five-minute
    system marker is sent as a five-minute marker, as the API requires; after a
    one-hour one it stays."""
    messages = history()
    messages[1]["content"][1]["content"]["content"]["cache_control"] = {
        "type": "ephemeral", "ttl": "1h"}
    for reference in messages[1]["content"][3]["content"]["tool_references"]:
        del reference["cache_control"]
    system = [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral", "ttl": ttl}}]
    out_system, tools, out = place_cache_markers(CachePolicy(), system=system, tools=[],
                                                 messages=messages)
    body = {"system": out_system, "tools": tools, "messages": out}
    assert every_marker(body) == 2 and cache_marker_problem(body) is None
    document = out[1]["content"][1]["content"]["content"]
    assert document["cache_control"] == ({"type": "ephemeral"} if ttl == "5m" else
                                         {"type": "ephemeral", "ttl": "1h"})
