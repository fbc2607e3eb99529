"""Testing helpers for applications built on loopengine.

`FakeClock` makes retry waits and deadlines instant and exact.
"""

from loopengine._clock import FakeClock

__all__ = ["FakeClock"]
