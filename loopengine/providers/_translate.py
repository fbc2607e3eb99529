"""What the translations of the engine's Anthropic-shaped requests to the other
APIs (Chat Completions, Responses, Gemini) share: the fault of what an API has
no equivalent for (`untranslatable`), the checks of a message's role and of a
block's type, the walk over a request's blocks that `check_translatable` makes
(`check_blocks`), a tool definition as a function declaration, and a
``tool_choice`` in an API's own words (`tool_choice`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from loopengine.providers._base import ProviderRequest
from loopengine.providers._faults import FaultKind, ProviderFault

__all__ = ["RESULT_BLOCKS", "block_kind", "check_blocks", "function_tool", "message_role",
           "result_kind", "tool_choice", "untranslatable"]

T = TypeVar("T")


def untranslatable(what: str, api: str) -> ProviderFault:
    """The fault of a request holding ``what``, which ``api`` has no equivalent for."""
    return ProviderFault(FaultKind.BAD_REQUEST,
                         f"{what} has no {api} equivalent, so the request was not "
                         "sent", error_code="untranslatable")


def message_role(message: Mapping[str, Any], api: str) -> str:
    """The message's role, when a translation to ``api`` has one for it."""
    role = message.get("role")
    if role not in ("assistant", "user"):
        raise untranslatable(f"a message with role {role!r}", api)
    return str(role)


def block_kind(block: object, known: frozenset[str], what: str, api: str) -> str:
    """A block's type, when it is one of the ``known`` types a translation to
    ``api`` has an equivalent for; else the `untranslatable` fault of ``what``
    (a template for the type: ``"a user {!r} block"``). What is not a block is
    named by its class."""
    kind = block.get("type") if isinstance(block, Mapping) else type(block).__name__
    if kind not in known:
        raise untranslatable(what.format(kind), api)
    return str(kind)


RESULT_BLOCKS = frozenset({"text", "image", "document"})
"""The blocks inside a tool result every translation carries: as themselves, or
as the note `media_note` makes where its API's tool results are text."""


def result_kind(block: object, api: str) -> str:
    """The type of a block inside a tool result, one of `RESULT_BLOCKS`; else the
    `untranslatable` fault naming ``api``."""
    return block_kind(block, RESULT_BLOCKS, "a {!r} block inside a tool result", api)


def check_blocks(request: ProviderRequest, assistant_kind: Callable[[Mapping[str, Any]], object],
                 user_kind: Callable[[Mapping[str, Any]], object], api: str) -> None:
    """Every block of the request's messages through its role's check (each
    raises on a block ``api`` has no equivalent for), in the order a
    translation meets them."""
    for message in request.messages:
        role = message_role(message, api)
        content = message.get("content")
        if isinstance(content, str):
            continue
        kind_of = assistant_kind if role == "assistant" else user_kind
        for block in content or ():
            kind_of(block)


def function_tool(tool: Mapping[str, Any], schema: str = "parameters") -> dict[str, Any]:
    """An Anthropic tool definition as the function declaration the other APIs
    take: its name, its JSON schema under ``schema``, and its description when
    it has one."""
    out: dict[str, Any] = {"name": tool.get("name"),
                           schema: tool.get("input_schema") or {"type": "object"}}
    if tool.get("description"):
        out["description"] = tool["description"]
    return out


def tool_choice(choice: Mapping[str, Any] | None, modes: Mapping[str, T],
                named: Callable[[Any], T], api: str) -> T | None:
    """An Anthropic ``tool_choice`` as ``api`` takes it, or None for none (the API's
    default): ``auto``, ``none`` and ``any`` as ``modes`` names them, a named
    ``tool`` as ``named(name)``.

    Raises:
        ProviderFault: ``bad_request`` (``untranslatable``): another kind.
    """
    if choice is None:
        return None
    kind = choice.get("type")
    if kind == "tool":
        return named(choice.get("name"))
    if isinstance(kind, str) and kind in modes:
        return modes[kind]
    raise untranslatable(f"tool_choice {kind!r}", api)
