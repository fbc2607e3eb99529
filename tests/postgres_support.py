"""A throwaway PostgreSQL server for the tests, started from the system's binaries.

`start_server` runs ``initdb`` and ``pg_ctl start`` in a temporary directory
of its own, listening only on a unix socket in that directory (nothing on the
network), with ``fsync`` and ``synchronous_commit`` on: the durability the
ledger promises is the server's real one. As root it runs the server as the
``postgres`` user (PostgreSQL refuses to run as root), in a directory under
/tmp that user can reach.

Without the binaries (or psycopg) the tests that need a server skip, saying
why; with ``LOOPENGINE_REQUIRE_POSTGRES=1`` (CI) they fail instead, so a run
never passes without them.
"""

from __future__ import annotations

import glob
import importlib
import os
import pwd
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from loopengine.persistence import PostgresLedger
from loopengine.persistence._postgres import APPLICATION_NAME

REQUIRE = "LOOPENGINE_REQUIRE_POSTGRES"


def require_module(name: str) -> Any:
    """Import ``name`` (psycopg) for a test module, skipping the module without it
    unless the environment requires PostgreSQL."""
    if os.environ.get(REQUIRE) == "1":
        return importlib.import_module(name)
    return pytest.importorskip(name, reason=f"{name} is not installed (the postgres extra)")


def _binaries() -> Path | None:
    """The directory holding initdb, pg_ctl and postgres (the newest version)."""
    found = os.environ.get("LOOPENGINE_POSTGRES_BIN")
    candidates = [found] if found else []
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"),
                         key=lambda p: int(p.split("/")[-2]) if p.split("/")[-2].isdigit()
                         else 0, reverse=True)
    which = shutil.which("initdb")
    if which:
        candidates.append(str(Path(which).parent))
    for candidate in candidates:
        if candidate and all((Path(candidate) / name).is_file()
                             for name in ("initdb", "pg_ctl", "postgres")):
            return Path(candidate)
    return None


def unavailable(reason: str) -> None:
    """Skip, or fail when the environment requires PostgreSQL."""
    if os.environ.get(REQUIRE) == "1":
        pytest.fail(f"{REQUIRE}=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@dataclass
class PostgresServer:
    """A running throwaway server."""

    directory: Path
    """Its data directory's parent, and the directory of its socket."""
    bin: Path
    user: str
    """The database superuser (the OS user the server runs as)."""

    def dsn(self, dbname: str = "postgres") -> str:
        """A connection string for ``dbname`` on the socket."""
        return f"host={self.directory} port=5432 user={self.user} dbname={dbname}"

    def connect(self, **kwargs: Any) -> Any:
        """A psycopg connection (autocommit) to the server's ``postgres`` database."""
        import psycopg

        kwargs.setdefault("autocommit", True)
        return psycopg.connect(self.dsn(), **kwargs)

    def create_database(self) -> str:
        """A new empty database's connection string."""
        name = f"db_{uuid.uuid4().hex[:12]}"
        with self.connect() as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.dsn(name)

    def terminate(self, application_name: str) -> int:
        """Kill every backend of ``application_name`` (``pg_terminate_backend``);
        return how many there were."""
        with self.connect() as conn:
            rows = conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = %s AND pid <> pg_backend_pid()", (application_name,),
            ).fetchall()
        return len(rows)

    def stop(self) -> None:
        """Stop the server at once and remove its files."""
        self._run("pg_ctl", "-D", str(self.directory / "data"), "-m", "immediate", "-w", "-s",
                  "stop", check=False)
        shutil.rmtree(self.directory, ignore_errors=True)

    def _run(self, tool: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return _run_as(self.user, [str(self.bin / tool), *args], check=check)


def _run_as(user: str, argv: list[str], *, check: bool) -> subprocess.CompletedProcess[str]:
    kwargs: dict[str, Any] = {}
    if os.geteuid() == 0:
        entry = pwd.getpwnam(user)
        kwargs.update(user=entry.pw_uid, group=entry.pw_gid, extra_groups=[])
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=120,
                          stdin=subprocess.DEVNULL, **kwargs)


def start_server() -> PostgresServer:
    """initdb and start a server in a fresh directory (skips or fails when it cannot)."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        unavailable("psycopg is not installed (the postgres extra)")
    binaries = _binaries()
    if binaries is None:
        unavailable("no PostgreSQL server binaries (initdb, pg_ctl, postgres) found under "
                    "/usr/lib/postgresql/*/bin or on PATH")
    assert binaries is not None
    if os.geteuid() == 0:
        try:
            user = pwd.getpwnam("postgres").pw_name
        except KeyError:
            unavailable("running as root and there is no 'postgres' user to run the server as")
        parent: str | None = "/tmp"  # a root-only temporary directory would shut it out
    else:
        user = pwd.getpwuid(os.geteuid()).pw_name
        parent = None
    directory = Path(tempfile.mkdtemp(prefix="loopengine-pg-", dir=parent))
    if os.geteuid() == 0:
        entry = pwd.getpwnam(user)
        os.chown(directory, entry.pw_uid, entry.pw_gid)
    server = PostgresServer(directory, binaries, user)
    data = directory / "data"
    try:
        # --no-sync: only initdb's own files skip the fsync; the server fsyncs.
        server._run("initdb", "-D", str(data), "-U", user, "-A", "trust", "-E", "UTF8",
                    "--locale=C", "--no-sync", "--no-instructions")
        options = (f"-c listen_addresses='' -k {directory} -c fsync=on "
                   "-c synchronous_commit=on -c max_connections=200")
        server._run("pg_ctl", "-D", str(data), "-w", "-s", "-t", "60", "-o", options,
                    "-l", str(directory / "server.log"), "start")
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as error:
        log = directory / "server.log"
        detail = getattr(error, "stderr", "") or ""
        if log.exists():
            detail += log.read_text(errors="replace")[-2000:]
        server.stop()
        unavailable(f"the PostgreSQL server did not start: {error}\n{detail}")
    return server


def fresh_schema() -> str:
    """A schema name no other test uses."""
    return f"t_{uuid.uuid4().hex[:12]}"


Rows = tuple[dict[str, dict[str, Any]], dict[tuple[str, int], dict[str, Any]]]


def read_postgres(ledger: PostgresLedger) -> Rows:
    """Every invocation and attempt row of a PostgresLedger's tables (as `read_db`)."""
    import psycopg
    from psycopg.rows import dict_row

    with psycopg.connect(ledger.dsn, autocommit=True, row_factory=dict_row) as conn:
        if ledger.schema is not None:
            conn.execute(psycopg.sql.SQL("SET search_path = {}").format(
                psycopg.sql.Identifier(ledger.schema)))
        invocations = {r["id"]: r for r in conn.execute("SELECT * FROM invocations")}
        attempts = {(r["invocation_id"], r["ordinal"]): r
                    for r in conn.execute("SELECT * FROM attempts")}
    return invocations, attempts


async def round_trips(ledger: PostgresLedger,
                      action: Callable[[], Awaitable[Any]]) -> list[list[str]]:
    """What the ledger's writer sent the server while ``action()`` ran, round trip by
    round trip (libpq's trace of its session; a round trip ends with a sync or a
    simple query): each a list of the statements sent, a simple query as
    ``Query <text>``, an extended one as its text (or ``Prepared`` once psycopg
    has prepared it). Call it while the writer is idle."""
    from psycopg import pq

    writer = ledger._writer
    assert writer is not None and writer._conn is not None
    pgconn = writer._conn.pgconn
    with tempfile.TemporaryFile("w+") as trace:
        pgconn.trace(trace.fileno())
        pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        try:
            await action()
        finally:
            pgconn.untrace()
        trace.seek(0)
        lines = trace.read().splitlines()
    trips: list[list[str]] = [[]]
    text: str | None = None
    for line in lines:
        direction, _, message, *rest = line.split("\t")
        detail = rest[0].strip() if rest else ""
        if direction != "F":
            continue
        if message == "Parse":
            text = detail[detail.index('" "') + 3:detail.rindex('"')]
        elif message == "Bind" and text is None:
            text = "Prepared"  # parsed before, under the name it binds
        elif message == "Execute":
            trips[-1].append(text or "")
            text = None
        elif message == "Query":
            trips[-1].append(f"Query {detail.strip(chr(34))}")
        if message in ("Sync", "Query"):
            trips.append([])
    return trips[:-1]  # the last one is still empty


def waits_for_a_lock(postgres_server: PostgresServer, dbname: str) -> None:
    """Return once a ledger's session on ``dbname`` waits for a row another
    session holds; from a thread."""
    give_up = time.monotonic() + 30  # a bound for a hang, not a measure
    while time.monotonic() < give_up:
        with postgres_server.connect() as conn:
            if conn.execute("SELECT 1 FROM pg_stat_activity WHERE application_name = %s "
                            "AND datname = %s AND wait_event_type = 'Lock'",
                            (APPLICATION_NAME, dbname)).fetchall():
                return
        time.sleep(0.01)
    raise AssertionError("the ledger's session never waited for the lock")
