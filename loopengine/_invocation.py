"""One invocation's state and accounting, shared by `Engine.run` and `Engine.call`.

`Invocation` holds what one run or call has done so far: its attempts'
records, usage, cost and charges, and where it stands in its lifecycle. The
steps that change it live by concept: `loopengine._lifecycle` (begin, end,
the cleanup nothing interrupts), `loopengine._admission` (the credit
account's reservation and settlement) and `loopengine._attempt` (each
attempt: dispatch, send, settle; the retry loop). The run loop and the
structured call decide *what* to send; none of these decides anything about
the conversation.
"""

from __future__ import annotations

import inspect
import logging
import math
import random
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import TYPE_CHECKING

import anyio

from loopengine._accounts import CreditAccounts, Reservation
from loopengine._attribution import Attribution
from loopengine._clock import Clock
from loopengine._errors import LoopEngineError
from loopengine._features import Features
from loopengine._operation import Operation
from loopengine._pricing import Billing, PriceBook, Priced, nanousd_to_usd
from loopengine._raised import own_failure
from loopengine._result import AttemptsSummary
from loopengine._usage import Usage, sum_past_limit
from loopengine._validate import MAX_INTEGER
from loopengine.events import Event, Observer, TextDelta
from loopengine.guards._checkpoints import ConversationState, GuardTrip, check_before_attempt
from loopengine.guards._credits import turn_credits
from loopengine.guards._deadline import Deadline
from loopengine.guards._limits import Limits
from loopengine.persistence._protocol import Ledger
from loopengine.persistence._records import AttemptRecord
from loopengine.providers._base import Container, Provider
from loopengine.providers._faults import ProviderFault
from loopengine.providers._retry import RetryPolicy

if TYPE_CHECKING:
    from loopengine._runstore import RunStore

logger = logging.getLogger("loopengine")

__all__ = ["LEDGER_GRACE", "InFlight", "Invocation"]


@dataclass(slots=True)
class InFlight:
    """The attempt in flight: its record's index, when it started, what the
    run's ``on_text`` callback raised, and what a cut stream had served."""

    index: int
    started: float
    announced: bool = False
    """Whether its `AttemptStarted` was emitted."""
    written: bool = False
    """Whether its row was written (its dispatch's write returned; at once
    without a ledger): from then on the ledger has it, sent or not."""
    sent: bool = False
    """Whether the request was handed to the provider (its row was durable)."""
    callback_error: BaseException | None = None
    """What the run's ``on_text`` callback raised during this attempt."""
    served: ProviderFault | None = None
    """What its stream had served when a cancellation cut it (the provider's
    report to `loopengine.providers._base.watch_cuts`): its settle keeps it."""
    clock: Clock | None = None
    """The engine's clock, once the request is sent."""
    ends: float = math.inf
    """When its own timeout elapses, on ``clock``."""
    deadline: float = math.inf
    """When the earliest deadline around it (the run's, or its caller's) passes,
    on ``clock``."""
    deadline_cut: bool = False
    """Whether a replay of a recorded attempt the deadline cut said so
    (`cut_at_deadline`): its timeout is the deadline's doing, as a capped one is."""

    def keep_served(self, cut: ProviderFault) -> None:
        """Keep what the stream had served when a cancellation cut it."""
        self.served = cut

    def cut_by(self) -> str:
        """What a cancellation cutting the attempt now is (`ServedSink.cut_by`)."""
        # A microsecond's leeway: the times are sums of floats on the same clock.
        now = math.inf if self.clock is None else self.clock.now() + 1e-6
        if now >= self.deadline:
            return "deadline"
        return "timeout" if now >= self.ends else "caller"

    def cut_at_deadline(self) -> None:
        """Take the timeout about to be raised as the deadline's (`ServedSink`)."""
        self.deadline_cut = True


_NOBODY = Attribution()
"""The attribution of a run given none (frozen: one instance serves them all)."""

LEDGER_GRACE = 0.2
"""Seconds past the deadline that the writes settling a run are awaited (a cut
attempt's settle, the end, the account's settlement; inside the run its
deadline scope ends every wait), and the least an end is awaited: past them
the run returns, its writes queued (a stalled writer cannot hold a run past
its deadline, R04)."""


class Invocation:
    """The accounting of one run or call (internal)."""

    # Slots: thousands are alive at once in a busy process.
    __slots__ = (
        "account", "accounts", "announced", "asked_limits", "attribution", "base_attempts",
        "base_turns", "begun", "clock", "container", "cost_nanousd", "credits", "deadline",
        "denied", "depth",
        "descendant_credits", "earlier_attempts", "ended", "engine", "features", "fee_excess",
        "fees_reserved", "id",
        "in_flight", "kind",
        "last_fault", "ledger", "limits", "billing", "max_depth", "observers", "operation",
        "output_tokens", "parent",
        "paused_seconds", "paused_turn", "pause_seal", "permit", "policy", "prices", "provider",
        "segment_token",
        "provider_cost_nanousd",
        "lease_owner", "records", "reservation", "admitting", "deadline_cut", "rng", "run_store",
        "served_by", "started", "text_sink", "turn_attempts", "turn_charge", "turns_credits",
        "unpriced",
        "unpriced_warned", "usage", "usage_complete", "vendor", "genai_operation", "geo",
    )
    def __init__(
        self,
        *,
        kind: str,
        operation: Operation,
        provider: Provider,
        limits: Limits,
        policy: RetryPolicy,
        attribution: Attribution | None,
        ledger: Ledger | None,
        prices: PriceBook,
        clock: Clock,
        rng: random.Random,
        observers: Sequence[Observer],
        unpriced_warned: set[str] | None = None,
        accounts: CreditAccounts | None = None,
        account: str | None = None,
        text_sink: Callable[[TextDelta], None] | None = None,
        features: Features | None = None,
        billing: Billing,
    ) -> None:
        self.id = str(uuid.uuid4())
        self.kind = kind
        self.operation = operation
        self.features = features if features is not None else operation.features
        """The request features of this run: the operation's, narrowed (R13)."""
        self.provider = provider
        self.limits = limits
        self.asked_limits = limits
        """The limits before admission narrowed them (what a resume asks again)."""
        self.policy = policy
        self.attribution = attribution or _NOBODY
        self.ledger = ledger
        self.prices = prices
        self.clock = clock
        self.rng = rng
        self.observers = tuple(observers)
        self.vendor = provider.vendor
        """Whose API serves the route: what ``served_by`` and prices name."""
        self.genai_operation = provider.genai_operation
        """What its requests are, as the GenAI conventions name the operation."""
        self.geo = provider.inference_geo
        """Where the provider serves every request, when that changes the price
        (`Provider.inference_geo`): each reply's usage carries it."""
        self.billing = billing
        """How the provider bills its requests beyond their usage, asked once before
        the run (`Provider.billing` of its model and features): its credit hold
        check, its reservations and every attempt's price read it."""
        self.served_by = f"{self.vendor}:{operation.model}"
        self.started = clock.now()
        self.deadline = Deadline.after(self.started, limits.total_time)
        self.records: list[AttemptRecord] = []
        self.run_store: RunStore | None = None
        """Where the run checkpoints its state and holds its lease, or None
        (docs/pause-and-resume.md)."""
        self.lease_owner: str | None = None
        """This segment's lease owner id in the run store."""
        self.base_attempts = 0
        """Attempts of the invocation's earlier segments (a resumed run's ordinals continue)."""
        self.base_turns = 0
        """Turns of the invocation's earlier segments (those a resumed run goes on
        from): its turns never count fewer."""
        self.earlier_attempts: dict[int, int] = {}
        """Each turn's highest attempt number in earlier segments: a recovered run's
        turn sent again goes on numbering its attempts from there."""
        self.paused_seconds = 0.0
        """How long a resumed run waited paused."""
        self.paused_turn: tuple[int, Usage, int] | None = None
        """A resumed run's turn whose calls waited: its number, its successful
        attempts' usage and its charge in nano-USD, all made before the pause."""
        self.pause_seal: str | None = None
        """The seal of the pause a resumed run takes (its ledger's compare-and-set), or None."""
        self.segment_token: str | None = None
        """What the ledger's row keeps as its ``pause_seal`` while this segment runs
        it: ``""`` for a run's first segment, the token its take wrote for a
        resumed one; None before the row is this segment's. A segment holding
        a run store's lease ends and pauses the run only on it (`held_end`)."""
        self.usage = Usage()
        self.usage_complete = True
        self.output_tokens = 0
        self.cost_nanousd = 0
        self.provider_cost_nanousd = 0
        self.unpriced = False
        self.last_fault: ProviderFault | None = None
        self.turn_attempts: dict[int, int] = {}
        self.turn_charge: dict[int, int] = {}
        """Each turn's charge in nano-USD: its charged attempts' cost (`add_charge`)."""
        self.turns_credits = 0
        """The sum of `turn_credits` over every turn of ``turn_charge``, kept as they grow."""
        self.in_flight: InFlight | None = None
        self.ended = False
        self.announced = False
        self.begun = False
        self.accounts = accounts if account is not None else None
        self.account = account
        self.reservation: Reservation | None = None
        self.admitting = False
        self.deadline_cut = False
        """A replayed attempt was cut by the run's deadline, as recorded
        (`InFlight.cut_at_deadline`): no time remains for another request,
        whatever the replay's clock says."""
        """Its admission asked its account for a reservation and the run stopped
        waiting for the answer (a cancellation, its deadline): its end settles
        whatever reservation of it landed (`settle_account`)."""
        self.fees_reserved = 0
        """The worst case of one turn's server-tool fees its account reservation
        holds on top of its hold (a root run on an account, `admit`)."""
        self.fee_excess = 0
        """How far the worst case of one of its turns' server-tool fees passes what
        its root's reservation holds for them (a delegated run): its turns see the
        root's hold that much lower (`credit_tree`)."""
        self.text_sink = text_sink
        """Where streamed text goes as `TextDelta` (`Engine.stream`), or None."""
        self.denied: GuardTrip | None = None
        """Set by `begin` when the run's account had nothing to reserve."""
        self.unpriced_warned = unpriced_warned if unpriced_warned is not None else set()
        self.credits = 0
        """Its own turns' credits so far (R03): what its ledger row records."""
        self.descendant_credits = 0
        """The credits of the runs it delegated to, theirs included, as they are spent."""
        self.parent: Invocation | None = None
        """The run whose tool started this one (a sub-agent, docs/tools.md), or None."""
        self.depth = 0
        """How deep it is nested: 0 for a root, 1 for its children, ..."""
        self.max_depth: int | None = None
        """How deep its tree may nest, as the delegations above it bound it (the
        least ``max_depth`` on its path from the root); None for a root."""
        self.engine: object = None
        """The `Engine` running it: where ``ToolContext.run`` starts a child by default."""
        self.permit: anyio.Lock | None = None
        """A root's crossing permit, shared by its tree (`crossing_permit`)."""
        self.container: Container | None = None
        """The code execution container the latest settled reply that named one
        named (set by `loopengine._attempt.settle`; a resumed run's from its
        state): its id goes on the later requests while it lives (`live_container`)."""

    def add_credits(self, credits: int) -> None:
        """Charge a turn's ``credits`` to this run and to every run above it, as they
        are spent: an ancestor's hold counts its descendants' credits (docs/tools.md)."""
        self.credits += credits
        ancestor = self.parent
        while ancestor is not None:
            ancestor.descendant_credits += credits
            ancestor = ancestor.parent

    @property
    def root(self) -> Invocation:
        """The run at the top of this run's tree (itself, unless delegated)."""
        root = self
        while root.parent is not None:
            root = root.parent
        return root

    def crossing_permit(self) -> anyio.Lock:
        """The crossing permit of this run's tree, kept by its root (made on first
        use, inside the run): the turn holding it is the only one in flight in
        the tree that may cross a hold (`needs_crossing_permit`)."""
        root = self.root
        if root.permit is None:
            root.permit = anyio.Lock()
        return root.permit

    @property
    def tree_credits(self) -> int:
        """Its own credits plus its descendants': what its account is charged."""
        return self.credits + self.descendant_credits

    def credit_tree(self) -> list[tuple[int | None, int]]:
        """``(credit_hold, tree_credits)`` of this run and each of its ancestors.

        The root's hold is seen lowered by this run's `fee_excess`: the turn that
        crosses it may run all its server tools, and only the fees the root's
        account reservation holds may pass the hold (docs/accounts.md)."""
        tree: list[tuple[int | None, int]] = []
        node: Invocation | None = self
        while node is not None:
            hold = node.limits.credit_hold
            if node.parent is None and hold is not None:
                hold = max(0, hold - self.fee_excess)
            tree.append((hold, node.tree_credits))
            node = node.parent
        return tree

    async def emit(self, event: Event) -> None:
        """Deliver ``event`` to every observer; an observer's failure is only logged."""
        for observer in self.observers:
            try:
                maybe = observer(event)
                if inspect.isawaitable(maybe):
                    await maybe
            except BaseException as error:
                if not own_failure(error):
                    raise
                logger.exception("observer %r failed on %s; the run goes on",
                                  observer, type(event).__name__)

    async def confirm(self, write: Awaitable[None], *, at_least: float = 0.0) -> bool:
        """Await a ledger write, no later than `LEDGER_GRACE` past the deadline
        (and at least ``at_least`` seconds): the bound of the writes made
        outside the run's deadline scope (its settling, a call's admission);
        False when it was not confirmed by then (it stays queued)."""
        limit = max(self.deadline.remaining(self.clock.now()) + LEDGER_GRACE, at_least)
        with self.clock.cancel_scope(limit) as scope:
            await write
        return not scope.cancelled_caught

    def count_attempts_on(self, error: BaseException) -> None:
        """Give a loopengine error that ends this run or call its attempt count."""
        if isinstance(error, LoopEngineError) and error.attempts is None:
            error.attempts = len(self.records)

    def live_container(self) -> str | None:
        """The id of the run's container for the next request, while it has not expired."""
        return None if self.container is None else self.container.live(self.clock.wall())

    def remaining(self) -> float:
        return self.deadline.remaining(self.clock.now())

    def before_attempt(self) -> GuardTrip | None:
        # The pre-attempt guard reads only the deadline, which never moves: its
        # state is built for the check rather than kept for the whole run.
        return check_before_attempt(
            ConversationState(turns=0, tool_calls=0, credits=0, deadline=self.deadline),
            self.limits, self.deadline.at if self.deadline_cut else self.clock.now())

    def attempts_in_turn(self, turn: int) -> int:
        """Attempts dispatched for ``turn`` so far."""
        return self.turn_attempts.get(turn, 0)

    def past_limit(self, usage: Usage, priced: Priced | None, turn: int, *,
                   charged: bool) -> str | None:
        """What settling an attempt of ``turn`` that served ``usage`` (priced
        ``priced``; ``charged``: a reply the run is charged for) would take past
        2**63 - 1, the most a ledger column holds: one of the run's usage sums,
        its cost in nano-USD, or its tree's credits (the turn's charge included).
        None when every total stays within it."""
        name = sum_past_limit(self.usage, usage)
        if name is not None:
            return f"the run's {name}"
        if priced is None:
            return None
        if self.provider_cost_nanousd + priced.cost_nanousd > MAX_INTEGER:
            return "the run's cost in nano-USD"
        if charged:
            rate, quantum = self.prices.credits_per_usd, self.prices.credit_quantum
            root = self.root
            # A structured call keeps its turns' credits outside `credits` (0):
            # its other turns' charges count them.
            own = self.credits or self.turns_credits - self.turn_credits(turn)
            tree = root.tree_credits - self.credits + own
            credits = turn_credits(self.turn_charge.get(turn, 0) + priced.cost_nanousd,
                                   rate, quantum)
            if tree + credits > MAX_INTEGER:
                return "the run's credits"
        return None

    def add_charge(self, turn: int, nanousd: int) -> None:
        """Add ``nanousd`` to the charge of ``turn`` (and its credits to `turns_credits`)."""
        before = self.turn_credits(turn)
        self.turn_charge[turn] = self.turn_charge.get(turn, 0) + nanousd
        self.turns_credits += self.turn_credits(turn) - before

    def turn_credits(self, turn: int) -> int:
        """The turn's charge in credits, rounded up to the quantum (R03)."""
        return turn_credits(self.turn_charge.get(turn, 0), self.prices.credits_per_usd,
                            self.prices.credit_quantum)

    def turn_cost_nanousd(self, turn: int) -> int:
        """The turn's charged cost (its attempts before a pause included)."""
        charge = self.turn_charge.get(turn, 0)
        if self.paused_turn is not None and self.paused_turn[0] == turn:
            charge += self.paused_turn[2]
        return charge

    def turn_cost_usd(self, turn: int) -> Decimal:
        """The turn's charged cost in USD (its attempts before a pause included)."""
        return nanousd_to_usd(self.turn_cost_nanousd(turn))

    def turn_usage(self, turn: int) -> Usage:
        """The usage of the turn's successful attempts (before a pause included)."""
        total = Usage()
        if self.paused_turn is not None and self.paused_turn[0] == turn:
            total = self.paused_turn[1]
        for record in self.records:
            settle = record.settle
            if (record.dispatch.turn == turn and settle is not None and settle.outcome == "ok"
                    and settle.usage is not None):
                total = total + settle.usage
        return total

    @property
    def cost_usd(self) -> Decimal:
        """The charged cost so far."""
        return nanousd_to_usd(self.cost_nanousd)

    def summary(self) -> AttemptsSummary:
        """The attempts made so far."""
        count = self.base_attempts + len(self.records)
        if self.ledger is None:
            retained = 0
        else:
            retained = min(count, self.ledger.max_retained_attempts)
        return AttemptsSummary(
            count=count,
            output_tokens=self.output_tokens,
            usage_complete=self.usage_complete,
            retained=retained,
            incomplete=self.ledger is not None and retained < count,
        )
