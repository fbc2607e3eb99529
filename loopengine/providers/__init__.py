"""Providers: the `Provider` seam, fault classification, the retry policy,
cache-marker placement, and the providers themselves: `AnthropicProvider`,
`OpenAIProvider` and `OpenAIResponsesProvider` (extra ``openai``),
`GeminiProvider` (extra ``gemini``) and
`ScriptedProvider`.

The four SDK providers are imported on first use, with their SDKs:
``import loopengine`` imports no provider SDK.
"""

import typing

from loopengine._features import Features
from loopengine._lazy import lazy_exports as _lazy_exports
from loopengine.providers._base import (
    FEATURES,
    STOP_REASONS,
    Billing,
    Container,
    Provider,
    ProviderRequest,
    ProviderResponse,
    TextCallback,
)
from loopengine.providers._cache import MAX_CACHE_MARKERS, CachePolicy, place_cache_markers
from loopengine.providers._faults import FaultKind, ProviderFault
from loopengine.providers._recording import RecordingProvider, ReplayProvider
from loopengine.providers._retry import RetryPolicy, RetryStop, backoff_wait
from loopengine.providers._scripted import Reply, ScriptedProvider

if typing.TYPE_CHECKING:
    from loopengine.providers._anthropic import AnthropicProvider
    from loopengine.providers._gemini import GeminiProvider
    from loopengine.providers._openai import OpenAIProvider
    from loopengine.providers._openai_responses import OpenAIResponsesProvider

__all__ = [
    "FEATURES",
    "MAX_CACHE_MARKERS",
    "STOP_REASONS",
    "AnthropicProvider",
    "Billing",
    "CachePolicy",
    "Container",
    "FaultKind",
    "Features",
    "GeminiProvider",
    "OpenAIProvider",
    "OpenAIResponsesProvider",
    "Provider",
    "ProviderFault",
    "ProviderRequest",
    "ProviderResponse",
    "RecordingProvider",
    "ReplayProvider",
    "Reply",
    "RetryPolicy",
    "RetryStop",
    "ScriptedProvider",
    "TextCallback",
    "backoff_wait",
    "place_cache_markers",
]


_SDK_PROVIDERS = {"AnthropicProvider": "_anthropic", "OpenAIProvider": "_openai",
                  "OpenAIResponsesProvider": "_openai_responses", "GeminiProvider": "_gemini"}


# The SDK-backed providers load with their SDK (seconds of imports), so only
# when a program names one.
__getattr__, __dir__ = _lazy_exports(__name__, {
    name: f"{__name__}.{module}" for name, module in _SDK_PROVIDERS.items()})
