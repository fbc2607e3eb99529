"""`read_tree`: a run and the runs below it, as every store holds them.

A recovery reads this of a dead run's sub-agents (what they charged, which
ones its process left running); each store answers from its own rows, the
memory ledger from its dicts and the databases with the same SQL.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from decimal import Decimal
from typing import Any

from loopengine.persistence._account_store import TreeRun, descendants

from .ledger_support import NOW, dispatch, end, settle, start


async def test_a_tree_reads_alike_on_every_store(each_ledger: Any) -> None:
    """A root, a child that ended and a grandchild still running (two turns of
    charged attempts, a third turn only dispatched, an uncharged attempt), and
    an unrelated run: the tree holds the first three in the order they started,
    each with its turns and, while running, its turns' charged costs."""
    ledger = each_ledger
    for n, (run, parent) in enumerate([("root", None), ("child", "root"),
                                       ("grandchild", "child"), ("other", None)]):
        await ledger.start_invocation(dataclasses.replace(
            start(run), parent_invocation_id=parent, started_at=NOW + timedelta(seconds=n)))
    await ledger.dispatch_attempt(dispatch(1, "child"))
    await ledger.settle_attempt(settle(1, "child"))
    await ledger.end_invocation(dataclasses.replace(end("child"), credits=7, tool_calls=2))
    for ordinal, cost, charged in ((1, 1_500_000_000, True), (2, 10, False),
                                   (3, 2_000_000_000, True), (4, 300_000_000, True)):
        record = dispatch(ordinal, "grandchild")
        await ledger.dispatch_attempt(dataclasses.replace(record, turn=min(ordinal, 2)))
        await ledger.settle_attempt(dataclasses.replace(
            settle(ordinal, "grandchild"), cost_nanousd=cost, charged=charged))
    await ledger.dispatch_attempt(dataclasses.replace(dispatch(5, "grandchild"), turn=3))
    await ledger.dispatch_attempt(dispatch(1, "other"))

    runs = await ledger.read_tree("root")

    assert [dataclasses.replace(r, turn_costs=tuple(sorted(r.turn_costs))) for r in runs] == [
        TreeRun("root", "running", 0, 0, 0, ()),
        TreeRun("child", "completed", 1, 2, 7, ()),
        TreeRun("grandchild", "running", 3, 0, 0, (1_500_000_000, 2_300_000_000)),
    ]
    rate = Decimal(1)  # a credit a USD: 1.5 USD -> 2, 2.3 USD -> 3
    assert descendants(runs, "root", rate, 1) == (7 + 2 + 3, [("grandchild", 3, 0, 5)])
    assert await ledger.read_tree("nobody") == []
