"""`Operation`: the published definition of one AI use, and the TOML catalogue."""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from loopengine import _validate
from loopengine._errors import ConfigError
from loopengine._features import Features, ServerTool, Thinking, check_features
from loopengine.guards._limits import Limits
from loopengine.providers._cache import CachePolicy
from loopengine.providers._retry import RetryPolicy

__all__ = ["DEFAULT_WRAP_UP_TEXT", "Operation", "load_operations"]

DEFAULT_WRAP_UP_TEXT = (
    "This is your last turn: tools are no longer available. Give your best final "
    "answer now from what you have gathered so far."
)
"""The wrap-up instruction an operation uses unless it publishes its own."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Operation:
    """One published AI use: its route, its ceilings and its policies.

    A run of an operation may narrow its limits, never widen them, and can
    never change its route (R13): the engine serves ``provider``/``model`` and
    nothing else, even when that route fails.
    """

    name: str
    """The operation's name, e.g. ``teammate.answer``; recorded on every invocation."""
    provider: str
    """The route: the name of the provider that serves it (``anthropic``)."""
    model: str
    """The model id on that route."""
    max_output_tokens: int = 1024
    """``max_tokens`` of each request of a run, and of a structured call's first
    request (its truncation retries double it up to the growth ceiling:
    ``model_max_output_tokens``, else four times the first request)."""
    version: str = "1"
    """The published version; recorded with each invocation."""
    limits: Limits = field(default_factory=Limits)
    """The conversation's bounds."""
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    """The retry policy of each turn."""
    cache: CachePolicy = field(default_factory=CachePolicy)
    """Where prompt-cache markers go."""
    model_max_output_tokens: int | None = None
    """The model's own output limit, if known; ``max_tokens`` never exceeds it."""
    wrap_up_text: str = DEFAULT_WRAP_UP_TEXT
    """What a wrap-up turn (``Limits(wrap_up=True)``) adds to the conversation."""
    thinking: Thinking | None = None
    """Anthropic extended thinking (a budget, or adaptive with an effort); None: off."""
    server_tools: tuple[ServerTool, ...] = ()
    """Tools the provider runs itself (web search, web fetch, code execution...),
    each with its ``max_uses``; their per-request fees are priced (docs/pricing.md)."""
    betas: tuple[str, ...] = ()
    """Anthropic beta headers the requests send (``anthropic-beta``)."""
    context_management: Mapping[str, Any] | None = None
    """Anthropic's ``context_management`` object (compaction, context editing), sent
    as given; it must be a JSON object."""
    reasoning_effort: str | None = None
    """OpenAI's ``reasoning_effort`` (``none`` ... ``xhigh``); None: the API's default."""
    service_tier: str | None = None
    """OpenAI's ``service_tier`` (``auto``, ``default``, ``flex``, ``scale``,
    ``priority``); None: the API's default. It changes the price."""
    web_search_options: Mapping[str, Any] | None = None
    """OpenAI Chat Completions' ``web_search_options`` for a search model
    (``search_context_size``, ``user_location``), sent as given; it must be a
    JSON object. None: the API's defaults (the model searches all the same)."""

    def __post_init__(self) -> None:
        # Recorded on every invocation and printed by the audit.
        _validate.recorded_name("name", self.name)
        _validate.recorded_name("provider", self.provider)
        _validate.recorded_name("model", self.model, max_length=1024)  # an ARN, a path
        if self.model != self.model.strip():
            # "anthropic: claude-..." would ask the API for the model " claude-...".
            raise ConfigError("model", f"{_validate.shown(self.model)} has whitespace around "
                                       f"it: the model id is {_validate.shown(self.model.strip())}")
        _validate.recorded_name("version", self.version)
        _validate.text("wrap_up_text", self.wrap_up_text)
        _validate.integer("max_output_tokens", self.max_output_tokens, minimum=1)
        _validate.integer("model_max_output_tokens", self.model_max_output_tokens, minimum=1,
                          optional=True)
        for name, kind in (("limits", Limits), ("retry", RetryPolicy), ("cache", CachePolicy)):
            if not isinstance(getattr(self, name), kind):
                raise ConfigError(name, f"must be a {kind.__name__}, "
                                        f"got {_validate.shown(getattr(self, name))}")
        check_features(self)

    def __hash__(self) -> int:
        # ``context_management`` and ``web_search_options`` are mappings; hash the
        # operation by its features' hash.
        return hash((self.name, self.version, self.route, self.features))

    @property
    def route(self) -> str:
        """``provider:model``, as recorded in ``served_by``."""
        return f"{self.provider}:{self.model}"

    @property
    def features(self) -> Features:
        """The request features this operation publishes (part of its route, R13)."""
        return Features(
            thinking=self.thinking, server_tools=self.server_tools, betas=self.betas,
            context_management=self.context_management,
            reasoning_effort=self.reasoning_effort, service_tier=self.service_tier,
            web_search_options=self.web_search_options,
        )

    @property
    def output_ceiling(self) -> int:
        """The most ``max_tokens`` any request of this operation may ask for."""
        if self.model_max_output_tokens is None:
            return self.max_output_tokens
        return min(self.max_output_tokens, self.model_max_output_tokens)

    @classmethod
    def from_model(cls, model: str, **fields: Any) -> Operation:
        """The default operation of ``"vendor:model"`` (``"anthropic:claude-sonnet-4-5"``):
        named after it, on the route ``vendor``, with ``max_output_tokens=4096`` and
        the default `Limits`, `RetryPolicy` and `CachePolicy`; ``fields`` override any
        of them (``limits=le.Limits(max_turns=4)``).

        Raises:
            ConfigError: ``model`` is not ``"vendor:model"`` of a known vendor.
        """
        from loopengine._short import operation_from_model

        return operation_from_model(model, **fields)

    @classmethod
    def from_mapping(cls, name: str, values: Mapping[str, Any]) -> Operation:
        """Build an operation from a catalogue table; unknown keys are errors.

        Raises:
            ConfigError: with the field relative to the table (``limits.max_turns``).
        """
        # Every field but the name, which is the table's own.
        known = [item.name for item in fields(cls) if item.name != "name"]
        _validate.known_keys("operation", values, known, "an operation setting")
        args: dict[str, Any] = {k: v for k, v in values.items()
                                if k not in ("limits", "retry", "cache")}
        if "version" in args and isinstance(args["version"], int):
            args["version"] = str(args["version"])
        for key, build in (("limits", Limits.from_mapping), ("retry", RetryPolicy.from_mapping),
                           ("cache", _cache_from_mapping)):
            if key in values:
                table = values[key]
                if not isinstance(table, Mapping):
                    raise ConfigError(key, f"must be a table, got {_validate.shown(table)}")
                try:
                    args[key] = build(table)
                except ConfigError as error:
                    raise error.with_prefix(key) from None
        if "thinking" in values:
            table = values["thinking"]
            if not isinstance(table, Mapping):
                raise ConfigError("thinking", f"must be a table, got {_validate.shown(table)}")
            try:
                args["thinking"] = Thinking.from_mapping(table)
            except ConfigError as error:
                raise error.with_prefix("thinking") from None
        if "server_tools" in values:
            args["server_tools"] = _server_tools_from_list(values["server_tools"])
        if isinstance(args.get("betas"), list):
            args["betas"] = tuple(args["betas"])
        for required in ("provider", "model"):
            if required not in args:
                raise ConfigError(required, "is required")
        return cls(name=name, **args)


def _server_tools_from_list(values: object) -> tuple[ServerTool, ...]:
    if not isinstance(values, list):
        raise ConfigError("server_tools", "must be an array of tables, got "
                                          f"{_validate.shown(values)}")
    tools = []
    for i, table in enumerate(values):
        if not isinstance(table, Mapping):
            raise ConfigError(f"server_tools[{i}]",
                              f"must be a table, got {_validate.shown(table)}")
        try:
            tools.append(ServerTool.from_mapping(table))
        except ConfigError as error:
            raise error.with_prefix(f"server_tools[{i}]") from None
    return tuple(tools)


def _cache_from_mapping(values: Mapping[str, Any]) -> CachePolicy:
    _validate.known_keys("cache", values, ("system", "tools", "conversation", "ttl"),
                         "a cache setting")
    return CachePolicy(**values)


def load_operations(path: str | Path) -> dict[str, Operation]:
    """Read a TOML catalogue of operations: one ``[operations."<name>"]`` table each.

    Example::

        [operations."teammate.answer"]
        version = "3"
        provider = "anthropic"
        model = "claude-sonnet-4-5"
        max_output_tokens = 1024
        limits = { max_turns = 6, credit_hold = 500 }
        retry = { max_attempts = 3 }
        thinking = { budget_tokens = 2048 }
        betas = ["compact-2026-01-12"]
        context_management = { edits = [{ type = "compact_20260112" }] }

        [[operations."teammate.answer".server_tools]]
        type = "web_search_20250305"
        name = "web_search"
        max_uses = 5
        params = { allowed_domains = ["example.com"] }

    Returns:
        The operations by name.

    Raises:
        ConfigError: the file is missing, is not TOML, or a value is wrong. The
            field names the operation and the key
            (``operations.teammate.answer.limits.max_turns``) and the message
            names the file.
    """
    where = Path(_validate.file_path("path", path))
    try:
        data = tomllib.loads(where.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError("path", f"no operations catalogue at {where}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError("path", f"cannot read {where}: {error}") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError("path", f"{where} is not valid TOML: {error}") from None
    unknown = set(data) - {"operations"}
    if unknown:
        raise ConfigError(sorted(unknown)[0], f"{where}: unknown top-level key; operations go "
                                              'under [operations."<name>"]')
    table = data.get("operations", {})
    if not isinstance(table, Mapping):
        raise ConfigError("operations", f"{where}: must be a table of operations")
    operations: dict[str, Operation] = {}
    for name, values in table.items():
        if not isinstance(values, Mapping):
            raise ConfigError(f"operations.{name}", f"{where}: must be a table")
        try:
            operations[name] = Operation.from_mapping(name, values)
        except ConfigError as error:
            raise ConfigError(f"operations.{name}.{error.field}",
                              f"{error.message} (in {where})") from None
    return operations
