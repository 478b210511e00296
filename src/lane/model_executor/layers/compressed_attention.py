"""DeepSeek V4's attention cache: a sliding window of raw K=V tokens in every layer,
plus compressed entries in CSA / HCA layers (seed steps 23-27).

Per layer, in the paged pool (all indexed by the request's token block table;
the block size is a multiple of every compression rate, so a block holds whole
windows):
- ``kv_cache`` [blocks, block_size, head_dim]: each token's K (= V).
- ``entry_cache`` [blocks, block_size / rate, head_dim]: one pooled entry per
  ``rate`` tokens, in *entry space* (entry w sits where token w * rate does).
- CSA only: ``index_cache`` [blocks, block_size / rate, index_head_dim], the
  lightning indexer's keys, and ``*_snap`` (float32): the running state at the
  end of each block, so a prefix-cache hit can resume compression there.

Per request, in a running-state slot (float32): the pending, not yet complete
window, as online-softmax accumulators (running max, denominator and weighted
sum per channel) instead of the raw rows: O(head_dim) state, exact up to
rounding. HCA keeps one accumulator; CSA two, because its entries overlap: entry
w pools window w-1's first series (Ca) and window w's second (Cb).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from lane.model_executor.layers.attention import CacheLayer

NEG_INF = float("-inf")


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """V4 rope: interleaved pairs (2i, 2i+1) on the *last* 2 * cos.shape[-1] channels.
    cos / sin broadcast against x[..., 0::2] of the rope part."""
    r = 2 * cos.shape[-1]
    rope = x[..., -r:]
    x1, x2 = rope[..., 0::2].float(), rope[..., 1::2].float()
    out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat((x[..., :-r], out), dim=-1)


def row_acc(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The accumulator of a single row per channel: [..., C] -> [..., 3, C]."""
    return torch.stack((gate, torch.ones_like(gate), kv), dim=-2)


def empty_acc(channels: int) -> torch.Tensor:
    """An accumulator over no rows: [3, C] = (max, denominator, weighted sum)."""
    acc = torch.zeros(3, channels)
    acc[0] = NEG_INF
    return acc


def pool(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Per-channel softmax pooling of [W, m, C] rows (gate -inf where a slot is
    empty) -> accumulators [W, 3, C]."""
    m = gate.amax(dim=1)
    e = torch.exp(gate - torch.where(torch.isinf(m), torch.zeros_like(m), m)[:, None])
    return torch.stack((m, e.sum(dim=1), (e * kv).sum(dim=1)), dim=1)


def merge(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Combine accumulators [..., 3, C] over disjoint rows."""
    ma, mb = a[..., 0, :], b[..., 0, :]
    m = torch.maximum(ma, mb)
    ms = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    wa = torch.where(torch.isinf(ma), torch.zeros_like(ma), torch.exp(ma - ms))
    wb = torch.where(torch.isinf(mb), torch.zeros_like(mb), torch.exp(mb - ms))
    return torch.stack((m, a[..., 1, :] * wa + b[..., 1, :] * wb, a[..., 2, :] * wa + b[..., 2, :] * wb), dim=-2)


@dataclass
class ChunkCompression:
    pooled: torch.Tensor  # [nc, C] entries of the windows this chunk completed (before norm and rope)
    first_window: int  # window index of pooled[0]
    state: torch.Tensor  # [2, 3, C] the request's running state after the chunk
    closed_ca: torch.Tensor | None  # [nc, 3, C] CSA: each completed window's Ca accumulator


def compress_chunk(kv: torch.Tensor, gate: torch.Tensor, p0: int, rate: int, overlap: bool,
                   state: torch.Tensor) -> ChunkCompression:
    """Fold one request's rows for positions p0 .. p0 + n - 1 (float32, gate with its
    position bias) into its running state ``[2, 3, C]`` (current entry, next entry)
    and pool every window the chunk completes."""
    n, width = kv.shape
    C = width // 2 if overlap else width
    w0, wl = p0 // rate, (p0 + n - 1) // rate
    nw, off = wl - w0 + 1, p0 - w0 * rate
    pk = kv.new_zeros(nw * rate, width)
    pg = kv.new_full((nw * rate, width), NEG_INF)
    pk[off:off + n], pg[off:off + n] = kv, gate
    pk, pg = pk.view(nw, rate, width), pg.view(nw, rate, width)
    nc = (p0 + n) // rate - w0  # windows completed by this chunk
    if overlap:
        ca = pool(pk[..., :C], pg[..., :C])
        cur = pool(pk[..., C:], pg[..., C:])
        ca[0] = merge(state[1], ca[0])
        cur[0] = merge(state[0], cur[0])
        if nw > 1:
            cur[1:] = merge(ca[:-1], cur[1:])
    else:
        ca, cur = None, pool(pk, pg)
        cur[0] = merge(state[0], cur[0])
    new_state = torch.stack((empty_acc(C), empty_acc(C)))
    if nc == nw:  # ends on a window edge: the next entry starts from the last Ca
        if overlap:
            new_state[0] = ca[-1]
    else:
        new_state[0] = cur[-1]
        if overlap:
            new_state[1] = ca[-1]
    pooled = cur[:nc, 2] / cur[:nc, 1]
    return ChunkCompression(pooled, w0, new_state, ca[:nc] if overlap else None)


class V4AttentionCache(CacheLayer):
    """One V4 layer's paged cache and running state (see the module docstring)."""

    def __init__(self, layer_type: str, head_dim: int, window: int, rate: int = 0, index_head_dim: int = 0) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.window = window
        self.head_dim = head_dim
        self.rate = rate
        self.index_head_dim = index_head_dim if layer_type == "compressed_sparse_attention" else 0
        self.kv_cache = torch.empty(0)
        self.entry_cache = torch.empty(0)
        self.index_cache = torch.empty(0)
        self.entry_snap = torch.empty(0)
        self.index_snap = torch.empty(0)
        self.state = torch.empty(0)
        self.index_state = torch.empty(0)

    @property
    def sparse(self) -> bool:
        return self.index_head_dim > 0

    def cache_shapes(self, block_size: int) -> dict[str, tuple[int, ...]]:
        shapes = {"kv_cache": (block_size, self.head_dim)}
        if not self.rate:
            return shapes
        if block_size % self.rate:
            raise ValueError(f"--block-size {block_size} must be a multiple of every compression rate "
                             f"(this model has {self.rate}); whole windows must fit in a block")
        shapes["entry_cache"] = (block_size // self.rate, self.head_dim)
        if self.sparse:
            shapes["index_cache"] = (block_size // self.rate, self.index_head_dim)
            shapes["entry_snap"] = (3, self.head_dim)
            shapes["index_snap"] = (3, self.index_head_dim)
        return shapes

    def cache_dtype(self, name: str) -> torch.dtype | None:
        return torch.float32 if name.endswith("_snap") else None

    def cache_group(self, name: str) -> str:
        return "window" if name == "kv_cache" else "full"

    @property
    def sliding_window(self) -> int:
        return self.window

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        if not self.rate:
            return {}
        shapes = {"state": (2, 3, self.head_dim)}
        if self.sparse:
            shapes["index_state"] = (2, 3, self.index_head_dim)
        return shapes

    # -- addressing ---------------------------------------------------------------
    # tables are one request's [blocks] with positions [L], or a batch's [B, blocks] with [B, L]
    def token_slots(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        bs = self.kv_cache.shape[1]
        return table.gather(-1, positions // bs) * bs + positions % bs

    def entry_slots(self, table: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
        per_block = self.entry_cache.shape[1]
        pos = windows * self.rate
        return table.gather(-1, pos // self.kv_cache.shape[1]) * per_block + (pos % self.kv_cache.shape[1]) // self.rate

    def window_keys(self, window_table: torch.Tensor, first: int, last: int) -> torch.Tensor:
        """Cached K=V of positions first .. last (the window group's table) -> [L, head_dim]"""
        return self.kv_cache.view(-1, self.head_dim)[self.token_slots(window_table, torch.arange(first, last + 1))]

    def entries(self, cache: torch.Tensor, table: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
        """Entries (of ``entry_cache`` or ``index_cache``) of windows [E] or [B, E] -> [..., C]"""
        return cache.view(-1, cache.shape[-1])[self.entry_slots(table, windows)]

    def write_entries(self, cache: torch.Tensor, table: torch.Tensor, first_window: int, rows: torch.Tensor) -> None:
        if rows.shape[0]:
            windows = torch.arange(first_window, first_window + rows.shape[0])
            cache.view(-1, cache.shape[-1])[self.entry_slots(table, windows)] = rows.to(cache.dtype)

    # -- running state --------------------------------------------------------------
    def load_state(self, which: str, slot: int, p0: int, fresh: bool, table: torch.Tensor) -> torch.Tensor:
        """The state a chunk starting at p0 continues from: empty at 0; after a
        prefix-cache hit, the snapshot taken at the end of the block before p0."""
        C = self.head_dim if which == "state" else self.index_head_dim
        if p0 == 0:
            return torch.stack((empty_acc(C), empty_acc(C)))
        if fresh:
            snap = self.entry_snap if which == "state" else self.index_snap
            bs = self.kv_cache.shape[1]
            if p0 % bs:
                raise RuntimeError(f"compressed-attention state restored at {p0}, not a block edge")
            state = torch.stack((empty_acc(C), empty_acc(C)))
            if self.sparse:
                state[0] = snap[table[p0 // bs - 1]]
            return state
        return getattr(self, which)[slot].clone()

    def save_state(self, which: str, slot: int, comp: ChunkCompression, table: torch.Tensor) -> None:
        getattr(self, which)[slot] = comp.state
        if comp.closed_ca is None:
            return
        bs = self.kv_cache.shape[1]
        snap = self.entry_snap if which == "state" else self.index_snap
        for k in range(comp.closed_ca.shape[0]):  # block edges this chunk crossed
            end = (comp.first_window + k + 1) * self.rate
            if end % bs == 0:
                snap[table[end // bs - 1]] = comp.closed_ca[k]


class V4RMSNorm(nn.Module):
    """RMSNorm with a float32 weight applied before the cast back (as V4's reference)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def attend_with_sinks(q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor, sinks: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Shared-KV attention (K = V = keys) with a per-head sink logit in the denominator.
    One request's chunk: q [n, H, d], keys [L, d], allowed [n, L]; or one query per
    request: q [B, H, d], keys [B, L, d], allowed [B, L]. -> like q"""
    n, H, _ = q.shape
    logits = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [n, H, L]
    logits = logits.masked_fill(~allowed[:, None, :], NEG_INF)
    combined = torch.cat((logits, sinks.view(1, H, 1).expand(n, H, 1).to(logits.dtype)), dim=-1)
    combined = combined - combined.amax(dim=-1, keepdim=True)
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    return torch.matmul(probs.to(keys.dtype), keys)
