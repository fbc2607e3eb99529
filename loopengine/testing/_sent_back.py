"""What the fake APIs require back with the calls they served, checked one way.

A thinking model's API hands out something with a tool call that it wants back
when the call goes back in a later request's transcript: Gemini's thought
signature (natively, and in an OpenAI-compatible call's ``extra_content``),
DeepSeek's ``reasoning_content``, OpenRouter's ``reasoning_details``, the
Responses API's reasoning item. Each fake remembers what it served, by the
call's key (`Served`), and refuses a request that sends a call back without
it (`call_sent_back_without`), within the current turn where the API checks
only that (`current_turn`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

__all__ = ["Served", "call_sent_back_without", "current_turn"]

V = TypeVar("V")


class Served(Mapping[str, V], Generic[V]):
    """What a fake served with each of its calls, by the call's key: what the API
    requires back with the call. Handler threads write it while others read it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[str, V] = {}

    def remember(self, keys: Iterable[str], value: V) -> None:
        """Note that each call of ``keys`` was served with ``value``."""
        self.update(dict.fromkeys(keys, value))

    def update(self, served: Mapping[str, V]) -> None:
        """Note what each call of ``served`` was served with."""
        with self._lock:
            self._by_key.update(served)

    def __getitem__(self, key: str) -> V:
        with self._lock:
            return self._by_key[key]

    def __iter__(self) -> Iterator[str]:
        with self._lock:
            return iter(list(self._by_key))

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_key)


def current_turn(messages: Sequence[object], prompted: Callable[[Mapping[str, Any]], bool]) -> int:
    """The index of the first message of the current turn: the one after the last
    message that ``prompted`` says is the user's own (not only tool results), or 0."""
    return max((index + 1 for index, message in enumerate(messages)
                if isinstance(message, Mapping) and prompted(message)), default=0)


def call_sent_back_without(
    messages: Sequence[object], served: Mapping[str, object],
    calls: Callable[[Mapping[str, Any]], Iterable[tuple[int, str, object]]], *, start: int = 0,
) -> tuple[int, int, str] | None:
    """The first call, from ``messages[start]`` on, that the server served with
    something (``served``, by the call's key) and that comes back without it, or
    with something else: its message's index, its position in the message and
    its key; None when every call carries back what it was served with.

    ``calls`` lists a message's calls as ``(position, key, what came back with it)``.
    """
    for index in range(start, len(messages)):
        message = messages[index]
        if not isinstance(message, Mapping):
            continue
        for position, key, sent in calls(message):
            required = served.get(key)
            if required is not None and sent != required:
                return index, position, key
    return None
