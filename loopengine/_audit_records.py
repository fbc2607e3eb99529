"""What the audit answers: the rows and reports of loopengine.audit's queries
(loopengine.persistence._audit), as plain frozen values.

Money is integer nano-USD, exact; each type with a cost also gives it in USD
as a `Decimal`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from decimal import Decimal
from typing import Any, TypedDict

__all__ = ["AccountMismatch", "AccountRow", "Mismatch", "Reconciliation", "RunRow",
           "SpendRow", "Where", "usd_text"]

_NANO = Decimal(1_000_000_000)


def usd_text(nanousd: int) -> str:
    """Integer nano-USD as exact USD text in plain notation, as the audit prints
    and exports money: ``0.000000019``, never ``1.9E-8`` (`str` of a `Decimal`
    under a millionth of a dollar), which a person misreads and an invoice
    tool may not parse."""
    return format(Decimal(nanousd) / _NANO, "f")


class Where(TypedDict, total=False):
    """Which records a query reads; every filter given must hold."""

    since: str | None
    """From this time (inclusive): a date (midnight UTC) or an ISO-8601 time; one
    without an offset is UTC, one with an offset (or ``Z``) is converted to
    UTC. A value that is neither raises `ConfigError` (a `ValueError`)."""
    until: str | None
    """Before this time (exclusive), read as ``since`` is; later than ``since``."""
    tenant: str | None
    """The invocation's tenant."""
    feature: str | None
    """The invocation's feature."""
    outcome: str | None
    """The invocation's outcome (``running`` while it runs)."""



@dataclass(frozen=True, slots=True)
class RunRow:
    """One invocation, as `audit runs` lists it."""

    id: str
    """The invocation id (what `show` takes)."""
    started_at: str
    """When it started (ISO-8601 UTC)."""
    tenant: str | None
    feature: str | None
    operation: str
    outcome: str
    """Its outcome, or ``running``."""
    attempt_count: int
    """Its attempts, retained or not."""
    cost_nanousd: int
    """Charged cost (S01)."""
    credits: int
    unpriced_attempts: int = 0
    """Its attempt rows that served tokens without a price: their cost is in no total."""
    usage_unknown: int = 0
    """Its attempt rows the server answered whose usage is unknown."""
    usage_floor: int = 0
    """Its attempt rows whose usage is a floor (a stream cut before its end)."""

    @property
    def cost_usd(self) -> Decimal:
        """``cost_nanousd`` in USD, exactly."""
        return Decimal(self.cost_nanousd) / _NANO



@dataclass(frozen=True, slots=True)
class SpendRow:
    """Spend of one group over a period (invocations by their start time)."""

    key: str | None
    """The tenant, feature, model, operation, user or correlation id (None when not set)."""
    invocations: int
    """Invocations started in the period."""
    attempts: int
    """Their attempts (``attempt_count``: retained or not)."""
    input_tokens: int
    """Uncached input tokens served."""
    output_tokens: int
    """Output tokens served."""
    cache_read_tokens: int
    """Cache-read tokens served."""
    cache_write_tokens: int
    """Cache-write tokens served."""
    cost_nanousd: int
    """Charged cost: successful attempts only (S01)."""
    provider_cost_nanousd: int
    """Every priced attempt: what the provider may bill."""
    credits: int
    """Credits charged."""
    unpriced_attempts: int = 0
    """Attempt rows that served tokens without a price: their cost is in neither total."""
    unpriced_tokens: int = 0
    """The tokens those attempts served (input, output, cache read and write)."""
    web_search_requests: int = 0
    """Web searches the provider ran (each billed a fee)."""
    web_fetch_requests: int = 0
    """Web fetches the provider ran."""
    reasoning_tokens: int = 0
    """The part of ``output_tokens`` spent reasoning, where reported."""
    iterations: int = 0
    """Sampling iterations reported inside requests (compaction, advisor...)."""
    fee_nanousd: int = 0
    """The part of ``cost_nanousd`` that is per-request fees rather than tokens."""
    usage_unknown: int = 0
    """Attempt rows the server answered (a response id, a reply or a success status)
    whose usage is unknown: what they served is in no total, never a silent $0."""
    usage_floor: int = 0
    """Attempt rows whose usage is a floor (``usage_approx``: a stream cut before its
    end reported what had arrived): the provider may bill more than the totals hold."""

    @property
    def cost_usd(self) -> Decimal:
        """``cost_nanousd`` in USD, exactly."""
        return Decimal(self.cost_nanousd) / _NANO

    @property
    def provider_cost_usd(self) -> Decimal:
        """``provider_cost_nanousd`` in USD, exactly."""
        return Decimal(self.provider_cost_nanousd) / _NANO



@dataclass(frozen=True, slots=True)
class Mismatch:
    """An invocation total that its attempt rows do not add up to."""

    invocation_id: str
    """The invocation."""
    column: str
    """The total that differs (or ``charged`` for a charged attempt that was not ok)."""
    recorded: int
    """What the invocation row says."""
    computed: int
    """What its attempt rows add up to."""



@dataclass(frozen=True, slots=True)
class Reconciliation:
    """The result of `reconcile`; `ok` when nothing needs a look."""

    invocations: int
    """Invocations checked."""
    attempts: int
    """Attempt rows checked."""
    mismatches: list[Mismatch] = field(default_factory=list)
    """Totals that do not equal their rows' sums."""
    unsettled: list[dict[str, Any]] = field(default_factory=list)
    """Attempt rows still ``dispatched``: in flight, or their process died (with
    ``older_than``: only those dispatched within it)."""
    incomplete: list[dict[str, Any]] = field(default_factory=list)
    """Invocations with more attempts than rows (R07): their sums cannot be checked."""
    running: list[dict[str, Any]] = field(default_factory=list)
    """Invocations not ended: still running, or their process died (with
    ``older_than``: only those started within it)."""
    orphans: list[dict[str, Any]] = field(default_factory=list)
    """Attempt rows whose invocation row is missing."""
    unpriced: list[dict[str, Any]] = field(default_factory=list)
    """Attempt rows that served tokens without a price: their cost is in no total."""
    abandoned: list[dict[str, Any]] = field(default_factory=list)
    """Invocations not ended that started more than ``older_than`` ago: their
    process died (each with ``dispatched``, its attempts left unsettled)."""
    abandoned_attempts: list[dict[str, Any]] = field(default_factory=list)
    """Attempt rows still ``dispatched`` more than ``older_than`` after they were
    sent: their usage is unknown (the provider may have served and billed them)."""
    older_than: timedelta | None = None
    """The age past which an open record counts as abandoned, or None (every
    open record then needs a look)."""
    accounts: list[AccountMismatch] = field(default_factory=list)
    """Credit accounts whose balances do not equal their journal, or whose runs'
    charges do not equal those runs' credits (docs/accounts.md)."""
    usage_unknown: list[dict[str, Any]] = field(default_factory=list)
    """Settled attempt rows the server answered (a response id, a reply or a success
    status) whose usage is unknown: the provider may bill what they served, and no
    total holds it."""
    in_doubt: list[dict[str, Any]] = field(default_factory=list)
    """Tool calls that may have run (``started`` without an end, their run not
    held by a live process; or ``in_doubt``): a resume asks for a decision on
    each (docs/pause-and-resume.md)."""
    expired_leases: list[dict[str, Any]] = field(default_factory=list)
    """Runs of the run store still running whose lease expired: their process
    died; ``engine.resume(invocation_id)`` recovers them."""
    expired_pauses: list[dict[str, Any]] = field(default_factory=list)
    """Paused runs waiting longer than their ``pause_timeout``: a resume would
    end them ``time_limit``."""
    dead_segments: list[dict[str, Any]] = field(default_factory=list)
    """Running segments left open by a process that died, whose run has gone on
    (recovered) or is no longer running: where a run's processes died. For a
    look only: they do not fail the check (what they left is listed above)."""
    usage_floor: list[dict[str, Any]] = field(default_factory=list)
    """Attempt rows whose usage is a floor (``usage_approx``): a stream cut before its
    end, whose usage and cost are what had arrived, so the provider may bill more.
    For a look only: unlike usage unknown they do not fail the check, for the
    totals hold what had arrived, a cut stream is routine (a caller that stops
    reading, a connection lost) and no later record can complete its usage;
    the exact figure is on the provider's invoice, under its ``response_id``."""

    @property
    def ok(self) -> bool:
        """True when every total reconciles and nothing needs a look.

        Mismatches, incomplete records, orphan rows, unpriced attempts,
        abandoned records, tool calls in doubt and stored runs whose lease or
        pause expired need one. Open records need one too unless
        ``older_than`` was given: they are then in flight.
        """
        if self.mismatches or self.incomplete or self.orphans or self.unpriced \
                or self.abandoned or self.abandoned_attempts or self.accounts \
                or self.usage_unknown or self.in_doubt or self.expired_leases \
                or self.expired_pauses:
            return False
        return self.older_than is not None or not (self.unsettled or self.running)



@dataclass(frozen=True, slots=True)
class AccountRow:
    """One credit account's balance, as `audit accounts` lists it."""

    account: str
    granted: int
    spent: int
    reserved: int
    available: int
    """``granted - spent - reserved``."""
    updated_at: str



@dataclass(frozen=True, slots=True)
class AccountMismatch:
    """An account balance that its journal (or its runs' credits) does not match."""

    account: str
    column: str
    """``granted``, ``spent`` or ``reserved`` against the journal; ``charged``
    for one run's settled charge against that run's credits; ``open`` for a
    reservation that ``open_reservations`` holds (recorded 1) and the journal
    released, or the journal leaves unreleased (computed 1) and the table
    lacks (docs/accounts.md)."""
    recorded: int
    computed: int
    invocation_id: str | None = None
    """For ``charged`` and ``open``: the run."""
