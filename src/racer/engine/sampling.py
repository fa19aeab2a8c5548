"""Choosing tokens from verified logits: greedy, or exact speculative sampling over a
draft tree.

Sampling walks the tree from the root: at each node it draws one token from the
model's processed distribution there; if a child carries that token it descends,
otherwise it emits the token and stops. Drafts carry no probabilities, so every emitted
token is an exact sample from the model given its true context, whatever the tree —
the output distribution is that of plain sampling. On an accelerator every node draws
its token at once, in one batched draw, and the walk then reads them (one host read a
step); the walk only ever looks at the draws of the nodes it visits, each independent
of the others, so the distribution is the same. On the CPU, where a read costs nothing,
only the visited nodes are processed and drawn, in turn. Logits are processed with
transformers' own processors, in generate's order (repetition penalty, temperature,
top-k, top-p), in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from racer.drafting.tree import DraftTree
from racer.engine.host import to_host


@dataclass(frozen=True)
class SamplingParams:
    """``temperature`` 0 means greedy (top_p/top_k then change nothing); ``top_k`` 0 and
    ``top_p`` 1 switch those filters off; ``seed`` None draws a fresh seed per request."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        def number(name: str, value: object) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name}: expected a finite number, got {value!r}")
            return float(value)

        if number("temperature", self.temperature) < 0:
            raise ValueError(f"temperature: expected 0 (greedy) or more, got {self.temperature}")
        if not 0 < number("top_p", self.top_p) <= 1:
            raise ValueError(f"top_p: expected a value in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k: expected 0 (off) or a positive integer, got {self.top_k!r}")
        if number("repetition_penalty", self.repetition_penalty) <= 0:
            raise ValueError(f"repetition_penalty: expected a positive number (1 = off), got {self.repetition_penalty}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed: expected a non-negative integer or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def processors(self) -> list:
        from transformers.generation.logits_process import (
            RepetitionPenaltyLogitsProcessor,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        out: list = []
        if self.repetition_penalty != 1.0:
            out.append(RepetitionPenaltyLogitsProcessor(self.repetition_penalty))
        if not self.greedy:
            if self.temperature != 1.0:
                out.append(TemperatureLogitsWarper(self.temperature))
            if self.top_k:
                out.append(TopKLogitsWarper(self.top_k))
            if self.top_p < 1.0:
                out.append(TopPLogitsWarper(self.top_p))
        return out


def accept_greedy(tree: DraftTree, argmax: Sequence[int]) -> list[int]:
    """Longest root-to-node path whose every token is its parent's argmax."""
    path = [0]
    node = 0
    while True:
        child = tree.child(node, argmax[node])
        if child is None:
            return path
        path.append(child)
        node = child


class TokenChooser:
    """One request's token choice: greedy, or sampling with its own generator."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu",
                 batched: bool | None = None) -> None:
        """``batched``: draw every node's token at once (default: off the CPU only)."""
        self.params = params
        self.batched = torch.device(device).type != "cpu" if batched is None else batched
        self.processors = params.processors()
        # Only the repetition penalty reads the context; the warpers ignore it, so
        # without the penalty no per-token copy of the context is made.
        self.reads_context = params.repetition_penalty != 1.0
        self.generator: torch.Generator | None = None
        if not params.greedy:
            self.generator = torch.Generator(device=device)
            if params.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(params.seed)

    def process(self, logits: torch.Tensor, contexts: torch.Tensor) -> torch.Tensor:
        """Processed float32 scores for rows of ``logits`` whose contexts (for the
        repetition penalty) are the rows of ``contexts``."""
        scores = logits.float()
        for processor in self.processors:
            scores = processor(contexts, scores)
        return scores

    def first(self, last_logits: torch.Tensor, prompt: Sequence[int]) -> int:
        """The token after the prompt, from the prefill's last logits (1, vocab)."""
        if self.params.greedy and not self.processors:
            return int(to_host(torch.argmax(last_logits[-1])))
        context = torch.tensor([list(prompt) if self.reads_context else []], dtype=torch.long,
                               device=last_logits.device)
        return self._pick(self.process(last_logits[-1:], context)[0])

    def _pick(self, scores: torch.Tensor) -> int:
        if self.generator is None:
            return int(to_host(torch.argmax(scores)))
        probs = torch.softmax(scores, dim=-1)
        return int(to_host(torch.multinomial(probs, 1, generator=self.generator))[0])

    def node_tokens(self, tree: DraftTree, logits: torch.Tensor, prompt: Sequence[int],
                    emitted: Sequence[int]) -> torch.Tensor | None:
        """Each node's chosen token, shape (N,), left on the device: its argmax
        (greedy) or one draw from its processed distribution (batched sampling). None
        where the chooser samples by walking (``walk``). The tree's root is
        ``emitted[-1]``; the prompt and emitted tokens are the context the repetition
        penalty looks at."""
        if self.params.greedy and not self.processors:
            return torch.argmax(logits, dim=-1)
        if not self.params.greedy and not self.batched:
            return None
        base = list(prompt) + list(emitted) if self.reads_context else []
        contexts = _node_contexts(tree, base, logits.device) if self.reads_context else \
            torch.empty((len(tree), 0), dtype=torch.long, device=logits.device)
        scores = self.process(logits, contexts)
        if self.params.greedy:  # repetition penalty only
            return torch.argmax(scores, dim=-1)
        return torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=self.generator)[:, 0]

    def walk(self, tree: DraftTree, logits: torch.Tensor, prompt: Sequence[int],
             emitted: Sequence[int]) -> tuple[list[int], int]:
        """Sampling by walking the tree, drawing at each visited node in turn: the
        accepted node path (root first) and the token that follows it."""
        base = list(prompt) + list(emitted) if self.reads_context else []
        path, node = [0], 0
        while True:
            tokens = base + [tree.tokens[i] for i in path[1:]] if self.reads_context else []
            context = torch.tensor([tokens], dtype=torch.long, device=logits.device)
            scores = self.process(logits[node : node + 1], context)
            token = self._pick(scores[0])
            child = tree.child(node, token)
            if child is None:
                return path, token
            path.append(child)
            node = child

    def accept(self, tree: DraftTree, logits: torch.Tensor, prompt: Sequence[int],
               emitted: Sequence[int]) -> tuple[list[int], int]:
        """The accepted node path (root first) and the token that follows it."""
        chosen = self.node_tokens(tree, logits, prompt, emitted)
        if chosen is None:
            return self.walk(tree, logits, prompt, emitted)
        tokens = to_host(chosen).tolist()
        path = accept_greedy(tree, tokens)
        return path, tokens[path[-1]]


def _node_contexts(tree: DraftTree, base: list[int], device: torch.device) -> torch.Tensor:
    """(N, len(base) + depth) ids: node i's context (base + its path below the root),
    padded with the root, which every node's context already holds (the repetition
    penalty depends only on which tokens occur)."""
    depth = max(tree.depths)
    root = base[-1]
    rows = []
    for i in range(len(tree)):
        below = [tree.tokens[j] for j in tree.path_to(i)[1:]]
        rows.append(base + below + [root] * (depth - len(below)))
    return torch.tensor(rows, device=device)
