"""What batch invariance costs, and how the step cost grows with the batch: the embedded SmolLM2
under --quantization auto (Q4_1 blocks, the integer kernel for every M) and none (dense), in
bfloat16 and float32, each run batch-invariant (the default) and with LANE_BATCH_INVARIANT=0
(the per-shape fastest paths: oneDNN / MKL for many rows, GGUF weights dequantized for prefill,
the flash prefill attention), same build, same run, interleaved.

    python benchmarks/batch_invariance.py [--configs auto:bfloat16,none:float32] [--rounds 2]

Per config and mode, in a fresh process: offline throughput (--prompts random 128-token prompts,
--output-len tokens each, all submitted at once: prefill chunks and decodes mixed as a server
mixes them), a 512-token prefill, and the decode step at M = 1, 8, 16, 32, 64 rows (M requests
decoding together; the median step over the steps where all M decode). Each figure keeps its
best round. Printed: the table, invariant / fastest per figure, the 32-row / 1-row step ratio
(the issue's target: <= 3x), and last a JSON object of the headline figures.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

RUN = r"""
import json, random, statistics, sys, time
from lane import LLM, SamplingParams
q, dtype, prompts, out_len = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
llm = LLM(dtype=dtype, quantization=q, show_progress=False, max_model_len=1024, max_num_seqs=64,
          enable_prefix_caching=False)
rng = random.Random(0)
def ids(n):
    return {"prompt_token_ids": [rng.randrange(1000, 40000) for _ in range(n)]}
res = {}
work = [ids(128) for _ in range(prompts)]
sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
llm.generate(work[:4], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
t0 = time.perf_counter()
llm.generate(work, sp, use_tqdm=False)
res["throughput_tok_s"] = prompts * out_len / (time.perf_counter() - t0)
one = SamplingParams(temperature=0, max_tokens=1)
p512 = ids(512)
llm.generate([p512], one, use_tqdm=False)
t0 = time.perf_counter()
llm.generate([p512], one, use_tqdm=False)
res["prefill512_tok_s"] = 512 / (time.perf_counter() - t0)
core = llm.engine
for m in (1, 8, 16, 32, 64):
    for j in range(m):
        llm._add_processed(None, ids(32)["prompt_token_ids"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    steps = []
    while core.scheduler.has_unfinished():
        decoding = len(core.scheduler.running) == m and not core.scheduler.waiting
        t0 = time.perf_counter()
        llm._step()
        if decoding:
            steps.append(time.perf_counter() - t0)
    res[f"step_ms_m{m}"] = 1e3 * statistics.median(steps[2:] or steps)
print("RESULT " + json.dumps(res))
"""

FIGURES = ["throughput_tok_s", "prefill512_tok_s"] + [f"step_ms_m{m}" for m in (1, 8, 16, 32, 64)]


def run_one(quant: str, dtype: str, invariant: bool, prompts: int, out_len: int) -> dict:
    env = {**os.environ, "LANE_BATCH_INVARIANT": "1" if invariant else "0", "LANE_LOGGING_LEVEL": "WARNING"}
    p = subprocess.run([sys.executable, "-c", RUN, quant, dtype, str(prompts), str(out_len)], env=env,
                       capture_output=True, text=True, timeout=1800)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{quant}/{dtype} invariant={invariant} failed:\n{p.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def better(name: str, a: float, b: float) -> float:
    return min(a, b) if name.startswith("step_ms") else max(a, b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="auto:bfloat16,auto:float32,none:bfloat16,none:float32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    args = ap.parse_args()
    configs = [tuple(c.split(":")) for c in args.configs.split(",")]
    best: dict[tuple, dict] = {}
    total = args.rounds * len(configs) * 2
    done = 0
    for r in range(args.rounds):
        for quant, dtype in configs:
            for invariant in ((True, False) if r % 2 == 0 else (False, True)):
                done += 1
                print(f"[{done}/{total}] round {r + 1}: {quant} {dtype} "
                      f"{'invariant' if invariant else 'fastest'}", file=sys.stderr, flush=True)
                res = run_one(quant, dtype, invariant, args.prompts, args.output_len)
                key = (quant, dtype, invariant)
                best[key] = res if key not in best else {k: better(k, best[key][k], v) for k, v in res.items()}
    print(f"\nSmolLM2-135M, {args.prompts} prompts x 128 in / {args.output_len} out; best of {args.rounds} rounds")
    print(f"{'config':<15} {'mode':<9} {'tok/s':>7} {'pp512':>7} " + " ".join(f"{'M=' + str(m):>7}" for m in (1, 8, 16, 32, 64))
          + "  32/1")
    headline: dict[str, float] = {}
    for quant, dtype in configs:
        for invariant in (True, False):
            b = best[(quant, dtype, invariant)]
            print(f"{quant + ' ' + dtype:<15} {'invariant' if invariant else 'fastest':<9} "
                  f"{b['throughput_tok_s']:>7.1f} {b['prefill512_tok_s']:>7.0f} "
                  + " ".join(f"{b[f'step_ms_m{m}']:>7.2f}" for m in (1, 8, 16, 32, 64))
                  + f"  {b['step_ms_m32'] / b['step_ms_m1']:.2f}")
        inv, fast = best[(quant, dtype, True)], best[(quant, dtype, False)]
        tag = f"{quant}_{dtype}"
        headline[f"{tag}_throughput_ratio"] = round(inv["throughput_tok_s"] / fast["throughput_tok_s"], 3)
        headline[f"{tag}_prefill_ratio"] = round(inv["prefill512_tok_s"] / fast["prefill512_tok_s"], 3)
        headline[f"{tag}_tok_s"] = round(inv["throughput_tok_s"], 1)
        headline[f"{tag}_step32_over_step1"] = round(inv["step_ms_m32"] / inv["step_ms_m1"], 2)
        headline[f"{tag}_step1_ms"] = round(inv["step_ms_m1"], 2)
    print("\ninvariant / fastest (1.0: free): throughput, 512-token prefill")
    for quant, dtype in configs:
        tag = f"{quant}_{dtype}"
        print(f"  {quant} {dtype}: {headline[f'{tag}_throughput_ratio']:.3f}, {headline[f'{tag}_prefill_ratio']:.3f}")
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
