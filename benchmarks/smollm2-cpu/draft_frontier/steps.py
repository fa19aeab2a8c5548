"""Where racer's proposer and suffix decoding draft differently: each step of a replay
logged (request, answer position, chain, accepted), then two logs joined on the
positions both reached.

    .venv/bin/python steps.py log /tmp/df/code.pkl 8 /tmp/df/racer.json racer 0.2      # racer's proposer
    .venv-vllm/bin/python steps.py log /tmp/df/code.pkl 8 /tmp/df/suffix.json suffix  # suffix decoding
    python steps.py join /tmp/df/racer.json /tmp/df/suffix.json
"""
import collections, json, sys
from pathlib import Path

import replay


def log(path: Path, c: int, out: str, method: str, floor: float | None) -> None:
    replay.STEPS = []
    results = replay.run_suffix(path, c) if method == "suffix" else replay.run_racer(path, c, method, [floor])
    for key, (reached, accepted) in results[0].get("by_key", {}).items():
        print(f"  {key}: {accepted}/{reached} accepted where reached ({accepted / reached:.2f})")
    json.dump(replay.STEPS, open(out, "w"))


def join(first: str, second: str) -> None:
    a = {(r, p): (chain, acc) for r, p, chain, acc in json.load(open(first))}
    b = {(r, p): (chain, acc) for r, p, chain, acc in json.load(open(second))}
    common = set(a) & set(b)
    print(f"positions both reached: {len(common)} (first {len(a)}, second {len(b)})")
    groups = collections.defaultdict(lambda: [0, 0, 0, 0, 0])  # steps, drafted and accepted by each
    for key in common:
        (ca, aa), (cb, ab) = a[key], b[key]
        g = groups[("first drafts" if ca else "first empty", "second drafts" if cb else "second empty")]
        for i, v in enumerate((1, len(ca), aa, len(cb), ab)):
            g[i] += v
    for kind, (n, da, aa, db, ab) in sorted(groups.items()):
        print(f"{kind[0]}, {kind[1]}: {n} steps; first drafted {da}, accepted {aa}; second drafted {db}, accepted {ab}")


if __name__ == "__main__":
    if sys.argv[1] == "log":
        method = sys.argv[5]
        log(Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4], method, float(sys.argv[6]) if method != "suffix" else None)
    else:
        join(sys.argv[2], sys.argv[3])
