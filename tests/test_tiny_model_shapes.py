"""`lane tiny-model llama --shape`: Llama-3.2's shapes, the pick by L3 size that
benchmarks/dram_bound.py makes, and a shrunken model written as bf16 shards tensor by tensor."""
import json
import math
import os

import pytest

from lane.entrypoints.tiny_model import SHAPES, pick_shape, q4_0_file_bytes, shape_params, write_llama_shape


def test_shapes_are_llama_3_2s():
    one, three = shape_params(SHAPES["llama-3.2-1b"]), shape_params(SHAPES["llama-3.2-3b"])
    assert one["model.layers.15.self_attn.k_proj.weight"] == (512, 2048)  # 8 KV heads of 64
    assert one["model.layers.0.mlp.down_proj.weight"] == (2048, 8192)
    assert three["model.layers.27.self_attn.q_proj.weight"] == (3072, 3072)  # 24 heads of 128
    assert three["model.embed_tokens.weight"] == (49152, 3072)  # SmolLM2's vocabulary
    assert "lm_head.weight" not in one and "model.layers.16.input_layernorm.weight" not in one  # tied; 16 layers
    params = lambda p: sum(math.prod(s) for s in p.values())
    assert 1.0e9 < params(one) < 1.1e9 and 2.9e9 < params(three) < 3.0e9
    assert 550 << 20 < q4_0_file_bytes(SHAPES["llama-3.2-1b"]) < 650 << 20


def test_pick_by_l3():
    assert pick_shape(32 << 20) == "llama-3.2-1b"  # this EPYC: 1B's Q4_0 is ~600 MiB >= 64 MiB
    assert pick_shape(480 << 20) == "llama-3.2-3b"  # a 480 MiB-L3 Xeon: 600 MiB < 960 MiB
    assert pick_shape(4 << 30) == "llama-3.2-3b"  # none is big enough: the largest


def test_dram_bound_reads_sizes():
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import dram_bound

    assert dram_bound.parse_size("32768K") == 32 << 20
    assert dram_bound.parse_size("32 MiB") == 32 << 20 and dram_bound.parse_size("1024") == 1024
    l3 = dram_bound.l3_cache_bytes()
    assert l3 is None or l3 > 0


def test_shrunken_shape_writes_bf16_shards(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors import safe_open

    small = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=256, head_dim=32)
    out = write_llama_shape("llama-3.2-1b", str(tmp_path / "m"), **small)
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["hidden_size"] == 128 and cfg["tie_word_embeddings"] and cfg["rope_parameters"]["rope_type"] == "llama3"
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    expected = shape_params({**SHAPES["llama-3.2-1b"], **small})
    assert set(weight_map) == set(expected)
    assert len(set(weight_map.values())) == 3  # one shard per layer, one for embedding and norm
    seen = {}
    for shard in set(weight_map.values()):
        with safe_open(os.path.join(out, shard), "pt") as f:
            for name in f.keys():
                seen[name] = f.get_tensor(name)
    assert {k: tuple(v.shape) for k, v in seen.items()} == expected
    assert all(v.dtype == torch.bfloat16 for v in seen.values())
    q = seen["model.layers.1.self_attn.q_proj.weight"].float()
    assert 0.015 < q.std() < 0.025  # N(0, 0.02)
    assert abs(seen["model.norm.weight"].float().mean() - 1) < 0.05
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))


def test_shape_only_for_llama(tmp_path):
    from lane.entrypoints.tiny_model import write_tiny_model

    with pytest.raises(ValueError, match="llama"):
        write_tiny_model("qwen3", str(tmp_path / "x"), shape="llama-3.2-1b")
    with pytest.raises(ValueError, match="unknown shape"):
        write_tiny_model("llama", str(tmp_path / "x"), shape="llama-3.2-8b")
