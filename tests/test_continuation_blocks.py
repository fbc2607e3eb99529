"""A history holding every content block the Messages API documents (and one it
does not document yet) is accepted and sent back exactly as it came (docs/architecture.md):
thinking with its signature, redacted thinking, server tools and their results
(web search, web fetch, code execution with its bash and text-editor variants, an
advisor), MCP tool use and results, compaction, fallback, container uploads, text
with citations, search results, documents and images.

The fixtures are written from the API's documented shapes (the Messages API
reference, the web search, web fetch, code execution, MCP connector, compaction,
advisor and fallback pages) and the `anthropic` SDK's beta parameter types."""

from __future__ import annotations

import copy
from typing import Any

import pytest

import loopengine as le
from loopengine._engine import normalize_messages
from loopengine.providers import AnthropicProvider
from loopengine.testing import FakeAnthropicServer
from loopengine.testing import Reply as WireReply

OPERATION = le.Operation(name="continuation.test", provider="anthropic",
                         model="claude-continuation-test", max_output_tokens=64)
SIGNING_KEY = b"continuation blocks"
SIGNER = FakeAnthropicServer(signing_key=SIGNING_KEY)
"""Never started: it signs the history's thinking as a server with the same key
issues it (the API refuses a thinking block whose signature it did not issue)."""
THINKING = "The user wants a birth date; search."

USER_BLOCKS: dict[str, dict[str, Any]] = {
    "text": {"type": "text", "text": "Look into these."},
    "image": {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                          "data": "iVBORw0KGgoAAAANSUhEUgAAAAEAAAAB"}},
    "document": {"type": "document", "source": {"type": "base64",
                                                "media_type": "application/pdf",
                                                "data": "JVBERi0xLjQKJcfsj6IKNSAwIG9iago="},
                 "title": "Report", "context": "Quarterly", "citations": {"enabled": True}},
    "search_result": {"type": "search_result", "source": "https://docs.example.test/reset",
                      "title": "Reset your password",
                      "content": [{"type": "text", "text": "Open settings, then security."}],
                      "citations": {"enabled": True}},
    "container_upload": {"type": "container_upload",
                         "file_id": "file_011CNha8iCJcU1wXNR6q4V8w"},
}

ASSISTANT_BLOCKS: dict[str, dict[str, Any]] = {
    "thinking": {"type": "thinking", "thinking": THINKING,
                 "signature": SIGNER.thinking_signature(THINKING)},
    "redacted_thinking": {"type": "redacted_thinking", "data": SIGNER.redacted_data()},
    "text_with_citations": {
        "type": "text", "text": "Claude Shannon was born on April 30, 1916.",
        "citations": [{"type": "web_search_result_location",
                       "url": "https://en.wikipedia.org/wiki/Claude_Shannon",
                       "title": "Claude Shannon - Wikipedia",
                       "encrypted_index": "Eo8BCioIAhgBIiQyYjQ0OWJmZi1lNm",
                       "cited_text": "Claude Elwood Shannon (April 30, 1916 - February 24, 2001)"},
                      {"type": "char_location", "cited_text": "Open settings",
                       "document_index": 0, "document_title": "Report",
                       "start_char_index": 0, "end_char_index": 13}]},
    "server_tool_use": {"type": "server_tool_use", "id": "srvtoolu_01WYG3ziw53XMcoyKL4XcZmE",
                        "name": "web_search", "input": {"query": "claude shannon birth date"}},
    "web_search_tool_result": {
        "type": "web_search_tool_result", "tool_use_id": "srvtoolu_01WYG3ziw53XMcoyKL4XcZmE",
        "content": [{"type": "web_search_result",
                     "url": "https://en.wikipedia.org/wiki/Claude_Shannon",
                     "title": "Claude Shannon - Wikipedia",
                     "encrypted_content": "EqgfCioIARgBIiQ3YTAwMjY1Mi1mZjM5LTQ1NGUtODgxNC1k",
                     "page_age": "April 30, 2025"}]},
    "server_tool_use_web_fetch": {"type": "server_tool_use", "id": "srvtoolu_01fetch",
                                  "name": "web_fetch",
                                  "input": {"url": "https://example.test/article"}},
    "web_fetch_tool_result": {
        "type": "web_fetch_tool_result", "tool_use_id": "srvtoolu_01fetch",
        "content": {"type": "web_fetch_result", "url": "https://example.test/article",
                    "content": {"type": "document",
                                "source": {"type": "text", "media_type": "text/plain",
                                           "data": "Full text of the article."},
                                "title": "Article", "citations": {"enabled": True}},
                    "retrieved_at": "2025-08-25T10:30:00Z"}},
    "server_tool_use_code_execution": {"type": "server_tool_use", "id": "srvtoolu_01code",
                                       "name": "code_execution",
                                       "input": {"code": "print(2 + 2)"}},
    "code_execution_tool_result": {
        "type": "code_execution_tool_result", "tool_use_id": "srvtoolu_01code",
        "content": {"type": "code_execution_result", "stdout": "4\n", "stderr": "",
                    "return_code": 0, "content": []}},
    "server_tool_use_bash": {"type": "server_tool_use", "id": "srvtoolu_01bash",
                             "name": "bash_code_execution",
                             "input": {"command": "ls -la | head -5"}},
    "bash_code_execution_tool_result": {
        "type": "bash_code_execution_tool_result", "tool_use_id": "srvtoolu_01bash",
        "content": {"type": "bash_code_execution_result", "stdout": "total 8\n",
                    "stderr": "", "return_code": 0,
                    "content": [{"type": "bash_code_execution_output",
                                 "file_id": "file_011CPA7kVu6h7e8x4Zg1c9RZ"}]}},
    "server_tool_use_text_editor": {"type": "server_tool_use", "id": "srvtoolu_01edit",
                                    "name": "text_editor_code_execution",
                                    "input": {"command": "view", "path": "/tmp/notes.py"}},
    "text_editor_code_execution_tool_result": {
        "type": "text_editor_code_execution_tool_result", "tool_use_id": "srvtoolu_01edit",
        "content": {"type": "text_editor_code_execution_result", "file_type": "text",
                    "content": "print('hi')\n", "numLines": 1, "startLine": 1,
                    "totalLines": 1}},
    "server_tool_use_advisor": {"type": "server_tool_use",
                                "id": "srvtoolu_012xj8SM7Gg8HKKmpPDuKHvs",
                                "name": "advisor", "input": {}},
    "advisor_tool_result": {
        "type": "advisor_tool_result", "tool_use_id": "srvtoolu_012xj8SM7Gg8HKKmpPDuKHvs",
        "content": {"type": "advisor_result", "text": "The answer is 4.",
                    "stop_reason": "end_turn"}},
    "mcp_tool_use": {"type": "mcp_tool_use", "id": "mcptoolu_01AmgVfcYg7HkjXerTSn1F93",
                     "name": "search_repositories", "server_name": "test-server",
                     "input": {"query": "pydantic-ai in:name"}},
    "mcp_tool_result": {"type": "mcp_tool_result",
                        "tool_use_id": "mcptoolu_01AmgVfcYg7HkjXerTSn1F93", "is_error": False,
                        "content": [{"type": "text", "text": "{\"total_count\": 461}"}]},
    "compaction": {"type": "compaction", "content": "Summary: the user asked about k."},
    "fallback": {"type": "fallback", "to": {"model": "claude-sonnet-4-5"}, "trigger": None},
    "a_type_not_yet_documented": {"type": "future_block_20270101", "payload": {"a": [1, 2]},
                                  "note": "carried through unchanged"},
    "tool_use": {"type": "tool_use", "id": "toolu_01A09q90qw90lq917835lq9",
                 "name": "lookup", "input": {"key": "k"}},
}

TOOL_RESULT = {"type": "tool_result", "tool_use_id": "toolu_01A09q90qw90lq917835lq9",
               "content": [{"type": "text", "text": "value of k"}], "is_error": False}


def history() -> list[dict[str, Any]]:
    """A conversation holding every block: the user's, then the assistant's turn
    (ending with a call of the engine's own tool), then that call's result."""
    return [
        {"role": "user", "content": list(copy.deepcopy(USER_BLOCKS).values())},
        {"role": "assistant", "content": list(copy.deepcopy(ASSISTANT_BLOCKS).values())},
        {"role": "user", "content": [copy.deepcopy(TOOL_RESULT)]},
    ]


@le.tool
async def lookup(key: str) -> str:
    """Look a key up."""
    return f"value of {key}"


@pytest.mark.parametrize("name", sorted(ASSISTANT_BLOCKS))
def test_each_block_the_api_returns_validates_and_is_copied_unchanged(name: str) -> None:
    """Each block, alone in an assistant turn, passes validation and the copy equals it."""
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": [ASSISTANT_BLOCKS[name]]},
                {"role": "user", "content": "go on"}]
    assert normalize_messages(messages) == messages


@pytest.mark.parametrize("name", sorted(USER_BLOCKS))
def test_each_block_a_user_sends_validates_and_is_copied_unchanged(name: str) -> None:
    """Each block a caller writes into a user turn passes and is copied as given."""
    messages = [{"role": "user", "content": [USER_BLOCKS[name]]}]
    assert normalize_messages(messages) == messages


@pytest.mark.parametrize("stream", [False, True])
async def test_a_history_of_every_block_is_sent_back_exactly(stream: bool) -> None:
    """Through the real SDK: the request the server receives carries the history's
    blocks unchanged, and `result.messages` keeps them, ready to continue again."""
    given = history()
    with FakeAnthropicServer([WireReply.text("Done.")], signing_key=SIGNING_KEY) as server:
        async with AnthropicProvider(api_key="test", base_url=server.url,
                                     stream=stream) as provider:
            result = await le.Engine(provider).run(OPERATION, given, tools=[lookup])
    assert result.outcome is le.Outcome.COMPLETED
    [request] = server.requests
    assert request.messages == history()
    assert result.messages[:3] == history()
    assert given == history()  # the caller's list is not touched


def test_the_blocks_the_engine_reads_are_still_checked() -> None:
    """Carrying unknown blocks through does not loosen the blocks the engine runs:
    a tool call without an id, or a tool result without its call's id, is refused."""
    with pytest.raises(le.ConfigError) as caught:
        normalize_messages([{"role": "user", "content": "q"},
                            {"role": "assistant", "content": [
                                {"type": "tool_use", "name": "lookup", "input": {}}]}])
    assert caught.value.field == "messages[1].content[0].id"
    with pytest.raises(le.ConfigError) as caught:
        normalize_messages([{"role": "user", "content": [
            {"type": "tool_result", "content": "x"}]}])
    assert caught.value.field == "messages[0].content[0].tool_use_id"


def test_a_carried_block_must_still_be_encodable() -> None:
    """A block carried through unchecked is still proven encodable as JSON."""
    with pytest.raises(le.ConfigError) as caught:
        normalize_messages([{"role": "user", "content": "q"},
                            {"role": "assistant", "content": [
                                {"type": "compaction", "content": "bad \ud800"}]}])
    assert caught.value.field == "messages[1].content[0].content"
