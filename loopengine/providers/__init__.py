"""Providers: the `Provider` seam, fault classification, the shared retry loop,
cache-marker placement, and the providers themselves: `AnthropicProvider`,
`OpenAIProvider` (extra ``openai``) and `ScriptedProvider`, and the
`PooledTransport` their clients send through."""

from loopengine.providers._anthropic import AnthropicProvider
from loopengine.providers._base import Provider, ProviderRequest, ProviderResponse, TextCallback
from loopengine.providers._cache import MAX_CACHE_MARKERS, CachePolicy, place_cache_markers
from loopengine.providers._faults import FaultKind, ProviderFault
from loopengine.providers._openai import OpenAIProvider
from loopengine.providers._recording import RecordingProvider, ReplayProvider
from loopengine.providers._retry import RetryPolicy, RetryStop, backoff_wait, run_with_retries
from loopengine.providers._scripted import Reply, ScriptedProvider
from loopengine.providers._transport import PooledTransport

__all__ = [
    "MAX_CACHE_MARKERS",
    "AnthropicProvider",
    "CachePolicy",
    "FaultKind",
    "OpenAIProvider",
    "PooledTransport",
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
    "run_with_retries",
]
