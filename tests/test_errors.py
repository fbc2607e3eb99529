"""The exception tree: one root, drawn in `loopengine._errors`, pickling intact."""

from __future__ import annotations

import ast
import importlib
import inspect
import pickle
import pkgutil
import re
from typing import Any

import pytest

import loopengine as le
from loopengine import _errors
from loopengine.providers import _faults


def _drawn_tree() -> dict[str, str | None]:
    """The tree of the module docstring, as ``{class name: parent name}``."""
    doc = _errors.__doc__ or ""
    parents: dict[str, str | None] = {}
    stack: list[tuple[int, str]] = []
    for line in doc.splitlines():
        match = re.fullmatch(r"( *)\* (\w+)", line)
        if match is None:
            if parents and not line.strip():
                break  # the tree ends at the first blank line after it
            continue
        depth = len(match.group(1))
        while stack and stack[-1][0] >= depth:
            stack.pop()
        parents[match.group(2)] = stack[-1][1] if stack else None
        stack.append((depth, match.group(2)))
    return parents


def _library_errors() -> set[type[BaseException]]:
    """Every `LoopEngineError` subclass the library defines (all modules imported)."""
    for info in pkgutil.walk_packages(le.__path__, "loopengine."):
        try:
            importlib.import_module(info.name)
        except ImportError:  # a module of an optional extra that is not installed
            continue
    found: set[type[BaseException]] = set()
    todo: list[type[BaseException]] = [le.LoopEngineError]
    while todo:
        cls = todo.pop()
        if cls.__module__.startswith("loopengine") and cls not in found:
            found.add(cls)
            todo.extend(cls.__subclasses__())
    return found


def test_the_drawn_tree_is_the_class_tree() -> None:
    """Each class in the docstring's tree derives from the class drawn above it,
    and every library exception is drawn."""
    tree = _drawn_tree()
    assert tree["LoopEngineError"] is None
    for name, parent in tree.items():
        cls = getattr(le, name)
        if parent is not None:
            library_bases = [b for b in cls.__bases__ if issubclass(b, le.LoopEngineError)]
            assert library_bases == [getattr(le, parent)], name
    assert {cls.__name__ for cls in _library_errors()} == set(tree)


def test_every_error_class_but_the_fault_lives_in_one_module() -> None:
    """The public names are the classes of `_errors` (the same objects everywhere)."""
    for name in _errors.__all__:
        assert getattr(le, name) is getattr(_errors, name)
    assert _faults.ProviderError is le.ProviderError
    assert le.StructuredOutputError.__module__ == "loopengine._errors"


def test_the_errors_module_imports_nothing_of_the_library_at_run_time() -> None:
    """Every module can import the errors: they import nothing back."""
    tree = ast.parse(inspect.getsource(_errors))
    for node in tree.body:  # module level; TYPE_CHECKING blocks are ``if`` nodes
        if isinstance(node, ast.ImportFrom):
            assert not (node.module or "").startswith("loopengine"), node.module
        if isinstance(node, ast.Import):
            assert not any(a.name.startswith("loopengine") for a in node.names)
    for node in tree.body:
        if isinstance(node, ast.If):
            assert ast.unparse(node.test) == "TYPE_CHECKING"


def test_a_structured_output_error_ends_incomplete() -> None:
    """Its outcome is the value of `Outcome.INCOMPLETE` (written as a literal there)."""
    error = le.StructuredOutputError("x", attempts=2, reason="invalid", detail="d")
    assert error.outcome == le.Outcome.INCOMPLETE.value


def _examples() -> list[BaseException]:
    fault = le.ProviderFault("overloaded", "busy", http_status=529, request_id="req_1")
    config = le.ConfigError("messages[2].content[0].text", "is not valid UTF-8")
    config.attempts = 0
    return [
        le.LoopEngineError("root"),
        config,
        le.LedgerError("disk full"),
        fault,
        le.OutcomeError("turn limit", outcome="turn_limit", attempts=6),
        le.ProviderError("x", fault=fault, outcome="provider_error", attempts=3),
        le.StructuredOutputError("no answer", attempts=4, reason="truncated", detail="cut"),
        le.ReplayMismatchError("request 2 differs"),
        le.RunBusyError("inv-1", "host:42:abc", "its lease runs until later"),
        le.ToolInputError("input.key: is required"),
        le.MCPServerError("the server did not start"),
        le.MCPToolError("no such city"),
    ]


def _fields(error: BaseException) -> dict[str, Any]:
    return {k: (_fields(v) if isinstance(v, BaseException) else v)
            for k, v in vars(error).items()}


@pytest.mark.parametrize("error", _examples(), ids=lambda e: type(e).__name__)
def test_every_error_pickles_with_its_fields(error: BaseException) -> None:
    """An error crosses a process boundary with its class, message and fields."""
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert copy.args == error.args and str(copy) == str(error)
    assert _fields(copy) == _fields(error)


def test_every_class_of_the_tree_has_a_pickling_example() -> None:
    """The pickling test covers the whole tree."""
    assert {type(e).__name__ for e in _examples()} == set(_drawn_tree())
