"""What a paused run hands back: its pending calls, the decisions on them, and
its `RunState` (docs/pause-and-resume.md).

A `RunState` is data, not code: the transcript, the operation and limits the
run was admitted under, who it is accounted to, and the progress a resume
needs. Tools, judges and the output model are code: the caller passes them
to `Engine.resume` again. It never holds keys or providers. It is encoded as
versioned JSON (`RunState.dumps`), so another process, or another host, can
resume the run; `RunState.loads` refuses anything it did not write.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any, Literal, get_args

from loopengine import _validate
from loopengine._attribution import Attribution
from loopengine._errors import ConfigError
from loopengine._features import Features, features_from_table, features_table
from loopengine._operation import Operation
from loopengine._usage import Usage, usage_from_json, usage_json
from loopengine._validate import field_values
from loopengine.guards._limits import Limits
from loopengine.providers._base import Container
from loopengine.providers._retry import RetryPolicy

__all__ = ["Approve", "Decision", "Deny", "PendingCall", "RunState", "Supply", "json_digest"]

FORMAT = "loopengine.run_state"
"""The ``format`` every encoded state carries."""
VERSION = 1
"""The encoding this code writes and reads."""


PendingReason = Literal["approval", "in_doubt"]
"""Why a pending call waits (`PendingCall.reason`)."""


@dataclass(frozen=True, slots=True)
class PendingCall:
    """A tool call of a paused run that waits for a decision."""

    id: str
    """The call's id (``tool_use`` id): the key of `Engine.resume`'s ``decisions``."""
    tool: str
    """The tool's name."""
    input: Any
    """The input the model gave, as it gave it (not yet validated)."""
    reason: PendingReason = "approval"
    """Why it waits: its tool asks for approval (``approval``), or, after a
    crash, it may have run (``in_doubt``)."""


@dataclass(frozen=True, slots=True)
class Approve:
    """Run the call."""


@dataclass(frozen=True, slots=True)
class Deny:
    """Do not run the call: the model gets an ``is_error`` result with ``reason``."""

    reason: str = "The call was denied."
    """What the model is told."""

    def __post_init__(self) -> None:
        _validate.text("reason", self.reason)


@dataclass(frozen=True, slots=True)
class Supply:
    """Do not run the call: the model gets ``text`` as its result."""

    text: str
    """The tool output the model is given."""

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise ConfigError("text", f"must be text, got {_validate.shown(self.text)}")
        if self.text:
            _validate.text("text", self.text)  # sendable: no lone surrogate


Decision = Approve | Deny | Supply
"""A decision on one pending call."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Progress:
    """What a paused run had done (internal). A resume with a ledger enforces
    the ledger's counts, not these."""

    turns: int
    tool_calls: int
    credits: int
    attempts: int
    cost_nanousd: int
    provider_cost_nanousd: int
    usage: Usage
    running_seconds: float
    """Time the run ran before its pause (``total_time`` counts only this)."""
    descendant_credits: int = 0
    """Credits of the runs it delegated to (sub-agents), theirs included: its
    credit hold and its account count them with its own."""
    turn_input_tokens: int = 0
    """The last turn's (whose calls wait) input tokens, cached included: the
    accounting its calls' events carry when they run in the next segment."""
    turn_output_tokens: int = 0
    """The last turn's output tokens."""
    turn_cost_nanousd: int = 0
    """The last turn's charged cost."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunState:
    """A paused run, enough to resume it anywhere (`Engine.resume`).

    Encode it with `dumps`, decode it with `loads`; ``invocation_id`` names
    the run in the ledger. It holds the conversation (the transcript), so
    store it where conversation text may be kept.
    """

    invocation_id: str
    """The run's invocation id: the same in every segment."""
    operation: Operation
    """The operation the run was started with."""
    limits: Limits
    """The run's limits as asked (before its account's admission narrowed them)."""
    retry: RetryPolicy
    """The run's retry policy."""
    attribution: Attribution
    """Who the run is accounted to."""
    system: list[dict[str, Any]] | None
    """The system prompt blocks."""
    messages: list[dict[str, Any]]
    """The transcript up to the paused reply (its calls have no results yet)."""
    given: int
    """How many of ``messages`` the caller gave at the start."""
    final_tool: str
    """The terminal tool's name (structured mode)."""
    structured: bool
    """Whether the run was started with an ``output`` model."""
    output_digest: str | None
    """The sha256 (hex) of the terminal tool's definition as the run sent it
    (its name and the output model's JSON schema), so a resume can tell
    another model from the run's; None without an output model, or in a state
    encoded before it was kept."""
    tools: tuple[str, ...] | None
    """The names of the tools the run was given, so a resume can tell one
    missing; None in a state encoded before they were kept (unknown)."""
    features: Features | None
    """The run's request features (its operation's, as ``run(features=...)``
    narrowed them), which its resumed requests send again; None in a state
    encoded before they were kept (its operation's)."""
    pending: tuple[PendingCall, ...]
    """The calls waiting for a decision."""
    batch: tuple[str, ...]
    """The ids of every call of the paused batch, in order (the pending ones among them)."""
    results: list[dict[str, Any]]
    """Tool results the paused reply already has (a rejected answer's feedback)."""
    repair: bool
    """Whether the next turn is a repair turn."""
    answered_calls: dict[str, int]
    """Calls of each tool that ran its handler (for ``max_calls``)."""
    progress: Progress
    """Counts at the pause (a ledger's rows win over them)."""
    paused_at: datetime
    """When the run paused (UTC)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Room for later versions' fields (kept, not read)."""
    container: Container | None = None
    """The code execution container the run's replies last named (its id and
    expiry), which its resumed requests send again while it has not expired;
    None without one (or in a state encoded before it was kept)."""

    def dumps(self) -> bytes:
        """The state as versioned JSON bytes (no keys, no code)."""
        encoded = self._encoded()
        try:
            return json.dumps(encoded, ensure_ascii=False, separators=(",", ":")).encode()
        except UnicodeEncodeError:
            # A lone surrogate (a model's reply may carry one, escaped in its
            # JSON): escaped again here, which `loads` reads back the same.
            return json.dumps(encoded, separators=(",", ":")).encode()

    def _encoded(self) -> dict[str, Any]:
        """The state as JSON values (what `dumps` encodes). Without a container,
        no ``container`` key: a state encoded before it was kept keeps its seal."""
        operation = self.operation
        container = {} if self.container is None else {"container": self.container.to_json()}
        return {
            "format": FORMAT,
            "version": VERSION,
            "invocation_id": self.invocation_id,
            "operation": {
                "name": operation.name, "version": operation.version,
                "provider": operation.provider, "model": operation.model,
                "max_output_tokens": operation.max_output_tokens,
                "model_max_output_tokens": operation.model_max_output_tokens,
                "wrap_up_text": operation.wrap_up_text,
                "limits": field_values(operation.limits), "retry": field_values(operation.retry),
                "cache": field_values(operation.cache), **features_table(operation),
            },
            "limits": field_values(self.limits),
            "retry": field_values(self.retry),
            "attribution": field_values(self.attribution),
            "system": self.system,
            "messages": self.messages,
            "given": self.given,
            "final_tool": self.final_tool,
            "structured": self.structured,
            "output_digest": self.output_digest,
            "tools": None if self.tools is None else list(self.tools),
            "features": None if self.features is None else features_table(self.features),
            "pending": [[p.id, p.tool, p.input, p.reason] for p in self.pending],
            "batch": list(self.batch),
            "results": self.results,
            "repair": self.repair,
            "answered_calls": self.answered_calls,
            "progress": {**field_values(self.progress),
                         "usage": usage_json(self.progress.usage)},
            "paused_at": self.paused_at.isoformat(),
            "extra": self.extra,
            **container,
        }

    @classmethod
    def loads(cls, data: bytes | str) -> RunState:
        """Decode a state `dumps` wrote.

        Raises:
            ConfigError: ``data`` is not a state this version of loopengine
                wrote (not JSON, another format, a newer version, a missing
                or mistyped field).
        """
        try:
            raw = json.loads(data)
        except (ValueError, TypeError) as error:
            raise ConfigError("state", f"is not a loopengine run state: {error}") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise ConfigError("state", "is not a loopengine run state")
        if raw.get("version") != VERSION:
            version = _validate.shown(raw.get("version"))
            raise ConfigError("state", f"has version {version}; this loopengine reads "
                                       f"version {VERSION}")
        try:
            op = dict(raw["operation"])
            name = op.pop("name")
            progress = dict(raw["progress"])
            usage = usage_from_json(progress.pop("usage"))
            state = cls(
                invocation_id=_text(raw["invocation_id"]),
                operation=Operation.from_mapping(_text(name), op),
                limits=Limits.from_mapping(raw["limits"]),
                retry=RetryPolicy.from_mapping(raw["retry"]),
                attribution=Attribution(**raw["attribution"]),
                system=_blocks(raw["system"], optional=True),
                messages=_messages(raw["messages"]),
                given=int(raw["given"]),
                final_tool=_text(raw["final_tool"]),
                structured=bool(raw["structured"]),
                # Absent from a state encoded before they were kept: unknown.
                output_digest=_optional_text(raw.get("output_digest")),
                tools=None if raw.get("tools") is None else tuple(
                    _text(name) for name in _list(raw["tools"])),
                features=None if raw.get("features") is None else features_from_table(
                    raw["features"]),
                pending=tuple(PendingCall(_text(i), _text(t), v, r)
                              for i, t, v, r in raw["pending"]),
                batch=tuple(_text(i) for i in raw["batch"]),
                results=_blocks(raw["results"]),
                repair=bool(raw["repair"]),
                answered_calls={_text(k): int(v) for k, v in raw["answered_calls"].items()},
                progress=_progress(Progress(usage=usage, **progress)),
                paused_at=datetime.fromisoformat(raw["paused_at"]),
                extra=dict(raw.get("extra") or {}),
                container=Container.from_json(raw.get("container"), strict=True),
            )
        except ConfigError as error:
            raise ConfigError("state", f"holds a bad value: {error}") from None
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ConfigError("state", f"is damaged ({type(error).__name__}: {error})") \
                from None
        if state.paused_at.tzinfo is None:
            raise ConfigError("state", f"has paused_at {raw['paused_at']!r} without a UTC "
                                       "offset")
        last = state.messages[-1] if state.messages else {}
        if state.batch and (last.get("role") != "assistant"
                            or not isinstance(last.get("content"), list)):
            raise ConfigError("state", "has a batch of tool calls, but its transcript does "
                                       "not end with the reply that asked for them")
        for call in state.pending:
            if call.reason not in get_args(PendingReason):
                raise ConfigError("state", f"pending call {call.id} has reason {call.reason!r}")
        return state

    def seal(self) -> str:
        """The state's seal: a SHA-256 digest of everything a resume takes from
        it (the transcript, the batch and its pending calls, the operation,
        limits and attribution, the calls each tool has made, the running
        time, its sub-agents' credits), apart from the counts a ledger keeps
        itself on the run's own row (turns, tool calls,
        credits, attempts, cost, usage), the time of the pause and ``extra``.

        A ledger keeps the seal of each paused invocation, and a resume must
        hand back a state with that seal: an earlier pause's state, another
        run's, or one edited in what the ledger cannot check, is refused."""
        encoded = self._encoded()
        del encoded["paused_at"], encoded["extra"]
        encoded["progress"] = {"running_seconds": self.progress.running_seconds,
                               "descendant_credits": self.progress.descendant_credits}
        return json_digest(encoded)


def json_digest(value: Any) -> str:
    """The SHA-256 (hex) of ``value`` as JSON, its keys sorted and every
    character beyond ASCII escaped (a lone surrogate too): equal for equal
    values, however they were built."""
    text = json.dumps(value, separators=(",", ":"), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected text, got {type(value).__name__}")
    return value


def _optional_text(value: object) -> str | None:
    return None if value is None else _text(value)


def _list(value: object) -> list[Any]:
    if not isinstance(value, list):
        raise TypeError(f"expected a list, got {type(value).__name__}")
    return value


def _blocks(value: object, *, optional: bool = False) -> Any:
    """A list of JSON objects (content blocks), or None when ``optional``."""
    if value is None and optional:
        return None
    for item in _list(value):
        if not isinstance(item, dict):
            raise TypeError(f"expected a JSON object, got {type(item).__name__}")
    return value


def _messages(value: object) -> list[Any]:
    """A transcript: messages of a ``role`` and a ``content`` (text or blocks)."""
    for message in _list(value):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise TypeError("expected a message of role 'user' or 'assistant', got "
                            f"{_validate.shown(message)}")
        if not isinstance(message.get("content"), str):
            _blocks(message.get("content"))
    return _list(value)


def _progress(progress: Progress) -> Progress:
    """``progress`` once each count is checked: non-negative integers, and seconds."""
    for name in (f.name for f in fields(progress)):
        if name == "running_seconds":
            _validate.seconds("progress.running_seconds", progress.running_seconds,
                              positive=False)
        elif name != "usage":
            _validate.integer(f"progress.{name}", getattr(progress, name), minimum=0)
    return progress


def check_decisions(pending: tuple[PendingCall, ...],
                    decisions: Mapping[str, Decision] | None) -> dict[str, Decision]:
    """The decisions for ``pending``, each call decided and nothing else.

    Raises:
        ConfigError: a pending call without a decision, a decision for a call
            that is not pending, or a value that is not a decision.
    """
    given = dict(decisions or {})
    ids = {call.id for call in pending}
    for key, value in given.items():
        if key not in ids:
            raise ConfigError(f"decisions[{key!r}]", "names no pending call of this run "
                                                    f"(pending: {', '.join(sorted(ids))})")
        if not isinstance(value, Approve | Deny | Supply):
            raise ConfigError(f"decisions[{key!r}]", "must be Approve(), Deny(reason) or "
                                                    f"Supply(text), got {_validate.shown(value)}")
    missing = [call.id for call in pending if call.id not in given]
    if missing:
        raise ConfigError("decisions", f"no decision for pending call(s) {', '.join(missing)}")
    return given
