"""Greedy float32 output through the seed deployment (lane proxy in front of the prefill and decode
instances) against one rank of one instance of the same model, int8 cache and MTP k = 3 too:
the traced prompt and a few random-token prompts, token for token.

    python check_output.py PROXY_URL MODEL_DIR PROMPT_FILE [--max-tokens 32]
"""
from __future__ import annotations

import argparse
import sys

import httpx2 as httpx
import torch

from lane import LLM, SamplingParams


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("proxy_url")
    ap.add_argument("model")
    ap.add_argument("prompt_file")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    llm = LLM(args.model, dtype="float32", kv_cache_dtype="int8", show_progress=False, kv_cache_memory_bytes=512 << 20,
              speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    tok = llm.get_tokenizer()
    with open(args.prompt_file) as f:
        prompts = [tok(f.read())["input_ids"]]
    g = torch.Generator().manual_seed(1)
    prompts += [torch.randint(3, len(tok), (n,), generator=g).tolist() for n in (200, 700, 1300)]
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                                          use_tqdm=False)]
    llm.shutdown()
    bad = 0
    for i, (p, w) in enumerate(zip(prompts, want)):
        r = httpx.post(args.proxy_url + "/v1/completions", timeout=600, json={
            "model": "seed", "prompt": p, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
            "return_tokens_as_token_ids": True, "logprobs": 1})
        r.raise_for_status()
        got = [int(t.removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["tokens"]]
        same = got == list(w)
        bad += not same
        print(f"prompt {i} ({len(p)} tokens): {'equal' if same else 'DIFFERENT'} "
              f"({sum(a == b for a, b in zip(got, w))}/{len(w)} tokens match)")
    print("greedy output equals one rank of one instance for every prompt" if not bad else f"{bad} prompts differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
