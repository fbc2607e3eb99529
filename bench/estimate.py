"""Benchmark: `Engine.estimate` of a 100,000-token conversation, next to a bare encode.

Run with::

    python bench/estimate.py

The baseline is tiktoken's own work on the same text (one `encode_ordinary` of
all of the conversation's text, the least any count can cost); the estimate
adds walking the messages, counting each text, and pricing every turn with
genai-prices. Both use the encoding already loaded; the one-time load of the
shipped file (read, SHA-256 check, parse) is measured and printed apart.
Medians (and the fastest) of repeated runs, measured in this process.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import loopengine as le
from loopengine import _tokenizer
from loopengine.providers import ScriptedProvider

TARGET_TOKENS = 100_000
REPEATS = 25
BUDGET_MS = 50.0

SENTENCES = [
    "The invoice for March was sent to the billing contact on file, not the account owner.",
    "Can you check whether the export job finished before the maintenance window started?",
    "Resetting a password sends a link that expires after thirty minutes.",
    "def retry(fn, attempts=3):\n    for i in range(attempts):\n        try:\n"
    "            return fn()\n        except TimeoutError:\n            continue\n",
    "SELECT tenant, SUM(cost_nanousd) FROM invocations GROUP BY tenant ORDER BY 2 DESC;",
    "Die Rechnung wurde am 3. April 2026 an die hinterlegte Adresse verschickt.",
    "Order #48213 shipped in 2 boxes: 14.5 kg and 3.2 kg, tracking 1Z999AA10123456784.",
    "請確認帳戶的付款方式是否已更新。",
    "Error 529 overloaded_error: the service is temporarily overloaded, retry later.",
    "{\"id\": \"toolu_01\", \"name\": \"search_docs\", \"input\": {\"query\": \"sso setup\"}}",
    "She said the dashboard looked fine, but the numbers didn't match last week's report.",
    "Step 4: open Settings → Security → Single sign-on, then paste the metadata URL.",
]


def conversation(encoding: Any) -> list[dict[str, Any]]:
    """Alternating user/assistant messages of shuffled sentences, ~100k cl100k tokens."""
    rng = random.Random(2026)
    messages: list[dict[str, Any]] = []
    total = 0
    while total < TARGET_TOKENS:
        text = " ".join(rng.choice(SENTENCES) for _ in range(rng.randint(20, 60)))
        total += len(encoding.encode_ordinary(text))
        role = "user" if len(messages) % 2 == 0 else "assistant"
        messages.append({"role": role, "content": [{"type": "text", "text": text}]})
    if messages[-1]["role"] != "user":
        messages.append({"role": "user", "content": "Please summarise the above."})
    return messages


def paired_timings_ms(
    first: Callable[[], object], second: Callable[[], object]
) -> tuple[tuple[float, float], tuple[float, float]]:
    """(median, fastest) of REPEATS calls of each, alternating, so that both see the
    same machine load; the fastest shows how much of the median is other processes."""
    first()
    second()  # warm up
    samples: tuple[list[float], list[float]] = ([], [])
    for _ in range(REPEATS):
        for fn, out in ((first, samples[0]), (second, samples[1])):
            started = time.perf_counter()
            fn()
            out.append((time.perf_counter() - started) * 1000)
    a, b = samples
    return (statistics.median(a), min(a)), (statistics.median(b), min(b))


def main() -> None:
    started = time.perf_counter()
    encoding = _tokenizer.load_cl100k(_tokenizer.SHIPPED_CL100K)
    load_ms = (time.perf_counter() - started) * 1000
    _tokenizer.cl100k()  # the engine's cached copy

    messages = conversation(encoding)
    text = "\n".join(block["text"] for m in messages for block in m["content"]
                     if isinstance(block, dict))

    @le.tool(name="search_docs", description="Search the product documentation.")
    def search_docs(query: str, limit: int = 5) -> str:
        return query

    operation = le.Operation(name="bench.estimate", provider="anthropic",
                             model="claude-sonnet-4-5", max_output_tokens=1024,
                             limits=le.Limits(max_turns=10))
    engine = le.Engine(ScriptedProvider())
    system = "You are the help desk assistant. Answer from the documentation."

    def estimate() -> le.Estimate:
        return engine.estimate(operation, messages, system=system, tools=[search_docs])

    result = estimate()
    (baseline, baseline_min), (measured, measured_min) = paired_timings_ms(
        lambda: encoding.encode_ordinary(text), estimate)

    print(f"conversation: {len(messages)} messages, {result.counted_tokens:,} cl100k tokens "
          f"(~{result.input_tokens:,} Claude tokens), {result.turns} turns priced")
    print(f"worst case: {result.total_input_tokens:,} input + {result.output_tokens:,} output "
          f"tokens, ${result.cost_usd}, {result.credits:,} credits")
    print()
    print(f"{'':36}{'median ms':>10}{'ratio':>7}{'fastest ms':>12}{'ratio':>7}")
    print(f"{'baseline: encoding.encode_ordinary':36}{baseline:>10.2f}{1.0:>7.2f}"
          f"{baseline_min:>12.2f}{1.0:>7.2f}")
    print(f"{'Engine.estimate':36}{measured:>10.2f}{measured / baseline:>7.2f}"
          f"{measured_min:>12.2f}{measured_min / baseline_min:>7.2f}")
    print(f"{'first use: read, verify, parse file':36}{load_ms:>10.2f}")
    print()
    verdict = "within" if measured < BUDGET_MS else "OVER"
    print(f"Engine.estimate: {measured:.2f} ms, {verdict} the {BUDGET_MS:.0f} ms budget")


if __name__ == "__main__":
    main()
