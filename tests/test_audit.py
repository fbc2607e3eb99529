"""`loopengine audit`: the real command (click's runner on the real ``main``, and the
installed script once) on ledger files written by real engine runs."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import random
import shutil
import sqlite3
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

import loopengine as le
from loopengine import _audit_cli
from loopengine.cli import main
from loopengine.persistence import SQLiteLedger, _audit
from loopengine.persistence._schema import SCHEMA_TABLE, SCHEMA_VERSION
from loopengine.providers import FaultKind, ProviderFault, Reply, ScriptedProvider
from loopengine.testing import FakeClock

from .conftest import MODEL, operation
from .ledger_support import judge, lookup, read_db, start, teammate_script
from .test_audit_robust import table

HAIKU = "claude-haiku-4-5"
PRICES = le.PriceBook(
    [le.ModelPrice(provider="anthropic", model=MODEL, input_per_mtok=Decimal(1),
                   output_per_mtok=Decimal(1)),
     le.ModelPrice(provider="anthropic", model=HAIKU, input_per_mtok=Decimal(2),
                   output_per_mtok=Decimal(2))],
    credits_per_usd=Decimal(1_000_000),
)
FAST = le.RetryPolicy(initial_wait=0.001, max_wait=0.001)
OTHER = le.Operation(name="other.op", provider="anthropic", model=HAIKU, max_output_tokens=256,
                     retry=FAST)


async def record(path: Path, day: str, script: list[Any], op: le.Operation,
                 attribution: le.Attribution, **kwargs: Any) -> le.RunResult:
    """One run, on its own fake clock starting at ``day``, recorded in ``path``."""
    clock = FakeClock(wall_start=datetime.fromisoformat(day).replace(tzinfo=UTC))
    with SQLiteLedger(path, max_retained_attempts=kwargs.pop("retain", 64)) as ledger:
        engine = le.Engine(ScriptedProvider(script, clock=clock), ledger=ledger, prices=PRICES,
                           clock=clock, rng=random.Random(3))
        return await engine.run(op, "go", attribution=attribution, **kwargs)


@pytest.fixture
async def ledger_file(tmp_path: Path) -> dict[str, Any]:
    """Three runs over two months, two tenants, two features, two operations and models."""
    path = tmp_path / "ledger.db"
    a = await record(path, "2026-01-10", teammate_script(), operation(retry=FAST),
                     le.Attribution(tenant="acme", feature="help"), tools=[lookup], accept=judge)
    b = await record(path, "2026-02-10", [Reply.text("hi")], operation(),
                     le.Attribution(tenant="globex", feature="search"))
    no_id = ProviderFault(FaultKind.SERVER_ERROR, "boom", http_status=500)
    c = await record(path, "2026-02-20", [no_id, Reply.text("ok")], OTHER,
                     le.Attribution(tenant="acme", feature="search"))
    return {"path": path, "a": a, "b": b, "c": c}


def cli(*args: str | Path) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def nano(result: le.RunResult) -> int:
    return int(result.cost_usd * 10**9)


# -- spend --------------------------------------------------------------------------------


def test_spend_by_tenant_over_periods(ledger_file: dict[str, Any]) -> None:
    """Spend per tenant sums its invocations' totals; --since/--until select by start."""
    conn = _audit.open_ledger(ledger_file["path"])
    a, b, c = ledger_file["a"], ledger_file["b"], ledger_file["c"]
    rows = {r.key: r for r in _audit.spend(conn, by="tenant")}
    assert rows["acme"].cost_nanousd == nano(a) + nano(c)
    assert rows["acme"].invocations == 2 and rows["acme"].attempts == 6 + 2
    assert rows["acme"].provider_cost_nanousd > rows["acme"].cost_nanousd  # the cut stream
    assert rows["globex"].cost_nanousd == nano(b)
    assert rows["acme"].credits == a.credits + c.credits
    feb = {r.key: r for r in _audit.spend(conn, by="tenant",
                                          since=_audit_cli.parse_moment("2026-02-01"))}
    assert feb["acme"].cost_nanousd == nano(c) and feb["acme"].invocations == 1
    jan = {r.key: r for r in _audit.spend(conn, by="tenant",
                                          until=_audit_cli.parse_moment("2026-02-01"))}
    assert set(jan) == {"acme"} and jan["acme"].cost_nanousd == nano(a)
    conn.close()

    result = cli("audit", "spend", "--db", ledger_file["path"], "--since", "2026-02-01")
    assert result.exit_code == 0, result.output
    assert "Spend by tenant from 2026-02-01T00:00:00.000000+00:00" in result.output
    lines = {line.split()[0]: line.split() for line in result.output.splitlines()[3:]}
    assert lines["acme"][7] == str(Decimal(nano(c)) / 10**9)
    assert lines["globex"][1] == "1"


@pytest.mark.parametrize(("by", "keys"), [
    ("feature", {"help", "search"}),
    ("model", {MODEL, HAIKU}),
    ("operation", {"test.op", "other.op"}),
])
def test_spend_groups_by_feature_model_and_operation(
    ledger_file: dict[str, Any], by: str, keys: set[str]
) -> None:
    """Each grouping gives one row per value, and the rows add up to the whole."""
    result = cli("audit", "spend", "--db", ledger_file["path"], "--by", by, "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert {r[by] for r in rows} == keys
    total = sum(nano(ledger_file[k]) for k in "abc")
    assert sum(r["cost_nanousd"] for r in rows) == total


def test_spend_refuses_a_bad_date(ledger_file: dict[str, Any]) -> None:
    """A --since that is not a date is a usage error naming the value."""
    result = cli("audit", "spend", "--db", ledger_file["path"], "--since", "last tuesday")
    assert result.exit_code == 2 and "'last tuesday' is not a date" in result.output


# -- show ---------------------------------------------------------------------------------


def test_show_prints_the_invocation_and_its_attempts(ledger_file: dict[str, Any]) -> None:
    """show gives every invocation column and one line per attempt, by id or a prefix."""
    a = ledger_file["a"]
    result = cli("audit", "show", "--db", ledger_file["path"], a.invocation_id[:8])
    assert result.exit_code == 0, result.output
    assert f"id                     {a.invocation_id}" in result.output
    assert "outcome                completed" in result.output
    attempt_lines = [line for line in result.output.splitlines()
                     if line.split() and line.split()[0].isdigit() and len(line.split()) > 8]
    assert [line.split()[0] for line in attempt_lines] == ["1", "2", "3", "4", "5", "6"]
    assert "repair" in attempt_lines[5] and "aborted" in attempt_lines[2]

    as_json = json.loads(cli("audit", "show", "--db", ledger_file["path"], a.invocation_id,
                             "--json").output)
    assert as_json["invocation"]["cost_nanousd"] == nano(a)
    assert [x["ordinal"] for x in as_json["attempts"]] == [1, 2, 3, 4, 5, 6]


def test_show_an_unknown_invocation_fails(ledger_file: dict[str, Any]) -> None:
    """An id that matches nothing exits 2 and says so."""
    result = cli("audit", "show", "--db", ledger_file["path"], "no-such-id")
    assert result.exit_code == 2 and "no invocation no-such-id" in result.output


async def test_show_names_an_unknown_or_ambiguous_id_as_given(tmp_path: Path) -> None:
    """The message keeps the id whole: a prefix of several ids is quoted once on
    each side, and an id ending in a quote keeps it."""
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as ledger:
        for invocation_id in ("inv-1", "inv-2"):
            await ledger.start_invocation(start(invocation_id))
        await ledger.flush()
    several = cli("audit", "show", "--db", path, "inv-")
    assert several.exit_code == 2
    assert "Error: 'inv-' is the start of several invocation ids; give more of it" in \
        several.output
    quoted = cli("audit", "show", "--db", path, "inv'")
    assert quoted.exit_code == 2 and "Error: no invocation inv'\n" in quoted.output


# -- reconcile --------------------------------------------------------------------------------


def test_reconcile_a_clean_ledger(ledger_file: dict[str, Any]) -> None:
    """Engine-written totals reconcile with their rows by construction: exit 0."""
    result = cli("audit", "reconcile", "--db", ledger_file["path"])
    assert result.exit_code == 0, result.output
    assert "Checked 3 invocations and 9 attempt rows." in result.output
    assert "Everything reconciles." in result.output


def test_reconcile_reports_a_total_that_does_not_add_up(ledger_file: dict[str, Any]) -> None:
    """A total edited behind the ledger's back is reported with both values: exit 1."""
    path, a = ledger_file["path"], ledger_file["a"]
    conn = sqlite3.connect(path)
    conn.execute("UPDATE invocations SET cost_nanousd = cost_nanousd + 1, "
                 "output_tokens = 0 WHERE id = ?", (a.invocation_id,))
    conn.commit()
    conn.close()
    result = cli("audit", "reconcile", "--db", path, "--json")
    assert result.exit_code == 1
    report = json.loads(result.output)
    assert report["ok"] is False
    assert {(m["column"], m["recorded"]) for m in report["mismatches"]} == {
        ("cost_nanousd", nano(a) + 1), ("output_tokens", 0)}
    assert all(m["invocation_id"] == a.invocation_id for m in report["mismatches"])


async def test_reconcile_lists_incomplete_records(tmp_path: Path) -> None:
    """A run with more attempts than rows is listed as incomplete, and export says so."""
    path = tmp_path / "ledger.db"
    faults = [ProviderFault(FaultKind.OVERLOADED, "busy") for _ in range(2)]
    result = await record(path, "2026-01-01", [*faults, Reply.text("ok")], operation(retry=FAST),
                          le.Attribution(tenant="acme"), retain=2)
    assert result.attempts.incomplete
    outcome = cli("audit", "reconcile", "--db", path)
    assert outcome.exit_code == 1
    assert "Incomplete records (more attempts than rows kept, R07): 1" in outcome.output
    assert f"{result.invocation_id}  test.op    3         2" in outcome.output
    exported = CliRunner().invoke(main, ["audit", "export", "--db", str(path), "--format",
                                         "jsonl"])
    assert exported.exit_code == 0
    assert len(exported.stdout.splitlines()) == 2
    assert "1 invocation in this export is incomplete" in exported.stderr


# -- export --------------------------------------------------------------------------------------


def test_export_csv_has_every_attempt_and_marks_missing_response_ids(
    ledger_file: dict[str, Any]
) -> None:
    """One CSV row per attempt with its attribution; rows without a response id are
    kept and marked."""
    result = cli("audit", "export", "--db", ledger_file["path"], "--format", "csv")
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(io.StringIO(result.output)))
    assert len(rows) == 9
    assert tuple(rows[0]) == _audit.EXPORT_COLUMNS
    missing = [r for r in rows if r["response_id_missing"] == "1"]
    assert {(r["operation"], r["fault"], r["response_id"]) for r in missing} == {
        ("test.op", "overloaded", ""), ("other.op", "server_error", "")}
    assert all(r["response_id"] for r in rows if r["response_id_missing"] == "0")
    charged = sum(Decimal(r["cost_usd"]) for r in rows if r["charged"] == "1")
    assert charged == sum(ledger_file[k].cost_usd for k in "abc")
    assert {r["tenant"] for r in rows} == {"acme", "globex"}


def test_export_jsonl_over_a_period(ledger_file: dict[str, Any], tmp_path: Path) -> None:
    """JSONL rows to a file, only the attempts started in the period."""
    out = tmp_path / "invoice.jsonl"
    result = cli("audit", "export", "--db", ledger_file["path"], "--format", "jsonl",
                 "--since", "2026-02-01", "--until", "2026-02-15", "-o", out)
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["tenant"], r["invocation_id"]) for r in rows] == [
        ("globex", ledger_file["b"].invocation_id)]
    assert rows[0]["response_id_missing"] == 0 and rows[0]["cost_usd"] == "0.00012"


# -- files that cannot be audited ------------------------------------------------------------


def test_files_that_are_not_ledgers_exit_2(tmp_path: Path) -> None:
    """A missing file, a text file, a foreign database and a newer schema: exit 2 with a
    message naming the problem."""
    assert "no such file" in cli("audit", "reconcile", "--db", tmp_path / "nope.db").output
    text = tmp_path / "notes.txt"
    text.write_text("hello " * 200)
    foreign = tmp_path / "foreign.db"
    sqlite3.connect(foreign).execute("CREATE TABLE t (x)").connection.commit()
    newer = tmp_path / "newer.db"
    SQLiteLedger(newer).close()
    conn = sqlite3.connect(newer)
    conn.execute(f"INSERT INTO {SCHEMA_TABLE} VALUES (?, 'future', 'x')", (SCHEMA_VERSION + 1,))
    conn.commit()
    conn.close()
    for path, message in [(tmp_path / "nope.db", "no such file"),
                          (text, "is not a SQLite database"),
                          (foreign, "is not a loopengine ledger"),
                          (newer, "newer than this loopengine understands")]:
        for command in (["spend"], ["show", "x"], ["reconcile"], ["export", "--format", "csv"]):
            result = cli("audit", command[0], "--db", path, *command[1:])
            assert result.exit_code == 2, (path, command, result.output)
            assert message in result.output, (path, command, result.output)


def test_audit_never_writes(ledger_file: dict[str, Any]) -> None:
    """The database file is byte-for-byte the same after every audit command, and the
    connection the audit uses cannot write."""
    path = ledger_file["path"]
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    for args in (["spend"], ["show", ledger_file["a"].invocation_id], ["reconcile"],
                 ["export", "--format", "csv"]):
        cli("audit", args[0], "--db", path, *args[1:])
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before
    conn = _audit.open_ledger(path)
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        conn.execute("DELETE FROM attempts")
    conn.close()


@pytest.mark.slow
def test_the_installed_script_audits_a_real_ledger(ledger_file: dict[str, Any]) -> None:
    """The ``loopengine`` console script (as installed) runs reconcile and spend."""
    script = shutil.which("loopengine", path=str(Path(sys.executable).parent))
    assert script is not None
    path = str(ledger_file["path"])
    done = subprocess.run([script, "audit", "reconcile", "--db", path], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "Everything reconciles." in done.stdout
    spent = subprocess.run([script, "audit", "spend", "--db", path, "--by", "operation",
                            "--json"], capture_output=True, text=True, timeout=60)
    assert spent.returncode == 0, spent.stderr
    assert {r["operation"] for r in json.loads(spent.stdout)} == {"test.op", "other.op"}
    assert read_db(path)[0]  # the file still reads after the script's read-only opens


async def test_the_audit_queries_have_a_public_home(tmp_path: Path) -> None:
    """`loopengine.audit` is what the CLI prints, for use from Python."""
    from loopengine import audit
    from loopengine.persistence import SQLiteLedger

    path = tmp_path / "ledger.db"
    SQLiteLedger(path).close()
    conn = audit.open_ledger(path)
    try:
        report = audit.reconcile(conn)
        assert report.ok and report.invocations == 0
        assert audit.accounts(conn) == [] and audit.spend(conn, by="tenant") == []
    finally:
        conn.close()


# -- runs, filters, totals, pipes ------------------------------------------------------------


def test_runs_lists_invocations_newest_first_with_a_totals_row(
    ledger_file: dict[str, Any],
) -> None:
    """`audit runs` prints each invocation's id (what `show` takes), start, tenant,
    feature, operation, outcome, attempts and cost, newest first, then their totals."""
    a, b, c = ledger_file["a"], ledger_file["b"], ledger_file["c"]
    result = cli("audit", "runs", "--db", ledger_file["path"])
    assert result.exit_code == 0, result.output
    rows = table(result.output, "id")
    assert [r["id"] for r in rows] == [c.invocation_id, b.invocation_id, a.invocation_id]
    assert [(r["tenant"], r["feature"], r["operation"]) for r in rows] == [
        ("acme", "search", "other.op"), ("globex", "search", "test.op"),
        ("acme", "help", "test.op")]
    assert rows[2]["started_at"].startswith("2026-01-10")
    assert [r["outcome"] for r in rows] == ["completed"] * 3
    assert [int(r["attempts"]) for r in rows] == [2, 1, 6]
    assert rows[1]["charged USD"] == str(Decimal(nano(b)) / 10**9)
    (total,) = table(result.output, "id", total=True)
    assert total["id"] == "total: 3 invocations" and total["attempts"] == "9"
    assert Decimal(total["charged USD"]) == Decimal(nano(a) + nano(b) + nano(c)) / 10**9
    assert int(total["credits"]) == a.credits + b.credits + c.credits
    shown = cli("audit", "show", "--db", ledger_file["path"], rows[0]["id"])
    assert shown.exit_code == 0 and c.invocation_id in shown.output


def test_runs_filters_by_tenant_feature_outcome_period_and_limit(
    ledger_file: dict[str, Any],
) -> None:
    """Every filter narrows the list; --limit keeps the newest and says more exist."""
    a, b, c = ledger_file["a"], ledger_file["b"], ledger_file["c"]
    path = ledger_file["path"]

    def ids(*args: str) -> list[str]:
        result = cli("audit", "runs", "--db", path, "--json", *args)
        assert result.exit_code == 0, result.output
        return [row["id"] for row in json.loads(result.output)]

    assert ids("--tenant", "acme") == [c.invocation_id, a.invocation_id]
    assert ids("--feature", "search") == [c.invocation_id, b.invocation_id]
    assert ids("--tenant", "acme", "--feature", "search") == [c.invocation_id]
    assert ids("--since", "2026-02-01", "--until", "2026-02-15") == [b.invocation_id]
    assert ids("--outcome", "completed") == [c.invocation_id, b.invocation_id,
                                             a.invocation_id]
    assert ids("--outcome", "running") == []
    assert ids("--limit", "2") == [c.invocation_id, b.invocation_id]
    limited = cli("audit", "runs", "--db", path, "--limit", "1")
    assert "The newest 1 shown; --limit N or --all shows more." in limited.output
    none = cli("audit", "runs", "--db", path, "--tenant", "initech")
    assert none.exit_code == 0 and none.output == (
        "No invocations from the start until now with tenant initech.\n")
    # The filters that found nothing are named, so an empty answer is not read
    # as an empty ledger.
    narrowed = cli("audit", "spend", "--db", path, "--feature", "nothing",
                   "--outcome", "failed", "--since", "2026-01-01")
    assert narrowed.exit_code == 0 and narrowed.output == (
        "No invocations from 2026-01-01T00:00:00.000000+00:00 until now "
        "with feature nothing, outcome failed.\n")
    bad = cli("audit", "runs", "--db", path, "--outcome", "fine")
    assert bad.exit_code == 2 and "'fine' is not one of" in bad.output


def test_runs_says_there_are_more_only_when_there_are(ledger_file: dict[str, Any]) -> None:
    """Three invocations: --limit 3 shows them all and says nothing of more;
    --limit 2 shows two and says more exist."""
    path = ledger_file["path"]
    every = cli("audit", "runs", "--db", path, "--limit", "3")
    assert every.exit_code == 0 and "total: 3 invocations" in every.output
    assert "shows more" not in every.output
    fewer = cli("audit", "runs", "--db", path, "--limit", "2")
    assert "total: 2 invocations" in fewer.output
    assert "The newest 2 shown; --limit N or --all shows more." in fewer.output


def test_spend_and_accounts_end_with_a_totals_row(ledger_file: dict[str, Any]) -> None:
    """The totals row of `spend` adds up its columns."""
    a, b, c = ledger_file["a"], ledger_file["b"], ledger_file["c"]
    result = cli("audit", "spend", "--db", ledger_file["path"], "--by", "feature")
    assert result.exit_code == 0, result.output
    rows = table(result.output, "feature")
    (total,) = table(result.output, "feature", total=True)
    assert {r["feature"] for r in rows} == {"help", "search"}
    assert total["feature"] == "total" and total["invocations"] == "3"
    assert total["attempts"] == str(sum(int(r["attempts"]) for r in rows)) == "9"
    assert Decimal(total["charged USD"]) == Decimal(nano(a) + nano(b) + nano(c)) / 10**9
    acme = cli("audit", "spend", "--db", ledger_file["path"], "--tenant", "acme", "--json")
    assert [row["tenant"] for row in json.loads(acme.output)] == ["acme"]


def test_export_filters_like_runs_and_writes_csv_by_default(
    ledger_file: dict[str, Any],
) -> None:
    """`export` takes the same filters; without --format it writes CSV."""
    c = ledger_file["c"]
    result = CliRunner().invoke(main, ["audit", "export", "--db", str(ledger_file["path"]),
                                       "--tenant", "acme", "--feature", "search"])
    assert result.exit_code == 0, result.output
    rows = list(csv.DictReader(io.StringIO(result.stdout)))
    assert {r["invocation_id"] for r in rows} == {c.invocation_id} and len(rows) == 2
    assert {r["tenant"] for r in rows} == {"acme"}


def test_output_into_a_closed_pipe_is_a_quiet_exit_0(ledger_file: dict[str, Any]) -> None:
    """A reader that goes away (`| head`) ends the command quietly, as it ends any filter."""
    script = Path(sys.executable).with_name("loopengine")
    for command in (["runs"], ["export", "--format", "jsonl"], ["show", ledger_file["a"]
                                                                .invocation_id]):
        child = subprocess.Popen([str(script), "audit", *command, "--db",
                                  str(ledger_file["path"])],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert child.stdout is not None and child.stderr is not None
        child.stdout.close()  # before the command writes: its first write meets no reader
        assert child.wait(timeout=60) == 0, command
        assert child.stderr.read() == b"", command
        child.stderr.close()


async def test_reconcile_counts_in_the_singular_and_the_plural(
    tmp_path: Path, ledger_file: dict[str, Any]
) -> None:
    """One invocation is "1 invocation", three are "3 invocations"."""
    assert "Checked 3 invocations and 9 attempt rows." in cli(
        "audit", "reconcile", "--db", ledger_file["path"]).output
    one = tmp_path / "one.db"
    await record(one, "2026-01-01", [Reply.text("ok")], operation(), le.Attribution())
    assert "Checked 1 invocation and 1 attempt row." in cli("audit", "reconcile", "--db",
                                                            one).output


def test_schema_is_for_postgresql_only(ledger_file: dict[str, Any]) -> None:
    """--schema on a SQLite file is a one-line refusal (exit 2)."""
    result = cli("audit", "runs", "--db", ledger_file["path"], "--schema", "billing")
    assert result.exit_code == 2
    assert "--schema names a PostgreSQL schema; a SQLite ledger has none" in result.output


async def test_money_under_a_millionth_of_a_dollar_is_plain_decimal_text(
    tmp_path: Path,
) -> None:
    """A cost of 190 nano-USD reads 0.00000019 in every table, JSON and export
    (`str` of its Decimal is 1.9E-7, which a person misreads and an invoice tool
    may not parse)."""
    path = tmp_path / "tiny.db"
    tiny = le.PriceBook([le.ModelPrice(provider="anthropic", model=MODEL,
                                       input_per_mtok=Decimal("0.01"),
                                       output_per_mtok=Decimal("0.01"))])
    clock = FakeClock(wall_start=datetime(2026, 1, 1, tzinfo=UTC))
    with SQLiteLedger(path) as ledger:
        engine = le.Engine(ScriptedProvider([Reply.text("hi", usage=le.Usage(10, 9))],
                                            clock=clock),
                           ledger=ledger, prices=tiny, clock=clock, rng=random.Random(1))
        result = await engine.run(operation(), "go")
    assert result.cost_usd == Decimal("1.9E-7")
    outputs = {" ".join(args): cli("audit", *args, "--db", path) for args in (
        ["runs"], ["runs", "--json"], ["spend"], ["spend", "--json"],
        ["show", result.invocation_id], ["export"], ["export", "--format", "jsonl"])}
    for command, output in outputs.items():
        assert output.exit_code == 0, (command, output.output)
        assert "0.00000019" in output.output, command
        assert "E-" not in output.output, command
    (row,) = json.loads(outputs["spend --json"].output)
    assert (row["cost_usd"], row["provider_cost_usd"]) == ("0.00000019", "0.00000019")
    (exported,) = csv.DictReader(io.StringIO(outputs["export"].output))
    assert exported["cost_usd"] == "0.00000019"


async def test_reconcile_reads_a_now_without_a_time_zone_as_utc(tmp_path: Path) -> None:
    """A paused run with a 60 s pause_timeout: reconcile ``now`` 30 s and 5 min after
    its pause, naive or in UTC, finds it waiting and then late alike (a naive
    ``now`` raised TypeError against the stored pause time)."""

    @le.tool(approval=True)
    async def refund(order: str) -> str:
        """Refund an order."""
        return "refunded"

    path = tmp_path / "ledger.db"
    paused_at = datetime(2026, 1, 13, 1, tzinfo=UTC)
    clock = FakeClock(wall_start=paused_at)
    with SQLiteLedger(path) as ledger:
        engine = le.Engine(ScriptedProvider([Reply.tool_calls(("refund", {"order": "A"}))],
                                            clock=clock),
                           ledger=ledger, clock=clock, run_store=le.RunStore(ledger))
        result = await engine.run(operation(pause_timeout=60), "go", tools=[refund])
    assert result.outcome is le.Outcome.PAUSED
    conn = _audit.open_ledger(path)
    try:
        for after, late in ((30, 0), (300, 1)):
            aware = paused_at + timedelta(seconds=after)
            for now in (aware, aware.replace(tzinfo=None)):
                found = _audit.reconcile(conn, now=now, older_than=timedelta(hours=1))
                assert [p["invocation_id"] for p in found.expired_pauses] == \
                    [result.invocation_id] * late, now
    finally:
        conn.close()
