"""The short path: a model string builds the provider and a default operation,
and the ``*_sync`` methods run the async ones from plain code.

``Operation.from_model("anthropic:claude-sonnet-4-5")`` is the full form with
its defaults filled in: an `Operation` named after the model, on the route
``anthropic``, with the library's default limits, retries and
``max_output_tokens``. ``Engine.from_model(...)`` builds the vendor's
provider from the environment, exactly as the vendor's SDK reads it
(``ANTHROPIC_API_KEY`` or ``ANTHROPIC_AUTH_TOKEN``, and ``ANTHROPIC_BASE_URL``;
``OPENAI_API_KEY`` and ``OPENAI_BASE_URL``; ``"openai-responses:gpt-5"`` is the
same vendor through its Responses API; ``GOOGLE_API_KEY`` or ``GEMINI_API_KEY`` and
``GOOGLE_GEMINI_BASE_URL`` for ``"gemini:<model>"``, on the route ``gemini``).
The provider's module, and so its SDK, is imported only then.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from loopengine import _validate
from loopengine._errors import ConfigError

if TYPE_CHECKING:
    from loopengine._operation import Operation
    from loopengine.providers._base import Provider

__all__ = ["VENDORS", "engine_from_model", "key_variables", "operation_from_model",
           "parse_model", "provider_for_vendor", "run_privately", "sync_method"]

VENDORS: dict[str, str] = {"anthropic": "ANTHROPIC_API_KEY", "openai": "OPENAI_API_KEY",
                           "openai-responses": "OPENAI_API_KEY", "gemini": "GEMINI_API_KEY"}
"""The routes a model string may name, and the variable holding each one's key:
``openai-responses`` is OpenAI's Responses API (`OpenAIResponsesProvider` on that
route; its vendor, in ``served_by`` and prices, stays ``openai``); ``gemini`` is
the Gemini API (`GeminiProvider`; its vendor is ``google``)."""

_ALSO_KEYS: dict[str, tuple[str, ...]] = {"anthropic": ("ANTHROPIC_AUTH_TOKEN",),
                                          "gemini": ("GOOGLE_API_KEY",)}
"""Other variables a vendor's SDK reads its credentials from (the ``anthropic``
SDK sends ``ANTHROPIC_AUTH_TOKEN`` as a bearer token; google-genai reads
``GOOGLE_API_KEY`` first, then ``GEMINI_API_KEY``)."""

_PROVIDER_CLASSES: dict[str, str] = {
    "anthropic": "AnthropicProvider", "openai": "OpenAIProvider",
    "openai-responses": "OpenAIResponsesProvider", "gemini": "GeminiProvider"}
"""The provider class each route of a model string is served by (in
``loopengine.providers``), for messages."""

_BUILT_IN_CODE: dict[str, str] = {
    "aws-bedrock": "AnthropicProvider.bedrock(...)",
    "google-vertex": "AnthropicProvider.vertex(...)",
    "gemini-vertex": "GeminiProvider(vertexai=True, ...)",
    "azure": "OpenAIProvider(azure_endpoint=..., api_version=...)"}
"""The routes the library's providers serve that a model string does not build
(their settings are more than a key), and how each provider is built."""

DEFAULT_MAX_OUTPUT_TOKENS = 4096
"""The ``max_output_tokens`` of an operation built from a model string: room for
an answer after tool turns, well under every current model's ceiling."""

P = ParamSpec("P")
T = TypeVar("T")
S = TypeVar("S")
E = TypeVar("E")


def parse_model(model: object) -> tuple[str, str]:
    """``"vendor:model"`` as ``(vendor, model)``.

    Raises:
        ConfigError: ``model`` is not such a string, or names another vendor.
    """
    if not isinstance(model, str) or ":" not in model:
        raise ConfigError("model", f"must be 'vendor:model' (for example "
                                   f"'anthropic:claude-sonnet-4-5'), got {_validate.shown(model)}")
    vendor, _, name = model.partition(":")
    if vendor not in VENDORS:
        raise ConfigError("model", f"{_not_built(vendor)}; a model string names one of "
                                   f"{', '.join(map(repr, VENDORS))}")
    if not name.strip():
        raise ConfigError("model", f"{_validate.shown(model)} names no model after the vendor")
    return vendor, name


def operation_from_model(model: str, **fields: Any) -> Operation:
    """The default operation of ``model`` (see `loopengine.Operation.from_model`)."""
    from loopengine._operation import Operation

    vendor, name = parse_model(model)
    values: dict[str, Any] = {"name": model, "provider": vendor, "model": name,
                              "max_output_tokens": DEFAULT_MAX_OUTPUT_TOKENS}
    return Operation(**{**values, **fields})


def _not_built(route: str) -> str:
    """Why a model string (or `Engine.from_model`) builds no provider for ``route``."""
    if route in _BUILT_IN_CODE:
        return (f"{route!r} is served by {_BUILT_IN_CODE[route]}, which a model string "
                "does not build: build it and give it to Engine (docs/providers.md)")
    return f"{route!r} is not a vendor this library speaks to"


def key_variables(vendor: str) -> tuple[str, ...]:
    """The environment variables any one of which gives ``vendor``'s SDK its
    credential (the route's key variable first)."""
    return (VENDORS[vendor], *_ALSO_KEYS.get(vendor, ()))


def provider_for_vendor(vendor: str, **options: Any) -> Provider:
    """The provider of ``vendor``, its client configured from the environment.

    Raises:
        ConfigError: the vendor's API key variable is not set (and no
            ``api_key`` was given).
        ImportError: the vendor's SDK is not installed (the message names its extra).
    """
    if vendor not in VENDORS:
        raise ConfigError("model", _not_built(vendor))
    names = key_variables(vendor)
    if not options.get("api_key") and not any(os.environ.get(name) for name in names):
        named = " or ".join(names)
        # Engine.from_model takes Engine's keywords, not the provider's: a key
        # in code goes to the provider, which is then given to Engine.
        raise ConfigError("model", f"{named} is not set: export it, "
                                   f"or build the provider with its key "
                                   f"({_PROVIDER_CLASSES[vendor]}(api_key=...)) and give it "
                                   "to Engine")
    if vendor == "anthropic":
        from loopengine.providers import AnthropicProvider

        return AnthropicProvider(**options)
    if vendor == "openai-responses":
        from loopengine.providers import OpenAIResponsesProvider

        return OpenAIResponsesProvider(route=vendor, **options)
    if vendor == "gemini":
        from loopengine.providers import GeminiProvider

        return GeminiProvider(**options)
    from loopengine.providers import OpenAIProvider

    return OpenAIProvider(**options)


def _running_loop() -> str | None:
    """The event loop running in this thread (``asyncio``, ``trio``), if any."""
    try:
        asyncio.get_running_loop()
        return "asyncio"
    except RuntimeError:
        pass
    trio = sys.modules.get("trio")  # only a program that imported trio can be running it
    if trio is not None:
        try:
            trio.lowlevel.current_trio_token()
            return "trio"
        except RuntimeError:
            pass
    return None


def engine_from_model(engine_class: Callable[..., E], model: str | Operation,
                      **engine_options: Any) -> E:
    """An engine whose one provider serves ``model``'s vendor (see
    `loopengine.Engine.from_model`)."""
    from loopengine._operation import Operation

    vendor = model.provider if isinstance(model, Operation) else parse_model(model)[0]
    return engine_class(provider_for_vendor(vendor), **engine_options)


def run_privately(make: Callable[[], Awaitable[T]], method: str) -> T:
    """Await ``make()`` on a private event loop, refusing inside a running one.

    Raises:
        ConfigError: an event loop (asyncio's, trio's) is running in this thread;
            nothing was started.
    """
    library = _running_loop()
    if library is not None:
        raise ConfigError(method, f"called inside a running {library} event loop, which it "
                                  f"would block; use `await engine.{method.removesuffix('_sync')}"
                                  "(...)` there")

    async def main() -> T:
        return await make()

    return asyncio.run(main())


def sync_method(
    method: Callable[Concatenate[S, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[S, P], T]:
    """The blocking twin of an async method: same arguments, run by `run_privately`."""
    name = f"{method.__name__}_sync"

    def blocking(self: S, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return run_privately(lambda: method(self, *args, **kwargs), name)

    blocking.__name__ = blocking.__qualname__ = name
    blocking.__doc__ = (f"`{method.__name__}` for code without an event loop: the same "
                        "arguments, run to the end on a private event loop (a plain "
                        "script, a sync web handler, a task queue worker).\n\n"
                        "Raises:\n    ConfigError: called inside a running event loop "
                        f"(use ``await {method.__name__}(...)`` there).")
    return blocking
