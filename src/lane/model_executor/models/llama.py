"""Llama family (SmolLM2, Llama 2/3 with llama3 rope scaling, tied embeddings, GQA).

Qwen2, Qwen3 and Mistral reuse these blocks with their own switches; their
files hold only what differs. Q/K/V and gate/up are fused into one matmul each
(fewer, larger GEMMs: the main lever against per-op overhead on CPU).
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn

from lane import platform, tracing
from lane.attention.metadata import get_forward_context
from lane.tracing import Step
from lane.model_executor.layers.activation import silu_and_mul
from lane.model_executor.layers.layernorm import RMSNorm
from lane.model_executor.layers import cpu_kernels
from lane.distributed.parallel_state import get_tp_group
from lane.model_executor.layers.linear import Linear
from lane.distributed.parallel_state import sequence_parallel_begin
from lane.model_executor.layers.parallel_linear import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                                                        VocabParallelEmbedding, gather_rows, local_kv_heads,
                                                        qkv_parallel_linear)
from lane.model_executor.layers.vocab_embedding import VocabEmbedding
from lane.model_executor.loader.gguf_loader import GGMLBlocks
from lane.model_executor.loader.safetensors_loader import materialize
from lane.model_executor.layers.rotary_embedding import RotaryEmbedding
from lane.model_executor.models.llama_decode import FusedDecode


class LlamaMLP(nn.Module):
    """gate | up split by rank, down by its input: one all-reduce after (step 31), or none where
    the caller sums several partials first (``reduce=False``: a MoE's shared experts)."""
    kernels_float32 = False  # float32 SwiGLU on the kernels too (linear.kernels_in_float32)

    def __init__(self, hidden: int, intermediate: int, bias: bool, reduce: bool = True) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden, [intermediate, intermediate], bias=bias)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias=bias, reduce_step=Step.COMM_FFN_REDUCE,
                                           compute_step=Step.OPS_FFN, reduce=reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), self.kernels_float32))


class LlamaAttention(nn.Module):
    qkv_bias_default = False
    qk_norm = False  # Qwen3: RMSNorm over each head of q and k before rope

    def __init__(self, config, rotary: RotaryEmbedding) -> None:
        super().__init__()
        tp = get_tp_group()
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.num_heads = heads // tp.world_size  # this rank's
        self.num_kv_heads = local_kv_heads(kv_heads, tp)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        qkv_bias = getattr(config, "attention_bias", False) or self.qkv_bias_default
        o_bias = getattr(config, "attention_bias", False)
        self.qkv_proj = qkv_parallel_linear(config.hidden_size, self.head_dim, heads, kv_heads, qkv_bias, tp)
        self.o_proj = RowParallelLinear(heads * self.head_dim, config.hidden_size, bias=o_bias)
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = rotary
        attn_cls = platform.select_attention_backend(config).backend.get_impl_cls()  # paged_sdpa by default
        self.attn = attn_cls(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5)

    def forward(self, rope, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(rope, q, k)
        mark = tracing.forward_mark()
        mark(Step.MODEL_QKV_PROJ)
        out = self.attn(q, k, v)  # marks 24 and 27
        out = self.o_proj(out)
        mark(Step.COMM_ATTN_REDUCE)
        return out


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention

    def __init__(self, config, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config, rotary)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size,
                            getattr(config, "mlp_bias", False))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope, x, residual):
        """x, residual: the rows of the residual stream this rank holds (all of them, or its own
        under sequence parallelism, where attention and the FFN gather every row first)."""
        mark = tracing.forward_mark()  # seed steps 21-30, summed over layers when tracing
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = gather_rows(x, Step.OPS_INPUT_NORM)
        mark(Step.OPS_INPUT_NORM)
        x = self.self_attn(rope, x)
        x, residual = self.post_attention_layernorm(x, residual)
        x = gather_rows(x, Step.OPS_INPUT_NORM)
        mark(Step.OPS_INPUT_NORM)
        x = self.mlp(x)
        mark(Step.OPS_FFN)
        return x, residual


class LlamaModel(nn.Module):
    layer_cls = LlamaDecoderLayer
    _fused: FusedDecode | None | bool = False  # False: not planned yet

    def __init__(self, config, max_position: int) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rotary = RotaryEmbedding(config, head_dim, max_position)
        self.rotary = rotary
        self.layers = nn.ModuleList(self.layer_cls(config, rotary) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def _fused_decode(self, x: torch.Tensor) -> FusedDecode | None:
        """The fused decode plan, made on the first forward after the caches are bound (and
        again if they are rebound); None where this model or CPU cannot take it."""
        if self._fused is False or (self._fused is not None and not self._fused.current(self)):
            if not FusedDecode.ready(self):
                return None
            self._fused = FusedDecode.build(self, x.dtype)
        return self._fused

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        sequence_parallel_begin(input_ids.shape[0])
        x = self.embed_tokens(input_ids)
        tracing.forward_mark()(Step.OPS_INPUT_NORM)
        md = get_forward_context().attn_metadata
        fused = self._fused_decode(x)
        if fused is not None and fused.applies(x, md):  # decodes and row-by-row chunks: one kernel call
            x, residual = fused(x, positions, md[0])
        else:
            rope = self.rotary.prepare(positions, x.dtype)
            residual = None
            for layer in self.layers:
                x, residual = layer(rope, x, residual)
        x, _ = self.norm(x, residual)
        x = gather_rows(x, Step.MODEL_LM_HEAD)
        tracing.forward_mark()(Step.MODEL_LM_HEAD)
        return x


class LlamaForCausalLM(nn.Module):
    model_cls = LlamaModel
    # checkpoint name -> (fused parameter, shard index)
    stacked_params = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config, max_position: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_cls(config, max_position or config.max_position_embeddings)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names) in, fusing q/k/v and gate/up."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            target = self.load_weight(params, name, tensor)
            if target is not None:
                loaded.add(target)
        return loaded

    def load_weight(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
        """One tensor into its parameter (or its shard of a fused one); returns the
        parameter's name, or None for a tensor that is not kept."""
        if "rotary_emb.inv_freq" in name or (
                getattr(self.config, "tie_word_embeddings", False) and name == "lm_head.weight"):
            return None
        parts = name.split(".")
        target, shard = name, None
        if len(parts) >= 2 and parts[-2] in self.stacked_params:
            fused, shard = self.stacked_params[parts[-2]]
            target = ".".join(parts[:-2] + [fused, parts[-1]])
        if target not in params and not isinstance(tensor, GGMLBlocks):
            raise KeyError(f"checkpoint tensor {name} has no place in {type(self).__name__}")
        module_name, _, attr = target.rpartition(".")
        module = self.get_submodule(module_name)
        offset = None  # a tensor-parallel layer's slice: where it goes in the local weight
        if hasattr(module, "shard"):
            tensor, offset = module.shard(tensor, shard, attr)
        tensor = materialize(tensor)
        if isinstance(tensor, GGMLBlocks):
            if not cpu_kernels.build() or not isinstance(module, (Linear, VocabEmbedding)):
                tensor = tensor.dequantize()  # no kernels, or a layer that runs dense only
            elif isinstance(module, VocabEmbedding):
                module.load_quantized(tensor.kind, tensor.blocks)
                if getattr(self.config, "tie_word_embeddings", False):  # the LM head reads the same blocks
                    self.lm_head.load_quantized(tensor.kind, tensor.blocks)
                return target
            else:
                if offset is None:
                    offset = 0 if shard is None else sum(self._shard_sizes(target, module.out_features)[:shard])
                module.load_quantized(tensor.kind, tensor.blocks, offset)
                return target
        param = params[target]
        with torch.no_grad():
            if shard is not None and offset is not None:  # a fused part, already this rank's rows
                param.narrow(0, offset, tensor.shape[0]).copy_(tensor)
            elif shard is None:
                if param.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != "
                                     f"model shape {tuple(param.shape)}")
                param.copy_(tensor)
            else:
                sizes = self._shard_sizes(target, param.shape[0])
                param.narrow(0, sum(sizes[:shard]), sizes[shard]).copy_(tensor)
        return target

    def _shard_sizes(self, fused_name: str, rows: int) -> list[int]:
        if ".qkv_proj." in fused_name:
            a = self.model.layers[0].self_attn
            return [a.q_size, a.kv_size, a.kv_size]
        return [rows // 2] * 2  # gate_up_proj
