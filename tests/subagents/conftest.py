"""A run delegating to another, through either provider's real SDK and its loopback
fake server: the scenarios are written once and run on both wire formats."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

import loopengine as le
from loopengine.testing import FakeClock

from ..adapter.conftest import Harness, harness
from ..conftest import operation
from ..openai.conftest import OpenAIHarness, openai_operation


@dataclasses.dataclass
class Route:
    """A harness on one provider's fake server, and the tests' operation on its route."""

    wire: Harness
    operation: Callable[..., le.Operation]

    def named(self, name: str, **limits: Any) -> le.Operation:
        """The route's operation named ``name`` with ``limits``."""
        return dataclasses.replace(self.operation(**limits), name=name)


@pytest.fixture(params=["anthropic", "openai"])
async def route(request: pytest.FixtureRequest, clock: FakeClock) -> AsyncIterator[Route]:
    """Each provider in turn: AnthropicProvider on FakeAnthropicServer, OpenAIProvider
    on FakeOpenAIServer."""
    if request.param == "anthropic":
        async with harness(request.getfixturevalue("fake_anthropic_server"), clock) as h:
            yield Route(h, operation)
        return
    h = OpenAIHarness(request.getfixturevalue("fake_openai_server"), clock)
    try:
        yield Route(h, openai_operation)
    finally:
        await h.aclose()
