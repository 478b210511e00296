"""The seed's deployment, scaled down to a CI test (examples/seed_shape/run.sh is the full one):
a tiny DeepSeek V4 of V4-Flash's layer pattern served by a prefill and a decode instance, each
two tensor-parallel ranks with expert, sequence and DSA context parallelism, EPLB, MTP k = 3 and
the int8 cache, joined by the TCP connector behind lane proxy. One request, prefilled in 4
chunks, is traced through the proxy while /metrics is scraped: its trace records all 57 steps;
the deployment's greedy tokens equal one rank of one instance's; EPLB moved experts, the KV
went over, drafts were accepted, /metrics labels the cache int8; and nothing is left running."""
import json
import threading
import time

import httpx2 as httpx
import torch

from lane import LLM, SamplingParams
from lane.entrypoints.tiny_model import write_tiny_model
from lane.tracing import STEPS, coverage
from lane.tracing.client import run as trace_request
from utils import RemoteServer, descendants, free_port, metric, pid_alive, start_proxy

MTP = {"method": "mtp", "num_speculative_tokens": 3}
PROMPT_TOKENS, CHUNKS, NEW_TOKENS = 300, 4, 20


def _instance(model: str, role: str) -> list[str]:
    return ["--model", model, "--served-model-name", "seed", "--dtype", "float32", "-tp", "2",
            "--enable-expert-parallel", "--enable-sequence-parallel", "--enable-dsa-cp",
            "--enable-eplb", "--eplb-config", json.dumps({"step_interval": 3, "window_size": 3}),
            "--speculative-config", json.dumps(MTP), "--kv-cache-dtype", "int8",
            "--max-num-batched-tokens", str(PROMPT_TOKENS // CHUNKS), "--kv-cache-memory-bytes", "128M",
            "--max-model-len", "2048", "--trace", "--kv-transfer-config",
            json.dumps({"kv_connector": "TcpConnector", "kv_role": role, "kv_port": free_port()})]


def test_seed_deployment_traces_all_57_steps(tmp_path, monkeypatch):
    monkeypatch.setenv("LANE_RPC_SECRET", "seed-shape-test-secret-0123456789")
    model = write_tiny_model("deepseek_v4", str(tmp_path / "model"), seed_shape=True)
    prompt = torch.randint(3, 49152, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = LLM(model, dtype="float32", kv_cache_dtype="int8", speculative_config=MTP, show_progress=False,
              kv_cache_memory_bytes=128 << 20, max_model_len=2048)
    want = ref.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                                        ignore_eos=True), use_tqdm=False)
    want = want[0].outputs[0].token_ids
    ref.shutdown()

    with RemoteServer(_instance(model, "kv_producer")) as p, RemoteServer(_instance(model, "kv_consumer")) as d:
        proxy, url = start_proxy(p.port, d.port, "--health-interval", "0.2")
        tree = {s.proc.pid: descendants(s.proc.pid) for s in (p, d)}
        try:
            # one request traced while a monitor scrapes /metrics (step 56); the proxy probes (57)
            done = threading.Event()

            def scrape():
                while not done.is_set():
                    for inst in (p, d):
                        httpx.get(inst.url + "/metrics", timeout=10)
                    time.sleep(0.05)
            scraper = threading.Thread(target=scrape, daemon=True)
            scraper.start()
            try:
                _, html_path, trace = trace_request(url, prompt, None, "seed", NEW_TOKENS, False,
                                                    str(tmp_path / "trace"), None)
            finally:
                done.set()
                scraper.join()
            ran, missing = coverage(trace["spans"])
            assert not missing and len(ran) == len(STEPS) == 57, missing
            spans = [s for s in trace["spans"] if not s.get("skipped")]
            where = {(s["attrs"].get("instance", "").split(" ")[0], s["attrs"].get("rank")) for s in spans}
            assert {("prefill", 0), ("prefill", 1), ("decode", 0), ("decode", 1), ("proxy", None)} <= where
            chunks = [s for s in spans if s["step"] == 17 and s["attrs"]["instance"].startswith("prefill")]
            assert len(chunks) == CHUNKS
            assert "57/57 steps recorded" in open(html_path).read()
            # the deployment's greedy tokens (a prefix-cache hit now) against one rank of one instance's
            r = httpx.post(url + "/v1/completions", timeout=120, json={
                "model": "seed", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
                "logprobs": 1, "return_tokens_as_token_ids": True})
            got = [int(t.removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["tokens"]]
            assert got == list(want)
            # EPLB moved expert weights, the KV went from prefill to decode, drafts were accepted
            m = {i: httpx.get(i.url + "/metrics").text for i in (p, d)}
            assert metric(m[p], "lane:eplb_moved_bytes_total") + metric(m[d], "lane:eplb_moved_bytes_total") > 0
            assert metric(m[d], "lane:kv_transfer_bytes_total") > 0
            assert metric(m[d], "vllm:spec_decode_num_accepted_tokens_total") > 0
            for i in (p, d):  # the cache labelled as stored; nothing running or held
                assert 'cache_dtype="int8"' in m[i]
                assert metric(m[i], "vllm:num_requests_running") == 0
        finally:
            proxy.terminate()
            proxy.wait(10)
    # nothing left running: both instances' engine cores and workers, and the proxy, are gone
    assert proxy.poll() is not None
    deadline = time.monotonic() + 10
    while (left := [pid for root, kids in tree.items() for pid in {root, *kids} if pid_alive(pid)]) and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left and all(len(kids) >= 3 for kids in tree.values()), (left, tree)
