"""Tools from MCP servers, as `loopengine.Tool` objects (extra ``mcp``).

`MCPServer` connects to a server over stdio (a command it starts) or
streamable HTTP, lists its tools and gives each as a `Tool` whose handler
calls the server. The engine treats them as any tool: the run's tool budget,
the tool's ``max_calls`` and ``timeout`` and the run's deadline all apply to
a call, which this module does not re-implement; so does approval: the
server's ``approval=`` and ``idempotent=`` (for every tool, by name, or per
call) become each tool's own, and a call that needs approval pauses the run
before it reaches the server.

What a call's result becomes (docs/tools.md):

* an MCP result with ``isError`` -> the handler raises `MCPToolError` with the
  result's text, so the model gets an ``is_error`` result (through the
  engine's ``tool_error_text`` hook, as any handler's error);
* a result the SDK refuses (structured content that its tool's output
  schema does not match, or a result that is not a valid MCP tool result)
  -> `MCPToolError`: the call was answered;
* text -> text blocks; PNG, JPEG, GIF and WebP images -> image blocks; an
  embedded PDF -> a document block (data that is not base64 -> a note);
  structured content -> its JSON as a text block when the result has no
  other content (the protocol has a server mirror it as text otherwise);
  audio, other binary data and resource links -> a text block describing them;
* a dead server, a closed connection, an HTTP answer without a JSON-RPC one
  after which the server may have run the call (a gateway's 504, a 202, a
  body that is not an answer, a redirect: `_INVENTED`), a call the server
  still says is under way when the SDK stops asking, or a protocol failure
  -> the handler raises `MCPServerError` saying the result is not known (an
  ``is_error`` result for that call, recorded ``in_doubt``), and the
  next call opens a new session, once; a call the engine cancels (its tool's
  timeout, the run's deadline, a cancelled run) leaves the session suspect of
  hanging, so the next call opens a new one too, while calls still running on
  the old session finish there;
* an HTTP 404 without a JSON-RPC answer (the server did not take the call),
  or a call whose HTTP request could not connect when no request of that
  call got an HTTP response (`_Sent`) -> `MCPServerError` saying the call did
  not run (recorded ``failed``); a later round of a call (the server asked for
  input, or said it is under way) that cannot connect leaves its result not
  known (``in_doubt``), as the server may have acted on an earlier round.

A server that announces changes to its tool list (``tools.listChanged``) is
listed again when it says they changed (one listing at a time, listings a
change prompts at least a second apart; after a listing fails, none for a
wait, and readings do not wait for one until a listing succeeds); a run given
the `MCPServer` itself (a `loopengine._tools.ToolSource`) in its ``tools``
reads them before each turn and each batch, so it offers and answers with the
tools as they are.

One `MCPServer` serves any number of concurrent runs over one session.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import AsyncIterator, Callable, Collection, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from contextvars import ContextVar
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeAlias, TypedDict, Unpack

import anyio
import anyio.abc
import pydantic

from loopengine import _validate
from loopengine._clock import Clock, SystemClock
from loopengine._errors import ConfigError, MCPServerError, MCPToolError
from loopengine._tools import Tool, ToolSource, check_tool_name

try:
    import httpx2
    import mcp_types
    from mcp import Client, InputRequiredRoundsExceededError, MCPError, StdioServerParameters
    from mcp.client.stdio import stdio_client
    from mcp.client.streamable_http import streamable_http_client
    from mcp.client.subscriptions import SubscriptionLost
    from mcp.shared.subscriptions import ToolsListChanged
    from mcp_types.version import MODERN_PROTOCOL_VERSIONS as _MODERN
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "loopengine.mcp needs the official MCP SDK: pip install 'loopengine-core[mcp]'"
    ) from error

__all__ = ["CONNECT_TIMEOUT", "MCPServer", "MCPServerError", "MCPToolError"]

logger = logging.getLogger("loopengine")

CONNECT_TIMEOUT = 30.0
"""Seconds to start (or reach) a server and open a session, by default: a
process start is slower than a call (``connect_timeout=``)."""

_REQUEST_ERRORS = frozenset({mcp_types.INVALID_PARAMS, mcp_types.METHOD_NOT_FOUND})
"""JSON-RPC error codes that blame the request, not the session it came on."""

_INVENTED: tuple[tuple[int, str, bool], ...] = (
    # An error status without a JSON-RPC body (a 502 or 504 from a gateway that
    # passed the call on and stopped waiting; the SDK does not say which status).
    (mcp_types.INTERNAL_ERROR, "Server returned an error response", True),
    # A 202: queued, or run, with no answer to come.
    (mcp_types.INVALID_REQUEST, "server answered a request with 202 Accepted", True),
    # A success status whose body is not an answer: JSON that does not parse, an
    # event stream whose message does not, a body of another type.
    (mcp_types.PARSE_ERROR, "Failed to parse JSON response: ", True),
    (mcp_types.PARSE_ERROR, "Failed to parse SSE message: ", True),
    (mcp_types.INVALID_REQUEST, "Unexpected content type: ", True),
    # A redirect it does not follow: a 303 says the request was processed (the
    # SDK does not say which status it was).
    (mcp_types.INVALID_REQUEST, "Redirect to ", True),
    # A 404 without a JSON-RPC body, on a session (the server no longer has it)
    # or on none (no such endpoint): the request was not taken.
    (mcp_types.INVALID_REQUEST, "Session terminated", False),
    (mcp_types.METHOD_NOT_FOUND, "Not Found", False),
)
"""The errors the SDK's streamable HTTP transport makes up itself when the HTTP
answer to a request it sent carried no JSON-RPC answer: each JSON-RPC code, the
message (its start, when it ends with a space: the rest names what came) and
whether the server may have run the call (its result is then not known). A
closed connection or an event stream that ended without an answer is
``CONNECTION_CLOSED``, whose result is not known either."""


def _invented(error: MCPError) -> bool | None:
    """For an error the SDK's HTTP transport made up (`_INVENTED`), whether the
    server may have run the call; None for any other error (the server's own)."""
    if error.data is not None:
        return None
    for code, message, may_have_run in _INVENTED:
        if error.code == code and (error.message == message or (
                message.endswith(" ") and error.message.startswith(message))):
            return may_have_run
    return None


class _Sent:
    """What the HTTP client (`_Connecting`) saw of the ``tools/call`` requests of
    one call (`MCPServer._call`): the SDK sends one per round of the call (a
    server asking for input, or saying it is under way, is asked again; a call
    refused for a stale tool listing is resent once)."""

    def __init__(self) -> None:
        self.unsent: list[str] = []
        """Why requests could not be sent (their connection could not be made)."""
        self.answered = False
        """Whether a request got an HTTP response: it reached the server."""

    def not_sent(self) -> bool:
        """Whether the call never reached the server: a request could not be
        sent and none got a response (a later round that cannot connect
        follows one the server may have acted on)."""
        return bool(self.unsent) and not self.answered


_SENT: ContextVar[_Sent | None] = ContextVar("loopengine_mcp_sent", default=None)
"""Set by a call (`MCPServer._call`) to the `_Sent` to which the HTTP client
(`_Connecting`) adds what became of its ``tools/call`` requests. The SDK sends
each request from a copy of its caller's context."""

_RELISTEN_WAIT = 30.0
"""The longest wait, in seconds, before opening again a stream announcing a
server's tool changes that ended without bringing one (`MCPServer._listen`)."""

_RELIST_INTERVAL = 1.0
"""The least time, in seconds, from the start of one listing of a server's
tools prompted by a change to the start of the next (`MCPServer._list_again`):
a server announcing changes without pause is listed at most once a second."""

_RETRY_LISTING = 2.0
"""Seconds after a failed listing of a server's tools before the changes it was
to read are listed again (`MCPServer._retry_at`), the first time: the wait
doubles with each listing that fails in a row, up to `_RETRY_LISTING_MAX`."""

_RETRY_LISTING_MAX = 60.0
"""The longest wait, in seconds, after a failed listing before the next."""

_IMAGE_TYPES = frozenset({"image/png", "image/jpeg", "image/gif", "image/webp"})
"""The image media types a tool result block may carry."""


# What ``approval=`` takes: one setting for every tool of the server (a bool, or
# a callable deciding per call), the names of the tools that need approval, or a
# mapping of tool name to its own setting (tools it does not name need none).
_Approval: TypeAlias = (
    "bool | Callable[[Any], bool] | Collection[str] | Mapping[str, bool | Callable[[Any], bool]]"
)
# What ``idempotent=`` takes: the same, without callables.
_Idempotent: TypeAlias = "bool | Collection[str] | Mapping[str, bool]"


class _Options(TypedDict, total=False):
    """The settings `MCPServer.stdio` and `MCPServer.http` pass on to `MCPServer`
    (each documented there, its default there too)."""

    prefix: str | None
    allow: Collection[str] | None
    timeout: float | None
    connect_timeout: float
    approval: _Approval
    idempotent: _Idempotent
    clock: Clock | None


def _settings(options: Mapping[str, object]) -> Mapping[str, Any]:
    """``options`` given to `MCPServer.stdio` or `MCPServer.http`, checked to
    name only settings of `_Options` (a misspelt one is a ConfigError naming it,
    as a provider's unknown keyword is, not a bare TypeError)."""
    for name in options:
        if name not in _Options.__optional_keys__:
            raise ConfigError(name, "is not a setting of MCPServer (known: "
                                    f"{', '.join(sorted(_Options.__optional_keys__))})")
    return options


def _per_tool(field: str, value: object, *, calls: bool) -> object:
    """Check an ``approval=`` or ``idempotent=`` setting (``calls``: a callable is a
    setting too); return it, a set of names as a frozenset, a mapping as a dict."""
    def setting(where: str, item: object) -> None:
        if isinstance(item, bool):
            return
        if calls and callable(item):
            _validate.sync_callable(where, item, "(call) -> bool")
            return
        wanted = "a bool or a callable (call) -> bool" if calls else "a bool"
        raise ConfigError(where, f"must be {wanted}, got {_validate.shown(item)}")

    if isinstance(value, bool):
        return value
    if calls and callable(value) and not isinstance(value, type):
        _validate.sync_callable(field, value, "(call) -> bool")
        return value
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ConfigError(field, f"tool names must be text, got {_validate.shown(key)}")
            setting(f"{field}[{key!r}]", item)
        return dict(value)
    if isinstance(value, str) or not isinstance(value, Collection):
        raise ConfigError(field, "must be a bool, a collection of tool names or a mapping "
                                 f"of tool name to setting, got {_validate.shown(value)}")
    for key in value:
        if not isinstance(key, str):
            raise ConfigError(field, f"tool names must be text, got {_validate.shown(key)}")
    return frozenset(value)


def _setting_for(value: object, name: str) -> Any:
    """The setting ``_per_tool`` checked, for the server's tool ``name``."""
    if isinstance(value, frozenset):
        return name in value
    if isinstance(value, dict):
        return value.get(name, False)
    return value


def _named(value: object) -> frozenset[str]:
    """The tool names an ``approval=`` or ``idempotent=`` setting names (none for one
    setting of every tool)."""
    return frozenset(value) if isinstance(value, frozenset | dict) else frozenset()


def _string_mapping(field: str, value: object) -> None:
    """Check that ``value`` is None or a mapping of text to text (an environment,
    headers), else raise `ConfigError` naming ``field``."""
    if value is None:
        return
    if not isinstance(value, Mapping):
        raise ConfigError(field, f"must be a mapping of text to text, got {_validate.shown(value)}")
    for key, item in value.items():
        if not isinstance(key, str) or not isinstance(item, str):
            raise ConfigError(f"{field}[{key!r}]", "keys and values must be text")


class _Session:
    """One connection to the server, held open by a task of the server's task group.

    Calls count themselves in ``users``; a retired session takes no new calls
    and closes when its last call ends.
    """

    def __init__(self) -> None:
        self.client: Client | None = None
        self.error: BaseException | None = None
        self.ready = anyio.Event()
        self.stop = anyio.Event()
        self.scope = anyio.CancelScope()
        self.users = 0
        self.retired = False
        self.group: anyio.abc.TaskGroup | None = None
        """Runs the session's own tasks: its change subscription, a new listing."""
        self.listening = False
        """Whether a ``subscriptions/listen`` stream brings the tool list's changes."""

    def retire(self) -> None:
        self.retired = True
        if self.users == 0:
            self.stop.set()


class MCPServer(ToolSource):
    """An MCP server's tools, as `Tool` objects for `Engine.run`.

    Build one with `MCPServer.stdio` or `MCPServer.http`; ``async with
    server:`` connects and lists the tools, and `tools` holds them until the
    block ends (which closes the connection, or stops the process). A tool's
    name, description and input schema are the server's own; calls go to the
    server under its session, shared by every run that uses the tools.

    Args:
        transport: A function returning a new MCP transport (the SDK's
            ``(read, write)`` stream pair as an async context manager) each
            time a session is opened.
        label: How errors and logs name the server.
        prefix: Put before every tool name (two servers with one tool name).
        allow: Only these of the server's tool names become tools (None: all).
            Each must be one of the server's at ``async with``; later, one the
            server drops is not offered, one it lists again is, and one it
            adds that ``allow`` does not name is not given.
        timeout: Seconds each call may take (the tools' ``timeout``).
        connect_timeout: Seconds to start or reach the server and open a
            session (at ``async with``, and when a call opens a new one: that
            call's own timeout still bounds it), and to list its tools.
        approval: Which calls need a person's approval before they run (the
            tools' ``approval``, docs/pause-and-resume.md): True or False for
            every tool, a callable ``(call) -> bool`` deciding per call, the
            server's names of the tools that need it, or a mapping of those
            names to True, False or a callable.
        idempotent: Which tools may run twice without harm (the tools'
            ``idempotent``): True or False for every tool, the names of the
            idempotent ones, or a mapping of name to bool.
        clock: The clock the server's own time passes on: its waits (before
            a listen stream that ended is opened again, and between listings
            of a tool list that keeps changing) and ``connect_timeout`` (a
            cancel scope from `Clock.cancel_scope`), as the tools' ``timeout``
            is on the engine's clock. Default the system's (anyio's time: on
            trio, trio's clock); `loopengine.testing.FakeClock` makes the
            waits instant in tests, and on it ``connect_timeout`` never
            expires by itself, as no timeout does.
    """

    def __init__(
        self,
        transport: Callable[[], AbstractAsyncContextManager[Any]],
        *,
        label: str,
        prefix: str | None = None,
        allow: Collection[str] | None = None,
        timeout: float | None = None,
        connect_timeout: float = CONNECT_TIMEOUT,
        approval: _Approval = False,
        idempotent: _Idempotent = False,
        clock: Clock | None = None,
    ) -> None:
        _validate.seconds("timeout", timeout, optional=True)
        self.approval: object = _per_tool("approval", approval, calls=True)
        """Which calls need approval (see `MCPServer`)."""
        self.idempotent: object = _per_tool("idempotent", idempotent, calls=False)
        """Which tools are idempotent (see `MCPServer`)."""
        _validate.seconds("connect_timeout", connect_timeout)
        _validate.clock("clock", clock)
        if not callable(transport):
            raise ConfigError("transport", "must be a function returning an MCP transport, "
                                           f"got {_validate.shown(transport)}")
        _validate.text("label", label)
        if prefix is not None and not isinstance(prefix, str):
            raise ConfigError("prefix", f"must be a string, got {_validate.shown(prefix)}")
        if prefix:
            # It starts every tool name: refused here, before a server is started.
            check_tool_name("prefix", prefix)
        if isinstance(allow, str):
            raise ConfigError("allow", "must be a collection of tool names, not one string")
        if allow is not None:
            for i, allowed in enumerate(_validate.items("allow", allow)):
                _validate.text(f"allow[{i}]", allowed)
        self._transport = transport
        self.label = label
        """How errors and logs name the server (its command or URL)."""
        self.prefix = prefix or ""
        """Put before every tool name."""
        self.allow: frozenset[str] | None = None if allow is None else frozenset(allow)
        """The server's tool names to give as tools (None: all)."""
        self.timeout = None if timeout is None else float(timeout)
        """Seconds each call may take (None: only the run's deadline)."""
        self.connect_timeout = float(connect_timeout)
        """Seconds to start or reach the server and open a session."""
        self._clock: Clock = clock or SystemClock()
        self._tools: tuple[Tool, ...] | None = None
        self._group: anyio.abc.TaskGroup | None = None
        self._session: _Session | None = None
        self._sessions: set[_Session] = set()
        """Every session not yet closed: the current one and retired ones still in use."""
        self._lock = anyio.Lock()
        self._listing: anyio.Event | None = None
        """Set when a listing ends, while the tools are being listed again."""
        self._heard = 0
        """Changes heard of so far."""
        self._read = 0
        """Changes heard of before the last listing (done or failed) began: while
        fewer than `_heard`, a change waits to be listed."""
        self._listed_at = -math.inf
        """When (on the clock) the last listing prompted by a change began."""
        self._retry_at: float | None = None
        """When (on the clock) the tools may be listed again after the last
        listing failed (None: it did not fail)."""
        self._retry_wait = 0.0
        """The wait after the last failed listing (`_RETRY_LISTING`, doubling)."""
        self._opened = 0
        """Sessions opened so far: a new one after the first lists the tools again."""

    @classmethod
    def stdio(
        cls,
        command: str,
        args: Sequence[str] = (),
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        **options: Unpack[_Options],
    ) -> MCPServer:
        """A server the SDK starts as a subprocess and talks to over its stdin/stdout.

        Args:
            command: The executable.
            args: Its arguments.
            env: Environment variables, over the SDK's safe defaults (``PATH``,
                ``HOME``...): the server does not inherit the whole environment.
            cwd: Its working directory.
            **options: The server's settings, as `MCPServer` takes them
                (``prefix``, ``allow``, ``timeout``, ``connect_timeout``,
                ``approval``, ``idempotent``, ``clock``).
        """
        _validate.text("command", command)
        if isinstance(args, str) or not isinstance(args, Sequence):
            raise ConfigError("args", "must be a sequence of arguments, not "
                                      f"{_validate.shown(args)}")
        for n, arg in enumerate(args):
            _validate.text(f"args[{n}]", arg)
        _string_mapping("env", env)
        if cwd is not None and not isinstance(cwd, str | Path):
            raise ConfigError("cwd", f"must be a path, got {_validate.shown(cwd)}")
        parameters = StdioServerParameters(
            command=command, args=list(args), env=None if env is None else dict(env), cwd=cwd)

        def transport() -> AbstractAsyncContextManager[Any]:
            return stdio_client(parameters)

        return cls(transport, label=" ".join([command, *args]), **_settings(options))

    @classmethod
    def http(
        cls,
        url: str,
        *,
        headers: Mapping[str, str] | None = None,
        **options: Unpack[_Options],
    ) -> MCPServer:
        """A server reached over streamable HTTP at ``url`` (e.g. ``http://host/mcp``).

        Args:
            url: The server's MCP endpoint.
            headers: Sent with every request (an ``Authorization`` header...).
            **options: The server's settings, as `MCPServer` takes them
                (``prefix``, ``allow``, ``timeout``, ``connect_timeout``,
                ``approval``, ``idempotent``, ``clock``).
        """
        _validate.text("url", url)
        if not url.startswith(("http://", "https://")):
            raise ConfigError("url", f"must be an http:// or https:// URL, got {url!r}")
        _string_mapping("headers", headers)
        fixed = dict(headers or {})

        def transport() -> AbstractAsyncContextManager[Any]:
            return _http_transport(url, fixed)

        return cls(transport, label=url, **_settings(options))

    def __repr__(self) -> str:
        return f"MCPServer({self.label!r})"

    @property
    def tools(self) -> tuple[Tool, ...]:
        """The server's tools (inside ``async with server:``), as last listed: a
        server that announces changes to its tool list is listed again when it
        says it changed (and when a new session is opened)."""
        if self._tools is None:
            raise RuntimeError(f"{self!r}: use the tools inside `async with server:`")
        return self._tools

    async def current_tools(self) -> tuple[Tool, ...]:
        """The server's tools now: when the server said its tools changed and they
        are being listed again, waits for that (at most ``connect_timeout``;
        past it, or when the listing fails, the tools as last listed).

        After a listing failed, until one succeeds: the tools as last listed,
        at once; the changes still unread are listed again by the first
        reading once a wait has passed since the failure (`_RETRY_LISTING`,
        doubling with each failure in a row up to `_RETRY_LISTING_MAX`, on the
        server's clock), which does not wait for that listing either."""
        # Only the changes heard of so far: a server announcing changes without
        # end must not hold a run for longer than two listings (and the wait
        # between them).
        wanted = self._heard
        session = self._session
        if self._retry_at is not None:
            if self._read < wanted and session is not None and self._tools is not None \
                    and self._clock.now() >= self._retry_at:
                self._relist(session)  # a change whose listing failed is still unread
            return self.tools
        with self._clock.cancel_scope(self.connect_timeout):
            while self._read < wanted and self._listing is not None:
                await self._listing.wait()
        return self.tools

    def offers(self, name: str) -> bool:
        """Whether a tool of this name (with the prefix) may be one of the server's."""
        if not name.startswith(self.prefix):
            return False
        return self.allow is None or name[len(self.prefix):] in self.allow

    # -- lifetime -----------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        """Connect, list the server's tools and build `tools`.

        Raises:
            MCPServerError: the server did not start or answer within
                ``connect_timeout``, or did not list its tools.
            ConfigError: a listed tool's name (with the prefix) is not a valid
                tool name, or ``allow``, ``approval`` or ``idempotent`` names a
                tool the server does not have.
        """
        if self._group is not None:
            raise RuntimeError(f"{self!r} is already open")
        group = anyio.create_task_group()
        await group.__aenter__()
        self._group = group
        try:
            try:
                session = await self._current()
                assert session.client is not None
                heard = self._heard
                with self._listing_bounded():
                    listed = await _list_tools(session.client)
            except Exception as error:
                raise MCPServerError(f"MCP server {self.label} did not start or list its "
                                     f"tools: {_describe(error)}") from error
            self._tools = self._build_tools(listed)
            self._read = heard
            if self._heard > heard:
                # Heard of during the listing (or a listen stream began, which
                # replays nothing): its answer may predate them.
                self._tools_changed(session)
        except BaseException:
            await self._close()
            raise
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Close the session (stop the server's process) and forget the tools."""
        await self._close()

    async def _close(self) -> None:
        group, self._group, self._tools = self._group, None, None
        self._session = None
        self._opened = 0  # a later `async with` starts afresh
        if group is None:
            return
        for session in self._sessions:
            session.stop.set()
        # The caller's exception is not the group's: its tasks end on their
        # own once stopped (or by the caller's cancellation, which reaches them).
        try:
            await group.__aexit__(None, None, None)
        finally:
            self._read = self._heard  # a later `async with` lists every tool

    def _start(self) -> _Session:
        """A new session, connecting in the server's task group."""
        assert self._group is not None
        session = _Session()
        self._session = session
        self._retry_at, self._retry_wait = None, 0.0  # a new session lists at once
        self._sessions.add(session)
        self._group.start_soon(self._hold, session)
        return session

    @contextmanager
    def _listing_bounded(self) -> Iterator[None]:
        """Bound a listing of the tools by ``connect_timeout`` on the server's
        clock; past it, raise `TimeoutError` saying so."""
        with self._clock.cancel_scope(self.connect_timeout) as scope:
            yield
        if scope.cancelled_caught:
            raise TimeoutError(f"listing the tools took longer than {self.connect_timeout:g}s")

    async def _connected(self, session: _Session) -> None:
        """Wait until ``session`` is connected; raise what connecting raised."""
        seconds = self.connect_timeout
        # The wait is bounded here, not in the holding task: a scope around
        # entering the client would have to close before the client's own.
        with self._clock.cancel_scope(seconds):
            await session.ready.wait()
        if not session.ready.is_set():
            session.error = TimeoutError(f"did not connect within {seconds:g}s")
            session.scope.cancel()
            session.retire()
        if session.error is not None:
            raise session.error

    async def _hold(self, session: _Session) -> None:
        """Hold one session open until it is stopped (runs in the server's task group)."""

        async def heard(message: object) -> None:
            # A handshake-era server announces a change on the session itself;
            # a 2026 one on the listen stream (`_listen`), teed here too.
            if isinstance(message, mcp_types.ToolListChangedNotification) \
                    and not session.listening:
                self._tools_changed(session)

        try:
            with session.scope:
                async with Client(self._transport(), cache=None,
                                  message_handler=heard) as client, \
                        anyio.create_task_group() as group:
                    session.client, session.group = client, group
                    if _announces_changes(client):
                        # Not waited for: a server that never acknowledges the
                        # subscription must not keep its tools from being used.
                        group.start_soon(self._listen, session, client)
                    try:
                        session.ready.set()
                        self._opened += 1
                        if self._opened > 1:
                            self._tools_changed(session)  # a new process may have others
                        await session.stop.wait()
                        group.cancel_scope.cancel()
                    finally:
                        session.group = None  # it starts no more tasks
        except Exception as error:
            # Never let a failing connection reach the task group: it would
            # cancel the caller's `async with server:` block.
            if not session.ready.is_set():
                session.error = error
            else:
                # Usually a server already gone: nothing is left to do.
                logger.info("MCP server %s: closing its session failed: %s", self.label,
                            _describe(error))
        finally:
            self._sessions.discard(session)
            session.retired = True
            if session.error is None and session.client is None:
                session.error = MCPServerError("the connection was cancelled")
            session.ready.set()

    async def _listen(self, session: _Session, client: Client) -> None:
        """Hear of the tool list's changes on a ``subscriptions/listen`` stream (the
        2026 protocol), until the session ends. A stream that ends (the server
        closed it, or it was lost: an idle HTTP stream reaches its read
        timeout) is opened again, at once the first time, then after a wait on
        the server's clock that grows while streams end without bringing a
        change (1 s, doubling, at most `_RELISTEN_WAIT`)."""
        wait = 0.0
        while True:
            try:
                async with client.listen(tools_list_changed=True) as subscription:
                    if not subscription.honored.tools_list_changed:
                        logger.info("MCP server %s: it does not announce its tool list's "
                                    "changes on a listen stream", self.label)
                        return
                    session.listening = True
                    # A change before this stream began is not replayed: the
                    # tools are listed again (after the first listing, when it
                    # is under way).
                    self._tools_changed(session)
                    async for event in subscription:
                        wait = 0.0
                        if isinstance(event, ToolsListChanged):
                            self._tools_changed(session)
                ended = "it was closed"
            except SubscriptionLost as error:
                ended = _describe(error)
            except Exception as error:
                logger.info("MCP server %s: its tool list's changes are not heard of: %s",
                            self.label, _describe(error))
                return
            finally:
                session.listening = False
            logger.debug("MCP server %s: the stream announcing its tool changes ended (%s); "
                         "listening again", self.label, ended)
            await self._clock.sleep(wait)
            wait = min(max(2 * wait, 1.0), _RELISTEN_WAIT)

    def _tools_changed(self, session: _Session) -> None:
        """The server said its tools changed: list them again (one listing at a
        time, the first one at ``async with`` included; the changes heard of
        during one are read by one more)."""
        if session is not self._session or session.group is None or self._group is None:
            return  # an old session's news: the current one's listing counts
        self._heard += 1
        if self._tools is None:
            return  # the first listing is under way: `__aenter__` lists again after it
        self._relist(session)

    def _relist(self, session: _Session) -> None:
        """Start listing the tools again on ``session`` (`_list_again`), unless a
        listing is under way or the session has ended."""
        if self._listing is None and session.group is not None:
            self._listing = anyio.Event()
            session.group.start_soon(self._list_again, session)

    async def _list_again(self, session: _Session) -> None:
        """List the tools again while a change waits to be read, each listing at
        least `_RELIST_INTERVAL` after the last began (the changes heard of
        meanwhile are all read by the next); a listing that fails keeps the
        tools as they were and leaves the changes unread, for the next change
        (listed once `_retry_at` has passed), session or reading of the tools
        (`current_tools`, once `_retry_at` has passed) to list again."""
        try:
            while self._read < self._heard and session is self._session:
                # After a failed listing, none before its wait has passed.
                wait = max(self._listed_at + _RELIST_INTERVAL,
                           -math.inf if self._retry_at is None else self._retry_at) \
                    - self._clock.now()
                if wait > 0:
                    await self._clock.sleep(wait)
                    continue  # the session may have been replaced meanwhile
                self._listed_at = self._clock.now()
                heard = self._heard
                assert session.client is not None
                try:
                    with self._listing_bounded():
                        listed = await _list_tools(session.client)
                except Exception as error:
                    if session is not self._session:
                        # The session died under its listing: the new one lists
                        # at once (below), with no wait for this failure.
                        continue
                    self._retry_wait = min(max(2 * self._retry_wait, _RETRY_LISTING),
                                           _RETRY_LISTING_MAX)
                    self._retry_at = self._clock.now() + self._retry_wait
                    logger.warning("MCP server %s: its tools changed, but listing them "
                                   "again failed (%s); they stay as they were until a "
                                   "listing succeeds (tried again in %gs at the "
                                   "earliest)", self.label, _describe(error),
                                   self._retry_wait)
                    return  # unread still: waiters go on with the tools as they were
                self._retry_at, self._retry_wait = None, 0.0
                if self._group is not None:
                    before = [t.definition for t in self._tools or ()]
                    self._tools = self._build_tools(listed, strict=False)
                    if [t.definition for t in self._tools] != before:
                        logger.info("MCP server %s: its tools are now %s", self.label,
                                    ", ".join(t.name for t in self._tools) or "none")
                # Waiters for the changes this listing read go on.
                self._read = heard
                ended, self._listing = self._listing, anyio.Event()
                if ended is not None:
                    ended.set()
        finally:
            listing, self._listing = self._listing, None
            if listing is not None:
                listing.set()
            if self._read < self._heard and self._session is not None \
                    and self._session is not session:
                self._tools_changed(self._session)  # heard of on the session that replaced it

    async def _current(self) -> _Session:
        """The session a call should use, connected; a new one if the last was lost."""
        session = self._session
        if session is None or session.retired:
            async with self._lock:
                if self._group is None:
                    raise MCPServerError("it is closed")
                session = self._session
                if session is None or session.retired:
                    if session is not None:
                        logger.info("MCP server %s: opening a new session", self.label)
                    session = self._start()
        await self._connected(session)
        return session

    # -- tools --------------------------------------------------------------------------

    def _build_tools(self, listed: Sequence[mcp_types.Tool], *,
                     strict: bool = True) -> tuple[Tool, ...]:
        """The listed tools as `Tool` objects. ``strict`` (the first listing, at
        ``async with``): a setting naming a tool the server lacks, or a tool
        that cannot be one, is a `ConfigError`. In a later listing (the tools
        changed) a setting may name a tool the server dropped: that tool is
        simply not given; a tool that cannot be one is left out, said in the
        log. A run using the tools goes on."""
        names = {item.name for item in listed}
        for field, named in (("allow", self.allow or frozenset()),
                             ("approval", _named(self.approval)),
                             ("idempotent", _named(self.idempotent))):
            if strict and not named <= names:
                missing = ", ".join(sorted(named - names))
                raise ConfigError(field, f"MCP server {self.label} has no tool {missing} "
                                         f"(it has: {', '.join(sorted(names)) or 'none'})")
        tools: dict[str, Tool] = {}
        # A tool listed again unchanged stays the same object (built, and warned
        # about, once).
        kept = {} if strict or self._tools is None else {t.name: t for t in self._tools}
        for item in listed:
            if self.allow is not None and item.name not in self.allow:
                continue
            name = self.prefix + item.name
            try:
                if name in tools:
                    raise ConfigError("name", f"the server lists two tools named {item.name!r}")
                same = kept.get(name)
                if same is not None and same.description == (item.description or "") \
                        and same.input_schema == item.input_schema:
                    tools[name] = same
                    continue
                tools[name] = Tool(name, item.description or "", dict(item.input_schema),
                                   self._handler(item.name), timeout=self.timeout,
                                   approval=_setting_for(self.approval, item.name),
                                   idempotent=_setting_for(self.idempotent, item.name))
            except ConfigError as error:
                if strict:
                    raise ConfigError(error.field, f"MCP server {self.label}, tool "
                                      f"{item.name!r}: {error}; leave it out with allow=") \
                        from None
                logger.warning("MCP server %s: its tool %r is left out: %s", self.label,
                               item.name, error)
        return tuple(tools.values())

    def _handler(self, name: str) -> Callable[[dict[str, Any]], Any]:
        async def call(arguments: dict[str, Any]) -> str | list[dict[str, Any]]:
            return await self._call(name, arguments)

        call.__name__ = name
        call.__qualname__ = f"MCPServer.{name}"
        return call

    async def _call(self, name: str, arguments: dict[str, Any]) -> str | list[dict[str, Any]]:
        try:
            session = await self._current()
        except Exception as error:
            raise MCPServerError(
                f"the MCP server could not be reached: {_describe(error)}") from error
        assert session.client is not None
        session.users += 1
        kept = False
        sent = _Sent()
        token = _SENT.set(sent)
        try:
            result = await session.client.call_tool(name, arguments)
            kept = True
        except MCPError as error:
            if error.code == mcp_types.CONNECTION_CLOSED and sent.not_sent():
                # The transport ended because this call's request could not connect.
                raise _not_sent(sent.unsent) from error
            if error.code == mcp_types.CONNECTION_CLOSED:
                raise MCPServerError("the MCP server closed the connection during the call; "
                                     "the result is not known", result_unknown=True) from error
            # An error about the request itself leaves the session sound; any
            # other (an internal error, a terminated session) may not have.
            kept = error.code in _REQUEST_ERRORS
            invented = _invented(error)
            if invented is True:
                raise MCPServerError(f"the MCP server's HTTP answer held no result "
                                     f"({_shown(error)}); the result is not known",
                                     result_unknown=True) from error
            if invented is False:
                raise MCPServerError(f"the MCP server's HTTP answer was 404 "
                                     f"({error.message}); the call did not run") from error
            raise MCPToolError(f"{name}: {error.message}") from error
        except InputRequiredRoundsExceededError as error:
            # The server answered each round that the call was under way (only a
            # request state, to ask again with): it may yet finish it.
            kept = True
            raise MCPServerError("the MCP server was still working on the call when its "
                                 "client stopped asking; the result is not known",
                                 result_unknown=True) from error
        except RuntimeError as error:
            # The SDK's check of the result it received against the tool's output
            # schema: the call ran once and was answered, the session is sound.
            kept = True
            raise MCPToolError(f"{name}: its result was refused: {error}") from error
        except pydantic.ValidationError as error:
            # An answer the protocol's types refuse (content missing its text...):
            # the call ran once and was answered, on a sound session; it is a
            # failed call, not one whose result is not known.
            kept = True
            first = error.errors()[0] if error.error_count() else None
            where = "" if first is None else \
                f" ({'.'.join(str(part) for part in first['loc'])}: {first['msg']})"
            raise MCPToolError(f"{name}: its result was refused: it is not a valid MCP "
                               f"tool result{where}") from error
        except Exception as error:
            if sent.not_sent():
                raise _not_sent(sent.unsent) from error
            raise MCPServerError(f"the MCP server failed during the call ({_describe(error)}); "
                                 "the result is not known", result_unknown=True) from error
        finally:
            _SENT.reset(token)
            session.users -= 1
            if not kept:
                # Lost, or cancelled before an answer (a hung server looks the
                # same from here): the next call opens a new session.
                session.retire()
            elif session.retired and session.users == 0:
                session.stop.set()
        if result.is_error:
            raise MCPToolError(_result_text(result) or f"{name} failed")
        return _content(result)


@asynccontextmanager
async def _http_transport(url: str, headers: dict[str, str]) -> AsyncIterator[Any]:
    """The SDK's streamable HTTP transport on an HTTP client with ``headers``."""
    # The SDK's own defaults: 30 s to connect or write, 300 s to read a stream.
    timeout = httpx2.Timeout(30.0, read=300.0)
    async with httpx2.AsyncClient(headers=headers, timeout=timeout,
                                  transport=_Connecting(httpx2.AsyncHTTPTransport())) as http, \
            streamable_http_client(url, http_client=http) as streams:
        yield streams


class _Connecting(httpx2.AsyncBaseTransport):
    """The HTTP client's own transport (as the client would build it), noting
    for the call that sent it (`_SENT`) a ``tools/call`` request whose
    connection could not be made (it never reached the server) and one that
    got a response (it did)."""

    def __init__(self, inner: httpx2.AsyncBaseTransport) -> None:
        self._inner = inner

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        sent = _SENT.get()
        try:
            response = await self._inner.handle_async_request(request)
        except (httpx2.ConnectError, httpx2.ConnectTimeout) as error:
            if sent is not None and _calls_a_tool(request):
                sent.unsent.append(str(error) or type(error).__name__)
            raise
        if sent is not None and _calls_a_tool(request) and 200 <= response.status_code < 300:
            # Taken: a refusal (a 400 for a header mismatch, which the SDK sends
            # again) ran nothing; an error after the server acted comes in a
            # 2xx body (JSON-RPC) or as an error status the call reads as in doubt.
            sent.answered = True
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


def _not_sent(unsent: list[str]) -> MCPServerError:
    """The error of a call that never reached the server (`_Sent.not_sent`): it failed."""
    return MCPServerError(f"the MCP server could not be reached ({unsent[0]}); "
                          "the call was not sent")


def _calls_a_tool(request: httpx2.Request) -> bool:
    """Whether ``request`` carries a JSON-RPC ``tools/call`` request."""
    try:
        message = json.loads(request.content)
    except (ValueError, httpx2.RequestNotRead):
        return False
    return isinstance(message, dict) and message.get("method") == "tools/call"


def _announces_changes(client: Client) -> bool:
    """Whether the server says it announces changes to its tool list and the
    session hears of them on a ``subscriptions/listen`` stream (the 2026
    protocol; a handshake-era server sends them on the session unasked)."""
    tools = client.server_capabilities.tools
    return bool(tools is not None and tools.list_changed
                and client.protocol_version in _MODERN)


async def _list_tools(client: Client) -> list[mcp_types.Tool]:
    """Every page of the server's tool listing."""
    tools: list[mcp_types.Tool] = []
    cursor: str | None = None
    while True:
        page = await client.list_tools(cursor=cursor)
        tools.extend(page.tools)
        cursor = page.next_cursor
        if cursor is None:
            return tools


def _shown(error: MCPError) -> str:
    """An error the SDK made up, for the model: a parse error without the
    parser's own account of the body (lines of it), any other's first line."""
    if error.code == mcp_types.PARSE_ERROR:
        return error.message.split(":", 1)[0]
    return error.message.strip().split("\n", 1)[0]


def _describe(error: BaseException) -> str:
    """The error's message; a task group's one error rather than the group."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return str(error) or type(error).__name__


def _content(result: mcp_types.CallToolResult) -> str | list[dict[str, Any]]:
    """An MCP tool result as tool-result content: one text, or Anthropic blocks."""
    blocks = [_block(item) for item in result.content]
    # The protocol asks a server to mirror its structured content in a text
    # block; only when the content is empty is the structured value all there is.
    if not blocks and result.structured_content is not None:
        blocks.append({"type": "text", "text": json.dumps(
            result.structured_content, ensure_ascii=False, default=str)})
    if not blocks:
        return ""
    if len(blocks) == 1 and blocks[0]["type"] == "text":
        return str(blocks[0]["text"])
    return blocks


def _result_text(result: mcp_types.CallToolResult) -> str:
    content = _content(result)
    if isinstance(content, str):
        return content
    return "\n\n".join(str(b["text"]) if b["type"] == "text" else f"[{b['type']}]"
                       for b in content)


def _block(item: Any) -> dict[str, Any]:
    """One MCP content item as an Anthropic content block."""
    if isinstance(item, mcp_types.TextContent):
        return {"type": "text", "text": item.text}
    # Binary data that is not base64 would make the API refuse the whole next
    # request: the model reads a note in its place.
    if isinstance(item, mcp_types.ImageContent):
        if item.mime_type in _IMAGE_TYPES and _validate.decoded_size(item.data) is not None:
            return {"type": "image", "source": {"type": "base64", "media_type": item.mime_type,
                                                "data": item.data}}
        return _binary_note("image", item.mime_type, item.data)
    if isinstance(item, mcp_types.AudioContent):
        return _binary_note("audio", item.mime_type, item.data)
    if isinstance(item, mcp_types.ResourceLink):
        described = f": {item.description}" if item.description else ""
        return {"type": "text", "text": f"[resource link {item.uri} ({item.name}){described}]"}
    if isinstance(item, mcp_types.EmbeddedResource):
        resource = item.resource
        if isinstance(resource, mcp_types.TextResourceContents):
            return {"type": "text", "text": resource.text}
        mime = resource.mime_type or "application/octet-stream"
        if _validate.decoded_size(resource.blob) is None:
            return _binary_note(f"resource {resource.uri}", mime, resource.blob)
        if mime in _IMAGE_TYPES:
            return {"type": "image", "source": {"type": "base64", "media_type": mime,
                                                "data": resource.blob}}
        if mime == "application/pdf":
            return {"type": "document", "source": {"type": "base64", "media_type": mime,
                                                   "data": resource.blob}}
        return _binary_note(f"resource {resource.uri}", mime, resource.blob)
    return {"type": "text", "text": f"[{getattr(item, 'type', type(item).__name__)} content]"}


def _binary_note(what: str, mime: str, data: str) -> dict[str, Any]:
    """A text block standing for binary content a tool result cannot carry."""
    return {"type": "text", "text": _validate.binary_note(what, mime, data)}
