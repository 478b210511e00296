"""Kimi Linear (``KimiLinearForCausalLM``; ``KimiK3ForCausalLM`` is the same class, as in the
seed's registry): Kimi Delta Attention (KDA) layers interleaved with MLA layers that use no
rope, and DeepSeek-style MoE (sigmoid router with a selection bias, groups, shared experts).

KDA is a gated delta rule with a per-channel decay. Each request carries, per KDA layer, a
fixed-size state in a running-state slot (``RunningStateSpec``, vLLM's ``MambaSpec`` family):
the short causal convolution's last ``kernel - 1`` inputs and the recurrent state [heads, d_k,
d_v], float32. A prefill chunk continues from its request's state in the chunked (WY) form;
decode rows step it in the recurrent form, batched. The state is not snapshotted at block
edges, so a prefix-cache hit could not rebuild it: these models compute every prompt from its
start (``RunningStateSpec.prefix_hits``; ``lane explain`` says so). Over tensor-parallel ranks
the KDA heads split like attention heads (the convolution's channels with them).
"""
from __future__ import annotations

import re

import torch
import torch.nn as nn
import torch.nn.functional as F

from lane import tracing
from lane.attention.metadata import RunningStateMetadata
from lane.distributed.parallel_state import get_tp_group, sequence_parallel_begin
from lane.kv_cache_interface import KVCacheSpec, RunningStateSpec
from lane.model_executor.layers.attention import CacheLayer
from lane.model_executor.layers.layernorm import RMSNorm
from lane.model_executor.layers.linear import Linear
from lane.model_executor.layers.parallel_linear import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                                        gather_rows, shard_param)
from lane.model_executor.loader.safetensors_loader import materialize
from lane.model_executor.models.deepseek_v2 import DeepseekV2MLAAttention, DeepseekV2MoE, DeepseekV3ForCausalLM
from lane.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from lane.tracing import Step

FULL, LINEAR = "full_attention", "linear_attention"


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_recurrent(q, k, v, g, beta, state):
    """One row per request: q, k, g [B, H, K] (q, k normalised, q scaled; g the log decay), v
    [B, H, V], beta [B, H], state [B, H, K, V] -> (out [B, H, V], the state after)."""
    state = state * g.exp()[..., None]
    delta = (v - (state * k[..., None]).sum(-2)) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(-2), state


def kda_chunked(q, k, v, g, beta, state, chunk: int = 64):
    """One request's n rows (as kda_recurrent's, [n, ...]) from ``state`` [H, K, V], in chunks
    of ``chunk`` rows: within a chunk the delta rule's updates in closed (WY) form, across
    chunks the state carried -> (out [n, H, V], the state after)."""
    n, H, K = k.shape
    C, pad = chunk, (-n) % chunk
    q, k, v, g = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v, g))  # [H, N, *]
    beta = F.pad(beta.transpose(0, 1), (0, pad))
    nc = (n + pad) // C
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    q, k, v, g, k_beta, v_beta = (x.reshape(H, nc, C, -1) for x in (q, k, v, g, k_beta, v_beta))
    g = g.cumsum(-2)
    upper = torch.triu(torch.ones(C, C, dtype=torch.bool), 0)
    strict = torch.triu(torch.ones(C, C, dtype=torch.bool), 1)
    decay = (g[..., :, None, :] - g[..., None, :, :]).masked_fill(strict[..., None], float("-inf")).exp()
    a = -(k_beta[..., :, None, :] * k[..., None, :, :] * decay).sum(-1).masked_fill(upper, 0)
    for i in range(1, C):  # (I + A)^-1 by forward substitution, row by row
        row = a[..., i, :i].clone()
        a[..., i, :i] = row + (row[..., None] * a[..., :i, :i].clone()).sum(-2)
    a = a + torch.eye(C)
    v = a @ v_beta
    k_cumdecay = a @ (k_beta * g.exp())
    out = torch.zeros_like(v)
    for i in range(nc):
        q_i, k_i, g_i = q[:, i], k[:, i], g[:, i]
        intra = (q_i[:, :, None, :] * k_i[:, None, :, :] * decay[:, i]).sum(-1).masked_fill(strict, 0)
        v_new = v[:, i] - k_cumdecay[:, i] @ state
        out[:, i] = (q_i * g_i.exp()) @ state + intra @ v_new
        state = state * g_i[:, -1].exp()[..., None] + (k_i * (g_i[:, -1:] - g_i).exp()).transpose(-1, -2) @ v_new
    return out.reshape(H, nc * C, -1)[:, :n].transpose(0, 1), state


class KDAState(CacheLayer):
    """A KDA layer's per-request state: ``conv_state`` [channels, kernel - 1] (the last inputs
    of the short convolution) and ``recurrent_state`` [heads, d_k, d_v], float32."""
    supports_8bit_cache = True  # under C8 the MLA layers' latent goes to 8 bits; this state stays float32

    def __init__(self, channels: int, kernel: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.conv_shape, self.rec_shape = (channels, kernel - 1), (heads, head_dim, head_dim)
        self.conv_state = torch.empty(0)
        self.recurrent_state = torch.empty(0)

    def kv_cache_specs(self, block_size: int, dtype: torch.dtype,
                       enable_prefix_caching: bool) -> dict[str, KVCacheSpec]:
        return {"conv_state": RunningStateSpec(block_size, torch.float32, self.conv_shape, prefix_hits=False),
                "recurrent_state": RunningStateSpec(block_size, torch.float32, self.rec_shape, prefix_hits=False)}


class KimiDeltaAttention(nn.Module):
    """KDA: q, k, v through a short causal convolution (SiLU), a per-channel forget gate and a
    per-head write strength, the delta rule over the request's state, a gated RMSNorm out."""

    def __init__(self, config) -> None:
        super().__init__()
        tp = get_tp_group()
        hidden, H_all, d = config.hidden_size, config.linear_num_heads, config.linear_head_dim
        self.H, self.d = H_all // tp.world_size, d
        width = H_all * d
        self.kernel = config.linear_conv_kernel_dim
        self.q_proj = ColumnParallelLinear(hidden, width, bias=False)
        self.k_proj = ColumnParallelLinear(hidden, width, bias=False)
        self.v_proj = ColumnParallelLinear(hidden, width, bias=False)
        # [q | k | v] channels of this rank's heads, one filter each: read as a matrix, kept as loaded
        self.conv_weight = nn.Parameter(torch.empty(3 * self.H * d, self.kernel))
        self.f_a_proj = Linear(hidden, d, bias=False)
        self.f_b_proj = ColumnParallelLinear(d, width, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(self.H * d, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(self.H, dtype=torch.float32))
        self.b_proj = ColumnParallelLinear(hidden, H_all, bias=False)
        self.g_a_proj = Linear(hidden, d, bias=False)
        self.g_b_proj = ColumnParallelLinear(d, width, bias=False)
        self.o_norm_weight = nn.Parameter(torch.ones(d))
        self.eps = config.rms_norm_eps
        self.o_proj = RowParallelLinear(width, hidden, bias=False)
        self.state = KDAState(3 * self.H * d, self.kernel, self.H, d)

    def forward(self, rope, x: torch.Tensor) -> torch.Tensor:
        md: RunningStateMetadata = self.state.attn_metadata("recurrent_state")
        T, H, d = x.shape[0], self.H, self.d
        mixed = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1).float()  # [T, 3 H d]
        g = self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias
        g = (-self.A_log.exp()[:, None] * F.softplus(g.view(T, H, d), threshold=20.0))  # log decay per channel
        beta = torch.sigmoid(self.b_proj(x).float())  # [T, H]
        mark = tracing.forward_mark()
        mark(Step.MODEL_QKV_PROJ)
        out = torch.empty(T, H, d)
        conv, rec = self.state.conv_state, self.state.recurrent_state
        nd, held = md.num_decodes, rec.numel() > 0  # no state held: a profiling run
        if nd:  # decode rows: one convolution step and one delta-rule step each, batched
            slots = md.decode_slots
            prev = conv[slots] if held else torch.zeros(nd, mixed.shape[1], self.kernel - 1)
            window = torch.cat((prev, mixed[:nd, :, None]), dim=-1)  # [B, channels, kernel]
            q, k, v = self._qkv(F.silu((window * self.conv_weight).sum(-1)))
            out[:nd], state = kda_recurrent(q, k, v, g[:nd], beta[:nd], rec[slots] if held else torch.zeros(nd, H, d, d))
            if held:
                conv[slots], rec[slots] = window[..., 1:], state
        for (s, e), slot, fresh in zip(md.prefill_rows, md.prefill_slots, md.prefill_fresh):
            prev = torch.zeros(self.kernel - 1, mixed.shape[1]) if fresh or not held else conv[slot].T
            full = torch.cat((prev, mixed[s:e]))  # [kernel - 1 + n, channels]
            conved = sum(full[j:j + e - s] * self.conv_weight[:, j] for j in range(self.kernel))
            state = torch.zeros(H, d, d) if fresh or not held else rec[slot]
            q, k, v = self._qkv(F.silu(conved))
            out[s:e], state = kda_chunked(q, k, v, g[s:e], beta[s:e], state)
            if held:
                conv[slot], rec[slot] = full[-(self.kernel - 1):].T, state
        mark(Step.OPS_ATTENTION)
        gate = self.g_b_proj(self.g_a_proj(x)).float().view(T, H, d)
        o = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps) * self.o_norm_weight.float()
        o = (o * torch.sigmoid(gate)).to(x.dtype).view(T, H * d)
        return self.o_proj(o)

    def _qkv(self, mixed: torch.Tensor):
        q, k, v = mixed.view(mixed.shape[0], 3, self.H, self.d).unbind(1)
        return l2norm(q) * self.d ** -0.5, l2norm(k), v


class KimiLinearDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config, layer_idx: int) -> None:
        nn.Module.__init__(self)
        self.layer_type = config.layer_types[layer_idx]
        # MLA without rope ("NoPE"): positions come from the KDA layers
        self.self_attn = (DeepseekV2MLAAttention(config, None, False) if self.layer_type == FULL
                          else KimiDeltaAttention(config))
        self.mlp = (DeepseekV2MoE(config) if config.mlp_layer_types[layer_idx] == "sparse"  # DeepSeek's router
                    else LlamaMLP(config.hidden_size, config.intermediate_size, False))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class KimiLinearModel(LlamaModel):
    def __init__(self, config, max_position: int) -> None:
        nn.Module.__init__(self)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(KimiLinearDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        sequence_parallel_begin(input_ids.shape[0])
        x, residual = self.embed_tokens(input_ids), None
        tracing.forward_mark()(Step.OPS_INPUT_NORM)
        for layer in self.layers:
            x, residual = layer(None, x, residual)  # no rope anywhere
        x, _ = self.norm(x, residual)
        x = gather_rows(x, Step.MODEL_LM_HEAD)
        tracing.forward_mark()(Step.MODEL_LM_HEAD)
        return x


class KimiLinearForCausalLM(DeepseekV3ForCausalLM):
    model_cls = KimiLinearModel

    def __init__(self, config, max_position: int | None = None) -> None:
        super().__init__(config, max_position)
        self.kv_cache_skip = ()  # no MTP layers

    def load_weight(self, params: dict[str, nn.Parameter], name: str, tensor) -> str | None:
        # the released names: block_sparse_moe for the FFN, experts' w1 / w3 / w2 for gate / up / down
        name = name.replace(".block_sparse_moe.", ".mlp.")
        if m := _KIMI_EXPERT.match(name):
            name = f"{m.group(1)}.{m.group(2)}.{_W[m.group(3)]}_proj.weight"
        prefix, _, leaf = name.rpartition(".self_attn.")
        if prefix and self.model.layers[int(prefix.rsplit(".", 1)[1])].layer_type == LINEAR:
            return self._load_kda(params, f"{prefix}.self_attn.", leaf, tensor)
        return super().load_weight(params, name, tensor)

    def _load_kda(self, params, at: str, leaf: str, tensor) -> str | None:
        """A KDA layer's tensor into this module's, each split by this rank's heads (the
        convolution's q / k / v filters go into their thirds of ``conv_weight``)."""
        target = at + {"o_norm.weight": "o_norm_weight"}.get(leaf, leaf)
        if leaf in ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"):
            target = at + "conv_weight"
        module = self.get_submodule(target.rpartition(".")[0])
        tensor = materialize(tensor)
        if hasattr(module, "shard"):  # a tensor-parallel projection (not MLA's: no q regrouping)
            return LlamaForCausalLM.load_weight(self, params, target, tensor)
        dst = params[target]
        if target.endswith("conv_weight"):
            third = dst.shape[0] // 3
            dst = dst.narrow(0, "qkv".index(leaf[0]) * third, third)
            tensor = shard_param(dst, tensor.reshape(tensor.shape[0], -1))
        elif leaf in ("dt_bias", "A_log"):
            tensor = shard_param(dst, tensor.reshape(-1))
        if dst.shape != tensor.shape:
            raise ValueError(f"{at}{leaf}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(tensor)
        return target


_KIMI_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(w[123])\.weight$")
_W = {"w1": "gate", "w3": "up", "w2": "down"}
