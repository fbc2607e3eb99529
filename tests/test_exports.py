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
        "RunStore", "StoredRun", "RunState", "RunBusyError", "PendingCall", "Approve", "Deny",
        "Supply", "CreditAccounts",
    },
    "loopengine.guards": {"Limits", "ConversationState", "GuardTrip", "Deadline"},
    "loopengine.providers": {"Provider", "ProviderFault", "FaultKind", "ScriptedProvider",
                             "RetryPolicy", "CachePolicy"},
    "loopengine.persistence": {"Ledger", "MemoryLedger", "SQLiteLedger", "PostgresLedger"},
    "loopengine.testing": {"FakeClock", "FakeAnthropicServer", "FakeOpenAIServer",
                           "FakeGeminiServer", "FakeBedrockServer", "FakeVertexServer"},
}

MODULES = {
    "loopengine.mcp": {"MCPServer", "MCPServerError", "MCPToolError", "CONNECT_TIMEOUT"},
    "loopengine.events": {"Event", "RunStarted", "RunEnded", "RunPaused", "RunResumed",
                          "TextDelta", "ToolCallEvent"},
    "loopengine.otel": {"OpenTelemetryObserver"},
    "loopengine.audit": {"open_ledger", "runs", "spend", "show", "reconcile", "accounts",
                         "export_rows"},
}
"""Single-file modules: they import their dependencies' names plainly, so their
__all__ is checked against what they define, not against every name they hold."""

LAZY = {"loopengine.providers": {"AnthropicProvider", "GeminiProvider", "OpenAIProvider",
                                   "OpenAIResponsesProvider"}}
"""Names a package imports on first use (with their SDK), so not yet in its namespace."""

ON_FIRST_USE = {"loopengine", "loopengine.testing"}
"""Packages whose every name loads on first use (PEP 562)."""


@pytest.mark.parametrize("name", sorted(CONTRACT))
def test_all_is_exactly_the_public_names(name: str) -> None:
    """No public name is missing from __all__, and __all__ names nothing extra."""
    module = importlib.import_module(name)
    if name in ON_FIRST_USE:
        # Its names load on first use: each must resolve, and then stands in
        # the namespace.
        for attr in module.__all__:
            getattr(module, attr)
    public = {
        attr for attr, value in vars(module).items()
        if not attr.startswith("_") and not isinstance(value, types.ModuleType)
        and not (name in ON_FIRST_USE and attr in {"annotations", "TYPE_CHECKING"})
    } | LAZY.get(name, set())
    assert set(module.__all__) == public
    assert len(module.__all__) == len(set(module.__all__))
    assert CONTRACT[name] <= set(module.__all__)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_a_modules_all_names_what_it_defines(name: str) -> None:
    """Every public class and function a module defines is in its __all__, and every
    name in __all__ resolves."""
    module = importlib.import_module(name)
    for attr in module.__all__:
        getattr(module, attr)
    defined = {
        attr for attr, value in vars(module).items()
        if not attr.startswith("_") and (inspect.isclass(value) or inspect.isfunction(value))
        and value.__module__ == name
    }
    assert defined <= set(module.__all__)
    assert len(module.__all__) == len(set(module.__all__))
    assert MODULES[name] <= set(module.__all__)


@pytest.mark.parametrize("name", sorted(CONTRACT | MODULES))
def test_every_public_name_has_a_docstring(name: str) -> None:
    """Every exported class and function documents itself (type aliases cannot)."""
    module = importlib.import_module(name)
    for attr in module.__all__:
        value = getattr(module, attr)
        if isinstance(value, type) or inspect.isfunction(value):
            assert (value.__doc__ or "").strip(), f"{name}.{attr} has no docstring"


def test_the_installed_version_is_the_packages_own() -> None:
    """The distribution's version is read from ``loopengine.__version__``
    (one place), so what pip reports is what the package and its traces say."""
    import importlib.metadata

    import loopengine

    assert importlib.metadata.version("loopengine-core") == loopengine.__version__


def test_all_is_sorted() -> None:
    """``loopengine.__all__`` lists its names in order, so a reader finds one."""
    import loopengine

    names = list(loopengine.__all__)
    assert names == sorted(names, key=lambda n: (n[0].islower(), n))
