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
