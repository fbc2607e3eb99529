"""Several processes writing one PostgreSQL ledger at once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .postgres_support import PostgresServer, fresh_schema, require_module

psycopg = require_module("psycopg")

CHILD = Path(__file__).with_name("postgres_child.py")

pytestmark = pytest.mark.slow


def test_four_processes_write_one_database(
    postgres_server: PostgresServer, tmp_path: Path
) -> None:
    """4 processes x 50 concurrent runs through the SDK (each with a retried
    overload) on one new schema: no lost, duplicated or unsettled row, no
    deadlock, every invocation's totals equal its attempts' sums, and the tokens
    equal what each process's FakeAnthropicServer put on the wire."""
    schema, go = fresh_schema(), tmp_path / "go"
    # -P: the script's directory (tests/) must not shadow installed packages.
    children = [subprocess.Popen([sys.executable, "-P", str(CHILD), postgres_server.dsn(),
                                  schema, "50", f"p{n}", str(go)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for n in range(4)]
    try:
        for child in children:
            assert child.stdout is not None
            line = child.stdout.readline().strip()
            assert line == "READY", (line, child.stderr.read() if child.stderr else "")
        go.touch()  # every child starts writing now
        outputs = [child.communicate(timeout=120) for child in children]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.communicate()
    served = [0, 0]
    for child, (out, err) in zip(children, outputs, strict=True):
        assert child.returncode == 0, err
        assert "deadlock" not in err and out.startswith("DONE"), (out, err)
        _, _, served_in, served_out = out.split()
        served[0] += int(served_in)
        served[1] += int(served_out)

    with psycopg.connect(postgres_server.dsn(), autocommit=True) as conn:
        conn.execute(psycopg.sql.SQL("SET search_path = {}").format(
            psycopg.sql.Identifier(schema)))
        counts = conn.execute(
            "SELECT count(*), count(DISTINCT tenant), "
            "count(*) FILTER (WHERE outcome = 'completed' AND attempt_count = 3 "
            "AND attempts_retained = 3 AND incomplete = 0), "
            "sum(input_tokens), sum(output_tokens) FROM invocations").fetchone()
        assert counts == (200, 4, 200, served[0], served[1])
        attempts = conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE outcome = 'dispatched'), "
            "count(DISTINCT (invocation_id, ordinal)), sum(input_tokens) FROM attempts"
        ).fetchone()
        assert attempts == (600, 0, 600, served[0])
        # Every invocation reconciles: its totals are its attempts' sums.
        mismatched = conn.execute(
            "SELECT i.id FROM invocations i JOIN attempts a ON a.invocation_id = i.id "
            "GROUP BY i.id, i.input_tokens, i.output_tokens, i.cost_nanousd, "
            "i.provider_cost_nanousd, i.attempt_count "
            "HAVING i.input_tokens <> coalesce(sum(a.input_tokens), 0) "
            "OR i.output_tokens <> coalesce(sum(a.output_tokens), 0) "
            "OR i.cost_nanousd <> coalesce(sum(a.cost_nanousd) FILTER (WHERE a.charged = 1), 0) "
            "OR i.provider_cost_nanousd <> coalesce(sum(a.cost_nanousd), 0) "
            "OR i.attempt_count <> count(*)").fetchall()
        assert mismatched == []
