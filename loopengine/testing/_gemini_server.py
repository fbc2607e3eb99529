"""`FakeGeminiServer`: the Gemini API on loopback, scripted, for tests.

A real HTTP/1.1 server on 127.0.0.1 that answers ``POST
/v1beta/models/{model}:generateContent`` (and ``/v1/...``, the SDK's default
version) in JSON and
``:streamGenerateContent?alt=sse`` in server-sent events (each event a whole
``GenerateContentResponse``, its ``usageMetadata`` cumulative), and the same
methods under Vertex AI's ``/v1beta1/projects/{p}/locations/{l}/publishers/
google/models/{model}`` (``v1beta1`` or ``v1``; without the project and
location in Vertex AI's express mode). It takes the same script items as
`FakeAnthropicServer` (it is the same `LoopbackServer`), in Gemini's shapes
(camelCase, as the API sends them):

* `Reply`: its text blocks are ``text`` parts, its ``tool_use`` blocks
  ``functionCall`` parts (``id``, ``name``, ``args``); a ``thinking`` block
  with text is a thought part (``thought: true``), and one with a
  ``signature`` puts that signature (base64) as the ``thoughtSignature`` of
  the part it stands for (its own, or, when its text is empty, the next part
  of the reply; an empty text part at the end when none follows). Its stop
  reason is the ``finishReason``: ``end_turn`` and ``tool_use`` -> ``STOP``,
  ``max_tokens`` and ``model_context_window_exceeded`` -> ``MAX_TOKENS``,
  ``refusal`` -> ``SAFETY``, any other value
  as it is (``PROHIBITED_CONTENT``, ``RECITATION``...). A stop reason
  ``MALFORMED_FUNCTION_CALL`` (or ``UNEXPECTED_TOOL_CALL``) sends a candidate
  without content whose ``finishMessage`` is ``"Malformed function call: "``
  and the reply's text; a stop reason ``blocked:<REASON>`` sends no candidate
  and ``promptFeedback.blockReason`` ``<REASON>`` (a prompt blocked before
  generation). The usage is ``promptTokenCount`` (uncached input and cache
  reads), ``cachedContentTokenCount`` (the cache reads),
  ``candidatesTokenCount`` (output that is not reasoning) and
  ``thoughtsTokenCount`` (the reasoning);
* `ErrorReply`: ``{"error": {"code", "message", "status", "details"}}`` with
  its status and headers: ``type`` is the canonical ``status`` (derived from
  the HTTP status when not given: 429 ``RESOURCE_EXHAUSTED``, 503
  ``UNAVAILABLE``...), ``error_code`` an ``ErrorInfo`` detail's ``reason``;
  or its own ``body``. `quota_exceeded`, `billing_disabled` and
  `credits_depleted` build the API's own;
* `StreamErrorEvent`: a ``data: {"error": {...}}`` event inside the stream
  after some chunks (a non-streaming request gets the status its type
  stands for);
* `CutStream`, `StallStream`, `DropConnection`, delays, callables: as for
  `FakeAnthropicServer`. A stream ends with the chunk that carries the
  ``finishReason``: cutting it before leaves that out.

The API sends no request id header, nor does the fake. A request whose
``contents`` the API refuses (function responses that do not answer the
function calls of the model turn before them, one for one; a function call of
the current turn sent back without the thought signature the server sent it
with, which Gemini 3 refuses) gets the API's 400 without taking a script item.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from loopengine._usage import Usage
from loopengine.providers._scripted import Reply
from loopengine.testing._google_errors import google_error
from loopengine.testing._loopback import (
    ErrorReply,
    Frame,
    LoopbackServer,
    RecordedRequest,
    ServerItem,
)
from loopengine.testing._sent_back import Served, call_sent_back_without, current_turn

__all__ = ["FakeGeminiServer", "contents_problem", "signature_of"]

_STATUS_NAMES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    408: "DEADLINE_EXCEEDED",
    409: "ABORTED",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}

_TYPE_STATUS = {
    "INVALID_ARGUMENT": 400,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "RESOURCE_EXHAUSTED": 429,
    "INTERNAL": 500,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
    "overloaded_error": 503,
}

_FINISH_REASONS = {
    "end_turn": "STOP",
    "stop_sequence": "STOP",
    "tool_use": "STOP",
    "max_tokens": "MAX_TOKENS",
    # Gemini has no finish reason of its own for an answer that filled the
    # context window: it stops at MAX_TOKENS.
    "model_context_window_exceeded": "MAX_TOKENS",
    "refusal": "SAFETY",
}

_MALFORMED = frozenset({"MALFORMED_FUNCTION_CALL", "UNEXPECTED_TOOL_CALL"})
_WORDS = re.compile(r"\s*\S+\s*|\s+")
_PATH = re.compile(r"/v1(?:beta)?/models/[^/:]+:(generateContent|streamGenerateContent)"
                   r"|/v1(?:beta1)?/(?:projects/[^/]+/locations/[^/]+/)?publishers/google/"
                   r"models/[^/:]+:(generateContent|streamGenerateContent)")


class FakeGeminiServer(LoopbackServer):
    """A scripted Gemini API on 127.0.0.1, for tests.

    Use it as a context manager (or call `start` and `close`); point a
    ``GeminiProvider`` (or any ``google-genai`` client) at `url` through the
    SDK's HTTP options::

        with FakeGeminiServer() as server:
            server.add(Reply.text("Hello"))
            provider = GeminiProvider(api_key="test",
                                      http_options={"base_url": server.url})
            ...
            assert server.requests[0].path.endswith("gemini-2.5-flash:generateContent")

    Args:
        script: Items to serve, one per request, in order (see `add`).
        host: The address to bind; loopback by default.

    When the script runs out, requests get a 400 ``INVALID_ARGUMENT`` saying
    so: a permanent fault, so a test that sends more than it scripted fails
    clearly instead of retrying.
    """

    path = "/v1beta/models/{model}:generateContent"
    request_id_header = None

    @staticmethod
    def quota_exceeded(retry_delay: str = "45s", **kwargs: Any) -> ErrorReply:
        """The API's 429 ``RESOURCE_EXHAUSTED`` for a per-minute quota, with its
        ``QuotaFailure`` and its ``RetryInfo.retryDelay``."""
        return ErrorReply(status=429, body={"error": google_error(
            429, "RESOURCE_EXHAUSTED",
            "You exceeded your current quota, please check your plan and billing details.",
            quota=("generativelanguage.googleapis.com/"
                   "generate_content_paid_tier_input_token_count",
                   "GenerateContentPaidTierInputTokensPerModelPerMinute"),
            retry_delay=retry_delay)}, **kwargs)

    @staticmethod
    def billing_disabled(**kwargs: Any) -> ErrorReply:
        """The API's 403 ``PERMISSION_DENIED`` with ``ErrorInfo.reason``
        ``BILLING_DISABLED``: the project's billing is off."""
        return ErrorReply(status=403, body={"error": {
            "code": 403, "status": "PERMISSION_DENIED",
            "message": "This API method requires billing to be enabled.",
            "details": [{"@type": "type.googleapis.com/google.rpc.ErrorInfo",
                         "reason": "BILLING_DISABLED", "domain": "googleapis.com",
                         "metadata": {"service": "generativelanguage.googleapis.com"}}]}},
            **kwargs)

    @staticmethod
    def credits_depleted(**kwargs: Any) -> ErrorReply:
        """The API's 429 ``RESOURCE_EXHAUSTED`` for depleted prepayment credits."""
        return ErrorReply(status=429, body={"error": {
            "code": 429, "status": "RESOURCE_EXHAUSTED",
            "message": "Your prepayment credits are depleted. Please go to AI Studio at "
                       "https://ai.studio/projects to manage your project and billing."}},
            **kwargs)

    def _serves(self, path: str) -> bool:
        return _PATH.fullmatch(path) is not None

    def _streamed(self, request: RecordedRequest) -> bool:
        return ":streamGenerateContent" in request.path

    def __init__(self, script: Iterable[ServerItem] = (), *, host: str = "127.0.0.1") -> None:
        super().__init__(script, host=host)
        self._signed: Served[bytes] = Served()
        # The thought signature served on each function call (by `_call_key`):
        # the API refuses a call of the current turn sent back without it.

    def _refusal(self, body: Any) -> str | None:
        return contents_problem(body) or self._signature_problem(body)

    def _signature_problem(self, body: Any) -> str | None:
        """Why the API would refuse ``body``'s thought signatures, or None: a
        function call of the current turn (the model's contents since the last
        user content that is not only function responses) that the server sent
        with a thought signature, sent back without that signature."""
        contents = body.get("contents") if isinstance(body, Mapping) else None
        if not isinstance(contents, list):
            return None
        found = call_sent_back_without(contents, self._signed, _signatures_sent,
                                       start=current_turn(contents, _prompted))
        if found is None:
            return None
        index, position, _ = found
        call = contents[index]["parts"][position]["functionCall"]
        return ("Function call is missing a thought_signature in functionCall "
                "parts. This is required for tools to work correctly, and missing "
                "thought_signature may lead to degraded model performance. "
                f"Additional data, function call `default_api:{call.get('name')}` "
                f", position {position + 1}. Please refer to "
                "https://ai.google.dev/gemini-api/docs/thought-signatures for more "
                "details.")

    def _error_body(self, item: ErrorReply) -> bytes:
        given = item.given_body()
        if given is not None:
            return given
        return json.dumps({"error": _error(item.status, item.type, item.message,
                                           item.error_code)}).encode()

    def _error_status(self, error_type: str) -> int:
        return _TYPE_STATUS.get(error_type, 500)

    def _error_event(self, error_type: str, message: str, request: RecordedRequest) -> bytes:
        status = self._error_status(error_type)
        return _data({"error": _error(status, None if error_type == "overloaded_error"
                                      else error_type, message, None)})

    def _message(self, reply: Reply, request: RecordedRequest, number: int) -> dict[str, Any]:
        model = _model_of(request.path)
        stop = reply.stop_reason or ""
        response: dict[str, Any] = {}
        if stop.startswith("blocked:"):
            response["promptFeedback"] = {"blockReason": stop.partition(":")[2]}
        elif stop in _MALFORMED:
            text = "".join(str(b.get("text", "")) for b in reply.content
                           if b.get("type") == "text")
            response["candidates"] = [{"finishReason": stop, "index": 0,
                                       "finishMessage": f"Malformed function call: {text}"}]
        else:
            candidate: dict[str, Any] = {"content": {"parts": _parts(reply.content),
                                                     "role": "model"}, "index": 0}
            finish = _FINISH_REASONS.get(stop, stop) if reply.stop_reason else None
            if finish:
                candidate["finishReason"] = finish
            response["candidates"] = [candidate]
        usage = _usage_json(reply.usage, blocked=stop.startswith("blocked:"))
        if usage is not None:
            response["usageMetadata"] = usage
        for part in (response.get("candidates") or [{}])[0].get("content", {}).get("parts", ()):
            try:
                signature = signature_of(part) if "functionCall" in part else None
            except ValueError:  # a scripted signature that is not base64: not checked
                signature = None
            if signature is not None:
                self._signed.remember([_call_key(part["functionCall"])], signature)
        response["modelVersion"] = model
        response["responseId"] = reply.response_id or f"resp-fake-{number:04d}"
        return response

    def _frames(self, message: dict[str, Any], reply: Reply,
                request: RecordedRequest) -> list[Frame]:
        head = {key: message[key] for key in ("modelVersion", "responseId")}
        usage = message.get("usageMetadata")
        candidates = message.get("candidates")
        if not candidates or "content" not in candidates[0]:
            # A blocked prompt or a malformed call: one event, as the API sends it.
            return [Frame(_data(message), self._served_usage(reply.usage, request))]
        candidate = candidates[0]
        pieces: list[dict[str, Any]] = []
        for part in candidate["content"]["parts"]:
            if "text" in part and not part.get("thought") and len(part) == 1:
                pieces.extend({"text": word} for word in _WORDS.findall(part["text"]))
            else:
                pieces.append(part)
        finish = candidate.get("finishReason")
        frames: list[Frame] = []
        chunks = [*([piece] for piece in pieces), [{"text": ""}]]
        for index, parts in enumerate(chunks):
            last = index == len(chunks) - 1
            share = _share(usage, index + 1, len(chunks))
            body: dict[str, Any] = {"candidates": [{"content": {"parts": parts,
                                                               "role": "model"},
                                                   "index": 0}], **head}
            if last and finish:
                body["candidates"][0]["finishReason"] = finish
            if share is not None:
                body["usageMetadata"] = share
            frames.append(Frame(_data(body), _read_usage(share)))
        return frames

    def _served_usage(self, usage: Usage | None, request: RecordedRequest) -> Usage | None:
        return _read_usage(_usage_json(usage, blocked=False))


def _model_of(path: str) -> str:
    return path.split("?")[0].rpartition("/models/")[2].partition(":")[0]


def _error(status: int, name: str | None, message: str, reason: str | None) -> dict[str, Any]:
    return google_error(status, name or _STATUS_NAMES.get(status) or (
        "INTERNAL" if status >= 500 else "INVALID_ARGUMENT"), message, reason=reason)


def _parts(content: Any) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    pending: str | None = None
    for block in content:
        kind = block.get("type")
        part: dict[str, Any]
        if kind == "thinking":
            if not block.get("thinking"):
                pending = block.get("signature") or pending
                continue
            part = {"text": block["thinking"], "thought": True}
            if block.get("signature"):
                part["thoughtSignature"] = block["signature"]
            parts.append(part)
            continue
        if kind == "text":
            part = {"text": str(block.get("text", ""))}
        elif kind == "tool_use":
            call: dict[str, Any] = {"name": block.get("name"), "args": block.get("input") or {}}
            if block.get("id"):
                call["id"] = block["id"]
            part = {"functionCall": call}
        else:
            continue
        if pending is not None:
            part["thoughtSignature"] = pending
            pending = None
        parts.append(part)
    if pending is not None:
        parts.append({"text": "", "thoughtSignature": pending})
    return parts


def _usage_json(usage: Usage | None, *, blocked: bool) -> dict[str, Any] | None:
    if usage is None:
        return None
    prompt = usage.total_input_tokens
    thoughts = 0 if blocked else usage.reasoning_tokens
    candidates = 0 if blocked else usage.output_tokens - thoughts
    out: dict[str, Any] = {"promptTokenCount": prompt,
                           "totalTokenCount": prompt + candidates + thoughts}
    if candidates:
        out["candidatesTokenCount"] = candidates
    if thoughts:
        out["thoughtsTokenCount"] = thoughts
    if usage.cache_read_tokens:
        out["cachedContentTokenCount"] = usage.cache_read_tokens
    return out


def _share(usage: Mapping[str, Any] | None, done: int, total: int) -> dict[str, Any] | None:
    """The cumulative usage of a stream after ``done`` of its ``total`` chunks: the
    prompt and thoughts from the first chunk, the candidates growing to their total."""
    if usage is None:
        return None
    share = dict(usage)
    candidates = usage.get("candidatesTokenCount", 0) * done // total
    share["candidatesTokenCount"] = candidates
    share["totalTokenCount"] = (usage["promptTokenCount"] + candidates
                                + usage.get("thoughtsTokenCount", 0))
    return share


def _read_usage(raw: Mapping[str, Any] | None) -> Usage | None:
    """The usage a client reads from ``usageMetadata`` (the provider's mapping)."""
    if raw is None:
        return None
    cached = raw.get("cachedContentTokenCount", 0)
    thoughts = raw.get("thoughtsTokenCount", 0)
    return Usage(input_tokens=raw["promptTokenCount"] + raw.get("toolUsePromptTokenCount", 0)
                 - cached, output_tokens=raw.get("candidatesTokenCount", 0) + thoughts,
                 cache_read_tokens=cached, reasoning_tokens=thoughts)


def _data(payload: Mapping[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\r\n\r\n".encode()


def _prompted(content: Mapping[str, Any]) -> bool:
    """Whether ``content`` is the user's own: a user content that is not only
    function responses."""
    return content.get("role") == "user" and any(
        isinstance(p, Mapping) and "functionResponse" not in p
        for p in content.get("parts") or ())


def _signatures_sent(content: Mapping[str, Any]) -> Iterator[tuple[int, str, object]]:
    """Each function call part of ``content`` (by its position among the parts and
    `_call_key`), with the thought signature it carries."""
    for position, part in enumerate(content.get("parts") or ()):
        call = part.get("functionCall") if isinstance(part, Mapping) else None
        if isinstance(call, Mapping):
            try:
                signature = signature_of(part)
            except ValueError:  # not base64: not any signature the server served
                signature = None
            yield position, _call_key(call), signature


def _call_key(call: Mapping[str, Any]) -> str:
    """What names a function call across requests: its name and arguments (the
    server may send it without an id, and the client give it one)."""
    return json.dumps([call.get("name"), call.get("args") or {}], sort_keys=True)


def signature_of(part: Mapping[str, Any]) -> bytes | None:
    """The thought signature of a request part, decoded (the SDK sends it URL-safe)."""
    value = part.get("thoughtSignature")
    if not isinstance(value, str):
        return None
    return base64.urlsafe_b64decode(value.replace("+", "-").replace("/", "_"))


def contents_problem(body: Any) -> str | None:
    """Why the Gemini API would refuse ``body``'s ``contents``, or None.

    The function responses of a user turn must answer the function calls of the
    model turn right before it, one for one.
    """
    if not isinstance(body, Mapping):
        return "the body is not a JSON object"
    contents = body.get("contents")
    if not isinstance(contents, list) or not contents:
        return "contents is not specified"
    calls: list[str] = []
    for index, content in enumerate(contents):
        parts = content.get("parts") if isinstance(content, Mapping) else None
        if not isinstance(parts, list) or not parts:
            return f"contents[{index}].parts must not be empty"
        answers = [p["functionResponse"].get("name") for p in parts
                   if isinstance(p, Mapping) and isinstance(p.get("functionResponse"), Mapping)]
        if calls or answers:
            if content.get("role") != "user" or sorted(answers) != sorted(calls):
                return ("Please ensure that the number of function response parts is equal "
                        "to the number of function call parts of the function call turn.")
        calls = [p["functionCall"].get("name") for p in parts
                 if isinstance(p, Mapping) and isinstance(p.get("functionCall"), Mapping)]
    return None
