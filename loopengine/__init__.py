"""loopengine: an accountable async tool loop for LLM conversations.

Every guard is checked at a fixed checkpoint, every provider request is an
attempt that is priced and recorded, and every failure either takes a bounded
retry path or ends the conversation with a named `Outcome`.
"""

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
    "RunResult",
    "RunState",
    "RunStream",
    "ServerTool",
    "StructuredOutputError",
    "Thinking",
    "Supply",
    "Tool",
    "ToolContext",
    "ToolInputError",
    "Usage",
    "UsageIteration",
    "agent_tool",
    "load_operations",
    "tool",
]
