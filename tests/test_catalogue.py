"""The TOML operations catalogue: clear errors naming the operation and the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import loopengine as le

GOOD = '''
[operations."teammate.answer"]
version = "3"
provider = "anthropic"
model = "claude-sonnet-4-5"
max_output_tokens = 1024
limits = { max_turns = 6, credit_hold = 500 }
retry = { max_attempts = 4, initial_wait = 0.25 }
cache = { system = true, conversation = true }

[operations."search.rank"]
provider = "anthropic"
model = "claude-haiku-4-5"
'''


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "operations.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_load_operations_reads_every_table(tmp_path: Path) -> None:
    """Each table is one Operation; unspecified values take their defaults."""
    ops = le.load_operations(write(tmp_path, GOOD))
    answer = ops["teammate.answer"]
    assert (answer.version, answer.model, answer.max_output_tokens) == ("3", "claude-sonnet-4-5",
                                                                        1024)
    assert (answer.limits.max_turns, answer.limits.credit_hold) == (6, 500)
    assert answer.limits.max_tool_calls == 32
    assert (answer.retry.max_attempts, answer.retry.initial_wait) == (4, 0.25)
    assert answer.cache.system and answer.cache.conversation and not answer.cache.tools
    assert ops["search.rank"].limits == le.Limits()


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('[operations."a"]\nprovider = "anthropic"\nmodel = "m"\nlimits = { max_turns = 0 }',
         "operations.a.limits.max_turns"),
        ('[operations."a"]\nprovider = "anthropic"\nmodel = "m"\nlimits = { max_turn = 2 }',
         "operations.a.limits.max_turn"),
        ('[operations."a"]\nprovider = "anthropic"\nmodel = "m"\nretry = { max_attempts = 2.5 }',
         "operations.a.retry.max_attempts"),
        ('[operations."a"]\nprovider = "anthropic"\nmodel = "m"\ntemperature = 1',
         "operations.a.temperature"),
        ('[operations."a"]\nmodel = "m"', "operations.a.provider"),
        ('[operations."a"]\nprovider = "anthropic"\nmodel = "m"\nlimits = 3',
         "operations.a.limits"),
        ('[operation."a"]\nprovider = "x"', "operation"),
    ],
)
def test_bad_catalogue_names_operation_and_key(tmp_path: Path, text: str, field: str) -> None:
    """The error's field is the dotted path; its message names the file."""
    path = write(tmp_path, text)
    with pytest.raises(le.ConfigError) as info:
        le.load_operations(path)
    assert info.value.field == field
    assert str(path) in str(info.value)


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    """A missing file and invalid TOML are ConfigErrors, not tracebacks from tomllib."""
    with pytest.raises(le.ConfigError, match="no operations catalogue"):
        le.load_operations(tmp_path / "absent.toml")
    with pytest.raises(le.ConfigError, match="not valid TOML"):
        le.load_operations(write(tmp_path, "[operations\n"))


@pytest.mark.parametrize("path", [None, 3, b"operations.toml", "operations\0.toml"])
def test_a_catalogue_path_that_names_no_file_is_a_config_error(path: Any) -> None:
    """``load_operations(None)`` (a TypeError from pathlib) and a path holding a NUL
    byte (a ValueError from open) are ConfigErrors on ``path``, as a missing file is."""
    with pytest.raises(le.ConfigError) as caught:
        le.load_operations(path)
    assert caught.value.field == "path"
