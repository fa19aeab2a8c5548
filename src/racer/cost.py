"""What a decoding step costs on this hardware, as a function of the verified tree's
size and the cache length: measured once per model/device/dtype/threads (one pass
per size and linear kernel, twice), cached on disk, and refreshed from the step
timings of real decoding.

Model: ``seconds(n, L) = base(n) + (L - L0) * (per_position + per_position_node * n)``,
``base`` piecewise linear over measured sizes at cache length ``L0``. A CPU's curve is
far from smooth (here a 2- or 3-row matmul costs more than a 4-row one), which is why
it is a table and not a fitted formula.

Each size is timed with every linear kernel this model and machine offer (see
``racer.verify.KERNELS``: the model's own layers, ``WeightMajorLinear``, oneDNN-packed
weights); the table keeps the fastest, and the verifier uses that kernel for that size.
A kernel is offered only where it gives the logits the model's own layers give
(checked once, to the tolerance of tree verification itself).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
FORMAT = 4  # 4: timed with tree attention (racer.attention); older tables are re-measured


@dataclass
class CostModel:
    sizes: list[int]
    seconds: list[float]  # step time at each size, cache length ``length``
    length: int
    per_position: float = 0.0  # growth per cached token, per step
    per_position_node: float = 0.0  # growth per cached token, per tree node
    kernels: list[str] = field(default_factory=list)  # fastest linear kernel at each size ("model" if empty)
    path: str | None = field(default=None, compare=False)  # where refreshes are saved
    rate: float = 0.1  # how fast step timings pull the table

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.seconds) or not self.sizes:
            raise ValueError("cost model: expected one time per size")
        if list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] != 1:
            raise ValueError(f"cost model: sizes must start at 1 and increase, got {self.sizes}")
        if not all(s > 0 for s in self.seconds):
            raise ValueError("cost model: times must be positive")
        from racer.verify import KERNELS

        self.kernels = list(self.kernels) or ["model"] * len(self.sizes)
        if len(self.kernels) != len(self.sizes) or not set(self.kernels) <= set(KERNELS):
            raise ValueError(f"cost model: expected one kernel from {KERNELS} per size, got {self.kernels}")

    def _bracket(self, n: int) -> tuple[int, int, float]:
        """Indices i, j of the sizes around ``n`` and the weight of j (linear)."""
        sizes = self.sizes
        if n <= sizes[0] or len(sizes) == 1:
            return 0, 0, 0.0
        if n >= sizes[-1]:
            i, j = len(sizes) - 2, len(sizes) - 1
        else:
            j = next(k for k, s in enumerate(sizes) if s >= n)
            i = j - 1
        return i, j, (n - sizes[i]) / (sizes[j] - sizes[i])

    def base(self, n: int) -> float:
        i, j, w = self._bracket(n)
        return (1 - w) * self.seconds[i] + w * self.seconds[j]

    def predict(self, nodes: int, cached: int) -> float:
        """Seconds for one step verifying ``nodes`` nodes on a cache of ``cached`` tokens."""
        growth = (cached - self.length) * (self.per_position + self.per_position_node * nodes)
        base = self.base(nodes)
        return max(base + growth, 0.25 * base)

    def kernel(self, n: int) -> str:
        """The linear kernel to verify ``n`` nodes with: that of the nearest measured
        size (the smaller on a tie; the largest measured size's beyond the table)."""
        i, j, w = self._bracket(n)
        return self.kernels[j] if w > 0.5 else self.kernels[i]

    def refresh(self, nodes: int, cached: int, seconds: float) -> None:
        """Pull the table toward an observed step time (a least-mean-squares step on the
        two sizes around ``nodes``). Outliers (a page fault, the other core busy) are
        clipped to half the prediction, so one slow step cannot move it far."""
        predicted = self.predict(nodes, cached)
        error = max(-0.5 * predicted, min(0.5 * predicted, seconds - predicted))
        i, j, w = self._bracket(nodes)
        if nodes > self.sizes[-1]:
            i, w = j, 0.0  # beyond the table: only the last measured size moves
        for index, weight in ((i, 1 - w), (j, w)):
            if weight > 0:
                self.seconds[index] = max(self.seconds[index] + self.rate * weight * error, 1e-6)

    def to_json(self) -> dict:
        data = asdict(self)
        data.pop("path")
        data.pop("rate")
        return {"format": FORMAT, **data}

    @staticmethod
    def from_json(data: dict, path: str | None = None) -> "CostModel":
        if data.get("format") != FORMAT:
            raise ValueError("cost model: unknown format")
        return CostModel(list(data["sizes"]), list(data["seconds"]), int(data["length"]),
                         float(data["per_position"]), float(data["per_position_node"]),
                         [str(k) for k in data["kernels"]], path)

    def save(self) -> None:
        """Write the (refreshed) table back to its cache file, atomically."""
        if self.path:
            _write_json(Path(self.path), self.to_json())


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        json.dump(data, out)
    os.replace(tmp, path)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware_key(model: Any) -> dict:
    """What a cost table depends on: the model's shape, device, dtype, threads, torch."""
    import torch

    config = model.config
    shape = {k: getattr(config, k, None) for k in ("model_type", "hidden_size", "intermediate_size",
                                                    "num_hidden_layers", "num_attention_heads",
                                                    "num_key_value_heads", "vocab_size")}
    param = next(model.parameters())
    device = str(param.device)
    if param.device.type == "cuda":
        device += ":" + torch.cuda.get_device_name(param.device)
    return {"model": getattr(config, "_name_or_path", "") or "", "shape": shape, "device": device,
            "cpu": _cpu_name(), "dtype": str(param.dtype), "threads": torch.get_num_threads(),
            "attention": getattr(config, "_attn_implementation", None), "torch": torch.__version__}


def cost_file(model: Any) -> Path:
    from racer.loading import cache_dir

    key = json.dumps(hardware_key(model), sort_keys=True, default=str)
    return cache_dir() / "costs" / (hashlib.sha256(key.encode()).hexdigest()[:20] + ".json")


def measure(model: Any, sizes: Sequence[int] = SIZES, length: int = 32, grown: int = 192,
            repeats: int = 2) -> CostModel:
    """Time verification passes of random trees of each size on a cache of ``length``
    tokens (best of ``repeats``, with each linear kernel on offer), then grow the cache by
    ``grown`` tokens and time the smallest and largest size again for the growth terms."""
    import numpy as np

    from racer.tree import chain
    from racer.verify import KERNELS, TreeVerifier, random_tree

    verifier = TreeVerifier(model)
    vocab = int(model.config.vocab_size)
    rng = np.random.default_rng(0)
    limit = verifier.max_positions
    length = max(1, min(length, limit // 4))
    grown = max(0, min(grown, limit // 2 - length))
    sizes = [s for s in sizes if length + grown + s < limit] or [1]
    verifier.prefill([int(t) for t in rng.integers(vocab, size=length)])

    def timed(size: int, kernel: str) -> float:
        verifier.use_kernel(kernel)
        tree = random_tree(rng, vocab, size, max(1, min(size - 1, 8)))
        start = time.perf_counter()
        float(verifier.verify(tree)[-1, 0])  # reading a value waits for an asynchronous device
        seconds = time.perf_counter() - start
        verifier.commit([], size)  # drop the tree again
        return seconds

    offered = [k for k in KERNELS if k == "model" or _kernel_agrees(verifier, rng, vocab, k)]
    for kernel in offered:
        timed(sizes[-1], kernel)  # warm-up: first-call allocations
    best = {(s, k): float("inf") for s in sizes for k in offered}
    for _ in range(repeats):
        for s, k in best:
            best[s, k] = min(best[s, k], timed(s, k))
    chosen = [min(offered, key=lambda k: best[s, k]) for s in sizes]
    table = CostModel(list(sizes), [best[s, k] for s, k in zip(sizes, chosen)], length, kernels=chosen)
    if grown > 0 and len(sizes) > 1:
        chunk = sizes[-1]
        verifier.use_kernel("model")
        while verifier.cached < length + grown:  # grow the cache with committed chains
            take = min(chunk, length + grown - verifier.cached)
            tree = chain(int(rng.integers(vocab)), [int(t) for t in rng.integers(vocab, size=take - 1)])
            verifier.verify(tree)
            verifier.commit(list(range(take)), take)
        at = verifier.cached
        small, large = sizes[0], sizes[-1]
        g_small = (min(timed(small, chosen[0]) for _ in range(repeats)) - table.seconds[0]) / (at - length)
        g_large = (min(timed(large, chosen[-1]) for _ in range(repeats)) - table.seconds[-1]) / (at - length)
        per_node = max((g_large - g_small) / (large - small), 0.0)
        table.per_position_node = per_node
        table.per_position = max(g_small - per_node * small, 0.0)
    return table


def _kernel_agrees(verifier: Any, rng: Any, vocab: int, kernel: str) -> bool:
    """Whether ``kernel`` is available and gives this model the logits its own layers
    give (a kernel leaves alone layers that do not call ``linear`` on plain weights, so
    this guards against an exotic modeling file or a broken build, not rounding)."""
    from racer.verify import packed_weights, random_tree, tolerance

    if kernel == "packed" and packed_weights(verifier.model) is None:
        return False
    tree = random_tree(rng, vocab, 8, 3)
    logits = []
    for name in ("model", kernel):
        verifier.use_kernel(name)
        logits.append(verifier.verify(tree).float())
        verifier.commit([], len(tree))
    error = float((logits[0] - logits[1]).abs().max())
    return error <= tolerance(verifier.dtype, float(logits[0].abs().max()))


def disk_cache_enabled() -> bool:
    """False when RACER_COST_CACHE=0: measure every time, never save."""
    return os.environ.get("RACER_COST_CACHE", "1") != "0"


def load_or_measure(model: Any, refresh: bool = False) -> CostModel:
    """The cost model cached on disk for this model and hardware, measured if absent
    (or if ``refresh``). Set RACER_COST_CACHE=0 to measure every time, never saving."""
    use_disk = disk_cache_enabled()
    path = cost_file(model)
    if use_disk and not refresh and path.exists():
        try:
            return CostModel.from_json(json.loads(path.read_text(encoding="utf-8")), str(path))
        except (ValueError, KeyError, TypeError, json.JSONDecodeError):
            pass  # an old or damaged file: measure again
    measured = measure(model)
    if use_disk:
        measured.path = str(path)
        measured.save()
    return measured
