"""MultiConnector: several connectors as one (vLLM's), e.g. a TCP pull for requests that come
with ``kv_transfer_params`` and shared storage for the rest.

``kv_connector_extra_config.connectors`` lists their configs (each a ``--kv-transfer-config``
object; role and ports default to this one's). A request's KV is loaded by the first connector
that has any of it; every connector saves (each to its own store); a request's blocks stay held
while any connector keeps them, and the first connector's ``kv_transfer_params`` go out.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from lane.kv_transfer.base import KVConnectorBase, KVConnectorMetadata, KVConnectorOutput


@dataclass
class MultiConnectorMetadata(KVConnectorMetadata):
    parts: list[KVConnectorMetadata] = field(default_factory=list)


class MultiConnector(KVConnectorBase):
    def __init__(self, config, role, kv_cache_config, layout, rank: int = 0, tp_size: int = 1) -> None:
        from lane.config import KVTransferConfig
        from lane.kv_transfer.factory import create_connector

        super().__init__(config, role, kv_cache_config, layout, rank, tp_size)
        subs = config.kv_connector_extra_config.get("connectors")
        if not subs or not isinstance(subs, list):
            raise ValueError('--kv-transfer-config: MultiConnector needs kv_connector_extra_config {"connectors": '
                             '[{"kv_connector": ...}, ...]}')
        shared = {k: getattr(config, k) for k in ("kv_role", "kv_ip", "kv_port", "engine_id")}
        dp = config.kv_connector_extra_config.get("dp_rank")
        self.connectors = []
        for sub in subs:
            if sub.get("kv_connector") == "MultiConnector":
                raise ValueError("--kv-transfer-config: a MultiConnector inside a MultiConnector")
            sub = {**shared, **sub}
            if dp is not None:
                sub["kv_connector_extra_config"] = {**sub.get("kv_connector_extra_config", {}), "dp_rank": dp}
            self.connectors.append(create_connector(KVTransferConfig.parse(sub), role, kv_cache_config, layout,
                                                    rank, tp_size))
        self.moves_running_state = any(c.moves_running_state for c in self.connectors)
        self._loader: dict[str, KVConnectorBase] = {}  # request id -> the connector loading its KV

    def bind_block_ids(self, get_block_ids) -> None:
        for c in self.connectors:
            c.bind_block_ids(get_block_ids)

    # -- scheduler side ----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        for c in self.connectors:
            n, load_async = c.get_num_new_matched_tokens(request, num_computed_tokens)
            if n:
                self._loader[request.request_id] = c
                return n, load_async
        return 0, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens: int) -> None:
        c = self._loader.pop(request.request_id, None)
        if c is not None:
            c.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> MultiConnectorMetadata:
        return MultiConnectorMetadata([c.build_connector_meta(scheduler_output) for c in self.connectors])

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for c in self.connectors:
            c.update_connector_output(output)

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        delay, params = False, None
        for c in self.connectors:
            d, p = c.request_finished(request, block_ids)
            delay |= d
            params = params or p
        return delay, params

    def has_pending_meta(self) -> bool:
        return any(c.has_pending_meta() for c in self.connectors)

    def take_expired(self) -> list[str]:
        return [rid for c in self.connectors for rid in c.take_expired()]

    # -- worker side ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches) -> None:
        super().register_kv_caches(kv_caches)
        for c in self.connectors:
            c.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, meta) -> None:
        parts = meta.parts if isinstance(meta, MultiConnectorMetadata) else [None] * len(self.connectors)
        for c, part in zip(self.connectors, parts):
            c.bind_connector_metadata(part)

    def start_load_kv(self) -> None:
        for c in self.connectors:
            c.start_load_kv()

    def wait_for_save(self) -> None:
        for c in self.connectors:
            c.wait_for_save()

    def take_output(self, finished_req_ids: set[str]) -> KVConnectorOutput | None:
        outs = [o for c in self.connectors if (o := c.take_output(finished_req_ids)) is not None]
        if not outs:
            return None
        merged = KVConnectorOutput()
        for o in outs:
            merged.finished_sending |= o.finished_sending
            merged.finished_recving |= o.finished_recving
            merged.bytes_sent += o.bytes_sent
            merged.bytes_received += o.bytes_received
            merged.seconds += o.seconds
            merged.failed.update(o.failed)
        return merged

    def shutdown(self) -> None:
        for c in self.connectors:
            c.shutdown()
