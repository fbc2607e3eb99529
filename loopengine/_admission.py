"""Admission and settlement of a run's credit account (docs/accounts.md).

Before its first request a run on an account reserves its credit hold
(`admit`); at its end the real charge is settled and the hold released, once
(`settle_account`). Both are awaited no later than the run's deadline.
"""

from __future__ import annotations

import dataclasses
import logging
from datetime import datetime

from loopengine._accounts import Reservation
from loopengine._errors import ConfigError
from loopengine._features import ServerTool
from loopengine._invocation import LEDGER_GRACE, Invocation
from loopengine._pricing import Billing, PriceBook, to_nanousd
from loopengine.guards._checkpoints import check_admission, unconfirmed_by_deadline
from loopengine.guards._credits import turn_credits

__all__ = ["admit", "check_fees_bounded", "delegated_fees", "fee_margin", "settle_account"]

logger = logging.getLogger("loopengine")


def fee_margin(inv: Invocation, at: datetime) -> int:
    """The credits of the worst case of one turn's server-tool fees (every web
    search and web fetch tool used ``max_uses`` times), reserved on top of the
    hold: the turn that crosses the hold may run them all (R03). A search model's
    web search on every request (`Invocation.billing`) is one of them."""
    if not inv.features.server_tools and not inv.billing.searches_per_request:
        return 0
    fees = inv.prices.turn_fees(inv.vendor, inv.operation.model, inv.features.server_tools,
                                at, billing=inv.billing)
    # The engine refuses an account run with an unbounded or unpriced fee.
    assert fees.usd is not None
    return turn_credits(to_nanousd(fees.usd), inv.prices.credits_per_usd,
                        inv.prices.credit_quantum)


def check_fees_bounded(prices: PriceBook, vendor: str, model: str,
                       server_tools: tuple[ServerTool, ...], at: datetime, account: str,
                       billing: Billing) -> None:
    """Refuse a run on ``account`` (or in the tree of a run on it) whose server tools
    have a fee and no ``max_uses``: its turn's worst case, reserved on the account,
    has no bound. ``billing`` is the run's (`Provider.billing`): a tool whose fee
    is the provider's own has one whatever the model's list says.

    Raises:
        ConfigError: such a tool (``server_tools``).
    """
    if not server_tools:
        return
    unbounded = prices.turn_fees(vendor, model, server_tools, at, billing=billing).unbounded
    if unbounded:
        raise ConfigError(
            "server_tools",
            f"a run on account {account!r} reserves the worst case of a turn's "
            f"server-tool fees, and {', '.join(unbounded)} has a fee and no max_uses: "
            "publish one (or lower it for the run with features=)")


def delegated_fees(inv: Invocation, root: Invocation, at: datetime) -> None:
    """Bound a delegated run's server-tool fees by its root's account reservation:
    refused when unbounded (`check_fees_bounded`), else its `fee_excess` set to how
    far one of its turns' worst case passes what the root reserved for fees."""
    if root.account is None:
        return
    check_fees_bounded(inv.prices, inv.vendor, inv.operation.model,
                       inv.features.server_tools, at, root.account, inv.billing)
    inv.fee_excess = max(0, fee_margin(inv, at) - root.fees_reserved)


async def admit(inv: Invocation, at: datetime, *, spent: int = 0) -> None:
    """Reserve the run's credit hold on its account before its first request
    (docs/accounts.md), with the worst case of one turn's server-tool fees on top
    (`fee_margin`): less available narrows the hold; nothing available for the
    hold past that margin denies the run.

    A resumed run has ``spent`` credits already settled (at its pause): it
    reserves only what its hold leaves (a credit, when it leaves none)."""
    assert inv.accounts is not None and inv.account is not None
    assert inv.limits.credit_hold is not None  # every run on an account has a hold
    hold = max(0, inv.limits.credit_hold - spent)
    # A resumed run that spent all its hold still goes on as far as its hold
    # lets it (R03: its decided calls run, and reaching the hold exactly is no
    # trip): it reserves a credit, so that it is admitted and settled as any run.
    asked = max(hold, 1)
    margin = fee_margin(inv, at)
    accounts, account = inv.accounts, inv.account
    got: list[Reservation] = []

    async def reserve() -> None:
        got.append(await accounts.reserve(
            account, inv.id, asked,
            expires_at=accounts.expiry(inv.limits.total_time),
            credits_per_usd=inv.prices.credits_per_usd,
            credit_quantum=inv.prices.credit_quantum, margin=margin))

    inv.admitting = True  # until the answer arrives
    try:
        confirmed = await inv.confirm(reserve())
    except Exception:
        # Refused (a LedgerError: rolled back, nothing reserved): nothing for
        # the run's end to settle.
        inv.admitting = False
        raise
    if not confirmed:
        inv.denied = unconfirmed_by_deadline(inv.limits, "the account's reservation")
        return
    inv.admitting = False
    reservation = got[0]
    inv.denied = check_admission(account, reservation.credits, reservation.available, asked,
                                 fees=margin, spent=spent)
    if inv.denied is not None:
        return
    inv.reservation = reservation
    inv.fees_reserved = margin
    held = reservation.credits - margin
    if held < hold:
        # A narrowing (R13): the run may spend only what was reserved.
        inv.limits = dataclasses.replace(inv.limits, credit_hold=spent + held)


async def settle_account(inv: Invocation, credits: int) -> None:
    """Charge the run's real credits on its account and release its hold, once.

    A run that stopped waiting for its admission (`Invocation.admitting`) settles
    whatever that admission reserved once it lands, rather than leaving it held
    until its expiry."""
    if inv.accounts is None:
        return
    if inv.reservation is not None:
        reservation, inv.reservation = inv.reservation, None
        settling = inv.accounts.settle(reservation, credits)
    elif inv.admitting and inv.account is not None:
        inv.admitting = False
        settling = inv.accounts.recover(inv.account, inv.id, stopped=True)
    else:
        return
    settled = await inv.confirm(settling, at_least=LEDGER_GRACE)
    if not settled:
        logger.warning("%s %s: its account's settlement was not confirmed by its "
                       "deadline; it completes later, or at the reservation's expiry",
                       inv.kind, inv.id)
