"""`GeminiProvider`: the Gemini API through the official ``google-genai`` SDK.

One `send` is one wire request (``models/{model}:generateContent``, or
``:streamGenerateContent?alt=sse``), in the Gemini Developer API mode (an API
key) or the Vertex AI mode (a ``genai.Client(vertexai=True, ...)`` passed
in). The SDK never retries on its own: its HTTP options say
``retry_options={"attempts": 1}`` (which also turns off the SDK's silent
retry of a failed aiohttp connection): the client's own, for a client the
provider builds, else every request's; every request carries the engine's
attempt timeout (already capped at the run's remaining time, R04), and the SDK's own loops
(automatic function calling, automatic continuation) are off. The event-loop
rules are `AnthropicProvider`'s, from the same code (``_clients.py``): a
client per event loop when built from keywords, a client given by the caller
bound to its first loop.

Its request goes through ``_gemini_contents.py`` (the translation) and every
SDK error becomes a fault in ``_gemini_faults.py``'s `classify_error`.

The ``google-genai`` SDK is the extra ``gemini`` (``pip install
'loopengine-core[gemini]'``): this module imports it only when a provider is
built.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

import httpx2

from loopengine._errors import ConfigError
from loopengine.providers._base import ProviderRequest, ProviderResponse, TextCallback
from loopengine.providers._clients import (
    BoundClient,
    ClientPerLoop,
    client_keywords,
    client_or_keywords,
    connection_limit,
    http_client,
    shared_tls,
)
from loopengine.providers._faults import FaultKind, ProviderFault
from loopengine.providers._gemini_contents import (
    StreamedReply,
    check_translatable,
    gemini_config,
    gemini_contents,
)
from loopengine.providers._gemini_faults import (
    check_finish,
    classify_error,
    read_failures,
)
from loopengine.providers._sdk import (
    DEFAULT_STREAM_IDLE_TIMEOUT,
    NO_SDK_RETRIES,
    SDKProvider,
    import_sdk,
    read_stream,
)

if TYPE_CHECKING:
    from google import genai

__all__ = ["GeminiProvider"]

# HTTP options the provider sets itself: a client of the caller's making comes
# as ``client`` instead (it is then bound to its first event loop).
_OWN_OPTIONS = ("httpx_async_client", "httpx_client", "aiohttp_client", "async_client_args")


class _Session:
    """One ``genai.Client`` and what closing it takes: the async HTTP client
    the provider built for it (the SDK leaves a client it was given open)."""

    def __init__(self, client: genai.Client, owned: tuple[Any, ...] = ()) -> None:
        self.client = client
        self._owned = owned

    async def close(self) -> None:
        """Close the HTTP clients the provider built for this session."""
        for http in self._owned:
            if isinstance(http, httpx2.AsyncClient):
                await http.aclose()
            else:
                http.close()


class _Chunks:
    """A stream whose first chunk was read already: that chunk, then the rest."""

    def __init__(self, first: Any, rest: AsyncIterator[Any]) -> None:
        self._first = first
        self._rest = rest

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> Any:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await self._rest.__anext__()


class GeminiProvider(SDKProvider[_Session]):
    """The Gemini API as a `Provider`, through the ``google-genai`` SDK.

    Args:
        client: A ``google.genai.Client``: the Vertex AI mode
            (``genai.Client(vertexai=True, project=..., location=...)``) or any
            client of the caller's making. It is used on the first event loop
            that sends through it only (a request on another loop raises
            `ConfigError` before anything is sent) and never closed; each
            request turns its retries off.
        stream: Stream every response (``streamGenerateContent?alt=sse``), also
            when nobody reads its text. Whatever it says, a request whose run
            reads the text (``on_text``, `loopengine.Engine.stream`) is streamed.
        route: The route this provider serves (an operation's ``provider``).
            Default: ``gemini``, or ``gemini-vertex`` for a Vertex AI client (apart
            from Claude's ``google-vertex`` route, so one engine can hold both).
        stream_idle_timeout: Seconds a stream may go without a chunk before
            the attempt is aborted with reason ``idle`` (and retried).
        max_connections: Without ``client``: the most connections the
            provider's HTTP client (of each event loop) opens; default 1,000.
        **client_kwargs: Without ``client``: the keywords to build a
            ``genai.Client`` (``api_key``, ``http_options``...). Without
            ``api_key`` the SDK reads ``GOOGLE_API_KEY``, then
            ``GEMINI_API_KEY``. ``http_options`` may set ``base_url``,
            ``api_version`` and ``headers``; its ``retry_options`` may only
            make one attempt, and the HTTP clients are the provider's (one
            per event loop, built as `AnthropicProvider` builds them).

    Raises:
        ConfigError: both a client and keywords, a client that is not a
            ``genai.Client``, retries asked of the SDK, HTTP clients among the
            ``http_options``, keywords the SDK refuses (no API key), a bad
            ``route``, ``stream_idle_timeout`` or ``max_connections``.
        ImportError: the ``gemini`` extra is not installed.

    The attempt's ``served_by`` is ``google:<model>`` (``google-vertex:<model>``
    for a Vertex AI client) and its price is genai-prices' ``google`` one.

    Example::

        provider = GeminiProvider(api_key=key)
        engine = loopengine.Engine(provider)
        op = loopengine.Operation(name="help.answer", provider="gemini",
                                  model="gemini-2.5-flash")
    """

    def __init__(
        self,
        client: genai.Client | None = None,
        *,
        stream: bool = False,
        route: str | None = None,
        stream_idle_timeout: float = DEFAULT_STREAM_IDLE_TIMEOUT,
        max_connections: int | None = None,
        **client_kwargs: Any,
    ) -> None:
        self._settings(stream, stream_idle_timeout, route)
        # A client of the caller's making may retry on its own (its options
        # are the caller's): each request then turns its retries off.
        self._retries_per_request = client is not None
        genai = import_sdk("google.genai", "google-genai", provider="GeminiProvider",
                           extra="gemini")
        auth_errors = import_sdk("google.auth.exceptions", "google-auth",
                                 provider="GeminiProvider", extra="gemini")
        connections = connection_limit(max_connections, client, client_kwargs)
        if client is not None:
            client_or_keywords(client, client_kwargs)
            if not isinstance(client, genai.Client):
                raise ConfigError("client", f"must be a google.genai.Client, got "
                                            f"{type(client).__name__}")
            self._clients: ClientPerLoop[_Session] | BoundClient[_Session] = BoundClient(
                "GeminiProvider", _Session(client))
        else:
            client_keywords(genai.Client, client_kwargs)
            options = _http_options(client_kwargs.pop("http_options", None))
            tls = shared_tls()

            def build(on_asyncio: bool) -> _Session:
                http = http_client(tls(), connections, on_asyncio=on_asyncio,
                                   sdk_default=httpx2.AsyncClient)
                # The SDK builds a sync client too unless given one; this one
                # shares the TLS context and is never used.
                plain = httpx2.Client(verify=tls())
                try:
                    built = genai.Client(**client_kwargs, http_options={
                        **options, "httpx_async_client": http, "httpx_client": plain})
                except (ValueError, TypeError) as error:
                    plain.close()
                    raise ConfigError("client", f"the google-genai SDK refused the client "
                                                f"settings: {error}") from None
                except auth_errors.GoogleAuthError as error:
                    # Vertex AI mode without a project: the SDK loads Application
                    # Default Credentials (for their project) as it builds the client.
                    plain.close()
                    raise ConfigError("client", "the google-genai SDK found no Vertex AI "
                                                f"credentials to read the project from: "
                                                f"{error}") from None
                return _Session(built, (http, plain))

            self._clients = ClientPerLoop("GeminiProvider", build)
        vertex = bool(self.client.client.vertexai)
        # Not the vendor: Claude's google-vertex route may serve beside it.
        self._name_route("google-vertex" if vertex else "google",
                         "gemini-vertex" if vertex else "gemini")

    genai_operation = "generate_content"
    """Gemini's ``generateContent``, on the Gemini API and on Vertex AI alike:
    the OpenTelemetry GenAI conventions' ``generate_content``."""

    features = frozenset({"thinking"})
    """The Gemini API's optional request features (docs/providers.md): ``thinking``,
    sent as ``thinkingConfig.thinkingBudget`` (``-1``, dynamic, for an adaptive
    `loopengine.Thinking`; its ``effort`` as ``thinkingLevel``). The vendor
    (`vendor`) is ``google``, or ``google-vertex`` for a Vertex AI client."""

    def check_request(self, request: ProviderRequest) -> None:
        """Before an attempt is recorded: refuse a request the Gemini API has no
        equivalent for (an image given by URL, a document that is not base64
        data, a server tool block...), by the translation's own rules.

        Raises:
            ProviderFault: ``bad_request``, ``error_code`` ``untranslatable``.
        """
        check_translatable(request)

    def _params(self, request: ProviderRequest, *, stream: bool) -> dict[str, Any]:
        # At least a millisecond: the SDK takes whole milliseconds.
        http_options: dict[str, Any] = {"timeout": max(1, int(request.timeout * 1000))}
        if self._retries_per_request:
            http_options["retry_options"] = {"attempts": 1}
        # The translation's dicts as they are, the config too: the SDK validates
        # them once (a config model it would deep-copy, and built into
        # `types.Content` models here the transcript cost each turn far more
        # CPU; docs/performance.md).
        return {"model": request.model, "contents": gemini_contents(request.messages),
                "config": gemini_config(request, http_options)}

    async def _send_plain(self, client: _Session, params: dict[str, Any]) -> ProviderResponse:
        try:
            response = await client.client.aio.models.generate_content(**params)
        except read_failures() as error:
            raise _request_fault(error) from error
        reply = StreamedReply()
        reply.add(response)
        # A reply with no finished candidate and no blocked prompt answered
        # nothing: `_response` refuses it (a stream in that state is cut, below).
        return self._response(reply)

    async def _send_streaming(
        self, client: _Session, params: dict[str, Any], on_text: TextCallback | None
    ) -> ProviderResponse:
        try:
            # An async generator (typed as an iterator): its aclose closes the
            # response and releases the connection.
            stream: Any = await client.client.aio.models.generate_content_stream(**params)
            # The SDK sends the request when the stream is first read: an error
            # status (or a refused connection) comes with the first chunk.
            first: Any = await stream.__anext__()
        except StopAsyncIteration:
            first = None
        except read_failures() as error:
            raise _request_fault(error) from error
        reply = StreamedReply()

        await read_stream(
            _Chunks(first, stream), idle=self._idle, failures=read_failures(),
            classify=classify_error, take=reply.add, on_text=on_text, close=stream.aclose,
            http_status=200, request_id=None, served=lambda: (reply.usage, reply.response_id),
            missing=lambda: None if reply.ended else "its finishReason")
        return self._response(reply)

    @staticmethod
    def _response(reply: StreamedReply) -> ProviderResponse:
        if reply.block_reason is None:
            # A blocked prompt is a refusal, whatever its candidate says; without
            # one, a missing finishReason is an invalid response (`check_end`).
            check_finish(reply.finish_reason, usage=reply.usage, response_id=reply.response_id)
        content, stop = reply.content()
        return ProviderResponse(content=content, stop_reason=stop, usage=reply.usage,
                                response_id=reply.response_id, http_status=200,
                                model=reply.model)


def _request_fault(error: BaseException) -> ProviderFault:
    """The fault of an SDK call that failed before its reply was read: the SDK's
    refusal of the request's config (it validates the dict it is handed before
    anything is sent) is ``untranslatable``; any other error is classified."""
    from pydantic import ValidationError

    if isinstance(error, ValidationError) and error.title == "GenerateContentConfig":
        return ProviderFault(FaultKind.BAD_REQUEST, f"the google-genai SDK refused the "
                             f"request: {error.error_count()} invalid field(s)",
                             error_code="untranslatable")
    return classify_error(error)


def _http_options(given: object) -> dict[str, Any]:
    """The caller's ``http_options`` as a dict, checked: retries off, no HTTP clients.

    Raises:
        ConfigError: retries asked of the SDK, or HTTP clients among them.
    """
    if given is None:
        options: dict[str, Any] = {}
    elif isinstance(given, Mapping):
        options = dict(given)
    elif hasattr(given, "model_dump"):
        options = {k: v for k, v in given.model_dump().items() if v is not None}
    else:
        raise ConfigError("http_options", f"must be a mapping or google.genai.types."
                                          f"HttpOptions, got {type(given).__name__}")
    own = [name for name in _OWN_OPTIONS if options.get(name) is not None]
    if own:
        raise ConfigError("http_options", f"{', '.join(own)}: the provider builds its HTTP "
                                          "clients (one per event loop); to send through "
                                          "your own, pass a genai.Client as client")
    retries = options.get("retry_options")
    attempts = (retries.get("attempts") if isinstance(retries, Mapping)
                else getattr(retries, "attempts", None))
    if retries is not None and attempts not in (0, 1):
        raise ConfigError("http_options", f"retry_options: {NO_SDK_RETRIES}")
    options["retry_options"] = {"attempts": 1}
    return options
