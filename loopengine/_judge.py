"""The consumer's verdict on a final answer: `Accept` or `Reject` (R10, R14)."""

from __future__ import annotations

from dataclasses import dataclass

from loopengine import _validate
from loopengine._errors import ConfigError

__all__ = ["Accept", "Reject", "Verdict"]


@dataclass(frozen=True, slots=True)
class Accept:
    """The answer is accepted: the run ends ``completed`` at once (R14)."""


@dataclass(frozen=True, slots=True)
class Reject:
    """The answer is rejected; ``feedback`` goes back to the model for repair (R10).

    The feedback is shown to the model, so it must be fit to disclose to it.
    """

    feedback: str
    """What to tell the model about why the answer was not accepted."""

    def __post_init__(self) -> None:
        if not isinstance(self.feedback, str) or not self.feedback.strip():
            raise ConfigError("feedback", "a rejection needs non-empty feedback for the model")
        # It goes to the model in the next request: refused here if JSON cannot
        # carry it, so that request can be sent (a judge that raises rejects).
        _validate.json_copy("feedback", self.feedback)


Verdict = Accept | Reject | bool
"""What an ``accept`` judge may return; ``True`` is `Accept`, ``False`` a generic `Reject`."""

DEFAULT_REJECTION = "The answer was not accepted. Check it against the instructions and try again."
