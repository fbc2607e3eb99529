"""The pytest plugin of loopengine: the ``fake_anthropic_server``,
``fake_openai_server`` and ``fake_gemini_server`` fixtures.

Installed with the package (entry point ``pytest11``), so any test suite that
has loopengine installed can ask for the fixture by name::

    async def test_answers(fake_anthropic_server):
        fake_anthropic_server.add(Reply.text("Hello"))
        provider = AnthropicProvider(api_key="test", base_url=fake_anthropic_server.url)
        ...

    async def test_answers_on_openai(fake_openai_server):
        fake_openai_server.add(Reply.text("Hello"))
        provider = OpenAIProvider(api_key="test", base_url=fake_openai_server.base_url)
        ...

pytest loads this plugin in every test process where loopengine is installed,
so it imports the fake servers (and, through them, loopengine) only when a
test asks for one of the fixtures.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from loopengine.testing import FakeAnthropicServer, FakeGeminiServer, FakeOpenAIServer

__all__ = ["fake_anthropic_server", "fake_gemini_server", "fake_openai_server"]


@pytest.fixture
def fake_anthropic_server() -> Iterator[FakeAnthropicServer]:
    """A started `FakeAnthropicServer` with an empty script, closed after the test."""
    from loopengine.testing import FakeAnthropicServer

    with FakeAnthropicServer() as server:
        yield server


@pytest.fixture
def fake_openai_server() -> Iterator[FakeOpenAIServer]:
    """A started `FakeOpenAIServer` with an empty script, closed after the test."""
    from loopengine.testing import FakeOpenAIServer

    with FakeOpenAIServer() as server:
        yield server


@pytest.fixture
def fake_gemini_server() -> Iterator[FakeGeminiServer]:
    """A started `FakeGeminiServer` with an empty script, closed after the test."""
    from loopengine.testing import FakeGeminiServer

    with FakeGeminiServer() as server:
        yield server
