"""The decoding loop: draft, verify the tree in one pass, accept (greedy or exact
sampling), repeat.

The engine knows nothing of how drafts are made: it talks to a ``Drafter``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from racer.budget import CostCurve, DraftBudget
from racer.cost import CostModel, load_or_measure
from racer.drafters import Drafter, make_drafter
from racer.sampling import SamplingParams, TokenChooser
from racer.tree import DraftTree
from racer.verify import TreeVerifier, self_test


@dataclass
class StepStats:
    tree_size: int  # nodes verified, root included
    accepted: int  # draft tokens accepted beyond the root (the "a" of 1 + a)
    draft_s: float
    verify_s: float
    candidates: int = 0  # nodes the drafter proposed before the draft budget chose (capacity=auto)


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    prompt_tokens: int
    steps: list[StepStats] = field(default_factory=list)
    prefill_s: float = 0.0
    wall_s: float = 0.0
    stop_reason: str = "length"  # "eos", "stop", "length" or "context"
    drafter_stats: dict = field(default_factory=dict)

    @property
    def passes(self) -> int:
        """Verification passes, the prefill (which yields the first token) included."""
        return 1 + len(self.steps)

    @property
    def mat(self) -> float:
        """Mean accepted tokens: emitted tokens per verification pass."""
        return len(self.tokens) / self.passes if self.tokens else 0.0

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class _Chunk:
    """Tokens emitted by one pass and whether generation ends with them."""

    tokens: list[int]
    done: bool


def _end_token_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def encode_prompt(tokenizer: Any, prompt: Any, chat: bool) -> list[int]:
    """Token ids for a prompt given as text, chat messages, or ids."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("prompt: expected non-empty text, got an empty string")
        if chat:
            if not getattr(tokenizer, "chat_template", None):
                raise ValueError("chat: the tokenizer has no chat template; pass chat=False for raw text")
            prompt = [{"role": "user", "content": prompt}]
        else:
            return list(tokenizer(prompt, add_special_tokens=False).input_ids) or _empty()
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):  # BatchEncoding in transformers 5
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    if isinstance(prompt, (list, tuple, np.ndarray, torch.Tensor)):
        ids = [int(t) for t in (prompt.tolist() if hasattr(prompt, "tolist") else prompt)]
        return ids or _empty()
    raise ValueError(f"prompt: expected text, chat messages or token ids, got {type(prompt).__name__}")


def _empty() -> list[int]:
    raise ValueError("prompt: expected at least one token, got none")


class _Stopper:
    """Cuts a chunk of new tokens at the first end token, stop string or limit."""

    def __init__(self, tokenizer: Any, end_ids: set[int], stop: Sequence[str], limit: int) -> None:
        self.tokenizer, self.end_ids, self.stop, self.limit = tokenizer, end_ids, list(stop), limit
        # A stop string of m characters spans at most m tokens, plus byte-split pieces.
        self.window = 4 * max((len(s) for s in self.stop), default=0) + 4
        self.reason = "length"

    def cut(self, emitted: list[int], new: Sequence[int]) -> _Chunk:
        out: list[int] = []
        for token in new:
            if len(emitted) + len(out) >= self.limit:
                return _Chunk(out, True)
            out.append(int(token))
            if token in self.end_ids:
                self.reason = "eos"
                return _Chunk(out, True)
            if self.stop:
                tail = (emitted + out)[-self.window :]
                text = self.tokenizer.decode(tail)
                if any(s in text for s in self.stop):
                    self.reason = "stop"
                    return _Chunk(out, True)
        return _Chunk(out, len(emitted) + len(out) >= self.limit)


class Decoder:
    """Decodes with one model and one drafter. Reusable across requests: the drafter
    decides whether anything it learnt carries over.

    A drafter with ``capacity=auto`` proposes a generous candidate tree and the draft
    budget keeps the part worth verifying on this hardware: ``cost`` is the step-cost
    model (default: measured once and cached on disk, see ``racer.cost``). A measured
    ``CostModel`` also says which linear kernel verifies each tree size fastest, for
    every drafter that drafts."""

    def __init__(self, model: Any, tokenizer: Any, method: str | Drafter = "none",
                 check: bool = True, cost: CostCurve | None = None) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.drafter = make_drafter(method) if isinstance(method, str) else method
        if not isinstance(self.drafter, Drafter):
            raise ValueError(f"method: expected a method name or a Drafter, got {type(method).__name__}")
        if check:
            self_test(model)
        self.verifier = TreeVerifier(model)
        self.end_ids = _end_token_ids(model, tokenizer)
        if self.drafter.topk_nodes not in ("tree", "last"):
            raise ValueError(f"drafter {type(self.drafter).__name__}: topk_nodes: expected 'tree' or 'last', "
                             f"got {self.drafter.topk_nodes!r}")
        self.drafter.attach(tokenizer, set(self.end_ids))
        self.budget: DraftBudget | None = None
        if cost is None and (self.drafter.drafts or self.drafter.auto_capacity):
            cost = load_or_measure(model)
        if isinstance(cost, CostModel):
            self.verifier.set_kernels(cost.kernel, cost.kernels)
        if self.drafter.auto_capacity and cost is not None:
            self.budget = DraftBudget(cost)

    def _steps(self, ids: list[int], max_new_tokens: int, stop: Sequence[str],
               result: GenerationResult, max_tree: int, sampling: SamplingParams) -> Iterator[list[int]]:
        drafter, verifier, budget = self.drafter, self.verifier, self.budget
        stopper = _Stopper(self.tokenizer, self.end_ids, stop, max_new_tokens)
        emitted = result.tokens
        k = drafter.topk
        last_only = drafter.topk_nodes == "last"

        start = time.perf_counter()
        chooser = TokenChooser(sampling, verifier.device)
        logits = verifier.prefill(ids, all_logits=drafter.wants_prompt_topk)
        root = chooser.first(logits[-1:], ids)
        prompt_topk = None
        if drafter.wants_prompt_topk:
            prompt_topk = torch.topk(logits, k, dim=-1).indices.numpy()
        elif k:
            prompt_topk = torch.topk(logits[-1:], k, dim=-1).indices.numpy()
        result.prefill_s = time.perf_counter() - start
        drafter.begin(ids, prompt_topk)
        chunk = stopper.cut(emitted, [root])
        while True:
            emitted.extend(chunk.tokens)
            if chunk.tokens:
                yield chunk.tokens
            room = verifier.max_positions - verifier.cached
            if chunk.done or room <= 1:
                result.stop_reason = stopper.reason if chunk.done else "context"
                result.drafter_stats = drafter.request_stats()
                if budget is not None:
                    budget.finish()
                return
            t0 = time.perf_counter()
            tree = drafter.draft(emitted[-1], min(max_tree, room))
            candidates = len(tree)
            cached = verifier.cached
            if budget is not None:
                tree = budget.select(tree, cached)
            t1 = time.perf_counter()
            logits = verifier.verify(tree)
            path, following = chooser.accept(tree, logits, ids, emitted)
            verifier.commit(path, len(tree))
            tree_topk = None
            if k:
                rows = logits[path[-1] : path[-1] + 1] if last_only else logits
                tree_topk = torch.topk(rows, k, dim=-1).indices.numpy()
            t2 = time.perf_counter()
            drafter.observe(tree, tree_topk, path)
            t3 = time.perf_counter()
            if budget is not None:
                budget.observe(tree, path, cached, t3 - t0)
            result.steps.append(StepStats(len(tree), len(path) - 1, (t1 - t0) + (t3 - t2), t2 - t1, candidates))
            new = [tree.tokens[i] for i in path[1:]] + [following]
            chunk = stopper.cut(emitted, new)

    def _start(self, prompt: Any, max_new_tokens: int, stop: Sequence[str] | str | None,
               chat: bool) -> tuple[list[int], list[str], GenerationResult]:
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens: expected a positive integer, got {max_new_tokens!r}")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop: expected non-empty strings, got {stop!r}")
        if stops and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer")
        ids = encode_prompt(self.tokenizer, prompt, chat)
        limit = self.verifier.max_positions
        if len(ids) >= limit:
            raise ValueError(f"prompt: {len(ids)} tokens do not fit the model's context window of {limit} tokens "
                             "(one position is needed for the first new token)")
        return ids, stops, GenerationResult(tokens=[], text="", prompt_tokens=len(ids))

    def generate(self, prompt: Any, *, max_new_tokens: int = 256, stop: Sequence[str] | str | None = None,
                 chat: bool = False, max_tree: int = 1 << 16, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, repetition_penalty: float = 1.0, seed: int | None = None) -> GenerationResult:
        """Decode greedily (``temperature`` 0, the default) or by exact sampling; returns
        the new tokens, their text and per-step statistics. The sampling parameters
        mean what they mean in Hugging Face ``generate``; ``seed`` makes a run repeatable
        for the same method and settings."""
        sampling = SamplingParams(temperature, top_p, top_k, repetition_penalty, seed)
        ids, stops, result = self._start(prompt, max_new_tokens, stop, chat)
        start = time.perf_counter()
        for _ in self._steps(ids, max_new_tokens, stops, result, max_tree, sampling):
            pass
        result.wall_s = time.perf_counter() - start
        result.text = self._decode(result.tokens)
        return result

    def _decode(self, tokens: list[int]) -> str:
        # A tokenizer is optional for callers that work in token ids only.
        return self.tokenizer.decode(tokens, skip_special_tokens=True) if self.tokenizer is not None else ""

    def stream(self, prompt: Any, *, max_new_tokens: int = 256, stop: Sequence[str] | str | None = None,
               chat: bool = False, max_tree: int = 1 << 16, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, repetition_penalty: float = 1.0, seed: int | None = None,
               result: GenerationResult | None = None) -> Iterator[str]:
        """Yield text as it is accepted (parameters as ``generate``). Pass ``result`` to
        collect the statistics."""
        sampling = SamplingParams(temperature, top_p, top_k, repetition_penalty, seed)
        ids, stops, fresh = self._start(prompt, max_new_tokens, stop, chat)
        result = fresh if result is None else result
        result.prompt_tokens = fresh.prompt_tokens
        start = time.perf_counter()
        shown = ""
        for _ in self._steps(ids, max_new_tokens, stops, result, max_tree, sampling):
            text = self._decode(result.tokens)
            # Hold back a trailing partial UTF-8 character until its other bytes arrive.
            stable = text[:-1] if text.endswith("\ufffd") else text
            if len(stable) > len(shown) and stable.startswith(shown):
                yield stable[len(shown):]
                shown = stable
        result.wall_s = time.perf_counter() - start
        result.text = self._decode(result.tokens)
        if result.text.startswith(shown) and len(result.text) > len(shown):
            yield result.text[len(shown):]


def generate(model: Any, tokenizer: Any, prompt: Any, *, method: str | Drafter = "none",
             max_new_tokens: int = 256, stop: Sequence[str] | str | None = None,
             chat: bool = False, **sampling: Any) -> GenerationResult:
    """One-shot generation with ``method`` (sampling keywords as ``Decoder.generate``);
    see ``Decoder`` to reuse a drafter."""
    return Decoder(model, tokenizer, method).generate(prompt, max_new_tokens=max_new_tokens, stop=stop, chat=chat,
                                                      **sampling)
