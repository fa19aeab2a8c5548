"""Command line: ``racer generate``, ``chat``, ``methods``, ``bench``, ``cost``, ``serve``,
``bench-serve``, ``measure`` and ``datastore build``; bad input is one line naming the argument and
exit status 2, Ctrl-C is exit status 130."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Sequence


def default_threads() -> int:
    """The cores this process may run on. Never the load of the moment: the thread
    count is part of the cost table's key, so a load-dependent default would calibrate
    afresh whenever the machine is busy and keep a table measured under load for good.
    ``--threads`` sets fewer where other work shares the cores."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number from 1 to 65535, got {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number from 1 to 65535, got {value}")
    return value


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="Hugging Face model id or local folder (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")
    p.add_argument("--device", default=None, help="torch device, e.g. cpu or cuda (default: where the model loads)")
    p.add_argument("--threads", type=_positive, default=None,
                   help="CPU threads for torch (default: every core this process may use)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples exactly")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default 0 = off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="as in Hugging Face generate (default 1 = off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed: the same seed repeats a run of the same method")


def _sampling(args: argparse.Namespace) -> dict:
    from racer.engine import SamplingParams

    params = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                  repetition_penalty=args.repetition_penalty, seed=args.seed)
    SamplingParams(**params)  # fail on bad values before loading anything
    return params


def _build_parser() -> argparse.ArgumentParser:
    import racer

    parser = argparse.ArgumentParser(prog="racer", description="Lossless speculative decoding for Hugging Face causal LMs")
    parser.add_argument("--version", action="version", version=f"racer {racer.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate an answer, streaming it")
    gen.add_argument("prompt", help="the user message (through the chat template when the model has one, "
                                    "unless --raw)")
    gen.add_argument("--method", default="racer",
                     help="draft method with options, e.g. racer, racer:capacity=16, pld (see 'racer methods')")
    gen.add_argument("--max-new-tokens", type=_positive, default=256)
    gen.add_argument("--stop", action="append", default=[],
                     help="stop string, left out of the text as the server does (repeatable)")
    gen.add_argument("--raw", action="store_true", help="feed the prompt as raw text, no chat template")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object (text, every token with the draft source that proposed it and "
                          "its pass, statistics) instead of streaming the text")
    gen.add_argument("--compare", action="store_true",
                     help="also run plain decoding (same sampling settings); print the speedup and, when "
                          "greedy, whether outputs are identical")
    _add_sampling_args(gen)
    _add_model_args(gen)

    talk = sub.add_parser("chat", help="a terminal chat that tints each token by the draft source that proposed it")
    talk.add_argument("--method", default="racer", help="draft method with options (default: racer; /method switches)")
    talk.add_argument("--max-new-tokens", type=_positive, default=512)
    talk.add_argument("--system", default=None, help="a system message to open every conversation with")
    _add_sampling_args(talk)
    _add_model_args(talk)

    sub.add_parser("methods", help="list draft methods and their options")

    bench = sub.add_parser("bench", help="compare methods side by side on benchmark prompts")
    bench.add_argument("--methods", default="ar,hf,pld,racer",
                       help="comma-separated: ar, hf, hf-pld and draft methods with options (default: ar,hf,pld,racer)")
    bench.add_argument("--datasets", default="spec_bench,human_eval,mgsm",
                       help="comma-separated: spec_bench, human_eval, mgsm, code_edit, agent_sessions or JSONL "
                            "paths; NAME:N takes N per category (of agent_sessions: N sessions)")
    bench.add_argument("--limit", type=_positive, default=None, help="first N prompts of each category")
    bench.add_argument("--max-new-tokens", type=_positive, default=256)
    bench.add_argument("--baseline", default=None,
                       help="method the speedups are relative to (default: ar when it runs, else the first method)")
    bench.add_argument("--warmup", type=int, default=1, help="warm-up rounds of every method on a prompt of its own (default: 1)")
    _add_sampling_args(bench)
    bench.set_defaults(seed=0)  # a bench run repeats unless told otherwise
    bench.add_argument("--json", default=None, help="write every per-prompt record and the summary here")
    bench.add_argument("--plots", default=None, help="write PNG plots into this folder")
    bench.add_argument("--report", nargs="+", default=None,
                       help="re-render tables/plots from saved JSON files (merged); runs nothing")
    _add_model_args(bench)

    cost = sub.add_parser("cost", help="show the step-cost table capacity=auto uses (measured once per "
                                       "model, device, dtype and threads; cached)")
    cost.add_argument("--refresh", action="store_true", help="measure again, replacing the cached table")
    _add_model_args(cost)

    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (chat and completions, streaming)")
    serve.add_argument("--method", default="racer", help="draft method with options, as in generate (default: racer)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=_port, default=8000, help="port (default: 8000)")
    serve.add_argument("--max-batch", type=_positive, default=8, help="requests verified together (default: 8)")
    serve.add_argument("--max-queue", type=int, default=32,
                       help="requests waiting beyond the batch before new ones get 429 (default: 32)")
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/ routes")
    serve.add_argument("--default-max-tokens", type=_positive, default=1024,
                       help="max_tokens of a request that names none (default: 1024, or the rest of the context)")
    serve.add_argument("--max-body", type=_positive, default=4 << 20,
                       help="largest request body in bytes; larger ones get 413 before they are read (default: 4 MiB)")
    serve.add_argument("--grace", type=float, default=10.0,
                       help="seconds SIGTERM lets requests in flight finish (default: 10)")
    serve.add_argument("--memory-scope", choices=("request", "server", "user"), default="server",
                       help="whose requests share drafter memory: none, all (default), or those with the same "
                            "'user' field (see docs/serving.md)")
    serve.add_argument("--prefill-chunk", type=_positive, default=2048,
                       help="prompt tokens prefilled a step, of one or more waiting requests: the most a step "
                            "delays the requests decoding (default: 2048)")
    serve.add_argument("--prefix-cache-mib", type=int, default=512,
                       help="MiB of finished requests' KV kept for later prompts of the same memory scope that "
                            "begin with the same tokens, as an agent's next call does (0: none; default: 512)")
    _add_model_args(serve)

    load = sub.add_parser("bench-serve", help="load-test racer serve (one server per method) and, as the anchor, "
                                              "transformers serve --continuous-batching, with C concurrent clients")
    load.add_argument("--methods", default="none,pld,racer", help="racer serve --method of each server, the first "
                                                                  "the baseline (default: none,pld,racer)")
    load.add_argument("--concurrency", default="1,2,4,8", help="comma-separated client counts (default: 1,2,4,8)")
    load.add_argument("--max-tokens", type=_positive, default=256, help="max_tokens of every request (default: 256)")
    load.add_argument("--per-client", type=_positive, default=2, help="requests (agent: sessions) each client sends in turn (default: 2)")
    load.add_argument("--max-batch", type=_positive, default=8, help="the racer servers' --max-batch (default: 8)")
    load.add_argument("--rounds", type=_positive, default=1,
                      help="times over the whole load, interleaved; the median round is reported (default: 1)")
    load.add_argument("--no-anchor", action="store_true", help="skip transformers serve")
    from racer.bench.clients import WORKLOADS

    load.add_argument("--workload", choices=WORKLOADS, default="mix",
                      help="the prompts: mix (Spec-Bench and HumanEval, alternating), code_edit (requests "
                           "that rewrite the code they carry) or agent (agent sessions, each call resending the "
                           "conversation with its tool outputs) (default: mix)")
    load.add_argument("--vllm", default=None, metavar="PYTHON",
                      help="the Python of an environment with vLLM (make vllm-env: .venv-vllm/bin/python): also "
                           "measure vLLM's OpenAI server on the same model folder, once per --vllm-methods")
    load.add_argument("--vllm-methods", default="none,ngram,ngram3,suffix,racer",
                      help="vLLM's speculation in each vLLM server: none, ngram (its defaults), ngram3 "
                           "(prompt_lookup_max 3), suffix (needs arctic-inference), "
                           "racer (racer's proposer, its default method), "
                           "racer:OPTIONS (its method spec, e.g. racer:memory=kept); "
                           "the first is the table's baseline (default: all five)")
    load.add_argument("--vllm-tokens", type=_positive, default=5,
                      help="num_speculative_tokens of vLLM's ngram proposers (default: 5)")
    load.add_argument("--vllm-racer-tokens", type=_positive, default=16,
                      help="num_speculative_tokens of racer's proposer, the longest chain (default: 16)")
    load.add_argument("--fresh-servers", action="store_true",
                      help="start every server for each load and stop it after (memory for one server at a "
                           "time; the default with --vllm)")
    load.add_argument("--memory", default=None, metavar="N,M,...",
                      help="instead: one server of the first method, its resident memory after N, M, ... requests "
                           "(16 tokens each, every prompt different)")
    load.add_argument("--out", default="bench-serve", help="folder for serve.json, the plot and server logs")
    _add_model_args(load)

    measure = sub.add_parser("measure", help="time parts of a step and 16-bit agreement, for the figures in docs/")
    measure.add_argument("what", choices=("costs", "agreement", "kernels", "attention", "runs", "evidence",
                                          "append", "selftest", "batch"))
    measure.add_argument("--dataset", default="human_eval", help="evidence: the questions")
    measure.add_argument("--limit", type=_positive, default=10, help="evidence: prompts per category")
    measure.add_argument("--method", default="racer", help="evidence: a drafter with capacity=auto")
    measure.add_argument("--dtype", default="bfloat16", help="agreement: the 16-bit format")
    measure.add_argument("--methods", default="none,pld,racer:capacity=16", help="agreement: the methods")
    measure.add_argument("--batch-methods", default="none,pld,racer", help="batch: methods, the first the baseline")
    measure.add_argument("--concurrency", default="1,2,4,8", help="batch: requests decoded together")
    measure.add_argument("--tokens", type=_positive, default=128, help="new tokens a prompt")
    measure.add_argument("--threads", type=_positive, default=1, help="CPU threads for torch (default: 1)")

    store = sub.add_parser("datastore", help="REST datastores")
    store_sub = store.add_subparsers(dest="datastore_command", required=True)
    build = store_sub.add_parser("build", help="tokenise a corpus and write its suffix array, for rest:datastore=DIR")
    build.add_argument("corpus", nargs="+",
                       help="JSONL files (one document per line), text files, or folders of them (recursive)")
    build.add_argument("--out", required=True, help="folder to write the datastore to")
    build.add_argument("--field", default="text",
                       help="JSONL field holding the text; strings inside lists/turns are joined (default: text)")
    build.add_argument("--pattern", default="*", help="file name pattern inside folders (default: every file)")
    build.add_argument("--exclude", action="append", default=[],
                       help="skip files under folders whose path has a part matching this pattern (repeatable)")
    build.add_argument("--model", default=None,
                       help="model whose tokenizer to use: HF id or local folder (default: embedded SmolLM2-135M-Instruct)")
    return parser


def _setup_torch(threads: int | None) -> int:
    from racer.loading import use_threads

    return use_threads(threads or default_threads())


def _cmd_methods(args: argparse.Namespace) -> int:
    from racer.drafting import METHODS, method_options

    def shown(key: str, value: object) -> str:
        if key == "capacity" and value is None:
            return "(all it drafts)"
        return "(required)" if value == "" else "(by variant)" if value is None else str(value)

    width = max(len(name) for name in METHODS) + 2
    for name, (_, summary) in METHODS.items():
        print(f"{name:<{width}}{summary}")
        options = ", ".join(f"{k}={shown(k, v)}" for k, v in method_options(name).items())
        if options:
            print(f"{'':<{width}}options: {options}")
    print("\nUse as NAME or NAME:key=value:key=value, e.g. --method racer:capacity=16")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from rich.console import Console
    from transformers.utils import logging as hf_logging

    from racer import Decoder, GenerationOptions, GenerationResult, load_model, parse_method

    err = Console(stderr=True, soft_wrap=True)
    method = parse_method(args.method)  # fail on a bad method before loading anything
    options = GenerationOptions(max_new_tokens=args.max_new_tokens, stop=args.stop,
                                chat=False if args.raw else None, **_sampling(args))
    threads = _setup_torch(args.threads)
    hf_logging.disable_progress_bar()
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device, announce=err.print)
    decoder = Decoder(model, tokenizer, method)
    decoder.calibrate(announce=lambda line: err.print(line))
    # Warm-up (not reported) with plain decoding, so no drafter memory sees the prompt early.
    Decoder(model, tokenizer, "none", check=False).generate(args.prompt, options, max_new_tokens=4)

    result = GenerationResult.empty()
    try:
        for piece in decoder.stream(args.prompt, options, result=result):
            if not args.json:
                sys.stdout.write(piece)
                sys.stdout.flush()
    except KeyboardInterrupt:  # Ctrl-C: what was generated so far, no traceback
        result.text = tokenizer.decode(result.tokens, skip_special_tokens=True)
        result.stop_reason = "interrupted"
        if args.json:
            print(json.dumps(_generation_json(args.method, tokenizer, result, None), ensure_ascii=False))
        else:
            sys.stdout.write("\n")
        err.print(f"[bold]interrupted[/] after {len(result.tokens)} tokens")
        return 130
    if not args.json:
        sys.stdout.write("\n")
    err.print(f"[bold]{args.method}[/]: {len(result.tokens)} tokens, {result.passes} passes, "
              f"MAT {result.mat:.2f}, {result.tokens_per_s:.1f} tokens/s ({threads} threads, stop: {result.stop_reason})")
    if result.steps and method.auto:
        sizes = [s.tree_size for s in result.steps]
        err.print(f"draft budget: {sum(sizes) / len(sizes):.1f} nodes verified per step on average "
                  f"(of {sum(s.candidates for s in result.steps) / len(sizes):.1f} proposed), largest {max(sizes)}")
    plain = Decoder(model, tokenizer, "none").generate(args.prompt, options) if args.compare else None
    if args.json:
        print(json.dumps(_generation_json(args.method, tokenizer, result, plain), ensure_ascii=False))
    if plain is not None:
        return _report_compare(err, result, plain, args.temperature == 0, str(decoder.facts.dtype))
    return 0


SIXTEEN_BIT = ("torch.bfloat16", "torch.float16")


def _report_compare(err: Any, result: Any, plain: Any, greedy: bool, dtype: str) -> int:
    """The speedup over plain decoding and whether the outputs agree, with what racer
    promises where they need not (sampling; 16-bit formats)."""
    speedup = plain.wall_s / result.wall_s if result.wall_s else float("nan")
    err.print(f"[bold]plain {'greedy' if greedy else 'sampling'}[/]: {len(plain.tokens)} tokens, "
              f"{plain.tokens_per_s:.1f} tokens/s")
    same = plain.tokens == result.tokens
    head = f"[bold]speedup {speedup:.2f}x[/] (wall time, one run each); outputs identical: "
    if not greedy:  # two samples of one distribution need not be equal
        err.print(head + f"{'yes' if same else 'no'} (sampling: equal in distribution; with the same --seed "
                         "usually equal token for token)")
        return 0
    if dtype in SIXTEEN_BIT:
        first = next((i for i, (a, b) in enumerate(zip(result.tokens, plain.tokens)) if a != b),
                     min(len(result.tokens), len(plain.tokens)))
        where = "" if same else f", from token {first} on"
        err.print(head + f"{'yes' if same else 'no'}{where}. In {dtype.removeprefix('torch.')} a pass over several "
                         "tokens rounds differently from a one-token pass, so near-ties between the two likeliest "
                         "tokens can flip; racer promises there that every token is the argmax of logits computed for "
                         "its true context, up to 16-bit rounding (docs/lossless.md). Use float32 for output "
                         "identical to plain greedy decoding.")
        return 0
    err.print(head + ("[green]yes[/]" if same else "[red]NO[/]"))
    return 0 if same else 1


def _cmd_chat(args: argparse.Namespace) -> int:
    from rich.console import Console
    from transformers.utils import logging as hf_logging

    from racer import GenerationOptions, load_model, parse_method
    from racer.chat import Chat, run

    parse_method(args.method)  # fail on a bad method before loading anything
    options = GenerationOptions(max_new_tokens=args.max_new_tokens, **_sampling(args))
    _setup_torch(args.threads)
    hf_logging.disable_progress_bar()
    console = Console(highlight=False, soft_wrap=True)
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device,
                                  announce=lambda line: console.print(line, style="dim"))
    return run(Chat(model, tokenizer, args.method, options, console, args.system), console.input)


def _generation_json(method: str, tokenizer: object, result: object, plain: object) -> dict:
    from racer import TokenSpans

    pieces = TokenSpans.of(tokenizer, result).pieces()
    out = {"method": method, "text": result.text, "stop_reason": result.stop_reason,
           "tokens": [{"id": t, "text": p, "source": s, "step": n}
                      for t, p, s, n in zip(result.tokens, pieces, result.token_sources, result.token_steps)],
           "provenance": result.provenance, "passes": result.passes, "mat": round(result.mat, 4),
           "tree_sizes": [s.tree_size for s in result.steps], "prefill_s": round(result.prefill_s, 4),
           "wall_s": round(result.wall_s, 4), "tokens_per_s": round(result.tokens_per_s, 2)}
    if plain is not None:
        out["plain"] = {"wall_s": round(plain.wall_s, 4), "tokens_per_s": round(plain.tokens_per_s, 2),
                        "identical": plain.tokens == result.tokens}
    return out


def _cmd_bench(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from racer import bench

    # Piped or captured output gets the whole table rather than one folded to 80 columns.
    console = Console() if sys.stdout.isatty() else Console(width=160)
    if args.report:
        result = bench.merge([bench.load(path) for path in args.report])
    else:
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        baseline = args.baseline or ("ar" if "ar" in methods or not methods else methods[0])
        if args.warmup < 0:
            raise ValueError(f"warmup: expected 0 or more prompts, got {args.warmup}")
        from racer import parse_method

        for spec in methods:  # fail on a bad method before loading anything
            if spec not in ("ar",) + bench.HF_METHODS:
                parse_method(spec)
        sampling = _sampling(args)
        questions = bench.iter_questions([d.strip() for d in args.datasets.split(",") if d.strip()], args.limit)
        threads = _setup_torch(args.threads)
        import torch
        from transformers.utils import logging as hf_logging

        from racer import load_model

        hf_logging.disable_progress_bar()
        torch.manual_seed(args.seed or 0)
        model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn()]
        with Progress(*columns, console=console, transient=True) as bar:
            task = bar.add_task("prompts x methods", total=len(questions) * len(methods))
            result = bench.run_bench(model, tokenizer, methods, questions, max_new_tokens=args.max_new_tokens,
                                     baseline=baseline, warmup=args.warmup, threads=threads, sampling=sampling,
                                     progress=lambda spec: bar.update(task, advance=1, description=spec))
        result.settings.update(datasets=args.datasets, limit=args.limit, dtype=args.dtype,
                               model=args.model or "SmolLM2-135M-Instruct")
        if args.json:
            bench.save(result, args.json)
    bench.render_tables(result, console)
    if args.plots:
        for path in bench.write_plots(result, args.plots):
            console.print(f"wrote {path}")
    if args.json and not args.report:
        console.print(f"wrote {args.json}")
    return 0


def _cmd_measure(args: argparse.Namespace) -> int:
    from racer.bench import measure

    measure.run(args)
    return 0


def _cmd_datastore(args: argparse.Namespace) -> int:
    import time

    from racer import DEFAULT_MODEL, build_datastore, load_tokenizer

    start = time.perf_counter()
    tokenizer = load_tokenizer(args.model)
    meta = build_datastore(args.corpus, tokenizer, args.out, field=args.field, pattern=args.pattern,
                           exclude=args.exclude, name=args.model or DEFAULT_MODEL)
    print(f"wrote {args.out}: {meta['documents']} documents, {meta['tokens']} tokens "
          f"(tokenizer {meta['tokenizer']}, fingerprint {meta['fingerprint']}) in {time.perf_counter() - start:.1f} s")
    return 0


def _cmd_cost(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from racer.engine.calibration import cost_file, disk_cache_enabled, load_or_measure
    from racer.fastpaths import KERNEL_LABELS
    from racer.loading import load_model

    threads = _setup_torch(args.threads)
    hf_logging.disable_progress_bar()
    model, _ = load_model(args.model, dtype=args.dtype, device=args.device)
    cached = disk_cache_enabled() and cost_file(model).exists() and not args.refresh
    table = load_or_measure(model, refresh=args.refresh)
    print(f"{'cached in' if cached else 'measured now, saved to'} {table.path or '(not saved)'} ({threads} threads)")
    print("nodes: " + " ".join(f"{n:>6}" for n in table.sizes))
    print("ms:    " + " ".join(f"{1000 * t:>6.1f}" for t in table.seconds))
    print("kernel:" + " ".join(f"{KERNEL_LABELS[k]:>6}" for k in table.kernels))
    if table.prefill_size:
        print(f"prompt chunks: {KERNEL_LABELS[table.prefill_kernel]} (fastest on {table.prefill_size} prompt tokens)")
    print(f"at a cache of {table.length} tokens; per extra cached token: "
          f"+{1e6 * table.per_position:.2f} µs per step + {1e6 * table.per_position_node:.3f} µs per node")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from racer.serve import serve

    if args.max_queue < 0:
        raise ValueError(f"--max-queue: expected 0 or more, got {args.max_queue}")
    if args.prefix_cache_mib < 0:
        raise ValueError(f"--prefix-cache-mib: expected 0 or more, got {args.prefix_cache_mib}")
    threads = _setup_torch(args.threads)
    serve(args.model, method=args.method, dtype=args.dtype, device=args.device, host=args.host, port=args.port,
          max_batch=args.max_batch, max_queue=args.max_queue, api_key=args.api_key,
          default_max_tokens=args.default_max_tokens, grace=args.grace, memory_scope=args.memory_scope,
          max_body=args.max_body, threads=threads, prefix_cache_mib=args.prefix_cache_mib,
          prefill_chunk=args.prefill_chunk)
    return 0


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    from racer import parse_method
    from racer.bench.serving import bench_serve, server_memory

    try:
        concurrency = [_positive(c) for c in args.concurrency.split(",")]
    except argparse.ArgumentTypeError as err:
        raise ValueError(f"--concurrency: {err}") from None
    methods = [m for m in args.methods.split(",") if m]
    for method in methods:
        parse_method(method)  # a bad spec fails before any server starts
    if args.memory:
        try:
            marks = sorted(_positive(m) for m in args.memory.split(","))
        except argparse.ArgumentTypeError as err:
            raise ValueError(f"--memory: {err}") from None
        rows = server_memory(methods[0], marks, max(concurrency), 16, Path(args.out), args.model, args.dtype,
                             args.threads, args.max_batch)
        print("| requests answered | resident memory (MiB) | idle drafters |\n|---|---|---|")
        for row in rows:
            print(f"| {row['requests']} | {row['rss_mib']:.0f} | {row['idle_drafters']:.0f} |")
        return 0
    from racer.bench.servers import vllm_speculative_config

    vllm_methods = [m for m in args.vllm_methods.split(",") if m]
    for method in vllm_methods:
        vllm_speculative_config(method)  # a bad name fails before any server starts
    if args.vllm and not Path(args.vllm).is_file():
        raise ValueError(f"--vllm: no Python at {args.vllm} (make vllm-env builds .venv-vllm/bin/python)")
    loads = bench_serve(methods, concurrency, args.max_tokens, args.per_client, not args.no_anchor, Path(args.out),
                        args.model, args.dtype, args.threads, args.max_batch, args.rounds,
                        vllm=args.vllm, vllm_methods=vllm_methods, vllm_tokens=args.vllm_tokens,
                        vllm_racer_tokens=args.vllm_racer_tokens,
                        fresh=args.fresh_servers or bool(args.vllm), workload=args.workload)
    return 0 if loads and not any(load.errors for load in loads) else 1


COMMANDS = {"generate": _cmd_generate, "chat": _cmd_chat, "methods": _cmd_methods, "bench": _cmd_bench,
            "cost": _cmd_cost, "serve": _cmd_serve, "bench-serve": _cmd_bench_serve, "measure": _cmd_measure,
            "datastore": _cmd_datastore}


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (ValueError, LookupError) as err:  # bad input: one clear line, no traceback
        print(f"racer: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("racer: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
