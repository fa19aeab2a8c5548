"""``racer bench``: every method side by side on one loaded model, interleaved per
prompt, with per-prompt records from which every summary figure is recomputed.

Only the public API is used: ``load_model``, ``Decoder`` and the method registry.
"""

from __future__ import annotations

import os
import platform
import time
from typing import Any, Callable, Iterable, Sequence

from racer.bench.report import BenchResult, Record

HF_METHODS = ("hf", "hf-pld")
WARMUP_PROMPT = "Say hello and introduce yourself in two sentences."


def machine_info(threads: int) -> dict:
    import torch
    import transformers

    from racer.engine.calibration import cpu_info

    return {**cpu_info(), "cores": os.cpu_count(), "threads": threads, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version()}


class _Runner:
    """Runs one method on a prompt and returns a Record."""

    def __init__(self, spec: str, model: Any, tokenizer: Any, sampling: dict | None = None) -> None:
        from racer import Decoder

        self.spec = spec
        self.sampling = dict(sampling or {})
        self.calls = 0
        self.model, self.tokenizer = model, tokenizer
        if spec in HF_METHODS:
            self.decoder = None
            self.options: dict = {"method": spec}
        else:
            self.decoder = Decoder(model, tokenizer, "none" if spec == "ar" else spec)
            self.decoder.calibrate()  # here, not inside the first timed prompt
            self.options = self.decoder.method.describe()

    def _sampling_now(self) -> dict:
        # Each call gets its own seed, derived from the bench seed, so a rerun repeats.
        sampling = dict(self.sampling)
        if sampling.get("seed") is not None:
            sampling["seed"] = sampling["seed"] * 1_000_003 + self.calls
        self.calls += 1
        return sampling

    def run(self, ids: list[int], max_new_tokens: int) -> tuple[list[int], dict]:
        sampling = self._sampling_now()
        if self.decoder is None:
            import torch

            tensor = torch.tensor([ids])
            extra: dict[str, Any] = {"prompt_lookup_num_tokens": 10} if self.spec == "hf-pld" else {}
            temperature = sampling.get("temperature", 0.0)
            if temperature > 0:
                if sampling.get("seed") is not None:
                    torch.manual_seed(sampling["seed"])
                extra.update(do_sample=True, temperature=temperature, top_p=sampling.get("top_p", 1.0),
                             top_k=sampling.get("top_k", 0))  # 0 switches HF's default top-k of 50 off
            else:
                extra.update(do_sample=False, top_p=None, top_k=None, temperature=None)
            if sampling.get("repetition_penalty", 1.0) != 1.0:
                extra["repetition_penalty"] = sampling["repetition_penalty"]
            start = time.perf_counter()
            with torch.inference_mode():
                out = self.model.generate(tensor, attention_mask=torch.ones_like(tensor),
                                          max_new_tokens=max_new_tokens, **extra)
            wall = time.perf_counter() - start
            tokens = out[0, len(ids):].tolist()
            # HF's prompt lookup hides its passes; plain generate makes one per token.
            steps = None if self.spec == "hf-pld" else max(0, len(tokens) - 1)
            return tokens, dict(steps=steps, accepted=None, tree_sizes=None, wall_s=wall, draft_s=0.0, verify_s=wall)
        result = self.decoder.generate(ids, max_new_tokens=max_new_tokens, **sampling)
        return result.tokens, dict(steps=len(result.steps), accepted=[s.accepted for s in result.steps],
                                   tree_sizes=[s.tree_size for s in result.steps], wall_s=result.wall_s,
                                   draft_s=sum(s.draft_s for s in result.steps),
                                   verify_s=sum(s.verify_s for s in result.steps),
                                   step_draft_us=[round(s.draft_s * 1e6) for s in result.steps],
                                   drafter_stats=result.drafter_stats or None)


def run_bench(model: Any, tokenizer: Any, methods: Sequence[str], questions: Sequence[Any], *,
              max_new_tokens: int = 256, baseline: str = "ar", warmup: int = 1, threads: int = 1,
              sampling: dict | None = None, progress: Callable[[str], None] | None = None) -> BenchResult:
    """Run every method on every question, rotating the method order per question.
    ``sampling``: keyword arguments of ``Decoder.generate`` (temperature, top_p, ...;
    greedy when absent). Sampled outputs are not compared (``identical`` is None)."""
    from racer import encode_prompt

    if not methods:
        raise ValueError("methods: expected at least one method")
    if baseline not in methods:
        raise ValueError(f"baseline: expected one of the methods ({', '.join(methods)}), got {baseline!r}")
    if len(set(methods)) != len(methods):
        raise ValueError(f"methods: each method once, got {', '.join(methods)}")
    sampling = dict(sampling or {})
    greedy = sampling.get("temperature", 0.0) == 0
    runners = [_Runner(spec, model, tokenizer, sampling) for spec in methods]
    result = BenchResult(machine_info(threads), {"methods": list(methods), "baseline": baseline,
                                                 "max_new_tokens": max_new_tokens, "warmup": warmup,
                                                 "prompts": len(questions), "sampling": sampling})
    prompts = [encode_prompt(tokenizer, q.chat, chat=True) for q in questions]
    # Warm-up (lazy initialisation, allocator, caches), not recorded; on a prompt of its
    # own so that no drafter that keeps memory has seen a measured prompt.
    warm_ids = encode_prompt(tokenizer, [{"role": "user", "content": WARMUP_PROMPT}], chat=True)
    for _ in range(warmup):
        for runner in runners:
            runner.run(warm_ids, min(16, max_new_tokens))
    for index, (question, ids) in enumerate(zip(questions, prompts)):
        shift = index % len(runners)
        done: dict[str, Record] = {}
        for runner in runners[shift:] + runners[:shift]:
            tokens, stats = runner.run(ids, max_new_tokens)
            done[runner.spec] = Record(runner.spec, runner.options, question.dataset, question.category,
                                       question.question_id, len(tokens), tokens=tokens, prompt=index, **stats)
            if progress:
                progress(runner.spec)
        reference = done[baseline].tokens
        for spec in methods:
            done[spec].identical = done[spec].tokens == reference if greedy else None
            result.records.append(done[spec])
    return result


def iter_questions(datasets: Iterable[str], limit: int | None) -> list[Any]:
    """Questions of each dataset; ``name:N`` overrides ``limit`` for that dataset."""
    from racer.bench.questions import load_questions

    out = []
    for entry in datasets:
        name, sep, count = entry.rpartition(":")
        if sep and count.isdigit():
            out.extend(load_questions(name, int(count)))
        else:
            out.extend(load_questions(entry, limit))
    return out
