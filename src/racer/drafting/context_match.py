"""The longest earlier match of a request's context and what followed it: the deep chain
RACER drafts where the answer is copying its prompt or itself (agent calls resending
their tool outputs, code rewritten with small edits).

The n-gram automaton reaches at most n - (border depth) tokens past a match, and its
retrieval spreads the tree's nodes over every frequent continuation. Where the context
has just repeated a long run of earlier text, the likeliest draft is one deep chain: the
tokens that followed that run, for as far as they go (suffix decoding's draft, from the
request's own text). ``ContextMatch`` indexes every position of the context by the
``key`` tokens ending there (the most recent ``per_key`` of them), and at a draft finds,
among those, the earlier occurrence with the longest match behind it (``reach`` tokens at
most; ties to the most recent). Pure Python, linear in what is appended.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence


class Match(NamedTuple):
    """An earlier occurrence of the context's end: how many tokens match (at most the
    index's ``reach``) and the tokens that followed it."""

    length: int
    continuation: list[int]


class ContextMatch:
    def __init__(self, key: int = 3, per_key: int = 8, reach: int = 64) -> None:
        if key < 1:
            raise ValueError(f"key: expected a key length of at least 1 token, got {key}")
        if per_key < 1:
            raise ValueError(f"per_key: expected at least 1 position per key, got {per_key}")
        if reach < key:
            raise ValueError(f"reach: expected at least the key length {key}, got {reach}")
        self.key, self.per_key, self.reach = key, per_key, reach
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}  # key -> end positions, oldest first

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.append(token)

    def append(self, token: int) -> None:
        tokens = self.tokens
        tokens.append(int(token))
        if len(tokens) >= self.key:
            ends = self.ends.setdefault(tuple(tokens[-self.key :]), [])
            ends.append(len(tokens) - 1)
            if len(ends) > self.per_key:
                del ends[0]

    def longest(self, root: int, limit: int) -> Match | None:
        """The earlier occurrence of the longest suffix of context + ``root`` (at least
        ``key`` tokens) among the indexed ones, and up to ``limit`` tokens that followed
        it (running on into ``root`` itself where the text repeats with a short
        period); None when the last ``key`` tokens never occurred before, or nothing
        followed them."""
        tokens, k = self.tokens, self.key
        if len(tokens) < k - 1 or limit < 1:
            return None
        probe = tuple(tokens[len(tokens) - k + 1 :]) + (int(root),)
        ends = self.ends.get(probe)
        if not ends:
            return None
        here = len(tokens)  # root's position in context + root
        best_length, best_end = 0, -1
        for end in reversed(ends):  # most recent first: ties keep it
            length = k
            while (length < self.reach and end - length >= 0
                   and tokens[end - length] == tokens[here - length]):
                length += 1
            if length > best_length:
                best_length, best_end = length, end
        continuation = tokens[best_end + 1 : best_end + 1 + limit]
        if len(continuation) < limit and best_end + 1 + len(continuation) == here:
            continuation.append(int(root))  # the occurrence ran up to the root's own position
        return Match(best_length, continuation) if continuation else None
