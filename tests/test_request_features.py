"""Request features published on the operation (docs/pricing.md): validation, the TOML
catalogue, narrowing (R13), and the credit-hold refusal of unpriceable features."""

from __future__ import annotations

import copy
import pickle
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

import loopengine as le
from loopengine._features import Features, narrow_features
from loopengine.providers import Reply

from .conftest import MODEL, EngineFactory

SEARCH = le.ServerTool(type="web_search_20250305", name="web_search", max_uses=5,
                       params={"allowed_domains": ["example.com"]})
FETCH = le.ServerTool(type="web_fetch_20250910", name="web_fetch", max_uses=3)
CODE = le.ServerTool(type="code_execution_20250825", name="code_execution")


def op(**features: Any) -> le.Operation:
    return le.Operation(name="research", provider="anthropic", model=MODEL, **features)


def field_of(build: Any) -> str:
    with pytest.raises(le.ConfigError) as caught:
        build()
    return caught.value.field


def test_thinking_takes_a_budget_or_adaptive_with_an_effort() -> None:
    """Each wrong thinking setting names its field."""
    assert le.Thinking(budget_tokens=2048).budget_tokens == 2048
    assert le.Thinking(adaptive=True, effort="low").effort == "low"
    assert le.Thinking(adaptive=True).effort is None
    assert field_of(lambda: le.Thinking(budget_tokens=1000)) == "budget_tokens"
    assert field_of(lambda: le.Thinking()) == "budget_tokens"
    assert field_of(lambda: le.Thinking(adaptive=True, budget_tokens=2048)) == "budget_tokens"
    assert field_of(lambda: le.Thinking(adaptive=True, effort="extreme")) == "effort"
    assert field_of(lambda: le.Thinking(budget_tokens=2048, effort="low")) == "effort"
    assert field_of(lambda: le.Thinking(adaptive=1, budget_tokens=2048)) == "adaptive"


def test_server_tool_validates_and_copies_its_params() -> None:
    """max_uses >= 1, params a JSON object that cannot shadow the tool's own keys."""
    given = {"allowed_domains": ["example.com"]}
    tool = le.ServerTool(type="web_search_20250305", name="web_search", max_uses=2, params=given)
    given["allowed_domains"].append("evil.com")
    assert tool.definition == {"type": "web_search_20250305", "name": "web_search",
                               "max_uses": 2, "allowed_domains": ["example.com"]}
    assert field_of(lambda: le.ServerTool(type="x", name="y", max_uses=0)) == "max_uses"
    assert field_of(lambda: le.ServerTool(type="", name="y")) == "type"
    assert field_of(lambda: le.ServerTool(type="x", name="y", params={"a": object()})) == "params"
    assert field_of(lambda: le.ServerTool(type="x", name="y", params={"max_uses": 3})) \
        == "params.max_uses"


def test_operation_validates_each_feature_by_field() -> None:
    """An operation names the offending feature, with the tool's index."""
    assert field_of(lambda: op(server_tools=(SEARCH, "web_fetch"))) == "server_tools[1]"
    assert field_of(lambda: op(server_tools=(SEARCH, SEARCH))) == "server_tools[1].name"
    assert field_of(lambda: op(thinking={"budget_tokens": 2048})) == "thinking"
    assert field_of(lambda: op(betas="compact-2026-01-12")) == "betas"
    assert field_of(lambda: op(betas=("ok", ""))) == "betas[1]"
    assert field_of(lambda: op(context_management=["edits"])) == "context_management"
    assert field_of(lambda: op(context_management={"x": float("nan")})) == "context_management"
    assert field_of(lambda: op(reasoning_effort="maximal")) == "reasoning_effort"
    assert field_of(lambda: op(service_tier="gold")) == "service_tier"


def test_an_operation_with_features_is_a_value() -> None:
    """Hashable, equal to its copy, picklable; its features are one frozen value."""
    published = op(thinking=le.Thinking(budget_tokens=4096), server_tools=[SEARCH],
                   betas=["compact-2026-01-12"],
                   context_management={"edits": [{"type": "compact_20260112"}]})
    assert published.server_tools == (SEARCH,) and published.betas == ("compact-2026-01-12",)
    assert pickle.loads(pickle.dumps(published)) == published
    assert copy.deepcopy(published) == published
    assert hash(published) == hash(copy.deepcopy(published))
    assert published.features == Features(
        thinking=le.Thinking(budget_tokens=4096), server_tools=(SEARCH,),
        betas=("compact-2026-01-12",),
        context_management={"edits": [{"type": "compact_20260112"}]})


CATALOGUE = """
[operations."research"]
provider = "anthropic"
model = "claude-sonnet-4-5"
thinking = { budget_tokens = 2048 }
betas = ["compact-2026-01-12"]

[operations."research".context_management]
edits = [{ type = "compact_20260112", trigger = { type = "input_tokens", value = 150000 } }]

[[operations."research".server_tools]]
type = "web_search_20250305"
name = "web_search"
max_uses = 5
params = { allowed_domains = ["example.com"] }

[[operations."research".server_tools]]
type = "web_fetch_20250910"
name = "web_fetch"
max_uses = 3

[operations."chat"]
provider = "openai"
model = "gpt-5"
reasoning_effort = "low"
service_tier = "flex"
"""


def test_load_operations_reads_the_features(tmp_path: Path) -> None:
    """Every feature can be published in the TOML catalogue."""
    path = tmp_path / "operations.toml"
    path.write_text(CATALOGUE)
    operations = le.load_operations(path)
    research = operations["research"]
    assert research.thinking == le.Thinking(budget_tokens=2048)
    assert research.server_tools == (SEARCH, FETCH)
    assert research.betas == ("compact-2026-01-12",)
    assert research.context_management == {"edits": [{
        "type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 150000}}]}
    assert (operations["chat"].reasoning_effort, operations["chat"].service_tier) \
        == ("low", "flex")


@pytest.mark.parametrize(("table", "field"), [
    ('server_tools = [{ type = "web_search_20250305", name = "s", max_uses = 0 }]',
     "server_tools[0].max_uses"),
    ('server_tools = [{ type = "web_search_20250305", name = "s", uses = 2 }]',
     "server_tools[0].uses"),
    ("server_tools = { name = 1 }", "server_tools"),
    ("thinking = { budget_tokens = 10 }", "thinking.budget_tokens"),
    ('thinking = { adaptive = true, effort = "max" }', "thinking.effort"),
    ("context_management = 3", "context_management"),
])
def test_catalogue_errors_name_the_feature(tmp_path: Path, table: str, field: str) -> None:
    """A wrong feature in the catalogue names the operation and the feature's key."""
    path = tmp_path / "operations.toml"
    path.write_text(f'[operations."x"]\nprovider = "anthropic"\nmodel = "m"\n{table}\n')
    with pytest.raises(le.ConfigError) as caught:
        le.load_operations(path)
    assert caught.value.field == f"operations.x.{field}"


PUBLISHED = Features(
    thinking=le.Thinking(budget_tokens=4096), server_tools=(SEARCH, FETCH),
    betas=("compact-2026-01-12", "context-management-2025-06-27"),
    context_management={"edits": [{"type": "clear_tool_uses_20250919"}]},
    reasoning_effort="medium", service_tier="flex",
)


def test_r13_a_run_may_lower_numbers_and_drop_features() -> None:
    """Lower max_uses and budgets, fewer tools and betas, features off: all narrowings."""
    lower = le.ServerTool(type="web_search_20250305", name="web_search", max_uses=2,
                          params={"allowed_domains": ["example.com"]})
    narrowed = narrow_features(PUBLISHED, {
        "thinking": le.Thinking(budget_tokens=1024), "server_tools": (lower,),
        "betas": ("compact-2026-01-12",), "reasoning_effort": "low",
    })
    assert narrowed.server_tools == (lower,)
    assert narrowed.thinking == le.Thinking(budget_tokens=1024)
    assert narrowed.betas == ("compact-2026-01-12",) and narrowed.reasoning_effort == "low"
    # What the override does not name keeps its published value.
    assert narrowed.context_management == PUBLISHED.context_management
    assert narrowed.service_tier == "flex"
    off = narrow_features(PUBLISHED, {"thinking": None, "server_tools": (),
                                      "context_management": None, "service_tier": None})
    assert (off.thinking, off.server_tools, off.context_management, off.service_tier) \
        == (None, (), None, None)
    assert narrow_features(PUBLISHED, None) is PUBLISHED
    assert narrow_features(PUBLISHED, {"service_tier": "flex"}) == PUBLISHED


@pytest.mark.parametrize(("requested", "field"), [
    ({"server_tools": (le.ServerTool(type="web_search_20250305", name="web_search",
                                     max_uses=6, params={"allowed_domains": ["example.com"]}),)},
     "server_tools[0].max_uses"),
    ({"server_tools": (FETCH, le.ServerTool(type="web_search_20250305", name="web_search",
                                            params={"allowed_domains": ["example.com"]}))},
     "server_tools[1].max_uses"),
    ({"server_tools": (CODE,)}, "server_tools[0].name"),
    ({"server_tools": (le.ServerTool(type="web_search_20250305", name="web_search",
                                     max_uses=1),)}, "server_tools[0].params"),
    ({"server_tools": (le.ServerTool(type="web_search_20260209", name="web_search",
                                     max_uses=1, params={"allowed_domains": ["example.com"]}),)},
     "server_tools[0].type"),
    ({"thinking": le.Thinking(budget_tokens=8192)}, "thinking.budget_tokens"),
    ({"thinking": le.Thinking(adaptive=True)}, "thinking.adaptive"),
    ({"betas": ("advisor-tool-2026-03-01",)}, "betas"),
    ({"context_management": {"edits": []}}, "context_management"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
    ({"service_tier": "priority"}, "service_tier"),
    ({"temperature": 0.2}, "temperature"),
    ({"server_tools": (SEARCH.definition,)}, "server_tools[0]"),
])
def test_r13_a_run_never_adds_a_feature_or_raises_a_number(
    requested: dict[str, Any], field: str
) -> None:
    """Widening is refused (not clamped), naming the feature."""
    with pytest.raises(le.ConfigError) as caught:
        narrow_features(PUBLISHED, requested)
    assert caught.value.field == field


def test_r13_features_an_operation_does_not_publish_cannot_be_added() -> None:
    """No thinking, no effort published: asking for either is refused."""
    bare = Features()
    assert field_of(lambda: narrow_features(bare, {"thinking": le.Thinking(budget_tokens=1024)})) \
        == "thinking"
    assert field_of(lambda: narrow_features(bare, {"reasoning_effort": "low"})) \
        == "reasoning_effort"
    adaptive = Features(thinking=le.Thinking(adaptive=True, effort="medium"))
    assert narrow_features(adaptive, {"thinking": le.Thinking(adaptive=True, effort="low")}) \
        .thinking == le.Thinking(adaptive=True, effort="low")
    assert field_of(lambda: narrow_features(
        adaptive, {"thinking": le.Thinking(adaptive=True, effort="high")})) == "thinking.effort"


async def test_credit_hold_is_refused_on_features_without_a_price(
    make_engine: EngineFactory,
) -> None:
    """Like an unpriced model: web search without a fee, code execution (container
    time) and an advisor on an unpriced model are refused before anything is sent."""
    engine, provider, ledger = make_engine(Reply.text("hi"))
    held = le.Limits(credit_hold=10_000)
    advisor = le.ServerTool(type="advisor_20260301", name="advisor",
                            params={"model": "no-such-model"})
    for tools, reason in (((SEARCH,), "no web search fee"),
                          ((CODE,), "container time"),
                          ((advisor,), "advisor model 'no-such-model' has no price")):
        with pytest.raises(le.ConfigError, match=reason) as caught:
            await engine.run(op(server_tools=tools, limits=held), "go")
        assert caught.value.field == "prices"
    with pytest.raises(le.ConfigError, match="service_tier 'priority'"):
        await engine.run(op(service_tier="priority", limits=held), "go")
    assert provider.requests == [] and ledger.invocations == {}
    # Without a credit hold nothing needs enforcing: the run goes ahead.
    result = await engine.run(op(server_tools=(SEARCH, CODE)), "go")
    assert result.outcome is le.Outcome.COMPLETED


async def test_web_search_with_a_fee_is_held_and_charged(make_engine: EngineFactory) -> None:
    """With the fee in the book the hold is accepted, and the ledger charges the fee."""
    book = le.PriceBook([le.ModelPrice(
        provider="anthropic", model=MODEL, input_per_mtok=Decimal(3), output_per_mtok=Decimal(15),
        web_search_per_k=Decimal(10))], credits_per_usd=Decimal(1_000_000))
    engine, _, ledger = make_engine(
        Reply.text("found", usage=le.Usage(input_tokens=1000, output_tokens=100,
                                           web_search_requests=10)), prices=book)
    result = await engine.run(op(server_tools=(SEARCH, FETCH),
                                 limits=le.Limits(credit_hold=1_000_000)), "go")
    assert result.outcome is le.Outcome.COMPLETED
    # 10 searches at $10 per 1,000 = $0.10; 1,000 in at $3/MTok + 100 out at $15/MTok.
    [row] = ledger.attempts.values()
    assert row["cost_nanousd"] == 100_000_000 + 3_000_000 + 1_500_000


async def test_a_server_tool_cannot_share_a_name_with_the_runs_tools(
    make_engine: EngineFactory,
) -> None:
    """The model calls tools by name: a client tool or the terminal tool named like a
    server tool is refused before anything is sent."""
    import pydantic

    engine, provider, ledger = make_engine(Reply.text("hi"))

    @le.tool
    async def web_search(query: str) -> str:
        """Search."""
        return "x"

    class Answer(pydantic.BaseModel):
        text: str

    with pytest.raises(le.ConfigError) as caught:
        await engine.run(op(server_tools=(FETCH, SEARCH)), "go", tools=[web_search])
    assert caught.value.field == "server_tools[1].name"
    answer_tool = le.ServerTool(type="web_fetch_20250910", name="final_answer")
    with pytest.raises(le.ConfigError) as caught:
        await engine.run(op(server_tools=(answer_tool,)), "go", output=Answer)
    assert caught.value.field == "server_tools[0].name"
    assert provider.requests == [] and ledger.invocations == {}


def test_a_deep_bad_feature_value_is_a_config_error_with_a_bounded_message() -> None:
    """A caller's bad value, however deeply nested, is named in a bounded message:
    the error is a ConfigError, never a RecursionError from its repr."""
    deep: list[object] = []
    inner = deep
    for _ in range(3000):
        inner.append([])
        inner = inner[0]  # type: ignore[assignment]
    for build in (lambda: le.Thinking(adaptive=True, effort=deep),  # type: ignore[arg-type]
                  lambda: le.Operation(name="a", provider="anthropic", model="m",
                                       max_output_tokens=1, thinking=deep),  # type: ignore[arg-type]
                  lambda: le.Operation(name="a", provider="anthropic", model="m",
                                       max_output_tokens=1, server_tools=deep)):  # type: ignore[arg-type]
        with pytest.raises(le.ConfigError) as raised:
            build()
        assert len(str(raised.value)) < 500
