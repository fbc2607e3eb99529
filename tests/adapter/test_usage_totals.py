"""A run's totals stay within what a ledger column holds (2**63 - 1): a reply
whose counts are each valid but would take a run's usage sum, cost or credits
past it is that attempt's ``invalid_response``, recorded with its ids and no
usage, through the real SDK against the loopback FakeAnthropicServer."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pydantic
import pytest

import loopengine as le
from loopengine.persistence import SQLiteLedger
from loopengine.testing import Reply

from ..conftest import MODEL, operation
from .conftest import STREAMING, Harness

HALF = 2**62
"""A count that fits a ledger column once, not twice."""


@le.tool
def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: The key.
    """
    return f"value of {key}"


def refused(result: le.RunResult, index: int) -> None:
    settle = result.attempt_log[index].settle
    assert settle is not None
    assert (settle.outcome, settle.fault, settle.error_code) == (
        "error", "server_error", "invalid_response")
    assert settle.usage is None and settle.cost_nanousd is None
    assert settle.response_id is not None and settle.http_status == 200


@STREAMING
@pytest.mark.parametrize("field", ["input_tokens", "output_tokens", "cache_read_tokens"])
async def test_r07_a_reply_that_would_overflow_the_runs_usage_is_an_invalid_response(
    wire: Harness, stream: bool, field: str
) -> None:
    """Two replies of 2**62 tokens each: the second would take the run's sum past
    2**63 - 1, so it is refused (retried), and the run's totals are the sum of
    the attempts it kept, in the result and in the ledger."""
    big = le.Usage(**{"output_tokens": 1, field: HALF})
    engine, ledger = wire.engine(
        Reply.tool_calls(("lookup", {"key": "a"}), usage=big),
        Reply.text("too much", usage=big),
        Reply.text("done"), stream=stream, prices=le.PriceBook(fallback=False))
    result = await engine.run(operation(), "go", tools=[lookup])
    assert result.outcome is le.Outcome.COMPLETED and result.answer == "done"
    refused(result, 1)
    kept = [a.settle.usage for a in result.attempt_log if a.settle and a.settle.usage]
    assert len(kept) == 2 and result.usage == kept[0] + kept[1]
    assert getattr(result.usage, field) == HALF + getattr(kept[1], field)
    (row,) = ledger.invocations.values()
    assert row[field] == getattr(result.usage, field)
    second = ledger.attempts[(result.invocation_id, 2)]
    assert second[field] is None and second["response_id"] == "msg_fake_0002"


async def test_a_reply_whose_cost_would_overflow_is_refused_on_every_store(
    wire: Harness, each_ledger: Any
) -> None:
    """A reply whose counts are valid but whose cost in nano-USD passes 2**63 - 1
    ($1 per million tokens: 2**60 tokens cost about 1.15e21 nano-USD) is refused,
    not written: every store records the run and its retry."""
    engine, _ = wire.engine(
        Reply.text("costly", usage=le.Usage(input_tokens=2**60, output_tokens=1)),
        Reply.text("done"), ledger=each_ledger)
    result = await engine.run(operation(), "go")
    assert result.outcome is le.Outcome.COMPLETED
    refused(result, 0)
    settle = result.attempt_log[1].settle
    assert settle is not None and result.cost_usd == Decimal(settle.cost_nanousd or 0) / 10**9


async def test_a_reply_whose_credits_would_overflow_is_refused(wire: Harness) -> None:
    """At 10**15 credits per USD a $10,000 reply is 10**19 credits, past 2**63 - 1:
    refused, and the run ends with the retry's credits."""
    prices = le.PriceBook([le.ModelPrice(provider="anthropic", model=MODEL,
                                         input_per_mtok=Decimal(1), output_per_mtok=Decimal(1))],
                          credits_per_usd=Decimal(10**15))
    engine, ledger = wire.engine(
        Reply.text("dear", usage=le.Usage(input_tokens=10**10, output_tokens=1)),
        Reply.text("done", usage=le.Usage(input_tokens=1, output_tokens=1)), prices=prices)
    result = await engine.run(operation(), "go")
    assert result.outcome is le.Outcome.COMPLETED
    refused(result, 0)
    assert result.credits == 2 * 10**9  # $2e-6 at 10**15 credits per USD
    (row,) = ledger.invocations.values()
    assert row["credits"] == result.credits


class Scene(pydantic.BaseModel):
    scene: str


async def test_a_structured_calls_credits_over_its_turns_stay_storable(
    wire: Harness, tmp_path: Any
) -> None:
    """A structured call keeps its turns' credits apart from the run's: two
    turns of 5e18 credits each would pass 2**63 - 1 together, so the second
    reply is refused, and the SQLite ledger records the call."""
    prices = le.PriceBook([le.ModelPrice(provider="anthropic", model=MODEL,
                                         input_per_mtok=Decimal(1), output_per_mtok=Decimal(1))],
                          credits_per_usd=Decimal(10**15))
    dear = le.Usage(input_tokens=5 * 10**9, output_tokens=1)  # $5,000: 5e18 credits
    cut = Reply(content=[{"type": "tool_use", "id": "toolu_cut", "name": "final_answer",
                          "input": {}}], stop_reason="max_tokens", usage=dear)
    with SQLiteLedger(tmp_path / "ledger.db") as ledger:
        engine, _ = wire.engine(cut, Reply.final({"scene": "x"}, usage=dear),
                                Reply.final({"scene": "done"}), ledger=ledger, prices=prices)
        operation = le.Operation(name="book.scene", provider="anthropic", model=MODEL,
                                 max_output_tokens=64)
        result = await engine.call(operation, "Write.", output=Scene)
    assert result.data == Scene(scene="done")
    settles = [record.settle for record in result.attempt_log]
    assert [(s.outcome, s.error_code) for s in settles if s is not None] == [
        ("ok", None), ("error", "invalid_response"), ("ok", None)]
    # Each kept turn's cost in nano-USD is 10**6 credits per nano-USD, exactly.
    assert result.credits == sum(s.cost_nanousd * 10**6 for s in settles
                                 if s is not None and s.cost_nanousd is not None)
