"""A process that forks the runs of the recovery tests (run as a module, not collected).

``python -m tests.recovery_child``: imports loopengine and both SDKs once,
then reads one JSON command a line from stdin and runs each in a forked
child (tens of milliseconds, where a fresh interpreter takes a second), so a
test can kill or race many processes quickly. Children are reaped
automatically. Every line a child prints starts with its command's ``tag``
and is written in one ``write`` (lines of children never interleave).

Commands (``db`` is ``{"sqlite": path}`` or ``{"postgres": dsn, "schema": name}``):

* ``{"op": "crash", "tag", "vendor", "url", "db", "log"}``: run a
  conversation whose batch calls ``charge`` (not idempotent) and ``lookup``
  (idempotent). Each handler appends ``start <tool> <invocation id>`` to the
  file ``log`` and prints ``TAG started <tool> <invocation id>``, waits a
  random moment, appends ``effect <tool> <invocation id>``, then waits to be
  killed.
* ``{"op": "wire", "tag", "vendor", "url", "db", "log", "mode"}``: run a
  conversation with the tool ``charge`` (which appends ``effect charge <invocation
  id>`` to ``log``). ``mode`` ``request``: print ``TAG sent <invocation id>``
  as each attempt goes out (its row durable), to be killed while the server
  holds the reply; ``settled``: once turn 1's reply is settled (durable,
  before the run's checkpoint), print ``TAG settled <invocation id>`` and
  wait there to be killed.
* ``{"op": "delegate", "tag", "vendor", "url", "db"}``: run ``parent.op``
  (credit hold 5000, accounted to tenant ``acme``) with the sub-agent tool
  ``helper`` (``child.op``), whose own sub-agent tool ``inner``
  (``grandchild.op``) calls ``dig``, which prints ``TAG started <grandchild
  id>`` and waits to be killed.
* ``{"op": "resume", "tag", "vendor", "url", "db", "log", "run", "decisions",
  "go"}``: print ``TAG ready`` and wait until the file ``go`` exists (when
  ``go`` is given), then resume the run ``run`` from the run store alone,
  with ``decisions`` (``{call_id: "approve"}``) and the tool ``send``
  (approval needed), which appends ``send <invocation id>`` to ``log``.
  Prints ``TAG result {json}`` or ``TAG busy``.

The parent prints ``helper ready`` once it has imported everything, then
``TAG pid N`` for each child.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import tempfile
import time
from decimal import Decimal
from typing import Any

import anyio
import httpx2

import loopengine as le
from loopengine import events
from loopengine.persistence import MemoryLedger, PostgresLedger, SQLiteLedger
from loopengine.providers import AnthropicProvider, OpenAIProvider, Provider

MODELS = {"anthropic": "claude-sonnet-4-5", "openai": "gpt-4o-mini"}


def say(tag: str, text: str) -> None:
    os.write(1, f"{tag} {text}\n".encode())


def note(log: str, line: str) -> None:
    with open(log, "a", encoding="utf-8") as out:
        out.write(line + "\n")


def operation(vendor: str) -> le.Operation:
    return le.Operation(name="recovery.op", provider=vendor, model=MODELS[vendor],
                        max_output_tokens=256, limits=le.Limits(total_time=300.0))


def parts(command: dict[str, Any]) -> tuple[Provider, Any, le.PriceBook]:
    vendor = command["vendor"]
    provider: Provider = (AnthropicProvider(api_key="test-key", base_url=command["url"],
                                            http_client=httpx2.AsyncClient(verify=False))
                          if vendor == "anthropic"
                          else OpenAIProvider(api_key="test-key", base_url=command["url"]))
    db = command["db"]
    ledger: Any = (None if not db else SQLiteLedger(db["sqlite"]) if "sqlite" in db
                   else PostgresLedger(db["postgres"], schema=db["schema"]))
    prices = le.PriceBook([le.ModelPrice(provider=vendor, model=MODELS[vendor],
                                         input_per_mtok=Decimal(1), output_per_mtok=Decimal(1))],
                          credits_per_usd=Decimal(1_000_000))
    return provider, ledger, prices


async def crash(command: dict[str, Any]) -> None:
    tag, log = command["tag"], command["log"]

    async def work(tool: str, ctx: le.ToolContext) -> str:
        note(log, f"start {tool} {ctx.invocation_id}")
        say(tag, f"started {tool} {ctx.invocation_id}")
        await anyio.sleep(random.uniform(0.0, 0.01))
        note(log, f"effect {tool} {ctx.invocation_id}")
        await anyio.sleep(60)  # killed meanwhile
        return "unreachable"

    @le.tool
    async def charge(card: str, ctx: le.ToolContext) -> str:
        """Charge a card."""
        return await work("charge", ctx)

    @le.tool(idempotent=True)
    async def lookup(card: str, ctx: le.ToolContext) -> str:
        """Look a card up."""
        return await work("lookup", ctx)

    provider, ledger, prices = parts(command)
    engine = le.Engine(provider, ledger=ledger, prices=prices, run_store=le.RunStore(ledger))
    await engine.run(operation(command["vendor"]), "pay", tools=[charge, lookup])


async def wire(command: dict[str, Any]) -> None:
    tag, log, mode = command["tag"], command["log"], command["mode"]

    async def watch(event: object) -> None:
        if mode == "request" and isinstance(event, events.AttemptStarted):
            say(tag, f"sent {event.run_id}")
        if (mode == "settled" and isinstance(event, events.AttemptSettled)
                and event.turn == 1):
            say(tag, f"settled {event.run_id}")
            await anyio.sleep(60)  # killed meanwhile

    @le.tool
    def charge(card: str, ctx: le.ToolContext) -> str:
        """Charge a card."""
        note(log, f"effect charge {ctx.invocation_id}")
        return f"charged {card}"

    provider, ledger, prices = parts(command)
    engine = le.Engine(provider, ledger=ledger, prices=prices, run_store=le.RunStore(ledger),
                       observers=[watch])
    await engine.run(operation(command["vendor"]), "pay", tools=[charge])


async def delegate(command: dict[str, Any]) -> None:
    tag, vendor = command["tag"], command["vendor"]

    @le.tool
    async def dig(key: str, ctx: le.ToolContext) -> str:
        """Dig a key up."""
        say(tag, f"started {ctx.invocation_id}")
        await anyio.sleep(60)  # killed meanwhile
        return "unreachable"

    def named(name: str, **limits: Any) -> le.Operation:
        base = operation(vendor)
        return le.Operation(name=name, provider=vendor, model=base.model,
                            max_output_tokens=base.max_output_tokens,
                            limits=le.Limits(total_time=300.0, **limits))

    provider, ledger, prices = parts(command)
    engine = le.Engine(provider, ledger=ledger, prices=prices, run_store=le.RunStore(ledger),
                       accounts=le.CreditAccounts(ledger))
    inner = le.agent_tool(engine, named("grandchild.op"), name="inner", description="Digs.",
                          tools=[dig])
    helper = le.agent_tool(engine, named("child.op"), name="helper", description="Helps.",
                           tools=[inner])
    await engine.run(named("parent.op", credit_hold=5000), "go", tools=[helper],
                     attribution=le.Attribution(tenant="acme"))


def wait_for(path: str) -> None:
    """Return once ``path`` exists (polled: the racers leave together)."""
    give_up = time.monotonic() + 30
    while not os.path.exists(path) and time.monotonic() < give_up:
        time.sleep(0.0005)


async def resume(command: dict[str, Any]) -> None:
    tag, log = command["tag"], command["log"]

    @le.tool(approval=True)
    def send(to: str, ctx: le.ToolContext) -> str:
        """Send the message to someone."""
        note(log, f"send {ctx.invocation_id}")
        return f"sent to {to}"

    provider, ledger, prices = parts(command)
    engine = le.Engine(provider, ledger=ledger, prices=prices, run_store=le.RunStore(ledger))
    go = command.get("go")
    if go is not None:
        # Both racers wait here until the test has seen both ready.
        say(tag, "ready")
        wait_for(go)
    try:
        result = await engine.resume(
            command["run"], tools=[send],
            decisions={call: le.Approve() for call in command.get("decisions", ())})
    except le.RunBusyError:
        say(tag, "busy")
        return
    finally:
        await provider.aclose()  # type: ignore[attr-defined]
    say(tag, "result " + json.dumps({
        "outcome": result.outcome.value, "invocation_id": result.invocation_id,
        "turns": result.turns, "tool_calls": result.tool_calls,
        "attempts": result.attempts.count, "answer": result.answer}))
    ledger.close()


async def warm_up() -> None:
    """Build an engine on each provider once, so the modules imported lazily
    are imported here, once, and not in every child."""
    for vendor in MODELS:
        provider, _, prices = parts({"vendor": vendor, "url": "http://127.0.0.1:9", "db": {}})
        ledger = MemoryLedger()
        le.Engine(provider, ledger=ledger, prices=prices, run_store=le.RunStore(ledger))
        await provider.aclose()  # type: ignore[attr-defined]
    for name in le.__all__:
        getattr(le, name)
    import psycopg  # noqa: F401  (PostgresLedger imports it when it connects)

    import loopengine.persistence._postgres_schema  # noqa: F401

    with tempfile.TemporaryDirectory() as folder:
        with SQLiteLedger(os.path.join(folder, "warm.db")) as ledger:
            await le.RunStore(ledger).load("none")


def main() -> None:
    anyio.run(warm_up)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children reap themselves
    say("helper", "ready")
    for line in sys.stdin:
        command = json.loads(line)
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            code = 0
            try:
                anyio.run({"crash": crash, "delegate": delegate, "resume": resume,
                           "wire": wire}[command["op"]],
                          command)
            except BaseException as error:  # reported, then the child exits
                say(command["tag"], f"error {error!r}")
                code = 1
            finally:
                os._exit(code)
        say(command["tag"], f"pid {pid}")


if __name__ == "__main__":
    main()
