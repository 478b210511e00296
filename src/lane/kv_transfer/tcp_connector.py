"""TcpConnector: NIXL's pull semantics over ZeroMQ (vLLM's NixlConnector shape, ours).

The prefill engine (kv_producer / kv_both) runs a request given ``kv_transfer_params:
{"do_remote_decode": true}``; when it finishes, its blocks stay held (delayed free) and the
response carries what the decode engine needs to pull them: ``remote_block_ids`` (one list per
KV cache group), ``remote_engine_id``, ``remote_request_id``, ``remote_host``, ``remote_port``,
``tp_size``, and ``do_remote_prefill: true``.

The decode engine (kv_consumer / kv_both) admits such a request with blocks for all its prompt
tokens but the last, and parks it (WAITING_FOR_REMOTE_KVS) while its workers pull them, layer by
layer, on the prefill engine's side channel; other requests run meanwhile. Once every rank has
its blocks the request computes one prompt token (the last, whose logits it needs) and decodes.
A worker that has pulled tells the prefill side, which frees the blocks; blocks nobody pulls are
freed after ``kv_connector_extra_config.abort_timeout_s`` (120). A pull that fails (the prefill
engine is gone, or does not know the request) is counted and the prompt recomputed here.

The side channel: each prefill rank binds a ZeroMQ ROUTER on ``kv_ip:kv_port + dp_rank * tp +
tp_rank`` (``kv_port + dp_rank`` at one rank, as vLLM). Every frame is signed with the
deployment's secret (``LANE_RPC_SECRET`` or ``--rpc-secret-file``, rpc_auth.py): a frame that
does not check is dropped, logged, and nothing of it is read; bodies are msgpack headers and raw
tensor bytes, never pickles. The decode side may run more tensor-parallel ranks than the prefill
side (a multiple of them): each decode rank pulls from the prefill rank holding its KV heads and
takes those heads (MLA latents and V3.2 / V4 caches are the same on every rank).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

import msgspec
import torch

from lane.kv_cache_interface import FullAttentionSpec
from lane.kv_transfer.base import KVConnectorBase, KVConnectorMetadata, KVConnectorRole
from lane.kv_transfer.blocks import block_plan
from lane.tracing import Step, tracer

logger = logging.getLogger(__name__)

DEFAULT_ABORT_TIMEOUT_S = 120.0
PULL_TIMEOUT_S = 30.0  # a pull that gets no answer this long fails (the prefill engine is gone)


# -- side-channel messages (msgpack) -----------------------------------------------------------
class PullLayer(msgspec.Struct, tag="pull"):
    request_id: str  # the prefill engine's
    layer: str  # cache layer (module) name
    positions: list[list[int]]  # per group: block positions in the prefill engine's table
    heads: tuple[int, int] | None = None  # KV heads [a, b) of full-attention tensors (global), None: all


class Done(msgspec.Struct, tag="done"):
    request_id: str
    pullers: int = 1  # decode ranks that pull from this prefill rank: the blocks go when all are done


class LayerData(msgspec.Struct):
    ok: bool
    error: str = ""
    names: list[str] = []
    dtypes: list[str] = []
    shapes: list[list[int]] = []


_REQ = msgspec.msgpack.Decoder(PullLayer | Done)
_REP = msgspec.msgpack.Decoder(LayerData)
_ENC = msgspec.msgpack.Encoder()


@dataclass
class PullSpec:
    """One request's pull, as the scheduler hands it to the workers."""
    req_id: str
    remote_request_id: str
    host: str
    port: int  # the prefill engine's base side-channel port (its rank 0)
    remote_tp: int
    plan: list[list[tuple[int, int]]]  # per group: (block position, local block id); positions are the same there

    @property
    def positions(self) -> list[list[int]]:
        return [[p for p, _ in g] for g in self.plan]


@dataclass
class Exposure:
    request_id: str
    block_ids: list[list[int]]  # per group, the request's whole tables here


@dataclass
class TcpConnectorMetadata(KVConnectorMetadata):
    pulls: list[PullSpec] = field(default_factory=list)
    expose: list[Exposure] = field(default_factory=list)
    unexpose: list[str] = field(default_factory=list)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


class TcpConnector(KVConnectorBase):
    # V4's running compression state moves too, as it was before the last prompt token (the prefill
    # side keeps that state for a request it hands over): the decode side goes on from it
    moves_running_state = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        cfg = self.config
        self.producer, self.consumer = cfg.is_kv_producer, cfg.is_kv_consumer
        self.abort_timeout_s = float(cfg.kv_connector_extra_config.get("abort_timeout_s", DEFAULT_ABORT_TIMEOUT_S))
        self.dp_rank = int(cfg.kv_connector_extra_config.get("dp_rank", 0))  # set by lane serve per replica
        # scheduler side
        self._pulls: list[PullSpec] = []
        self._expose: list[Exposure] = []
        self._unexpose: list[str] = []
        self._exposed: dict[str, float] = {}  # request id -> deadline (its blocks are held for a pull)
        # worker side
        self._served: dict[str, list[list[int]]] = {}
        self._lock = threading.Lock()
        self._done_sending: set[str] = set()
        self._done_counts: dict[str, int] = {}  # Done messages so far, per request (several decode ranks)
        self._serving: dict[str, list] = {}  # request id -> [first pull's time, bytes served] (traces)
        self._done_recving: set[str] = set()
        self._failed: dict[str, str] = {}
        self._closing = False
        if self.role is KVConnectorRole.WORKER:
            import queue

            from lane.distributed.rpc_auth import RpcAuth, resolve_rpc_secret

            secret = resolve_rpc_secret(cfg.kv_connector_extra_config.get("rpc_secret_file"), create=True)
            # one sender id per process, its counter rising over every frame it sends: pulls go one
            # at a time (a queue and one thread), so the prefill side sees them in order
            self._client_auth = RpcAuth(secret, int.from_bytes(os.urandom(4), "little") | 1)
            self._server_auth = RpcAuth(secret, 0)
            self._queue: queue.Queue = queue.Queue()
            threading.Thread(target=self._pull_loop, daemon=True, name="KVPull").start()
            if self.producer:
                self._start_server()

    # -- scheduler side ---------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if not (self.consumer and params and params.get("do_remote_prefill")) or request.num_output_tokens:
            return 0, False
        if params.get("_pulled"):  # pulled once already (a preempted request recomputes here)
            return 0, False
        missing = [k for k in ("remote_block_ids", "remote_host", "remote_port", "remote_request_id")
                   if k not in params]
        groups = len(self.kv_cache_config.groups)
        if missing or len(params.get("remote_block_ids", ())) != groups:
            logger.error("request %s: kv_transfer_params %s; its prompt is computed here",
                         request.request_id, f"lack {', '.join(missing)}" if missing else
                         f"name {len(params['remote_block_ids'])} KV cache groups, this engine has {groups} "
                         f"(the two engines serve different models)")
            params["_pulled"] = True
            return 0, False
        end = request.num_prompt_tokens - 1  # the last prompt token is computed here (its logits)
        return max(end - num_computed_tokens, 0), True

    def update_state_after_alloc(self, request, block_ids, num_external_tokens: int) -> None:
        if not num_external_tokens:
            return
        params = request.kv_transfer_params
        end = request.num_prompt_tokens - 1
        plan = block_plan(self.kv_cache_config, block_ids, end - num_external_tokens, end, with_state=True)
        self._pulls.append(PullSpec(request.request_id, params["remote_request_id"], params["remote_host"],
                                    int(params["remote_port"]), int(params.get("tp_size", 1)), plan))
        params["_pulled"] = True

    def build_connector_meta(self, scheduler_output) -> TcpConnectorMetadata:
        meta = TcpConnectorMetadata(self._pulls, self._expose, self._unexpose)
        self._pulls, self._expose, self._unexpose = [], [], []
        return meta

    def has_pending_meta(self) -> bool:
        return bool(self._pulls or self._expose or self._unexpose)

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        params = request.kv_transfer_params
        if not (self.producer and params and params.get("do_remote_decode")) or not request.status.finish_reason \
                or request.status.finish_reason == "abort":
            return False, None
        rid = request.request_id
        self._exposed[rid] = time.monotonic() + self.abort_timeout_s
        self._expose.append(Exposure(rid, [list(ids) for ids in block_ids]))
        return True, {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": block_ids,
                      "remote_engine_id": self.config.engine_id, "remote_request_id": rid,
                      "remote_host": self.config.kv_ip, "remote_port": self.config.kv_port + self.dp_rank * self.tp_size,
                      "tp_size": self.tp_size}

    def update_connector_output(self, output) -> None:
        for rid in output.finished_sending:
            if self._exposed.pop(rid, None) is not None:
                self._unexpose.append(rid)

    def take_expired(self) -> list[str]:
        """Requests whose blocks waited for a pull longer than abort_timeout_s: the scheduler frees them."""
        now = time.monotonic()
        gone = [rid for rid, deadline in self._exposed.items() if deadline < now]
        for rid in gone:
            del self._exposed[rid]
            self._unexpose.append(rid)
        return gone

    # -- worker side: the prefill engine's side channel --------------------------------------
    def _start_server(self) -> None:
        import zmq

        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        port = self.config.kv_port + self.dp_rank * self.tp_size + self.rank
        sock.bind(f"tcp://{self.config.kv_ip}:{port}")
        t = threading.Thread(target=self._serve, args=(sock,), daemon=True, name="KVSideChannel")
        t.start()
        logger.info("KV side channel (rank %d) on %s:%d", self.rank, self.config.kv_ip, port)

    def _serve(self, sock) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        waiting: list[tuple[bytes, PullLayer, float]] = []  # pulls that came before their request was exposed
        while not self._closing:
            if poller.poll(10):
                ident, frame = sock.recv_multipart()
                try:
                    _, body = self._server_auth.open(frame)
                except Exception as e:  # noqa: BLE001 - AuthError: nothing of it is read
                    self._server_auth.log_dropped("KV side channel", e)
                    logger.error("KV side channel: a pull signed with another secret than this engine's was "
                                 "refused (the decode engine needs the same LANE_RPC_SECRET / --rpc-secret-file)")
                    sock.send_multipart([ident, self._server_auth.seal(_ENC.encode(LayerData(
                        False, "refused: this prefill engine signs with another secret than yours "
                               "(LANE_RPC_SECRET / --rpc-secret-file)")))])
                    continue
                try:
                    msg = _REQ.decode(body)
                except msgspec.DecodeError as e:
                    sock.send_multipart([ident, self._server_auth.seal(_ENC.encode(LayerData(False, f"bad message: {e}")))])
                    continue
                if isinstance(msg, Done):
                    with self._lock:
                        n = self._done_counts.get(msg.request_id, 0) + 1
                        if n >= msg.pullers:
                            self._done_counts.pop(msg.request_id, None)
                            self._done_sending.add(msg.request_id)
                            self._served_span(msg.request_id)
                        else:
                            self._done_counts[msg.request_id] = n
                    sock.send_multipart([ident, self._server_auth.seal(_ENC.encode(LayerData(True)))])
                    continue
                waiting.append((ident, msg, time.monotonic() + 5.0))
            still = []
            for ident, msg, deadline in waiting:
                with self._lock:
                    tables = self._served.get(msg.request_id)
                if tables is None and time.monotonic() < deadline:
                    still.append((ident, msg, deadline))
                    continue
                try:
                    reply = self._layer_reply(msg, tables)
                except (IndexError, KeyError, RuntimeError) as e:  # positions this request does not have
                    reply = [self._server_auth.seal(_ENC.encode(LayerData(False, f"{type(e).__name__}: {e}")))]
                sock.send_multipart([ident, *reply])
            waiting = still
        sock.close(0)

    def _served_span(self, request_id: str) -> None:
        """Step 55 on the prefill side: from the first pull of a request's blocks to its last Done."""
        first, nbytes = self._serving.pop(request_id, (None, 0))
        if tracer.enabled and first is not None:
            tracer.record(Step.KV_TRANSFER, first, time.monotonic(), [request_id], connector="TcpConnector",
                          direction="serve", bytes=nbytes, ms=round((time.monotonic() - first) * 1e3, 3))

    def _layer_reply(self, msg: PullLayer, tables) -> list[bytes]:
        if tables is None:
            return [self._server_auth.seal(_ENC.encode(LayerData(
                False, f"request {msg.request_id} is not held here (never prefilled, pulled already or expired)")))]
        names, dtypes, shapes, parts = [], [], [], []
        for name in self.layers[msg.layer]:
            t, g = self.kv_caches[name], self.group_of[name]
            ids = [tables[g][p] for p in msg.positions[g]]
            if not ids:
                continue
            data = t[torch.tensor(ids)]
            if msg.heads is not None and name in self._head_split:
                first = self._first_head()
                data = data[:, msg.heads[0] - first:msg.heads[1] - first]
            data = data.contiguous()
            names.append(name)
            dtypes.append(str(data.dtype))
            shapes.append(list(data.shape))
            parts.append(data.view(torch.uint8).numpy().tobytes())
            nbytes = data.numel() * data.element_size()
            self.stats.bytes_sent += nbytes
            entry = self._serving.setdefault(msg.request_id, [time.monotonic(), 0])
            entry[1] += nbytes
        head = self._server_auth.seal(_ENC.encode(LayerData(True, "", names, dtypes, shapes)))
        return [head, self._server_auth.seal(b"".join(parts))]

    def _first_head(self) -> int:
        """The first of the model's KV heads this rank's paged K/V holds."""
        total = self.layout.kv_heads
        if total >= self.tp_size:  # heads split evenly
            return self.rank * self._kv_heads_per_rank
        return self.rank // (self.tp_size // total)  # fewer heads than ranks: each on tp / total ranks

    def register_kv_caches(self, kv_caches) -> None:
        super().register_kv_caches(kv_caches)
        # paged K/V holds a slice of the KV heads on each rank; MLA latents, indexer keys and V4's
        # caches are the same on every rank
        specs = {n: s for g in self.kv_cache_config.groups for n, s in zip(g.layer_names, g.specs)}
        self._head_split = {n for n, s in specs.items() if isinstance(s, FullAttentionSpec)}
        self._kv_heads_per_rank = next((specs[n].num_kv_heads for n in self._head_split), 1)

    # -- worker side: every step -------------------------------------------------------------
    def start_load_kv(self) -> None:
        meta = self._meta
        if not isinstance(meta, TcpConnectorMetadata):
            return
        with self._lock:
            for e in meta.expose:
                self._served[e.request_id] = e.block_ids
            for rid in meta.unexpose:
                self._served.pop(rid, None)
        for spec in meta.pulls:
            self._queue.put(spec)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        with self._lock:
            sending, self._done_sending = self._done_sending, set()
            recving, self._done_recving = self._done_recving, set()
            failed, self._failed = self._failed, {}
        self.stats.failed.update(failed)
        return sending, recving

    def _heads_wanted(self, spec: PullSpec) -> tuple[int, int] | None:
        """This rank's global KV heads, when the prefill side splits heads over fewer ranks."""
        if spec.remote_tp == self.tp_size:
            return None
        first = self._first_head()
        return first, first + self._kv_heads_per_rank

    def _remote_rank(self, spec: PullSpec) -> int:
        if self.tp_size % spec.remote_tp:
            raise ValueError(f"the prefill engine runs {spec.remote_tp} tensor-parallel ranks, this one {self.tp_size}: "
                             f"the decode side's ranks must be a multiple of the prefill side's")
        return self.rank // (self.tp_size // spec.remote_tp)

    def _pull_loop(self) -> None:
        while not self._closing:
            self._pull(self._queue.get())

    def _pull(self, spec: PullSpec) -> None:
        """One request's blocks from its prefill rank, layer by layer, then Done."""
        import zmq

        t0, nbytes = time.monotonic(), 0
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        auth = self._client_auth
        try:
            remote_rank = self._remote_rank(spec)
            sock.connect(f"tcp://{spec.host}:{spec.port + remote_rank}")
            heads = self._heads_wanted(spec)
            positions = spec.positions
            for layer in self.layers:
                sock.send(auth.seal(_ENC.encode(PullLayer(spec.remote_request_id, layer, positions, heads))))
                frames = self._recv(sock, auth, 2)
                head = _REP.decode(frames[0])
                if not head.ok:
                    raise RuntimeError(head.error)
                blob, offset = frames[1], 0
                for name, dt, shape in zip(head.names, head.dtypes, head.shapes):
                    n = int(torch.Size(shape).numel()) * _dtype(dt).itemsize
                    data = torch.frombuffer(bytearray(blob[offset:offset + n]), dtype=torch.uint8).view(
                        _dtype(dt)).view(shape)
                    offset += n
                    t = self.kv_caches[name]
                    local = [b for _, b in spec.plan[self.group_of[name]]]
                    t[torch.tensor(local)] = data.to(t.dtype)
                    nbytes += n
            sock.send(auth.seal(_ENC.encode(Done(spec.remote_request_id, self.tp_size // spec.remote_tp))))
            self._recv(sock, auth, 1)
            with self._lock:
                self._done_recving.add(spec.req_id)
                self.stats.bytes_received += nbytes
                self.stats.seconds += time.monotonic() - t0
            if tracer.enabled:
                tracer.record(Step.KV_TRANSFER, t0, time.monotonic(), [spec.req_id], connector="TcpConnector",
                              direction="pull", bytes=nbytes, blocks=sum(len(g) for g in spec.plan),
                              ms=round((time.monotonic() - t0) * 1e3, 3), remote=f"{spec.host}:{spec.port}")
        except Exception as e:  # noqa: BLE001 - the request recomputes its prompt; said in the log
            logger.warning("KV pull of request %s from %s:%d failed: %s; its prompt is recomputed here",
                           spec.req_id, spec.host, spec.port, e)
            with self._lock:
                self._failed[spec.req_id] = str(e)
                self._done_recving.add(spec.req_id)
        finally:
            sock.close(0)

    def _recv(self, sock, auth, n: int) -> list[memoryview]:
        import zmq

        if not sock.poll(int(PULL_TIMEOUT_S * 1000), zmq.POLLIN):
            raise TimeoutError(f"no answer from the prefill engine within {PULL_TIMEOUT_S:.0f} s")
        out = []
        for f in sock.recv_multipart()[:n]:  # an error answer is one frame
            try:
                out.append(auth.open(f)[1])
            except Exception as e:  # noqa: BLE001
                raise RuntimeError(f"the prefill engine's answer does not check ({e}): it signs with another "
                                   f"secret than this engine (LANE_RPC_SECRET / --rpc-secret-file)") from None
        return out

    def shutdown(self) -> None:
        self._closing = True
