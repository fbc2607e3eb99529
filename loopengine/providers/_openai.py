"""`OpenAIProvider`: the Chat Completions API through the official ``openai`` SDK.

One `send` is one wire request, to OpenAI, Azure OpenAI or any server that
speaks Chat Completions (vLLM, Ollama, OpenRouter...). The SDK client is
always used with ``max_retries=0``: the SDK would otherwise retry 408, 409,
429 (quota errors included) and 5xx on its own, invisibly. Each request
carries the engine's attempt timeout, already capped at the run's remaining
time (R04). The event-loop rules are `AnthropicProvider`'s, from the same
code (``_clients.py``): a client per event loop when built from keywords, a
client given by the caller bound to its first loop.

The engine's transcript stays Anthropic-shaped; this module translates at
its boundary, both ways (`chat_messages`, `chat_tools`, `chat_tool_choice`,
`content_from_message`):

* ``system`` blocks become one ``system`` message; a user message's
  ``tool_result`` blocks become one ``tool`` message each, in order (an
  ``is_error`` result's text starts with ``Error:``, so the model reads it as
  a failure); ``tool_use`` blocks become the assistant's ``tool_calls``;
  ``thinking`` blocks and ``cache_control`` markers have no equivalent and
  are dropped (OpenAI caches prompt prefixes on its own);
* tools become ``function`` tools with the JSON schema as ``parameters``;
  ``tool_choice`` ``auto`` / ``none`` / ``any`` / a named tool become
  ``auto`` / ``none`` / ``required`` / that function;
* the reply's text and ``refusal`` become text blocks, its tool calls
  ``tool_use`` blocks, all of one turn in one batch. Arguments that are not
  a JSON object are kept as the string the model sent: the tool's input
  validation then gives the model a recoverable error result (R15).

``finish_reason`` becomes the engine's stop reason: ``stop`` -> ``end_turn``,
``tool_calls`` -> ``tool_use``, ``length`` -> ``max_tokens`` (``incomplete``),
``content_filter`` (or a ``refusal``) -> ``refusal`` (``refused``). Usage:
``prompt_tokens`` includes ``prompt_tokens_details.cached_tokens``, so the
uncached input is the difference and the cached part is the cache read;
reasoning tokens are inside ``completion_tokens``.

Every SDK (and transport) error becomes one `ProviderFault` in `classify_error`
(DESIGN.md §14):

=====================  ===========================================================
fault kind             from
=====================  ===========================================================
``credit_exhausted``   ``insufficient_quota`` (as ``type`` or ``code``),
                       ``billing_hard_limit_reached``, ``billing_not_active``,
                       ``credit_balance_exhausted``, ``*_spend_limit_exceeded``,
                       whatever the status; 402
``rate_limited``       any other 429 (``retry-after-ms`` / ``retry-after`` honoured)
``timeout``            408, the SDK's timeout
``server_error``       409, 5xx, an error object inside a stream, a body that is
                       not a completion
``connection``         refused, reset or closed before a response
``aborted``            the body or stream cut after the response began, a stream
                       that ended before its ``finish_reason`` or its usage
                       chunk, an idle stream
``unauthorized``       401, 403
``bad_request``        400, 404, 413, 422, other 4xx; a transcript block that has
                       no Chat Completions equivalent; the client failing on its
                       own state (``client_state``)
=====================  ===========================================================

The ``openai`` SDK is the extra ``openai`` (``pip install 'loopengine-core[openai]'``):
this module imports it only when a provider is built.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

import anyio
import httpx2

from loopengine import _validate
from loopengine._errors import ConfigError
from loopengine._usage import Usage
from loopengine.providers._base import ProviderRequest, ProviderResponse
from loopengine.providers._clients import (
    Clients,
    SDKProvider,
    gate,
    gates,
    http_client,
    sdk_keywords,
    shared_tls,
)
from loopengine.providers._clients import (
    max_connections as max_connections_of,
)
from loopengine.providers._faults import (
    FaultKind,
    ProviderFault,
    SDKErrors,
    classify_sdk_error,
    is_credit_code,
    retry_after,
    should_retry,
)

if TYPE_CHECKING:
    import openai

__all__ = [
    "DEFAULT_STREAM_IDLE_TIMEOUT",
    "OpenAIProvider",
    "chat_messages",
    "chat_tool_choice",
    "chat_tools",
    "classify_error",
    "content_from_message",
    "stop_reason",
    "usage_from_api",
]

DEFAULT_STREAM_IDLE_TIMEOUT = 60.0
"""Seconds a stream may go without a chunk before the attempt is aborted (``idle``)."""

# Keywords that only an Azure client takes: given them, the provider builds one.
_AZURE_KEYWORDS = frozenset({"azure_endpoint", "azure_deployment", "api_version",
                             "azure_ad_token", "azure_ad_token_provider"})

_FINISH_REASONS = {
    "stop": "end_turn",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "length": "max_tokens",
    "content_filter": "refusal",
}

# Error types (and codes) that tell what went wrong when there is no status
# to read: an error object inside a stream that began with a 200.
_TYPE_KINDS = {
    "invalid_request_error": FaultKind.BAD_REQUEST,
    "authentication_error": FaultKind.UNAUTHORIZED,
    "permission_error": FaultKind.UNAUTHORIZED,
    "rate_limit_error": FaultKind.RATE_LIMITED,
    "rate_limit_exceeded": FaultKind.RATE_LIMITED,
    "requests": FaultKind.RATE_LIMITED,
    "tokens": FaultKind.RATE_LIMITED,
    "timeout": FaultKind.TIMEOUT,
    "timeout_error": FaultKind.TIMEOUT,
    "overloaded_error": FaultKind.OVERLOADED,
    "server_error": FaultKind.SERVER_ERROR,
    "api_error": FaultKind.SERVER_ERROR,
}

_STATUS_KINDS = {
    401: FaultKind.UNAUTHORIZED,
    402: FaultKind.CREDIT_EXHAUSTED,
    403: FaultKind.UNAUTHORIZED,
    408: FaultKind.TIMEOUT,
    # A conflict is transient: the SDK itself would retry it.
    409: FaultKind.SERVER_ERROR,
    429: FaultKind.RATE_LIMITED,
}


def _import_openai() -> Any:
    try:
        import openai
    except ImportError as error:  # pragma: no cover - the dev install has the extra
        raise ImportError("OpenAIProvider needs the openai SDK, which is not installed: "
                          "pip install 'loopengine-core[openai]'") from error
    return openai


@functools.cache
def _failures() -> tuple[type[BaseException], ...]:
    """What the SDK raises for a request that failed: its own errors and the
    transport's (never the caller's cancellation, nor the `LedgerError` of the
    before-wire gate, which propagate as they are)."""
    return (_import_openai().OpenAIError, httpx2.HTTPError, httpx2.StreamError)


@functools.cache
def _read_failures() -> tuple[type[BaseException], ...]:
    """What reading a stream may raise: `_failures`, and the SDK's own
    ``ValueError`` / ``RuntimeError`` for a body that is not a stream of chunks."""
    return (*_failures(), ValueError, RuntimeError)


@functools.cache
def _sdk() -> SDKErrors:
    openai = _import_openai()
    return SDKErrors(status=openai.APIStatusError, timeout=openai.APITimeoutError,
                     connection=openai.APIConnectionError, base=openai.APIError,
                     validation=openai.APIResponseValidationError)


class OpenAIProvider(SDKProvider["openai.AsyncOpenAI"]):
    """The Chat Completions API as a `Provider`, through the ``openai`` SDK.

    Args:
        client: An ``openai.AsyncOpenAI`` (or ``AsyncAzureOpenAI``) client.
            The provider uses a copy of it with ``max_retries=0`` and never
            closes it; it is used on the first event loop that sends through
            it only: a request on any other loop raises `ConfigError` before
            anything is sent.
        stream: Stream each response (``stream_options={"include_usage":
            true}``) and hand text deltas to the run's ``on_text`` callback.
        route: The route this provider serves: an operation's ``provider``
            must name it (R13). Default: the vendor, ``openai``, or ``azure``
            for an Azure client.
        stream_idle_timeout: Seconds a stream may go without a chunk before
            the attempt is aborted with reason ``idle`` (and retried).
        max_connections: Without ``client`` or ``http_client``: the most
            connections the provider's client (of each event loop) opens;
            default 1,000, the SDK's own. A request in flight holds a
            connection (HTTP/1.1), so a process with more conversations
            waiting on the model at once raises it, and its open-file limit
            with it. Every connection is kept alive between turns. The
            client is on asyncio the aiohttp one of the ``anthropic`` SDK
            (whose transport classifies connection errors as such), and on
            trio the SDK's httpx one on `PooledTransport` (whose pool does the same
            work per request however many are in flight); where the
            environment configures a proxy, the SDK's own httpx client with
            the same limits (docs/performance.md).
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
            keywords the SDK refuses, a bad ``route`` or
            ``stream_idle_timeout``, or a ``max_connections`` that is not a
            positive integer or comes with a ``client`` or ``http_client``.
        ImportError: the ``openai`` extra is not installed.

    The attempt's ``served_by`` is ``<route>:<model>`` and its price is looked
    up under the route (genai-prices knows ``openai`` and ``azure``); a model
    no price source knows (a local vLLM or Ollama model) is unpriced, like any
    other.

    Example::

        provider = OpenAIProvider(api_key=key, stream=True)
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
        max_connections: int | None = None,
        **client_kwargs: Any,
    ) -> None:
        _validate.boolean("stream", stream)
        self._idle = _validate.required_seconds("stream_idle_timeout", stream_idle_timeout)
        if route is not None:
            _validate.text("route", route)
        sdk = _import_openai()
        connections = max_connections_of(max_connections, client, client_kwargs)
        sdk_keywords(client, client_kwargs)
        try:
            if client is None:
                azure = bool(_AZURE_KEYWORDS & client_kwargs.keys())
                sdk_class = sdk.AsyncAzureOpenAI if azure else sdk.AsyncOpenAI
                if client_kwargs.get("http_client") is not None:
                    built = sdk_class(max_retries=0, **client_kwargs)
                    self._clients = Clients("OpenAIProvider", bound=self._own_copy(built),
                                            bound_as="http_client", owned=True)
                else:
                    client_kwargs.pop("http_client", None)
                    self._clients = Clients("OpenAIProvider",
                                            build=self._builder(sdk_class, client_kwargs,
                                                                connections))
            else:
                if not isinstance(client, sdk.AsyncOpenAI):
                    raise ConfigError("client", "must be an async openai client (AsyncOpenAI "
                                                f"or AsyncAzureOpenAI), got "
                                                f"{type(client).__name__}")
                self._clients = Clients("OpenAIProvider", bound=self._own_copy(client))
        except sdk.OpenAIError as error:
            # Missing credentials, contradictory Azure settings: the SDK says
            # so when the client is built, before anything is sent.
            raise ConfigError("client", f"the openai SDK refused the client settings: "
                                        f"{error}") from None
        self.awaits_before_wire = gates(type(self.client))
        self._vendor = "azure" if isinstance(self.client, sdk.AsyncAzureOpenAI) else "openai"
        self._name = route if route is not None else self._vendor
        self._stream = stream

    @staticmethod
    def _own_copy(base: openai.AsyncOpenAI) -> openai.AsyncOpenAI:
        # A copy shares the caller's connection pool; only its retries differ.
        # Our own copy (never the caller's client) awaits the attempt's ledger
        # write just before the wire.
        return gate(base.with_options(max_retries=0))

    @staticmethod
    def _builder(sdk_class: Any, client_kwargs: dict[str, Any],
                 connections: int) -> Callable[[bool], openai.AsyncOpenAI]:
        sdk = _import_openai()
        tls = shared_tls()

        def build(on_asyncio: bool) -> openai.AsyncOpenAI:
            built: openai.AsyncOpenAI = gate(sdk_class(
                max_retries=0, http_client=http_client(
                    tls(), connections, on_asyncio=on_asyncio,
                    sdk_default=sdk.DefaultAsyncHttpxClient),
                **client_kwargs))
            return built

        return build

    @property
    def name(self) -> str:
        """The route: ``openai`` (``azure`` for an Azure client) unless ``route`` named another."""
        return self._name

    @property
    def vendor(self) -> str:
        """Whose API the requests reach: ``openai``, or ``azure`` for an Azure client."""
        return self._vendor

    def _params(self, request: ProviderRequest) -> dict[str, Any]:
        return _params(request, stream=self._stream)

    async def _send_plain(self, client: openai.AsyncOpenAI,
                          params: dict[str, Any]) -> ProviderResponse:
        # The raw-response form hands over the body as JSON: the engine keeps
        # Anthropic-shaped dicts, so building the SDK's models would be wasted.
        try:
            async with client.chat.completions.with_streaming_response.create(**params) as raw:
                request_id = raw.headers.get("x-request-id")
                status = raw.status_code
                try:
                    body = await raw.json()
                except _failures() as error:
                    raise classify_error(error, request_id=request_id, in_body=True) from error
                except ValueError:
                    body = None
        except _failures() as error:
            raise classify_error(error) from error
        choice = _first_choice(body)
        message = choice.get("message") if choice is not None else None
        if choice is None or not isinstance(message, Mapping) or not isinstance(body, Mapping):
            raise ProviderFault(FaultKind.SERVER_ERROR,
                                "the response body is not a chat completion",
                                http_status=status, error_code="invalid_response",
                                request_id=request_id)
        content, stop = content_from_message(message, choice.get("finish_reason"))
        return ProviderResponse(
            content=content,
            stop_reason=stop,
            usage=usage_from_api(body.get("usage")),
            response_id=_text(body.get("id")),
            request_id=request_id,
            http_status=status,
            model=_text(body.get("model")),
        )

    async def _send_streaming(
        self, client: openai.AsyncOpenAI, request: ProviderRequest, params: dict[str, Any]
    ) -> ProviderResponse:
        try:
            stream: Any = await client.chat.completions.create(**params)
        except _failures() as error:
            raise classify_error(error) from error
        reply = _Accumulated()
        response = stream.response
        request_id = response.headers.get("x-request-id")
        try:
            while True:
                with anyio.move_on_after(self._idle) as idle:
                    try:
                        chunk = await stream.__anext__()
                    except StopAsyncIteration:
                        break
                    except _read_failures() as error:
                        raise classify_error(error, request_id=request_id, in_body=True,
                                             usage=reply.usage,
                                             response_id=reply.response_id) from error
                if idle.cancelled_caught:
                    raise ProviderFault(
                        FaultKind.ABORTED, f"the stream sent no chunk for {self._idle:g}s",
                        http_status=response.status_code, aborted_reason="idle",
                        request_id=request_id, usage=reply.usage,
                        usage_approx=reply.usage is not None, response_id=reply.response_id)
                text = reply.add(chunk)
                if text and request.on_text is not None:
                    try:
                        maybe = request.on_text(text)
                        if inspect.isawaitable(maybe):
                            await maybe
                    except Exception as error:
                        # The engine raises the callback's own exception to its
                        # caller; the fault carries what was served.
                        raise ProviderFault(
                            FaultKind.ABORTED, "the on_text callback raised",
                            http_status=response.status_code, request_id=request_id,
                            usage=reply.usage, usage_approx=reply.usage is not None,
                            response_id=reply.response_id) from error
        finally:
            # Closing releases the connection; it must happen even while the
            # caller's cancellation (or the attempt timeout) unwinds us.
            with anyio.CancelScope(shield=True):
                await stream.close()
        missing = ("its finish_reason" if reply.finish_reason is None
                   else "its usage chunk" if reply.usage is None else None)
        if missing is not None:
            # The SDK returns quietly from a stream cut short.
            raise ProviderFault(
                FaultKind.ABORTED, f"the stream ended before {missing}",
                http_status=response.status_code, request_id=request_id,
                usage=reply.usage, usage_approx=reply.usage is not None,
                response_id=reply.response_id)
        content, stop = reply.content()
        return ProviderResponse(content=content, stop_reason=stop, usage=reply.usage,
                                response_id=reply.response_id, request_id=request_id,
                                http_status=response.status_code, model=reply.model)


def _first_choice(body: object) -> Mapping[str, Any] | None:
    if not isinstance(body, Mapping):
        return None
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        return None
    return choices[0]


class _Accumulated:
    """A streamed completion, put together chunk by chunk."""

    def __init__(self) -> None:
        self.response_id: str | None = None
        self.model: str | None = None
        self.text: list[str] = []
        self.refusal: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.finish_reason: str | None = None
        self.usage: Usage | None = None

    def add(self, chunk: Any) -> str:
        """Take one chunk; return its text delta."""
        if self.response_id is None:
            self.response_id = _text(getattr(chunk, "id", None))
            self.model = _text(getattr(chunk, "model", None))
        if getattr(chunk, "usage", None) is not None:
            self.usage = usage_from_api(chunk.usage.to_dict())
        text = ""
        for choice in getattr(chunk, "choices", None) or ():
            if getattr(choice, "index", 0) != 0:
                continue
            delta = choice.delta
            if delta is not None:
                if delta.content:
                    text += delta.content
                if delta.refusal:
                    self.refusal.append(delta.refusal)
                for call in delta.tool_calls or ():
                    entry = self.calls.setdefault(call.index,
                                                  {"id": None, "name": "", "arguments": []})
                    if call.id:
                        entry["id"] = call.id
                    if call.function is not None:
                        if call.function.name:
                            entry["name"] += call.function.name
                        if call.function.arguments:
                            entry["arguments"].append(call.function.arguments)
            if choice.finish_reason is not None:
                self.finish_reason = choice.finish_reason
        if text:
            self.text.append(text)
        return text

    def content(self) -> tuple[list[dict[str, Any]], str | None]:
        """The reply's content blocks and stop reason."""
        message: dict[str, Any] = {
            "content": "".join(self.text) or None,
            "refusal": "".join(self.refusal) or None,
            "tool_calls": [
                {"id": call["id"], "type": "function",
                 "function": {"name": call["name"], "arguments": "".join(call["arguments"])}}
                for _, call in sorted(self.calls.items())
            ],
        }
        return content_from_message(message, self.finish_reason)


def _params(request: ProviderRequest, *, stream: bool) -> dict[str, Any]:
    params: dict[str, Any] = {
        "model": request.model,
        "messages": chat_messages(request.system, request.messages),
        "max_completion_tokens": request.max_tokens,
        "timeout": request.timeout,
    }
    if request.tools:
        params["tools"] = chat_tools(request.tools)
        choice = chat_tool_choice(request.tool_choice)
        if choice is not None:
            params["tool_choice"] = choice
        if request.tool_choice is not None and request.tool_choice.get(
                "disable_parallel_tool_use") is True:
            params["parallel_tool_calls"] = False
    if stream:
        params["stream"] = True
        params["stream_options"] = {"include_usage": True}
    return params


# -- translation: the engine's Anthropic shapes <-> Chat Completions ------------------------


def _untranslatable(what: str) -> ProviderFault:
    return ProviderFault(FaultKind.BAD_REQUEST,
                         f"{what} has no Chat Completions equivalent, so the request was not "
                         "sent", error_code="untranslatable")


def chat_messages(
    system: Sequence[Mapping[str, Any]] | None, messages: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """The Chat Completions ``messages`` for an Anthropic ``system`` and ``messages``.

    Raises:
        ProviderFault: ``bad_request`` (``untranslatable``) for a block that
            has no Chat Completions equivalent (a document, a server tool).
    """
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": "\n\n".join(
            str(block.get("text", "")) for block in system)})
    for message in messages:
        role = message.get("role")
        content = message.get("content")
        if role == "assistant":
            out.append(_assistant_message(content))
        elif role == "user":
            out.extend(_user_messages(content))
        else:
            raise _untranslatable(f"a message with role {role!r}")
    return out


def _assistant_message(content: Any) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in content or ():
        kind = block.get("type")
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_use":
            tool_input = block.get("input", {})
            # Arguments the model sent malformed are sent back as they came.
            arguments = tool_input if isinstance(tool_input, str) else json.dumps(tool_input)
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block.get("name"), "arguments": arguments}})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # another vendor's reasoning: nothing to send it as
        else:
            raise _untranslatable(f"an assistant {kind!r} block")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        message["tool_calls"] = calls
    elif message["content"] is None:
        message["content"] = ""
    return message


def _user_messages(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    # The API wants each tool call's result right after the assistant's calls,
    # so the results go first and the rest of the user's message after them.
    results: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for block in content or ():
        kind = block.get("type")
        if kind == "tool_result":
            text = _result_text(block.get("content"))
            if block.get("is_error") is True:
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": text})
        elif kind == "text":
            parts.append({"type": "text", "text": str(block.get("text", ""))})
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block)}})
        else:
            raise _untranslatable(f"a user {kind!r} block")
    if parts:
        if all(part["type"] == "text" for part in parts):
            results.append({"role": "user",
                            "content": "\n\n".join(part["text"] for part in parts)})
        else:
            results.append({"role": "user", "content": parts})
    return results


def _result_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for block in content:
        if not isinstance(block, Mapping) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, Mapping) else type(block).__name__
            raise _untranslatable(f"a {kind!r} block inside a tool result")
        texts.append(str(block.get("text", "")))
    return "\n\n".join(texts)


def _image_url(block: Mapping[str, Any]) -> str:
    source = block.get("source")
    if isinstance(source, Mapping):
        if source.get("type") == "base64":
            return f"data:{source.get('media_type')};base64,{source.get('data')}"
        if source.get("type") == "url":
            return str(source.get("url"))
    raise _untranslatable("an image that is neither base64 data nor a URL")


def chat_tools(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Chat Completions ``function`` tools for Anthropic tool definitions."""
    out = []
    for tool in tools:
        function: dict[str, Any] = {"name": tool.get("name"),
                                    "parameters": tool.get("input_schema") or {"type": "object"}}
        if tool.get("description"):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Mapping[str, Any] | None) -> str | dict[str, Any] | None:
    """The Chat Completions ``tool_choice`` for an Anthropic one (None: the default)."""
    if choice is None:
        return None
    kind = choice.get("type")
    if kind == "auto":
        return "auto"
    if kind == "none":
        return "none"
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise _untranslatable(f"tool_choice {kind!r}")


def content_from_message(
    message: Mapping[str, Any], finish_reason: object
) -> tuple[list[dict[str, Any]], str | None]:
    """Anthropic content blocks and stop reason for a Chat Completions ``message``.

    A ``refusal`` is text whose stop reason is ``refusal``; each tool call is
    a ``tool_use`` block whose ``input`` is the parsed arguments, or the
    arguments as sent when they are not a JSON object (the loop's input
    validation then answers the model with an error result, R15).
    """
    content: list[dict[str, Any]] = []
    text = message.get("content")
    if isinstance(text, str) and text:
        content.append({"type": "text", "text": text})
    refusal = message.get("refusal")
    if isinstance(refusal, str) and refusal:
        content.append({"type": "text", "text": refusal})
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        content.append({"type": "tool_use", "id": call.get("id"), "name": function.get("name"),
                        "input": _arguments(function.get("arguments"))})
    stop = stop_reason(finish_reason)
    if isinstance(refusal, str) and refusal:
        stop = "refusal"
    return content, stop


def _arguments(raw: object) -> Any:
    if raw is None or raw == "":
        return {}
    if not isinstance(raw, str):
        return raw
    try:
        parsed = json.loads(raw)
    except ValueError:
        return raw
    return parsed if isinstance(parsed, dict) else raw


def stop_reason(finish_reason: object) -> str | None:
    """The engine's stop reason for a ``finish_reason``: ``stop`` -> ``end_turn``,
    ``tool_calls`` -> ``tool_use``, ``length`` -> ``max_tokens``,
    ``content_filter`` -> ``refusal``; another value is kept as it is."""
    if not isinstance(finish_reason, str):
        return None
    return _FINISH_REASONS.get(finish_reason, finish_reason)


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return 0
    return value


def usage_from_api(raw: object) -> Usage | None:
    """Map a Chat Completions ``usage`` object (a dict) to `Usage`.

    ``prompt_tokens`` counts the cached tokens too: ``input_tokens`` is
    ``prompt_tokens - prompt_tokens_details.cached_tokens`` and
    ``cache_read_tokens`` the cached ones; ``output_tokens`` is
    ``completion_tokens``, reasoning tokens included. Missing or null counts
    are 0; a missing usage object is None.
    """
    if not isinstance(raw, Mapping):
        return None
    prompt = _count(raw.get("prompt_tokens"))
    details = raw.get("prompt_tokens_details")
    cached = min(prompt, _count(details.get("cached_tokens"))) if isinstance(
        details, Mapping) else 0
    return Usage(input_tokens=prompt - cached, output_tokens=_count(raw.get("completion_tokens")),
                 cache_read_tokens=cached)


# -- classification: the one place SDK errors become faults ---------------------------------


def classify_error(
    error: BaseException,
    *,
    request_id: str | None = None,
    in_body: bool = False,
    usage: Usage | None = None,
    response_id: str | None = None,
    now: datetime | None = None,
) -> ProviderFault:
    """Classify an ``openai`` SDK or transport error as one `ProviderFault` (DESIGN.md §14).

    Args:
        error: What the SDK (or the HTTP transport under it) raised.
        request_id: The request id, when the response had begun.
        in_body: The error came while the body or stream was being read,
            after a response began: a transport failure there cuts the stream
            (``aborted``).
        usage: Usage reported before the failure.
        response_id: The completion id, when the stream had announced one.
        now: The current time, for ``retry-after`` given as an HTTP date.

    Returns:
        The fault; it is never raised here.
    """
    return classify_sdk_error(
        error, _sdk(),
        status_fault=lambda status: _status_fault(status, usage=usage, response_id=response_id,
                                                  now=now),
        api_fault=lambda api: _stream_fault(api, request_id=request_id, usage=usage,
                                            response_id=response_id),
        request_id=request_id, in_body=in_body, usage=usage, response_id=response_id,
    )


def _error_fields(error: Any) -> tuple[str | None, str | None, str]:
    """``(type, code, message)`` of an SDK error, from its attributes or its body."""
    body = error.body if isinstance(error.body, Mapping) else {}
    error_type = _text(getattr(error, "type", None)) or _text(body.get("type"))
    code = _text(getattr(error, "code", None)) or _text(body.get("code"))
    message = _text(body.get("message")) or _text(getattr(error, "message", None)) or ""
    return error_type, code, message


def _status_fault(
    error: Any, *, usage: Usage | None, response_id: str | None, now: datetime | None
) -> ProviderFault:
    status: int = error.status_code
    error_type, code, message = _error_fields(error)
    headers = error.response.headers
    return ProviderFault(
        _kind(status, error_type, code),
        f"HTTP {status} {error_type or 'error'}: {message}".rstrip(": "),
        http_status=status,
        error_code=code or error_type,
        retry_after=retry_after(headers, now=now),
        should_retry=should_retry(headers),
        request_id=error.request_id,
        response_id=response_id,
        usage=usage,
        usage_approx=usage is not None,
    )


def _stream_fault(
    error: Any, *, request_id: str | None, usage: Usage | None, response_id: str | None
) -> ProviderFault:
    """An error object inside a stream: the SDK raises it without a status."""
    error_type, code, message = _error_fields(error)
    return ProviderFault(
        _kind(200, error_type, code),
        f"HTTP 200 mid-stream {error_type or 'error'}: {message}".rstrip(": "),
        http_status=200, error_code=code or error_type, request_id=request_id,
        response_id=response_id, usage=usage, usage_approx=usage is not None,
    )


def _kind(status: int, error_type: str | None, code: str | None) -> FaultKind:
    """The fault kind of an error response (or of an error inside a stream, status 200)."""
    if is_credit_code(code) or is_credit_code(error_type):
        return FaultKind.CREDIT_EXHAUSTED
    if status == 200 or (status >= 500 and error_type == "overloaded_error"):
        # After a 200 only the error's type (or code) tells what went wrong;
        # an unknown one is the server's failure.
        return _TYPE_KINDS.get(code or "", _TYPE_KINDS.get(error_type or "",
                                                           FaultKind.SERVER_ERROR))
    if status in _STATUS_KINDS:
        return _STATUS_KINDS[status]
    if status >= 500:
        return FaultKind.SERVER_ERROR
    return FaultKind.BAD_REQUEST

