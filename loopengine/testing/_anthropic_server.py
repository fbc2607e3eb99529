"""`FakeAnthropicServer`: the Messages API on loopback, scripted, for tests.

It answers ``POST /v1/messages`` in JSON or, when the request asks for
``"stream": true``, in server-sent events shaped like Anthropic's, from the
script items of `loopengine.testing._loopback` (which serves the script,
records every request and counts the usage put on the wire). This module is
the Anthropic wire format alone: the path, the error bodies and statuses,
the message and its events.

A request the API refuses gets the API's 400 without taking a script item:
one whose ``cache_control`` markers it refuses (more than four, a one-hour
marker after a five-minute one), one with thinking whose ``tool_choice``
forces a tool (``any`` or a named ``tool``), or whose final assistant
message (a prefill, a continuation, or the one whose calls the last user
message's tool results answer) does not begin with a thinking block,
one with a message whose content is empty (but for a final assistant
message), one whose ``container`` is not a live container of the server, or
one answering a programmatic tool call (a ``tool_use`` with a ``caller``
other than ``direct``) without its ``container``, or one sending back a
``thinking`` block whose ``signature`` the server did not issue for that
text, or a ``redacted_thinking`` block whose ``data`` it did not issue
(``messages.1.content.0: Invalid `signature` in `thinking` block``), or one
defining a tool whose ``input_schema`` has ``oneOf``, ``allOf`` or ``anyOf``
at its root, or names a property there that the API's pattern refuses
(``^[a-zA-Z0-9_.-]{1,64}$``: a space, an ``@``, a name of 65 characters).

The server signs the thinking it serves, as the API does: a scripted
``thinking`` block without a ``signature`` is served with one the server
issued for its text (an HMAC under the server's key, `thinking_signature`),
and a ``redacted_thinking`` block without ``data`` with data the server
issued; a signature or data the script gives is served as it is (and
refused when it comes back, unless the server issued it).

A reply to a request with a code execution tool, or with a ``container``,
names its container (``container``: ``id``, ``expires_at``), as the API's
does: a new one the first time, valid for `container_lifetime` from `now`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from loopengine import _validate
from loopengine._errors import ConfigError
from loopengine._usage import Usage, UsageIteration
from loopengine.providers._cache import cache_marker_problem
from loopengine.providers._messages_api import (
    TOOL_BLOCKS_WITHOUT_TOOLS,
    tool_blocks_without_tools,
    tool_schema_refusal,
    unthought_opening,
)
from loopengine.providers._scripted import Reply
from loopengine.testing._loopback import (
    ErrorReply,
    Frame,
    LoopbackServer,
    RecordedRequest,
    ServerItem,
    tool_schema_problem,
)

__all__ = ["FakeAnthropicServer"]

_TYPE_STATUS = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "billing_error": 402,
    "permission_error": 403,
    "not_found_error": 404,
    "rate_limit_error": 429,
    "api_error": 500,
    "timeout_error": 504,
    "overloaded_error": 529,
}


class FakeAnthropicServer(LoopbackServer):
    """A scripted Messages API on 127.0.0.1, for tests.

    Use it as a context manager (or call `start` and `close`); point an
    ``anthropic`` client at `url`::

        with FakeAnthropicServer() as server:
            server.add(Reply.text("Hello"))
            provider = AnthropicProvider(api_key="test", base_url=server.url)
            ...
            assert server.requests[0].body["model"] == "claude-sonnet-4-5"

    Args:
        script: Items to serve, one per request, in order (see `add`).
        host: The address to bind; loopback by default.
        signing_key: The key of the thinking signatures it issues and checks;
            a new random one when None. Servers given the same key take each
            other's signatures, as one API does (a run resumed in another
            process, against another fake).

    Raises:
        ConfigError: a ``signing_key`` that is not bytes.

    When the script runs out, requests get a 400 ``invalid_request_error``
    saying so: a permanent fault, so a test that sends more than it scripted
    fails clearly instead of retrying.

    It takes bursts of hundreds of simultaneous connections (a listen backlog
    of 1024). Each connection is served by a daemon thread, so a server that
    is never closed does not keep the interpreter from exiting; `close` waits
    for those threads to end.
    """

    path = "/v1/messages"
    request_id_header = "request-id"

    def __init__(self, script: Iterable[ServerItem] = (), *, host: str = "127.0.0.1",
                 signing_key: bytes | None = None) -> None:
        super().__init__(script, host=host)
        if signing_key is not None and not isinstance(signing_key, bytes):
            raise ConfigError("signing_key", f"must be bytes or None, got "
                                             f"{_validate.shown(signing_key)}")
        self._key = signing_key if signing_key is not None else secrets.token_bytes(32)
        self.containers: dict[str, datetime] = {}
        """The code execution containers the server made: their expiry, by id."""
        self.now: Callable[[], datetime] = lambda: datetime.now(UTC)
        """The server's clock for containers (a test may give it its fake clock's wall)."""
        self.container_lifetime = timedelta(hours=1)
        """How long a container lives after the last request that used it."""

    def thinking_signature(self, thinking: str) -> str:
        """The ``signature`` this server gives a ``thinking`` block of that text (and
        takes back with it): a scripted thinking block without one is served with it."""
        mac = hmac.new(self._key, b"thinking\0" + thinking.encode(), hashlib.sha256)
        return base64.b64encode(mac.digest()).decode()

    def redacted_data(self) -> str:
        """New ``data`` for a ``redacted_thinking`` block, which this server takes back
        (a scripted redacted block without ``data`` is served with it)."""
        nonce = secrets.token_bytes(16)
        mac = hmac.new(self._key, b"redacted\0" + nonce, hashlib.sha256).digest()
        return base64.b64encode(nonce + mac).decode()

    def _issued(self, block: Mapping[str, Any]) -> bool:
        """Whether the server issued a thinking block as it is sent back: its
        ``signature`` (of its text as served) or its redacted ``data``."""
        if block.get("type") == "thinking":
            signature, thinking = block.get("signature"), block.get("thinking")
            # As bytes: compare_digest takes no str that is not ASCII.
            return (isinstance(signature, str) and isinstance(thinking, str)
                    and hmac.compare_digest(signature.encode(),
                                            self.thinking_signature(thinking).encode()))
        data = block.get("data")
        try:
            raw = base64.b64decode(data, validate=True) if isinstance(data, str) else b""
        except ValueError:
            return False
        nonce, mac = raw[:16], raw[16:]
        return len(nonce) == 16 and hmac.compare_digest(
            mac, hmac.new(self._key, b"redacted\0" + nonce, hashlib.sha256).digest())

    def _signature_problem(self, body: Any) -> str | None:
        """Why the API would refuse ``body``'s thinking blocks, or None: a ``thinking``
        block whose signature it did not issue for that text (a signature from
        elsewhere, or the text altered), or a ``redacted_thinking`` block whose
        ``data`` it did not issue."""
        messages = body.get("messages") if isinstance(body, Mapping) else None
        for i, message in enumerate(messages if isinstance(messages, list) else ()):
            content = message.get("content") if isinstance(message, Mapping) else None
            if not isinstance(content, list) or message.get("role") != "assistant":
                continue
            for j, block in enumerate(content):
                kind = block.get("type") if isinstance(block, Mapping) else None
                if kind in ("thinking", "redacted_thinking") and not self._issued(block):
                    field = "signature" if kind == "thinking" else "data"
                    return f"messages.{i}.content.{j}: Invalid `{field}` in `{kind}` block"
        return None

    def _refusal(self, body: Any) -> str | None:
        problem = (cache_marker_problem(body) or _thinking_problem(body)
                   or self._signature_problem(body)
                   or _empty_problem(body) or _pairing_problem(body)
                   or self._container_problem(body))
        if problem is None and isinstance(body, Mapping) and tool_blocks_without_tools(
                body.get("messages"), body.get("tools")):
            problem = TOOL_BLOCKS_WITHOUT_TOOLS
        refused = tool_schema_refusal(body.get("tools")) if isinstance(body, Mapping) else None
        if problem is None and refused is not None:
            problem = refused[1]
        return problem or tool_schema_problem(
            body.get("tools") if isinstance(body, Mapping) else None,
            lambda tool: tool.get("input_schema") if "input_schema" in tool else None,
            lambda index, tool, kind: f"tools.{index}.custom.input_schema.type: "
                                      + ("Field required" if kind is None
                                         else "Input should be 'object'"))

    def _container_problem(self, body: Any) -> str | None:
        """Why the API would refuse a request's ``container``, or None: one it does
        not know or that expired, or none with a programmatic tool call's result."""
        if not isinstance(body, Mapping):
            return None
        ident = _container_id(body.get("container"))
        if ident is not None:
            expires = self.containers.get(ident)
            if expires is None:
                return f"container {ident!r} not found"
            if expires <= self.now():
                return f"container {ident!r} has expired"
            return None
        messages = body.get("messages")
        last = messages[-2] if isinstance(messages, list) and len(messages) > 1 else None
        content = last.get("content") if isinstance(last, Mapping) else None
        for block in content if isinstance(content, list) else ():
            caller = block.get("caller") if isinstance(block, Mapping) else None
            if (block.get("type") == "tool_use" and isinstance(caller, Mapping)
                    and caller.get("type") not in (None, "direct")):
                return ("container_id is required when there are pending tool uses "
                        "generated by code execution with tools.")
        return None

    def _container(self, body: Any) -> dict[str, str] | None:
        """The container a reply to ``body`` names (made, or kept alive), or None."""
        if not isinstance(body, Mapping):
            return None
        ident = _container_id(body.get("container"))
        tools = body.get("tools")
        if ident is None and not any(
                isinstance(t, Mapping) and str(t.get("type", "")).startswith("code_execution_")
                for t in (tools if isinstance(tools, list) else ())):
            return None
        if ident is None:
            ident = f"container_fake_{len(self.containers) + 1:04d}"
        expires = self.containers[ident] = self.now() + self.container_lifetime
        return {"id": ident, "expires_at": expires.isoformat().replace("+00:00", "Z")}

    def _error_body(self, item: ErrorReply) -> bytes:
        return item.payload()

    def _error_status(self, error_type: str) -> int:
        return _TYPE_STATUS.get(error_type, 500)

    def _error_event(self, error_type: str, message: str, request: RecordedRequest) -> bytes:
        return _sse("error", {"type": "error", "error": {"type": error_type,
                                                         "message": message}})

    def _raw_event(self, data: Mapping[str, Any] | str) -> bytes:
        # The Messages API names each event: a raw payload is sent as an error event.
        if isinstance(data, str):
            return f"event: error\ndata: {data}\n\n".encode()
        return _sse("error", data)

    def _message(self, reply: Reply, request: RecordedRequest, number: int) -> dict[str, Any]:
        message = _message(reply, self._model(request), number)
        for block in message["content"]:
            # As the API does, the server signs the thinking it serves; a
            # signature (or data) the script gives is served as it is.
            if block.get("type") == "thinking" and "signature" not in block:
                block["signature"] = self.thinking_signature(str(block.get("thinking", "")))
            elif block.get("type") == "redacted_thinking" and "data" not in block:
                block["data"] = self.redacted_data()
        container = self._container(request.body)
        if container is not None:
            message["container"] = container
        return message

    def _frames(self, message: dict[str, Any], reply: Reply,
                request: RecordedRequest) -> list[Frame]:
        events = _events(message, reply.usage)
        return [Frame(self._event(name, data), seen)
                for (name, data), seen in zip(events, _usage_seen(events, reply.usage),
                                              strict=True)]

    def _model(self, request: RecordedRequest) -> str | None:
        """The model a request names (the body's ``model``)."""
        model = request.body.get("model") if isinstance(request.body, Mapping) else None
        return model if isinstance(model, str) else None

    def _event(self, name: str, data: Mapping[str, Any]) -> bytes:
        """One event of a streamed message on the wire (a server-sent event)."""
        return _sse(name, data)


def _container_id(value: object) -> str | None:
    """A request's ``container``: an id, or ``{"id": ...}`` (with skills)."""
    if isinstance(value, Mapping):
        value = value.get("id")
    return value if isinstance(value, str) else None


def _thinking_problem(body: Any) -> str | None:
    """Why the API would refuse a request's thinking, or None: thinking with a
    ``tool_choice`` that forces a tool, which the API never takes, or with a
    final assistant message (a prefill) that does not begin with a thinking
    block."""
    if not isinstance(body, Mapping):
        return None
    thinking, choice = body.get("thinking"), body.get("tool_choice")
    if not isinstance(thinking, Mapping) or thinking.get("type") == "disabled":
        return None
    if isinstance(choice, Mapping) and choice.get("type") in ("any", "tool"):
        return "Thinking may not be enabled when tool_choice forces tool use."
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    # The final assistant message: a prefill, or the one whose calls the last
    # user message answers (the lastmost set of tool_use and tool_result blocks).
    index = len(messages) - 1
    if _answers_calls(messages[index]) and index > 0:
        index -= 1
    kind = unthought_opening(messages[index])
    if kind is not None:
        return (f"messages.{index}.content.0.type: Expected `thinking` or "
                f"`redacted_thinking`, but found `{kind}`. When `thinking` is enabled, "
                "a final `assistant` message must start with a thinking block "
                "(preceeding the lastmost set of `tool_use` and `tool_result` blocks).")
    return None


def _answers_calls(message: object) -> bool:
    """Whether ``message`` is a user message holding ``tool_result`` blocks."""
    content = message.get("content") if isinstance(message, Mapping) else None
    return (isinstance(message, Mapping) and message.get("role") == "user"
            and isinstance(content, list) and any(
                isinstance(b, Mapping) and b.get("type") == "tool_result" for b in content))


def _pairing_problem(body: Any) -> str | None:
    """Why the API would refuse a request's tool calls and results, or None, in its
    words: a ``tool_use`` block (of any assistant message but the final one)
    whose id no ``tool_result`` of the next message answers, or a
    ``tool_result`` whose ``tool_use_id`` no ``tool_use`` of the previous
    message has."""
    messages = body.get("messages") if isinstance(body, Mapping) else None
    if not isinstance(messages, list):
        return None
    asked: list[str] = []  # the previous message's calls
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, Mapping) else None
        content = message.get("content") if isinstance(message, Mapping) else None
        blocks = [b for b in content if isinstance(b, Mapping)] if isinstance(
            content, list) else []
        for j, block in enumerate(blocks if role == "user" else ()):
            if block.get("type") == "tool_result" and block.get("tool_use_id") not in asked:
                return (f"messages.{i}.content.{j}: unexpected `tool_use_id` found in "
                        f"`tool_result` blocks: {block.get('tool_use_id')}. Each "
                        "`tool_result` block must have a corresponding `tool_use` block "
                        "in the previous message.")
        answered = {b.get("tool_use_id") for b in blocks if b.get("type") == "tool_result"}
        missing = [call for call in asked if call not in answered or role != "user"]
        if missing:
            return (f"messages.{i - 1}: `tool_use` ids were found without `tool_result` "
                    f"blocks immediately after: {', '.join(missing)}. Each `tool_use` "
                    "block must have a corresponding `tool_result` block in the next "
                    "message.")
        asked = [str(b.get("id")) for b in blocks
                 if b.get("type") == "tool_use"] if role == "assistant" else []
    return None


def _empty_problem(body: Any) -> str | None:
    """Why the API would refuse a request's messages, or None: one whose content
    is empty, anywhere but as the final assistant message."""
    messages = body.get("messages") if isinstance(body, Mapping) else None
    if not isinstance(messages, list):
        return None
    for i, message in enumerate(messages):
        final = i == len(messages) - 1 and isinstance(message, Mapping) and (
            message.get("role") == "assistant")
        if isinstance(message, Mapping) and message.get("content") in ("", []) and not final:
            return (f"messages.{i}: all messages must have non-empty content except for "
                    "the optional final assistant message")
    return None


# -- wire shapes ---------------------------------------------------------------------


def _tokens_json(usage: Usage | UsageIteration) -> dict[str, Any]:
    return {
        "input_tokens": usage.input_tokens,
        "output_tokens": usage.output_tokens,
        "cache_creation_input_tokens": usage.cache_write_tokens,
        "cache_read_input_tokens": usage.cache_read_tokens,
        "cache_creation": {
            "ephemeral_5m_input_tokens": usage.cache_write_5m_tokens,
            "ephemeral_1h_input_tokens": usage.cache_write_1h_tokens,
        },
    }


def _top(usage: Usage) -> Usage:
    """The tokens the API puts at the top level of ``usage``: with iterations,
    the ``message`` iterations only."""
    if not usage.iterations:
        return usage
    return sum((i.tokens() for i in usage.iterations if i.type == "message"), Usage())


def _usage_json(usage: Usage | None) -> dict[str, Any] | None:
    """``usage`` as the API reports it. With iterations, the top level is what
    the API puts there: the ``message`` iterations only (compaction and
    advisor passes are billed but appear only in ``iterations``), so a client
    that reads the top level under-counts, as it would against the API."""
    if usage is None:
        return None
    body = _tokens_json(_top(usage))
    if usage.web_search_requests or usage.web_fetch_requests:
        body["server_tool_use"] = {"web_search_requests": usage.web_search_requests,
                                   "web_fetch_requests": usage.web_fetch_requests}
    body["service_tier"] = usage.service_tier or "standard"
    # Every reply names where and how fast it ran, as the API's usage does.
    body["inference_geo"] = usage.inference_geo or "global"
    body["speed"] = usage.speed or "standard"
    if usage.iterations:
        body["iterations"] = [
            {**_tokens_json(i), "type": i.type, **({"model": i.model} if i.model else {})}
            for i in usage.iterations]
    return body


def _message(reply: Reply, model: str | None, number: int) -> dict[str, Any]:
    message: dict[str, Any] = {
        "id": reply.response_id or f"msg_fake_{number:04d}",
        "type": "message",
        "role": "assistant",
        "model": model or "claude-fake",
        "content": [dict(block) for block in reply.content],
        "stop_reason": reply.stop_reason,
        "stop_sequence": None,
    }
    usage = _usage_json(reply.usage)
    if usage is not None:
        message["usage"] = usage
    return message


_WORDS = re.compile(r"\s*\S+\s*|\s+")


def _events(message: Mapping[str, Any], usage: Usage | None) -> list[tuple[str, dict[str, Any]]]:
    """The server-sent events of a message, as the API streams it."""
    # The container comes with message_delta, as the API streams it.
    start = {**{k: v for k, v in message.items() if k != "container"}, "content": [],
             "stop_reason": None}
    upfront = _usage_json(usage)
    if usage is not None and upfront is not None:
        # The API reports input and cache tokens up front and the output
        # tokens so far (a token or so); message_delta carries the final count.
        start["usage"] = {**{k: v for k, v in upfront.items()
                             if k not in ("iterations", "server_tool_use")},
                          "output_tokens": min(1, usage.output_tokens)}
    events: list[tuple[str, dict[str, Any]]] = [("message_start",
                                                  {"type": "message_start", "message": start})]
    for index, block in enumerate(message["content"]):
        kind = block.get("type")
        if kind == "text":
            events.append(_block_start(index, {**block, "text": ""}))
            for piece in _WORDS.findall(str(block.get("text", ""))):
                events.append(_delta(index, {"type": "text_delta", "text": piece}))
        elif kind in ("tool_use", "server_tool_use", "mcp_tool_use"):
            events.append(_block_start(index, {**block, "input": {}}))
            events.append(_delta(index, {"type": "input_json_delta",
                                         "partial_json": json.dumps(block.get("input", {}))}))
        elif kind == "thinking":
            events.append(_block_start(index, {**block, "thinking": "", "signature": ""}))
            events.append(_delta(index, {"type": "thinking_delta",
                                         "thinking": block.get("thinking", "")}))
            events.append(_delta(index, {"type": "signature_delta",
                                         "signature": block.get("signature", "")}))
        elif kind == "compaction":
            # The summary comes in a compaction_delta, as the API streams it.
            carried = {key: block[key] for key in ("content", "encrypted_content")
                       if key in block}
            events.append(_block_start(index, {**block, **dict.fromkeys(carried)}))
            events.append(_delta(index, {"type": "compaction_delta", **carried}))
        else:
            events.append(_block_start(index, dict(block)))
        events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
    delta: dict[str, Any] = {
        "type": "message_delta",
        "delta": {"stop_reason": message.get("stop_reason"), "stop_sequence": None,
                  **({"container": message["container"]} if "container" in message else {})},
        "usage": _delta_usage(usage),
    }
    events.append(("message_delta", delta))
    events.append(("message_stop", {"type": "message_stop"}))
    return events


def _delta_usage(usage: Usage | None) -> dict[str, Any]:
    """A ``message_delta``'s usage: the final output count and, as the API
    sends them there, the server tool counts and the iterations."""
    whole = _usage_json(usage)
    if whole is None:
        return {"output_tokens": 0}
    body = {"output_tokens": whole["output_tokens"]}
    for key in ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens",
                "server_tool_use", "iterations"):
        if key in whole and (key != "input_tokens" or "iterations" in whole):
            body[key] = whole[key]
    return body


def _block_start(index: int, block: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    return ("content_block_start",
            {"type": "content_block_start", "index": index, "content_block": dict(block)})


def _delta(index: int, delta: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    return ("content_block_delta", {"type": "content_block_delta", "index": index,
                                    "delta": dict(delta)})


def _sse(name: str, data: Mapping[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


def _usage_seen(events: Sequence[tuple[str, Mapping[str, Any]]],
                usage: Usage | None) -> list[Usage | None]:
    """The usage a client has seen after each of ``events``: the input and cache
    tokens of ``message_start`` and the output tokens reported so far."""
    if usage is None or not events or events[0][0] != "message_start":
        return [None] * len(events)
    output = min(1, usage.output_tokens)
    top = _top(usage)
    seen: list[Usage | None] = []
    whole = False
    for name, data in events:
        if name == "message_delta":
            output = int(data["usage"]["output_tokens"])
            # The rest of the vector (iterations, server tool use) arrives here.
            whole = True
        seen.append(usage if whole else Usage(
            input_tokens=top.input_tokens,
            output_tokens=output,
            cache_read_tokens=top.cache_read_tokens,
            cache_write_tokens=top.cache_write_tokens,
            cache_write_1h_tokens=top.cache_write_1h_tokens,
            service_tier=usage.service_tier,
            inference_geo=usage.inference_geo,
            speed=usage.speed,
        ))
    return seen
