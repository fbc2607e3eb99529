"""Bad input never escapes as a bare Python error: whatever is passed to the public
constructors and to `Engine.run` / `Engine.call`, the only exception that comes out
is a `ConfigError` with a `.field` (or, from a run or call that started, an outcome
of it), never a TypeError, a RecursionError or an OverflowError (hypothesis)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import anyio
import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import loopengine as le
from loopengine.persistence import MemoryLedger
from loopengine.providers import Reply, ScriptedProvider
from loopengine.testing import (
    CutStream,
    DropConnection,
    ErrorReply,
    FakeAnthropicServer,
    FakeClock,
    StallStream,
    StreamErrorEvent,
)
from loopengine.testing import Reply as WireReply


def deep(levels: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(levels):
        value = [value]
    return value


class BrokenRepr:
    """An object whose repr raises (an error message must not call it blindly)."""

    def __repr__(self) -> str:
        raise RuntimeError("no repr")


async def handler(**_: Any) -> str:
    return "ok"


class Answer(pydantic.BaseModel):
    x: int = 1


PRICE = le.ModelPrice(provider="anthropic", model="m", input_per_mtok=Decimal(1),
                      output_per_mtok=Decimal(2))
TOOL = le.Tool("lookup", "Look up.", {"type": "object"}, handler)

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=2**60),
    st.floats(allow_nan=True, allow_infinity=True),
    st.decimals(allow_nan=True, allow_infinity=True),
    st.text(st.characters(blacklist_categories=()), max_size=8),  # lone surrogates too
    st.binary(max_size=4), st.datetimes(), st.datetimes(timezones=st.just(UTC)),
    st.sampled_from(["", " ", "5m", "1h", "1e999999", "NaN", "3"]),
)
SPECIAL = [deep(3000), BrokenRepr(), object(), object, 3j, frozenset({1}), handler, Answer,
           le.Limits(), le.RetryPolicy(), PRICE, TOOL, [PRICE], [TOOL], (TOOL, TOOL),
           {"max_turns": 2}, {"max_turns": deep(3000)}, {"nope": 1}, le.Attribution(tenant="t"),
           iter([1, 2])]
"""Values no strategy draws: deep, unprintable, of the library's own types. Chosen by
index (hypothesis would print a 3,000-deep list in a strategy's repr)."""


class _Pick:
    """``values[index]``, shown by its index: hypothesis shows the draws of a
    failing example, and the repr of a 3,000-deep list (the list's
    ``__getitem__`` would show it) is a RecursionError that hid the failure
    behind a FlakyStrategyDefinition."""

    def __init__(self, values: list[Any]) -> None:
        self.values = values

    def __call__(self, index: int) -> Any:
        return self.values[index]

    def __repr__(self) -> str:
        return f"<one of {len(self.values)} special values>"


def special(values: list[Any]) -> st.SearchStrategy[Any]:
    return st.integers(0, len(values) - 1).map(_Pick(values))


PLAIN = st.one_of(
    SCALARS,
    st.recursive(SCALARS, lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.tuples(inner),
        st.dictionaries(st.one_of(st.text(max_size=4), st.integers()), inner, max_size=3)),
        max_leaves=6),
)
JUNK = st.one_of(PLAIN, special(SPECIAL))

BLOCKS = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": JUNK}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": JUNK, "name": JUNK,
                           "input": JUNK}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": st.just("t1"),
                           "content": JUNK}),
    st.fixed_dictionaries({"type": st.one_of(JUNK, st.just("compaction")), "content": JUNK}),
    JUNK,
)
MESSAGES = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["user", "assistant"]),
    "content": st.one_of(JUNK, st.lists(BLOCKS, max_size=3))}), min_size=1, max_size=3)
"""Histories shaped like messages with junk where the values go."""
NOT_CALLABLE = st.one_of(PLAIN, special([v for v in SPECIAL if not callable(v)]))
"""For the callback keywords: a callable there is the caller's own code, whose
exceptions are its own (an ``on_text`` that raises reaches the caller, by design)."""
VALUES = {"messages": st.one_of(JUNK, MESSAGES), "system": st.one_of(
    JUNK, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": JUNK}),
                   max_size=2)),
    "accept": NOT_CALLABLE, "on_text": NOT_CALLABLE, "tool_error_text": NOT_CALLABLE}

OPERATION = le.Operation(name="robust", provider="anthropic", model="m", max_output_tokens=16)

# Each public constructor: how to call it, the valid arguments, the fields to spoil.
CONSTRUCTORS: dict[str, tuple[Callable[..., Any], dict[str, Any]]] = {
    "Operation": (le.Operation, {"name": "n", "provider": "p", "model": "m",
                                 "max_output_tokens": 16, "version": "1", "limits": le.Limits(),
                                 "retry": le.RetryPolicy(), "cache": le.CachePolicy(),
                                 "model_max_output_tokens": None, "wrap_up_text": "Wrap up."}),
    "Limits": (le.Limits, {"max_turns": 3, "max_tool_batch": None, "max_tool_calls": None,
                           "total_time": None, "attempt_timeout": 60.0, "credit_hold": None,
                           "wrap_up": False}),
    "RetryPolicy": (le.RetryPolicy, {"max_attempts": 3, "initial_wait": 0.5, "max_wait": 8.0,
                                     "grow_max_tokens": True}),
    "CachePolicy": (le.CachePolicy, {"system": True, "tools": True, "conversation": True,
                                     "ttl": "1h"}),
    "Tool": (le.Tool, {"name": "t", "description": "d",
                       "input_schema": {"type": "object", "properties": {
                           "a": {"type": "integer", "minimum": 0},
                           "b": {"anyOf": [{"type": "string"}, {"$ref": "#/$defs/n"}]}},
                           "required": ["a"], "$defs": {"n": {"type": "array",
                                                              "items": {"$ref": "#/$defs/n"}}}},
                       "handler": handler, "max_calls": None, "timeout": None}),
    "tool": (lambda fn, **kw: le.tool(fn, **kw),
             {"fn": handler, "name": None, "description": None, "max_calls": None,
              "timeout": None}),
    "PriceBook": (le.PriceBook, {"prices": [PRICE], "credits_per_usd": Decimal(1000),
                                 "credit_quantum": 1, "fallback": True}),
    "ModelPrice": (le.ModelPrice, {"provider": "p", "model": "m", "input_per_mtok": 1,
                                   "output_per_mtok": 2, "cache_read_per_mtok": None,
                                   "cache_write_per_mtok": None, "cache_write_1h_per_mtok": None,
                                   "effective_from": None}),
    "Attribution": (le.Attribution, {"tenant": "t", "user_id": None, "feature": None,
                                     "correlation_id": None}),
    "Engine": (lambda provider, **kw: le.Engine(provider, **kw),
               {"provider": ScriptedProvider([Reply.text("ok")]), "ledger": None, "prices": None,
                "observers": (), "clock": None, "rng": None, "tool_error_text": None,
                "accounts": None}),
}

SPOILABLE = {name: list(valid) for name, (_, valid) in CONSTRUCTORS.items()}


def spoiled(data: st.DataObject, valid: dict[str, Any], fields: list[str]) -> dict[str, Any]:
    """The valid arguments with one or more of them replaced by junk."""
    chosen = data.draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique=True))
    return {**valid, **{f: data.draw(VALUES.get(f, JUNK), label=f) for f in chosen}}


def only_config_errors(call: Callable[[], Any]) -> None:
    """Run ``call``: success, or a ConfigError naming a field, nothing else."""
    try:
        call()
    except le.ConfigError as error:
        assert isinstance(error.field, str) and error.field
        assert str(error)
    except le.OutcomeError:
        pass  # a call that started and ended without an answer: an outcome, not bad input


@pytest.fixture(autouse=True)
def _quiet_tool_warnings(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="loopengine")


@pytest.mark.parametrize("name", sorted(CONSTRUCTORS))
@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_public_constructor_raises_only_config_errors(name: str, data: st.DataObject) -> None:
    """Any junk in any argument of a public constructor is a ConfigError (or is fine);
    an engine built from it then runs to an outcome: nothing bad was let through."""
    build, valid = CONSTRUCTORS[name]
    arguments = spoiled(data, valid, SPOILABLE[name])

    tool_input = data.draw(JUNK, label="tool input")

    def build_and_use() -> None:
        built = build(**arguments)
        if isinstance(built, le.Engine):
            anyio.run(lambda: built.run(OPERATION, "hi"))
        if isinstance(built, le.Tool):
            # Whatever a model sends is checked against the schema the tool kept:
            # a ToolInputError (answered to the model) or the handler's argument.
            with contextlib.suppress(le.ToolInputError):
                built.validate(tool_input)

    only_config_errors(build_and_use)


RUN_VALID: dict[str, Any] = {
    "operation": OPERATION, "messages": "hi", "system": None, "tools": (), "output": None,
    "accept": None, "attribution": None, "limits": None, "retry": None, "on_text": None,
    "tool_error_text": None, "final_tool": "final_answer"}
CALL_VALID: dict[str, Any] = {
    "operation": OPERATION, "messages": "hi", "output": Answer, "system": None, "retry": None,
    "attribution": None, "max_tokens": None, "limits": None, "prompt_fallback": False}


def engine() -> le.Engine:
    provider = ScriptedProvider([Reply.final({"x": 1}), Reply.text("done"),
                                 Reply.final({"x": 1})])
    return le.Engine(provider, ledger=MemoryLedger(),
                     prices=le.PriceBook([PRICE], fallback=False))


@pytest.mark.parametrize(("method", "valid"), [("run", RUN_VALID), ("call", CALL_VALID)])
@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_run_and_call_keywords_raise_only_config_errors(
    method: str, valid: dict[str, Any], data: st.DataObject
) -> None:
    """Any junk in the operation, the messages or any keyword of run / call is a
    ConfigError; nothing else escapes (a run's outcome is a value)."""
    arguments = spoiled(data, valid, list(valid))

    async def go() -> None:
        chosen = getattr(engine(), method)
        operation, messages = arguments.pop("operation"), arguments.pop("messages")
        await chosen(operation, messages, **arguments)

    only_config_errors(lambda: anyio.run(go))


@pytest.mark.parametrize(("method", "valid"), [("run", RUN_VALID), ("call", CALL_VALID)])
def test_the_valid_arguments_run(method: str, valid: dict[str, Any]) -> None:
    """The base the property spoils is itself valid: a run and a call complete."""

    async def go() -> Any:
        arguments = dict(valid)
        operation, messages = arguments.pop("operation"), arguments.pop("messages")
        return await getattr(engine(), method)(operation, messages, **arguments)

    result = anyio.run(go)
    assert result.invocation_id


@pytest.mark.parametrize(("build", "field"), [
    (lambda: ScriptedProvider(None), "script"),  # type: ignore[arg-type]
    (lambda: le.Usage(input_tokens=2**63, output_tokens=1), "input_tokens"),
    (lambda: le.Usage(1, 1, cache_read_tokens=2**64), "cache_read_tokens"),
    (lambda: ScriptedProvider([Reply.text("a"), 3]), "script[1]"),  # type: ignore[list-item]
    (lambda: ScriptedProvider().add(None), "items[0]"),  # type: ignore[arg-type]
    (lambda: Reply.text(3), "text"),  # type: ignore[arg-type]
    (lambda: Reply.text("a", usage=3), "usage"),  # type: ignore[arg-type]
    (lambda: Reply.text("a", delay=-1), "delay"),
    (lambda: Reply.tool_calls(3), "calls[0]"),  # type: ignore[arg-type]
    (lambda: Reply.tool_calls(("lookup", {}), ("", {})), "calls[1][0]"),
    (lambda: Reply.tool_calls(("lookup", 3)), "calls[0]"),  # type: ignore[arg-type]
    (lambda: Reply.tool_calls(("lookup", {}), text=3), "text"),  # type: ignore[arg-type]
    (lambda: Reply.final(3), "data"),  # type: ignore[arg-type]
    (lambda: Reply.final({}, tool_name=None), "tool_name"),  # type: ignore[arg-type]
    (lambda: le.Engine(ScriptedProvider([]), observers=None), "observers"),  # type: ignore[arg-type]
    (lambda: le.PriceBook(credits_per_usd=deep(3000)), "credits_per_usd"),  # type: ignore[arg-type]
    (lambda: le.Limits(max_turns=deep(3000)), "max_turns"),  # type: ignore[arg-type]
    (lambda: le.Limits(total_time=10**400), "total_time"),
    (lambda: le.Limits(credit_hold=2**63), "credit_hold"),
    (lambda: le.ModelPrice(provider="p", model="m", input_per_mtok="1e999999",
                           output_per_mtok=1), "input_per_mtok"),
    (lambda: le.Attribution(tenant=BrokenRepr()), "attribution.tenant"),  # type: ignore[arg-type]
    (lambda: le.Operation(name="n", provider="p", model="m",
                          limits=BrokenRepr()), "limits"),  # type: ignore[arg-type]
    (lambda: le.Tool("t", "d", {"type": "object"}, handler, timeout=10**400), "timeout"),
    (lambda: le.CachePolicy(ttl=deep(3000)), "ttl"),  # type: ignore[arg-type]
    (lambda: MemoryLedger(max_retained_attempts=deep(3000)), "max_retained_attempts"),
    (lambda: MemoryLedger(max_retained_attempts=BrokenRepr()), "max_retained_attempts"),
    (lambda: le.CreditAccounts(deep(3000)), "ledger"),
    (lambda: le.CreditAccounts(BrokenRepr()), "ledger"),
    (lambda: le.Usage(1, 1, iterations=(deep(3000),)), "iterations[0]"),  # type: ignore[arg-type]
    (lambda: le.Operation.from_mapping("op", {"provider": "p", "model": "m",
                                              "thinking": BrokenRepr()}), "thinking"),
    (lambda: le.Operation.from_mapping("op", {"provider": "p", "model": "m",
                                              "server_tools": [deep(3000)]}), "server_tools[0]"),
    (lambda: le.CachePolicy(ttl=BrokenRepr()), "ttl"),  # type: ignore[arg-type]
    (lambda: le.ModelPrice(provider="p", model="m", input_per_mtok=1, output_per_mtok=1,
                           effective_from=datetime(2025, 1, 1)), "effective_from"),
])
def test_the_cases_found_are_config_errors_naming_the_field(
    build: Callable[[], Any], field: str
) -> None:
    """The shapes that once escaped as TypeError, RecursionError or OverflowError."""
    with pytest.raises(le.ConfigError) as caught:
        build()
    assert caught.value.field == field


async def test_a_tools_list_holding_junk_names_the_item() -> None:
    """``tools=[tool, 3000-deep list]`` names ``tools[1]`` without printing the list."""
    with pytest.raises(le.ConfigError) as caught:
        await engine().run(OPERATION, "hi", tools=[TOOL, deep(3000)])
    assert caught.value.field == "tools[1]"
    assert len(str(caught.value)) < 200


class _Opaque:
    """A class pydantic has no JSON schema for."""


class _OpaqueField(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(arbitrary_types_allowed=True)
    value: _Opaque


class _Numbers(pydantic.RootModel[list[int]]):
    """A model whose JSON schema is an array's: no tool input."""


class _NaNDefault(pydantic.BaseModel):
    x: float = float("nan")


@pytest.mark.parametrize(("output", "says"), [
    (_OpaqueField, "no JSON schema"),
    (_Numbers, "type 'array'"),
    (_NaNDefault, "finite"),
    (pydantic.BaseModel, "subclass of BaseModel"),
])
@pytest.mark.parametrize("method", ["run", "call", "estimate"])
async def test_an_output_model_no_tool_can_carry_is_refused_before_anything_is_recorded(
    output: Any, says: str, method: str
) -> None:
    """``output=`` a model whose schema pydantic cannot generate, that is not an
    object's, or that JSON cannot carry is a ConfigError on ``output``: never a
    pydantic error, an AttributeError or a run of refused answers, and nothing is
    sent or recorded."""
    provider = ScriptedProvider([Reply.final({"x": 1})] * 3)
    ledger = MemoryLedger()
    built = le.Engine(provider, ledger=ledger, prices=le.PriceBook([PRICE], fallback=False))
    with pytest.raises(le.ConfigError, match=says) as caught:
        if method == "estimate":
            built.estimate(OPERATION, "hi", output=output)
        else:
            await getattr(built, method)(OPERATION, "hi", output=output)
    assert caught.value.field.startswith("output")
    assert provider.requests == []
    assert ledger.invocations == {}


def test_a_tool_input_model_no_tool_can_carry_is_a_config_error() -> None:
    """``Tool(input_model=...)`` refuses the same models, on ``input_model``."""
    for model in (_OpaqueField, _Numbers, pydantic.BaseModel):
        with pytest.raises(le.ConfigError) as caught:
            le.Tool("t", "d", handler=handler, input_model=model)
        assert caught.value.field == "input_model"


def test_a_function_python_cannot_read_is_not_a_tool() -> None:
    """``le.tool(int)`` (no signature Python can read) is a ConfigError on ``handler``,
    not inspect's ValueError."""
    with pytest.raises(le.ConfigError, match="signature") as caught:
        le.tool(int)
    assert caught.value.field == "handler"


def test_an_empty_tool_name_given_is_refused_not_replaced() -> None:
    """``@le.tool(name="")`` is a ConfigError on ``name``: a name given is checked,
    never silently replaced by the function's."""

    def lookup() -> str:
        """Look up."""
        return "x"

    with pytest.raises(le.ConfigError) as caught:
        le.tool(lookup, name="")
    assert caught.value.field == "name"


def test_a_tool_name_that_cannot_be_printed_is_refused_before_it_names_anything() -> None:
    """``le.tool(fn, name=<a 3,000-deep list>)`` is a ConfigError on ``name``: the
    name is checked before the input model is named after it (formatting it
    there raised RecursionError)."""

    def lookup(key: str) -> str:
        """Look a key up."""
        return key

    with pytest.raises(le.ConfigError) as caught:
        le.tool(lookup, name=deep(3000))
    assert caught.value.field == "name"

def _failing_lookup(key: str) -> str:
    """Look a key up."""
    raise ValueError("no \ud800 such key")


async def _async_error_text(name: str, error: BaseException) -> str:
    return f"{name} could not look it up"


@pytest.mark.parametrize(("hook", "told"), [
    (None, "no \ufffd such key"),
    (lambda name, error: 1 / 0, "_failing_lookup failed (ValueError)."),
    (lambda name, error: 3, "_failing_lookup failed (ValueError)."),
    (lambda name: "one argument", "_failing_lookup failed (ValueError)."),
    (_async_error_text, "_failing_lookup could not look it up"),
])
async def test_the_error_text_a_model_gets_is_always_a_string_it_can_be_sent(
    hook: Any, told: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Through the real SDK: a handler's message holding a lone surrogate is sent with
    U+FFFD in its place (it failed the SDK's encoder after its attempt's row); a
    ``tool_error_text`` hook that raises, returns a non-string or takes the wrong
    arguments is logged at ERROR and the model told the error's type (it escaped as
    an ExceptionGroup, or sent a tool result whose content was an int). An async hook
    is awaited, as an async judge is."""
    from loopengine.providers import AnthropicProvider
    from loopengine.testing import FakeAnthropicServer
    from loopengine.testing import Reply as WireReply

    lookup = le.tool(_failing_lookup)
    with FakeAnthropicServer([WireReply.tool_calls(("_failing_lookup", {"key": "k"})),
                              WireReply.text("done")]) as server:
        async with AnthropicProvider(api_key="test", base_url=server.url) as provider:
            result = await le.Engine(provider).run(OPERATION, "hi", tools=[lookup],
                                                   tool_error_text=hook)
        (sent,) = server.requests[1].messages[-1]["content"]
    assert result.outcome is le.Outcome.COMPLETED
    assert sent["is_error"] is True
    assert sent["content"] == told
    logged = [r for r in caplog.records if "tool_error_text hook" in r.getMessage()]
    assert [r.levelno for r in logged] == (
        [] if hook in (None, _async_error_text) else [logging.ERROR])


@pytest.mark.parametrize(("build", "field"), [
    (lambda values: le.Limits.from_mapping(values), "limits"),
    (lambda values: le.RetryPolicy.from_mapping(values), "retry"),
    (lambda values: le.Thinking.from_mapping(values), "thinking"),
    (lambda values: le.ServerTool.from_mapping(values), "server_tool"),
    (lambda values: le.Operation.from_mapping("op", values), "operation"),
])
@pytest.mark.parametrize("values", [None, [("max_turns", 3)], 3, "max_turns=3"])
def test_a_from_mapping_given_no_mapping_names_it(
    build: Callable[[Any], Any], field: str, values: Any
) -> None:
    """``Limits.from_mapping(None)`` (and each other ``from_mapping``) is a ConfigError
    naming the table, not the TypeError of iterating None."""
    with pytest.raises(le.ConfigError, match="must be a mapping") as caught:
        build(values)
    assert caught.value.field == field


@pytest.mark.parametrize("field", ["name", "provider", "model", "version"])
@pytest.mark.parametrize("bad", ["a\x00b", "line\nbreak", "zero\u200bwidth", "x" * 2000])
def test_an_operation_name_the_ledger_cannot_record_is_a_config_error(field: str, bad: str) -> None:
    """An operation's name, route, model and version are recorded on every invocation
    and printed by the audit: a NUL (which PostgreSQL text refuses: the run's first
    write was a LedgerError) or any other unprintable character, or an overlong
    value, is a ConfigError on that field when the operation is built."""
    values = {"name": "n", "provider": "anthropic", "model": "m", "version": "1", field: bad}
    with pytest.raises(le.ConfigError) as caught:
        le.Operation(max_output_tokens=16, **values)
    assert caught.value.field == field


def test_a_model_id_as_long_as_an_arn_is_accepted() -> None:
    """Model ids are printable and may be long (a Bedrock inference profile's ARN)."""
    arn = ("arn:aws:bedrock:us-east-1:123456789012:application-inference-profile/"
           + "a" * 200)
    assert le.Operation(name="n", provider="anthropic", model=arn).model == arn


@pytest.mark.parametrize(("account", "note", "field"), [
    ("acme\x00", None, "account"),
    ("acme\n", None, "account"),
    ("acme", "paid\x00", "note"),
    ("acme", "a\ud800", "note"),
])
async def test_a_grant_the_ledger_cannot_record_is_a_config_error(
    tmp_path: Any, account: str, note: str | None, field: str
) -> None:
    """An account name holding a NUL or another unprintable character, or a note
    holding a NUL or a lone surrogate, is a ConfigError before anything is written
    (on PostgreSQL the NUL was a LedgerError), and the account gets nothing."""
    from loopengine.persistence import SQLiteLedger

    async with SQLiteLedger(str(tmp_path / "ledger.db")) as ledger:
        accounts = le.CreditAccounts(ledger)
        with pytest.raises(le.ConfigError) as caught:
            await accounts.grant(account, 5, note)
        assert caught.value.field == field
        assert (await accounts.balance("acme")).granted == 0


def test_a_grant_note_may_span_lines() -> None:
    """A note is free text: line breaks are recorded as given."""
    from loopengine import _validate

    assert _validate.recorded_text("note", "line one\nline two") == "line one\nline two"


@pytest.mark.parametrize(("build", "field"), [
    (lambda: FakeClock(wall_start=datetime(2025, 1, 1)), "wall_start"),
    (lambda: FakeClock(wall_start="2025-01-01T00:00:00Z"), "wall_start"),  # type: ignore[arg-type]
    (lambda: FakeClock(float("nan")), "start"),
    (lambda: FakeClock().advance(-1), "seconds"),
    (lambda: FakeClock().advance(float("inf")), "seconds"),
])
def test_a_fake_clock_refuses_a_naive_wall_or_time_going_back(
    build: Callable[[], Any], field: str
) -> None:
    """``FakeClock(wall_start=<naive datetime>)`` is a ConfigError when built: a run on
    it failed its first comparison (a price's start) with a TypeError. Its monotonic
    time never goes back nor becomes NaN."""
    with pytest.raises(le.ConfigError) as caught:
        build()
    assert caught.value.field == field


async def test_a_run_on_a_fake_clock_with_an_aware_wall_start_is_priced() -> None:
    """The same run on an aware ``wall_start`` completes, priced at that moment."""
    clock = FakeClock(wall_start=datetime(2025, 1, 1, tzinfo=UTC))
    dated = le.ModelPrice(provider="anthropic", model="m", input_per_mtok=1, output_per_mtok=2,
                          effective_from=datetime(2024, 1, 1, tzinfo=UTC))
    provider = ScriptedProvider([Reply.text("ok")], clock=clock)
    result = await le.Engine(provider, clock=clock,
                             prices=le.PriceBook([dated], fallback=False)).run(OPERATION, "hi")
    assert result.outcome is le.Outcome.COMPLETED
    assert result.cost_usd > 0


def _numbers(count: int) -> Any:
    """Count up."""
    yield from range(count)


async def _numbers_async(count: int) -> Any:
    """Count up."""
    for number in range(count):
        yield number


@pytest.mark.parametrize("function", [_numbers, _numbers_async])
def test_a_generator_function_is_not_a_tool_handler(function: Any) -> None:
    """A generator function's call returns a generator, which the model got as its
    repr (``<generator object ...>``): ``le.tool`` and ``Tool`` refuse it."""
    with pytest.raises(le.ConfigError, match="generator") as caught:
        le.tool(function)
    assert caught.value.field == "handler"
    with pytest.raises(le.ConfigError, match="generator"):
        le.Tool("count", "Count up.", {"type": "object"}, function)


async def _look_up(argument: dict[str, Any]) -> str:
    return f"found {argument['key']}"


async def _forgetful(argument: dict[str, Any]) -> Any:
    return _look_up(argument)  # an ``await`` forgotten


@pytest.mark.parametrize("handler", [lambda argument: _look_up(argument), _forgetful],
                         ids=["sync", "async"])
async def test_a_handler_returning_a_coroutine_gives_what_it_awaits_to(handler: Any) -> None:
    """A handler that returns a coroutine (a sync lambda around an async function,
    an async one that forgot an ``await``) gives the model the coroutine's result,
    as a judge's awaitable verdict is awaited; it was ``<coroutine object ...>``,
    never awaited."""
    lookup = le.Tool("lookup", "Look up.", {"type": "object"}, handler)
    provider = ScriptedProvider([Reply.tool_calls(("lookup", {"key": "k"})),
                                 Reply.text("done")])
    result = await le.Engine(provider).run(OPERATION, "hi", tools=[lookup])
    assert result.outcome is le.Outcome.COMPLETED
    (sent,) = provider.requests[1].messages[-1]["content"]
    assert sent["content"] == "found k" and not sent.get("is_error")


class _NaiveClock:
    """A clock of the caller's whose wall time has no UTC offset."""

    def now(self) -> float:
        return 0.0

    def wall(self) -> datetime:
        return datetime(2026, 1, 1)

    async def sleep(self, seconds: float) -> None:
        return None

    def cancel_scope(self, seconds: float) -> anyio.CancelScope:
        return anyio.CancelScope()

    def deadline_scope(self, at: float) -> anyio.CancelScope:
        return anyio.CancelScope()

    def effective_deadline(self) -> float:
        return float("inf")


async def test_a_clock_whose_wall_is_naive_is_refused_when_given(tmp_path: Any) -> None:
    """``Engine(clock=...)`` and ``CreditAccounts(clock=...)`` read the clock's wall
    time once: a naive one is a ConfigError on ``clock.wall()``, where a run failed
    its first price lookup with a TypeError."""
    from loopengine.persistence import SQLiteLedger

    with pytest.raises(le.ConfigError) as caught:
        le.Engine(ScriptedProvider([Reply.text("ok")]), clock=_NaiveClock())  # type: ignore[arg-type]
    assert caught.value.field == "clock.wall()"
    async with SQLiteLedger(str(tmp_path / "ledger.db")) as ledger:
        with pytest.raises(le.ConfigError) as caught:
            le.CreditAccounts(ledger, clock=_NaiveClock())  # type: ignore[arg-type]
    assert caught.value.field == "clock.wall()"


@pytest.mark.parametrize("build", [
    lambda: FakeAnthropicServer([3]),
    lambda: FakeAnthropicServer(None),  # type: ignore[arg-type]
    lambda: FakeAnthropicServer().add(WireReply.text("ok"), "a reply"),  # type: ignore[arg-type]
])
def test_a_fake_servers_script_holding_junk_is_refused_when_given(build: Any) -> None:
    """A script item no request could be served (``3``) broke that request's
    connection when it came, a TypeError in the server's thread; ``None`` as the
    script was a TypeError. Each is a ConfigError naming it, before any request."""
    with pytest.raises(le.ConfigError) as caught:
        build()
    assert caught.value.field in {"script", "script[0]", "items[1]"}


@pytest.mark.parametrize(("build", "field"), [
    (lambda: ErrorReply(status="503"), "status"),
    (lambda: ErrorReply(status=5030), "status"),
    (lambda: DropConnection(delay=float("nan")), "delay"),
    (lambda: CutStream(reply=WireReply.text("x"), how="cut"), "how"),
    (lambda: CutStream(reply="x"), "reply"),
    (lambda: StreamErrorEvent(reply=WireReply.text("x"), after=-1), "after"),
    (lambda: StallStream(reply=WireReply.text("x"), seconds=-1), "seconds"),
])
def test_a_fake_servers_fault_item_with_a_bad_setting_names_it(
    build: Callable[[], Any], field: str
) -> None:
    """The fakes' fault items were built with any value and failed when served
    (a status "503" on the wire, a cut of an unknown kind); each is a ConfigError
    naming the setting."""
    with pytest.raises(le.ConfigError) as caught:
        build()
    assert caught.value.field == field


class _Orders:
    """A service whose methods are tools."""

    def status(self, order_id: str) -> str:
        """Look an order up."""
        return f"{order_id} shipped"


def test_a_method_taken_from_its_class_is_refused_and_a_bound_one_is_a_tool() -> None:
    """``@le.tool`` on a method in its class body (or ``le.tool(Orders.status)``) made
    ``self`` a required input the model had to supply; it is a ConfigError saying to
    use the bound method, which is a tool whose input is ``order_id`` alone."""
    with pytest.raises(le.ConfigError, match="bound method") as caught:
        le.tool(_Orders.status)
    assert caught.value.field == "handler"
    bound = le.tool(_Orders().status)
    assert bound.input_schema["required"] == ["order_id"]
    assert bound.validate({"order_id": "A-1"}).order_id == "A-1"


@pytest.mark.parametrize("field", ["total_time", "attempt_timeout", "pause_timeout"])
def test_a_duration_beyond_ten_years_is_a_config_error(field: str) -> None:
    """``Limits(total_time=1e15)`` was accepted, and a run on an account then failed
    after its invocation started, with the OverflowError of its reservation's
    expiry (a datetime past the year 9999)."""
    with pytest.raises(le.ConfigError, match="ten years") as caught:
        le.Limits(**{field: 1e15})
    assert caught.value.field == field


async def test_a_run_on_an_account_with_the_longest_limits_completes(tmp_path: Any) -> None:
    """The longest durations allowed carry through a run on an account with a run
    store: the reservation's expiry and the lease are computed, and it pauses and
    resumes to completion."""
    from loopengine import _validate
    from loopengine.persistence import SQLiteLedger

    longest = _validate.MAX_SECONDS
    operation = le.Operation(name="long", provider="anthropic", model="m", max_output_tokens=16,
                             limits=le.Limits(total_time=longest, attempt_timeout=longest,
                                              pause_timeout=longest, credit_hold=100))
    act = le.Tool("act", "Act.", {"type": "object"}, handler, approval=True)
    async with SQLiteLedger(str(tmp_path / "ledger.db")) as ledger:
        accounts = le.CreditAccounts(ledger)
        await accounts.grant("acme", 1000)
        engine = le.Engine(ScriptedProvider([Reply.tool_calls(("act", {})), Reply.text("done")]),
                           ledger=ledger, accounts=accounts, run_store=le.RunStore(ledger),
                           prices=le.PriceBook([PRICE], fallback=False))
        paused = await engine.run(operation, "go", tools=[act],
                                  attribution=le.Attribution(tenant="acme"))
        assert paused.outcome is le.Outcome.PAUSED
        done = await engine.resume(paused.invocation_id, tools=[act],
                                   decisions={paused.pending[0].id: le.Approve()})
    assert done.outcome is le.Outcome.COMPLETED



def _cyclic() -> list[Any]:
    """A list that holds itself: no query string can be written of it."""
    looped: list[Any] = []
    looped.append(looped)
    return looped


def _provider(name: str, **kwargs: Any) -> Any:
    from loopengine.providers import AnthropicProvider, GeminiProvider, OpenAIProvider

    if name == "bedrock":
        return AnthropicProvider.bedrock(**{"aws_region": "us-east-1", "aws_access_key": "a",
                                            "aws_secret_key": "b", **kwargs})
    build = {"anthropic": AnthropicProvider, "openai": OpenAIProvider,
             "gemini": GeminiProvider}[name]
    return build(**{"api_key": "k", **kwargs})


_SHARED_KEYWORDS = [("api_kye", "k"), ("base_url", 3), ("http_client", 3), ("timeout", "5"),
                    ("api_key", 3), ("api_key", ""), ("default_headers", ["x"]),
                    ("default_query", {1: "x"}), ("default_headers", {"x-team": 7}),
                    ("default_headers", {"x-team": None}), ("default_headers", {"x-team": b"a"}),
                    ("default_query", {"team": object()}), ("default_query", {"team": [{1: "x"}]}),
                    ("default_query", {"team": _cyclic()})]


@pytest.mark.parametrize(("provider", "keyword", "bad"), [
    *((name, keyword, bad) for name in ("anthropic", "bedrock", "openai")
      for keyword, bad in _SHARED_KEYWORDS),
    ("gemini", "api_kye", "k"), ("gemini", "api_key", 3), ("gemini", "api_key", ""),
])
def test_a_provider_keyword_unknown_or_of_the_wrong_type_is_a_config_error_naming_it(
    provider: str, keyword: str, bad: object
) -> None:
    """When the provider is built, through the SDK's keyword list and one shared
    check: the SDK would raise its own TypeError or AttributeError, or fail the
    first request."""
    with pytest.raises(le.ConfigError) as info:
        _provider(provider, **{keyword: bad})
    assert info.value.field == keyword
