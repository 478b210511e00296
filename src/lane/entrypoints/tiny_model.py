"""``lane tiny-model ARCH OUT_DIR``: a small random checkpoint that transformers'
AutoModelForCausalLM loads, with SmolLM2's tokenizer (vocabulary 49,152; bos 1, eos 2),
so these architectures run end to end on a laptop."""
from __future__ import annotations

import os

COMMON = dict(vocab_size=49152, hidden_size=64, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
              initializer_range=0.2, rms_norm_eps=1e-6, tie_word_embeddings=False)
DEEPSEEK = dict(intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3, first_k_dense_replace=1,
                n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                routed_scaling_factor=2.5, norm_topk_prob=True, num_attention_heads=4, num_key_value_heads=4,
                q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
TINY = {  # name -> (transformers config class, model class, config fields)
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", DEEPSEEK),
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM",
                     dict(DEEPSEEK, index_topk=16, index_n_heads=16, index_head_dim=32)),
}


def write_tiny_model(arch: str, out_dir: str, seed: int = 0) -> str:
    import torch
    import transformers

    from lane.config import ModelConfig

    if arch not in TINY:
        raise ValueError(f"unknown architecture {arch!r}; choose from {', '.join(TINY)}")
    cfg_name, model_name, fields = TINY[arch]
    torch.manual_seed(seed)
    config = getattr(transformers, cfg_name)(**COMMON, **fields, architectures=[model_name])
    model = getattr(transformers, model_name)(config).eval()
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    model.generation_config.bos_token_id, model.generation_config.eos_token_id = 1, 2
    model.generation_config.save_pretrained(out_dir)
    ModelConfig(None).get_tokenizer().save_pretrained(out_dir)  # SmolLM2's, from the packaged GGUF
    return out_dir
