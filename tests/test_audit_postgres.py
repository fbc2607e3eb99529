"""`loopengine audit ... --db postgresql://...` answers what it answers on SQLite:
the same runs recorded in a PostgresLedger and in a SQLiteLedger give the same
spend, reconciliation and export, from the same queries."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from click.testing import CliRunner

import loopengine as le
from loopengine.cli import main
from loopengine.persistence import PostgresLedger, SQLiteLedger
from loopengine.providers import Reply, ScriptedProvider

from .conftest import PRICES, operation
from .ledger_support import lookup, overloaded
from .postgres_support import PostgresServer


def url_of(server: PostgresServer, dbname: str) -> str:
    return (f"postgresql:///{dbname}?host={server.directory}&port=5432"
            f"&user={server.user}")


def audit(*args: str) -> Any:
    return CliRunner().invoke(main, ["audit", *args])


async def record(ledger: Any) -> list[le.RunResult]:
    """The same three runs, on any ledger."""
    results = []
    for n, tenant in enumerate(["acme", "acme", "zenith"]):
        provider = ScriptedProvider([overloaded(), Reply.tool_calls(("lookup", {"key": "k"})),
                                     Reply.text("done")])
        engine = le.Engine(provider, ledger=ledger, prices=PRICES, rng=random.Random(n))
        results.append(await engine.run(operation(), "go", tools=[lookup],
                                        attribution=le.Attribution(tenant=tenant)))
    return results


async def test_the_audit_answers_the_same_on_postgresql_and_sqlite(
    postgres_server: PostgresServer, tmp_path: Path
) -> None:
    dsn = postgres_server.create_database()
    dbname = dsn.rsplit("dbname=", 1)[1]
    async with PostgresLedger(dsn) as pg:
        pg_runs = await record(pg)
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as lite:
        await record(lite)
    url = url_of(postgres_server, dbname)
    for command in (["spend", "--by", "tenant"], ["spend", "--by", "model", "--json"],
                    ["reconcile"], ["reconcile", "--older-than", "1h"]):
        on_pg, on_sqlite = audit(*command, "--db", url), audit(*command, "--db", str(path))
        assert on_pg.exit_code == on_sqlite.exit_code == 0, (command, on_pg.output)
        assert on_pg.output == on_sqlite.output, command
    shown = audit("show", pg_runs[0].invocation_id, "--db", url, "--json")
    assert shown.exit_code == 0, shown.output
    record_ = json.loads(shown.output)
    assert record_["invocation"]["id"] == pg_runs[0].invocation_id
    assert [a["outcome"] for a in record_["attempts"]] == ["error", "ok", "ok"]
    assert record_["invocation"]["started_at"].endswith("+00:00")
    by_prefix = audit("show", pg_runs[1].invocation_id[:13], "--db", url, "--json")
    assert json.loads(by_prefix.output)["invocation"]["id"] == pg_runs[1].invocation_id
    exported = audit("export", "--format", "jsonl", "--db", url)
    lines = [json.loads(line) for line in exported.output.splitlines()]
    assert exported.exit_code == 0 and len(lines) == 9


def test_a_bad_postgresql_url_is_one_line_and_exit_2(postgres_server: PostgresServer) -> None:
    """An unreachable server, or a database without a ledger: exit 2, one line, and
    never the password."""
    unreachable = audit("spend", "--db", "postgresql://me:s3cret@127.0.0.1:1/nothing")
    assert unreachable.exit_code == 2
    assert "cannot connect" in unreachable.output and "s3cret" not in unreachable.output
    # libpq's two lines ("Connection refused", a tab, "Is the server running...")
    # read as words, not as the escapes \x0a\x09 of the one-line error.
    assert "\\x0a" not in unreachable.output and "\\x09" not in unreachable.output
    empty = postgres_server.create_database().rsplit("dbname=", 1)[1]
    no_ledger = audit("reconcile", "--db", url_of(postgres_server, empty))
    assert no_ledger.exit_code == 2 and "holds no loopengine ledger" in no_ledger.output


async def test_a_ledger_in_its_own_schema_is_audited_with_schema(
    postgres_server: PostgresServer,
) -> None:
    """--schema names the ledger's schema (the URL's search_path works too); without
    it the database's default search path holds no ledger, and the message says so."""
    from .postgres_support import fresh_schema

    dsn = postgres_server.create_database()
    dbname = dsn.rsplit("dbname=", 1)[1]
    schema = fresh_schema()
    async with PostgresLedger(dsn, schema=schema) as pg:
        await record(pg)
    url = url_of(postgres_server, dbname)
    for args in (["--schema", schema], ["--db", url + f"&options=-csearch_path%3D{schema}"]):
        result = audit("spend", "--by", "tenant", "--db", url, "--json", *args)
        assert result.exit_code == 0, result.output
        assert {row["tenant"] for row in json.loads(result.output)} == {"acme", "zenith"}
    runs = audit("runs", "--db", url, "--schema", schema, "--tenant", "acme", "--json")
    assert [row["tenant"] for row in json.loads(runs.output)] == ["acme", "acme"]
    missing = audit("runs", "--db", url, "--schema", schema + "_x")
    assert missing.exit_code == 2
    assert f"holds no loopengine ledger in schema {schema}_x" in missing.output


async def test_runs_and_filters_answer_the_same_on_postgresql_and_sqlite(
    postgres_server: PostgresServer, tmp_path: Path
) -> None:
    """`runs`, its filters and totals, and the filtered export, read on the server."""
    dsn = postgres_server.create_database()
    async with PostgresLedger(dsn) as pg:
        pg_runs = await record(pg)
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as lite:
        await record(lite)
    url = url_of(postgres_server, dsn.rsplit("dbname=", 1)[1])
    for command in (["runs"], ["runs", "--tenant", "zenith"], ["runs", "--outcome", "running"],
                    ["spend", "--tenant", "acme"], ["accounts"]):
        on_pg, on_sqlite = audit(*command, "--db", url), audit(*command, "--db", str(path))
        assert on_pg.exit_code == on_sqlite.exit_code == 0, (command, on_pg.output)
        # The ids differ between the two stores; everything else is the same.
        assert on_pg.output.count("\n") == on_sqlite.output.count("\n"), command
    listed = json.loads(audit("runs", "--db", url, "--json", "--limit", "1").output)
    assert [row["id"] for row in listed] == [pg_runs[-1].invocation_id]
    assert listed[0]["attempt_count"] == 3 and listed[0]["started_at"].endswith("+00:00")
    total = audit("runs", "--db", url).output.splitlines()[-1]
    assert total.startswith("total: 3 invocations") and " 9 " in total
    exported = audit("export", "--db", url, "--tenant", "zenith")
    assert exported.exit_code == 0 and len(exported.output.splitlines()) == 1 + 3


def test_the_demo_writes_to_postgresql_and_reconcile_reads_it(
    postgres_server: PostgresServer,
) -> None:
    """`loopengine demo --db postgresql://...` records its run in PostgreSQL, and
    `audit reconcile` on the same URL finds everything reconciled."""
    dbname = postgres_server.create_database().rsplit("dbname=", 1)[1]
    url = url_of(postgres_server, dbname)
    ran = CliRunner().invoke(main, ["demo", "--db", url])
    assert ran.exit_code == 0, ran.output
    assert "Outcome:  completed" in ran.output and "Attempts recorded in postgresql" in ran.output
    checked = audit("reconcile", "--db", url)
    assert checked.exit_code == 0, checked.output
    assert "Checked 1 invocation and " in checked.output
    assert "Everything reconciles." in checked.output


def test_a_strange_schema_name_is_one_line_and_exit_2(postgres_server: PostgresServer) -> None:
    """A schema name is quoted as an identifier: a name with quotes, spaces or a NUL
    finds no ledger or is refused, in one line (exit 2), never as SQL."""
    url = url_of(postgres_server, postgres_server.create_database().rsplit("dbname=", 1)[1])
    for schema in ('x"; DROP TABLE invocations; --', "a b", "nul\0here"):
        result = audit("runs", "--db", url, "--schema", schema)
        assert result.exit_code == 2, (schema, result.output)
        assert "bug in loopengine" not in result.output
        assert len(result.output.strip().splitlines()) == 1


def test_a_postgresql_ledger_older_than_delegation_and_the_usage_vector_is_audited(
        postgres_server: PostgresServer) -> None:
    """A version-5 ledger (no parent_invocation_id, no usage vector columns, no run
    tables) is read as SQLite reads one, not refused: through temporary views
    that supply the later columns, the ledger itself left as it is."""
    import psycopg

    from loopengine.persistence._postgres_schema import MIGRATIONS, migrate

    dsn = postgres_server.create_database()
    dbname = dsn.rsplit("dbname=", 1)[1]
    with psycopg.connect(dsn) as conn:
        migrate(conn, schema=None, name="old", migrations=MIGRATIONS[:5])
        conn.execute("INSERT INTO invocations (id, operation, operation_version, provider, "
                     "model, tenant, started_at, outcome, credits) VALUES ('old-1', 'op', "
                     "'1', 'anthropic', 'm', 'acme', '2026-01-01T00:00:00+00:00', "
                     "'completed', 7)")
        conn.commit()
    url = url_of(postgres_server, dbname)
    shown = audit("show", "old-1", "--db", url, "--json")
    assert shown.exit_code == 0, shown.output
    record_ = json.loads(shown.output)
    assert record_["children"] == [] and record_["invocation"]["web_search_requests"] == 0
    rolled = audit("spend", "--roll-up", "--json", "--db", url)
    assert rolled.exit_code == 0, rolled.output
    assert [(r["tenant"], r["credits"]) for r in json.loads(rolled.output)] == [("acme", 7)]
    reconciled = audit("reconcile", "--db", url)
    assert reconciled.exit_code == 0, reconciled.output
    exported = audit("export", "--format", "jsonl", "--db", url)
    assert exported.exit_code == 0, exported.output
    with psycopg.connect(dsn) as conn:  # the ledger is as it was
        assert conn.execute("SELECT MAX(version) FROM loopengine_schema").fetchone()[0] == 5
