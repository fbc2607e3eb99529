"""The pytest plugin the package registers (entry point ``pytest11``): run in a
fresh pytest process on a project of its own, as a user's suite would run it."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

USES_THE_FIXTURES = '''
import socket

import pytest

from loopengine.testing import FakeAnthropicServer, FakeGeminiServer, FakeOpenAIServer, Reply

SEEN = []

@pytest.mark.parametrize("name, kind", [("fake_anthropic_server", FakeAnthropicServer),
                                        ("fake_openai_server", FakeOpenAIServer),
                                        ("fake_gemini_server", FakeGeminiServer)])
def test_a_started_server_with_an_empty_script(request, name, kind):
    server = request.getfixturevalue(name)
    assert type(server) is kind
    assert server.url.startswith("http://127.0.0.1:") and server.requests == []
    socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1]))).close()
    SEEN.append(server)

def test_each_server_was_closed_after_its_test():
    assert len(SEEN) == 3
    for server in SEEN:
        with pytest.raises(RuntimeError, match="not started"):
            server.url

@pytest.mark.asyncio
async def test_in_an_async_test(fake_anthropic_server):
    fake_anthropic_server.add(Reply.text("hi"))
    assert fake_anthropic_server.url.startswith("http://127.0.0.1:")
'''


def test_a_suite_gets_each_fixture_started_and_closed_after_its_test(
        pytester: pytest.Pytester) -> None:
    """Any project with loopengine installed has the fixtures: each a started
    server of its kind with an empty script, closed when the test ends, in sync and
    async tests (pytest-asyncio's strict mode), and without warnings."""
    pytester.makeini("[pytest]\nasyncio_mode = strict\n"
                     "asyncio_default_fixture_loop_scope = function\n")
    pytester.makepyfile(test_user=USES_THE_FIXTURES)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-W", "error",
                                           "--strict-markers")
    result.assert_outcomes(passed=5)


def test_the_plugin_adds_nothing_to_a_suite_that_does_not_use_it(
        pytester: pytest.Pytester) -> None:
    """A suite that asks for no fixture of loopengine's sees the same markers and
    options, and runs the same, with the plugin as without it."""
    pytester.makepyfile(test_plain="def test_plain():\n    assert True\n")
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")

    def output(*args: str) -> list[str]:
        run = pytester.runpytest_inprocess("-p", "no:cacheprovider", *args)
        return [line for line in run.outlines if "plugins:" not in line]

    for listing in ("--markers", "--help"):
        assert output(listing) == output(listing, "-p", "no:loopengine")
    runs = [pytester.runpytest_inprocess("-p", "no:cacheprovider", "-W", "error", *disabled)
            for disabled in ((), ("-p", "no:loopengine"))]
    assert [run.parseoutcomes() for run in runs] == [{"passed": 1}] * 2


LOADED_BY_A_PLAIN_SUITE = '''
import sys

def test_plain():
    loaded = sorted(m for m in sys.modules
                    if m.startswith(("loopengine.", "pydantic", "httpx", "anthropic")))
    print("LOADED", loaded)
'''


def test_a_suite_that_does_not_use_the_plugin_loads_no_server(
        pytester: pytest.Pytester) -> None:
    """pytest loads the plugin in every test process where loopengine is
    installed; a suite that asks for none of its fixtures pays for the plugin
    module alone: no fake server, no engine, no pydantic, no HTTP client."""
    pytester.makepyfile(test_plain=LOADED_BY_A_PLAIN_SUITE)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-s")
    result.assert_outcomes(passed=1)
    line = next(line for line in result.outlines if "LOADED" in line)
    assert line.split("LOADED", 1)[1].strip() == str(
        ["loopengine._lazy", "loopengine.testing", "loopengine.testing.pytest_plugin"])
