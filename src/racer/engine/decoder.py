"""The decoding loop: draft, keep what the budget chooses, verify the tree in one pass,
accept (greedy or exact sampling), repeat.

The engine knows nothing of how drafts are made: it talks to a ``Drafter`` through the
interface of ``racer.drafting.base``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch

from racer.budget import CostCurve, CostModel, DraftBudget, WholeTree
from racer.budget.calibration import announce_on_stderr, load_or_measure
from racer.drafting import Drafter, Method, parse_method
from racer.engine.host import to_host
from racer.engine.model_facts import ModelFacts
from racer.engine.options import GenerationOptions, request_ids
from racer.engine.provenance import accepted_sources
from racer.engine.results import GenerationResult, StepStats
from racer.engine.sampling import TokenChooser, accept_greedy
from racer.engine.selftest import WindowCheck, self_test
from racer.engine.stopping import Chunk, Stopper, answer_text, end_token_ids, visible_text
from racer.engine.verifier import TreeVerifier
from racer.fastpaths import FastPaths


def top_ids(logits: torch.Tensor, k: int) -> np.ndarray:
    """The ``k`` most likely token ids of each row, as a host array."""
    return to_host(torch.topk(logits, k, dim=-1).indices)


@dataclass
class _Request:
    """One request in flight."""

    ids: list[int]  # the prompt
    result: GenerationResult  # its tokens are the context after the prompt
    chooser: TokenChooser
    stopper: Stopper


class Decoder:
    """Decodes with one model and one draft method. Reusable across requests: the
    drafter decides whether anything it learnt carries over.

    ``method``: a spec such as ``"racer:capacity=16"`` or a ``Drafter``; ``capacity``
    overrides the method's (``"auto"``: each step the draft budget keeps the part of the
    drafter's candidate tree worth verifying on this hardware; a number: a fixed size).
    ``cost``: the step-cost curve (default: measured once per model and hardware and
    cached on disk, see ``calibrate``); a measured ``CostModel`` also says which linear
    kernel verifies each tree size fastest. ``fast_paths``: ``False`` verifies with the
    model's own code only, or a ``FastPaths`` switches each fast path on its own.
    ``check``: self-test tree verification on this model first (and, the first time a
    request's context reaches one of its attention windows, past its windows)."""

    def __init__(self, model: Any, tokenizer: Any, method: str | Drafter | Method = "none", *,
                 capacity: int | str | None = None, cost: CostCurve | None = None, check: bool = True,
                 fast_paths: bool | FastPaths = True) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.method = _resolve_method(method, capacity)
        self.drafter = self.method.drafter
        self.facts = ModelFacts.of(model)
        self.fast_paths = FastPaths.of(fast_paths).on(self.facts.device.type)
        if check:
            self_test(model)
        self.verifier = TreeVerifier(model, self.fast_paths, self.facts)
        # The self-test past the model's windows waits for the first request that reaches one.
        self._windows = WindowCheck(model, self.verifier.layout, self.verifier.max_positions, check)
        self.end_ids = end_token_ids(model, tokenizer)
        self.drafter.attach(tokenizer, set(self.end_ids))
        self.cost: CostCurve | None = None
        self.budget: DraftBudget | WholeTree = WholeTree()
        self._calibrated = False
        if cost is not None or not self.method.drafts:
            self._use_cost(cost)

    # -- set-up ---------------------------------------------------------------------
    def calibrate(self, refresh: bool = False,
                  announce: Callable[[str], None] | None = announce_on_stderr) -> None:
        """Read the step-cost table this decoder needs from the disk cache, or measure it
        (tens of seconds on a CPU; ``announce`` is told first): a drafting method uses it
        to choose each tree size's linear kernel, ``capacity=auto`` for the draft budget.
        The first ``generate`` or ``stream`` calls this if nobody did."""
        if self._calibrated and not refresh:
            return
        self._use_cost(load_or_measure(self.model, refresh, self.fast_paths, announce))

    def _use_cost(self, cost: CostCurve | None) -> None:
        self.cost = cost
        if isinstance(cost, CostModel):
            self.verifier.set_kernels(cost.kernel, cost.kernels)
        self.budget = DraftBudget(cost) if self.method.auto and cost is not None else WholeTree()
        self._calibrated = True

    # -- the loop -------------------------------------------------------------------
    def _run(self, prompt: Any, options: GenerationOptions, result: GenerationResult) -> Iterator[list[int]]:
        """Prefill, then one step per verification pass; yields each pass's new tokens."""
        ids = request_ids(self.tokenizer, prompt, options, self.verifier.max_positions)
        self.calibrate()
        request, chunk = self._prefill(ids, options, result)
        sources = ["none"]
        while True:
            result.extend(chunk.tokens, sources, len(result.steps))
            if chunk.tokens:
                yield chunk.tokens
            room = self.verifier.max_positions - self.verifier.cached
            if chunk.done or room <= 1:
                result.stop_reason = request.stopper.reason if chunk.done else "context"
                result.drafter_stats = self.drafter.request_stats()
                self.budget.finish()
                return
            stats, chunk, sources = self._step(request, min(self.method.draft_size, options.max_tree, room))
            result.steps.append(stats)

    def _prefill(self, ids: list[int], options: GenerationOptions,
                 result: GenerationResult) -> tuple[_Request, Chunk]:
        result.restart(len(ids))
        start = time.perf_counter()
        request = _Request(ids, result, TokenChooser(options, self.verifier.device),
                           Stopper(self.tokenizer, self.end_ids, options.stop, options.max_new_tokens))
        needs = self.drafter.needs
        logits = self.verifier.prefill(ids, all_logits=needs.prompt)
        root = request.chooser.first(logits[-1:], ids)
        prompt_topk = self._top_ids(logits, None if needs.prompt else len(logits) - 1)
        result.prefill_s = time.perf_counter() - start
        self.drafter.begin(ids, prompt_topk)
        return request, request.stopper.cut(result.tokens, [root])

    def _step(self, request: _Request, size: int) -> tuple[StepStats, Chunk, list[str]]:
        self._windows.before(self.verifier.cached + size)
        emitted = request.result.tokens
        start = time.perf_counter()
        candidates = self.drafter.draft(emitted[-1], size)
        cached = self.verifier.cached
        tree = self.budget.select(candidates, cached)
        drafted = time.perf_counter()
        logits = self.verifier.verify(tree)
        path, following, topk = self._accept(request, tree, logits)
        self.verifier.commit(path, len(tree))
        verified = time.perf_counter()
        self.drafter.observe(tree, topk, path)
        observed = time.perf_counter()
        self.budget.observe(tree, path, cached, observed - start)
        stats = StepStats(len(tree), len(path) - 1, (drafted - start) + (observed - verified), verified - drafted,
                          len(candidates))
        chunk = request.stopper.cut(emitted, [tree.tokens[i] for i in path[1:]] + [following])
        return stats, chunk, accepted_sources(tree, path)

    def _accept(self, request: _Request, tree: Any, logits: torch.Tensor) -> tuple[list[int], int, np.ndarray | None]:
        """The accepted path, the token after it and the drafter's top-k ids, read from
        the device in one transfer: each node's chosen token beside its top-k ids. (A
        walk that samples node by node, and top-k of the last node only, read after the
        path is known: both happen on the CPU only, where reading costs nothing.)"""
        needs = self.drafter.needs
        chosen = request.chooser.node_tokens(tree, logits, request.ids, request.result.tokens)
        if chosen is None:
            path, following = request.chooser.walk(tree, logits, request.ids, request.result.tokens)
            return path, following, self._top_ids(logits, path[-1] if needs.at == "last" else None)
        # Off the CPU (a batched chooser) the top-k of every row travels with the tokens,
        # even for a drafter that needs only the last accepted node's.
        every_row = needs.topk and (needs.at == "tree" or request.chooser.batched)
        if every_row:
            host = to_host(torch.cat([chosen[:, None], torch.topk(logits, needs.topk, dim=-1).indices], dim=1))
            tokens, topk = host[:, 0].tolist(), host[:, 1:]
        else:
            tokens, topk = to_host(chosen).tolist(), None
        path = accept_greedy(tree, tokens)
        if needs.topk and needs.at == "last":
            topk = topk[path[-1] : path[-1] + 1] if topk is not None else self._top_ids(logits, path[-1])
        return path, tokens[path[-1]], topk

    def _top_ids(self, logits: torch.Tensor, row: int | None) -> np.ndarray | None:
        """The drafter's top-k ids of every row of ``logits``, or of one row; None when it
        asks for none."""
        k = self.drafter.needs.topk
        if not k:
            return None
        return top_ids(logits if row is None else logits[row : row + 1], k)

    # -- public entry points ------------------------------------------------------------
    def generate(self, prompt: Any, options: GenerationOptions | None = None, **fields: Any) -> GenerationResult:
        """Decode ``prompt`` (text, chat messages or token ids) greedily (the default) or
        by exact sampling; returns the new tokens, their text and per-step statistics.
        Options come as a ``GenerationOptions`` and/or as its fields by keyword
        (``max_new_tokens=64, temperature=0.7``)."""
        options = GenerationOptions.of(options, fields)
        result = GenerationResult.empty()
        start = time.perf_counter()
        for _ in self._run(prompt, options, result):
            pass
        result.wall_s = time.perf_counter() - start
        result.text = answer_text(self.tokenizer, result.tokens, options.stop)
        return result

    def stream(self, prompt: Any, options: GenerationOptions | None = None, *,
               result: GenerationResult | None = None, **fields: Any) -> Iterator[str]:
        """Yield text as it is accepted (arguments as ``generate``); the pieces join to
        the result's ``text``. Pass ``result`` to collect the statistics; it is emptied
        first."""
        options = GenerationOptions.of(options, fields)
        result = GenerationResult.empty() if result is None else result
        start = time.perf_counter()
        shown = ""
        for _ in self._run(prompt, options, result):
            if self.tokenizer is None:
                continue
            text = visible_text(self.tokenizer.decode(result.tokens, skip_special_tokens=True), options.stop, False)
            if len(text) > len(shown) and text.startswith(shown):
                yield text[len(shown):]
                shown = text
        result.wall_s = time.perf_counter() - start
        result.text = answer_text(self.tokenizer, result.tokens, options.stop)
        if result.text.startswith(shown) and len(result.text) > len(shown):
            yield result.text[len(shown):]


def _resolve_method(method: str | Drafter | Method, capacity: int | str | None) -> Method:
    if isinstance(method, str):
        return parse_method(method, capacity)
    if isinstance(method, Method):
        return method if capacity is None else Method.of(method.drafter, capacity)
    return Method.of(method, capacity)  # a Drafter, or a clear error


def generate(model: Any, tokenizer: Any, prompt: Any, *, method: str | Drafter = "none",
             **options: Any) -> GenerationResult:
    """One-shot generation with ``method`` (options as ``Decoder.generate``); see
    ``Decoder`` to reuse a drafter."""
    return Decoder(model, tokenizer, method).generate(prompt, **options)
