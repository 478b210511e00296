"""Qwen3-MoE on a tiny random checkpoint: logits and greedy tokens against transformers
(chunked prefill, a batch, prefix hits, a preemption), and the same weights from a GGUF
(``qwen3moe``) the test writes with the gguf package: dense equal to the HF directory, and
under --quantization auto with the experts kept in Q8_0 blocks."""
import numpy as np
import pytest
import torch

from lane import LLM, SamplingParams
from lane.entrypoints.tiny_model import write_tiny_model
from lane.model_executor.layers.fused_moe import FusedMoE
from conftest import assert_greedy_equals_hf, assert_logprobs_match_hf, teacher_forced_logits
from test_deepseek import _prompts

FP32 = dict(dtype="float32", show_progress=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model("qwen3_moe", str(tmp_path_factory.mktemp("qwen3-moe") / "m"))


@pytest.fixture(scope="module")
def hf(tiny):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()


def test_logits_match_transformers(tiny, hf):
    llm = LLM(tiny, kv_cache_memory_bytes=8 << 20, **FP32)
    model = llm.engine.worker.model
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert sorted(model.moe_layers()) == [1, 2]  # layer 0 is in mlp_only_layers
    assert_logprobs_match_hf(llm, hf, _prompts((5, 17, 40)), 12, "qwen3_moe")


def test_engine_greedy_equals_transformers(tiny, hf):
    """Chunked prefill (16 tokens a step), a batch of mixed lengths, prefix hits and a pool
    small enough that a request is preempted and recomputed: transformers' tokens."""
    llm = LLM(tiny, kv_cache_memory_bytes=112 << 10, block_size=16, max_num_batched_tokens=16, max_num_seqs=4,
              max_model_len=96, **FP32)
    shared = _prompts((32,), seed=2)[0]
    prompts = _prompts((7, 40), seed=3) + [shared + [5, 6, 7], shared + [9, 8]]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], sp, use_tqdm=False)
    outs += llm.generate([{"prompt_token_ids": prompts[3]}], sp, use_tqdm=False)
    sched = llm.engine.scheduler
    assert sched.kv.stats.hits > 0 and sched.num_preemptions > 0, (sched.kv.stats.hits, sched.num_preemptions)
    for ids, out in zip(prompts, outs):
        assert assert_greedy_equals_hf(hf, ids, out.outputs[0].token_ids, 24, len(ids)) == 24


def write_gguf(hf_dir: str, path: str, expert_kind: str = "F32") -> str:
    """The HF checkpoint as llama.cpp's qwen3moe GGUF: Q/K rows as they are (no rope
    permutation for qwen3), experts stacked [E, rows, cols], SmolLM2's tokenizer."""
    import json

    import gguf
    from safetensors.torch import load_file

    from lane.config import ModelConfig
    from lane.transformers_utils.gguf_file import gguf_field, open_gguf

    cfg = json.load(open(f"{hf_dir}/config.json"))
    t = load_file(f"{hf_dir}/model.safetensors")
    n_experts = cfg.get("num_local_experts") or cfg["num_experts"]  # transformers 5 writes the former
    src = open_gguf(ModelConfig(None).gguf_file)  # the packaged SmolLM2 GGUF: its tokenizer
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_count(n_experts)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_parameters", {}).get("rope_theta", cfg.get("rope_theta", 10000.0)))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(gguf_field(src, "tokenizer.ggml.pre"))
    w.add_token_list(gguf_field(src, "tokenizer.ggml.tokens"))
    w.add_token_types(gguf_field(src, "tokenizer.ggml.token_type"))
    w.add_token_merges(gguf_field(src, "tokenizer.ggml.merges"))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def add(name: str, x: torch.Tensor, kind: str = "F32") -> None:
        a = x.float().numpy()
        if kind == "F32":
            w.add_tensor(name, a)
        else:
            q = gguf.quants.quantize(a, gguf.GGMLQuantizationType[kind])
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType[kind])

    add("token_embd.weight", t["model.embed_tokens.weight"])
    add("output.weight", t["lm_head.weight"])
    add("output_norm.weight", t["model.norm.weight"])
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(cfg["num_hidden_layers"]):
        for hf_name, g in names.items():
            key = f"model.layers.{i}.{hf_name}.weight"
            if key in t:
                add(f"blk.{i}.{g}.weight", t[key])
        for proj, g in (("gate", "ffn_gate_exps"), ("up", "ffn_up_exps"), ("down", "ffn_down_exps")):
            key = f"model.layers.{i}.mlp.experts.{{}}.{proj}_proj.weight"
            if key.format(0) in t:
                add(f"blk.{i}.{g}.weight", torch.stack([t[key.format(e)] for e in range(n_experts)]),
                    expert_kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_qwen3moe_equals_hf_dir_and_keeps_quantized_experts(tmp_path):
    """The same weights from a qwen3moe GGUF (every layer sparse, as llama.cpp's qwen3moe has
    them): F32 tensors give the HF directory's logits; Q8_0 experts under --quantization auto
    stay in their blocks (no dense expert stack resident) and track the dequantized run's
    greedy tokens."""
    tiny = write_tiny_model("qwen3_moe", str(tmp_path / "hf"), mlp_only_layers=[])
    ids = _prompts((30,), seed=5)[0]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    kw = dict(kv_cache_memory_bytes=8 << 20, max_model_len=128, **FP32)

    def run(model: str, **extra):
        llm = LLM(model, **kw, **extra)
        out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0].outputs[0]
        moe = [m for m in llm.engine.worker.model.modules() if isinstance(m, FusedMoE)]
        llm.shutdown()
        return list(out.token_ids), [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)], moe

    want, want_lp, _ = run(tiny)
    got, got_lp, _ = run(write_gguf(tiny, str(tmp_path / "f32.gguf")))
    assert got == want
    np.testing.assert_allclose(got_lp, want_lp, atol=1e-4)
    q8 = write_gguf(tiny, str(tmp_path / "q8.gguf"), "Q8_0")
    args = dict(max_model_len=128, kv_cache_memory_bytes=8 << 20, threads=1, **FP32)
    dense, kept = LLM(q8, quantization="none", **args), LLM(q8, quantization="auto", **args)
    moe = [m for m in kept.engine.worker.model.modules() if isinstance(m, FusedMoE)]
    assert moe and all(m.ggml_kinds == {"w13": "Q8_0", "w2": "Q8_0"} and m.w13 is None and m.w2 is None for m in moe)
    assert all(m.ggml_x8 == {"w13", "w2"} for m in moe)  # each slot repacked: the 8-row kernel
    ref = teacher_forced_logits(dense, ids, len(ids))
    for chunk in (1, len(ids)):  # decode rows and a prefill: each expert's few rows on the integer kernel
        rel = float((teacher_forced_logits(kept, ids, chunk) - ref).norm() / ref.norm())
        assert rel < 0.03, (chunk, rel)  # 8-bit activations: ~1.5% here


def test_gguf_kept_experts_move_under_eplb(tmp_path):
    """Q8_0 experts kept in their blocks, over two expert-parallel ranks with EPLB rearranging
    every 3 steps: blocks move as they are (moved bytes counted), every slot ends up holding its
    expert's blocks exactly as a one-rank load holds them, and the tokens equal one rank's."""
    hf = write_tiny_model("qwen3_moe", str(tmp_path / "hf"), mlp_only_layers=[])
    q8 = write_gguf(hf, str(tmp_path / "q8.gguf"), "Q8_0")
    kw = dict(FP32, quantization="auto", max_model_len=128, kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=16)
    prompts = [{"prompt_token_ids": p} for p in _prompts((30, 45, 20), seed=7)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    one = LLM(q8, **kw)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, sp, use_tqdm=False)]
    slots = one.engine.worker.expert_slots()
    one.shutdown()
    assert all(t.dtype == torch.uint8 for _, ts in slots.values() for t in ts)  # blocks, no dense stack
    two = LLM(q8, tensor_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
              eplb_config={"num_redundant_experts": 2, "step_interval": 3, "window_size": 3}, **kw)
    try:
        assert [o.outputs[0].token_ids for o in two.generate(prompts, sp, use_tqdm=False)] == want
        assert two.engine.eplb_stats.moved_bytes > 0
        for per_rank in two.engine.executor.collective_rpc("expert_slots"):
            for layer, (experts, tensors) in per_rank.items():
                for s, e in enumerate(experts):
                    assert all(torch.equal(t[s], r[e]) for t, r in zip(tensors, slots[layer][1])), (layer, s, e)
    finally:
        two.shutdown()
