"""Chain proposers replayed on the same greedy answers, as vLLM would verify them: how
many tokens each step emits, how many draft tokens each verified, for racer's proposer
(``racer.integrations.vllm.ChainDrafts``) at fixed floors and for suffix decoding
(Arctic Inference's ``SuffixDecodingCache`` with vLLM's defaults).

    python replay.py answers WORKLOAD N OUT.pkl            # .venv: greedy answers, top-k rows
    python replay.py racer OUT.pkl C METHOD FLOOR[,FLOOR]  # .venv: racer's proposer
    python replay.py suffix OUT.pkl C [MIN_PROB,FACTOR,CACHED] # .venv-vllm: suffix decoding

C rows decode at once, each step proposing for every row, a finished request's row
taking the next request (what vLLM's batch does, minus timing). A chain's accepted
length is its longest prefix that the greedy answer continues with. racer's proposer
gets, as inside vLLM, the model's top-k ids at every position its last chain was
verified at: the answer's own rows (one pass over prompt + answer) where the chain
agreed with it, and a pass over the rejected tokens where it did not (cached in the
answers file, so every floor reuses them). Figures are printed and appended to
OUT.pkl's folder as ``replay.jsonl``.
"""
import json, os, pickle, sys, time
from pathlib import Path

import numpy as np

MAX_TOKENS = 256
K = 8


def answers(workload: str, n: int, out: Path) -> None:
    import torch
    import racer
    from racer.bench.clients import prompt_pool
    from racer.engine.options import encode_prompt
    from racer.engine.verifier import TreeVerifier

    torch.set_num_threads(2)
    tok = racer.load_tokenizer(None)
    model, _ = racer.load_model(None)
    pool = prompt_pool(workload)
    prompts = []
    for item in pool:  # agent sessions: every call of a session, in order
        prompts.extend(item.requests if hasattr(item, "requests") else [item])
    prompts = prompts[:n]
    records = []
    for i, prompt in enumerate(prompts):
        ids = encode_prompt(tok, prompt, chat=True)
        result = racer.generate(model, tok, ids, method="racer", max_new_tokens=MAX_TOKENS)
        answer = list(result.tokens)
        verifier = TreeVerifier(model)
        with torch.inference_mode():
            logits = verifier.prefill(ids + answer, keep=0)
            rows = torch.topk(logits, K, dim=-1).indices.numpy().astype(np.int32)
        full = ids + answer
        # rows[p]: the model's top-k after full[p]; greedy means rows[p][0] == full[p+1]
        agree = sum(int(rows[len(ids) - 1 + j][0] == answer[j]) for j in range(len(answer)))
        kv = [(k[0].clone(), v[0].clone()) for k, v in verifier._layers()]
        records.append({"prompt": ids, "answer": answer, "rows": rows, "agree": agree})
        torch.save(kv, out.with_suffix(f".kv{i}.pt"))
        print(f"{i}: prompt {len(ids)} answer {len(answer)} teacher-forced argmax agrees at {agree}", flush=True)
    with open(out, "wb") as f:
        pickle.dump({"workload": workload, "records": records, "forwards": {}}, f)


class Rows:
    """The top-k rows of the positions a chain was verified at."""

    def __init__(self, data: dict, out: Path) -> None:
        self.records, self.forwards, self.out = data["records"], data["forwards"], out
        self._verifier = None
        self.passes = 0

    def of(self, req: int, root_at: int, chain: list[int], accepted: int) -> np.ndarray:
        rec = self.records[req]
        full_rows = rec["rows"]
        rows = [full_rows[root_at + i] for i in range(accepted + 1)]
        rest = chain[accepted:]
        if rest:
            rows.extend(self._forward(req, root_at + accepted + 1, rest))
        return np.stack(rows)

    def _forward(self, req: int, length: int, tokens: list[int]) -> list[np.ndarray]:
        key = (req, length, tuple(tokens))
        if key not in self.forwards:
            import torch
            from racer.drafting.tree import chain
            from racer.engine.verifier import TreeVerifier

            if self._verifier is None:
                import racer
                torch.set_num_threads(int(os.environ.get("REPLAY_THREADS", 2)))
                model, _ = racer.load_model(None)
                self._verifier = TreeVerifier(model)
                self._kv = {}
            if req not in self._kv:
                self._kv = {req: torch.load(self.out.with_suffix(f".kv{req}.pt"))}
            with torch.inference_mode():
                self._verifier.resume(self._kv[req], length)
                logits = self._verifier.verify(chain(tokens[0], tokens[1:]))
                self.forwards[key] = torch.topk(logits, K, dim=-1).indices.numpy().astype(np.int32)
            self.passes += 1
        return list(self.forwards[key])


STEPS: list | None = None  # set to a list to log each step: (request, answer tokens before it, chain, accepted)


def replay(data: dict, c: int, propose, finish=None) -> dict:
    """Decode every record with at most ``c`` rows at once. ``propose(rows)`` gets, per
    row, (request, tokens just emitted, whole context) and returns each row's chain."""
    records = data["records"]
    queue = list(range(len(records)))
    active: list[list] = []  # [request, emitted so far, tokens just emitted]
    stats = {"steps": 0, "emitted": 0, "drafted": 0, "accepted": 0, "empty": 0, "requests": len(records)}
    while queue or active:
        while queue and len(active) < c:
            req = queue.pop(0)
            active.append([req, 1, [records[req]["answer"][0]]])  # the first token comes from prefill
        view = []
        for req, done, new in active:
            rec = records[req]
            view.append((req, new, rec["prompt"] + rec["answer"][:done]))
        chains = propose(view)
        still = []
        for (req, done, new), chain in zip(active, chains):
            answer = records[req]["answer"]
            left = answer[done:]
            accepted = 0
            while accepted < len(chain) and accepted < len(left) and chain[accepted] == left[accepted]:
                accepted += 1
            emitted = left[: accepted + 1]
            stats["steps"] += 1
            stats["drafted"] += len(chain)
            stats["accepted"] += accepted
            stats["empty"] += not chain
            if STEPS is not None:
                STEPS.append((req, done, [int(t) for t in chain], accepted))
            stats["emitted"] += len(emitted)
            if done + len(emitted) < len(answer):
                still.append([req, done + len(emitted), emitted])
            elif finish is not None:
                finish(req)
        active = still
    return stats


def summary(label: str, stats: dict) -> dict:
    s = dict(stats, label=label)
    s["tokens_per_step"] = s["emitted"] / s["steps"]
    s["acceptance"] = s["accepted"] / max(1, s["drafted"])
    s["drafted_per_step"] = s["drafted"] / s["steps"]
    s["empty_share"] = s["empty"] / s["steps"]
    for beta in (0.03, 0.1, 0.3):  # a draft token's cost as a share of a row's one-token step
        s[f"model_speedup_b{beta}"] = s["emitted"] / (s["steps"] + beta * s["drafted"])
    print(f"{label}: {s['tokens_per_step']:.3f} tokens/step, drafted {s['drafted_per_step']:.2f}/step, "
          f"acceptance {s['acceptance']:.3f}, empty {s['empty_share']:.3f}; modelled speedup "
          + ", ".join(f"b={b}: {s[f'model_speedup_b{b}']:.3f}" for b in (0.03, 0.1, 0.3)), flush=True)
    return s


def run_racer(path: Path, c: int, method: str, floors: list[float]) -> list[dict]:
    from racer.integrations.vllm import ChainDrafts

    data = pickle.load(open(path, "rb"))
    rows = Rows(data, path)
    results = []
    for floor in floors:
        drafts = ChainDrafts(method, 16, idle=4 * 8, min_prob=floor)
        by_request: dict[int, tuple[int, list[int]]] = {}  # request -> (root position, last chain)
        keys_of: dict[int, list[str]] = {}  # request -> its last chain's nodes' evidence keys
        tally: dict[str, list[int]] = {}  # evidence key -> [nodes reached, accepted]
        slots: list = []  # the batch's rows: a request or a hole, as vLLM's input batch keeps them

        def propose(view):
            for req, _, _ in view:  # a new request takes the first hole, else a new row
                if req not in slots:
                    if None in slots:
                        slots[slots.index(None)] = req
                    else:
                        slots.append(req)
            while None in slots:  # condense: the last request moves into the first hole
                last = slots.pop()
                if last is not None:
                    slots[slots.index(None)] = last
            by_req = {v[0]: v for v in view}
            sampled, contexts, pass_rows, had_chain = [], [], [], set()
            for req in slots:
                _, new, context = by_req[req]
                last = by_request.get(req)
                if last is not None:  # the pass verified its chain: root and draft tokens
                    root_at, chain = last
                    pass_rows.append(rows.of(req, root_at, chain, len(new) - 1))
                    had_chain.add(len(pass_rows) - 1)
                else:  # its prefill: the prompt's last position
                    pass_rows.append(data["records"][req]["rows"][len(context) - 2][None])
                sampled.append(new)
                contexts.append(context)
            if hasattr(drafts, "_follow"):
                chains = drafts.propose(sampled, contexts, np.concatenate(pass_rows))
            else:  # before 'moved': a callback per row (each row given its request's own rows)
                chains = drafts.propose(sampled, contexts, lambda r: pass_rows[r] if r in had_chain else None)
            for row, (req, context, chain, new) in enumerate(zip(slots, contexts, chains, sampled)):
                pending = keys_of.pop(req, None)
                if pending is not None:  # what its last chain's nodes did, by evidence key
                    accepted = len(new) - 1
                    for depth, key in enumerate(pending, 1):
                        if depth > accepted + 1:
                            break
                        tally.setdefault(key, [0, 0])[0] += 1
                        tally[key][1] += depth <= accepted
                state = drafts.rows.get(row)
                if state is not None and state.chain is not None and state.chain.features:
                    keys_of[req] = [str(state.chain.features[i][:2]) for i in range(1, len(state.chain))]
                by_request[req] = (len(context) - 1, chain)
            out_by_req = dict(zip(slots, chains))
            return [out_by_req[req] for req, _, _ in view]

        def finish(req):
            slots[slots.index(req)] = None

        start = time.perf_counter()
        stats = replay(data, c, propose, finish)
        stats["seconds"] = time.perf_counter() - start
        stats["forward_passes"] = rows.passes
        stats["started"], stats["rebuilt"] = drafts.started, drafts.rebuilt
        stats["by_key"] = {k: v for k, v in sorted(tally.items(), key=lambda kv: -kv[1][0])}
        results.append(summary(f"{data['workload']} C={c} {method} floor={floor}", stats))
    with open(path, "wb") as f:
        pickle.dump(data, f)
    return results


def run_suffix(path: Path, c: int, depth: int = 24, factor: float = 1.0, min_prob: float = 0.1,
               cached: int = 10000) -> list[dict]:
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    data = pickle.load(open(path, "rb"))
    cache = SuffixDecodingCache(max_tree_depth=depth, max_cached_requests=cached)
    records = data["records"]

    def propose(view):
        out = []
        for req, new, context in view:
            if req not in cache.active_requests:
                cache.start_request(req, np.array(records[req]["prompt"], dtype=np.int32))
            cache.add_active_response(req, list(new))
            pattern = np.array(context[-depth:], dtype=np.int32)
            draft = cache.speculate(req, pattern, max_spec_tokens=depth, max_spec_factor=factor,
                                    min_token_prob=min_prob)
            out.append(list(draft.token_ids))
        return out

    stats = replay(data, c, propose, cache.stop_request)
    return [summary(f"{data['workload']} C={c} suffix min_prob={min_prob} factor={factor} cached={cached}", stats)]


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "answers":
        answers(sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]))
        sys.exit()
    path, c = Path(sys.argv[2]), int(sys.argv[3])
    if mode == "racer":
        results = run_racer(path, c, sys.argv[4], [float(f) for f in sys.argv[5].split(",")])
    else:
        extra = [float(x) for x in sys.argv[4].split(",")] if len(sys.argv) > 4 else []
        min_prob, factor, cached = (extra + [0.1, 1.0, 10000][len(extra):])[:3]
        results = run_suffix(path, c, 24, factor, min_prob, int(cached))
    with open(path.parent / "replay.jsonl", "a") as f:
        for r in results:
            f.write(json.dumps(r) + "\n")
