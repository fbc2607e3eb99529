"""The auditor's questions, asked of a ledger opened read-only (`open_ledger`).

`loopengine audit` is a thin shell over these functions: the invocations of a
period (`runs`); spend over a period grouped by tenant, feature, model,
operation, user or correlation id; one invocation with its attempts; the
reconciliation of attempt rows against invocation totals; the credit accounts
(`accounts`); and the per-attempt invoice export. Everything here only reads.
The SQL is written once: it runs unchanged on SQLite and, through
`PostgresReader`, on PostgreSQL.

An attempt is *unpriced* when it reported tokens but has no cost: no price
source knew its model. Its tokens are in the totals, its cost in none of them,
so every answer here names such attempts instead of showing a quiet $0.

Values are checked as they are read: a value of a type the ledger never
stores (a BLOB, text or a real number in an integer column, NULL in a NOT NULL
one) raises `LedgerError` naming its row and column, instead of a wrong total
or a crash. `show` alone returns what is stored, whatever it is: it is how an
auditor looks at a damaged record.
"""

from __future__ import annotations

import functools
import json
import sqlite3
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any, Literal, Unpack

from loopengine import _validate
from loopengine._audit_records import (
    AccountMismatch,
    AccountRow,
    Mismatch,
    Reconciliation,
    RunRow,
    SpendRow,
    Where,
    usd_text,
)
from loopengine._errors import ConfigError, LedgerError
from loopengine._outcome import Outcome
from loopengine.persistence import _account_store
from loopengine.persistence._audit_open import (
    AuditConnection,
    describe_value,
    has_table,
    stream,
)
from loopengine.persistence._audit_open import open_ledger as open_ledger
from loopengine.persistence._schema import ATTEMPT_COLUMNS, MIGRATIONS, format_time

__all__ = ["EXPORT_COLUMNS", "GROUPINGS", "OUTCOMES", "AccountMismatch", "AccountRow", "Mismatch",
           "Reconciliation", "RunRow", "SpendRow", "Where", "children", "describe_value",
           "export_rows", "incomplete_in_export", "is_unpriced", "open_ledger", "reconcile",
           "moment", "run_state", "runs", "segments", "show", "spend", "tool_calls", "usd_text"]

Grouping = Literal["tenant", "feature", "model", "operation", "user_id", "correlation_id"]
GROUPINGS: tuple[Grouping, ...] = ("tenant", "feature", "model", "operation", "user_id",
                                   "correlation_id")
"""What `spend` can group by."""

# Usage columns that an invocation total must equal over its rows (the fee,
# like the cost, over its charged rows only).
_SUMMED = ("input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens",
           "cache_write_1h_tokens", "web_search_requests", "web_fetch_requests",
           "reasoning_tokens", "iterations")

# The tokens an attempt was served (cache_write_1h_tokens is a part of
# cache_write_tokens, so it is not added again).
_TOKEN_COLUMNS = ("input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens")


def _tokens_sql(alias: str) -> str:
    return " + ".join(f"COALESCE({alias}.{c}, 0)" for c in _TOKEN_COLUMNS)


def _unpriced_sql(alias: str) -> str:
    return f"({alias}.cost_nanousd IS NULL AND ({_tokens_sql(alias)}) > 0)"


def _usage_unknown_sql(alias: str) -> str:
    """An attempt the server answered whose usage is unknown: it sent a response
    id, a reply (``ok``) or a success status (a body cut before its usage, a
    stream cut before its first event), and the provider may bill it."""
    return (f"({alias}.input_tokens IS NULL AND {alias}.outcome != 'dispatched' AND "
            f"({alias}.response_id IS NOT NULL OR {alias}.outcome = 'ok' OR "
            f"{alias}.http_status BETWEEN 200 AND 299))")


def _usage_floor_sql(alias: str) -> str:
    """An attempt whose usage is a floor: a stream cut before its end reported what
    had arrived (``usage_approx``); the provider may bill more than it holds."""
    return f"({alias}.usage_approx = 1 AND {alias}.input_tokens IS NOT NULL)"


def _flagged_rows(m: str) -> dict[str, str]:
    """The FROM clauses of invocation ``m``'s attempt rows that are unpriced, whose
    usage is unknown, and whose usage is a floor: correlated through the
    attempts' primary key, so each costs a look-up per invocation."""
    return {name: f"FROM attempts AS a WHERE a.invocation_id = {m}.id AND {test('a')}"
            for name, test in (("unpriced", _unpriced_sql), ("usage_unknown", _usage_unknown_sql),
                               ("usage_floor", _usage_floor_sql))}


EXPORT_COLUMNS: tuple[str, ...] = (
    *ATTEMPT_COLUMNS[:2], "tenant", "user_id", "feature", "correlation_id", "operation",
    "operation_version", "provider", "model", *ATTEMPT_COLUMNS[2:], "cost_usd",
    "response_id_missing", "unpriced",
)
"""The columns of an invoice export row: the attempt, who it is accounted to,
its cost in USD, whether it lacks a response id, and whether it is unpriced
(tokens served, no cost)."""

# The joined invocation columns of an export row: NULL for an attempt row
# whose invocation row is missing, whatever the invocation table requires.
_EXPORT_JOINED = ("tenant", "user_id", "feature", "correlation_id", "operation",
                  "operation_version", "provider", "model")


# -- values --------------------------------------------------------------------------------


@functools.cache
def _declared() -> dict[str, dict[str, tuple[type, bool]]]:
    """Each ledger column's Python type and whether it is NOT NULL, from the schema."""
    conn = sqlite3.connect(":memory:")
    try:
        for migration in MIGRATIONS:
            for statement in migration.statements:
                conn.execute(statement)
        types: dict[str, type] = {"INTEGER": int, "TEXT": str}
        return {table: {str(r[1]): (types.get(str(r[2]).upper(), object), bool(r[3]))
                        for r in conn.execute(f"PRAGMA table_info({table})")}
                for table in ("invocations", "attempts")}
    finally:
        conn.close()


def _check(table: str, row: Any, columns: tuple[str, ...], where: Callable[[Any], str],
           *, nullable: bool = False) -> None:
    """Raise `LedgerError` when a column of ``row`` holds what the ledger never stores."""
    declared = _declared()[table]
    for column in columns:
        kind, not_null = declared[column]
        value = row[column]
        if value is None:
            if not_null and not nullable:
                raise _bad(where(row), column, value, kind)
        elif not isinstance(value, kind):
            raise _bad(where(row), column, value, kind)


def _bad(where: str, column: str, value: object, kind: type) -> LedgerError:
    wanted = "an integer" if kind is int else "text"
    return LedgerError(f"{where}: {column} holds {describe_value(value)} where a ledger "
                       f"stores {wanted}; this file was not written by loopengine as it is")


def _where_invocation(row: Any) -> str:
    return f"invocation {_short(row['id'])}"


def _where_attempt(row: Any) -> str:
    return f"attempt {_short(row['invocation_id'])} #{_short(row['ordinal'])}"


def _short(value: object) -> str:
    if isinstance(value, int):
        return str(value)
    return value if isinstance(value, str) and len(value) <= 80 and value.isprintable() \
        else describe_value(value)


def is_unpriced(attempt: Mapping[str, Any]) -> bool:
    """Whether an attempt row reported tokens but carries no cost (no price knew it)."""
    if attempt.get("cost_nanousd") is not None:
        return False
    return any(isinstance(attempt.get(c), int) and attempt[c] > 0 for c in _TOKEN_COLUMNS)


def _tokens(attempt: Mapping[str, Any]) -> int:
    return sum(v for c in _TOKEN_COLUMNS if isinstance(v := attempt.get(c), int))


# -- filters -----------------------------------------------------------------------------


def moment(text: str) -> str:
    """A date or ISO-8601 time as the ledger's UTC text, for period filters.

    ``2026-03-01`` means midnight UTC; a time without an offset is UTC; one
    with an offset (or ``Z``) is converted to UTC. Every period filter is
    read through this, so that it compares with the stored times as the
    times they are, not as text.

    Raises:
        ValueError: ``text`` is neither, or is outside the years 1 to 9999 once
            converted to UTC.
    """
    try:
        when = datetime.fromisoformat(text)
    except (ValueError, TypeError):
        raise ValueError(f"{text!r} is not a date (YYYY-MM-DD) or an ISO-8601 time") from None
    try:
        # A date alone parses as naive midnight, which format_time takes as UTC.
        return format_time(when)
    except OverflowError:
        raise ValueError(f"{text!r} is outside the years 1 to 9999 once converted to "
                         "UTC") from None


OUTCOMES = tuple(o.value for o in Outcome)
"""What ``outcome=`` may filter on: how an invocation ended, or ``running``
(one of `loopengine.Outcome`'s values too)."""


def _where(time_column: str, where: Where, *, joined: bool = False) -> tuple[str, list[str]]:
    """The SQL condition (`` WHERE ...`` or `` AND ...`` when ``joined``) and its
    parameters: the period on ``time_column`` (its bounds read by `moment`),
    the rest on the invocation ``i``.

    Raises:
        ConfigError: a filter `Where` does not have, a value that is not text
            (dropped, it would widen the query to every row), an outcome no
            invocation has, ``since`` or ``until`` that is not a date or time,
            or a period whose ``until`` is not later than its ``since``.
    """
    _validate.known_keys("where", where, Where.__annotations__, "a filter")
    tests = ((f"{time_column} >= ?", "since"), (f"{time_column} < ?", "until"),
             ("i.tenant = ?", "tenant"), ("i.feature = ?", "feature"),
             ("i.outcome = ?", "outcome"))
    read: dict[str, str] = {}  # the period's bounds, as `moment` read them
    clauses: list[str] = []
    params: list[str] = []
    for clause, key in tests:
        value = where.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise ConfigError(key, f"must be text or None, got {_validate.shown(value)}")
        if key == "outcome" and value not in OUTCOMES:
            raise ConfigError(key, f"{_validate.shown(value)} is not an outcome (one of "
                                   f"{', '.join(OUTCOMES)})")
        if key in ("since", "until"):
            try:
                value = read[key] = moment(value)
            except ValueError as error:
                raise ConfigError(key, str(error)) from None
        clauses.append(clause)
        params.append(value)
    since, until = where.get("since"), where.get("until")
    if since is not None and until is not None and read["until"] <= read["since"]:
        raise ConfigError("until", f"must be later than since ({since} to {until} is an "
                                   "empty period)")
    if not clauses:
        return "", []
    return (" AND " if joined else " WHERE ") + " AND ".join(clauses), params


# -- runs ----------------------------------------------------------------------------------


_RUN_COLUMNS = ("id", "started_at", "tenant", "feature", "operation", "outcome",
                "attempt_count", "cost_nanousd", "credits")


def runs(conn: AuditConnection, *, limit: int | None = None,
         **where: Unpack[Where]) -> list[RunRow]:
    """The invocations started in the period that match ``where``, newest first,
    each with how many of its attempt rows are unpriced, have usage unknown,
    or have a usage floor (what its cost does not hold, never a quiet $0).

    Args:
        conn: From `open_ledger`.
        limit: At most this many (the newest), or None for all.
        **where: The filters (`Where`).

    Raises:
        LedgerError: the rows hold values a ledger never stores.
    """
    _validate.integer("limit", limit, minimum=0, optional=True)
    clause, params = _where("i.started_at", where)
    flags = ", ".join(f"(SELECT COUNT(*) {rows}) AS {name}"
                      for name, rows in _flagged_rows("i").items())
    sql = (f"SELECT {', '.join(f'i.{c}' for c in _RUN_COLUMNS)}, {flags} FROM invocations AS i"
           f"{clause} ORDER BY i.started_at DESC, i.id DESC")
    if limit is not None:
        sql += f" LIMIT {int(limit)}"
    found = []
    for row in conn.execute(sql, params):
        _check("invocations", row, _RUN_COLUMNS, _where_invocation)
        found.append(RunRow(*row))
    return found


# -- spend ---------------------------------------------------------------------------------


_SPEND_SUMS = ("invocations", "attempt_count", "input_tokens", "output_tokens",
               "cache_read_tokens", "cache_write_tokens", "cost_nanousd",
               "provider_cost_nanousd", "credits", "unpriced_attempts", "unpriced_tokens",
               "web_search_requests", "web_fetch_requests", "reasoning_tokens", "iterations",
               "fee_nanousd", "usage_unknown", "usage_floor")


def spend(conn: AuditConnection, *, by: Grouping = "tenant", roll_up: bool = False,
          **where: Unpack[Where]) -> list[SpendRow]:
    """Spend grouped by ``by``, over invocations started in the period that
    match ``where``.

    With ``roll_up``, each tree of delegated runs (sub-agents, docs/tools.md)
    counts as its root: its descendants' totals are added to the root's, the
    root's ``by`` and start (and ``where``) place the whole tree, and
    ``invocations`` counts roots.

    The totals come from the invocation rows, which count every attempt even
    past the retention cap (R07), so they are complete where rows are not.
    The unpriced, usage-unknown and usage-floor counts come from the attempt
    rows kept.

    Args:
        conn: From `open_ledger`.
        by: One of `GROUPINGS`.
        **where: The filters (`Where`).

    Raises:
        ConfigError: ``by`` is not one of `GROUPINGS`, or a bad filter
            (`Where`).
        LedgerError: the rows hold values a ledger never stores.
    """
    if by not in GROUPINGS:
        raise ConfigError("by", f"cannot group by {_validate.shown(by)}; choose one of "
                                f"{', '.join(GROUPINGS)}")
    _validate.boolean("roll_up", roll_up)
    clause, params = _where("i.started_at", where)
    if roll_up:
        # ``i`` is each tree's root (grouped and filtered), ``m`` each of its members.
        source = ("WITH RECURSIVE roots (id, root) AS (SELECT id, id FROM invocations AS i "
                  "WHERE i.parent_invocation_id IS NULL UNION ALL SELECT i.id, r.root FROM "
                  "invocations AS i JOIN roots AS r ON i.parent_invocation_id = r.id) ",
                  "FROM roots AS r JOIN invocations AS m ON m.id = r.id "
                  "JOIN invocations AS i ON i.id = r.root")
        count, m = "COUNT(DISTINCT i.id)", "m"
    else:
        source, count, m = ("", "FROM invocations AS i"), "COUNT(*)", "i"
    # Correlated through the attempts' primary key, so the cost follows the
    # period's invocations, not the whole table.
    flagged = _flagged_rows(m)
    unpriced, unknown, floor = (flagged["unpriced"], flagged["usage_unknown"],
                                flagged["usage_floor"])
    sql = (
        f"{source[0]}SELECT i.{by} AS key, {count}, SUM({m}.attempt_count), "
        f"SUM({m}.input_tokens), SUM({m}.output_tokens), SUM({m}.cache_read_tokens), "
        f"SUM({m}.cache_write_tokens), SUM({m}.cost_nanousd), "
        f"SUM({m}.provider_cost_nanousd), SUM({m}.credits), "
        f"SUM((SELECT COUNT(*) {unpriced})), SUM((SELECT SUM({_tokens_sql('a')}) {unpriced})), "
        f"SUM({m}.web_search_requests), SUM({m}.web_fetch_requests), SUM({m}.reasoning_tokens), "
        f"SUM({m}.iterations), SUM({m}.fee_nanousd), SUM((SELECT COUNT(*) {unknown})), "
        f"SUM((SELECT COUNT(*) {floor})) "
        f"{source[1]}{clause} GROUP BY i.{by}"
    )
    rows = []
    for row in conn.execute(sql, params):
        key, sums = row[0], tuple(row)[1:]
        if key is not None and not isinstance(key, str):
            raise LedgerError(f"invocations hold a {by} that is {describe_value(key)}, where a "
                              "ledger stores text; this file was not written by loopengine "
                              "as it is")
        for name, value in zip(_SPEND_SUMS, sums, strict=True):
            if value is not None and not isinstance(value, int):
                # SUM is a real number when any value it adds is not an integer.
                raise LedgerError(f"invocations of {by} {_short(key)} hold a {name} that is "
                                  "not an integer; this file was not written by loopengine "
                                  "as it is")
        rows.append(SpendRow(key, *(v or 0 for v in sums)))
    # The costliest first, then by name (NULL, no tenant, first).
    return sorted(rows, key=lambda r: (-r.cost_nanousd, *_text_order(r.key)))


def _text_order(text: object) -> tuple[bool, str]:
    """How the audit orders names (tenants, accounts, ids...), NULL first: by their
    characters' code points, which is SQLite's order of UTF-8 text, and not
    PostgreSQL's, which follows the database's collation (en-US puts ``acme``
    before ``Zenith``) and puts NULL last; so both stores list the same rows in
    the same order. (Whatever else a hand-made file holds is ordered as its text.)"""
    return text is not None, "" if text is None else str(text)


# -- show ----------------------------------------------------------------------------------


def show(conn: AuditConnection, invocation_id: str) -> tuple[dict[str, Any],
                                                                list[dict[str, Any]]]:
    """One invocation and its attempt rows in ordinal order, as stored.

    ``invocation_id`` may be a unique prefix of the id. Each attempt also
    carries ``unpriced`` (`is_unpriced`).

    Raises:
        ConfigError: ``invocation_id`` is not a non-empty string (an empty
            one is the start of every id).
        LookupError: no invocation matches, or a prefix matches several.
    """
    _validate.text("invocation_id", invocation_id)
    rows = conn.execute("SELECT * FROM invocations WHERE id = ?", (invocation_id,)).fetchall()
    if not rows:
        # Not LIKE: SQLite's ignores case (where PostgreSQL's does not), so a
        # prefix would find a run on one store and not on the other.
        rows = conn.execute("SELECT * FROM invocations WHERE "
                            "substr(id, 1, length(CAST(? AS TEXT))) = ? LIMIT 2",
                            (invocation_id, invocation_id)).fetchall()
    if not rows:
        raise LookupError(f"no invocation {invocation_id}")
    if len(rows) > 1:
        raise LookupError(f"{invocation_id!r} is the start of several invocation ids; "
                          "give more of it")
    invocation = dict(rows[0])
    attempts = [dict(r) for r in conn.execute(
        "SELECT * FROM attempts WHERE invocation_id = ? ORDER BY ordinal", (invocation["id"],))]
    for attempt in attempts:
        attempt["unpriced"] = is_unpriced(attempt)
    return invocation, attempts


def segments(conn: AuditConnection, invocation_id: str) -> list[dict[str, Any]]:
    """The invocation's running segments (docs/ledger.md, "segments") in order: ``ordinal``,
    ``started_at``, ``ended_at`` and ``outcome`` (``paused``, or how it ended;
    both None while it runs or when its process died); empty on a ledger
    older than segments, and for a run started before it had them."""
    return _rows_of(conn, "segments", ("ordinal", "started_at", "ended_at", "outcome"),
                    "ordinal", invocation_id)


def tool_calls(conn: AuditConnection, invocation_id: str) -> list[dict[str, Any]]:
    """The invocation's tool calls and their statuses (docs/pause-and-resume.md), in the order
    they were recorded (by turn and time, a call without one first, then by id);
    empty on a ledger without a run store's tables."""
    calls = _rows_of(conn, "tool_calls",
                     ("call_id", "turn", "tool", "status", "started_at", "ended_at"),
                     "turn", invocation_id)
    # Within a turn sorted here, not by the query: PostgreSQL puts NULL last and
    # orders ids by its collation, SQLite NULL first and by characters (`_text_order`).
    turns = {turn: n for n, turn in enumerate(dict.fromkeys(c["turn"] for c in calls))}
    return sorted(calls, key=lambda c: (turns[c["turn"]],
                                        *_text_order(c["started_at"] or c["ended_at"]),
                                        *_text_order(c["call_id"])))


def _rows_of(conn: AuditConnection, table: str, columns: tuple[str, ...], order: str,
             invocation_id: str) -> list[dict[str, Any]]:
    """The ``columns`` of the invocation's rows of ``table`` (one a later schema
    version added: none on a ledger without it), ordered by ``order``."""
    if not has_table(conn, table):
        return []
    return [dict(r) for r in conn.execute(
        f"SELECT {', '.join(columns)} FROM {table} WHERE invocation_id = ? ORDER BY {order}",
        (invocation_id,))]


def run_state(conn: AuditConnection, invocation_id: str) -> dict[str, Any] | None:
    """The invocation's row in ``run_states`` without its state (the transcript is
    never shown): ``version``, ``lease_owner``, ``lease_expires_at``,
    ``paused_at``, ``updated_at``; None when it has none (it ended, or ran
    without a run store)."""
    if not has_table(conn, "run_states"):
        return None
    row = conn.execute("SELECT version, lease_owner, lease_expires_at, paused_at, updated_at "
                       "FROM run_states WHERE invocation_id = ?", (invocation_id,)).fetchone()
    return None if row is None else dict(row)


_CHILD_COLUMNS = ("id", "operation", "started_at", "outcome", "turns", "attempt_count",
                  "cost_nanousd", "credits")


def children(conn: AuditConnection, invocation_id: str) -> list[dict[str, Any]]:
    """The runs ``invocation_id`` delegated to (its sub-agents, docs/tools.md), in the
    order they started: each with its own turns, attempts, cost and credits, and
    ``tree_credits``, its credits plus its own descendants'. Empty on a ledger
    older than delegated runs.

    Raises:
        LedgerError: the rows hold values a ledger never stores.
    """
    found = []
    for row in conn.execute(
            f"SELECT {', '.join(_CHILD_COLUMNS)} FROM invocations "
            "WHERE parent_invocation_id = ? ORDER BY started_at, id", (invocation_id,)):
        _check("invocations", row, _CHILD_COLUMNS, _where_invocation)
        child = dict(row)
        total = conn.execute(f"{_account_store.TREE}SELECT SUM(i.credits) FROM tree "
                             "JOIN invocations AS i ON i.id = tree.id",
                             (child["id"],)).fetchone()[0]
        child["tree_credits"] = int(total or 0)
        found.append(child)
    return found


# -- reconcile -----------------------------------------------------------------------------


# The invocation columns reconcile reads, checked before they are compared.
_RECONCILED = ("id", "operation", "started_at", "outcome", "attempt_count",
               "attempts_retained", "incomplete", *_SUMMED, "cost_nanousd",
               "provider_cost_nanousd", "fee_nanousd")


def reconcile(
    conn: AuditConnection,
    *,
    older_than: timedelta | None = None,
    now: datetime | None = None,
) -> Reconciliation:
    """Check every invocation's totals against its attempt rows.

    For an invocation whose rows are complete (``incomplete = 0``) each token
    total must equal the sum over its rows, ``cost_nanousd`` the sum over its
    charged rows, ``provider_cost_nanousd`` the sum over every priced row, and
    ``attempt_count`` and ``attempts_retained`` the number of rows; so must
    each usage count (server tool requests, reasoning tokens, iterations),
    and ``fee_nanousd`` the sum over its charged rows. A charged row must be
    an ``ok`` one (S01). Rows still ``dispatched``, invocations still
    ``running``, incomplete invocations, unpriced attempts and attempts the
    server answered whose usage is unknown ("usage unknown") are listed, and
    so, for a look without failing the check, are attempts whose usage is a
    floor (a stream cut before its end: "usage floor").

    Args:
        conn: From `open_ledger`.
        older_than: An invocation still ``running`` that started longer ago,
            and an attempt still ``dispatched`` that was sent longer ago, are
            listed as abandoned; younger ones are in flight and do not make the
            result not `ok`. None: every open record is listed as open and
            needs a look.
        now: The time ``older_than`` counts back from and pauses are timed
            against (now, by default); one without a time zone is UTC, as
            the ledger's times are.

    Raises:
        LedgerError: the rows hold values a ledger never stores.
    """
    if older_than is not None and (not isinstance(older_than, timedelta)
                                   or older_than < timedelta(0)):
        raise ConfigError("older_than", "must be a timedelta of at least 0 or None, got "
                                        f"{_validate.shown(older_than)}")
    if now is not None and not isinstance(now, datetime):
        raise ConfigError("now", f"must be a datetime or None, got {_validate.shown(now)}")
    cutoff: str | None = None
    moment = now or datetime.now(UTC)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    if older_than is not None:
        try:
            cutoff = format_time(moment - older_than)
        except OverflowError:  # further back than year 1: nothing is older
            cutoff = format_time(datetime.min)
    # Each invocation's attempt sums, grouped on the attempts alone and joined:
    # an older ledger's invocations are a view, with no key to group i.* by.
    summed = {f"sum_{c}": f"SUM(a.{c})" for c in _SUMMED} | {
        "row_count": "COUNT(a.ordinal)",
        "sum_cost": "SUM(CASE WHEN a.charged = 1 THEN a.cost_nanousd END)",
        "sum_provider_cost": "SUM(a.cost_nanousd)",
        "sum_fee": "SUM(CASE WHEN a.charged = 1 THEN a.fee_nanousd END)",
        "charged_not_ok": "SUM(CASE WHEN a.charged = 1 AND a.outcome != 'ok' THEN 1 ELSE 0 END)",
        "dispatched": "SUM(CASE WHEN a.outcome = 'dispatched' THEN 1 ELSE 0 END)",
    }
    inner = ", ".join(f"{how} AS {name}" for name, how in summed.items())
    outer = ", ".join(f"COALESCE(s.{name}, 0) AS {name}" for name in summed)
    rows = conn.execute(
        f"SELECT i.*, {outer} FROM invocations AS i LEFT JOIN "
        f"(SELECT a.invocation_id, {inner} FROM attempts AS a GROUP BY a.invocation_id) AS s "
        "ON s.invocation_id = i.id ORDER BY i.started_at, i.id"
    ).fetchall()
    mismatches: list[Mismatch] = []
    incomplete: list[dict[str, Any]] = []
    running: list[dict[str, Any]] = []
    abandoned: list[dict[str, Any]] = []
    attempts = 0
    for row in rows:
        _check("invocations", row, _RECONCILED, _where_invocation)
        for name in ("row_count", *(f"sum_{c}" for c in _SUMMED), "sum_cost",
                     "sum_provider_cost", "sum_fee", "charged_not_ok", "dispatched"):
            if not isinstance(row[name], int):
                raise LedgerError(f"the attempt rows of {_where_invocation(row)} hold values "
                                  f"that are not integers ({name}); this file was not "
                                  "written by loopengine as it is")
        inv = row["id"]
        attempts += row["row_count"]

        def differs(column: str, recorded: int, computed: int, inv: str = inv) -> None:
            if recorded != computed:
                mismatches.append(Mismatch(inv, column, recorded, computed))

        differs("attempts_retained", row["attempts_retained"], row["row_count"])
        differs("charged", 0, row["charged_not_ok"])
        if row["outcome"] == "running":
            if cutoff is not None and row["started_at"] < cutoff:
                abandoned.append(_brief(row))
            else:
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
        differs("fee_nanousd", row["fee_nanousd"], row["sum_fee"])
    unsettled: list[dict[str, Any]] = []
    abandoned_attempts: list[dict[str, Any]] = []
    for r in conn.execute(
            "SELECT invocation_id, ordinal, turn, attempt, phase, served_by, started_at "
            "FROM attempts WHERE outcome = 'dispatched' "
            "ORDER BY started_at, invocation_id, ordinal"):
        attempt = dict(r)
        _check("attempts", attempt, tuple(attempt), _where_attempt)
        old = cutoff is not None and attempt["started_at"] < cutoff
        (abandoned_attempts if old else unsettled).append(attempt)
    unpriced = _flagged(conn, _TOKEN_COLUMNS, _unpriced_sql("a"))
    for attempt in unpriced:
        attempt["tokens"] = _tokens(attempt)
    usage_unknown = _flagged(conn, ("response_id",), _usage_unknown_sql("a"))
    usage_floor = _flagged(conn, ("aborted_reason", "input_tokens", "output_tokens",
                                  "cost_nanousd", "response_id"), _usage_floor_sql("a"))
    orphans = [dict(r) for r in conn.execute(
        "SELECT invocation_id, ordinal FROM attempts WHERE invocation_id NOT IN "
        "(SELECT id FROM invocations) ORDER BY invocation_id, ordinal")]
    in_doubt, expired_leases, expired_pauses = _stored_runs(conn, moment)
    dead_segments = [dict(r) for r in conn.execute(
        "SELECT s.invocation_id, s.ordinal, s.started_at FROM segments AS s "
        "JOIN invocations AS i ON i.id = s.invocation_id "
        "WHERE s.ended_at IS NULL AND s.outcome IS NULL AND (i.outcome <> 'running' "
        "OR EXISTS (SELECT 1 FROM segments AS n WHERE n.invocation_id = s.invocation_id "
        "AND n.ordinal > s.ordinal)) ORDER BY s.started_at, s.invocation_id, s.ordinal")
    ] if has_table(conn, "segments") else []
    return Reconciliation(invocations=len(rows), attempts=attempts + len(orphans),
                          mismatches=mismatches, unsettled=unsettled, incomplete=incomplete,
                          running=running, orphans=orphans, unpriced=unpriced,
                          abandoned=abandoned, abandoned_attempts=abandoned_attempts,
                          older_than=older_than, accounts=reconcile_accounts(conn),
                          usage_unknown=usage_unknown, usage_floor=usage_floor,
                          in_doubt=in_doubt,
                          expired_leases=expired_leases, expired_pauses=expired_pauses,
                          dead_segments=dead_segments)


def _stored_runs(conn: AuditConnection, now: datetime) -> tuple[
        list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """From the run store's tables (none on an older ledger): the tool calls in
    doubt (marked ``in_doubt``, or ``started`` with no end while no live lease
    holds their run), the running runs whose lease expired (their process
    died: a resume recovers them), and the paused runs past their
    ``pause_timeout``."""
    if not has_table(conn, "run_states"):
        return [], [], []
    at = format_time(now)
    live = {str(r[0]) for r in conn.execute(
        "SELECT invocation_id FROM run_states WHERE paused_at IS NULL "
        "AND lease_expires_at >= ?", (at,))}
    in_doubt = sorted((dict(r) for r in conn.execute(
        "SELECT invocation_id, call_id, turn, tool, status, started_at FROM tool_calls "
        "WHERE status IN ('started', 'in_doubt')")
        if r["status"] == "in_doubt" or r["invocation_id"] not in live),
        # A batch's calls start at one time: ordered here by their ids' characters,
        # as on SQLite, not by PostgreSQL's collation (`_text_order`).
        key=lambda c: tuple(part for column in ("started_at", "invocation_id", "call_id")
                            for part in _text_order(c[column])))
    expired_leases = [dict(r) for r in conn.execute(
        "SELECT invocation_id, lease_owner, lease_expires_at, updated_at FROM run_states "
        "WHERE paused_at IS NULL AND lease_expires_at < ? ORDER BY lease_expires_at",
        (at,))]
    expired_pauses = []
    for row in conn.execute("SELECT invocation_id, paused_at, state FROM run_states "
                            "WHERE paused_at IS NOT NULL ORDER BY paused_at"):
        # Only the limit is read from the state: the transcript is never shown.
        try:
            timeout = json.loads(row["state"])["limits"]["pause_timeout"]
            paused_at = datetime.fromisoformat(str(row["paused_at"]))
        except (ValueError, TypeError, KeyError):
            continue
        if isinstance(timeout, int | float) and \
                (now - paused_at).total_seconds() > timeout:
            expired_pauses.append({"invocation_id": row["invocation_id"],
                                   "paused_at": row["paused_at"], "pause_timeout": timeout})
    return in_doubt, expired_leases, expired_pauses


def _flagged(conn: AuditConnection, columns: tuple[str, ...],
             condition: str) -> list[dict[str, Any]]:
    """The attempt rows (``a``) meeting ``condition``, in time order, with their
    key, ``served_by``, ``started_at``, ``outcome`` and ``columns``; checked."""
    found = []
    for r in conn.execute(
            "SELECT invocation_id, ordinal, served_by, started_at, outcome, "
            f"{', '.join(columns)} FROM attempts AS a WHERE {condition} "
            "ORDER BY started_at, invocation_id, ordinal"):
        attempt = dict(r)
        _check("attempts", attempt, tuple(attempt), _where_attempt)
        found.append(attempt)
    return found


# -- credit accounts ---------------------------------------------------------------


def accounts(conn: AuditConnection) -> list[AccountRow]:
    """Every credit account's granted, spent, reserved and available credits
    (none in a ledger older than the accounts)."""
    if not has_table(conn, "accounts"):
        return []
    out = []
    for row in conn.execute("SELECT account, granted, spent, reserved, updated_at "
                            "FROM accounts"):
        values = tuple(row)
        if not all(isinstance(v, int) for v in values[1:4]):
            raise LedgerError(f"account {describe_value(values[0])} holds values that are "
                              "not integers; this file was not written by loopengine as it is")
        out.append(AccountRow(str(values[0]), values[1], values[2], values[3],
                              _account_store.available(*values[1:4]), str(values[4])))
    return sorted(out, key=lambda r: _text_order(r.account))


def reconcile_accounts(conn: AuditConnection) -> list[AccountMismatch]:
    """Check each account against its journal, and each settled run's charge
    against that run's credits (its recorded credits once it ended; for a run
    whose process died, what its settled attempts charged): every run whose
    reservations were all released, one released with no charge included; and
    the table of open reservations against the journal's unreleased ones."""
    if not has_table(conn, "accounts"):
        return []
    found: list[AccountMismatch] = []
    sums = ", ".join(f"COALESCE({sql}, 0)" for sql in _account_store.JOURNAL_SUMS.values())
    for row in accounts(conn):
        computed = conn.execute(f"SELECT {sums} FROM account_entries WHERE account = ?",
                                (row.account,)).fetchone()
        for column, value in zip(_account_store.JOURNAL_SUMS, computed, strict=True):
            recorded = getattr(row, column)
            if recorded != value:
                found.append(AccountMismatch(row.account, column, recorded, int(value)))
    if has_table(conn, "open_reservations"):
        found += [AccountMismatch(account, "open", held, journal, invocation_id)
                  for account, invocation_id, held, journal
                  in _account_store.open_differences(conn)]
    journaled = _account_store.every_entries(conn)
    for account, invocation_id, rate, quantum in sorted(conn.execute(
            # One row of rates per invocation that reserved (a resumed run
            # reserved once per segment).
            "SELECT account, invocation_id, MAX(credits_per_usd), MAX(credit_quantum) "
            "FROM account_entries WHERE kind = 'reserve' AND invocation_id IS NOT NULL "
            "GROUP BY account, invocation_id"), key=lambda r: (r[0], r[1])):
        run = journaled[invocation_id]
        if not run.released:
            continue  # a resumed run in progress: its earlier segments' settlement is partial
        # A root's reservation pays for its tree of delegated runs (docs/tools.md);
        # a reservation released with no charge is a charge of 0.
        expected = _account_store.charged(conn, invocation_id, Decimal(rate), int(quantum))
        if run.settled != expected:
            found.append(AccountMismatch(account, "charged", run.settled, expected,
                                         invocation_id))
    return found


def _brief(row: Any) -> dict[str, Any]:
    return {k: row[k] for k in ("id", "operation", "tenant", "started_at", "outcome",
                                "attempt_count", "attempts_retained", "dispatched")}


# -- export --------------------------------------------------------------------------------


def export_rows(conn: AuditConnection, **where: Unpack[Where]) -> Iterator[dict[str, Any]]:
    """Every attempt row started in the period whose invocation matches
    ``where`` (`Where`), for an invoice.

    Each row carries who it is accounted to, its cost in USD (exact plain decimal
    text, None when it has no cost), ``response_id_missing`` (1 when the
    provider gave no response id: such rows are marked, never dropped) and
    ``unpriced`` (1 when it served tokens without a price).

    Raises:
        ConfigError: a bad filter (`Where`), raised by this call.
        LedgerError: a row holds a value a ledger never stores (raised when
            that row is reached).
    """
    clause, params = _where("a.started_at", where)
    return _exported(conn, clause, params)


def _exported(conn: AuditConnection, clause: str, params: list[str]) -> Iterator[dict[str, Any]]:
    columns = ", ".join(f"a.{c}" for c in ATTEMPT_COLUMNS)
    sql = (f"SELECT {columns}, i.tenant, i.user_id, i.feature, i.correlation_id, i.operation, "
           "i.operation_version, i.provider, i.model FROM attempts AS a "
           f"LEFT JOIN invocations AS i ON i.id = a.invocation_id{clause} "
           "ORDER BY a.started_at, a.invocation_id, a.ordinal")
    for row in stream(conn, sql, params):
        record = dict(row)
        _check("attempts", record, ATTEMPT_COLUMNS, _where_attempt)
        _check("invocations", record, _EXPORT_JOINED, _where_attempt, nullable=True)
        cost = record["cost_nanousd"]
        record["cost_usd"] = None if cost is None else usd_text(cost)
        record["response_id_missing"] = int(not record["response_id"])
        record["unpriced"] = int(is_unpriced(record))
        yield {column: record[column] for column in EXPORT_COLUMNS}


def incomplete_in_export(conn: AuditConnection, **where: Unpack[Where]) -> int:
    """How many invocations in an export (`export_rows` with the same filters)
    have fewer rows than attempts."""
    clause, params = _where("a.started_at", where, joined=True)
    sql = ("SELECT COUNT(DISTINCT a.invocation_id) FROM attempts AS a JOIN invocations AS i "
           f"ON i.id = a.invocation_id WHERE i.incomplete = 1{clause}")
    return int(conn.execute(sql, params).fetchone()[0])
