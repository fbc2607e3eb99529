"""Credits: a turn's charge in the product's own unit (R03, S01)."""

from __future__ import annotations

from decimal import ROUND_CEILING, Decimal

__all__ = ["turn_credits"]

_NANO = Decimal(1_000_000_000)


def turn_credits(cost_nanousd: int, credits_per_usd: Decimal, credit_quantum: int) -> int:
    """A turn's charge in credits: its USD cost rounded *up* to the credit quantum.

    Rounding happens per turn, before the charge accumulates (R03), so a
    conversation of ten tiny turns is charged ten quanta, not one.

    Args:
        cost_nanousd: The priced usage of the turn's charged attempts, in 1e-9 USD.
        credits_per_usd: How many credits one USD buys.
        credit_quantum: The smallest chargeable number of credits (>= 1).
    """
    if cost_nanousd <= 0:
        return 0
    credits = Decimal(cost_nanousd) / _NANO * credits_per_usd
    quanta = (credits / credit_quantum).to_integral_value(rounding=ROUND_CEILING)
    return int(quanta) * credit_quantum
