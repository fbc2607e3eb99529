"""`Deadline`: the absolute end of a conversation (R04)."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Deadline"]


@dataclass(frozen=True, slots=True)
class Deadline:
    """An absolute point on the engine clock, or none (``at`` is infinite).

    Deadlines are absolute (``start + total_time``) so that retries and tool
    handlers all spend from the same allowance instead of each restarting it.
    """

    at: float

    @classmethod
    def after(cls, start: float, total_time: float | None) -> Deadline:
        """The deadline ``total_time`` seconds after ``start`` (none for None)."""
        return cls(math.inf if total_time is None else start + total_time)

    def remaining(self, now: float) -> float:
        """Seconds left at ``now``, never negative (infinite without a deadline)."""
        return max(0.0, self.at - now)

    def expired(self, now: float) -> bool:
        """True when no time remains at ``now``."""
        return self.remaining(now) <= 0.0
