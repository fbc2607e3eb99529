"""`OpenAIResponsesProvider`: the Responses API through the official ``openai`` SDK.

One `send` is one ``client.responses.create`` request, with ``store=False``
and never a ``previous_response_id``: the server keeps nothing, each request
carries the whole transcript (reasoning items with their
``encrypted_content``), so a run's history is ``result.messages`` alone, as
on every other route. The client rules are `OpenAIProvider`'s, from the same
code (`openai_clients`): ``max_retries=0``, a client per event loop when
built from keywords, a given client bound to its first loop.

Its request goes through `responses_params` and its reply back through
`content_from_response` (``_openai_responses_items.py``, the translation);
every SDK error becomes a fault in the Chat route's `classify_error` (the
same SDK and error bodies), and an error that arrives after a 200 (an
``error`` event, ``response.failed``, a body whose status is ``failed``) in
`event_fault` (``_openai_faults.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from loopengine import _validate
from loopengine._features import Features
from loopengine._pricing import DOCUMENTED_FEES
from loopengine.providers._base import (
    DEFAULT_BILLING,
    Billing,
    ProviderRequest,
    ProviderResponse,
    TextCallback,
    text_or_none,
)
from loopengine.providers._faults import FaultKind, ProviderFault
from loopengine.providers._openai import json_body, openai_clients
from loopengine.providers._openai_faults import (
    body_fault,
    classify_error,
    event_fault,
    failures,
    read_failures,
)
from loopengine.providers._openai_responses_items import (
    PREVIEW_SEARCH,
    StreamedResponse,
    check_translatable,
    content_from_response,
    reasoning_model,
    responses_params,
    usage_from_response,
)
from loopengine.providers._sdk import DEFAULT_STREAM_IDLE_TIMEOUT, SDKProvider, read_stream

if TYPE_CHECKING:
    import openai

__all__ = ["OpenAIResponsesProvider"]


class OpenAIResponsesProvider(SDKProvider["openai.AsyncOpenAI"]):
    """The Responses API as a `Provider`, through the ``openai`` SDK.

    Args:
        client: An ``openai.AsyncOpenAI`` (or ``AsyncAzureOpenAI``) client,
            used as `OpenAIProvider` uses one (a copy with ``max_retries=0``,
            on the first event loop that sends through it only).
        stream: Stream every response, also when nobody reads its text. A
            request whose run reads the text (``on_text``,
            `loopengine.Engine.stream`) is streamed whatever it says.
        route: The route this provider serves: an operation's ``provider``
            must name it (R13). Default: the vendor, ``openai`` (``azure``
            for an Azure client). ``served_by`` and prices keep the vendor.
        stream_idle_timeout: Seconds a stream may go without an event before
            the attempt is aborted with reason ``idle`` (and retried).
        max_connections: As for `OpenAIProvider`.
        **client_kwargs: Without ``client``: the keywords to build an
            ``AsyncOpenAI`` (or ``AsyncAzureOpenAI``), as for `OpenAIProvider`.

    Raises:
        ConfigError: what `OpenAIProvider` refuses.
        ImportError: the ``openai`` extra is not installed.

    Example::

        provider = OpenAIResponsesProvider(api_key=key)
        engine = loopengine.Engine(provider)
        op = loopengine.Operation(name="help.answer", provider="openai",
                                  model="gpt-5-mini", reasoning_effort="low")
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
        self._settings(stream, stream_idle_timeout, route)
        self._clients, vendor = openai_clients("OpenAIResponsesProvider", client,
                                               client_kwargs, max_connections)
        self._name_route(vendor)

    features = frozenset({"reasoning_effort", "service_tier", "server_tools"})
    """The Responses API's optional request features (docs/providers.md):
    ``reasoning_effort`` (sent as ``reasoning.effort``, with
    ``include=["reasoning.encrypted_content"]``, which a request to a reasoning
    model carries without it too), ``service_tier``, and
    server tools of the web search types (``web_search``,
    ``web_search_preview``...; another type is refused before anything is
    recorded, by `check_request`)."""

    def check_request(self, request: ProviderRequest) -> None:
        """Before an attempt is recorded: refuse a request the Responses API has no
        equivalent for (a document, a block inside a tool result other than
        text, an image or a document, a Messages API server tool block, a
        server tool other than web search), by the
        translation's own rules, without translating it.

        Raises:
            ProviderFault: ``bad_request``, ``error_code`` ``untranslatable``.
        """
        check_translatable(request)

    def billing(self, model: str, features: Features) -> Billing:
        """OpenAI's fee for the web search preview tool on a non-reasoning model
        (`reasoning_model`: ``gpt-4o``, ``gpt-4.1``...), $25 per 1,000 calls
        (`loopengine._pricing.DOCUMENTED_FEES`), when the request has a
        ``web_search_preview`` tool and its vendor is ``openai``
        (`Billing.web_search_per_k`); else the model's fee (the web search
        tool's, and the preview tool's on a reasoning model: $10). All else
        as the usage says (`Provider.billing`)."""
        if self.vendor == "openai" and not reasoning_model(model) and any(
                tool.type.startswith(PREVIEW_SEARCH) for tool in features.server_tools):
            return Billing(web_search_per_k=DOCUMENTED_FEES[("openai", PREVIEW_SEARCH)])
        return DEFAULT_BILLING

    def _params(self, request: ProviderRequest, *, stream: bool) -> dict[str, Any]:
        return responses_params(request, stream=stream)

    async def _send_plain(self, client: openai.AsyncOpenAI,
                          params: dict[str, Any]) -> ProviderResponse:
        body, request_id, status = await json_body(
            client.responses.with_streaming_response.create, params, what="a response",
            valid=lambda body: isinstance(body.get("output"), list) or isinstance(
                body.get("error"), Mapping))
        if not isinstance(body.get("output"), list):
            raise body_fault(body, request_id=request_id, usage=usage_from_response(body))
        return _finished(body, request_id=request_id, http_status=status)

    async def _send_streaming(
        self, client: openai.AsyncOpenAI, params: dict[str, Any], on_text: TextCallback | None
    ) -> ProviderResponse:
        try:
            stream: Any = await client.responses.create(**params)
        except failures() as error:
            raise classify_error(error) from error
        reply = StreamedResponse()
        response = stream.response
        request_id = response.headers.get("x-request-id")

        def take(event: Any) -> str:
            text = reply.add(event)
            if reply.error is not None:
                raise event_fault(reply.error, request_id=request_id, usage=None,
                                  response_id=reply.response_id)
            return text

        await read_stream(
            stream, idle=self._idle, failures=read_failures(), classify=classify_error,
            take=take, on_text=on_text, close=stream.close,
            http_status=response.status_code, request_id=request_id,
            # Usage comes with the last event only: a cut stream's is unknown.
            served=lambda: (None, reply.response_id),
            missing=lambda: "response.completed or response.incomplete"
            if reply.final is None else None)
        return _finished(reply.response(), request_id=request_id,
                         http_status=response.status_code)


def _finished(body: Mapping[str, Any], *, request_id: str | None,
              http_status: int | None) -> ProviderResponse:
    """The `ProviderResponse` of a response that ended, or the fault of one that
    failed (``failed``) or did not end (``in_progress``, ``cancelled``...)."""
    usage = usage_from_response(body)
    response_id = text_or_none(body.get("id"))
    status = body.get("status")
    if status == "failed":
        # A failed response reports what it used, whole: billed, not a floor.
        raise event_fault(body.get("error"), request_id=request_id, usage=usage,
                          response_id=response_id, usage_approx=False)
    if status not in ("completed", "incomplete"):
        raise ProviderFault(FaultKind.SERVER_ERROR, f"the response ended with status "
                                                    f"{_validate.shown(status)}",
                            http_status=http_status, error_code="invalid_response",
                            request_id=request_id, response_id=response_id, usage=usage)
    content, stop = content_from_response(body)
    return ProviderResponse(content=content, stop_reason=stop, usage=usage,
                            response_id=response_id, request_id=request_id,
                            http_status=http_status, model=text_or_none(body.get("model")))
