"""Persistence: the `Ledger` contract, its records, and the stores that implement it."""

from loopengine.persistence._memory import MemoryLedger
from loopengine.persistence._postgres import PostgresLedger
from loopengine.persistence._protocol import (
    DEFAULT_MAX_RETAINED_ATTEMPTS,
    Ledger,
)
from loopengine.persistence._records import (
    AttemptDispatch,
    AttemptRecord,
    AttemptSettle,
    InvocationEnd,
    InvocationStart,
)
from loopengine.persistence._sqlite import SQLiteLedger

__all__ = [
    "DEFAULT_MAX_RETAINED_ATTEMPTS",
    "AttemptDispatch",
    "AttemptRecord",
    "AttemptSettle",
    "InvocationEnd",
    "InvocationStart",
    "Ledger",
    "MemoryLedger",
    "PostgresLedger",
    "SQLiteLedger",
]
