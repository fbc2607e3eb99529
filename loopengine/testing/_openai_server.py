"""`FakeOpenAIServer`: the Chat Completions and Responses APIs on loopback,
scripted, for tests.

A real HTTP/1.1 server on 127.0.0.1 that answers ``POST
/v1/chat/completions`` (and Azure's ``/openai/deployments/{name}/chat/completions``)
in JSON or, when the request asks for ``"stream": true``, in server-sent
``chat.completion.chunk`` events ending with ``data: [DONE]``; and ``POST
/v1/responses`` in the Responses API's shapes and events, from the same
script (``_openai_responses_wire.py`` says how a `Reply` looks there). It takes the
same script items as `FakeAnthropicServer` (it is the same `LoopbackServer`),
rendered in the Chat Completions shapes:

* `Reply`: its text blocks are the message's ``content``, its ``tool_use``
  blocks its ``tool_calls`` (an ``input`` given as a string is sent as the
  arguments verbatim, to script malformed arguments; a block's
  ``extra_content``, Gemini's thought signature, goes on its call, and a
  later request of the same turn that sends that call back without it is
  refused, as Gemini's OpenAI-compatible endpoint refuses it; its
  ``reasoning_content`` blocks are the message's ``reasoning_content``, as a
  thinking server such as DeepSeek sends it, streamed before the text, and a
  later request that sends back one of those tool calls without it is
  refused, as DeepSeek refuses it); its ``reasoning_details`` blocks are the
  message's ``reasoning_details`` (OpenRouter's), streamed detail by detail,
  a text in pieces under its ``index``, and a tool-call turn served with them
  sent back without them is refused, as a thinking model behind OpenRouter
  refuses it; its stop reason is the
  ``finish_reason`` (``end_turn`` -> ``stop``, ``tool_use`` -> ``tool_calls``,
  ``max_tokens`` and ``model_context_window_exceeded`` -> ``length``,
  ``refusal`` -> ``content_filter``, any other value as it is, None as
  ``null``); its usage is ``prompt_tokens`` (uncached input, cache
  reads and cache writes), ``prompt_tokens_details.cached_tokens`` (the cache
  reads) and ``cache_write_tokens`` (the writes), ``completion_tokens`` and
  ``completion_tokens_details.reasoning_tokens``; the usage's
  ``service_tier`` is the completion's (``default`` when it has none). A
  stream carries the usage in a last chunk only when the request asked for
  it (``stream_options.include_usage``), as the API does, and never when the
  server is built with ``stream_usage=False``;
* `ErrorReply`: ``{"error": {"message", "type", "param", "code"}}`` with its
  status and headers (``type`` derived from the status when not given,
  ``code`` from ``error_code``), or its own ``body``;
* `StreamErrorEvent`: an ``{"error": {...}}`` event inside the stream after
  some chunks (a non-streaming request gets the status its type stands for);
  its ``data`` is sent as the event instead when given (an error chunk that
  carries ``usage`` and an ``id``, as OpenRouter sends it);
* `CutStream`, `StallStream`, `DropConnection`, delays, callables: as for
  `FakeAnthropicServer`. A stream is chunks, then (if asked) the usage chunk,
  then ``[DONE]``: cutting it ``after`` the chunks of the answer leaves out
  the usage; cutting earlier leaves out the ``finish_reason`` too. A stream on
  Azure's path begins, as Azure's does, with a chunk of the prompt's filter
  results whose ``id`` and ``model`` are empty; a server built with
  ``tool_call_indexes=False`` streams each tool call whole, without its
  ``index``, as Gemini's OpenAI-compatible endpoint does.

A request whose ``messages`` the API refuses (a ``tool`` message that
answers no call of the assistant message before it, an assistant's call left
without its ``tool`` message) gets the API's 400 without taking a script
item, and so does a Responses request the API refuses (reasoning parameters
for a model that does not reason, a reasoning item without its encrypted
content or without the item that followed it, an output item without its
reasoning item), and a request of either API whose function's parameters
are not an object's schema (or have ``anyOf``, ``enum``... at their root) or
hold an array schema without ``items``.
Requests are recorded and the usage served is counted as by
`FakeAnthropicServer`: `usage_served` is the usage a client reads, in the
engine's convention (cache reads apart from the uncached input).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from loopengine._usage import Usage
from loopengine.providers._openai_chat import ROOT_KEYWORDS, arrays_without_items, root_keyword
from loopengine.providers._scripted import Reply
from loopengine.testing import _openai_responses_wire as responses
from loopengine.testing._loopback import (
    ErrorReply,
    Frame,
    LoopbackServer,
    RecordedRequest,
    ServerItem,
    tool_schema_problem,
)
from loopengine.testing._sent_back import Served, call_sent_back_without, current_turn

__all__ = ["FakeOpenAIServer", "transcript_problem"]

_STATUS_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "requests",
}

_TYPE_STATUS = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "permission_error": 403,
    "insufficient_quota": 429,
    "requests": 429,
    "tokens": 429,
    "rate_limit_error": 429,
    "overloaded_error": 503,
    "timeout": 408,
}

_FINISH_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "tool_use": "tool_calls",
    "max_tokens": "length",
    # Chat Completions has no finish reason of its own for an answer that
    # filled the context window: it stops at its length.
    "model_context_window_exceeded": "length",
    "refusal": "content_filter",
}

_WORDS = re.compile(r"\s*\S+\s*|\s+")
_AZURE_PATH = re.compile(r"/openai/deployments/[^/]+/chat/completions")


class FakeOpenAIServer(LoopbackServer):
    """A scripted Chat Completions (and Responses) API on 127.0.0.1, for tests.

    Use it as a context manager (or call `start` and `close`); point an
    ``openai`` client at `base_url`::

        with FakeOpenAIServer() as server:
            server.add(Reply.text("Hello"))
            provider = OpenAIProvider(api_key="test", base_url=server.base_url)
            ...
            assert server.requests[0].body["model"] == "gpt-4o-mini"

    Args:
        script: Items to serve, one per request, in order (see `add`).
        host: The address to bind; loopback by default.
        stream_usage: False: streams never carry the usage chunk, whatever
            the request asks, as some compatible servers do (older vLLM,
            llama.cpp, some gateways); the stream still ends with its
            ``finish_reason`` and ``[DONE]``.
        tool_call_indexes: False: a streamed tool call comes whole in one
            delta without its ``index``, as Gemini's OpenAI-compatible
            endpoint sends it.

    When the script runs out, requests get a 400 ``invalid_request_error``
    saying so: a permanent fault, so a test that sends more than it scripted
    fails clearly instead of retrying.
    """

    path = "/v1/chat/completions"
    request_id_header = "x-request-id"

    def __init__(self, script: Iterable[ServerItem] = (), *, host: str = "127.0.0.1",
                 stream_usage: bool = True, tool_call_indexes: bool = True) -> None:
        super().__init__(script, host=host)
        self.stream_usage = stream_usage
        """Whether a stream that asks for its usage chunk gets it."""
        self.tool_call_indexes = tool_call_indexes
        """Whether a streamed tool call names its ``index`` (and comes in pieces);
        False: each call comes whole in one delta without one, as Gemini's
        OpenAI-compatible endpoint sends them."""
        self._reasoned: Served[str] = Served()
        # The Responses output items served after a reasoning item, by id: the
        # API refuses one sent back with its id but without that reasoning.
        self._reasoning: Served[bool] = Served()
        # The tool calls served with a reasoning_content (as DeepSeek's thinking
        # mode does) or OpenRouter's reasoning_details, by "<field>:<call id>":
        # their message is refused without that field.
        self._signed_calls: Served[Any] = Served()
        # The thought signatures served in tool calls' extra_content (Gemini's
        # OpenAI-compatible endpoint), by call id: required back in the current turn.

    @property
    def base_url(self) -> str:
        """The ``base_url`` to give an ``openai`` client: `url` with ``/v1``."""
        return f"{self.url}/v1"

    def _serves(self, path: str) -> bool:
        # Azure's form of the same endpoint names the deployment in the path.
        return (path in (self.path, responses.PATH)
                or _AZURE_PATH.fullmatch(path) is not None)

    def _refusal(self, body: Any) -> str | None:
        # Only a Responses request has an ``input``.
        if isinstance(body, Mapping) and "input" in body:
            return (responses.reasoning_problem(body)
                    or responses.input_problem(body, self._reasoned)
                    or _parameters_problem(
                        body.get("tools"), lambda tool: tool.get("parameters")
                        if tool.get("type") == "function" else None))
        return (transcript_problem(body) or self._reasoning_problem(body)
                or self._signature_problem(body)
                or _parameters_problem(
                    body.get("tools") if isinstance(body, Mapping) else None,
                    lambda tool: tool["function"].get("parameters")
                    if isinstance(tool.get("function"), Mapping) else None))

    def _reasoning_problem(self, body: Any) -> str | None:
        """Why a thinking server (DeepSeek, OpenRouter's) would refuse ``body``'s
        messages: a tool-call turn it served with a ``reasoning_content`` (or
        ``reasoning_details``), sent back without it."""
        found = call_sent_back_without(body.get("messages") or (), self._reasoning,
                                       _reasoning_sent)
        if found is None:
            return None
        index, _, key = found
        return (f"Missing {key.partition(':')[0]} field in the assistant message at "
                f"message index {index}.")

    def _signature_problem(self, body: Any) -> str | None:
        """Why Gemini's OpenAI-compatible endpoint would refuse ``body``'s messages:
        a tool call of the current turn (the messages after the last ``user``
        one) that it served with a thought signature in its ``extra_content``,
        sent back without that signature."""
        messages = body.get("messages") or ()
        found = call_sent_back_without(
            messages, self._signed_calls, _signatures_sent,
            start=current_turn(messages, lambda message: message.get("role") == "user"))
        if found is None:
            return None
        index, _, call_id = found
        return (f"messages[{index}]: Function call is missing a thought_signature "
                f"in functionCall parts (function call `{call_id}`). This "
                "is required for tools to work correctly.")

    def _error_body(self, item: ErrorReply) -> bytes:
        if isinstance(item.body, str):
            return item.body.encode()
        if item.body is not None:
            return json.dumps(item.body).encode()
        return json.dumps({"error": _error(item.status, item.type, item.message,
                                           item.error_code)}).encode()

    def _error_status(self, error_type: str) -> int:
        return _TYPE_STATUS.get(error_type, 500)

    def _error_event(self, error_type: str, message: str, request: RecordedRequest) -> bytes:
        if _is_responses(request):
            return responses.error_event(error_type, message)
        return _data({"error": {"message": message, "type": error_type, "param": None,
                                "code": None}})

    def _message(self, reply: Reply, request: RecordedRequest, number: int) -> dict[str, Any]:
        if _is_responses(request):
            response = responses.response_body(reply, request, number)
            self._reasoned.update(responses.reasoned_items(response))
            return response
        model = request.body.get("model") if isinstance(request.body, Mapping) else None
        texts = [str(b.get("text", "")) for b in reply.content if b.get("type") == "text"]
        calls = [{"id": b.get("id"), "type": "function",
                  "function": {"name": b.get("name"), "arguments": _arguments(b.get("input"))},
                  **({"extra_content": b["extra_content"]} if "extra_content" in b else {})}
                 for b in reply.content if b.get("type") == "tool_use"]
        message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None,
                                   "refusal": None}
        reasoned = [str(b.get("reasoning_content", "")) for b in reply.content
                    if b.get("type") == "reasoning_content"]
        if reasoned:  # even empty: DeepSeek may reason nothing and ask it back
            message["reasoning_content"] = "".join(reasoned)
            self._reasoning.remember((f"reasoning_content:{call['id']}" for call in calls),
                                     True)
        details = [detail for b in reply.content if b.get("type") == "reasoning_details"
                   for detail in b.get("reasoning_details") or ()]
        if details:
            message["reasoning_details"] = details
            self._reasoning.remember((f"reasoning_details:{call['id']}" for call in calls),
                                     True)
        for call in calls:
            signature = _thought_signature(call)
            if signature is not None:
                self._signed_calls.remember([str(call["id"])], signature)
        if calls:
            message["tool_calls"] = calls
        completion: dict[str, Any] = {
            "id": reply.response_id or f"chatcmpl-fake-{number:04d}",
            "object": "chat.completion",
            "created": 1_700_000_000 + number,
            "model": model or "gpt-fake",
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": _finish_reason(reply.stop_reason)}],
            "system_fingerprint": None,
            "service_tier": (reply.usage.service_tier if reply.usage else None) or "default",
        }
        usage = _usage_json(reply.usage)
        if usage is not None:
            completion["usage"] = usage
        return completion

    def _frames(self, message: dict[str, Any], reply: Reply,
                request: RecordedRequest) -> list[Frame]:
        if _is_responses(request):
            return responses.response_frames(message, reply)
        head = {key: message[key] for key in ("id", "created", "model", "system_fingerprint",
                                               "service_tier")}
        choice = message["choices"][0]
        answer = choice["message"]

        def chunk(delta: Mapping[str, Any], finish: str | None = None) -> bytes:
            return _data({**head, "object": "chat.completion.chunk",
                          "choices": [{"index": 0, "delta": dict(delta), "logprobs": None,
                                       "finish_reason": finish}]})

        frames = []
        if _AZURE_PATH.fullmatch(request.path.split("?")[0]) is not None:
            # Azure's first chunk: the prompt's filter results, no id, no model.
            frames.append(_data({"choices": [], "created": 0, "id": "", "model": "",
                                 "object": "", "prompt_filter_results": [{
                                     "prompt_index": 0, "content_filter_results": {}}]}))
        frames.append(chunk({"role": "assistant", "content": ""}))
        reasoning = answer.get("reasoning_content")
        for piece in _WORDS.findall(reasoning or "") or ([""] if reasoning == "" else []):
            frames.append(chunk({"reasoning_content": piece}))
        for index, detail in enumerate(answer.get("reasoning_details") or ()):
            # The text in pieces, then the rest (a signature) with the last.
            text = str(detail.get("text") or "")
            pieces = _WORDS.findall(text) or [text]
            for n, piece in enumerate(pieces):
                rest = ({k: v for k, v in detail.items() if k != "text"}
                        if n == len(pieces) - 1 else {"type": detail.get("type")})
                frames.append(chunk({"reasoning_details": [
                    {**rest, **({"text": piece} if "text" in detail else {}),
                     "index": index}]}))
        for piece in _WORDS.findall(answer["content"] or ""):
            frames.append(chunk({"content": piece}))
        for index, call in enumerate(answer.get("tool_calls", ())):
            function = call["function"]
            extra = {"extra_content": call["extra_content"]} if "extra_content" in call else {}
            if not self.tool_call_indexes:
                frames.append(chunk({"tool_calls": [{"id": call["id"], "type": "function",
                                                     "function": dict(function), **extra}]}))
                continue
            frames.append(chunk({"tool_calls": [{
                "index": index, "id": call["id"], "type": "function",
                "function": {"name": function["name"], "arguments": ""}, **extra}]}))
            arguments = function["arguments"]
            # In two pieces, as the API streams them: the client joins them.
            for part in (arguments[: len(arguments) // 2], arguments[len(arguments) // 2:]):
                if part:
                    frames.append(chunk({"tool_calls": [{"index": index,
                                                         "function": {"arguments": part}}]}))
        frames.append(chunk({}, choice["finish_reason"]))
        out = [Frame(data, None) for data in frames]
        served: Usage | None = None
        options = request.body.get("stream_options") if isinstance(request.body, Mapping) \
            else None
        if isinstance(options, Mapping) and options.get("include_usage") is True \
                and "usage" in message and self.stream_usage:
            served = self._served_usage(reply.usage, request)
            out.append(Frame(_data({**head, "object": "chat.completion.chunk", "choices": [],
                                    "usage": message["usage"]}), served))
        out.append(Frame(b"data: [DONE]\n\n", served))
        return out

    def _served_usage(self, usage: Usage | None, request: RecordedRequest) -> Usage | None:
        # Chat Completions reports no web searches; the Responses API does.
        return responses.served_usage(usage, web_searches=_is_responses(request))


def _is_responses(request: RecordedRequest) -> bool:
    return request.path.split("?")[0] == responses.PATH


def _error(status: int, error_type: str | None, message: str,
           code: str | None) -> dict[str, Any]:
    kind = error_type or _STATUS_TYPES.get(status) or (
        "server_error" if status >= 500 else "invalid_request_error")
    return {"message": message, "type": kind, "param": None, "code": code}


def _finish_reason(stop_reason: str | None) -> str | None:
    if stop_reason is None:
        return None
    return _FINISH_REASONS.get(stop_reason, stop_reason)


def _reasoning_sent(message: Mapping[str, Any]) -> Iterator[tuple[int, str, object]]:
    """Each tool call of ``message`` under each reasoning field (``<field>:<call
    id>``), with whether the message carries that field back."""
    for field in ("reasoning_content", "reasoning_details"):
        carried = message.get(field) not in (None, [])
        for position, call in enumerate(message.get("tool_calls") or ()):
            if isinstance(call, Mapping):
                yield position, f"{field}:{call.get('id')}", carried


def _signatures_sent(message: Mapping[str, Any]) -> Iterator[tuple[int, str, object]]:
    """Each tool call of ``message`` (by id) with the thought signature it carries."""
    for position, call in enumerate(message.get("tool_calls") or ()):
        if isinstance(call, Mapping):
            yield position, str(call.get("id")), _thought_signature(call)


def _thought_signature(call: Mapping[str, Any]) -> Any:
    """A tool call's thought signature (``extra_content.google.thought_signature``),
    as Gemini's OpenAI-compatible endpoint sends it, or None."""
    extra = call.get("extra_content")
    google = extra.get("google") if isinstance(extra, Mapping) else None
    return google.get("thought_signature") if isinstance(google, Mapping) else None


def _arguments(tool_input: Any) -> str:
    return tool_input if isinstance(tool_input, str) else json.dumps(tool_input or {})


def _usage_json(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    prompt = usage.total_input_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": usage.output_tokens,
        "total_tokens": prompt + usage.output_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cache_read_tokens,
                                  "cache_write_tokens": usage.cache_write_tokens,
                                  "audio_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens,
                                      "audio_tokens": 0,
                                      "accepted_prediction_tokens": 0,
                                      "rejected_prediction_tokens": 0},
    }


def _data(payload: Mapping[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def _parameters_problem(tools: object,
                        schema_of: Callable[[Mapping[str, Any]], object]) -> str | None:
    """Why either OpenAI API would refuse a request's function ``tools`` (their
    parameters read by ``schema_of``), in its words: parameters that are not an
    object's schema (or one with ``anyOf``... at its root), or that hold an
    array schema without ``items``."""
    problem = tool_schema_problem(tools, schema_of, _schema_refusal)
    for tool in tools if problem is None and isinstance(tools, list) else ():
        schema = schema_of(tool) if isinstance(tool, Mapping) else None
        if root_keyword(schema) is not None:
            return (f"Invalid schema for function '{_function_name(tool)}': schema must have "
                    "type 'object' and not have "
                    f"{'/'.join(repr(key) for key in ROOT_KEYWORDS)} at the top level.")
        path = next(arrays_without_items(schema), None)
        if path is not None:
            return (f"Invalid schema for function '{_function_name(tool)}': In "
                    f"context={path!r}, array schema missing items.")
    return problem


def _function_name(tool: Mapping[str, Any]) -> object:
    function = tool.get("function")
    return (function if isinstance(function, Mapping) else tool).get("name")


def _schema_refusal(index: int, tool: Mapping[str, Any], kind: object) -> str:
    """OpenAI's words for a function tool whose parameters are not an object's."""
    return (f"Invalid schema for function '{_function_name(tool)}': schema must be a JSON "
            f"Schema of 'type: \"object\"', got 'type: \"{kind}\"'.")


def transcript_problem(body: Any) -> str | None:
    """Why the Chat Completions API would refuse ``body``'s ``messages``, or None.

    Each assistant message's ``tool_calls`` must be answered, one ``tool``
    message per call id, by the messages right after it, and a ``tool``
    message must answer a call of that assistant message.
    """
    if not isinstance(body, Mapping):
        return "the body is not a JSON object"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "messages: a non-empty array is required"
    pending: list[str] = []
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, Mapping) else None
        if role == "tool":
            call_id = message.get("tool_call_id")
            if call_id not in pending:
                return (f"messages[{index}]: a message with role 'tool' must be a response to "
                        f"a preceding message with 'tool_calls' (tool_call_id {call_id!r})")
            pending.remove(call_id)
            continue
        if pending:
            return (f"messages[{index}]: an assistant message with 'tool_calls' must be "
                    f"followed by tool messages responding to each 'tool_call_id' "
                    f"(missing: {', '.join(pending)})")
        if role not in ("system", "developer", "user", "assistant"):
            return f"messages[{index}]: unknown role {role!r}"
        if role == "assistant":
            pending = [str(call.get("id")) for call in message.get("tool_calls") or ()]
    if pending:
        return ("messages: an assistant message with 'tool_calls' must be followed by tool "
                f"messages responding to each 'tool_call_id' (missing: {', '.join(pending)})")
    return None
