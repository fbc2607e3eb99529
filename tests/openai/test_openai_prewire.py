"""A request OpenAIProvider cannot translate is refused before its attempt is
recorded (`Provider.check_request`): no row, nothing on the wire, not retried,
no turn; through the real ``openai`` SDK, FakeOpenAIServer and a SQLite ledger."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pydantic
import pytest

import loopengine as le
from loopengine.persistence import SQLiteLedger
from loopengine.providers._openai_chat import chat_messages, check_translatable
from loopengine.testing import Reply

from ..check_support import Shapes, refused_alike
from .conftest import OpenAIHarness, openai_operation

PNG = [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                    "data": "iVBORw0KGgo="}}]


async def test_a_tool_result_image_reaches_the_model_as_a_note_beside_its_text(
    wire: OpenAIHarness, tmp_path: Path,
) -> None:
    """A tool answers with text and an image, which a Chat Completions tool message
    cannot carry: the tool message holds the text and a note the model can read
    in the image's place (its media type and size); the run completes, both turns
    recorded."""

    @le.tool
    async def snapshot() -> list[dict[str, Any]]:
        """Take a screenshot."""
        return [{"type": "text", "text": "the login page"}, *PNG,
                {"type": "image", "source": {"type": "url", "url": "https://x.test/b.png"}}]

    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as ledger:
        engine, _ = wire.engine(Reply.tool_calls(("snapshot", {})),
                                Reply.text("It shows the login page."), ledger=ledger)
        result = await engine.run(openai_operation(), "look", tools=[snapshot])
    assert result.outcome is le.Outcome.COMPLETED
    (tool_message,) = [m for m in wire.server.requests[1].body["messages"]
                       if m["role"] == "tool"]
    assert tool_message["content"] == (
        "the login page\n\n[image: image/png, 8 bytes, not shown]\n\n"
        "[image: https://x.test/b.png, not shown]")
    # The transcript keeps the image itself: another route could show it.
    (kept,) = [b for m in result.messages if isinstance(m["content"], list)
               for b in m["content"] if b.get("type") == "tool_result"]
    assert kept["content"][1] == PNG[0]
    with sqlite3.connect(path) as db:
        rows = db.execute("SELECT turn, attempt, outcome FROM attempts").fetchall()
    assert rows == [(1, 1, "ok"), (2, 1, "ok")]


async def test_a_refused_first_request_is_no_turn_and_no_attempt(
    wire: OpenAIHarness, tmp_path: Path,
) -> None:
    """Refused at its very first request (a document in the prompt), a run
    sends nothing, records no attempt and counts no turn (R01)."""
    prompt = [{"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                              "data": "notes"}}]
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as ledger:
        engine, _ = wire.engine(Reply.text("unused"), ledger=ledger)
        result = await engine.run(openai_operation(), [{"role": "user", "content": prompt}])
    assert result.outcome is le.Outcome.PROVIDER_ERROR
    assert result.fault is not None and result.fault.error_code == "untranslatable"
    assert result.turns == 0 and result.attempt_log == ()
    assert wire.server.requests == []
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT count(*) FROM attempts").fetchone() == (0,)
        assert db.execute("SELECT outcome, turns, attempt_count FROM invocations").fetchone() \
            == ("provider_error", 0, 0)


class Summary(pydantic.BaseModel):
    """A call's output."""

    text: str


async def test_a_call_refused_before_the_wire_records_no_attempt_and_no_turn(
    wire: OpenAIHarness, tmp_path: Path,
) -> None:
    """`Engine.call` alike: a ProviderError carrying the untranslatable fault and
    no attempt; the ledger's invocation ended provider_error with no turn."""
    prompt = [{"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                              "data": "notes"}}]
    path = tmp_path / "ledger.db"
    with SQLiteLedger(path) as ledger:
        engine, _ = wire.engine(Reply.text("unused"), ledger=ledger)
        with pytest.raises(le.ProviderError) as info:
            await engine.call(openai_operation(), [{"role": "user", "content": prompt}],
                              output=Summary)
    assert info.value.fault is not None and info.value.fault.error_code == "untranslatable"
    assert info.value.attempts == 0
    assert wire.server.requests == []
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT count(*) FROM attempts").fetchone() == (0,)
        assert db.execute("SELECT outcome, turns, attempt_count FROM invocations").fetchone() \
            == ("provider_error", 0, 0)


def test_the_check_and_the_translation_refuse_alike() -> None:
    """`check_translatable` refuses exactly what the translation refuses, with the
    same fault, and passes what it sends."""
    shapes: Shapes = [
        ([{"role": "user", "content": "hi"}], False),
        ([{"role": "user", "content": [{"type": "text", "text": "hi"}, *PNG]}], False),
        ([{"role": "assistant", "content": [{"type": "thinking", "thinking": "t"},
                                            {"type": "tool_use", "id": "c", "name": "f",
                                             "input": {}}]},
          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c",
                                        "content": [{"type": "text", "text": "ok"}]}]}], False),
        ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c",
                                        "content": PNG}]}], False),
        ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c",
                                        "content": [{"type": "search_result"}]}]}], True),
        ([{"role": "user", "content": [{"type": "image", "source": {"type": "file"}}]}], True),
        ([{"role": "user", "content": [{"type": "document", "source": {}}]}], True),
        ([{"role": "assistant", "content": [{"type": "server_tool_use", "id": "s"}]}], True),
        ([{"role": "system", "content": "x"}], True),
    ]
    refused_alike(check_translatable, lambda messages: chat_messages(None, messages), shapes)
