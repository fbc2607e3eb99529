"""The SQL of credit accounts on a ledger's database (docs/accounts.md).

Written for SQLite's ``?`` parameters; a PostgreSQL connection is given
through an adapter that spells them ``%s`` and sets ``locks_rows``.

Shared by `loopengine.CreditAccounts` (admission and settlement) and the audit
(``loopengine audit accounts``, ``reconcile``): one reading of the journal.
Every function works inside a transaction its caller holds. The accounts'
transactions find reservations still held in ``open_reservations``, which
`journal` keeps beside the journal, never by walking the journal itself: an
account's transaction costs what it has in flight, not its history.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from loopengine.guards._credits import turn_credits
from loopengine.persistence._schema import UNRELEASED

__all__ = ["TREE", "AccountBalance", "JOURNAL_SUMS", "RunEntries", "TreeRun", "account_of",
           "charged", "close_reservations", "descendants", "entries", "every_entries", "is_open",
           "journal", "lock", "open_differences", "read", "tree"]

JOURNAL_SUMS = {
    "granted": "SUM(CASE WHEN kind = 'grant' THEN credits ELSE 0 END)",
    "spent": "SUM(CASE WHEN kind IN ('settle', 'expire') THEN credits ELSE 0 END)",
    "reserved": "SUM(CASE kind WHEN 'reserve' THEN credits WHEN 'release' THEN -credits "
                "ELSE 0 END)",
}
"""What each column of ``accounts`` is, as a sum over ``account_entries``."""


@dataclass(frozen=True, slots=True)
class AccountBalance:
    """An account's credits: ``available = granted - spent - reserved``."""

    account: str
    granted: int
    """Every credit granted to the account."""
    spent: int
    """The real charges of its settled runs."""
    reserved: int
    """The holds of its runs in progress."""
    available: int
    """What a new run may still reserve."""


def lock(conn: Any, account: str) -> None:
    """Hold ``account``'s row for the rest of the transaction, where the store
    needs it: PostgreSQL's row lock serializes the transactions of one account
    across hosts; SQLite's ``BEGIN IMMEDIATE`` already holds the whole file."""
    if getattr(conn, "locks_rows", False):
        conn.execute("SELECT 1 FROM accounts WHERE account = ? FOR UPDATE", (account,))


def read(conn: Any, account: str) -> AccountBalance:
    row = conn.execute("SELECT granted, spent, reserved FROM accounts WHERE account = ?",
                       (account,)).fetchone()
    granted, spent, reserved = (int(v) for v in row) if row else (0, 0, 0)
    return AccountBalance(account, granted, spent, reserved,
                          available(granted, spent, reserved))


def available(granted: int, spent: int, reserved: int) -> int:
    """What an account's new runs may still reserve: what was granted, less its
    runs' real charges and the holds of those in progress."""
    return granted - spent - reserved


_BALANCES = ("granted", "spent", "reserved")
_EFFECT = {"grant": ("granted", 1), "reserve": ("reserved", 1), "release": ("reserved", -1),
           "settle": ("spent", 1), "expire": ("spent", 1)}


def journal(conn: Any, account: str, now: str, kind: str, credits: int,
            invocation_id: str | None, note: str | None, *, expires_at: str | None = None,
            rate: str | None = None, quantum: int | None = None) -> int | None:
    """One journal entry and its effect on the account row and on the open
    reservations (a ``reserve`` opens one, a ``release`` closes its invocation's
    oldest), in the open transaction: the one place they are written. Returns
    a ``reserve``'s entry id (its ``open_reservations`` row's key), else None."""
    insert = ("INSERT INTO account_entries (account, at, kind, credits, invocation_id, note, "
              "expires_at, credits_per_usd, credit_quantum) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)")
    values = (account, now, kind, credits, invocation_id, note, expires_at, rate, quantum)
    entry: int | None = None
    if kind == "reserve":
        ((entry,),) = conn.execute(f"{insert} RETURNING id", values).fetchall()
        conn.execute("INSERT INTO open_reservations (entry_id, account, invocation_id, "
                     "expires_at) VALUES (?, ?, ?, ?)", (entry, account, invocation_id,
                                                         expires_at))
    else:
        conn.execute(insert, values)
    if kind == "release":
        # First in, first out, as the journal counts them (`_schema.UNRELEASED`).
        conn.execute("DELETE FROM open_reservations WHERE entry_id = (SELECT MIN(entry_id) "
                     "FROM open_reservations WHERE invocation_id = ?)", (invocation_id,))
    column, sign = _EFFECT[kind]
    # The row made with its first entry, or added to: one statement (one
    # round trip on a server).
    effect = [sign * credits if c == column else 0 for c in _BALANCES]
    conn.execute(
        "INSERT INTO accounts (account, granted, spent, reserved, updated_at) "
        f"VALUES (?, ?, ?, ?, ?) ON CONFLICT (account) DO UPDATE SET {column} = "
        f"accounts.{column} + excluded.{column}, updated_at = excluded.updated_at",
        (account, *effect, now))
    return None if entry is None else int(entry)


@dataclass(frozen=True, slots=True)
class RunEntries:
    """What an invocation's journal entries say of its settlement (`entries`)."""

    released: bool
    """Every reservation of it was released (a paused run released one, and its
    resume reserves again: one per running segment)."""
    outlived: bool
    """Its last reservation was closed by its expiry and it has not settled
    since: it was alive past its expiry (a run without ``total_time`` past the
    hour assumed of it), so its own settlement still owes what it spent after
    the expiry charged it."""
    settled: int
    """The credits already charged to it (its earlier segments', settled when it
    paused, or an expiry's): a settlement charges only what comes on top."""


_RUN_SUMS = ("COALESCE(SUM(CASE kind WHEN 'reserve' THEN 1 WHEN 'release' THEN -1 ELSE 0 END), 0), "
             f"COALESCE({JOURNAL_SUMS['spent']}, 0), MAX(CASE WHEN kind = 'release' THEN id END), "
             "MAX(CASE WHEN kind = 'release' AND (expires_at IS NOT NULL OR note = ?) THEN id "
             "END), MAX(CASE WHEN kind = 'settle' THEN id END)")
"""A run's journal entries as `RunEntries` reads them: its reservations not
released, what was charged to it (as ``spent`` counts it), and the ids of its
last release, last expiry's release and last settlement (the parameter: the
note of an expiry's release, `entries`)."""


def entries(conn: Any, invocation_id: str) -> RunEntries:
    """What the journal says of the invocation's settlement, in one statement.
    An expiry's ``release`` is the one that carries the reservation's
    ``expires_at`` (`close_reservations`), or, written by a version that kept
    no ``expires_at`` on a release (a fleet part-way through an upgrade
    shares the schema), the one with an expiry's note."""
    return _run_entries(*conn.execute(f"SELECT {_RUN_SUMS} FROM account_entries WHERE "
                                      "invocation_id = ?", (_NOTES["expire"][1], invocation_id)
                                      ).fetchone())


def every_entries(conn: Any) -> dict[str, RunEntries]:
    """`entries` of every invocation the journal names, in one statement (for
    the audit, which reads them all)."""
    return {str(run): _run_entries(*sums) for run, *sums in conn.execute(
        f"SELECT invocation_id, {_RUN_SUMS} FROM account_entries WHERE invocation_id IS NOT "
        "NULL GROUP BY invocation_id", (_NOTES["expire"][1],))}


def _run_entries(unreleased: int, settled: int, last_release: int | None,
                 last_expiry: int | None, last_settle: int | None) -> RunEntries:
    """`RunEntries` from a row of `_RUN_SUMS`."""
    outlived = (last_expiry is not None and last_expiry == last_release
                and (last_settle is None or last_settle < last_expiry))
    return RunEntries(int(unreleased) <= 0, outlived, int(settled))


def is_open(conn: Any, entry: int) -> bool:
    """Whether the reservation journaled as entry ``entry`` is still held (its
    ``open_reservations`` row): neither its run's settlement, an expiry nor a
    recovery has released it."""
    return conn.execute("SELECT 1 FROM open_reservations WHERE entry_id = ?",
                        (entry,)).fetchone() is not None


def account_of(conn: Any, invocation_id: str) -> str | None:
    """The account the invocation reserved its credits on (its first ``reserve``
    entry), or None: it never ran on an account."""
    row = conn.execute("SELECT account FROM account_entries WHERE invocation_id = ? "
                       "AND kind = 'reserve' ORDER BY id LIMIT 1", (invocation_id,)).fetchone()
    return None if row is None else str(row[0])


def open_differences(conn: Any) -> list[tuple[str, str, int, int]]:
    """Where ``open_reservations`` and the journal disagree, as ``(account,
    invocation_id, held, open)``: each row the table holds that no unreleased
    reservation of the journal reads as (one released, or its figures changed)
    as ``held=1, open=0``; each reservation the journal leaves unreleased that
    the table lacks as it reads, ``held=0, open=1`` (`_schema.UNRELEASED`,
    which walks the whole journal: for the audit, not a transaction)."""
    table = "SELECT entry_id, account, invocation_id, expires_at FROM open_reservations"
    found = [(str(account), str(invocation_id), held, 1 - held)
             for first, second, held in ((table, UNRELEASED, 1), (UNRELEASED, table, 0))
             for account, invocation_id in conn.execute(
                 f"SELECT d.account, d.invocation_id FROM ({first} EXCEPT {second}) AS d"
             ).fetchall()]
    return sorted(found)


def close_reservations(conn: Any, account: str, now: str, *, expired: bool,
                       recovered: str | None = None, stopped: bool = False) -> None:
    """Charge and release ``account``'s open reservations that expired (if
    ``expired``: every transaction that admits a run, grants or reads a
    balance settles them first; kind ``expire``, the release keeping the
    reservation's ``expires_at``: `entries` knows an expiry by it) and then
    the one of the invocation ``recovered`` (kind ``settle``: a recovered
    run's, left by the running segment whose process died, charged what the
    ledger says that segment spent), each group in the order they were
    reserved; from one reading of ``open_reservations`` (its rows as many as
    the account's runs in flight, whatever its history). ``stopped``: the
    invocation ``recovered`` is a run that stopped waiting for its admission,
    settled at its end (its entries' notes say so)."""
    which, values = [], []
    if expired:
        which.append("o.expires_at < ?")
        values.append(now)
    if recovered is not None:
        which.append("o.invocation_id = ?")
        values.append(recovered)
    # One SELECT a condition, joined by UNION (a row both select is read once):
    # each is answered by its own index, where ``o.account = ? AND (... OR ...)``
    # walked every open reservation of the account (SQLite's plan), a cost per
    # admission that grew with the account's runs in flight.
    found = conn.execute(
        " UNION ".join(
            "SELECT o.entry_id, o.invocation_id, r.credits, r.credits_per_usd, "
            "r.credit_quantum, o.expires_at, CASE WHEN o.expires_at < ? THEN 1 ELSE 0 END "
            "FROM open_reservations AS o JOIN account_entries AS r ON r.id = o.entry_id "
            f"WHERE o.account = ? AND {condition}" for condition in which)
        + " ORDER BY 1",
        tuple(arg for value in values for arg in (now, account, value))).fetchall()
    # The expired first, as an expiry reads them before a recovery does.
    for _, invocation_id, reserved, rate, quantum, expires_at, late in sorted(
            found, key=lambda row: not (expired and row[6])):
        kind = "expire" if expired and late else "settle"
        charge_note, release_note = _NOTES["stopped" if stopped and kind == "settle" else kind]
        charge = (charged(conn, invocation_id, Decimal(rate), int(quantum))
                  - entries(conn, invocation_id).settled)
        if charge > 0:
            journal(conn, account, now, kind, charge, invocation_id, charge_note)
        journal(conn, account, now, "release", int(reserved), invocation_id, release_note,
                expires_at=expires_at if kind == "expire" else None)


_NOTES = {"expire": ("settled after its reservation expired",
                     "released after its reservation expired"),
          "settle": ("settled when its run was recovered", "released when its run was recovered"),
          "stopped": ("settled at the end of its run, which stopped waiting for it",
                      "released at the end of its run, which stopped waiting for it")}
"""The notes of the entries `close_reservations` writes, by the kind of its charge:
for a reader."""


TREE = ("WITH RECURSIVE tree (id) AS (SELECT CAST(? AS TEXT) UNION ALL "
        "SELECT i.id FROM invocations AS i JOIN tree AS t ON i.parent_invocation_id = t.id) ")
"""The ids of a run and of every run it delegated to, theirs included (a sub-agent's
tree, docs/tools.md): a common table expression taking the root's id."""


@dataclass(frozen=True, slots=True)
class TreeRun:
    """One run of a tree of delegated runs, as the ledger holds it: what its
    account's settlement and a recovery of its root read of it."""

    id: str
    outcome: str
    turns: int
    """Its turns: as recorded, or, while it runs, the last its attempt rows
    reached when later (a run writes its counts only when it ends, and a turn
    counts once its request was sent, R01)."""
    tool_calls: int
    credits: int
    """Its credits as recorded (written when it ends or pauses)."""
    turn_costs: tuple[int, ...]
    """While it runs, the nano-USD of each of its turns' settled, charged
    attempts (empty once it ended or paused: its ``credits`` count then)."""

    def charge(self, rate: Decimal, quantum: int) -> int:
        """What it charged its account: its credits once it ended (or paused),
        else its settled turns' charges, each rounded up (R03)."""
        if self.outcome != "running":
            return self.credits
        return sum(turn_credits(cost, rate, quantum) for cost in self.turn_costs)


def tree(conn: Any, invocation_id: str) -> list[TreeRun]:
    """The run ``invocation_id`` and every run below it (`TREE`), in the order
    they started, in two statements whatever the tree's size."""
    runs = conn.execute(
        f"{TREE}SELECT i.id, i.outcome, i.turns, i.tool_calls, i.credits, "
        "CASE WHEN i.outcome = 'running' THEN (SELECT MAX(a.turn) FROM attempts AS a "
        "WHERE a.invocation_id = i.id) END FROM invocations AS i JOIN tree AS t "
        "ON t.id = i.id ORDER BY i.started_at, i.id", (invocation_id,)).fetchall()
    costs: dict[str, list[int]] = {}
    # CROSS JOIN keeps SQLite's join order (the tree, then its rows by their keys):
    # left to choose, it may read every attempt row of the ledger for each tree.
    for member, cost in conn.execute(
            f"{TREE}SELECT a.invocation_id, SUM(a.cost_nanousd) FROM tree AS t "
            "CROSS JOIN invocations AS i CROSS JOIN attempts AS a "
            "WHERE i.id = t.id AND i.outcome = 'running' AND a.invocation_id = i.id "
            "AND a.charged = 1 AND a.cost_nanousd IS NOT NULL "
            "GROUP BY a.invocation_id, a.turn", (invocation_id,)).fetchall():
        costs.setdefault(str(member), []).append(int(cost))
    return [TreeRun(str(member), str(outcome), max(int(turns), int(reached or 0)),
                    int(tool_calls), int(credits), tuple(costs.get(str(member), ())))
            for member, outcome, turns, tool_calls, credits, reached in runs]


def charged(conn: Any, invocation_id: str, rate: Decimal, quantum: int) -> int:
    """What the ledger says a run charged its account: for it and each run it
    delegated to (its tree, which one reservation pays for), its credits if it
    ended, else the rounded turn charges of its settled, charged attempts (R03)."""
    return sum(run.charge(rate, quantum) for run in tree(conn, invocation_id))


def descendants(runs: Sequence[TreeRun], invocation_id: str, rate: Decimal, quantum: int
                ) -> tuple[int, list[tuple[str, int, int, int]]]:
    """What the runs ``invocation_id`` delegated to charged, theirs included, of
    its tree ``runs`` (`tree`): its tree's charge less its own (a run recovered
    after its process died learns so what its sub-agents spent, those cut by
    the crash too); and those of them the ledger still holds ``running``, in
    the order they started, as ``(id, turns, tool_calls, charge)``: their turns
    and tool calls as `TreeRun` reads them, and the charge counted for them in
    that sum (each run's charge computed once, for both)."""
    below = [(run, run.charge(rate, quantum)) for run in runs if run.id != invocation_id]
    return (sum(charge for _, charge in below),
            [(run.id, run.turns, run.tool_calls, charge) for run, charge in below
             if run.outcome == "running"])
