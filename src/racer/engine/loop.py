"""The decoding engine: requests join and leave between steps, and each step verifies
every decoding request's draft tree in one pass. A single request is a batch of one
(``racer.Decoder`` is a front over this engine with one row).

Joining requests are prefilled in chunks, at most ``prefill_chunk`` prompt tokens a
step in all, so long prompts delay the requests already decoding by a bounded amount a
step. Where the rows pack (``racer.engine.rows``), a step takes chunks of as many
waiting requests, in order, as that bound and the free rows allow, and each request
holds its row from its first chunk: a chunk that is not its prompt's last rides in the
step's one pass beside the decoding rows' trees (``_rides``), and the prompts' last
chunks share a pass of their own first, so that their first tokens leave at once;
elsewhere the first waiting request's chunk is a pass of its own and the request takes
a row when its prefill is done. Each step: the budget says
whether to draft and how many candidates to ask for; each request's drafter proposes a
tree; the budget keeps the part of each worth verifying; one pass verifies them all;
each row accepts its path (greedy, or exact sampling), keeps its KV, and its drafter
and acceptance model learn what the pass revealed.

The engine knows nothing of how drafts are made: it talks to drafters through the
interface of ``racer.drafting.base`` and the lifecycle of ``racer.engine.memory``.
"""

from __future__ import annotations

import copy
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable

import numpy as np
import torch

from racer.budget import BatchBudget, Budget, CostModel, DraftBudget, StepTiming, WholeTree
from racer.budget.batch_cost import BatchCostModel, rows_to_measure
from racer.drafting import Drafter, Method, parse_method
from racer.drafting.tree import DraftTree
from racer.engine.calibration import announce_on_stderr, load_or_measure
from racer.engine.host import to_host
from racer.engine.memory import DraftSession, DrafterMemory
from racer.engine.model_facts import ModelFacts
from racer.engine.options import GenerationOptions, request_ids
from racer.engine.prompt_head import PromptHead, latest_positions, spread
from racer.engine.provenance import accepted_sources
from racer.engine.results import GenerationResult, StepStats
from racer.engine.rows import Chunk, OneRow, Prompt, Rows, SlotRows
from racer.engine.sampling import TokenChooser, accept_greedy
from racer.engine.selftest import WindowCheck, self_test
from racer.engine.stopping import Stopper, answer_text, end_token_ids
from racer.engine.verifier import TreeVerifier
from racer.fastpaths import FastPaths


PROMPT_WINDOW = 0  # prompt positions whose predictions a drafter with Needs.prompt sees (0: all)


def top_ids(logits: torch.Tensor, k: int) -> np.ndarray:
    """The ``k`` most likely token ids of each row, as a host array."""
    return to_host(torch.topk(logits, k, dim=-1).indices)


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
    """One request, from ``submit`` to its result."""

    id: int
    ids: list[int]  # the prompt
    options: GenerationOptions
    chooser: TokenChooser
    stopper: Stopper
    result: GenerationResult  # its tokens are the context after the prompt
    scope: Hashable | None
    started: float
    session: DraftSession | None = None  # from the end of its prefill to its finish
    prompt: Prompt | None = None  # while prefilling
    logits: list[torch.Tensor] = field(default_factory=list)  # prefill rows the drafter needs (logits or hidden)
    last_logits: torch.Tensor | None = None  # the prompt's last position, until drafting begins
    deferred: bool = False  # ``logits`` holds hidden states for ``PromptHead``
    row: int | None = None
    cancelled: bool = False


def resolve_method(method: str | Drafter | Method, capacity: int | str | None = None) -> Method:
    """A method spec, a ``Drafter`` or a ``Method``, with ``capacity`` overriding its own."""
    if isinstance(method, str):
        return parse_method(method, capacity)
    if isinstance(method, Method):
        return method if capacity is None else Method.of(method.drafter, capacity)
    return Method.of(method, capacity)  # a Drafter, or a clear error


class BatchDecoder:
    """Decodes requests with one model and one draft method, up to ``max_batch`` of them
    verified together (the others wait, in order).

    ``method``: a spec such as ``"racer:capacity=16"`` (each request gets a drafter built
    from it, or one a finished request of its memory scope handed back, see ``submit``),
    or, with ``max_batch=1``, a ``Drafter`` or ``Method`` (that one drafter serves every
    request); ``capacity`` overrides the method's (``"auto"``: each step the draft budget
    keeps the part of the candidate trees worth verifying on this hardware; a number: a
    fixed size). ``prefill_chunk``: the most prompt tokens prefilled in one step.
    ``cost``: the step-cost curve; None: ``calibrate`` reads or measures it on the first
    step. With one row it is read per tree size (a ``CostModel``); with more, a
    ``BatchCostModel`` measured on batched passes, or a one-row curve read per node as a
    rough prior. A measured curve also says which linear kernel verifies each pass size
    fastest. The engine refreshes its curve with its steps; a table it read or measured
    itself is saved back to the disk cache whenever the last request in flight finishes,
    a curve given here is copied and never saved.
    ``memory_limit``: idle drafters kept for later requests of their scope (default
    ``4 x max_batch``); ``fast_paths``: ``False`` verifies with the model's own code
    only, or a ``FastPaths`` switches each fast path on its own; ``check``: self-test tree
    verification on this model first (and, the first time a request's context reaches
    one of its attention windows, past its windows). ``detokenize``: False leaves every
    result's ``text`` empty, for a caller that decodes the tokens where it answers (a
    server's API process). ``prompt_window``: a drafter that reads the model's
    predictions over the prompt (``Needs.prompt``) gets them at the prompt's last
    ``prompt_window`` positions (0: at every one, the LM head over the whole prompt).

    ``seconds`` adds up, over the engine's life, where its steps spent their time:
    ``prefill`` (prompt chunks and the first token), ``draft`` (proposing, choosing,
    the drafters' and acceptance models' updates), ``verify`` (the pass, reading it,
    acceptance, keeping the accepted KV), ``emit`` (stop checks and results) and
    ``finish`` (ending requests, their text included)."""

    def __init__(self, model: Any, tokenizer: Any, method: str | Drafter | Method = "racer", *,
                 max_batch: int = 8, prefill_chunk: int = 512, capacity: int | str | None = None, cost: Any = None,
                 check: bool = True, fast_paths: bool | FastPaths = True, memory_limit: int | None = None,
                 detokenize: bool = True, prompt_window: int = PROMPT_WINDOW, prefix_cache_mib: int = 0) -> None:
        for name, value in (("max_batch", max_batch), ("prefill_chunk", prefill_chunk)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        if isinstance(prefix_cache_mib, bool) or not isinstance(prefix_cache_mib, int) or prefix_cache_mib < 0:
            raise ValueError(f"prefix_cache_mib: expected a non-negative integer (MiB), got {prefix_cache_mib!r}")
        if isinstance(prompt_window, bool) or not isinstance(prompt_window, int) or prompt_window < 0:
            raise ValueError(f"prompt_window: expected 0 (every position) or a positive integer, got {prompt_window!r}")
        if not isinstance(method, str) and max_batch > 1:
            raise ValueError(f"method: a {type(method).__name__} drafts for one request at a time; pass a method "
                             "spec such as 'racer:capacity=16' for max_batch > 1")
        self.model, self.tokenizer = model, tokenizer
        self.spec, self.capacity = method, capacity
        self.method: Method = resolve_method(method, capacity)  # checks the spec once
        self.max_batch, self.prefill_chunk = max_batch, prefill_chunk
        self.detokenize, self.prompt_window = detokenize, prompt_window
        self.seconds = dict.fromkeys(("prefill", "draft", "verify", "emit", "finish"), 0.0)
        self.facts = ModelFacts.of(model)
        self.fast_paths = FastPaths.of(fast_paths).on(self.facts.device.type)
        if check:
            self_test(model)
        self.verifier = TreeVerifier(model, self.fast_paths, self.facts)
        self.prompt_head = PromptHead(model, self.verifier.kernels if self.fast_paths.kernels else None)
        # The self-test past the model's windows waits for the first pass that reaches one.
        self._windows = WindowCheck(model, self.verifier.layout, self.verifier.max_positions, check)
        self.prefix_cache_mib = prefix_cache_mib
        self.rows: Rows = (OneRow(self.verifier) if max_batch == 1
                           else SlotRows(self.verifier, model.config, prefix_cache_mib << 20, max_batch))
        self.end_ids = end_token_ids(self.facts.end_ids, tokenizer)
        self.needs = self.method.drafter.needs
        # Attached now, so that a drafter that cannot serve this model (a datastore of
        # another tokenizer) is refused here, not at the first request.
        self.method.drafter.attach(tokenizer, set(self.end_ids))
        self.memory = DrafterMemory(self._new_drafter, self.method.auto,
                                    4 * max_batch if memory_limit is None else memory_limit)
        self.cost: Any = None
        self.budget: Budget = WholeTree()
        self.lone_budget: Budget | None = None  # with more rows, for steps that hold one request
        self._calibrated = False
        if cost is not None or not self._needs_costs():
            self._use_cost(cost)
        self._waiting: list[_Request] = []
        self._active: list[_Request] = []  # in row order
        self._finished: dict[int, _Request] = {}
        self._next_id = 0
        self._unsaved = False  # the cost curve learnt since it was last saved

    def fresh(self) -> "BatchDecoder":
        """A new, empty engine with the same model, settings, cost curve and idle
        drafters (no self-test again)."""
        engine = BatchDecoder(self.model, self.tokenizer, self.spec, max_batch=self.max_batch,
                              prefill_chunk=self.prefill_chunk, capacity=self.capacity, cost=self.cost, check=False,
                              fast_paths=self.fast_paths, memory_limit=self.memory.pool.limit,
                              detokenize=self.detokenize, prompt_window=self.prompt_window,
                              prefix_cache_mib=self.prefix_cache_mib)
        engine.memory = self.memory
        return engine

    def _new_drafter(self) -> Drafter:
        if not isinstance(self.spec, str):  # one drafter serves every request
            return self.method.drafter
        drafter = resolve_method(self.spec).drafter
        drafter.attach(self.tokenizer, set(self.end_ids))
        return drafter

    # -- set-up ---------------------------------------------------------------------
    def _needs_costs(self) -> bool:
        # A lone request that never drafts verifies one token a pass: nothing to choose.
        return self.method.drafts or self.max_batch > 1

    def calibrate(self, refresh: bool = False,
                  announce: Callable[[str], None] | None = announce_on_stderr) -> None:
        """Read from the disk cache, or measure (``announce`` is told first), the cost
        table this engine needs: the one-tree table for each pass size's linear kernel
        (and, with one row and ``capacity=auto``, for the draft budget), and, with more
        rows and ``capacity=auto``, the cost of batched passes of 1..``max_batch`` rows.
        The first ``step`` calls this if nobody did."""
        if self._calibrated and not refresh:
            return
        batched = self.method.auto and self.max_batch > 1
        rows = rows_to_measure(self.max_batch) if batched else None
        self._use_cost(load_or_measure(self.model, refresh, self.fast_paths, announce, rows=rows), own=True)

    def _use_cost(self, cost: Any, own: bool = False) -> None:
        """``own``: a table ``calibrate`` read or measured, saved back as it learns; a
        curve given as ``cost`` stays the caller's: the engine learns on a copy of it,
        which it never saves."""
        if cost is not None and not own:
            cost = copy.deepcopy(cost)
            if hasattr(cost, "path"):
                cost.path = None
        one_tree = cost.kernel_table if isinstance(cost, BatchCostModel) else cost
        if isinstance(one_tree, CostModel):
            self.verifier.set_kernels(one_tree.kernel, one_tree.used_kernels)
        self.cost = cost
        self.lone_budget = None
        if not self.method.auto or cost is None:
            self.budget = WholeTree()
        elif self.max_batch == 1:
            self.budget = DraftBudget(cost)
        else:
            self.budget = BatchBudget(cost)
            if one_tree is not None:
                # A step with one request in it is chosen per node, as a lone request's.
                self.lone_budget = DraftBudget(one_tree)
        self._calibrated = True

    # -- requests -------------------------------------------------------------------
    def submit(self, prompt: Any, options: GenerationOptions | None = None, *, scope: Hashable | None = None,
               result: GenerationResult | None = None, request_id: int | None = None, **fields: Any) -> int:
        """Queue a request (text, chat messages or token ids); returns its id. Options
        come as a ``GenerationOptions`` and/or as its fields by keyword.

        ``scope``: requests of one scope share drafter memory: this request drafts with
        the idle drafter of the scope that holds the longest start of its prompt, else the
        one a finished request of the scope handed back last (if one is idle)
        and hands it back when it ends; None: a drafter of its own, dropped after.
        ``result``: where the request's tokens and statistics go as it decodes (emptied
        first; ``self.result`` hands it back at the end), for a caller that shows them
        as they come. ``request_id``: the id to give it (a caller's own key; not one in
        flight or unclaimed), else the next free one."""
        started = time.perf_counter()
        if request_id is not None:
            if isinstance(request_id, bool) or not isinstance(request_id, int) or request_id < 0:
                raise ValueError(f"request_id: expected a non-negative integer, got {request_id!r}")
            if request_id in self._finished or request_id in self.in_flight:
                raise ValueError(f"request_id: {request_id} is in flight or its result is unclaimed")
        options = GenerationOptions.of(options, fields)
        ids = request_ids(self.tokenizer, prompt, options, self.verifier.max_positions)
        if result is None:
            result = GenerationResult.empty(len(ids))
        else:
            result.restart(len(ids))
        request = _Request(self._next_id if request_id is None else request_id, ids, options, TokenChooser(options, self.verifier.device),
                           Stopper(self.tokenizer, self.end_ids if options.end_ids is None else set(options.end_ids),
                                   options.stop, options.max_new_tokens),
                           result, scope, started)
        self._next_id = max(self._next_id, request.id) + 1
        self._waiting.append(request)
        return request.id

    def cancel(self, request: int) -> None:
        """End a request at the next step (a client that went away)."""
        for queued in self._waiting + self._active:
            if queued.id == request:
                queued.cancelled = True

    def result(self, request: int) -> GenerationResult:
        """A finished request's result (its tokens, text and per-step statistics),
        handed over once: the engine keeps nothing of a request after that."""
        if request not in self._finished:
            raise KeyError(f"request: {request} has not finished (or its result was taken)")
        return self._finished.pop(request).result

    @property
    def in_flight(self) -> list[int]:
        """The ids of the requests waiting or decoding."""
        return [r.id for r in self._waiting + self._active]

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
        return len(self.memory)

    def generate_all(self, prompts: Iterable[Any], **fields: Any) -> list[GenerationResult]:
        """Decode every prompt together (options as ``submit``)."""
        ids = [self.submit(prompt, **fields) for prompt in prompts]
        while self.busy:
            self.step()
        return [self.result(i) for i in ids]

    # -- one step -------------------------------------------------------------------
    def step(self, early: Callable[[list[Update]], None] | None = None) -> list[Update]:
        """Prefill chunks of waiting requests (``_next_chunks``) and one pass over the
        decoding ones: a chunk rides in that pass where the rows pack, some request
        decodes and it is not its prompt's last, else the chunks' pass comes first.
        Returns what each request emitted.
        ``early``: told what the step emitted so far before work the tokens need not wait
        for (the decoding requests' pass after a chunk's own pass; a joining request's
        drafter learning its prompt after the shared one); those updates are then left
        out of what ``step`` returns."""
        if not self._calibrated:
            self.calibrate()
        updates: list[Update] = []
        for request in [r for r in self._waiting + self._active if r.cancelled]:
            if request in self._waiting:
                self._waiting.remove(request)
            self._finish(request, "cancelled")
            updates.append(Update(request.id, [], True))
        chunks = self._next_chunks()
        riding = chunks.pop() if chunks and self._rides(*chunks[-1]) else None
        if chunks:
            start = time.perf_counter()
            with self._capture([request for request, _ in chunks]) as hidden:
                self.rows.prefill([chunk for _, chunk in chunks])
            seconds = time.perf_counter() - start
            tokens = sum(len(chunk.tokens) for _, chunk in chunks)
            joined = [self._chunk_done(request, chunk, hidden, updates, seconds * len(chunk.tokens) / tokens)
                      for request, chunk in chunks]
            updates = self._join([request for request in joined if request is not None], updates, early,
                                 always=True)
        if self._active:
            updates = self._join(self._verify(updates, riding), updates, early)
        if self._unsaved and not self.busy:
            self._save_cost()
        return updates

    def _join(self, joined: list[_Request], updates: list[Update], early: Callable[[list[Update]], None] | None,
              always: bool = False) -> list[Update]:
        """Hand ``updates`` to ``early`` (where given) before the ``joined`` requests'
        drafters learn their prompts (or, ``always``, before the pass still to come);
        returns what is left for ``step`` to return."""
        if early is not None and updates and (always or joined):
            early(updates)
            updates = []
        for request in joined:
            self._begin_drafting(request)
        return updates

    def _save_cost(self) -> None:
        save = getattr(self.cost, "save", None)
        if save is not None:
            save()
        self._unsaved = False

    def _rides(self, request: _Request, chunk: Chunk) -> bool:
        """Whether ``chunk`` (of ``request``'s prompt) rides in the decoding rows' pass:
        where the rows pack, and not the prompt's last chunk, which takes a pass of its
        own first (with the other prompts' last chunks of the step), so that the
        request's first token leaves at once and the request joins this step's pass
        rather than the next one's (riding saves only the trees' pass's fixed costs,
        which the joining request would pay for with a whole step's wait)."""
        last = chunk.prompt.cached + len(chunk.tokens) >= len(request.ids)
        return self.rows.packs and bool(self._active) and not last

    def _next_chunks(self) -> list[tuple[_Request, Chunk]]:
        """The prompt chunks this step prefills: the waiting requests' in order, at most
        ``prefill_chunk`` tokens in all, while rows are free (so at most the last of them
        is not its prompt's last chunk). Where the rows do not pack, the first waiting
        request's only: its prompt is prefilled on a verifier of its own. A request whose
        prompt shares more leading tokens with one prefilled in this step than with any
        kept prefix waits until that one is kept (``Rows.waits_for``): it then computes
        only the rest."""
        room, chunks = self.prefill_chunk, []
        holding = len(self._active) + sum(request.prompt is not None for request in self._waiting)
        for request in self._waiting:
            if room == 0 or (chunks and not self.rows.packs):
                break
            if request.prompt is None:
                ahead = [other.ids for other, _ in chunks if other.scope == request.scope]
                if holding >= self.max_batch or self.rows.waits_for(request.scope, request.ids, ahead):
                    break
                holding += 1
            chunk = self._next_chunk(request, room)
            room -= len(chunk.tokens)
            chunks.append((request, chunk))
        return chunks

    def _next_chunk(self, request: _Request, room: int) -> Chunk:
        """The next chunk of ``request``'s prompt, at most ``room`` tokens (its prefill
        begins with the first)."""
        if request.prompt is None:
            # A kept prefix of the prompt (``racer.engine.prefixes``) is not computed again.
            request.prompt = self.rows.begin_prompt(request.ids, request.scope)
            request.result.prompt_reused = request.prompt.cached
            request.deferred = self.needs.prompt and self.prompt_head.usable
        done = request.prompt.cached
        # Predictions over the prompt for a drafter that reads them: from the LM head
        # after the first token has left (``racer.engine.prompt_head``) where this model
        # allows it, else in this pass. ``prompt_window`` keeps them to its last positions
        # (a reused prefix has none: the drafter sees the rows computed here).
        return Chunk(request.prompt, request.ids[done : done + room], 1 if request.deferred else self._window)

    @property
    def _window(self) -> int:
        """The prompt's last positions whose predictions the drafter gets (0: all)."""
        return self.prompt_window if self.needs.prompt else 1

    def _capture(self, requests: list[_Request]) -> Any:
        """The prompt head's capture of the hidden states in the pass inside the block,
        where one of ``requests`` (whose chunks the pass computes) needs them."""
        return self.prompt_head.capture() if any(request.deferred for request in requests) else nullcontext([])

    def _chunk_done(self, request: _Request, chunk: Chunk, hidden: list[torch.Tensor], updates: list[Update],
                    seconds: float) -> _Request | None:
        """After ``chunk``'s pass (``hidden``: what the prompt head captured in it;
        ``seconds``: the chunk's share of the pass); returns the request once
        its prefill is done and it decodes (its drafting begins with ``_begin_drafting``)."""
        start = time.perf_counter()
        if request.deferred and not hidden:  # the model's pass went around the hooked module
            self.prompt_head.missed()
            request.deferred, request.logits = False, []  # this prompt's drafter sees its last rows only
        request.logits.append(chunk.rows_of(torch.cat(hidden)) if request.deferred else chunk.logits)
        if self._window:
            request.logits = [torch.cat(request.logits)[-self._window:]]
        if request.prompt.cached < len(request.ids):
            request.result.prefill_s += seconds + time.perf_counter() - start
            self.seconds["prefill"] += seconds + time.perf_counter() - start
            return None
        self._waiting.remove(request)
        request.last_logits = chunk.logits[-1:]
        root = request.chooser.first(request.last_logits, request.ids)
        request.row = self.rows.admit(request.prompt)
        request.prompt = None
        self._active.append(request)
        self._active.sort(key=lambda r: r.row)  # a row freed while it was prefilled took it lower
        cut = request.stopper.cut(request.result.tokens, [root])
        request.result.extend(cut.tokens, ["none"], 0)
        full = self.rows.lengths[request.row] + 1 >= self.verifier.max_positions
        updates.append(Update(request.id, cut.tokens, cut.done or full, ["none"] * len(cut.tokens), 0, 0))
        request.result.prefill_s += seconds + time.perf_counter() - start
        self.seconds["prefill"] += seconds + time.perf_counter() - start
        if cut.done or full:
            request.logits, request.last_logits = [], None
            self._finish(request, request.stopper.reason if cut.done else "context")
            return None
        return request

    def _begin_drafting(self, request: _Request) -> None:
        """Once the request's first token is out (to ``step``'s ``early``, where given):
        its prompt's KV is kept, and its drafter learns its prompt (and the model's
        predictions over it, for a drafter that reads them)."""
        start = time.perf_counter()
        # Kept now, not only when it finishes: requests of its scope that arrive while it
        # decodes (concurrent sessions, one system prompt) start from its prompt's KV.
        self.rows.keep(request.row, request.scope, request.ids)
        prompt_topk = None
        if self.needs.topk:
            rows = torch.cat(request.logits)
            covered, at = len(rows), None
            if self.needs.prompt_rows == "latest" and covered > 1:
                at = latest_positions(request.ids[len(request.ids) - len(rows) :])
                rows = rows[torch.from_numpy(at).to(rows.device)]
            if request.deferred:
                prompt_topk = self.prompt_head.top_ids(rows, request.last_logits, self.needs.topk)
                if prompt_topk is None:  # this model's head is its own: its last position only
                    prompt_topk, at = top_ids(request.last_logits, self.needs.topk), None
            else:
                prompt_topk = top_ids(rows, self.needs.topk)
            if at is not None:
                prompt_topk = spread(prompt_topk, at, covered)
        request.session = self.memory.begin(request.scope, request.ids, prompt_topk)
        request.logits, request.last_logits = [], None
        request.result.prefill_s += time.perf_counter() - start
        self.seconds["prefill"] += time.perf_counter() - start

    def _verify(self, updates: list[Update], riding: tuple[_Request, Chunk] | None = None) -> list[_Request]:
        """One step over the decoding requests, with ``riding`` (a waiting request and a
        chunk of its prompt) in the same pass where given; returns that request if its
        prefill is done and it decodes from the next step. Every request's ``StepStats``
        holds the step's times: ``draft_s`` proposing, choosing and the drafters'
        updates, ``verify_s`` the pass, reading it, acceptance and keeping the accepted
        KV (with a chunk in the pass, the trees' share of the pass, in proportion to the
        positions each computes)."""
        start = time.perf_counter()
        rows = [request.row for request in self._active]
        lengths = [self.rows.lengths[row] for row in rows]
        self._windows.before(max(lengths) + self.method.draft_size)
        budget = self.lone_budget if self.lone_budget is not None and len(self._active) == 1 else self.budget
        budget.packed = self.rows.packs
        drafting = budget.drafts()
        proposed: list[DraftTree] = []
        for request, length in zip(self._active, lengths):
            root = request.result.tokens[-1]
            room = self.verifier.max_positions - length
            size = budget.ask(min(self.method.draft_size, request.options.max_tree, room))
            proposed.append(request.session.draft(root, size) if drafting else DraftTree.single(root))
        candidates = [len(tree) for tree in proposed]
        trees = budget.select(proposed, [r.session.acceptance for r in self._active], lengths) if drafting else proposed
        drafted_at = time.perf_counter()
        joining, chunk = riding if riding is not None else (None, None)
        with self._capture([joining] if joining is not None else []) as hidden:
            logits = self.rows.forward(trees, rows, chunk)
        chosen, topk = self._read(trees, logits)
        accepted = []
        for i, (request, tree, tokens, rows_topk) in enumerate(zip(self._active, trees, chosen, topk)):
            row_logits = logits[i, : len(tree)]
            if tokens is None:  # a sampling walk on the CPU
                path, following = request.chooser.walk(tree, row_logits, request.ids, request.result.tokens)
            else:
                path = accept_greedy(tree, tokens)
                following = tokens[path[-1]]
            if self.needs.at == "last" and self.needs.topk:
                rows_topk = (rows_topk[path[-1] : path[-1] + 1] if rows_topk is not None
                             else top_ids(row_logits[path[-1] : path[-1] + 1], self.needs.topk))
            self.rows.commit(request.row, path, len(tree))
            accepted.append((path, following, rows_topk))
        pass_s = time.perf_counter() - drafted_at
        chunk_s = 0.0
        if chunk is not None:  # the chunk's share of the pass, by the positions it computed
            nodes = sum(len(tree) for tree in trees)
            chunk_s = pass_s * len(chunk.tokens) / (len(chunk.tokens) + nodes)
            pass_s -= chunk_s
        for request, tree, (path, _, rows_topk) in zip(self._active, trees, accepted):
            request.session.observe(tree, rows_topk, path, rated=drafting)
        step_s = time.perf_counter() - start - chunk_s
        draft_s = step_s - pass_s
        if chunk is None:  # a pass that carried a prompt chunk says little of what trees cost
            budget.observe(StepTiming(trees, lengths, pass_s, step_s, draft_s if drafting else None))
        self.seconds["draft"] += draft_s
        self.seconds["verify"] += pass_s
        emitting = time.perf_counter()
        ended = []
        for request, tree, (path, following, _), size in zip(list(self._active), trees, accepted, candidates):
            request.result.steps.append(StepStats(len(tree), len(path) - 1, draft_s, pass_s, size))
            cut = request.stopper.cut(request.result.tokens, [tree.tokens[i] for i in path[1:]] + [following])
            sources = accepted_sources(tree, path)[: len(cut.tokens)]
            request.result.extend(cut.tokens, sources, len(request.result.steps))
            full = self.rows.lengths[request.row] + 1 >= self.verifier.max_positions
            if cut.done or full:
                ended.append((request, request.stopper.reason if cut.done else "context"))
            updates.append(Update(request.id, cut.tokens, cut.done or full, sources, len(request.result.steps),
                                  len(tree)))
        self._unsaved = True
        self.seconds["emit"] += time.perf_counter() - emitting
        for request, reason in ended:  # after the loop: releasing a row moves another
            self._finish(request, reason)
        joined = self._chunk_done(joining, chunk, hidden, updates, chunk_s) if joining is not None else None
        return [joined] if joined is not None else []

    def _read(self, trees: list[DraftTree], logits: torch.Tensor) -> tuple[list, list]:
        """Every row's chosen node tokens and the drafter's top-k ids, read in one
        transfer. A sampling walk on the CPU reads later, node by node; where choosers
        walk on the CPU, reading costs nothing, so the top-k of a drafter that needs the
        last accepted node's only is taken once the path is known."""
        rows, nodes = len(trees), logits.shape[1]
        late = self.needs.at == "last" and not any(r.chooser.batched for r in self._active)
        k = 0 if late else self.needs.topk
        parts, walking = [], []
        for i, (request, tree) in enumerate(zip(self._active, trees)):
            chosen = request.chooser.node_tokens(tree, logits[i, : len(tree)], request.ids, request.result.tokens)
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
        start = time.perf_counter()
        row = request.row if request in self._active else request.prompt.row if request.prompt is not None else None
        if row is not None:
            self.rows.keep(row, request.scope, request.ids + request.result.tokens)
            moved = self.rows.release(row)
            if request in self._active:
                self._active.remove(request)
            for other in self._active + self._waiting:
                if moved is None:
                    break
                if other.row == moved:
                    other.row = row
                elif other.prompt is not None and other.prompt.row == moved:
                    other.prompt.row = row
            self._active.sort(key=lambda r: r.row)
        request.prompt = None
        result = request.result
        result.stop_reason = reason
        if request.session is not None:
            result.drafter_stats = self.memory.end(request.session)
            request.session = None
        result.wall_s = time.perf_counter() - request.started
        if self.detokenize:
            result.text = answer_text(self.tokenizer, result.tokens, request.options.stop)
        self._finished[request.id] = request
        self.seconds["finish"] += time.perf_counter() - start
