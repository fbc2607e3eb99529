"""Record a provider's answers to a JSONL file, and replay them with no network.

`RecordingProvider(inner, path)` passes each request to ``inner`` and writes
the request and what came back (the response, or the fault) as one JSON line.
`ReplayProvider(path)` serves each request the recorded outcome of the same
request and raises `ReplayMismatchError` as soon as a request differs from
the recorded ones, so a replayed run or call makes the same decisions and
reports the same attempts and outcome as the recorded one. Each request is
recorded with how the provider bills it beyond its usage (`Provider.billing`,
where it is not the default), and the replay declares the same, so a replay
is priced, reserved and refused a credit hold as the recorded run was.

A recording holds conversation content: the messages, the system prompt, the
tool definitions and the replies. Treat it like the conversation itself.
It holds no key and no authentication header: a `ProviderRequest` has none.
A fault's message is the server's, as the run's result reports it.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel

from loopengine import _validate
from loopengine._errors import ConfigError, LoopEngineError, ReplayMismatchError
from loopengine._features import Features, features_table
from loopengine._usage import Usage, usage_from_json, usage_json
from loopengine.providers._base import (
    DEFAULT_BILLING,
    FEATURES,
    NEW_CALL_ID,
    Billing,
    Container,
    Provider,
    ProviderRequest,
    ProviderResponse,
    ServedSink,
    TextCallback,
    cut_sink,
    genai_operation_of,
    hand_text,
    watch_cuts,
)
from loopengine.providers._cache import CachePolicy
from loopengine.providers._faults import ProviderFault, timed_out

__all__ = ["RecordingProvider", "ReplayProvider"]

FORMAT = "loopengine.recording"
VERSION = 1

_CUT_BY = ("timeout", "deadline", "caller")
"""What may cut a recorded attempt (`ServedSink.cut_by`)."""

_FAULT_FIELDS = ("http_status", "error_code", "retry_after", "should_retry", "request_id",
                 "response_id", "usage_approx", "aborted_reason")
_RESPONSE_FIELDS = ("stop_reason", "response_id", "request_id", "http_status", "model",
                    "usage_approx")


def _earlier(header: Mapping[str, Any]) -> bool:
    """Whether a recording's header was written before a recording named the
    request features and the cache policy: such a header names no vendor
    (both came in together), and its requests are compared without them."""
    return "vendor" not in header


def request_body(request: ProviderRequest, *, earlier: bool = False) -> dict[str, Any]:
    """What identifies a request: everything sent except the time-dependent timeout
    and the container (whose expiry is the engine clock's, which a replay need
    not share). The request features and the cache policy are named only when
    set, so a recording of a request without them reads as it did before they
    were recorded; ``earlier``: never, as a recording begun before they were
    recorded (`_earlier`) holds its requests."""
    body: dict[str, Any] = {
        "model": request.model,
        "max_tokens": request.max_tokens,
        "system": request.system,
        "tools": list(request.tools),
        "tool_choice": request.tool_choice,
        "messages": list(request.messages),
    }
    if earlier:
        return body
    features = features_table(request.features)
    if features:
        body["features"] = features
    if request.cache != CachePolicy():
        body["cache"] = _validate.field_values(request.cache)
    return body


def _comparable(body: Mapping[str, Any]) -> Any:
    """``body`` as a replay compares it: as JSON, each call id the engine made
    itself (`new_call_id`, for a call its server named no id for or another
    call's) in the order it first appears, since a replayed run makes other ones."""
    made: dict[str, str] = {}

    def renamed(match: re.Match[str]) -> str:
        return made.setdefault(match.group(), f"call_made_{len(made) + 1}")

    def walk(value: Any) -> Any:
        if isinstance(value, str):
            return NEW_CALL_ID.sub(renamed, value)
        if isinstance(value, dict):
            return {key: walk(item) for key, item in value.items()}
        if isinstance(value, list):
            return [walk(item) for item in value]
        return value

    return walk(json.loads(json.dumps(body, default=str)))


def _digest(body: Mapping[str, Any]) -> str:
    """The SHA-256 of ``body`` as a replay compares it (`_comparable`)."""
    canonical = json.dumps(_comparable(body), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _billing_key(model: object, features: object) -> str:
    """What a replay finds a recorded billing by: a request's model and its
    features as `request_body` records them."""
    return json.dumps([model, features], sort_keys=True, default=str)


def _usage_json(usage: Usage | None, geo: str | None) -> dict[str, Any] | None:
    """``usage`` as recorded: served in the inner provider's declared geo, as the
    engine prices it (`Usage.served_in`), so a replay is priced as the
    recorded run was."""
    return None if usage is None else usage_json(usage.served_in(geo))


def _recording_path(path: object) -> Path:
    """``path`` as a recording's file, or a `ConfigError` naming ``path``."""
    return Path(_validate.file_path("path", path))


class RecordingProvider:
    """Wraps a provider and appends every attempt to a JSONL recording.

    Args:
        inner: The provider that really answers.
        path: The recording file (created, or emptied if it exists).
        append: Go on with the recording at ``path``, if there is one, instead
            of emptying it: a paused run resumed in another process records
            its second half after its first.

    Raises:
        ConfigError: ``inner`` is not a provider, the file cannot be created
            (its directory is missing, the path is empty or names a
            directory), or, with ``append``, the file is not a recording or
            one of another provider's.
    """

    def __init__(self, inner: Provider, path: str | Path, *, append: bool = False) -> None:
        if not _validate.implements(inner, Provider):
            raise ConfigError("inner", f"{inner!r} is not a Provider")
        _validate.boolean("append", append)
        self.inner = inner
        self.path = _recording_path(path)
        header = {"format": FORMAT, "version": VERSION, "provider": inner.name,
                  "vendor": inner.vendor, "genai_operation": inner.genai_operation}
        self._earlier = False
        if append and self.path.is_file() and self.path.stat().st_size:
            recorded = _load(self.path)[0]
            if (recorded["provider"], recorded.get("vendor", recorded["provider"])) != (
                    inner.name, inner.vendor):
                raise ConfigError("path", f"{self.path} is a recording of provider "
                                          f"{recorded['provider']!r}, not {inner.name!r}")
            # Gone on with as it was begun, so that its replay compares every
            # request alike.
            self._earlier = _earlier(recorded)
            return
        try:
            self.path.write_text("", encoding="utf-8")
        except OSError as error:  # a missing directory, a directory, no permission
            raise ConfigError("path", f"cannot create the recording {self.path}: "
                                      f"{error.strerror or error}") from None
        self._write(header)

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

    def billing(self, model: str, features: Features) -> Billing:
        """How the inner provider bills its requests to ``model`` with ``features``
        (recorded with each request, where it is not the default)."""
        return self.inner.billing(model, features)

    def check_ready(self) -> None:
        """Ask the inner provider whether it can send from here (passed on)."""
        self.inner.check_ready()

    def check_request(self, request: ProviderRequest) -> None:
        """Ask the inner provider whether it can send ``request`` (passed on); a
        refusal is recorded, so that the replay refuses the request as well."""
        try:
            self.inner.check_request(request)
        except ProviderFault as fault:
            self._write({**self._request_json(request), "refused": self._fault_json(fault)})
            raise

    def _request_json(self, request: ProviderRequest) -> dict[str, Any]:
        """``request`` as recorded: what identifies it (`request_body`), its digest
        and, where it is not the default, how the inner provider bills it
        (`Provider.billing`), which the replay declares in its place."""
        body = request_body(request, earlier=self._earlier)
        entry: dict[str, Any] = {"request": body, "request_sha256": _digest(body)}
        billing = self.inner.billing(request.model, request.features)
        if billing != DEFAULT_BILLING:
            entry["billing"] = _validate.field_values(billing)
        return entry

    def _fault_json(self, fault: ProviderFault) -> dict[str, Any]:
        """``fault`` as recorded (`_fault_from` reads it back)."""
        return {
            "kind": fault.kind.value,
            "message": fault.message,
            "usage": _usage_json(fault.usage, self.inner.inference_geo),
            **{name: getattr(fault, name) for name in _FAULT_FIELDS},
        }

    def _write(self, entry: Mapping[str, Any]) -> None:
        # One append per attempt, the file closed between them: nothing to
        # close, and a crash loses at most the line being written.
        with self.path.open("a", encoding="utf-8") as file:
            file.write(json.dumps(entry, sort_keys=True, default=str) + "\n")

    async def send(self, request: ProviderRequest, *,
                   on_text: TextCallback | None = None) -> ProviderResponse:
        """Send through the inner provider and record the request and its outcome,
        with the pieces of text it handed to ``on_text``, if given."""
        entry = self._request_json(request)
        handed: TextCallback | None = None
        if on_text is not None:
            pieces = entry["text"] = []

            async def handed(text: str) -> None:
                pieces.append(text)
                maybe = on_text(text)
                if maybe is not None:
                    await maybe

        # What a stream a cancellation cuts had served, on its way to the attempt.
        sink = cut_sink()
        kept = _KeptCut(sink)
        if sink is not None:
            watch_cuts(kept)
        try:
            response = await self.inner.send(request, on_text=handed)
        except ProviderFault as fault:
            entry["fault"] = self._fault_json(fault)
            self._write(entry)
            raise
        except anyio.get_cancelled_exc_class():
            # Cut by the attempt's timeout, a deadline or the caller's
            # cancellation: sent, and unanswered. Unrecorded, its replay would
            # serve its retry's reply to it. A timeout's cut is written as it
            # always was; any other names what cut it (`_Cut.by`).
            entry["cut"] = None if kept.served is None else self._fault_json(kept.served)
            by = kept.cut_by()
            if by != "timeout":
                entry["cut_by"] = by
            self._write(entry)
            raise
        finally:
            if sink is not None:
                watch_cuts(sink)
        entry["response"] = {
            "content": list(response.content),
            "usage": _usage_json(response.usage, self.inner.inference_geo),
            "container": None if response.container is None else response.container.to_json(),
            **{name: getattr(response, name) for name in _RESPONSE_FIELDS},
        }
        self._write(entry)
        return response


class ReplayProvider:
    """Serves a recording back without any network: each request, the recorded
    outcome of the same request (of those not served yet, the first).

    Args:
        path: A file written by `RecordingProvider`.
        strict: Compare each request with the recorded ones (default): a
            request that none of the attempts not served yet sent raises
            `ReplayMismatchError`. False: serve the recorded attempts in their
            order, whatever is sent.

    Raises:
        ConfigError: the file is missing, cannot be read, is empty, or is not
            a loopengine recording: a line that is not JSON (a file cut
            short), a first line that is not a recording's header, or an
            attempt that is not one, named by its line.
    """

    def __init__(self, path: str | Path, *, strict: bool = True) -> None:
        self.path = _recording_path(path)
        header, entries, outcomes, billings = _load(self.path)
        self.entries: list[dict[str, Any]] = []
        """The recorded attempts, in their order."""
        # How the recorded provider billed each model and features it was sent
        # where that was not the default (`Provider.billing`), the first recorded.
        self._billings: dict[str, Billing] = {}
        for entry, billing in zip(entries, billings, strict=True):
            if billing != DEFAULT_BILLING:
                request = entry["request"]
                self._billings.setdefault(
                    _billing_key(request.get("model"), request.get("features", {})), billing)
        self._outcomes: list[ProviderResponse | ProviderFault | _Cut] = []
        # The recorded refusals before the wire (`check_request`), by request.
        self._refusals: dict[str, collections.deque[ProviderFault]] = {}
        for entry, outcome in zip(entries, outcomes, strict=True):
            if "refused" in entry and isinstance(outcome, ProviderFault):
                self._refusals.setdefault(entry["request_sha256"], collections.deque()).append(
                    outcome)
            else:
                self.entries.append(entry)
                self._outcomes.append(outcome)
        self._name = str(header["provider"])
        # A recording made before the header named them: what the route says.
        self._vendor = str(header.get("vendor") or self._name)
        # A recording begun before requests were recorded with their features
        # and cache policy: each request is compared without them.
        self._earlier = _earlier(header)
        self._operation = str(header.get("genai_operation") or genai_operation_of(self._name))
        self.strict = strict
        self.position = 0
        """How many recorded attempts have been served."""
        self._received = 0
        self._served = [False] * len(self.entries)
        self._first = 0  # no recorded attempt before it is left unserved
        # The recorded attempts not served yet of each request, in their order.
        self._waiting: dict[str, collections.deque[int]] = {}
        for index, entry in enumerate(self.entries):
            self._waiting.setdefault(entry["request_sha256"], collections.deque()).append(index)

    @property
    def name(self) -> str:
        """The recorded provider's route."""
        return self._name

    @property
    def vendor(self) -> str:
        """The recorded provider's vendor, so that a replay is priced and its
        attempts served by (``served_by``) as the recorded run's were."""
        return self._vendor

    @property
    def genai_operation(self) -> str:
        """What the recorded provider's requests are (`Provider.genai_operation`)."""
        return self._operation

    streaming = True
    """The text a recorded attempt handed to ``on_text`` goes to it again, piece by
    piece (a recording made without ``on_text``: each text block of the reply)."""
    inference_geo = None
    """None: each recorded reply's usage names the geo it was served in, if any."""
    features = FEATURES
    """A recording answers whatever was recorded."""

    def billing(self, model: str, features: Features) -> Billing:
        """How the recorded provider billed its requests to ``model`` with
        ``features``, as recorded with them, so that the replay is priced (and
        its credit hold checked, its reservations made) as the recorded run
        was; the default where none was recorded (`Provider.billing`)."""
        # A recording begun without features (`_earlier`) keeps none with a billing.
        table = {} if self._earlier else features_table(features)
        return self._billings.get(_billing_key(model, table), DEFAULT_BILLING)

    def check_ready(self) -> None:
        """Always ready: a recording needs no connection."""

    def check_request(self, request: ProviderRequest) -> None:
        """Refuse a request the recorded provider refused before the wire, as it did.

        Raises:
            ProviderFault: the recorded refusal of this request.
        """
        if self._refusals:
            refusals = self._refusals.get(_digest(request_body(request, earlier=self._earlier)))
            if refusals:
                raise refusals.popleft()

    @property
    def exhausted(self) -> bool:
        """True when every recorded attempt has been served."""
        return self.position >= len(self.entries)

    async def send(self, request: ProviderRequest, *,
                   on_text: TextCallback | None = None) -> ProviderResponse:
        """Serve the recorded outcome of this request: of the recorded attempts
        not served yet that sent the same request, the first. Runs recorded
        concurrently replay whatever order their requests come in; a run's
        retries of one request are served in their recorded order.

        Raises:
            ReplayMismatchError: the request differs from every recorded
                attempt not served yet, or the recording has no more attempts.
            ProviderFault: the recorded attempt failed.
        """
        await anyio.lowlevel.checkpoint()
        self._received += 1
        if self.exhausted:
            raise ReplayMismatchError(
                f"{self.path}: request {self._received} was not recorded "
                f"(the recording holds {len(self.entries)})"
            )
        while self._served[self._first]:
            self._first += 1
        if not self.strict:
            index = self._first
            self._waiting[self.entries[index]["request_sha256"]].remove(index)
        elif waiting := self._waiting.get(
                _digest(body := request_body(request, earlier=self._earlier))):
            index = waiting.popleft()
        else:
            recorded = self.entries[self._first]["request"]
            raise ReplayMismatchError(
                f"{self.path}: request {self._received} differs from the recording "
                f"({_first_difference(_comparable(recorded), _comparable(body))})"
            )
        self._served[index] = True
        self.position += 1
        entry = self.entries[index]
        outcome = self._outcomes[index]
        pieces = entry.get("text")
        if pieces is not None:
            # The text as the recorded attempt handed it, piece by piece (a cut
            # stream's too).
            await hand_text(on_text, [{"type": "text", "text": piece} for piece in pieces])
        elif isinstance(outcome, ProviderResponse):
            # Recorded without ``on_text``: the reply's text blocks.
            await hand_text(on_text, outcome.content)
        if isinstance(outcome, _Cut):
            # The recorded attempt was cut with no answer: what its stream had
            # served goes to the attempt, which is cut as the recorded one was.
            sink = cut_sink()
            if sink is not None and outcome.served is not None:
                sink.keep_served(outcome.served)
            if outcome.by == "timeout":
                raise timed_out(request.timeout)
            if outcome.by == "deadline":
                if sink is not None:
                    # A replay is quicker than its recording: the attempt is
                    # told the deadline cut it, as the recorded one was, and
                    # the run ends on its time limit whatever the clock says.
                    sink.cut_at_deadline()
                    raise timed_out(request.timeout)
                raise ReplayMismatchError(
                    f"{self.path}: request {self._received} was cut by a deadline (the "
                    "run's or its caller's) in the recording, and no deadline can cut it here")
            raise ReplayMismatchError(
                f"{self.path}: request {self._received} was cut by its caller in the "
                "recording (the run was cancelled), which a replay cannot reproduce: the "
                "recorded run ended there")
        if isinstance(outcome, ProviderFault):
            raise outcome
        return outcome


def _load(path: Path) -> tuple[
        dict[str, Any], list[dict[str, Any]], list[ProviderResponse | ProviderFault | _Cut],
        list[Billing]]:
    """The recording at ``path``, read (`_read`)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise ConfigError("path", f"no recording at {path}") from None
    except (OSError, UnicodeDecodeError) as error:  # a directory, no permission, binary
        raise ConfigError("path", f"cannot read the recording {path}: "
                                  f"{getattr(error, 'strerror', None) or error}") from None
    return _read(path, lines)


def _read(path: Path, lines: list[str]) -> tuple[
        dict[str, Any], list[dict[str, Any]], list[ProviderResponse | ProviderFault | _Cut],
        list[Billing]]:
    """The header, the entries, their outcomes and their billings of a recording's
    ``lines``, each entry checked where it is read, so a file cut short, edited
    or not a recording is a `ConfigError` naming the file and the line, not an
    error from deep inside a replayed run."""
    numbered = [(n, line) for n, line in enumerate(lines, start=1) if line.strip()]
    if not numbered:
        raise ConfigError("path", f"{path} is empty, not a loopengine recording")
    (first, line), *attempts = numbered
    header = _json_object(f"{path}, line {first}", line)
    _check_header(f"{path}, line {first}", header)
    entries: list[dict[str, Any]] = []
    outcomes: list[ProviderResponse | ProviderFault | _Cut] = []
    billings: list[Billing] = []
    for n, line in attempts:
        entry = _json_object(f"{path}, line {n}", line)
        try:
            outcomes.append(_outcome(entry))
            billings.append(_billing_from(entry.get("billing", {})))
        except KeyError as error:
            raise ConfigError("path", f"{path}, line {n} is not a recorded attempt: it "
                                      f"has no {error.args[0]!r}") from None
        except (TypeError, ValueError, LoopEngineError) as error:
            raise ConfigError("path", f"{path}, line {n} is not a recorded attempt: "
                                      f"{error}") from None
        entries.append(entry)
    return header, entries, outcomes, billings


def _json_object(where: str, line: str) -> dict[str, Any]:
    """One line of a recording, a JSON object."""
    try:
        value = json.loads(line)
    except json.JSONDecodeError as error:
        raise ConfigError("path", f"{where} is not JSON ({error.msg}, column {error.colno}): "
                                  "not a loopengine recording, or one cut short") from None
    if not isinstance(value, dict):
        raise ConfigError("path", f"{where} is not a JSON object: not a loopengine recording")
    return value


def _check_header(where: str, header: Mapping[str, Any]) -> None:
    """Refuse a first line that is not a recording's header of this version."""
    if header.get("format") != FORMAT:
        raise ConfigError("path", f"{where} is not a loopengine recording's first line")
    if header.get("version") != VERSION:
        raise ConfigError("path", f"{where}: recording version "
                                  f"{_validate.shown(header.get('version'))} is not {VERSION}")
    if not isinstance(header.get("provider"), str):
        raise ConfigError("path", f"{where} names no provider")


def _outcome(entry: Mapping[str, Any]) -> ProviderResponse | ProviderFault | _Cut:
    """The response or the fault a recorded attempt holds (a `KeyError`,
    `TypeError`, `ValueError` or `ConfigError` for an entry that is not one)."""
    if not isinstance(entry["request"], dict) or not isinstance(entry["request_sha256"], str):
        raise TypeError("its request is not an object with its SHA-256")
    text = entry.get("text", [])
    if not isinstance(text, list) or not all(isinstance(piece, str) for piece in text):
        raise TypeError("its text is not a list of strings")
    if "fault" in entry or "refused" in entry:
        return _fault_from(entry.get("fault") or entry["refused"])
    if "cut" in entry:
        by = entry.get("cut_by", "timeout")
        if by not in _CUT_BY:
            raise ValueError(f"its cut_by is not one of {', '.join(_CUT_BY)}")
        return _Cut(None if entry["cut"] is None else _fault_from(entry["cut"]), by)
    recorded = entry["response"]
    usage = recorded.get("usage")
    return ProviderResponse(
        content=recorded["content"],
        usage=usage_from_json(usage) if usage else None,
        # The code execution container the reply named, so that the replayed
        # run sends it on as the recorded one did.
        container=Container.from_json(recorded.get("container")),
        # A recording made before a field existed holds its default.
        **{name: recorded[name] for name in _RESPONSE_FIELDS if name in recorded},
    )


def _billing_from(recorded: object) -> Billing:
    """The `Billing` that `RecordingProvider._request_json` wrote (none: the
    default, as a request billed as its usage says was recorded)."""
    if not isinstance(recorded, dict):
        raise TypeError("its billing is not an object")
    return Billing(**recorded)


def _fault_from(recorded: Mapping[str, Any]) -> ProviderFault:
    """The `ProviderFault` that `RecordingProvider._fault_json` wrote."""
    fields = dict(recorded)
    kind, message = fields.pop("kind"), fields.pop("message")
    usage = fields.pop("usage", None)
    return ProviderFault(kind, message, usage=usage_from_json(usage) if usage else None,
                         **fields)


@dataclasses.dataclass(frozen=True, slots=True)
class _Cut:
    """A recorded attempt a cancellation cut before it was answered."""

    served: ProviderFault | None
    """What its stream had served by then, if anything."""
    by: str = "timeout"
    """What cut it (`ServedSink.cut_by`): ``timeout``, its own timeout (also a
    cut recorded before cuts named what cut them); ``deadline``, its timeout
    capped at a deadline; ``caller``, the run's cancellation."""


class _KeptCut:
    """Passes what a cut stream had served on to the attempt's sink (`cut_sink`),
    keeping it for the recording."""

    def __init__(self, sink: ServedSink | None) -> None:
        self.sink = sink
        self.served: ProviderFault | None = None

    def keep_served(self, cut: ProviderFault) -> None:
        """Keep what the stream had served, and pass it on."""
        self.served = cut
        if self.sink is not None:
            self.sink.keep_served(cut)

    def cut_by(self) -> str:
        """What the cut is, as the attempt says (`ServedSink.cut_by`); ``caller``
        with no attempt to ask (a send outside the engine)."""
        return "caller" if self.sink is None else self.sink.cut_by()

    def cut_at_deadline(self) -> None:
        """Pass on to the attempt that the deadline cut it (`ServedSink`)."""
        if self.sink is not None:
            self.sink.cut_at_deadline()


def _first_difference(recorded: Any, sent: Any, where: str = "request") -> str:
    """Where two JSON values first differ, for the mismatch message (no values shown)."""
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
