"""`Attribution`: who a run is for, recorded with its invocation."""

from __future__ import annotations

from dataclasses import dataclass

from loopengine import _validate

__all__ = ["Attribution"]

MAX_LENGTH = 256
"""The most characters an attribution field may hold."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Attribution:
    """Who and what a run is accounted to. Every field is optional.

    These are identifiers, not content: they are stored in the ledger, so
    they must not carry personal data beyond an opaque id. Each is a
    printable string (no control, format or separator characters; see
    `loopengine._validate.identifier`) of at most 256 characters, so a stored
    value can neither drive the terminal of an auditor who prints it nor grow
    the ledger without bound.

    Raises:
        ConfigError: a field is not a string, is blank, longer than 256
            characters or not printable; ``.field`` names it, e.g.
            ``"attribution.correlation_id"``.
    """

    tenant: str | None = None
    """The customer account."""
    user_id: str | None = None
    """The (opaque) end-user id."""
    feature: str | None = None
    """The product feature making the run."""
    correlation_id: str | None = None
    """An id joining the run to the caller's own request or trace."""

    def __post_init__(self) -> None:
        for name in ("tenant", "user_id", "feature", "correlation_id"):
            _validate.identifier(f"attribution.{name}", getattr(self, name),
                                 max_length=MAX_LENGTH)
