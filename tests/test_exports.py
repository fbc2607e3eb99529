"""Each package's __all__ is exactly its public names, and covers the contract."""

from __future__ import annotations

import importlib
import inspect
import types

import pytest

CONTRACT = {
    "loopengine": {
        "Engine", "Operation", "Limits", "RetryPolicy", "PriceBook", "ModelPrice", "Attribution",
        "tool", "Tool", "Accept", "Reject", "Outcome", "RunResult", "AttemptsSummary", "Usage",
        "LoopEngineError", "ConfigError", "ProviderError", "LedgerError", "load_operations",
    },
    "loopengine.guards": {"Limits", "ConversationState", "GuardTrip", "Deadline"},
    "loopengine.providers": {"Provider", "ProviderFault", "FaultKind", "ScriptedProvider",
                             "RetryPolicy", "CachePolicy"},
    "loopengine.persistence": {"Ledger", "MemoryLedger"},
    "loopengine.testing": {"FakeClock"},
}

LAZY = {"loopengine.providers": {"AnthropicProvider", "GeminiProvider", "OpenAIProvider",
                                   "OpenAIResponsesProvider"}}
"""Names a package imports on first use (with their SDK), so not yet in its namespace."""


@pytest.mark.parametrize("name", sorted(CONTRACT))
def test_all_is_exactly_the_public_names(name: str) -> None:
    """No public name is missing from __all__, and __all__ names nothing extra."""
    module = importlib.import_module(name)
    if name == "loopengine":
        # Its names load on first use (PEP 562): each must resolve, and then
        # stands in the namespace.
        for attr in module.__all__:
            getattr(module, attr)
    public = {
        attr for attr, value in vars(module).items()
        if not attr.startswith("_") and not isinstance(value, types.ModuleType)
        and not (name == "loopengine" and attr in {"annotations", "TYPE_CHECKING", "Any"})
    } | LAZY.get(name, set())
    assert set(module.__all__) == public
    assert len(module.__all__) == len(set(module.__all__))
    assert CONTRACT[name] <= set(module.__all__)


@pytest.mark.parametrize("name", sorted(CONTRACT))
def test_every_public_name_has_a_docstring(name: str) -> None:
    """Every exported class and function documents itself (type aliases cannot)."""
    module = importlib.import_module(name)
    for attr in module.__all__:
        value = getattr(module, attr)
        if isinstance(value, type) or inspect.isfunction(value):
            assert (value.__doc__ or "").strip(), f"{name}.{attr} has no docstring"
