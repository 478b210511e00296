"""Quality of the quantized path (`--quantization auto`: GGUF blocks, 8-bit activations)
against the dequantized float32 path (`none`) on the embedded SmolLM2 Q4_1, same build, same
run: perplexity on the README (teacher-forced, 16-token chunks: the integer kernels' rows),
and greedy agreement over 256 tokens from a few prompts (matching tokens before the first
difference, and position by position).

    python benchmarks/quantized_quality.py [--tokens 256]

The last line is a JSON object: both perplexities and their ratio, and the agreement.
"""
from __future__ import annotations

import argparse
import json
import os

PROMPTS = ["The capital of France is", "Write a short story about a robot who learns to paint.",
           "def quicksort(arr):", "The three laws of thermodynamics are", "Once upon a time, in a small village,",
           "Explain how a hash table works."]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    from lane import LLM, SamplingParams
    from lane.bench.quality import perplexity

    common = dict(dtype="float32", show_progress=False, max_model_len=2048, kv_cache_memory_bytes=512 << 20,
                  enable_prefix_caching=False)
    llms = {q: LLM(quantization=q, **common) for q in ("auto", "none")}
    readme = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
    ids = llms["auto"].get_tokenizer().encode(open(readme).read())[:1024]
    ppl = {}
    for q, llm in llms.items():
        ppl[q] = perplexity(llm, ids)
        print(f"perplexity, README ({len(ids)} tokens), {q}: {ppl[q]:.3f}", flush=True)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    outs = {q: [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
            for q, llm in llms.items()}
    prefix, same = [], []
    for p, a, b in zip(PROMPTS, outs["auto"], outs["none"]):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        prefix.append(first)
        same.append(sum(x == y for x, y in zip(a, b)) / len(a))
        print(f"  {p[:40]!r:44s} identical for {first:3d} of {len(a)} tokens; {100 * same[-1]:5.1f}% by position")
    res = {"ppl_auto": round(ppl["auto"], 3), "ppl_none": round(ppl["none"], 3),
           "ppl_ratio": round(ppl["auto"] / ppl["none"], 4), "tokens": args.tokens,
           "greedy_identical_prefix": prefix, "greedy_identical_prefix_mean": round(sum(prefix) / len(prefix), 1),
           "greedy_same_by_position": round(sum(same) / len(same), 3)}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
