"""The ``loopengine`` command: ``audit`` answers an auditor's questions from a
ledger file (read-only), ``demo`` runs a short conversation end to end.

Exit status: 0 on success; 1 when ``audit reconcile`` finds something that
does not reconcile; 2 when the command cannot run (a missing file, a file that
is not a ledger, a schema newer than this code, a bad option).
"""

from __future__ import annotations

import csv
import json
import sqlite3
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from typing import IO, Any

import click

from loopengine._errors import LedgerError
from loopengine.persistence import _audit

__all__ = ["main"]


class _CannotRun(click.ClickException):
    """The command could not do its work (exit status 2, like a usage error)."""

    exit_code = 2


@click.group()
@click.version_option(package_name="loopengine")
def main() -> None:
    """loopengine: an accountable async tool loop for LLM conversations."""


@main.group()
def audit() -> None:
    """Read a ledger file (opened read-only): spend, one invocation, reconciliation,
    an invoice export."""


_DB = click.option("--db", "db", required=True, type=click.Path(dir_okay=False, path_type=Path),
                   help="The ledger's SQLite file.")
_JSON = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")


def _moment(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return _audit.parse_moment(value)
    except ValueError as error:
        raise click.BadParameter(str(error)) from None


_SINCE = click.option("--since", callback=_moment, metavar="DATE",
                      help="From this date or ISO-8601 time (inclusive, UTC).")
_UNTIL = click.option("--until", callback=_moment, metavar="DATE",
                      help="Before this date or ISO-8601 time (exclusive, UTC).")


@contextmanager
def _ledger(path: Path) -> Iterator[sqlite3.Connection]:
    try:
        conn = _audit.open_ledger(path)
    except LedgerError as error:
        raise _CannotRun(str(error)) from None
    try:
        yield conn
    except sqlite3.DatabaseError as error:
        raise _CannotRun(f"{path}: {error}") from None
    finally:
        conn.close()


def _usd(nanousd: int | None) -> str:
    return "" if nanousd is None else str(Decimal(nanousd) / Decimal(1_000_000_000))


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[("" if v is None else str(v)) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
              for r in cells]
    return "\n".join(lines)


def _print_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, default=str))


@audit.command()
@_DB
@click.option("--by", type=click.Choice(_audit.GROUPINGS), default="tenant", show_default=True,
              help="What to group the spend by.")
@_SINCE
@_UNTIL
@_JSON
def spend(db: Path, by: _audit.Grouping, since: str | None, until: str | None,
          as_json: bool) -> None:
    """Spend per tenant, feature, model or operation, over invocations started in a period.

    Charged cost counts successful attempts only; provider cost counts every
    attempt that reported usage (what the provider may bill).
    """
    with _ledger(db) as conn:
        rows = _audit.spend(conn, by=by, since=since, until=until)
    if as_json:
        _print_json([{by: r.key, "invocations": r.invocations, "attempts": r.attempts,
                      "input_tokens": r.input_tokens, "output_tokens": r.output_tokens,
                      "cache_read_tokens": r.cache_read_tokens,
                      "cache_write_tokens": r.cache_write_tokens,
                      "cost_nanousd": r.cost_nanousd, "cost_usd": str(r.cost_usd),
                      "provider_cost_nanousd": r.provider_cost_nanousd,
                      "provider_cost_usd": str(r.provider_cost_usd), "credits": r.credits}
                     for r in rows])
        return
    period = f" from {since or 'the start'} until {until or 'now'}"
    if not rows:
        click.echo(f"No invocations{period}.")
        return
    click.echo(f"Spend by {by}{period}:")
    click.echo(_table(
        [by, "invocations", "attempts", "input", "output", "cache read", "cache write",
         "charged USD", "provider USD", "credits"],
        [[r.key if r.key is not None else "(none)", r.invocations, r.attempts, r.input_tokens,
          r.output_tokens, r.cache_read_tokens, r.cache_write_tokens, _usd(r.cost_nanousd),
          _usd(r.provider_cost_nanousd), r.credits] for r in rows]))


_ATTEMPT_TABLE = ("ordinal", "turn", "attempt", "phase", "outcome", "fault", "http_status",
                  "latency_ms", "input_tokens", "output_tokens", "cost_usd", "charged",
                  "response_id")


def attempts_table(attempts: Sequence[dict[str, Any]]) -> str:
    """The attempt rows as the text table ``show`` and ``demo`` print."""
    rows = []
    for a in attempts:
        outcome = a["outcome"] + (f"/{a['aborted_reason']}" if a.get("aborted_reason") else "")
        rows.append([a["ordinal"], a["turn"], a["attempt"], a["phase"], outcome, a["fault"],
                     a["http_status"], a["latency_ms"], a["input_tokens"], a["output_tokens"],
                     _usd(a["cost_nanousd"]), "yes" if a["charged"] else "no",
                     a["response_id"] or "(none)"])
    return _table(_ATTEMPT_TABLE, rows)


@audit.command()
@_DB
@click.argument("invocation_id")
@_JSON
def show(db: Path, invocation_id: str, as_json: bool) -> None:
    """One invocation (by id, or a unique start of it) and its attempts."""
    with _ledger(db) as conn:
        try:
            invocation, attempts = _audit.show(conn, invocation_id)
        except LookupError as error:
            raise _CannotRun(str(error).strip("'\"")) from None
    if as_json:
        _print_json({"invocation": invocation, "attempts": attempts})
        return
    width = max(len(k) for k in invocation)
    for key, value in invocation.items():
        if key in ("cost_nanousd", "provider_cost_nanousd"):
            value = f"{value} (USD {_usd(value)})"
        click.echo(f"{key.ljust(width)}  {'' if value is None else value}")
    click.echo("")
    if invocation["incomplete"]:
        click.echo(f"{invocation['attempt_count']} attempts, {invocation['attempts_retained']} "
                   "rows retained: the record is incomplete (later attempts are counted "
                   "in the totals, without rows).")
    click.echo(attempts_table(attempts) if attempts else "No attempt rows.")


@audit.command()
@_DB
@_JSON
def reconcile(db: Path, as_json: bool) -> None:
    """Check attempt rows against invocation totals; list unsettled attempts, incomplete
    records and invocations still running. Exits 1 when anything does not reconcile."""
    with _ledger(db) as conn:
        result = _audit.reconcile(conn)
    if as_json:
        _print_json({"ok": result.ok, "invocations": result.invocations,
                     "attempts": result.attempts,
                     "mismatches": [vars_of(m) for m in result.mismatches],
                     "unsettled": result.unsettled, "incomplete": result.incomplete,
                     "running": result.running, "orphans": result.orphans})
    else:
        click.echo(f"Checked {result.invocations} invocations and {result.attempts} attempt rows.")
        sections: list[tuple[str, list[list[Any]], list[str]]] = [
            ("Totals that do not equal their attempt rows",
             [[m.invocation_id, m.column, m.recorded, m.computed] for m in result.mismatches],
             ["invocation", "column", "recorded", "rows add up to"]),
            ("Attempts still dispatched (in flight, or their process died)",
             [[u["invocation_id"], u["ordinal"], u["turn"], u["attempt"], u["phase"],
               u["started_at"]] for u in result.unsettled],
             ["invocation", "ordinal", "turn", "attempt", "phase", "started_at"]),
            ("Incomplete records (more attempts than rows kept, R07)",
             [[i["id"], i["operation"], i["attempt_count"], i["attempts_retained"]]
              for i in result.incomplete],
             ["invocation", "operation", "attempts", "rows"]),
            ("Invocations still running (or their process died)",
             [[i["id"], i["operation"], i["tenant"], i["started_at"]] for i in result.running],
             ["invocation", "operation", "tenant", "started_at"]),
            ("Attempt rows without an invocation row",
             [[o["invocation_id"], o["ordinal"]] for o in result.orphans],
             ["invocation", "ordinal"]),
        ]
        for title, rows, headers in sections:
            if rows:
                click.echo(f"\n{title}: {len(rows)}")
                click.echo(_table(headers, rows))
        click.echo("\nEverything reconciles." if result.ok else "\nThe ledger does not reconcile.")
    if not result.ok:
        sys.exit(1)


def vars_of(item: Any) -> dict[str, Any]:
    """A slotted dataclass as a dict."""
    return {name: getattr(item, name) for name in item.__slots__}


@audit.command()
@_DB
@click.option("--format", "fmt", type=click.Choice(["csv", "jsonl"]), required=True,
              help="CSV with a header row, or one JSON object per line.")
@_SINCE
@_UNTIL
@click.option("--output", "-o", type=click.File("w", encoding="utf-8"), default="-",
              help="Where to write (standard output by default).")
def export(db: Path, fmt: str, since: str | None, until: str | None, output: IO[str]) -> None:
    """One row per attempt, for an invoice. Rows without a response id are marked
    (response_id_missing = 1), never dropped."""
    with _ledger(db) as conn:
        rows = _audit.export_rows(conn, since=since, until=until)
        write: Callable[[dict[str, Any]], object]
        if fmt == "csv":
            writer = csv.DictWriter(output, fieldnames=_audit.EXPORT_COLUMNS, lineterminator="\n")
            writer.writeheader()
            write = writer.writerow
        else:
            def write(row: dict[str, Any]) -> None:
                output.write(json.dumps(row) + "\n")
        for row in rows:
            write(row)
        incomplete = _audit.incomplete_in_export(conn, since=since, until=until)
    if incomplete:
        click.echo(f"note: {incomplete} invocation(s) in this export are incomplete (R07): "
                   "they made more attempts than the rows exported; their totals are in "
                   "`loopengine audit spend`.", err=True)


@main.command()
@click.option("--live", is_flag=True,
              help="Talk to the real Anthropic API (needs ANTHROPIC_API_KEY) instead of the "
                   "built-in fake server.")
@click.option("--db", "db", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("loopengine-demo.db"), show_default=True,
              help="Where to write the demo's ledger.")
def demo(live: bool, db: Path) -> None:
    """Run a short teammate conversation end to end and show its ledger.

    Offline by default: a loopback fake of the Messages API serves an overload
    (retried), two tool turns, an answer the judge rejects, and its repair.
    """
    from loopengine._demo import DemoUnavailable, run_demo

    try:
        run_demo(db, live=live, echo=click.echo)
    except (LedgerError, DemoUnavailable) as error:
        raise _CannotRun(str(error)) from None
