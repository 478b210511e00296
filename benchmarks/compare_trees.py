"""lane against another checkout of lane (a `git worktree` of an earlier commit), on
offline_throughput.py's workload: 64 random prompts of 128-512 tokens, 128 output tokens,
greedy, the CPU's fastest dtype; plus batch-1 decode and 1,024-token prefill. Runs
alternate between the two trees, each in a fresh process; the figures are medians.

    git worktree add /tmp/lane-before <commit>
    python benchmarks/compare_trees.py /tmp/lane-before/src src [--rounds 3]

The last line is a JSON object: per figure, before, after and after / before.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RUN = f"""
import json, sys
sys.path.insert(0, {HERE!r})
from offline_throughput import concrete_dtype, make_workload, run_lane
dtype = concrete_dtype("auto")
r = run_lane(make_workload(64, 128, 512, 49152, 0), 128, dtype, None)
print(json.dumps({{**r, "dtype": dtype}}))
"""
FIGURES = ("lane_tok_s", "lane_b1_decode_tok_s", "lane_prefill_tok_s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before", help="the other tree's src/ directory")
    ap.add_argument("after", help="this tree's src/ directory")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    trees = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    runs: dict[str, list[dict]] = {k: [] for k in trees}
    for rnd in range(args.rounds):
        for name in (("before", "after") if rnd % 2 == 0 else ("after", "before")):
            env = {**os.environ, "PYTHONPATH": trees[name], "LANE_LOGGING_LEVEL": "WARNING", "HF_HUB_OFFLINE": "1"}
            p = subprocess.run([sys.executable, "-c", RUN], env=env, capture_output=True, text=True)
            if p.returncode:
                sys.exit(f"{name} run failed:\n{p.stderr[-3000:]}")
            r = json.loads(p.stdout.strip().splitlines()[-1])
            runs[name].append(r)
            print(f"round {rnd + 1} {name:6s} " + ", ".join(f"{k} {r[k]:.1f}" for k in FIGURES), flush=True)
    out = {}
    for k in FIGURES:
        b, a = (statistics.median(r[k] for r in runs[n]) for n in ("before", "after"))
        out[k] = {"before": round(b, 1), "after": round(a, 1), "ratio": round(a / b, 3)}
        print(f"{k}: before {b:.1f}, after {a:.1f}: {a / b:.3f}x")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
