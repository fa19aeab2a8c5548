"""The KV of prompts and finished requests, kept for later requests that begin with the
same tokens.

An agent or a chat client resends its whole conversation on every call, so each call's
prompt begins with the previous call's prompt (and often its answer), and concurrent
clients' prompts often begin with one system prompt. A request's prompt positions are
copied out of its row once prefilled, and its cached positions (prompt and answer)
before the row is freed, which replaces the prompt's (an entry that another extends
goes); a new request of the same memory scope whose prompt shares at least ``minimum``
leading tokens with one of them starts its prefill from a copy of that KV and computes
only the rest.
Positions hold the same keys and values whichever pass computed them, so the answer is
the one a full prefill gives.

Bounded in bytes, least recently used out first. Entries are per scope: a request
never starts from the KV of a scope it is not in (its time to first token would tell
it what another scope sent), and requests without a scope neither keep nor reuse.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Sequence

import numpy as np
import torch


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


@dataclass
class Prefix:
    tokens: np.ndarray  # the ids whose KV is kept, position by position
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per attention layer: keys, values (heads, positions, dim)

    @property
    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv)


class PrefixStore:
    """Prompts' and finished requests' KV by scope, at most ``capacity`` bytes in all."""

    def __init__(self, capacity: int, minimum: int = 64) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"capacity: expected bytes, a non-negative integer, got {capacity!r}")
        if isinstance(minimum, bool) or not isinstance(minimum, int) or minimum < 1:
            raise ValueError(f"minimum: expected a positive number of tokens, got {minimum!r}")
        self.capacity, self.minimum = capacity, minimum
        self._entries: OrderedDict[int, tuple[Hashable, Prefix]] = OrderedDict()
        self._next = 0
        self.held = 0  # bytes
        self.reused = 0  # prompt tokens whose prefill a kept prefix saved

    def __len__(self) -> int:
        return len(self._entries)

    def wants(self, scope: Hashable | None, length: int) -> bool:
        """Whether a request of ``scope`` that cached ``length`` tokens is worth keeping."""
        return scope is not None and self.capacity > 0 and length >= self.minimum

    def holds(self, scope: Hashable, tokens: Sequence[int]) -> bool:
        """Whether a kept prefix of ``scope`` already begins with all of ``tokens``
        (keeping them again would copy KV that adds nothing)."""
        wanted = np.asarray(tokens, dtype=np.int64)
        return any(other_scope == scope and common_prefix(other.tokens, wanted) == len(wanted)
                   for other_scope, other in self._entries.values())

    def put(self, scope: Hashable, prefix: Prefix) -> None:
        """Keep ``prefix``; one it extends (or repeats) goes, then the least recently
        used until the store fits."""
        size = prefix.nbytes
        if size > self.capacity:
            return
        for key, (other_scope, other) in list(self._entries.items()):
            if other_scope == scope and common_prefix(other.tokens, prefix.tokens) == len(other.tokens):
                self._drop(key)
        while self.held + size > self.capacity and self._entries:
            self._drop(next(iter(self._entries)))
        self._entries[self._next] = (scope, prefix)
        self._next += 1
        self.held += size

    def longest(self, scope: Hashable | None, ids: Sequence[int]) -> tuple[Prefix | None, int]:
        """The kept prefix of ``scope`` sharing the most leading tokens with ``ids``,
        and how many it may give (at least ``minimum``; never all of ``ids``: the last
        token is computed, for its logits); (None, 0) if none does."""
        key, length = self._best(scope, ids)
        if key is None:
            return None, 0
        self._entries.move_to_end(key)
        self.reused += length
        return self._entries[key][1], length

    def reusable(self, scope: Hashable | None, ids: Sequence[int]) -> int:
        """How many of ``ids`` ``longest`` would give now (nothing is used or moved)."""
        return self._best(scope, ids)[1]

    def _best(self, scope: Hashable | None, ids: Sequence[int]) -> tuple[int | None, int]:
        if scope is None or not self._entries:
            return None, 0
        wanted = np.asarray(ids, dtype=np.int64)
        best_key, best_length = None, 0
        for key, (other_scope, prefix) in self._entries.items():
            if other_scope != scope:
                continue
            length = min(common_prefix(prefix.tokens, wanted), len(wanted) - 1)
            if length > best_length:
                best_key, best_length = key, length
        if best_key is None or best_length < self.minimum:
            return None, 0
        return best_key, best_length

    def _drop(self, key: int) -> None:
        _, prefix = self._entries.pop(key)
        self.held -= prefix.nbytes
