"""Tensor, expert and data parallelism on torch.distributed (gloo): real worker processes,
real collectives, float32 greedy output token-identical with one rank."""
import os
import re
import signal
import subprocess
import sys
import time

import httpx2 as httpx
import openai
import pytest
import torch

from lane import LLM, SamplingParams
from lane.entrypoints.tiny_model import write_tiny_model
from lane.model_executor.loader import resident_weight_bytes
from lane.tracing import Step, tracer
from utils import RemoteServer, free_port

FP32 = dict(dtype="float32", show_progress=False)
# a long prompt (chunked at 16 tokens a step), two sharing 24 tokens (prefix hits), and enough
# output that a small pool preempts
PROMPTS = [list(range(100, 148)), list(range(200, 224)) + [5, 6, 7], list(range(200, 224)) + [9, 8]]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _tokens(llm: LLM) -> list[list[int]]:
    """The first two prompts together, then the third (its first block is then a cache hit)."""
    return [o.outputs[0].token_ids for batch in (PROMPTS[:2], PROMPTS[2:])
            for o in llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-parallel")
    return {arch: write_tiny_model(arch, str(root / arch)) for arch in
            ("llama", "qwen3", "qwen3_moe", "kimi_linear", "deepseek_v3", "deepseek_v32", "glm_moe_dsa",
             "deepseek_v4")}


def _engine_kw(arch: str) -> dict:
    # small pools: the runs preempt (checked below), and chunked prefill at 16 tokens a step
    return dict(FP32, max_num_batched_tokens=16, max_model_len=64,
                kv_cache_memory_bytes={"llama": 48 << 10, "qwen3": 48 << 10}.get(arch, 4 << 20))


@pytest.mark.parametrize("arch,ep,sp,cp", [("llama", False, False, False), ("llama", False, True, False),
                                           ("qwen3", False, False, False), ("qwen3", False, True, False),
                                           ("qwen3_moe", True, True, False), ("kimi_linear", True, True, False),
                                           ("deepseek_v3", False, False, False), ("deepseek_v3", True, True, False),
                                           ("deepseek_v32", False, True, True), ("glm_moe_dsa", True, True, True),
                                           ("deepseek_v4", False, False, False),
                                           ("deepseek_v4", True, True, True)])
def test_two_ranks_equal_one(tiny, arch, ep, sp, cp):
    """TP=2 (or EP=2: whole experts per rank; or SP: each rank holds only its rows between
    attention and the FFN, a decode of one row leaving a rank none; or DSA-CP: each rank runs
    the indexer and sparse attention for its share of a prefill step's rows, every head) gives TP=1's greedy tokens, with chunked
    prefill, prefix-cache hits and (Llama, Qwen3) preemption; each rank holds at most 0.6x the
    weights."""
    kw = _engine_kw(arch)
    ref = LLM(tiny[arch], **kw)
    want = _tokens(ref)
    ref_bytes = resident_weight_bytes(ref.engine.worker.model)
    ref_preempted = ref.engine.scheduler.num_preemptions
    moe = arch.startswith(("deepseek", "glm", "kimi")) or arch.endswith("_moe")
    ref_heat = ref.engine.executor.expert_counts() if moe else None
    ref.shutdown()
    if cp:  # the trace shows step 26: each rank's rows, its stages
        tracer.enable()
        tracer.drain()
    try:
        llm = LLM(tiny[arch], tensor_parallel_size=2, enable_expert_parallel=ep, enable_sequence_parallel=sp,
                  enable_dsa_cp=cp, **kw)
        got = _tokens(llm)
        spans = tracer.drain()
    finally:
        tracer.enabled = False
        tracer.drain()
    try:
        assert got == want
        if cp:
            gathers = [s for s in spans if s.step == Step.COMM_CP_GATHER]
            assert {s.attrs["rank"] for s in gathers} == {0, 1}
            # the three stages: q heads -> rows (all-to-all), each rank's context, outputs rows -> heads
            assert all(s.attrs.get("alltoall_bytes", 0) > 0 and "cp_rows_per_rank" in s.attrs
                       and s.attrs["stage"].count(",") == 2 for s in gathers)
        sched = llm.engine.scheduler
        # the shared prefix was found in the cache (Kimi's delta-rule state allows no hit)
        assert sched.kv.stats.hits > 0 if arch != "kimi_linear" else sched.kv.stats.hits == 0
        if arch in ("llama", "qwen3"):
            assert ref_preempted > 0 and sched.num_preemptions > 0
        per_rank = llm.engine.executor.weight_bytes()
        assert len(per_rank) == 2 and max(per_rank) <= 0.6 * ref_bytes, (per_rank, ref_bytes)
        if moe:  # heat: each EP rank counts its own experts, summed over ranks
            heat = llm.engine.executor.expert_counts()
            assert heat == ref_heat
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch,spec,sp", [("deepseek_v4", {"method": "mtp", "num_speculative_tokens": 2}, True),
                                          ("llama", {"method": "ngram", "num_speculative_tokens": 3,
                                                     "prompt_lookup_min": 1, "prompt_lookup_max": 2}, False)])
def test_speculation_over_two_ranks_equals_one_rank_without(tiny, arch, spec, sp):
    """Drafts at TP=2 (every rank drafts and verifies alike, from the same gathered logits; V4's
    MTP block with sequence parallelism, its embedding scattered and its streams gathered):
    TP=1's tokens without speculation, prefill chunks and prefix hits included."""
    kw = _engine_kw(arch)
    ref = LLM(tiny[arch], **kw)
    want = _tokens(ref)
    ref.shutdown()
    llm = LLM(tiny[arch], tensor_parallel_size=2, speculative_config=spec, enable_sequence_parallel=sp, **kw)
    try:
        assert _tokens(llm) == want
        s = llm.engine.scheduler.make_stats().spec_decoding
        assert s.num_drafts > 0 and s.num_accepted_tokens <= s.num_draft_tokens
    finally:
        llm.shutdown()


def test_smollm_gguf_tp3_equals_tp1_and_records_collectives(smollm_gguf):
    """SmolLM2 (9 heads, 3 KV heads) over three ranks from the GGUF, dequantized to float32:
    the same tokens; the trace has every rank's spans, the groups' set-up (steps 2, 5) and
    the all-reduce bytes after attention (28) and the FFN (31), the logits gather (33)."""
    prompts = ["Once upon a time", "The capital of France is"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = LLM(smollm_gguf, quantization="none", **FP32)
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    ref_bytes = resident_weight_bytes(ref.engine.worker.model)
    ref.shutdown()
    tracer.enable()
    tracer.drain()
    try:
        llm = LLM(smollm_gguf, quantization="none", tensor_parallel_size=3, **FP32)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
        spans = tracer.drain()
    finally:
        tracer.enabled = False
        tracer.drain()
    try:
        assert max(llm.engine.executor.weight_bytes()) <= 0.6 * ref_bytes
        ranks = {s.attrs.get("rank") for s in spans}
        assert {0, 1, 2} <= ranks
        for step in (Step.DIST_INIT, Step.DIST_BIND_GROUPS):
            assert {s.attrs["rank"] for s in spans if s.step == step} == {0, 1, 2}
        for step, key in ((Step.COMM_ATTN_REDUCE, "allreduce_bytes"), (Step.COMM_FFN_REDUCE, "allreduce_bytes"),
                          (Step.COMM_LOGITS_GATHER, "allgather_bytes")):
            moved = [s.attrs.get(key, 0) for s in spans if s.step == step]
            assert moved and all(b > 0 for b in moved), step
        # the trace file gives each further rank's spans tracks of their own; the page draws rank 0's
        from lane.tracing import span_dict
        from lane.tracing.export import chrome_trace

        trace = {"request_id": "r", "spans": [span_dict(s) for s in spans]}
        tracks = {e["args"]["name"] for e in chrome_trace(trace)["traceEvents"] if e["name"] == "thread_name"}
        assert {"runner", "runner (rank 1)", "comm (rank 2)"} <= tracks
    finally:
        llm.shutdown()
    # sequence parallelism: the same tokens; in a step with a prompt chunk the embedding's
    # reduce-scatter leaves each rank its rows (step 22, the rows per rank in the span), attention
    # and the FFN reduce-scatter (28, 31)
    tracer.enable()
    tracer.drain()
    try:
        llm = LLM(smollm_gguf, quantization="none", tensor_parallel_size=3, enable_sequence_parallel=True, **FP32)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
        spans = tracer.drain()
    finally:
        tracer.enabled = False
        tracer.drain()
        llm.shutdown()
    sp = [s for s in spans if s.step == Step.COMM_SP_SCATTER]
    assert {s.attrs["rank"] for s in sp} == {0, 1, 2}
    n = len(llm.tokenizer.encode(prompts[0])) + len(llm.tokenizer.encode(prompts[1]))  # the first step's rows
    assert any(sum(map(int, s.attrs["rows_per_rank"].split("/"))) == n for s in sp)
    assert all(s.attrs.get("allgather_bytes", 0) > 0 and s.attrs.get("reducescatter_bytes", 0) > 0 for s in sp)
    # a forward with a prompt chunk reduce-scatters; a decode-only one keeps every row (all-reduce)
    for step in (Step.COMM_ATTN_REDUCE, Step.COMM_FFN_REDUCE):
        kinds = {(bool(s.attrs.get("reducescatter_bytes")), bool(s.attrs.get("allreduce_bytes")))
                 for s in spans if s.step == step}
        assert kinds == {(True, False), (False, True)}, (step, kinds)


def test_smollm_quantized_blocks_split_on_block_boundaries(smollm_gguf):
    """The GGUF's Q4_1 / Q8_0 blocks stay blocks on every rank (o_proj and down_proj split
    along their input on whole 32-value blocks): a third of the bytes each, and greedy
    decoding that follows TP=1's until a near tie (the ranks sum block dot products in
    another order), where the two picks are each other's runner-up."""
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)
    prompts = ["Once upon a time", "def fibonacci(n):"]
    ref = LLM(smollm_gguf, **FP32)
    want = ref.generate(prompts, params, use_tqdm=False)
    ref_bytes = resident_weight_bytes(ref.engine.worker.model)
    ref.shutdown()
    llm = LLM(smollm_gguf, tensor_parallel_size=3, **FP32)
    try:
        got = llm.generate(prompts, params, use_tqdm=False)
        per_rank = llm.engine.executor.weight_bytes()
        assert max(per_rank) <= 0.4 * ref_bytes, (per_rank, ref_bytes)
        for a, b in zip(want, got):
            for t, (x, y) in enumerate(zip(a.outputs[0].token_ids, b.outputs[0].token_ids)):
                if x != y:
                    assert x in b.outputs[0].logprobs[t] and y in a.outputs[0].logprobs[t]
                    break
            else:
                continue
    finally:
        llm.shutdown()


def _lane(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lane.entrypoints.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("args,message", [
    (["generate", "hi", "-tp", "2"], "tensor_parallel_size 2 does not divide 9 attention heads"),
    (["generate", "hi", "--enable-expert-parallel", "-tp", "3"], "needs a model with routed experts"),
    (["serve", "--nnodes", "2", "--node-rank", "1", "-tp", "2"], "--node-rank 1 runs workers only: add --headless"),
    (["serve", "--nnodes", "2", "-tp", "3"], "--nnodes 2 does not divide tensor_parallel_size 3"),
    (["generate", "hi", "--enable-sequence-parallel"], "--enable-sequence-parallel splits each step's rows"),
    (["generate", "hi", "-tp", "3", "--enable-dsa-cp"], "this one has no index_topk"),
])
def test_impossible_layouts_are_refused_with_the_numbers(args, message):
    r = _lane(*args)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr


def _worker_pids(server: RemoteServer) -> dict[int, list[int]]:
    """Engine index -> its workers' pids, from each engine core's start-up line."""
    found = re.finditer(r"\(EngineCore_DP(\d+) pid=\d+\).*Started \d+ worker processes \(pids ([0-9, ]+)\)",
                        server.read_log())
    return {int(m.group(1)): [int(p) for p in m.group(2).split(",")] for m in found}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie has exited
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _completions(server: RemoteServer, prompts: list[list[int]], max_tokens: int = 16) -> list[list[int]]:
    c = server.client()
    model = c.models.list().data[0].id
    out = []
    for p in prompts:
        r = c.completions.create(model=model, prompt=p, max_tokens=max_tokens, temperature=0,
                                 extra_body={"ignore_eos": True})
        out.append(r.choices[0].text)
    return out


def test_serve_tp2_dp2_then_a_killed_worker_fails_the_engine(tiny):
    """lane serve -tp 2 -dp 2 (four workers, two engines) answers as one rank does; then a
    worker killed mid-stream errors the stream and turns /health 503 within 5 s; SIGTERM
    after stops everything."""
    ref = LLM(tiny["qwen3"], **FP32)
    tok = ref.get_tokenizer()
    want = [o.outputs[0].text for o in ref.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                     GREEDY, use_tqdm=False)]
    ref.shutdown()
    with RemoteServer(["--model", tiny["qwen3"], "--dtype", "float32", "-tp", "2", "-dp", "2",
                       "--max-num-batched-tokens", "16"]) as s:
        by_engine = _worker_pids(s)
        workers = by_engine[0] + by_engine[1]
        assert len(workers) == 4 and len(s.engine_pids()) == 2
        assert _completions(s, PROMPTS) == want
        c = s.client(timeout=30)
        model = c.models.list().data[0].id
        stream = c.completions.create(model=model, prompt=tok.decode(PROMPTS[0]), max_tokens=900,
                                      extra_body={"ignore_eos": True, "data_parallel_rank": 0}, stream=True)
        next(iter(stream))
        t0 = time.monotonic()
        os.kill(by_engine[0][1], signal.SIGKILL)  # rank 1 of the engine serving the stream
        with pytest.raises(openai.APIError):
            for _ in stream:
                pass
        assert time.monotonic() - t0 < 5
        while httpx.get(s.url + "/health").status_code != 503:
            assert time.monotonic() - t0 < 5
            time.sleep(0.1)
        assert s.stop() == 0
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in workers)


class _CreatesAFile:
    """A pickle that would create a file when loaded: what an attacker sends."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _listening(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp writes them) listening on ``port``."""
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return [r[1].split(":")[0] for r in rows if r[3] == "0A" and int(r[1].split(":")[1], 16) == port]


def test_two_nodes_sign_every_message_refuse_another_secret_and_fail_fast_on_a_lost_node(tiny, tmp_path):
    """--nnodes 2 on loopback: node 0 runs the API server, the engine and rank 0; node 1
    (--headless) runs rank 1, reached over ZeroMQ and gloo. A headless node with another
    secret is refused by name before it loads; with node 0's secret the output equals one
    process; a raw pickle sent to the engine's ports runs nothing and is logged; the ports
    listen on --master-addr's interface only; a SIGKILLed headless node fails the engine
    (/health 503) within 5 s."""
    import pickle

    import zmq

    ref = LLM(tiny["llama"], **FP32)
    want = [o.outputs[0].text for o in ref.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                     GREEDY, use_tqdm=False)]
    ref.shutdown()
    port = free_port()
    common = ["--model", tiny["llama"], "--dtype", "float32", "-tp", "2", "--nnodes", "2",
              "--master-addr", "127.0.0.1", "--master-port", str(port)]
    headless = [sys.executable, "-m", "lane.entrypoints.cli", "serve", *common, "--node-rank", "1", "--headless"]
    secret = "a-deployment-secret-for-this-test-only"

    def node1(env_secret: str) -> subprocess.Popen:
        return subprocess.Popen(headless, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "LANE_RPC_SECRET": env_secret})

    wrong, right = node1("another-secret-that-is-long-enough"), node1(secret)
    try:
        with RemoteServer([*common, "--node-rank", "0"], env={"LANE_RPC_SECRET": secret}) as s:
            assert wrong.wait(30) == 2
            out = wrong.stdout.read()
            assert ("--rpc-secret-file / LANE_RPC_SECRET: the engine at 127.0.0.1:%d signs its messages with "
                    "another secret than this node's" % (port + 1)) in out
            assert "Traceback" not in out and "Loading" not in out  # refused before loading
            assert "Started 2 worker processes" in s.read_log()
            assert "dropped a frame signed with another secret" in s.read_log()  # its heartbeats
            assert secret not in s.read_log() + out
            assert _completions(s, PROMPTS) == want
            # only the interface of --master-addr listens (127.0.0.1, not 0.0.0.0)
            for p in (port + 1, port + 2):
                assert _listening(p) == ["0100007F"], p
            # an attacker's pickle on the replies port, and noise on both
            marker = tmp_path / "pwned"
            ctx = zmq.Context()
            push = ctx.socket(zmq.PUSH)
            push.connect(f"tcp://127.0.0.1:{port + 2}")
            push.send(pickle.dumps((1, "ok", _CreatesAFile(str(marker)))))
            push.send(b"\0" * 64)
            push.close(linger=2000)
            ctx.term()
            import socket as socketlib

            with socketlib.create_connection(("127.0.0.1", port + 1), timeout=5) as raw:
                raw.sendall(pickle.dumps(_CreatesAFile(str(marker))))
            time.sleep(1.0)
            assert not marker.exists()
            assert "worker replies (from 127.0.0.1): dropped" in s.read_log()
            assert _completions(s, PROMPTS[:1]) == want[:1]  # still serving
            # a lost node: its workers go with it, their heartbeats stop
            t0 = time.monotonic()
            right.kill()
            while httpx.get(s.url + "/health").status_code != 503:
                assert time.monotonic() - t0 < 5, "a lost node took more than 5 s to fail the engine"
                time.sleep(0.1)
            assert "on another machine sent no heartbeat" in s.read_log()
        assert "Node 1 of 2: worker ranks [1]" in right.stdout.read()
    finally:
        for p in (wrong, right):
            if p.poll() is None:
                p.kill()


def test_a_headless_node_without_a_secret_is_refused_by_name(tiny, tmp_path):
    r = subprocess.run([sys.executable, "-m", "lane.entrypoints.cli", "serve", "--model", tiny["llama"], "-tp", "2",
                        "--nnodes", "2", "--node-rank", "1", "--headless", "--master-port", str(free_port())],
                       capture_output=True, text=True, timeout=120,
                       env={**{k: v for k, v in os.environ.items() if k != "LANE_RPC_SECRET"}, "HOME": str(tmp_path)})
    assert r.returncode == 2
    assert f"--rpc-secret-file: no RPC secret at {tmp_path}/.cache/lane/rpc-secret" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.fixture
def ray_cluster():
    import shutil
    import tempfile

    ray = pytest.importorskip("ray")  # the [test] extra installs it
    tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths live under it
    port = free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    subprocess.run([ray_bin, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
                    "--num-cpus", "4", "--include-dashboard=false", "--disable-usage-stats",
                    f"--temp-dir={tmp}"], check=True, env=env, capture_output=True, timeout=120)
    os.environ["RAY_ADDRESS"] = f"127.0.0.1:{port}"
    try:
        yield ray
    finally:
        if ray.is_initialized():
            ray.shutdown()
        os.environ.pop("RAY_ADDRESS", None)
        subprocess.run([ray_bin, "stop", "--force"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(tmp, ignore_errors=True)


def test_ray_backend_equals_one_rank(tiny, ray_cluster):
    ref = LLM(tiny["llama"], **FP32)
    want = _tokens(ref)
    ref.shutdown()
    llm = LLM(tiny["llama"], tensor_parallel_size=2, distributed_executor_backend="ray", **FP32)
    try:
        assert _tokens(llm) == want
        assert len(llm.engine.executor.pids) == 2
    finally:
        llm.shutdown()


def test_explain_shows_the_layout_and_each_ranks_pool(smollm_gguf, tiny):
    from lane.entrypoints.explain import explain

    text = explain(smollm_gguf, "float32", kv_cache_memory_bytes=96 << 20, tensor_parallel_size=3)
    assert "rank 1: query heads 3-5, KV head 1, vocabulary rows 16384-32767" in text
    one = re.search(r"budget [0-9.,]+ MiB -> ([0-9,]+) blocks", text).group(1)
    # a rank holds a third of the KV heads in a third of the budget: as many blocks
    assert f"a KV pool of {int(one.replace(',', '')) - 1:,} blocks" in text
    text = explain(tiny["deepseek_v4"], "float32", tensor_parallel_size=2, enable_expert_parallel=True)
    assert "rank 1: query heads 2-3, output group 1, the shared K=V head and mHC replicated, experts 4-7 whole" in text
    with pytest.raises(ValueError, match="does not divide 9 attention heads"):
        explain(smollm_gguf, tensor_parallel_size=2)


def test_a_worker_that_stops_answering_fails_the_engine_after_worker_timeout(tiny, monkeypatch):
    from lane.executor.abstract import WorkerError

    monkeypatch.setenv("LANE_FAULT_INJECT", "worker_hang:1:3")  # rank 1 hangs at its third step
    llm = LLM(tiny["llama"], tensor_parallel_size=2, worker_timeout=3, **FP32)
    try:
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match="rank|within 3 s"):
            _tokens(llm)
        assert time.monotonic() - t0 < 10
    finally:
        t0 = time.monotonic()
        llm.shutdown()
        assert time.monotonic() - t0 < 15


def _left_behind() -> list[str]:
    """This process's workers, rings and IPC dirs, and the executor's threads, still there."""
    import glob
    import multiprocessing
    import tempfile
    import threading

    from lane.ipc_paths import SHM_DIR

    pid = os.getpid()
    return ([f"child {p.pid}" for p in multiprocessing.active_children()]
            + glob.glob(os.path.join(SHM_DIR, f"lane-*-{pid}-*"))
            + glob.glob(os.path.join(tempfile.gettempdir(), f"lane-workers-{pid}-*"))
            + [t.name for t in threading.enumerate() if t.name in ("WorkerReplies", "MessageQueueRemote",
                                                                  "WorkerMonitor")])


def test_a_rank_that_cannot_start_leaves_nothing_behind_nor_does_a_shutdown(tiny, monkeypatch):
    from lane.executor.abstract import WorkerError

    monkeypatch.setenv("LANE_FAULT_INJECT", "worker_start_fail:1")
    with pytest.raises(WorkerError, match="worker rank 1: RuntimeError: injected start-up failure"):
        LLM(tiny["llama"], tensor_parallel_size=2, kv_cache_memory_bytes=4 << 20, **FP32)
    assert _left_behind() == []
    monkeypatch.delenv("LANE_FAULT_INJECT")
    llm = LLM(tiny["llama"], tensor_parallel_size=2, kv_cache_memory_bytes=4 << 20, **FP32)
    assert len(_left_behind()) > 2  # its workers, IPC dir and threads, while it runs
    llm.shutdown()
    time.sleep(0.2)  # the monitor thread sees its workers go
    assert _left_behind() == []


def _stacked_experts_copy(src: str, dst: str) -> str:
    """The checkpoint with its per-expert tensors stacked as transformers holds them
    (``experts.gate_up_proj`` [E, 2I, H] gate | up, ``experts.down_proj`` [E, H, I])."""
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for f in ("model.safetensors", "model-mtp.safetensors"):
        tensors = load_file(os.path.join(dst, f))
        per_expert: dict = {}
        for name in list(tensors):
            if m := re.match(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", name):
                per_expert.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = tensors.pop(name)
        for prefix, parts in per_expert.items():
            n = 1 + max(e for e, _ in parts)
            tensors[prefix + ".gate_up_proj"] = torch.stack([torch.cat((parts[e, "gate"], parts[e, "up"])) for e in range(n)])
            tensors[prefix + ".down_proj"] = torch.stack([parts[e, "down"] for e in range(n)])
        save_file(tensors, os.path.join(dst, f), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("fmt", ["fp8", "stacked"])
def test_each_rank_reads_only_its_slices_of_fp8_and_stacked_expert_checkpoints(tiny, tmp_path, fmt):
    """TP=2 with expert parallelism: every rank reads at most 0.6x of the checkpoint's bytes
    (fp8 weights dequantized a slice at a time; stacked experts narrowed to the rank's own),
    and the output equals one rank's."""
    d = (write_tiny_model("deepseek_v3", str(tmp_path / "fp8"), fp8=True) if fmt == "fp8"
         else _stacked_experts_copy(tiny["deepseek_v3"], str(tmp_path / "stacked")))
    kw = dict(FP32, max_num_batched_tokens=16, kv_cache_memory_bytes=4 << 20)
    one = LLM(d, **kw)
    read, total = one.engine.worker.model.checkpoint_bytes_read
    assert read >= 0.9 * total  # one rank reads it all
    want = _tokens(one)
    one.shutdown()
    llm = LLM(d, tensor_parallel_size=2, enable_expert_parallel=True, **kw)
    try:
        per_rank = llm.engine.executor.collective_rpc("checkpoint_bytes_read")
        for rank, (read, total) in enumerate(per_rank):
            assert read <= 0.6 * total, (rank, read, total)
        assert _tokens(llm) == want
    finally:
        llm.shutdown()
