"""Measuring the step-cost table on the model itself (one pass per size and linear
kernel in each of four shuffled rounds, the fastest kept; and which kernel prefills a
prompt fastest) and caching it on disk.

A kernel is offered only where it gives the logits the model's own layers give
(checked once, to the tolerance of tree verification itself). Measuring takes tens of
seconds on a CPU, so it is announced, and done only when asked for
(``BatchDecoder.calibrate``, ``racer cost``) or when the engine first needs a table.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import random
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from racer.budget.batch_cost import BatchCostModel, nodes_to_measure
from racer.budget.cost import PREFILL, SIZES, CostModel
from racer.drafting.tree import chain
from racer.engine.host import host_float, synchronize, to_host
from racer.engine.model_facts import ModelFacts
from racer.engine.rows import SlotRows
from racer.engine.selftest import random_tree, tolerance
from racer.engine.verifier import TreeVerifier
from racer.fastpaths import KERNELS, FastPaths
from racer.loading import announce_on_stderr, cache_dir

Announce = Callable[[str], None]


class Progress:
    """Lines for ``announce`` while timing: every ``every`` seconds (``EVERY``), how far
    it is and about how long is left; one more when it is done, if any was said (a
    timing over within seconds says nothing more than that it began)."""

    EVERY = 5.0

    def __init__(self, announce: Announce | None, what: str, total: int, every: float | None = None) -> None:
        self.announce, self.what, self.total = announce, what, max(total, 1)
        self.every = self.EVERY if every is None else every
        self.done = 0
        self.said = False
        self.started = self.last = time.perf_counter()

    def tick(self) -> None:
        self.done += 1
        now = time.perf_counter()
        if self.announce is None or now - self.last < self.every or self.done >= self.total:
            return
        self.last, self.said = now, True
        left = (now - self.started) / self.done * (self.total - self.done)
        self.announce(f"{self.what}: {100 * self.done // self.total}% ({self.done}/{self.total} passes), "
                      f"about {left:.0f} s left")

    def close(self) -> None:
        if self.announce is not None and self.said:
            self.announce(f"{self.what}: done in {time.perf_counter() - self.started:.0f} s")


# Vector extensions that change which kernels run, and so what a pass costs: CPUs of
# different generations can share a model name ("AMD EPYC" on a cloud VM).
_ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "asimd", "sve")


def cpu_info() -> dict[str, Any]:
    """The CPU's model name and the vector extensions it has (from /proc/cpuinfo where
    there is one)."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    name = value.strip()
                elif key.strip() in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return {"cpu": name, "isa": [f for f in _ISA_FLAGS if f in flags]}


def hardware_key(model: Any, fast_paths: FastPaths = FastPaths()) -> dict:
    """What a cost table depends on: the model's shape, device, dtype, threads, torch,
    and which fast paths verify its trees."""
    config = model.config
    shape = {k: getattr(config, k, None) for k in ("model_type", "hidden_size", "intermediate_size",
                                                    "num_hidden_layers", "num_attention_heads",
                                                    "num_key_value_heads", "vocab_size")}
    facts = ModelFacts.of(model)
    device = str(facts.device)
    if facts.device.type == "cuda":
        device += ":" + torch.cuda.get_device_name(facts.device)
    return {"model": getattr(config, "_name_or_path", "") or "", "shape": shape, "device": device,
            **cpu_info(), "dtype": str(facts.dtype), "threads": torch.get_num_threads(),
            "attention": getattr(config, "_attn_implementation", None), "torch": torch.__version__,
            "fast_paths": fast_paths.key()}


def cost_file(model: Any, fast_paths: FastPaths = FastPaths()) -> Path:
    key = json.dumps(hardware_key(model, fast_paths), sort_keys=True, default=str)
    return cache_dir() / "costs" / (hashlib.sha256(key.encode()).hexdigest()[:20] + ".json")


def measure(model: Any, sizes: Sequence[int] = SIZES, length: int = 32, grown: int = 192,
            repeats: int = 4, fast_paths: FastPaths = FastPaths(), announce: Announce | None = None) -> CostModel:
    """Time verification passes of random trees of each size on a cache of ``length``
    tokens (best of ``repeats`` rounds, with each linear kernel on offer), and the
    smallest and largest size on a cache ``grown`` tokens longer for the growth terms.
    Each round visits the (size, kernel) pairs in a fresh random order: on
    a shared machine a few slow seconds would otherwise land on the same neighbouring
    sizes every round and make them look dearer than the sizes around them, which
    steers the budget away from them for good (it seldom verifies them again to learn
    better). ``announce`` hears how far it is, every few seconds."""
    verifier = TreeVerifier(model, fast_paths)
    vocab = verifier.facts.vocab_size
    rng = np.random.default_rng(0)
    limit = verifier.max_positions
    length = max(1, min(length, limit // 4))
    grown = max(0, min(grown, limit // 2 - length))
    sizes = [s for s in sizes if length + grown + s < limit] or [1]
    verifier.prefill([int(t) for t in rng.integers(vocab, size=length)])

    def timed(on: Any, size: int, kernel: str) -> float:
        on.use_kernel(kernel)
        tree = random_tree(rng, vocab, size, max(1, min(size - 1, 8)))
        seconds = _seconds(on.device, lambda: on.verify(tree))
        on.commit([], size)  # drop the tree again
        return seconds

    offered = [k for k in KERNELS if k == "model" or (fast_paths.kernels and _kernel_agrees(verifier, rng, vocab, k))]
    for kernel in offered:
        timed(verifier, sizes[-1], kernel)  # warm-up: first-call allocations
    # The growth terms come from the smallest and largest size on a second, longer
    # cache, timed in the same shuffled rounds: a difference of two timings taken
    # minutes apart would mostly measure how the machine's speed changed meanwhile.
    small, large = sizes[0], sizes[-1]
    far = None
    if grown > 0 and len(sizes) > 1:
        far = TreeVerifier(model, fast_paths)
        far.prefill([int(t) for t in rng.integers(vocab, size=length)])
        far.use_kernel("model")
        while far.cached < length + grown:  # grow the cache with committed chains
            take = min(large, length + grown - far.cached)
            tree = chain(int(rng.integers(vocab)), [int(t) for t in rng.integers(vocab, size=take - 1)])
            far.verify(tree)
            far.commit(list(range(take)), take)
    best = {(near, s, k): float("inf") for near in (True, False) for s in sizes for k in offered
            if near or (far is not None and s in (small, large))}
    pairs = list(best)
    progress = Progress(announce, "timing verification passes", repeats * len(pairs))
    for _ in range(repeats):
        for index in rng.permutation(len(pairs)):
            near, s, k = pairs[index]
            best[near, s, k] = min(best[near, s, k], timed(verifier if near else far, s, k))
            progress.tick()
    progress.close()
    chosen = [min(offered, key=lambda k: best[True, s, k]) for s in sizes]
    prefill_size, prefill_kernel = _fastest_prefill(model, fast_paths, offered, rng, repeats // 2 or 1)
    table = CostModel(list(sizes), [best[True, s, k] for s, k in zip(sizes, chosen)], length, kernels=chosen,
                      prefill_size=prefill_size, prefill_kernel=prefill_kernel)
    if far is not None:
        at = far.cached
        g_small = (best[False, small, chosen[0]] - table.seconds[0]) / (at - length)
        g_large = (best[False, large, chosen[-1]] - table.seconds[-1]) / (at - length)
        per_node = max((g_large - g_small) / (large - small), 0.0)
        table.per_position_node = per_node
        table.per_position = max(g_small - per_node * small, 0.0)
    return table


def _fastest_prefill(model: Any, fast_paths: FastPaths, offered: Sequence[str], rng: Any,
                     repeats: int) -> tuple[int, str]:
    """The prompt width (``PREFILL``, within the context window) and the kernel among
    ``offered`` that prefilled a prompt of that width fastest, best of ``repeats``
    shuffled rounds; (0, "model") where the model's own layers are all there is."""
    verifier = TreeVerifier(model, fast_paths)
    size = min(PREFILL, verifier.max_positions // 2)
    if len(offered) == 1 or size <= SIZES[-1]:
        return 0, "model"
    prompt = [int(t) for t in rng.integers(verifier.facts.vocab_size, size=size)]
    best = dict.fromkeys(offered, float("inf"))
    for kernel in offered:  # warm-up: first-call allocations at this width
        verifier.use_kernel(kernel)
        verifier.prefill(prompt)
    for _ in range(repeats):
        for index in rng.permutation(len(offered)):
            kernel = offered[index]
            verifier.use_kernel(kernel)
            best[kernel] = min(best[kernel], _seconds(verifier.device, lambda: verifier.prefill(prompt)))
    return size, min(offered, key=best.__getitem__)


def _seconds(device: Any, run: Callable[[], Any]) -> float:
    """Wall seconds of ``run()`` on ``device``, its queued work included (an accelerator
    returns before its work is done)."""
    synchronize(device)
    start = time.perf_counter()
    run()
    synchronize(device)
    return time.perf_counter() - start


def _kernel_agrees(verifier: Any, rng: Any, vocab: int, kernel: str) -> bool:
    """Whether ``kernel`` is available and gives this model the logits its own layers
    give (a kernel leaves alone layers that do not call ``linear`` on plain weights, so
    this guards against an exotic modeling file or a broken build, not rounding)."""
    if not verifier.kernels.available(kernel):
        return False
    tree = random_tree(rng, vocab, 8, 3)
    logits = []
    for name in ("model", kernel):
        verifier.use_kernel(name)
        logits.append(verifier.verify(tree).float())
        verifier.commit([], len(tree))
    error = host_float((logits[0] - logits[1]).abs().max())
    return error <= tolerance(verifier.dtype, host_float(logits[0].abs().max()))


def disk_cache_enabled() -> bool:
    """False when RACER_COST_CACHE=0: measure every time, never save."""
    return os.environ.get("RACER_COST_CACHE", "1") != "0"


def load_or_measure(model: Any, refresh: bool = False, fast_paths: FastPaths = FastPaths(),
                    announce: Announce | None = announce_on_stderr, *,
                    rows: Sequence[int] | None = None) -> CostModel | BatchCostModel:
    """The cost table cached on disk for this model and hardware, measured if absent
    (or if ``refresh``), with a line to ``announce`` before measuring; the table keeps
    its file's path, so that ``save`` writes its refreshes back. Set
    RACER_COST_CACHE=0 to measure every time, never saving.

    ``rows`` None: the table of one tree per pass, by size, with each size's fastest
    linear kernel (``measure``). ``rows``: the table of batched passes of each of those
    row counts (``measure_batch``), timed with the kernels of the first table, which is
    read or measured first."""
    single = _cached(cost_file(model, fast_paths), CostModel.from_json, refresh, announce,
                     f"verification passes of 1-{SIZES[-1]}-node trees (tens of seconds on a CPU)",
                     lambda: measure(model, fast_paths=fast_paths, announce=announce))
    if rows is None:
        return single
    rows = list(rows)

    def read(data: dict, path: str) -> BatchCostModel:
        table = BatchCostModel.from_json(data, path)
        if table.rows != rows:
            raise ValueError("batch cost model: other row counts")
        return table

    def build() -> BatchCostModel:
        timer = BatchedPassTimer(model, single, max(rows), fast_paths)
        table = measure_batch(timer.seconds, rows, announce=announce)
        table.kernel_table = CostModel(list(single.sizes), list(single.seconds), single.length,
                                       kernels=list(single.kernels), prefill_size=single.prefill_size,
                                       prefill_kernel=single.prefill_kernel)
        return table

    path = batch_cost_file(model, rows, [*map(str, single.sizes), *single.kernels,
                                         f"prefill {single.prefill_size}: {single.prefill_kernel}"], fast_paths)
    return _cached(path, read, refresh, announce, f"batched passes of 1-{rows[-1]} requests", build)


def _cached(path: Path, read: Callable[[dict, str], Any], refresh: bool, announce: Announce | None, what: str,
            build: Callable[[], Any]) -> Any:
    use_disk = disk_cache_enabled()
    if use_disk and not refresh and path.exists():
        try:
            return read(json.loads(path.read_text(encoding="utf-8")), str(path))
        except (ValueError, KeyError, TypeError, json.JSONDecodeError):
            pass  # an old or damaged file: measure again
    if announce is not None:
        where = f"; cached in {path.parent}" if use_disk else " (RACER_COST_CACHE=0: not saved)"
        announce(f"timing {what} once for this model and hardware{where}")
    table = build()
    if use_disk:
        table.path = str(path)
        table.save()
    return table


class BatchedPassTimer:
    """Times batched passes for ``measure_batch`` on caches of its own: up to ``rows``
    rows holding one random context, grown when a longer one is asked for."""

    def __init__(self, model: Any, single: CostModel, rows: int, fast_paths: FastPaths) -> None:
        self.model, self.most = model, rows
        self.verifier = TreeVerifier(model, fast_paths)
        self.verifier.set_kernels(single.kernel, single.used_kernels)  # as the engine verifies
        self.store: SlotRows | None = None
        self.context = 0

    def seconds(self, rows: int, nodes: int, cached: int) -> float:
        """One pass of ``rows`` random trees of ``nodes`` nodes on caches of ``cached``
        tokens, read as a step reads."""
        vocab = self.verifier.facts.vocab_size
        if self.store is None or self.context < cached:
            prefill = TreeVerifier(self.model, self.verifier.fast_paths, self.verifier.facts, self.verifier.layout)
            rng = np.random.default_rng(0)
            prefill.prefill([int(t) for t in rng.integers(vocab, size=cached)])
            self.store = SlotRows(self.verifier, self.model.config, rows=self.most)
            for _ in range(self.most):
                self.store.load(prefill)
            self.context = cached
        rng = np.random.default_rng(rows * 1000 + nodes)
        trees = [random_tree(rng, vocab, nodes, max(1, min(nodes - 1, 8))) for _ in range(rows)]
        with self.store.only(rows, cached):
            synchronize(self.verifier.device)
            start = time.perf_counter()
            to_host(self.store.forward(trees).argmax(dim=-1))
            return time.perf_counter() - start


def measure_batch(time_pass: Callable[[int, int, int], float], rows: Sequence[int], length: int = 32,
                  grown: int = 192, repeats: int = 3, seed: int = 0,
                  announce: Announce | None = None) -> BatchCostModel:
    """Time batched passes: ``time_pass(rows, nodes, cached)`` is one pass of ``rows``
    random trees of ``nodes`` nodes on caches of ``cached`` tokens, in seconds. Every
    (rows, nodes) pair at ``length``, and each row count's smallest and largest size at
    ``length + grown`` for the growth terms, visited in shuffled rounds, best of
    ``repeats`` (as ``measure``)."""
    rng = random.Random(seed)
    sizes = {r: nodes_to_measure(r) for r in rows}
    for r in rows:  # warm-up: first-call allocations of each row count
        time_pass(r, sizes[r][-1], length + grown)
    best: dict[tuple[int, int, int], float] = {}
    for r in rows:
        for n in sizes[r]:
            best[r, n, length] = float("inf")
        if grown > 0 and len(sizes[r]) > 1:
            best[r, sizes[r][0], length + grown] = best[r, sizes[r][-1], length + grown] = float("inf")
    pairs = list(best)
    progress = Progress(announce, "timing batched passes", repeats * len(pairs))
    for _ in range(repeats):
        rng.shuffle(pairs)
        for key in pairs:
            best[key] = min(best[key], time_pass(*key))
            progress.tick()
    progress.close()
    curves = []
    for r in rows:
        table = CostModel(list(sizes[r]), [best[r, n, length] for n in sizes[r]], length)
        if (r, sizes[r][0], length + grown) in best:
            small, large = sizes[r][0], sizes[r][-1]
            g_small = (best[r, small, length + grown] - best[r, small, length]) / grown
            g_large = (best[r, large, length + grown] - best[r, large, length]) / grown
            table.per_position_node = max((g_large - g_small) / (large - small), 0.0)
            table.per_position = max(g_small - table.per_position_node * small, 0.0)
        curves.append(table)
    return BatchCostModel(list(rows), curves)


def batch_cost_file(model: Any, rows: Sequence[int], kernels: Sequence[str],
                    fast_paths: FastPaths = FastPaths()) -> Path:
    key = json.dumps({**hardware_key(model, fast_paths), "rows": list(rows), "kernels": list(kernels)},
                     sort_keys=True, default=str)
    return cache_dir() / "costs" / ("batch-" + hashlib.sha256(key.encode()).hexdigest()[:20] + ".json")
