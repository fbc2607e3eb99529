"""`ToolContext`: what a tool handler may know of the run that called it.

A handler that declares a parameter annotated `ToolContext` receives one per
call; the parameter is not part of the tool's input schema, so the model never
sees it. Through it a handler knows its run (``invocation_id``), its call
(``call_id``), who the run is accounted to, the call's deadline, a key stable
for the call, and can start a delegated run inside the run's budgets
(`ToolContext.run`, docs/tools.md, "Sub-agents").
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from loopengine._attribution import Attribution
from loopengine._errors import ConfigError

if TYPE_CHECKING:
    from loopengine._invocation import Invocation
    from loopengine._operation import Operation
    from loopengine._pricing import PriceBook
    from loopengine._result import RunResult

__all__ = ["DEFAULT_MAX_DEPTH", "ToolContext", "check_delegates", "check_same_credits",
           "check_same_ledger"]

DEFAULT_MAX_DEPTH = 3
"""How deep delegated runs may nest by default: a root's children are at depth 1."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolContext:
    """The run and call a tool handler serves (docs/tools.md, docs/pause-and-resume.md).

    Declare a handler parameter annotated ``loopengine.ToolContext`` to receive it.
    """

    invocation_id: str
    """The ledger id of the run that called the tool."""
    call_id: str
    """The model's id of this tool call."""
    attribution: Attribution
    """Who the run is accounted to."""
    deadline: float
    """The call's absolute deadline on the engine's clock: the run's, or the one
    the tool's ``timeout`` sets when earlier (``inf`` without either). A
    delegated run (`run`) is held to it."""
    _invocation: Invocation = field(repr=False)

    @property
    def idempotency_key(self) -> str:
        """A key derived from the run and the call: the same for this call however
        often it is made, different for every other call (hex SHA-256)."""
        return hashlib.sha256(f"{self.invocation_id}\x00{self.call_id}".encode()).hexdigest()

    async def run(
        self,
        operation: Operation,
        messages: str | Sequence[Any],
        *,
        engine: Any = None,
        max_depth: int = DEFAULT_MAX_DEPTH,
        **run_kwargs: Any,
    ) -> RunResult:
        """Run a delegated conversation (a sub-agent) inside this run's budgets.

        The child is its own invocation, recorded with ``parent_invocation_id``
        and this run's attribution. Its credit hold is narrowed to what this
        run's hold has left (this run's credits and its other delegated runs'
        counted), its deadline to this call's (`deadline`: this run's, or this
        tool's timeout's when earlier); it takes no admission of its own:
        its credits are charged to this run's account reservation, settled once
        when the root run ends. Its result is returned whatever its outcome. It
        never pauses (nothing could resume it): a batch of its that needs
        approval does not run, and it ends ``incomplete``, its ``detail``
        naming the calls that needed approval.

        Args:
            operation: The child's operation (its limits, narrowed as above).
            messages: Its first user message, or message dicts, as for `Engine.run`.
            engine: The `Engine` to run it on (this run's by default); it must
                record on this run's ledger and count credits in the same
                units (its `PriceBook`'s ``credits_per_usd`` and
                ``credit_quantum``).
            max_depth: How deep delegated runs may nest; a child past it is not
                run. A larger one than a delegation above this run set is
                narrowed to that one.
            **run_kwargs: `Engine.run`'s keywords (``tools``, ``system``,
                ``output``, ``accept``, ``limits``, ...), but not ``attribution``.

        Raises:
            ConfigError: the child would nest past ``max_depth`` (nothing is
                sent), ``attribution`` was given, ``engine`` records on another
                ledger or counts credits in other units, or its input is bad. Raised in a
                handler, it becomes that call's ``is_error`` result.
        """
        # Imported here: the delegation runs the tool loop, which builds contexts.
        from loopengine._delegate import run_child

        return await run_child(self._invocation, operation, messages, engine=engine,
                               deadline=self.deadline, max_depth=max_depth,
                               run_kwargs=run_kwargs)


def check_same_ledger(field: str, child: object, parent: object, what: str) -> None:
    """Refuse a delegated run recording on another ledger than its parent's.

    A child's row names its parent (``parent_invocation_id``) and the root
    settles the whole tree from the ledger's rows: a tree split over two
    ledgers (or half unrecorded) cannot be audited, rolled up or reconciled.

    Raises:
        ConfigError: ``child`` is not the very ledger object ``parent`` is
            (both None is the same: nothing is recorded); names both.
    """
    if child is not parent:
        # Two ledgers alike (two empty MemoryLedgers) are still two objects.
        other = " (another object)" if repr(child) == repr(parent) else ""
        raise ConfigError(field, f"{what} records on {child!r}{other}, but the calling run "
                                 f"on {parent!r}: a delegated run must record on its "
                                 "parent's ledger (give its Engine the same ledger object)")


def check_same_credits(field: str, child: PriceBook, parent: PriceBook, what: str) -> None:
    """Refuse a delegated run that counts credits in other units than its parent.

    A child's credits are added to its ancestors' as they are spent: they
    count against the root's hold and are settled on its account. Counted at
    another ``credits_per_usd`` (or rounded to another ``credit_quantum``)
    they would be a sum of two currencies: the tree's hold and account would
    be charged a thousandth, or a thousand times, what the child spent.

    Raises:
        ConfigError: the two price books' ``credits_per_usd`` or
            ``credit_quantum`` differ; names both.
    """
    if (child.credits_per_usd, child.credit_quantum) != (parent.credits_per_usd,
                                                         parent.credit_quantum):
        raise ConfigError(field, f"{what} counts credits at {child.credits_per_usd} per USD "
                                 f"(quantum {child.credit_quantum}), but the calling run at "
                                 f"{parent.credits_per_usd} per USD (quantum "
                                 f"{parent.credit_quantum}): a delegated run's credits count "
                                 "against its parent's hold and account, so give its Engine "
                                 "a PriceBook with the same credits_per_usd and credit_quantum")


def context_for(inv: Invocation, call_id: str, timeout: float | None) -> ToolContext:
    """The context of call ``call_id`` of run ``inv``, starting now, whose tool
    may take ``timeout`` seconds (None: the run's time)."""
    deadline = inv.deadline.at
    if timeout is not None:
        deadline = min(deadline, inv.clock.now() + timeout)
    return ToolContext(invocation_id=inv.id, call_id=call_id, attribution=inv.attribution,
                       deadline=deadline, _invocation=inv)


def check_delegates(tools: Iterable[object], ledger: object, prices: PriceBook) -> None:
    """Refuse a tool of ``tools`` that runs its delegated run (an ``agent_tool``)
    on an engine recording on another ledger than ``ledger``, or counting
    credits in other units than ``prices`` (`check_same_ledger`,
    `check_same_credits`): checked for a run's tools when it starts, and for a
    delegate's own tools when it is built, so a tree is refused whole.

    Raises:
        ConfigError: ``tools``, naming the tool and both ledgers (or both units).
    """
    for tool in tools:
        engine = getattr(tool, "delegates_to", None)
        if engine is not None:
            what = f"tool {getattr(tool, 'name', '')!r} runs its delegated run on an engine that"
            check_same_ledger("tools", engine.ledger, ledger, what)
            check_same_credits("tools", engine.prices, prices, what)
