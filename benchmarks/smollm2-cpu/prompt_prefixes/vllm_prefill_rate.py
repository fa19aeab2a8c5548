"""vLLM's prefill, tokens per second: ``LLM.generate`` of one token after random
prompts of each length on the embedded model (float32, eager, prefix caching off), best
of 3. Run in ``.venv-vllm``:

    VLLM_CPU_OMP_THREADS_BIND=0-1 .venv-vllm/bin/python benchmarks/smollm2-cpu/prompt_prefixes/vllm_prefill_rate.py 256,512,1024
"""

import os
import sys
import time

import numpy as np


def main() -> None:
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    from vllm import LLM, SamplingParams

    from racer.loading import model_folder

    llm = LLM(model=model_folder(None), dtype="float32", enforce_eager=True, enable_prefix_caching=False,
              max_model_len=4096)
    once = SamplingParams(max_tokens=1, temperature=0)
    rng = np.random.default_rng(0)
    for length in (int(n) for n in sys.argv[1].split(",")):
        ids = [int(t) for t in rng.integers(1000, 40000, size=length)]
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": ids}], once, use_tqdm=False)
            best = min(best, time.perf_counter() - start)
        print(f"vLLM: {length} tokens in {best:.3f} s, {length / best:.0f} tokens/s", flush=True)


if __name__ == "__main__":  # vLLM's engine process is spawned: it imports this file
    main()
