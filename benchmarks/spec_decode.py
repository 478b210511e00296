"""Speculative decoding: decode tok/s with and without drafts, same run, same weights.

- SmolLM2 (the packaged GGUF), n-gram prompt lookup with k drafts, batch 1 and 8, on
  (a) an input-grounded workload: chat prompts that ask to repeat or lightly edit a given
      passage, so the answer copies the prompt (where prompt lookup pays), and
  (b) the random workload: random-token prompts, as ``lane bench --dataset random`` sends
      (little to look up: this measures what speculation costs when it finds nothing).
- MTP on the random DeepSeek V3.2 / V4 of the MoE benchmarks (moe_decode.py, v4_decode.py):
  random MTP heads accept almost nothing, so this is the overhead of drafting and verifying.

Decode speed is (time for 1 + N tokens) - (time for 1 token): prefill cancels out. Greedy,
ignore EOS; both engines are loaded at once and measured alternately, best of ``--repeats``. vLLM's CPU runner refuses speculative decoding (vllm
#28384), so the peer here is lane itself without drafts.

    python benchmarks/spec_decode.py [--batch-sizes 1,8] [--new-tokens 64] [--k 3] [--mtp-k 1]
                                     [--skip-mtp] [--skip-ngram]

The last line is a JSON object of the headline figures.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_decode import prompts as random_prompts, time_lane as timed  # noqa: E402
from offline_throughput import check_quiet  # noqa: E402

PASSAGES = [
    "The city council met on Tuesday to discuss the new budget. After a long debate, the members agreed to "
    "increase funding for public libraries and parks, while reducing spending on road repairs. The mayor said "
    "the decision reflects what residents asked for during the spring consultations, and that the changes "
    "will take effect at the start of the next fiscal year.",
    "To bake the bread, mix the flour, water, salt and yeast in a large bowl until a rough dough forms. Knead "
    "it on a floured surface for ten minutes, then leave it covered in a warm place for an hour. Shape the "
    "loaf, let it rise again for thirty minutes, and bake it in a hot oven for about forty minutes.",
    "The museum's new exhibition brings together more than two hundred objects from ancient trade routes, "
    "including coins, textiles, maps and ceramics. Visitors can follow the journey of goods across deserts "
    "and seas, and learn how merchants, sailors and scholars exchanged ideas as well as products.",
    "Our support team is available from nine in the morning until six in the evening, Monday to Friday. If "
    "you have a problem with your order, please include your order number and a short description of the "
    "issue in your message, and we will reply within one working day.",
]
TASKS = ["Repeat the following passage exactly, word for word:",
         "Copy the following text, changing nothing:",
         "Rewrite the following passage, replacing every 'the' with 'THE' and keeping everything else:",
         "Repeat this paragraph back to me verbatim:"]


def grounded_prompts(llm, batch: int) -> list[list[int]]:
    out = []
    for i in range(batch):
        msg = f"{TASKS[i % len(TASKS)]}\n\n{PASSAGES[i % len(PASSAGES)]}"
        out.append(llm.apply_chat_template([{"role": "user", "content": msg}]))
    return out


def decode_time(llm, ids, n_new: int) -> float:
    return timed(llm, ids, 1 + n_new) - timed(llm, ids, 1)


def acceptance(llm, before) -> dict:
    after = llm.engine.scheduler.make_stats().spec_decoding
    drafts = after.num_drafts - before.num_drafts
    draft_toks = after.num_draft_tokens - before.num_draft_tokens
    acc = after.num_accepted_tokens - before.num_accepted_tokens
    return {"acceptance_rate": round(acc / draft_toks, 3) if draft_toks else 0.0,
            "acceptance_length": round(1 + acc / drafts, 2) if drafts else 1.0}


def run_model(label: str, make_llm, spec: dict, workloads: dict, batches: list[int], n_new: int,
              repeats: int, results: dict) -> None:
    """Both engines loaded at once; each measurement alternates off / on (best of ``repeats``
    each), so a slow spell of the machine hits both."""
    print(f"[{label}] loading both engines (speculation off, on) ...", flush=True)
    off, on = make_llm(None), make_llm(spec)
    for wl, prompts in workloads.items():
        for b in batches:
            ids = prompts(off, b)
            for llm in (off, on):
                timed(llm, ids, 2)  # warm-up
            before = on.engine.scheduler.make_stats().spec_decoding
            best = {"off": float("inf"), "on": float("inf")}
            for _ in range(repeats):
                best["off"] = min(best["off"], decode_time(off, ids, n_new))
                best["on"] = min(best["on"], decode_time(on, ids, n_new))
            r = {k: {"decode_tok_s": round(b * n_new / t, 1)} for k, t in best.items()}
            r["on"].update(acceptance(on, before))
            results[(label, wl, b)] = r
            print(f"  {wl:9s} batch {b}: off {r['off']}, on {r['on']}", flush=True)
    for llm in (off, on):
        llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=3, help="drafts per step (n-gram)")
    ap.add_argument("--mtp-k", type=int, default=1, help="drafts per step (MTP)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-mtp", action="store_true")
    ap.add_argument("--skip-ngram", action="store_true")
    args = ap.parse_args()
    check_quiet()
    from lane import LLM

    batches = [int(b) for b in args.batch_sizes.split(",")]
    results: dict = {}
    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    if not args.skip_ngram:
        run_model("SmolLM2 n-gram", lambda cfg: LLM(show_progress=False, speculative_config=cfg), ngram,
                  {"grounded": grounded_prompts, "random": lambda llm, b: random_prompts(b, 128)},
                  batches, args.new_tokens, args.repeats, results)
    if not args.skip_mtp:
        from moe_decode import CONFIG as V32_CONFIG, MODEL_DIR as V32_DIR, cached_model
        from v4_decode import CONFIG as V4_CONFIG, MODEL_DIR as V4_DIR

        mtp = {"method": "mtp", "num_speculative_tokens": args.mtp_k}
        for label, arch, cfg, path in (("V3.2 MTP", "deepseek_v32", V32_CONFIG, V32_DIR),
                                       ("V4 MTP", "deepseek_v4", V4_CONFIG, V4_DIR)):
            path = cached_model(arch, path + "-mtp", cfg)
            run_model(label, lambda c, p=path: LLM(p, max_model_len=1024, show_progress=False,
                                                   speculative_config=c), mtp,
                      {"random": lambda llm, b: random_prompts(b, 256)}, [1], args.new_tokens // 2, args.repeats,
                      results)

    print("\n| model | workload | batch | decode tok/s off | on | ratio | acceptance rate | length |")
    print("|---|---|---|---|---|---|---|---|")
    headline = {}
    for (label, wl, b), r in results.items():
        off, on = r["off"]["decode_tok_s"], r["on"]["decode_tok_s"]
        ratio = round(on / off, 2)
        print(f"| {label} | {wl} | {b} | {off} | {on} | {ratio}x | {r['on'].get('acceptance_rate')} | "
              f"{r['on'].get('acceptance_length')} |")
        key = f"{label.split()[0].lower().replace('.', '')}_{label.split()[1].lower().replace('-', '')}_{wl}_b{b}"
        headline[f"{key}_speedup"] = ratio
        headline[f"{key}_acceptance_rate"] = r["on"].get("acceptance_rate")
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
