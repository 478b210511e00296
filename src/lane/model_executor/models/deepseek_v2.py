"""DeepSeek V3 and V3.2: MLA on a latent cache, DeepSeekMoE, and (V3.2) DSA.

- Attention: q through a LoRA (``q_a_proj`` -> RMSNorm -> ``q_b_proj``) or one
  ``q_proj``; K/V compressed to a ``kv_lora_rank`` latent plus one shared roped
  key. ``q_a_proj`` and ``kv_a_proj_with_mqa`` read the same input and are fused
  into one matmul. The cache and the attention itself are ``layers/mla.py``.
- Rope: DeepSeek rotates interleaved pairs. At load time the rope rows of the
  projections are reordered (evens, then odds), which turns it into the usual
  half-split rope with equal dot products (transformers does the same reorder on
  the fly); the q projection's rows are also regrouped to [every head's nope |
  every head's rope] so both parts are plain views.
- FFN: the first ``first_k_dense_replace`` layers are a dense MLP, the rest
  routed experts (``layers/fused_moe.py``) plus shared experts.
- V3.2 adds the lightning indexer (``layers/indexer.py``) to every layer; GLM-5
  (``GlmMoeDsaForCausalLM``) rotates its indexer's rope as interleaved pairs (reordered at
  load, like the main attention's) and its "shared" layers (``indexer_types``) reuse the
  previous "full" layer's top-k instead of running an indexer.
- The MTP layer (``num_nextn_predict_layers``, checkpoint layer index
  ``num_hidden_layers``) is loaded into ``self.mtp`` for speculative decoding.
"""
from __future__ import annotations

import logging
import math
import re

import torch
import torch.nn as nn
import torch.nn.functional as F

from lane import platform, tracing
from lane.distributed.parallel_state import (dsa_context_parallel, dsa_head_group, get_tp_group,
                                             replica_local_experts, sequence_parallel_begin)
from lane.distributed.layout import num_routed_experts
from lane.tracing import Step
from lane.model_executor.layers.context_parallel import heads_to_rows, row_window, rows_to_heads
from lane.model_executor.layers.fused_moe import (FusedMoE, combine_routed, grouped_topk, load_expert_weight,
                                                  share_rows)
from lane.model_executor.layers.indexer import Indexer, SharedTopk
from lane.model_executor.layers.layernorm import RMSNorm
from lane.model_executor.layers.linear import Linear
from lane.model_executor.layers.parallel_linear import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                                                        VocabParallelEmbedding, gather_rows, own_rows,
                                                        reduce_partial)
from lane.model_executor.layers.rotary_embedding import RotaryEmbedding
from lane.model_executor.loader.safetensors_loader import materialize
from lane.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel

logger = logging.getLogger(__name__)


def yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(config) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under yarn (the
    reference's correction for the longer context)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        m = yarn_mscale(params["factor"], params["mscale_all_dim"])
        scale *= m * m
    return scale


class DeepseekV2MLAAttention(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding, use_indexer: bool, shared: SharedTopk | None = None,
                 reuse_topk: bool = False) -> None:
        """``use_indexer``: a sparse (DSA) layer; ``reuse_topk``: it attends the top-k that the
        last layer with an indexer left in ``shared`` (GLM-5), instead of running its own."""
        super().__init__()
        tp = get_tp_group()
        H_all = config.num_attention_heads
        H = self.num_heads = H_all // tp.world_size  # this rank's heads; the latent cache is whole on every rank
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        self.kv_lora_rank = config.kv_lora_rank
        self.nope, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        bias = getattr(config, "attention_bias", False)
        hidden = config.hidden_size
        q_parts = [H_all * self.nope, H_all * self.rope_dim]  # the rows are regrouped at load: every nope, every rope
        if self.q_lora_rank:
            self.fused_qkv_a_proj = Linear(hidden, self.q_lora_rank + self.kv_lora_rank + self.rope_dim, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, q_parts, bias=False)
        else:
            self.q_proj = ColumnParallelLinear(hidden, q_parts, bias=False)
            self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6)
        # MLA absorbs its weight into the decode path (absorbed_weights): it stays as loaded. Under
        # DSA context parallelism a rank attends its rows with every head: kv_b_proj is whole
        self.context_parallel = use_indexer and dsa_context_parallel()
        kv_b_group = dsa_head_group() if use_indexer else tp
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, H_all * (self.nope + self.v_head_dim), bias=False,
                                              quantizable=False, tp=kv_b_group)
        self.o_proj = RowParallelLinear(H_all * self.v_head_dim, hidden, bias=bias)
        self.rotary = rotary
        attn_cls = platform.select_attention_backend(config).backend.get_impl_cls()  # mla / sparse_mla
        self.attn = attn_cls(H_all // kv_b_group.world_size, self.kv_lora_rank, self.nope, self.rope_dim,
                             self.v_head_dim, mla_softmax_scale(config), self.kv_b_proj,
                             head_offset=H * tp.rank_in_group if self.context_parallel else 0)
        self.indexer = (Indexer(hidden, self.q_lora_rank, config.index_n_heads, config.index_head_dim,
                                config.index_topk, rotary) if use_indexer and not reuse_topk else None)
        self.reuse_topk = reuse_topk
        self._shared = (shared,)  # not a submodule: one object the model's layers share

    def _select(self, rope, x, q_resid, win=None):
        """This layer's top-k: its indexer's (left for the layers that reuse it), or the last one's."""
        shared = self._shared[0]
        if self.indexer is None:
            return shared.selection if self.reuse_topk else None
        sel = self.indexer(rope, x, q_resid, win)  # mark 25
        if shared is not None:
            shared.selection = sel
        return sel

    def forward(self, rope, x: torch.Tensor) -> torch.Tensor:
        T, H = x.shape[0], self.num_heads
        q_resid = None
        if self.q_lora_rank:
            q_c, kv_a = self.fused_qkv_a_proj(x).split([self.q_lora_rank, self.kv_lora_rank + self.rope_dim], -1)
            q_resid = self.q_a_layernorm(q_c.contiguous())
            q = self.q_b_proj(q_resid)
        else:
            q, kv_a = self.q_proj(x), self.kv_a_proj_with_mqa(x)
        q_nope = q[:, :H * self.nope].view(T, H, self.nope)
        q_pe = q[:, H * self.nope:].view(T, H, self.rope_dim)
        latent = self.kv_a_layernorm(kv_a[:, :self.kv_lora_rank].contiguous())
        k_pe = kv_a[:, self.kv_lora_rank:].contiguous().view(T, 1, self.rope_dim)
        if self.rotary is not None:  # None: no rope (Kimi Linear's MLA layers)
            q_pe, k_pe = self.rotary(rope, q_pe, k_pe)
        mark = tracing.forward_mark()
        mark(Step.MODEL_QKV_PROJ)
        k_pe = k_pe.view(T, self.rope_dim)
        win = row_window(T, bool(self.attn.attn_metadata("kv_cache").prefills)) if self.context_parallel else None
        if win is None:
            out = self.attn(q_nope, q_pe, latent, k_pe, self._select(rope, x, q_resid))  # marks 24, 25, 27
        else:  # DSA context parallelism: this rank's rows with every head (marks 26)
            q = heads_to_rows(torch.cat((q_nope, q_pe), dim=-1), win)
            sparse = self._select(rope, x, q_resid, win)
            out = self.attn(q[..., :self.nope], q[..., self.nope:], latent, k_pe, sparse, win)
            out = rows_to_heads(out.view(q.shape[0], -1, self.v_head_dim), win).reshape(T, -1)
        out = self.o_proj(out)
        mark(Step.COMM_ATTN_REDUCE)
        return out


class DeepseekV2MoE(nn.Module):
    """Routed experts behind DeepSeek's gate, plus the always-on shared experts. Other families
    use it under their config names (Kimi Linear as it is; Qwen3-MoE with a softmax router,
    ``scoring_func``, and no selection bias, ``routing_bias=False``)."""

    def __init__(self, config, scoring_func: str | None = None, routing_bias: bool = True) -> None:
        super().__init__()
        E, hidden = num_routed_experts(config), config.hidden_size
        self.top_k = config.num_experts_per_tok
        self.scoring_func = scoring_func or getattr(config, "scoring_func", "sigmoid")
        self.n_group, self.topk_group = getattr(config, "n_group", None), getattr(config, "topk_group", None)
        self.renormalize = getattr(config, "norm_topk_prob", True)
        self.routed_scaling_factor = getattr(config, "routed_scaling_factor", 1.0)
        self.gate = nn.Module()  # float32, as the reference keeps it: it makes a discrete choice
        self.gate.weight = nn.Parameter(torch.empty(E, hidden, dtype=torch.float32), requires_grad=False)
        self.gate.e_score_correction_bias = (nn.Parameter(torch.zeros(E, dtype=torch.float32), requires_grad=False)
                                             if routing_bias else None)
        self.experts = FusedMoE(E, self.top_k, hidden, config.moe_intermediate_size)
        n_shared = getattr(config, "n_shared_experts", 0) or 0
        # partial sums, like the routed experts': one all-reduce after both (step 31)
        self.shared_experts = (LlamaMLP(hidden, config.moe_intermediate_size * n_shared, False, reduce=False)
                               if n_shared else None)
        self.tp = get_tp_group()

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.gate.weight)
        weights, ids = grouped_topk(
            logits, self.top_k, scoring_func=self.scoring_func, correction_bias=self.gate.e_score_correction_bias,
            num_expert_group=self.n_group, topk_group=self.topk_group, renormalize=self.renormalize,
            routed_scaling_factor=self.routed_scaling_factor)
        tracing.forward_mark()(Step.MODEL_MOE_ROUTE)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.experts.all_to_all:  # each token routed once, by its own rank (FusedMoE.all_to_all)
            mine = share_rows(self.tp, x)
            routed = self.experts.forward_all_to_all(mine, *self._route(mine))
            shared = self.shared_experts(x) if self.shared_experts is not None else None
            return combine_routed(self.tp, routed, shared, x.shape[0])
        out = self.experts(x, *self._route(x))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return reduce_partial(self.tp, out, Step.COMM_FFN_REDUCE, compute_step=Step.OPS_FFN)


def is_moe_layer(config, layer_idx: int) -> bool:
    types = getattr(config, "mlp_layer_types", None)
    if types and layer_idx < len(types):
        return types[layer_idx] == "sparse"
    return bool(getattr(config, "n_routed_experts", None)) and layer_idx >= getattr(config, "first_k_dense_replace", 0)


class DeepseekV2DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config, rotary: RotaryEmbedding, layer_idx: int, shared: SharedTopk | None = None) -> None:
        nn.Module.__init__(self)
        # V3.2: every layer has a lightning indexer; GLM-5: "shared" layers reuse the last one's top-k
        types = getattr(config, "indexer_types", None) or []
        reuse = layer_idx < len(types) and types[layer_idx] == "shared"
        self.self_attn = DeepseekV2MLAAttention(config, rotary, bool(getattr(config, "index_topk", None)), shared,
                                                reuse)
        self.mlp = (DeepseekV2MoE(config) if is_moe_layer(config, layer_idx)
                    else LlamaMLP(config.hidden_size, config.intermediate_size, False))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekMTPLayer(DeepseekV2DecoderLayer):
    """The multi-token-prediction block: mixes the next token's embedding with the
    main model's last hidden state, then one decoder layer and its own head. Kept
    loaded for speculative decoding; its embedding is the main model's."""

    def __init__(self, config, rotary: RotaryEmbedding, layer_idx: int) -> None:
        super().__init__(config, rotary, layer_idx)
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.eh_proj = Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.shared_head.head = ParallelLMHead(config.hidden_size, config.vocab_size)


def drop_unloaded_mtp(model: nn.Module, loaded: set[str]) -> None:
    """A checkpoint without MTP weights (transformers saves none) drops the MTP layers."""
    if len(model.mtp) and not any(n.startswith("mtp.") for n in loaded):
        logger.info("checkpoint has no MTP layer (num_nextn_predict_layers=%d): not kept", len(model.mtp))
        model.mtp = nn.ModuleList()


class DeepseekV2Model(LlamaModel):
    def __init__(self, config, max_position: int) -> None:
        nn.Module.__init__(self)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config, config.qk_rope_head_dim, max_position)
        self.shared_topk = SharedTopk()
        self.layers = nn.ModuleList(DeepseekV2DecoderLayer(config, self.rotary, i, self.shared_topk)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


_INDEXER_ROPE_ROWS = (".wq_b.weight", ".wk.weight", ".k_norm.weight", ".k_norm.bias")


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    model_cls = DeepseekV2Model
    rope_interleave_always = False
    indexer_rope_interleaved = False

    def __init__(self, config, max_position: int | None = None) -> None:
        super().__init__(config, max_position)
        self.stacked_params = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        if getattr(config, "q_lora_rank", None):
            self.stacked_params.update(q_a_proj=("fused_qkv_a_proj", 0), kv_a_proj_with_mqa=("fused_qkv_a_proj", 1))
        # the MTP layer runs only to draft (speculative decoding, which then gives it a cache)
        self.kv_cache_skip = ("mtp.",)
        n_mtp = getattr(config, "num_nextn_predict_layers", 0) or 0
        with replica_local_experts():
            self.mtp = nn.ModuleList(DeepseekMTPLayer(config, self.model.rotary, config.num_hidden_layers + i)
                                     for i in range(n_mtp))

    def moe_layers(self) -> dict[int, FusedMoE]:
        return {i: layer.mlp.experts for i, layer in enumerate(self.model.layers)
                if isinstance(layer.mlp, DeepseekV2MoE)}

    # -- MTP drafting (speculative decoding) ----------------------------------------
    @property
    def num_mtp_layers(self) -> int:
        return len(self.mtp)

    def mtp_source(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the MTP layer reads of the main model: its final (normed) hidden states."""
        return hidden

    def mtp_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, source: torch.Tensor,
                    i: int = 0) -> torch.Tensor:
        """MTP layer i at positions t: eh_proj(cat[enorm(emb(x_{t+1})), hnorm(h_t)]) -> one
        decoder block. Returns its hidden states (fed back for the next draft)."""
        layer = self.mtp[i]
        sequence_parallel_begin(input_ids.shape[0])
        e = self.model.embed_tokens(input_ids)  # this rank's rows under sequence parallelism
        e = e.masked_fill(own_rows(positions == 0)[:, None], 0.0)  # position 0 has no previous token (as vLLM)
        x = layer.eh_proj(torch.cat((layer.enorm(e), layer.hnorm(own_rows(source))), dim=-1))
        h, residual = layer(self.model.rotary.prepare(positions, x.dtype), x, None)
        return gather_rows(h + residual)

    def mtp_logits(self, hidden: torch.Tensor, i: int = 0) -> torch.Tensor:
        head = self.mtp[i].shared_head
        return head.head(head.norm(hidden))

    def load_weight(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
        name = self._mtp_name(name)
        if name is None:
            return None
        if (expert := load_expert_weight(self, name, tensor)) is not None:
            return expert
        if name.endswith((".q_b_proj.weight", ".q_proj.weight")):
            # regrouped whole to [every nope | every rope]; each part then split by heads on its own
            tensor = self._regroup_q(materialize(tensor))
            module = self.get_submodule(name.rpartition(".")[0])
            n = self.config.num_attention_heads * self.config.qk_nope_head_dim
            with torch.no_grad():
                for part, rows in enumerate((tensor[:n], tensor[n:])):
                    rows, offset = module.shard(rows, part)
                    module.weight.narrow(0, offset, rows.shape[0]).copy_(rows)
            return name
        if self.indexer_rope_interleaved and ".indexer." in name and name.endswith(_INDEXER_ROPE_ROWS):
            tensor = self._indexer_rope_rows(materialize(tensor), name)
        if ".kv_a_proj_with_mqa." in name:
            tensor = materialize(tensor)
            tensor = torch.cat((tensor[:self.config.kv_lora_rank],
                                self._deinterleave(tensor[self.config.kv_lora_rank:])))
        return super().load_weight(params, name, tensor)

    def finish_loading(self, loaded: set[str]) -> None:
        drop_unloaded_mtp(self, loaded)

    def _mtp_name(self, name: str) -> str | None:
        """model.layers.{N + i}.* (N = num_hidden_layers) -> mtp.{i}.*; None to skip."""
        m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
        if not m or int(m.group(1)) < self.config.num_hidden_layers:
            return name
        i = int(m.group(1)) - self.config.num_hidden_layers
        if i >= len(self.mtp):
            logger.debug("skipping %s: the config has no MTP layer %d", name, i)
            return None
        if m.group(2) == "embed_tokens.weight":  # a copy of the main embedding
            return None
        return f"mtp.{i}.{m.group(2)}"

    def _indexer_rope_rows(self, w: torch.Tensor, name: str) -> torch.Tensor:
        """GLM-5's indexer rotates interleaved pairs on each head's first qk_rope_head_dim
        channels: those rows (of wq_b per head, of wk, and of k_norm, which acts per channel
        before the rope) reordered evens then odds, for the half-split rope; dot products equal."""
        r = self.config.qk_rope_head_dim
        heads = self.config.index_n_heads if name.endswith(".wq_b.weight") else 1
        w = w.reshape(heads, -1, *w.shape[1:]).clone()
        w[:, :r] = torch.cat((w[:, 0:r:2], w[:, 1:r:2]), dim=1)
        return w.reshape(-1, *w.shape[2:])

    def _deinterleave(self, rows: torch.Tensor) -> torch.Tensor:
        """Interleaved rope rows (x0, x1), (x2, x3), ... -> evens then odds."""
        if not (self.rope_interleave_always or getattr(self.config, "rope_interleave", True)):
            return rows
        return torch.cat((rows[0::2], rows[1::2]))

    def _regroup_q(self, w: torch.Tensor) -> torch.Tensor:
        """[H * (nope + rope), in] -> [H * nope | H * rope (de-interleaved)]"""
        c = self.config
        w = w.view(c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim, -1)
        rope = torch.stack([self._deinterleave(h) for h in w[:, c.qk_nope_head_dim:]])
        return torch.cat((w[:, :c.qk_nope_head_dim].reshape(-1, w.shape[-1]), rope.reshape(-1, w.shape[-1])))

    def _shard_sizes(self, fused_name: str, rows: int) -> list[int]:
        if ".fused_qkv_a_proj." in fused_name:
            c = self.config
            return [c.q_lora_rank, c.kv_lora_rank + c.qk_rope_head_dim]
        return super()._shard_sizes(fused_name, rows)


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """V3.2 = V3 + the lightning indexer in every layer (chosen by ``index_topk``)."""
    rope_interleave_always = True  # its main attention always rotates interleaved pairs


class GlmMoeDsaForCausalLM(DeepseekV32ForCausalLM):
    """GLM-5: V3.2's layers, its indexer's rope interleaved, "shared" layers reusing the last
    "full" layer's top-k (``indexer_types``). Its MTP layer is V3's (transformers has none)."""
    indexer_rope_interleaved = True
