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
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from loopengine.testing._anthropic_server import FakeAnthropicServer
from loopengine.testing._gemini_server import FakeGeminiServer
from loopengine.testing._openai_server import FakeOpenAIServer

__all__ = ["fake_anthropic_server", "fake_gemini_server", "fake_openai_server"]


@pytest.fixture
def fake_anthropic_server() -> Iterator[FakeAnthropicServer]:
    """A started `FakeAnthropicServer` with an empty script, closed after the test."""
    with FakeAnthropicServer() as server:
        yield server


@pytest.fixture
def fake_openai_server() -> Iterator[FakeOpenAIServer]:
    """A started `FakeOpenAIServer` with an empty script, closed after the test."""
    with FakeOpenAIServer() as server:
        yield server


@pytest.fixture
def fake_gemini_server() -> Iterator[FakeGeminiServer]:
    """A started `FakeGeminiServer` with an empty script, closed after the test."""
    with FakeGeminiServer() as server:
        yield server
