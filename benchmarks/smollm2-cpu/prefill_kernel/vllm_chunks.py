"""vLLM's time for the prompt chunks of ``compare.py``: 512 new tokens after 0, 1,000 and
2,000 cached ones (prefix caching on; the cached part sent once before), ``REPEATS``
times each on fresh random tokens, medians; float32, eager, 2 threads, one token out.
Run with vLLM's environment (``make vllm-env``):

    .venv-vllm/bin/python benchmarks/smollm2-cpu/prefill_kernel/vllm_chunks.py MODEL_FOLDER REPEATS
"""

import os
import random
import statistics
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=4096,
              enable_prefix_caching=True, max_num_seqs=8)
    repeats = int(sys.argv[2])
    rng = random.Random(0)
    one = SamplingParams(max_tokens=1, temperature=0)

    def timed(ids: list[int]) -> float:
        start = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=ids)], one, use_tqdm=False)
        return time.perf_counter() - start

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    timed(tokens(512))  # warm-up
    for cached in (0, 1000, 2000):
        seconds = []
        for _ in range(repeats):
            prefix = tokens(cached)
            if cached:
                timed(prefix)
            seconds.append(timed(prefix + tokens(512)))
        print(f"| 512 after {cached} | vLLM {1000 * statistics.median(seconds):.0f} ms |", flush=True)


if __name__ == "__main__":
    main()
