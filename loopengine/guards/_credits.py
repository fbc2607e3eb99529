"""Credits: a turn's charge in the product's own unit (R03, S01)."""

from __future__ import annotations

from decimal import Decimal

__all__ = ["turn_credits"]

_NANO = 1_000_000_000


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
    # In integers, exactly: `decimal` arithmetic rounds a product past its
    # context's 28 digits (half-even), which can drop the fraction the
    # ceiling must see (a rate of many digits on a large turn).
    numerator, denominator = credits_per_usd.as_integer_ratio()
    quanta = -(-cost_nanousd * numerator // (denominator * _NANO * credit_quantum))
    return quanta * credit_quantum
