"""`Engine`: runs operations on their published route, accountably."""

from __future__ import annotations

import contextlib
import copy
import functools
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any, TypeVar

import pydantic

from loopengine import _validate
from loopengine._accounts import CreditAccounts, recorded_account
from loopengine._admission import check_fees_bounded
from loopengine._attribution import Attribution
from loopengine._call import ANSWER_TOOL, CallResult, CallSpec, run_call
from loopengine._clock import Clock, SystemClock
from loopengine._context import check_delegates
from loopengine._errors import ConfigError, RunBusyError
from loopengine._estimate import Estimate, estimate_run
from loopengine._features import (
    Features,
    check_server_tool_names,
    enabled_features,
    narrow_features,
)
from loopengine._invocation import Invocation
from loopengine._named import given_values
from loopengine._operation import Operation
from loopengine._pause import check_seal, pending_approvals
from loopengine._pricing import DEFAULT_BILLING, Billing, PriceBook
from loopengine._result import RunResult
from loopengine._run import (
    RunSpec,
    ToolErrorText,
    check_unique_tools,
    default_tool_error_text,
    final_tool_definition,
    give_back,
    resume_loop,
    run_loop,
)
from loopengine._runstate import (
    Approve,
    Decision,
    PendingCall,
    RunState,
    check_decisions,
    json_digest,
)
from loopengine._runstore import (
    UNBOUNDED_RUN,
    RunStore,
    StoredRun,
    holds_run,
    new_owner,
    taken_without_store,
)
from loopengine._short import engine_from_model, sync_method
from loopengine._stream import RunStream, stream_run
from loopengine._tools import ExpandedTools, Tool, ToolSource, check_tool_name, expand_tools
from loopengine.events import Observer, TextDelta
from loopengine.guards._limits import Limits
from loopengine.persistence._protocol import Ledger
from loopengine.providers._base import Provider, TextCallback
from loopengine.providers._retry import RetryPolicy

__all__ = ["Engine"]

M = TypeVar("M", bound=pydantic.BaseModel)
Messages = str | Sequence[Mapping[str, Any]]
System = str | Sequence[Mapping[str, Any]] | None


_RUN_KEYWORDS = frozenset({"system", "tools", "output", "accept", "attribution", "limits",
                           "retry", "features", "on_text", "tool_error_text", "final_tool"})
"""The keywords of `Engine.run` after its operation and messages."""


_CALL_LIMITS = ("total_time", "attempt_timeout", "credit_hold")
"""The limits a structured call applies; the others are a run's (turns, tools,
wrap-up, pauses)."""


def _check_call_limits(limits: Limits | Mapping[str, object] | None) -> None:
    """Refuse a call's ``limits`` naming one that a call does not apply: it would
    be ignored (``max_turns=1`` would not stop a second request).

    Raises:
        ConfigError: on the first such limit (``limits.<name>``).
    """
    if limits is None:
        return
    named = given_values(limits) if isinstance(limits, Limits) else dict(limits)
    for name, value in named.items():
        if value is not None and name not in _CALL_LIMITS:
            raise ConfigError(
                f"limits.{name}", f"a structured call does not apply it (it applies "
                                  f"{', '.join(_CALL_LIMITS)}): its requests are capped by "
                                  "retry={'max_attempts': N}")


_NO_FEATURES = Features()
"""The features of a run that enables none."""


def _check_sendable(provider: Provider, operation: Operation, features: Features) -> None:
    """Refuse a run whose request features its provider cannot send (its declared
    `Provider.features`), before anything is recorded. A provider that sends
    only some server tools declares ``server_tools:<type prefix>`` for each
    kind instead of ``server_tools``.

    Raises:
        ConfigError: on the first such feature.
    """
    for name in enabled_features(features):
        if name == "server_tools" and name not in provider.features:
            # A provider that sends some server tools only names their type
            # prefixes (``server_tools:web_search_``).
            kinds = tuple(entry.removeprefix("server_tools:") for entry in provider.features
                          if entry.startswith("server_tools:"))
            if kinds:
                for i, tool in enumerate(features.server_tools):
                    if not tool.type.startswith(kinds):
                        raise ConfigError(
                            f"server_tools[{i}].type",
                            f"operation {operation.name!r} enables the server tool "
                            f"{tool.type!r}, which the {provider.vendor} provider of route "
                            f"{operation.provider!r} cannot send (it sends server tools of "
                            f"the types {', '.join(f'{k}*' for k in kinds)})")
                continue
        if name not in provider.features:
            raise ConfigError(
                name, f"operation {operation.name!r} enables {name}, which the "
                      f"{provider.vendor} provider of route {operation.provider!r} cannot "
                      f"send (it sends: {', '.join(sorted(provider.features)) or 'none'})")


def _billing(provider: Provider, operation: Operation, features: Features) -> Billing:
    """How ``provider`` bills a run of ``operation`` with ``features`` beyond its
    usage (`Provider.billing`), asked before anything is recorded. The common
    case, the default, is one shared value (`DEFAULT_BILLING`): thousands of
    runs alive at once hold no object of their own for it.

    Raises:
        ConfigError: the provider's answer is not a `Billing`.
    """
    billing = provider.billing(operation.model, features)
    if not isinstance(billing, Billing):
        raise ConfigError("provider", f"the {provider.name} provider's billing() must return "
                                      f"a Billing, got {_validate.shown(billing)}")
    return DEFAULT_BILLING if billing == DEFAULT_BILLING else billing


class Engine:
    """Runs conversations (`run`) and structured calls (`call`) of operations.

    Args:
        provider: The provider serving the operations' route, or a mapping of
            route name to provider. An operation runs only on the provider
            whose name is its ``provider``; there is no substitute (R13).
        ledger: Where invocations and attempts are recorded (`SQLiteLedger`),
            or None to record nothing.
        prices: Prices and the credit exchange rate; genai-prices by default.
        observers: Callables receiving each `loopengine.events` event.
        clock: The time source (`loopengine.testing.FakeClock` in tests).
        rng: The jitter source of retry waits.
        tool_error_text: ``(tool_name, error) -> str``: what the model is told
            when a tool handler raises (default: the exception's message, R09);
            an async one is awaited. One that raises or returns no string is
            logged at ERROR and the model is told only the error's type.
        accounts: `CreditAccounts` on this engine's ledger: each run on an
            account reserves its credit hold before its first request and
            settles its charge at its end (docs/accounts.md).
        run_store: A `RunStore` on this engine's ledger: each run holds a
            lease and checkpoints its state there, each tool call is recorded
            ``started`` before its handler runs, and ``resume(invocation_id)``
            resumes a paused run or recovers one whose process died
            (docs/pause-and-resume.md).
    """

    def __init__(
        self,
        provider: Provider | Mapping[str, Provider],
        *,
        ledger: Ledger | None = None,
        prices: PriceBook | None = None,
        observers: Iterable[Observer] = (),
        clock: Clock | None = None,
        rng: random.Random | None = None,
        tool_error_text: ToolErrorText | None = None,
        accounts: CreditAccounts | None = None,
        run_store: RunStore | None = None,
    ) -> None:
        if isinstance(provider, Mapping):
            providers = dict(provider)
        else:
            providers = {getattr(provider, "name", ""): provider}
        if not providers:
            raise ConfigError("provider", "an engine needs at least one provider")
        for route, item in providers.items():
            if not _validate.implements(item, Provider):
                raise ConfigError("provider", f"{_validate.shown(item)} is not a Provider "
                                              "(name and send)")
            if item.name != route:
                raise ConfigError("provider", f"the provider for route {route!r} is named "
                                              f"{item.name!r}")
        if ledger is not None and not _validate.implements(ledger, Ledger):
            raise ConfigError("ledger", f"{_validate.shown(ledger)} does not implement "
                                        "the Ledger protocol")
        if prices is not None and not isinstance(prices, PriceBook):
            raise ConfigError("prices", f"must be a PriceBook, got {_validate.shown(prices)}")
        observer_list = _validate.items("observers", observers)
        for i, observer in enumerate(observer_list):
            if not callable(observer):
                raise ConfigError(f"observers[{i}]",
                                  f"must be callable, got {_validate.shown(observer)}")
            if isinstance(observer, type):
                # Called with each event, a class would build an object and drop it.
                raise ConfigError(f"observers[{i}]", f"must be an observer, got the class "
                                                     f"{observer.__name__}: give an instance")
        if tool_error_text is not None and not callable(tool_error_text):
            raise ConfigError("tool_error_text", "must be callable")
        _validate.clock("clock", clock)
        if rng is not None and not isinstance(rng, random.Random):
            raise ConfigError("rng", f"must be a random.Random, got {_validate.shown(rng)}")
        for field, value, kind, name in (
                ("accounts", accounts, CreditAccounts, "the accounts"),
                ("run_store", run_store, RunStore, "the run store")):
            if value is None:
                continue
            if not isinstance(value, kind):
                raise ConfigError(field, f"must be {kind.__name__}, got {_validate.shown(value)}")
            if value.ledger is not ledger:
                raise ConfigError(field, f"{name} must live on this engine's ledger")
        self.run_store = run_store
        self.accounts = accounts
        self.providers: dict[str, Provider] = providers
        self.ledger = ledger
        self.prices = prices or PriceBook()
        self.observers: list[Observer] = observer_list
        self.clock: Clock = clock or SystemClock()
        self.rng = rng or random.Random()
        self.tool_error_text: ToolErrorText = tool_error_text or default_tool_error_text
        # Routes (``provider:model``) whose missing price was logged: once each.
        self._unpriced_warned: set[str] = set()

    def provider_for(self, operation: Operation) -> Provider:
        """The provider of ``operation``'s published route.

        Raises:
            ConfigError: no provider of this engine serves that route (R13).
        """
        if not isinstance(operation, Operation):
            raise ConfigError("operation",
                              f"must be an Operation, got {_validate.shown(operation)}")
        provider = self.providers.get(operation.provider)
        if provider is None:
            raise ConfigError(
                "provider",
                f"operation {operation.name!r} is published on route {operation.provider!r}, "
                f"which this engine does not serve (it serves {', '.join(self.providers)}); "
                "loopengine never substitutes another route",
            )
        return provider

    def _invocation(
        self,
        kind: str,
        operation: Operation,
        limits: Limits | Mapping[str, object] | None,
        retry: RetryPolicy | Mapping[str, object] | None,
        attribution: Attribution | None,
        *,
        observers: Sequence[Observer] = (),
        text_sink: Callable[[TextDelta], None] | None = None,
        features: Mapping[str, Any] | None = None,
    ) -> Invocation:
        provider = self.provider_for(operation)
        run_limits = operation.limits.narrow(limits)
        policy = operation.retry.narrow(retry)
        run_features = narrow_features(operation.features, features)
        if run_features == _NO_FEATURES:
            # The common case shares one value: thousands of invocations alive
            # at once hold no object of their own for it.
            run_features = _NO_FEATURES
        _check_sendable(provider, operation, run_features)
        if attribution is not None and not isinstance(attribution, Attribution):
            raise ConfigError("attribution",
                              f"must be an Attribution, got {_validate.shown(attribution)}")
        account = (self.accounts.account_for(attribution or Attribution())
                   if self.accounts is not None else None)
        if account is not None and run_limits.credit_hold is None:
            assert self.accounts is not None
            if self.accounts.default_hold is None:
                raise ConfigError(
                    "limits.credit_hold",
                    f"a run on account {account!r} needs a credit hold to reserve: publish "
                    "one on the operation or give CreditAccounts(default_hold=...)")
            run_limits = replace(run_limits, credit_hold=self.accounts.default_hold)
        vendor = provider.vendor
        if run_limits.credit_hold is not None and not self.prices.knows(
            vendor, operation.model, self.clock.wall()
        ):
            raise ConfigError(
                "prices",
                f"{vendor}:{operation.model} has no price, so its credit_hold "
                "cannot be enforced; add a ModelPrice to the PriceBook",
            )
        billing = _billing(provider, operation, run_features)
        if run_limits.credit_hold is not None:
            unpriced = self.prices.unpriced_features(
                vendor, operation.model, run_features, self.clock.wall(),
                geo=provider.inference_geo, billing=billing)
            if unpriced:
                raise ConfigError(
                    "prices",
                    f"operation {operation.name!r} enables features without a price, so its "
                    f"credit_hold cannot be enforced: {'; '.join(unpriced)}",
                )
        if account is not None:
            check_fees_bounded(self.prices, vendor, operation.model, run_features.server_tools,
                               self.clock.wall(), account, billing)
        return Invocation(
            kind=kind, operation=operation, provider=provider, limits=run_limits,
            policy=policy, attribution=attribution, ledger=self.ledger, prices=self.prices,
            clock=self.clock, rng=self.rng, observers=[*self.observers, *observers],
            text_sink=text_sink, features=run_features, billing=billing,
            unpriced_warned=self._unpriced_warned, accounts=self.accounts, account=account,
        )

    async def run(
        self,
        operation: Operation,
        messages: Messages,
        *,
        system: System = None,
        tools: Iterable[Tool | ToolSource] = (),
        output: type[pydantic.BaseModel] | None = None,
        accept: Callable[[Any], Any] | None = None,
        attribution: Attribution | None = None,
        limits: Limits | Mapping[str, object] | None = None,
        retry: RetryPolicy | Mapping[str, object] | None = None,
        features: Mapping[str, Any] | None = None,
        on_text: TextCallback | None = None,
        tool_error_text: ToolErrorText | None = None,
        final_tool: str = ANSWER_TOOL,
    ) -> RunResult:
        """Run a conversation of ``operation`` to an outcome.

        Args:
            operation: The published operation (route, limits, policies).
            messages: One user message, or Anthropic-shaped message dicts.
            system: The system prompt: a string or Anthropic text blocks.
            tools: The tools the model may call: `Tool` objects, and MCP
                servers (`loopengine.mcp.MCPServer`) whose tools, which may
                change during the run, are read again before each turn and
                each tool batch (docs/tools.md).
            output: A pydantic model for structured mode: the model answers by
                calling the terminal tool ``final_tool`` with this schema.
            accept: The judge of a final answer, sync or async: returns
                `Accept`, `Reject` or a bool. A judge that raises rejects.
            attribution: Who the run is accounted to.
            limits: Narrows the operation's limits for this run (never
                widens): only the fields it names, the keys of a mapping or
                the fields passed to the `Limits`.
            retry: Narrows the operation's retry policy for this run.
            features: Narrows the operation's request features for this run
                (never widens, never adds one): a mapping naming only what it
                narrows, e.g. ``{"server_tools": (le.ServerTool(type=...,
                name="web_search", max_uses=2),), "thinking": None}``
                (docs/pricing.md).
            on_text: Receives the text deltas as they arrive: each request
                of the run is streamed (a provider that cannot stream is a
                `ConfigError`, before anything is recorded). A
                failed attempt's text has already been delivered when its retry
                starts: observers' attempt events say which attempt the text
                belongs to (docs/observability.md).
            tool_error_text: Overrides the engine's hook for this run.
            final_tool: The terminal tool's name in structured mode; naming
                one without ``output`` is a `ConfigError`.

        Returns:
            The `RunResult`, whatever the outcome; it keeps the whole transcript.

        Raises:
            ConfigError: bad input, an unserved route, ``on_text`` on a
                provider that cannot stream, or an unpriced model (or
                enabled feature, docs/pricing.md) with a credit hold;
                raised before anything is sent.
            LedgerError: the ledger could not record the run; it is recorded
                ``failed`` where the ledger still can, and observers see
                `RunEnded` with outcome ``failed``.
            ReplayMismatchError: a `ReplayProvider`'s recording diverged;
                recorded ``failed`` likewise.
        """
        inv, spec = self._prepare_run(
            operation, messages, system=system, tools=tools, output=output, accept=accept,
            attribution=attribution, limits=limits, retry=retry, features=features,
            on_text=on_text,
            tool_error_text=tool_error_text, final_tool=final_tool)
        return await run_loop(inv, spec)

    async def resume(
        self,
        state: RunState | bytes | str,
        *,
        decisions: Mapping[str, Decision] | None = None,
        operation: Operation | None = None,
        tools: Iterable[Tool | ToolSource] = (),
        output: type[pydantic.BaseModel] | None = None,
        accept: Callable[[Any], Any] | None = None,
        on_text: TextCallback | None = None,
        tool_error_text: ToolErrorText | None = None,
        force: bool = False,
    ) -> RunResult:
        """Resume a paused run (``result.state`` of a ``paused`` result) as the
        same invocation (docs/pause-and-resume.md).

        The pending calls are decided first: an `Approve` runs the call, a
        `Deny` gives the model an ``is_error`` result with its reason, a
        `Supply` gives it the supplied text; each uses a unit of tool budget
        (R08). Then the loop goes on. Tools and judges are code, so they are
        passed again. With a ledger, the budgets enforced (turns, tool calls,
        credits) and the attempt ordinals continue from the ledger's rows for
        the invocation, whatever the state says; without one, the state is
        trusted. A run on an account reserves its credits again: when nothing
        is available the result is ``admission_denied`` with the state kept
        (``result.state``) for a later resume.

        With a `RunStore` (``Engine(run_store=...)``), ``state`` may be the
        run's invocation id: its state is read from the store. That also
        recovers a run whose process died (its lease expired, or ``force``):
        an attempt it left unsettled stays as the ledger has it and the turn
        is sent again; a call it left ``started`` is in doubt: run again if
        its tool is ``idempotent``, else the run returns ``paused`` with the
        call in ``result.pending`` (reason ``in_doubt``) for a decision, whatever
        decisions this resume was given (made before the call was in doubt). Of
        two resumes of one run, one proceeds and the other raises
        `RunBusyError` before anything is sent. A run paused without a run
        store is adopted into this engine's: its first checkpoint stores it.

        Args:
            state: The `RunState`, its `RunState.dumps` bytes, or (with a run
                store) the run's invocation id.
            decisions: One decision per pending call, by call id.
            operation: The published operation to resume under, when the
                state is not trusted: its limits are then the ceiling (the
                state's limits only narrow them). Default: the operation the
                state carries. It must have the same name, version, provider
                and model (those the invocation was recorded with).
            tools: The run's tools, as given to `run`: every one of them (more
                may be added; a tool a given MCP server dropped meanwhile is
                not asked for).
            output: The run's output model, as given to `run` (or a class of
                the same JSON schema).
            accept: The judge of a final answer.
            on_text: Receives streamed text deltas.
            tool_error_text: Overrides the engine's hook for this run.
            force: Take the run over even though its lease has not expired
                (its process is known to be dead).

        Returns:
            The `RunResult`; it may be ``paused`` again.

        Raises:
            ConfigError: before anything is sent: a state that does not load,
                a pending call without a decision or a decision for no pending
                call, ``tools`` lacking one of the run's tools (a state encoded
                before they were kept: an approved call's), an output model
                other than the run's (its JSON schema differs; a state encoded
                before the schema's digest was kept: a missing or extra
                model), an invocation the ledger does not hold paused, a state
                other than the one its pause returned (an earlier pause's,
                another run's, or one edited in more than its counts:
                `RunState.seal`), or a pause longer than
                ``Limits.pause_timeout`` (the invocation is then ended
                ``time_limit``), or an invocation id the run store does not
                hold, or (on an engine without a run store) a run whose state
                a run store on the ledger keeps, or a run that reserved its
                credits on an account this engine would not charge (it has no
                accounts, or its ``key`` names another).
            RunBusyError: another resume took the pause or holds the run, or
                its process's lease has not expired; nothing was sent or recorded.
        """
        _validate.boolean("force", force)
        if decisions is not None and not isinstance(decisions, Mapping):
            raise ConfigError("decisions", "must be a mapping of pending call id to Approve(), "
                                           f"Deny(reason) or Supply(text), got "
                                           f"{_validate.shown(decisions)}")
        tools = check_tools(tools)  # read more than once below
        output = _check_output(output)
        stored: StoredRun | None = None
        by_id = isinstance(state, str) and not state.lstrip().startswith("{")
        if isinstance(state, str) and by_id:
            if self.run_store is None:
                raise ConfigError("state", "resuming a run by its invocation id needs "
                                           "Engine(run_store=...)")
            stored = await self.run_store.load(state)
            if stored is None:
                raise ConfigError("state", f"the run store holds no run {state[:80]!r} "
                                           "(it ended, or never ran with a run store)")
            state = stored.state
        if isinstance(state, bytes | str):
            state = RunState.loads(state)
        if not isinstance(state, RunState):
            raise ConfigError("state", f"must be a RunState, got {_validate.shown(state)}")
        if self.run_store is not None and stored is None:
            stored = await self.run_store.load(state.invocation_id)
        elif self.run_store is None and await holds_run(self.ledger, state.invocation_id):
            # Resumed here, its row would outlive it, and its lease go unchecked.
            raise ConfigError("state", f"run {state.invocation_id} keeps its state in a run "
                                       "store: resume it on an engine with "
                                       "run_store=RunStore(ledger)")
        await self._check_resume_account(state)
        untaken = None
        # The row's state, read once (by id, it is ``state`` already).
        saved = None if stored is None else state if by_id else RunState.loads(stored.state)
        if stored is not None:
            assert saved is not None
            stored.check_free(self.clock.wall(), force)
            if stored.unsettled_take(saved):
                untaken = await self._settle_take(stored, saved)
        # A stored run that is not paused was running when its process died:
        # its last checkpoint is newer than any state the caller holds.
        recovering = stored is not None and stored.paused_at is None
        if recovering and not by_id:
            assert saved is not None
            state = saved
        elif saved is not None and not by_id:
            # Before the claim: a state that is not the pause's takes nothing.
            check_seal(state, saved.seal())
        # The sources' tools as they are now, read once for the checks and the run.
        expanded = expand_tools(tools)
        if recovering and not state.pending:
            assert self.run_store is not None
            state = replace(state, pending=await self._in_doubt(state, expanded.tools))
            # Calls this recovery finds in doubt have been decided by nobody:
            # decisions given with it were made before, for their approval
            # (a queue's job delivered again), so the run pauses and asks.
            found_in_doubt = any(call.reason == "in_doubt" for call in state.pending)
        else:
            found_in_doubt = False
        if recovering and decisions:
            # A job delivered again carries decisions its first delivery
            # already applied (those calls ran, or were recorded approved):
            # stale, not errors. Only the pending calls take decisions.
            pending_ids = {call.id for call in state.pending}
            decisions = {key: value for key, value in dict(decisions).items()
                         if key in pending_ids}
        undecided = recovering and bool(state.pending) and (not decisions or found_in_doubt)
        decided = {} if undecided else check_decisions(state.pending, decisions)
        if operation is None:
            operation = state.operation
        elif not isinstance(operation, Operation) or _route(operation) != _route(
                state.operation):
            # The invocation's row names one version, route and model: a
            # resumed segment sent elsewhere would be audited as the row's.
            name, version, provider, model = _route(state.operation)
            raise ConfigError("operation", f"must be the run's operation, {name!r} version "
                                           f"{version!r} on {provider!r} model {model!r}")
        _check_resume_tools(state, tools, expanded.tools, decided)
        _check_resume_output(state, output)
        inv, spec = self._prepare_run(
            operation, state.messages[:max(1, state.given)], system=state.system,
            tools=tools, expanded=expanded, output=output, accept=accept,
            attribution=state.attribution,
            limits=state.limits, retry=state.retry, on_text=on_text,
            tool_error_text=tool_error_text, final_tool=state.final_tool,
            # The run's features as it ran: narrowed from the operation's again.
            features=None if state.features is None else _validate.field_values(
                state.features))
        # The transcript as it paused: its last reply's calls still wait for results.
        spec = replace(spec, messages=copy.deepcopy(state.messages))
        release = None
        if stored is not None:
            assert self.run_store is not None
            # Taken before anything is sent or recorded: of two resumes, one.
            inv.lease_owner = owner = new_owner()
            release = functools.partial(self.run_store.release, state.invocation_id, owner,
                                        paused_at=stored.paused_at)
            left = state.limits.total_time
            if left is not None:
                left = max(0.0, left - state.progress.running_seconds)
            try:
                await self.run_store.claim(
                    state.invocation_id, inv.lease_owner, version=stored.version,
                    expires_at=self.clock.wall() + timedelta(
                        seconds=(left if left is not None else UNBOUNDED_RUN)
                        + self.run_store.lease_grace),
                    now=self.clock.wall(), force=force)
            except RunBusyError:
                raise  # another resume holds it: nothing was taken
            except BaseException:
                # Cancelled (or failed) while the claim was written: it may have
                # committed all the same, so it is given back.
                await give_back(state.invocation_id, release)
                raise
        # A run paused without a run store: its first checkpoint adopts it
        # into this engine's (`_Loop.run`).
        return await resume_loop(inv, spec, state, decided, recovering=recovering,
                                 untaken=untaken,
                                 undecided=undecided, release=release,
                                 adopt=self.run_store is not None and stored is None)

    async def _settle_take(self, stored: StoredRun, saved: RunState) -> str | None:
        """A row a resume wrote to take the run's pause, its process dead (or its
        resume failed) before the run's first checkpoint after the take
        (`StoredRun.unsettled_take`): the recovery goes on when a resume under
        a run store took the pause (its row is this one: None is returned) or
        nobody did (the ledger holds the pause the row's state is: its seal
        is returned, for the recovery to take it as a resume does).
        Otherwise another resume, on an engine without a run store, took the
        pause (`taken_without_store`), or took it and paused the run again,
        and the run is its own: the row is deleted, so that no recovery takes
        the run from it.

        Raises:
            RunBusyError: another resume took the pause; nothing was taken.
        """
        assert self.run_store is not None
        found = await self.run_store.ledger.read_progress(stored.invocation_id)
        if found is None or found.outcome not in ("running", "paused"):
            return None  # ended: the resume forgets the row and says so
        if found.outcome == "running" and not taken_without_store(found.seal):
            return None
        if found.outcome == "paused" and found.seal in (None, saved.seal()):
            return found.seal or ""
        # Unless another recovery wrote it since it was read.
        await self.run_store.drop(stored.invocation_id, None, version=stored.version)
        raise RunBusyError(stored.invocation_id, None, "another resume took its pause")

    async def _check_resume_account(self, state: RunState) -> None:
        """Refuse to resume a run that reserved its credits on an account on an
        engine that would not charge that account: its resumed segment would
        run unreserved and uncharged, and `audit reconcile` find the account
        short of the run's credits.

        Raises:
            ConfigError: this engine has no accounts, or charges the run's
                attribution to another account.
        """
        account = await recorded_account(self.ledger, state.invocation_id)
        if account is None:
            return
        mine = None if self.accounts is None else self.accounts.account_for(state.attribution)
        if mine == account:
            return
        here = ("this engine has no accounts" if self.accounts is None
                else f"this engine's accounts charge it to {mine!r}")
        raise ConfigError("state", f"run {state.invocation_id} reserved its credits on account "
                                   f"{account!r}, and {here}: resume it on an engine with "
                                   "accounts=CreditAccounts(ledger) that charges it there")

    async def _in_doubt(self, state: RunState, tools: tuple[Tool, ...]
                        ) -> tuple[PendingCall, ...]:
        """The calls of a recovered run's batch that wait for a decision: those
        that may have run (recorded ``started`` or ``in_doubt`` without an
        end, not of an ``idempotent`` tool: those run again), and those not
        run yet whose tool asks for approval (not approved yet)."""
        assert self.run_store is not None
        if not state.batch:
            return ()
        statuses = await self.run_store.tool_calls(state.invocation_id)
        done = {str(r.get("tool_use_id")) for r in state.results}
        last = state.messages[-1] if state.messages else {}
        blocks = {str(b.get("id")): b for b in last.get("content") or ()
                  if isinstance(b, Mapping) and b.get("type") == "tool_use"}
        by_name = {t.name: t for t in tools}
        pending: list[PendingCall] = []
        waiting: list[Mapping[str, Any]] = []
        for call_id in state.batch:
            block = blocks.get(call_id)
            if block is None or call_id in done:
                continue
            status = statuses.get(call_id)
            if status not in ("started", "in_doubt"):
                if status != "approved":
                    waiting.append(block)  # not run yet: it may still need approval
                continue
            tool = by_name.get(str(block.get("name")))
            if tool is not None and tool.idempotent:
                continue
            pending.append(PendingCall(call_id, str(block.get("name")),
                                       block.get("input", {}), "in_doubt"))
        return (*pending, *pending_approvals(waiting, by_name, state.invocation_id))

    def _prepare_run(
        self,
        operation: Operation,
        messages: Messages,
        *,
        system: System = None,
        tools: Iterable[Tool | ToolSource] = (),
        expanded: ExpandedTools | None = None,
        output: type[pydantic.BaseModel] | None = None,
        accept: Callable[[Any], Any] | None = None,
        attribution: Attribution | None = None,
        limits: Limits | Mapping[str, object] | None = None,
        retry: RetryPolicy | Mapping[str, object] | None = None,
        features: Mapping[str, Any] | None = None,
        on_text: TextCallback | None = None,
        tool_error_text: ToolErrorText | None = None,
        final_tool: str = ANSWER_TOOL,
        observers: Sequence[Observer] = (),
        text_sink: Callable[[TextDelta], None] | None = None,
    ) -> tuple[Invocation, RunSpec]:
        """Check a run's input and build its invocation (nothing is sent or recorded).

        ``expanded``: ``tools`` with each source's tools in place, when the
        caller already read them (`expand_tools`; a resume does, for its checks)."""
        given = check_tools(tools)
        if expanded is None:
            expanded = expand_tools(given)
        spec = RunSpec(
            messages=normalize_messages(messages),
            system=normalize_system(system),
            tools=expanded.tools,
            # Read again before each turn and each batch (`ToolSource`).
            sources=given if any(isinstance(t, ToolSource) for t in given) else (),
            output=_check_output(output),
            accept=_check_callable("accept", accept),
            on_text=_check_callable("on_text", on_text),
            tool_error_text=_check_callable("tool_error_text", tool_error_text)
            or self.tool_error_text,
            final_tool=final_tool,
        )
        check_tool_name("final_tool", final_tool)
        if output is None and final_tool != ANSWER_TOOL:
            raise ConfigError("final_tool", f"{final_tool!r} would name the answer tool of a "
                                            "structured run, and this run has no output "
                                            "model: give output= too, or leave final_tool out")
        check_unique_tools(spec.tools, final_tool, structured=output is not None,
                           places=expanded.places)
        check_delegates(spec.tools, self.ledger, self.prices)
        inv = self._invocation("run", operation, limits, retry, attribution, features=features,
                               observers=observers, text_sink=text_sink)
        check_server_tool_names(inv.features.server_tools, {
            *(t.name for t in spec.tools), *((final_tool,) if output is not None else ())})
        if (spec.on_text is not None or text_sink is not None) and not inv.provider.streaming:
            # Silence would look like a model that said nothing (docs/observability.md).
            wants = "on_text" if text_sink is None else "Engine.stream"
            raise ConfigError(
                wants,
                f"route {operation.provider!r} is served by {type(inv.provider).__name__}, "
                f"which cannot stream (its streaming is False), so {wants} would get no "
                "text: serve the route with a provider that streams, or make yours "
                "stream (streaming True, send hands on_text the text)")
        inv.engine = self  # where its tools' delegated runs start (ToolContext.run)
        inv.run_store = self.run_store
        return inv, spec

    def stream(
        self, operation: Operation, messages: Messages, **run_kwargs: Any
    ) -> contextlib.AbstractAsyncContextManager[RunStream]:
        """Run a conversation as `run` does, yielding its events as they happen.

        Example::

            async with engine.stream(operation, "Plan my week", tools=tools) as run:
                async for event in run:
                    if isinstance(event, loopengine.events.TextDelta):
                        print(event.text, end="")
            result = run.result

        ``run_kwargs`` are `run`'s keywords. The iteration yields the events
        observers get (`RunStarted` ... `RunEnded`) and a
        `loopengine.events.TextDelta` for each piece of text: each request of
        the run is streamed, whatever the provider's ``stream`` setting (a
        retried attempt's text has its own ``attempt``). ``run.result`` is the
        `RunResult` once the iteration has ended. Leaving the ``async with``
        early (a ``break``) cancels the run, recorded ``cancelled``.

        Raises:
            ConfigError: bad input, or a provider that cannot stream, at
                ``async with``, before anything is sent.
        """
        unknown = set(run_kwargs) - _RUN_KEYWORDS
        if unknown:
            raise ConfigError(sorted(unknown)[0], "is not an argument of Engine.run")

        def prepare(observers: Sequence[Observer], text_sink: Callable[[TextDelta], None],
                    ) -> tuple[Invocation, RunSpec]:
            return self._prepare_run(operation, messages, observers=observers,
                                     text_sink=text_sink, **run_kwargs)

        return stream_run(prepare)

    async def call(
        self,
        operation: Operation,
        messages: Messages,
        *,
        output: type[M],
        system: System = None,
        retry: RetryPolicy | Mapping[str, object] | None = None,
        attribution: Attribution | None = None,
        max_tokens: int | None = None,
        limits: Limits | Mapping[str, object] | None = None,
        prompt_fallback: bool = False,
    ) -> CallResult[M]:
        """Make one structured call of ``operation`` and report every request it made.

        The model is forced to answer through a tool whose input schema is
        ``output``. Invalid replies are retried with the validation error fed
        back, truncated ones with ``max_tokens`` doubled (unless
        ``retry.grow_max_tokens`` is false) up to the growth ceiling: the
        operation's ``model_max_output_tokens`` when it publishes one, else
        four times the first request's ``max_tokens``. Transport faults are
        retried as in a run. ``retry.max_attempts`` caps
        every request of the call (1 turns retries off); a value above the
        operation's own is clamped. See docs/structured-calls.md.

        Args:
            operation: The published operation.
            messages: One user message, or Anthropic-shaped message dicts.
            output: The pydantic model of the answer.
            system: The system prompt: a string or Anthropic text blocks.
            retry: Narrows the operation's retry policy for this call.
            attribution: Who the call is accounted to.
            max_tokens: The first request's ``max_tokens`` (default: the
                operation's ``max_output_tokens``); never above that, nor
                above ``model_max_output_tokens``.
            limits: Narrows the operation's limits a call applies:
                ``total_time``, ``attempt_timeout`` and ``credit_hold`` (naming
                another is a `ConfigError`: ``retry.max_attempts`` caps the
                call's requests).
            prompt_fallback: Make the last permitted attempt with a
                prompt-embedded schema when native attempts failed validation.

        Returns:
            The `CallResult`: ``data``, ``usage`` (of the attempt ``data`` came
            from) and ``attempts``.

        Raises:
            ConfigError: bad input, e.g. ``retry.max_attempts`` not an integer
                in 1..16 (``.field == "retry.max_attempts"``).
            ProviderError: a provider fault ended the call; ``.attempts`` says
                how many requests it made.
            StructuredOutputError: the attempts ran out without a valid answer.
            OutcomeError: the call was refused, ran out of time or credits, or
                its credit account admitted nothing (``admission_denied``).
            LedgerError: the ledger could not record the call; it is recorded
                ``failed`` where the ledger still can.
            ReplayMismatchError: a `ReplayProvider`'s recording diverged;
                recorded ``failed`` likewise.
        """
        checked_output = _check_output(output)
        if checked_output is None:
            raise ConfigError("output", "a structured call needs an output model")
        if max_tokens is not None:
            _validate.integer("max_tokens", max_tokens, minimum=1)
        _validate.boolean("prompt_fallback", prompt_fallback)
        inv = self._invocation("call", operation, limits, retry, attribution)
        _check_call_limits(limits)
        spec = CallSpec(
            messages=normalize_messages(messages),
            system=normalize_system(system),
            output=checked_output,
            max_tokens=max_tokens or operation.max_output_tokens,
            prompt_fallback=prompt_fallback,
        )
        return await run_call(inv, spec)

    run_sync = sync_method(run)
    resume_sync = sync_method(resume)
    call_sync = sync_method(call)

    @classmethod
    def from_model(cls, model: str | Operation, **engine_options: Any) -> Engine:
        """An engine for ``model`` (``"anthropic:claude-sonnet-4-5"``,
        ``"openai:gpt-4o"``, or an operation built from one), its provider built
        from the environment as the vendor's SDK reads it (``ANTHROPIC_API_KEY``
        or ``ANTHROPIC_AUTH_TOKEN`` and ``ANTHROPIC_BASE_URL``, ``OPENAI_API_KEY``
        and ``OPENAI_BASE_URL``, ``GOOGLE_API_KEY`` or ``GEMINI_API_KEY``).

        Args:
            model: ``"vendor:model"`` or an `Operation`: the vendor picks the provider.
            **engine_options: `Engine`'s keywords (``ledger=``, ``prices=``, ...).

        Raises:
            ConfigError: an unknown vendor (or a route a model string does not
                build), or its API key variable is not set.
            ImportError: the vendor's SDK is not installed (the message names the
                extra to install).
        """
        return engine_from_model(cls, model, **engine_options)

    def estimate(
        self,
        operation: Operation,
        messages: Messages,
        *,
        system: System = None,
        tools: Iterable[Tool | ToolSource] = (),
        output: type[pydantic.BaseModel] | None = None,
        limits: Limits | Mapping[str, object] | None = None,
    ) -> Estimate:
        """The worst case of a run of ``operation``, before it starts: tokens, USD, credits.

        Synchronous, offline: input is counted with the shipped ``cl100k_base``
        and scaled to Claude's tokenizer; output and turns are the limits'
        worst case; prices are this engine's, at its clock's current time. See
        docs/observability.md for the model.

        Args:
            operation: The published operation.
            messages: One user message, or Anthropic-shaped message dicts.
            system: The system prompt: a string or Anthropic text blocks.
            tools: The tools the run would offer.
            output: The structured-mode model, whose terminal tool is counted.
            limits: Narrows the operation's limits, as for `run`.

        Raises:
            ConfigError: bad input, as `run` would raise it.
            LoopEngineError: the shipped tokenizer file is damaged.
        """
        expanded = expand_tools(check_tools(tools))
        return estimate_run(operation, normalize_messages(messages),
                            system=normalize_system(system), tools=expanded.tools,
                            places=expanded.places, output=output,
                            limits=limits, prices=self.prices, at=self.clock.wall(),
                            vendor=(provider := self.provider_for(operation)).vendor,
                            geo=provider.inference_geo,
                            billing=_billing(provider, operation, operation.features))


def _route(operation: Operation) -> tuple[str, str, str, str]:
    """What names a run's operation in its ledger row: name, version, route, model."""
    return operation.name, operation.version, operation.provider, operation.model


def normalize_messages(messages: Messages) -> list[dict[str, Any]]:
    """One user message or a list of Anthropic-shaped messages, as our own copy.

    Each message is checked against the shape the installed ``anthropic`` SDK
    declares (``anthropic.types.MessageParam``): a ``role`` of ``user`` or
    ``assistant`` and no other keys but ``content``, a string or a list of
    content blocks, each matching the SDK's type for its ``type``
    (`loopengine._validate.content_block`). As the API requires, the first
    message is the user's, only a final assistant message (a prefill) may
    be empty, and a user message holds no empty text block and some
    non-whitespace text unless it holds other blocks. All of it is checked
    before anything is sent.

    Raises:
        ConfigError: the first problem found; ``.field`` is its path, e.g.
            ``"messages[1].content[0].type"``.
    """
    if isinstance(messages, str):
        if not messages.strip():
            # The API refuses a user message without non-whitespace text (a 400
            # after the attempt's row): refused here, as an empty one is.
            raise ConfigError("messages", "must not be empty or blank")
        # Proven encodable as a list's strings are: a lone surrogate fails here,
        # not in the SDK after the attempt's row.
        return [{"role": "user", "content": _validate.json_copy("messages", messages)}]
    if not isinstance(messages, Sequence) or not messages:
        raise ConfigError("messages", "must be a string or a non-empty list of messages")
    out: list[dict[str, Any]] = []
    last = len(messages) - 1
    for i, message in enumerate(messages):
        field = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise ConfigError(field, f"must be a dict, got {type(message).__name__}")
        role = message.get("role")
        if role not in ("user", "assistant"):
            hint = " (give the system prompt as system=)" if role == "system" else ""
            got = repr(role) if isinstance(role, str) and len(role) <= 40 else type(role).__name__
            raise ConfigError(f"{field}.role", f"must be 'user' or 'assistant', got {got}{hint}")
        if i == 0 and role != "user":
            raise ConfigError(f"{field}.role", "the first message must be the user's, "
                                               f"got {role!r}")
        for key in message:
            if key not in ("role", "content"):
                name = key if isinstance(key, str) and key.isidentifier() else "?"
                raise ConfigError(f"{field}.{name}",
                                  "is not a message field (a message has role and content)")
        content = message.get("content")
        if isinstance(content, str):
            empty = not content
        elif isinstance(content, list | tuple):
            empty = not content
            for j, block in enumerate(content):
                _validate.content_block(f"{field}.content[{j}]", block)
        else:
            raise ConfigError(f"{field}.content", "must be a string or a list of content "
                                                  f"blocks, got {type(content).__name__}")
        if empty and not (i == last and role == "assistant"):
            raise ConfigError(f"{field}.content", "must not be empty (only a final assistant "
                                                  "message may be)")
        if role == "user":
            _check_user_text(field, content)
        out.append(_validate.json_copy(field, message))
    return out


def _check_user_text(field: str, content: str | Sequence[Any]) -> None:
    """A user message's text is what the API accepts: no empty text block, and
    some non-whitespace text when the message holds nothing but text (it refuses
    either with a 400, which would come after the attempt's row). Assistant
    messages are left as the model wrote them: they are its own history."""
    if isinstance(content, str):
        if not content.strip():
            raise ConfigError(f"{field}.content", "must not be blank (the API needs "
                                                  "non-whitespace text)")
        return
    texts = [(j, block.get("text")) for j, block in enumerate(content)
             if block.get("type") == "text"]
    for j, text in texts:
        if text == "":
            raise ConfigError(f"{field}.content[{j}].text", "must not be empty")
    if len(texts) == len(content) and not any(
            isinstance(text, str) and text.strip() for _, text in texts):
        raise ConfigError(f"{field}.content[{texts[0][0]}].text",
                          "must not be blank: the message holds no non-whitespace text")


def normalize_system(system: System) -> list[dict[str, Any]] | None:
    """A system prompt string or text blocks, as a list of text blocks.

    Each block is checked against the anthropic SDK's ``TextBlockParam``
    (``cache_control`` and ``citations`` included).

    Raises:
        ConfigError: not a string or a list of ``text`` blocks; ``.field`` is
            the offending path, e.g. ``"system[0].cache_control.ttl"``.
    """
    if system is None:
        return None
    if isinstance(system, str):
        if not system:
            return None
        return [{"type": "text", "text": _validate.json_copy("system", system)}]
    if not isinstance(system, Sequence):
        raise ConfigError("system", "must be a string or a list of text blocks")
    out: list[dict[str, Any]] = []
    for i, block in enumerate(system):
        if not isinstance(block, Mapping) or block.get("type") != "text":
            raise ConfigError(f"system[{i}]", "must be a text block {'type': 'text', 'text': ...}")
        _validate.content_block(f"system[{i}]", block, kinds=("text",))
        out.append(_validate.json_copy(f"system[{i}]", block))
    return out or None


def check_tools(tools: object) -> tuple[Tool | ToolSource, ...]:
    """The ``tools`` argument of `Engine.run` and `Engine.estimate`, as a tuple
    of tools and tool sources (an MCP server, whose tools may change).

    Raises:
        ConfigError: a single `Tool` or source (not a list of them), a string,
            a mapping or anything else that is not an iterable of tools; each
            item must be a `Tool` or a source (checked with the names,
            `check_unique_tools`).
    """
    if isinstance(tools, Tool):
        raise ConfigError("tools", f"must be a list of tools, got the single tool "
                                   f"{tools.name!r}: pass tools=[{tools.name}]")
    if isinstance(tools, ToolSource):
        raise ConfigError("tools", f"must be a list of tools, got the single source "
                                   f"{tools!r}: pass tools=[server]")
    if isinstance(tools, str | bytes | Mapping) or not isinstance(tools, Iterable):
        raise ConfigError("tools", f"must be a list of tools, got {type(tools).__name__}")
    checked = tuple(tools)
    for i, item in enumerate(checked):
        if not isinstance(item, Tool | ToolSource):
            raise ConfigError(f"tools[{i}]", "must be a Tool (use @loopengine.tool), "
                                             f"got {_validate.shown(item)}")
    return checked


def _check_resume_tools(state: RunState, tools: tuple[Tool | ToolSource, ...],
                        expanded: tuple[Tool, ...], decided: Mapping[str, Decision]) -> None:
    """A resume's ``tools`` carry every tool the run of ``state`` was given (a
    state that predates that record: every approved call's tool), so an
    approved call is never answered "no such tool" by mistake. A tool a
    given source may have dropped while the run was paused is not asked for:
    its calls are answered as an unknown tool's.

    Raises:
        ConfigError: a tool missing, named."""
    names = {tool.name for tool in expanded}
    sources = [item for item in tools if isinstance(item, ToolSource)]
    needed = list(state.tools or ())
    needed += [call.tool for call in state.pending if isinstance(decided.get(call.id), Approve)]
    missing = sorted({name for name in needed if name not in names
                      and not any(source.offers(name) for source in sources)})
    if missing:
        raise ConfigError("tools", f"lacks the run's tool(s) {', '.join(map(repr, missing))}: "
                                   "pass the tools the run was given")


def _check_resume_output(state: RunState, output: type[pydantic.BaseModel] | None) -> None:
    """A resume's ``output`` is the run's output model: one exactly when the run
    had one, and (when the state keeps its digest) the same terminal tool
    definition, so the model's answer is validated as the run asked for it.

    Raises:
        ConfigError: another output model, or a missing or extra one."""
    if (output is not None) != state.structured:
        raise ConfigError("output", "must be the output model the run was started with"
                                    if state.structured else
                                    "the run was started without one")
    if output is None or state.output_digest is None:
        return  # a state encoded before the digest was kept: only the presence checked
    definition = final_tool_definition(output, state.final_tool)
    digests = {json_digest(definition)}
    earlier = _validate.earlier_model_schema(output)
    if earlier is not None:
        # A recursive model's run paused when its schema was sent as a bare
        # ``$ref``: its digest is of that schema, the same model's.
        digests.add(json_digest(definition | {"input_schema": earlier}))
    if state.output_digest not in digests:
        raise ConfigError("output", f"must be the output model the run was started with: "
                                    f"{output.__name__}'s JSON schema is not the run's")


def _check_output(output: object) -> type[pydantic.BaseModel] | None:
    if output is None:
        return None
    _validate.model_schema("output", output)  # a model no tool can carry fails here
    assert isinstance(output, type) and issubclass(output, pydantic.BaseModel)
    return output


def _check_callable(field: str, value: Any) -> Any:
    if value is not None and not callable(value):
        raise ConfigError(field, f"must be callable, got {_validate.shown(value)}")
    return value
