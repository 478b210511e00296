"""``lane tiny-model ARCH OUT_DIR``: a small random checkpoint that transformers'
AutoModelForCausalLM loads, with SmolLM2's tokenizer (vocabulary 49,152; bos 1, eos 2),
so these architectures run end to end on a laptop.

DeepSeek checkpoints also get what the released ones have and transformers does
not write: a non-zero ``e_score_correction_bias`` (so ``noaux_tc`` routing is
exercised) and the MTP layer's weights (``model-mtp.safetensors``, ignored by
transformers). ``--fp8`` stores the linear weights FP8 block-quantised with
``weight_scale_inv``, as DeepSeek releases them (lane dequantises on load;
transformers needs its FP8 integration for it).

``--shape llama-3.2-1b`` / ``llama-3.2-3b`` (llama only) writes a full-size random Llama of
that shape instead (SHAPES: Llama-3.2's layers, SmolLM2's vocabulary), in bfloat16, one
tensor at a time into one safetensors shard per layer: no float32 copy of the model, nor the
whole model in memory, is ever held (write_llama_shape).
"""
from __future__ import annotations

import json
import os
import re

COMMON = dict(vocab_size=49152, hidden_size=64, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
              initializer_range=0.2, rms_norm_eps=1e-6, tie_word_embeddings=False)
DEEPSEEK = dict(intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3, first_k_dense_replace=1,
                n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                routed_scaling_factor=2.5, norm_topk_prob=True, num_attention_heads=4, num_key_value_heads=4,
                q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                num_nextn_predict_layers=1)
TINY = {  # name -> (transformers config class, model class, config fields)
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16)),
    # layer 0 dense (mlp_only_layers), 1 and 2 sparse: 8 experts, top 2, renormalised
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                       norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0])),
    # KDA, KDA, MLA (no rope), KDA; layer 0 dense, the rest MoE with a shared expert
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM",
                    dict(intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16,
                         qk_rope_head_dim=8, v_head_dim=16, num_local_experts=8, num_experts_per_tok=2, n_group=2,
                         topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5, linear_num_heads=4,
                         linear_head_dim=16, linear_conv_kernel_dim=4,
                         layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
                         mlp_layer_types=["dense", "sparse", "sparse", "sparse"], pad_token_id=0)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", DEEPSEEK),
    # 16 indexer heads: index scores are sums of relus, and with few heads many tokens
    # score exactly 0, whose top-k order is then arbitrary. Near ties (a k-th and
    # (k+1)-th score within float32 noise) still happen now and then; the tests
    # compare around them (tests/conftest.py DsaNearTies)
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM",
                     dict(DEEPSEEK, index_topk=16, index_n_heads=16, index_head_dim=32)),
    # GLM-5: V3.2 with an interleaved indexer rope; layer 1 reuses layer 0's top-k
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM",
                    dict(DEEPSEEK, index_topk=16, index_n_heads=16, index_head_dim=32,
                         indexer_types=["full", "shared", "full"])),
}
# DEEPSEEK_V4.md §6: every layer type (SWA, CSA rate 4 with a top-8 indexer, HCA rate 16),
# hash and learned MoE, mHC with 4 streams; both ropes (yarn "compress")
DEEPSEEK_V4 = dict(
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=32, partial_rotary_factor=0.25,
    q_lora_rank=32, o_groups=2, o_lora_rank=16,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                 "compressed_sparse_attention"],
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    sliding_window=16, index_n_heads=16, index_head_dim=16, index_topk=8, n_routed_experts=8,
    num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32, scoring_func="sqrtsoftplus",
    routed_scaling_factor=1.5, swiglu_limit=10.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                  "beta_fast": 32, "beta_slow": 1},
    max_position_embeddings=1048576, num_nextn_predict_layers=1)
TINY["deepseek_v4"] = ("DeepseekV4Config", "DeepseekV4ForCausalLM", DEEPSEEK_V4)
# --seed-shape: V4-Flash's layer pattern, scaled down (DEEPSEEK_V4.md §1): two sliding-window
# layers, then CSA (rate 4) and HCA (rate 128) alternating; hash routing in the first three
# layers; a 128-token window; 8 experts, so 4 EP ranks hold 2 each
SEED_SHAPE_V4 = dict(
    num_hidden_layers=6, sliding_window=128,
    layer_types=["sliding_attention", "sliding_attention", "compressed_sparse_attention",
                 "heavily_compressed_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
    mlp_layer_types=["hash_moe", "hash_moe", "hash_moe", "moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128})
FP8_BLOCK = (32, 32)  # small blocks so a tiny weight spans several, some partial (releases use 128)

# Llama-3.2's shapes (meta-llama/Llama-3.2-{1B,3B}'s config.json) with SmolLM2's vocabulary
# (49,152; Llama-3's 128,256-token tokenizer is gated): --shape. Both tie the embeddings.
SHAPES = {
    "llama-3.2-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=8192, head_dim=64),
    "llama-3.2-3b": dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                         intermediate_size=8192, head_dim=128),
}
LLAMA_3_2 = dict(vocab_size=49152, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5, tie_word_embeddings=True,
                 initializer_range=0.02, max_position_embeddings=131072, hidden_act="silu",
                 rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                  "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                  "original_max_position_embeddings": 8192})


def shape_params(shape: dict) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every weight a Llama of ``shape`` (SHAPES' fields, LLAMA_3_2's
    vocabulary) saves: the tied lm_head is not one of them."""
    c = {**LLAMA_3_2, **shape}
    h, f, d = c["hidden_size"], c["intermediate_size"], c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    out = {"model.embed_tokens.weight": (c["vocab_size"], h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (q, h),
                    p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
                    p + "self_attn.o_proj.weight": (h, q), p + "post_attention_layernorm.weight": (h,),
                    p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                    p + "mlp.down_proj.weight": (h, f)})
    out["model.norm.weight"] = (h,)
    if not c["tie_word_embeddings"]:
        out["lm_head.weight"] = (c["vocab_size"], h)
    return out


def q4_0_file_bytes(shape: dict) -> int:
    """Tensor bytes of ``shape``'s ``llama-quantize ... Q4_0`` file: every matrix in Q4_0 (18
    bytes a block of 32), but the tied embedding, which llama-quantize makes Q6_K (210 bytes a
    block of 256) as it is also the output; norms float32."""
    total = 0
    for name, s in shape_params(shape).items():
        n = _numel(s)
        total += 4 * n if len(s) == 1 else n * 210 // 256 if name == "model.embed_tokens.weight" else n * 18 // 32
    return total


def pick_shape(l3_bytes: int, factor: float = 2.0) -> str:
    """The smallest of SHAPES whose Q4_0 file is at least ``factor`` x the L3 (decode then
    streams its weights from DRAM every token), else the largest."""
    by_size = sorted(SHAPES, key=lambda k: q4_0_file_bytes(SHAPES[k]))
    return next((k for k in by_size if q4_0_file_bytes(SHAPES[k]) >= factor * l3_bytes), by_size[-1])


def write_llama_shape(shape: str | dict, out_dir: str, seed: int = 0, show_progress: bool = False,
                      **overrides) -> str:
    """A random-weight Llama of ``shape`` (a SHAPES name, or its fields) with SmolLM2's tokenizer,
    as an HF directory: config.json, one bf16 safetensors shard per layer (plus one for the
    embedding and final norm) and its index. Each tensor is drawn in bfloat16 itself (N(0, 0.02);
    norms 1 + N(0, 0.1)) and a shard is written as soon as its tensors are made, so at most one
    layer's bf16 weights are in memory at a time. ``overrides`` change config fields (tests shrink
    the model with them)."""
    import torch
    import transformers
    from safetensors.torch import save_file

    from lane.config import ModelConfig

    if isinstance(shape, str):
        if shape not in SHAPES:
            raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
        shape = SHAPES[shape]
    fields = {**LLAMA_3_2, **shape, **overrides}
    config = transformers.LlamaConfig(**fields, architectures=["LlamaForCausalLM"], dtype="bfloat16")
    params = shape_params(fields)
    groups: dict[str, list[str]] = {}  # shard key -> names, in order: "layers.i" or "top"
    for name in params:
        m = re.match(r"model\.layers\.(\d+)\.", name)
        groups.setdefault(f"layers.{m.group(1)}" if m else "top", []).append(name)
    os.makedirs(out_dir, exist_ok=True)
    config.save_pretrained(out_dir)
    gen = transformers.GenerationConfig(bos_token_id=1, eos_token_id=2)
    gen.save_pretrained(out_dir)
    ModelConfig(None).get_tokenizer().save_pretrained(out_dir)  # SmolLM2's, from the packaged GGUF

    g = torch.Generator().manual_seed(seed)
    std = fields["initializer_range"]
    weight_map, total = {}, 0
    keys = list(groups)
    bar = None
    if show_progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(_numel(s) for s in params.values()) * 2, unit="B", unit_scale=True,
                   desc="random bf16 weights")
    for i, key in enumerate(keys, 1):
        shard = f"model-{i:05d}-of-{len(keys):05d}.safetensors"
        tensors = {}
        for name in groups[key]:
            t = torch.randn(params[name], generator=g, dtype=torch.bfloat16)
            if len(params[name]) == 1:  # a norm's weight: near 1
                t.mul_(0.1).add_(1.0)
            else:
                t.mul_(std)
            tensors[name] = t
            weight_map[name] = shard
            total += t.numel() * t.element_size()
        save_file(tensors, os.path.join(out_dir, shard), metadata={"format": "pt"})
        if bar is not None:
            bar.update(sum(t.numel() * 2 for t in tensors.values()))
        del tensors
    if bar is not None:
        bar.close()
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return out_dir


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def write_tiny_model(arch: str, out_dir: str, seed: int = 0, fp8: bool = False, shape: str | None = None,
                     seed_shape: bool = False, **overrides) -> str:
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    from lane.config import ModelConfig

    if arch not in TINY:
        raise ValueError(f"unknown architecture {arch!r}; choose from {', '.join(TINY)}")
    if shape is not None:
        if arch != "llama":
            raise ValueError("--shape is for llama (Llama-3.2's shapes)")
        if fp8:
            raise ValueError("--shape writes bf16 weights; --fp8 is for DeepSeek")
        return write_llama_shape(shape, out_dir, seed, show_progress=True, **overrides)
    if seed_shape:
        if arch != "deepseek_v4":
            raise ValueError("--seed-shape is for deepseek_v4 (V4-Flash's layer pattern)")
        overrides = {**SEED_SHAPE_V4, **overrides}
    if fp8 and not arch.startswith("deepseek"):
        raise ValueError("--fp8 is for the DeepSeek architectures (released FP8 block-quantised)")
    cfg_name, model_name, fields = TINY[arch]
    torch.manual_seed(seed)
    config = getattr(transformers, cfg_name)(**{**COMMON, **fields, **overrides}, architectures=[model_name])
    model = getattr(transformers, model_name)(config).eval()
    deepseek = arch in ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")  # V3-style extras: routing bias, MTP file
    if arch == "deepseek_v4":
        _v4_nonzero(model, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:  # initialised to 0 / 1: make them count
                p.add_(torch.randn_like(p) * 0.1)
        for layer in model.model.layers if deepseek or arch == "kimi_linear" else ():
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    model.generation_config.bos_token_id, model.generation_config.eos_token_id = 1, 2
    model.generation_config.save_pretrained(out_dir)
    ModelConfig(None).get_tokenizer().save_pretrained(out_dir)  # SmolLM2's, from the packaged GGUF
    if arch == "deepseek_v4":
        main = os.path.join(out_dir, "model.safetensors")
        tensors = load_file(main)
        if seed_shape:
            _seed_shape_drafts_well(tensors)
            save_file(tensors, main, metadata={"format": "pt"})
        mtp = _v4_mtp_tensors(tensors, config)
        if seed_shape:
            _seed_shape_drafts_well(tensors, mtp)
        if fp8:
            save_file(quantize_checkpoint(tensors, FP8_BLOCK, _V4_FP8, ".scale"), main, metadata={"format": "pt"})
            mtp = quantize_checkpoint(mtp, FP8_BLOCK, _V4_FP8, ".scale")
            _add_fp8_config(out_dir)
        save_file(mtp, os.path.join(out_dir, "model-mtp.safetensors"))
    if deepseek:
        main = os.path.join(out_dir, "model.safetensors")
        tensors = load_file(main)
        mtp = _mtp_tensors(tensors, config)
        save_file(quantize_checkpoint(mtp, FP8_BLOCK) if fp8 else mtp, os.path.join(out_dir, "model-mtp.safetensors"))
        if fp8:
            save_file(quantize_checkpoint(tensors, FP8_BLOCK), main, metadata={"format": "pt"})
            _add_fp8_config(out_dir)
    return out_dir


DRAFT_ARCH = {"DeepseekV3ForCausalLM": "DeepSeekMTPModel", "DeepseekV32ForCausalLM": "DeepSeekMTPModel",
              "GlmMoeDsaForCausalLM": "DeepSeekMTPModel", "DeepseekV4ForCausalLM": "DeepSeekV4MTPModel"}


def split_mtp_draft(model_dir: str, draft_dir: str) -> str:
    """Move a tiny DeepSeek checkpoint's MTP layers (``model-mtp.safetensors``) into a draft
    checkpoint of their own (config.json naming the draft architecture, the target's sizes);
    the target keeps no MTP layer (num_nextn_predict_layers 0)."""
    import shutil

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    arch = cfg["architectures"][0]
    if arch not in DRAFT_ARCH or not os.path.exists(os.path.join(model_dir, "model-mtp.safetensors")):
        raise ValueError(f"--mtp-draft: {arch} has no MTP layers to split off")
    os.makedirs(draft_dir, exist_ok=True)
    shutil.move(os.path.join(model_dir, "model-mtp.safetensors"), os.path.join(draft_dir, "model.safetensors"))
    with open(os.path.join(draft_dir, "config.json"), "w") as f:
        json.dump({**cfg, "architectures": [DRAFT_ARCH[arch]]}, f, indent=2)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump({**cfg, "num_nextn_predict_layers": 0}, f, indent=2)
    return draft_dir


def _add_fp8_config(out_dir: str) -> None:
    cfg_path = os.path.join(out_dir, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(FP8_BLOCK)}
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)


def _V4_FP8(name: str, t) -> bool:
    """V4 ships its dense attention and shared-expert linears in FP8 (scales named
    ``.scale``); compressor and indexer projections stay bf16."""
    import re

    return t.dim() == 2 and bool(re.search(r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)\.weight$|"
                                           r"\.shared_experts\.w[123]\.weight$", name))


def _v4_nonzero(model, seed: int) -> None:
    """transformers zeroes these at init (DEEPSEEK_V4.md §6): make them count. Hash
    routing gets distinct random experts per token; embeddings and head N(0, 1) widen
    the argmax margins."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("tid2eid"):
                E, k = model.config.n_routed_experts, p.shape[1]
                p.copy_(torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(p.shape[0])]))
            elif name.endswith(("sinks", "position_bias", "e_score_correction_bias", ".base", "hc_base")):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
                p.copy_(torch.randn(p.shape, generator=g))


def _mtp_tensors(tensors: dict, config) -> dict:
    """Layer ``num_hidden_layers``: a decoder layer (a copy of the last one, perturbed)
    plus enorm / hnorm / eh_proj / shared_head and the copy of the embedding that
    DeepSeek's checkpoints carry."""
    import torch

    n, h = config.num_hidden_layers, config.hidden_size
    last = f"model.layers.{n - 1}."
    out = {f"model.layers.{n}." + k[len(last):]: (v + 0.01 * torch.randn_like(v)).contiguous()
           for k, v in tensors.items() if k.startswith(last)}
    mtp = f"model.layers.{n}."
    out[mtp + "enorm.weight"] = torch.ones(h) + 0.1 * torch.randn(h)
    out[mtp + "hnorm.weight"] = torch.ones(h) + 0.1 * torch.randn(h)
    out[mtp + "eh_proj.weight"] = 0.1 * torch.randn(h, 2 * h)
    out[mtp + "shared_head.norm.weight"] = torch.ones(h)
    out[mtp + "shared_head.head.weight"] = 0.1 * torch.randn(config.vocab_size, h)
    out[mtp + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    return out


def _seed_shape_drafts_well(tensors: dict, mtp: dict | None = None) -> None:
    """A random MTP layer never drafts the random model's next token (acceptance 0), so the
    seed shape's is built to guess it: the MTP layer reads the next token's embedding straight
    (e_proj = I, h_proj = 0) through the main model's hc_head and final norm, i.e. drafts what
    the main model would say after that token were its layers silent; the main model's layers
    write small updates (output projections x 0.05). Its drafts are then right about a third
    of the time, while every layer still moves the argmax (most tokens differ from the guess)."""
    import torch

    if mtp is None:
        for k in tensors:
            if k.endswith(("attn.wo_b.weight", ".w2.weight")):
                tensors[k] = tensors[k] * 0.05
        return
    D = tensors["model.norm.weight"].shape[0]
    mtp.update({"mtp.0.e_proj.weight": torch.eye(D), "mtp.0.h_proj.weight": torch.zeros(D, D),
                "mtp.0.enorm.weight": torch.ones(D), "mtp.0.norm.weight": tensors["model.norm.weight"].clone()})
    for x in ("fn", "base", "scale"):
        mtp[f"mtp.0.hc_head_{x}"] = tensors[f"model.hc_head.hc_{x}"].clone()


def _v4_mtp_tensors(tensors: dict, config) -> dict:
    """``mtp.0.*`` in the released names (DEEPSEEK_V4.md §4): a block with sliding-window
    attention (the first SWA layer's, perturbed) and learned routing (the last layer's
    MoE), plus e_proj / h_proj / enorm / hnorm / norm and its own hc_head."""
    import torch

    swa = config.layer_types.index("sliding_attention")
    moe = max(i for i, t in enumerate(config.mlp_layer_types) if t == "moe")
    out = {}
    for k, v in tensors.items():
        m = re.match(r"model\.layers\.(\d+)\.(.*)", k)
        if not m:
            continue
        layer, rest = int(m.group(1)), m.group(2)
        if layer == (moe if rest.startswith(("mlp.", "ffn.")) else swa) and not rest.endswith("tid2eid"):
            name = f"mtp.0.{rest}"  # transformers saves V4 under the released names, as the MTP's are
            out[name] = (v + 0.01 * torch.randn_like(v)).contiguous() if v.is_floating_point() else v.clone()
    D, n = config.hidden_size, config.hc_mult
    for norm in ("enorm", "hnorm", "norm"):
        out[f"mtp.0.{norm}.weight"] = torch.ones(D) + 0.1 * torch.randn(D)
    out["mtp.0.e_proj.weight"] = 0.2 * torch.randn(D, D)
    out["mtp.0.h_proj.weight"] = 0.2 * torch.randn(D, D)
    out["mtp.0.hc_head_fn"] = tensors["model.hc_head.hc_fn"] + 0.01 * torch.randn(n, n * D)
    out["mtp.0.hc_head_base"] = 0.1 * torch.randn(n)
    out["mtp.0.hc_head_scale"] = tensors["model.hc_head.hc_scale"].clone()
    return out


def _quantizable(name: str, t) -> bool:
    """The linear weights DeepSeek stores in FP8: not embeddings, head, norms or the router."""
    return (t.dim() == 2 and name.endswith(".weight") and "embed_tokens" not in name and "lm_head" not in name
            and ".mlp.gate." not in name and "norm" not in name and "weights_proj" not in name)


def quantize_block_fp8(w, block: tuple[int, int]):
    """float [N, K] -> (float8_e4m3fn [N, K], float32 scale_inv [ceil(N/bn), ceil(K/bk)])."""
    import torch

    n, k = w.shape
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.zeros(nb * bn, kb * bk)
    padded[:n, :k] = w.float()
    blocks = padded.view(nb, bn, kb, bk)
    scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)  # e4m3's largest normal is 448
    q = (blocks / scale[:, None, :, None]).view(nb * bn, kb * bk)[:n, :k].to(torch.float8_e4m3fn)
    return q.contiguous(), scale


def quantize_checkpoint(tensors: dict, block: tuple[int, int], quantizable=None, scale_suffix: str = "") -> dict:
    """FP8 copies of the quantizable weights with their block scales: ``W.weight_scale_inv``
    (V3), or ``W.scale`` with ``scale_suffix=".scale"`` (V4)."""
    quantizable = quantizable or _quantizable
    out = {}
    for name, t in tensors.items():
        if quantizable(name, t):
            scale_name = name.removesuffix(".weight") + scale_suffix if scale_suffix else name + "_scale_inv"
            out[name], out[scale_name] = quantize_block_fp8(t, block)
        else:
            out[name] = t
    return out
