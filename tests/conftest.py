"""Shared fixtures: a fake clock, an operation and an engine on a scripted provider."""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncIterator, Callable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

import loopengine as le
from loopengine.persistence import MemoryLedger, PostgresLedger, SQLiteLedger
from loopengine.providers import ScriptedProvider
from loopengine.testing import FakeClock

from .postgres_support import PostgresServer, fresh_schema, start_server

MODEL = "claude-sonnet-4-5"

# One USD per million tokens in and out, one credit per micro-dollar: a scripted
# reply of 100 input and 20 output tokens costs 120 credits, easy to reason about.
PRICES = le.PriceBook(
    [le.ModelPrice(provider="anthropic", model=MODEL, input_per_mtok=Decimal(1),
                   output_per_mtok=Decimal(1))],
    credits_per_usd=Decimal(1_000_000),
)


@pytest.fixture
def clock() -> FakeClock:
    """A clock that only moves when slept on."""
    return FakeClock()


def operation(**limits: Any) -> le.Operation:
    """The test operation, with ``limits`` overriding the defaults."""
    retry = limits.pop("retry", le.RetryPolicy())
    return le.Operation(name="test.op", provider="anthropic", model=MODEL,
                        max_output_tokens=512, limits=le.Limits(**limits), retry=retry)


EngineFactory = Callable[..., tuple[le.Engine, ScriptedProvider, MemoryLedger]]


@pytest.fixture
def make_engine(clock: FakeClock) -> EngineFactory:
    """``make_engine(*script, **engine_kwargs) -> (engine, provider, ledger)``."""

    def make(*script: Any, **kwargs: Any) -> tuple[le.Engine, ScriptedProvider, MemoryLedger]:
        provider = ScriptedProvider(list(script), clock=clock)
        ledger = kwargs.pop("ledger", MemoryLedger())
        kwargs.setdefault("prices", PRICES)
        engine = le.Engine(provider, ledger=ledger, clock=clock, rng=random.Random(7), **kwargs)
        return engine, provider, ledger

    return make


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A throwaway PostgreSQL server for the whole session (skips without the
    binaries; fails instead under LOOPENGINE_REQUIRE_POSTGRES=1)."""
    server = start_server()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["memory", "sqlite", "postgres"])
async def each_ledger(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    """Each ledger store in turn (PostgreSQL on the session's throwaway server)."""
    async with _store(request, tmp_path) as store:
        yield store


@pytest.fixture(params=["sqlite", "postgres"])
async def each_database(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    """Each ledger store on a database (those that hold credit accounts) in turn."""
    async with _store(request, tmp_path) as store:
        yield store


@contextlib.asynccontextmanager
async def _store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    """The ledger store ``request.param`` names, open."""
    if request.param == "memory":
        yield MemoryLedger()
    elif request.param == "sqlite":
        with SQLiteLedger(tmp_path / "ledger.db") as store:
            yield store
    else:
        server: PostgresServer = request.getfixturevalue("postgres_server")
        async with PostgresLedger(server.dsn(), schema=fresh_schema()) as store:
            yield store
