"""Continuous batching with batched tree verification: many requests, one pass a step.

Requests join and leave between steps. A joining request is prefilled on its own cache
in chunks of at most ``prefill_chunk`` tokens, one chunk per step, so a long prompt
delays the requests already decoding by one bounded chunk a step; then its KV moves
into a row of the batch's ``SlotCache``. Each step every active request's drafter
proposes a tree, and one forward pass verifies all of them: the trees are padded to
the largest, each row gets its own positions and masks (its own context within its
layers' windows, its own ancestors), so no request sees another's tokens. Acceptance,
compaction and the drafter's update are per request; each request has its own drafter.

Design choice: one batch row per request with per-row lengths, rather than one
flattened sequence whose mask separates requests: a flattened pass would attend every
query to every request's cache (B times the attention work), while rows attend only
to their own, at the price of padding trees to the largest and contexts to the
longest row.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from dataclasses import replace

from racer.budget import AcceptanceModel, CostCurve, CostModel
from racer.budget.batch import BatchBudget
from racer.drafting import Drafter, Method, parse_method
from racer.drafting.tree import DraftTree, chain
from racer.engine.decoder import top_ids
from racer.engine.host import to_host
from racer.engine.options import GenerationOptions, request_ids
from racer.engine.results import GenerationResult, StepStats
from racer.engine.sampling import TokenChooser, accept_greedy
from racer.engine.selftest import WindowCheck, self_test
from racer.engine.slots import SlotCache
from racer.engine.stopping import Stopper, end_token_ids
from racer.engine.verifier import TreeVerifier
from racer.engine.windows import indexed_windows
from racer.fastpaths import FastPaths


@dataclass
class Update:
    """What one step did for one request: the tokens it emitted, and whether it ended."""

    request: int
    tokens: list[int]
    done: bool


@dataclass
class _Request:
    id: int
    ids: list[int]
    options: GenerationOptions
    drafter: Drafter
    acceptance: AcceptanceModel | None  # capacity=auto: how often this request's drafts are accepted
    chooser: TokenChooser
    stopper: Stopper
    result: GenerationResult
    verifier: TreeVerifier | None = None  # while prefilling
    prefilled: int = 0
    logits: list[torch.Tensor] = field(default_factory=list)  # prefill logits the drafter needs
    row: int | None = None
    cancelled: bool = False
    started: float = 0.0


class BatchDecoder:
    """Decodes many requests at once with one model and one draft method.

    ``method``: a spec such as ``"racer:capacity=16"`` (each request gets its own
    drafter built from it); ``max_batch``: requests verified together (the others wait,
    in order); ``prefill_chunk``: the most prompt tokens prefilled in one step; ``cost``:
    the step-cost curve a ``capacity=auto`` method's budget uses; ``check``: self-test
    tree verification on this model first."""

    def __init__(self, model: Any, tokenizer: Any, method: str = "racer", *, max_batch: int = 8,
                 prefill_chunk: int = 512, cost: CostCurve | None = None, check: bool = True,
                 fast_paths: bool | FastPaths = True) -> None:
        if not isinstance(method, str):
            raise ValueError(f"method: expected a method spec such as 'racer:capacity=16', got {type(method).__name__}")
        for name, value in (("max_batch", max_batch), ("prefill_chunk", prefill_chunk)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        self.model, self.tokenizer, self.spec = model, tokenizer, method
        self.method: Method = parse_method(method)  # checks the spec once
        if self.method.auto and cost is None:
            raise ValueError("cost: a capacity=auto method needs a step-cost curve (e.g. Decoder.calibrate's)")
        self.max_batch, self.prefill_chunk, self.cost = max_batch, prefill_chunk, cost
        self.fast_paths = FastPaths.of(fast_paths).on(next(model.parameters()).device.type)
        if check:
            self_test(model)
        self.core = TreeVerifier(model, self.fast_paths)
        self._windows = WindowCheck(model, self.core.layout, self.core.max_positions, check)
        if isinstance(cost, CostModel):
            self.core.set_kernels(cost.kernel, cost.kernels)
            # Refreshed by batched passes, which are not what the cached table measures:
            # a copy of its own, never saved.
            self.cost = replace(cost, seconds=list(cost.seconds), variance=list(cost.variance), path=None)
        self.budget = BatchBudget(self.cost) if self.method.auto else None
        self.slots = SlotCache(model.config)
        self.core.cache = self.slots.cache
        self.end_ids = end_token_ids(model, tokenizer)
        self.needs = self.method.drafter.needs
        self._waiting: list[_Request] = []
        self._active: list[_Request] = []  # in row order
        self._finished: dict[int, _Request] = {}
        self._next_id = 0

    def fresh(self) -> "BatchDecoder":
        """A new, empty decoder with the same model and settings (no self-test again)."""
        return BatchDecoder(self.model, self.tokenizer, self.spec, max_batch=self.max_batch,
                            prefill_chunk=self.prefill_chunk, cost=self.cost, check=False, fast_paths=self.fast_paths)

    # -- requests -------------------------------------------------------------------
    def submit(self, prompt: Any, options: GenerationOptions | None = None, **fields: Any) -> int:
        """Queue a request (text, chat messages or token ids); returns its id."""
        options = GenerationOptions.of(options, fields)
        ids = request_ids(self.tokenizer, prompt, options, self.core.max_positions)
        method = parse_method(self.spec)
        drafter = method.drafter
        drafter.attach(self.tokenizer, set(self.end_ids))
        acceptance = AcceptanceModel() if method.auto else None
        request = _Request(self._next_id, ids, options, drafter, acceptance,
                           TokenChooser(options, self.core.device),
                           Stopper(self.tokenizer, self.end_ids, options.stop, options.max_new_tokens),
                           GenerationResult.empty(len(ids)), started=time.perf_counter())
        self._next_id += 1
        self._waiting.append(request)
        return request.id

    def cancel(self, request: int) -> None:
        """End a request at the next step (a client that went away)."""
        for queued in self._waiting + self._active:
            if queued.id == request:
                queued.cancelled = True

    def result(self, request: int) -> GenerationResult:
        """A finished request's result (its tokens, text and per-step statistics),
        handed over once: the decoder keeps nothing of a request after that."""
        if request not in self._finished:
            raise KeyError(f"request: {request} has not finished (or its result was taken)")
        return self._finished.pop(request).result

    @property
    def busy(self) -> bool:
        return bool(self._waiting or self._active)

    @property
    def active(self) -> int:
        return len(self._active)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def generate_all(self, prompts: Iterable[Any], **fields: Any) -> list[GenerationResult]:
        """Decode every prompt together (options as ``Decoder.generate``)."""
        ids = [self.submit(prompt, **fields) for prompt in prompts]
        while self.busy:
            self.step()
        return [self.result(i) for i in ids]

    # -- one step -------------------------------------------------------------------
    def step(self) -> list[Update]:
        """One prefill chunk for the first waiting request (if any), then one batched
        verification pass over the active ones. Returns what each request emitted."""
        updates: list[Update] = []
        for request in [r for r in self._waiting + self._active if r.cancelled]:
            if request in self._waiting:
                self._waiting.remove(request)
            self._finish(request, "cancelled")
            updates.append(Update(request.id, [], True))
        if self._waiting and len(self._active) < self.max_batch:
            self._prefill_chunk(self._waiting[0], updates)
        if self._active:
            self._verify(updates)
        return updates

    def _prefill_chunk(self, request: _Request, updates: list[Update]) -> None:
        start = time.perf_counter()
        if request.verifier is None:
            request.verifier = TreeVerifier(self.model, self.fast_paths)
        verifier, ids = request.verifier, request.ids
        take = ids[request.prefilled : request.prefilled + self.prefill_chunk]
        if request.prefilled == 0:
            logits = verifier.prefill(take, all_logits=self.needs.prompt)
        else:
            with torch.inference_mode():
                logits = verifier.verify(chain(take[0], take[1:]))
            verifier.commit(list(range(len(take))), len(take))
        request.prefilled += len(take)
        request.logits.append(logits if self.needs.prompt else logits[-1:])
        request.result.prefill_s += time.perf_counter() - start
        if request.prefilled < len(ids):
            return
        self._waiting.remove(request)
        logits = torch.cat(request.logits) if self.needs.prompt else request.logits[-1]
        root = request.chooser.first(logits[-1:], ids)
        request.drafter.begin(ids, top_ids(logits, self.needs.topk) if self.needs.topk else None)
        request.row = self.slots.admit(verifier.cache, verifier.cached)
        request.verifier, request.logits = None, []
        self._active.append(request)
        chunk = request.stopper.cut(request.result.tokens, [root])
        request.result.tokens.extend(chunk.tokens)
        full = verifier.cached + 1 >= self.core.max_positions
        updates.append(Update(request.id, chunk.tokens, chunk.done or full))
        if chunk.done or full:
            self._finish(request, request.stopper.reason if chunk.done else "context")

    def _verify(self, updates: list[Update]) -> None:
        start = time.perf_counter()
        self._windows.before(max(self.slots.state.lengths) + self.method.draft_size)
        proposed: list[DraftTree] = []
        for request in self._active:
            room = self.core.max_positions - self.slots.state.lengths[request.row]
            size = min(self.method.draft_size, request.options.max_tree, room)
            proposed.append(request.drafter.draft(request.result.tokens[-1], size))
        candidates = [len(tree) for tree in proposed]
        if self.budget is not None:
            trees = self.budget.select(proposed, [r.acceptance for r in self._active], self.slots.state.lengths)
        else:
            trees = proposed
        drafted_at = time.perf_counter()
        logits = self._forward(trees)
        chosen, topk = self._read(trees, logits)
        verified_at = time.perf_counter()
        ended = []
        for request, tree, tokens, rows_topk, proposed in zip(list(self._active), trees, chosen, topk, candidates):
            if tokens is None:  # a sampling walk on the CPU (the top-k came with the read)
                path, following = request.chooser.walk(tree, logits[request.row, : len(tree)], request.ids,
                                                       request.result.tokens)
            else:
                path = accept_greedy(tree, tokens)
                following = tokens[path[-1]]
            if rows_topk is not None and self.needs.at == "last":
                rows_topk = rows_topk[path[-1] : path[-1] + 1]
            self.slots.compact(request.row, path)
            request.drafter.observe(tree, rows_topk, path)
            if request.acceptance is not None:
                request.acceptance.observe(tree, path)
            request.result.steps.append(StepStats(len(tree), len(path) - 1, drafted_at - start,
                                                  verified_at - drafted_at, proposed))
            chunk = request.stopper.cut(request.result.tokens, [tree.tokens[i] for i in path[1:]] + [following])
            request.result.tokens.extend(chunk.tokens)
            full = self.slots.state.lengths[request.row] + 1 >= self.core.max_positions
            if chunk.done or full:
                ended.append((request, request.stopper.reason if chunk.done else "context"))
            updates.append(Update(request.id, chunk.tokens, chunk.done or full))
        if self.budget is not None:
            self.budget.observe(len(trees), max(len(tree) for tree in trees), max(self.slots.state.lengths),
                                time.perf_counter() - start)
        for request, reason in ended:  # after the loop: releasing a row moves another
            self._finish(request, reason)

    def _forward(self, trees: list[DraftTree]) -> torch.Tensor:
        """One pass over every active row's tree, padded to the largest: logits of
        shape (rows, nodes, vocab)."""
        core, device = self.core, self.core.device
        rows, nodes = len(trees), max(len(tree) for tree in trees)
        lengths = self.slots.state.lengths
        ids = torch.zeros((rows, nodes), dtype=torch.long)
        positions = torch.zeros((rows, nodes), dtype=torch.long)
        for row, tree in enumerate(trees):
            ids[row, : len(tree)] = torch.tensor(tree.tokens)
            ids[row, len(tree):] = tree.tokens[0]
            positions[row, : len(tree)] = torch.tensor(tree.depths) + lengths[row]
            positions[row, len(tree):] = lengths[row]
        self.slots.begin_pass(nodes, device)
        mask = self._masks(trees, nodes)
        linear = core.kernels.using(core.kernel_of(rows * nodes))
        attention = core.tree_attention if core.tree_attention is not None else nullcontext()
        with linear, attention, indexed_windows(core.layout, mask) as model_mask:
            return core._forward(ids.to(device), positions.to(device), model_mask, nodes, batched=True)

    def _masks(self, trees: list[DraftTree], nodes: int) -> Any:
        """Each row's masks (``racer.engine.windows``), placed in a padded
        (rows, 1, nodes, span) tensor per mask the model takes; padding nodes see only
        themselves."""
        core, span = self.core, self.slots.state.span
        lowest = torch.finfo(core.dtype).min
        padded: dict[str, torch.Tensor] = {}
        for row, tree in enumerate(trees):
            length, size = self.slots.state.lengths[row], len(tree)
            depths = torch.tensor(tree.depths, dtype=torch.long, device=core.device)
            ancestors = torch.from_numpy(tree.ancestor_mask()).to(core.device)
            seen = core.layout.visible(length, depths, ancestors, max(tree.depths))
            for key, allowed in (seen.items() if isinstance(seen, dict) else [("", seen)]):
                if key not in padded:
                    padded[key] = torch.full((len(trees), 1, nodes, span), lowest, dtype=core.dtype,
                                             device=core.device)
                padded[key][row, 0, :size, : length + size].masked_fill_(allowed, 0)
                pads = torch.arange(size, nodes, device=core.device)
                padded[key][row, 0, pads, length + pads] = 0
        return padded[""] if "" in padded else padded

    def _read(self, trees: list[DraftTree], logits: torch.Tensor) -> tuple[list, list]:
        """Every row's chosen node tokens and the drafter's top-k ids, read in one
        transfer (a sampling walk on the CPU reads later, per node)."""
        rows, nodes = len(trees), logits.shape[1]
        k = self.needs.topk
        parts, walking = [], []
        for request, tree in zip(self._active, trees):
            chosen = request.chooser.node_tokens(tree, logits[request.row, : len(tree)], request.ids,
                                                 request.result.tokens)
            walking.append(chosen is None)
            row = torch.zeros(nodes, dtype=torch.long, device=logits.device)
            if chosen is not None:
                row[: len(tree)] = chosen
            parts.append(row)
        table = torch.stack(parts)[:, :, None]
        if k:
            table = torch.cat([table, torch.topk(logits, k, dim=-1).indices], dim=2)
        host = to_host(table)
        chosen = [None if walking[r] else host[r, : len(trees[r]), 0].tolist() for r in range(rows)]
        topk = [host[r, : len(trees[r]), 1:] if k else None for r in range(rows)]
        return chosen, topk

    def _finish(self, request: _Request, reason: str) -> None:
        if request in self._active:
            moved = self.slots.release(request.row)
            self._active.remove(request)
            for other in self._active:
                if moved is not None and other.row == moved:
                    other.row = request.row
            self._active.sort(key=lambda r: r.row)
        request.result.stop_reason = reason
        request.result.drafter_stats = request.drafter.request_stats()
        request.result.wall_s = time.perf_counter() - request.started
        request.result.text = (self.tokenizer.decode(request.result.tokens, skip_special_tokens=True)
                               if self.tokenizer is not None else "")
        self._finished[request.id] = request
