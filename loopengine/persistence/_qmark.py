"""A PostgreSQL connection as SQL written for SQLite's ``?`` parameters expects it.

The SQL of the ledger's own transactions (the credit accounts', the run
store's, the writer's reads) and of the audit is written once, with ``?``
markers; on PostgreSQL it is spelled ``%s`` (`percent_s`), the transactions'
through `QmarkConnection`, which also says that the store locks rows
(``locks_rows``: a ``SELECT ... FOR UPDATE`` serializes one row's
transactions across hosts, where SQLite's ``BEGIN IMMEDIATE`` already holds
the whole file).
"""

from __future__ import annotations

from typing import Any

__all__ = ["QmarkConnection", "percent_s"]


def percent_s(statement: str) -> str:
    """``statement``, written with ``?`` parameters, as psycopg reads it: each
    ``?`` spelled ``%s``, a literal ``%`` doubled."""
    return statement.replace("%", "%%").replace("?", "%s")


class QmarkConnection:
    """A psycopg connection taking ``?`` parameters."""

    locks_rows = True
    """PostgreSQL locks rows (``FOR UPDATE``)."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def execute(self, statement: str, parameters: tuple[Any, ...] = ()) -> Any:
        """Run ``statement`` with ``?`` markers (`percent_s`)."""
        return self._conn.execute(percent_s(statement), parameters)
