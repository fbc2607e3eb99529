"""The pytest plugin of loopengine: a ``fake_anthropic_server`` fixture.

Installed with the package (entry point ``pytest11``), so any test suite that
has loopengine installed can ask for the fixture by name::

    async def test_answers(fake_anthropic_server):
        fake_anthropic_server.add(Reply.text("Hello"))
        provider = AnthropicProvider(api_key="test", base_url=fake_anthropic_server.url)
        ...
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from loopengine.testing._server import FakeAnthropicServer

__all__ = ["fake_anthropic_server"]


@pytest.fixture
def fake_anthropic_server() -> Iterator[FakeAnthropicServer]:
    """A started `FakeAnthropicServer` with an empty script, closed after the test."""
    with FakeAnthropicServer() as server:
        yield server
