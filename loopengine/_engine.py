"""`Engine`: runs operations on their published route, accountably."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import pydantic

from loopengine import _validate
from loopengine._attribution import Attribution
from loopengine._call import CallResult, CallSpec, run_call
from loopengine._clock import Clock, SystemClock
from loopengine._errors import ConfigError
from loopengine._estimate import Estimate, estimate_run
from loopengine._invocation import Invocation
from loopengine._operation import Operation
from loopengine._pricing import PriceBook
from loopengine._result import RunResult
from loopengine._run import (
    RunSpec,
    ToolErrorText,
    check_unique_tools,
    default_tool_error_text,
    run_loop,
)
from loopengine._tools import Tool
from loopengine.events import Observer
from loopengine.guards._limits import Limits
from loopengine.persistence._protocol import Ledger
from loopengine.providers._base import Provider, TextCallback
from loopengine.providers._retry import RetryPolicy

__all__ = ["Engine"]

M = TypeVar("M", bound=pydantic.BaseModel)
Messages = str | Sequence[Mapping[str, Any]]
System = str | Sequence[Mapping[str, Any]] | None


class Engine:
    """Runs conversations (`run`) and structured calls (`call`) of operations.

    Args:
        provider: The provider serving the operations' route, or a mapping of
            route name to provider. An operation runs only on the provider
            whose name is its ``provider``; there is no substitute (R13).
        ledger: Where invocations and attempts are recorded (`SQLiteLedger`),
            or None to record nothing.
        prices: Prices and the credit exchange rate; genai-prices by default.
        observers: Callables receiving each `loopengine.events` event.
        clock: The time source (`loopengine.testing.FakeClock` in tests).
        rng: The jitter source of retry waits.
        tool_error_text: ``(tool_name, error) -> str``: what the model is told
            when a tool handler raises (default: the exception's message, R09).
    """

    def __init__(
        self,
        provider: Provider | Mapping[str, Provider],
        *,
        ledger: Ledger | None = None,
        prices: PriceBook | None = None,
        observers: Iterable[Observer] = (),
        clock: Clock | None = None,
        rng: random.Random | None = None,
        tool_error_text: ToolErrorText | None = None,
    ) -> None:
        if isinstance(provider, Mapping):
            providers = dict(provider)
        else:
            providers = {getattr(provider, "name", ""): provider}
        if not providers:
            raise ConfigError("provider", "an engine needs at least one provider")
        for route, item in providers.items():
            if not isinstance(item, Provider):
                raise ConfigError("provider", f"{item!r} is not a Provider (name and send)")
            if item.name != route:
                raise ConfigError("provider", f"the provider for route {route!r} is named "
                                              f"{item.name!r}")
        if ledger is not None and not isinstance(ledger, Ledger):
            raise ConfigError("ledger", f"{ledger!r} does not implement the Ledger protocol")
        if prices is not None and not isinstance(prices, PriceBook):
            raise ConfigError("prices", f"must be a PriceBook, got {prices!r}")
        observer_list = list(observers)
        for i, observer in enumerate(observer_list):
            if not callable(observer):
                raise ConfigError(f"observers[{i}]", f"must be callable, got {observer!r}")
        if tool_error_text is not None and not callable(tool_error_text):
            raise ConfigError("tool_error_text", "must be callable")
        self.providers: dict[str, Provider] = providers
        self.ledger = ledger
        self.prices = prices or PriceBook()
        self.observers: list[Observer] = observer_list
        self.clock: Clock = clock or SystemClock()
        self.rng = rng or random.Random()
        self.tool_error_text: ToolErrorText = tool_error_text or default_tool_error_text
        # Routes (``provider:model``) whose missing price was logged: once each.
        self._unpriced_warned: set[str] = set()

    def provider_for(self, operation: Operation) -> Provider:
        """The provider of ``operation``'s published route.

        Raises:
            ConfigError: no provider of this engine serves that route (R13).
        """
        if not isinstance(operation, Operation):
            raise ConfigError("operation", f"must be an Operation, got {operation!r}")
        provider = self.providers.get(operation.provider)
        if provider is None:
            raise ConfigError(
                "provider",
                f"operation {operation.name!r} is published on route {operation.provider!r}, "
                f"which this engine does not serve (it serves {', '.join(self.providers)}); "
                "loopengine never substitutes another route",
            )
        return provider

    def _invocation(
        self,
        kind: str,
        operation: Operation,
        limits: Limits | Mapping[str, object] | None,
        retry: RetryPolicy | Mapping[str, object] | None,
        attribution: Attribution | None,
    ) -> Invocation:
        provider = self.provider_for(operation)
        run_limits = operation.limits.narrow(limits)
        policy = operation.retry.narrow(retry)
        if attribution is not None and not isinstance(attribution, Attribution):
            raise ConfigError("attribution", f"must be an Attribution, got {attribution!r}")
        if run_limits.credit_hold is not None and not self.prices.knows(
            operation.provider, operation.model, self.clock.wall()
        ):
            raise ConfigError(
                "prices",
                f"{operation.provider}:{operation.model} has no price, so its credit_hold "
                "cannot be enforced; add a ModelPrice to the PriceBook",
            )
        return Invocation(
            kind=kind, operation=operation, provider=provider, limits=run_limits,
            policy=policy, attribution=attribution, ledger=self.ledger, prices=self.prices,
            clock=self.clock, rng=self.rng, observers=self.observers,
            unpriced_warned=self._unpriced_warned,
        )

    async def run(
        self,
        operation: Operation,
        messages: Messages,
        *,
        system: System = None,
        tools: Iterable[Tool] = (),
        output: type[pydantic.BaseModel] | None = None,
        accept: Callable[[Any], Any] | None = None,
        attribution: Attribution | None = None,
        limits: Limits | Mapping[str, object] | None = None,
        retry: RetryPolicy | Mapping[str, object] | None = None,
        on_text: TextCallback | None = None,
        tool_error_text: ToolErrorText | None = None,
        final_tool: str = "final_answer",
    ) -> RunResult:
        """Run a conversation of ``operation`` to an outcome.

        Args:
            operation: The published operation (route, limits, policies).
            messages: One user message, or Anthropic-shaped message dicts.
            system: The system prompt: a string or Anthropic text blocks.
            tools: The tools the model may call.
            output: A pydantic model for structured mode: the model answers by
                calling the terminal tool ``final_tool`` with this schema.
            accept: The judge of a final answer, sync or async: returns
                `Accept`, `Reject` or a bool. A judge that raises rejects.
            attribution: Who the run is accounted to.
            limits: Narrows the operation's limits for this run (never
                widens): only the fields it names, the keys of a mapping or
                the fields passed to the `Limits`.
            retry: Narrows the operation's retry policy for this run.
            on_text: Receives streamed text deltas (streaming providers). A
                failed attempt's text has already been delivered when its retry
                starts: observers' attempt events say which attempt the text
                belongs to (docs/observability.md).
            tool_error_text: Overrides the engine's hook for this run.
            final_tool: The terminal tool's name in structured mode.

        Returns:
            The `RunResult`, whatever the outcome; it keeps the whole transcript.

        Raises:
            ConfigError: bad input, an unserved route, or an unpriced model with
                a credit hold; raised before anything is sent.
            LedgerError: the ledger could not record the run; it is recorded
                ``failed`` where the ledger still can, and observers see
                `RunEnded` with outcome ``failed``.
        """
        spec = RunSpec(
            messages=normalize_messages(messages),
            system=normalize_system(system),
            tools=tuple(tools),
            output=_check_output(output),
            accept=_check_callable("accept", accept),
            on_text=_check_callable("on_text", on_text),
            tool_error_text=_check_callable("tool_error_text", tool_error_text)
            or self.tool_error_text,
            final_tool=final_tool,
        )
        if not isinstance(final_tool, str) or not final_tool:
            raise ConfigError("final_tool", "must be a non-empty tool name")
        check_unique_tools(spec.tools, final_tool, structured=output is not None)
        inv = self._invocation("run", operation, limits, retry, attribution)
        return await run_loop(inv, spec)

    async def call(
        self,
        operation: Operation,
        messages: Messages,
        *,
        output: type[M],
        system: System = None,
        retry: RetryPolicy | Mapping[str, object] | None = None,
        attribution: Attribution | None = None,
        max_tokens: int | None = None,
        limits: Limits | Mapping[str, object] | None = None,
        prompt_fallback: bool = False,
    ) -> CallResult[M]:
        """Make one structured call of ``operation`` and report every request it made.

        The model is forced to answer through a tool whose input schema is
        ``output``. Invalid replies are retried with the validation error fed
        back, truncated ones with ``max_tokens`` doubled (unless
        ``retry.grow_max_tokens`` is false) up to the growth ceiling: the
        operation's ``model_max_output_tokens`` when it publishes one, else
        four times the first request's ``max_tokens``. Transport faults are
        retried as in a run. ``retry.max_attempts`` caps
        every request of the call (1 turns retries off); a value above the
        operation's own is clamped. See docs/structured-calls.md.

        Args:
            operation: The published operation.
            messages: One user message, or Anthropic-shaped message dicts.
            output: The pydantic model of the answer.
            system: The system prompt: a string or Anthropic text blocks.
            retry: Narrows the operation's retry policy for this call.
            attribution: Who the call is accounted to.
            max_tokens: The first request's ``max_tokens`` (default: the
                operation's ``max_output_tokens``); never above that, nor
                above ``model_max_output_tokens``.
            limits: Narrows the operation's limits (time, credit hold).
            prompt_fallback: Make the last permitted attempt with a
                prompt-embedded schema when native attempts failed validation.

        Returns:
            The `CallResult`: ``data``, ``usage`` (of the attempt ``data`` came
            from) and ``attempts``.

        Raises:
            ConfigError: bad input, e.g. ``retry.max_attempts`` not an integer
                in 1..16 (``.field == "retry.max_attempts"``).
            ProviderError: a provider fault ended the call; ``.attempts`` says
                how many requests it made.
            StructuredOutputError: the attempts ran out without a valid answer.
            OutcomeError: the call was refused, ran out of time or credits.
            LedgerError: the ledger could not record the call; it is recorded
                ``failed`` where the ledger still can.
        """
        checked_output = _check_output(output)
        if checked_output is None:
            raise ConfigError("output", "a structured call needs an output model")
        if max_tokens is not None:
            _validate.integer("max_tokens", max_tokens, minimum=1)
        _validate.boolean("prompt_fallback", prompt_fallback)
        inv = self._invocation("call", operation, limits, retry, attribution)
        spec = CallSpec(
            messages=normalize_messages(messages),
            system=normalize_system(system),
            output=checked_output,
            max_tokens=max_tokens or operation.max_output_tokens,
            prompt_fallback=prompt_fallback,
        )
        return await run_call(inv, spec)

    def estimate(
        self,
        operation: Operation,
        messages: Messages,
        *,
        system: System = None,
        tools: Iterable[Tool] = (),
        output: type[pydantic.BaseModel] | None = None,
        limits: Limits | Mapping[str, object] | None = None,
    ) -> Estimate:
        """The worst case of a run of ``operation``, before it starts: tokens, USD, credits.

        Synchronous, offline: input is counted with the shipped ``cl100k_base``
        and scaled to Claude's tokenizer; output and turns are the limits'
        worst case; prices are this engine's, at its clock's current time. See
        docs/observability.md for the model.

        Args:
            operation: The published operation.
            messages: One user message, or Anthropic-shaped message dicts.
            system: The system prompt: a string or Anthropic text blocks.
            tools: The tools the run would offer.
            output: The structured-mode model, whose terminal tool is counted.
            limits: Narrows the operation's limits, as for `run`.

        Raises:
            ConfigError: bad input, as `run` would raise it.
            LoopEngineError: the shipped tokenizer file is damaged.
        """
        return estimate_run(operation, normalize_messages(messages),
                            system=normalize_system(system), tools=tools, output=output,
                            limits=limits, prices=self.prices, at=self.clock.wall())


def normalize_messages(messages: Messages) -> list[dict[str, Any]]:
    """One user message or a list of Anthropic-shaped messages, as our own copy.

    Raises:
        ConfigError: empty, or a message without a ``role`` of ``user`` or
            ``assistant`` and a string or list ``content``.
    """
    if isinstance(messages, str):
        if not messages:
            raise ConfigError("messages", "must not be empty")
        return [{"role": "user", "content": messages}]
    if not isinstance(messages, Sequence) or not messages:
        raise ConfigError("messages", "must be a string or a non-empty list of messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ConfigError(f"messages[{i}]", f"must be a dict, got {type(message).__name__}")
        if message.get("role") not in ("user", "assistant"):
            raise ConfigError(f"messages[{i}].role",
                              f"must be 'user' or 'assistant', got {message.get('role')!r}")
        content = message.get("content")
        if not isinstance(content, str | list | tuple):
            raise ConfigError(f"messages[{i}].content", "must be a string or a list of blocks")
        if isinstance(content, list | tuple) and not all(isinstance(b, Mapping) for b in content):
            raise ConfigError(f"messages[{i}].content", "every block must be a dict")
        copied = copy.deepcopy(dict(message))
        if isinstance(copied["content"], tuple):
            copied["content"] = list(copied["content"])
        out.append(copied)
    return out


def normalize_system(system: System) -> list[dict[str, Any]] | None:
    """A system prompt string or text blocks, as a list of text blocks.

    Raises:
        ConfigError: not a string or a list of ``text`` blocks.
    """
    if system is None:
        return None
    if isinstance(system, str):
        return [{"type": "text", "text": system}] if system else None
    if not isinstance(system, Sequence):
        raise ConfigError("system", "must be a string or a list of text blocks")
    out: list[dict[str, Any]] = []
    for i, block in enumerate(system):
        if not isinstance(block, Mapping) or block.get("type") != "text" or not isinstance(
            block.get("text"), str
        ):
            raise ConfigError(f"system[{i}]", "must be a text block {'type': 'text', 'text': ...}")
        out.append(copy.deepcopy(dict(block)))
    return out or None


def _check_output(output: object) -> type[pydantic.BaseModel] | None:
    if output is None:
        return None
    if isinstance(output, type) and issubclass(output, pydantic.BaseModel):
        return output
    raise ConfigError("output", f"must be a pydantic model class, got {output!r}")


def _check_callable(field: str, value: Any) -> Any:
    if value is not None and not callable(value):
        raise ConfigError(field, f"must be callable, got {value!r}")
    return value
