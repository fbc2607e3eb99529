"""`Attribution`: who a run is for, recorded with its invocation."""

from __future__ import annotations

from dataclasses import dataclass

from loopengine import _validate

__all__ = ["Attribution"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Attribution:
    """Who and what a run is accounted to. Every field is optional.

    These are identifiers, not content: they are stored in the ledger, so
    they must not carry personal data beyond an opaque id.
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
            _validate.text(name, getattr(self, name), optional=True)
