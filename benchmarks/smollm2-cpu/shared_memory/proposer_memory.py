"""What racer's drafter memory holds after 10,000 requests, through the code that keeps it:
the vLLM proposer's core (``ChainDrafts``, 8 rows decoding at once, its default method
``racer:memory=shared``, scope ``server`` or ``request``) and racer serve's
``DrafterMemory`` (``--memory-scope user`` with 1,000 users, its default method and
``racer:memory=shared``). No model runs: a request's prompt is the first part of a real
text of the shipped datasets (the agent sessions' whole conversations included), its
answer the next ``ANSWER`` tokens of that text (or, with ``novel``, tokens drawn at
random, so every n-gram is new: the automata's worst case); the stand-in verifier
accepts a chain as far as it follows the answer, and gives as the model's top-k the
answer's next token first, random ids after. Prints, at each checkpoint, the process's
resident memory over its start, what each structure holds, and the proposer's Python
time per row and step.

    .venv/bin/python benchmarks/smollm2-cpu/shared_memory/proposer_memory.py VARIANT [REQUESTS] [novel]

VARIANT: ``vllm-server``, ``vllm-request``, ``serve-user``, ``serve-user-shared``.
"""

import gc
import json
import random
import sys
import time

import numpy as np

from racer import load_tokenizer, parse_method
from racer.bench.questions import DATASETS, load_questions
from racer.engine.memory import DrafterMemory
from racer.integrations.vllm import ChainDrafts

ANSWER = 64  # answer tokens a request
PROMPT = 1024  # at most this many prompt tokens
ROWS = 8
K = 8  # top-k ids a verified position gives (RACER's copy-logit rows)
CHECKPOINTS = (0, 100, 1_000, 2_500, 5_000, 7_500, 10_000)

variant = sys.argv[1]
requests_total = int(sys.argv[2]) if len(sys.argv) > 2 else 10_000
novel = "novel" in sys.argv[3:]
rng = random.Random(0)
tokenizer = load_tokenizer(None)
vocab = len(tokenizer)


def text_ids(question) -> list[int]:
    if question.messages:
        return tokenizer.apply_chat_template(list(question.messages), tokenize=True)
    return tokenizer.encode(question.prompt)


texts = [ids for d in DATASETS for ids in map(text_ids, load_questions(d)) if len(ids) > 24]


def request(serial: int) -> tuple[list[int], list[int]]:
    ids = texts[serial % len(texts)]
    cut = min(PROMPT, max(16, len(ids) - ANSWER))
    prompt, answer = ids[:cut], ids[cut : cut + ANSWER]
    answer += [rng.randrange(vocab) for _ in range(ANSWER - len(answer))]  # a short text's answer, padded
    if novel:
        answer = [rng.randrange(vocab) for _ in range(ANSWER)]
    return prompt, answer


def topk_rows(chain: list[int], truth: list[int]) -> np.ndarray:
    """The model's top-k at each verified position: the true next token first where the
    chain still follows the answer, random ids after."""
    rows = np.array([[rng.randrange(vocab) for _ in range(K)] for _ in range(len(chain) + 1)], dtype=np.int64)
    for at in range(len(chain) + 1):
        if at < len(truth):
            rows[at, 0] = truth[at]
        if at < len(chain) and (at >= len(truth) or chain[at] != truth[at]):
            break
    return rows


def resident_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def shared_stats(memory: DrafterMemory) -> dict:
    stats = [s.stats() for s in memory.shared.values()]
    return {"shared_scopes": len(stats), "shared_nodes": sum(s["nodes"] for s in stats),
            "shared_table_rows": sum(s["rows"] for s in stats), "shared_evictions": sum(s["evictions"] for s in stats)}


def idle_stats(memory: DrafterMemory) -> dict:
    nodes = rows = 0
    for _, (drafter, _) in memory.pool._idle.values():  # RACER drafters
        nodes += drafter.automaton.live
        rows += len(drafter.table)
    return {"idle_drafters": len(memory), "idle_nodes": nodes, "idle_table_rows": rows,
            "rate_models": len(memory.rates)}


def report(done: int, started_mib: float, seconds: float, row_steps: int, memory: DrafterMemory, extra: dict) -> None:
    gc.collect()
    line = {"variant": variant, "novel": novel, "requests": done,
            "resident_mib_more": round(resident_mib() - started_mib, 1),
            "us_per_row_step": round(seconds / max(row_steps, 1) * 1e6, 1), **shared_stats(memory),
            **idle_stats(memory), **extra}
    print(json.dumps(line), flush=True)


def run_vllm(scope: str | None) -> None:
    drafts = ChainDrafts("racer:memory=shared", tokens=16, idle=4 * ROWS, tokenizer=tokenizer, end_ids=set(), scope=scope)
    started_mib = resident_mib()
    live: list[list] = [None] * ROWS  # per row: [context, answer, at, chain]
    begun = done = row_steps = 0
    seconds = 0.0
    checkpoints = list(CHECKPOINTS)
    report(0, started_mib, 0.0, 0, drafts.memory, {"rows": 0})
    checkpoints.pop(0)
    while done < requests_total:
        sampled, contexts, rows_topk = [], [], []
        for row in range(ROWS):
            state = live[row]
            if state is None or state[2] >= len(state[1]):
                if state is not None:
                    done += 1
                    if checkpoints and done >= checkpoints[0]:
                        report(done, started_mib, seconds, row_steps, drafts.memory, {"rows": len(drafts.rows)})
                        checkpoints.pop(0)
                prompt, answer = request(begun)
                begun += 1
                state = live[row] = [prompt + [answer[0]], answer, 1, []]
                sampled.append([answer[0]])  # its prefill sampled the answer's first token
                rows_topk.append(np.array([[answer[0]] + [rng.randrange(vocab) for _ in range(K - 1)]]))
            else:
                context, answer, at, chain = state
                truth = answer[at:]
                accepted = 0
                while accepted < len(chain) and accepted < len(truth) and chain[accepted] == truth[accepted]:
                    accepted += 1
                new = truth[: accepted + 1]
                state[0] = context + new
                state[2] = at + len(new)
                sampled.append(new)
                rows_topk.append(topk_rows(chain, truth))
            contexts.append(state[0])
        tic = time.perf_counter()
        chains = drafts.propose(sampled, contexts, np.concatenate(rows_topk), 0.3)
        seconds += time.perf_counter() - tic
        row_steps += ROWS
        for row, chain in enumerate(chains):
            live[row][3] = chain


def run_serve(method: str, users: int = 1000) -> None:
    parsed = parse_method(method)

    def build():
        drafter = parse_method(method).drafter
        drafter.attach(tokenizer, set())
        return drafter

    memory = DrafterMemory(build, rated=True, limit=4 * ROWS)  # racer serve's default: 4 × --max-batch
    size = parsed.draft_size
    started_mib = resident_mib()
    seconds, row_steps = 0.0, 0
    checkpoints = list(CHECKPOINTS)
    report(0, started_mib, 0.0, 0, memory, {})
    checkpoints.pop(0)
    for serial in range(requests_total):
        prompt, answer = request(serial)
        tic = time.perf_counter()
        session = memory.begin(f"user-{serial % users}", prompt, None)
        at, context = 0, list(prompt)
        while at < len(answer):
            tree = session.draft(context[-1], size)
            truth = answer[at:]
            path, node = [0], 0
            for token in truth:  # the tree's deepest path that follows the answer
                nxt = tree.child(node, token)
                if nxt is None:
                    break
                path.append(nxt)
                node = nxt
            rows = np.array([[rng.randrange(vocab) for _ in range(K)] for _ in range(len(tree))], dtype=np.int64)
            for depth, index in enumerate(path):
                if depth < len(truth):
                    rows[index, 0] = truth[depth]
            session.observe(tree, rows, path)
            new = truth[: len(path)]
            context += new
            at += len(new)
            row_steps += 1
        memory.end(session)
        seconds += time.perf_counter() - tic
        if checkpoints and serial + 1 >= checkpoints[0]:
            report(serial + 1, started_mib, seconds, row_steps, memory, {})
            checkpoints.pop(0)


if variant == "vllm-server":
    run_vllm("server")
elif variant == "vllm-request":
    run_vllm(None)
elif variant == "serve-user":
    run_serve("racer")
elif variant == "serve-user-shared":
    run_serve("racer:memory=shared")
else:
    raise SystemExit(f"variant: expected vllm-server, vllm-request, serve-user or serve-user-shared, "
                     f"got {variant!r}")
