"""Where each emitted token came from, as text: which draft source proposed it
(``GenerationResult.token_sources``) mapped onto the characters it decodes to, for a
page or a terminal to tint."""

from __future__ import annotations

from bisect import bisect_right
from typing import Any, Sequence

from racer.drafting.tree import DraftTree, source_name
from racer.engine.detokenize import Detokenizer


def accepted_sources(tree: DraftTree, path: Sequence[int]) -> list[str]:
    """The provenance of what a pass that accepted ``path`` emits: each accepted draft
    node's sources, then "none" for the model's own token after them."""
    sources = tree.sources
    return [source_name(sources[i]) if sources else "none" for i in path[1:]] + ["none"]


class TokenSpans:
    """Emitted tokens with their provenance, as character ranges of the decoded text.

    ``add`` takes tokens as a pass emits them (decoded incrementally, in time linear in
    the answer's length: ``racer.engine.detokenize``), ``finish`` the end of the answer;
    ``spans(start, end)`` describes the characters ``start:end`` of ``text`` as runs
    ``[length, source, step]``: each character is tinted by the token whose decoding
    completed it (a character split over several tokens belongs to the last of them)."""

    def __init__(self, tokenizer: Any) -> None:
        self.detokenizer = Detokenizer(tokenizer)
        self.tokens: list[int] = []
        self.sources: list[str] = []
        self.steps: list[int] = []
        self.ends: list[int] = []  # after token i, the decoded text is stable up to ends[i]

    @property
    def text(self) -> str:
        return self.detokenizer.text

    def add(self, tokens: Sequence[int], sources: Sequence[str], step: int | Sequence[int]) -> str:
        """Append a pass's tokens; returns the text they complete."""
        before = len(self.text)
        for i, token in enumerate(tokens):
            self.tokens.append(int(token))
            self.sources.append(sources[i] if i < len(sources) else "none")
            self.steps.append(step if isinstance(step, int) else int(step[i]))
            self.detokenizer.add([token])
            self.ends.append(len(self.text))
        return self.text[before:]

    def finish(self) -> str:
        """The answer is complete: the text still held back (its last token's)."""
        piece = self.detokenizer.finish()
        if self.ends:
            self.ends[-1] = len(self.text)
        return piece

    @classmethod
    def of(cls, tokenizer: Any, result: Any) -> "TokenSpans":
        """The spans of a finished ``GenerationResult``."""
        spans = cls(tokenizer)
        spans.add(result.tokens, result.token_sources, result.token_steps)
        spans.finish()
        return spans

    def pieces(self) -> list[str]:
        """Each token's text: the characters its decoding completed ("" for an end
        token, or for the first bytes of a character that a later token completes)."""
        starts = [0] + self.ends[:-1]
        return [self.text[a:b] for a, b in zip(starts, self.ends)]

    def spans(self, start: int = 0, end: int | None = None) -> list[list]:
        end = len(self.text) if end is None else end
        runs: list[list] = []
        token = min(bisect_right(self.ends, start), max(len(self.ends) - 1, 0))  # the token holding ``start``
        for position in range(start, end):
            while token < len(self.ends) - 1 and self.ends[token] <= position:
                token += 1
            key = (self.sources[token], self.steps[token]) if self.ends else ("none", 0)
            if runs and (runs[-1][1], runs[-1][2]) == key:
                runs[-1][0] += 1
            else:
                runs.append([1, *key])
        return runs
