"""What a batch keeps of its drafters between requests: a bounded pool of idle
drafters (each with its acceptance model), keyed by memory scope. Pure Python.

A drafter's memory is its own state (RACER's n-gram automaton and copy-logit table,
Token Recycling's adjacency table, ...), which its ``begin`` keeps or clears as its
``memory`` option says. One drafter serves one request at a time, so memory travels
with drafters: a request that ends hands its drafter back to its scope, and the next
request of that scope takes the drafter handed back last (the freshest memory). With
C requests in flight a scope holds up to C drafters, each with the memory of the
requests it served. Requests of no scope (``None``) get a new drafter and give
nothing back.

Bounded: at most ``limit`` idle drafters are kept over all scopes, the least recently
returned dropped first; each drafter bounds its own memory (``nodes``, ``k``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Hashable, Generic, TypeVar

Item = TypeVar("Item")


class DrafterPool(Generic[Item]):
    def __init__(self, limit: int) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"limit: expected a non-negative integer, got {limit!r}")
        self.limit = limit
        self._idle: "OrderedDict[int, tuple[Hashable, Item]]" = OrderedDict()  # oldest first
        self._serial = 0

    def take(self, scope: Hashable | None, build: Callable[[], Item]) -> Item:
        """The idle item of ``scope`` returned last, or a new one from ``build``."""
        if scope is not None:
            for serial in reversed(self._idle):
                key, item = self._idle[serial]
                if key == scope:
                    del self._idle[serial]
                    return item
        return build()

    def give_back(self, scope: Hashable | None, item: Item) -> None:
        if scope is None or self.limit == 0:
            return
        self._serial += 1
        self._idle[self._serial] = (scope, item)
        while len(self._idle) > self.limit:
            self._idle.popitem(last=False)

    def __len__(self) -> int:
        return len(self._idle)

    def scopes(self) -> set[Any]:
        return {key for key, _ in self._idle.values()}
