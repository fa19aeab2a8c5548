"""Draft methods by name, with options written ``name:key=value:key=value``."""

from __future__ import annotations

import inspect
from typing import Any, Callable

from racer.drafters.base import Drafter, NoDrafter
from racer.drafters.logitspec import LogitSpecDrafter
from racer.drafters.pld import PromptLookupDrafter
from racer.drafters.racer import RacerDrafter
from racer.drafters.rest import RestDrafter
from racer.drafters.token_recycling import TokenRecyclingDrafter

METHODS: dict[str, tuple[Callable[..., Drafter], str]] = {
    "racer": (RacerDrafter, "RACER: Aho-Corasick retrieval of seen n-grams + copy-logit tree, merged"),
    "none": (NoDrafter, "plain autoregressive decoding through the same loop"),
    "pld": (PromptLookupDrafter, "prompt lookup: n-gram match in the context, one chain (variant=original|hf)"),
    "token-recycling": (TokenRecyclingDrafter, "Token Recycling: vocab x 8 table of verified top-8, static 81-node tree"),
    "logitspec": (LogitSpecDrafter, "LogitSpec: last logits guess the next-next token; context n-gram retrieval"),
    "rest": (RestDrafter, "REST: suffix-array retrieval from a datastore (racer datastore build)"),
}


def register(name: str, factory: Callable[..., Drafter], summary: str) -> None:
    METHODS[name] = (factory, summary)


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


def method_options(name: str) -> dict[str, Any]:
    """Options a method takes, with their defaults."""
    factory = METHODS[name][0]
    return {p.name: p.default for p in inspect.signature(factory).parameters.values()
            if p.default is not inspect.Parameter.empty}


def make_drafter(spec: str) -> Drafter:
    """Build a drafter from ``name[:key=value...]``, e.g. ``racer:capacity=16``."""
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
            raise ValueError(f"method {name}: option {part!r} is not key=value with key in "
                             f"{', '.join(allowed) or '(no options)'}")
        options[key] = _parse_value(value)
    try:
        return METHODS[name][0](**options)
    except TypeError as err:
        raise ValueError(f"method {name}: {err}") from None


__all__ = ["Drafter", "NoDrafter", "PromptLookupDrafter", "RacerDrafter", "TokenRecyclingDrafter",
           "LogitSpecDrafter", "RestDrafter", "METHODS", "make_drafter", "method_options", "register"]
