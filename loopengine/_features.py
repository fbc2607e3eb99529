"""Request features an operation publishes: thinking, server tools, betas, context
management, OpenAI reasoning effort and service tier, and a Chat Completions
search model's web search options (docs/pricing.md).

They are part of the operation's published route (R13): a run may use fewer
of them or lower a number (a tool's ``max_uses``, a thinking budget, a
reasoning effort), never add one or raise a number. `narrow_features` is that
rule, written once. Unlike a limit, which is a ceiling and is clamped, a
feature asked for beyond what is published is refused with `ConfigError`: a
caller who asks for a tool or a budget the operation does not publish has
made a mistake that clamping would hide.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final

from loopengine import _validate
from loopengine._errors import ConfigError

__all__ = [
    "REASONING_EFFORTS",
    "SERVICE_TIERS",
    "THINKING_EFFORTS",
    "Features",
    "ServerTool",
    "Thinking",
    "check_features",
    "check_server_tool_names",
    "enabled_features",
    "features_from_table",
    "features_table",
    "is_web_search",
    "narrow_features",
]

THINKING_EFFORTS: Final = ("low", "medium", "high")
"""Anthropic adaptive thinking's ``effort``, lowest first."""

REASONING_EFFORTS: Final = ("none", "minimal", "low", "medium", "high", "xhigh")
"""OpenAI's ``reasoning_effort`` values, lowest first."""

SERVICE_TIERS: Final = ("auto", "default", "flex", "scale", "priority")
"""OpenAI's ``service_tier`` values."""

_OBJECTS: Final = ("context_management", "web_search_options")
"""The features that are JSON objects sent as given."""

_MIN_THINKING_BUDGET: Final = 1024
"""The smallest ``budget_tokens`` the Messages API accepts."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Thinking:
    """Anthropic extended thinking: a token budget, or adaptive thinking with an effort.

    ``Thinking(budget_tokens=2048)`` sends ``{"type": "enabled", "budget_tokens":
    2048}``; ``Thinking(adaptive=True, effort="medium")`` sends ``{"type":
    "adaptive"}`` with the effort. Thinking tokens are billed as output.
    """

    budget_tokens: int | None = None
    """Tokens the model may think with (>= 1024); None with ``adaptive``."""
    adaptive: bool = False
    """Let the model decide how much to think (no budget)."""
    effort: str | None = None
    """With ``adaptive``: ``"low"``, ``"medium"`` or ``"high"``; None: the API's default."""

    def __post_init__(self) -> None:
        _validate.boolean("adaptive", self.adaptive)
        if self.adaptive:
            if self.budget_tokens is not None:
                raise ConfigError("budget_tokens", "adaptive thinking takes no budget_tokens")
            if self.effort is not None and self.effort not in THINKING_EFFORTS:
                raise ConfigError("effort", f"must be one of {', '.join(THINKING_EFFORTS)}, "
                                            f"got {_validate.shown(self.effort)}")
            return
        if self.effort is not None:
            raise ConfigError("effort", "only adaptive thinking takes an effort")
        if self.budget_tokens is None:
            raise ConfigError("budget_tokens", "is required unless adaptive=True")
        _validate.integer("budget_tokens", self.budget_tokens, minimum=_MIN_THINKING_BUDGET)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> Thinking:
        """Build from a mapping (a TOML table); unknown keys are errors."""
        _validate.known_keys("thinking", values, cls.__dataclass_fields__, "a thinking setting")
        return cls(**values)


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerTool:
    """A tool the provider runs itself (Anthropic's web search, web fetch, code
    execution, advisor, or any other type the vendor documents).

    It is sent as ``{"type": type, "name": name, "max_uses": max_uses, **params}``
    (without ``max_uses`` when it is None).
    """

    type: str
    """The versioned tool type, e.g. ``web_search_20250305``, ``web_fetch_20250910``,
    ``code_execution_20250825``."""
    name: str
    """The tool's name in the conversation, e.g. ``web_search``; unique per operation."""
    max_uses: int | None = None
    """The most times one request may use it (>= 1); None: the API's default.
    The worst case of its fees is counted from it (`Engine.estimate`, and an
    account's reservation)."""
    params: Mapping[str, Any] = field(default_factory=dict)
    """Further keys of the tool's definition, passed through as given
    (``allowed_domains``, ``user_location``, an advisor's ``model``...): a JSON object."""

    def __post_init__(self) -> None:
        _validate.text("type", self.type)
        _validate.text("name", self.name)
        _validate.integer("max_uses", self.max_uses, minimum=1, optional=True)
        params = _json_object("params", self.params)
        for key in ("type", "name", "max_uses"):
            if key in params:
                raise ConfigError(f"params.{key}", f"is a field of ServerTool: give {key}= itself")
        # A private copy (the caller's dict is not shared); a plain dict rather
        # than a read-only proxy so that the tool pickles and deep-copies.
        object.__setattr__(self, "params", params)

    def __hash__(self) -> int:
        return hash((self.type, self.name, self.max_uses, _canonical(dict(self.params))))

    @property
    def definition(self) -> dict[str, Any]:
        """The tool's definition as the Messages API takes it."""
        body: dict[str, Any] = {"type": self.type, "name": self.name}
        if self.max_uses is not None:
            body["max_uses"] = self.max_uses
        body.update(json.loads(json.dumps(dict(self.params))))
        return body

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> ServerTool:
        """Build from a mapping (a TOML table); unknown keys are errors."""
        _validate.known_keys("server_tool", values, cls.__dataclass_fields__,
                             "a server tool setting")
        return cls(**values)


@dataclass(frozen=True, slots=True, kw_only=True)
class Features:
    """The request features of one operation, or of one run of it (narrowed)."""

    thinking: Thinking | None = None
    """Anthropic extended thinking, or None."""
    server_tools: tuple[ServerTool, ...] = ()
    """Tools the provider runs itself."""
    betas: tuple[str, ...] = ()
    """Anthropic beta headers (``anthropic-beta``)."""
    context_management: Mapping[str, Any] | None = None
    """Anthropic's ``context_management`` object (compaction, context editing), as given."""
    reasoning_effort: str | None = None
    """OpenAI's ``reasoning_effort``."""
    service_tier: str | None = None
    """OpenAI's ``service_tier``."""
    web_search_options: Mapping[str, Any] | None = None
    """OpenAI Chat Completions' ``web_search_options`` object (a search model's
    ``search_context_size``, ``user_location``), as given."""

    def __post_init__(self) -> None:
        check_features(self)

    def __hash__(self) -> int:
        return hash((self.thinking, self.server_tools, self.betas,
                     _canonical(self.context_management), self.reasoning_effort,
                     self.service_tier, _canonical(self.web_search_options)))


def check_features(features: Any) -> None:
    """Validate (and freeze) the feature fields of ``features`` in place.

    ``features`` is a `Features` or an `Operation`, which carries the same
    fields under the same names; each error names the field
    (``server_tools[0].max_uses``).
    """
    thinking = features.thinking
    if thinking is not None and not isinstance(thinking, Thinking):
        raise ConfigError(
            "thinking",
            f"must be a Thinking or None, got {_validate.shown(thinking)}")
    tools = features.server_tools
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
        raise ConfigError(
            "server_tools",
            f"must be a sequence of ServerTool, got {_validate.shown(tools)}")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, ServerTool):
            raise ConfigError(
                f"server_tools[{i}]",
                f"must be a ServerTool, got {_validate.shown(tool)}")
        if tool.name in names:
            raise ConfigError(f"server_tools[{i}].name", f"{tool.name!r} is given twice")
        names.add(tool.name)
    object.__setattr__(features, "server_tools", tuple(tools))
    betas = features.betas
    if isinstance(betas, (str, bytes)) or not isinstance(betas, Sequence):
        raise ConfigError("betas", f"must be a sequence of strings, got {_validate.shown(betas)}")
    for i, beta in enumerate(betas):
        _validate.text(f"betas[{i}]", beta)
    object.__setattr__(features, "betas", tuple(betas))
    for name in _OBJECTS:
        if getattr(features, name) is not None:
            object.__setattr__(features, name, _json_object(name, getattr(features, name)))
    _choice("reasoning_effort", features.reasoning_effort, REASONING_EFFORTS)
    _choice("service_tier", features.service_tier, SERVICE_TIERS)


def features_table(features: Any) -> dict[str, Any]:
    """The feature fields of ``features`` (a `Features` or an `Operation`) as
    JSON values, the ones switched off left out: what `features_from_table`
    and `Operation.from_mapping` read back."""
    table: dict[str, Any] = {}
    if features.thinking is not None:
        table["thinking"] = _validate.field_values(features.thinking)
    if features.server_tools:
        # The params copied: the table is the caller's, the tool's own dict is not.
        table["server_tools"] = [{**_validate.field_values(t), "params": dict(t.params)}
                                 for t in features.server_tools]
    if features.betas:
        table["betas"] = list(features.betas)
    for name in ("context_management", "reasoning_effort", "service_tier",
                 "web_search_options"):
        value = getattr(features, name)
        if value is not None:
            table[name] = dict(value) if name in _OBJECTS else value
    return table


def features_from_table(table: Mapping[str, Any]) -> Features:
    """The `Features` that `features_table` wrote (what it left out: off).

    Raises:
        ConfigError: a key or value no feature takes.
    """
    _validate.known_keys("features", table, Features.__dataclass_fields__, "a request feature")
    values = dict(table)
    if values.get("thinking") is not None:
        values["thinking"] = Thinking.from_mapping(values["thinking"])
    values["server_tools"] = tuple(ServerTool.from_mapping(t)
                                   for t in values.get("server_tools") or ())
    values["betas"] = tuple(values.get("betas") or ())
    return Features(**values)


def enabled_features(features: Features) -> tuple[str, ...]:
    """The names of the features ``features`` enables (of ``Features``' fields, in
    their order): what a provider must be able to send (`Provider.features`)."""
    return tuple(name for name in Features.__dataclass_fields__ if getattr(features, name))


def is_web_search(tool_type: str) -> bool:
    """Whether a server tool ``type`` is a web search, billed per search: Anthropic's
    versioned ``web_search_...`` types and the Responses API's ``web_search``
    (and ``web_search_preview``...)."""
    return tool_type == "web_search" or tool_type.startswith("web_search_")


def check_server_tool_names(server_tools: Sequence[ServerTool], names: set[str]) -> None:
    """Refuse a server tool named like one of a run's own tools (``names``): the
    model calls tools by name, so the two would be indistinguishable.

    Raises:
        ConfigError: on ``server_tools[i].name``.
    """
    for i, tool in enumerate(server_tools):
        if tool.name in names:
            raise ConfigError(f"server_tools[{i}].name",
                              f"{tool.name!r} is also the name of one of the run's tools")


def narrow_features(published: Features, requested: Mapping[str, Any] | None) -> Features:
    """The features of one run: ``published`` narrowed by ``requested`` (R13).

    ``requested`` names only what it narrows (its keys); every other feature
    keeps its published value. Narrowing means:

    * ``thinking``: None (off), or the same mode with a budget (or adaptive
      effort) no higher than the published one;
    * ``server_tools``: a subset of the published tools, by name; each with
      the same type and params and a ``max_uses`` no higher (a published
      None is the API's default, which any number narrows);
    * ``betas``: a subset;
    * ``context_management``: None or the published object unchanged;
    * ``reasoning_effort``: None or no higher than the published one;
    * ``service_tier``: None or the published tier;
    * ``web_search_options``: None (the API's defaults) or the published object
      unchanged.

    Raises:
        ConfigError: ``requested`` adds a feature or raises a number (the
            field names it, e.g. ``server_tools[0].max_uses``), names no
            feature, or holds an invalid value.
    """
    if requested is None:
        return published
    _validate.known_keys("features", requested, Features.__dataclass_fields__,
                         "a request feature")
    asked = Features(**requested)
    changes: dict[str, Any] = {}
    for name in requested:
        value = getattr(asked, name)
        current = getattr(published, name)
        if name == "thinking":
            _narrow_thinking(current, value)
        elif name == "server_tools":
            _narrow_tools(current, value)
        elif name == "betas":
            extra = [b for b in value if b not in current]
            if extra:
                raise ConfigError("betas", f"{extra[0]!r} is not published by the operation")
        elif name == "reasoning_effort":
            _narrow_order(name, current, value, REASONING_EFFORTS)
        elif value is not None and value != current:
            # context_management, service_tier and web_search_options: off, or
            # exactly as published.
            raise ConfigError(name, f"can only be omitted or kept as published "
                                    f"({_short(current)}), got {_short(value)}")
        changes[name] = value
    return replace(published, **changes)


def _narrow_thinking(published: Thinking | None, asked: Thinking | None) -> None:
    if asked is None:
        return
    if published is None:
        raise ConfigError("thinking", "is not published by the operation")
    if asked.adaptive != published.adaptive:
        raise ConfigError("thinking.adaptive", f"must stay {published.adaptive} as published")
    if published.adaptive:
        if published.effort is not None:
            _narrow_order("thinking.effort", published.effort, asked.effort, THINKING_EFFORTS,
                          none_is_lowest=False)
        return
    assert asked.budget_tokens is not None and published.budget_tokens is not None
    if asked.budget_tokens > published.budget_tokens:
        raise ConfigError("thinking.budget_tokens", f"{asked.budget_tokens} is above the "
                                                    f"published {published.budget_tokens}")


def _narrow_tools(published: tuple[ServerTool, ...], asked: tuple[ServerTool, ...]) -> None:
    by_name = {tool.name: tool for tool in published}
    for i, tool in enumerate(asked):
        where = f"server_tools[{i}]"
        base = by_name.get(tool.name)
        if base is None:
            raise ConfigError(f"{where}.name", f"{tool.name!r} is not published by the operation")
        if tool.type != base.type:
            raise ConfigError(f"{where}.type", f"must stay {base.type!r} as published")
        if dict(tool.params) != dict(base.params):
            raise ConfigError(f"{where}.params", "must stay as published")
        if base.max_uses is not None and (tool.max_uses is None or tool.max_uses > base.max_uses):
            raise ConfigError(f"{where}.max_uses", f"{tool.max_uses} is above the published "
                                                   f"{base.max_uses}")


def _narrow_order(
    field_name: str, published: str | None, asked: str | None, order: Sequence[str],
    *, none_is_lowest: bool = True,
) -> None:
    if asked is None:
        if none_is_lowest:
            return
        raise ConfigError(field_name, f"must be given (published: {_validate.shown(published)})")
    if published is None:
        raise ConfigError(field_name, "is not published by the operation")
    if order.index(asked) > order.index(published):
        raise ConfigError(
            field_name,
            f"{_validate.shown(asked)} is above the published {_validate.shown(published)}")


def _choice(field_name: str, value: object, allowed: Sequence[str]) -> None:
    if value is not None and value not in allowed:
        raise ConfigError(
            field_name,
            f"must be one of {', '.join(allowed)} or None, got {_validate.shown(value)}")


def _json_object(field_name: str, value: object) -> dict[str, Any]:
    """A deep copy of ``value`` if it is a JSON object (string keys, JSON values)."""
    if not isinstance(value, Mapping):
        raise ConfigError(
            field_name,
            f"must be a JSON object (a mapping), got {_validate.shown(value)}")
    try:
        copied = json.loads(json.dumps(dict(value), allow_nan=False))
    except (TypeError, ValueError) as error:
        raise ConfigError(field_name, f"must be a JSON object: {error}") from None
    if not isinstance(copied, dict) or any(not isinstance(k, str) for k in value):
        raise ConfigError(field_name, "must be a JSON object with string keys")
    return copied


def _canonical(value: Mapping[str, Any] | None) -> str | None:
    return None if value is None else json.dumps(dict(value), sort_keys=True)


def _short(value: object) -> str:
    if isinstance(value, Mapping):
        return json.dumps(dict(value), sort_keys=True)[:80]
    return repr(value)

