"""Qwen3: Llama with per-head RMSNorm on q and k before rope, explicit head_dim."""
from lane.model_executor.models.llama import (LlamaAttention, LlamaDecoderLayer,
                                              LlamaForCausalLM, LlamaModel)


class Qwen3Attention(LlamaAttention):
    qk_norm = True


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3Model
