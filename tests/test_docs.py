"""Every ```python block of README.md and docs/*.md runs, so the documentation cannot
drift from the code.

How the blocks run:

* The blocks of one file run in order in one namespace, as a reader would type
  them: a later block may use what an earlier one defined.
* Top-level ``await`` is allowed (the examples are written for an async caller).
  A block that calls a blocking ``*_sync`` method or ``asyncio.run`` (a whole
  program) runs in a thread of its own, as a plain script would: no event
  loop is running there.
* Every page is a whole program: its blocks start from an empty namespace,
  and define (or import) every name they use, as a reader's script would.
* A function a block defines named ``test_*`` is called as pytest would call it,
  with the fixtures ``fake_anthropic_server`` (a started `FakeAnthropicServer`
  with an empty script) and ``tmp_path``.
* The environment is a reader's with a key: ``ANTHROPIC_API_KEY`` is set and
  ``ANTHROPIC_BASE_URL`` points at a loopback `FakeAnthropicServer`, so a
  block's ``AnthropicProvider()`` (or ``Engine.from_model``) reaches it; it
  answers a forced tool call with input built from the tool's schema and
  anything else with a text answer about resetting a password (the docs'
  running example).
* The working directory is a fresh temporary one (blocks write ``ledger.db``).
* A block that cannot run here is preceded by an HTML comment saying why:
  ``<!-- no-run: needs a PostgreSQL server -->`` (docs/ledger.md's one).
"""

from __future__ import annotations

import ast
import inspect
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest

from loopengine.testing import FakeAnthropicServer, RecordedRequest, Reply

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

ANSWER = "You can reset your password from the Settings page."

_FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)
_BLOCKING = re.compile(r"\.(run|call)_sync\(|asyncio\.run\(")
_NO_RUN = re.compile(r"<!--\s*no-run:\s*(?P<why>[^>]*?)\s*-->\s*\Z")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    source: str
    skip: str | None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def python_blocks(path: Path) -> list[Block]:
    """The ```python blocks of a Markdown file, with their line and no-run reason."""
    text = path.read_text(encoding="utf-8")
    blocks = []
    for match in _FENCE.finditer(text):
        if match.group(1).strip() != "python":
            continue
        before = text[:match.start()]
        skip = _NO_RUN.search(before)
        blocks.append(Block(path, before.count("\n") + 2, match.group(2),
                            skip.group("why") if skip else None))
    return blocks


def example_input(schema: dict[str, Any]) -> Any:
    """A value matching a (simple) JSON schema, for the fake's forced tool calls."""
    kind = schema.get("type")
    if "enum" in schema:
        return schema["enum"][0]
    if kind == "object":
        properties = schema.get("properties", {})
        return {name: example_input(sub) for name, sub in properties.items()
                if name in schema.get("required", properties)}
    return {"string": "example", "integer": 1, "number": 1.0, "boolean": True,
            "array": []}.get(str(kind), "example")


def respond(request: RecordedRequest) -> Reply:
    choice = request.body.get("tool_choice") or {}
    if choice.get("type") == "tool":
        (tool,) = [t for t in request.body["tools"] if t["name"] == choice["name"]]
        return Reply.tool_calls((tool["name"], example_input(tool["input_schema"])))
    return Reply.text(ANSWER)


@pytest.fixture
def docs_server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeAnthropicServer]:
    with FakeAnthropicServer() as server:
        # Answers every request; the scripts of the examples' own servers are theirs.
        server.add(*[respond] * 200)
        monkeypatch.setenv("ANTHROPIC_BASE_URL", server.url)
        monkeypatch.setenv("ANTHROPIC_API_KEY", "test")
        monkeypatch.chdir(tmp_path)
        yield server


async def call_test(function: Any, tmp_path: Path) -> None:
    """Call a test function a block defined, with the fixtures it names."""
    arguments: dict[str, Any] = {}
    servers = []
    for name in inspect.signature(function).parameters:
        if name == "fake_anthropic_server":
            server = FakeAnthropicServer().start()
            servers.append(server)
            arguments[name] = server
        elif name == "tmp_path":
            arguments[name] = tmp_path
        else:
            raise AssertionError(f"{function.__name__} asks for fixture {name!r}")
    try:
        outcome = function(**arguments)
        if inspect.isawaitable(outcome):
            await outcome
    finally:
        for server in servers:
            server.close()


@pytest.fixture
def logger_levels() -> Iterator[None]:
    """Puts back the loggers' levels a page's example sets (docs/observability.md
    turns loopengine's logging to DEBUG): the tests after it run as they would alone."""
    loggers = [logging.getLogger(), *(logger for logger in
                                      logging.root.manager.loggerDict.values()
                                      if isinstance(logger, logging.Logger))]
    levels = {logger: logger.level for logger in loggers}
    yield
    for logger in logging.root.manager.loggerDict.values():
        if isinstance(logger, logging.Logger) and logger not in levels:
            logger.setLevel(logging.NOTSET)  # created by the page
    for logger, level in levels.items():
        logger.setLevel(level)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
@pytest.mark.usefixtures("logger_levels")
async def test_every_python_block_runs(
    path: Path, docs_server: FakeAnthropicServer, tmp_path: Path
) -> None:
    """Each ```python block of the file runs (its test functions too), in order."""
    namespace: dict[str, Any] = {"__name__": f"docs_{path.stem.replace('-', '_')}"}
    called = []
    for block in python_blocks(path):
        if block.skip is not None:
            assert block.skip, f"{block.where}: a no-run comment must say why"
            continue
        before = set(namespace)
        try:
            code = compile(block.source, block.where, "exec",
                           flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
            if _BLOCKING.search(block.source):
                outcome = await anyio.to_thread.run_sync(eval, code, namespace)
            else:
                outcome = eval(code, namespace)  # the docs' own examples, nothing else
            if inspect.isawaitable(outcome):
                await outcome
            for name in sorted(set(namespace) - before):
                if name.startswith("test_") and callable(namespace[name]):
                    await call_test(namespace[name], tmp_path / name)
                    called.append(name)
        except Exception as error:
            raise AssertionError(f"{block.where}: the block fails: {error!r}") from error
    if path.name == "testing.md":  # the page is mostly tests: they did run
        assert len(called) >= 4, called


def test_the_docs_have_python_blocks_to_run() -> None:
    """The collector finds the blocks (a renamed fence would silently run nothing)."""
    counted = {p.name: len(python_blocks(p)) for p in DOCS}
    assert counted["README.md"] >= 1
    assert counted["testing.md"] >= 5
    assert sum(counted.values()) >= 12


def test_a_no_run_comment_skips_only_the_next_block(tmp_path: Path) -> None:
    """The convention: ``<!-- no-run: why -->`` right before a fence skips that block."""
    page = tmp_path / "page.md"
    page.write_text("```python\nx = 1\n```\n\n<!-- no-run: needs a real API key -->\n"
                    "```python\nraise SystemExit\n```\n\n```python\ny = x\n```\n",
                    encoding="utf-8")
    blocks = python_blocks(page)
    assert [(b.line, b.skip) for b in blocks] == [
        (2, None), (7, "needs a real API key"), (11, None)]
