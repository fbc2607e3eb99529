"""Bad input to the public API is a `ConfigError` naming the argument, raised by the
call that received it: never accepted only to misbehave mid-run, never a bare
TypeError or AttributeError from deep inside."""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import anyio
import pytest
from click.testing import CliRunner

import loopengine as le
from loopengine import audit
from loopengine.cli import main
from loopengine.mcp import MCPServer
from loopengine.otel import OpenTelemetryObserver
from loopengine.persistence import SQLiteLedger
from loopengine.providers import (
    Container,
    ProviderResponse,
    RecordingProvider,
    ReplayProvider,
    Reply,
    ScriptedProvider,
)
from loopengine.testing import FakeAnthropicServer, FakeClock
from loopengine.testing import Reply as WireReply


def refused(call: Callable[[], object], field: str) -> le.ConfigError:
    """Run ``call``: it must raise a ConfigError naming ``field``."""
    with pytest.raises(le.ConfigError) as raised:
        call()
    assert raised.value.field == field
    return raised.value


async def _async_check(_: Any) -> bool:
    return False


class _AsyncCall:
    async def __call__(self, _: Any) -> bool:
        return False


ASYNC_CALLABLES = [_async_check, functools.partial(_async_check), _AsyncCall()]


async def lookup(city: str) -> str:
    """Look a city up."""
    return city


@pytest.mark.parametrize("check", ASYNC_CALLABLES)
def test_an_async_approval_check_is_refused_when_the_tool_is_built(check: Any) -> None:
    """An approval check's answer is used as it is returned: an async one would
    answer a coroutine, and every call would wait for a person, whatever it said."""
    with pytest.raises(le.ConfigError, match="not async") as raised:
        le.tool(lookup, approval=check)
    assert raised.value.field == "approval"
    with pytest.raises(le.ConfigError, match="not async"):
        le.Tool("t", "d", {"type": "object"}, lookup, approval=check)
    assert le.tool(lookup, approval=lambda call: True).approval is not False


@pytest.mark.parametrize("approval", [_async_check, {"lookup": _async_check}])
def test_an_mcp_servers_async_approval_check_is_refused(approval: Any) -> None:
    """The same for an MCP server's approval, for every tool or by name."""
    with pytest.raises(le.ConfigError, match="not async") as raised:
        MCPServer.stdio("server", approval=approval)
    assert raised.value.field.startswith("approval")


def test_an_async_account_key_is_refused(tmp_path: Any) -> None:
    """An account key is used as it is returned: an async one's coroutine is no
    account name, and every run would fail when it started."""
    ledger = SQLiteLedger(tmp_path / "ledger.db")
    try:
        with pytest.raises(le.ConfigError, match="not async") as raised:
            le.CreditAccounts(ledger, key=_async_check)
        assert raised.value.field == "key"
        assert le.CreditAccounts(ledger, key=lambda a: a.tenant) is not None
    finally:
        ledger.close()


async def _async_reply(_: Any) -> Reply:
    return Reply.text("hi")


def test_an_async_script_function_is_refused_when_the_script_is_given() -> None:
    """A scripted provider's or fake server's script function is called and its
    answer served as it is: an async one's coroutine is no reply, and its run
    ended provider_error instead of naming the script's mistake."""
    with pytest.raises(le.ConfigError, match="not async") as raised:
        ScriptedProvider([Reply.text("a"), _async_reply])
    assert raised.value.field == "script[1]"
    provider = ScriptedProvider([])
    with pytest.raises(le.ConfigError, match="not async"):
        provider.add(_async_reply)
    with pytest.raises(le.ConfigError, match="not async") as raised:
        FakeAnthropicServer([WireReply.text("a"), _async_reply])
    assert raised.value.field == "script[1]"


LEDGER = "ledger.db"


@pytest.mark.parametrize(("build", "field"), [
    (lambda: le.Engine(ScriptedProvider), "provider"),
    (lambda: le.Engine({"anthropic": ScriptedProvider}), "provider"),
    (lambda: le.Engine(ScriptedProvider([]), ledger=SQLiteLedger), "ledger"),
    (lambda: le.Engine(ScriptedProvider([]), clock=FakeClock), "clock"),
    (lambda: le.Engine(ScriptedProvider([]), observers=[OpenTelemetryObserver]), "observers[0]"),
    (lambda: le.CreditAccounts(SQLiteLedger(LEDGER), clock=FakeClock), "clock"),
    (lambda: RecordingProvider(ScriptedProvider, LEDGER), "inner"),
    (lambda: OpenTelemetryObserver(providers=[ScriptedProvider]), "providers"),
])
def test_a_class_given_for_an_object_is_refused(build: Any, field: str,
                                                tmp_path: Any, monkeypatch: Any) -> None:
    """A class passes a protocol's isinstance check (its methods are attributes):
    given without its call, it failed mid-run calling a method without ``self``
    (or, as an observer, built and dropped an object on every event)."""
    monkeypatch.chdir(tmp_path)
    refused(build, field)


@pytest.mark.parametrize(("path", "says"), [
    ("missing/call.jsonl", "cannot create the recording"),
    (".", "cannot create the recording"),
    ("", "path is empty"),
    ("  ", "path is only whitespace"),
    (3, "must be a str"),
])
def test_a_recording_path_that_cannot_be_a_file_is_a_config_error(
        path: Any, says: str, tmp_path: Any, monkeypatch: Any) -> None:
    """A recording in a missing directory, a directory or no path at all was an
    OSError from deep inside (or a TypeError for a number); a replay of a
    directory the same."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(le.ConfigError, match=says) as raised:
        RecordingProvider(ScriptedProvider([]), path)
    assert raised.value.field == "path"
    if path != "missing/call.jsonl":
        with pytest.raises(le.ConfigError) as raised:
            ReplayProvider(path)
        assert raised.value.field == "path"


@pytest.mark.parametrize("ref", ["#/$defs/missing", "#/properties/nope", "#/$defs/n/items"])
def test_a_local_ref_to_nothing_is_refused_when_the_tool_is_built(ref: str) -> None:
    """A ``$ref`` that points to nothing was checked as "any value" and sent, for
    the API to refuse the tool definition after the attempt's row."""
    schema = {"type": "object", "properties": {"a": {"$ref": ref}},
              "$defs": {"n": {"type": "integer"}}}
    with pytest.raises(le.ConfigError, match="names no schema") as raised:
        le.Tool("t", "d", schema, lookup)
    assert raised.value.field == "input_schema"


def test_a_named_anchor_and_a_percent_encoded_pointer_are_not_refused() -> None:
    """Only a JSON pointer that names nothing is refused: a plain-name fragment
    (``#node``, an ``$anchor``) is left to the API, and a pointer's fragment is
    percent-decoded before it is followed (``#/$defs/a%20b`` is ``a b``)."""
    schema = {"type": "object", "properties": {
        "a": {"$ref": "#node"}, "b": {"$ref": "#/$defs/a%20b"}},
        "$defs": {"a b": {"type": "integer"}, "n": {"$anchor": "node", "type": "string"}}}
    tool = le.Tool("t", "d", schema, lookup)
    assert tool.validate({"b": 3}) == {"b": 3}
    with pytest.raises(le.ToolInputError, match="b"):
        tool.validate({"b": "three"})


def test_a_ref_to_the_root_is_checked_as_the_root() -> None:
    """``#`` is the whole schema (a tree of nodes): a node of the wrong shape is
    refused, not let through as "any value"."""
    tree = le.Tool("tree", "d", {"type": "object", "properties": {
        "n": {"type": "integer"}, "child": {"$ref": "#"}}}, lookup)
    assert tree.validate({"n": 1, "child": {"n": 2}}) == {"n": 1, "child": {"n": 2}}
    with pytest.raises(le.ToolInputError, match="child.n"):
        tree.validate({"n": 1, "child": {"n": "two"}})


# -- the audit's arguments, from Python and from the command line -------------------------


@pytest.fixture(scope="module")
def one_run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A ledger holding one run, by tenant acme."""
    path = tmp_path_factory.mktemp("audit") / "ledger.db"

    async def go() -> None:
        with SQLiteLedger(path) as ledger:
            engine = le.Engine(ScriptedProvider([Reply.text("ok")]), ledger=ledger)
            operation = le.Operation(name="probe", provider="anthropic", model="m",
                                     max_output_tokens=16)
            await engine.run(operation, "go", attribution=le.Attribution(tenant="acme"))

    anyio.run(go)
    return path


@pytest.mark.parametrize(("query", "field"), [
    (lambda c: audit.runs(c, tenant=3), "tenant"),
    (lambda c: audit.runs(c, since=datetime(2026, 1, 1, tzinfo=UTC)), "since"),
    (lambda c: audit.spend(c, tenat="acme"), "tenat"),
    (lambda c: audit.runs(c, outcome="complete"), "outcome"),
    (lambda c: audit.runs(c, since="2027-01-01", until="2026-01-01"), "until"),
    (lambda c: audit.export_rows(c, since="2026-01-01", until="2026-01-01"), "until"),
    (lambda c: audit.runs(c, since="yesterday"), "since"),
    (lambda c: audit.runs(c, limit=-1), "limit"),
    (lambda c: audit.runs(c, limit=10**30), "limit"),
    (lambda c: audit.spend(c, by="tenants"), "by"),
    (lambda c: audit.spend(c, roll_up="no"), "roll_up"),
    (lambda c: audit.show(c, ""), "invocation_id"),
    (lambda c: audit.show(c, None), "invocation_id"),
    (lambda c: audit.reconcile(c, older_than=3600), "older_than"),
    (lambda c: audit.reconcile(c, older_than=timedelta(hours=-1)), "older_than"),
])
def test_a_bad_audit_argument_is_a_config_error_naming_it(one_run: Any, query: Any,
                                                          field: str) -> None:
    """A filter that is not text, or names no filter, was dropped and the query
    read every row (an invoice export of every tenant); an outcome typo or an
    inverted period read none, and an empty id showed whichever run there was;
    a negative limit was none, the rest a TypeError or a database error."""
    conn = audit.open_ledger(one_run)
    try:
        with pytest.raises(le.ConfigError) as raised:
            query(conn)
        assert raised.value.field == field
        assert isinstance(raised.value, ValueError)  # as the docs promised for the period
        assert [r.tenant for r in audit.runs(conn, tenant="acme", outcome="completed")] == \
            ["acme"]
    finally:
        conn.close()


@pytest.mark.parametrize(("args", "says"), [
    (["runs", "--since", "2027-01-01", "--until", "2026-01-01"], "--until: must be later"),
    (["export", "--since", "2026-01-01", "--until", "2026-01-01"], "--until: must be later"),
    (["show", ""], "INVOCATION_ID: must be a non-empty string"),
    (["runs", "--limit", str(10**30)], "--limit"),
])
def test_a_bad_audit_command_argument_exits_2_with_one_line(one_run: Any, args: list[str],
                                                            says: str) -> None:
    """The same through the command: exit 2 and a line naming the option, never a
    table of whichever run there was, an empty answer or a database error."""
    result = CliRunner().invoke(main, ["audit", args[0], "--db", str(one_run), *args[1:]],
                                catch_exceptions=False)
    assert result.exit_code == 2, result.output
    assert says in result.output
    assert "Traceback" not in result.output and "bug" not in result.output


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"kind": "rate_limit"}, "kind"),
    ({"kind": ["timeout"]}, "kind"),
    ({"message": 3}, "message"),
    ({"usage": {"input_tokens": 3}}, "usage"),
    ({"retry_after": "5"}, "retry_after"),
    ({"retry_after": float("nan")}, "retry_after"),
    ({"retry_after": -1}, "retry_after"),
    ({"http_status": "500"}, "http_status"),
    ({"http_status": True}, "http_status"),
    ({"should_retry": "false"}, "should_retry"),
    ({"usage_approx": None}, "usage_approx"),
    ({"error_code": 400}, "error_code"),
    ({"request_id": b"req_1"}, "request_id"),
    ({"response_id": 7}, "response_id"),
    ({"aborted_reason": ["idle"]}, "aborted_reason"),
])
def test_a_fault_that_the_retry_loop_cannot_read_is_refused_where_it_is_built(
        kwargs: dict[str, Any], field: str) -> None:
    """A custom provider's or a script's fault with a usage that is no Usage, or a
    retry_after that is text, broke the run mid-retry with an AttributeError or
    a TypeError escaping it; a kind that is no FaultKind was a bare ValueError;
    should_retry="false" was retried, and a status or id of another type went
    to the ledger as it was."""
    arguments: dict[str, Any] = {"kind": le.FaultKind.RATE_LIMITED, "message": "slow down",
                                 **kwargs}
    with pytest.raises(le.ConfigError) as raised:
        le.ProviderFault(arguments.pop("kind"), arguments.pop("message"), **arguments)
    assert raised.value.field == field
    fault = le.ProviderFault("rate_limited", "slow down", retry_after=2, usage=le.Usage())
    assert fault.kind is le.FaultKind.RATE_LIMITED and fault.retry_after == 2


TEXT = [{"type": "text", "text": "hi"}]


@pytest.mark.parametrize(("build", "field"), [
    (lambda: ProviderResponse(content=3, stop_reason="end_turn"), "content"),
    (lambda: ProviderResponse(content="hi", stop_reason="end_turn"), "content"),
    (lambda: ProviderResponse(content=[3], stop_reason="end_turn"), "content[0]"),
    (lambda: ProviderResponse(content=TEXT, stop_reason=3), "stop_reason"),
    (lambda: ProviderResponse(content=TEXT, stop_reason="end_turn", usage=3), "usage"),
    (lambda: ProviderResponse(content=TEXT, stop_reason="end_turn", container="c"), "container"),
    (lambda: Container("c", datetime(2030, 1, 1)), "expires_at"),
    (lambda: Container("", datetime(2030, 1, 1, tzinfo=UTC)), "id"),
    (lambda: Reply(content=3), "content"),
    (lambda: Reply(content=TEXT, usage={"input_tokens": 1}), "usage"),
    (lambda: Reply(content=TEXT, delay=float("nan")), "delay"),
    (lambda: ScriptedProvider([], clock=3), "clock"),
    (lambda: ScriptedProvider([], name=""), "name"),
])
def test_a_response_the_engine_cannot_read_is_refused_where_it_is_built(
        build: Any, field: str) -> None:
    """A custom provider's response (or a scripted one) with content that is no
    list of blocks, a usage that is no Usage or a container expiring at a naive
    time broke its run with a TypeError or AttributeError escaping it; a scripted
    provider's junk clock ended its run provider_error."""
    refused(build, field)


@pytest.mark.parametrize(("db", "says"), [
    ("", "--db: needs a file path, and the path is empty"),
    (" ", "--db: needs a file path, and the path is only whitespace"),
    ("postgresql://[::1", "--db: is not a PostgreSQL connection string"),
])
def test_a_demo_ledger_path_the_ledger_refuses_exits_2_with_one_line(db: str,
                                                                      says: str) -> None:
    """An empty --db (or a malformed URL) was a ConfigError traceback with exit 1;
    libpq's message kept its trailing newline."""
    result = CliRunner().invoke(main, ["demo", "--db", db], catch_exceptions=False)
    assert result.exit_code == 2, result.output
    assert says in result.output
    assert result.output.count("\n") == 1 and "\\x0a" not in result.output


def test_a_price_book_asked_at_a_naive_time_says_so_whatever_it_holds() -> None:
    """A naive ``at`` worked on a book without dated entries and was a TypeError on
    one with an ``effective_from``: the same question now has one answer."""
    dated = le.ModelPrice(provider="anthropic", model="m", input_per_mtok=Decimal(1),
                          output_per_mtok=Decimal(2),
                          effective_from=datetime(2026, 1, 1, tzinfo=UTC))
    undated = le.ModelPrice(provider="anthropic", model="n", input_per_mtok=Decimal(1),
                            output_per_mtok=Decimal(2))
    book = le.PriceBook([dated, undated])
    naive = datetime(2026, 6, 1)
    for model in ("m", "n"):
        refused(lambda m=model: book.price("anthropic", m, le.Usage(input_tokens=1), naive),
                "at")
        refused(lambda m=model: book.knows("anthropic", m, naive), "at")
    refused(lambda: book.price("anthropic", "m", {"input_tokens": 1},
                               naive.replace(tzinfo=UTC)), "usage")
    priced = book.price("anthropic", "m", le.Usage(input_tokens=1_000_000),
                        naive.replace(tzinfo=UTC))
    assert priced is not None and priced.cost_nanousd == 1_000_000_000


@pytest.mark.parametrize("host", ["", " ", 3])
def test_a_fake_server_host_that_names_no_address_is_refused(host: Any) -> None:
    """An empty host bound the fake on every interface instead of loopback; a
    number was a TypeError when the server started."""
    refused(lambda: FakeAnthropicServer(host=host), "host")


@pytest.mark.parametrize("path", ["", " ", "\t"])
def test_a_blank_path_names_no_file(path: str, tmp_path: Any, monkeypatch: Any) -> None:
    """A path of only whitespace (an unset or mistyped setting) made a file named
    ``' '`` in the working directory for a ledger; it is refused like an empty
    one, by the ledger, a recording and an operations catalogue, and nothing
    is created."""
    monkeypatch.chdir(tmp_path)
    for build in (lambda: SQLiteLedger(path), lambda: le.load_operations(path),
                  lambda: RecordingProvider(ScriptedProvider([]), path)):
        refused(build, "path")
    assert list(tmp_path.iterdir()) == []
