"""Helpers for the ledger tests: read either ledger's rows in one shape, and build
scripted conversations that exercise every kind of attempt."""

from __future__ import annotations

import sqlite3
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import loopengine as le
from loopengine.persistence import (
    AttemptDispatch,
    AttemptSettle,
    InvocationEnd,
    InvocationStart,
    MemoryLedger,
    PostgresLedger,
    SQLiteLedger,
)
from loopengine.providers import FaultKind, ProviderFault, Reply

Rows = tuple[dict[str, dict[str, Any]], dict[tuple[str, int], dict[str, Any]]]

TIME_COLUMNS = ("started_at", "ended_at")


def queued(ledger: SQLiteLedger | PostgresLedger, count: int) -> None:
    """Return once ``count`` transactions wait for the ledger's writer (its credit
    accounts' or run store's: `ThreadedLedger._transact_qmark`); from a thread."""
    while len(ledger._calls) < count:
        time.sleep(0.001)


def read_db(path: str | Path) -> Rows:
    """Every invocation and attempt row of a ledger file, read-only, times parsed."""
    conn = sqlite3.connect(Path(path).resolve().as_uri() + "?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    try:
        invocations = {r["id"]: _parse(dict(r)) for r in conn.execute("SELECT * FROM invocations")}
        attempts = {(r["invocation_id"], r["ordinal"]): _parse(dict(r))
                    for r in conn.execute("SELECT * FROM attempts")}
    finally:
        conn.close()
    return invocations, attempts


def read_memory(ledger: MemoryLedger) -> Rows:
    """A MemoryLedger's rows in the shape `read_db` gives."""
    invocations = {k: _parse(dict(v)) for k, v in ledger.invocations.items()}
    attempts = {k: _parse(dict(v)) for k, v in ledger.attempts.items()}
    return invocations, attempts


async def read_rows(ledger: Any) -> Rows:
    """The rows of a MemoryLedger or (flushed first) an SQLiteLedger or PostgresLedger."""
    if isinstance(ledger, SQLiteLedger):
        await ledger.flush()
        return read_db(ledger.path)
    if isinstance(ledger, PostgresLedger):
        from .postgres_support import read_postgres

        await ledger.flush()
        return read_postgres(ledger)
    return read_memory(ledger)


def _parse(row: dict[str, Any]) -> dict[str, Any]:
    for column in TIME_COLUMNS:
        if isinstance(row.get(column), str):
            row[column] = datetime.fromisoformat(row[column])
    return row


def overloaded() -> ProviderFault:
    """A retryable 529 fault."""
    return ProviderFault(FaultKind.OVERLOADED, "overloaded", http_status=529,
                         error_code="overloaded_error", request_id="req_overloaded")


def cut_stream(usage: le.Usage) -> ProviderFault:
    """A stream cut after it had reported ``usage`` (a floor)."""
    return ProviderFault(FaultKind.ABORTED, "stream cut", http_status=200, usage=usage,
                         usage_approx=True, response_id="msg_cut")


@le.tool
async def lookup(key: str) -> str:
    """Look a key up."""
    return f"value of {key}"


def teammate_script() -> list[Any]:
    """A conversation with every kind of attempt: an overload that is retried, a cut
    stream that reported usage, two tool turns, a rejected answer and its repair."""
    return [
        overloaded(),
        Reply.tool_calls(("lookup", {"key": "a"}), usage=le.Usage(120, 30, 10, 5)),
        cut_stream(le.Usage(50, 7)),
        Reply.tool_calls(("lookup", {"key": "b"}), usage=le.Usage(200, 40, 100)),
        Reply.text("first draft", usage=le.Usage(300, 60)),
        Reply.text("final answer", usage=le.Usage(320, 70, 0, 0)),
    ]


def judge(answer: str) -> le.Accept | le.Reject:
    """Accept only the final answer."""
    return le.Accept() if answer == "final answer" else le.Reject("not yet")


# -- records written to a ledger directly ---------------------------------------------

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def start(invocation_id: str = "inv-1") -> InvocationStart:
    return InvocationStart(id=invocation_id, operation="op", operation_version="1",
                           provider="anthropic", model="m", tenant="t", user_id=None,
                           feature=None, correlation_id=None, started_at=NOW)


def dispatch(ordinal: int, invocation_id: str = "inv-1") -> AttemptDispatch:
    return AttemptDispatch(invocation_id=invocation_id, ordinal=ordinal, turn=ordinal,
                           attempt=1, phase="turn", served_by="anthropic:m", started_at=NOW,
                           max_tokens=100, timeout_ms=1000, wait_ms=0)


def settle(ordinal: int, invocation_id: str = "inv-1") -> AttemptSettle:
    return AttemptSettle(invocation_id=invocation_id, ordinal=ordinal, outcome="ok",
                         latency_ms=3, usage=le.Usage(10, 2), cost_nanousd=12, charged=True)


def end(invocation_id: str = "inv-1") -> InvocationEnd:
    return InvocationEnd(id=invocation_id, ended_at=NOW, outcome="completed", turns=1,
                         tool_calls=0, credits=1)


def connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    return conn
