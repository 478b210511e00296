"""A model's transformers config: from config.json, or built from a GGUF file's
metadata (seed step 4's config half; the weights are model_executor.loader's)."""
from __future__ import annotations

import json
import os

from lane.transformers_utils.gguf_file import GGUFFile, gguf_field, open_gguf

GGUF_ARCH_TO_HF = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}


def gguf_to_hf_config(reader: GGUFFile):
    """A transformers config built from the GGUF metadata."""
    from transformers import AutoConfig

    arch = gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCH_TO_HF:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; "
                         f"supported: {', '.join(sorted(GGUF_ARCH_TO_HF))}")
    p = f"{arch}."
    n_heads = gguf_field(reader, p + "attention.head_count")
    hidden = gguf_field(reader, p + "embedding_length")
    tokens = gguf_field(reader, "tokenizer.ggml.tokens") or []
    kw = dict(
        architectures=[GGUF_ARCH_TO_HF[arch]],
        vocab_size=gguf_field(reader, p + "vocab_size", len(tokens)),
        hidden_size=hidden,
        intermediate_size=gguf_field(reader, p + "feed_forward_length"),
        num_hidden_layers=gguf_field(reader, p + "block_count"),
        num_attention_heads=n_heads,
        num_key_value_heads=gguf_field(reader, p + "attention.head_count_kv", n_heads),
        max_position_embeddings=gguf_field(reader, p + "context_length", 4096),
        rms_norm_eps=gguf_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=gguf_field(reader, p + "rope.freq_base", 10000.0),
        head_dim=gguf_field(reader, p + "attention.key_length", hidden // n_heads),
        tie_word_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
        bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=gguf_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=gguf_field(reader, "tokenizer.ggml.padding_token_id"),
    )
    if arch == "qwen3moe":  # every layer sparse, top-k renormalised (llama.cpp's qwen3moe)
        kw.update(num_experts=gguf_field(reader, p + "expert_count"),
                  num_experts_per_tok=gguf_field(reader, p + "expert_used_count"),
                  moe_intermediate_size=gguf_field(reader, p + "expert_feed_forward_length"),
                  norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
        kw["intermediate_size"] = kw["intermediate_size"] or kw["moe_intermediate_size"]
    model_type = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                  "qwen3moe": "qwen3_moe"}[arch]
    cfg = AutoConfig.for_model(model_type, **kw)
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": float(kw["rope_theta"])}
    return cfg


def get_config(model_dir: str, gguf_file: str | None = None):
    """The transformers config of an HF model directory, or of ``gguf_file``. A
    config.json of a model_type transformers does not know still loads, as a plain
    PretrainedConfig with ``load_error`` set, so the registry can name its architecture."""
    if gguf_file:
        return gguf_to_hf_config(open_gguf(gguf_file))
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_dir)
    except (ValueError, KeyError) as e:
        # an unknown model_type: keep the raw fields so the registry can name the architecture
        with open(os.path.join(model_dir, "config.json")) as f:
            raw = json.load(f)
        from transformers import PretrainedConfig

        cfg = PretrainedConfig(**raw)
        cfg.load_error = str(e)
        return cfg
