"""The ledger's rules, written once for every store that keeps them in rows.

A store's writer hands its queued writes (*ops*) to a `Planner`, which checks
each one against what it knows of its invocation and turns the accepted ones
into rows (a `Batch`); the store supplies only its statements and its
transaction (`Store`). The rules live here and nowhere else:

* an invocation is started once, and nothing is written for it once it has
  ended or for one that was never started; an end whose outcome is
  ``paused`` (or ``running``: a paused invocation resumed) does not end it
  (`OPEN_OUTCOMES`), so a paused invocation takes further writes;
* an attempt is dispatched once and settled once;
* an invocation runs in segments (``segments``): its start opens the first,
  a resume (an end whose outcome is ``running``) opens the next, and a pause
  or its end closes the one open, in the same transaction; a segment whose
  process died stays open, and its recovery opens the next (a sub-agent's
  that died with it is ended by that recovery, its segment left open). An
  invocation started before segments were recorded gets none;
* the first ``max_retained`` attempts of an invocation get a row; later ones
  only increase ``attempt_count`` and set ``incomplete`` (R07);
* each settle adds its usage (tokens, server tool requests, reasoning
  tokens, iterations) and cost to the invocation's totals as
  increments (``column = column + ...``, never an absolute value, so the row
  stays right whoever else writes it); every priced attempt counts towards
  ``provider_cost_nanousd``, only the charged ones towards ``cost_nanousd``
  (S01);
* a deferred write that is refused (nobody may be awaiting it) refuses the
  invocation's next writes too, so its failure reaches a caller;
* one transaction carries a whole batch; when a write in it fails, the writes
  are retried one by one so one bad write never sinks the others.

Ops are flat lists ``[kind, op_id, *fields]`` of plain values (text,
integers, None); the fields of each kind are listed below.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from loopengine._usage import Usage
from loopengine.persistence._records import InvocationProgress
from loopengine.persistence._schema import stored_time

# Op kinds. START is deferred (nobody waits for it), and so is a SETTLE of
# nothing served; the others are durable: somebody waits until they are
# committed.
START: Final = 0
DISPATCH: Final = 1
SETTLE: Final = 2
END: Final = 3
FLUSH: Final = 4

Op = list[Any]
"""``[kind, op_id, *fields]``; the fields of each kind are listed below."""

# (START, op_id, id, operation, operation_version, provider, model, tenant,
#  user_id, feature, correlation_id, started_at, parent_invocation_id)
INVOCATION_INSERT: Final = ("id", "operation", "operation_version", "provider", "model",
                            "tenant", "user_id", "feature", "correlation_id", "started_at",
                            "parent_invocation_id")
# (DISPATCH, op_id, invocation_id, ordinal, turn, attempt, phase, served_by,
#  started_at, max_tokens, timeout_ms, wait_ms)
ATTEMPT_INSERT: Final = ("invocation_id", "ordinal", "turn", "attempt", "phase", "served_by",
                         "started_at", "max_tokens", "timeout_ms", "wait_ms")
# (SETTLE, op_id, invocation_id, ordinal, *ATTEMPT_SETTLE): the five token
# counts and the four usage counts (server tool requests, reasoning tokens,
# iterations) are None when the attempt reported no usage; the fee is None
# when it was not priced.
ATTEMPT_SETTLE: Final = ("outcome", "latency_ms", "fault", "aborted_reason", "http_status",
                         "error_code", "input_tokens", "output_tokens", "cache_read_tokens",
                         "cache_write_tokens", "cache_write_1h_tokens", "usage_approx",
                         "cost_nanousd", "charged", "price_ref", "response_id", "request_id",
                         "stop_reason", "web_search_requests", "web_fetch_requests",
                         "reasoning_tokens", "iterations", "fee_nanousd")
# (END, op_id, id, *END_SET, at, expect_seal, expect_outcome, keep_segment):
# ``at`` is when it was written (a resume's segment starts then);
# ``expect_seal``, when not None, is what the row must still be:
# ``expect_outcome`` with that ``pause_seal`` ("" for none). A compare-and-set:
# of two resumes of one pause (or a resume and a pause's timeout), the second
# changes no row and is refused; so is the end or pause of a segment whose run
# another process took over (``running`` with the segment's own token), and a
# second end of a run its dead process left ``running`` (ended by its root's
# recovery, ``keep_segment`` true: its open segment stays open).
END_SET: Final = ("ended_at", "outcome", "turns", "tool_calls", "credits", "pause_seal")
_E_AT: Final = 3 + len(END_SET)
SEGMENT_OPEN: Final = ("invocation_id", "ordinal", "started_at")
"""The columns a segment's row is inserted with."""
SEGMENT_CLOSE: Final = ("ended_at", "outcome")
"""The columns closing a segment sets (then ``invocation_id`` and ``ordinal``)."""
INSERTS: Final = {"start": ("invocations", INVOCATION_INSERT),
                  "dispatch": ("attempts", ATTEMPT_INSERT), "open": ("segments", SEGMENT_OPEN)}
"""The table and columns of each kind of row a batch inserts."""
# (FLUSH, op_id) carries nothing: it only waits for what was queued before it.

DELTA_COLUMNS: Final = ("attempt_count", "attempts_retained", "incomplete", "input_tokens",
                        "output_tokens", "cache_read_tokens", "cache_write_tokens",
                        "cache_write_1h_tokens", "cost_nanousd", "provider_cost_nanousd",
                        "web_search_requests", "web_fetch_requests", "reasoning_tokens",
                        "iterations", "fee_nanousd")
"""The invocation totals a batch changes, in the order of a `Batch.delta_rows` row.
Each is added to, never overwritten; ``incomplete`` is raised to at least its
value (a store writes it with its ``MAX``)."""
INCOMPLETE: Final = DELTA_COLUMNS.index("incomplete")
_D_COUNT, _D_RETAINED, _D_INCOMPLETE = 0, 1, INCOMPLETE
_D_INPUT, _D_COST, _D_PROVIDER_COST = 3, 8, 9
_D_COUNTS, _D_FEE = 10, 14

# Where a SETTLE op carries its facts (op[4:] is ATTEMPT_SETTLE).
_S_TOKENS: Final = 4 + ATTEMPT_SETTLE.index("input_tokens")
_S_COST: Final = 4 + ATTEMPT_SETTLE.index("cost_nanousd")
_S_CHARGED: Final = 4 + ATTEMPT_SETTLE.index("charged")
_S_COUNTS: Final = 4 + ATTEMPT_SETTLE.index("web_search_requests")
_S_FEE: Final = 4 + ATTEMPT_SETTLE.index("fee_nanousd")


class Refused(Exception):
    """A write the ledger will not make (its message says why)."""


class Lost(Exception):
    """The store could not be reached during a transaction (a lost connection, a
    lock held past the busy timeout): nothing in it is refused, its writes wait
    for the store to come back (`ThreadedLedger`), and whether it committed is
    decided then (`_threaded.Writer.committed`).

    Args:
        batch: What the transaction wrote (what `_threaded.Writer.committed` looks for);
            None for a transaction of other callers (`_threaded.Call`).
        ops: The transaction's ops.
        error: The store's error.
        uncertain: The connection was lost during the commit itself, so the
            transaction may have committed; otherwise it certainly did not.
    """

    def __init__(self, batch: Batch | None, ops: Sequence[Op], error: BaseException, *,
                 uncertain: bool) -> None:
        super().__init__(str(error))
        self.batch = batch
        self.ops = list(ops)
        self.error = error
        self.uncertain = uncertain
        self.rest: list[Op] = []
        """Ops of the same call to `Planner.commit` not yet tried (after ``ops``)."""
        self.refused: list[tuple[int, str]] = []
        """Durable ops that call already refused, before ``ops``."""


class Mismatch(Exception):
    """A statement changed other rows than planned: another writer changed rows this
    one counted on. The batch is retried write by write to find which one."""


def expect(changed: int, count: int, what: str) -> None:
    """Check that a statement planned for ``count`` rows changed that many.

    Raises:
        Mismatch: it changed another number.
    """
    if changed != count:
        raise Mismatch(f"expected to update {count} {what}, updated {changed}")


OPEN_OUTCOMES: Final = ("running", "paused")
"""Outcomes of an invocation that has not ended: it still takes writes."""


@dataclass(frozen=True, slots=True)
class Known:
    """An invocation's committed state, as a store reads it."""

    retained: int
    """Its ``attempts_retained``."""
    ended: bool
    """Its ``outcome`` is none of `OPEN_OUTCOMES`."""
    unsettled: Sequence[int]
    """The ordinals of its rows still ``dispatched``."""
    segment: int | None = None
    """Its last segment's ordinal, or None when it has none (started before
    segments were recorded)."""
    segment_open: bool = False
    """Its last segment has not ended (it runs, or its process died)."""


PROGRESS_COLUMNS: Final = ("outcome", "ended_at", "turns", "tool_calls", "credits",
                           "attempt_count", "cost_nanousd", "provider_cost_nanousd",
                           "pause_seal", "iterations")
"""The ``invocations`` columns `read_progress` reads first, in its order."""
PROGRESS_USAGE: Final = ("input_tokens", "output_tokens", "cache_read_tokens",
                         "cache_write_tokens", "cache_write_1h_tokens", "web_search_requests",
                         "web_fetch_requests", "reasoning_tokens")
"""The usage totals `read_progress` reads after them (`Usage`'s field names)."""
PROGRESS_QUERY: Final = (f"SELECT {', '.join(PROGRESS_COLUMNS + PROGRESS_USAGE)} "
                         "FROM invocations WHERE id = ?")
"""What `read_progress` asks (``?``: the invocation's id)."""


def read_progress(rows: Callable[[str], Sequence[Sequence[Any]]]) -> InvocationProgress | None:
    """An invocation's committed progress (what a resume enforces its budgets
    from), read through ``rows(sql)``, which runs `PROGRESS_QUERY` for it."""
    found = rows(PROGRESS_QUERY)
    if not found:
        return None
    (outcome, ended_at, turns, tool_calls, credits, attempts, cost, provider_cost, seal,
     iterations) = found[0][:len(PROGRESS_COLUMNS)]
    return InvocationProgress(
        outcome=str(outcome), ended_at=stored_time(ended_at), turns=int(turns),
        tool_calls=int(tool_calls),
        credits=int(credits), attempt_count=int(attempts), cost_nanousd=int(cost),
        provider_cost_nanousd=int(provider_cost), seal=None if seal is None else str(seal),
        iterations=int(iterations),
        usage=usage_counts(int(value) for value in found[0][len(PROGRESS_COLUMNS):]))


def usage_counts(counts: Iterable[int]) -> Usage:
    """A `Usage` of the counts of `PROGRESS_USAGE`, in that order."""
    (input_tokens, output_tokens, cache_read, cache_write, cache_write_1h, web_search,
     web_fetch, reasoning) = counts
    return Usage(input_tokens, output_tokens, cache_read, cache_write, cache_write_1h,
                 web_search, web_fetch, reasoning)


class Store:
    """What a store supplies to the planner, and the planner it writes under
    (``planner``, whose `Planner.commit` writes through it): its transaction and
    its statements (a subclass supplies every method).

    ``begin``, ``load``, ``execute`` and ``finish`` raise one of ``errors`` when
    the database fails them; the planner then calls ``abort``.

    Args:
        name: How the store is named in messages (a file's path, a server).
        max_retained: Attempt rows kept per invocation (R07).
    """

    errors: tuple[type[BaseException], ...] = ()
    """The exceptions that mean a database or a value failed, not a bug."""

    def __init__(self, name: str, max_retained: int) -> None:
        self.name = name
        self.planner = Planner(self, max_retained)

    def begin(self) -> None:
        """Open the transaction (taking the write lock, if the store has one)."""
        raise NotImplementedError

    def load(self, invocation_id: str) -> Known | None:
        """The committed state of an invocation this planner has not written, or None
        when there is no such invocation."""
        raise NotImplementedError

    def execute(self, batch: Batch) -> None:
        """Write the batch's rows (in the transaction ``begin`` opened)."""
        raise NotImplementedError

    def finish(self) -> None:
        """Commit the transaction, durably."""
        raise NotImplementedError

    def abort(self) -> None:
        """Roll back whatever is open (never raises)."""
        raise NotImplementedError

    def isolates(self, error: BaseException) -> bool:
        """Whether ``error``, raised once the transaction began, is worth retrying
        write by write (False when nothing more can be written now, such as a
        lost connection)."""
        raise NotImplementedError

    def lost(self, error: BaseException) -> bool:
        """Whether ``error`` means the store cannot be reached for now (a lost
        connection, a lock held too long): the writes wait and are replayed
        (`Lost`) instead of being refused. Called before `abort`."""
        return False


@dataclass(slots=True)
class _Live:
    """What the planner knows of an invocation it writes."""

    retained: int
    unsettled: set[int] = field(default_factory=set)
    """Retained attempts still ``dispatched``."""
    overflow: set[int] | None = field(default_factory=set)
    """Attempts past the retention cap not yet settled; None when unknown (an
    invocation started by another ledger), and then any ordinal is accepted."""
    ended: bool = False
    segment: int | None = 1
    """Its last segment's ordinal; None when it records none (`Known.segment`)."""
    segment_open: bool = True
    """Its last segment has not ended."""


@dataclass(slots=True)
class Batch:
    """The rows one transaction writes, grouped by statement (each row in the
    order of its statement's columns)."""

    starts: list[Sequence[Any]] = field(default_factory=list)
    """`INVOCATION_INSERT` rows."""
    dispatches: list[Sequence[Any]] = field(default_factory=list)
    """`ATTEMPT_INSERT` rows."""
    settles: list[Sequence[Any]] = field(default_factory=list)
    """`ATTEMPT_SETTLE` values, then ``invocation_id`` and ``ordinal``."""
    deltas: dict[str, list[int]] = field(default_factory=dict)
    """Each invocation's changes to its totals, in `DELTA_COLUMNS` order."""
    ends: list[Sequence[Any]] = field(default_factory=list)
    """`END_SET` values, then the outcome and the seal the row must have (the
    seal None: any row), then ``id``."""
    opens: list[Sequence[Any]] = field(default_factory=list)
    """`SEGMENT_OPEN` rows."""
    closes: list[Sequence[Any]] = field(default_factory=list)
    """`SEGMENT_CLOSE` values, then ``invocation_id`` and ``ordinal``."""
    touched: set[str] = field(default_factory=set)
    """Invocations whose `_Live` this batch changed (forgotten if it rolls back)."""
    refused: list[tuple[int, str]] = field(default_factory=list)
    """Durable ops refused while planning: ``(op_id, message)``."""
    done_failing: list[str] = field(default_factory=list)
    """Invocations whose end this batch refused for an earlier refused write
    (`Planner._failed`): nothing more is written for them, so the refusal is
    forgotten once the batch commits."""
    planned: int = 0
    """Writes accepted into this batch."""

    def delta_rows(self) -> list[Sequence[Any]]:
        """The `deltas` as rows: the `DELTA_COLUMNS` values, then the invocation's id."""
        return [(*d, i) for i, d in self.deltas.items()]


def describe(op: Op) -> str:
    """What ``op`` does, for a message."""
    kind = op[0]
    if kind == START:
        return f"starting invocation {op[2]}"
    if kind == DISPATCH:
        return f"dispatching attempt {op[3]} of {op[2]}"
    if kind == SETTLE:
        return f"settling attempt {op[3]} of {op[2]}"
    if kind == END:
        return f"ending invocation {op[2]}"
    return "committing"


class Planner:
    """Turns ops into rows under the ledger's rules, and commits them through a store.

    Not thread-safe: the store's one writer calls it.

    Args:
        store: Where the rows go.
        max_retained: Attempt rows kept per invocation (R07).
    """

    def __init__(self, store: Store, max_retained: int) -> None:
        self.store = store
        self.max_retained = max_retained
        self.commits = 0
        """Transactions committed."""
        self.writes = 0
        """Ops committed (starts, dispatches, settles, ends)."""
        self._live: dict[str, _Live] = {}
        self._failed: dict[str, str] = {}
        """Invocations whose deferred write was refused: their next writes are too,
        up to and including their end (after which nothing more is written for
        them, and the entry goes)."""

    def commit(self, ops: Sequence[Op]) -> list[tuple[int, str]]:
        """Write ``ops`` in one transaction (when a write fails, each on its own).

        Returns:
            The durable ops refused, as ``(op_id, message)``.

        Raises:
            Lost: the store could not be reached; the ops from ``Lost.ops`` on
                are neither committed nor refused yet.
        """
        store = self.store
        batch = Batch()
        began = committing = False
        errors: tuple[type[BaseException], ...] = (*store.errors, Mismatch)
        try:
            store.begin()
            began = True
            self._plan(batch, ops)
            store.execute(batch)
            committing = True
            store.finish()
        except errors as error:
            lost = store.lost(error)
            store.abort()
            # Forget what this batch taught the planner: the next write to
            # those invocations reads their committed state again.
            for invocation_id in batch.touched:
                self._live.pop(invocation_id, None)
            if lost:
                raise Lost(batch, ops, error, uncertain=committing) from error
            if began and len(ops) > 1 and store.isolates(error):
                # Isolate the write that failed so the others still land.
                refused: list[tuple[int, str]] = []
                for index, op in enumerate(ops):
                    try:
                        refused += self.commit([op])
                    except Lost as lost_alone:
                        lost_alone.refused[:0] = refused
                        lost_alone.rest += ops[index + 1:]
                        raise
                return refused
            # A single write failed, or the transaction could not begin:
            # retrying each write would fail again.
            reason = str(error)
            return self.refuse(ops, lambda op: f"{store.name}: {describe(op)} failed: {reason}")
        return self.committed(batch)

    def committed(self, batch: Batch) -> list[tuple[int, str]]:
        """Count ``batch`` as committed (also one whose commit was lost, found
        committed on reconnection); return the durable ops it refused."""
        for row in batch.ends:
            # Ended: nothing more will be written for it by the engine.
            self._live.pop(row[-1], None)
        for invocation_id in batch.done_failing:
            self._failed.pop(invocation_id, None)
        self.commits += 1
        self.writes += batch.planned
        return batch.refused

    def refuse(self, ops: Sequence[Op], why: Callable[[Op], str]) -> list[tuple[int, str]]:
        """Refuse ``ops``, each with the message ``why(op)``; return the durable ones
        refused, as ``(op_id, message)``."""
        failed = Batch()
        for op in ops:
            self._refuse(op, why(op), failed)
            if _final_end(op):
                self._failed.pop(op[2], None)
        return failed.refused

    def _refuse(self, op: Op, message: str, batch: Batch) -> None:
        kind = op[0]
        if kind in (START, SETTLE):
            # A deferred write may have nobody awaiting it: its invocation's
            # next durable write reports the failure, and nothing more is
            # written for it.
            self._failed.setdefault(op[2], message)
        if kind != START:
            # A settle of what the provider served is awaited: report it too.
            batch.refused.append((op[1], message))

    # -- planning: check each op against what is known and turn it into rows ------

    def _plan(self, batch: Batch, ops: Sequence[Op]) -> None:
        failed = self._failed
        for op in ops:
            kind = op[0]
            if kind >= FLUSH:
                continue
            try:
                if failed:
                    message = failed.get(op[2])
                    if message is not None:
                        if _final_end(op):
                            batch.done_failing.append(op[2])
                        raise Refused(message)
                if kind == SETTLE:
                    self._plan_settle(batch, op)
                elif kind == DISPATCH:
                    self._plan_dispatch(batch, op)
                elif kind == START:
                    self._plan_start(batch, op)
                else:
                    self._plan_end(batch, op)
            except Refused as refusal:
                self._refuse(op, str(refusal), batch)
                continue
            batch.planned += 1

    def _touch(self, batch: Batch, invocation_id: str) -> _Live:
        batch.touched.add(invocation_id)
        live = self._live.get(invocation_id)
        if live is not None and not live.ended:
            return live
        if live is None:
            # Not started by this planner (or forgotten after a rollback): read
            # its committed state.
            known = self.store.load(invocation_id)
            if known is None:
                raise Refused(f"{self.store.name}: no invocation {invocation_id}")
            live = _Live(known.retained, set(known.unsettled), None, ended=known.ended,
                         segment=known.segment, segment_open=known.segment_open)
            self._live[invocation_id] = live
        if live.ended:
            raise Refused(f"{self.store.name}: invocation {invocation_id} has already ended")
        return live

    def _plan_start(self, batch: Batch, op: Op) -> None:
        invocation_id = op[2]
        if invocation_id in self._live:
            raise Refused(f"{self.store.name}: invocation {invocation_id} already exists")
        batch.touched.add(invocation_id)
        self._live[invocation_id] = _Live(0)
        batch.starts.append(op[2:])
        # Its first segment starts with it.
        batch.opens.append((invocation_id, 1, op[11]))

    def _deltas(self, batch: Batch, invocation_id: str) -> list[int]:
        deltas = batch.deltas.get(invocation_id)
        if deltas is None:
            deltas = batch.deltas[invocation_id] = [0] * len(DELTA_COLUMNS)
        return deltas

    def _plan_dispatch(self, batch: Batch, op: Op) -> None:
        invocation_id, ordinal = op[2], op[3]
        live = self._touch(batch, invocation_id)
        overflow = live.overflow
        if ordinal in live.unsettled or (overflow is not None and ordinal in overflow):
            raise Refused(
                f"{self.store.name}: attempt {ordinal} of {invocation_id} is already dispatched")
        deltas = self._deltas(batch, invocation_id)
        deltas[_D_COUNT] += 1
        if live.retained >= self.max_retained:
            # R07: past the cap an attempt is counted, not kept.
            deltas[_D_INCOMPLETE] = 1
            if overflow is not None:
                overflow.add(ordinal)
            return
        live.retained += 1
        live.unsettled.add(ordinal)
        deltas[_D_RETAINED] += 1
        batch.dispatches.append(op[2:])

    def _plan_settle(self, batch: Batch, op: Op) -> None:
        invocation_id, ordinal = op[2], op[3]
        live = self._touch(batch, invocation_id)
        if ordinal in live.unsettled:
            live.unsettled.discard(ordinal)
            retained = True
        elif live.overflow is None or ordinal in live.overflow:
            if live.overflow is not None:
                live.overflow.discard(ordinal)
            retained = False
        else:
            raise Refused(
                f"{self.store.name}: attempt {ordinal} of {invocation_id} was not dispatched "
                "or is already settled")
        deltas = self._deltas(batch, invocation_id)
        if op[_S_TOKENS] is not None:
            for index in range(5):
                deltas[_D_INPUT + index] += op[_S_TOKENS + index]
            for index in range(4):
                deltas[_D_COUNTS + index] += op[_S_COUNTS + index]
        cost = op[_S_COST]
        if cost is not None:
            # S01: every priced attempt is what the provider may bill; only
            # the charged (successful) ones are what the run costs, and their
            # fees the part of that cost that is fees.
            deltas[_D_PROVIDER_COST] += cost
            if op[_S_CHARGED]:
                deltas[_D_COST] += cost
                deltas[_D_FEE] += op[_S_FEE]
        if retained:
            batch.settles.append((*op[4:], invocation_id, ordinal))

    def _plan_end(self, batch: Batch, op: Op) -> None:
        invocation_id, ended_at, outcome = op[2], op[3], op[4]
        at, expect_seal, expect_outcome, keep = op[_E_AT:]
        live = self._touch(batch, invocation_id)
        # A pause (or a resume) changes the outcome without ending it.
        live.ended = outcome not in OPEN_OUTCOMES
        batch.ends.append((*op[3:_E_AT], expect_outcome, expect_seal, invocation_id))
        if live.segment is None or (keep and live.ended):
            # A run its process left running, ended by its root's recovery:
            # its segment stays open, as its process left it.
            return
        if outcome == "running":
            # A resume: the next segment. One still open was its process's,
            # which died (the run is recovered): it stays open.
            live.segment += 1
            live.segment_open = True
            batch.opens.append((invocation_id, live.segment, at))
        elif live.segment_open:
            live.segment_open = False
            batch.closes.append((ended_at or at, outcome, invocation_id, live.segment))


def _final_end(op: Op) -> bool:
    """Whether ``op`` ends its invocation (a pause does not): its last write."""
    return op[0] == END and op[4] not in OPEN_OUTCOMES


ROW_COLUMNS: Final = {
    "start": INVOCATION_INSERT, "open": SEGMENT_OPEN, "dispatch": ATTEMPT_INSERT,
    "settle": (*ATTEMPT_SETTLE, "invocation_id", "ordinal"), "add": (*DELTA_COLUMNS, "id"),
    "end": (*END_SET, "expect_outcome", "expect_seal", "id"),
    "close": (*SEGMENT_CLOSE, "invocation_id", "ordinal"),
}
"""What each value of a `statements` row of each kind is, in order."""


def many_rows(kind: str, source: str, greatest: str) -> str:
    """The statement writing every row of ``kind`` at once from ``source``, a store's
    table ``v`` of the rows (columns named as `ROW_COLUMNS` says); ``greatest`` is
    the store's larger of two values.

    Totals are increments, never absolute values, so they are right whoever else
    wrote the row; an end is a compare-and-set (`END_SET`).
    """
    def sets(columns: Sequence[str]) -> str:
        return ", ".join(f"{c} = v.{c}" for c in columns)

    if kind in INSERTS:
        table, columns = INSERTS[kind]
        return f"INSERT INTO {table} ({', '.join(columns)}) SELECT * FROM {source}"
    if kind == "settle":
        return (f"UPDATE attempts AS a SET {sets(ATTEMPT_SETTLE)} FROM {source} WHERE "
                "a.invocation_id = v.invocation_id AND a.ordinal = v.ordinal "
                "AND a.outcome = 'dispatched'")
    if kind == "close":
        return (f"UPDATE segments AS s SET {sets(SEGMENT_CLOSE)} FROM {source} WHERE "
                "s.invocation_id = v.invocation_id AND s.ordinal = v.ordinal")
    if kind == "add":
        totals = ", ".join(f"{c} = {greatest}(i.{c}, v.{c})" if n == INCOMPLETE
                           else f"{c} = i.{c} + v.{c}" for n, c in enumerate(DELTA_COLUMNS))
        return f"UPDATE invocations AS i SET {totals} FROM {source} WHERE i.id = v.id"
    assert kind == "end"
    return (f"UPDATE invocations AS i SET {sets(END_SET)} FROM {source} WHERE "
            "i.id = v.id AND (v.expect_seal IS NULL OR (i.outcome = v.expect_outcome "
            "AND COALESCE(i.pause_seal, '') = v.expect_seal))")


Execute = Callable[[str, list[Sequence[Any]]], int]
"""``(kind, rows) -> rows changed``: one of a store's statements run for many rows."""


def statements(batch: Batch) -> list[tuple[str, list[Sequence[Any]], str | None]]:
    """The statements that write ``batch``, in the order that keeps rows existing
    before they are updated: ``(kind, rows, what)``, where an update must change
    exactly one ``what`` per row (`expect`) and an insert has None.

    The kinds are ``start``, ``open`` (a segment), ``dispatch``, ``settle``,
    ``add`` (the `Batch.delta_rows`), ``end`` and ``close`` (a segment).
    """
    planned: list[tuple[str, list[Sequence[Any]], str | None]] = [
        ("start", batch.starts, None), ("open", batch.opens, None),
        ("dispatch", batch.dispatches, None),
        ("settle", batch.settles, "dispatched attempt rows"),
        ("add", batch.delta_rows(), "invocation rows"), ("end", batch.ends, "invocation rows"),
        ("close", batch.closes, "open segment rows"),
    ]
    return [statement for statement in planned if statement[1]]


def execute(batch: Batch, run: Execute) -> None:
    """Write ``batch`` with a store's statements (`statements`), one at a time,
    checking each update's row count.

    Raises:
        Mismatch: an update changed another number of rows than planned.
    """
    for kind, rows, what in statements(batch):
        changed = run(kind, rows)
        if what is not None:
            expect(changed, len(rows), what)
