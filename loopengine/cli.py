"""The ``loopengine`` command: ``audit`` answers an auditor's questions from a
ledger (read-only), ``demo`` runs a short conversation end to end.

Exit status: 0 on success (also when the reader of the output goes away, as
``| head`` does); 1 when ``audit reconcile`` finds something that needs a
look (a total that does not add up, an unpriced attempt, an open or abandoned
record); 2 when the command cannot run (a bad option, a missing file, a file
that is not a ledger or that this user cannot read, a value a ledger never
stores), with a one-line message on standard error.

Stored values never reach the terminal raw: table output shows control and
other non-printable characters as escapes (``\\x1b``, ``\\u202e``), the CSV
export also neutralises cells that a spreadsheet would run as formulas, and
JSON output escapes them the JSON way, keeping every value exact.

This module imports only click: each subcommand imports what it needs when
it runs (the audit's commands live in loopengine._audit_cli), so
``loopengine --help`` starts fast.
"""

from __future__ import annotations

import importlib

import click

__all__ = ["CannotRun", "main", "printable"]


def printable(text: str) -> str:
    """``text`` with every character `str.isprintable` refuses written as an escape.

    Control characters (C0, DEL, C1), format characters such as bidi
    overrides and zero-width spaces, line separators and unassigned code
    points become ``\\xNN``, ``\\uNNNN`` or ``\\UNNNNNNNN``, so a stored value
    cannot move the cursor, clear the screen, reorder a line or hide text.
    """
    if text.isprintable():
        return text
    out = []
    for ch in text:
        if ch.isprintable():
            out.append(ch)
        else:
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else
                       f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    return "".join(out)


class CannotRun(click.ClickException):
    """The command could not do its work (exit status 2, like a usage error)."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        # One line, whatever a path or a stored value holds.
        super().__init__(printable(message))


class _LazyGroup(click.Group):
    """A group whose subcommands are attributes of ``module``, imported only when
    the group is used (``loopengine --help`` does not import them)."""

    def __init__(self, *args: object, module: str, commands: tuple[str, ...],
                 **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]  # click's own keywords
        self._module = module
        self._names = commands

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(self._names)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self._names:
            return None
        command = getattr(importlib.import_module(self._module), cmd_name)
        assert isinstance(command, click.Command)
        return command


@click.group()
@click.version_option(package_name="loopengine-core")
def main() -> None:
    """loopengine: an accountable async tool loop for LLM conversations."""


@main.group(cls=_LazyGroup, module="loopengine._audit_cli",
            commands=("accounts", "export", "reconcile", "runs", "show", "spend"))
def audit() -> None:
    """Read a ledger (a SQLite file opened read-only, or a postgresql:// URL): the
    runs of a period, spend, one invocation, reconciliation, credit accounts, an
    invoice export."""
    import io
    import sys

    # A character the terminal's encoding lacks is printed as an escape, not a crash.
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="backslashreplace")


@main.command()
@click.option("--provider", "provider",
              type=click.Choice(["anthropic", "openai", "openai-responses", "gemini"]),
              default="anthropic", show_default=True,
              help="Whose API the demo speaks: Anthropic's Messages API; OpenAI's Chat "
                   "Completions (openai) or Responses API (openai-responses), which need the "
                   "openai extra (pip install 'loopengine-core[openai]'); or the Gemini API "
                   "(gemini), which needs the gemini extra (pip install "
                   "'loopengine-core[gemini]').")
@click.option("--live", is_flag=True,
              help="Talk to the real API (needs ANTHROPIC_API_KEY or ANTHROPIC_AUTH_TOKEN; "
                   "OPENAI_API_KEY with --provider openai or openai-responses; GEMINI_API_KEY "
                   "or GOOGLE_API_KEY with --provider gemini) instead of the built-in fake "
                   "server.")
@click.option("--db", "db", type=str, default="loopengine-demo.db", show_default=True,
              help="Where to write the demo's ledger: a SQLite file, or a postgresql:// URL "
                   "(needs the postgres extra: pip install 'loopengine-core[postgres]').")
def demo(provider: str, live: bool, db: str) -> None:
    """Run a short teammate conversation end to end and show its ledger.

    Offline by default: a loopback fake of the provider's API serves an overload
    (retried), two tool turns, an answer the judge rejects, and its repair.
    """
    from loopengine._audit_cli import attempts_table
    from loopengine._demo import DemoUnavailable, run_demo
    from loopengine._errors import ConfigError, LedgerError

    try:
        run_demo(db, attempts_table=attempts_table, provider=provider, live=live,
                 echo=click.echo)
    except ConfigError as error:  # the ledger refused --db (an empty path, a bad URL)
        name = "--db" if error.field in ("path", "dsn") else error.field
        raise CannotRun(printable(f"{name}: {error.message}")) from None
    except (LedgerError, DemoUnavailable) as error:
        raise CannotRun(str(error)) from None
