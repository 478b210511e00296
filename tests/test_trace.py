"""`lane serve --trace` and `lane trace`: a real request's 57-step trace, across the API
server and engine-core processes on one time axis, drawn in real headless Chromium."""
import json
import re
import shutil
import subprocess
import sys

import httpx2 as httpx
import pytest

from utils import RemoteServer

LANE = [sys.executable, "-m", "lane.entrypoints.cli"]
BUDGET = 256
EOS_AT_ONCE = "Tell me a short story about a fox."
PROMPT = "The history of computing is long and full of surprises; machines grew from gears to chips. " * 30


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """Two `lane trace` runs of one long prompt: the second hits the prefix cache."""
    out = tmp_path_factory.mktemp("traces")
    (out / "prompt.txt").write_text(PROMPT)
    with RemoteServer(["--dtype", "float32", "--kv-cache-memory-bytes", "256M", "--max-model-len", "2048",
                       "--max-num-batched-tokens", str(BUDGET), "--trace"]) as s:
        runs = []
        for name in ("first", "second"):
            r = subprocess.run([*LANE, "trace", "--base-url", s.url, "--prompt-file", str(out / "prompt.txt"),
                                "--max-tokens", "8", "--output-dir", str(out / name)],
                               capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, r.stderr
            runs.append(json.loads((out / name / "trace.json").read_text()))
            (out / name / "stdout.txt").write_text(r.stdout)
        # greedy SmolLM2 answers this one with EOS at once: a first chunk with no text
        r = subprocess.run([*LANE, "trace", EOS_AT_ONCE, "--base-url", s.url, "--output-dir", str(out / "eos")],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        prompt_tokens = httpx.post(s.url + "/tokenize", json={"prompt": PROMPT}).json()["count"]
        missing = httpx.get(s.url + "/v1/traces/cmpl-nope")
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"
    return runs, prompt_tokens, out


def events(trace, step=None):
    evs = [e for e in trace["traceEvents"] if e["ph"] != "M"]
    return [e for e in evs if step is None or e["args"]["step"] == step]


def end(e):
    # less a hundredth of a µs: ts and dur are rounded to the ns in trace.json
    return e["ts"] + e.get("dur", 0) - 0.01


def test_trace_holds_every_step_in_order(traces):
    (first, second), prompt_tokens, _ = traces
    evs = events(first)
    rid = first["metadata"]["request_id"]
    assert all(e["args"]["request_id"] == rid and "step" in e["args"] for e in evs)
    recorded = {e["args"]["step"] for e in evs if e["ph"] == "X"}
    skipped = {e["args"]["step"]: e["args"]["skipped"] for e in evs if e["ph"] == "i"}
    # start-up, once; what a dense single-rank model does not do is skipped, with its reason
    assert {1, 3, 4, 6, 8, 9} <= recorded and {2, 5, 7} <= set(skipped)
    assert set(range(10, 41)) <= recorded | set(skipped)
    assert {22, 25, 26, 29, 31, 33} <= set(skipped)
    assert "index_topk" in skipped[25] and "speculative decoding off" == skipped[45]
    assert "PD disaggregation off" == skipped[55] and "dense model" in skipped[29]
    assert {41, 42, 43, 44, 49, 50, 51, 52} <= recorded
    # lane trace counts the steps recorded and names each missing one with its reason
    said = (traces[2] / "first" / "stdout.txt").read_text()
    assert f"{len(recorded)}/57 steps recorded" in said
    assert "missing 45 model.mtp_draft: speculative decoding off" in said
    assert all(f"missing {n} " in said for n in set(range(1, 58)) - recorded)
    attention = events(first, 27)[0]["args"]
    assert attention["backend"] == "paged_sdpa" and attention["layers"] == 30
    # the prompt went in ceil(tokens / budget) chunks
    chunks = events(first, 17)
    assert len(chunks) == -(-prompt_tokens // BUDGET)
    assert [c["args"]["chunk"] for c in chunks] == list(range(len(chunks)))
    # steps 10-18 in their order
    firsts = [events(first, s)[0] for s in range(10, 19)]
    assert all(a["ts"] <= b["ts"] for a, b in zip(firsts, firsts[1:]))
    # prefix hits: none the first time, whole blocks the second
    assert events(first, 16)[0]["args"]["hit_tokens"] == 0
    assert events(second, 16)[0]["args"]["hit_tokens"] >= BUDGET


def test_first_token_received_even_when_it_ends_the_request(traces):
    """A request whose first token is EOS still has its "first token received" (step 40),
    after the server's first chunk (39): the picture's TTFT needs it."""
    _, _, out = traces
    trace = json.loads((out / "eos" / "trace.json").read_text())
    assert events(trace, 51)[0]["args"]["output_tokens"] == 1 and not events(trace, 43)
    (first_chunk,), (received,) = events(trace, 39), events(trace, 40)
    assert received["ts"] >= end(first_chunk) and received["args"]["ttft_ms"] > 0


def test_processes_share_one_time_axis(traces):
    (first, _), _, _ = traces
    ev = lambda s: events(first, s)  # noqa: E731
    pids = {e["args"]["step"]: e["args"]["pid"] for e in events(first) if e["ph"] == "X"}
    assert pids[11] != pids[14] != pids[10]  # API server, engine core and client: three processes
    one = lambda s: ev(s)[0]  # noqa: E731
    assert one(12)["ts"] >= end(one(11))
    assert one(14)["ts"] >= end(one(13))  # engine after the API server's routing
    for d, w in zip(ev(19), ev(20)):  # each dispatch, then that step's input preparation
        assert w["ts"] >= end(d)
    sample = ev(34)
    attention = ev(27)
    # the forward of the last prefill chunk comes before its sampling
    assert sample[0]["ts"] >= end(attention[len(ev(17)) - 1])
    assert one(38)["ts"] >= end(one(37))  # API server after the engine's output
    assert one(40)["ts"] >= end(one(39))  # the client after the SSE chunk
    decodes = ev(43)
    assert len(decodes) == ev(51)[0]["args"]["output_tokens"] - 1
    for k, d in enumerate(decodes):  # each decode step after the previous step's sampling
        assert d["ts"] >= end(sample[k])


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_trace_html_in_headless_chromium(traces):
    (first, _), _, out = traces
    page = out / "first" / "trace.html"
    html = page.read_text()
    assert "http://" not in html.split("<script>")[0] and "src=" not in html  # self-contained
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    dom = subprocess.run(["chromium", *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True,
                         timeout=120).stdout
    assert 'data-rendered="1"' in dom
    lanes = re.findall(r'class="lane-header"[^>]*>([a-z]+)<', dom)
    assert lanes == ["client", "frontend", "engine", "scheduler", "kv", "worker", "runner", "model", "comm", "ops"]
    drawn = [int(n) for n in re.findall(r'class="step[^"]*" data-step="(\d+)"', dom)]
    evs = events(first)
    assert sorted(drawn) == sorted(e["args"]["step"] for e in evs)
    assert len(re.findall(r'class="step skipped"', dom)) == sum(e["ph"] == "i" for e in evs)
    assert "TTFT" in dom and 'class="arrow"' in dom
    shot = out / "shot.png"
    subprocess.run(["chromium", *flags, "--window-size=1600,1200", f"--screenshot={shot}", page.as_uri()],
                   capture_output=True, timeout=120)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20000


def test_trace_without_tracing_is_a_clear_error(tmp_path, plain_server):
    r = subprocess.run([*LANE, "trace", "--base-url", plain_server.url, "hello", "--max-tokens", "2",
                        "--output-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "--trace" in r.stderr and "Traceback" not in r.stderr


def test_per_forward_and_per_layer_spans_offline(lane_smollm_fp32):
    from lane import SamplingParams
    from lane.tracing import tracer

    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    try:
        for detail, per_forward in ((False, 1), (True, 30)):
            tracer.enable(layer_detail=detail)
            tracer.drain()
            lane_smollm_fp32.generate(["Once upon a time"], params, use_tqdm=False)
            spans = tracer.drain()
            forwards = sum(s.step == 20 for s in spans)
            assert forwards == 3
            assert sum(s.step == 27 for s in spans) == per_forward * forwards
            assert sum(s.step == 30 for s in spans) == per_forward * forwards
    finally:
        tracer.enabled = tracer.layer_detail = False
        tracer.drain()
