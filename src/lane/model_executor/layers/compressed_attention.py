"""DeepSeek V4's attention cache: a sliding window of raw K=V tokens in every layer,
plus compressed entries in CSA / HCA layers (seed steps 23-27).

Per layer, in three KV cache groups (the block size is a multiple of every
compression rate, so a block holds whole windows):
- the sliding-window group: ``kv_cache`` [blocks, block_size, head_dim], each token's
  K (= V); blocks no query can see any more are released.
- the main group, kept for the whole context: ``entry_cache`` [blocks, block_size /
  rate, head_dim], one pooled entry per ``rate`` tokens, in *entry space* (entry w
  sits where token w * rate does); CSA only: ``index_cache`` [blocks, block_size /
  rate, index_head_dim], the lightning indexer's keys, and, with prefix caching,
  ``*_snap`` (float32): the running state at the end of each block, so a prefix-cache
  hit can resume compression there.
- the running-state group, per request (float32): the pending, not yet complete
window, as online-softmax accumulators (running max, denominator and weighted
sum per channel) instead of the raw rows: O(head_dim) state, exact up to
rounding. HCA keeps one accumulator; CSA two, because its entries overlap: entry
w pools window w-1's first series (Ca) and window w's second (Cb).

C8 (``--kv-cache-dtype int8 / fp8_e4m3``): the window's K=V, the entries and the indexer's
keys are stored a byte a value, each row with its float32 scale in a tensor of the same group
(``kv_scale``, ``entry_scale``, ``index_scale``: specs of the same kind, one value wide). A
window is dequantized as it is gathered (it is bounded); entries a pass of blocks at a time
(``entry_passes``), the indexer scoring and the attention's online softmax going over the
passes. The running state and the snapshots stay float32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from lane.attention.metadata import PagedAttentionMetadata, RunningStateMetadata
from lane.kv_cache_interface import (BlockEdgeStateSpec, CompressedEntrySpec, IndexerKeySpec, KVCacheSpec,
                                     RunningStateSpec, SlidingWindowSpec)
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


@dataclass
class CompressedAttentionMetadata:
    """One step as a V4 layer sees it, from its groups: the window group's (raw K=V),
    the main group's (entries, indexer keys, snapshots) and the running-state group's."""
    window: PagedAttentionMetadata
    entries: PagedAttentionMetadata | None = None  # None: a sliding-only layer
    state: RunningStateMetadata | None = None


@dataclass
class DecodeFold:
    """Decode rows whose window this token closed, and their pooled accumulators."""
    rows: torch.Tensor  # [r] row indices into the decode batch
    done: torch.Tensor  # [r, 3, C]


class V4AttentionCache(CacheLayer):
    """One V4 layer's cache and running state, and their bookkeeping: where entries and
    keys live, folding rows into the running state, snapshots at block edges. The model
    (``deepseek_v4.py``) supplies the maths: projections, norms, rope, attention."""
    supports_8bit_cache = True

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
        self.entry_snap = torch.empty(0)  # only with prefix caching
        self.index_snap = torch.empty(0)
        self.state = torch.empty(0)
        self.index_state = torch.empty(0)
        self.kv_scale = torch.empty(0)  # C8 only
        self.entry_scale = torch.empty(0)
        self.index_scale = torch.empty(0)
        # this step's chunks that end in drafts: (state, slot) -> what refolding fewer rows needs
        self._verify: dict[tuple[str, int], tuple] = {}

    @property
    def sparse(self) -> bool:
        return self.index_head_dim > 0

    @property
    def block_size(self) -> int:
        return self.kv_cache.shape[1]  # [blocks, block_size, head_dim]

    def kv_cache_specs(self, block_size: int, dtype: torch.dtype,
                       enable_prefix_caching: bool) -> dict[str, KVCacheSpec]:
        c8, store, f32 = self.kv_cache_dtype != "auto", self.stored_dtype(dtype), torch.float32
        specs: dict[str, KVCacheSpec] = {"kv_cache": SlidingWindowSpec(block_size, store, self.head_dim, self.window)}
        if c8:  # each row's scale, in the same group (a spec of the same kind, one value wide)
            specs["kv_scale"] = SlidingWindowSpec(block_size, f32, 1, self.window)
        if not self.rate:
            return specs
        if block_size % self.rate:
            raise ValueError(f"--block-size {block_size} must be a multiple of every compression rate "
                             f"(this model has {self.rate}); whole windows must fit in a block")
        specs["entry_cache"] = CompressedEntrySpec(block_size, store, self.head_dim, self.rate)
        if c8:
            specs["entry_scale"] = CompressedEntrySpec(block_size, f32, 1, self.rate)
        specs["state"] = RunningStateSpec(block_size, torch.float32, (2, 3, self.head_dim))
        if self.sparse:
            specs["index_cache"] = IndexerKeySpec(block_size, store, self.index_head_dim, self.rate)
            if c8:
                specs["index_scale"] = IndexerKeySpec(block_size, f32, 1, self.rate)
            specs["index_state"] = RunningStateSpec(block_size, torch.float32, (2, 3, self.index_head_dim))
            if enable_prefix_caching:  # what a hit resumes the overlapping windows from
                specs["entry_snap"] = BlockEdgeStateSpec(block_size, torch.float32, self.head_dim)
                specs["index_snap"] = BlockEdgeStateSpec(block_size, torch.float32, self.index_head_dim)
        return specs

    def metadata(self) -> CompressedAttentionMetadata:
        md = CompressedAttentionMetadata(self.attn_metadata("kv_cache"))
        if self.rate:
            md.entries, md.state = self.attn_metadata("entry_cache"), self.attn_metadata("state")
        return md

    def _entry_cache(self, which: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(the entries' cache, their scales under C8) of "state" or "index_state"."""
        return (self.entry_cache, self.entry_scale) if which == "state" else (self.index_cache, self.index_scale)

    def _snap(self, which: str) -> torch.Tensor:
        return self.entry_snap if which == "state" else self.index_snap

    # -- addressing ---------------------------------------------------------------
    # tables are one request's [blocks] with positions [L], or a batch's [B, blocks] with [B, L]
    def token_slots(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        bs = self.block_size
        return table.gather(-1, positions // bs) * bs + positions % bs

    def entry_slots(self, table: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
        bs, per_block = self.block_size, self.block_size // self.rate
        pos = windows * self.rate
        return table.gather(-1, pos // bs) * per_block + (pos % bs) // self.rate

    def write_window(self, kv: torch.Tensor, md: CompressedAttentionMetadata) -> None:
        """Every row's K=V into the window group's pool (step 24)."""
        self.write_rows(self.kv_cache, self.kv_scale, md.window.slot_mapping, kv)

    def window_keys(self, window_table: torch.Tensor, first: int, last: int) -> torch.Tensor:
        """Cached K=V of positions first .. last (the window group's table) -> [L, head_dim]"""
        return self.read_rows(self.kv_cache, self.kv_scale, self.token_slots(window_table, torch.arange(first, last + 1)))

    def decode_window_keys(self, window_tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[B, L] positions of each decode's window -> [B, L, head_dim]"""
        return self.read_rows(self.kv_cache, self.kv_scale, self.token_slots(window_tables, positions))

    def entries(self, which: str, table: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
        """Entries ("state": the pooled KV, "index_state": the indexer's keys) of windows
        [E] or [B, E] -> [..., C]"""
        return self.read_rows(*self._entry_cache(which), self.entry_slots(table, windows))

    def entry_passes(self, n_entries: int) -> list[tuple[int, int]]:
        """The ranges of entries read at once (``c8_passes``, a block holding block_size / rate)."""
        return self.c8_passes(n_entries, self.block_size // self.rate)

    def write_entries(self, which: str, table: torch.Tensor, windows: torch.Tensor, rows: torch.Tensor) -> None:
        """Entries of windows [E] (one request's table) or [B, 1] (a batch's tables)."""
        if rows.shape[0]:
            self.write_rows(*self._entry_cache(which), self.entry_slots(table, windows).reshape(-1), rows)

    # -- running state: a prefill chunk ---------------------------------------------
    def fold_prefill(self, which: str, kv: torch.Tensor, gate: torch.Tensor, overlap: bool,
                     md: CompressedAttentionMetadata, i: int) -> ChunkCompression:
        """Fold prefill chunk i's rows (float32, gate with its position bias) into its
        request's running state; pools every window the chunk completes."""
        span = md.entries.prefills[i]
        slot, fresh = md.state.prefill_slots[i], md.state.prefill_fresh[i]
        state = self._load_state(which, slot, span.num_computed, fresh, span.block_ids)
        if md.state.prefill_verify and md.state.prefill_verify[i]:
            self._verify[(which, slot)] = (kv, gate, span.num_computed, overlap, state.clone())
        comp = compress_chunk(kv, gate, span.num_computed, self.rate, overlap, state)
        getattr(self, which)[slot] = comp.state
        if comp.closed_ca is not None and self._snap(which).numel():
            snap = self._snap(which)
            for k in range(comp.closed_ca.shape[0]):  # block edges this chunk crossed
                end = (comp.first_window + k + 1) * self.rate
                if end % self.block_size == 0:
                    snap[span.block_ids[end // self.block_size - 1]] = comp.closed_ca[k]
        return comp

    def keep_verified(self, rows_by_slot: dict[int, int]) -> None:
        """Running state falls back to the last accepted row: the chunk's first rows folded
        again from the state before it (exact: the same rows in the same order)."""
        for (which, slot), (kv, gate, p0, overlap, state) in self._verify.items():
            n = rows_by_slot.get(slot)
            if n is not None and n < kv.shape[0]:  # n = 0: the state before the chunk, as it was
                getattr(self, which)[slot] = (state if n == 0 else
                                              compress_chunk(kv[:n], gate[:n], p0, self.rate, overlap, state).state)
        self._verify.clear()

    def _load_state(self, which: str, slot: int, p0: int, fresh: bool, table: torch.Tensor) -> torch.Tensor:
        """The state a chunk starting at p0 continues from: empty at 0; after a
        prefix-cache hit, the snapshot taken at the end of the block before p0."""
        C = self.head_dim if which == "state" else self.index_head_dim
        if p0 == 0:
            return torch.stack((empty_acc(C), empty_acc(C)))
        if fresh:
            if p0 % self.block_size:
                raise RuntimeError(f"compressed-attention state restored at {p0}, not a block edge")
            state = torch.stack((empty_acc(C), empty_acc(C)))
            if self.sparse:
                if not self._snap(which).numel():
                    raise RuntimeError("a prefix-cache hit on compressed attention without block-edge snapshots")
                state[0] = self._snap(which)[table[p0 // self.block_size - 1]]
            return state
        return getattr(self, which)[slot].clone()

    # -- running state: one token per decode ----------------------------------------
    def fold_decode(self, which: str, kv: torch.Tensor, gate: torch.Tensor, positions: torch.Tensor,
                    overlap: bool, md: CompressedAttentionMetadata) -> DecodeFold:
        """Fold each decode's row [B, width] into its request's state; returns the rows
        whose window this token closes, with their pooled accumulators."""
        slots = md.state.decode_slots
        state = getattr(self, which)[slots]  # [B, 2, 3, C]
        if overlap:
            C = kv.shape[1] // 2
            cur = merge(state[:, 0], row_acc(kv[:, C:], gate[:, C:]))
            nxt = merge(state[:, 1], row_acc(kv[:, :C], gate[:, :C]))
        else:
            cur, nxt = merge(state[:, 0], row_acc(kv, gate)), None
        empty = empty_acc(cur.shape[-1])
        new_state = torch.stack((cur, nxt if nxt is not None else torch.zeros_like(cur)), dim=1)
        if nxt is None:
            new_state[:, 1] = empty
        rows = ((positions + 1) % self.rate == 0).nonzero().squeeze(1)
        if rows.numel():
            new_state[rows, 0] = nxt[rows] if nxt is not None else empty
            new_state[rows, 1] = empty
            snap = self._snap(which)
            if nxt is not None and snap.numel():  # block edges: snapshot the state for prefix-cache hits
                bs = self.block_size
                edge = rows[(positions[rows] + 1) % bs == 0]
                if edge.numel():
                    tables = md.entries.decode_block_tables
                    snap[tables[edge].gather(1, ((positions[edge] + 1) // bs - 1)[:, None])[:, 0]] = nxt[edge]
        getattr(self, which)[slots] = new_state
        return DecodeFold(rows, cur[rows])


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


def attend_with_sinks(q: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor]], sinks: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Shared-KV attention (K = V = keys) with a per-head sink logit in the denominator, over
    ``parts`` of the context, each (keys, allowed). One request's chunk: q [n, H, d], keys
    [L, d], allowed [n, L]; or one query per request: q [B, H, d], keys [B, L, d], allowed
    [B, L]. -> like q. Several parts (C8's passes) merge by an online softmax that starts
    from the sink; a part no row may see is skipped."""
    n, H, _ = q.shape
    sink = sinks.view(1, H, 1).expand(n, H, 1)
    if len(parts) == 1:
        keys, allowed = parts[0]
        keys = keys.to(q.dtype)
        logits = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [n, H, L]
        logits = logits.masked_fill(~allowed[:, None, :], NEG_INF)
        combined = torch.cat((logits, sink.to(logits.dtype)), dim=-1)
        combined = combined - combined.amax(dim=-1, keepdim=True)
        probs = torch.softmax(combined, dim=-1)[..., :-1]
        return torch.matmul(probs.to(keys.dtype), keys)
    m, total = sink.float(), torch.ones(n, H, 1)
    acc = torch.zeros(n, H, q.shape[-1])
    for keys, allowed in parts:
        if not bool(allowed.any()):
            continue
        keys = keys.to(q.dtype)
        s = (torch.matmul(q, keys.transpose(-1, -2)) * scale).float().masked_fill(~allowed[:, None, :], NEG_INF)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))  # finite: the sink is in it
        c, p = torch.exp(m - m_new), torch.exp(s - m_new)
        total = total * c + p.sum(-1, keepdim=True)
        acc = acc * c + torch.matmul(p.to(keys.dtype), keys).float()
        m = m_new
    return (acc / total).to(q.dtype)
