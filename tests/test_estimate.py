"""`Engine.estimate`: offline token counts equal to tiktoken's, and the worst case by hand."""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pydantic
import pytest
import tiktoken
import tiktoken.load

import loopengine as le
from loopengine import _estimate, _tokenizer
from loopengine.providers import ScriptedProvider
from loopengine.testing import FakeClock

MODEL = "claude-estimate-test"
CL100K_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"

SAMPLES = [
    "hello world",
    "The quick brown fox jumps over the lazy dog.\n\nAnd then it ran away!",
    "def f(x: int) -> int:\n    return x ** 2  # squares\n",
    "Zürich, Kraków, Ελληνικά, 日本語のテキスト, 한국어, русский текст",
    "emoji 🦊🚀 and numbers 1234567890 and   spaces\t\ttabs\r\nCRLF",
    "text that mentions <|endoftext|> as plain text",
    "",
]


def price_book(**kwargs: Any) -> le.PriceBook:
    return le.PriceBook([le.ModelPrice(provider="anthropic", model=MODEL,
                                       input_per_mtok=Decimal(3), output_per_mtok=Decimal(15))],
                        credits_per_usd=Decimal(1000), **kwargs)


def operation(max_turns: int = 3, max_output_tokens: int = 100) -> le.Operation:
    return le.Operation(name="estimate.test", provider="anthropic", model=MODEL,
                        max_output_tokens=max_output_tokens,
                        limits=le.Limits(max_turns=max_turns))


def engine(prices: le.PriceBook | None = None, clock: FakeClock | None = None) -> le.Engine:
    return le.Engine(ScriptedProvider(), prices=prices or price_book(),
                     clock=clock or FakeClock())


@pytest.fixture
def fresh_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget the loaded encoding, so the test loads the shipped file itself."""
    monkeypatch.setattr(_tokenizer, "_encoding", None)


@pytest.fixture(scope="module")
def tiktoken_cl100k(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tiktoken.Encoding]:
    """tiktoken's own ``cl100k_base()``, offline: its cache is primed with the shipped file
    under the key tiktoken derives from the download URL."""
    cache = tmp_path_factory.mktemp("tiktoken-cache")
    shutil.copy(_tokenizer.SHIPPED_CL100K, cache / hashlib.sha1(CL100K_URL.encode()).hexdigest())
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
        from tiktoken_ext.openai_public import cl100k_base

        yield tiktoken.Encoding(**cl100k_base())


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Sockets cannot be made, and tiktoken's cache is an empty directory."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise OSError("network access in a test")

    monkeypatch.setattr(socket, "socket", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    cache = tmp_path / "empty-tiktoken-cache"
    cache.mkdir()
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    return cache


# -- offline -------------------------------------------------------------------------


@pytest.mark.usefixtures("fresh_tokenizer")
def test_estimate_works_with_networking_unavailable(no_network: Path) -> None:
    """With no sockets and an empty tiktoken cache, the shipped file is enough."""
    with pytest.raises(OSError):
        socket.create_connection(("example.com", 443))  # the network really is gone
    estimate = engine().estimate(operation(), "hello world")
    assert estimate.counted_tokens == 2
    assert _tokenizer._encoding is not None
    # Nothing was downloaded, nor copied into tiktoken's cache.
    assert list(no_network.iterdir()) == []


@pytest.mark.usefixtures("fresh_tokenizer")
def test_the_shipped_file_is_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Later estimates reuse the encoding built on first use."""
    loads: list[Path] = []
    real = _tokenizer.load_cl100k

    def counting(path: Path, expected_hash: str = _tokenizer.CL100K_SHA256) -> tiktoken.Encoding:
        loads.append(path)
        return real(path, expected_hash)

    monkeypatch.setattr(_tokenizer, "load_cl100k", counting)
    for _ in range(3):
        engine().estimate(operation(), "hello world")
    assert loads == [_tokenizer.SHIPPED_CL100K]


# -- the tokenizer is tiktoken's cl100k_base ---------------------------------------


def test_shipped_encoding_is_tiktokens_cl100k(tiktoken_cl100k: tiktoken.Encoding) -> None:
    """Same pattern, special tokens and ranks as tiktoken's own cl100k_base()."""
    ours = _tokenizer.cl100k()
    assert ours._pat_str == tiktoken_cl100k._pat_str
    assert ours._special_tokens == tiktoken_cl100k._special_tokens
    assert ours._mergeable_ranks == tiktoken_cl100k._mergeable_ranks
    assert ours.n_vocab == tiktoken_cl100k.n_vocab


def test_ranks_match_load_tiktoken_bpe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shipped file parses exactly as tiktoken's loader parses it, hash checked."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    ranks = tiktoken.load.load_tiktoken_bpe(str(_tokenizer.SHIPPED_CL100K),
                                            expected_hash=_tokenizer.CL100K_SHA256)
    assert _tokenizer.cl100k()._mergeable_ranks == ranks


@pytest.mark.parametrize("text", SAMPLES)
def test_token_counts_equal_tiktokens(text: str, tiktoken_cl100k: tiktoken.Encoding) -> None:
    """For sample texts, the estimate counts what tiktoken's cl100k_base counts."""
    expected = len(tiktoken_cl100k.encode_ordinary(text))
    assert _tokenizer.cl100k().encode_ordinary(text) == tiktoken_cl100k.encode_ordinary(text)
    messages = [{"role": "user", "content": [{"type": "text", "text": text}]}]
    if not text:
        # An empty text block is refused, as a run refuses it (the API would).
        with pytest.raises(le.ConfigError):
            engine().estimate(operation(), messages)
        return
    estimate = engine().estimate(operation(), messages)
    assert estimate.counted_tokens == expected


def test_special_token_text_is_counted_as_text(tiktoken_cl100k: tiktoken.Encoding) -> None:
    """A user's ``<|endoftext|>`` is ordinary text to count, not an error."""
    text = SAMPLES[5]
    estimate = engine().estimate(operation(), text)
    assert estimate.counted_tokens == len(tiktoken_cl100k.encode(text, disallowed_special=()))


# -- tampering ------------------------------------------------------------------------


def test_a_tampered_file_fails_loudly(tmp_path: Path) -> None:
    """One changed byte, and loading refuses with both hashes in the message."""
    tampered = tmp_path / "cl100k_base.tiktoken"
    data = bytearray(_tokenizer.SHIPPED_CL100K.read_bytes())
    data[100] ^= 0x01
    tampered.write_bytes(bytes(data))
    with pytest.raises(le.LoopEngineError) as raised:
        _tokenizer.load_cl100k(tampered)
    assert _tokenizer.CL100K_SHA256 in str(raised.value)
    assert hashlib.sha256(bytes(data)).hexdigest() in str(raised.value)


@pytest.mark.usefixtures("fresh_tokenizer")
def test_a_tampered_shipped_file_fails_the_estimate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If the package's copy is replaced, Engine.estimate raises instead of guessing."""
    tampered = tmp_path / "cl100k_base.tiktoken"
    tampered.write_bytes(_tokenizer.SHIPPED_CL100K.read_bytes() + b"\n")
    monkeypatch.setattr(_tokenizer, "SHIPPED_CL100K", tampered)
    with pytest.raises(le.LoopEngineError, match="SHA-256"):
        engine().estimate(operation(), "hello world")
    assert _tokenizer._encoding is None  # nothing half-loaded is kept


def test_a_missing_file_fails_loudly(tmp_path: Path) -> None:
    """A missing tokenizer file is a LoopEngineError naming the file."""
    with pytest.raises(le.LoopEngineError, match="cannot read the tokenizer file"):
        _tokenizer.load_cl100k(tmp_path / "absent.tiktoken")


# -- the worst case -----------------------------------------------------------------


def test_worst_case_arithmetic_by_hand() -> None:
    """3 turns of 100 output tokens on a 2-token prompt, priced and rounded per turn."""
    estimate = engine().estimate(operation(max_turns=3, max_output_tokens=100), "hello world")
    assert estimate.counted_tokens == 2  # "hello", " world"
    assert estimate.calibration == Decimal("1.3")
    assert estimate.framing_tokens == 4  # one message
    assert estimate.input_tokens == 3 + 4  # ceil(2 * 1.3) + 4
    assert (estimate.turns, estimate.max_output_tokens, estimate.output_tokens) == (3, 100, 300)
    # Each turn re-sends the earlier turns' output.
    assert estimate.turn_input_tokens == (7, 107, 207)
    assert estimate.total_input_tokens == 321
    # Turns: (7*3 + 100*15)/1e6 = 0.001521; (107*3 + 1500)/1e6 = 0.001821; 0.002121.
    assert estimate.cost_usd == Decimal("0.005463")
    # 1.521 -> 2, 1.821 -> 2, 2.121 -> 3 credits: rounded per turn, not 5.463 -> 6.
    assert estimate.credits == 7
    assert estimate.price_ref == f"book:anthropic/{MODEL}@always"
    assert (estimate.operation, estimate.route) == ("estimate.test", f"anthropic:{MODEL}")


def test_credits_round_to_the_quantum_per_turn() -> None:
    """With a quantum of 5, each of the three turns costs 5 credits."""
    estimate = engine(price_book(credit_quantum=5)).estimate(operation(), "hello world")
    assert estimate.credits == 15


def test_limits_narrow_the_worst_case() -> None:
    """A run's narrower limits give a smaller worst case; a wider one is clamped."""
    narrowed = engine().estimate(operation(max_turns=3), "hello world", limits={"max_turns": 1})
    assert (narrowed.turns, narrowed.turn_input_tokens, narrowed.credits) == (1, (7,), 2)
    widened = engine().estimate(operation(max_turns=3), "hello world", limits={"max_turns": 9})
    assert widened.turns == 3


def test_system_tools_and_structured_output_are_counted(
    tiktoken_cl100k: tiktoken.Encoding,
) -> None:
    """The system text, each tool definition as JSON, and the tool-use prompt are counted."""

    @le.tool(name="lookup", description="Look a key up.")
    def lookup(key: str) -> str:
        return key

    class Answer(pydantic.BaseModel):
        value: int

    def count(text: str) -> int:
        return len(tiktoken_cl100k.encode_ordinary(text))

    def as_json(value: Any) -> str:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)

    plain = engine().estimate(operation(), "hello world")
    full = engine().estimate(operation(), "hello world", system="Be brief.", tools=[lookup],
                             output=Answer)
    final = {"name": "final_answer",
             "description": "Give your final answer. Call this exactly once, when you "
                            "have the answer, with the answer as its input.",
             "input_schema": {"properties": {"value": {"title": "Value", "type": "integer"}},
                              "required": ["value"], "type": "object"}}
    assert full.counted_tokens == (plain.counted_tokens + count("Be brief.")
                                   + count(as_json(lookup.definition)) + count(as_json(final)))
    assert full.framing_tokens == plain.framing_tokens + _estimate.TOOL_PROMPT_TOKENS


def test_content_blocks_are_counted_by_kind(tiktoken_cl100k: tiktoken.Encoding) -> None:
    """Tool calls count their name and JSON input, results their text, images a fixed size."""
    messages = [
        {"role": "user", "content": "look it up"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Looking.", "cache_control": {"type": "ephemeral"}},
            {"type": "tool_use", "id": "t1", "name": "lookup", "input": {"key": "abc"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "text", "text": "the value"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": "iVBORw0KGgo" * 1000}},
            ]},
        ]},
    ]

    def count(text: str) -> int:
        return len(tiktoken_cl100k.encode_ordinary(text))

    estimate = engine().estimate(operation(), messages)
    assert estimate.counted_tokens == (count("look it up") + count("Looking.") + count("lookup")
                                       + count('{"key":"abc"}') + count("the value"))
    assert estimate.framing_tokens == 3 * _estimate.MESSAGE_OVERHEAD_TOKENS + _estimate.IMAGE_TOKENS


def test_prices_are_taken_at_the_engines_current_time() -> None:
    """A price that takes effect later does not apply; once the clock passes it, it does."""
    change = datetime(2026, 6, 1, tzinfo=UTC)
    book = le.PriceBook([
        le.ModelPrice(provider="anthropic", model=MODEL, input_per_mtok=Decimal(3),
                      output_per_mtok=Decimal(15)),
        le.ModelPrice(provider="anthropic", model=MODEL, input_per_mtok=Decimal(6),
                      output_per_mtok=Decimal(30), effective_from=change),
    ], credits_per_usd=Decimal(1000))
    clock = FakeClock(wall_start=change - timedelta(days=1))
    before = engine(book, clock).estimate(operation(), "hello world")
    clock.advance(2 * 86400)
    after = engine(book, clock).estimate(operation(), "hello world")
    assert before.cost_usd == Decimal("0.005463")
    assert after.cost_usd == 2 * Decimal("0.005463")
    assert (before.priced_at, after.priced_at) == (change - timedelta(days=1),
                                                   change + timedelta(days=1))


def test_an_unpriced_model_has_no_cost_or_credits() -> None:
    """Without a price, tokens are still estimated but USD and credits are None."""
    estimate = engine(le.PriceBook(fallback=False)).estimate(operation(), "hello world")
    assert (estimate.cost_usd, estimate.credits, estimate.price_ref) == (None, None, None)
    assert estimate.output_tokens == 300


def test_bad_input_is_a_config_error() -> None:
    """Input run would refuse, estimate refuses the same way."""
    with pytest.raises(le.ConfigError) as raised:
        engine().estimate(operation(), "")
    assert raised.value.field == "messages"
    with pytest.raises(le.ConfigError) as raised:
        engine().estimate(operation(), "hi", output=dict)  # type: ignore[arg-type]
    assert raised.value.field == "output"
    with pytest.raises(le.ConfigError) as raised:
        engine().estimate("op", "hi")  # type: ignore[arg-type]
    assert raised.value.field == "operation"


SEARCH_PER_K = Decimal(10)
"""Anthropic web search: $10 per 1,000 searches (a fee per request)."""


def test_server_tool_fees_count_at_their_worst_case() -> None:
    """Every turn may search ``max_uses`` times: 3 turns x (5 + 2) searches at
    $10 per 1,000 on top of the tokens; free web fetches add nothing."""
    book = le.PriceBook([le.ModelPrice(provider="anthropic", model=MODEL,
                                       input_per_mtok=Decimal(3), output_per_mtok=Decimal(15),
                                       web_search_per_k=SEARCH_PER_K)],
                        credits_per_usd=Decimal(1000))
    tools = (le.ServerTool(type="web_search_20250305", name="web_search", max_uses=5),
             le.ServerTool(type="web_search_20260209", name="news_search", max_uses=2),
             le.ServerTool(type="web_fetch_20250910", name="web_fetch"))
    searching = le.Operation(name="estimate.test", provider="anthropic", model=MODEL,
                             max_output_tokens=100, limits=le.Limits(max_turns=3),
                             server_tools=tools)
    estimate = engine(book).estimate(searching, "hello world")
    fee = 3 * (5 + 2) * SEARCH_PER_K / 1000
    # The tokens as in test_worst_case_arithmetic_by_hand: $0.005463.
    assert estimate.fee_usd == fee == Decimal("0.21")
    assert estimate.cost_usd == Decimal("0.005463") + fee
    # Per turn: 1.521 + 70 -> 72, 1.821 + 70 -> 72, 2.121 + 70 -> 73 credits.
    assert estimate.credits == 217
    assert estimate.unbounded_tools == ()
    plain = engine(book).estimate(operation(max_turns=3, max_output_tokens=100), "hello world")
    assert plain.fee_usd == 0 and plain.cost_usd == Decimal("0.005463")


def test_a_fee_without_max_uses_has_no_worst_case() -> None:
    """A web search tool without max_uses: the estimate names it and gives no cost."""
    unbounded = le.Operation(name="estimate.test", provider="anthropic", model=MODEL,
                             server_tools=(le.ServerTool(type="web_search_20250305",
                                                         name="web_search"),))
    estimate = engine().estimate(unbounded, "hello world")
    assert estimate.unbounded_tools == ("web_search",)
    assert (estimate.cost_usd, estimate.fee_usd, estimate.credits) == (None, None, None)
