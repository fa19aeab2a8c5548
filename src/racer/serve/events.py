"""What the API side and the engine core say to each other: commands one way, events
the other, as plain data (they cross a process boundary, pickled)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Union

from racer import GenerationOptions, GenerationResult


@dataclass
class Submit:
    """Decode ``ids`` (a prompt already checked against the context) as request ``key``."""

    key: int
    ids: list[int]
    options: GenerationOptions
    scope: Hashable | None = None


@dataclass
class Cancel:
    """End request ``key`` at the next step (its client went away, or the server stops)."""

    key: int


@dataclass
class Stop:
    """Cancel whatever is in flight, say so, and end."""


Command = Union[Submit, Cancel, Stop]


@dataclass
class Tokens:
    """Tokens one step emitted for request ``key``, with their provenance, the pass's
    number in the request (0: the prefill) and the nodes it verified."""

    key: int
    tokens: list[int]
    sources: list[str] = field(default_factory=list)
    step: int = 0
    tree_size: int = 0


@dataclass
class Finished:
    """Request ``key`` ended (``result.stop_reason`` says why; ``"cancelled"`` included).
    The result's ``text`` is empty: the API side decodes the tokens."""

    key: int
    result: GenerationResult


@dataclass
class Failed:
    """Request ``key`` could not be decoded: refused on arrival (``refused``: its prompt
    or options; the client's fault) or failed in a step (the server's)."""

    key: int
    message: str
    refused: bool = False


@dataclass
class Stepped:
    """One step happened: the batch's state after it, and the seconds the engine spent
    since the last ``Stepped``, by part (``BatchDecoder.seconds``, plus ``hand_off``:
    reading commands and sending events; waiting for work is what they leave)."""

    active: int
    waiting: int
    idle_drafters: int
    seconds: dict[str, float]


@dataclass
class Ready:
    """The engine is built: the model's context window and the batch's rows."""

    context: int
    max_batch: int


@dataclass
class BuildFailed:
    """Building the engine failed. ``bad_input``: the user's (a model that cannot be
    found or used, a bad option: said as one line), else the server's."""

    message: str
    bad_input: bool = False


Event = Union[Tokens, Finished, Failed, Stepped, Ready, BuildFailed]
