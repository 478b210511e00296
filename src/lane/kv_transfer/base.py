"""The KV connector API, as vLLM v1 names it (``kv_connector/v1/base.py``), ours.

A connector has two halves that never share memory: the scheduler's (in the engine core) decides
which requests load or save KV and puts that in the ``SchedulerOutput`` as data
(``KVConnectorMetadata``); the worker's (in every rank) does the loading and saving on its own
cache tensors, and reports requests whose transfers finished in the ``ModelRunnerOutput``.

Scheduler side:
- ``get_num_new_matched_tokens(request, num_computed_tokens) -> (int | None, load_async)``: prompt
  tokens past the local prefix hit whose KV the connector can supply (None: ask again later);
  ``load_async``: they arrive over the next steps (the request waits in WAITING_FOR_REMOTE_KVS).
- ``update_state_after_alloc(request, block_ids, num_external_tokens)``: the blocks they go into.
- ``build_connector_meta(scheduler_output) -> KVConnectorMetadata``: this step's work.
- ``update_connector_output(kv_connector_output)``: what the workers finished.
- ``request_finished(request, block_ids) -> (delay_free, kv_transfer_params)``: keep the blocks
  (another engine still pulls them) and what the next engine needs to find them.

Worker side: ``register_kv_caches``, ``start_load_kv``, ``wait_for_layer_load``,
``save_kv_layer``, ``wait_for_save``, ``get_finished(finished_req_ids) -> (done_sending,
done_recving)``.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from lane.config import KVTransferConfig
    from lane.core.request import Request
    from lane.core.scheduler_output import SchedulerOutput
    from lane.kv_cache_interface import KVCacheConfig


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


@dataclass
class KVConnectorMetadata:
    """What the scheduler half tells the worker half for one step (plain data)."""


@dataclass
class KVConnectorOutput:
    """What the workers report back (rank 0's, every rank does the same work)."""
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0  # transfer time this step
    failed: dict[str, str] = field(default_factory=dict)  # req id -> why its KV could not arrive


class KVOutputAggregator:
    """The ranks' KVConnectorOutputs as one: a request's sends or receives are finished once
    every rank has reported them (in this step or earlier ones); bytes add up; failures join."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._sending: dict[str, int] = {}
        self._recving: dict[str, int] = {}
        self._failed: dict[str, str] = {}  # a rank's failed receive, until every rank is done

    def merge(self, outs: list["KVConnectorOutput | None"]) -> "KVConnectorOutput | None":
        merged = KVConnectorOutput()
        seen = False
        for out in outs:
            if out is None:
                continue
            seen = True
            merged.bytes_sent += out.bytes_sent
            merged.bytes_received += out.bytes_received
            merged.seconds = max(merged.seconds, out.seconds)
            self._failed.update(out.failed)
            for ids, counts, done in ((out.finished_sending, self._sending, merged.finished_sending),
                                      (out.finished_recving, self._recving, merged.finished_recving)):
                for rid in ids:
                    counts[rid] = counts.get(rid, 0) + 1
                    if counts[rid] == self.world_size:
                        del counts[rid]
                        done.add(rid)
        for rid in merged.finished_recving & self._failed.keys():
            merged.failed[rid] = self._failed.pop(rid)
        return merged if seen else None


@dataclass
class LayoutInfo:
    """What must match between two engines for KV blocks to move between them as they are."""
    architecture: str
    block_size: int
    dtype: str
    tensors: dict[str, tuple]  # cache tensor name -> one block's shape
    kv_heads: int = 1  # the model's KV heads, all ranks together (paged K/V splits them over ranks)


class KVConnectorBase:
    def __init__(self, config: "KVTransferConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig",
                 layout: LayoutInfo, rank: int = 0, tp_size: int = 1) -> None:
        self.config, self.role = config, role
        self.kv_cache_config = kv_cache_config
        self.block_size = kv_cache_config.block_size
        self.layout = layout
        self.rank, self.tp_size = rank, tp_size
        self._meta: KVConnectorMetadata | None = None
        self.kv_caches: dict[str, "torch.Tensor"] = {}
        self.group_of: dict[str, int] = {}  # cache tensor name -> its KV cache group
        self.layers: dict[str, list[str]] = {}  # cache layer (module) -> its tensor names: what moves as one
        self.stats = KVConnectorOutput()  # this step's transfers (worker side)

    # -- scheduler side --------------------------------------------------------------
    get_block_ids = None  # the scheduler's KVCacheManager.get_block_ids (bind_block_ids)

    def bind_block_ids(self, get_block_ids) -> None:
        """The scheduler's lookup of a request's block ids, per group."""
        self.get_block_ids = get_block_ids

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: "Request", block_ids: tuple[list[int], ...],
                                 num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        pass

    def request_finished(self, request: "Request", block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        return False, None

    # whether a transfer carries running state (a request goes on from it, not from a block edge)
    moves_running_state: bool = False

    def has_pending_meta(self) -> bool:
        """Work for the workers that must reach them even when no request computes."""
        return False

    def take_expired(self) -> list[str]:
        """Requests whose blocks were kept for another engine too long (the scheduler frees them)."""
        return []

    # -- worker side -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        self.kv_caches = kv_caches
        for g, group in enumerate(self.kv_cache_config.groups):
            for name in group.layer_names:
                self.group_of[name] = g
        for name in kv_caches:
            self.layers.setdefault(name.rpartition(".")[0], []).append(name)

    def bind_connector_metadata(self, meta: KVConnectorMetadata | None) -> None:
        self._meta = meta

    def start_load_kv(self) -> None:
        """Before the forward: start (here: do) every load this step's metadata asks for."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before a layer reads its cache (loads are whole before the forward here: nothing)."""

    def save_kv_layer(self, layer_name: str) -> None:
        """After a layer wrote its cache (saves happen whole after the forward here: nothing)."""

    def wait_for_save(self) -> KVConnectorOutput:
        """After the forward: every save this step's metadata asks for, done."""
        return KVConnectorOutput()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        return set(), set()

    def take_output(self, finished_req_ids: set[str]) -> KVConnectorOutput | None:
        """After a step: what finished and what moved since the last call (None: nothing)."""
        sending, recving = self.get_finished(finished_req_ids)
        out, self.stats = self.stats, KVConnectorOutput()
        out.finished_sending |= sending
        out.finished_recving |= recving
        busy = out.finished_sending or out.finished_recving or out.bytes_sent or out.bytes_received or out.failed
        return out if busy else None

    def shutdown(self) -> None:
        pass


def layout_of(model_config, kv_cache_config: "KVCacheConfig") -> LayoutInfo:
    cfg = model_config.hf_config
    heads = getattr(cfg, "num_key_value_heads", None) or getattr(cfg, "num_attention_heads", 1)
    # the stored dtypes too: an int8 and an fp8 (C8) cache have the same shapes
    stored = sorted({str(spec.dtype).removeprefix("torch.") for g in kv_cache_config.groups for spec in g.specs})
    return LayoutInfo((model_config.architectures or ["?"])[0], kv_cache_config.block_size,
                      "/".join([str(model_config.dtype).removeprefix("torch."), *stored]),
                      {name: tuple(spec.shape) for g in kv_cache_config.groups
                       for name, spec in zip(g.layer_names, g.specs)}, int(heads))
