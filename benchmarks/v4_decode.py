"""DeepSeek V4 decode: a small-but-not-trivial random V4 (mHC, sliding + CSA + HCA
attention, hash and learned MoE) decoding in lane and in HF transformers, same run,
same weights, same dtype, batch 1 and 8.

The model (written once under ~/.cache/lane/bench-v4): 8 layers (2 sliding, then CSA /
HCA alternating), hidden 512, 8 heads of 128 with a 128-token window, CSA rate 4 with
an indexer top-64, HCA rate 64, 16 routed experts (4 active; 2 hash layers) + 1
shared, hc_mult 4. 512-token prompts, so the indexer selects and HCA entries exist.
transformers runs V4 eager only (its only attention implementation for V4).

    python benchmarks/v4_decode.py [--batch-sizes 1,8] [--prompt-len 512] [--new-tokens 64]

The last line is a JSON object of the headline figures.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_decode import arguments, cached_model, compare  # noqa: E402
from offline_throughput import check_quiet  # noqa: E402

CONFIG = dict(
    hidden_size=512, num_hidden_layers=8, num_attention_heads=8, head_dim=128, partial_rotary_factor=0.25,
    q_lora_rank=256, o_groups=4, o_lora_rank=128,
    layer_types=["sliding_attention"] * 2 + ["compressed_sparse_attention", "heavily_compressed_attention"] * 3,
    mlp_layer_types=["hash_moe"] * 2 + ["moe"] * 6,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 64},
    sliding_window=128, index_n_heads=16, index_head_dim=64, index_topk=64, n_routed_experts=16,
    num_experts_per_tok=4, moe_intermediate_size=256, initializer_range=0.05, max_position_embeddings=4096)
MODEL_DIR = os.path.expanduser(os.path.join("~", ".cache", "lane", "bench-v4"))


def main() -> None:
    args = arguments(__doc__)
    if args.prompt_len == 256:
        args.prompt_len = 512
    check_quiet()
    print(json.dumps(compare(cached_model("deepseek_v4", MODEL_DIR, CONFIG), "deepseek_v4 random, 8 layers (2 SWA, 3 CSA, 3 HCA), hidden 512, "
                                          "16 experts (4 active), hc_mult 4", args)))


if __name__ == "__main__":
    main()
