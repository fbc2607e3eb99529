"""loopengine: an accountable async tool loop for LLM conversations.

Every guard is checked at a fixed checkpoint, every provider request is an
attempt that is priced and recorded, and every failure either takes a bounded
retry path or ends the conversation with a named `Outcome`.
"""

# The public names are imported on first use (PEP 562): `import loopengine`
# and the CLI's ``--help`` load none of the engine, pydantic or the SDKs until
# a name is used. Type checkers read the imports below.

from typing import TYPE_CHECKING

from loopengine._lazy import lazy_exports as _lazy_exports

if TYPE_CHECKING:
    from loopengine._accounts import AccountBalance, CreditAccounts
    from loopengine._attribution import Attribution
    from loopengine._call import CallAttempts, CallResult
    from loopengine._context import ToolContext
    from loopengine._delegate import agent_tool
    from loopengine._engine import Engine
    from loopengine._errors import (
        ConfigError,
        LedgerError,
        LoopEngineError,
        MCPServerError,
        MCPToolError,
        OutcomeError,
        ProviderError,
        ReplayMismatchError,
        RunBusyError,
        StructuredOutputError,
        ToolInputError,
    )
    from loopengine._estimate import Estimate
    from loopengine._features import ServerTool, Thinking
    from loopengine._judge import Accept, Reject
    from loopengine._operation import Operation, load_operations
    from loopengine._outcome import Outcome
    from loopengine._pricing import ModelPrice, PriceBook
    from loopengine._result import AttemptsSummary, RunResult
    from loopengine._runstate import Approve, Deny, PendingCall, RunState, Supply
    from loopengine._runstore import RunStore, StoredRun
    from loopengine._stream import RunStream
    from loopengine._tools import Tool, tool
    from loopengine._usage import Usage, UsageIteration
    from loopengine.guards._limits import Limits
    from loopengine.providers._cache import CachePolicy
    from loopengine.providers._faults import FaultKind, ProviderFault
    from loopengine.providers._retry import RetryPolicy

__version__ = "0.1.0"

__all__ = [
    "Accept",
    "AccountBalance",
    "Approve",
    "AttemptsSummary",
    "Attribution",
    "CachePolicy",
    "CallAttempts",
    "CallResult",
    "ConfigError",
    "CreditAccounts",
    "Deny",
    "Engine",
    "Estimate",
    "FaultKind",
    "LedgerError",
    "Limits",
    "LoopEngineError",
    "MCPServerError",
    "MCPToolError",
    "ModelPrice",
    "Operation",
    "Outcome",
    "OutcomeError",
    "PendingCall",
    "PriceBook",
    "ProviderError",
    "ProviderFault",
    "Reject",
    "ReplayMismatchError",
    "RetryPolicy",
    "RunBusyError",
    "RunResult",
    "RunState",
    "RunStore",
    "RunStream",
    "ServerTool",
    "StoredRun",
    "StructuredOutputError",
    "Supply",
    "Thinking",
    "Tool",
    "ToolContext",
    "ToolInputError",
    "Usage",
    "UsageIteration",
    "agent_tool",
    "load_operations",
    "tool",
]

_EXPORTS: dict[str, str] = {
    "Accept": "loopengine._judge",
    "AccountBalance": "loopengine._accounts",
    "Approve": "loopengine._runstate",
    "AttemptsSummary": "loopengine._result",
    "Attribution": "loopengine._attribution",
    "CachePolicy": "loopengine.providers._cache",
    "CallAttempts": "loopengine._call",
    "CallResult": "loopengine._call",
    "ConfigError": "loopengine._errors",
    "CreditAccounts": "loopengine._accounts",
    "Deny": "loopengine._runstate",
    "Engine": "loopengine._engine",
    "Estimate": "loopengine._estimate",
    "FaultKind": "loopengine.providers._faults",
    "LedgerError": "loopengine._errors",
    "Limits": "loopengine.guards._limits",
    "LoopEngineError": "loopengine._errors",
    "MCPServerError": "loopengine._errors",
    "MCPToolError": "loopengine._errors",
    "ModelPrice": "loopengine._pricing",
    "Operation": "loopengine._operation",
    "Outcome": "loopengine._outcome",
    "OutcomeError": "loopengine._errors",
    "PendingCall": "loopengine._runstate",
    "PriceBook": "loopengine._pricing",
    "ProviderError": "loopengine._errors",
    "ProviderFault": "loopengine.providers._faults",
    "Reject": "loopengine._judge",
    "ReplayMismatchError": "loopengine._errors",
    "RetryPolicy": "loopengine.providers._retry",
    "RunBusyError": "loopengine._errors",
    "RunResult": "loopengine._result",
    "RunState": "loopengine._runstate",
    "RunStore": "loopengine._runstore",
    "RunStream": "loopengine._stream",
    "ServerTool": "loopengine._features",
    "StoredRun": "loopengine._runstore",
    "StructuredOutputError": "loopengine._errors",
    "Supply": "loopengine._runstate",
    "Thinking": "loopengine._features",
    "Tool": "loopengine._tools",
    "ToolContext": "loopengine._context",
    "ToolInputError": "loopengine._errors",
    "Usage": "loopengine._usage",
    "UsageIteration": "loopengine._usage",
    "agent_tool": "loopengine._delegate",
    "load_operations": "loopengine._operation",
    "tool": "loopengine._tools",
}
"""Each public name and the module that defines it."""


__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS)
