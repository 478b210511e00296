"""Qwen2: Llama with a bias on the q, k and v projections."""
from lane.model_executor.models.llama import (LlamaAttention, LlamaDecoderLayer,
                                              LlamaForCausalLM, LlamaModel)


class Qwen2Attention(LlamaAttention):
    qkv_bias_default = True


class Qwen2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen2Attention


class Qwen2Model(LlamaModel):
    layer_cls = Qwen2DecoderLayer


class Qwen2ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen2Model
