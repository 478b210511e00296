"""Data-parallel attention with experts spread over every replica's ranks (``-dp N
--enable-expert-parallel``, vLLM's semantics): one model world of dp x tp ranks, MoE dispatch
and combine by all-to-all, replicas in lock-step (an idle one runs dummy batches), and the
balance scheduler's admission freeze. Real servers, real processes, float32: every request
equals its solo run on one rank."""
from __future__ import annotations

import concurrent.futures as cf
import os
import random
import signal
import time

import httpx2 as httpx
import pytest

from lane import LLM, SamplingParams
from lane.entrypoints.tiny_model import write_tiny_model
from utils import RemoteServer, metric

FP32 = dict(dtype="float32", show_progress=False)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-dp")
    return {arch: write_tiny_model(arch, str(root / arch)) for arch in ("deepseek_v3", "deepseek_v4")}


def _solo(model: str, prompts: list[list[int]], max_tokens: list[int], **kw) -> list[list[int]]:
    """Each prompt alone on one rank (chunked as the server chunks)."""
    llm = LLM(model, **FP32, **kw)
    try:
        return [llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids for p, n in zip(prompts, max_tokens)]
    finally:
        llm.shutdown()


def _complete(server: RemoteServer, prompt: list[int], max_tokens: int, **extra) -> list[int]:
    """The greedy token ids the server answers (its logprobs name them)."""
    r = server.client().completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           logprobs=0, extra_body={"ignore_eos": True,
                                                                   "return_tokens_as_token_ids": True, **extra})
    return [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens]


def test_dp2_tp1_wide_ep_64_mixed_requests_balanced_and_equal_to_solo(tiny):
    """V3 over two replicas of one rank each, its experts over both (ep = 2): 64 requests of mixed
    lengths at once, few seats per replica (so one reaches its cap and admissions freeze) and a
    small pool (15 blocks a replica: 13-21 preemptions a run; 20 gave 3, and once none); each
    equals its solo run and the replicas stay balanced."""
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 4000) for _ in range(rng.randrange(4, 60))] for _ in range(64)]
    lens = [rng.randrange(4, 20) for _ in range(64)]
    want = _solo(tiny["deepseek_v3"], prompts, lens, max_num_batched_tokens=32, max_model_len=128)
    with RemoteServer(["--model", tiny["deepseek_v3"], "--dtype", "float32", "--served-model-name", "tiny",
                       "-dp", "2", "--enable-expert-parallel", "--max-num-seqs", "6",
                       "--max-num-batched-tokens", "32", "--max-model-len", "128",
                       "--kv-cache-memory-bytes", "120K"]) as s:
        with cf.ThreadPoolExecutor(64) as ex:
            got = list(ex.map(lambda pn: _complete(s, pn[0], pn[1]), zip(prompts, lens)))
        m = httpx.get(s.url + "/metrics").text
        # a replica that dies takes its lock-step partner down with it (its next sync sees the pid
        # gone), and /health fails at once
        engines = s.engine_pids()
        os.kill(engines[1], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while httpx.get(s.url + "/health").status_code != 503:
            assert time.monotonic() < deadline, "/health still answers 200"
            time.sleep(0.1)
        while _alive(engines[0]):
            assert time.monotonic() < deadline, "the other replica still runs"
            time.sleep(0.1)
    assert got == want
    assert metric(m, "lane:dp_imbalance") / 2 <= 1.5  # the same figure on both replicas
    assert metric(m, "lane:dp_admission_frozen_steps_total") > 0
    assert metric(m, "vllm:num_preemptions_total") > 0


def test_dp2_tp2_wide_ep_with_mtp_and_an_eplb_move_equals_solo(tiny):
    """V4 over two replicas of two ranks each, its experts over all four (ep = 4), MTP drafting
    k = 2 and EPLB moving experts mid-run: chunked prefill, a shared prefix found in the cache,
    and one replica idle while the other decodes (it runs dummy batches)."""
    prompts = [list(range(100, 148)), list(range(200, 224)) + [5, 6, 7], list(range(200, 224)) + [9, 8],
               list(range(300, 340))]
    want = _solo(tiny["deepseek_v4"], prompts, [16] * 4, max_num_batched_tokens=16, max_model_len=128)
    with RemoteServer(["--model", tiny["deepseek_v4"], "--dtype", "float32", "--served-model-name", "tiny",
                       "-dp", "2", "-tp", "2", "--enable-expert-parallel", "--max-num-batched-tokens", "16",
                       "--max-model-len", "128", "--speculative-config",
                       '{"method": "mtp", "num_speculative_tokens": 2}', "--enable-eplb", "--eplb-config",
                       '{"window_size": 4, "step_interval": 8}']) as s:
        with cf.ThreadPoolExecutor(4) as ex:  # both replicas busy
            together = list(ex.map(lambda p: _complete(s, p, 16), prompts))
        # one replica at a time: the other runs dummy batches for its collectives
        alone = [_complete(s, p, 16, data_parallel_rank=0) for p in prompts]
        m = httpx.get(s.url + "/metrics").text
    assert together == want and alone == want
    assert metric(m, "lane:dp_dummy_batches_total", engine="1") > 0
    assert metric(m, "vllm:prefix_cache_hits_total") > 0
    assert metric(m, "vllm:eplb_rebalance_events_total") > 0
    assert metric(m, "vllm:spec_decode_num_accepted_tokens_total") >= 0
    assert metric(m, "vllm:spec_decode_num_drafts_total") > 0


def test_explain_shows_every_ranks_heads_experts_and_rows(tiny):
    from lane.entrypoints.explain import explain

    text = explain(tiny["deepseek_v4"], "float32", tensor_parallel_size=2, enable_expert_parallel=True,
                   data_parallel_size=2)
    assert "data_parallel_size 2: attention data parallel, experts over all 4 ranks" in text
    for rank, experts in ((0, "experts 0-1"), (3, "experts 6-7")):
        line = next(x for x in text.splitlines() if x.strip().startswith(f"rank {rank} (replica {rank // 2}"))
        assert f"{experts} whole" in line and f"replica {rank // 2}'s own requests" in line
