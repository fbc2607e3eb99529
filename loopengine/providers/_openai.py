"""`OpenAIProvider`: the Chat Completions API through the official ``openai`` SDK.

One `send` is one wire request, to OpenAI, Azure OpenAI or any server that
speaks Chat Completions (vLLM, Ollama, OpenRouter...). The SDK client is
always used with ``max_retries=0``: the SDK would otherwise retry 408, 409,
429 (quota errors included) and 5xx on its own, invisibly. Each request
carries the engine's attempt timeout, already capped at the run's remaining
time (R04). The event-loop rules are `AnthropicProvider`'s, from the same
code (``_clients.py``): a client per event loop when built from keywords, a
client given by the caller bound to its first loop.

Its request goes through `chat_params` and its reply back through
`content_from_message` (``_openai_chat.py``, the translation); every SDK
error becomes a fault in `classify_error` (``_openai_faults.py``).

The ``openai`` SDK is the extra ``openai`` (``pip install 'loopengine-core[openai]'``):
this module imports it only when a provider is built.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from loopengine import _validate
from loopengine._errors import ConfigError
from loopengine._features import Features
from loopengine.providers._base import (
    Billing,
    ProviderRequest,
    ProviderResponse,
    TextCallback,
    text_or_none,
)
from loopengine.providers._clients import BoundClient, ClientPerLoop
from loopengine.providers._openai_chat import (
    StreamedCompletion,
    chat_params,
    check_translatable,
    content_from_message,
    first_choice,
    search_model,
    usage_from_api,
)
from loopengine.providers._openai_faults import (
    body_fault,
    check_finish,
    classify_error,
    failures,
    import_openai,
    read_failures,
)
from loopengine.providers._sdk import (
    DEFAULT_STREAM_IDLE_TIMEOUT,
    SDKProvider,
    provider_clients,
    read_stream,
)
from loopengine.providers._sdk import json_body as sdk_json_body

if TYPE_CHECKING:
    import openai

logger = logging.getLogger("loopengine")

__all__ = ["OpenAIProvider", "StreamUsage", "json_body",
           "openai_clients"]

StreamUsage = Literal["required", "optional"]
"""Whether a stream must end with its usage chunk (`OpenAIProvider`'s ``stream_usage``)."""

# Keywords that only an Azure client takes: given them, the provider builds one.
_AZURE_KEYWORDS = frozenset({"azure_endpoint", "azure_deployment", "api_version",
                             "azure_ad_token", "azure_ad_token_provider"})


def openai_clients(
    owner: str, client: openai.AsyncOpenAI | None, client_kwargs: dict[str, Any],
    max_connections: int | None,
) -> tuple[ClientPerLoop[openai.AsyncOpenAI] | BoundClient[openai.AsyncOpenAI], str]:
    """The clients of a provider on the ``openai`` SDK (`provider_clients`), and its
    vendor: ``azure`` for an Azure client (given, or built because the keywords
    name an Azure setting), else ``openai``.

    Raises:
        ConfigError: what `provider_clients` refuses, or client settings the
            SDK refuses (missing credentials, contradictory Azure settings).
    """
    sdk = import_openai(owner)
    azure = bool(_AZURE_KEYWORDS & client_kwargs.keys())
    try:
        clients: ClientPerLoop[Any] | BoundClient[Any] = provider_clients(
            owner, client, client_kwargs, max_connections=max_connections,
            accepts=(sdk.AsyncOpenAI,), sdk_default=sdk.DefaultAsyncHttpxClient,
            build=sdk.AsyncAzureOpenAI if azure else sdk.AsyncOpenAI)
    except sdk.OpenAIError as error:
        # Missing credentials, contradictory Azure settings: the SDK says
        # so when the client is built, before anything is sent.
        raise ConfigError("client", f"the openai SDK refused the client settings: "
                                    f"{error}") from None
    vendor = "azure" if isinstance(clients.current(), sdk.AsyncAzureOpenAI) else "openai"
    return clients, vendor


json_body = functools.partial(sdk_json_body, classify=classify_error, failures=failures,
                              request_id_of=lambda headers: headers.get("x-request-id"))
"""One request of the ``openai`` SDK read whole (`loopengine.providers._sdk.json_body`, with
`classify_error`, the SDK's errors and its ``x-request-id``): its body, a JSON object
``valid`` accepts, its request id and its status."""


class OpenAIProvider(SDKProvider["openai.AsyncOpenAI"]):
    """The Chat Completions API as a `Provider`, through the ``openai`` SDK.

    Args:
        client: An ``openai.AsyncOpenAI`` (or ``AsyncAzureOpenAI``) client.
            The provider uses a copy of it with ``max_retries=0`` and never
            closes it; it is used on the first event loop that sends through
            it only: a request on any other loop raises `ConfigError` before
            anything is sent.
        stream: Stream every response (``stream_options={"include_usage":
            true}``), also when nobody reads its text. Whatever it says, a
            request whose run reads the text (``on_text``,
            `loopengine.Engine.stream`) is streamed, its text deltas handed
            over as they arrive (docs/observability.md).
        route: The route this provider serves: an operation's ``provider``
            must name it (R13). Default: the vendor, ``openai``, or ``azure``
            for an Azure client.
        stream_idle_timeout: Seconds a stream may go without a chunk before
            the attempt is aborted with reason ``idle`` (and retried).
        stream_usage: ``"required"`` (default): a stream that ends without
            its usage chunk is an ``aborted`` attempt, retried. ``"optional"``,
            for a compatible server that sends no usage in streams (older
            vLLM, llama.cpp, some gateways): a stream that ends after its
            ``finish_reason`` without a usage chunk is accepted, the attempt
            ``ok`` with its usage unknown (no tokens and no cost in the
            ledger, ``usage_complete`` false in the result, a warning logged
            once per provider).
        max_connections: Without ``client`` or ``http_client``: the most
            connections the provider's client (of each event loop) opens;
            default 1,000, the SDK's own. A request in flight holds a
            connection (HTTP/1.1), so a process with more conversations
            waiting on the model at once raises it, and its open-file limit
            with it. Every connection is kept alive between turns. The
            client is on asyncio the aiohttp one of the ``anthropic`` SDK
            (whose transport classifies connection errors as such), and the
            SDK's own httpx one on trio or where the environment configures
            a proxy (docs/performance.md).
        **client_kwargs: Without ``client``: the keywords to build an
            ``AsyncOpenAI`` (``api_key``, ``base_url``, ``organization``...),
            or an ``AsyncAzureOpenAI`` when they include an Azure keyword
            (``azure_endpoint``, ``azure_deployment``, ``api_version``,
            ``azure_ad_token``, ``azure_ad_token_provider``). One client is
            built per event loop that sends, as `AnthropicProvider` does; an
            ``http_client`` among them binds the provider to the first loop
            that sends, and `aclose` closes it.

    Raises:
        ConfigError: both a client and client keywords, a client that is not
            an async ``openai`` client, ``max_retries`` other than 0,
            keywords the SDK refuses, a bad ``route``, ``stream_idle_timeout``
            or ``stream_usage``, or a ``max_connections`` that is not a
            positive integer or comes with a ``client`` or ``http_client``.
        ImportError: the ``openai`` extra is not installed.

    The attempt's ``served_by`` is ``<route>:<model>`` and its price is looked
    up under the route (genai-prices knows ``openai`` and ``azure``); a model
    no price source knows (a local vLLM or Ollama model) is unpriced, like any
    other.

    Example::

        provider = OpenAIProvider(api_key=key)
        engine = loopengine.Engine(provider)
        op = loopengine.Operation(name="help.answer", provider="openai",
                                  model="gpt-4o-mini")
    """

    def __init__(
        self,
        client: openai.AsyncOpenAI | None = None,
        *,
        stream: bool = False,
        route: str | None = None,
        stream_idle_timeout: float = DEFAULT_STREAM_IDLE_TIMEOUT,
        stream_usage: StreamUsage = "required",
        max_connections: int | None = None,
        **client_kwargs: Any,
    ) -> None:
        self._settings(stream, stream_idle_timeout, route)
        if stream_usage not in ("required", "optional"):
            raise ConfigError("stream_usage", f'must be "required" or "optional", got '
                                              f"{_validate.shown(stream_usage)}")
        self._usage_required = stream_usage == "required"
        self._usage_warned = False
        self._clients, vendor = openai_clients("OpenAIProvider", client, client_kwargs,
                                               max_connections)
        self._name_route(vendor)
        # Another server that speaks the wire format (vLLM, Ollama, OpenRouter)
        # takes tool schemas OpenAI's own API refuses.
        self._openai_rules = vendor == "azure" or str(
            self._clients.current().base_url.host).endswith(".openai.com")

    features = frozenset({"reasoning_effort", "service_tier", "web_search_options"})
    """The Chat Completions API's optional request features (docs/providers.md), sent as
    ``reasoning_effort``, ``service_tier`` and, to a search model only (a request
    to another model is refused by `check_request`), ``web_search_options``;
    an operation enabling another
    (thinking, server tools, betas, context management: the Messages API's)
    is refused by the engine before anything is recorded. The vendor
    (`vendor`) is ``openai``, or ``azure`` for an Azure client."""

    def billing(self, model: str, features: Features) -> Billing:
        """One web search every request runs for a search model (`search_model`:
        ``gpt-4o-search-preview``, ``gpt-4o-mini-search-preview``,
        ``gpt-5-search-api``, their dated names, under a compatible server's
        ``openai/`` prefix): it searches the web before every answer, billed a
        web search fee its ``usage`` does not count, so each reply's usage
        counts one web search (`Billing.searches_per_request`); else none.
        All else as the usage says (`Provider.billing`)."""
        return Billing(searches_per_request=_searches(model))

    def check_request(self, request: ProviderRequest) -> None:
        """Before an attempt is recorded: refuse a request the Chat Completions
        API has no equivalent for (a document, a server tool block, a block
        inside a tool result other than text, an image or a document...,
        ``web_search_options`` to a model that is not a search model), by the
        translation's own rules, without translating it; on OpenAI's own API
        or Azure's, a tool whose schema they refuse (``anyOf``... at its root).

        Raises:
            ProviderFault: ``bad_request``, ``error_code`` ``untranslatable``.
        """
        check_translatable(request, openai_rules=self._openai_rules)

    def _params(self, request: ProviderRequest, *, stream: bool) -> dict[str, Any]:
        return chat_params(request, stream=stream)

    async def _send_plain(self, client: openai.AsyncOpenAI,
                          params: dict[str, Any]) -> ProviderResponse:
        body, request_id, status = await json_body(
            client.chat.completions.with_streaming_response.create, params,
            what="a chat completion", valid=lambda body: _answered(body) or isinstance(
                body.get("error"), Mapping))
        usage = usage_from_api(body.get("usage"), body.get("service_tier"),
                               web_searches=_searches(params["model"]))
        if not _answered(body):
            raise body_fault(body, request_id=request_id, usage=usage)
        choice = first_choice(body) or {}
        response_id = text_or_none(body.get("id"))
        check_finish(choice.get("finish_reason"), http_status=status, request_id=request_id,
                     usage=usage, response_id=response_id)
        content, stop = content_from_message(choice["message"], choice.get("finish_reason"))
        return ProviderResponse(content=content, stop_reason=stop, usage=usage,
                                response_id=response_id, request_id=request_id,
                                http_status=status, model=text_or_none(body.get("model")))

    async def _send_streaming(
        self, client: openai.AsyncOpenAI, params: dict[str, Any], on_text: TextCallback | None
    ) -> ProviderResponse:
        sdk = import_openai()
        body = dict(params)
        timeout = body.pop("timeout")
        try:
            # `chat.completions.create(stream=True)` as the SDK sends it, but in its
            # "events" stream mode: an error object inside the stream comes as a
            # chunk instead of an exception, so the usage and the id the same
            # chunk may carry (OpenRouter sends ``{"error": ..., "usage": ...}``)
            # are not lost. The chunk is then raised as the SDK raises it.
            stream: Any = await client.post(
                "/chat/completions", body=body, cast_to=sdk.types.chat.ChatCompletion,
                stream=True, stream_cls=sdk.AsyncStream[sdk.types.chat.ChatCompletionChunk],
                options={"timeout": timeout, "stream_mode": "events"})
        except failures() as error:
            raise classify_error(error) from error
        reply = StreamedCompletion(web_searches=_searches(params["model"]))
        response = stream.response
        request_id = response.headers.get("x-request-id")

        def take(chunk: Any) -> str:
            text = reply.add(chunk)
            if reply.error is not None:
                error = reply.error
                message = error.get("message") if isinstance(error, Mapping) else None
                fault = classify_error(
                    sdk.APIError(message if isinstance(message, str) and message
                                 else "An error occurred during streaming",
                                 request=response.request, body=error),
                    request_id=request_id, in_body=True, usage=reply.usage,
                    response_id=reply.response_id)
                if reply.error_usage:
                    # The server's own count for the request, not a floor.
                    fault.usage_approx = False
                raise fault
            return text

        await read_stream(
            stream, idle=self._idle, failures=read_failures(), classify=classify_error,
            take=take, on_text=on_text, close=stream.close,
            http_status=response.status_code, request_id=request_id,
            served=lambda: (reply.usage, reply.response_id),
            missing=lambda: "its finish_reason" if reply.finish_reason is None
            else "its usage chunk" if reply.usage is None and self._usage_required else None)
        check_finish(reply.finish_reason, http_status=response.status_code,
                     request_id=request_id, usage=reply.usage, response_id=reply.response_id)
        if reply.usage is None and not self._usage_warned:
            # The reply is whole (its finish_reason came after its last
            # content); only its usage is unknown, as the caller allowed.
            self._usage_warned = True
            logger.warning(
                "route %s: a stream ended without its usage chunk (stream_usage="
                "'optional'): its attempt is recorded ok with unknown usage and no cost, "
                "and the result says usage_complete=False", self._name)
        content, stop = reply.content()
        return ProviderResponse(content=content, stop_reason=stop, usage=reply.usage,
                                response_id=reply.response_id, request_id=request_id,
                                http_status=response.status_code, model=reply.model)


def _searches(model: str) -> int:
    """The web searches every request to ``model`` runs: 1 for a search model
    (`search_model`), else 0 (`OpenAIProvider.billing`)."""
    return 1 if search_model(model) else 0


def _answered(body: Mapping[str, Any]) -> bool:
    """Whether a completion body holds a reply: its first choice's ``message``."""
    return isinstance((first_choice(body) or {}).get("message"), Mapping)
