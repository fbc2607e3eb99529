"""The test that a route's check before the wire (`Provider.check_request`) and its
translation refuse alike: the same transcripts, with the same fault."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from loopengine.providers import ProviderFault
from loopengine.providers._base import ProviderRequest
from loopengine.providers._faults import FaultKind

Shapes = Sequence[tuple[list[dict[str, Any]], bool]]
"""Transcripts, each with whether the route refuses it."""


def refused_alike(check: Callable[[ProviderRequest], None],
                  translate: Callable[[list[dict[str, Any]]], object], shapes: Shapes) -> None:
    """Each transcript is refused by both ``check`` (given it as a request) and
    ``translate`` (given its messages), with the same message, or by neither,
    as its flag says; the check's refusal is ``bad_request`` ``untranslatable``."""
    for messages, refused in shapes:
        try:
            translate(messages)
            translated = None
        except ProviderFault as fault:
            translated = fault.message
        try:
            check(ProviderRequest(model="m", max_tokens=1, messages=messages))
            checked = None
        except ProviderFault as fault:
            assert (fault.kind, fault.error_code) == (FaultKind.BAD_REQUEST, "untranslatable")
            checked = fault.message
        assert checked == translated, messages
        assert (checked is not None) == refused, messages
