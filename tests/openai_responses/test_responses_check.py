"""`OpenAIResponsesProvider.check_request` (the check before an attempt is recorded)
refuses exactly what the translation refuses, with the same fault, without
translating."""

from __future__ import annotations

from typing import Any

from loopengine.providers._openai_responses_items import check_translatable, responses_input

from ..check_support import Shapes, refused_alike

PNG = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                   "data": "iVBORw0KGgo="}}
URL_IMAGE = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}


def result(content: Any, **more: Any) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": "c", "content": content, **more}


def test_the_check_and_the_translation_refuse_alike() -> None:
    """Each transcript is refused by both, with the same message, or by neither."""
    shapes: Shapes = [
        ([{"role": "user", "content": "hi"}], False),
        ([{"role": "user", "content": [{"type": "text", "text": "hi"}, PNG, URL_IMAGE]}], False),
        ([{"role": "assistant", "content": [
            {"type": "thinking", "thinking": "t"},
            {"type": "reasoning", "id": "r", "encrypted_content": "e"},
            {"type": "tool_use", "id": "c", "name": "f", "input": {}}]},
          {"role": "user", "content": [result("ok"), result(None),
                                       result([{"type": "text", "text": "ok"}, PNG],
                                              is_error=True)]}], False),
        ([{"role": "user", "content": [result([{"type": "search_result"}])]}], True),
        ([{"role": "user", "content": [result([PNG, "not a block"])]}], True),
        ([{"role": "user", "content": [{"type": "image", "source": {"type": "file"}}]}], True),
        ([{"role": "user", "content": [{"type": "document", "source": {}}]}], True),
        ([{"role": "assistant", "content": [{"type": "server_tool_use", "id": "s"}]}], True),
        ([{"role": "system", "content": "x"}], True),
    ]
    refused_alike(check_translatable, responses_input, shapes)
