"""Whether a model can verify trees losslessly: an up-front check of its configuration
(attention implementation, layer kinds, windows), then a self-test of tree verification
against the model's own sequential decoding.

The self-test commits a branching path (nodes whose index in the pass differs from
their depth) before it verifies a second tree, so that an error of positions or
compaction fails it; its second form runs on a context longer than every window the
check found, so that an error of windows fails it too.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any, Sequence

import numpy as np
import torch

from racer.drafting.tree import DraftTree, TreeBuilder
from racer.engine.host import host_float
from racer.engine.support import UnsupportedModelError, check_supported
from racer.engine.model_facts import ModelFacts
from racer.engine.verifier import TreeVerifier

__all__ = ["UnsupportedModelError", "check_supported", "random_tree", "self_test", "sequential_logits", "tolerance"]

def tolerance(dtype: torch.dtype, scale: float) -> float:
    """Logit tolerance between batched-tree and sequential decoding, for logits of
    magnitude up to ``scale``. float32 agrees far inside the absolute bound; 16-bit
    formats keep ~3 significant digits, so their bound is relative to the logits'
    size, still far below what a wrong mask produces."""
    return 2e-3 if dtype == torch.float32 else 0.06 * max(scale, 1.0)


# Per model, which self-tests it passed: False (a short context), True (past its windows).
_checked: "weakref.WeakKeyDictionary[Any, set[bool]]" = weakref.WeakKeyDictionary()


def random_tree(rng: np.random.Generator, vocab: int, size: int, max_depth: int) -> DraftTree:
    """A random branching tree (for self-tests): each new node hangs under a random
    existing node of depth < max_depth."""
    builder = TreeBuilder(int(rng.integers(vocab)), size)
    while len(builder) < size:
        parent = int(rng.integers(len(builder)))
        if builder.depths[parent] < max_depth:
            builder.add_child(parent, int(rng.integers(vocab)))
    return builder.build()


def _plain_forward(model: Any, ids: Sequence[int], cache: Any) -> torch.Tensor:
    facts = ModelFacts.of(model)
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([list(ids)], device=facts.device), use_cache=True,
                    **{facts.cache_keyword: cache})
    return out.logits[0]


def sequential_logits(model: Any, context: Sequence[int], tree: DraftTree, prefix: Sequence[int] = ()) -> torch.Tensor:
    """Reference: each node's logits from plain decoding of context + prefix + its path,
    with the model's own masks and its own cache (sliding layers and all)."""
    try:
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
    except TypeError:  # transformers < 4.56
        cache = DynamicCache()
    _plain_forward(model, list(context) + list(prefix), cache)
    rows: dict[int, torch.Tensor] = {}
    for path in tree.leaf_paths():
        logits = _plain_forward(model, [tree.tokens[i] for i in path], copy.deepcopy(cache))
        rows.update(zip(path, logits))
    return torch.stack([rows[i] for i in range(len(tree))])


def _branching_path(tree: DraftTree) -> list[int]:
    """The path to the node whose index in the pass is furthest from its depth."""
    node = max(range(len(tree)), key=lambda i: (i - tree.depths[i], tree.depths[i]))
    return tree.path_to(node)


class WindowCheck:
    """The self-test past a model's windows, run once, before the first pass whose keys
    reach its shortest window (None: nothing to check, or checks switched off)."""

    def __init__(self, model: Any, layout: Any, limit: int, check: bool) -> None:
        self.model = model
        self.reach = layout.shortest(limit) if check else None

    def before(self, last_position: int) -> None:
        """A pass is about to reach ``last_position``."""
        if self.reach is not None and last_position >= self.reach:
            self_test(self.model, past_windows=True)
            self.reach = None


def self_test(model: Any, seed: int = 0, past_windows: bool = False) -> float:
    """Check once per model that tree verification matches sequential decoding, and
    returns the largest logit difference; raises UnsupportedModelError otherwise.

    ``past_windows``: on a context longer than every attention window the model has
    (a no-op where it has none). That costs a prefill of the longest window twice, so
    ``Decoder`` runs it the first time a request's context reaches a window, not at
    load."""
    found = check_supported(model)
    done = _checked.setdefault(model, set())
    if past_windows in done:
        return 0.0
    rng = np.random.default_rng(seed)
    facts = ModelFacts.of(model)
    vocab, limit = facts.vocab_size, facts.max_positions
    longest = found.longest(limit) if past_windows else 0
    if past_windows and not longest:
        done.add(True)
        return 0.0
    length = min(longest + 8, limit - 16) if longest else 5
    context = [int(t) for t in rng.integers(vocab, size=max(length, 1))]
    first, second = random_tree(rng, vocab, 7, 3), random_tree(rng, vocab, 7, 3)
    path = _branching_path(first)
    try:
        verifier = TreeVerifier(model)
        verifier.prefill(context)
        got = [verifier.verify(first).float()]
        verifier.commit(path, len(first))
        got.append(verifier.verify(second).float())
        want = [sequential_logits(model, context, first).float(),
                sequential_logits(model, context, second, [first.tokens[i] for i in path]).float()]
    except UnsupportedModelError:
        raise
    except Exception as err:  # an exotic modeling file: say what failed, not where
        raise UnsupportedModelError(
            f"{type(model).__name__}: tree verification failed its self-test ({type(err).__name__}: {err})"
        ) from err
    error, scale = 0.0, 0.0
    for g, w in zip(got, want):
        error = max(error, host_float((g - w).abs().max()))
        scale = max(scale, host_float(w.abs().max()))
    limit_error = tolerance(verifier.dtype, scale)
    if not error <= limit_error:
        where = f" on a {len(context)}-token context (past its {longest}-position window)" if longest else ""
        raise UnsupportedModelError(
            f"{type(model).__name__}: tree-verified logits differ from sequential decoding by {error:.3g} "
            f"(> {limit_error}){where}; this model's attention does not honour racer's tree masks"
        )
    done.add(past_windows)
    return error
