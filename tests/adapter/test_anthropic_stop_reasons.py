"""The end of a Messages reply through AnthropicProvider, the real ``anthropic`` SDK
and FakeAnthropicServer, JSON and streamed alike: a stop reason the SDK's
``BetaStopReason`` does not name, or none, is a fault, never an answer."""

from __future__ import annotations

from typing import get_args

import pytest
from anthropic.types.beta import BetaStopReason

import loopengine as le
from loopengine.providers._anthropic import STOP_REASONS
from loopengine.testing import Reply

from ..conftest import operation
from .conftest import STREAMING, Harness

USAGE = le.Usage(input_tokens=10, output_tokens=4)


def test_the_stop_reasons_read_are_the_sdks() -> None:
    """A stop reason the SDK adds is decided on here, not passed through (the
    beta's names are a superset of the stable ones: ``compaction`` besides)."""
    assert set(get_args(BetaStopReason)) == STOP_REASONS


@pytest.mark.parametrize(("stop", "code"), [("some_future_reason", "some_future_reason"),
                                            (None, "invalid_response")])
@STREAMING
async def test_r05_an_unread_stop_reason_is_a_server_error_retried(
    wire: Harness, stream: bool, stop: str | None, code: str
) -> None:
    """A stop reason newer than the SDK, or none in a whole message: not an answer
    but the server's failure, retried; the attempt keeps the usage and the status."""
    unread = Reply(content=[{"type": "text", "text": "half an"}], stop_reason=stop,
                   usage=USAGE)
    engine, _ = wire.engine(unread, Reply.text("the answer"), stream=stream)
    result = await engine.run(operation(), "go", accept=lambda _: True)
    assert result.outcome is le.Outcome.COMPLETED and result.answer == "the answer"
    first = result.attempt_log[0].settle
    assert first is not None
    assert (first.fault, first.error_code, first.http_status) == ("server_error", code, 200)
    assert first.usage == USAGE and first.charged is False
    assert len(wire.requests) == 2


@STREAMING
async def test_r11_a_call_whose_reply_paused_continues_its_turn(
        wire: Harness, stream: bool) -> None:
    """A call's reply that paused its turn (``pause_turn``: a server tool loop
    stopped) is no answer and no wrong one: it goes back as the last message and
    the next request continues the turn (phase ``continuation``), as a run's
    does; no repair is asked for."""
    import pydantic

    class City(pydantic.BaseModel):
        name: str

    paused = Reply(content=[{"type": "text", "text": "Searching. "}], stop_reason="pause_turn",
                   usage=USAGE)
    engine, ledger = wire.engine(paused, Reply.final({"name": "Oslo"}), stream=stream)
    result = await engine.call(operation(), "Capital of Norway?", output=City)

    assert result.data == City(name="Oslo") and result.attempts.count == 2
    continued = wire.requests[1].messages
    assert continued[-1] == {"role": "assistant",
                             "content": [{"type": "text", "text": "Searching. "}]}
    assert [(r.dispatch.turn, r.dispatch.phase) for r in result.attempt_log] == [
        (1, "turn"), (1, "continuation")]
