"""A ``tool_choice`` in each translated API's own words (Chat Completions, Responses,
Gemini), by the one rule they share: ``auto``, ``none``, ``any`` and a named tool
have an equivalent, any other kind is refused before the wire, naming the API."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from loopengine.providers import FaultKind, ProviderFault, ProviderRequest
from loopengine.providers._gemini_contents import check_translatable as gemini_check
from loopengine.providers._gemini_contents import gemini_config
from loopengine.providers._openai_chat import chat_params
from loopengine.providers._openai_chat import check_translatable as chat_check
from loopengine.providers._openai_responses_items import check_translatable as responses_check
from loopengine.providers._openai_responses_items import responses_params

KINDS = ({"type": "auto"}, {"type": "none"}, {"type": "any"},
         {"type": "tool", "name": "lookup"})

# Each API: how its request carries the choice, how it is checked, its name in faults.
APIS: dict[str, tuple[Callable[[ProviderRequest], Any], Callable[[ProviderRequest], None],
                      str]] = {
    "chat": (lambda request: chat_params(request, stream=False).get("tool_choice"),
             chat_check, "Chat Completions"),
    "responses": (lambda request: responses_params(request, stream=False).get("tool_choice"),
                  responses_check, "Responses API"),
    "gemini": (lambda request: gemini_config(request, {}).get("tool_config"),
               gemini_check, "Gemini"),
}

EXPECTED: dict[str, list[Any]] = {
    "chat": ["auto", "none", "required", {"type": "function", "function": {"name": "lookup"}}],
    "responses": ["auto", "none", "required", {"type": "function", "name": "lookup"}],
    "gemini": [{"function_calling_config": {"mode": "AUTO"}},
               {"function_calling_config": {"mode": "NONE"}},
               {"function_calling_config": {"mode": "ANY"}},
               {"function_calling_config": {"mode": "ANY",
                                            "allowed_function_names": ["lookup"]}}],
}


def request(choice: dict[str, Any] | None) -> ProviderRequest:
    """A request with one tool and ``choice``."""
    return ProviderRequest(model="m", max_tokens=16,
                           messages=[{"role": "user", "content": "hi"}],
                           tools=[{"name": "lookup", "input_schema": {"type": "object"}}],
                           tool_choice=choice)


@pytest.mark.parametrize("api", sorted(APIS))
def test_each_kind_becomes_the_apis_own_and_none_sends_nothing(api: str) -> None:
    """auto / none / any / a named tool each become the API's equivalent; no choice
    sends none (the API's default)."""
    carried, check, _ = APIS[api]
    for choice in KINDS:
        check(request(choice))
    assert [carried(request(choice)) for choice in KINDS] == EXPECTED[api]
    assert carried(request(None)) is None


@pytest.mark.parametrize("api", sorted(APIS))
def test_another_kind_is_refused_before_the_wire_naming_the_api(api: str) -> None:
    """A kind with no equivalent is an untranslatable bad_request, from the check
    and from the translation alike."""
    carried, check, name = APIS[api]
    for attempt in (check, carried):
        with pytest.raises(ProviderFault) as raised:
            attempt(request({"type": "bogus"}))
        assert (raised.value.kind, raised.value.error_code) == (FaultKind.BAD_REQUEST,
                                                                "untranslatable")
        assert raised.value.message == (f"tool_choice 'bogus' has no {name} equivalent, so "
                                        "the request was not sent")
