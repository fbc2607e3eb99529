"""The commands of ``loopengine audit`` (loopengine.cli imports this module only
when ``audit`` runs): a thin shell over loopengine.persistence._audit that
filters, prints tables with totals, and exports."""

from __future__ import annotations

import csv
import functools
import json
import os
import re
import sqlite3
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from decimal import Decimal
from typing import IO, Any, TypeVar

import click

from loopengine._errors import ConfigError, LedgerError
from loopengine._validate import MAX_INTEGER
from loopengine.cli import CannotRun, printable
from loopengine.persistence import _audit
from loopengine.persistence._audit import moment as parse_moment
from loopengine.persistence._audit_open import AuditConnection
from loopengine.persistence._audit_postgres import display_name

__all__ = ["accounts", "attempts_table", "export", "format_duration", "parse_duration",
           "parse_moment", "reconcile", "runs", "show", "spend", "vars_of"]

_F = TypeVar("_F", bound=Callable[..., Any])


def _blob(value: bytes) -> str:
    # The SQL literal of a BLOB: loopengine never stores one, a hand-made file may.
    return f"X'{value.hex().upper()}'"


def _cell(value: Any) -> str:
    """A stored value as a table cell."""
    if value is None:
        return ""
    if isinstance(value, bytes):
        return _blob(value)
    return printable(str(value))


_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def _csv_cell(value: Any) -> Any:
    """A stored value as a CSV cell: formulas neutralised, then control characters escaped."""
    if not isinstance(value, str):
        return value
    if value.startswith(_FORMULA_STARTS):
        # OWASP's advice: a leading quote makes every spreadsheet read the cell as text.
        value = "'" + value
    return printable(value)


def _json_default(value: Any) -> Any:
    if isinstance(value, bytes):
        return _blob(value)
    return str(value)


def _ledger_options(command: _F) -> _F:
    """``--db`` and ``--schema``: which ledger a command reads."""
    command = click.option(
        "--schema", "schema", metavar="NAME",
        help="PostgreSQL: the schema the ledger is in (default: the server's search_path)."
    )(command)
    return click.option(
        "--db", "db", required=True, type=str,
        help="The ledger: a SQLite file (read, never written or created) or a "
             "postgresql:// URL; either is read in one snapshot.")(command)


_JSON = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")


_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_DURATION = re.compile(r"(?:[0-9]+(?:\.[0-9]+)?[smhdw])+", re.ASCII)
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)([smhdw])", re.ASCII)


def parse_duration(text: str) -> timedelta:
    """A duration such as ``90s``, ``30m``, ``2h``, ``1d``, ``1w`` or ``1h30m``.

    Raises:
        ValueError: ``text`` is not one, or is longer than `datetime.timedelta` holds.
    """
    if not _DURATION.fullmatch(text):
        raise ValueError(f"{text!r} is not a duration such as 90s, 30m, 2h, 1d, 1w or 1h30m")
    seconds = sum(Decimal(number) * _UNIT_SECONDS[unit]
                  for number, unit in _DURATION_PART.findall(text))
    if seconds > Decimal(timedelta.max.days) * 86400:
        raise ValueError(f"{text!r} is too long a duration")
    return timedelta(seconds=float(seconds))


def format_duration(span: timedelta) -> str:
    """A duration as `parse_duration` reads it (``1d2h30m``, ``45s``, ``0s``)."""
    seconds = span.total_seconds()
    parts = []
    for unit in ("d", "h", "m"):
        count, seconds = divmod(seconds, _UNIT_SECONDS[unit])
        if count:
            parts.append(f"{int(count)}{unit}")
    if seconds or not parts:
        parts.append(f"{seconds:g}s")
    return "".join(parts)




def _moment(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return parse_moment(value)
    except ValueError as error:
        raise click.BadParameter(printable(str(error))) from None


def _duration(ctx: click.Context, param: click.Parameter,
              value: str | None) -> timedelta | None:
    if value is None:
        return None
    try:
        return parse_duration(value)
    except ValueError as error:
        raise click.BadParameter(printable(str(error))) from None


def _filters(what: str) -> Callable[[_F], _F]:
    """``--since``, ``--until``, ``--tenant``, ``--feature`` and ``--outcome``
    (the keys of `_audit.Where`), the period applying to ``what``'s start."""

    def add(command: _F) -> _F:
        options = [
            click.option("--since", callback=_moment, metavar="DATE",
                         help=f"{what} started from this date or ISO-8601 time (inclusive, "
                              "UTC)."),
            click.option("--until", callback=_moment, metavar="DATE",
                         help=f"{what} started before this date or ISO-8601 time "
                              "(exclusive, UTC)."),
            click.option("--tenant", metavar="TENANT", help="Only this tenant's invocations."),
            click.option("--feature", metavar="FEATURE",
                         help="Only this feature's invocations."),
            click.option("--outcome", type=click.Choice(_audit.OUTCOMES),
                         help="Only invocations that ended so (running: not ended)."),
        ]
        for option in reversed(options):
            command = option(command)
        return command

    return add


def _audit_command(command: _F) -> _F:
    """Turn whatever stops an audit command into exit status 2 and a one-line message,
    and a reader that went away (``| head``) into a quiet exit 0."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        db = display_name(kwargs.get("db"))
        try:
            result = command(*args, **kwargs)
            # Flushed here, not at exit, so a closed pipe is caught below.
            sys.stdout.flush()
            return result
        except click.FileError as error:  # the output file, opened at its first write
            raise CannotRun(error.format_message()) from None
        except click.ClickException:
            raise
        except ConfigError as error:  # an argument the query refused (--until before --since)
            name = "INVOCATION_ID" if error.field == "invocation_id" \
                else f"--{error.field.replace('_', '-')}"
            raise CannotRun(printable(f"{name}: {error.message}")) from None
        except LedgerError as error:
            raise CannotRun(str(error)) from None
        except sqlite3.Error as error:
            raise CannotRun(f"{db}: {error}") from None
        except BrokenPipeError:
            # The reader took what it wanted (`| head`): as for any Unix filter,
            # that is no error. Python must not complain when it flushes at exit.
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
                os.close(devnull)
            except (OSError, ValueError):  # not a file descriptor (a test runner's stream)
                pass
            sys.exit(0)
        except OSError as error:
            raise CannotRun(f"cannot write the output: {error}") from None
        except Exception as error:  # the promise is no traceback, whatever the file holds
            raise CannotRun(f"{db}: cannot be audited ({type(error).__name__}: {error}); "
                            "this is a bug in loopengine, please report it") from None

    return run  # type: ignore[return-value]  # functools.wraps keeps the signature


@contextmanager
def _ledger(path: str, schema: str | None) -> Iterator[AuditConnection]:
    conn = _audit.open_ledger(path, schema=schema)
    try:
        yield conn
    except LedgerError as error:  # a row that holds what a ledger never stores
        named = str(error)
        if not named.startswith(display_name(path)):
            named = f"{display_name(path)}: {named}"
        raise LedgerError(named) from None
    finally:
        conn.close()


def _usd(nanousd: Any) -> str:
    if isinstance(nanousd, int):
        return _audit.usd_text(nanousd)
    return _cell(nanousd)


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]],
           total: Sequence[Any] | None = None) -> str:
    """A text table; ``total`` is a last row under a rule, when there are rows."""
    cells = [[_cell(v) for v in row] for row in rows]
    totals = [[_cell(v) for v in total]] if total is not None and rows else []
    widths = [max([len(h), *(len(r[i]) for r in [*cells, *totals])])
              for i, h in enumerate(headers)]

    def line(row: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *map(line, cells),
                      *(x for t in totals for x in (rule, line(t)))])


def _print_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, default=_json_default))


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def _period(since: str | None, until: str | None) -> str:
    return f" from {since or 'the start'} until {until or 'now'}"


def _matching(where: Mapping[str, Any]) -> str:
    """The period and the filters given, as the "nothing found" lines say them."""
    given = [f"{key} {where[key]}" for key in ("tenant", "feature", "outcome")
             if where.get(key) is not None]
    return _period(where["since"], where["until"]) + (
        f" with {', '.join(given)}" if given else "")


@click.command()
@_ledger_options
@_filters("Invocations")
@click.option("--limit", type=click.IntRange(min=1, max=MAX_INTEGER - 1), default=50,
              show_default=True,
              help="Show at most this many, the newest first.")
@click.option("--all", "every", is_flag=True, help="Show every match (no --limit).")
@_JSON
@_audit_command
def runs(db: str, schema: str | None, limit: int, every: bool, as_json: bool,
         **where: Any) -> None:
    """The invocations started in a period, newest first: their ids (what `show`
    takes), start, tenant, feature, operation, outcome, attempts and cost."""
    with _ledger(db, schema) as conn:
        # One more than shown: whether there are more is known, not guessed.
        rows = _audit.runs(conn, limit=None if every else limit + 1, **where)
    more = not every and len(rows) > limit
    rows = rows if every else rows[:limit]
    if as_json:
        _print_json([{**vars_of(r), "cost_usd": _audit.usd_text(r.cost_nanousd)} for r in rows])
        return
    if not rows:
        click.echo(f"No invocations{_matching(where)}.")
        return
    click.echo(_table(
        ["id", "started_at", "tenant", "feature", "operation", "outcome", "attempts",
         "charged USD", "credits", "not in USD"],
        [[r.id, r.started_at, r.tenant, r.feature, r.operation, r.outcome, r.attempt_count,
          _usd(r.cost_nanousd), r.credits, _not_in_usd(r)] for r in rows],
        total=[f"total: {_plural(len(rows), 'invocation')}", "", "", "", "", "",
               sum(r.attempt_count for r in rows), _usd(sum(r.cost_nanousd for r in rows)),
               sum(r.credits for r in rows), ""]))
    if any(_not_in_usd(r) for r in rows):
        click.echo("\n`not in USD` counts attempts whose cost the USD column does not hold: "
                   "unpriced (tokens served, no price), usage unknown (answered, no usage "
                   "reported), floor (a stream cut before its end: the provider may bill "
                   "more). `loopengine audit reconcile` lists them.")
    if more:
        click.echo(f"\nThe newest {limit} shown; --limit N or --all shows more.")


def _not_in_usd(row: _audit.RunRow) -> str:
    """What a run's charged USD does not hold, as `runs` shows it (empty when nothing)."""
    return ", ".join(f"{count} {what}" for count, what in (
        (row.unpriced_attempts, "unpriced"), (row.usage_unknown, "usage unknown"),
        (row.usage_floor, "floor")) if count)


@click.command()
@_ledger_options
@click.option("--by", type=click.Choice(_audit.GROUPINGS), default="tenant", show_default=True,
              help="What to group the spend by.")
@click.option("--roll-up", "roll_up", is_flag=True,
              help="Count each tree of delegated runs (sub-agents) as its root: their "
                   "totals are added to the root's, grouped and filtered by the root's.")
@_filters("Invocations")
@_JSON
@_audit_command
def spend(db: str, schema: str | None, by: _audit.Grouping, roll_up: bool, as_json: bool,
          **where: Any) -> None:
    """Spend per tenant, feature, model, operation, user_id or correlation_id, over
    invocations started in a period, with their total.

    Charged cost counts successful attempts only; provider cost counts every
    attempt that reported usage (what the provider may bill). Unpriced
    attempts (tokens served, no price known) are counted apart: their cost is
    in neither.
    """
    with _ledger(db, schema) as conn:
        rows = _audit.spend(conn, by=by, roll_up=roll_up, **where)
    if as_json:
        _print_json([{by: r.key, "invocations": r.invocations, "attempts": r.attempts,
                      "input_tokens": r.input_tokens, "output_tokens": r.output_tokens,
                      "cache_read_tokens": r.cache_read_tokens,
                      "cache_write_tokens": r.cache_write_tokens,
                      "cost_nanousd": r.cost_nanousd, "cost_usd": _audit.usd_text(r.cost_nanousd),
                      "provider_cost_nanousd": r.provider_cost_nanousd,
                      "provider_cost_usd": _audit.usd_text(r.provider_cost_nanousd),
                      "credits": r.credits,
                      "unpriced_attempts": r.unpriced_attempts,
                      "unpriced_tokens": r.unpriced_tokens,
                      "web_search_requests": r.web_search_requests,
                      "web_fetch_requests": r.web_fetch_requests,
                      "reasoning_tokens": r.reasoning_tokens, "iterations": r.iterations,
                      "fee_nanousd": r.fee_nanousd, "usage_unknown": r.usage_unknown,
                      "usage_floor": r.usage_floor}
                     for r in rows])
        return
    period = _period(where["since"], where["until"])
    if not rows:
        click.echo(f"No invocations{_matching(where)}.")
        return
    rolled = ", delegated runs rolled up into their roots" if roll_up else ""
    click.echo(f"Spend by {by}{period}{rolled}:")
    sums = [sum(getattr(r, name) for r in rows) for name in _SPEND_FIGURES]
    click.echo(_table(
        [by, "invocations", "attempts", "input", "output", "cache read", "cache write",
         "charged USD", "provider USD", "credits", "unpriced", "unpriced tokens",
         "web searches", "web fetches", "reasoning", "iterations", "fees USD",
         "usage unknown", "usage floor"],
        [[r.key if r.key is not None else "(none)",
          *_spend_cells([getattr(r, name) for name in _SPEND_FIGURES])] for r in rows],
        total=["total", *_spend_cells(sums)]))
    total = dict(zip(_SPEND_FIGURES, sums, strict=True))
    unpriced, tokens = total["unpriced_attempts"], total["unpriced_tokens"]
    if unpriced:
        click.echo(f"\n{_plural(unpriced, 'attempt')} ({_plural(tokens, 'token')}) had no "
                   "price: their cost is in no USD column above. `loopengine audit "
                   "reconcile` lists them.")
    if total["usage_unknown"]:
        click.echo(f"\n{_plural(total['usage_unknown'], 'attempt')} answered by the server "
                   "(a response id, a reply or a success status) reported no usage: what "
                   "they served is in no column above. `loopengine audit reconcile` lists "
                   "them.")
    if total["usage_floor"]:
        click.echo(f"\n{_plural(total['usage_floor'], 'attempt')} served a stream cut before "
                   "its end: their usage is a floor (what had arrived), the provider may "
                   "bill more. `loopengine audit reconcile` lists them.")


_SPEND_FIGURES = ("invocations", "attempts", "input_tokens", "output_tokens",
                  "cache_read_tokens", "cache_write_tokens", "cost_nanousd",
                  "provider_cost_nanousd", "credits", "unpriced_attempts", "unpriced_tokens",
                  "web_search_requests", "web_fetch_requests", "reasoning_tokens",
                  "iterations", "fee_nanousd", "usage_unknown", "usage_floor")


def _spend_cells(figures: list[int]) -> list[Any]:
    """`_SPEND_FIGURES` as table cells: the costs and the fees in USD."""
    return [_usd(v) if name.endswith("nanousd") else v
            for name, v in zip(_SPEND_FIGURES, figures, strict=True)]


_ATTEMPT_TABLE = ("ordinal", "turn", "attempt", "phase", "outcome", "fault", "http_status",
                  "latency_ms", "input_tokens", "output_tokens", "cache_read_tokens",
                  "cache_write_tokens", "cache_write_1h_tokens", "web_search_requests",
                  "web_fetch_requests", "reasoning_tokens", "iterations", "cost_usd",
                  "fee_usd", "charged", "price_ref", "response_id")


def attempts_table(attempts: Sequence[dict[str, Any]]) -> str:
    """The attempt rows as the text table ``show`` and ``demo`` print.

    Every column an attempt's cost follows from is there: its tokens (cache
    reads and writes included) and the price it was priced with. An attempt
    that served tokens without a price shows ``unpriced`` as its cost.
    """
    rows = []
    for a in attempts:
        outcome = _cell(a["outcome"]) + (f"/{_cell(a['aborted_reason'])}"
                                         if a.get("aborted_reason") else "")
        cost = "unpriced" if _audit.is_unpriced(a) else _usd(a["cost_nanousd"])
        rows.append([a["ordinal"], a["turn"], a["attempt"], a["phase"], outcome, a["fault"],
                     a["http_status"], a["latency_ms"], a["input_tokens"], a["output_tokens"],
                     a["cache_read_tokens"], a["cache_write_tokens"],
                     a["cache_write_1h_tokens"], a.get("web_search_requests"),
                     a.get("web_fetch_requests"), a.get("reasoning_tokens"),
                     a.get("iterations"), cost, _usd(a.get("fee_nanousd")),
                     "yes" if a["charged"] else "no",
                     a["price_ref"], a["response_id"] or "(none)"])
    return _table(_ATTEMPT_TABLE, rows)


@click.command()
@_ledger_options
@click.argument("invocation_id")
@_JSON
@_audit_command
def show(db: str, schema: str | None, invocation_id: str, as_json: bool) -> None:
    """One invocation (by id, or a unique start of it) and its attempts, as stored."""
    with _ledger(db, schema) as conn:
        try:
            invocation, attempts = _audit.show(conn, invocation_id)
        except LookupError as error:
            # Its message as written (str() of a LookupError is that; stripping
            # quotes off it would cut the id's own).
            raise CannotRun(str(error.args[0])) from None
        except UnicodeEncodeError:
            raise CannotRun(f"{invocation_id!r} is not an invocation id (it is not "
                             "valid text)") from None
        children = _audit.children(conn, invocation["id"])
        calls = _audit.tool_calls(conn, invocation["id"])
        stored = _audit.run_state(conn, invocation["id"])
        segments = _audit.segments(conn, invocation["id"])
    if as_json:
        _print_json({"invocation": invocation, "attempts": attempts, "children": children,
                     "segments": segments, "tool_calls": calls, "run_state": stored})
        return
    width = max(len(k) for k in invocation)
    for key, value in invocation.items():
        shown = f"{_cell(value)} (USD {_usd(value)})" if key in (
            "cost_nanousd", "provider_cost_nanousd", "fee_nanousd") else _cell(value)
        click.echo(f"{key.ljust(width)}  {shown}".rstrip())
    click.echo("")
    if invocation["incomplete"]:
        click.echo(f"{_cell(invocation['attempt_count'])} attempts, "
                   f"{_cell(invocation['attempts_retained'])} rows retained: the record is "
                   "incomplete (later attempts are counted in the totals, without rows).")
    unpriced = [a for a in attempts if a["unpriced"]]
    if unpriced:
        click.echo(f"{_plural(len(unpriced), 'attempt')} served tokens without a price "
                   f"(ordinal {', '.join(_cell(a['ordinal']) for a in unpriced)}): the costs "
                   "above do not include them.")
    click.echo(attempts_table(attempts) if attempts else "No attempt rows.")
    if stored is not None:
        click.echo("\nRun state: " + (
            f"paused since {_cell(stored['paused_at'])}" if stored["paused_at"] is not None
            else f"running, leased by {_cell(stored['lease_owner'])} until "
                 f"{_cell(stored['lease_expires_at'])}") + f" (version {_cell(stored['version'])})")
    if segments:
        click.echo(f"\nRunning segments: {len(segments)}")
        click.echo(_table(["segment", "started_at", "ended_at", "ended"],
                          [[g["ordinal"], g["started_at"], g["ended_at"] or "",
                            _segment_end(g, g is segments[-1], invocation["outcome"])]
                           for g in segments]))
    if calls:
        click.echo(f"\nTool calls: {len(calls)}")
        click.echo(_table(["call", "turn", "tool", "status", "started_at", "ended_at"],
                          [[c["call_id"], c["turn"], c["tool"], c["status"],
                            c["started_at"] or "", c["ended_at"] or ""] for c in calls]))
    if children:
        click.echo(f"\nDelegated runs (sub-agents): {len(children)}")
        click.echo(_table(
            ["id", "operation", "outcome", "turns", "attempts", "charged USD", "credits",
             "with theirs"],
            [[c["id"], c["operation"], c["outcome"], c["turns"], c["attempt_count"],
              _usd(c["cost_nanousd"]), c["credits"], c["tree_credits"]] for c in children],
            total=["total", "", "", "", sum(c["attempt_count"] for c in children),
                   _usd(sum(c["cost_nanousd"] for c in children)),
                   sum(c["credits"] for c in children),
                   sum(c["tree_credits"] for c in children)]))


def _segment_end(segment: dict[str, Any], last: bool, outcome: str) -> str:
    """How a segment ended, as `show` prints it: its outcome, ``running`` for the
    open last one of a running invocation, or that its process died."""
    if segment["outcome"] is not None:
        return str(segment["outcome"])
    if last and outcome == "running":
        return "running (or its process died)"
    return "its process died"


@click.command()
@_ledger_options
@click.option("--older-than", "older_than", callback=_duration, metavar="DURATION",
              help="A run still open after this long (90s, 30m, 2h, 1d, 1w, 1h30m) is reported "
                   "as abandoned; younger open runs are in flight and do not fail the check.")
@_JSON
@_audit_command
def reconcile(db: str, schema: str | None, older_than: timedelta | None, as_json: bool) -> None:
    """Check attempt rows against invocation totals; list unsettled attempts, incomplete
    records, unpriced attempts, attempts the server answered whose usage is unknown,
    invocations still running or abandoned, tool calls in doubt and stored runs whose
    lease or pause expired, and exit 1 when any is found. Attempts whose usage is a
    floor (a stream cut before its end) and running segments whose process died
    are listed too, without failing the check."""
    with _ledger(db, schema) as conn:
        result = _audit.reconcile(conn, older_than=older_than)
    if as_json:
        _print_json({"ok": result.ok, "invocations": result.invocations,
                     "attempts": result.attempts,
                     "older_than_seconds": (None if older_than is None
                                            else older_than.total_seconds()),
                     "mismatches": [vars_of(m) for m in result.mismatches],
                     "unsettled": result.unsettled, "incomplete": result.incomplete,
                     "running": result.running, "orphans": result.orphans,
                     "unpriced": result.unpriced, "abandoned": result.abandoned,
                     "abandoned_attempts": result.abandoned_attempts,
                     "accounts": [vars_of(m) for m in result.accounts],
                     "usage_unknown": result.usage_unknown, "in_doubt": result.in_doubt,
                     "expired_leases": result.expired_leases,
                     "expired_pauses": result.expired_pauses,
                     "dead_segments": result.dead_segments,
                     "usage_floor": result.usage_floor})
    else:
        _print_reconciliation(result)
    if not result.ok:
        sys.exit(1)


def _print_reconciliation(result: _audit.Reconciliation) -> None:
    age = None if result.older_than is None else format_duration(result.older_than)
    click.echo(f"Checked {_plural(result.invocations, 'invocation')} and "
               f"{_plural(result.attempts, 'attempt row')}.")
    unsettled_title, running_title = (
        ("Attempts still dispatched (in flight, or their process died)",
         "Invocations still running (or their process died)") if age is None else
        (f"Attempts in flight (dispatched less than {age} ago)",
         f"Invocations in flight (started less than {age} ago)"))
    attempt_headers = ["invocation", "ordinal", "turn", "attempt", "phase", "started_at"]
    run_headers = ["invocation", "operation", "tenant", "started_at"]
    sections: list[tuple[str, list[list[Any]], list[str]]] = [
        ("Totals that do not equal their attempt rows",
         [[m.invocation_id, m.column, m.recorded, m.computed] for m in result.mismatches],
         ["invocation", "column", "recorded", "rows add up to"]),
        (f"Attempts abandoned (dispatched more than {age} ago and never settled: their "
         "usage is unknown, the provider may have billed them)",
         [[u["invocation_id"], u["ordinal"], u["turn"], u["attempt"], u["phase"],
           u["started_at"]] for u in result.abandoned_attempts], attempt_headers),
        (unsettled_title,
         [[u["invocation_id"], u["ordinal"], u["turn"], u["attempt"], u["phase"],
           u["started_at"]] for u in result.unsettled], attempt_headers),
        ("Unpriced attempts (tokens served, no price: their cost is in no total)",
         [[u["invocation_id"], u["ordinal"], u["served_by"], u["outcome"], u["started_at"],
           u["input_tokens"], u["output_tokens"], u["cache_read_tokens"],
           u["cache_write_tokens"]] for u in result.unpriced],
         ["invocation", "ordinal", "served_by", "outcome", "started_at", "input", "output",
          "cache read", "cache write"]),
        ("Usage unknown (answered by the server, with a response id, a reply or a success "
         "status, but no usage: the provider may bill what they served)",
         [[u["invocation_id"], u["ordinal"], u["served_by"], u["outcome"], u["started_at"],
           u["response_id"]] for u in result.usage_unknown],
         ["invocation", "ordinal", "served_by", "outcome", "started_at", "response_id"]),
        ("Incomplete records (more attempts than rows kept, R07)",
         [[i["id"], i["operation"], i["attempt_count"], i["attempts_retained"]]
          for i in result.incomplete],
         ["invocation", "operation", "attempts", "rows"]),
        (f"Invocations abandoned (started more than {age} ago and never ended: their "
         "process died)",
         [[i["id"], i["operation"], i["tenant"], i["started_at"], i["dispatched"]]
          for i in result.abandoned], [*run_headers, "unsettled attempts"]),
        (running_title,
         [[i["id"], i["operation"], i["tenant"], i["started_at"]] for i in result.running],
         run_headers),
        ("Attempt rows without an invocation row",
         [[o["invocation_id"], o["ordinal"]] for o in result.orphans],
         ["invocation", "ordinal"]),
        ("Tool calls in doubt (started, never ended, their run not held by a live "
         "process: they may have run; a resume asks for a decision)",
         [[c["invocation_id"], c["call_id"], c["turn"], c["tool"], c["status"],
           c["started_at"] or ""] for c in result.in_doubt],
         ["invocation", "call", "turn", "tool", "status", "started_at"]),
        ("Runs whose lease expired (their process died: resume them to recover)",
         [[r["invocation_id"], r["lease_owner"] or "", r["lease_expires_at"] or ""]
          for r in result.expired_leases], ["invocation", "lease owner", "expired at"]),
        ("Paused runs past their pause_timeout",
         [[r["invocation_id"], r["paused_at"], r["pause_timeout"]]
          for r in result.expired_pauses], ["invocation", "paused_at", "pause_timeout (s)"]),
        ("Credit accounts that do not equal their journal, or runs charged other than "
         "their credits",
         [[m.account, m.column, m.invocation_id or "", m.recorded, m.computed]
          for m in result.accounts],
         ["account", "column", "invocation", "recorded", "journal or run says"]),
    ]
    sections.append((
        "Usage floors (a stream cut before its end: its usage and cost are what had "
        "arrived, the provider may bill more; for a look, not a failure)",
        [[u["invocation_id"], u["ordinal"], u["served_by"], u["outcome"],
          u["aborted_reason"] or "", u["started_at"], u["input_tokens"], u["output_tokens"],
          _usd(u["cost_nanousd"]), u["response_id"] or "(none)"] for u in result.usage_floor],
        ["invocation", "ordinal", "served_by", "outcome", "reason", "started_at", "input",
         "output", "USD", "response_id"]))
    sections.append((
        "Running segments whose process died (the run went on, or is no longer running; "
        "for a look, not a failure)",
        [[g["invocation_id"], g["ordinal"], g["started_at"]] for g in result.dead_segments],
        ["invocation", "segment", "started_at"]))
    for title, rows, headers in sections:
        if rows:
            click.echo(f"\n{title}: {len(rows)}")
            click.echo(_table(headers, rows))
    floors = len(result.usage_floor)
    # Listed for a look, never a failure: said after the verdict, either way.
    floor_note = (f" Listed without failing: {_plural(floors, 'attempt')} whose usage is a "
                  "floor." if floors else "")
    if result.ok:
        flying = len(result.running) + len(result.unsettled)
        click.echo("\nEverything reconciles." + (
            f" In flight, younger than {age}: {_plural(len(result.running), 'invocation')}, "
            f"{_plural(len(result.unsettled), 'attempt')}." if flying else "") + floor_note)
        return
    problems = [(len(result.mismatches), "total that does not add up",
                 "totals that do not add up"),
                (len(result.unpriced), "unpriced attempt", "unpriced attempts"),
                (len(result.usage_unknown), "attempt with usage unknown",
                 "attempts with usage unknown"),
                (len(result.incomplete), "incomplete record", "incomplete records"),
                (len(result.abandoned), "abandoned invocation", "abandoned invocations"),
                (len(result.abandoned_attempts), "abandoned attempt", "abandoned attempts"),
                (len(result.orphans), "attempt row without its invocation",
                 "attempt rows without their invocation"),
                (len(result.accounts), "account figure that does not add up",
                 "account figures that do not add up"),
                (len(result.in_doubt), "tool call in doubt", "tool calls in doubt"),
                (len(result.expired_leases), "run whose lease expired",
                 "runs whose lease expired"),
                (len(result.expired_pauses), "paused run past its pause_timeout",
                 "paused runs past their pause_timeout")]
    if result.older_than is None:
        problems += [(len(result.running), "invocation still running",
                      "invocations still running"),
                     (len(result.unsettled), "attempt still dispatched",
                      "attempts still dispatched")]
    named = [f"{n} {one if n == 1 else many}" for n, one, many in problems if n]
    click.echo(f"\nThe ledger does not reconcile: {', '.join(named)}.{floor_note}")


@click.command()
@_ledger_options
@_JSON
@_audit_command
def accounts(db: str, schema: str | None, as_json: bool) -> None:
    """Each credit account's granted, spent, reserved and available credits."""
    with _ledger(db, schema) as conn:
        rows = _audit.accounts(conn)
    if as_json:
        _print_json([vars_of(r) for r in rows])
        return
    if not rows:
        click.echo("No credit accounts.")
        return
    click.echo(_table(["account", "granted", "spent", "reserved", "available", "updated_at"],
                      [[r.account, r.granted, r.spent, r.reserved, r.available, r.updated_at]
                       for r in rows],
                      total=["total", *(sum(getattr(r, k) for r in rows)
                                        for k in ("granted", "spent", "reserved", "available")),
                             ""]))


def vars_of(item: Any) -> dict[str, Any]:
    """A slotted dataclass as a dict."""
    return {name: getattr(item, name) for name in item.__slots__}


@click.command()
@_ledger_options
@click.option("--format", "fmt", type=click.Choice(["csv", "jsonl"]), default="csv",
              show_default=True,
              help="CSV with a header row (for spreadsheets: formulas neutralised, control "
                   "characters escaped), or one JSON object per line (every value exact).")
@_filters("Attempts")
@click.option("--output", "-o", type=click.File("w", encoding="utf-8", lazy=True),
              default="-", help="Where to write (standard output by default).")
@_audit_command
def export(db: str, schema: str | None, fmt: str, output: IO[str], **where: Any) -> None:
    """One row per attempt, for an invoice. Rows without a response id are marked
    (response_id_missing = 1), never dropped; unpriced attempts are marked
    (unpriced = 1). The period is the attempts' start; the other filters are
    their invocations'."""
    with _ledger(db, schema) as conn:
        rows = _audit.export_rows(conn, **where)
        write: Callable[[dict[str, Any]], object]
        if fmt == "csv":
            writer = csv.DictWriter(output, fieldnames=_audit.EXPORT_COLUMNS, lineterminator="\n")
            writer.writeheader()

            def write(row: dict[str, Any]) -> None:
                writer.writerow({k: (v if k == "cost_usd" else _csv_cell(v))
                                 for k, v in row.items()})
        else:
            def write(row: dict[str, Any]) -> None:
                output.write(json.dumps(row) + "\n")
        unpriced = 0
        for row in rows:
            write(row)
            unpriced += row["unpriced"]
        incomplete = _audit.incomplete_in_export(conn, **where)
    if incomplete:
        click.echo(f"note: {_plural(incomplete, 'invocation')} in this export "
                   f"{'is' if incomplete == 1 else 'are'} incomplete (R07): they made more "
                   "attempts than the rows exported; their totals are in "
                   "`loopengine audit spend`.", err=True)
    if unpriced:
        click.echo(f"note: {_plural(unpriced, 'attempt')} in this export served tokens "
                   "without a price (unpriced = 1): their cost_usd is empty, not zero.",
                   err=True)
