"""The guards as pure functions of the conversation state."""

from __future__ import annotations

import math
from decimal import Decimal
from fractions import Fraction

from hypothesis import given, settings
from hypothesis import strategies as st

from loopengine import Limits, Outcome
from loopengine.guards import (
    ConversationState,
    Deadline,
    attempt_timeout,
    check_admission,
    check_before_attempt,
    check_before_turn,
    check_credits,
    check_delegated_credits,
    check_rejection_budget,
    check_terminal,
    check_tool_batch,
    needs_crossing_permit,
    turn_credits,
    unconfirmed_by_deadline,
)


def state(turns: int = 0, tool_calls: int = 0, credits: int = 0,
          deadline: float = math.inf) -> ConversationState:
    return ConversationState(turns=turns, tool_calls=tool_calls, credits=credits,
                             deadline=Deadline(deadline))


def test_turn_limit_trips_at_max_turns_not_before() -> None:
    """The turn guard lets turn max_turns through and stops the next."""
    limits = Limits(max_turns=3)
    assert check_before_turn(state(turns=2), limits, 0.0) is None
    trip = check_before_turn(state(turns=3), limits, 0.0)
    assert trip is not None and trip.outcome is Outcome.TURN_LIMIT
    assert (trip.guard, trip.observed, trip.limit) == ("max_turns", 3, 3)


def test_turn_limit_is_checked_before_time() -> None:
    """With both exhausted, the turn limit is reported (its checkpoint comes first)."""
    trip = check_before_turn(state(turns=3, deadline=5.0), Limits(max_turns=3), 10.0)
    assert trip is not None and trip.outcome is Outcome.TURN_LIMIT


def test_time_limit_trips_when_no_time_remains() -> None:
    """No request once the deadline is reached; a moment before, one may go."""
    limits = Limits(total_time=10.0)
    assert check_before_attempt(state(deadline=10.0), limits, 9.999) is None
    trip = check_before_attempt(state(deadline=10.0), limits, 10.0)
    assert trip is not None and trip.outcome is Outcome.TIME_LIMIT


def test_attempt_timeout_is_the_smaller_of_limit_and_remaining() -> None:
    """min(attempt_timeout, remaining), unbounded deadlines leaving the limit."""
    limits = Limits(attempt_timeout=30.0)
    assert attempt_timeout(limits, Deadline(100.0), 90.0) == 10.0
    assert attempt_timeout(limits, Deadline(100.0), 0.0) == 30.0
    assert attempt_timeout(limits, Deadline.after(0.0, None), 1e9) == 30.0


def test_deadline_is_absolute_and_never_negative() -> None:
    """Remaining time counts down from start + total_time and stops at zero."""
    deadline = Deadline.after(5.0, 10.0)
    assert deadline.remaining(5.0) == 10.0
    assert deadline.remaining(20.0) == 0.0 and deadline.expired(15.0)


def test_terminal_stop_reasons() -> None:
    """refusal is refused; max_tokens and context overflow are incomplete; others pass."""
    assert check_terminal("refusal").outcome is Outcome.REFUSED  # type: ignore[union-attr]
    assert check_terminal("max_tokens").outcome is Outcome.INCOMPLETE  # type: ignore[union-attr]
    overflow = check_terminal("model_context_window_exceeded")
    assert overflow is not None and overflow.outcome is Outcome.INCOMPLETE
    for fine in ("end_turn", "tool_use", "stop_sequence", None):
        assert check_terminal(fine) is None


def test_tool_batch_limit_before_budget() -> None:
    """An oversized batch is a batch-limit trip even when the budget is also short."""
    limits = Limits(max_tool_batch=2, max_tool_calls=1)
    trip = check_tool_batch(state(), limits, 3)
    assert trip is not None and trip.outcome is Outcome.TOOL_BATCH_LIMIT


def test_tool_budget_allows_exactly_what_remains() -> None:
    """A batch equal to the remaining budget runs; one more does not."""
    limits = Limits(max_tool_calls=5)
    assert check_tool_batch(state(tool_calls=3), limits, 2) is None
    trip = check_tool_batch(state(tool_calls=3), limits, 3)
    assert trip is not None and trip.outcome is Outcome.TOOL_LIMIT
    assert (trip.observed, trip.limit) == (6, 5)


def test_unlimited_tool_limits() -> None:
    """None means no limit."""
    limits = Limits(max_tool_batch=None, max_tool_calls=None)
    assert check_tool_batch(state(tool_calls=10_000), limits, 500) is None
    assert check_rejection_budget(state(tool_calls=10_000), limits) is None


def test_rejection_needs_one_unit_of_budget() -> None:
    """A rejection can be returned while one unit remains."""
    limits = Limits(max_tool_calls=2)
    assert check_rejection_budget(state(tool_calls=1), limits) is None
    trip = check_rejection_budget(state(tool_calls=2), limits)
    assert trip is not None and trip.outcome is Outcome.TOOL_LIMIT


def test_credit_hold_is_greater_than_not_greater_or_equal() -> None:
    """Exactly the hold continues; one credit more stops."""
    limits = Limits(credit_hold=100)
    assert check_credits(state(credits=100), limits) is None
    trip = check_credits(state(credits=101), limits)
    assert trip is not None and trip.outcome is Outcome.CREDIT_LIMIT
    assert check_credits(state(credits=10**9), Limits()) is None


def test_a_tree_past_any_ancestor_s_hold_stops_before_the_next_turn() -> None:
    """Each (hold, own plus descendants' credits) of a run and its ancestors: exactly
    a hold continues, one credit past any of them ends credit_limit, naming it."""
    assert check_delegated_credits([(60, 60), (100, 100), (None, 10**9)]) is None
    trip = check_delegated_credits([(60, 50), (100, 140)])
    assert trip is not None and trip.outcome is Outcome.CREDIT_LIMIT
    assert (trip.observed, trip.limit) == (140, 100)
    assert check_delegated_credits([]) is None


def test_a_turn_under_any_hold_in_its_tree_needs_the_crossing_permit() -> None:
    """A hold on the run or any run above it: the turn may cross it, so it needs the
    permit; with no hold anywhere above, nothing can be crossed."""
    assert needs_crossing_permit([(None, 0), (100, 10)])
    assert needs_crossing_permit([(90, 0)])
    assert not needs_crossing_permit([(None, 0), (None, 10**9)])
    assert not needs_crossing_permit([])


def test_turn_credits_round_up_to_the_quantum() -> None:
    """USD times the rate, rounded up to a multiple of the quantum; zero stays zero."""
    assert turn_credits(0, Decimal(1000), 1) == 0
    assert turn_credits(1, Decimal(1000), 1) == 1  # a nano-dollar still costs a credit
    assert turn_credits(1_000_000, Decimal(1000), 1) == 1  # exactly 1 credit
    assert turn_credits(1_000_001, Decimal(1000), 1) == 2
    assert turn_credits(120_000, Decimal(1_000_000), 50) == 150
    assert turn_credits(150_000, Decimal(1_000_000), 50) == 150


@settings(max_examples=300, deadline=None)
@given(cost=st.integers(1, 2**63 - 1),
       rate=st.decimals(min_value=Decimal("1e-20"), max_value=Decimal("9.99e15"),
                        allow_nan=False, allow_infinity=False, places=None),
       quantum=st.sampled_from([1, 7, 1000]))
def test_r03_turn_credits_are_the_exact_ceiling(cost: int, rate: Decimal, quantum: int) -> None:
    """Whatever the digits of the rate and the size of the turn, the charge is
    the exact cost in credits rounded up, never a credit short."""
    exact = Fraction(cost, 10**9) * Fraction(rate)
    assert turn_credits(cost, rate, quantum) == math.ceil(exact / quantum) * quantum


def test_r03_turn_credits_keep_a_fraction_past_28_digits() -> None:
    """A turn of $9,000,000,001 at a rate a hair above one credit per USD is a
    little over 9,000,000,001 credits: charged 9,000,000,002, where 28-digit
    decimal arithmetic rounded the fraction away and charged a credit short."""
    rate = Decimal("1.00000000000000000000000000001")
    assert turn_credits(9_000_000_001 * 10**9, rate, 1) == 9_000_000_002


def test_r04_a_write_not_confirmed_by_the_deadline_is_the_time_limit() -> None:
    """What the ledger did not record before the deadline ends the run ``time_limit``,
    naming what was not recorded and the limit."""
    trip = unconfirmed_by_deadline(Limits(total_time=5.0), "the attempt")
    assert (trip.outcome, trip.guard, trip.limit) == (Outcome.TIME_LIMIT, "total_time", 5.0)
    assert "did not record the attempt before the deadline" in trip.message


def test_admission_denies_only_a_run_with_nothing_reserved() -> None:
    """Nothing reserved denies the run (``admission_denied``, the balance observed);
    any reservation, even less than the hold, admits it (a narrowing)."""
    trip = check_admission("acme", 0, -1, 50)
    assert trip is not None
    assert (trip.outcome, trip.guard, trip.observed, trip.limit) == (
        Outcome.ADMISSION_DENIED, "account", -1, 50)
    # The balance's own figure, as `audit accounts` shows it.
    assert "has -1 credits available (overdrawn)" in trip.message
    empty = check_admission("acme", 0, 0, 50)
    assert empty is not None and "has 0 credits available, nothing" in empty.message
    assert check_admission("acme", 10, 10, 50) is None
    # A resumed run asks for what its hold leaves after what it spent.
    resumed = check_admission("acme", 0, 0, 1, spent=120)
    assert resumed is not None and resumed.limit == 1
    assert resumed.message.endswith("nothing to reserve for the 1 credit this resumed run "
                                    "asks for (120 of its hold already spent)")
