"""Shapes OpenAI-compatible servers send that OpenAI does not: their usage and
their text are kept. Chunks are built by the openai SDK's own (unvalidated)
construction, as its stream hands them to the provider."""

from __future__ import annotations

from typing import Any

from openai._models import construct_type
from openai.types.chat import ChatCompletionChunk

import loopengine as le
from loopengine.providers._openai_chat import StreamedCompletion, content_from_message


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
