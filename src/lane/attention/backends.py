"""Attention backends (seed step 3's second layer): which layer class a model's attention
uses, and how each KV cache group's metadata is built for it. ``platform`` picks one per
model from its config's fields; a platform plugin may pick its own."""
from __future__ import annotations

import importlib
from typing import ClassVar

from lane.attention.metadata import (CommonAttentionMetadata, build_paged_metadata,
                                     build_running_state_metadata)
from lane.kv_cache_interface import STATE, KVCacheGroupSpec


class AttentionBackend:
    name: ClassVar[str]
    impl: ClassVar[str]  # "module:Class" of the cache layer

    @classmethod
    def get_impl_cls(cls) -> type:
        module, _, qualname = cls.impl.partition(":")
        return getattr(importlib.import_module(module), qualname)

    @classmethod
    def build_metadata(cls, group: KVCacheGroupSpec, common: CommonAttentionMetadata,
                       block_ids: list[list[int]]):
        """One group's metadata for this step, from each request's block ids in that group."""
        if group.kind == STATE:
            return build_running_state_metadata(common, block_ids)
        return build_paged_metadata(common, block_ids, group.block_size)


class PagedSDPABackend(AttentionBackend):
    """Dense multi-head attention: K/V per head in paged blocks; SDPA for prefill chunks,
    the paged decode kernel for decodes."""
    name = "paged_sdpa"
    impl = "lane.model_executor.layers.attention:Attention"


class MLABackend(AttentionBackend):
    """Multi-head latent attention on a latent paged cache (absorbed decode)."""
    name = "mla"
    impl = "lane.model_executor.layers.mla:MLAAttention"


class SparseMLABackend(MLABackend):
    """MLA over the lightning indexer's top-k tokens (DSA, DeepSeek V3.2)."""
    name = "sparse_mla"


class CompressedAttentionBackend(AttentionBackend):
    """DeepSeek V4: a sliding window of raw K=V plus compressed entries (CSA / HCA), over
    three groups (window, main, running state)."""
    name = "compressed"
    impl = "lane.model_executor.layers.compressed_attention:V4AttentionCache"
