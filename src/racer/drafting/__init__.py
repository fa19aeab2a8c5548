"""Draft methods: pure Python and numpy, never torch; they see token ids and top-k ids only.

Methods are named by specs ``name:key=value:key=value``. ``capacity`` is read here, for
every method, and never by a drafter: ``auto`` lets the draft budget choose how much
of each candidate tree to verify, a number fixes the verified tree's size.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

from racer.drafting.base import Drafter, Needs, NoDrafter
from racer.drafting.logitspec import LogitSpecDrafter
from racer.drafting.pld import PromptLookupDrafter
from racer.drafting.racer import RacerDrafter
from racer.drafting.rest import RestDrafter
from racer.drafting.token_recycling import TokenRecyclingDrafter
from racer.drafting.tree import DraftTree, TreeBuilder

METHODS: dict[str, tuple[Callable[..., Drafter], str]] = {
    "racer": (RacerDrafter, "RACER: Aho-Corasick retrieval of seen n-grams + copy-logit tree, merged"),
    "none": (NoDrafter, "plain autoregressive decoding through the same loop"),
    "pld": (PromptLookupDrafter, "prompt lookup: n-gram match in the context, one chain (variant=original|hf)"),
    "token-recycling": (TokenRecyclingDrafter, "Token Recycling: vocab x 8 table of verified top-8, static 81-node tree"),
    "logitspec": (LogitSpecDrafter, "LogitSpec: last logits guess the next-next token; context n-gram retrieval"),
    "rest": (RestDrafter, "REST: suffix-array retrieval from a datastore (racer datastore build)"),
}

Capacity = Any  # "auto" or a node count (int), root included


def parse_capacity(value: Any) -> Capacity:
    """``capacity``: "auto" or a node count of at least 1, root included."""
    if value == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"capacity: expected 'auto' or a node count of at least 1, got {value!r}")
    return value


@dataclass(frozen=True)
class Method:
    """A drafter and how much of its trees to verify: ``capacity`` "auto" (the draft
    budget chooses each step among ``drafter.candidates`` proposed nodes) or a fixed
    node count."""

    drafter: Drafter
    capacity: Capacity

    @staticmethod
    def of(drafter: Drafter, capacity: Capacity | None = None) -> "Method":
        """``drafter`` with ``capacity``, or with its own default when None."""
        if not isinstance(drafter, Drafter):
            raise ValueError(f"method: expected a method name or a Drafter, got {type(drafter).__name__}")
        if capacity is None:
            capacity = drafter.default_capacity or drafter.candidates
        return Method(drafter, parse_capacity(capacity))

    @property
    def auto(self) -> bool:
        return self.capacity == "auto"

    @property
    def drafts(self) -> bool:
        """Whether any tree of more than the root can be verified."""
        return min(self.drafter.candidates, self.draft_size) > 1

    @property
    def draft_size(self) -> int:
        """Nodes asked of the drafter each step (before the room left in the context)."""
        return self.drafter.candidates if self.auto else self.capacity

    def describe(self) -> dict:
        described = self.drafter.describe()
        return {"method": described.pop("method"), "capacity": self.capacity, **described}


def _parse_value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _option_value(method: str, key: str, text: str, default: Any) -> Any:
    """An option's value read as its default's kind: an integer option takes an
    integer, a boolean one true or false; others (text, or None by default) as written."""
    value = _parse_value(text)
    kinds = {bool: ("true or false", (bool,)), int: ("an integer", (int,)), float: ("a number", (int, float))}
    if key != "capacity" and type(default) in kinds:
        expected, allowed = kinds[type(default)]
        if isinstance(value, bool) != (type(default) is bool) or not isinstance(value, allowed):
            raise ValueError(f"method {method}: {key}: expected {expected}, got {text!r}")
    return value


def method_options(name: str) -> dict[str, Any]:
    """Options a method takes, with their defaults (``capacity`` first; None: every
    node the method drafts)."""
    factory = METHODS[name][0]
    options = {p.name: p.default for p in inspect.signature(factory).parameters.values()
               if p.default is not inspect.Parameter.empty}
    return {"capacity": factory.default_capacity, **options}


def parse_method(spec: str, capacity: Capacity | None = None) -> Method:
    """The method a spec ``name[:key=value...]`` names, e.g. ``racer:capacity=16``;
    ``capacity``, if given, where the spec names none."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"method: expected a method name such as {', '.join(METHODS)}, got {spec!r}")
    name, *parts = spec.split(":")
    if name not in METHODS:
        raise ValueError(f"method: expected one of {', '.join(METHODS)}, got {name!r}")
    allowed = method_options(name)
    options: dict[str, Any] = {}
    for part in parts:
        key, sep, value = part.partition("=")
        key = key.replace("-", "_")
        if not sep or key not in allowed:
            raise ValueError(f"method {name}: option {part!r} is not key=value with key in {', '.join(allowed)}")
        options[key] = _option_value(name, key, value, allowed[key])
    if "capacity" in options:
        if capacity is not None:
            raise ValueError(f"capacity: given twice, in method {spec!r} and as capacity={capacity!r}")
        capacity = options.pop("capacity")
    if capacity is not None:
        try:
            capacity = parse_capacity(capacity)
        except ValueError as err:
            raise ValueError(f"method {name}: {err}") from None
    try:
        drafter = METHODS[name][0](**options)
    except TypeError as err:
        raise ValueError(f"method {name}: {err}") from None
    return Method.of(drafter, capacity)


def make_drafter(spec: str) -> Drafter:
    """The drafter a spec names (its capacity, if any, checked and left to ``parse_method``)."""
    return parse_method(spec).drafter


__all__ = ["Drafter", "DraftTree", "Method", "Needs", "NoDrafter", "PromptLookupDrafter", "RacerDrafter",
           "TokenRecyclingDrafter", "LogitSpecDrafter", "RestDrafter", "TreeBuilder", "METHODS", "make_drafter",
           "method_options", "parse_capacity", "parse_method"]
