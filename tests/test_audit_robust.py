"""`loopengine audit` against what an auditor really meets: bad arguments and bad files
(exit 2 and one line, never a traceback), ledgers this user cannot write, unpriced
attempts, abandoned runs, stored values that try to attack the terminal or the
spreadsheet, and the ledger files' own permissions."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import pwd
import random
import shutil
import sqlite3
import stat
import tempfile
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import pytest
from click.testing import CliRunner, Result
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import loopengine as le
from loopengine import _audit_cli
from loopengine.cli import main, printable
from loopengine.persistence import AttemptDispatch, InvocationStart, SQLiteLedger, _audit
from loopengine.persistence._schema import SCHEMA_TABLE
from loopengine.providers import Reply, ScriptedProvider
from loopengine.testing import FakeClock

from .conftest import MODEL, PRICES, operation

UNKNOWN = "claude-unpriced-0"
"""A model no price source knows."""
CACHED = "claude-cached-1"
CACHE_PRICES = le.PriceBook(
    [*PRICES.prices,
     le.ModelPrice(provider="anthropic", model=CACHED, input_per_mtok=Decimal(3),
                   output_per_mtok=Decimal(15), cache_read_per_mtok=Decimal("0.3"),
                   cache_write_per_mtok=Decimal("3.75"), cache_write_1h_per_mtok=Decimal(6))],
    credits_per_usd=Decimal(1_000_000),
)
EXIT_CODES = {0, 1, 2}
"""The documented exit statuses: ok, does not reconcile, cannot run."""


# -- helpers ---------------------------------------------------------------------------------


def cli(*args: str | Path) -> Result:
    """The real command, in-process; an exception escaping it fails the test."""
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def record(path: Path, *runs: tuple[str, le.Operation, list[Any], le.Attribution],
           prices: le.PriceBook | None = None) -> list[le.RunResult]:
    """Record each run (its start day, operation, script, attribution) in ``path``."""

    async def go() -> list[le.RunResult]:
        results = []
        with SQLiteLedger(path) as ledger:
            for day, op, script, attribution in runs:
                clock = FakeClock(wall_start=datetime.fromisoformat(day).replace(tzinfo=UTC))
                engine = le.Engine(ScriptedProvider(script, clock=clock), ledger=ledger,
                                   prices=prices or PRICES, clock=clock, rng=random.Random(3))
                results.append(await engine.run(op, "go", attribution=attribution))
        return results

    return anyio.run(go)


def open_runs(path: Path, starts: dict[str, datetime]) -> None:
    """Invocations that started (and sent one attempt) at the given times, and never
    ended: what a process killed mid-request leaves behind."""

    async def go() -> None:
        with SQLiteLedger(path) as ledger:
            for run_id, at in starts.items():
                await ledger.start_invocation(InvocationStart(
                    id=run_id, operation="test.op", operation_version="1", provider="anthropic",
                    model=MODEL, tenant="acme", user_id=None, feature=None, correlation_id=None,
                    started_at=at))
                await ledger.dispatch_attempt(AttemptDispatch(
                    invocation_id=run_id, ordinal=1, turn=1, attempt=1, phase="turn",
                    served_by=f"anthropic:{MODEL}", started_at=at, max_tokens=100,
                    timeout_ms=1000, wait_ms=0))

    anyio.run(go)


def edit(path: Path, *statements: str, params: tuple[Any, ...] = ()) -> None:
    """Change a ledger file behind loopengine's back."""
    conn = sqlite3.connect(path)
    try:
        conn.execute("PRAGMA ignore_check_constraints = ON")
        for statement in statements:
            conn.execute(statement, params if "?" in statement else ())
        conn.commit()
    finally:
        conn.close()


def op(model: str) -> le.Operation:
    return le.Operation(name="test.op", provider="anthropic", model=model, max_output_tokens=256)


def table(output: str, first_header: str, *, total: bool = False) -> list[dict[str, str]]:
    """The rows of the text table whose header starts with ``first_header``, by column
    (with ``total``: its totals row, alone)."""
    lines = output.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(first_header + " "))
    header, dashes = lines[at], lines[at + 1]
    spans, start = [], 0
    for part in dashes.split("  "):
        spans.append((start, start + len(part)))
        start += len(part) + 2
    names = [header[a:b].strip() for a, b in spans]
    rows = []
    for line in lines[at + 2:]:
        if not line.strip():
            break
        if line == dashes:  # the rule above the totals row
            rows = [] if total else rows
            if not total:
                break
            continue
        rows.append({n: line[a:b].strip() for n, (a, b) in zip(names, spans, strict=True)})
    return rows


def assert_one_line_error(result: Result) -> None:
    """Exit 2, no traceback, and the error is one printable line."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.stderr
    assert errors[0].isprintable(), errors[0]
    assert "please report" not in result.stderr, result.stderr


@pytest.fixture(scope="module")
def healthy(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A closed ledger of two runs, one of them unpriced."""
    path = tmp_path_factory.mktemp("healthy") / "ledger.db"
    priced, unpriced = record(
        path,
        ("2026-01-10", operation(), [Reply.text("hi")], le.Attribution(tenant="acme")),
        ("2026-01-11", op(UNKNOWN), [Reply.text("hi")], le.Attribution(tenant="globex")))
    return {"path": path, "bytes": path.read_bytes(), "priced": priced, "unpriced": unpriced}


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A fresh directory of this test's own (removed afterwards)."""
    where = Path(tempfile.mkdtemp(prefix="loopengine-audit-"))
    try:
        yield where
    finally:
        _make_removable(where)
        shutil.rmtree(where, ignore_errors=True)


def _make_removable(where: Path) -> None:
    for root, dirs, _ in os.walk(where):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o755)
    os.chmod(where, 0o755)


def copy_of(healthy: dict[str, Any], where: Path, name: str = "ledger.db") -> Path:
    path = where / name
    path.write_bytes(healthy["bytes"])
    return path


# -- 1. the CLI never crashes ------------------------------------------------------------------


@pytest.mark.parametrize("option", [
    ("--since", "9999-12-31T23:59:59-23:59"),
    ("--until", "0001-01-01T00:00:00+14:00"),
])
@pytest.mark.parametrize("command", [["spend"], ["export", "--format", "csv"]])
def test_times_out_of_range_in_utc_exit_2_with_one_line(
    healthy: dict[str, Any], option: tuple[str, str], command: list[str]
) -> None:
    """A time that leaves the years 1..9999 once converted to UTC is a usage error."""
    result = cli("audit", command[0], "--db", healthy["path"], *command[1:], *option)
    assert_one_line_error(result)
    assert "outside the years 1 to 9999" in result.stderr


@pytest.mark.parametrize("command", [["spend"], ["show", "x"], ["reconcile"],
                                     ["export", "--format", "jsonl"]])
def test_a_schema_version_stored_as_text_exits_2_for_every_subcommand(
    healthy: dict[str, Any], scratch: Path, command: list[str]
) -> None:
    """A hand-made schema table whose version is text is not a ledger: exit 2."""
    path = copy_of(healthy, scratch)
    edit(path, f"DROP TABLE {SCHEMA_TABLE}",
         f"CREATE TABLE {SCHEMA_TABLE} (version, name, applied_at)",
         f"INSERT INTO {SCHEMA_TABLE} VALUES ('two', 'x', 'y')")
    result = cli("audit", command[0], "--db", path, *command[1:])
    assert_one_line_error(result)
    assert "holds the version text ('two'), not an integer" in result.stderr


def test_a_text_schema_version_is_a_ledger_error_when_opening_to_write(
    healthy: dict[str, Any], scratch: Path
) -> None:
    """SQLiteLedger refuses the same file with a LedgerError, not a raw ValueError."""
    path = copy_of(healthy, scratch)
    edit(path, f"DROP TABLE {SCHEMA_TABLE}",
         f"CREATE TABLE {SCHEMA_TABLE} (version, name, applied_at)",
         f"INSERT INTO {SCHEMA_TABLE} VALUES ('two', 'x', 'y')")
    with pytest.raises(le.LedgerError, match="schema version"):
        SQLiteLedger(path)


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_a_blob_tenant_makes_export_exit_2_naming_the_row(
    healthy: dict[str, Any], scratch: Path, fmt: str
) -> None:
    """A BLOB where the ledger stores text stops the invoice with the row and column named."""
    path = copy_of(healthy, scratch)
    edit(path, "UPDATE invocations SET tenant = X'00FF1B' WHERE id = ?",
         params=(healthy["priced"].invocation_id,))
    result = cli("audit", "export", "--db", path, "--format", fmt)
    assert_one_line_error(result)
    assert f"attempt {healthy['priced'].invocation_id} #1: tenant holds a BLOB (X'00FF1B')" \
        in result.stderr
    assert str(path) in result.stderr


def test_a_blob_tenant_makes_spend_exit_2_and_show_print_it_as_a_literal(
    healthy: dict[str, Any], scratch: Path
) -> None:
    """spend refuses a BLOB group key; show, which prints what is stored, shows X'..'."""
    path = copy_of(healthy, scratch)
    edit(path, "UPDATE invocations SET tenant = X'00FF1B' WHERE id = ?",
         params=(healthy["priced"].invocation_id,))
    assert_one_line_error(cli("audit", "spend", "--db", path))
    shown = cli("audit", "show", "--db", path, healthy["priced"].invocation_id)
    assert shown.exit_code == 0, shown.output
    assert "tenant                 X'00FF1B'" in shown.output
    as_json = json.loads(cli("audit", "show", "--db", path, healthy["priced"].invocation_id,
                             "--json").output)
    assert as_json["invocation"]["tenant"] == "X'00FF1B'"


def test_invocations_defined_as_a_view_exit_2(healthy: dict[str, Any], scratch: Path) -> None:
    """A file whose invocations is a view is not a ledger (a view could run anything)."""
    path = copy_of(healthy, scratch)
    edit(path, "ALTER TABLE invocations RENAME TO invocations_real",
         "CREATE VIEW invocations AS SELECT * FROM invocations_real")
    for command in (["spend"], ["reconcile"], ["export", "--format", "jsonl"], ["show", "x"]):
        result = cli("audit", command[0], "--db", path, *command[1:])
        assert_one_line_error(result)
        assert "invocations is a view, not a table" in result.stderr


def test_text_in_an_integer_column_exits_2_naming_it(
    healthy: dict[str, Any], scratch: Path
) -> None:
    """Text where a cost is stored: spend, reconcile and export refuse, naming the column."""
    path = copy_of(healthy, scratch)
    edit(path, "UPDATE attempts SET cost_nanousd = 'lots'",
         "UPDATE invocations SET cost_nanousd = 'lots'")
    for command in (["spend"], ["reconcile"], ["export", "--format", "csv"]):
        result = cli("audit", command[0], "--db", path, *command[1:])
        assert_one_line_error(result)
        assert "cost_nanousd" in result.stderr


def test_a_missing_ledger_is_not_created(scratch: Path) -> None:
    """Auditing a path that does not exist exits 2 and leaves the directory empty."""
    for command in (["spend"], ["show", "x"], ["reconcile"], ["export", "--format", "csv"]):
        result = cli("audit", command[0], "--db", scratch / "nope.db", *command[1:])
        assert_one_line_error(result)
        assert "no such file" in result.stderr
    assert list(scratch.iterdir()) == []


def test_a_directory_a_fifo_and_an_empty_file_exit_2(scratch: Path) -> None:
    """Neither a directory nor a FIFO is opened (a FIFO would block); an empty file is
    an empty database, not a ledger."""
    fifo = scratch / "pipe.db"
    os.mkfifo(fifo)
    empty = scratch / "empty.db"
    empty.touch()
    for path, message in [(scratch, "directory"), (fifo, "not a regular file"),
                          (empty, "is not a loopengine ledger")]:
        result = cli("audit", "reconcile", "--db", path)
        assert_one_line_error(result)
        assert message in result.stderr
    assert empty.stat().st_size == 0


def test_open_ledger_refuses_a_nul_byte_and_an_empty_path() -> None:
    """The Python entry point says what is wrong with the path, as a LedgerError."""
    with pytest.raises(le.LedgerError, match="NUL byte"):
        _audit.open_ledger("led\0ger.db")
    with pytest.raises(le.LedgerError, match="empty"):
        _audit.open_ledger("")


_ARG_TEXT = st.text(
    st.one_of(st.characters(blacklist_characters="\x00"),
              st.sampled_from(["\udc80", "\x1b", "\n", "\r", "\u202e", "-", ":", "T", "+"])),
    max_size=30)
"""Argument text as a shell can pass it: anything but NUL, surrogate escapes included."""

_MOMENTS = st.one_of(
    _ARG_TEXT,
    st.datetimes(timezones=st.timezones() | st.just(UTC) | st.none()).map(
        lambda d: d.isoformat()),
    st.builds(lambda d, h, m, sign: f"{d.isoformat()}T00:00:00{sign}{h:02}:{m:02}",
              st.dates(), st.integers(0, 23), st.integers(0, 59), st.sampled_from("+-")),
)


@st.composite
def _audit_args(draw: st.DrawFn, db: str) -> list[str]:
    command = draw(st.sampled_from(["spend", "show", "reconcile", "export"]))
    where = draw(st.sampled_from([db, db + "-nope", "/", "", "\udc80.db"]))
    args = ["audit", command, f"--db={where}"]
    if command in ("spend", "export"):
        for option in ("--since", "--until"):
            if draw(st.booleans()):
                args.append(f"{option}={draw(_MOMENTS)}")
    if command == "spend" and draw(st.booleans()):
        args.append(f"--by={draw(st.sampled_from(_audit.GROUPINGS) | _ARG_TEXT)}")
    if command == "reconcile" and draw(st.booleans()):
        duration = st.sampled_from(["30m", "2h", "1d", "0s", "1h30m", "99999999999w",
                                    "1e9d", "-1h"])
        args.append(f"--older-than={draw(duration | _ARG_TEXT)}")
    if command == "export":
        args.append(f"--format={draw(st.sampled_from(['csv', 'jsonl']) | _ARG_TEXT)}")
    if command in ("spend", "show", "reconcile") and draw(st.booleans()):
        args.append("--json")
    if command == "show":
        args += ["--", draw(_ARG_TEXT | st.just(""))]
    return args


@settings(max_examples=120, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_arguments_exit_0_1_or_2_without_a_traceback(
    healthy: dict[str, Any], data: st.DataObject
) -> None:
    """Whatever the options hold, the exit status is documented and an error is one line."""
    args = data.draw(_audit_args(str(healthy["path"])))
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code in EXIT_CODES, (args, result.output)
    assert "Traceback" not in result.output
    if result.exit_code == 2:
        assert_one_line_error(result)
    assert healthy["path"].read_bytes() == healthy["bytes"]


_VALUES = st.one_of(st.binary(max_size=8), st.text(max_size=8), st.floats(), st.none(),
                    st.integers(-2**63, 2**63 - 1), st.sampled_from(["running", "dispatched"]))


@st.composite
def _bad_file(draw: st.DrawFn, healthy: bytes) -> tuple[str, Any]:
    kind = draw(st.sampled_from(["bytes", "empty", "directory", "truncated", "flipped",
                                 "tables", "values", "schema", "view", "no column"]))
    if kind == "bytes":
        return kind, draw(st.binary(max_size=2048))
    if kind == "truncated":
        return kind, healthy[:draw(st.integers(0, len(healthy) - 1))]
    if kind == "flipped":
        at = draw(st.integers(0, len(healthy) - 1))
        return kind, healthy[:at] + bytes([healthy[at] ^ draw(st.integers(1, 255))]) + \
            healthy[at + 1:]
    if kind == "tables":
        names = draw(st.lists(st.sampled_from(["invocations", "attempts", SCHEMA_TABLE, "x"]),
                              unique=True))
        columns = draw(st.lists(st.sampled_from(["id", "version", "tenant", "cost_nanousd",
                                                 "invocation_id", "ordinal"]),
                                min_size=1, unique=True))
        return kind, (names, columns, draw(_VALUES))
    if kind == "values":
        table_name = draw(st.sampled_from(["invocations", "attempts"]))
        from loopengine.persistence._schema import ATTEMPT_COLUMNS, INVOCATION_COLUMNS
        columns = INVOCATION_COLUMNS if table_name == "invocations" else ATTEMPT_COLUMNS
        return kind, (table_name, draw(st.sampled_from(columns)), draw(_VALUES))
    if kind == "schema":
        return kind, draw(_VALUES)
    if kind == "no column":
        return kind, draw(st.sampled_from(["tenant", "cost_nanousd", "started_at"]))
    return kind, None


def _write_bad_file(where: Path, kind: str, spec: Any, healthy: bytes) -> Path:
    path = where / "bad.db"
    if kind == "directory":
        path.mkdir()
    elif kind in ("bytes", "truncated", "flipped"):
        path.write_bytes(spec)
    elif kind == "empty":
        path.touch()
    elif kind == "tables":
        names, columns, value = spec
        conn = sqlite3.connect(path)
        for name in names:
            conn.execute(f"CREATE TABLE {name} ({', '.join(columns)})")
            conn.execute(f"INSERT INTO {name} VALUES ({', '.join('?' * len(columns))})",
                         [value] * len(columns))
        conn.commit()
        conn.close()
    else:
        path.write_bytes(healthy)
        if kind == "values":
            table_name, column, value = spec
            conn = sqlite3.connect(path)
            conn.execute("PRAGMA ignore_check_constraints = ON")
            conn.execute(f"UPDATE OR IGNORE {table_name} SET {column} = ?", (value,))
            conn.commit()
            conn.close()
        elif kind == "schema":
            # Untyped, so the version can hold anything (the real one is a rowid).
            edit(path, f"DROP TABLE {SCHEMA_TABLE}",
                 f"CREATE TABLE {SCHEMA_TABLE} (version, name, applied_at)",
                 f"INSERT INTO {SCHEMA_TABLE} VALUES (1, 'x', 'y'), (?, 'x', 'y')",
                 params=(spec,))
        elif kind == "view":
            edit(path, "ALTER TABLE attempts RENAME TO attempts_real",
                 "CREATE VIEW attempts AS SELECT * FROM attempts_real")
        elif kind == "no column":
            edit(path, "DROP INDEX invocations_started_at", "DROP INDEX invocations_running",
                 f"ALTER TABLE invocations DROP COLUMN {spec}")
    return path


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_hand_made_bad_files_exit_0_1_or_2_without_a_traceback(
    healthy: dict[str, Any], data: st.DataObject
) -> None:
    """Random bytes, an empty file, a damaged ledger, wrong tables, wrong value types, a
    directory: every subcommand ends with a documented status, and an error is one line."""
    kind, spec = data.draw(_bad_file(healthy["bytes"]))
    where = Path(tempfile.mkdtemp(prefix="loopengine-bad-"))
    try:
        path = _write_bad_file(where, kind, spec, healthy["bytes"])
        for command in (["spend"], ["spend", "--by", "user_id", "--json"],
                        ["show", healthy["priced"].invocation_id[:4]],
                        ["show", healthy["unpriced"].invocation_id, "--json"],
                        ["reconcile"], ["reconcile", "--older-than", "1h", "--json"],
                        ["export", "--format", "csv"], ["export", "--format", "jsonl"]):
            result = CliRunner().invoke(main, ["audit", command[0], "--db", str(path),
                                               *command[1:]], catch_exceptions=False)
            assert result.exit_code in EXIT_CODES, (kind, command, result.output)
            assert "Traceback" not in result.output
            if result.exit_code == 2:
                assert_one_line_error(result)
            assert "\x1b" not in result.stdout or command[-1] in ("--json", "jsonl")
    finally:
        shutil.rmtree(where, ignore_errors=True)


# -- 2. read-only auditors ---------------------------------------------------------------------


def _nobody() -> pwd.struct_passwd:
    if not hasattr(os, "fork") or os.geteuid() != 0:
        pytest.skip("runs the CLI as another user, which needs root (and fork)")
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no 'nobody' user to run the CLI as")


def in_child_as_nobody(work: Callable[[], Any]) -> Any:
    """``work()``'s JSON-able result, computed in a forked child that has dropped to the
    ``nobody`` user (the interpreter's files under /root are not readable by nobody,
    so a new interpreter could not start as it)."""
    user = _nobody()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)
            payload = {"result": work()}
        except BaseException as error:
            payload = {"error": repr(error)}
        with os.fdopen(write, "wb") as pipe:
            pipe.write(json.dumps(payload).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    payload = json.loads(data)
    assert "error" not in payload, payload["error"]
    return payload["result"]


def as_nobody(*args: str | Path) -> dict[str, Any]:
    """The CLI's exit code, stdout and stderr, run as ``nobody``."""

    def work() -> dict[str, Any]:
        result = CliRunner().invoke(main, [str(a) for a in args])
        return {"exit_code": result.exit_code, "stdout": result.stdout,
                "stderr": result.stderr,
                "exception": None if result.exception is None
                or isinstance(result.exception, SystemExit) else repr(result.exception)}

    return dict(in_child_as_nobody(work))


@pytest.fixture(scope="module")
def warmed(healthy: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every command run once as root, so the child run as nobody imports nothing more
    (the interpreter's own files are not readable by nobody)."""
    path = tmp_path_factory.mktemp("warm") / "ledger.db"
    path.write_bytes(healthy["bytes"])
    for command in (["spend"], ["show", healthy["priced"].invocation_id], ["reconcile"],
                    ["export", "--format", "csv"], ["export", "--format", "jsonl"]):
        CliRunner().invoke(main, ["audit", command[0], "--db", str(path), *command[1:]])
    CliRunner().invoke(main, ["audit", "spend", "--db", str(path / "x")])


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory under /tmp that nobody can reach (0755, owned by root)."""
    where = Path(tempfile.mkdtemp(prefix="loopengine-ro-", dir="/tmp"))
    os.chmod(where, 0o755)
    try:
        yield where
    finally:
        _make_removable(where)
        shutil.rmtree(where, ignore_errors=True)


@pytest.mark.parametrize("directory_mode", [0o755, 0o555])
def test_another_users_closed_ledger_is_audited_without_writing_anything(
    healthy: dict[str, Any], warmed: None, shared_dir: Path, directory_mode: int
) -> None:
    """Run as nobody on root's 0644 (or 0444) file, in a directory nobody cannot write:
    every subcommand reads it, and no byte or file changes."""
    path = copy_of(healthy, shared_dir)
    os.chmod(path, 0o444 if directory_mode == 0o555 else 0o644)
    os.chmod(shared_dir, directory_mode)
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    reconciled = as_nobody("audit", "reconcile", "--db", path, "--json")
    assert reconciled["exception"] is None, reconciled
    assert reconciled["exit_code"] == 1, reconciled  # the unpriced run
    report = json.loads(reconciled["stdout"])
    assert report["invocations"] == 2 and len(report["unpriced"]) == 1
    spent = as_nobody("audit", "spend", "--db", path, "--json")
    assert spent["exit_code"] == 0, spent
    assert {r["tenant"] for r in json.loads(spent["stdout"])} == {"acme", "globex"}
    shown = as_nobody("audit", "show", "--db", path, healthy["priced"].invocation_id)
    assert shown["exit_code"] == 0 and healthy["priced"].invocation_id in shown["stdout"]
    exported = as_nobody("audit", "export", "--db", path, "--format", "csv")
    assert exported["exit_code"] == 0 and len(exported["stdout"].splitlines()) == 3
    assert sorted(p.name for p in shared_dir.iterdir()) == ["ledger.db"]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before


def test_a_live_ledger_is_read_by_a_user_who_cannot_write_it(
    warmed: None, shared_dir: Path
) -> None:
    """While its writer has it open (a -wal and -shm the auditor may read), nobody sees
    every committed run, including those still only in the write-ahead log."""
    path = shared_dir / "ledger.db"

    async def go() -> None:
        with SQLiteLedger(path) as ledger:
            for n in range(3):
                clock = FakeClock(wall_start=datetime(2026, 1, 1, tzinfo=UTC))
                engine = le.Engine(ScriptedProvider([Reply.text("hi")], clock=clock),
                                   ledger=ledger, prices=PRICES, clock=clock)
                await engine.run(operation(), "go", attribution=le.Attribution(tenant=f"t{n}"))
            for name in ("ledger.db", "ledger.db-wal", "ledger.db-shm"):
                os.chmod(shared_dir / name, 0o644)
            assert (shared_dir / "ledger.db-wal").stat().st_size > 0
            result = await anyio.to_thread.run_sync(
                lambda: as_nobody("audit", "spend", "--db", path, "--json"))
            assert result["exit_code"] == 0, result
            assert {r["tenant"] for r in json.loads(result["stdout"])} == {"t0", "t1", "t2"}

    anyio.run(go)


def test_a_write_ahead_log_that_cannot_be_read_is_explained(
    healthy: dict[str, Any], warmed: None, shared_dir: Path, scratch: Path
) -> None:
    """A -wal with committed rows but no -shm, in a directory nobody cannot write: exit 2,
    saying that the log needs a shared-memory index nobody cannot create, and what to do."""
    source = copy_of(healthy, scratch)
    conn = sqlite3.connect(source)
    try:
        conn.execute("PRAGMA wal_autocheckpoint = 0")
        conn.execute("UPDATE invocations SET turns = turns + 1")
        conn.commit()
        shutil.copy(source, shared_dir / "ledger.db")
        shutil.copy(f"{source}-wal", shared_dir / "ledger.db-wal")
    finally:
        conn.close()
    for name in ("ledger.db", "ledger.db-wal"):
        os.chmod(shared_dir / name, 0o644)
    result = as_nobody("audit", "reconcile", "--db", shared_dir / "ledger.db")
    assert result["exit_code"] == 2, result
    error = result["stderr"].strip()
    assert len(error.splitlines()) == 1, error
    assert "cannot be read by this user" in error and "ledger.db-wal" in error
    assert "shared-memory index (ledger.db-shm)" in error and ".backup" in error
    assert sorted(p.name for p in shared_dir.iterdir()) == ["ledger.db", "ledger.db-wal"]


def test_a_file_this_user_cannot_read_says_permission_denied(
    healthy: dict[str, Any], warmed: None, shared_dir: Path
) -> None:
    """Root's 0600 ledger, audited as nobody: exit 2, saying it is not readable."""
    path = copy_of(healthy, shared_dir)
    os.chmod(path, 0o600)
    result = as_nobody("audit", "spend", "--db", path)
    assert result["exit_code"] == 2, result
    assert f"{path}: this user cannot read it (permission denied)" in result["stderr"]
    assert "Traceback" not in result["stderr"]
    opened = as_nobody_open(path)
    assert opened == f"LedgerError: {path}: this user cannot read it (permission denied)"


def as_nobody_open(path: Path) -> str:
    """What `open_ledger` says in a child run as nobody."""

    def work() -> str:
        try:
            _audit.open_ledger(path).close()
        except le.LedgerError as error:
            return f"LedgerError: {error}"
        return "opened"

    return str(in_child_as_nobody(work))


# -- 3. nothing unpriced is silent -----------------------------------------------------------


def test_spend_counts_unpriced_attempts_and_their_tokens(healthy: dict[str, Any]) -> None:
    """The unpriced run's tenant shows 1 unpriced attempt of 120 tokens, and a line says
    their cost is in no column; JSON carries the same counts."""
    result = cli("audit", "spend", "--db", healthy["path"])
    assert result.exit_code == 0, result.output
    rows = {r["tenant"]: r for r in table(result.output, "tenant")}
    assert (rows["globex"]["unpriced"], rows["globex"]["unpriced tokens"]) == ("1", "120")
    assert (rows["globex"]["charged USD"], rows["acme"]["unpriced"]) == ("0", "0")
    assert "1 attempt (120 tokens) had no price: their cost is in no USD column" \
        in result.output
    as_json = {r["tenant"]: r for r in json.loads(
        cli("audit", "spend", "--db", healthy["path"], "--json").output)}
    assert (as_json["globex"]["unpriced_attempts"], as_json["globex"]["unpriced_tokens"]) == (
        1, 120)
    assert as_json["acme"]["unpriced_attempts"] == 0


def test_show_marks_an_unpriced_attempt(healthy: dict[str, Any]) -> None:
    """Its cost reads 'unpriced' (not blank, not 0), and a line names it."""
    result = cli("audit", "show", "--db", healthy["path"], healthy["unpriced"].invocation_id)
    assert result.exit_code == 0, result.output
    (attempt,) = table(result.output, "ordinal")
    assert attempt["cost_usd"] == "unpriced"
    assert "1 attempt served tokens without a price (ordinal 1)" in result.output
    priced = cli("audit", "show", "--db", healthy["path"], healthy["priced"].invocation_id)
    assert "unpriced" not in priced.output


def test_reconcile_lists_unpriced_attempts_and_exits_1(healthy: dict[str, Any]) -> None:
    """An unpriced attempt needs a look: listed with its tokens, exit 1, and the verdict
    names it instead of 'Everything reconciles'."""
    result = cli("audit", "reconcile", "--db", healthy["path"])
    assert result.exit_code == 1, result.output
    assert "Unpriced attempts (tokens served, no price: their cost is in no total): 1" \
        in result.output
    (row,) = table(result.output, "invocation")
    assert (row["invocation"], row["served_by"], row["input"], row["output"]) == (
        healthy["unpriced"].invocation_id, f"anthropic:{UNKNOWN}", "100", "20")
    assert "Everything reconciles" not in result.output
    assert "The ledger does not reconcile: 1 unpriced attempt." in result.output
    report = json.loads(cli("audit", "reconcile", "--db", healthy["path"], "--json").output)
    assert report["ok"] is False and report["unpriced"][0]["tokens"] == 120


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_export_marks_unpriced_rows(healthy: dict[str, Any], fmt: str) -> None:
    """The unpriced row has unpriced = 1 and no cost (empty, not 0); a note says so."""
    result = cli("audit", "export", "--db", healthy["path"], "--format", fmt)
    assert result.exit_code == 0, result.output
    if fmt == "csv":
        rows = list(csv.DictReader(io.StringIO(result.stdout)))
    else:
        rows = [json.loads(line) for line in result.stdout.splitlines()]
    marks = {r["invocation_id"]: (str(r["unpriced"]), r["cost_usd"] or None) for r in rows}
    assert marks[healthy["unpriced"].invocation_id] == ("1", None)
    assert marks[healthy["priced"].invocation_id][0] == "0"
    assert marks[healthy["priced"].invocation_id][1] is not None
    assert "1 attempt in this export served tokens without a price" in result.stderr


# -- 4. more audit answers -------------------------------------------------------------------


def test_spend_by_user_id_and_by_correlation_id(scratch: Path) -> None:
    """Each grouping gives one row per value (None as '(none)'), adding up to the whole."""
    path = scratch / "ledger.db"
    results = record(
        path,
        ("2026-01-01", operation(), [Reply.text("a")], le.Attribution(user_id="u1",
                                                                     correlation_id="c1")),
        ("2026-01-02", operation(), [Reply.text("b")], le.Attribution(user_id="u1",
                                                                     correlation_id="c2")),
        ("2026-01-03", operation(), [Reply.text("c")], le.Attribution(user_id="u2")))
    total = sum(int(r.cost_usd * 10**9) for r in results)
    by_user = json.loads(cli("audit", "spend", "--db", path, "--by", "user_id",
                             "--json").output)
    assert {r["user_id"]: r["invocations"] for r in by_user} == {"u1": 2, "u2": 1}
    assert sum(r["cost_nanousd"] for r in by_user) == total
    by_correlation = cli("audit", "spend", "--db", path, "--by", "correlation_id")
    assert by_correlation.exit_code == 0, by_correlation.output
    rows = {r["correlation_id"]: r for r in table(by_correlation.output, "correlation_id")}
    assert set(rows) == {"c1", "c2", "(none)"}
    assert all(r["invocations"] == "1" for r in rows.values())


def test_reconcile_older_than_reports_abandoned_runs_apart_from_runs_in_flight(
    scratch: Path
) -> None:
    """A run open for years is abandoned (its unsettled attempt too): exit 1. A run that
    started a moment ago is in flight: listed, but it does not fail the check."""
    path = scratch / "ledger.db"
    now = datetime.now(UTC)
    open_runs(path, {"crashed": now - timedelta(days=400), "flying": now})
    result = cli("audit", "reconcile", "--db", path, "--older-than", "1d")
    assert result.exit_code == 1, result.output
    assert "Invocations abandoned (started more than 1d ago and never ended: their " \
           "process died): 1" in result.output
    assert "Attempts abandoned (dispatched more than 1d ago" in result.output
    assert "Invocations in flight (started less than 1d ago): 1" in result.output
    abandoned = table(result.output.split("Invocations abandoned")[1], "invocation")
    assert [(r["invocation"], r["unsettled attempts"]) for r in abandoned] == [("crashed", "1")]
    assert "The ledger does not reconcile: 1 abandoned invocation, 1 abandoned attempt." \
        in result.output
    report = json.loads(cli("audit", "reconcile", "--db", path, "--older-than", "1d",
                            "--json").output)
    assert [r["id"] for r in report["abandoned"]] == ["crashed"]
    assert [r["id"] for r in report["running"]] == ["flying"]
    assert report["older_than_seconds"] == 86400

    without = cli("audit", "reconcile", "--db", path)
    assert without.exit_code == 1
    assert "Invocations still running (or their process died): 2" in without.output


def test_reconcile_older_than_passes_when_only_young_runs_are_open(scratch: Path) -> None:
    """Runs in flight younger than the threshold: exit 0, and the verdict mentions them."""
    path = scratch / "ledger.db"
    open_runs(path, {"flying": datetime.now(UTC)})
    result = cli("audit", "reconcile", "--db", path, "--older-than", "2h")
    assert result.exit_code == 0, result.output
    assert "Everything reconciles. In flight, younger than 2h: 1 invocation, 1 attempt." \
        in result.output


@pytest.mark.parametrize("text", ["30", "m", "1x", "", "-1h", "1 h", "٣h"])
def test_reconcile_older_than_refuses_what_is_not_a_duration(
    healthy: dict[str, Any], text: str
) -> None:
    """A duration must be numbers with units s, m, h, d, w: anything else is a usage error."""
    result = cli("audit", "reconcile", "--db", healthy["path"], f"--older-than={text}")
    assert_one_line_error(result)
    assert "is not a duration" in result.stderr


@pytest.mark.parametrize(("text", "seconds"), [("90s", 90), ("30m", 1800), ("2h", 7200),
                                               ("1d", 86400), ("1w", 604800),
                                               ("1h30m", 5400), ("1.5h", 5400)])
def test_durations_parse(text: str, seconds: int) -> None:
    """The units a reconcile threshold takes, and their sums."""
    span = _audit_cli.parse_duration(text)
    assert span.total_seconds() == seconds
    assert _audit_cli.parse_duration(_audit_cli.format_duration(span)) == span


def test_show_prints_the_cache_columns_an_attempts_cost_follows_from(scratch: Path) -> None:
    """Input, output, cache read, cache write (and its one-hour part) and the price ref are
    printed: at that price they give exactly the printed cost."""
    path = scratch / "ledger.db"
    usage = le.Usage(input_tokens=100, output_tokens=20, cache_read_tokens=1000,
                     cache_write_tokens=500, cache_write_1h_tokens=200)
    (result,) = record(path, ("2026-01-01", op(CACHED), [Reply.text("hi", usage=usage)],
                              le.Attribution(tenant="acme")), prices=CACHE_PRICES)
    shown = cli("audit", "show", "--db", path, result.invocation_id)
    (row,) = table(shown.output, "ordinal")
    tokens = {k: int(row[k]) for k in ("input_tokens", "output_tokens", "cache_read_tokens",
                                       "cache_write_tokens", "cache_write_1h_tokens")}
    assert tokens == {"input_tokens": 100, "output_tokens": 20, "cache_read_tokens": 1000,
                      "cache_write_tokens": 500, "cache_write_1h_tokens": 200}
    assert row["price_ref"].startswith(f"book:anthropic/{CACHED}")
    per_mtok = (tokens["input_tokens"] * 3 + tokens["output_tokens"] * 15
                + tokens["cache_read_tokens"] * Decimal("0.3")
                + (tokens["cache_write_tokens"] - tokens["cache_write_1h_tokens"])
                * Decimal("3.75") + tokens["cache_write_1h_tokens"] * 6)
    assert Decimal(row["cost_usd"]) == per_mtok / 10**6 == result.cost_usd


# -- 5. stored values cannot attack the reader -------------------------------------------------


HOSTILE = {
    "tenant": "\x1b[2J\x1b]0;owned\x07acme",
    "user_id": "=HYPERLINK(\"http://evil.example\",\"click\")",
    "feature": "+cmd|' /C calc'!A0",
    "correlation_id": "\u202eevil\r\x7f\x9b31m",
}


@pytest.fixture
def hostile(healthy: dict[str, Any], scratch: Path) -> dict[str, Any]:
    """The healthy ledger with attribution values written behind loopengine's back (it
    refuses them itself), one run left open so reconcile prints its tenant."""
    path = copy_of(healthy, scratch)
    edit(path, "UPDATE invocations SET tenant = ?, user_id = ?, feature = ?, "
               "correlation_id = ?, outcome = 'running'",
         params=tuple(HOSTILE.values()))
    return {"path": path, "id": healthy["priced"].invocation_id}


def _harmless(text: str) -> None:
    for raw in ("\x1b", "\x07", "\r", "\x7f", "\x9b", "\u202e"):
        assert raw not in text, (raw, text)


@pytest.mark.parametrize("command", [["spend"], ["spend", "--by", "correlation_id"],
                                     ["show", "ID"], ["reconcile"]])
def test_control_characters_in_stored_values_are_escaped_in_tables(
    hostile: dict[str, Any], command: list[str]
) -> None:
    """ESC, BEL, CR, DEL, a C1 control and a bidi override are printed as escapes."""
    args = [hostile["id"] if a == "ID" else a for a in command]
    result = cli("audit", args[0], "--db", hostile["path"], *args[1:])
    assert result.exit_code in (0, 1), result.output
    _harmless(result.output)
    if command[-1] == "correlation_id":
        assert "\\u202eevil\\x0d\\x7f\\x9b31m" in result.output
    else:
        assert "\\x1b[2J\\x1b]0;owned\\x07acme" in result.output


def test_json_output_keeps_stored_values_exact_and_escaped(hostile: dict[str, Any]) -> None:
    """--json and JSONL escape control characters the JSON way: the terminal sees none,
    the parsed values are exactly what is stored."""
    shown = cli("audit", "show", "--db", hostile["path"], hostile["id"], "--json")
    _harmless(shown.stdout)
    invocation = json.loads(shown.stdout)["invocation"]
    assert {k: invocation[k] for k in HOSTILE} == HOSTILE
    exported = cli("audit", "export", "--db", hostile["path"], "--format", "jsonl")
    _harmless(exported.stdout)
    row = json.loads(exported.stdout.splitlines()[0])
    assert {k: row[k] for k in HOSTILE} == HOSTILE


def test_csv_export_neutralises_formulas_and_escapes_control_characters(
    hostile: dict[str, Any]
) -> None:
    """Cells starting with = + - @ tab or CR get a leading quote; control characters are
    escaped; numbers are left as numbers."""
    result = cli("audit", "export", "--db", hostile["path"], "--format", "csv")
    assert result.exit_code == 0, result.output
    _harmless(result.stdout)
    row = next(r for r in csv.DictReader(io.StringIO(result.stdout))
               if r["invocation_id"] == hostile["id"])
    assert row["user_id"] == "'=HYPERLINK(\"http://evil.example\",\"click\")"
    assert row["feature"] == "'+cmd|' /C calc'!A0"
    assert row["tenant"] == "\\x1b[2J\\x1b]0;owned\\x07acme"
    assert row["correlation_id"] == "\\u202eevil\\x0d\\x7f\\x9b31m"
    assert row["cost_usd"] == str(hostile_cost(hostile))


def hostile_cost(hostile: dict[str, Any]) -> Decimal:
    conn = _audit.open_ledger(hostile["path"])
    try:
        (cost,) = conn.execute("SELECT cost_nanousd FROM attempts WHERE invocation_id = ?",
                               (hostile["id"],)).fetchone()
    finally:
        conn.close()
    return Decimal(cost) / 10**9


@pytest.mark.parametrize("start", ["=", "+", "-", "@", "\t", "\r"])
def test_every_formula_prefix_is_neutralised(
    healthy: dict[str, Any], scratch: Path, start: str
) -> None:
    """Each prefix OWASP names, at the start of a stored text cell, is quoted."""
    path = copy_of(healthy, scratch)
    edit(path, "UPDATE invocations SET tenant = ?", params=(f"{start}1+1",))
    rows = list(csv.DictReader(io.StringIO(
        cli("audit", "export", "--db", path, "--format", "csv").stdout)))
    assert {r["tenant"] for r in rows} == {"'" + printable(f"{start}1+1")}


def test_an_error_naming_a_hostile_path_is_one_escaped_line(scratch: Path) -> None:
    """A path holding a newline and ESC is named in one line, escaped."""
    result = cli("audit", "spend", "--db", scratch / "evil\n\x1b[2J.db")
    assert_one_line_error(result)
    assert "evil\\x0a\\x1b[2J.db: no such file" in result.stderr


@pytest.mark.parametrize(("text", "shown"), [
    ("plain", "plain"), ("tab\there", "tab\\x09here"), ("\x00", "\\x00"),
    ("\x85next line", "\\x85next line"), ("zero\u200bwidth", "zero\\u200bwidth"),
    ("line\u2028sep", "line\\u2028sep"), ("café ✓", "café ✓"), ("\U000e0001", "\\U000e0001"),
])
def test_printable_escapes_what_str_isprintable_refuses(text: str, shown: str) -> None:
    """C0, C1, format characters and separators are escaped; printable text is kept."""
    assert printable(text) == shown


# -- 6. ledger files are private -------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o022, 0o000, 0o277])
def test_a_new_ledger_and_its_wal_and_shm_are_0600_whatever_the_umask(
    scratch: Path, umask: int
) -> None:
    """Created by the ledger under any umask, the file, its -wal and -shm are owner-only."""
    path = scratch / "ledger.db"
    old = os.umask(umask)
    try:
        ledger = SQLiteLedger(path)
    finally:
        os.umask(old)
    try:
        record_into(ledger)
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in scratch.iterdir()}
    finally:
        ledger.close()
    assert modes == {"ledger.db": 0o600, "ledger.db-wal": 0o600, "ledger.db-shm": 0o600}


def record_into(ledger: SQLiteLedger) -> None:
    async def go() -> None:
        clock = FakeClock()
        engine = le.Engine(ScriptedProvider([Reply.text("hi")], clock=clock), ledger=ledger,
                           prices=PRICES, clock=clock)
        await engine.run(operation(), "go")

    anyio.run(go)


def test_an_existing_ledgers_mode_is_left_alone(scratch: Path) -> None:
    """A file its owner made 0640 stays 0640 when a ledger opens it again, and SQLite
    gives its new -wal and -shm the same mode."""
    path = scratch / "ledger.db"
    SQLiteLedger(path).close()
    os.chmod(path, 0o640)
    with SQLiteLedger(path) as ledger:
        record_into(ledger)
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in scratch.iterdir()}
    assert modes == {"ledger.db": 0o640, "ledger.db-wal": 0o640, "ledger.db-shm": 0o640}


def test_a_path_with_a_nul_byte_is_a_config_error(scratch: Path) -> None:
    """A bad argument (ConfigError naming ``path``), and no file is created."""
    with pytest.raises(le.ConfigError, match="contains a NUL byte"):
        SQLiteLedger(f"{scratch}/led\0ger.db")
    assert list(scratch.iterdir()) == []


def test_an_empty_path_is_called_empty_not_in_memory() -> None:
    """SQLite would open a private temporary file for '': the message says the path is
    empty, and ':memory:' is still named an in-memory database."""
    with pytest.raises(le.ConfigError) as empty:
        SQLiteLedger("")
    assert "path is empty" in str(empty.value) and "in-memory" not in str(empty.value)
    with pytest.raises(le.ConfigError, match="in-memory database.*WAL"):
        SQLiteLedger(":memory:")


@pytest.mark.parametrize("path", [42, b"ledger.db", None])
def test_a_path_that_is_not_text_is_a_config_error(path: Any) -> None:
    """The path must be a str or an os.PathLike of str."""
    with pytest.raises(le.ConfigError, match="path: must be a str") as caught:
        SQLiteLedger(path)
    assert caught.value.field == "path"


def test_a_ledger_in_a_missing_directory_says_it_cannot_create_it(scratch: Path) -> None:
    """Creating the file first gives the OS's reason."""
    with pytest.raises(le.LedgerError, match="cannot open the ledger: cannot create the file "
                                             r"\(No such file or directory\)"):
        SQLiteLedger(scratch / "missing" / "ledger.db")

