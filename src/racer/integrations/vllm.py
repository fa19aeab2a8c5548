"""RACER as a vLLM speculative proposer (``speculative_config={"method": "custom_class",
"model": "racer.integrations.vllm.RacerProposer", "num_speculative_tokens": K}``; K is
the longest chain, 16 recommended: the chain budget cuts each to what pays).

vLLM verifies chains, not trees, and tells a proposer nothing but each batch row's
context and the tokens it just sampled: no request ids, no logits. So the core here,
``ChainDrafts``, is plain Python over racer's drafters: it follows each request by its
context, finding the state that drafted for it on the row it sat on or on the row it
moved from (vLLM condenses its batch when a request finishes); a request preempted or
finished is followed by none, and its drafter goes back to a bounded pool of idle ones
whose memory the next request inherits (the drafter lifecycle of
``racer.engine.memory``, as in ``racer serve``). It learns what was accepted from
what the row sampled, and turns racer's tree into the one chain its acceptance model
rates best: one model per memory scope, taught by every row's chains, its rates drawn
from their posteriors so that no kind of node is frozen out by a high floor.
``RacerProposer`` is the thin shell vLLM builds; the model's top-k at every verified
position (RACER's copy-logit table) comes from a wrapper around the
target model's ``compute_logits``. vLLM itself is imported by nobody here: racer never
depends on it.

The method and its options come from ``RACER_VLLM_METHOD`` (default ``DEFAULT_METHOD``:
RACER with the scope's shared memory, since vLLM computes no prompt logits and a
request's own copy-logit table starts empty), who shares drafter memory from
``RACER_VLLM_MEMORY_SCOPE`` (``server``, the default, or ``request``: vLLM tells a
proposer no user). vLLM
verifies every token of a chain, so a chain ends where its next token is less likely to
be reached than a verified position costs: the floor from ``racer.budget.chain``, fitted
to the engine's own steps as they are timed here, or ``RACER_VLLM_MIN_PROB`` when set,
raised by how far recent chains fell short of what the acceptance model expected of them.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from racer import DraftTree, parse_method
from racer.budget.chain import ChainBudget
from racer.budget.selection import path_probabilities
from racer.engine.memory import DraftSession, DrafterMemory

DEFAULT_METHOD = "racer:memory=shared"  # the proposer's method where RACER_VLLM_METHOD is unset
PREFIX = 32  # how many leading tokens identify a row's request
CALIBRATION_WINDOW = 2000.0  # expected tokens past which the calibration's counts are halved
WARMUP_FLOOR = 0.3  # the floor until enough of the engine's steps are timed to fit it
CALIBRATION_PRIOR = 16.0  # pseudo-tokens, accepted as expected, before any chain is verified


def best_chain(tree: DraftTree, probabilities: Sequence[float], limit: int, min_prob: float = 0.0) -> list[int]:
    """Node indices (root excluded) of the root-to-node path of at most ``limit`` draft
    tokens whose expected accepted length, the sum of its path probabilities, is largest,
    among nodes reached with probability ``min_prob`` or more: vLLM verifies every token
    it is given, so a token unlikely to be reached costs a position of the pass for
    little."""
    return _best_path(tree, path_probabilities(tree.parents, probabilities), limit, min_prob)


def _best_path(tree: DraftTree, path_p: Sequence[float], limit: int, min_prob: float) -> list[int]:
    """``best_chain`` from the nodes' path probabilities."""
    gain = [0.0] * len(tree)
    for i in range(1, len(tree)):
        gain[i] = gain[tree.parents[i]] + path_p[i]
    best, best_gain = 0, 0.0
    for i in range(1, len(tree)):
        if tree.depths[i] <= limit and path_p[i] >= min_prob and gain[i] > best_gain:
            best, best_gain = i, gain[i]
    return tree.path_to(best)[1:] if best else []


SCOPES = {"server": "server", "request": None}  # vLLM tells a proposer nothing of a request's user


def method_from_env() -> str:
    """``RACER_VLLM_METHOD``: the proposer's method spec (``DEFAULT_METHOD`` when unset)."""
    return os.environ.get("RACER_VLLM_METHOD", DEFAULT_METHOD)


def scope_from_env() -> str | None:
    """``RACER_VLLM_MEMORY_SCOPE``: ``server`` (the default: every request shares the
    idle drafters and, with ``memory=shared``, one shared memory, as racer serve's
    default) or ``request`` (nobody shares)."""
    text = os.environ.get("RACER_VLLM_MEMORY_SCOPE", "server")
    if text not in SCOPES:
        raise ValueError(f"RACER_VLLM_MEMORY_SCOPE: expected one of {', '.join(SCOPES)}, got {text!r}")
    return SCOPES[text]


@dataclass
class _Row:
    session: DraftSession
    prefix: tuple[int, ...]  # the request's first tokens
    length: int  # context length when it last drafted, root included
    chain: DraftTree | None  # the chain it proposed then
    expected: float = 0.0  # the chain's expected accepted length, as the acceptance model rated it


class ChainDrafts:
    """Per batch row, a racer drafter and the chain it proposes next."""

    def __init__(self, method: str = DEFAULT_METHOD, tokens: int = 5, idle: int = 32,
                 end_ids: set[int] | None = None, tokenizer: Any = None, min_prob: float = 0.0,
                 scope: str | None = "server") -> None:
        if not 0.0 <= min_prob <= 1.0:
            raise ValueError(f"min_prob: expected a probability in [0, 1], got {min_prob}")
        self.method, self.tokens, self.idle_limit, self.min_prob = method, tokens, idle, min_prob
        self.scope = scope  # every request's memory scope (None: each its own)
        self.end_ids, self.tokenizer = set(end_ids or ()), tokenizer
        parsed = parse_method(method)  # a bad spec fails here, not at the first step
        self.size, self.needs = parsed.draft_size, parsed.drafter.needs
        self.rows: dict[int, _Row] = {}
        self.memory = DrafterMemory(self._new_drafter, rated=True, limit=idle, shared_rates=True)
        self.started = 0  # requests a row began drafting for
        self.rebuilt = 0  # of which, on rows whose last request no longer continues there (nor moved)
        self.moved = 0  # requests followed from one batch row to another
        # Verified chains: tokens proposed, accepted, and accepted as the acceptance model expected.
        self.drafted, self.accepted, self.expected = 0, 0, 0.0
        self.proposals, self.empty = 0, 0  # chains proposed to decoding rows, and of them empty ones
        self._recent = [0.0, 0.0]  # accepted and expected, halved as they grow: the calibration's window

    def _new_drafter(self) -> Any:
        drafter = parse_method(self.method).drafter
        drafter.attach(self.tokenizer, self.end_ids)
        return drafter

    def propose(self, sampled: Sequence[Sequence[int]], contexts: Sequence[Sequence[int]],
                topk: np.ndarray | None = None, min_prob: float | None = None) -> list[list[int]]:
        """One step: ``sampled[i]`` the tokens row i just emitted (empty: still in
        prefill), ``contexts[i]`` its whole context (those tokens included); ``topk``
        the model's top-k ids at every position the pass verified, in batch order (a
        decoding row's last chain, root first; one position for any other row), if
        known; ``min_prob`` this step's floor (default: the one given at construction).
        Returns each row's next chain."""
        floor = self.min_prob if min_prob is None else min_prob
        ids = [context.tolist() if hasattr(context, "tolist") else [int(t) for t in context] for context in contexts]
        states = self._follow(sampled, ids)
        spans = self._spans(states, len(sampled), topk)
        out: list[list[int]] = []
        for row, (new, context) in enumerate(zip(sampled, ids)):
            if not new:
                out.append([])
                continue
            out.append(self._row(row, states.get(row), list(new), context, spans.get(row), floor))
        return out

    def _follow(self, sampled: Sequence[Sequence[int]], contexts: list[list[int]]) -> dict[int, _Row]:
        """Each decoding row's state: the one that drafted for its request, wherever
        that request sat in the last step (vLLM moves requests between rows when others
        finish or are preempted, and tells a proposer nothing of it). States no row
        continues are ended."""
        kept: dict[int, _Row] = {}
        loose = dict(self.rows)
        for row, (new, context) in enumerate(zip(sampled, contexts)):
            state = loose.get(row)
            if new and state is not None and self._continues(state, new, context):
                kept[row] = loose.pop(row)
        for row, (new, context) in enumerate(zip(sampled, contexts)):
            if not new or row in kept:
                continue
            for at, state in loose.items():
                if self._continues(state, new, context):
                    kept[row] = loose.pop(at)
                    self.moved += 1
                    break
            else:
                self.rebuilt += row in self.rows
        for state in loose.values():
            self.memory.end(state.session)
        self.rows = kept
        return kept

    def _spans(self, states: dict[int, _Row], rows: int, topk: np.ndarray | None) -> dict[int, np.ndarray]:
        """Each decoding row's slice of the pass's top-k: its last chain's positions,
        in batch order; nothing when the counts do not add up (every other row has one
        position)."""
        if topk is None:
            return {}
        sizes = [len(states[r].chain) if r in states and states[r].chain is not None else 1 for r in range(rows)]
        if sum(sizes) != len(topk):
            return {}
        out, at = {}, 0
        for row, size in enumerate(sizes):
            if row in states:
                out[row] = topk[at : at + size]
            at += size
        return out

    def _row(self, row: int, state: _Row | None, new: list[int], context: list[int], rows_topk: np.ndarray | None,
             floor: float) -> list[int]:
        if state is None:
            self.started += 1
            session = self.memory.begin(self.scope, context[:-1], None)
            state = self.rows[row] = _Row(session, tuple(context[:PREFIX]), len(context), None)
        elif state.chain is not None:
            accepted = len(new) - 1  # the row sampled its accepted drafts, then one token of its own
            path = list(range(accepted + 1))
            if rows_topk is not None and len(rows_topk) != len(state.chain):
                rows_topk = None
            state.session.observe(state.chain, rows_topk, path)
            self.drafted += len(state.chain) - 1
            self.accepted += accepted
            self.expected += state.expected
            self._recent = [self._recent[0] + accepted, self._recent[1] + state.expected]
            if self._recent[1] > CALIBRATION_WINDOW:
                self._recent = [self._recent[0] / 2, self._recent[1] / 2]
        state.length = len(context)
        tree = state.session.draft(context[-1], self.size)
        # Rates drawn from their posteriors (Thompson sampling): with a floor above a
        # key's current estimate, a mean would never verify that key again to learn otherwise.
        rates = state.session.acceptance.probabilities(tree, explore=True)
        path_p = path_probabilities(tree.parents, rates)
        nodes = _best_path(tree, path_p, self.tokens, min(1.0, floor / self.calibration()))
        # A path's indices increase, so root + path is a subtree: sources and evidence keys kept.
        state.chain = tree.subtree([0] + nodes)
        # Expected by the rates' means, not the draws that chose it: over the chain's nodes only.
        chain = state.chain
        state.expected = sum(path_probabilities(chain.parents, state.session.acceptance.probabilities(chain))[1:])
        self.proposals += 1
        self.empty += not nodes
        return [tree.tokens[i] for i in nodes]

    def calibration(self) -> float:
        """Accepted over expected draft tokens of the recent chains, at most 1: a chain
        is the best-rated path of its tree, so its rates run high (the winner of many
        candidates was also the luckiest estimate); the floor is raised by as much, so a
        token is verified where its calibrated probability clears it."""
        accepted, expected = self._recent
        return min(1.0, max(0.25, (accepted + CALIBRATION_PRIOR) / (expected + CALIBRATION_PRIOR)))

    @staticmethod
    def _continues(state: _Row, new: list[int], context: list[int]) -> bool:
        """Whether the row still holds the request it drafted for: the same first tokens,
        its context grown by exactly what it sampled, and the accepted tokens the
        chain's own."""
        if tuple(context[: len(state.prefix)]) != state.prefix or len(context) != state.length + len(new):
            return False
        if state.chain is None:
            return True
        chain = list(state.chain.tokens[1:])
        return (len(new) <= len(chain) + 1 and new[:-1] == chain[: len(new) - 1]
                and context[state.length - 1] == state.chain.tokens[0])


def stats_every_from_env() -> int:
    """``RACER_VLLM_STATS``: every how many steps the proposer reports (0, the default: never)."""
    text = os.environ.get("RACER_VLLM_STATS", "0")
    if not text.isdigit():
        raise ValueError(f"RACER_VLLM_STATS: expected a number of steps (0: never), got {text!r}")
    return int(text)


def min_prob_from_env() -> float | None:
    """``RACER_VLLM_MIN_PROB``: the least probability of being reached that a chain's
    last token may have, or ``auto`` (the default, None here): measured from the
    engine's steps (``racer.budget.chain``)."""
    text = os.environ.get("RACER_VLLM_MIN_PROB", "auto")
    if text == "auto":
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"RACER_VLLM_MIN_PROB: expected 'auto' or a probability in [0, 1], got {text!r}")
    return value


class RacerProposer:
    """What vLLM's ``custom_class`` speculative method builds: ``RacerProposer(vllm_config)``,
    then ``load_model(target_model)`` and ``propose(...)`` each step."""

    def __init__(self, vllm_config: Any) -> None:
        spec = vllm_config.speculative_config
        model_config = vllm_config.model_config
        config = model_config.hf_config
        eos = getattr(config, "eos_token_id", None)
        end_ids = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
        fixed = min_prob_from_env()
        self.drafts = ChainDrafts(method_from_env(), int(spec.num_speculative_tokens),
                                  idle=4 * int(vllm_config.scheduler_config.max_num_seqs), end_ids=end_ids,
                                  min_prob=fixed or 0.0, scope=scope_from_env())
        self.budget = ChainBudget(before=WARMUP_FLOOR) if fixed is None else None
        self.needs_topk = self.drafts.needs.topk
        self._logits_rows: np.ndarray | None = None  # top-k ids of the last target pass, one row per position
        self._last: tuple[float, list[list[int]]] | None = None  # when the last step was proposed, and what
        self._report_every = stats_every_from_env()
        self._steps = 0
        # Seconds spent here (the proposer's own work, which the engine's step waits
        # for) since the report window began (None: at the next call).
        self._spent, self._window = 0.0, None

    def load_model(self, target_model: Any) -> None:
        """Wrap the target's ``compute_logits``: each call's top-k ids (one row per
        verified position, the batch's rows in order) are kept for the next ``propose``."""
        if not self.needs_topk:
            return
        import torch

        from racer.engine.host import to_host

        inner = target_model.compute_logits
        k = self.needs_topk

        def compute_logits(hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
            logits = inner(hidden_states, *args, **kwargs)
            if logits is not None:
                with torch.no_grad():
                    self._logits_rows = to_host(torch.topk(logits, k, dim=-1).indices)
            return logits

        target_model.compute_logits = compute_logits

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: Any, token_ids_cpu: Any,
                slot_mappings: Any = None, **_: Any) -> list[list[int]]:
        now = time.perf_counter()
        contexts = [token_ids_cpu[i, : int(num_tokens_no_spec[i])] for i in range(len(sampled_token_ids))]
        rows = self._logits_rows
        self._logits_rows = None
        floor = self.budget.floor() if self.budget is not None else None
        before = (self.drafts.started, self.drafts.rebuilt, self.drafts.moved)
        chains = self.drafts.propose(sampled_token_ids, contexts, rows, floor)
        if self.budget is not None and (self.drafts.started, self.drafts.rebuilt, self.drafts.moved) == before:
            self._time_step(now, sampled_token_ids)
        if self._window is None:
            self._window = now
        self._spent += time.perf_counter() - now
        self._last = (now, chains)
        self._steps += 1
        if self._report_every and self._steps % self._report_every == 0:
            self._report(floor)
        return chains

    def _report(self, floor: float | None) -> None:
        """One line on stderr (the server's log): the chain budget's fit and how the
        acceptance model's expectation compares with what was accepted."""
        drafts, fit = self.drafts, self.budget.fit() if self.budget is not None else None
        cost = f"{fit[0] * 1e3:.2f} ms per draft token at {fit[1]:.1f} tokens/s" if fit else "no fit"
        print(f"racer proposer after {self._steps} steps: floor {floor if floor is not None else drafts.min_prob:.3f} "
              f"({cost}), calibration {drafts.calibration():.2f}; {drafts.empty} of {drafts.proposals} chains "
              f"empty; drafted {drafts.drafted}, accepted {drafts.accepted}, expected {drafts.expected:.1f}; "
              f"proposing took {self._spent * 1e3 / self._report_every:.2f} ms a step, "
              f"{self._spent / max(time.perf_counter() - self._window, 1e-9):.1%} of the steps' time",
              file=sys.stderr, flush=True)
        self._spent, self._window = 0.0, None

    def _time_step(self, now: float, sampled: list[list[int]]) -> None:
        """Time the pass since the last ``propose``, which verified its chains, if it
        held the same requests decoding and nothing else: no prefill, no request in or
        out (a new request's first step would also hold the idle time before it)."""
        if self._last is None:
            return
        then, chains = self._last
        if len(chains) == len(sampled) and all(0 < len(s) <= len(c) + 1 for s, c in zip(sampled, chains)):
            self.budget.observe(len(chains), sum(map(len, chains)), sum(map(len, sampled)), now - then)
