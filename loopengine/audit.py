"""The audit's queries, for use from Python: what ``loopengine audit`` prints.

Each function takes a connection from `open_ledger` (read-only; it works on a
ledger the caller cannot write) and raises `loopengine.LedgerError` where the
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
    SpendRow,
    accounts,
    export_rows,
    open_ledger,
    reconcile,
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
    "SpendRow",
    "accounts",
    "export_rows",
    "open_ledger",
    "reconcile",
    "show",
    "spend",
]
