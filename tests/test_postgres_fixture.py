"""The throwaway server's fixture: without PostgreSQL the tests that need it skip,
saying why, unless the environment requires it (CI), where they fail instead."""

from __future__ import annotations

import pytest

from . import postgres_support


def test_missing_binaries_skip_with_a_reason_or_fail_when_required(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No server binaries: `start_server` skips naming what is missing; with
    LOOPENGINE_REQUIRE_POSTGRES=1 it fails with the same reason."""
    monkeypatch.setattr(postgres_support, "_binaries", lambda: None)
    monkeypatch.delenv(postgres_support.REQUIRE, raising=False)
    with pytest.raises(pytest.skip.Exception, match="no PostgreSQL server binaries"):
        postgres_support.start_server()
    monkeypatch.setenv(postgres_support.REQUIRE, "1")
    with pytest.raises(pytest.fail.Exception,
                       match="LOOPENGINE_REQUIRE_POSTGRES=1 but no PostgreSQL server binaries"):
        postgres_support.start_server()
