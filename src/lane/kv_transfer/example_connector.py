"""ExampleConnector: KV through shared storage (vLLM's reference connector, ours).

A producer (``kv_role`` kv_producer or kv_both) writes, for every prompt, the KV of its
block-aligned prefix: one safetensors file per cache layer and rank under
``kv_connector_extra_config.shared_storage_path``, in a directory named by the hash of those
prompt tokens. A consumer (kv_consumer or kv_both) that gets the same prompt finds the directory
and loads those blocks instead of computing them: it computes only the tokens after the prefix
(1 to block_size of them; at least the last prompt token, whose logits it needs).

The prefix is the prompt's whole blocks before its last token, ``(n - 1) // block_size`` blocks.
It is saved in the step whose forward computes its last token (a sliding window's blocks are all
still held then), after that forward. Both engines must lay their caches out alike (model,
block size, dtype, tensor parallel size): the first engine writes ``layout.json``, later ones
are refused at start-up if theirs differs.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field

import torch
from safetensors.torch import load_file, save_file

from lane.kv_transfer.base import KVConnectorBase, KVConnectorMetadata, KVConnectorRole
from lane.kv_transfer.blocks import block_plan, gather, scatter
from lane.tracing import Step, tracer

logger = logging.getLogger(__name__)


@dataclass
class TransferSpec:
    req_id: str
    key: str
    plan: list[list[tuple[int, int]]]  # per group: (block position, block id)


@dataclass
class ExampleConnectorMetadata(KVConnectorMetadata):
    loads: list[TransferSpec] = field(default_factory=list)
    saves: list[TransferSpec] = field(default_factory=list)


class ExampleConnector(KVConnectorBase):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        extra = self.config.kv_connector_extra_config
        if "shared_storage_path" not in extra:
            raise ValueError('--kv-transfer-config: ExampleConnector needs kv_connector_extra_config '
                             '{"shared_storage_path": DIR}')
        self.root = os.path.abspath(extra["shared_storage_path"])
        os.makedirs(self.root, exist_ok=True)
        self.producer, self.consumer = self.config.is_kv_producer, self.config.is_kv_consumer
        # scheduler side
        self._prompts: dict[str, list[int]] = {}  # requests seen, until finished
        self._saved: set[str] = set()
        self._loads: list[TransferSpec] = []
        if self.role is KVConnectorRole.WORKER:
            self._check_layout()

    # -- keys ---------------------------------------------------------------------------
    def _prefix_tokens(self, num_prompt_tokens: int) -> int:
        return (num_prompt_tokens - 1) // self.block_size * self.block_size

    def _key(self, token_ids: list[int]) -> str:
        h = hashlib.sha256(f"{self.layout.architecture}|{self.block_size}|".encode())
        h.update(torch.tensor(token_ids, dtype=torch.int64).numpy().tobytes())
        return h.hexdigest()[:32]

    def _complete(self, key: str) -> bool:
        d = os.path.join(self.root, key)
        return all(os.path.exists(os.path.join(d, f"done.r{r}.json")) for r in range(self.tp_size))

    def _check_layout(self) -> None:
        path = os.path.join(self.root, f"layout.tp{self.tp_size}.r{self.rank}.json")
        mine = {"architecture": self.layout.architecture, "block_size": self.layout.block_size,
                "dtype": self.layout.dtype, "tensors": {k: list(v) for k, v in self.layout.tensors.items()}}
        if os.path.exists(path):
            with open(path) as f:
                theirs = json.load(f)
            if theirs != mine:
                diff = [k for k in mine if mine[k] != theirs.get(k)]
                raise ValueError(f"--kv-transfer-config: the KV under {self.root} was written by an engine whose "
                                 f"cache differs from this one's in {', '.join(diff)} (theirs: "
                                 f"{ {k: theirs.get(k) for k in diff if k != 'tensors'} }); use another "
                                 f"shared_storage_path or the same model, block size, dtype and -tp")
        else:
            tmp = f"{path}.{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(mine, f)
            os.replace(tmp, path)

    # -- scheduler side ----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.consumer or request.num_output_tokens:
            return 0, False
        end = self._prefix_tokens(request.num_prompt_tokens)
        if end <= num_computed_tokens or not self._complete(self._key(request.prompt_token_ids[:end])):
            return 0, False
        return end - num_computed_tokens, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens: int) -> None:
        if not num_external_tokens:
            return
        end = self._prefix_tokens(request.num_prompt_tokens)
        start = end - num_external_tokens
        self._loads.append(TransferSpec(request.request_id, self._key(request.prompt_token_ids[:end]),
                                        block_plan(self.kv_cache_config, block_ids, start, end)))

    def build_connector_meta(self, scheduler_output) -> ExampleConnectorMetadata:
        meta = ExampleConnectorMetadata(loads=self._loads)
        self._loads = []
        for new in scheduler_output.scheduled_new_reqs:
            self._prompts.setdefault(new.req_id, list(new.prompt_token_ids))
        if not self.producer:
            return meta
        computed = {n.req_id: n.num_computed_tokens for n in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            prompt = self._prompts.get(rid)
            if prompt is None or rid in self._saved:
                continue
            end = self._prefix_tokens(len(prompt))
            if end and computed[rid] + n >= end:  # this forward computes the prefix's last token
                self._saved.add(rid)
                key = self._key(prompt[:end])
                if not self._complete(key):
                    meta.saves.append(TransferSpec(rid, key, block_plan(self.kv_cache_config,
                                                                        self.get_block_ids(rid), 0, end)))
        return meta

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        self._prompts.pop(request.request_id, None)
        self._saved.discard(request.request_id)
        return False, None

    # -- worker side: one file per cache layer and rank ------------------------------------------
    def start_load_kv(self) -> None:
        meta = self._meta
        if isinstance(meta, ExampleConnectorMetadata) and meta.loads:
            self._transfer(meta.loads, "load", self._load)

    def wait_for_save(self) -> None:
        meta = self._meta
        if isinstance(meta, ExampleConnectorMetadata) and meta.saves:
            self._transfer(meta.saves, "save", self._save)

    def _transfer(self, specs: list[TransferSpec], direction: str, move) -> None:
        """Each request's blocks moved by ``move(spec, its directory) -> bytes``, timed into the
        stats and step 55."""
        t0 = time.perf_counter()
        for spec in specs:
            t1 = time.monotonic()
            self._span(spec, direction, t1, move(spec, os.path.join(self.root, spec.key)))
        self.stats.seconds += time.perf_counter() - t0

    def _load(self, spec: TransferSpec, d: str) -> int:
        nbytes = 0
        with open(os.path.join(d, f"done.r{self.rank}.json")) as f:
            positions = json.load(f)["positions"]
        for module, names in self.layers.items():
            data = load_file(os.path.join(d, f"{module}.r{self.rank}.safetensors"))
            nbytes += scatter({n: self.kv_caches[n] for n in names}, self.group_of, spec.plan, data, positions)
        self.stats.bytes_received += nbytes
        return nbytes

    def _save(self, spec: TransferSpec, d: str) -> int:
        nbytes = 0
        os.makedirs(d, exist_ok=True)
        for module, names in self.layers.items():
            data = gather({n: self.kv_caches[n] for n in names}, self.group_of, spec.plan)
            tmp = os.path.join(d, f".{module}.r{self.rank}.{os.getpid()}.tmp")
            save_file(data, tmp)
            os.replace(tmp, os.path.join(d, f"{module}.r{self.rank}.safetensors"))
            nbytes += sum(t.numel() * t.element_size() for t in data.values())
        self.stats.bytes_sent += nbytes
        done = os.path.join(d, f"done.r{self.rank}.json")  # last: the scheduler's sign it is whole
        with open(done + ".tmp", "w") as f:
            json.dump({"positions": [[p for p, _ in g] for g in spec.plan]}, f)
        os.replace(done + ".tmp", done)
        return nbytes

    def _span(self, spec: TransferSpec, direction: str, t0: float, nbytes: int) -> None:
        """Step 55 for one request's blocks."""
        if tracer.enabled:
            tracer.record(Step.KV_TRANSFER, t0, time.monotonic(), [spec.req_id], connector="ExampleConnector",
                          direction=direction, bytes=nbytes, blocks=sum(len(g) for g in spec.plan),
                          ms=round((time.monotonic() - t0) * 1e3, 3))
