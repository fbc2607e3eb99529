"""Sub-agents (docs/tools.md): a tool whose handler runs a child conversation inside the
calling run's budgets: its credit hold, its deadline, its account reservation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

import loopengine as le
from loopengine import audit, events
from loopengine.persistence import MemoryLedger, SQLiteLedger
from loopengine.providers import ScriptedProvider
from loopengine.testing import ErrorReply, FakeClock, Reply

from ..conftest import PRICES, operation
from .conftest import Route

ACME = le.Attribution(tenant="acme", feature="research")


def spend(credits: int) -> le.Usage:
    """A reply's usage worth ``credits`` on the tests' prices (one credit per token)."""
    return le.Usage(input_tokens=credits - 10, output_tokens=10)


@le.tool
def lookup(key: str) -> str:
    """Look a key up."""
    return key.upper()


def last_results(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tool results of a transcript's last message."""
    return [b for b in messages[-1]["content"] if b.get("type") == "tool_result"]


async def test_a_child_is_held_to_what_its_parent_has_left_and_the_account_settles_the_tree(
    route: Route, tmp_path: Path,
) -> None:
    """Parent hold 100, child that would spend 300: the child stops at the 60 its
    parent had left (its crossing turn billed, R03), the parent ends credit_limit
    without another turn, credits_total is 40 + 100, each row keeps its own, one
    reservation is settled once with the tree's 140, and the audit reconciles."""
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as ledger:
        accounts = le.CreditAccounts(ledger)
        await accounts.grant("acme", 1000)
        engine, _ = route.wire.engine(
            Reply.tool_calls(("researcher", {"task": "dig"}), usage=spend(40)),
            # The child: six turns of 50 would be 300.
            *[Reply.tool_calls(("lookup", {"key": str(i)}), usage=spend(50)) for i in range(6)],
            ledger=ledger, accounts=accounts)
        researcher = le.agent_tool(engine, route.named("child.op", credit_hold=300),
                                   name="researcher", description="Researches a task.",
                                   tools=[lookup])
        result = await engine.run(route.named("parent.op", credit_hold=100), "go",
                                  tools=[researcher], attribution=ACME)
        balance = await accounts.balance("acme")
    assert result.outcome is le.Outcome.CREDIT_LIMIT
    assert (result.credits, result.credits_total) == (40, 140)
    assert len(route.wire.requests) == 3  # parent, then the child's two turns; no more
    [refusal] = last_results(result.messages)
    assert refusal["is_error"] and "credit_limit" in str(refusal["content"])
    conn = audit.open_ledger(path)
    try:
        rows = {r["operation"]: dict(r) for r in conn.execute(
            "SELECT id, operation, outcome, credits, turns, parent_invocation_id, tenant, "
            "feature FROM invocations")}
        entries = [tuple(r) for r in conn.execute(
            "SELECT kind, credits, invocation_id FROM account_entries WHERE kind != 'grant' "
            "ORDER BY id")]
        report = audit.reconcile(conn)
    finally:
        conn.close()
    parent, child = rows["parent.op"], rows["child.op"]
    assert (parent["credits"], parent["parent_invocation_id"]) == (40, None)
    assert (child["outcome"], child["credits"], child["turns"]) == ("credit_limit", 100, 2)
    assert child["parent_invocation_id"] == parent["id"] == result.invocation_id
    assert (child["tenant"], child["feature"]) == ("acme", "research")
    assert entries == [("reserve", 100, parent["id"]), ("settle", 140, parent["id"]),
                       ("release", 100, parent["id"])]
    assert (balance.spent, balance.reserved, balance.available) == (140, 0, 860)
    assert report.ok, report


@pytest.mark.parametrize("limit", ["turn_limit", "time_limit"])
async def test_a_child_ending_on_a_limit_is_an_error_result_and_the_parent_goes_on(
    route: Route, limit: str,
) -> None:
    """A child that runs out of turns or time gives the parent's model an is_error
    result naming the limit; the parent's next turn answers."""
    clock = route.wire.clock

    @le.tool
    async def slow(key: str) -> str:
        """Takes a minute."""
        await clock.sleep(60)
        return key

    child_limits: dict[str, Any] = ({"max_turns": 1} if limit == "turn_limit"
                                    else {"total_time": 5.0})
    engine, ledger = route.wire.engine(
        Reply.tool_calls(("helper", {"task": "try"})),
        Reply.tool_calls(("slow", {"key": "a"})),
        Reply.text("done without help"))
    helper = le.agent_tool(engine, route.named("child.op", **child_limits), name="helper",
                           description="Helps.", tools=[slow])
    result = await engine.run(route.named("parent.op"), "go", tools=[helper])
    assert result.outcome is le.Outcome.COMPLETED and result.answer == "done without help"
    [answered] = last_results(result.messages[:3])
    assert answered["is_error"] and limit in answered["content"]
    assert limit in str(route.wire.requests[2].messages[-1])  # what the model was sent
    child = next(r for r in ledger.invocations.values() if r["operation"] == "child.op")
    assert child["outcome"] == limit and child["parent_invocation_id"] == result.invocation_id


async def test_a_child_ending_another_way_tells_the_parent_s_model_its_outcome(
    route: Route,
) -> None:
    """A child whose request fails, and one cut off at its token limit: the
    parent's model gets an is_error result naming each outcome (a limit is
    called one; these are not), and the parent goes on."""
    engine, ledger = route.wire.engine(
        Reply.tool_calls(("helper", {"task": "a"})),
        ErrorReply(status=400, message="malformed"),
        Reply.tool_calls(("helper", {"task": "b"})),
        Reply.text("half an ans", stop_reason="max_tokens"),
        Reply.text("done without help"))
    helper = le.agent_tool(engine, route.named("child.op"), name="helper",
                           description="Helps.")
    result = await engine.run(route.named("parent.op"), "go", tools=[helper])
    assert result.outcome is le.Outcome.COMPLETED and result.answer == "done without help"
    [failed] = last_results(result.messages[:3])
    [cut] = last_results(result.messages[:5])
    assert failed["is_error"] and cut["is_error"]
    assert failed["content"].startswith("helper ended provider_error without an answer: ")
    assert cut["content"].startswith("helper ended incomplete without an answer: ")
    assert sorted(r["outcome"] for r in ledger.invocations.values()
                  if r["operation"] == "child.op") == ["incomplete", "provider_error"]


@pytest.mark.parametrize("inner_depth", [1, 3], ids=["same", "wider-inner"])
async def test_nesting_past_max_depth_is_an_error_result_and_sends_nothing(
    route: Route, inner_depth: int,
) -> None:
    """max_depth=1 on the outer delegate: the child may run, its own delegate
    (depth 2) is refused with an is_error result, and no request is sent for
    it; also when that inner delegate allows three levels (``wider-inner``):
    a delegate's bound is narrowed to its ancestors', so the grandchild, 2
    deep, is past the bound the outer call set."""
    engine, ledger = route.wire.engine(
        Reply.tool_calls(("outer", {"task": "a"})),      # parent
        Reply.tool_calls(("inner", {"task": "b"})),      # child, depth 1
        Reply.text("child gave up on nesting"),          # child
        Reply.text("all done"))                          # parent
    inner = le.agent_tool(engine, route.named("grandchild.op"), name="inner",
                          description="Nested.", max_depth=inner_depth)
    outer = le.agent_tool(engine, route.named("child.op"), name="outer",
                          description="Delegates.", tools=[inner], max_depth=1)
    result = await engine.run(route.named("parent.op"), "go", tools=[outer])
    assert result.outcome is le.Outcome.COMPLETED and result.answer == "all done"
    assert len(route.wire.requests) == 4
    assert "max_depth=1" in str(route.wire.requests[2].messages[-1])
    assert sorted(r["operation"] for r in ledger.invocations.values()) == ["child.op",
                                                                          "parent.op"]


async def test_cancelling_the_parent_cancels_the_child_and_records_both_cancelled(
    route: Route,
) -> None:
    """The caller cancels while the child's tool runs: the child and the parent are
    both recorded cancelled, and the cancellation propagates."""
    started = anyio.Event()

    @le.tool
    async def forever(key: str) -> str:
        """Never returns."""
        started.set()
        await anyio.sleep_forever()
        return key

    engine, ledger = route.wire.engine(
        Reply.tool_calls(("helper", {"task": "wait"})),
        Reply.tool_calls(("forever", {"key": "a"})))
    helper = le.agent_tool(engine, route.named("child.op"), name="helper",
                           description="Waits.", tools=[forever])
    async with anyio.create_task_group() as group:
        group.start_soon(lambda: engine.run(route.named("parent.op"), "go", tools=[helper]))
        await started.wait()
        group.cancel_scope.cancel()
    outcomes = {r["operation"]: r["outcome"] for r in ledger.invocations.values()}
    assert outcomes == {"parent.op": "cancelled", "child.op": "cancelled"}


def test_the_context_parameter_is_not_shown_to_the_model() -> None:
    """A handler's le.ToolContext parameter is left out of the tool's input schema."""

    @le.tool
    async def who(key: str, ctx: le.ToolContext) -> str:
        """Says who called."""
        return ctx.invocation_id

    assert list(who.input_schema["properties"]) == ["key"]
    assert who.context_parameter == "ctx"


async def test_a_handler_gets_its_call_s_context(route: Route) -> None:
    """ctx carries the run's id, the call's id, the attribution, the deadline and a
    key stable for the call."""
    seen: list[le.ToolContext] = []

    @le.tool
    def who(key: str, ctx: le.ToolContext) -> str:
        """Says who called."""
        seen.append(ctx)
        return ctx.idempotency_key

    engine, _ = route.wire.engine(Reply.tool_calls(("who", {"key": "a"})), Reply.text("ok"))
    result = await engine.run(route.named("parent.op", total_time=30.0), "go", tools=[who],
                              attribution=ACME)
    [ctx] = seen
    assert ctx.invocation_id == result.invocation_id and ctx.attribution == ACME
    assert ctx.call_id and ctx.deadline == pytest.approx(route.wire.clock.now() + 30, abs=30)
    assert len(ctx.idempotency_key) == 64 and ctx.idempotency_key == seen[0].idempotency_key


async def test_an_input_model_s_fields_reach_the_child_as_json(route: Route) -> None:
    """With input_model, the model fills its fields and the child gets them as JSON text."""
    import pydantic

    class Question(pydantic.BaseModel):
        topic: str
        depth: int

    engine, _ = route.wire.engine(
        Reply.tool_calls(("ask", {"topic": "passwords", "depth": 2})),
        Reply.text("child answer"), Reply.text("parent answer"))
    ask = le.agent_tool(engine, route.named("child.op"), name="ask",
                        description="Asks.", input_model=Question)
    assert set(ask.input_schema["properties"]) == {"topic", "depth"}
    result = await engine.run(route.named("parent.op"), "go", tools=[ask])
    assert result.answer == "parent answer"
    assert '{"topic":"passwords","depth":2}' in str(route.wire.requests[1].messages[0])
    [answered] = last_results(result.messages[:3])
    assert answered["content"] == "child answer" and not answered.get("is_error")


async def test_an_agent_tool_on_another_ledger_is_refused_at_run_start(
    route: Route, tmp_path: Path,
) -> None:
    """agent_tool's engine records on another ledger than the run given the tool: the
    run is refused before anything is recorded or sent, naming both ledgers (the
    tree's rows could not be audited, rolled up or reconciled)."""
    engine, ledger = route.wire.engine()
    with SQLiteLedger(tmp_path / "other.db") as other:
        elsewhere = le.Engine(engine.providers, ledger=other, prices=engine.prices)
        helper = le.agent_tool(elsewhere, route.named("child.op"), name="helper",
                               description="Helps.")
        assert helper.delegates_to is elsewhere
        with pytest.raises(le.ConfigError) as raised:
            await engine.run(route.named("parent.op"), "go", tools=[helper])
    assert raised.value.field == "tools"
    assert "SQLiteLedger(" in str(raised.value) and "MemoryLedger(" in str(raised.value)
    assert ledger.invocations == {} and route.wire.requests == []
    # An engine recording nothing is no better: its child rows would be missing.
    unrecorded = le.agent_tool(le.Engine(engine.providers, prices=engine.prices),
                               route.named("child.op"), name="helper", description="Helps.")
    with pytest.raises(le.ConfigError, match="parent's ledger"):
        await engine.run(route.named("parent.op"), "go", tools=[unrecorded])


async def test_a_nested_agent_tool_on_another_ledger_is_refused_when_built(
    route: Route, tmp_path: Path,
) -> None:
    """A delegate's own delegate recording on another ledger (or counting credits in
    other units) is refused when the outer agent_tool is built, naming both:
    otherwise the root would run and spend, and only the model would learn of the
    mistake, from an is_error result, once it delegated."""
    engine, ledger = route.wire.engine()
    with SQLiteLedger(tmp_path / "other.db") as other:
        elsewhere = le.Engine(engine.providers, ledger=other, prices=engine.prices)
        inner = le.agent_tool(elsewhere, route.named("grandchild.op"), name="inner",
                              description="Nested.")
        with pytest.raises(le.ConfigError, match="parent's ledger") as raised:
            le.agent_tool(engine, route.named("child.op"), name="outer",
                          description="Delegates.", tools=[inner])
    assert raised.value.field == "tools"
    assert "SQLiteLedger(" in str(raised.value) and "MemoryLedger(" in str(raised.value)
    coarser = le.PriceBook(list(engine.prices.prices),
                           credits_per_usd=engine.prices.credits_per_usd, credit_quantum=10)
    inner = le.agent_tool(le.Engine(engine.providers, ledger=ledger, prices=coarser),
                          route.named("grandchild.op"), name="inner", description="Nested.")
    with pytest.raises(le.ConfigError, match="counts credits at"):
        le.agent_tool(engine, route.named("child.op"), name="outer",
                      description="Delegates.", tools=[inner])
    assert ledger.invocations == {} and route.wire.requests == []


async def test_a_delegated_run_counting_credits_in_other_units_is_refused(
    route: Route,
) -> None:
    """A child engine whose PriceBook counts credits at another rate (or quantum)
    would add its spend to the parent's hold and account in another currency (a
    thousandth of it here): an agent_tool on it is refused at run start, and
    ctx.run on it at that call (an is_error result), before anything is sent."""
    engine, ledger = route.wire.engine(
        Reply.tool_calls(("delegate", {"task": "x"})), Reply.text("done alone"))
    cheaper = le.PriceBook(list(engine.prices.prices),
                           credits_per_usd=engine.prices.credits_per_usd / 1000)
    coarser = le.PriceBook(list(engine.prices.prices),
                           credits_per_usd=engine.prices.credits_per_usd, credit_quantum=10)
    for prices in (cheaper, coarser):
        other = le.Engine(engine.providers, ledger=ledger, prices=prices)
        helper = le.agent_tool(other, route.named("child.op"), name="helper",
                               description="Helps.")
        with pytest.raises(le.ConfigError, match="counts credits at") as raised:
            await engine.run(route.named("parent.op"), "go", tools=[helper])
        assert raised.value.field == "tools"
    assert ledger.invocations == {} and route.wire.requests == []

    @le.tool
    async def delegate(task: str, ctx: le.ToolContext) -> str:
        """Delegates the task."""
        result = await ctx.run(route.named("child.op"), task, engine=le.Engine(
            engine.providers, ledger=ledger, prices=cheaper))
        return str(result.answer)

    result = await engine.run(route.named("parent.op"), "go", tools=[delegate])
    assert result.outcome is le.Outcome.COMPLETED and result.answer == "done alone"
    [refused] = last_results(result.messages[:3])
    assert refused["is_error"] and "counts credits at" in str(refused["content"])
    assert len(route.wire.requests) == 2
    assert [r["operation"] for r in ledger.invocations.values()] == ["parent.op"]


async def test_ctx_run_on_another_ledger_is_an_error_result_and_sends_nothing(
    route: Route,
) -> None:
    """A handler's ctx.run(engine=...) on another ledger is refused at that call, before
    the child is recorded or sent: the call gets an is_error result naming both
    ledgers and the parent goes on."""
    engine, ledger = route.wire.engine(
        Reply.tool_calls(("delegate", {"task": "x"})), Reply.text("done alone"))
    other = MemoryLedger()
    elsewhere = le.Engine(engine.providers, ledger=other, prices=engine.prices)

    @le.tool
    async def delegate(task: str, ctx: le.ToolContext) -> str:
        """Delegates the task."""
        result = await ctx.run(route.named("child.op"), task, engine=elsewhere)
        return str(result.answer)

    result = await engine.run(route.named("parent.op"), "go", tools=[delegate])
    assert result.outcome is le.Outcome.COMPLETED and result.answer == "done alone"
    [refused] = last_results(result.messages[:3])
    assert refused["is_error"]
    assert "records on MemoryLedger(0 invocations), but the calling run on MemoryLedger(1 " \
        in str(refused["content"])
    assert len(route.wire.requests) == 2 and other.invocations == {}
    assert [r["operation"] for r in ledger.invocations.values()] == ["parent.op"]


async def test_r04_a_child_is_held_to_its_calling_tool_s_timeout() -> None:
    """A handler with a 10 s timeout delegates to a child whose reply would take
    100 s: the call's deadline (ctx.deadline) is 10 s away, not the run's 120,
    and the child, held to it, ends time_limit when it comes rather than
    outliving the call that waits for it."""
    clock = FakeClock()
    seen: list[le.ToolContext] = []
    children: list[le.RunResult] = []

    @le.tool(timeout=10)
    async def research(task: str, ctx: le.ToolContext) -> str:
        """Researches a task."""
        seen.append(ctx)
        children.append(await ctx.run(operation(), task))
        return str(children[-1].answer)

    ledger = MemoryLedger()
    provider = ScriptedProvider([Reply.tool_calls(("research", {"task": "dig"})),
                                 Reply.text("too late", delay=100),
                                 Reply.text("done alone")], clock=clock)
    engine = le.Engine(provider, ledger=ledger, prices=PRICES, clock=clock)
    result = await engine.run(operation(total_time=120.0), "go", tools=[research])
    assert result.outcome is le.Outcome.COMPLETED and result.answer == "done alone"
    [ctx] = seen
    assert ctx.deadline == 10.0
    [child] = children
    assert child.outcome is le.Outcome.TIME_LIMIT
    assert clock.now() == 10.0


async def test_r04_a_child_started_when_the_parent_s_time_is_spent_ends_time_limit() -> None:
    """An observer that outlasts the parent's deadline (its attempt's settle is
    announced whatever the time) leaves no time for the batch: a delegating
    tool's child then ends ``time_limit`` at once, sending nothing, instead of
    being refused a total_time that is not positive (a ConfigError the model
    would have been told of)."""
    clock = FakeClock()
    seen: list[events.Event] = []

    async def slow(event: events.Event) -> None:
        seen.append(event)
        if isinstance(event, events.AttemptSettled) and len(seen) < 5:
            await clock.sleep(100)  # past the parent's 60 s

    ledger = MemoryLedger()
    provider = ScriptedProvider([Reply.tool_calls(("helper", {"task": "try"})),
                                 Reply.text("never sent")], clock=clock)
    engine = le.Engine(provider, ledger=ledger, prices=PRICES, clock=clock, observers=[slow])
    helper = le.agent_tool(engine, operation(), name="helper", description="Helps.")
    result = await engine.run(operation(total_time=60.0), "go", tools=[helper])
    assert result.outcome is le.Outcome.TIME_LIMIT
    assert len(provider.requests) == 1
    (child,) = [r for r in ledger.invocations.values()
                if r["parent_invocation_id"] == result.invocation_id]
    assert child["outcome"] == "time_limit"
    (ended,) = [e for e in seen if isinstance(e, events.ToolCallEvent) and e.status != "started"]
    assert (ended.status, ended.error) == ("failed", "handler raised DelegationStopped")
