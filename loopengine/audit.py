"""The audit's queries, for use from Python: what ``loopengine audit`` prints.

Each function takes a connection from `open_ledger` (a SQLite file opened
read-only, even one the caller cannot write, or a ``postgresql://`` URL read
in one snapshot) and raises `loopengine.LedgerError` where the
command exits 2. See docs/ledger.md.

Example::

    from loopengine import audit

    conn = audit.open_ledger("ledger.db")
    report = audit.reconcile(conn)
    print(report.ok, len(report.unpriced))
"""

from loopengine.persistence._audit import (
    EXPORT_COLUMNS,
    GROUPINGS,
    AccountMismatch,
    AccountRow,
    Mismatch,
    Reconciliation,
    RunRow,
    SpendRow,
    Where,
    accounts,
    children,
    export_rows,
    open_ledger,
    reconcile,
    runs,
    show,
    spend,
)

__all__ = [
    "EXPORT_COLUMNS",
    "GROUPINGS",
    "AccountMismatch",
    "AccountRow",
    "Mismatch",
    "Reconciliation",
    "RunRow",
    "SpendRow",
    "Where",
    "accounts",
    "children",
    "export_rows",
    "open_ledger",
    "reconcile",
    "runs",
    "show",
    "spend",
]
