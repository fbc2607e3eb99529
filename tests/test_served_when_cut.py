"""A stream that a cancellation cuts (the caller leaving, the attempt's timeout, the
run's deadline) keeps what the server had served: its status, its response id and
its usage so far (a floor), in the attempt's row, its `AttemptSettled` and the
result alike, so the audit sees what the provider may bill.

Through each SDK provider, its real SDK and its loopback fake: the server sends
the start of a streamed reply (the response id, and on the Messages API and the
Gemini API the input tokens) and then nothing more. A reply read whole is cut the
same way once its status and headers have arrived, while its body comes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest

import loopengine as le
from loopengine import audit, events
from loopengine.persistence import SQLiteLedger
from loopengine.providers import (
    AnthropicProvider,
    GeminiProvider,
    OpenAIProvider,
    OpenAIResponsesProvider,
)
from loopengine.testing import (
    FakeAnthropicServer,
    FakeGeminiServer,
    FakeOpenAIServer,
    Reply,
    StallStream,
)

NEVER = 3600.0
"""The stall outlasts the test: the server sends nothing more until it closes."""

USAGE = le.Usage(input_tokens=900, output_tokens=40)


@dataclass(frozen=True)
class Route:
    server: Callable[[], Any]
    provider: Callable[[Any], Any]
    route: str
    vendor: str
    model: str
    after: int
    """Events (chunks) sent before the stall: past the first text, before the end."""
    input_floor: int | None
    """The input tokens the events before the stall report (None: no usage before
    the end of the stream, as Chat Completions and the Responses API send it)."""


ROUTES = {
    "anthropic": Route(FakeAnthropicServer,
                       lambda s: AnthropicProvider(api_key="k", base_url=s.url),
                       "anthropic", "anthropic", "claude-sonnet-4-5", 3, 900),
    "openai": Route(FakeOpenAIServer,
                    lambda s: OpenAIProvider(api_key="k", base_url=s.base_url),
                    "openai", "openai", "gpt-4o-mini", 3, None),
    "openai-responses": Route(FakeOpenAIServer,
                              lambda s: OpenAIResponsesProvider(api_key="k", base_url=s.base_url),
                              "openai", "openai", "gpt-4o-mini", 6, None),
    "gemini": Route(FakeGeminiServer,
                    lambda s: GeminiProvider(api_key="k", http_options={"base_url": s.url}),
                    "gemini", "google", "gemini-2.5-flash", 1, 900),
}


@pytest.fixture(params=list(ROUTES))
async def wire(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Route, Any, Any]]:
    route = ROUTES[request.param]
    with route.server() as server:
        provider = route.provider(server)
        try:
            yield route, server, provider
        finally:
            await provider.aclose()


def book(route: Route) -> le.PriceBook:
    return le.PriceBook([le.ModelPrice(provider=route.vendor, model=route.model,
                                       input_per_mtok=Decimal(1), output_per_mtok=Decimal(1))])


def audited(path: Path) -> tuple[dict[str, Any], dict[str, Any], audit.Reconciliation]:
    """The ledger's one run, its one attempt row and the reconcile report, as the
    audit reads them."""
    conn = audit.open_ledger(str(path))
    try:
        (run_row,) = audit.runs(conn)
        invocation, (row,) = audit.show(conn, run_row.id)
        return invocation, row, audit.reconcile(conn)
    finally:
        conn.close()


def stalled() -> StallStream:
    return StallStream(reply=Reply.text("one two three four five six", usage=USAGE),
                       after=0, seconds=NEVER)


async def test_r07_leaving_a_stream_keeps_what_it_had_served(
    wire: tuple[Route, Any, Any], tmp_path: Path
) -> None:
    """The caller leaves `Engine.stream` at the first text: the attempt is aborted
    (external) with the reply's status and response id, and, where the stream had
    reported it, its input usage as a floor; the ledger, the event and the audit
    agree, and an answered attempt without usage is listed as usage unknown."""
    route, server, provider = wire
    server.add(StallStream(reply=stalled().reply, after=route.after, seconds=NEVER))
    seen: list[events.Event] = []
    path = tmp_path / "ledger.db"
    operation = le.Operation(name="cut", provider=route.route, model=route.model)
    with SQLiteLedger(str(path)) as ledger:
        engine = le.Engine(provider, ledger=ledger, prices=book(route), observers=[seen.append])
        with anyio.fail_after(30):
            async with engine.stream(operation, "go") as run:
                async for event in run:
                    if isinstance(event, events.TextDelta):
                        break
    (settled,) = [e for e in seen if isinstance(e, events.AttemptSettled)]
    assert (settled.outcome, settled.aborted_reason, settled.fault) == (
        "aborted", "external", None)
    assert settled.http_status == 200 and settled.response_id
    invocation, row, report = audited(path)
    assert invocation["outcome"] == "cancelled"
    assert (row["http_status"], row["response_id"]) == (200, settled.response_id)
    assert report.mismatches == []
    if route.input_floor is None:
        assert settled.usage is None and row["input_tokens"] is None
        assert [a["ordinal"] for a in report.usage_unknown] == [1] and not report.ok
    else:
        assert settled.usage is not None and settled.usage_approx
        assert settled.usage.input_tokens == route.input_floor == row["input_tokens"]
        assert row["usage_approx"] == 1 and row["charged"] == 0
        assert row["cost_nanousd"] == invocation["provider_cost_nanousd"] > 0
        assert invocation["cost_nanousd"] == 0  # never charged, what it served is billed
        assert [a["ordinal"] for a in report.usage_floor] == [1]


@pytest.mark.realtime
async def test_r07_the_attempt_timeout_keeps_what_the_stream_had_served(tmp_path: Path) -> None:
    """The engine's own attempt timeout cuts a stream that stalled after its first
    events: the timed-out attempt keeps the reply's id and input tokens (a floor),
    and the run's provider cost holds them, as the server's count does. The
    timeout is a whole second, so a busy machine gets the request out first."""
    route = ROUTES["anthropic"]
    with route.server() as server:
        server.add(StallStream(reply=stalled().reply, after=route.after, seconds=NEVER),
                   Reply.text("ok", usage=le.Usage(input_tokens=10, output_tokens=1)))
        provider = route.provider(server)
        try:
            engine = le.Engine(provider, prices=book(route))
            operation = le.Operation(name="cut", provider=route.route, model=route.model,
                                     limits=le.Limits(attempt_timeout=1.0),
                                     retry=le.RetryPolicy(initial_wait=0, max_wait=0))
            result = await engine.run(operation, "go", on_text=lambda text: None)
        finally:
            await provider.aclose()
        served = server.usage_served
    assert result.outcome is le.Outcome.COMPLETED
    cut = result.attempt_log[0].settle
    assert cut is not None and (cut.fault, cut.http_status) == ("timeout", 200)
    assert cut.response_id and cut.usage_approx
    assert cut.usage is not None and cut.usage.input_tokens == 900
    assert result.usage.input_tokens == served.input_tokens == 910


HOOKED = {
    "anthropic": lambda s, http: AnthropicProvider(api_key="k", base_url=s.url, http_client=http),
    "openai": lambda s, http: OpenAIProvider(api_key="k", base_url=s.base_url, http_client=http),
    "openai-responses": lambda s, http: OpenAIResponsesProvider(api_key="k", base_url=s.base_url,
                                                                http_client=http),
}
"""The providers that read a whole reply through the SDK's raw response (status and
headers first, then the body), on an HTTP client whose response hook says when the
headers have arrived."""


@pytest.mark.parametrize("name", list(HOOKED))
async def test_r07_a_reply_cut_while_its_body_arrives_keeps_its_status_and_request_id(
    name: str, tmp_path: Path
) -> None:
    """A request that is not streamed, cancelled by the caller once the server has
    sent its status and headers (and half its body, then nothing more): the
    attempt is aborted (external) with that status and the request id, so the
    audit lists it as answered with its usage unknown, as a cut stream's."""
    route = ROUTES[name]
    headers = anyio.Event()

    async def arrived(response: httpx2.Response) -> None:
        headers.set()

    seen: list[events.Event] = []
    path = tmp_path / "ledger.db"
    operation = le.Operation(name="cut", provider=route.route, model=route.model)
    with route.server() as server:
        server.add(stalled())
        provider = HOOKED[name](server, httpx2.AsyncClient(event_hooks={"response": [arrived]}))
        try:
            with SQLiteLedger(str(path)) as ledger:
                engine = le.Engine(provider, ledger=ledger, prices=book(route),
                                   observers=[seen.append])
                with anyio.fail_after(30), anyio.CancelScope() as scope:
                    async with anyio.create_task_group() as group:
                        group.start_soon(engine.run, operation, "go")
                        await headers.wait()
                        scope.cancel()
        finally:
            await provider.aclose()
    assert scope.cancelled_caught
    (settled,) = [e for e in seen if isinstance(e, events.AttemptSettled)]
    assert (settled.outcome, settled.aborted_reason, settled.fault) == (
        "aborted", "external", None)
    assert (settled.http_status, settled.request_id, settled.usage) == (
        200, "req_fake_0001", None)
    invocation, row, report = audited(path)
    assert invocation["outcome"] == "cancelled"
    assert (row["http_status"], row["request_id"], row["input_tokens"]) == (
        200, "req_fake_0001", None)
    assert [a["ordinal"] for a in report.usage_unknown] == [1] and not report.ok
