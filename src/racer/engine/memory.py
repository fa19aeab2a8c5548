"""Who drafts for a request, and what it remembers: the drafter lifecycle that the
engine and the vLLM proposer share. Pure Python.

A request's drafting is a ``DraftSession``: ``DrafterMemory.begin`` gives it a drafter
(with its acceptance model) and tells the drafter the prompt; the session drafts and
observes step by step; ``DrafterMemory.end`` hands the drafter back. A drafter's
memory is its own state (RACER's n-gram automaton and copy-logit table, Token
Recycling's adjacency table, ...), which its ``begin`` keeps or clears as its
``memory`` option says. One drafter serves one request at a time, so memory travels
with drafters: a request that ends hands its drafter back to its scope, and the next
request of that scope takes one of its idle drafters: the one that holds the longest
start of its prompt as the text of the last request it served (``Drafter.holds``: the
drafter of the same conversation, where a client resends it, which then learns only
what is new), else the one handed back last (the freshest memory). With C requests in
flight a scope holds up to C drafters, each with the memory of the requests it served.
Requests of no scope (``None``) get a new drafter and give nothing back.

A drafter configured to share (RACER's ``memory=shared`` or ``kept-shared``) also
reads and writes the memory of its request's scope (``Drafter.new_shared``, one per
scope, made by the first drafter that asks): every request of the scope, live or ended,
writes there, whichever drafter serves it. Requests of no scope share nothing.

Rates may be shared too (``shared_rates``): one acceptance model per scope, which every
session of the scope reads and teaches, instead of one that travels with each drafter.
An engine that rates few nodes per request (vLLM's proposer verifies one chain a step)
learns C times as fast, and a new request starts from what its scope has shown.
Requests of no scope get a model of their own.

Bounded: at most ``limit`` idle drafters are kept over all scopes, the least recently
returned dropped first; each drafter bounds its own memory (``nodes``, ``k``); shared
memories are kept for at most ``scopes`` scopes, the least recently begun dropped first
(its live requests keep writing to it until they end), each bounded by its drafter's
options (``shared_nodes``, ``k``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Generic, Hashable, Sequence, TypeVar

import numpy as np

from racer.budget.acceptance import AcceptanceModel
from racer.drafting.base import Drafter
from racer.drafting.tree import DraftTree

Item = TypeVar("Item")


class DrafterPool(Generic[Item]):
    """Idle items (drafters with their acceptance models) by scope, bounded."""

    def __init__(self, limit: int) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"limit: expected a non-negative integer, got {limit!r}")
        self.limit = limit
        self._idle: "OrderedDict[int, tuple[Hashable, Item]]" = OrderedDict()  # oldest first
        self._serial = 0

    def take(self, scope: Hashable | None, build: Callable[[], Item],
             score: Callable[[Item], int] | None = None) -> Item:
        """The idle item of ``scope`` returned last, or a new one from ``build``; with
        ``score``, the idle item of ``scope`` that scores highest (ties: the one
        returned last)."""
        serial = self._last(scope) if score is None else self._best(scope, score)
        if serial is None:
            return build()
        return self._idle.pop(serial)[1]

    def _best(self, scope: Hashable | None, score: Callable[[Item], int]) -> int | None:
        best, best_score = None, -1
        if scope is not None:
            for serial in reversed(self._idle):
                key, item = self._idle[serial]
                if key == scope:
                    value = score(item)
                    if value > best_score:
                        best, best_score = serial, value
        return best

    def peek(self, scope: Hashable | None) -> Item | None:
        """The idle item ``take`` would give ``scope``, left where it is (None: none)."""
        serial = self._last(scope)
        return None if serial is None else self._idle[serial][1]

    def _last(self, scope: Hashable | None) -> int | None:
        if scope is not None:
            for serial in reversed(self._idle):
                if self._idle[serial][0] == scope:
                    return serial
        return None

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


class DraftSession:
    """One request's drafting, from ``DrafterMemory.begin`` to ``end``: its drafter and
    the acceptance model that rates the drafter's nodes (None where nothing rates them:
    a fixed capacity)."""

    def __init__(self, drafter: Drafter, acceptance: AcceptanceModel | None, scope: Hashable | None) -> None:
        self.drafter, self.acceptance, self.scope = drafter, acceptance, scope
        self.ended = False

    def draft(self, root: int, size: int) -> DraftTree:
        """A candidate tree of at most ``size`` nodes under ``root``."""
        return self.drafter.draft(root, size)

    def observe(self, tree: DraftTree, tree_topk: np.ndarray | None, accepted: Sequence[int],
                rated: bool = True) -> None:
        """What verifying ``tree`` revealed (``Drafter.observe``); the acceptance model
        learns from it too where ``rated`` (a tree the budget chose from the drafter's
        rates, not a bare root verified while drafting paused)."""
        self.drafter.observe(tree, tree_topk, accepted)
        if self.acceptance is not None and rated:
            self.acceptance.observe(tree, accepted)


class DrafterMemory:
    """Drafters for requests, kept between requests by memory scope (``DrafterPool``).

    ``build``: a new drafter, attached to its model (``Drafter.attach``); ``rated``:
    whether sessions are rated by an acceptance model; ``limit``: idle drafters kept;
    ``scopes``: scopes whose shared memory (and shared rates) are kept;
    ``shared_rates``: one acceptance model per scope rather than one per drafter."""

    def __init__(self, build: Callable[[], Drafter], rated: bool, limit: int, scopes: int = 8,
                 shared_rates: bool = False) -> None:
        if isinstance(scopes, bool) or not isinstance(scopes, int) or scopes < 1:
            raise ValueError(f"scopes: expected a positive integer, got {scopes!r}")
        self.build, self.rated, self.scopes = build, rated, scopes
        self.shared_rates = shared_rates and rated
        self.pool: DrafterPool[tuple[Drafter, AcceptanceModel | None]] = DrafterPool(limit)
        self.shared: "OrderedDict[Hashable, Any]" = OrderedDict()  # least recently begun first
        self.rates: "OrderedDict[Hashable, AcceptanceModel]" = OrderedDict()  # least recently begun first

    def _new(self) -> tuple[Drafter, AcceptanceModel | None]:
        return self.build(), AcceptanceModel() if self.rated and not self.shared_rates else None

    def begin(self, scope: Hashable | None, prompt: Sequence[int], prompt_topk: np.ndarray | None) -> DraftSession:
        """A request starts: the idle drafter of its scope that holds the longest start
        of its prompt (ties: the one handed back last), or a new one, learns its prompt
        (``Drafter.begin``)."""
        prompt = prompt if isinstance(prompt, list) else [int(t) for t in prompt]  # scored once per idle drafter
        drafter, acceptance = self.pool.take(scope, self._new, lambda item: item[0].holds(prompt))
        if self.shared_rates:
            acceptance = self._rates(scope)
        drafter.share(self._shared(scope, drafter))
        drafter.begin(prompt, prompt_topk)
        return DraftSession(drafter, acceptance, scope)

    def _rates(self, scope: Hashable | None) -> AcceptanceModel:
        if scope is None:
            return AcceptanceModel()
        rates = self.rates.get(scope)
        if rates is None:
            rates = self.rates[scope] = AcceptanceModel()
            while len(self.rates) > self.scopes:
                self.rates.popitem(last=False)
        self.rates.move_to_end(scope)
        return rates

    def _shared(self, scope: Hashable | None, drafter: Drafter) -> Any:
        if scope is None:
            return None
        shared = self.shared.get(scope)
        if shared is None:
            shared = drafter.new_shared()
            if shared is None:
                return None
            self.shared[scope] = shared
            while len(self.shared) > self.scopes:
                self.shared.popitem(last=False)
        self.shared.move_to_end(scope)
        return shared

    def end(self, session: DraftSession) -> dict:
        """The request ended: its drafter's counts for it (``Drafter.request_stats``);
        the drafter goes back to its scope."""
        if session.ended:
            raise RuntimeError("draft session: ended twice")
        session.ended = True
        stats = session.drafter.request_stats()
        session.drafter.share(None)  # an idle drafter holds no scope's memory alive
        own = None if self.shared_rates else session.acceptance  # shared rates stay with the scope
        self.pool.give_back(session.scope, (session.drafter, own))
        return stats

    def __len__(self) -> int:
        """Idle drafters kept."""
        return len(self.pool)
