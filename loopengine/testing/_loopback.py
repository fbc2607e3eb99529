"""The machinery of a scripted model API on loopback: script items, recording,
usage counting and the HTTP plumbing.

`LoopbackServer` is a real HTTP/1.1 server on 127.0.0.1 (an ephemeral port)
that answers one path. Each request takes the next item of a script:

* `Reply` (the same class `ScriptedProvider` serves): a message with any
  content, stop reason and usage, after an optional delay;
* `ErrorReply`: an error status with an error body (or any body) and any
  headers;
* `DropConnection`: the connection is closed (or reset) without an answer;
* `CutStream`: the reply's stream ends after some events, either cleanly or
  by a dropped connection;
* `StreamErrorEvent`: the reply's stream sends an error event after some
  events, as an API does when it overloads mid-answer;
* `StallStream`: the reply's stream goes quiet for a while after some events;
* a callable taking the `RecordedRequest` and returning one of the above.

Every request is recorded (`LoopbackServer.requests`: method, path,
lowercased headers, parsed JSON body) and the usage the server put on the
wire is counted (`LoopbackServer.usage_served`), so a test can check an
attempt ledger against an independent witness. It uses only the standard
library: handlers run in threads, so the server works under any event loop.

A subclass gives the path and the shapes on the wire:
`loopengine.testing.FakeAnthropicServer` (Messages API) and
`loopengine.testing.FakeOpenAIServer` (Chat Completions).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import select
import socket
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Literal, Self

from loopengine import _validate
from loopengine._errors import ConfigError
from loopengine._usage import Usage
from loopengine.providers._scripted import Reply

__all__ = [
    "CutStream",
    "DropConnection",
    "ErrorReply",
    "Frame",
    "LoopbackServer",
    "RecordedRequest",
    "ServerItem",
    "StallStream",
    "StreamErrorEvent",
]

_STATUS_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class ErrorReply:
    """An error response: ``status`` with an error body in the server's API shape.

    `FakeAnthropicServer` sends ``{"type": "error", "error": {"type": ...,
    "message": ...}}`` (plus ``details.error_code`` when ``error_code`` is
    given); `loopengine.testing.FakeOpenAIServer` sends ``{"error":
    {"message": ..., "type": ..., "param": null, "code": ...}}``. ``body``
    replaces either (a dict is sent as JSON, a string as it is).
    """

    status: int
    """The HTTP status."""
    type: str | None = None
    """``error.type``; derived from the status when None (529: ``overloaded_error``)."""
    message: str = "scripted error"
    """``error.message``."""
    error_code: str | None = None
    """``error.details.error_code`` (e.g. ``enforced_spend_limit_reached``), or none."""
    body: Mapping[str, Any] | str | None = None
    """A whole body to send instead of the Anthropic-shaped one."""
    headers: Mapping[str, str] = field(default_factory=dict)
    """Extra response headers (``retry-after``, ``x-should-retry``...)."""
    delay: float = 0.0
    """Real seconds to wait before answering."""

    def __post_init__(self) -> None:
        _validate.integer("status", self.status, minimum=100, maximum=599)
        _validate.seconds("delay", self.delay, positive=False)

    @classmethod
    def overloaded(cls, **kwargs: Any) -> ErrorReply:
        """529 ``overloaded_error``."""
        return cls(status=529, message="Overloaded", **kwargs)

    @classmethod
    def rate_limited(cls, *, retry_after: float | None = None, **kwargs: Any) -> ErrorReply:
        """429 ``rate_limit_error``, with a ``retry-after`` header when given."""
        headers = dict(kwargs.pop("headers", {}))
        if retry_after is not None:
            headers["retry-after"] = f"{retry_after:g}"
        return cls(status=429, message="Number of request tokens has exceeded your rate limit.",
                   headers=headers, **kwargs)

    @classmethod
    def spend_limit(cls, **kwargs: Any) -> ErrorReply:
        """429 whose ``error_code`` says the organisation's spend limit is reached."""
        return cls(status=429, message="You have reached your spend limit.",
                   error_code="enforced_spend_limit_reached", **kwargs)

    @classmethod
    def credit_balance_too_low(cls, **kwargs: Any) -> ErrorReply:
        """Anthropic's 400 for a depleted prepaid balance."""
        return cls(status=400, message="Your credit balance is too low to access the Anthropic "
                   "API. Please go to Plans & Billing to upgrade or purchase credits.", **kwargs)

    @classmethod
    def insufficient_quota(cls, **kwargs: Any) -> ErrorReply:
        """OpenAI's 429 for a depleted quota (``insufficient_quota``), not a rate limit."""
        return cls(status=429, type="insufficient_quota", error_code="insufficient_quota",
                   message="You exceeded your current quota, please check your plan and "
                   "billing details.", **kwargs)

    def error_type(self) -> str:
        """The ``error.type`` `FakeAnthropicServer` sends."""
        if self.type is not None:
            return self.type
        if self.status in _STATUS_TYPES:
            return _STATUS_TYPES[self.status]
        return "api_error" if self.status >= 500 else "invalid_request_error"

    def given_body(self) -> bytes | None:
        """``body`` as the bytes to send (a dict as JSON, a string as it is), or None
        when the server's own error shape is to be sent."""
        if isinstance(self.body, str):
            return self.body.encode()
        if self.body is not None:
            return json.dumps(self.body).encode()
        return None

    def payload(self) -> bytes:
        """The response body `FakeAnthropicServer` sends."""
        given = self.given_body()
        if given is not None:
            return given
        error: dict[str, Any] = {"type": self.error_type(), "message": self.message}
        if self.error_code is not None:
            error["details"] = {"error_code": self.error_code}
        return json.dumps({"type": "error", "error": error}).encode()


@dataclass(frozen=True, slots=True, kw_only=True)
class DropConnection:
    """Close the connection without sending a response."""

    reset: bool = True
    """True sends a TCP reset; False closes the connection cleanly."""
    delay: float = 0.0
    """Real seconds to wait before dropping."""

    def __post_init__(self) -> None:
        _validate.boolean("reset", self.reset)
        _validate.seconds("delay", self.delay, positive=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class CutStream:
    """Serve ``reply`` but stop after ``after`` events.

    A streaming request gets the first ``after`` server-sent events of the
    reply (so never its ``message_stop``); a non-streaming request gets its
    status line, headers and half its body before the connection drops.
    """

    reply: Reply
    """The reply whose stream is cut."""
    after: int = 2
    """Events sent before the cut."""
    how: Literal["end", "drop"] = "end"
    """``end``: the body ends cleanly, as when a proxy gives up; ``drop``: the
    connection is closed mid-body."""

    def __post_init__(self) -> None:
        _check_cut(self.reply, self.after)
        if self.how not in ("end", "drop"):
            raise ConfigError("how", f"must be 'end' or 'drop', got {_validate.shown(self.how)}")


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamErrorEvent:
    """Serve ``reply`` but send an ``error`` event after ``after`` events.

    The response status is 200 (the error arrives inside the stream). A
    non-streaming request gets the HTTP error the type stands for instead
    (``overloaded_error``: 529).
    """

    reply: Reply
    """The reply that is interrupted."""
    after: int = 2
    """Events sent before the error event."""
    type: str = "overloaded_error"
    """``error.type`` of the event."""
    message: str = "Overloaded"
    """``error.message`` of the event."""
    data: Mapping[str, Any] | str | None = None
    """The event's payload as sent (a dict as JSON, a string as it is) instead of
    the server's error shape: an error chunk that also carries ``usage`` and an
    ``id``, as OpenRouter sends it. A non-streaming request still gets the HTTP
    error ``type`` stands for."""
    usage: Usage | None = None
    """The usage ``data`` reports, in the engine's convention: counted as served
    (`LoopbackServer.usage_served`) in place of what the events before it showed."""

    def __post_init__(self) -> None:
        _check_cut(self.reply, self.after)


@dataclass(frozen=True, slots=True, kw_only=True)
class StallStream:
    """Serve ``reply`` but go quiet for ``seconds`` after ``after`` events.

    Afterwards the rest of the stream is sent (a client that gave up meanwhile
    has closed the connection). A non-streaming request gets its status line,
    headers and half its body, then the same pause, then the rest: a reply
    whose body a client may be cut reading.
    """

    reply: Reply
    """The reply that stalls."""
    after: int = 2
    """Events sent before the pause."""
    seconds: float = 1.0
    """Real seconds of silence."""

    def __post_init__(self) -> None:
        _check_cut(self.reply, self.after)
        _validate.seconds("seconds", self.seconds, positive=False)


def tool_schema_problem(tools: object, schema_of: Callable[[Mapping[str, Any]], object],
                        message: Callable[[int, Mapping[str, Any], object], str],
                        ) -> str | None:
    """Why an API would refuse a request's ``tools``: one whose input schema
    does not say ``"type": "object"`` at its root (the Messages API and
    OpenAI's both refuse it), or None.

    ``schema_of`` reads a tool's input schema (None: not a function tool, a
    server tool say); ``message`` words the refusal as that API does, from the
    tool's index, the tool and the root ``type`` it has.
    """
    if not isinstance(tools, list):
        return None
    for index, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            continue
        schema = schema_of(tool)
        if schema is None:
            continue
        kind = schema.get("type") if isinstance(schema, Mapping) else None
        if kind != "object":
            return message(index, tool, kind)
    return None


def _check_cut(reply: object, after: object) -> None:
    """The reply a stream item interrupts, and how many events come first."""
    if not isinstance(reply, Reply):
        raise ConfigError("reply", f"must be a Reply, got {_validate.shown(reply)}")
    _validate.integer("after", after, minimum=0)


ServerItem = (
    Reply | ErrorReply | DropConnection | CutStream | StreamErrorEvent | StallStream
    | Callable[["RecordedRequest"], Any]
)
"""One script item: a response, a fault, or a function of the request giving one."""

_ITEM_TYPES = (Reply, ErrorReply, DropConnection, CutStream, StreamErrorEvent, StallStream)
"""The script items that are not functions of the request."""


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    """One request the server received."""

    method: str
    """``POST``, usually."""
    path: str
    """The request path, e.g. ``/v1/messages``."""
    headers: Mapping[str, str]
    """The request headers, keys lowercased."""
    body: Any
    """The parsed JSON body (None when it was not JSON)."""

    @property
    def stream(self) -> bool:
        """Whether the request asked for a streamed response."""
        return isinstance(self.body, Mapping) and self.body.get("stream") is True

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The ``messages`` of the body."""
        return list(self.body.get("messages", [])) if isinstance(self.body, Mapping) else []

    @property
    def timeout(self) -> float | None:
        """The client's request timeout in seconds, when the SDK sent one
        (``x-stainless-timeout``; the ``openai`` SDK's ``x-stainless-read-timeout``;
        the ``google-genai`` SDK's ``x-server-timeout``, whole seconds rounded up)."""
        value = self.headers.get("x-stainless-timeout", self.headers.get(
            "x-stainless-read-timeout", self.headers.get("x-server-timeout")))
        try:
            return float(value) if value is not None else None
        except ValueError:
            return None


class _Drop(Exception):
    """Raised inside a handler to abandon the connection without answering."""

    def __init__(self, reset: bool) -> None:
        super().__init__("connection dropped")
        self.reset = reset


@dataclass(frozen=True, slots=True)
class Frame:
    """One server-sent event on the wire, and the usage a client has seen once it
    has read this event (and every one before it), or None for none yet."""

    data: bytes
    """The encoded event."""
    usage: Usage | None
    """The usage the stream has reported up to and including this event."""


def _script(field: str, items: object) -> list[ServerItem]:
    """``items`` as a script, each checked to be a `ServerItem`: a junk item was
    found only when its request came, and broke that request's connection.

    Raises:
        ConfigError: not a list, or an item that no request could be served.
    """
    listed = _validate.items(field, items)
    for i, item in enumerate(listed):
        if not isinstance(item, _ITEM_TYPES) and not callable(item):
            raise ConfigError(f"{field}[{i}]", "must be a Reply, ErrorReply, DropConnection, "
                                               "CutStream, StreamErrorEvent, StallStream or a "
                                               "function of the request returning one, got "
                                               f"{_validate.shown(item)}")
        if not isinstance(item, _ITEM_TYPES):
            _validate.sync_callable(f"{field}[{i}]", item, "(request) -> item")
    return listed


class LoopbackServer:
    """The HTTP machinery and the script of a scripted model API on 127.0.0.1.

    A subclass says which path it serves and how a script item looks on its
    wire (`FakeAnthropicServer`, `loopengine.testing.FakeOpenAIServer`); this
    class serves the script, records every request and counts the usage put
    on the wire, the same way for every vendor.

    Args:
        script: Items to serve, one per request, in order (see `add`).
        host: The address to bind; loopback by default.

    Raises:
        ConfigError: a script item no request could be served, or a ``host``
            that is not a non-empty string (an empty one binds every
            interface, not loopback).
    """

    path = "/"
    """The one path the server answers (``POST``)."""
    request_id_header: str | None = "request-id"
    """The response header that carries the request id (None: the API sends none)."""
    stream_content_type = "text/event-stream"
    """The content type of a streamed response."""

    def __init__(self, script: Iterable[ServerItem] = (), *, host: str = "127.0.0.1") -> None:
        _validate.text("host", host)
        self._host = host
        self._lock = threading.Lock()
        self._items: Iterator[ServerItem] = iter(_script("script", script))
        self._requests: list[RecordedRequest] = []
        self._served: list[Usage | None] = []
        self._ids = itertools.count(1)
        self._stopping = threading.Event()
        self._connections: set[socket.socket] = set()
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> Self:
        """Bind an ephemeral port and serve in a background thread."""
        if self._httpd is not None:
            raise RuntimeError("the server is already started")
        self._stopping.clear()
        self._httpd = _HTTPServer((self._host, 0), _Handler, self)
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        kwargs={"poll_interval": 0.01},
                                        name=type(self).__name__, daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving, drop open connections and wait for the handlers to end."""
        httpd, thread = self._httpd, self._thread
        if httpd is None:
            return
        self._stopping.set()
        httpd.shutdown()
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            # Idle keep-alive connections would otherwise hold their handler
            # thread (and so `server_close`) until the client closes them.
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        httpd.server_close()
        if thread is not None:
            thread.join()
        self._httpd = self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- the script ------------------------------------------------------------

    @property
    def url(self) -> str:
        """The base URL to give the client, e.g. ``http://127.0.0.1:49152``."""
        if self._httpd is None:
            raise RuntimeError("the server is not started")
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def add(self, *items: ServerItem) -> None:
        """Append items to the script, served one per request in order."""
        checked = _script("items", items)
        with self._lock:
            self._items = itertools.chain(self._items, checked)

    @property
    def requests(self) -> list[RecordedRequest]:
        """Every request received so far, in arrival order."""
        with self._lock:
            return list(self._requests)

    @property
    def usage_served(self) -> Usage:
        """The usage the server put on the wire, summed over every response.

        A complete reply counts its usage; a cut or interrupted stream counts
        what its events had reported when it stopped (for the Messages API,
        the input and cache tokens of ``message_start`` and the output tokens
        sent so far); errors and dropped connections count nothing.
        """
        with self._lock:
            total = Usage()
            for usage in self._served:
                if usage is not None:
                    total = total + usage
            return total

    @property
    def responses_served(self) -> int:
        """How many responses carried usage (complete, cut or interrupted replies)."""
        with self._lock:
            return sum(1 for usage in self._served if usage is not None)

    # -- serving (handler threads) ------------------------------------------------

    def _next_item(self, request: RecordedRequest, *, consume: bool) -> tuple[int, Any]:
        with self._lock:
            self._requests.append(request)
            number = len(self._requests)
            item = next(self._items, None) if consume else None
        return number, item

    def _count(self, usage: Usage | None) -> int | None:
        """Count ``usage`` as served; return its index (to correct it later)."""
        if usage is None:
            return None
        with self._lock:
            self._served.append(usage)
            return len(self._served) - 1

    def _recount(self, index: int | None, usage: Usage | None) -> None:
        if index is not None:
            with self._lock:
                self._served[index] = usage

    def _deliver(self, handler: _Handler, usage: Usage | None, data: bytes, *,
                 index: int | None = None) -> int | None:
        """Write ``data``, counting ``usage`` as served first.

        Counting before the write matters: the client may read the response
        and the test check `usage_served` before this thread runs again. A
        write that fails takes the count back.
        """
        if handler.peer_gone():
            # The client gave up during a delay; a write could still succeed
            # into the socket buffer, but nobody would read it.
            raise _Drop(reset=False)
        if index is None:
            previous, index = None, self._count(usage)
        else:
            with self._lock:
                previous = self._served[index]
            self._recount(index, usage)
        try:
            handler.write(data)
        except OSError:
            self._recount(index, previous)
            raise
        return index

    def _wait(self, seconds: float) -> None:
        """Sleep, but wake at once when the server stops."""
        if seconds > 0 and self._stopping.wait(seconds):
            raise _Drop(reset=False)

    def _handle(self, handler: _Handler) -> None:
        length = int(handler.headers.get("content-length") or 0)
        raw = handler.rfile.read(length) if length else b""
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = None
        request = RecordedRequest(
            method=handler.command,
            path=handler.path,
            headers={k.lower(): v for k, v in handler.headers.items()},
            body=body,
        )
        served = self._serves(handler.path.split("?")[0]) and handler.command == "POST"
        # Requests the real API refuses are refused here too, before the script.
        problem = self._refusal(body) if served else None
        number, item = self._next_item(request, consume=served and problem is None)
        if not served:
            item = ErrorReply(status=404, message=f"{handler.command} {handler.path} is not "
                              f"served by this fake (only POST {self.path})")
        elif problem is not None:
            item = ErrorReply(status=400, message=problem)
        if callable(item) and not isinstance(item, _ITEM_TYPES):
            item = self._ask(item, request, number)
        if item is None:
            item = ErrorReply(status=400, message=f"the script has no reply for request {number}")
        self._serve(handler, item, request, number)

    @staticmethod
    def _ask(function: Callable[[RecordedRequest], Any], request: RecordedRequest,
             number: int) -> ServerItem:
        """The item a script function gives for ``request``.

        A function that raises, or returns something no request can be served,
        is the test's own bug: the client gets a 400 saying so (a permanent
        fault, not retried) rather than a dropped connection that the SDK
        retries into the next script item.
        """
        try:
            item = function(request)
        except BaseException as error:  # pytest.fail() and pytest.skip() too
            return ErrorReply(status=400, message=f"the script's function for request "
                                                  f"{number} raised {type(error).__name__}: "
                                                  f"{error}")
        if not isinstance(item, _ITEM_TYPES):
            return ErrorReply(status=400, message=f"the script's function for request "
                                                  f"{number} returned {_validate.shown(item)}, "
                                                  "not a script item")
        return item

    def _serve(self, handler: _Handler, item: Any, request: RecordedRequest, number: int) -> None:
        ids = ({self.request_id_header: f"req_fake_{number:04d}"}
               if self.request_id_header else {})
        if isinstance(item, ErrorReply):
            self._wait(item.delay)
            handler.send_bytes(item.status, self._error_body(item), "application/json",
                               {**ids, **self._error_headers(item), **item.headers})
            return
        if isinstance(item, DropConnection):
            self._wait(item.delay)
            raise _Drop(reset=item.reset)
        streamed = self._streamed(request)
        if isinstance(item, StreamErrorEvent) and not streamed:
            self._serve(handler, ErrorReply(status=self._error_status(item.type),
                                            type=item.type, message=item.message),
                        request, number)
            return
        if isinstance(item, Reply):
            reply, mode, after = item, "full", 0
        elif isinstance(item, CutStream):
            reply, mode, after = item.reply, item.how, item.after
        elif isinstance(item, StreamErrorEvent):
            reply, mode, after = item.reply, "error", item.after
        elif isinstance(item, StallStream):
            reply, mode, after = item.reply, "stall", item.after
        else:
            raise TypeError(f"not a script item: {item!r}")
        self._wait(reply.delay)
        message = self._message(reply, request, number)
        if not streamed:
            payload = json.dumps(message).encode()
            if mode == "stall":
                # The status and headers, half the body; the rest after the pause.
                head = handler.head(200, "application/json", {
                    **ids, "content-length": str(len(payload))})
                half = len(payload) // 2
                self._deliver(handler, None, head + payload[:half])
                self._wait(item.seconds)
                self._deliver(handler, self._served_usage(reply.usage, request),
                              payload[half:])
                return
            if mode in ("end", "drop"):
                # The status and headers promise the whole body; half arrives.
                handler.send_head(200, "application/json", {**ids,
                                                            "content-length": str(len(payload))})
                handler.write(payload[: len(payload) // 2])
                raise _Drop(reset=False)
            head = handler.head(200, "application/json", {
                **ids, "content-length": str(len(payload))})
            self._deliver(handler, self._served_usage(reply.usage, request), head + payload)
            return
        frames = self._frames(message, reply, request)
        head = handler.head(200, self.stream_content_type, {**ids,
                                                            "transfer-encoding": "chunked",
                                                       "cache-control": "no-cache"})
        cut = len(frames) if mode == "full" else min(after, len(frames))
        sent = frames[:cut]
        index = self._deliver(handler, sent[-1].usage if sent else None,
                              head + _chunk(b"".join(frame.data for frame in sent)))
        if mode in ("full", "end"):
            handler.end_chunks()
        elif mode == "drop":
            raise _Drop(reset=False)
        elif mode == "error":
            if item.data is None:
                handler.write_chunk(self._error_event(item.type, item.message, request))
            else:
                self._deliver(handler, item.usage, _chunk(self._raw_event(item.data)),
                              index=index)
            handler.end_chunks()
        else:  # stall
            self._wait(item.seconds)
            rest = b"".join(frame.data for frame in frames[cut:])
            # Still listening: the client sees the whole reply.
            self._deliver(handler, frames[-1].usage if frames else None, _chunk(rest),
                          index=index)
            handler.end_chunks()

    # -- what a subclass says about its wire ------------------------------------------

    def _serves(self, path: str) -> bool:
        """Whether ``path`` (without its query) is the API's."""
        return path == self.path

    def _refusal(self, body: Any) -> str | None:
        """Why the real API would refuse this request body (a 400), or None."""
        return None

    def _streamed(self, request: RecordedRequest) -> bool:
        """Whether ``request`` asked for a streamed response (default: its body's
        ``"stream": true``)."""
        return request.stream

    def _error_headers(self, item: ErrorReply) -> dict[str, str]:
        """Headers an error response carries besides the request id and the item's own."""
        return {}

    def _error_body(self, item: ErrorReply) -> bytes:
        """The body of an error response."""
        raise NotImplementedError

    def _error_status(self, error_type: str) -> int:
        """The HTTP status a non-streaming request gets for a `StreamErrorEvent`."""
        raise NotImplementedError

    def _error_event(self, error_type: str, message: str, request: RecordedRequest) -> bytes:
        """The server-sent event of an error inside the stream answering ``request``."""
        raise NotImplementedError

    def _raw_event(self, data: Mapping[str, Any] | str) -> bytes:
        """A server-sent event of ``data`` as given (`StreamErrorEvent.data`)."""
        text = data if isinstance(data, str) else json.dumps(data)
        return f"data: {text}\n\n".encode()

    def _message(self, reply: Reply, request: RecordedRequest, number: int) -> dict[str, Any]:
        """The JSON body of ``reply``."""
        raise NotImplementedError

    def _frames(self, message: dict[str, Any], reply: Reply,
                request: RecordedRequest) -> list[Frame]:
        """The server-sent events of ``message``, in order."""
        raise NotImplementedError

    def _served_usage(self, usage: Usage | None, request: RecordedRequest) -> Usage | None:
        """The usage a client reads from a whole JSON reply scripted with ``usage``
        (answering ``request``)."""
        return usage


def _chunk(data: bytes) -> bytes:
    """``data`` as one chunk of a chunked body (nothing for no data: an empty
    chunk would end the body)."""
    return f"{len(data):x}\r\n".encode() + data + b"\r\n" if data else b""


# -- the HTTP plumbing ---------------------------------------------------------------------


class _HTTPServer(ThreadingHTTPServer):
    # socketserver's default backlog of 5 resets connections as soon as a few
    # dozen clients connect at once; the kernel caps this at its own limit.
    request_queue_size = 1024
    # A server that is never closed must not keep the interpreter from
    # exiting: handler threads are daemons. socketserver joins only non-daemon
    # threads, so `server_close` joins them itself, and a closed server never
    # leaves one behind.
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[_Handler],
                 owner: LoopbackServer) -> None:
        self.owner = owner
        self._handlers: set[threading.Thread] = set()
        self._handlers_lock = threading.Lock()
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        thread = threading.Thread(target=self.process_request_thread,
                                  args=(request, client_address),
                                  name=f"{type(self.owner).__name__} handler",
                                  daemon=True)
        with self._handlers_lock:
            self._handlers.add(thread)
        try:
            thread.start()
        except BaseException:
            with self._handlers_lock:
                self._handlers.discard(thread)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._handlers_lock:
                self._handlers.discard(threading.current_thread())

    def server_close(self) -> None:
        super().server_close()
        with self._handlers_lock:
            handlers = list(self._handlers)
        for thread in handlers:
            thread.join()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _HTTPServer

    def setup(self) -> None:
        super().setup()
        # Streamed events are small writes: without this, Nagle's algorithm and
        # delayed acknowledgements add tens of milliseconds per response.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self.server.owner._lock:
            self.server.owner._connections.add(self.connection)

    def finish(self) -> None:
        with self.server.owner._lock:
            self.server.owner._connections.discard(self.connection)
        with contextlib.suppress(OSError):
            super().finish()

    def handle(self) -> None:
        try:
            super().handle()
        except _Drop as drop:
            # Outside `handle_one_request`, which would flush the closed file.
            self._drop(drop.reset)
        except OSError:
            # The client went away (it timed out or gave up on a stalled stream).
            pass

    def _drop(self, reset: bool) -> None:
        with contextlib.suppress(OSError):
            if reset:
                # SO_LINGER with a zero timeout makes close() send a reset.
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                           struct.pack("ii", 1, 0))
            else:
                self.connection.shutdown(socket.SHUT_RDWR)
        # The socket closes for real only once its file objects are closed.
        for stream in (self.rfile, self.wfile, self.connection):
            with contextlib.suppress(OSError):
                stream.close()

    def do_POST(self) -> None:  # noqa: N802 - the name http.server dispatches to
        self.server.owner._handle(self)

    def do_GET(self) -> None:  # noqa: N802
        self.server.owner._handle(self)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - base signature
        """Stay quiet: tests read the recorded requests, not a log."""

    def head(self, status: int, content_type: str, headers: Mapping[str, str]) -> bytes:
        """The status line and headers, as bytes to write with the first data."""
        lines = [f"{self.protocol_version} {status} {self.responses.get(status, ('',))[0]}",
                 f"server: {self.version_string()}", f"date: {self.date_time_string()}",
                 f"content-type: {content_type}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def send_head(self, status: int, content_type: str, headers: Mapping[str, str]) -> None:
        self.write(self.head(status, content_type, headers))

    def send_bytes(self, status: int, payload: bytes, content_type: str,
                   headers: Mapping[str, str]) -> None:
        self.send_head(status, content_type, {**headers, "content-length": str(len(payload))})
        self.write(payload)

    def peer_gone(self) -> bool:
        """Whether the client has closed its end (a write would still succeed once)."""
        # poll, not select: select cannot watch a descriptor past 1023, and a
        # server under a few thousand connections has those.
        poller = select.poll()
        poller.register(self.connection, select.POLLIN)
        if not poller.poll(0):
            return False
        try:
            return bool(self.connection.recv(1, socket.MSG_PEEK) == b"")
        except OSError:
            return True

    def write(self, data: bytes) -> None:
        self.wfile.write(data)
        self.wfile.flush()

    def write_chunk(self, data: bytes) -> None:
        self.write(_chunk(data))

    def end_chunks(self) -> None:
        self.write(b"0\r\n\r\n")
