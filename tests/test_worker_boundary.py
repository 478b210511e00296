"""The scheduler / worker boundary is data: every SchedulerOutput an engine step hands its
worker round-trips through msgspec unchanged, and a Worker in a separate process, built
from nothing but the engine's settings, the KVCacheConfig and those serialized outputs,
samples the same tokens as the engine's own worker did."""
import json
import pickle
import subprocess
import sys

import msgspec
import pytest
import torch

from lane import LLM, SamplingParams
from lane.core.scheduler_output import SchedulerOutput
from lane.entrypoints.tiny_model import write_tiny_model

REPLAY = r"""
import json, pickle, sys
import msgspec
from lane.config import EngineArgs
from lane.core.scheduler_output import SchedulerOutput
from lane.worker.worker import Worker

with open(sys.argv[1], "rb") as f:
    record = pickle.load(f)
worker = Worker(EngineArgs(**record["args"]).create_engine_config())
assert worker.initialize_kv_cache(record["kv_cache_config"]) == record["kv_cache_config"]
worker.warmup()
decoder = msgspec.msgpack.Decoder(SchedulerOutput)
steps = []
for payload in record["steps"]:
    out = worker.execute_model(decoder.decode(payload))
    steps.append([out.req_ids, out.sampled_token_ids, out.logprobs])
print(json.dumps(steps))
"""


def _record(llm: LLM) -> list:
    """Wrap the engine's worker: each step's SchedulerOutput, encoded as it would cross a
    process boundary, and what the worker returned."""
    worker = llm.engine.worker
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(SchedulerOutput)
    steps = []
    run = worker.execute_model

    def execute_model(so):
        payload = encoder.encode(so)
        assert decoder.decode(payload) == so  # unchanged through msgspec
        assert pickle.loads(pickle.dumps(so)) == so
        out = run(so)
        steps.append((payload, so, out))
        return out

    worker.execute_model = execute_model
    return steps


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    return write_tiny_model("deepseek_v4", str(tmp_path_factory.mktemp("v4b") / "v4"))


def _case(name, smollm_gguf, v4):
    if name == "smollm":  # 29 blocks of 16 tokens (+ the null block) for 590 tokens: preemption
        return dict(model=smollm_gguf, kv_cache_memory_bytes=30 * 30 * 2 * 3 * 64 * 4 * 16, max_model_len=256,
                    max_num_batched_tokens=64, max_num_seqs=4)
    # window blocks for 16 requests: those a hit's next query sees are still cached in round 2
    return dict(model=v4, kv_cache_memory_bytes=16 << 20, max_model_len=512, max_num_batched_tokens=48,
                max_num_seqs=16)


@pytest.mark.parametrize("name", ["smollm", "v4"])
def test_worker_in_another_process_replays_scheduler_outputs(name, smollm_gguf, v4, tmp_path):
    args = dict(dtype="float32", show_progress=False, **_case(name, smollm_gguf, v4))
    llm = LLM(**args)
    steps = _record(llm)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (100, 97, 120, 33)]
    greedy = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=60, ignore_eos=True, logprobs=2)
    for _ in range(2):  # the second round hits the prefix cache
        llm.generate([{"prompt_token_ids": p} for p in prompts], [greedy, seeded, greedy, greedy], use_tqdm=False)
    sos = [so for _, so, _ in steps]
    assert any(so.scheduled_new_reqs for so in sos) and any(so.finished_req_ids for so in sos)
    assert any(n.num_computed_tokens > 0 for so in sos for n in so.scheduled_new_reqs)  # prefix hits
    assert any(n > 1 for so in sos for rid, n in so.num_scheduled_tokens.items()
               if rid in so.scheduled_cached_reqs.req_ids)  # later chunks of a chunked prefill
    if name == "smollm":
        assert llm.engine.scheduler.num_preemptions > 0
        assert any(any(so.scheduled_cached_reqs.resumed_from_preemption) for so in sos)
    else:
        assert [g.kind for g in llm.engine.kv_cache_config.groups] == ["full", "sliding_window", "state"]

    record = tmp_path / "record.pkl"
    with open(record, "wb") as f:
        pickle.dump({"args": {k: v for k, v in args.items()}, "kv_cache_config": llm.engine.kv_cache_config,
                     "steps": [payload for payload, _, _ in steps]}, f)
    r = subprocess.run([sys.executable, "-c", REPLAY, str(record)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    replayed = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(replayed) == len(steps)
    for (_, _, out), (req_ids, tokens, logprobs) in zip(steps, replayed):
        assert (out.req_ids, out.sampled_token_ids) == (req_ids, tokens)
        assert (out.logprobs is None) == (logprobs is None)
