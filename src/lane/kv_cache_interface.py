"""What each cache-holding layer keeps, and how the engine groups and sizes it (vLLM's
``kv_cache_interface.py``).

A layer declares one ``KVCacheSpec`` per cache tensor it owns. Specs say what one block
(or, for running state, one request's slot) holds, and which kind of manager keeps the
blocks: ``full`` (every block of the context stays), ``sliding_window`` (blocks no
future query can see are released) or ``state`` (one slot per running request, like
Mamba's). The worker groups tensors by kind into ``KVCacheGroupSpec``s; one pool per
group. The engine hands the resulting ``KVCacheConfig`` to the scheduler unchanged.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

FULL, SLIDING_WINDOW, STATE = "full", "sliding_window", "state"
# --kv-cache-dtype: the model dtype, or C8's 8 bits with a scale per row (set_kv_cache_dtype)
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")
_KIND_ORDER = (FULL, SLIDING_WINDOW, STATE)


@dataclass(frozen=True)
class KVCacheSpec:
    block_size: int
    dtype: torch.dtype
    kind: ClassVar[str] = FULL

    @property
    def shape(self) -> tuple[int, ...]:
        """One block's (or one slot's) tensor shape."""
        raise NotImplementedError

    @property
    def page_size_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def group_key(self) -> tuple:
        """Tensors with equal keys share block tables (one group, one pool)."""
        return (self.kind, self.block_size)


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """K or V of every head: [kv_heads, block_size, head_size] per block."""
    num_kv_heads: int = 1
    head_size: int = 0

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_kv_heads, self.block_size, self.head_size)


@dataclass(frozen=True)
class KVScaleSpec(KVCacheSpec):
    """An 8-bit cache's scales (C8, ``--kv-cache-dtype int8 / fp8_e4m3``): one float per token
    and KV head, [kv_heads, block_size] per block, so no scale spans a tensor-parallel split."""
    num_kv_heads: int = 1

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_kv_heads, self.block_size)


@dataclass(frozen=True)
class MLAAttentionSpec(KVCacheSpec):
    """MLA's latent + roped shared key: [1, block_size, kv_lora_rank + rope] per block."""
    head_size: int = 0

    @property
    def shape(self) -> tuple[int, ...]:
        return (1, self.block_size, self.head_size)


@dataclass(frozen=True)
class IndexerKeySpec(KVCacheSpec):
    """The lightning indexer's key per token (DSA, V3.2: [1, block_size, d]) or per
    compressed window (V4's CSA: [block_size / rate, d])."""
    head_size: int = 0
    compress_rate: int = 1

    @property
    def shape(self) -> tuple[int, ...]:
        if self.compress_rate == 1:
            return (1, self.block_size, self.head_size)
        return (self.block_size // self.compress_rate, self.head_size)


@dataclass(frozen=True)
class CompressedEntrySpec(KVCacheSpec):
    """DeepSeek V4's pooled entries, one per ``compress_rate`` tokens: [block_size / rate, d]."""
    head_size: int = 0
    compress_rate: int = 1

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.block_size // self.compress_rate, self.head_size)


@dataclass(frozen=True)
class BlockEdgeStateSpec(KVCacheSpec):
    """A running state's snapshot at each block's end ([3, d] online-softmax accumulators):
    what a prefix-cache hit resumes compression from. Only worth its bytes with prefix caching."""
    head_size: int = 0

    @property
    def shape(self) -> tuple[int, ...]:
        return (3, self.head_size)


@dataclass(frozen=True)
class SlidingWindowSpec(KVCacheSpec):
    """Raw per-token entries of which only the last ``sliding_window`` tokens are read:
    [block_size, head_size] per block."""
    head_size: int = 0
    sliding_window: int = 0
    kind: ClassVar[str] = SLIDING_WINDOW

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.block_size, self.head_size)

    @property
    def group_key(self) -> tuple:
        return (self.kind, self.block_size, self.sliding_window)


@dataclass(frozen=True)
class RunningStateSpec(KVCacheSpec):
    """Per-request running state (compressed attention's pending window, a linear-attention
    layer's recurrent and convolution state), one slot per running request. ``prefix_hits``:
    whether a prefix-cache hit can rebuild it (V4's from block-edge snapshots); a state that
    cannot (Kimi's delta rule) makes its model compute every prompt from its start."""
    state_shape: tuple[int, ...] = ()
    prefix_hits: bool = True
    kind: ClassVar[str] = STATE

    @property
    def shape(self) -> tuple[int, ...]:
        return self.state_shape


@dataclass
class KVCacheGroupSpec:
    """Cache tensors that share block tables: one pool, one manager kind."""
    kind: str
    block_size: int
    layer_names: list[str]  # "<module>.<tensor>", aligned with specs
    specs: list[KVCacheSpec]
    sliding_window: int = 0

    @property
    def page_size_bytes(self) -> int:
        """One block of every tensor of the group (for ``state``: one slot)."""
        return sum(s.page_size_bytes for s in self.specs)


@dataclass
class KVCacheConfig:
    groups: list[KVCacheGroupSpec]
    num_blocks: list[int]  # per group: its pool, the null block (or unused slot 0) included

    @property
    def block_size(self) -> int:
        return self.groups[0].block_size

    def group_bytes(self, i: int) -> int:
        return self.num_blocks[i] * self.groups[i].page_size_bytes

    @property
    def total_bytes(self) -> int:
        return sum(self.group_bytes(i) for i in range(len(self.groups)))

    def first_group(self, kind: str) -> int | None:
        return next((i for i, g in enumerate(self.groups) if g.kind == kind), None)


def group_kv_cache_specs(specs: dict[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
    """Tensors with the same group key share a group; full groups first, then sliding
    windows, then running state (so group 0 is the main pool)."""
    groups: dict[tuple, KVCacheGroupSpec] = {}
    for name, spec in specs.items():
        g = groups.get(spec.group_key)
        if g is None:
            g = groups[spec.group_key] = KVCacheGroupSpec(
                spec.kind, spec.block_size, [], [], getattr(spec, "sliding_window", 0))
        g.layer_names.append(name)
        g.specs.append(spec)
    return sorted(groups.values(), key=lambda g: (_KIND_ORDER.index(g.kind), g.sliding_window))
