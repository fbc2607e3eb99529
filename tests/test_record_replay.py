"""`RecordingProvider` and `ReplayProvider` on the real providers (through their
SDKs and the loopback fake servers): a replayed run reports what the recorded
one did, a changed request is caught, and a bad recording is named."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import re
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import anyio
import pytest

import loopengine as le
from loopengine._features import Features
from loopengine.events import AttemptSettled
from loopengine.persistence import MemoryLedger
from loopengine.providers import (
    AnthropicProvider,
    Billing,
    FaultKind,
    GeminiProvider,
    OpenAIProvider,
    Provider,
    ProviderFault,
    ProviderRequest,
    ProviderResponse,
    RecordingProvider,
    ReplayProvider,
    ScriptedProvider,
    TextCallback,
)
from loopengine.providers._base import cut_sink
from loopengine.testing import (
    CutStream,
    ErrorReply,
    FakeAnthropicServer,
    FakeClock,
    FakeGeminiServer,
    FakeOpenAIServer,
    Reply,
)

from .conftest import MODEL, PRICES, operation
from .test_deadline import Silent, on_mock_clock

GEMINI = "gemini-2.5-flash"


@le.tool
async def lookup(key: str) -> str:
    """Look a key up."""
    return f"value of {key}"


def lookup_call(key: str = "a") -> tuple[str, dict[str, Any]]:
    """A call of `lookup`."""
    return ("lookup", {"key": key})


def op() -> le.Operation:
    """The tests' Anthropic operation (tests/conftest.py)."""
    return operation()


def attempt_rows(ledger: MemoryLedger) -> list[dict[str, Any]]:
    """The ledger's attempt rows, without what differs from run to run (ids, times)."""
    return [{k: v for k, v in row.items() if k not in ("invocation_id", "started_at")}
            for row in ledger.attempts.values()]


@pytest.mark.parametrize("route", [None, "gemini-eu"])
async def test_a_replayed_gemini_run_is_priced_and_served_by_as_recorded(
        fake_gemini_server: FakeGeminiServer, tmp_path: Path, route: str | None) -> None:
    """Gemini's route (``gemini``, or one the provider was given) is not its
    vendor (``google``), which prices it and names it in ``served_by``: the
    replay took the route for the vendor, so its attempts were priced from
    another vendor's entry (or not at all), and, on a route it did not know
    for Gemini's, named its requests' operation ``chat``."""
    path = tmp_path / "run.jsonl"
    prices = le.PriceBook([le.ModelPrice(provider="google", model=GEMINI,
                                         input_per_mtok=Decimal(1), output_per_mtok=Decimal(1))])
    op = le.Operation(name="g", provider=route or "gemini", model=GEMINI, max_output_tokens=100)
    fake_gemini_server.add(ErrorReply(status=503), Reply.tool_calls(lookup_call()),
                           Reply.text("done"))
    inner = GeminiProvider(api_key="test-key", route=route,
                           http_options={"base_url": fake_gemini_server.url})
    ledgers = MemoryLedger(), MemoryLedger()
    results = []
    for provider, ledger in zip((RecordingProvider(inner, path), None), ledgers, strict=True):
        engine = le.Engine(provider or ReplayProvider(path), ledger=ledger, prices=prices,
                           clock=FakeClock(), rng=random.Random(7))
        results.append(await engine.run(op, "look a up", tools=[lookup]))
    recorded, replayed = results
    assert recorded.outcome is le.Outcome.COMPLETED and recorded.cost_usd == Decimal("0.00024")
    assert (replayed.outcome, replayed.cost_usd) == (recorded.outcome, recorded.cost_usd)
    assert attempt_rows(ledgers[1]) == attempt_rows(ledgers[0])
    assert {row["served_by"] for row in attempt_rows(ledgers[1])} == {f"google:{GEMINI}"}
    assert ReplayProvider(path).genai_operation == "generate_content"


async def test_a_reply_with_usage_iterations_replays_with_the_recorded_usage(
        fake_anthropic_server: FakeAnthropicServer, tmp_path: Path) -> None:
    """A reply whose usage reports iterations (a compaction) replays: its
    iterations came back as a list of dicts, which `Usage` refuses, and a usage
    without iterations as ``iterations=[]``, unequal to the recorded ``()``."""
    path = tmp_path / "run.jsonl"
    compacted = le.Usage.from_iterations((
        le.UsageIteration(type="compaction", input_tokens=5000, output_tokens=100),
        le.UsageIteration(type="message", input_tokens=200, output_tokens=10)))
    fake_anthropic_server.add(Reply.tool_calls(lookup_call(), usage=compacted),
                              Reply.text("done"))
    inner = AnthropicProvider(api_key="test-key", base_url=fake_anthropic_server.url)
    results, settled = [], []
    for provider in (RecordingProvider(inner, path), None):
        events: list[object] = []
        engine = le.Engine(provider or ReplayProvider(path), prices=PRICES,
                           clock=FakeClock(), observers=[events.append])
        results.append(await engine.run(op(), "look a up", tools=[lookup]))
        settled.append([e.usage for e in events if isinstance(e, AttemptSettled)])
    recorded, replayed = results
    assert recorded.outcome is le.Outcome.COMPLETED and recorded.usage.iterations
    assert (replayed.outcome, replayed.usage, replayed.cost_usd) == (
        recorded.outcome, recorded.usage, recorded.cost_usd)
    assert settled[1] == settled[0] and settled[0][0].iterations


@pytest.mark.parametrize(("change", "where"), [
    ({"thinking": None}, "request.features"),
    ({"thinking": le.Thinking(budget_tokens=2048)}, "request.features.thinking.budget_tokens"),
    ({"cache": le.CachePolicy(system=True)}, "request.cache"),
])
async def test_a_replay_with_other_features_or_cache_markers_is_a_mismatch(
        fake_anthropic_server: FakeAnthropicServer, tmp_path: Path,
        change: dict[str, Any], where: str) -> None:
    """Thinking and the cache policy are sent (``thinking``, ``cache_control``) and
    change the reply and its price, but a replay that changed them was served
    the recorded reply as if the request were the same."""
    path = tmp_path / "run.jsonl"
    fake_anthropic_server.add(Reply.text("done"))
    recorded_op = dataclasses.replace(op(), max_output_tokens=4096,
                                      thinking=le.Thinking(budget_tokens=1024))
    inner = AnthropicProvider(api_key="test-key", base_url=fake_anthropic_server.url)
    await le.Engine(RecordingProvider(inner, path), prices=PRICES).run(recorded_op, "hi")
    replayed = await le.Engine(ReplayProvider(path), prices=PRICES).run(recorded_op, "hi")
    assert replayed.outcome is le.Outcome.COMPLETED
    with pytest.raises(le.ReplayMismatchError, match=f"{where} differs"):
        await le.Engine(ReplayProvider(path), prices=PRICES).run(
            dataclasses.replace(recorded_op, **change), "hi")


def _earlier_recording(path: Path, *, header: dict[str, Any]) -> None:
    """A recording as written before requests were recorded with their features
    and cache policy: a header naming no vendor, and each request without them
    (its digest, the SHA-256 of its sorted, compact JSON, taken without them)."""
    request = {"max_tokens": 4096, "messages": [{"content": "hi", "role": "user"}],
               "model": MODEL, "system": None, "tool_choice": None, "tools": []}
    digest = hashlib.sha256(json.dumps(request, sort_keys=True,
                                       separators=(",", ":")).encode()).hexdigest()
    response = {"container": None, "content": [{"text": "done", "type": "text"}],
                "http_status": 200, "model": MODEL, "request_id": "req_1",
                "response_id": "msg_1", "stop_reason": "end_turn",
                "usage": {"input_tokens": 100, "output_tokens": 20}, "usage_approx": False}
    lines = [header, {"request": request, "request_sha256": digest, "response": response}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")


async def test_a_recording_made_before_features_were_recorded_replays(tmp_path: Path) -> None:
    """A recording written before requests were recorded with their features and
    cache policy (its header names no vendor) replays as it did: the replay
    digested each request with them and refused a run with thinking, betas,
    server tools or cache markers at its first request ("request.features
    differs"). A recording that names its vendor still compares them, and a
    recording begun the earlier way goes on that way when appended to."""
    path = tmp_path / "run.jsonl"
    header = {"format": "loopengine.recording", "provider": "anthropic", "version": 1}
    thinking = dataclasses.replace(op(), max_output_tokens=4096,
                                   thinking=le.Thinking(budget_tokens=1024),
                                   cache=le.CachePolicy(system=True))
    _earlier_recording(path, header=header)
    replayed = await le.Engine(ReplayProvider(path), prices=PRICES).run(thinking, "hi")
    assert (replayed.outcome, replayed.answer) == (le.Outcome.COMPLETED, "done")

    # Appended to, the earlier recording's new requests are recorded without them too.
    await le.Engine(RecordingProvider(ScriptedProvider([Reply.text("again")], name="anthropic"),
                                      path, append=True), prices=PRICES).run(thinking, "hi")
    replay = ReplayProvider(path)
    answers = [(await le.Engine(replay, prices=PRICES).run(thinking, "hi")).answer
               for _ in range(2)]
    assert answers == ["done", "again"] and replay.exhausted

    # The same request in a recording that names its vendor: its features differ.
    _earlier_recording(path, header={**header, "vendor": "anthropic"})
    with pytest.raises(le.ReplayMismatchError, match=r"request\.cache differs"):
        await le.Engine(ReplayProvider(path), prices=PRICES).run(thinking, "hi")
    with pytest.raises(le.ReplayMismatchError, match=r"request\.features differs"):
        await le.Engine(ReplayProvider(path), prices=PRICES).run(
            dataclasses.replace(thinking, cache=le.CachePolicy()), "hi")



def _cut(lines: list[str]) -> list[str]:
    return [*lines[:-1], lines[-1][:-30]]


def _no_response(lines: list[str]) -> list[str]:
    entry = json.loads(lines[2])
    del entry["response"]
    return [*lines[:2], json.dumps(entry)]


def _odd_usage(lines: list[str]) -> list[str]:
    entry = json.loads(lines[1])
    entry["response"]["usage"]["tokens"] = 3
    return [lines[0], json.dumps(entry), lines[2]]


def _billing(billing: object) -> Callable[[list[str]], list[str]]:
    def damage(lines: list[str]) -> list[str]:
        entry = json.loads(lines[1])
        entry["billing"] = billing
        return [lines[0], json.dumps(entry), lines[2]]
    return damage


@pytest.mark.parametrize(("damage", "says"), [
    (lambda lines: [*lines[:2], "", "{oops", lines[2]], "line 4 is not JSON"),
    (_cut, "line 3 is not JSON .*or one cut short"),
    (lambda lines: ["[]", *lines], "line 1 is not a JSON object"),
    (lambda lines: ['{"format": "loopengine.recording", "version": 1}', *lines[1:]],
     "line 1 names no provider"),
    (lambda lines: [lines[0], "7"], "line 2 is not a JSON object"),
    (_no_response, "line 3 is not a recorded attempt: it has no 'response'"),
    (_odd_usage, "line 2 is not a recorded attempt: .*'tokens'"),
    (_billing([1]), "line 2 is not a recorded attempt: its billing is not an object"),
    (_billing({"searches_per_request": -1}),
     "line 2 is not a recorded attempt: .*searches_per_request.* at least 0"),
    (_billing({"searches": 1}), "line 2 is not a recorded attempt: .*'searches'"),
    (lambda lines: [], "is empty"),
    (lambda lines: [lines[0], json.dumps({**json.loads(lines[1]), "cut": None,
                                          "cut_by": "noon"}), lines[2]],
     "line 2 is not a recorded attempt: its cut_by is not one of timeout, deadline, caller"),
])
async def test_a_damaged_recording_is_refused_naming_the_file_and_the_line(
        tmp_path: Path, damage: Any, says: str) -> None:
    """A recording cut short, edited or not a recording at all is refused when the
    replay is built, naming the line: a bad line was reported as line 1 (each
    line was parsed alone), a first line that is not an object or names no
    provider escaped as an AttributeError or KeyError, and an attempt that is
    not one as a TypeError or KeyError inside the replayed run."""
    path = tmp_path / "run.jsonl"
    script = ScriptedProvider([Reply.tool_calls(lookup_call()), Reply.text("done")])
    await le.Engine(RecordingProvider(script, path), prices=PRICES).run(
        op(), "look a up", tools=[lookup])
    lines = path.read_text().splitlines()
    assert len(lines) == 3
    path.write_text("\n".join(damage(lines)) + "\n")
    with pytest.raises(le.ConfigError, match=f"{re.escape(str(path))},? {says}") as raised:
        ReplayProvider(path)
    assert raised.value.field == "path"


async def test_a_run_whose_calls_the_engine_named_replays(
        fake_openai_server: FakeOpenAIServer, tmp_path: Path) -> None:
    """A server that names two calls alike (``0``): the engine names the second
    itself, with an id of its own (`new_call_id`) that the next request sends.
    A replay names it again, with another id, and was refused as a request that
    differs from the recording though nothing had changed."""
    path = tmp_path / "run.jsonl"
    calls = [{"type": "tool_use", "id": "0", "name": "lookup", "input": {"key": key}}
             for key in ("a", "b")]
    fake_openai_server.add(Reply(content=calls, stop_reason="tool_use"), Reply.text("done"))
    inner = OpenAIProvider(api_key="test-key", base_url=fake_openai_server.base_url)
    operation = le.Operation(name="o", provider="openai", model="gpt-4o", max_output_tokens=100)
    results = []
    for provider in (RecordingProvider(inner, path), None):
        results.append(await le.Engine(provider or ReplayProvider(path), prices=PRICES).run(
            operation, "look a and b up", tools=[lookup]))
    recorded, replayed = results
    assert recorded.outcome is le.Outcome.COMPLETED
    made = recorded.messages[1]["content"][1]["id"]
    assert made != "0" and made in json.dumps(fake_openai_server.requests[1].body)
    assert (replayed.outcome, replayed.attempts) == (recorded.outcome, recorded.attempts)
    assert replayed.messages[1]["content"][1]["id"] != made


async def test_a_replayed_stream_hands_the_text_as_the_recorded_one_did(
        fake_anthropic_server: FakeAnthropicServer, tmp_path: Path) -> None:
    """`Engine.stream` replayed yields the recorded run's events: its text came as
    one piece per reply instead of the pieces the stream had handed out, and
    the text a cut stream had handed out before its retry not at all."""
    path = tmp_path / "run.jsonl"
    fake_anthropic_server.add(CutStream(reply=Reply.text("half an answer, cut"), after=3),
                              Reply.text("a whole answer"))
    inner = AnthropicProvider(api_key="test-key", base_url=fake_anthropic_server.url)
    seen = []
    for provider in (RecordingProvider(inner, path), None):
        engine = le.Engine(provider or ReplayProvider(path), prices=PRICES, clock=FakeClock(),
                           rng=random.Random(7))
        async with engine.stream(op(), "go") as run:
            events = [event async for event in run]
        assert run.result.outcome is le.Outcome.COMPLETED
        seen.append([(type(e).__name__, getattr(e, "text", None), getattr(e, "attempt", None))
                     for e in events])
    recorded, replayed = seen
    assert [e for e in recorded if e[0] == "TextDelta"] == [
        ("TextDelta", "half ", 1), ("TextDelta", "a ", 2), ("TextDelta", "whole ", 2),
        ("TextDelta", "answer", 2)]
    assert replayed == recorded


class SlowFirst(Provider):
    """A provider whose first request gets no answer in time: its stream had
    served some usage when the attempt's timeout cut it (what a real provider
    reports to `cut_sink`); the retry is answered."""

    name = "anthropic"

    def __init__(self) -> None:
        self.sent = 0

    async def send(self, request: ProviderRequest, *,
                   on_text: TextCallback | None = None) -> ProviderResponse:
        self.sent += 1
        if self.sent == 1:
            try:
                await anyio.sleep_forever()
            finally:
                sink = cut_sink()
                assert sink is not None
                sink.keep_served(ProviderFault(
                    FaultKind.ABORTED, "cut", http_status=200, response_id="msg_cut",
                    usage=le.Usage(input_tokens=100, output_tokens=3), usage_approx=True))
        return ProviderResponse(content=[{"type": "text", "text": "done"}],
                                stop_reason="end_turn", usage=le.Usage(input_tokens=100,
                                                                       output_tokens=20))


def test_an_attempt_its_timeout_cut_replays_as_a_timeout(tmp_path: Path) -> None:
    """An attempt the engine's timeout cut (a cancellation, not a fault the provider
    raised) was not recorded: the replay served its retry's reply to it, so
    the replayed run had one attempt fewer, and not the usage the cut stream
    had served. On trio's MockClock: the timeout passes in no real time."""
    path = tmp_path / "run.jsonl"
    operation = dataclasses.replace(op(), limits=le.Limits(attempt_timeout=30))
    ledgers = MemoryLedger(), MemoryLedger()

    async def runs() -> list[le.RunResult]:
        results = []
        for provider, ledger in zip((RecordingProvider(SlowFirst(), path),
                                     None), ledgers, strict=True):
            engine = le.Engine(provider or ReplayProvider(path), ledger=ledger, prices=PRICES,
                               rng=random.Random(7))
            results.append(await engine.run(operation, "go"))
        return results

    recorded, replayed = on_mock_clock(runs)[0]
    assert recorded.outcome is le.Outcome.COMPLETED and recorded.attempts.count == 2
    assert (replayed.outcome, replayed.attempts, replayed.usage, replayed.cost_usd) == (
        recorded.outcome, recorded.attempts, recorded.usage, recorded.cost_usd)
    rows = [attempt_rows(ledger) for ledger in ledgers]
    for row in (*rows[0], *rows[1]):
        del row["latency_ms"]  # the recorded attempt waited its timeout; a replay does not
    assert rows[1] == rows[0]
    assert (rows[0][0]["fault"], rows[0][0]["output_tokens"]) == ("timeout", 3)
    # Written as a timeout's cut always was: it names nothing more.
    assert "cut_by" not in json.loads(path.read_text().splitlines()[1])


@pytest.mark.parametrize(("limits", "attempts"), [
    ({"total_time": 5.0}, 1),
    ({"total_time": 100.0, "attempt_timeout": 60.0}, 2),
    ({"total_time": 60.0, "attempt_timeout": 60.0}, 1),
], ids=["capped", "after-a-timeout", "both-at-once"])
def test_r04_an_attempt_the_runs_deadline_cut_replays_cut_by_that_deadline(
        tmp_path: Path, limits: dict[str, float], attempts: int) -> None:
    """A run whose deadline cut its attempt ended ``time_limit``; the cut was
    recorded as any cut and replayed as the attempt's timeout, so the replayed
    run retried, and failed with "request N was not recorded". It is recorded
    as the deadline's (also when the attempt's own timeout would have passed
    at the same instant), and replayed as a cut by the deadline at once: a
    replay is quicker than its recording (an earlier attempt its timeout cut
    replays with no wait), so the replayed clock is not at the deadline yet.
    On trio's MockClock: the deadline passes in no real time."""
    path = tmp_path / "run.jsonl"
    ledgers = MemoryLedger(), MemoryLedger()

    async def runs() -> list[le.RunResult]:
        providers: list[Callable[[], Provider]] = [
            lambda: RecordingProvider(Silent(), path), lambda: ReplayProvider(path)]
        return [await le.Engine(provider(), ledger=ledger, prices=PRICES).run(
                    operation(**limits), "go")
                for provider, ledger in zip(providers, ledgers, strict=True)]

    (recorded, replayed), took = on_mock_clock(runs)
    cuts = [json.loads(line).get("cut_by") for line in path.read_text().splitlines()[1:]]
    assert cuts == [None] * (attempts - 1) + ["deadline"]
    assert recorded.outcome is le.Outcome.TIME_LIMIT and recorded.attempts.count == attempts
    assert (replayed.outcome, replayed.attempts) == (recorded.outcome, recorded.attempts)
    # The recorded run's wait, and no more than a retry's back-off of the replay's.
    assert limits["total_time"] <= took < limits["total_time"] + 1
    rows = [attempt_rows(ledger) for ledger in ledgers]
    for row in (*rows[0], *rows[1]):
        # Times: the recorded attempts waited, a replay does not (its clock is
        # earlier, so its timeouts are not capped alike), and back-offs jitter.
        for key in ("latency_ms", "timeout_ms", "wait_ms"):
            del row[key]
    assert rows[1] == rows[0] and rows[0][-1]["aborted_reason"] == "deadline"


def test_an_attempt_its_caller_cut_replays_as_an_error_saying_so(tmp_path: Path) -> None:
    """A run its caller cancelled, its attempt in flight, was replayed as though a
    timeout had cut the attempt: the replayed run retried and failed with
    "request 2 was not recorded". Nothing in a replay can cancel it where its
    caller did, so the replay says the recorded attempt was cut by its caller."""
    path = tmp_path / "run.jsonl"

    async def cancelled_after(seconds: float, provider: Provider) -> None:
        async with anyio.create_task_group() as group:
            group.start_soon(le.Engine(provider, prices=PRICES).run, operation(), "go")
            await anyio.sleep(seconds)
            group.cancel_scope.cancel()

    async def record() -> None:
        await cancelled_after(2, RecordingProvider(Silent(), path))

    on_mock_clock(record)
    assert json.loads(path.read_text().splitlines()[1])["cut_by"] == "caller"

    async def replay() -> None:
        await le.Engine(ReplayProvider(path), prices=PRICES).run(operation(), "go")

    with pytest.raises(le.ReplayMismatchError,
                       match="request 1 was cut by its caller in the recording"):
        on_mock_clock(replay)


async def test_runs_recorded_concurrently_replay_in_any_order(
        fake_anthropic_server: FakeAnthropicServer, tmp_path: Path) -> None:
    """Runs that shared a recording were recorded in the order their requests
    happened to come; replayed, their requests came in another order and the
    first was refused as a request that differs from the recording."""
    path = tmp_path / "runs.jsonl"
    fake_anthropic_server.add(*(Reply.text(f"answer {n}") for n in range(3)))
    inner = AnthropicProvider(api_key="test-key", base_url=fake_anthropic_server.url)

    async def together(provider: Provider, order: list[int]) -> dict[int, str | None]:
        answers: dict[int, str | None] = {}

        async def one(n: int) -> None:
            answers[n] = (await le.Engine(provider, prices=PRICES).run(op(), f"q{n}")).answer

        async with anyio.create_task_group() as group:
            for n in order:
                group.start_soon(one, n)
        return answers

    recorded = await together(RecordingProvider(inner, path), [0, 1, 2])
    replay = ReplayProvider(path)
    assert await together(replay, [2, 1, 0]) == recorded
    assert replay.exhausted


@le.tool(approval=True)
async def refund(order_id: str) -> str:
    """Refund an order."""
    return f"refunded {order_id}"


async def test_a_run_resumed_elsewhere_appends_to_its_recording_and_replays(
        fake_anthropic_server: FakeAnthropicServer, tmp_path: Path) -> None:
    """A paused run resumed in another process records its second half with a
    second `RecordingProvider`, which emptied the file: the first half was
    lost, and the run could not be replayed. With ``append`` it goes on with
    the recording, and a replay pauses and resumes as the recorded run did."""
    path = tmp_path / "run.jsonl"
    fake_anthropic_server.add(Reply.tool_calls(("refund", {"order_id": "o1"})),
                              Reply.text("refunded"))
    inner = AnthropicProvider(api_key="test-key", base_url=fake_anthropic_server.url)

    async def pause_then_resume(first: Provider, second: Callable[[], Provider]) -> Any:
        paused = await le.Engine(first, prices=PRICES).run(op(), "refund o1", tools=[refund])
        assert paused.outcome is le.Outcome.PAUSED and paused.state is not None
        state = le.RunState.loads(paused.state.dumps())
        return await le.Engine(second(), prices=PRICES).resume(
            state, decisions={paused.pending[0].id: le.Approve()}, tools=[refund])

    recorded = await pause_then_resume(RecordingProvider(inner, path),
                                       lambda: RecordingProvider(inner, path, append=True))
    assert recorded.outcome is le.Outcome.COMPLETED
    assert len(path.read_text().splitlines()) == 3
    replayed = await pause_then_resume(ReplayProvider(path), lambda: ReplayProvider(path))
    assert (replayed.outcome, replayed.answer, replayed.attempts) == (
        recorded.outcome, recorded.answer, recorded.attempts)
    with pytest.raises(le.ConfigError, match="a recording of provider 'anthropic', not"):
        RecordingProvider(ScriptedProvider([], name="openai"), path, append=True)


async def test_a_request_refused_before_the_wire_is_refused_by_its_replay(
        fake_anthropic_server: FakeAnthropicServer, tmp_path: Path) -> None:
    """A request the provider refuses before the wire (thinking with a prefill,
    which the Messages API refuses) ends the recorded run ``provider_error`` with
    no attempt; the replay accepted it and raised ReplayMismatchError, since no
    attempt of it had been recorded."""
    path = tmp_path / "run.jsonl"
    inner = AnthropicProvider(api_key="test-key", base_url=fake_anthropic_server.url)
    thinking = dataclasses.replace(op(), max_output_tokens=4096,
                                   thinking=le.Thinking(budget_tokens=1024))
    prefill = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "Sure,"}]
    results = []
    for provider in (RecordingProvider(inner, path), None):
        results.append(await le.Engine(provider or ReplayProvider(path), prices=PRICES).run(
            thinking, prefill))
    recorded, replayed = results
    assert recorded.outcome is le.Outcome.PROVIDER_ERROR and recorded.attempts.count == 0
    assert fake_anthropic_server.requests == []
    assert (replayed.outcome, replayed.detail, replayed.attempts) == (
        recorded.outcome, recorded.detail, recorded.attempts)
    assert replayed.fault is not None and replayed.fault.kind is FaultKind.BAD_REQUEST


class _Billed(ScriptedProvider):
    """A scripted route that bills a request with a server tool one web search more
    than its usage counts, at $25 per 1,000."""

    def billing(self, model: str, features: Features) -> Billing:
        if features.server_tools:
            return Billing(searches_per_request=1, web_search_per_k=Decimal(25))
        return Billing()


async def test_a_recording_keeps_each_request_s_billing_and_its_replay_declares_it(
        tmp_path: Path) -> None:
    """Each request is recorded with how its provider bills it where that is not the
    default (a request billed as its usage says is written as before), and the
    replay declares, for a model and its features, the billing recorded with
    them: it declared the default whatever was recorded, so a replay was priced
    and refused a credit hold otherwise than its recorded run."""
    path = tmp_path / "run.jsonl"
    searching = dataclasses.replace(op(), server_tools=(
        le.ServerTool(type="web_search_20250305", name="web_search", max_uses=1),))
    engine = le.Engine(RecordingProvider(_Billed([Reply.text("a"), Reply.text("b")]), path),
                       prices=PRICES)
    for published in (op(), searching):
        await engine.run(published, "hi")
    plain, searched = (json.loads(line) for line in path.read_text().splitlines()[1:])
    assert "billing" not in plain
    assert searched["billing"] == {"searches_per_request": 1, "long_context": True,
                                   "web_search_per_k": "25"}
    replay = ReplayProvider(path)
    billed = Billing(searches_per_request=1, web_search_per_k=Decimal(25))
    assert replay.billing(MODEL, searching.features) == billed
    assert replay.billing(MODEL, op().features) == Billing()
    assert replay.billing("claude-opus-4-1", searching.features) == Billing()
    with pytest.raises(le.ConfigError, match="searches the web on every request"):
        await le.Engine(replay, prices=PRICES).run(
            dataclasses.replace(searching, limits=le.Limits(credit_hold=1_000)), "hi")
