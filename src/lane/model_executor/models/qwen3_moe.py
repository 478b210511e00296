"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm) with a sparse MoE FFN on every
``decoder_sparse_step``-th layer that ``mlp_only_layers`` does not list: a softmax router's
top-k experts (renormalised with ``norm_topk_prob``), no shared experts, no routing bias.
The routed experts are ``layers/fused_moe.py``'s, so tensor / expert parallelism, EPLB and
the data-parallel all-to-all work as for DeepSeek. From a GGUF (``qwen3moe``) the experts
stay in their blocks under ``--quantization auto``.
"""
from __future__ import annotations

import torch.nn as nn

from lane.model_executor.layers.fused_moe import FusedMoE, load_expert_weight
from lane.model_executor.layers.layernorm import RMSNorm
from lane.model_executor.layers.parallel_linear import VocabParallelEmbedding
from lane.model_executor.layers.rotary_embedding import RotaryEmbedding
from lane.model_executor.models.deepseek_v2 import DeepseekV2MoE
from lane.model_executor.models.llama import LlamaMLP
from lane.model_executor.models.qwen3 import Qwen3Attention, Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3Model


def is_sparse_layer(config, layer_idx: int) -> bool:
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or []) and config.num_experts > 0
            and (layer_idx + 1) % config.decoder_sparse_step == 0)


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def __init__(self, config, rotary: RotaryEmbedding, layer_idx: int) -> None:
        nn.Module.__init__(self)
        self.self_attn = Qwen3Attention(config, rotary)
        self.mlp = (DeepseekV2MoE(config, scoring_func="softmax", routing_bias=False)  # Qwen's router
                    if is_sparse_layer(config, layer_idx)
                    else LlamaMLP(config.hidden_size, config.intermediate_size, False))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3MoeModel(Qwen3Model):
    _fused = None  # the fused decode kernel runs dense MLPs only

    def __init__(self, config, max_position: int) -> None:
        nn.Module.__init__(self)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config, config.head_dim, max_position)
        self.layers = nn.ModuleList(Qwen3MoeDecoderLayer(config, self.rotary, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    model_cls = Qwen3MoeModel

    def moe_layers(self) -> dict[int, FusedMoE]:
        return {i: layer.mlp.experts for i, layer in enumerate(self.model.layers)
                if isinstance(layer.mlp, DeepseekV2MoE)}

    def load_weight(self, params: dict[str, nn.Parameter], name: str, tensor) -> str | None:
        if (expert := load_expert_weight(self, name, tensor)) is not None:
            return expert
        if name.endswith(("_stack.weight")):  # a GGUF's stacked experts: mlp.experts.{gate,up,down}_stack
            module, _, proj = name[:-len("_stack.weight")].rpartition(".")
            return f"{module}.{self.get_submodule(module).load_stack(proj, tensor)}"
        return super().load_weight(params, name, tensor)  # the router too: a float32 parameter
