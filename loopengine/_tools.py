"""Tools: what the model may call, with the schema its input is checked against.

A tool's input is validated before its handler runs; a call that fails
validation never reaches the handler and gets a recoverable error result
instead (R15). Sync handlers run in a worker thread, async ones on the loop;
at the run's deadline an async handler is cancelled, while a sync one's
thread, which cannot be stopped, is abandoned to run on (docs/guards.md, "2. Time").
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, NamedTuple, TypeVar, get_args, get_origin, overload

import anyio.to_thread
import pydantic
import pydantic_core
from pydantic.fields import FieldInfo

from loopengine import _validate
from loopengine._context import ToolContext
from loopengine._errors import ConfigError, ToolInputError
from loopengine._jsonschema import check_schema, schema_errors
from loopengine._raised import withheld

__all__ = ["ExpandedTools", "Tool", "ToolInputError", "ToolSource", "check_tool_name",
           "expand_tools", "tool"]

logger = logging.getLogger("loopengine")

M = TypeVar("M", bound=pydantic.BaseModel)

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def check_tool_name(field: str, name: object) -> str:
    """Return ``name`` if the API accepts it as a tool name, else raise `ConfigError`.

    A name is 1-64 letters, digits, ``_`` or ``-``, the whole string (a
    trailing newline is not allowed, as ``re.match`` with ``$`` would let it).
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(field, f"must match {_NAME.pattern}, got {_validate.shown(name)}")
    return name


class Tool:
    """A tool the model may call.

    Args:
        name: The name the model calls it by (letters, digits, ``_``, ``-``; 1-64).
        description: What it does, for the model.
        input_schema: A JSON Schema for the input; the handler receives the
            input as a dict.
        handler: The function to run, sync or async (a sync one that returns
            an awaitable has it awaited); not a generator function.
        input_model: A pydantic model for the input instead of a schema; the
            handler receives a model instance.
        max_calls: The most calls of this tool one run answers by running the
            handler; a later call gets an ``is_error`` result naming the cap,
            without running it (it still uses a unit of tool budget, R08).
        timeout: Seconds one call may take (within the run's deadline): past
            it an async handler is cancelled, a sync one's thread is abandoned
            (it cannot be stopped), and the call gets an ``is_error`` result.
        approval: Whether a call needs a person's approval before it runs:
            True, False, or ``(call) -> bool`` deciding per call (``call`` is
            the `PendingCall` that would be listed; a plain function, not an
            ``async def`` one; one that raises or
            answers anything but a bool asks). A batch holding such a call
            pauses the run before any of its handlers runs
            (docs/pause-and-resume.md).
        idempotent: Whether running a call twice does no harm (declared by
            the tool's author).

    Use `tool` to build one from a function's signature and docstring.
    """

    def __init__(
        self,
        name: str,
        description: str,
        input_schema: Mapping[str, Any] | None = None,
        handler: Callable[..., Any] | None = None,
        *,
        input_model: type[pydantic.BaseModel] | None = None,
        max_calls: int | None = None,
        timeout: float | None = None,
        approval: bool | Callable[[Any], bool] = False,
        idempotent: bool = False,
    ) -> None:
        _validate.integer("max_calls", max_calls, minimum=0, optional=True)
        _validate.seconds("timeout", timeout, optional=True)
        if not isinstance(approval, bool):
            _validate.sync_callable("approval", approval, "(call) -> bool, or a bool")
        _validate.boolean("idempotent", idempotent)
        self.approval = approval
        """Whether (or, as a callable, which) calls need approval before they run."""
        self.idempotent = idempotent
        """Whether running a call twice does no harm."""
        self.max_calls = max_calls
        """Calls of this tool one run answers by running its handler (None: no cap)."""
        self.timeout = None if timeout is None else float(timeout)
        """Seconds one call may run (None: only the run's deadline)."""
        check_tool_name("name", name)
        if not isinstance(description, str):
            raise ConfigError("description",
                              f"must be a string, got {_validate.shown(description)}")
        _validate.json_copy("description", description)  # sent as JSON: no lone surrogate
        if not description.strip():
            # Not an error (the API accepts it), but the model then has only the
            # name and the schema to go on: said once, when the tool is defined.
            logger.warning("tool %s has no description: the model sees only its name and "
                           "input schema (give a docstring or description=)", name)
        if handler is None or not callable(handler):
            raise ConfigError("handler", f"tool {name!r} needs a callable handler")
        if inspect.isgeneratorfunction(handler) or inspect.isasyncgenfunction(handler):
            # Its call returns a generator, which the model would get as its repr.
            raise ConfigError("handler", f"tool {name!r}: a generator function cannot be a "
                                         "handler: return the result (a list of the items)")
        if (input_schema is None) == (input_model is None):
            raise ConfigError(
                "input_schema", f"tool {name!r} needs exactly one of input_schema or input_model"
            )
        if input_schema is not None and (
            not isinstance(input_schema, Mapping) or input_schema.get("type") != "object"
        ):
            raise ConfigError(
                "input_schema", f"tool {name!r}: must be a JSON Schema of type 'object'"
            )
        self.name = name
        self.description = description
        self.input_model = input_model
        self.handler = handler
        # Our own copy, proven to encode as JSON and to have the shape the
        # input check reads, so a bad schema is refused here, not mid-run.
        self.input_schema: dict[str, Any] = _validate.json_copy(
            "input_schema", input_schema if input_schema is not None
            else _model_schema(input_model))  # type: ignore[arg-type]
        check_schema("input_schema", self.input_schema)
        self._parameters: tuple[tuple[str, str, bool], ...] | None = None
        """For a tool made of a function (`tool`): each parameter's field in the
        input model, its own name (the field's alias: the name the model sees)
        and whether it is positional-only."""
        self._is_async = _validate.is_async(handler)
        self.delegates_to: Any = None
        """The `Engine` this tool's handler runs a delegated conversation on
        (`loopengine.agent_tool`), or None: a run given the tool checks that it
        records on the run's own ledger."""
        self.context_parameter = _context_parameter(handler)
        """The handler's parameter annotated `ToolContext` (given the call's
        context, never shown to the model), or None."""

    def __repr__(self) -> str:
        return f"Tool({self.name!r})"

    @property
    def definition(self) -> dict[str, Any]:
        """The tool definition sent to the model."""
        return {
            "name": self.name,
            "description": self.description,
            "input_schema": self.input_schema,
        }

    def validate(self, tool_input: object) -> Any:
        """Check ``tool_input``; return the argument for the handler.

        Raises:
            ToolInputError: the input does not match; the message says where.
        """
        if self.input_model is not None:
            return validated(self.input_model, tool_input)
        problems = schema_errors(self.input_schema, tool_input)
        if problems:
            raise ToolInputError("; ".join(problems))
        return tool_input

    async def invoke(self, argument: Any, context: ToolContext | None = None) -> Any:
        """Run the handler with a validated argument (worker thread if sync), and
        ``context`` as its `ToolContext` parameter when it declares one.

        Cancelled (the run's deadline), this returns at once. A sync handler's
        thread cannot be stopped: it is abandoned, runs the handler to its end,
        and what it returns or raises then is discarded.
        """
        extra = {} if self.context_parameter is None else {self.context_parameter: context}
        if self._parameters is not None:
            assert isinstance(argument, pydantic.BaseModel)
            positional = [getattr(argument, field)
                          for field, _, only in self._parameters if only]
            keywords = {name: getattr(argument, field)
                        for field, name, only in self._parameters if not only}
            call = functools.partial(self.handler, *positional, **keywords, **extra)
        else:
            call = functools.partial(self.handler, argument, **extra)
        if self._is_async:
            value = await call()
        else:
            # The default thread limiter bounds the handlers running at once. A
            # handler abandoned (its timeout, the run's deadline or
            # cancellation) gives its token back at once, as on asyncio: on
            # trio the thread's own limiter holds it until the thread ends, so
            # abandoned handlers would leave later calls no thread to run in.
            async with anyio.to_thread.current_default_thread_limiter():
                value = await anyio.to_thread.run_sync(
                    _boxed, call, abandon_on_cancel=True, limiter=anyio.CapacityLimiter(1))
        if isinstance(value, _Raised):
            # Raised here, in the run's own frames: a KeyboardInterrupt, a
            # SystemExit or a GeneratorExit that came back through the worker's
            # future would be thrown into the task, which on asyncio ends the
            # event loop (or closes the task) before the run can record its end.
            raise value.error
        if inspect.isawaitable(value):
            # A function returning a coroutine (a lambda around an async one,
            # an async one that forgot its await): its result is what that
            # awaits to, as a judge's is, never the coroutine's repr.
            return await value
        return value


class ToolSource:
    """Tools that may change while a run uses them (`loopengine.mcp.MCPServer`).

    Given among a run's ``tools``, a source is read when the run starts, again
    before each turn's request is built and before each tool batch runs: a
    turn offers the tools the source has then, and a call is checked against
    (and answered by) the tool of its name then; a call of a tool the source
    no longer has is answered as any unknown tool's (docs/tools.md).
    """

    @property
    def tools(self) -> tuple[Tool, ...]:
        """The tools as last known."""
        raise NotImplementedError

    async def current_tools(self) -> tuple[Tool, ...]:
        """The tools now: waits for a change the source has heard of to be read."""
        return self.tools

    def offers(self, name: str) -> bool:
        """Whether a tool of this name may come from this source (a resume given
        the source does not ask for a tool of that name the source dropped)."""
        return True


class ExpandedTools(NamedTuple):
    """A run's ``tools`` with each source's tools in place (`expand_tools`)."""

    tools: tuple[Tool, ...]
    """The tools, in order."""
    places: tuple[tuple[str, str], ...]
    """Where the caller put each tool, as an error names it: the field
    (``tools[i]``, its position in ``tools`` as written) and, for a source's
    tool, the source (``MCPServer('...')``; empty for a tool given itself)."""


def expand_tools(given: Sequence[Tool | ToolSource]) -> ExpandedTools:
    """The tools of ``given``, each source's as it has them now, in order, with
    where the caller put each.

    Raises:
        ConfigError: a source cannot give its tools (an MCP server not open).
    """
    tools: list[Tool] = []
    places: list[tuple[str, str]] = []
    for i, item in enumerate(given):
        if isinstance(item, Tool):
            tools.append(item)
            places.append((f"tools[{i}]", ""))
            continue
        try:
            held = item.tools
        except RuntimeError as error:
            raise ConfigError(f"tools[{i}]", str(error)) from None
        tools.extend(held)
        places.extend((f"tools[{i}]", repr(item)) for _ in held)
    return ExpandedTools(tuple(tools), tuple(places))


class _Raised:
    """What a sync handler raised that is not an `Exception` (internal)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _boxed(call: Callable[[], Any]) -> Any:
    """``call()`` in a worker thread, a `BaseException` that is not an
    `Exception` returned in a `_Raised` rather than raised."""
    try:
        return call()
    except Exception:
        raise
    except BaseException as error:
        return _Raised(error)


def validated(model: type[M], value: object, *, from_json: bool = False) -> M:
    """``value`` (JSON text with ``from_json``) as an instance of ``model``: a
    tool's input, or an answer for a run's or call's ``output=``, checked in
    pydantic's JSON mode, since the model sent it as JSON.

    What the model sent is checked by the model class's own code, which may
    raise more than pydantic turns into a validation error (a validator that
    raises a TypeError or a KeyError): that is the input failing its check
    too, not an error that ends the run. It is logged at ERROR under
    ``loopengine`` (the traceback, its message withheld) as the bug it is.

    Raises:
        ToolInputError: the value does not match; the message, which goes to
            the model, says where (``field: problem``), or the type of what a
            validator raised.
    """
    if not from_json:
        try:
            # What the model sent is JSON, so it is checked as JSON: a strict
            # model takes "2024-01-02" for a date, or "a" for an enum member,
            # only there (its Python mode wants a date, a member).
            text = json.dumps(value, ensure_ascii=False, allow_nan=True)
            text.encode()  # pydantic reads JSON as UTF-8: a lone surrogate cannot be
            value = text
        except (TypeError, ValueError):
            pass  # not JSON (a Python object a test scripted, a lone surrogate): as it is
    try:
        if isinstance(value, str):
            return model.model_validate_json(value)
        return model.model_validate(value)
    except pydantic.ValidationError as error:
        raise ToolInputError(describe_validation_error(error)) from None
    except Exception as error:
        logger.error("a validator of %s raised %s; the input counts as invalid",
                     model.__name__, type(error).__name__, exc_info=withheld(error))
        # Its message is not shown: a bug's message was not written for the
        # model (a validator's ValueError is, and pydantic shows it).
        raise ToolInputError(f"a check of the input raised {type(error).__name__}") from None


def describe_validation_error(error: pydantic.ValidationError) -> str:
    """A pydantic error as short ``field: problem`` lines, without input values."""
    parts = []
    for item in error.errors(include_url=False, include_input=False):
        where = ".".join(str(p) for p in item["loc"]) or "input"
        parts.append(f"{where}: {item['msg']}")
    return "; ".join(parts)


def _context_parameter(handler: Callable[..., Any]) -> str | None:
    """The name of ``handler``'s parameter annotated `ToolContext`, if it has one."""
    try:
        parameters = inspect.signature(handler, eval_str=True).parameters.values()
    except (NameError, TypeError, ValueError):
        return None  # no signature to read (a builtin), or one naming no context
    for param in parameters:
        if param.annotation is ToolContext:
            return param.name
    return None


def _model_schema(model: type[pydantic.BaseModel]) -> dict[str, Any]:
    schema = _validate.model_schema("input_model", model)
    schema.setdefault("properties", {})
    return schema


def _docstring_parts(fn: Callable[..., Any]) -> tuple[str, dict[str, str]]:
    """The description (text before ``Args:``) and per-argument descriptions."""
    doc = inspect.getdoc(fn) or ""
    head, _, rest = doc.partition("\nArgs:\n")
    params: dict[str, str] = {}
    current: str | None = None
    indent: int | None = None  # the entries' own: a deeper line continues one
    for line in rest.splitlines():
        if line and not line.startswith(" "):
            break  # the next section (Returns:, Raises:)
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip(" "))
        if indent is None:
            indent = depth
        match = re.match(r"^(\*{0,2}\w+)(?:\s*\(.*?\))?:\s*(.*)$", line.strip())
        if match and depth <= indent:
            current = match.group(1).lstrip("*")
            params[current] = match.group(2).strip()
        elif current:
            params[current] += " " + line.strip()
    return head.strip(), params


def _parameter_field(name: str, annotation: Any, default: Any,
                     described: str | None) -> FieldInfo:
    """The input model's field of a parameter: its alias is the parameter's
    name, its default the parameter's. A default that is a ``pydantic.Field``
    (``limit: int = Field(5, ge=1)``) is the field itself, not a value. The
    docstring's description (``described``) is used unless the parameter has
    one of its own, in that ``Field`` or in an ``Annotated[..., Field(...)]``."""
    own = [*(m for m in get_args(annotation)[1:] if isinstance(m, FieldInfo))] \
        if get_origin(annotation) is Annotated else []
    given = default if isinstance(default, FieldInfo) else pydantic.Field(default)
    if described is None or any(f.description for f in [*own, given]):
        return FieldInfo.merge_field_infos(given, pydantic.Field(alias=name))
    return FieldInfo.merge_field_infos(given, pydantic.Field(alias=name, description=described))


def _from_function(
    fn: Callable[..., Any], name: str | None, description: str | None,
    max_calls: int | None = None, timeout: float | None = None,
    approval: bool | Callable[[Any], bool] = False, idempotent: bool = False,
) -> Tool:
    if not callable(fn):
        raise ConfigError("handler", f"a tool needs a function, got {type(fn).__name__}")
    # A functools.partial has neither a name nor a docstring of its own (its
    # __doc__ is the partial class's): both come from the function it wraps.
    inner = fn
    while isinstance(inner, functools.partial):
        inner = inner.func
    label = getattr(inner, "__name__", None)
    if not isinstance(label, str):
        if name is None:
            raise ConfigError("name", f"a {type(fn).__name__} object has no __name__ to name "
                                      "the tool by: give tool(name=...)")
        label = name
    summary, param_docs = _docstring_parts(inner)
    fields: dict[str, Any] = {}
    try:
        # eval_str resolves string annotations (modules using postponed evaluation).
        parameters = inspect.signature(fn, eval_str=True).parameters.values()
    except NameError as error:
        raise ConfigError("handler", f"{label}: cannot resolve an annotation: {error}") \
            from None
    except (TypeError, ValueError):  # a builtin or class whose signature Python cannot read
        raise ConfigError("handler", f"{label}: Python cannot read its signature (a builtin "
                                     "or a class): wrap it in a function with annotated "
                                     "parameters") from None
    first = next(iter(parameters), None)
    if first is not None and first.name in ("self", "cls") \
            and first.annotation is first.empty and not inspect.ismethod(fn):
        # A method decorated in its class body: the model would be asked for it.
        raise ConfigError("handler", f"{label}: its first parameter is {first.name!r}, which "
                                     "the model would have to supply: make the tool of the "
                                     f"bound method (le.tool(instance.{label})) instead")
    # Each parameter is a field of the input model with the parameter's own
    # name as its alias (what the schema shows and the input is read by). The
    # field has that name too, unless pydantic keeps it for itself
    # (``model_config``, ``_private``, ``schema``): such a field is named by its
    # position. A positional-only parameter is passed by position.
    names: list[tuple[str, str, bool]] = []
    taken = {param.name for param in parameters}
    for param in parameters:
        if param.annotation is ToolContext:
            continue  # given by the engine, never by the model
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ConfigError("handler", f"{label}: *args and **kwargs cannot be tool input")
        annotation = Any if param.annotation is param.empty else param.annotation
        default = ... if param.default is param.empty else param.default
        field = param.name
        if field.startswith(("_", "model_")) or hasattr(pydantic.BaseModel, field):
            field = f"p{len(names)}"
            while field in taken:
                field += "_"
        fields[field] = (annotation, _parameter_field(param.name, annotation, default,
                                                      param_docs.get(param.name)))
        names.append((field, param.name, param.kind is param.POSITIONAL_ONLY))
    # A name given is checked, even "", before it names the input model.
    tool_name = label if name is None else check_tool_name("name", name)
    try:
        model = pydantic.create_model(f"{tool_name}_input", **fields)
        built = Tool(tool_name, description if description is not None else summary,
                     handler=fn, input_model=model, max_calls=max_calls, timeout=timeout,
                     approval=approval, idempotent=idempotent)
    except pydantic.PydanticUserError as error:
        raise ConfigError("handler", f"{label}: {error}") from None
    except ConfigError as error:
        if error.field != "input_model":
            raise
        # The input model is built here from the signature: its fault is the function's.
        raise ConfigError("handler", f"{label}: {error.message}") from None
    built._parameters = tuple(names)
    return built


@overload
def tool(fn: Callable[..., Any], /) -> Tool: ...


@overload
def tool(
    *, name: str | None = None, description: str | None = None,
    max_calls: int | None = None, timeout: float | None = None,
    approval: bool | Callable[[Any], bool] = False, idempotent: bool = False,
) -> Callable[[Callable[..., Any]], Tool]: ...


def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    max_calls: int | None = None,
    timeout: float | None = None,
    approval: bool | Callable[[Any], bool] = False,
    idempotent: bool = False,
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Make a `Tool` of a function: its parameters are the input schema.

    The docstring's first part describes the tool to the model; a Google-style
    ``Args:`` section describes each parameter. Use bare (``@tool``) or with
    ``name=``, ``description=``, ``max_calls=``, ``timeout=``, ``approval=`` and
    ``idempotent=`` (see `Tool`).
    The handler is called with keyword arguments.
    """
    if fn is not None:
        return _from_function(fn, name, description, max_calls, timeout, approval, idempotent)

    def decorate(f: Callable[..., Any]) -> Tool:
        return _from_function(f, name, description, max_calls, timeout, approval, idempotent)

    return decorate


def render_tool_output(value: object) -> str | list[dict[str, Any]]:
    """A handler's return value as tool-result content, always encodable as JSON.

    A model, or data holding models, dataclasses, enum members, sets or dates,
    is given as JSON (never as a Python repr), and so is a list that only looks
    like content blocks (records with a ``type`` key, a text block without its
    text): only blocks the API takes are given as blocks. A lone surrogate in
    what a handler returned (UTF-8 cannot encode it) is
    replaced by U+FFFD: the result goes back to the model in the next request,
    which could not be sent otherwise.
    """
    if isinstance(value, str):
        return _encodable_text(value)
    if value is None:
        return ""
    if isinstance(value, pydantic.BaseModel):
        return value.model_dump_json()
    if isinstance(value, list) and value and all(
        isinstance(b, dict) and b.get("type") in _RESULT_BLOCKS for b in value
    ):
        try:
            blocks = [_validate.json_copy("result", _encodable(b)) for b in value]
            for index, block in enumerate(blocks):
                _validate.content_block(f"result[{index}]", block, kinds=_RESULT_BLOCKS)
            return blocks
        except ConfigError:
            # Not JSON (a NaN, an object, too deep), or not blocks the API takes
            # (records that have a "type" key, a text block without its text):
            # sent as text below, which the next request can carry.
            pass
    return _encodable_text(json.dumps(value, default=_jsonable, ensure_ascii=False))


_RESULT_BLOCKS = ("text", "image", "document")
"""The content blocks a handler may return as its result's content."""


def _jsonable(value: object) -> object:
    """What JSON carries of a value `json` does not know: what pydantic makes of
    it (a model or dataclass its fields, an enum member its value, a set a list,
    a date its ISO text, bytes their text), else its ``str()``."""
    try:
        return pydantic_core.to_jsonable_python(value, fallback=str)
    except Exception:  # pydantic knows the type but not this value (bytes not UTF-8)
        return str(value)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _encodable_text(text: str) -> str:
    return text if text.isascii() else _SURROGATE.sub("\ufffd", text)


def _encodable(value: object, depth: int = 0) -> object:
    """``value`` with every string made encodable (`_encodable_text`); the depth
    is capped by `loopengine._validate.json_copy`, which refuses deeper values."""
    if isinstance(value, str):
        return _encodable_text(value)
    if depth > _validate.MAX_JSON_DEPTH:
        return value
    if isinstance(value, dict):
        return {k: _encodable(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_encodable(v, depth + 1) for v in value]
    return value
