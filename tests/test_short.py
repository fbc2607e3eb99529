"""The short path (README.md, "Five lines"): a model string builds the provider and
a default operation, and ``run_sync`` / ``call_sync`` run from code without an event
loop."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pydantic
import pytest
import trio

import loopengine as le
from loopengine.providers import AnthropicProvider, OpenAIProvider
from loopengine.testing import FakeAnthropicServer, FakeOpenAIServer, Reply

ROOT = Path(__file__).resolve().parent.parent


def readme_short_example() -> str:
    """The README's five-line agent, exactly as printed."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
    (block,) = [b for b in blocks if "Engine.from_model" in b and "run_sync" in b]
    return block


def test_the_readmes_five_line_agent_runs_as_printed() -> None:
    """The example runs in a fresh interpreter, its key and base URL from the
    environment, against a fake Messages API that calls both tools."""
    source = readme_short_example()
    with FakeAnthropicServer() as server:
        server.add(Reply.tool_calls(("add", {"a": 4, "b": 5})),
                   Reply.tool_calls(("multiply", {"a": 3, "b": 9})),
                   Reply.text("3 * (4 + 5) = 27"))
        env = {**os.environ, "ANTHROPIC_API_KEY": "sk-ant-test",
               "ANTHROPIC_BASE_URL": server.url}
        done = subprocess.run([sys.executable, "-c", source], env=env, capture_output=True,
                              text=True, timeout=120, check=False)
        requests = server.requests
    assert done.returncode == 0, done.stderr
    assert done.stdout == "completed 3 * (4 + 5) = 27\n"
    assert [r.body["model"] for r in requests] == ["claude-sonnet-4-5"] * 3
    assert {t["name"] for t in requests[0].body["tools"]} == {"add", "multiply"}
    results = [block for message in requests[2].body["messages"]
               if isinstance(message["content"], list)
               for block in message["content"] if block.get("type") == "tool_result"]
    assert [str(r["content"]) for r in results] == ["9.0", "27.0"]
    sent = requests[0].headers
    assert "sk-ant-test" in (sent.get("x-api-key") or sent.get("authorization", ""))


def test_the_readmes_offline_try_prints_what_it_says() -> None:
    """The README's way to try the agent with no key: its block in place of the
    five lines' last two, in a fresh interpreter with no Anthropic variables, prints
    the line the README promises."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)
    (offline,) = [b for b in blocks if "FakeAnthropicServer" in b and "run_sync" in b]
    five = readme_short_example().rstrip("\n").split("\n")
    assert five[-2].startswith("result = ") and five[-1].startswith("print(")
    source = "\n".join(five[:-2]) + "\n" + offline
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANTHROPIC_")}
    done = subprocess.run([sys.executable, "-c", source], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    promised = re.search(r"this prints\s+`([^`]*)`", text)
    assert promised is not None
    assert done.stdout == promised.group(1) + "\n"


def test_operation_from_model_fills_in_the_defaults_and_takes_overrides() -> None:
    """The default operation is named after the model string; keywords override."""
    op = le.Operation.from_model("anthropic:claude-sonnet-4-5")
    assert (op.name, op.provider, op.model) == ("anthropic:claude-sonnet-4-5", "anthropic",
                                                "claude-sonnet-4-5")
    assert op.max_output_tokens == 4096 and op.limits == le.Limits()
    assert op.retry == le.RetryPolicy()
    short = le.Operation.from_model("openai:gpt-4o", name="support.answer",
                                    limits=le.Limits(max_turns=4))
    assert (short.name, short.provider, short.model) == ("support.answer", "openai", "gpt-4o")
    assert short.limits.max_turns == 4


@pytest.mark.parametrize(("model", "says"), [
    ("claude-sonnet-4-5", "must be 'vendor:model'"),
    ("mistral:large", "'mistral' is not a vendor"),
    ("anthropic:", "names no model"),
    (42, "must be 'vendor:model'"),
])
def test_a_bad_model_string_is_a_config_error(model: object, says: str) -> None:
    """The message says what a model string is."""
    with pytest.raises(le.ConfigError, match=says) as caught:
        le.Operation.from_model(model)  # type: ignore[arg-type]  # the wrong type on purpose
    assert caught.value.field == "model"


def test_a_missing_key_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the vendor's key variable, the engine is refused before any request."""
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(le.ConfigError, match="OPENAI_API_KEY is not set"):
        le.Engine.from_model("openai:gpt-4o")


def test_an_anthropic_auth_token_is_a_key_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ANTHROPIC_AUTH_TOKEN`` alone, which the ``anthropic`` SDK sends as a bearer
    token and ``AnthropicProvider()`` accepts, builds the engine, and its requests
    carry it; with neither variable the message names both."""
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.delenv("ANTHROPIC_AUTH_TOKEN", raising=False)
    with pytest.raises(le.ConfigError, match="ANTHROPIC_API_KEY or ANTHROPIC_AUTH_TOKEN"):
        le.Engine.from_model("anthropic:claude-sonnet-4-5")
    with FakeAnthropicServer([Reply.text("Hello")]) as server:
        monkeypatch.setenv("ANTHROPIC_AUTH_TOKEN", "sk-ant-token")
        monkeypatch.setenv("ANTHROPIC_BASE_URL", server.url)
        op = le.Operation.from_model("anthropic:claude-sonnet-4-5")
        result = le.Engine.from_model(op).run_sync(op, "Hi")
        assert (result.outcome, result.answer) == (le.Outcome.COMPLETED, "Hello")
        assert server.requests[0].headers["authorization"] == "Bearer sk-ant-token"


def test_from_model_builds_the_vendors_provider(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's one provider is the vendor's, on the operation's route."""
    monkeypatch.setenv("ANTHROPIC_API_KEY", "k")
    monkeypatch.setenv("OPENAI_API_KEY", "k")
    anthropic = le.Engine.from_model("anthropic:claude-sonnet-4-5")
    assert isinstance(anthropic.providers["anthropic"], AnthropicProvider)
    openai = le.Engine.from_model(le.Operation.from_model("openai:gpt-4o"))
    assert isinstance(openai.providers["openai"], OpenAIProvider)


class Verdict(pydantic.BaseModel):
    ok: bool


def test_call_sync_on_openai_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """``call_sync`` takes ``call``'s arguments; the OpenAI key and base URL come
    from OPENAI_API_KEY and OPENAI_BASE_URL."""
    with FakeOpenAIServer() as server:
        server.add(lambda request: Reply.tool_calls(
            (request.body["tool_choice"]["function"]["name"], {"ok": True})))
        monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
        monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)
        op = le.Operation.from_model("openai:gpt-4o")
        result = le.Engine.from_model(op).call_sync(op, "Is it fine?", output=Verdict)
        assert result.data == Verdict(ok=True)
        assert server.requests[0].headers["authorization"] == "Bearer sk-test"


def test_run_sync_twice_each_on_its_own_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """One engine serves successive blocking calls (a sync handler, per request)."""
    with FakeAnthropicServer() as server:
        server.add(Reply.text("one"), Reply.text("two"))
        monkeypatch.setenv("ANTHROPIC_API_KEY", "k")
        monkeypatch.setenv("ANTHROPIC_BASE_URL", server.url)
        op = le.Operation.from_model("anthropic:claude-haiku-4-5")
        engine = le.Engine.from_model(op)
        assert [engine.run_sync(op, "go").answer for _ in range(2)] == ["one", "two"]


async def test_run_sync_inside_a_running_asyncio_loop_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Inside a running loop the blocking call would stall it: ConfigError, nothing sent
    (and no coroutine left un-awaited)."""
    monkeypatch.setenv("ANTHROPIC_API_KEY", "k")
    op = le.Operation.from_model("anthropic:claude-sonnet-4-5")
    engine = le.Engine.from_model(op)
    with pytest.raises(le.ConfigError, match="inside a running asyncio event loop") as caught:
        engine.run_sync(op, "go")
    assert caught.value.field == "run_sync"
    assert "await engine.run(...)" in str(caught.value)
    with pytest.raises(le.ConfigError, match="call_sync"):
        engine.call_sync(op, "go", output=Verdict)
    await asyncio.sleep(0)


def test_run_sync_inside_trio_is_refused_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """The refusal holds on trio's loop as on asyncio's."""
    monkeypatch.setenv("ANTHROPIC_API_KEY", "k")
    op = le.Operation.from_model("anthropic:claude-sonnet-4-5")
    engine = le.Engine.from_model(op)

    async def inside() -> str:
        try:
            engine.run_sync(op, "go")
        except le.ConfigError as error:
            return str(error)
        return "not refused"

    assert "inside a running trio event loop" in trio.run(inside)


def test_the_sync_methods_say_what_they_are() -> None:
    """Their names and help are their own, not the async method's."""
    assert le.Engine.run_sync.__name__ == "run_sync"
    assert "private event loop" in (le.Engine.call_sync.__doc__ or "")
    assert json.dumps(sorted(n for n in dir(le.Engine) if n.endswith("_sync"))) == \
        '["call_sync", "resume_sync", "run_sync"]'


@pytest.mark.parametrize(("model", "provider"), [
    ("anthropic:claude-sonnet-4-5", "AnthropicProvider"),
    ("openai:gpt-4o", "OpenAIProvider"),
    ("openai-responses:gpt-5", "OpenAIResponsesProvider"),
])
def test_a_missing_key_says_what_works_instead(
    monkeypatch: pytest.MonkeyPatch, model: str, provider: str
) -> None:
    """The missing-key message named ``api_key=...`` as the way out, which
    ``Engine.from_model`` (taking Engine's keywords) raised the same error for; it
    names the provider to build with the key, and that provider, given to Engine,
    serves the route."""
    for name in ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "OPENAI_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(le.ConfigError) as caught:
        le.Engine.from_model(model)
    assert f"{provider}(api_key=...)" in caught.value.message
    # A route is not a vendor's name: the message said "to reach openai-responses's API".
    assert f"{model.partition(':')[0]}'s" not in caught.value.message
    assert "pass api_key" not in caught.value.message
    built = getattr(le.providers, provider)(api_key="k", **(
        {"route": "openai-responses"} if provider == "OpenAIResponsesProvider" else {}))
    operation = le.Operation.from_model(model)
    assert le.Engine(built).provider_for(operation) is built


@pytest.mark.parametrize("model", ["anthropic: claude-sonnet-4-5", "openai:gpt-4o ",
                                   "gemini:  gemini-2.5-flash "])
def test_whitespace_around_the_model_id_is_refused(model: str) -> None:
    """``"anthropic: claude-sonnet-4-5"`` built an operation whose model was
    ``" claude-sonnet-4-5"``, which the API answers with a 404 after the attempt is
    recorded; the message shows the id without it. ``Operation(model=...)`` too."""
    with pytest.raises(le.ConfigError, match="whitespace") as caught:
        le.Operation.from_model(model)
    assert caught.value.field == "model"
    model_id = model.partition(":")[2]
    assert repr(model_id.strip()) in caught.value.message
    with pytest.raises(le.ConfigError, match="whitespace"):
        le.Operation(name="n", provider="anthropic", model=model_id)


def test_a_missing_extra_names_the_provider_the_model_string_builds() -> None:
    """Without the ``openai`` (or ``google-genai``) SDK, ``Engine.from_model`` names
    the provider its route builds and the extra to install:
    ``"openai-responses:gpt-5"`` said ``OpenAIProvider``, a class the reader did not
    ask for. Run in a child interpreter where the SDKs cannot be imported."""
    script = (
        "import sys\n"
        "for name in ('openai', 'google.genai'):\n"
        "    sys.modules[name] = None  # 'import name' now fails, as when not installed\n"
        "import loopengine as le\n"
        "for model in ('openai:gpt-4o', 'openai-responses:gpt-5', 'gemini:gemini-2.5-flash'):\n"
        "    try:\n"
        "        le.Engine.from_model(model)\n"
        "    except ImportError as error:\n"
        "        print(error)\n")
    env = {**os.environ, "OPENAI_API_KEY": "k", "GEMINI_API_KEY": "k"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, check=True, env=env)
    assert done.stdout.splitlines() == [
        "OpenAIProvider needs the openai SDK, which is not installed: "
        "pip install 'loopengine-core[openai]'",
        "OpenAIResponsesProvider needs the openai SDK, which is not installed: "
        "pip install 'loopengine-core[openai]'",
        "GeminiProvider needs the google-genai SDK, which is not installed: "
        "pip install 'loopengine-core[gemini]'"]


@pytest.mark.parametrize(("route", "built_by"), [
    ("aws-bedrock", "AnthropicProvider.bedrock(...)"),
    ("google-vertex", "AnthropicProvider.vertex(...)"),
    ("gemini-vertex", "GeminiProvider(vertexai=True, ...)"),
    ("azure", "OpenAIProvider(azure_endpoint=..., api_version=...)"),
])
def test_a_route_a_model_string_does_not_build_names_its_provider(
    route: str, built_by: str
) -> None:
    """``Engine.from_model`` of an operation on Claude's Bedrock route (as
    docs/providers.md publishes it) said "'aws-bedrock' is not a vendor this library
    speaks to", which it is; the message names the provider that serves the route,
    for the operation and for a model string alike."""
    operation = le.Operation(name="help.answer", provider=route, model="m",
                             max_output_tokens=64)
    for model in (operation, f"{route}:m"):
        with pytest.raises(le.ConfigError) as caught:
            le.Engine.from_model(model)
        assert caught.value.field == "model"
        assert f"{route!r} is served by {built_by}" in caught.value.message
        assert "not a vendor" not in caught.value.message
