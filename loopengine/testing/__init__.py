"""Testing helpers for applications built on loopengine.

`FakeClock` makes retry waits and deadlines instant and exact.
`FakeAnthropicServer` is a scripted Messages API on loopback: point an
`AnthropicProvider` (or any ``anthropic`` client) at its ``url`` and script
replies, error statuses, dropped connections and broken streams with
`Reply`, `ErrorReply`, `DropConnection`, `CutStream`, `StreamErrorEvent` and
`StallStream`. `FakeOpenAIServer` is the same for the Chat Completions API
and the Responses API (``/v1/responses``), for `OpenAIProvider` and
`OpenAIResponsesProvider` (or any ``openai`` client), from the same script
items, and `FakeGeminiServer` for the Gemini API and `GeminiProvider`.
`FakeBedrockServer` and `FakeVertexServer` serve the Messages API as Amazon
Bedrock (event-stream framing) and Google Vertex AI do, for
`AnthropicProvider.bedrock` and `AnthropicProvider.vertex`.
The pytest fixtures ``fake_anthropic_server``, ``fake_openai_server`` and
``fake_gemini_server`` (registered by the package's pytest plugin) give each
test a started server.
See docs/testing.md.
"""

# The names are imported on first use (PEP 562), so that pytest loading the
# package's plugin in every test process loads no server until one is used.

from typing import TYPE_CHECKING

from loopengine._lazy import lazy_exports as _lazy_exports

if TYPE_CHECKING:
    from loopengine._clock import FakeClock
    from loopengine.providers._scripted import Reply
    from loopengine.testing._anthropic_server import FakeAnthropicServer
    from loopengine.testing._gemini_server import FakeGeminiServer
    from loopengine.testing._loopback import (
        CutStream,
        DropConnection,
        ErrorReply,
        RecordedRequest,
        ServerItem,
        StallStream,
        StreamErrorEvent,
    )
    from loopengine.testing._openai_server import FakeOpenAIServer
    from loopengine.testing._platform_servers import FakeBedrockServer, FakeVertexServer

__all__ = [
    "CutStream",
    "DropConnection",
    "ErrorReply",
    "FakeAnthropicServer",
    "FakeBedrockServer",
    "FakeClock",
    "FakeGeminiServer",
    "FakeOpenAIServer",
    "FakeVertexServer",
    "RecordedRequest",
    "Reply",
    "ServerItem",
    "StallStream",
    "StreamErrorEvent",
]

_EXPORTS: dict[str, str] = {
    "CutStream": "loopengine.testing._loopback",
    "DropConnection": "loopengine.testing._loopback",
    "ErrorReply": "loopengine.testing._loopback",
    "FakeAnthropicServer": "loopengine.testing._anthropic_server",
    "FakeBedrockServer": "loopengine.testing._platform_servers",
    "FakeClock": "loopengine._clock",
    "FakeGeminiServer": "loopengine.testing._gemini_server",
    "FakeOpenAIServer": "loopengine.testing._openai_server",
    "FakeVertexServer": "loopengine.testing._platform_servers",
    "RecordedRequest": "loopengine.testing._loopback",
    "Reply": "loopengine.providers._scripted",
    "ServerItem": "loopengine.testing._loopback",
    "StallStream": "loopengine.testing._loopback",
    "StreamErrorEvent": "loopengine.testing._loopback",
}
"""Each public name and the module that defines it."""

__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS)
