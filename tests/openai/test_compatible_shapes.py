"""Shapes OpenAI-compatible servers send that OpenAI does not: their usage and
their text are kept, and calls they name alike are told apart. Chunks are
built by the openai SDK's own (unvalidated) construction, as its stream hands
them to the provider."""

from __future__ import annotations

from typing import Any

import pytest
from openai._models import construct_type
from openai.types.chat import ChatCompletionChunk

import loopengine as le
from loopengine.persistence import MemoryLedger
from loopengine.providers._openai_chat import StreamedCompletion, content_from_message
from loopengine.testing import Reply

from .conftest import OpenAIHarness, calls_asked, openai_operation, tool_messages


def chunk(delta: dict[str, Any], *, finish: str | None = None,
          usage: dict[str, Any] | None = None) -> Any:
    data: dict[str, Any] = {"id": "cmpl-mistral-1", "object": "chat.completion.chunk",
                            "created": 1, "model": "magistral-medium-latest",
                            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage is not None:
        data["usage"] = usage
    return construct_type(type_=ChatCompletionChunk, value=data)


def test_a_mistral_stream_whose_content_is_a_list_keeps_its_text_and_usage() -> None:
    """Magistral streams ``delta.content`` as a list of parts (thinking, then text):
    the text parts are the answer, the thinking is dropped, nothing raises, and the
    usage and the response id are kept."""
    reply = StreamedCompletion()
    thinking = [{"type": "thinking", "thinking": [{"type": "text", "text": "Let me see."}]}]
    assert reply.add(chunk({"role": "assistant", "content": thinking})) == ""
    assert reply.add(chunk({"content": [{"type": "text", "text": "Paris"}]})) == "Paris"
    assert reply.add(chunk({"content": "."})) == "."
    reply.add(chunk({}, finish="stop", usage={"prompt_tokens": 12, "completion_tokens": 40,
                                              "total_tokens": 52}))
    content, stop = reply.content()
    assert (content, stop) == ([{"type": "text", "text": "Paris."}], "end_turn")
    assert reply.usage == le.Usage(input_tokens=12, output_tokens=40)
    assert reply.response_id == "cmpl-mistral-1"


def test_a_message_whose_content_is_a_list_keeps_its_text() -> None:
    """The same shape in a whole (JSON) reply."""
    message = {"role": "assistant", "content": [
        {"type": "thinking", "thinking": [{"type": "text", "text": "Hm."}]},
        {"type": "text", "text": "Paris."}]}
    assert content_from_message(message, "stop") == (
        [{"type": "text", "text": "Paris."}], "end_turn")


@pytest.mark.parametrize("given", ["0", "", None], ids=["same", "empty", "none"])
async def test_calls_a_server_names_alike_get_ids_keys_and_results_of_their_own(
        wire: OpenAIHarness, given: str | None) -> None:
    """A server that names every tool call alike (``0``, an empty id, none) in a
    batch and across turns: each call gets an id of its own (the first ``0``
    keeps it), so each gets its own idempotency key, its own result and its own
    run store row, and the ids sent back pair each result with its call."""
    paid: list[tuple[str, str]] = []

    @le.tool(idempotent=True)
    def pay(invoice: str, ctx: le.ToolContext) -> str:
        """Pay an invoice."""
        paid.append((invoice, ctx.idempotency_key))
        return f"paid {invoice}"

    def calls(*invoices: str) -> Reply:
        return Reply(content=[{"type": "tool_use", "id": given, "name": "pay",
                               "input": {"invoice": invoice}} for invoice in invoices],
                     stop_reason="tool_use")

    ledger = MemoryLedger()
    store = le.RunStore(ledger)
    engine, _ = wire.engine(calls("A", "B"), calls("C"), Reply.text("Paid."), ledger=ledger,
                            run_store=store)
    result = await engine.run(openai_operation(), "Pay A, B and C.", tools=[pay])
    assert result.outcome is le.Outcome.COMPLETED
    # A batch's handlers run at once (a sync one in a thread each): A and B in
    # either order, then C.
    invoices = [invoice for invoice, _ in paid]
    assert sorted(invoices[:2]) == ["A", "B"] and invoices[2:] == ["C"]
    assert len({key for _, key in paid}) == 3
    ids = [c["id"] for request in wire.requests[1:] for c in calls_asked(request)]
    ids = list(dict.fromkeys(ids))  # the second request's calls come again in the third
    assert len(ids) == 3 and all(ids)
    if given:
        assert ids[0] == given
    for request in wire.requests[1:]:
        asked = {c["id"]: c["input"]["invoice"] for c in calls_asked(request)}
        answered = {m["tool_call_id"]: m["content"] for m in tool_messages(request)}
        assert answered == {i: f"paid {invoice}" for i, invoice in asked.items()}
    assert await store.tool_calls(result.invocation_id) == dict.fromkeys(ids, "succeeded")
