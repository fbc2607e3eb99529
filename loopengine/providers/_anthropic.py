"""`AnthropicProvider`: the Messages API through the official ``anthropic`` SDK.

One `send` is one wire request. The SDK client is always used with
``max_retries=0``: the SDK would otherwise retry 408, 409, 429 and 5xx on its
own, invisibly, and every wire request must be an attempt the engine counts,
prices and records. Each request carries the engine's attempt timeout, which
the engine has already capped at the run's remaining time (R04).

Every SDK (and transport) error becomes one `ProviderFault` in `classify_error`,
the one place where the fault table of docs/architecture.md is applied:

=====================  ===========================================================
fault kind             from
=====================  ===========================================================
``credit_exhausted``   a spend-limit ``error_code`` (e.g. a 429 with
                       ``enforced_spend_limit_reached``), 402 / ``billing_error``,
                       "Your credit balance is too low", "You have reached your
                       specified API usage limits", OpenAI-style quota codes
``timeout``            408, ``timeout_error`` mid-stream, the SDK's timeout
``rate_limited``       429 (``retry-after-ms`` / ``retry-after`` honoured)
``overloaded``         529, ``overloaded_error`` (also mid-stream, after a 200)
``server_error``       409, 500, 502, 503, 504, other 5xx, ``api_error``, a body
                       that is not a message; a whole message whose
                       ``stop_reason`` is missing (``invalid_response``) or one
                       the SDK's ``BetaStopReason`` does not name (`STOP_REASONS`;
                       ``error_code`` the value): never an answer
``connection``         refused, reset or closed before a response: a transport
                       error (httpx2's, or an ``OSError``)
``aborted``            the stream or body was cut after the response began, a
                       stream that ended without ``message_stop``, an idle stream
``unauthorized``       401, 403
``bad_request``        400 ``invalid_request_error``, 404, 413, 422, other 4xx;
                       the client failing on its own state rather than on the
                       connection (``error_code`` ``client_state``: an event
                       loop that ended, a closed client), since such a request
                       may have reached the server and must not be sent twice
=====================  ===========================================================

The platforms answer in their own shapes as well, read at the same place:
Bedrock names its exception in ``x-amzn-errortype`` (or, inside an event
stream, in an exception frame the SDK hands over as an error event), Vertex
gives Google's ``error.status`` and reasons; `_PLATFORM_KINDS` maps them
onto the same kinds (``ThrottlingException`` and ``RESOURCE_EXHAUSTED`` are
``rate_limited``, ``ServiceUnavailableException`` ``overloaded``, a Google
reason ``BILLING_DISABLED`` and Bedrock's ``INVALID_PAYMENT_INSTRUMENT``
``credit_exhausted``...; docs/providers.md). A
Google error's ``google.rpc.RetryInfo.retryDelay`` is the wait, as on the
Gemini route (`retry_info_delay`), winning over a ``retry-after`` header.
A platform client that cannot sign its request (no AWS or Google credentials,
or a token endpoint out of reach) fails before the wire, also classified here
(`_credentials_fault`): ``unauthorized``, or ``connection`` when transient.

Credit exhaustion is checked first, whatever the status (R06). A server's
``x-should-retry`` is carried as `ProviderFault.should_retry`; the engine obeys
``false``. Usage that arrived before a stream broke is reported as a floor
(``usage_approx``). The caller's cancellation is never caught here.

Its SDK clients, one per event loop, come from ``_clients.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Self, TypeAlias, TypedDict

import anthropic
import httpx2

from loopengine._errors import ConfigError
from loopengine._features import Features
from loopengine._pricing import TOKEN_ONLY_TOOLS
from loopengine._usage import Usage, UsageIteration
from loopengine.providers._base import (
    STOP_REASONS,
    Billing,
    Container,
    ProviderRequest,
    ProviderResponse,
    TextCallback,
    priced_geo,
    priced_speed,
    priced_tier,
    reported_usage,
    text_or_none,
    token_count,
)
from loopengine.providers._cache import marker_lifetimes, place_cache_markers
from loopengine.providers._faults import (
    BILLING_REASONS,
    STATUS_KINDS,
    FaultKind,
    ProviderFault,
    SDKErrors,
    check_end,
    classify_sdk_error,
    google_details,
    is_credit_code,
    response_fault,
    retry_after,
    status_kind,
)
from loopengine.providers._messages_api import (
    TOOL_BLOCKS_WITHOUT_TOOLS,
    tool_blocks_without_tools,
    tool_schema_refusal,
    unthought_opening,
)
from loopengine.providers._sdk import (
    DEFAULT_STREAM_IDLE_TIMEOUT,
    SDKProvider,
    json_body,
    provider_clients,
    read_stream,
)

__all__ = [
    "AnthropicProvider",
    "classify_error",
    "retry_after",
    "usage_from_api",
]

AsyncClient: TypeAlias = (
    anthropic.AsyncAnthropic | anthropic.AsyncAnthropicBedrock | anthropic.AsyncAnthropicVertex
)
"""The SDK clients the provider accepts."""

# Lowercased fragments of the messages Anthropic sends for a depleted prepaid
# balance (400) and for a reached workspace usage limit (400); matched whatever
# the status, since a proxy may relay them as 429 (R06). And Bedrock's for an
# account its Marketplace subscription to Claude cannot bill (a 403
# AccessDeniedException, "Model access is denied due to
# INVALID_PAYMENT_INSTRUMENT:A valid payment instrument must be provided.").
_CREDIT_MESSAGES = (
    "credit balance is too low",
    "reached your specified api usage limits",
    "invalid_payment_instrument",
)

_TYPE_KINDS = {
    "invalid_request_error": FaultKind.BAD_REQUEST,
    "not_found_error": FaultKind.BAD_REQUEST,
    "request_too_large": FaultKind.BAD_REQUEST,
    "authentication_error": FaultKind.UNAUTHORIZED,
    "permission_error": FaultKind.UNAUTHORIZED,
    "billing_error": FaultKind.CREDIT_EXHAUSTED,
    "rate_limit_error": FaultKind.RATE_LIMITED,
    "timeout_error": FaultKind.TIMEOUT,
    "api_error": FaultKind.SERVER_ERROR,
    "overloaded_error": FaultKind.OVERLOADED,
    "conflict_error": FaultKind.SERVER_ERROR,
}

_STATUS_KINDS = {**STATUS_KINDS, 529: FaultKind.OVERLOADED}

# Bedrock's exceptions (lowercased: an HTTP error names them in
# ``x-amzn-errortype`` as ``ThrottlingException``, an exception frame inside
# an event stream as ``throttlingException``) and Vertex's Google statuses.
_PLATFORM_KINDS = {
    "throttlingexception": FaultKind.RATE_LIMITED,
    "servicequotaexceededexception": FaultKind.RATE_LIMITED,
    "serviceunavailableexception": FaultKind.OVERLOADED,
    "modelnotreadyexception": FaultKind.SERVER_ERROR,
    "internalserverexception": FaultKind.SERVER_ERROR,
    "modelstreamerrorexception": FaultKind.SERVER_ERROR,
    "modelerrorexception": FaultKind.SERVER_ERROR,
    "modeltimeoutexception": FaultKind.TIMEOUT,
    "validationexception": FaultKind.BAD_REQUEST,
    "resourcenotfoundexception": FaultKind.BAD_REQUEST,
    "accessdeniedexception": FaultKind.UNAUTHORIZED,
    "unrecognizedclientexception": FaultKind.UNAUTHORIZED,
    "invalidsignatureexception": FaultKind.UNAUTHORIZED,
    "expiredtokenexception": FaultKind.UNAUTHORIZED,
    "resource_exhausted": FaultKind.RATE_LIMITED,
    "permission_denied": FaultKind.UNAUTHORIZED,
    "unauthenticated": FaultKind.UNAUTHORIZED,
    "invalid_argument": FaultKind.BAD_REQUEST,
    "failed_precondition": FaultKind.BAD_REQUEST,
    "not_found": FaultKind.BAD_REQUEST,
    "deadline_exceeded": FaultKind.TIMEOUT,
    "unavailable": FaultKind.SERVER_ERROR,
    "internal": FaultKind.SERVER_ERROR,
}

# What the SDK raises for a request that failed: its own errors and the
# transport's (never the caller's cancellation, which propagates as it is).
_FAILURES = (anthropic.AnthropicError, httpx2.HTTPError)

_SDK = SDKErrors(status=anthropic.APIStatusError, timeout=anthropic.APITimeoutError,
                 connection=anthropic.APIConnectionError, base=anthropic.APIError,
                 validation=anthropic.APIResponseValidationError)


BEDROCK = "aws-bedrock"
"""The vendor (and default route) of a provider on an ``AsyncAnthropicBedrock`` client."""
VERTEX = "google-vertex"
"""The vendor (and default route) of a provider on an ``AsyncAnthropicVertex`` client."""

_ALL_FEATURES = frozenset({"thinking", "server_tools", "betas", "context_management"})

LONG_CONTEXT_BETA = "context-1m-"
"""The prefix of the betas that enable the 1M context window (``context-1m-2025-08-07``),
without which no request is billed the long-context rates (`AnthropicProvider.billing`)."""

# The Anthropic-defined tools a platform takes (by type prefix): the ones
# billed through their tokens only (the client runs them; tool search)
# everywhere, and web search on Vertex. Anthropic's hosted tools (web fetch,
# code execution, and web search on Bedrock) are not served there.
_PLATFORM_FEATURES = {
    BEDROCK: frozenset({"thinking", "betas", "context_management",
                        *(f"server_tools:{prefix}" for prefix in TOKEN_ONLY_TOOLS)}),
    VERTEX: frozenset({"thinking", "betas", "context_management",
                       *(f"server_tools:{prefix}"
                         for prefix in (*TOKEN_ONLY_TOOLS, "web_search_"))}),
}

# What each platform's client needs installed beyond the SDK: botocore decodes
# Bedrock's event streams (and, with boto3, signs requests); google-auth finds
# and refreshes Vertex credentials unless an access token is given.
_EXTRAS = {BEDROCK: ("bedrock", "botocore", "botocore"),
           VERTEX: ("vertex", "google.auth", "google-auth")}


def _require_extra(vendor: str, given: object) -> None:
    """Refuse a platform provider whose client would fail on its first request for
    want of a package: botocore for Bedrock (it decodes the event streams, and
    signs with boto3), google-auth for Vertex without an ``access_token`` or
    ``credentials``.

    Raises:
        ConfigError: the package is not installed.
    """
    if vendor not in _EXTRAS:
        return
    extra, module, package = _EXTRAS[vendor]
    if vendor == VERTEX:
        held = given if isinstance(given, dict) else vars(given)
        if held.get("access_token") is not None or held.get("credentials") is not None:
            return
    top = module.split(".")[0]
    if importlib.util.find_spec(top) is None or importlib.util.find_spec(module) is None:
        raise ConfigError("client", f"Claude on {vendor} needs {package}: "
                                    f"pip install 'loopengine-core[{extra}]'")


def _require_auth(client: AsyncClient) -> None:
    """Refuse an ``AsyncAnthropic`` client that has no way to authenticate: no
    ``api_key`` or ``auth_token`` (given, or from ``ANTHROPIC_API_KEY`` /
    ``ANTHROPIC_AUTH_TOKEN``), no ``credentials`` (given, from ``config`` or
    ``profile``, or found by the SDK's credential chain), and no ``X-Api-Key``
    or ``Authorization`` among its ``default_headers``. The SDK builds such a
    client, and raises a TypeError at each request; this says so when the
    provider is built, before any attempt is recorded. (The platform clients
    authenticate with AWS or Google credentials, found at request time.)

    Raises:
        ConfigError: ``api_key``: no authentication.
    """
    if not isinstance(client, anthropic.AsyncAnthropic):
        return
    if client.api_key or client.auth_token or getattr(client, "credentials", None) is not None:
        return
    headers = {name.lower() for name in client.default_headers}
    if headers & {"x-api-key", "authorization"}:
        return
    raise ConfigError("api_key", "no API key: pass api_key= (or auth_token=), set "
                                 "ANTHROPIC_API_KEY (or ANTHROPIC_AUTH_TOKEN), or give "
                                 "credentials=, config= or profile=")


def _vertex_geo(client: AsyncClient | None, client_kwargs: Mapping[str, Any]) -> str | None:
    """The region of a Vertex client's endpoint, as `Usage.inference_geo` keeps
    it: None for the global endpoint (the list rates), else the region or
    multi-region (``us-east5``, ``us``, ``eu``), which Google prices apart."""
    region = (getattr(client, "region", None) if client is not None else
              client_kwargs.get("region") or os.environ.get("CLOUD_ML_REGION"))
    return priced_geo(region)


def _vendor_of(kind: type[Any]) -> str:
    """The vendor of an SDK client class: the platform it reaches."""
    for client, vendor in ((anthropic.AsyncAnthropicBedrock, BEDROCK),
                           (anthropic.AsyncAnthropicVertex, VERTEX),
                           (anthropic.AsyncAnthropicFoundry, "foundry")):
        if issubclass(kind, client):
            return vendor
    return "anthropic"


class AnthropicProvider(SDKProvider[AsyncClient]):
    """The Anthropic Messages API as a `Provider`, through the ``anthropic`` SDK.

    Args:
        client: An ``anthropic.AsyncAnthropic`` (or ``AsyncAnthropicBedrock``,
            ``AsyncAnthropicVertex``) client. The provider uses a copy of it
            with ``max_retries=0`` and never closes it. Its connections belong
            to the event loop they were opened on, so the provider uses it on
            the first event loop that sends through it only: a request on any
            other loop (a second ``asyncio.run``) raises `ConfigError` before
            anything is sent.
        stream: Stream every response (server-sent events), also when
            nobody reads its text: a stream shows a stalled reply
            (``stream_idle_timeout``) and suits long outputs. Whatever it
            says, a request whose run reads the text (``on_text``,
            `loopengine.Engine.stream`) is streamed, its text deltas handed
            over as they arrive (docs/observability.md).
        stream_idle_timeout: Seconds a stream may go without an event before
            the attempt is aborted with reason ``idle`` (and retried).
        route: The route this provider serves (an operation's ``provider``),
            when one engine serves several of one vendor: two keys, two
            regions, a streaming and a plain client. Default: the vendor
            name. ``served_by`` and prices keep the vendor (``anthropic:<model>``).
        max_connections: Without ``client`` or ``http_client``: the most
            connections the provider's client (of each event loop) opens;
            default 1,000, the SDK's own. A request in flight holds a
            connection (HTTP/1.1), so a process with more conversations
            waiting on the model at once raises it, and its open-file limit
            with it. Every connection is kept alive between turns. The
            client is the SDK's aiohttp one on asyncio, and the SDK's own
            httpx one on trio or where the environment configures a proxy
            (docs/performance.md).
        **client_kwargs: Without ``client``: the keywords to build an
            ``AsyncAnthropic`` (``api_key``, ``base_url``, ``timeout``...).
            The provider builds one client per event loop that sends through
            it, so one provider (and one `loopengine.Engine`) serves
            consecutive ``asyncio.run`` calls, each on a client of its own;
            each loop's client is closed as that loop shuts down, or by
            `aclose` on that loop. An ``http_client`` among the keywords
            cannot be rebuilt per loop: the provider then builds one client
            on it, usable on the first event loop that sends only (as a
            ``client`` is), and closes it in `aclose`.

    Raises:
        ConfigError: both a client and client keywords, a synchronous client,
            ``max_retries`` other than 0, a bad ``stream_idle_timeout``, a
            ``max_connections`` that is not a positive integer or comes with
            a ``client`` or ``http_client``, a keyword ``AsyncAnthropic``
            does not take or of the wrong type (``.field`` names it), no
            way to authenticate (``api_key``: no key given, in
            ``ANTHROPIC_API_KEY`` or ``ANTHROPIC_AUTH_TOKEN``, nor
            ``credentials``, ``config`` or ``profile`` found), or credentials
            settings the SDK cannot load.

    Example::

        provider = AnthropicProvider(api_key=key)
        engine = loopengine.Engine(provider)
    """

    def __init__(
        self,
        client: AsyncClient | None = None,
        *,
        stream: bool = False,
        stream_idle_timeout: float = DEFAULT_STREAM_IDLE_TIMEOUT,
        route: str | None = None,
        max_connections: int | None = None,
        **client_kwargs: Any,
    ) -> None:
        self._setup(client, client_kwargs, anthropic.AsyncAnthropic, stream=stream,
                    stream_idle_timeout=stream_idle_timeout, route=route,
                    max_connections=max_connections)

    def _setup(self, client: AsyncClient | None, client_kwargs: dict[str, Any],
               build: type[AsyncClient], *, stream: bool, stream_idle_timeout: float,
               route: str | None, max_connections: int | None) -> Self:
        """Build the provider on ``client``, or on ``build`` clients made from
        ``client_kwargs``: the constructor's work, and `bedrock`'s and `vertex`'s."""
        self._settings(stream, stream_idle_timeout, route)
        vendor = _vendor_of(type(client) if client is not None else build)
        self._geo = _vertex_geo(client, client_kwargs) if vendor == VERTEX else None
        _require_extra(vendor, client if client is not None else client_kwargs)
        try:
            self._clients = provider_clients(
                "AnthropicProvider", client, client_kwargs, max_connections=max_connections,
                accepts=(anthropic.AsyncAnthropic, anthropic.AsyncAnthropicBedrock,
                         anthropic.AsyncAnthropicVertex),
                build=build, sdk_default=anthropic.DefaultAsyncHttpxClient)
        except ConfigError:
            raise
        except anthropic.AnthropicError as error:
            # A profile or credentials configuration the SDK cannot load.
            raise ConfigError("client", f"the anthropic SDK refused the client settings: "
                                        f"{error}") from None
        except ValueError as error:
            if build is anthropic.AsyncAnthropic:
                raise
            # The platform clients refuse a missing region or mixed credentials.
            raise ConfigError("client", f"{build.__name__}: {error}") from error
        _require_auth(self._clients.current())
        self._name_route(vendor)
        return self

    @classmethod
    def bedrock(
        cls,
        *,
        stream: bool = False,
        stream_idle_timeout: float = DEFAULT_STREAM_IDLE_TIMEOUT,
        route: str | None = None,
        max_connections: int | None = None,
        **client_kwargs: Any,
    ) -> AnthropicProvider:
        """Claude on Amazon Bedrock: a provider on ``anthropic.AsyncAnthropicBedrock``
        clients (extra ``bedrock``), one per event loop, as a provider built
        from keywords keeps them.

        Its vendor and default route are ``aws-bedrock``; an operation's
        ``model`` is the Bedrock model id or inference profile
        (``global.anthropic.claude-sonnet-4-5-20250929-v1:0``,
        ``us.anthropic...``), which also picks its price (docs/providers.md).

        Args:
            stream: As for the constructor.
            stream_idle_timeout: As for the constructor.
            route: The route, when not ``aws-bedrock``.
            max_connections: As for the constructor.
            **client_kwargs: ``AsyncAnthropicBedrock``'s keywords: ``aws_region``
                (else ``AWS_REGION`` / ``AWS_DEFAULT_REGION`` or the profile's),
                ``aws_access_key``, ``aws_secret_key``, ``aws_session_token``,
                ``aws_profile`` (else boto3's credential chain), or ``api_key``
                (a Bedrock API key, else ``AWS_BEARER_TOKEN_BEDROCK``),
                ``base_url``, ``timeout``...

        Raises:
            ConfigError: ``botocore`` is not installed (``pip install
                'loopengine-core[bedrock]'``), no region is known, both an API
                key and AWS credentials, or the constructor's reasons.
        """
        return cls.__new__(cls)._setup(None, client_kwargs, anthropic.AsyncAnthropicBedrock,
                                       stream=stream, stream_idle_timeout=stream_idle_timeout,
                                       route=route, max_connections=max_connections)

    @classmethod
    def vertex(
        cls,
        *,
        stream: bool = False,
        stream_idle_timeout: float = DEFAULT_STREAM_IDLE_TIMEOUT,
        route: str | None = None,
        max_connections: int | None = None,
        **client_kwargs: Any,
    ) -> AnthropicProvider:
        """Claude on Google Vertex AI: a provider on ``anthropic.AsyncAnthropicVertex``
        clients (extra ``vertex``), one per event loop, as a provider built
        from keywords keeps them.

        Its vendor and default route are ``google-vertex``; an operation's
        ``model`` is the Vertex model id (``claude-sonnet-4-5@20250929``).

        Args:
            stream: As for the constructor.
            stream_idle_timeout: As for the constructor.
            route: The route, when not ``google-vertex``.
            max_connections: As for the constructor.
            **client_kwargs: ``AsyncAnthropicVertex``'s keywords: ``region``
                (``global``, ``us-east5``...; else ``CLOUD_ML_REGION``),
                ``project_id`` (else ``ANTHROPIC_VERTEX_PROJECT_ID`` or the
                credentials' project), ``access_token`` or ``credentials``
                (else Application Default Credentials), ``base_url``,
                ``timeout``...

        Raises:
            ConfigError: neither an ``access_token`` nor ``credentials`` while
                ``google-auth`` is not installed (``pip install
                'loopengine-core[vertex]'``), no region, or the constructor's
                reasons.
        """
        return cls.__new__(cls)._setup(None, client_kwargs, anthropic.AsyncAnthropicVertex,
                                       stream=stream, stream_idle_timeout=stream_idle_timeout,
                                       route=route, max_connections=max_connections)

    @property
    def inference_geo(self) -> str | None:
        """On Vertex, the region of a regional or multi-region endpoint
        (``us-east5``, ``us``, ``eu``): Google prices those apart from the
        global endpoint, whose rates are the list's, and a reply does not
        say which it reached. None on the global endpoint, Anthropic and
        Bedrock (where the model id decides the price)."""
        return self._geo

    def billing(self, model: str, features: Features) -> Billing:
        """Long-context rates only where the request sends a 1M context beta
        (``context-1m-...``): the long-context rates (Claude Sonnet 4.5's past
        200,000 input tokens) are billed only with the 1M window enabled.
        Without it every sampling pass is within the standard window, and a
        server tool loop's usage, which adds its passes up (a web search
        loop's 400,000 input tokens), is priced at the standard rates
        (`Billing.long_context`); all else as the usage says
        (`Provider.billing`)."""
        return Billing(long_context=any(beta.startswith(LONG_CONTEXT_BETA)
                                        for beta in features.betas))

    @property
    def features(self) -> frozenset[str]:
        """The Messages API's optional request features (docs/providers.md), sent as
        the API takes them: ``thinking`` (``{"type": "enabled", "budget_tokens":
        N}``, or ``{"type": "adaptive"}`` with ``output_config.effort``), server
        tools as definitions in ``tools`` (before the run's own), betas as the
        ``anthropic-beta`` header (the Bedrock client moves them into the
        body's ``anthropic_beta``), ``context_management`` in the body. On
        Bedrock and Vertex, ``server_tools:<type prefix>`` entries name the
        Anthropic-defined tools the platform serves (the ones the client runs,
        and web search on Vertex): an operation with any other server tool is
        refused before anything is recorded. The vendor (`vendor`) is
        ``anthropic``, ``aws-bedrock``, ``google-vertex`` or ``foundry``."""
        return _PLATFORM_FEATURES.get(self._vendor, _ALL_FEATURES)

    def check_request(self, request: ProviderRequest) -> None:
        """Before an attempt is recorded: refuse a request the Messages API refuses.

        A thinking ``budget_tokens`` must be below the request's ``max_tokens``
        (unless an ``interleaved-thinking`` beta is on, where the budget spans
        the whole turn): the API answers such a request with a 400 every time.
        So it does a request whose messages hold ``tool_use`` or
        ``tool_result`` blocks and that defines no tools (a transcript with
        tool calls continued by a run given none), one defining a tool whose
        input schema the API refuses (`tool_schema_refusal`: ``anyOf`` at its
        root, a property named outside the API's pattern, as a pydantic field's
        alias with a space is),
        and, while thinking is on,
        one whose messages end with an assistant message (a prefill of the
        reply) that does not begin with a thinking block (`unthought_opening`;
        without thinking the prefill is sent).

        Raises:
            ProviderFault: ``bad_request``, ``error_code``
                ``invalid_request_error``: nothing is recorded or sent.
        """
        if tool_blocks_without_tools(request.messages,
                                     request.tools or request.features.server_tools):
            raise ProviderFault(
                FaultKind.BAD_REQUEST,
                f"{TOOL_BLOCKS_WITHOUT_TOOLS} The messages hold tool calls and the run "
                "gives no tools: give it the tools its transcript calls",
                error_code="invalid_request_error")
        refused = tool_schema_refusal(request.tools)
        if refused is not None:
            index, words, what = refused
            raise ProviderFault(
                FaultKind.BAD_REQUEST,
                f"tool {request.tools[index].get('name')!r}: {what}, which the Messages API "
                f"refuses ({words})", error_code="invalid_request_error")
        thinking = request.features.thinking
        if thinking is None:
            return
        if request.messages and unthought_opening(request.messages[-1]) is not None:
            raise ProviderFault(
                FaultKind.BAD_REQUEST,
                "the messages end with an assistant message (a prefill of the reply), which "
                "the Messages API refuses while thinking is on unless it begins with a "
                "thinking block: end with a user message, or run without thinking",
                error_code="invalid_request_error")
        if thinking.budget_tokens is None:
            return
        if thinking.budget_tokens < request.max_tokens or any(
                beta.startswith("interleaved-thinking") for beta in request.features.betas):
            return
        raise ProviderFault(
            FaultKind.BAD_REQUEST,
            f"thinking budget_tokens ({thinking.budget_tokens}) must be below max_tokens "
            f"({request.max_tokens}), as the Messages API requires: publish a "
            "max_output_tokens above the budget, or a lower budget",
            error_code="invalid_request_error")

    def _params(self, request: ProviderRequest, *, stream: bool) -> dict[str, Any]:
        # The SDK's stream() call asks for the stream itself.
        features = request.features
        # Server tools go first: a marker on the last tool then caches them too.
        # Markers are placed on every request, so the wire never carries more
        # than four whatever the caller marked (R12).
        system, tools, messages = place_cache_markers(
            request.cache, system=request.system,
            tools=[*(tool.definition for tool in features.server_tools), *request.tools],
            messages=_sendable(request.messages),
        )
        params: dict[str, Any] = {
            "model": request.model,
            "max_tokens": request.max_tokens,
            "messages": messages,
            "timeout": request.timeout,
        }
        if system:
            params["system"] = system
        if tools:
            params["tools"] = tools
        thinking = features.thinking
        if request.tool_choice is not None:
            params["tool_choice"] = _tool_choice(request.tool_choice, thinking=thinking is not None)
        if thinking is not None:
            if thinking.adaptive:
                params["thinking"] = {"type": "adaptive"}
                if thinking.effort is not None:
                    params["output_config"] = {"effort": thinking.effort}
            else:
                params["thinking"] = {"type": "enabled", "budget_tokens": thinking.budget_tokens}
        if features.betas:
            # The SDK's non-beta resource sends the header as given.
            params["extra_headers"] = {"anthropic-beta": ",".join(features.betas)}
        if features.context_management is not None:
            # Not a parameter of the SDK's non-beta resource: sent in the body as is.
            params["extra_body"] = {"context_management": dict(features.context_management)}
        if request.container is not None:
            # The run's code execution container: its files, and the one a
            # programmatic tool call's result must go back to.
            params["container"] = request.container
        return params

    async def send(self, request: ProviderRequest, *,
                   on_text: TextCallback | None = None) -> ProviderResponse:
        """Make one request within ``request.timeout`` (`SDKProvider.send`).

        Raises:
            ProviderFault: the request failed; every SDK error, and a platform
                client's failure to find its credentials, is classified.
            ConfigError: the client given to the provider belongs to another
                event loop than the running one; nothing was sent.
        """
        try:
            return await super().send(request, on_text=on_text)
        except ProviderFault:
            raise
        except Exception as error:
            # A platform client signs each request as it is made: what its
            # credentials raised is not an SDK error, and is classified here.
            fault = _credentials_fault(error)
            if fault is None:
                raise
            raise fault from error

    async def _send_plain(self, client: AsyncClient, params: dict[str, Any]) -> ProviderResponse:
        body, request_id, status = await json_body(
            client.messages.with_streaming_response.create, params, what="a message",
            valid=lambda body: isinstance(body.get("content"), list), classify=classify_error,
            failures=lambda: _FAILURES, request_id_of=_request_id)
        raw = body.get("usage")
        approx = False
        if isinstance(raw, Mapping):
            raw = dict(raw)
            approx = _split_writes(raw, params)
        model = text_or_none(body.get("model"))
        return _answer(body["content"], body.get("stop_reason"), usage_from_api(raw, model=model),
                       approx, response_id=text_or_none(body.get("id")), request_id=request_id,
                       http_status=status, model=model,
                       container=Container.from_json(body.get("container")))

    async def _send_streaming(
        self, client: AsyncClient, params: dict[str, Any], on_text: TextCallback | None
    ) -> ProviderResponse:
        try:
            manager = client.messages.stream(**params)
            stream = await manager.__aenter__()
        except _FAILURES as error:
            raise classify_error(error) from error
        request_id = _request_id(stream.response.headers)
        seen: set[str] = set()
        late: dict[str, Any] = {}
        inputs: dict[int, list[str]] = {}
        compacted: dict[int, dict[str, Any]] = {}

        def take(event: Any) -> str | None:
            seen.add(event.type)
            if event.type == "message_delta":
                late.update(event.usage.to_dict())
            elif event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                block = stream.current_message_snapshot.content[event.index]
                if block.type not in _SDK_INPUTS:
                    inputs.setdefault(event.index, []).append(event.delta.partial_json)
            elif event.type == "content_block_delta" and event.delta.type == "compaction_delta":
                # The SDK's accumulator drops it: the summary would be lost.
                delta = event.delta.to_dict()
                compacted[event.index] = {key: delta[key] for key in
                                          ("content", "encrypted_content") if key in delta}
            return event.text if event.type == "text" else None

        def message() -> Any:
            # The message so far, once the stream has announced one.
            return stream.current_message_snapshot if "message_start" in seen else None

        def served() -> tuple[Usage | None, str | None]:
            # What a stream that broke had served: its usage (a floor) and its id.
            snapshot = message()
            return (_snapshot_usage(snapshot, late, params)[0],
                    snapshot.id if snapshot is not None else None)

        await read_stream(
            stream, idle=self._idle, classify=classify_error, take=take, on_text=on_text,
            failures=(*_FAILURES, ValueError, RuntimeError, *_frame_errors(client)),
            close=stream.close,
            missing=lambda: None if "message_stop" in seen else "message_stop",
            http_status=stream.response.status_code, request_id=request_id, served=served)
        snapshot = message()
        assert snapshot is not None
        usage, approx = _snapshot_usage(snapshot, late, params)
        return _answer(_with_inputs([block.to_dict() for block in snapshot.content], inputs,
                                    compacted),
                       snapshot.stop_reason, usage, approx,
                       response_id=text_or_none(snapshot.id),
                       request_id=request_id, http_status=stream.response.status_code,
                       model=snapshot.model,
                       container=Container.from_json(
                           None if snapshot.container is None
                           else snapshot.container.to_dict(mode="json")))


def _answer(content: list[dict[str, Any]], stop_reason: object, usage: Usage | None,
            approx: bool, *, response_id: str | None, request_id: str | None,
            http_status: int, model: str | None,
            container: Container | None = None) -> ProviderResponse:
    """The response of a whole message (read as JSON or streamed), or the fault of
    one whose ``stop_reason`` is missing or not one of `STOP_REASONS`; ``approx``:
    its usage is a floor (`_split_writes`)."""
    check_end(stop_reason, STOP_REASONS, what="stop_reason", http_status=http_status,
              request_id=request_id, usage=usage, response_id=response_id, usage_approx=approx)
    return ProviderResponse(content=content, stop_reason=str(stop_reason), usage=usage,
                            usage_approx=approx, response_id=response_id,
                            request_id=request_id, http_status=http_status, model=model,
                            container=container)


def _sendable(messages: Sequence[Mapping[str, Any]]) -> Sequence[Mapping[str, Any]]:
    """``messages`` without the assistant replies that came back empty (Claude
    sometimes answers a tool result with nothing): the API refuses a message
    with empty content anywhere but as the final assistant message. The user
    turns around one are then sent one after the other, which the API takes
    as one turn. The transcript keeps the empty reply."""
    last = len(messages) - 1
    if all(message.get("content") or i == last for i, message in enumerate(messages)):
        return messages
    return [message for i, message in enumerate(messages)
            if message.get("content") or i == last or message.get("role") != "assistant"]


def _tool_choice(choice: Mapping[str, Any], *, thinking: bool) -> dict[str, Any]:
    """The ``tool_choice`` sent for a request's: as given, except that a choice
    forcing a tool (``any``, or a named ``tool``: a structured call's answer
    tool, a structured run's wrap-up) is sent as ``auto`` when thinking is on,
    since the API refuses thinking with a forced tool. The model then calls
    the answer tool or not; the engine's checks handle a reply that does not
    (a call's repair, a wrap-up's turn limit). ``disable_parallel_tool_use``
    is kept."""
    sent = dict(choice)
    if thinking and sent.get("type") in ("any", "tool"):
        sent = {"type": "auto", **({"disable_parallel_tool_use": sent["disable_parallel_tool_use"]}
                                   if "disable_parallel_tool_use" in sent else {})}
    return sent


# The blocks whose streamed ``input`` the SDK's accumulator fills itself; the
# provider joins the ``input_json_delta`` of any other (``mcp_tool_use``...).
_SDK_INPUTS = frozenset({"tool_use", "server_tool_use"})


def _with_inputs(content: list[dict[str, Any]], inputs: Mapping[int, list[str]],
                 compacted: Mapping[int, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``content`` with what the SDK's accumulator does not fill in: the streamed
    ``input`` of the blocks it does not track (an input that is not JSON is
    kept as the text sent, as a tool call's is), and a ``compaction`` block's
    ``content`` and ``encrypted_content``, which come in a ``compaction_delta``
    (each delta replaces them, as the SDK's beta accumulator reads it)."""
    for index, fields in compacted.items():
        content[index].update(fields)
    for index, parts in inputs.items():
        text = "".join(parts)
        try:
            content[index]["input"] = json.loads(text) if text else {}
        except ValueError:
            content[index]["input"] = text
    return content


def _snapshot_usage(snapshot: Any, late: Mapping[str, Any],
                    params: Mapping[str, Any]) -> tuple[Usage | None, bool]:
    """The usage of a streamed message so far, and whether it is a floor of the
    bill. ``late`` is the last ``message_delta``'s usage: the SDK's accumulator
    folds its counts into the snapshot but drops what it does not model
    (``iterations``), so keys the snapshot lacks are taken from it.

    The split of the cache writes by lifetime (``cache_creation``) comes only
    with ``message_start``; a ``message_delta`` has the cumulative
    ``cache_creation_input_tokens`` alone, which a server tool loop (more than
    one sampling pass) makes larger: `_split_writes` gives the writes past
    the split the lifetime of the markers of the request (``params``)."""
    if snapshot is None or getattr(snapshot, "usage", None) is None:
        return None, False
    raw = snapshot.usage.to_dict()
    for key, value in late.items():
        if raw.get(key) is None:
            raw[key] = value
    approx = _split_writes(raw, params)
    return usage_from_api(raw, model=snapshot.model), approx


def _split_writes(raw: dict[str, Any], params: Mapping[str, Any]) -> bool:
    """Give the cache writes of a ``usage`` (``raw``, changed in place) that its
    ``cache_creation`` split leaves out (a stream's ``message_delta`` counts
    more; a reply may have no split) the lifetime of the markers of the
    request (``params``): all of them one hour when every marker was, five minutes
    (`_tokens`' default) otherwise. True when the markers had both lifetimes:
    those writes' split is unknown, they are counted at the cheaper
    five-minute rate, and the usage is a floor of the bill. A reply with
    ``iterations`` is left alone: each iteration has its own split.

    The markers are read only for writes the split leaves out: that walks
    every block of the request, a cost a turn that grows with the transcript."""
    written = raw.get("cache_creation_input_tokens")
    if raw.get("iterations") or type(written) is not int:
        return False
    creation = raw.get("cache_creation")
    creation = creation if isinstance(creation, Mapping) else {}
    short, long = (creation.get(f"ephemeral_{ttl}_input_tokens") for ttl in ("5m", "1h"))
    short = short if type(short) is int else 0
    long = long if type(long) is int else 0
    if written <= short + long:
        return False
    lifetimes = marker_lifetimes(params)
    if lifetimes == {"1h"}:
        raw["cache_creation"] = {**creation, "ephemeral_5m_input_tokens": short,
                                 "ephemeral_1h_input_tokens": written - short}
        return False
    return "1h" in lifetimes


class _Tokens(TypedDict):
    input_tokens: int
    output_tokens: int
    cache_read_tokens: int
    cache_write_tokens: int
    cache_write_1h_tokens: int


def _tokens(raw: Mapping[str, Any]) -> _Tokens:
    """The token counts of a ``usage`` object or of one of its ``iterations``."""
    write = token_count(raw.get("cache_creation_input_tokens"))
    creation = raw.get("cache_creation")
    one_hour = 0
    if isinstance(creation, Mapping):
        five_minutes = token_count(creation.get("ephemeral_5m_input_tokens"))
        one_hour = token_count(creation.get("ephemeral_1h_input_tokens"))
        if write == 0:
            write = five_minutes + one_hour
    return {
        "input_tokens": token_count(raw.get("input_tokens")),
        "output_tokens": token_count(raw.get("output_tokens")),
        "cache_read_tokens": token_count(raw.get("cache_read_input_tokens")),
        "cache_write_tokens": write,
        "cache_write_1h_tokens": min(one_hour, write),
    }


@reported_usage
def usage_from_api(raw: object, *, model: str | None = None) -> Usage | None:
    """Map an Anthropic ``usage`` object (a dict) to `Usage`, all of it.

    ``input_tokens`` stays the uncached input (Anthropic's convention);
    ``cache_creation_input_tokens`` is the cache write, of which
    ``cache_creation.ephemeral_1h_input_tokens`` is the one-hour part.
    ``server_tool_use.web_search_requests`` / ``web_fetch_requests`` are the
    server tool requests (each billed a fee),
    ``output_tokens_details.thinking_tokens`` the ``reasoning_tokens`` (part of
    the output, priced as output), ``service_tier`` the tier that
    served the request, ``inference_geo`` where it ran and ``speed`` how fast,
    each kept when it changes the price (`priced_tier`, `priced_geo`,
    `priced_speed`: ``priority``, ``us``, ``fast``).

    When the reply reports ``iterations`` (compaction, an advisor, a server
    tool loop) the top-level token counts are not the bill (they leave out
    compaction and advisor iterations): the usage is built from the
    iterations (`Usage.from_iterations`), each keeping its ``model`` when it
    differs from ``model`` (the one that served the reply), so that it is
    priced at its own model. Missing or null counts are 0; a missing usage
    object is None.
    """
    if not isinstance(raw, Mapping):
        return None
    server = raw.get("server_tool_use")
    searches = fetches = 0
    if isinstance(server, Mapping):
        searches = token_count(server.get("web_search_requests"))
        fetches = token_count(server.get("web_fetch_requests"))
    details = raw.get("output_tokens_details")
    thinking = token_count(details.get("thinking_tokens")) if isinstance(details, Mapping) else 0
    tier = priced_tier(raw.get("service_tier"))
    geo = priced_geo(raw.get("inference_geo"))
    speed = priced_speed(raw.get("speed"))
    iterations = raw.get("iterations")
    if isinstance(iterations, list) and iterations:
        parts = tuple(_iteration(entry, model) for entry in iterations
                      if isinstance(entry, Mapping))
        return Usage.from_iterations(
            parts, web_search_requests=searches, web_fetch_requests=fetches,
            reasoning_tokens=min(thinking, sum(part.output_tokens for part in parts)),
            service_tier=tier, inference_geo=geo, speed=speed)
    tokens = _tokens(raw)
    return Usage(**tokens, web_search_requests=searches, web_fetch_requests=fetches,
                 reasoning_tokens=min(thinking, tokens["output_tokens"]),
                 service_tier=tier, inference_geo=geo, speed=speed)


def _iteration(raw: Mapping[str, Any], model: str | None) -> UsageIteration:
    own = text_or_none(raw.get("model"))
    return UsageIteration(type=text_or_none(raw.get("type")) or "message",
                          model=own if own and own != model else None, **_tokens(raw))


# -- classification: the one place SDK errors become faults ---------------------------------


def _status_fault(
    error: anthropic.APIStatusError,
    *,
    usage: Usage | None,
    response_id: str | None,
) -> ProviderFault:
    status = error.status_code
    body = error.body
    # The SDK reads type and api_message from the body's error; its error_code is
    # error.details.error_code, and the body's error.code stands in without one.
    error_type = error.type
    code = error.error_code or _nested(body, "error", "code")
    platform, reason, platform_message = _platform_error(error.response.headers, body)
    message = error.api_message or platform_message
    kind = _kind(status, error_type or platform, code or reason, message)
    # Vertex's own errors (a quota's RESOURCE_EXHAUSTED) name their wait in a
    # google.rpc.RetryInfo detail, as Gemini's do: it wins over retry-after.
    return response_fault(kind, status, error.response.headers, label=error_type or platform,
                          code=code or reason, message=message,
                          request_id=_request_id(error.response.headers), usage=usage,
                          response_id=response_id, details=google_details(body))


def _request_id(headers: Mapping[str, str]) -> str | None:
    """A response's request id: Anthropic's ``request-id`` (Vertex relays it),
    else Bedrock's ``x-amzn-requestid``."""
    return headers.get("request-id") or headers.get("x-amzn-requestid")


def _platform_error(headers: Mapping[str, str],
                    body: object) -> tuple[str | None, str | None, str]:
    """What a Bedrock or Vertex error response says in its own shape: its error
    name, a reason, and its message.

    Bedrock names the exception in ``x-amzn-errortype``
    (``ThrottlingException:http://internal.amazon.com/coral/...``) or the
    body's ``__type``, with ``{"message": ...}`` as the body. Vertex answers
    in Google's shape, ``{"error": {"code": 429, "status":
    "RESOURCE_EXHAUSTED", "message": ..., "details": [{"reason": ...}]}}``
    (sometimes inside a one-element list), when the error is Google's rather
    than the model's (an Anthropic-shaped body is read as usual).
    """
    details = google_details(body)
    if isinstance(body, list) and len(body) == 1:
        body = body[0]
    amazon = headers.get("x-amzn-errortype") or (
        _nested(body, "__type") if isinstance(body, Mapping) else None)
    if amazon:
        name = amazon.split(":")[0].rsplit("#", 1)[-1]
        return name, None, _nested(body, "message") or _nested(body, "Message") or ""
    google = _nested(body, "error", "status")
    if google:
        reasons = [d.get("reason") for d in details]
        reason = next((r for r in reasons if isinstance(r, str)), None)
        return google, reason, _nested(body, "error", "message") or ""
    return None, None, ""


def _nested(body: object, *keys: str) -> str | None:
    for key in keys:
        if not isinstance(body, Mapping):
            return None
        body = body.get(key)
    return body if isinstance(body, str) else None


def _kind(status: int, error_type: str | None, code: str | None, message: str) -> FaultKind:
    """The fault kind of an error response (or of a mid-stream error event, status 200).

    ``error_type`` is Anthropic's ``error.type``, else a platform's own error
    name (Bedrock's exception, Vertex's Google status), ``code`` the error
    code or a Google reason.
    """
    lowered = message.lower()
    if (
        status == 402
        or error_type == "billing_error"
        or is_credit_code(code)
        or code in BILLING_REASONS
        or any(fragment in lowered for fragment in _CREDIT_MESSAGES)
    ):
        return FaultKind.CREDIT_EXHAUSTED
    platform = _PLATFORM_KINDS.get((error_type or "").lower())
    if platform is not None:
        return platform
    if status == 200 or (status >= 500 and error_type == "overloaded_error"):
        # After a 200 only the event's type tells what went wrong; an unknown
        # type mid-stream is the server's failure.
        return _TYPE_KINDS.get(error_type or "", FaultKind.SERVER_ERROR)
    return status_kind(status, _STATUS_KINDS)


def classify_error(error: BaseException, *, request_id: str | None = None,
                   in_body: bool = False, usage: Usage | None = None,
                   response_id: str | None = None) -> ProviderFault:
    """Classify an SDK or transport error as one `ProviderFault` (the table in
    docs/architecture.md), a platform client's failure to find or refresh its
    credentials included (`_credentials_fault`)."""
    credentials = _credentials_fault(error)
    if credentials is not None:
        return credentials
    if isinstance(error, _frame_errors(None)):
        # A Bedrock event-stream frame that does not decode (a checksum or a
        # length that does not add up): the body is not a valid stream.
        return ProviderFault(FaultKind.SERVER_ERROR,
                             f"the event stream is not valid: {type(error).__name__}",
                             http_status=200, error_code="invalid_response",
                             request_id=request_id, usage=usage,
                             usage_approx=usage is not None, response_id=response_id)
    return classify_sdk_error(error, _SDK, status_fault=_status_fault, request_id=request_id,
                              in_body=in_body, usage=usage, response_id=response_id)


def _frame_errors(client: AsyncClient | None) -> tuple[type[BaseException], ...]:
    """What botocore's event-stream decoder raises for a frame that does not
    decode (``ChecksumMismatch``, ``InvalidPayloadLength``...), read from a
    Bedrock client's stream; none for another ``client``, nor while botocore
    is not loaded (no Bedrock stream could have raised it): it is never
    imported for the Messages API's own streams."""
    if client is not None and not isinstance(client, anthropic.AsyncAnthropicBedrock):
        return ()
    module = sys.modules.get("botocore.eventstream")
    if module is None and client is not None:
        module = importlib.import_module("botocore.eventstream")
    error = getattr(module, "ParserError", None)
    return (error,) if isinstance(error, type) and issubclass(error, BaseException) else ()


# What the SDK's Bedrock client raises when boto3's credential chain finds nothing.
_NO_AWS_CREDENTIALS = "could not resolve aws credentials"


def _credentials_fault(error: BaseException) -> ProviderFault | None:
    """The fault of a platform client that could not sign its request, or None.

    The SDK's platform clients find their credentials as each request is
    signed, before anything is sent, and raise what botocore and google-auth
    raise (a ``RuntimeError`` when boto3 finds no AWS credentials at all):
    none of it is an SDK error. Credentials that cannot be found or are
    refused (``DefaultCredentialsError``, ``NoCredentialsError``, a
    ``RefreshError`` the token endpoint refused) are ``unauthorized``, not
    retried; a token or credential endpoint that could not be reached (a
    google-auth ``TransportError`` or retryable ``RefreshError``, a botocore
    connection error while fetching credentials) is ``connection``, retried.
    The ``error_code`` is the exception's name.
    """
    name = type(error).__name__
    module = type(error).__module__
    if isinstance(error, RuntimeError) and _NO_AWS_CREDENTIALS in str(error).lower():
        kind = FaultKind.UNAUTHORIZED
        name = "NoCredentialsError"
    elif module.startswith("google.auth"):
        transient = name == "TransportError" or bool(getattr(error, "retryable", False))
        kind = FaultKind.CONNECTION if transient else FaultKind.UNAUTHORIZED
    elif module.startswith("botocore") and any(
            base.__name__ == "BotoCoreError" for base in type(error).__mro__):
        transient = any(base.__name__ in ("ConnectionError", "HTTPClientError")
                        for base in type(error).__mro__)
        kind = FaultKind.CONNECTION if transient else FaultKind.UNAUTHORIZED
    else:
        return None
    return ProviderFault(kind, f"the platform client could not sign the request: {name}: "
                               f"{error}", error_code=name)
