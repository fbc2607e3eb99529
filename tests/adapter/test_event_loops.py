"""One engine across consecutive event loops (a sync web handler or a task queue
calling ``asyncio.run`` again and again), through AnthropicProvider, the real
SDK and the loopback FakeAnthropicServer.

A pooled connection belongs to the loop that opened it. A provider built from
keywords keeps a client per loop, closed as that loop shuts down; a client the
caller gave is refused on any loop but its first, before anything is sent; and
a client failing on its own loop state is never recorded as a connection fault.

The tests are sync: each runs its event loops itself.
"""

from __future__ import annotations

import asyncio
import gc
import time
import warnings
import weakref
from collections.abc import Callable, Coroutine
from typing import Any

import anthropic
import anyio
import httpx2
import pytest

import loopengine as le
from loopengine import Usage
from loopengine.persistence import MemoryLedger
from loopengine.providers import AnthropicProvider, FaultKind, ProviderFault
from loopengine.providers._anthropic import classify_error
from loopengine.testing import FakeAnthropicServer, Reply

from ..conftest import MODEL, PRICES, operation
from .conftest import STREAMING


def reply(n: int) -> Reply:
    """A reply whose usage differs per run, so totals cannot match by accident."""
    return Reply.text(f"answer {n}", usage=Usage(input_tokens=100 + n, output_tokens=10 + n))


def ledger_usage(ledger: MemoryLedger) -> Usage:
    """The tokens the ledger's invocations add up to."""
    total = Usage()
    for row in ledger.invocations.values():
        total = total + Usage(input_tokens=row["input_tokens"],
                              output_tokens=row["output_tokens"],
                              cache_read_tokens=row["cache_read_tokens"],
                              cache_write_tokens=row["cache_write_tokens"])
    return total


def assert_nothing_left_open() -> None:
    """Collect garbage and check that no socket or transport was left unclosed."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gc.collect()
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []


def run_on_trio(coroutine: Callable[[], Coroutine[Any, Any, le.RunResult]]) -> le.RunResult:
    """``coroutine()`` on a fresh trio run, through anyio."""
    result: list[le.RunResult] = []

    async def main() -> None:
        result.append(await coroutine())

    anyio.run(main, backend="trio")
    return result[0]


@STREAMING
def test_one_engine_serves_four_consecutive_asyncio_runs_each_on_its_first_attempt(
    fake_anthropic_server: FakeAnthropicServer, stream: bool
) -> None:
    """Four ``asyncio.run`` calls on one engine whose provider was built from
    keywords: four runs completed on their first attempt, every attempt ``ok``,
    the ledger's tokens equal to what the server served, four requests."""
    server = fake_anthropic_server
    server.add(*(reply(n) for n in range(4)))
    provider = AnthropicProvider(api_key="test-key", base_url=server.url, stream=stream)
    ledger = MemoryLedger()
    engine = le.Engine(provider, ledger=ledger, prices=PRICES)
    results = [asyncio.run(engine.run(operation(), f"question {n}")) for n in range(4)]
    assert [r.outcome for r in results] == [le.Outcome.COMPLETED] * 4
    assert [r.answer for r in results] == [f"answer {n}" for n in range(4)]
    assert [r.attempts.count for r in results] == [1, 1, 1, 1]
    rows = list(ledger.attempts.values())
    assert [(row["outcome"], row["attempt"], row["fault"]) for row in rows] == [("ok", 1, None)] * 4
    assert all(row["request_id"] is not None for row in rows)
    assert len(server.requests) == 4
    assert ledger_usage(ledger) == server.usage_served == sum(
        (r.usage for r in results), Usage())
    assert_nothing_left_open()


def test_each_event_loops_client_is_closed_as_its_loop_shuts_down(
    fake_anthropic_server: FakeAnthropicServer,
) -> None:
    """Each loop sends on a client of its own, and that client is closed when
    ``asyncio.run`` shuts its loop down: nothing is left open for the next."""
    fake_anthropic_server.add(reply(1), reply(2))
    provider = AnthropicProvider(api_key="test-key", base_url=fake_anthropic_server.url)
    engine = le.Engine(provider, prices=PRICES)
    used: list[Any] = []

    async def one() -> le.RunResult:
        result = await engine.run(operation(), "hi")
        used.append(provider.client)
        assert not provider.client.is_closed()
        return result

    assert asyncio.run(one()).outcome is le.Outcome.COMPLETED
    assert asyncio.run(one()).outcome is le.Outcome.COMPLETED
    first, second = used
    assert first is not second
    assert first.is_closed() and second.is_closed()
    assert_nothing_left_open()


def test_a_loop_closed_without_shutting_down_leaves_no_client_behind(
    fake_anthropic_server: FakeAnthropicServer,
) -> None:
    """A loop closed with ``loop.close()`` alone cannot close its client; the next
    loop's run still completes on its first attempt, and the provider lets go of
    the dead loop's client instead of keeping it forever."""
    fake_anthropic_server.add(reply(1), reply(2))
    provider = AnthropicProvider(api_key="test-key", base_url=fake_anthropic_server.url)
    engine = le.Engine(provider, prices=PRICES)
    used: list[Any] = []

    async def first() -> le.RunResult:
        result = await engine.run(operation(), "hi")
        used.append(provider.client)
        return result

    # The dead loop's sockets can only be collected, and only the collection
    # below may do it, where their warnings are expected.
    gc.disable()
    try:
        loop = asyncio.new_event_loop()
        try:
            assert loop.run_until_complete(first()).outcome is le.Outcome.COMPLETED
        finally:
            loop.close()  # no shutdown_asyncgens(): the client's close never ran
        dead = weakref.ref(used.pop())
        del loop
        with asyncio.Runner() as second:
            result = second.run(engine.run(operation(), "again"))
            assert result.outcome is le.Outcome.COMPLETED and result.attempts.count == 1
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ResourceWarning)
                gc.collect()
            assert dead() is None
    finally:
        gc.enable()
    assert_nothing_left_open()


def test_aclose_closes_the_running_loops_client_and_a_later_request_builds_another(
    fake_anthropic_server: FakeAnthropicServer,
) -> None:
    """``aclose`` closes the client of the loop it runs on; the provider stays
    usable, on a new client."""
    fake_anthropic_server.add(reply(1), reply(2))
    provider = AnthropicProvider(api_key="test-key", base_url=fake_anthropic_server.url)
    engine = le.Engine(provider, prices=PRICES)

    async def main() -> None:
        assert (await engine.run(operation(), "hi")).outcome is le.Outcome.COMPLETED
        before = provider.client
        await provider.aclose()
        assert before.is_closed()
        assert (await engine.run(operation(), "again")).outcome is le.Outcome.COMPLETED
        assert provider.client is not before and not provider.client.is_closed()
        await provider.aclose()

    asyncio.run(main())
    assert len(fake_anthropic_server.requests) == 2
    assert_nothing_left_open()


def test_one_engine_serves_asyncio_and_trio_runs_in_turn(
    fake_anthropic_server: FakeAnthropicServer,
) -> None:
    """asyncio, anyio's trio backend, asyncio again, trio again, on one engine:
    each run completed on its first attempt."""
    server = fake_anthropic_server
    server.add(*(reply(n) for n in range(4)))
    provider = AnthropicProvider(api_key="test-key", base_url=server.url)
    ledger = MemoryLedger()
    engine = le.Engine(provider, ledger=ledger, prices=PRICES)

    def run() -> Coroutine[Any, Any, le.RunResult]:
        return engine.run(operation(), "hi")

    results = [asyncio.run(run()), run_on_trio(run), asyncio.run(run()), run_on_trio(run)]
    assert [r.outcome for r in results] == [le.Outcome.COMPLETED] * 4
    assert [r.attempts.count for r in results] == [1, 1, 1, 1]
    assert [row["outcome"] for row in ledger.attempts.values()] == ["ok"] * 4
    assert len(server.requests) == 4
    assert ledger_usage(ledger) == server.usage_served
    assert_nothing_left_open()


def passed_client(server: FakeAnthropicServer) -> tuple[AnthropicProvider, Callable[[], Any]]:
    """A provider on a client of the caller's, and how the caller closes it."""
    client = anthropic.AsyncAnthropic(api_key="test-key", base_url=server.url,
                                      http_client=httpx2.AsyncClient(verify=False))
    return AnthropicProvider(client), client.close


def passed_http_client(
    server: FakeAnthropicServer,
) -> tuple[AnthropicProvider, Callable[[], Any]]:
    """A provider built from keywords that include the caller's ``http_client``."""
    provider = AnthropicProvider(api_key="test-key", base_url=server.url,
                                 http_client=httpx2.AsyncClient(verify=False))
    return provider, provider.aclose


@pytest.mark.parametrize(("make", "field"), [(passed_client, "client"),
                                             (passed_http_client, "http_client")],
                         ids=["client", "http_client"])
def test_a_client_given_by_the_caller_is_refused_on_another_event_loop_before_anything_is_sent(
    fake_anthropic_server: FakeAnthropicServer,
    make: Callable[[FakeAnthropicServer], tuple[AnthropicProvider, Callable[[], Any]]],
    field: str,
) -> None:
    """A client (or an http_client) the caller gave works on the first loop that
    sends; on another loop, still open or ended, the run raises ConfigError
    naming it, and the server receives nothing."""
    server = fake_anthropic_server
    server.add(reply(1), reply(2), reply(3))
    provider, close = make(server)
    ledger = MemoryLedger()
    engine = le.Engine(provider, ledger=ledger, prices=PRICES)
    with asyncio.Runner() as first:
        assert first.run(engine.run(operation(), "hi")).outcome is le.Outcome.COMPLETED
        with pytest.raises(le.ConfigError, match="another event loop, which is still open") as info:
            asyncio.run(engine.run(operation(), "on another loop"))
        assert info.value.field == field
        assert len(server.requests) == 1
        # The caller closes their client on the loop its connections belong to.
        first.run(close())
    with pytest.raises(le.ConfigError, match="another event loop, which has ended") as info:
        asyncio.run(engine.run(operation(), "after the first loop ended"))
    assert info.value.field == field
    assert len(server.requests) == 1
    # Refused before its row was written: the failed runs recorded no attempt.
    assert [row["outcome"] for row in ledger.attempts.values()] == ["ok"]
    assert sorted(row["outcome"] for row in ledger.invocations.values()) == [
        "completed", "failed", "failed"]
    assert_nothing_left_open()


def test_a_request_on_a_connection_of_an_ended_loop_is_not_a_connection_fault(
    fake_anthropic_server: FakeAnthropicServer,
) -> None:
    """The SDK used directly on a second loop sends on the first loop's pooled
    connection: the server answers, the client fails on its own loop state. That
    request reached the server, so it is never classified as a connection fault
    (which would be retried and billed twice)."""
    server = fake_anthropic_server
    server.add(reply(1), reply(2))
    client = anthropic.AsyncAnthropic(api_key="test-key", base_url=server.url, max_retries=0,
                                      http_client=httpx2.AsyncClient(verify=False))

    async def create(sdk: anthropic.AsyncAnthropic) -> Any:
        return await sdk.messages.create(model=MODEL, max_tokens=64,
                                         messages=[{"role": "user", "content": "hi"}])

    def on_a_second_loop(sdk: anthropic.AsyncAnthropic) -> ProviderFault:
        try:
            asyncio.run(create(sdk))
        except anthropic.APIConnectionError as error:
            return classify_error(error)
        raise AssertionError("the request on the second loop succeeded")

    asyncio.run(create(client))
    try:
        fault = on_a_second_loop(client)
    finally:
        # The SDK leaves the first loop's socket to the garbage collector: the
        # leak a provider built from keywords avoids, collected here on purpose.
        del client
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()
    assert fault.kind is FaultKind.BAD_REQUEST and not fault.retryable
    assert fault.error_code == "client_state"
    assert "Event loop is closed" in fault.message
    # The request was written before the client failed: the server got it.
    deadline = time.monotonic() + 30  # a bound for a hang, not a measure
    while len(server.requests) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(server.requests) == 2


async def sdk_error_from(raised: Exception) -> Exception:
    """What the SDK raises when its HTTP transport raises ``raised``."""

    def handler(request: httpx2.Request) -> httpx2.Response:
        raise raised

    client = anthropic.AsyncAnthropic(
        api_key="k", base_url="http://fake.invalid", max_retries=0,
        http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(handler)))
    try:
        await client.messages.create(model=MODEL, max_tokens=10,
                                     messages=[{"role": "user", "content": "hi"}])
    except Exception as error:  # the SDK's own exception is what we classify
        return error
    finally:
        await client.close()
    raise AssertionError("the SDK raised nothing")


@pytest.mark.parametrize(
    ("raised", "kind"),
    [
        (RuntimeError("Event loop is closed"), FaultKind.BAD_REQUEST),
        (RuntimeError("Task got Future attached to a different loop"), FaultKind.BAD_REQUEST),
        (RuntimeError("Cannot send a request, as the client has been closed."),
         FaultKind.BAD_REQUEST),
        (httpx2.ConnectError("refused"), FaultKind.CONNECTION),
        (httpx2.ReadError("reset"), FaultKind.CONNECTION),
        (ConnectionResetError("reset by peer"), FaultKind.CONNECTION),
    ],
    ids=["loop-closed", "other-loop", "client-closed", "refused", "read-reset", "os-reset"],
)
def test_only_a_transport_error_under_the_sdks_connection_error_is_a_connection_fault(
    raised: Exception, kind: FaultKind
) -> None:
    """The SDK wraps whatever its HTTP client raised as APIConnectionError; a
    transport error is a connection fault, the client's own state is not (and
    is not retried)."""
    error = asyncio.run(sdk_error_from(raised))
    assert isinstance(error, anthropic.APIConnectionError)
    fault = classify_error(error)
    assert fault.kind is kind
    assert (fault.error_code == "client_state") is (kind is FaultKind.BAD_REQUEST)


def test_a_loop_error_read_from_a_stream_is_not_a_server_fault() -> None:
    """Mid-stream, an event-loop RuntimeError is the client's own state; the SDK's
    own RuntimeError (events out of order) stays the server's fault."""
    own = classify_error(RuntimeError("Event loop is closed"), in_body=True)
    assert own.kind is FaultKind.BAD_REQUEST and own.error_code == "client_state"
    server = classify_error(RuntimeError('Unexpected event order, got content_block_delta '
                                         'before "message_start"'), in_body=True)
    assert server.kind is FaultKind.SERVER_ERROR and server.error_code == "invalid_response"
