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

import copy
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable

import numpy as np
import torch

from racer.budget import AcceptanceModel, CostModel
from racer.budget.batch import BatchBudget
from racer.budget.batch_cost import BatchCostModel, rows_to_measure
from racer.budget.calibration import announce_on_stderr, load_or_measure, load_or_measure_batch
from racer.drafting import Drafter, Method, parse_method
from racer.drafting.tree import DraftTree, chain
from racer.engine.decoder import top_ids
from racer.engine.host import synchronize, to_host
from racer.engine.model_facts import ModelFacts
from racer.engine.memory import DrafterPool
from racer.engine.options import GenerationOptions, request_ids
from racer.engine.provenance import accepted_sources
from racer.engine.results import GenerationResult, StepStats
from racer.engine.sampling import TokenChooser, accept_greedy
from racer.engine.selftest import WindowCheck, random_tree, self_test
from racer.engine.slots import SlotCache
from racer.engine.stopping import Stopper, answer_text, end_token_ids
from racer.engine.verifier import TreeVerifier
from racer.engine.windows import indexed_windows
from racer.fastpaths import FastPaths


@dataclass
class Update:
    """What one step did for one request: the tokens it emitted, and whether it ended;
    each token's provenance (``GenerationResult.token_sources``), the pass's number in
    the request (0: the prefill) and the nodes verified for it (0: no pass)."""

    request: int
    tokens: list[int]
    done: bool
    sources: list[str] = field(default_factory=list)
    step: int = 0
    tree_size: int = 0


@dataclass
class _Request:
    id: int
    ids: list[int]
    options: GenerationOptions
    drafter: Drafter | None  # None once finished (handed back to its scope)
    acceptance: AcceptanceModel | None  # capacity=auto: how often this request's drafts are accepted
    chooser: TokenChooser
    stopper: Stopper
    result: GenerationResult
    verifier: TreeVerifier | None = None  # while prefilling
    prefilled: int = 0
    logits: list[torch.Tensor] = field(default_factory=list)  # prefill logits the drafter needs
    row: int | None = None
    cancelled: bool = False
    scope: Hashable | None = None
    started: float = 0.0


class BatchDecoder:
    """Decodes many requests at once with one model and one draft method.

    ``method``: a spec such as ``"racer:capacity=16"`` (each request gets a drafter
    built from it, or one a finished request of its memory scope handed back, see
    ``submit``); ``max_batch``: requests verified together (the others wait, in
    order); ``prefill_chunk``: the most prompt tokens prefilled in one step; ``cost``:
    the step-cost curve: a ``BatchCostModel`` measured on batched passes, or a
    single-request ``CostModel`` (its kernels, and its curve read per node as a rough
    prior); None: ``calibrate`` measures (or reads) both on the first step;
    ``memory_limit``: idle drafters kept for later requests of their scope (default
    ``4 x max_batch``); ``check``: self-test tree verification on this model first."""

    def __init__(self, model: Any, tokenizer: Any, method: str = "racer", *, max_batch: int = 8,
                 prefill_chunk: int = 512, cost: Any = None, check: bool = True,
                 fast_paths: bool | FastPaths = True, memory_limit: int | None = None) -> None:
        if not isinstance(method, str):
            raise ValueError(f"method: expected a method spec such as 'racer:capacity=16', got {type(method).__name__}")
        for name, value in (("max_batch", max_batch), ("prefill_chunk", prefill_chunk)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        self.model, self.tokenizer, self.spec = model, tokenizer, method
        self.method: Method = parse_method(method)  # checks the spec once
        self.max_batch, self.prefill_chunk = max_batch, prefill_chunk
        self.facts = ModelFacts.of(model)
        self.fast_paths = FastPaths.of(fast_paths).on(self.facts.device.type)
        if check:
            self_test(model)
        self.core = TreeVerifier(model, self.fast_paths, self.facts)
        self._windows = WindowCheck(model, self.core.layout, self.core.max_positions, check)
        self.pool: DrafterPool = DrafterPool(4 * max_batch if memory_limit is None else memory_limit)
        self.cost: Any = None
        self.budget: BatchBudget | None = None
        self._calibrated = False
        self._scratch: SlotCache | None = None  # calibration's caches
        if cost is not None:
            self._use_cost(cost)
        self.slots = SlotCache(model.config)
        self.core.cache = self.slots.cache
        self.end_ids = end_token_ids(model, tokenizer)
        self.needs = self.method.drafter.needs
        self._waiting: list[_Request] = []
        self._active: list[_Request] = []  # in row order
        self._finished: dict[int, _Request] = {}
        self._next_id = 0

    def fresh(self) -> "BatchDecoder":
        """A new, empty decoder with the same model, settings, cost curve and idle
        drafters (no self-test again)."""
        decoder = BatchDecoder(self.model, self.tokenizer, self.spec, max_batch=self.max_batch,
                               prefill_chunk=self.prefill_chunk, cost=self.cost, check=False,
                               fast_paths=self.fast_paths, memory_limit=self.pool.limit)
        decoder.pool = self.pool
        return decoder

    # -- set-up ---------------------------------------------------------------------
    def calibrate(self, refresh: bool = False,
                  announce: Callable[[str], None] | None = announce_on_stderr) -> None:
        """Read from the disk cache, or measure (``announce`` is told first), the
        single-request table for each pass size's linear kernel and, for a
        ``capacity=auto`` method, the cost of batched passes of 1..``max_batch`` rows.
        The first ``step`` calls this if no cost was given."""
        if self._calibrated and not refresh:
            return
        single = load_or_measure(self.model, refresh, self.fast_paths, announce)
        if not self.method.auto:
            self._use_cost(single)
            return
        self.core.set_kernels(single.kernel, single.kernels)  # the batched passes are timed with them
        try:
            table = load_or_measure_batch(self.model, rows_to_measure(self.max_batch), single, self._time_pass,
                                          refresh, self.fast_paths, announce)
        finally:
            self._scratch = None
        self._use_cost(table)

    def _use_cost(self, cost: Any) -> None:
        kernels = cost.kernel_table if isinstance(cost, BatchCostModel) else cost
        if isinstance(kernels, CostModel):
            self.core.set_kernels(kernels.kernel, kernels.kernels)
        if isinstance(cost, (CostModel, BatchCostModel)):
            # Refreshed by this decoder's steps: a copy of its own, never saved.
            cost = copy.deepcopy(cost)
            cost.path = None
        self.cost = cost
        self.budget = BatchBudget(cost) if self.method.auto else None
        self._calibrated = True

    def _time_pass(self, rows: int, nodes: int, cached: int) -> float:
        """Seconds for one batched pass of ``rows`` random trees of ``nodes`` nodes on
        caches of ``cached`` tokens, read as a step reads (for ``calibrate``)."""
        scratch = self._scratch
        if scratch is None or scratch.rows < self.max_batch or scratch.state.lengths[0] < cached:
            verifier = TreeVerifier(self.model, self.fast_paths, self.facts, self.core.layout)
            rng = np.random.default_rng(0)
            verifier.prefill([int(t) for t in rng.integers(self.facts.vocab_size, size=cached)])
            scratch = self._scratch = SlotCache(self.model.config)
            for _ in range(self.max_batch):
                scratch.admit(verifier.cache, cached)
        rng = np.random.default_rng(rows * 1000 + nodes)
        trees = [random_tree(rng, self.facts.vocab_size, nodes, max(1, min(nodes - 1, 8))) for _ in range(rows)]
        own, full = self.slots, scratch.state.lengths
        scratch.state.lengths = [cached] * rows
        self.slots, self.core.cache = scratch, scratch.cache
        try:
            synchronize(self.core.device)
            start = time.perf_counter()
            logits = self._forward(trees)
            to_host(logits.argmax(dim=-1))
            return time.perf_counter() - start
        finally:
            self.slots, self.core.cache = own, own.cache
            scratch.state.lengths = full

    # -- requests -------------------------------------------------------------------
    def submit(self, prompt: Any, options: GenerationOptions | None = None, *, scope: Hashable | None = None,
               **fields: Any) -> int:
        """Queue a request (text, chat messages or token ids); returns its id.

        ``scope``: requests of one scope share drafter memory: this request drafts with
        the drafter a finished request of the scope handed back last (if one is idle)
        and hands it back when it ends; None: a drafter of its own, dropped after."""
        options = GenerationOptions.of(options, fields)
        ids = request_ids(self.tokenizer, prompt, options, self.core.max_positions)
        drafter, acceptance = self.pool.take(scope, self._new_drafter)
        request = _Request(self._next_id, ids, options, drafter, acceptance,
                           TokenChooser(options, self.core.device),
                           Stopper(self.tokenizer, self.end_ids, options.stop, options.max_new_tokens),
                           GenerationResult.empty(len(ids)), scope=scope, started=time.perf_counter())
        self._next_id += 1
        self._waiting.append(request)
        return request.id

    def _new_drafter(self) -> tuple[Drafter, AcceptanceModel | None]:
        method = parse_method(self.spec)
        method.drafter.attach(self.tokenizer, set(self.end_ids))
        return method.drafter, AcceptanceModel() if method.auto else None

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

    @property
    def idle_drafters(self) -> int:
        """Drafters kept for later requests of their scope."""
        return len(self.pool)

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
        if not self._calibrated:
            self.calibrate()
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
            request.verifier = TreeVerifier(self.model, self.fast_paths, self.facts, self.core.layout)
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
        request.result.extend(chunk.tokens, ["none"], 0)
        full = verifier.cached + 1 >= self.core.max_positions
        updates.append(Update(request.id, chunk.tokens, chunk.done or full, ["none"] * len(chunk.tokens), 0, 0))
        if chunk.done or full:
            self._finish(request, request.stopper.reason if chunk.done else "context")

    def _verify(self, updates: list[Update]) -> None:
        start = time.perf_counter()
        self._windows.before(max(self.slots.state.lengths) + self.method.draft_size)
        budget = self.budget
        drafting = budget is None or budget.step_drafts()
        proposed: list[DraftTree] = []
        for request in self._active:
            root = request.result.tokens[-1]
            room = self.core.max_positions - self.slots.state.lengths[request.row]
            size = min(self.method.draft_size, request.options.max_tree, room)
            if budget is not None:
                size = budget.ask(size)
            proposed.append(request.drafter.draft(root, size) if drafting else DraftTree.single(root))
        candidates = [len(tree) for tree in proposed]
        if budget is not None and drafting:
            trees = budget.select(proposed, [r.acceptance for r in self._active], self.slots.state.lengths)
        else:
            trees = proposed
        longest = max(self.slots.state.lengths)
        drafted_at = time.perf_counter()
        logits = self._forward(trees)
        chosen, topk = self._read(trees, logits)
        verified_at = time.perf_counter()
        observing = 0.0
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
            observed_from = time.perf_counter()
            request.drafter.observe(tree, rows_topk, path)
            if request.acceptance is not None and drafting:
                request.acceptance.observe(tree, path)
            observing += time.perf_counter() - observed_from
            request.result.steps.append(StepStats(len(tree), len(path) - 1, drafted_at - start,
                                                  verified_at - drafted_at, proposed))
            chunk = request.stopper.cut(request.result.tokens, [tree.tokens[i] for i in path[1:]] + [following])
            sources = accepted_sources(tree, path)[: len(chunk.tokens)]
            request.result.extend(chunk.tokens, sources, len(request.result.steps))
            full = self.slots.state.lengths[request.row] + 1 >= self.core.max_positions
            if chunk.done or full:
                ended.append((request, request.stopper.reason if chunk.done else "context"))
            updates.append(Update(request.id, chunk.tokens, chunk.done or full, sources, len(request.result.steps),
                                  len(tree)))
        if budget is not None:
            budget.observe(len(trees), max(len(tree) for tree in trees), longest, verified_at - drafted_at,
                           time.perf_counter() - start, (drafted_at - start) + observing if drafting else None)
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
        request.result.text = answer_text(self.tokenizer, request.result.tokens, request.options.stop)
        self.pool.give_back(request.scope, (request.drafter, request.acceptance))
        request.drafter = request.acceptance = None
        self._finished[request.id] = request

