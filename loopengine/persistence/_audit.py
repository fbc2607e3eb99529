"""The auditor's questions, asked of a ledger file opened read-only.

`loopengine audit` is a thin shell over these functions: spend over a period
grouped by tenant, feature, model or operation; one invocation with its
attempts; the reconciliation of attempt rows against invocation totals; and
the per-attempt invoice export. Everything here only reads.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal

import sqlite_utils

from loopengine._errors import LedgerError
from loopengine.persistence._schema import (
    ATTEMPT_COLUMNS,
    INVOCATION_COLUMNS,
    SCHEMA_VERSION,
    format_time,
    schema_version,
)

__all__ = [
    "EXPORT_COLUMNS",
    "GROUPINGS",
    "Mismatch",
    "Reconciliation",
    "SpendRow",
    "export_rows",
    "incomplete_in_export",
    "open_ledger",
    "parse_moment",
    "reconcile",
    "show",
    "spend",
]

Grouping = Literal["tenant", "feature", "model", "operation"]
GROUPINGS: tuple[Grouping, ...] = ("tenant", "feature", "model", "operation")
"""What `spend` can group by."""

_NANO = Decimal(1_000_000_000)

# Token and money columns that an invocation total must equal over its rows.
_SUMMED = ("input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens",
           "cache_write_1h_tokens")

EXPORT_COLUMNS: tuple[str, ...] = (
    *ATTEMPT_COLUMNS[:2], "tenant", "user_id", "feature", "correlation_id", "operation",
    "operation_version", "provider", "model", *ATTEMPT_COLUMNS[2:], "cost_usd",
    "response_id_missing",
)
"""The columns of an invoice export row: the attempt, who it is accounted to,
its cost in USD, and whether it lacks a response id."""


def open_ledger(path: str | os.PathLike[str]) -> sqlite3.Connection:
    """Open a ledger file read-only, after checking that it is one this code reads.

    Args:
        path: The database file.

    Returns:
        A read-only connection whose rows are `sqlite3.Row`.

    Raises:
        LedgerError: the file does not exist, is not a SQLite database, is not a
            loopengine ledger, or has a schema newer than this code.
    """
    file = Path(path)
    if not file.exists():
        raise LedgerError(f"{file}: no such file")
    if not file.is_file():
        raise LedgerError(f"{file}: not a file")
    # mode=ro: an audit never writes, whatever it is asked.
    conn = sqlite3.connect(file.resolve().as_uri() + "?mode=ro", uri=True)
    try:
        try:
            version = schema_version(conn)
        except sqlite3.DatabaseError as error:
            raise LedgerError(f"{file} is not a SQLite database ({error})") from error
        if version is None:
            raise LedgerError(f"{file} is not a loopengine ledger (it has no "
                              "loopengine_schema table)")
        if version > SCHEMA_VERSION:
            raise LedgerError(
                f"{file} has ledger schema version {version}, newer than this loopengine "
                f"understands ({SCHEMA_VERSION}); upgrade loopengine to read it")
        db = sqlite_utils.Database(conn, recursive_triggers=False, execute_plugins=False)
        for table, wanted in (("invocations", INVOCATION_COLUMNS), ("attempts", ATTEMPT_COLUMNS)):
            have = set(db.table(table).columns_dict) if db.table(table).exists() else set()
            missing = [c for c in wanted if c not in have]
            if missing:
                raise LedgerError(f"{file} is not a loopengine ledger: table {table} lacks "
                                  f"{', '.join(missing)}")
    except BaseException:
        conn.close()
        raise
    conn.row_factory = sqlite3.Row
    return conn


def parse_moment(text: str) -> str:
    """A date or ISO-8601 time as the ledger's UTC text, for period filters.

    ``2026-03-01`` means midnight UTC; a time without an offset is UTC.

    Raises:
        ValueError: ``text`` is neither.
    """
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a date (YYYY-MM-DD) or an ISO-8601 time") from None
    if len(text) == 10:
        moment = datetime.combine(date.fromisoformat(text), datetime.min.time(), UTC)
    return format_time(moment)


def _period(column: str, since: str | None, until: str | None) -> tuple[str, list[str]]:
    clauses, params = [], []
    if since is not None:
        clauses.append(f"{column} >= ?")
        params.append(since)
    if until is not None:
        clauses.append(f"{column} < ?")
        params.append(until)
    return (" WHERE " + " AND ".join(clauses) if clauses else ""), params


@dataclass(frozen=True, slots=True)
class SpendRow:
    """Spend of one group over a period (invocations by their start time)."""

    key: str | None
    """The tenant, feature, model or operation (None when it was not set)."""
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

    @property
    def cost_usd(self) -> Decimal:
        """``cost_nanousd`` in USD, exactly."""
        return Decimal(self.cost_nanousd) / _NANO

    @property
    def provider_cost_usd(self) -> Decimal:
        """``provider_cost_nanousd`` in USD, exactly."""
        return Decimal(self.provider_cost_nanousd) / _NANO


def spend(
    conn: sqlite3.Connection,
    *,
    by: Grouping = "tenant",
    since: str | None = None,
    until: str | None = None,
) -> list[SpendRow]:
    """Spend grouped by ``by``, over invocations started in ``[since, until)``.

    The totals come from the invocation rows, which count every attempt even
    past the retention cap (R07), so they are complete where rows are not.

    Args:
        conn: From `open_ledger`.
        by: ``tenant``, ``feature``, ``model`` or ``operation``.
        since: Inclusive lower bound (`parse_moment` text), or None.
        until: Exclusive upper bound, or None.

    Raises:
        ValueError: ``by`` is not one of `GROUPINGS`.
    """
    if by not in GROUPINGS:
        raise ValueError(f"cannot group by {by!r}; choose one of {', '.join(GROUPINGS)}")
    where, params = _period("started_at", since, until)
    sql = (
        f"SELECT {by} AS key, COUNT(*), SUM(attempt_count), SUM(input_tokens), "
        "SUM(output_tokens), SUM(cache_read_tokens), SUM(cache_write_tokens), "
        f"SUM(cost_nanousd), SUM(provider_cost_nanousd), SUM(credits) FROM invocations{where} "
        f"GROUP BY {by} ORDER BY SUM(cost_nanousd) DESC, key"
    )
    return [SpendRow(row[0], *(int(v or 0) for v in tuple(row)[1:]))
            for row in conn.execute(sql, params)]


def show(conn: sqlite3.Connection, invocation_id: str) -> tuple[dict[str, Any],
                                                                list[dict[str, Any]]]:
    """One invocation and its attempt rows in ordinal order.

    ``invocation_id`` may be a unique prefix of the id.

    Raises:
        LookupError: no invocation matches, or a prefix matches several.
    """
    rows = conn.execute("SELECT * FROM invocations WHERE id = ?", (invocation_id,)).fetchall()
    if not rows:
        escaped = invocation_id.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        rows = conn.execute("SELECT * FROM invocations WHERE id LIKE ? ESCAPE '\\' LIMIT 2",
                            (escaped + "%",)).fetchall()
    if not rows:
        raise LookupError(f"no invocation {invocation_id}")
    if len(rows) > 1:
        raise LookupError(f"{invocation_id!r} is the start of several invocation ids; "
                          "give more of it")
    invocation = dict(rows[0])
    attempts = [dict(r) for r in conn.execute(
        "SELECT * FROM attempts WHERE invocation_id = ? ORDER BY ordinal", (invocation["id"],))]
    return invocation, attempts


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
    """Attempt rows still ``dispatched``: in flight, or their process died."""
    incomplete: list[dict[str, Any]] = field(default_factory=list)
    """Invocations with more attempts than rows (R07): their sums cannot be checked."""
    running: list[dict[str, Any]] = field(default_factory=list)
    """Invocations not ended: still running, or their process died."""
    orphans: list[dict[str, Any]] = field(default_factory=list)
    """Attempt rows whose invocation row is missing."""

    @property
    def ok(self) -> bool:
        """True when every total reconciles and nothing is open or incomplete."""
        return not (self.mismatches or self.unsettled or self.incomplete or self.running
                    or self.orphans)


def reconcile(conn: sqlite3.Connection) -> Reconciliation:
    """Check every invocation's totals against its attempt rows.

    For an invocation whose rows are complete (``incomplete = 0``) each token
    total must equal the sum over its rows, ``cost_nanousd`` the sum over its
    charged rows, ``provider_cost_nanousd`` the sum over every priced row, and
    ``attempt_count`` and ``attempts_retained`` the number of rows. A charged
    row must be an ``ok`` one (S01). Rows still ``dispatched``, invocations
    still ``running`` and incomplete invocations are listed.
    """
    sums = ", ".join(f"COALESCE(SUM(a.{c}), 0) AS sum_{c}" for c in _SUMMED)
    rows = conn.execute(
        f"SELECT i.*, COUNT(a.ordinal) AS row_count, {sums}, "
        "COALESCE(SUM(CASE WHEN a.charged = 1 THEN a.cost_nanousd END), 0) AS sum_cost, "
        "COALESCE(SUM(a.cost_nanousd), 0) AS sum_provider_cost, "
        "COALESCE(SUM(a.charged = 1 AND a.outcome != 'ok'), 0) AS charged_not_ok "
        "FROM invocations AS i LEFT JOIN attempts AS a ON a.invocation_id = i.id "
        "GROUP BY i.id ORDER BY i.started_at, i.id"
    ).fetchall()
    mismatches: list[Mismatch] = []
    incomplete: list[dict[str, Any]] = []
    running: list[dict[str, Any]] = []
    attempts = 0
    for row in rows:
        inv = row["id"]
        attempts += row["row_count"]

        def differs(column: str, recorded: int, computed: int, inv: str = inv) -> None:
            if recorded != computed:
                mismatches.append(Mismatch(inv, column, recorded, computed))

        differs("attempts_retained", row["attempts_retained"], row["row_count"])
        differs("charged", 0, row["charged_not_ok"])
        if row["outcome"] == "running":
            running.append(_brief(row))
        if row["incomplete"]:
            incomplete.append(_brief(row))
            if row["attempt_count"] <= row["attempts_retained"]:
                mismatches.append(Mismatch(inv, "attempt_count", row["attempt_count"],
                                           row["row_count"]))
            continue
        differs("attempt_count", row["attempt_count"], row["row_count"])
        for column in _SUMMED:
            differs(column, row[column], row[f"sum_{column}"])
        differs("cost_nanousd", row["cost_nanousd"], row["sum_cost"])
        differs("provider_cost_nanousd", row["provider_cost_nanousd"], row["sum_provider_cost"])
    unsettled = [dict(r) for r in conn.execute(
        "SELECT invocation_id, ordinal, turn, attempt, phase, served_by, started_at "
        "FROM attempts WHERE outcome = 'dispatched' ORDER BY started_at, invocation_id, ordinal")]
    orphans = [dict(r) for r in conn.execute(
        "SELECT invocation_id, ordinal FROM attempts WHERE invocation_id NOT IN "
        "(SELECT id FROM invocations) ORDER BY invocation_id, ordinal")]
    return Reconciliation(invocations=len(rows), attempts=attempts + len(orphans),
                          mismatches=mismatches, unsettled=unsettled, incomplete=incomplete,
                          running=running, orphans=orphans)


def _brief(row: sqlite3.Row) -> dict[str, Any]:
    return {k: row[k] for k in ("id", "operation", "tenant", "started_at", "outcome",
                                "attempt_count", "attempts_retained")}


def export_rows(
    conn: sqlite3.Connection, *, since: str | None = None, until: str | None = None
) -> Iterator[dict[str, Any]]:
    """Every attempt row started in ``[since, until)``, for an invoice.

    Each row carries who it is accounted to, its cost in USD (exact decimal
    text, None when unpriced), and ``response_id_missing`` (1 when the
    provider gave no response id: such rows are marked, never dropped).
    """
    where, params = _period("a.started_at", since, until)
    columns = ", ".join(f"a.{c}" for c in ATTEMPT_COLUMNS)
    sql = (f"SELECT {columns}, i.tenant, i.user_id, i.feature, i.correlation_id, i.operation, "
           "i.operation_version, i.provider, i.model FROM attempts AS a "
           f"LEFT JOIN invocations AS i ON i.id = a.invocation_id{where} "
           "ORDER BY a.started_at, a.invocation_id, a.ordinal")
    for row in conn.execute(sql, params):
        record = dict(row)
        cost = record["cost_nanousd"]
        record["cost_usd"] = None if cost is None else str(Decimal(cost) / _NANO)
        record["response_id_missing"] = int(not record["response_id"])
        yield {column: record[column] for column in EXPORT_COLUMNS}


def incomplete_in_export(
    conn: sqlite3.Connection, *, since: str | None = None, until: str | None = None
) -> int:
    """How many invocations with attempts in the period have fewer rows than attempts."""
    where, params = _period("a.started_at", since, until)
    sql = ("SELECT COUNT(DISTINCT a.invocation_id) FROM attempts AS a JOIN invocations AS i "
           f"ON i.id = a.invocation_id{where}{' AND' if where else ' WHERE'} i.incomplete = 1")
    return int(conn.execute(sql, params).fetchone()[0])
