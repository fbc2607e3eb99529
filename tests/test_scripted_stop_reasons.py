"""ScriptedProvider serves only the stop reasons a real provider hands the engine
(`STOP_REASONS`): a typo in a script is a ConfigError when it is scripted, not a
run that behaves as no provider can make it behave."""

from __future__ import annotations

import pytest

import loopengine as le
from loopengine.persistence import MemoryLedger
from loopengine.providers import ProviderRequest, Reply, ScriptedProvider
from loopengine.providers._base import STOP_REASONS
from loopengine.testing import FakeClock

from .conftest import operation


def typo() -> Reply:
    return Reply(content=[{"type": "text", "text": "done"}], stop_reason="end_trun")


def test_a_stop_reason_no_provider_sends_is_refused_when_scripted() -> None:
    """``end_trun`` (or None) in the script, or added to it, is a ConfigError naming
    the item; the message lists the stop reasons a provider sends."""
    with pytest.raises(le.ConfigError) as caught:
        ScriptedProvider([Reply.text("ok"), typo()])
    assert caught.value.field == "script[1].stop_reason"
    assert "'end_trun'" in str(caught.value) and "end_turn" in str(caught.value)
    provider = ScriptedProvider()
    with pytest.raises(le.ConfigError) as caught:
        provider.add(Reply(content=[{"type": "text", "text": "x"}], stop_reason=None))
    assert caught.value.field == "items[0].stop_reason"


@pytest.mark.parametrize("stop", sorted(STOP_REASONS))
def test_every_stop_reason_a_provider_sends_can_be_scripted(stop: str) -> None:
    """Each of the engine's stop reasons is taken as it is."""
    provider = ScriptedProvider([Reply(content=[{"type": "text", "text": "x"}],
                                       stop_reason=stop)])
    assert provider.requests == []


async def test_a_function_giving_a_bad_stop_reason_fails_the_run_with_config_error() -> None:
    """A script function's reply is known only when its request comes: the same
    ConfigError reaches the run's caller, and the run is recorded failed."""

    def reply(request: ProviderRequest) -> Reply:
        return typo()

    clock, ledger = FakeClock(), MemoryLedger()
    engine = le.Engine(ScriptedProvider([reply], clock=clock), ledger=ledger, clock=clock)
    with pytest.raises(le.ConfigError) as caught:
        await engine.run(operation(), "go")
    assert caught.value.field == "the reply to request 1.stop_reason"
    (invocation,) = ledger.invocations.values()
    assert invocation["outcome"] == "failed"
