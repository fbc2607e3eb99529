"""Record a provider's answers to a JSONL file, and replay them with no network.

`RecordingProvider(inner, path)` passes each request to ``inner`` and writes
the request and what came back (the response, or the fault) as one JSON line.
`ReplayProvider(path)` serves the recording back in order and raises
`ReplayMismatchError` as soon as a request differs from the recorded one, so
a replayed run or call makes the same decisions and reports the same attempts
and outcome as the recorded one.

A recording holds conversation content: the messages, the system prompt, the
tool definitions and the replies. Treat it like the conversation itself.
It never holds keys or headers: a `ProviderRequest` has none.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio.lowlevel

from loopengine import _validate
from loopengine._errors import ConfigError, ReplayMismatchError
from loopengine._features import Features
from loopengine._usage import Usage
from loopengine.providers._base import (
    FEATURES,
    Container,
    Provider,
    ProviderRequest,
    ProviderResponse,
    TextCallback,
    genai_operation_of,
    hand_text,
)
from loopengine.providers._faults import ProviderFault

__all__ = ["RecordingProvider", "ReplayProvider"]

FORMAT = "loopengine.recording"
VERSION = 1

_FAULT_FIELDS = ("http_status", "error_code", "retry_after", "should_retry", "request_id",
                 "response_id", "usage_approx", "aborted_reason")
_RESPONSE_FIELDS = ("stop_reason", "response_id", "request_id", "http_status", "model",
                    "usage_approx")


def request_body(request: ProviderRequest) -> dict[str, Any]:
    """What identifies a request: everything sent except the time-dependent timeout."""
    return {
        "model": request.model,
        "max_tokens": request.max_tokens,
        "system": request.system,
        "tools": list(request.tools),
        "tool_choice": request.tool_choice,
        "messages": list(request.messages),
    }


def _digest(body: Mapping[str, Any]) -> str:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _usage_json(usage: Usage | None, geo: str | None) -> dict[str, int] | None:
    """``usage`` as recorded: served in the inner provider's declared geo, as the
    engine prices it (`Usage.served_in`), so a replay is priced as the
    recorded run was."""
    return None if usage is None else dataclasses.asdict(usage.served_in(geo))


def _recording_path(path: object) -> Path:
    """``path`` as a recording's file, or a `ConfigError` naming ``path``."""
    return Path(_validate.file_path("path", path))


class RecordingProvider:
    """Wraps a provider and appends every attempt to a JSONL recording.

    Args:
        inner: The provider that really answers.
        path: The recording file (created, or emptied if it exists).

    Raises:
        ConfigError: ``inner`` is not a provider, or the file cannot be
            created (its directory is missing, the path is empty or names a
            directory).
    """

    def __init__(self, inner: Provider, path: str | Path) -> None:
        if not _validate.implements(inner, Provider):
            raise ConfigError("inner", f"{inner!r} is not a Provider")
        self.inner = inner
        self.path = _recording_path(path)
        try:
            self.path.write_text("", encoding="utf-8")
        except OSError as error:  # a missing directory, a directory, no permission
            raise ConfigError("path", f"cannot create the recording {self.path}: "
                                      f"{error.strerror or error}") from None
        self._write({"format": FORMAT, "version": VERSION, "provider": inner.name})

    @property
    def name(self) -> str:
        """The inner provider's route."""
        return self.inner.name

    @property
    def vendor(self) -> str:
        """The inner provider's vendor."""
        return self.inner.vendor

    @property
    def genai_operation(self) -> str:
        """What the inner provider's requests are."""
        return self.inner.genai_operation

    @property
    def streaming(self) -> bool:
        """Whether the inner provider streams."""
        return self.inner.streaming

    @property
    def features(self) -> frozenset[str]:
        """The inner provider's request features."""
        return self.inner.features

    @property
    def inference_geo(self) -> str | None:
        """Where the inner provider's replies are served."""
        return self.inner.inference_geo

    def request_web_searches(self, model: str) -> int:
        """The web searches the inner provider's requests to ``model`` run whatever
        they ask (its replies' usages count them, and so does the recording)."""
        return self.inner.request_web_searches(model)

    def long_context(self, features: Features) -> bool:
        """Whether the inner provider's requests with ``features`` can be billed
        long-context rates."""
        return self.inner.long_context(features)

    def web_search_fee(self, model: str, features: Features) -> Decimal | None:
        """The web search fee the inner provider's requests to ``model`` with
        ``features`` are billed, where it is the tool's own."""
        return self.inner.web_search_fee(model, features)

    def check_ready(self) -> None:
        """Ask the inner provider whether it can send from here (passed on)."""
        self.inner.check_ready()

    def check_request(self, request: ProviderRequest) -> None:
        """Ask the inner provider whether it can send ``request`` (passed on)."""
        self.inner.check_request(request)

    def _write(self, entry: Mapping[str, Any]) -> None:
        # One append per attempt, the file closed between them: nothing to
        # close, and a crash loses at most the line being written.
        with self.path.open("a", encoding="utf-8") as file:
            file.write(json.dumps(entry, sort_keys=True, default=str) + "\n")

    async def send(self, request: ProviderRequest, *,
                   on_text: TextCallback | None = None) -> ProviderResponse:
        """Send through the inner provider and record the request and its outcome."""
        body = request_body(request)
        entry: dict[str, Any] = {"request": body, "request_sha256": _digest(body)}
        try:
            response = await self.inner.send(request, on_text=on_text)
        except ProviderFault as fault:
            entry["fault"] = {
                "kind": fault.kind.value,
                "message": fault.message,
                "usage": _usage_json(fault.usage, self.inner.inference_geo),
                **{name: getattr(fault, name) for name in _FAULT_FIELDS},
            }
            self._write(entry)
            raise
        entry["response"] = {
            "content": list(response.content),
            "usage": _usage_json(response.usage, self.inner.inference_geo),
            "container": None if response.container is None else response.container.to_json(),
            **{name: getattr(response, name) for name in _RESPONSE_FIELDS},
        }
        self._write(entry)
        return response


class ReplayProvider:
    """Serves a recording back, in order, without any network.

    Args:
        path: A file written by `RecordingProvider`.
        strict: Compare each request with the recorded one (default); a
            difference raises `ReplayMismatchError`.

    Raises:
        ConfigError: the file is missing, cannot be read, or is not a
            loopengine recording.
    """

    def __init__(self, path: str | Path, *, strict: bool = True) -> None:
        self.path = _recording_path(path)
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            raise ConfigError("path", f"no recording at {self.path}") from None
        except (OSError, UnicodeDecodeError) as error:  # a directory, no permission, binary
            raise ConfigError("path", f"cannot read the recording {self.path}: "
                                      f"{getattr(error, 'strerror', None) or error}") from None
        try:
            entries = [json.loads(line) for line in lines if line.strip()]
        except json.JSONDecodeError as error:
            raise ConfigError("path", f"{self.path} is not a recording: {error}") from None
        if not entries or entries[0].get("format") != FORMAT:
            raise ConfigError("path", f"{self.path} is not a loopengine recording")
        if entries[0].get("version") != VERSION:
            raise ConfigError("path", f"{self.path}: recording version "
                                      f"{entries[0].get('version')} is not {VERSION}")
        self._name = str(entries[0]["provider"])
        self.entries = entries[1:]
        self.strict = strict
        self.position = 0

    @property
    def name(self) -> str:
        """The recorded provider's route."""
        return self._name

    @property
    def vendor(self) -> str:
        """The recorded provider's route (a recording keeps no vendor)."""
        return self._name

    @property
    def genai_operation(self) -> str:
        """What the recorded route's requests are, as far as its name says (a
        recording keeps no operation, as it keeps no vendor: `genai_operation_of`)."""
        return genai_operation_of(self._name)

    streaming = True
    """A recorded reply's text blocks go to ``on_text``, one call each."""
    inference_geo = None
    """None: each recorded reply's usage names the geo it was served in, if any."""
    features = FEATURES
    """A recording answers whatever was recorded."""

    def request_web_searches(self, model: str) -> int:
        """0: each recorded reply's usage counts the web searches it ran, a search
        model's included (`Provider.request_web_searches`)."""
        return 0

    def long_context(self, features: Features) -> bool:
        """True: a recorded usage past a model's long-context threshold is priced
        at its long-context rates (`Provider.long_context`)."""
        return True

    def web_search_fee(self, model: str, features: Features) -> Decimal | None:
        """None: a recorded reply's web searches are billed the model's fee
        (`Provider.web_search_fee`)."""
        return None

    def check_ready(self) -> None:
        """Always ready: a recording needs no connection."""

    def check_request(self, request: ProviderRequest) -> None:
        """Any request: a recording answers whatever was recorded."""

    @property
    def exhausted(self) -> bool:
        """True when every recorded attempt has been served."""
        return self.position >= len(self.entries)

    async def send(self, request: ProviderRequest, *,
                   on_text: TextCallback | None = None) -> ProviderResponse:
        """Serve the next recorded outcome of this request.

        Raises:
            ReplayMismatchError: the request differs from the recorded one, or
                the recording has no more attempts.
            ProviderFault: the recorded attempt failed.
        """
        await anyio.lowlevel.checkpoint()
        if self.exhausted:
            raise ReplayMismatchError(
                f"{self.path}: request {self.position + 1} was not recorded "
                f"(the recording holds {len(self.entries)})"
            )
        entry = self.entries[self.position]
        self.position += 1
        body = request_body(request)
        if self.strict and _digest(json.loads(json.dumps(body, default=str))) != entry[
            "request_sha256"
        ]:
            raise ReplayMismatchError(
                f"{self.path}: request {self.position} differs from the recording "
                f"({_first_difference(entry['request'], body)})"
            )
        if "fault" in entry:
            recorded = dict(entry["fault"])
            kind, message = recorded.pop("kind"), recorded.pop("message")
            usage = recorded.pop("usage")
            raise ProviderFault(kind, message, usage=Usage(**usage) if usage else None,
                                **recorded)
        recorded = entry["response"]
        usage = recorded["usage"]
        await hand_text(on_text, recorded["content"])
        return ProviderResponse(
            content=recorded["content"],
            usage=Usage(**usage) if usage else None,
            # The code execution container the reply named, so that the replayed
            # run sends it on as the recorded one did.
            container=Container.from_json(recorded.get("container")),
            # A recording made before a field existed holds its default.
            **{name: recorded[name] for name in _RESPONSE_FIELDS if name in recorded},
        )


def _first_difference(recorded: Any, sent: Any, where: str = "request") -> str:
    """Where two JSON values first differ, for the mismatch message (no values shown)."""
    sent = json.loads(json.dumps(sent, default=str))
    if isinstance(recorded, dict) and isinstance(sent, dict):
        for key in sorted(set(recorded) | set(sent)):
            if recorded.get(key) != sent.get(key):
                return _first_difference(recorded.get(key), sent.get(key), f"{where}.{key}")
    if isinstance(recorded, list) and isinstance(sent, list):
        if len(recorded) != len(sent):
            return f"{where} has {len(sent)} items, the recording {len(recorded)}"
        for i, (a, b) in enumerate(zip(recorded, sent, strict=True)):
            if a != b:
                return _first_difference(a, b, f"{where}[{i}]")
    return f"{where} differs"
