"""The GPU check's body (``scripts/gpu-check run`` sets up its packages and model first).

On a CUDA machine it runs, each step timed and its outcome one line of the report:
  1. the model-family matrix on CUDA (tests/test_families.py: tiny random models of
     every family, float32, every method against ``generate``);
  2. with the embedded model: the real-model lossless tests on CUDA (float32), then a
     short ``racer bench`` in bfloat16 (racer and its peers against ``hf`` generate);
  3. random-weight models of real shapes (SmolLM2-135M, Llama-3.2-1B, Llama-3.1-8B) in
     bfloat16: the measured step cost of 1- to 64-node trees relative to one node (what
     the draft budget chooses from), and whether greedy racer decoding at capacity 64
     matches ``generate`` token for token over 64 new tokens (random weights accept
     few drafts; this checks verification and compaction at those shapes, not speed).

Usage: python scripts/gpu_check.py [OUT_FOLDER]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A dry run elsewhere: GPU_CHECK_DEVICE=cpu GPU_CHECK_SHAPES=SmolLM2-135M python scripts/gpu_check.py
DEVICE = os.environ.get("GPU_CHECK_DEVICE", "cuda")
SHAPES = {  # name: (hidden, intermediate, layers, heads, kv heads, vocab)
    "SmolLM2-135M": (576, 1536, 30, 9, 3, 49152),
    "Llama-3.2-1B": (2048, 8192, 16, 32, 8, 128256),
    "Llama-3.1-8B": (4096, 14336, 32, 32, 8, 128256),
}
SHAPES = {name: SHAPES[name] for name in os.environ.get("GPU_CHECK_SHAPES", ",".join(SHAPES)).split(",")}
REPORT: list[str] = []


def say(line: str = "") -> None:
    print(line, flush=True)
    REPORT.append(line)


def pytest(label: str, args: list[str], limit: int) -> None:
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=limit)
        tail = [line for line in done.stdout.splitlines() if line.strip()][-1:] or ["(no output)"]
        outcome = tail[0]
        if done.returncode != 0:
            failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED")][:5]
            outcome += "".join(f"\n    {line}" for line in failed)
    except subprocess.TimeoutExpired:
        outcome = f"stopped after {limit} s"
    say(f"- {label}: {outcome} ({time.perf_counter() - start:.0f} s)")


def embedded_available() -> bool:
    try:
        from racer.loading import embedded_gguf_path

        return embedded_gguf_path().is_file()
    except Exception:
        return False


def bench(out: Path | None) -> None:
    start = time.perf_counter()
    target = (out or Path("/tmp")) / "gpu-bench.json"
    command = [sys.executable, "-m", "racer.cli", "bench", "--device", DEVICE, "--dtype", "bfloat16",
               "--methods", "hf,none,pld,racer,racer:capacity=16,token-recycling", "--baseline", "hf",
               "--datasets", "spec_bench:1,human_eval:3,mgsm:3", "--max-new-tokens", "128", "--json", str(target)]
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=150)
        say(f"- `racer bench` ({time.perf_counter() - start:.0f} s): `{' '.join(command[3:])}`")
        say("")
        say("```")
        for line in done.stdout.splitlines()[-24:]:
            say(line)
        if done.returncode:
            for line in done.stderr.splitlines()[-8:]:
                say(line)
        say("```")
    except subprocess.TimeoutExpired:
        say("- `racer bench`: stopped after 150 s")


def shapes() -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from racer import Decoder
    from racer.budget.calibration import measure

    say("")
    say("| shape (random weights, bf16) | step time, 1 node | 2 | 4 | 8 | 16 | 32 | 64 nodes | racer:capacity=64 vs generate |")
    say("|---|---|---|---|---|---|---|---|---|")
    for name, (hidden, inter, layers, heads, kv, vocab) in SHAPES.items():
        start = time.perf_counter()
        config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                             max_position_embeddings=4096, attn_implementation="sdpa")
        torch.manual_seed(0)
        with torch.device(DEVICE):
            model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
        cost = measure(model, sizes=(1, 2, 4, 8, 16, 32, 64), length=256, grown=256)
        first = cost.seconds[0]
        ratios = " | ".join(f"{s / first:.2f}x" for s in cost.seconds[1:])
        phrase = [int(t) for t in torch.randint(3, vocab, (16,))]
        ids = phrase * 8
        tensor = torch.tensor([ids], device=DEVICE)
        with torch.inference_mode():
            want = model.generate(tensor, attention_mask=torch.ones_like(tensor), do_sample=False, max_new_tokens=64,
                                  min_new_tokens=64, top_p=None, top_k=None, temperature=None)[0, len(ids):].tolist()
        # racer stops at the end token where generate (min_new_tokens) goes on: compare what both emitted.
        got = Decoder(model, None, "racer:capacity=64", cost=cost).generate(ids, max_new_tokens=64)
        same = got.tokens == want[: len(got.tokens)]
        where = "identical" if same else next(f"differs at token {i}" for i, (a, b) in
                                              enumerate(zip(got.tokens, want)) if a != b)
        accepted = sum(s.accepted for s in got.steps)
        say(f"| {name} | {first * 1e3:.2f} ms | {ratios} | {where} ({accepted} drafts accepted, "
            f"{time.perf_counter() - start:.0f} s) |")
        del model
        if DEVICE == "cuda":
            torch.cuda.empty_cache()


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1] else None
    import torch
    import transformers

    begin = time.perf_counter()
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("gpu-check: no CUDA device here (GPU_CHECK_DEVICE=cpu for a dry run)", file=sys.stderr)
        sys.exit(2)
    where = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    say(f"# racer GPU check: {where}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}")
    say("")
    pytest(f"family matrix on {DEVICE} (tests/test_families.py)", ["tests/test_families.py", "-n", "4"], 120)
    if embedded_available():
        pytest(f"real-model lossless tests on {DEVICE}, float32 (tests/test_lossless.py)",
               ["tests/test_lossless.py", "-n", "4"], 200)
        bench(out)
    else:
        say("- embedded model: not here (carry .gpu/model.1 and .gpu/model.2, see scripts/gpu-check); "
            "its lossless tests and bench were skipped")
    shapes()
    say("")
    say(f"({time.perf_counter() - begin:.0f} s in all)")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu-report.md").write_text("\n".join(REPORT) + "\n", encoding="utf-8")
        (out / "gpu-report.json").write_text(json.dumps({"lines": REPORT}), encoding="utf-8")


if __name__ == "__main__":
    os.environ.setdefault("RACER_TEST_DEVICE", DEVICE)
    main()
