"""`FakeBedrockServer` and `FakeVertexServer`: Claude's Messages API as Amazon
Bedrock and Google Vertex AI serve it, on loopback, scripted, for tests.

Both are `FakeAnthropicServer` with the platform's paths, request ids, error
shapes and (for Bedrock) stream framing: the message, its events and the
usage on the wire are the Messages API's own, rendered by the same code.

* Bedrock answers ``POST /model/{model}/invoke`` in JSON and
  ``/model/{model}/invoke-with-response-stream`` in AWS event-stream binary
  framing (``application/vnd.amazon.eventstream``): each Messages API event
  is one ``chunk`` event whose JSON payload's ``bytes`` is the base64 of the
  event's JSON. An error is ``{"message": ...}`` with its exception named in
  ``x-amzn-errortype``; an error inside a stream is an ``exception`` frame.
* Vertex answers ``POST /v1/projects/{project}/locations/{region}/publishers/
  anthropic/models/{model}:rawPredict`` in JSON and ``:streamRawPredict`` in
  server-sent events. A model's error is relayed in the Messages API's shape;
  an error of Google's own (a quota, a permission) is ``{"error": {"code",
  "message", "status", "details"}}``.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import struct
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote

from loopengine.testing._anthropic_server import FakeAnthropicServer
from loopengine.testing._google_errors import google_error
from loopengine.testing._loopback import ErrorReply, RecordedRequest

__all__ = ["FakeBedrockServer", "FakeVertexServer", "event_stream_message", "model_of"]

_BEDROCK_PATH = re.compile(
    r"/model/(?P<model>[^/]+)/(?P<action>invoke|invoke-with-response-stream)")

# The exception Bedrock names for a status, when the script names none.
_BEDROCK_EXCEPTIONS = {
    400: "ValidationException",
    401: "UnrecognizedClientException",
    403: "AccessDeniedException",
    404: "ResourceNotFoundException",
    408: "ModelTimeoutException",
    424: "ModelErrorException",
    429: "ThrottlingException",
    500: "InternalServerException",
    503: "ServiceUnavailableException",
    529: "ServiceUnavailableException",
}

# The exception frame inside a stream for a Messages API error type; the
# model's own overload reaches a Bedrock stream as a model stream error.
_STREAM_EXCEPTIONS = {
    "overloaded_error": "modelStreamErrorException",
    "rate_limit_error": "throttlingException",
    "api_error": "internalServerException",
    "invalid_request_error": "validationException",
    "timeout_error": "modelTimeoutException",
}

_VERTEX_PATH = re.compile(
    r"/v1/projects/[^/]+/locations/[^/]+/publishers/anthropic/models/"
    r"(?P<model>[^/:]+):(?P<action>rawPredict|streamRawPredict)")


def _header(name: str, value: str) -> bytes:
    """One event-stream header of type string (7)."""
    raw_name, raw_value = name.encode(), value.encode()
    return (struct.pack("!B", len(raw_name)) + raw_name + struct.pack("!BH", 7, len(raw_value))
            + raw_value)


def event_stream_message(headers: Mapping[str, str], payload: bytes) -> bytes:
    """One message of the AWS event-stream encoding (``application/vnd.amazon.eventstream``).

    The prelude is the total length and the headers' length (big-endian
    uint32 each) and the CRC32 of those eight bytes; then the headers (each a
    name length byte, the name, the type 7 for a string, a uint16 length and
    the value), the payload, and the CRC32 of everything before it.
    """
    encoded = b"".join(_header(name, value) for name, value in headers.items())
    total = 12 + len(encoded) + len(payload) + 4
    prelude = struct.pack("!II", total, len(encoded))
    prelude += struct.pack("!I", binascii.crc32(prelude) & 0xFFFFFFFF)
    message = prelude + encoded + payload
    return message + struct.pack("!I", binascii.crc32(message) & 0xFFFFFFFF)


class FakeBedrockServer(FakeAnthropicServer):
    """A scripted Claude on Amazon Bedrock (``InvokeModel`` and
    ``InvokeModelWithResponseStream``) on 127.0.0.1, for tests.

    Point an ``AsyncAnthropicBedrock`` client (or `AnthropicProvider.bedrock`)
    at `url`, with any AWS credentials (the signature is not checked)::

        with FakeBedrockServer() as server:
            server.add(Reply.text("Hello"))
            provider = AnthropicProvider.bedrock(
                base_url=server.url, aws_region="us-east-1",
                aws_access_key="AKIDEXAMPLE", aws_secret_key="secret")

    It takes `FakeAnthropicServer`'s script items. An `ErrorReply` is sent as
    Bedrock sends errors: ``{"message": ...}`` (or its own ``body``), its
    exception in ``x-amzn-errortype``: its ``type`` when that names one
    (``ErrorReply(status=429, type="ThrottlingException")``), else the one
    Bedrock sends for the status (429 ``ThrottlingException``, 503
    ``ServiceUnavailableException``, 403 ``AccessDeniedException``...). A
    `StreamErrorEvent` is an exception frame inside the event stream: its
    ``type`` when it names one (``throttlingException``), else Bedrock's for
    the Messages API type (``overloaded_error`` is a
    ``modelStreamErrorException``). The recorded request's body carries no
    ``model``: Bedrock takes it in the path.
    """

    path = "/model/{model}/invoke"
    request_id_header = "x-amzn-requestid"
    stream_content_type = "application/vnd.amazon.eventstream"

    def _serves(self, path: str) -> bool:
        return _BEDROCK_PATH.fullmatch(path) is not None

    def _streamed(self, request: RecordedRequest) -> bool:
        match = _BEDROCK_PATH.fullmatch(request.path.split("?")[0])
        return match is not None and match["action"] == "invoke-with-response-stream"

    def _model(self, request: RecordedRequest) -> str | None:
        return model_of(request)

    def _error_body(self, item: ErrorReply) -> bytes:
        if isinstance(item.body, str):
            return item.body.encode()
        body = item.body if item.body is not None else {"message": item.message}
        return json.dumps(body).encode()

    def _error_headers(self, item: ErrorReply) -> dict[str, str]:
        name = item.type if item.type and item.type[0].isupper() else _BEDROCK_EXCEPTIONS.get(
            item.status, "InternalServerException" if item.status >= 500
            else "ValidationException")
        return {"x-amzn-errortype":
                f"{name}:http://internal.amazon.com/coral/com.amazon.bedrock/"}

    def _error_status(self, error_type: str) -> int:
        return 503 if error_type == "overloaded_error" else super()._error_status(error_type)

    def _error_event(self, error_type: str, message: str, request: RecordedRequest) -> bytes:
        name = error_type if error_type.endswith("Exception") else _STREAM_EXCEPTIONS.get(
            error_type, "internalServerException")
        payload: dict[str, Any] = {"message": message}
        if name == "modelStreamErrorException":
            payload |= {"originalStatusCode": 529, "originalMessage": message}
        return event_stream_message({":message-type": "exception", ":exception-type": name,
                                     ":content-type": "application/json"},
                                    json.dumps(payload).encode())

    def _event(self, name: str, data: Mapping[str, Any]) -> bytes:
        chunk = base64.b64encode(json.dumps(data).encode()).decode()
        return event_stream_message({":event-type": "chunk", ":content-type": "application/json",
                                     ":message-type": "event"},
                                    json.dumps({"bytes": chunk}).encode())


class FakeVertexServer(FakeAnthropicServer):
    """A scripted Claude on Google Vertex AI (``rawPredict`` and
    ``streamRawPredict``) on 127.0.0.1, for tests.

    Point an ``AsyncAnthropicVertex`` client (or `AnthropicProvider.vertex`)
    at `base_url` with an ``access_token`` (so no Google credentials are
    looked up)::

        with FakeVertexServer() as server:
            server.add(Reply.text("Hello"))
            provider = AnthropicProvider.vertex(
                base_url=server.base_url, region="global", project_id="my-project",
                access_token="test-token")

    It takes `FakeAnthropicServer`'s script items. An `ErrorReply` whose
    ``type`` is a Google status (``RESOURCE_EXHAUSTED``,
    ``PERMISSION_DENIED``...) is sent in Google's shape, its ``error_code``
    as the reason of a ``google.rpc.ErrorInfo`` detail (``BILLING_DISABLED``);
    any other is the Messages API's error, as Vertex relays the model's.
    `quota_exceeded` is Vertex's quota 429 with its ``RetryInfo`` detail. The
    recorded request's body carries no ``model``: Vertex takes it in the path.
    """

    path = ("/v1/projects/{project}/locations/{region}/publishers/anthropic/models/"
            "{model}:rawPredict")

    @staticmethod
    def quota_exceeded(retry_delay: str = "45s", **kwargs: Any) -> ErrorReply:
        """Vertex AI's own 429 ``RESOURCE_EXHAUSTED`` for a per-minute quota of a
        base model, with its ``QuotaFailure`` and its ``RetryInfo.retryDelay``."""
        return ErrorReply(status=429, body={"error": google_error(
            429, "RESOURCE_EXHAUSTED",
            "Quota exceeded for aiplatform.googleapis.com/"
            "online_prediction_input_tokens_per_minute_per_base_model with base model: "
            "anthropic-claude-sonnet-4-5. Please submit a quota increase request.",
            quota=("aiplatform.googleapis.com/"
                   "online_prediction_input_tokens_per_minute_per_base_model",
                   "OnlinePredictionInputTokensPerMinutePerProjectPerBaseModel"),
            retry_delay=retry_delay)}, **kwargs)

    @property
    def base_url(self) -> str:
        """The ``base_url`` to give the client: `url` plus ``/v1``."""
        return f"{self.url}/v1"

    def _serves(self, path: str) -> bool:
        return _VERTEX_PATH.fullmatch(path) is not None

    def _model(self, request: RecordedRequest) -> str | None:
        return model_of(request)

    def _error_body(self, item: ErrorReply) -> bytes:
        status = item.type
        if item.body is not None or status is None or not status.isupper():
            return super()._error_body(item)
        return json.dumps({"error": google_error(item.status, status, item.message,
                                                 reason=item.error_code)}).encode()


def model_of(request: RecordedRequest) -> str | None:
    """The model a request to a platform names: Bedrock's and Vertex's in the path
    (``/model/{model}/invoke``, ``.../models/{model}:rawPredict``), else the
    body's ``model``."""
    path = request.path.split("?")[0]
    for pattern in (_BEDROCK_PATH, _VERTEX_PATH):
        match = pattern.fullmatch(path)
        if match is not None:
            return unquote(match["model"])
    model = request.body.get("model") if isinstance(request.body, Mapping) else None
    return model if isinstance(model, str) else None
