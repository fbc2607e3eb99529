"""Delegated runs (sub-agents, docs/tools.md): a tool whose handler runs another
conversation, charged to the calling run's budgets.

A child run is narrowed to what its parent has left: its credit hold to the
parent's hold minus the credits the parent's tree has spent, its deadline to
its call's (the parent's, or the tool's timeout's when earlier), its
``max_depth`` to the least one above it. It is its own invocation
(``parent_invocation_id``) with the parent's attribution, and it reserves
nothing on the account: each of its turns' credits is added to every ancestor
as it is spent (`Invocation.add_credits`), so the ancestors' holds see it
before their next turn (`check_delegated_credits`) and the root settles the
whole tree once. Under a hold, one turn at a time is in flight in the tree
(its crossing permit, `needs_crossing_permit`), so the tree crosses each hold
once at most.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import pydantic

from loopengine import _validate
from loopengine._admission import delegated_fees
from loopengine._context import (
    DEFAULT_MAX_DEPTH,
    ToolContext,
    check_delegates,
    check_same_credits,
    check_same_ledger,
)
from loopengine._engine import Engine, check_tools
from loopengine._errors import ConfigError
from loopengine._invocation import Invocation
from loopengine._operation import Operation
from loopengine._outcome import Outcome
from loopengine._result import RunResult
from loopengine._run import run_loop
from loopengine._tools import Tool, ToolSource
from loopengine.guards._deadline import Deadline

__all__ = ["LIMIT_OUTCOMES", "agent_tool", "run_child"]

LIMIT_OUTCOMES = frozenset({Outcome.CREDIT_LIMIT, Outcome.TIME_LIMIT, Outcome.TURN_LIMIT,
                            Outcome.TOOL_LIMIT, Outcome.TOOL_BATCH_LIMIT})
"""The outcomes a delegated run ends on a limit with."""

_NO_TIME = sys.float_info.min
"""The total_time a delegated run is given when its parent's time is spent: the
least a `Limits` takes (its deadline, its call's, is what ends it)."""

_TASK_SCHEMA = {
    "type": "object",
    "properties": {"task": {"type": "string", "description": "The task, in full: the "
                                                              "delegate sees nothing else."}},
    "required": ["task"],
}


async def run_child(
    parent: Invocation,
    operation: Operation,
    messages: str | Sequence[Any],
    *,
    engine: Any,
    deadline: float,
    max_depth: int,
    run_kwargs: dict[str, Any],
) -> RunResult:
    """Run a child of ``parent`` (`ToolContext.run`) for the call whose deadline
    is ``deadline`` (the parent's, or its tool's timeout's when earlier)."""
    _validate.integer("max_depth", max_depth, minimum=0)
    engine = engine if engine is not None else parent.engine
    if not isinstance(engine, Engine):
        raise ConfigError("engine", f"must be an Engine, got {_validate.shown(engine)}")
    check_same_ledger("engine", engine.ledger, parent.ledger, "the delegated run's engine")
    check_same_credits("engine", engine.prices, parent.prices, "the delegated run's engine")
    if "attribution" in run_kwargs:
        raise ConfigError("attribution", "a delegated run is accounted to its parent's "
                                         "attribution")
    depth = parent.depth + 1
    # A delegation nested under another is bounded by every one above it: a
    # wider max_depth further down is narrowed, as its other limits are.
    if parent.max_depth is not None:
        max_depth = min(max_depth, parent.max_depth)
    if depth > max_depth:
        raise ConfigError("max_depth", f"this delegated run would be nested {depth} deep, "
                                       f"past max_depth={max_depth}; it was not run")
    limits = operation.limits.narrow(run_kwargs.pop("limits", None))
    narrowed: dict[str, object] = {}
    hold = parent.limits.credit_hold
    if hold is not None:
        narrowed["credit_hold"] = max(0, hold - parent.tree_credits)
    remaining = Deadline(deadline).remaining(parent.clock.now())
    if remaining != float("inf"):
        # The parent's time may be spent already (an observer or a ledger write
        # that outlasted its deadline): the child then ends ``time_limit`` at
        # its first turn, as the deadline it takes below says, rather than
        # being refused a total_time that is not positive.
        narrowed["total_time"] = max(remaining, _NO_TIME)
    limits = limits.narrow(narrowed)
    inv, spec = engine._prepare_run(
        operation, messages, attribution=parent.attribution,
        limits=_validate.field_values(limits), **run_kwargs)
    inv.parent = parent
    # A delegated run is one call of its parent's: the parent's checkpoints
    # and its call's status cover it; it keeps no state of its own.
    inv.run_store = None
    inv.depth = depth
    inv.max_depth = max_depth
    # No admission of its own: its spend is part of the root's reservation.
    inv.accounts = None
    inv.account = None
    inv.deadline = Deadline(min(inv.deadline.at, deadline))
    # Its crossing turn's server-tool fees stay inside the root's reservation.
    delegated_fees(inv, parent.root, parent.clock.wall())
    return await run_loop(inv, spec)


def agent_tool(
    engine: Any,
    operation: Operation,
    *,
    name: str,
    description: str,
    tools: Sequence[Tool | ToolSource] = (),
    input_model: type[pydantic.BaseModel] | None = None,
    max_depth: int = DEFAULT_MAX_DEPTH,
) -> Tool:
    """A tool whose handler runs a delegated conversation of ``operation`` (a sub-agent).

    The model calls it with ``{"task": "..."}`` (or ``input_model``'s fields,
    given to the child as JSON text); the child's accepted answer is the
    tool's output. The child runs on ``engine`` with ``tools``, inside the
    calling run's budgets (`ToolContext.run`): its credits count towards the
    caller's hold and account reservation, its deadline is the caller's. A
    child that ends on a limit (``credit_limit``, ``time_limit``,
    ``turn_limit``, ...) or any other way but ``completed`` gives the calling
    model an ``is_error`` result naming its outcome; one past ``max_depth``
    is not run. A child never pauses: a batch of its that needs approval
    does not run, and it ends ``incomplete`` naming the calls that needed it.

    Args:
        engine: The `Engine` the child runs on. It must record on the calling
            run's ledger (the same ledger object, or both none), and count
            credits in the same units (its `PriceBook`'s ``credits_per_usd``
            and ``credit_quantum``): a run given this tool otherwise is
            refused with a `ConfigError` naming both, before anything is sent.
        operation: The child's operation.
        name: The tool's name.
        description: What the delegate does, for the calling model.
        tools: The child's tools.
        input_model: A pydantic model of the tool's input instead of ``task``.
        max_depth: How deep delegated runs may nest (the root's children are at
            1); narrowed to a smaller one a delegation above the caller set.

    Raises:
        ConfigError: a bad argument, or a tool of ``tools`` delegating to an
            engine on another ledger than ``engine``'s, or counting credits in
            other units (``tools``).
    """
    if not isinstance(engine, Engine):
        raise ConfigError("engine", f"must be an Engine, got {_validate.shown(engine)}")
    if not isinstance(operation, Operation):
        raise ConfigError("operation", f"must be an Operation, got {_validate.shown(operation)}")
    engine.provider_for(operation)  # an unserved route is refused now, not mid-run
    child_tools = check_tools(tools)
    # A delegate of the child's on another ledger is refused now, not when the
    # model first delegates (then only the model would hear of it).
    check_delegates(child_tools, engine.ledger, engine.prices)
    _validate.integer("max_depth", max_depth, minimum=0)

    async def delegate(argument: Any, ctx: ToolContext) -> Any:
        if isinstance(argument, pydantic.BaseModel):
            task = argument.model_dump_json()
        else:
            task = str(argument["task"])
        result = await ctx.run(operation, task, engine=engine, tools=child_tools,
                               max_depth=max_depth)
        if result.outcome is not Outcome.COMPLETED:
            kind = " (a limit)" if result.outcome in LIMIT_OUTCOMES else ""
            raise DelegationStopped(f"{name} ended {result.outcome.value}{kind} without "
                                    f"an answer: {result.detail}")
        return result.answer

    built = Tool(name, description, None if input_model is not None else _TASK_SCHEMA,
                 delegate, input_model=input_model)
    built.delegates_to = engine  # its ledger is checked against the calling run's at run start
    return built


class DelegationStopped(Exception):
    """A delegated run ended without an answer; its message, naming the outcome,
    is the calling model's ``is_error`` result."""
