"""`GeminiProvider.check_request` (the check before an attempt is recorded) refuses
exactly what the translation refuses, with the same fault, without translating;
what the SDK refuses of the request itself never reaches the wire either."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from loopengine.providers import ProviderFault
from loopengine.providers._base import ProviderRequest
from loopengine.providers._faults import FaultKind
from loopengine.providers._gemini_contents import check_translatable, gemini_contents

from ..check_support import Shapes, refused_alike
from .conftest import MODEL, GeminiHarness

DATA = base64.b64encode(b"\x89PNG\r\n\x1a\nfake").decode()
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": DATA}}
BAD_DATA = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                        "data": "not base64!"}}
URL_IMAGE = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
CALL = {"type": "tool_use", "id": "c", "name": "f", "input": {}}


def result(*content: Any) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": "c", "content": list(content)}


def test_the_check_and_the_translation_refuse_alike() -> None:
    """Each transcript is refused by both, with the same message, or by neither;
    where a transcript holds two faults, both name the first in the
    translation's order."""
    shapes: Shapes = [
        ([{"role": "user", "content": "hi"}], False),
        ([{"role": "user", "content": [{"type": "text", "text": "hi"}, IMAGE]}], False),
        ([{"role": "assistant", "content": [
            {"type": "thinking", "thinking": "t", "signature": base64.b64encode(b"s").decode()},
            {"type": "redacted_thinking", "data": "x"}, CALL]},
          {"role": "user", "content": [result({"type": "text", "text": "ok"}, IMAGE,
                                              URL_IMAGE)]}], False),
        ([{"role": "assistant", "content": [{"type": "tool_use", "id": "c", "name": "f",
                                             "input": "{malformed"}]},
          {"role": "user", "content": [result({"type": "text", "text": "ok"})]}], False),
        ([{"role": "user", "content": [result({"type": "search_result"})]}], True),
        ([{"role": "user", "content": [result(BAD_DATA, {"type": "search_result"})]}], True),
        ([{"role": "user", "content": [URL_IMAGE]}], True),
        ([{"role": "user", "content": [BAD_DATA]}], True),
        ([{"role": "user", "content": [{"type": "document", "source": {}}]}], True),
        ([{"role": "assistant", "content": [{"type": "thinking", "thinking": "",
                                             "signature": "%%"}]}], True),
        ([{"role": "assistant", "content": [{"type": "server_tool_use", "id": "s"}]}], True),
        ([{"role": "user", "content": [{"type": "search_result"}]}], True),
        ([{"role": "system", "content": "x"}], True),
        ([{"role": "user", "content": [URL_IMAGE]},
          {"role": "system", "content": "x"}], True),
    ]
    refused_alike(check_translatable, gemini_contents, shapes)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_config_the_sdk_refuses_is_untranslatable_and_never_sent(
    wire: GeminiHarness, stream: bool
) -> None:
    """The config goes to the SDK as a dict, which the SDK validates before
    anything is sent: a field it refuses (a tool named by a number) is an
    ``untranslatable`` fault, and the server sees no request."""
    provider = wire.provider(stream=stream)
    request = ProviderRequest(model=MODEL, max_tokens=16,
                              messages=[{"role": "user", "content": "hi"}],
                              tools=[{"name": 5, "input_schema": {"type": "object"}}])
    with pytest.raises(ProviderFault) as info:
        await provider.send(request)
    assert (info.value.kind, info.value.error_code) == (FaultKind.BAD_REQUEST, "untranslatable")
    assert "refused the request" in info.value.message
    assert wire.server.requests == []
