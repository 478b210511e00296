"""`lane bench` as users run it (a subprocess), against a server whose timing the test
sets, and against the real `lane serve`."""
import json
import os
import subprocess
import sys
import time

import httpx2 as httpx
import pytest

from utils import free_port

LANE = [sys.executable, "-m", "lane.entrypoints.cli"]
FAKE = os.path.join(os.path.dirname(__file__), "fake_openai_server.py")
TTFT_MS, ITL_MS, TOKENS = 200.0, 50.0, 10


def bench(*args, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([*LANE, "bench", "--disable-tqdm", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def fake_server(tmp_path_factory):
    port = free_port()
    proc = subprocess.Popen([sys.executable, FAKE, "--port", str(port), "--ttft-ms", str(TTFT_MS),
                             "--itl-ms", str(ITL_MS)])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.get(url + "/v1/models", timeout=1)
            break
        except httpx.HTTPError:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)
    # one throw-away run first: a fresh server's first streamed requests (its lazy imports and
    # first calls) cost a slow VM tens of ms, which the timing test would count
    warm = tmp_path_factory.mktemp("warm")
    data = write_jsonl(warm / "p.jsonl", [f"warm-up {i}" for i in range(4)])
    r = bench("--base-url", url, "--dataset-name", "jsonl", "--dataset-path", data, "--num-prompts", "4",
              "--max-concurrency", "4", "--result-dir", str(warm / "out"))
    assert r.returncode == 0, r.stderr
    yield url
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def write_jsonl(path, prompts, max_tokens=TOKENS):
    with open(path, "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p, "max_tokens": max_tokens}) + "\n")
    return str(path)


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_known_timing_is_measured(fake_server, tmp_path, backend):
    # four waves: the first wave's start-up (new connections, the fake server's first calls:
    # ~60 ms on a slow 2-core VM) is a quarter of the mean, not half
    n, conc = 16, 4
    data = write_jsonl(tmp_path / "p.jsonl", [f"hello number {i}" for i in range(n)])
    r = bench("--base-url", fake_server, "--backend", backend, "--dataset-name", "jsonl", "--dataset-path", data,
              "--num-prompts", str(n), "--max-concurrency", str(conc), "--result-dir", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["completed"] == n and s["failed"] == 0
    assert s["mean_ttft_ms"] == pytest.approx(TTFT_MS, rel=0.15)
    assert s["mean_tpot_ms"] == pytest.approx(ITL_MS, rel=0.15)
    assert s["median_itl_ms"] == pytest.approx(ITL_MS, rel=0.15)
    e2el_s = (TTFT_MS + (TOKENS - 1) * ITL_MS) / 1000
    assert s["mean_e2el_ms"] == pytest.approx(e2el_s * 1000, rel=0.15)
    # two waves of `conc` requests, each wave one E2EL long
    assert s["output_throughput"] == pytest.approx(n * TOKENS / (n / conc * e2el_s), rel=0.15)
    assert s["total_output_tokens"] == n * TOKENS  # from the server's usage
    # this run's server counters: fixed increments per request
    assert s["prefix_cache_queries"] == 100 * n and s["prefix_cache_hit_rate"] == pytest.approx(0.4)
    assert s["spec_decode_num_drafts"] == 10 * n
    assert s["spec_decode_acceptance_rate"] == pytest.approx(20 / 30)
    assert s["spec_decode_acceptance_length"] == pytest.approx(3.0)
    assert "Serving Benchmark Result" in r.stdout and "Mean TTFT (ms):" in r.stdout
    assert "Acceptance rate (%):" in r.stdout


def test_failures_and_timeouts_are_counted(fake_server, tmp_path):
    prompts = ["fine one", "please FAIL now", "fine two", "HANG here", "fine three"]
    data = write_jsonl(tmp_path / "p.jsonl", prompts, max_tokens=3)
    r = bench("--base-url", fake_server, "--dataset-name", "jsonl", "--dataset-path", data, "--num-prompts", "5",
              "--request-timeout", "2", "--result-dir", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["completed"] == 3 and s["failed"] == 2
    assert any("HTTP 500" in e for e in s["errors"]) and any("Timeout" in e for e in s["errors"])
    rows = (tmp_path / "out" / "requests.csv").read_text().splitlines()
    assert len(rows) == 6 and sum(",False," in row for row in rows) == 2


def test_goodput_and_compare(fake_server, tmp_path):
    data = write_jsonl(tmp_path / "p.jsonl", [f"p {i}" for i in range(4)])
    for name, slo in (("a", "ttft:1000"), ("b", "ttft:50")):
        r = bench("--base-url", fake_server, "--dataset-name", "jsonl", "--dataset-path", data, "--num-prompts", "4",
                  "--goodput", slo, "--save-result", "--result-dir", str(tmp_path / name),
                  "--result-filename", "summary.json")
        assert r.returncode == 0, r.stderr
    a = json.loads((tmp_path / "a" / "summary.json").read_text())
    b = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert a["request_goodput"] == pytest.approx(a["request_throughput"]) and b["request_goodput"] == 0
    r = subprocess.run([*LANE, "bench", "compare", str(tmp_path / "a" / "summary.json"),
                        str(tmp_path / "b" / "summary.json")], capture_output=True, text=True)
    assert r.returncode == 0 and "mean TTFT (ms)" in r.stdout and "B / A" in r.stdout


@pytest.mark.parametrize("args, needle", [
    (["--num-prompts", "0"], "--num-prompts"),
    (["--dataset-name", "sharegpt"], "--dataset-path"),
    (["--goodput", "speed:3"], "--goodput"),
    (["--percentile-metrics", "ttft,nope"], "--percentile-metrics"),
    (["--random-range-ratio", "1.5"], "--random-range-ratio"),
])
def test_bad_flags(args, needle):
    r = bench(*args)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr


def test_unreachable_server_is_a_clear_error():
    r = bench("--base-url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "2")
    assert r.returncode == 1 and "cannot reach" in r.stderr and "Traceback" not in r.stderr


def test_against_lane_serve(tmp_path, plain_server):
    import matplotlib.image

    # the shared server: lane bench reads its counters as this run's deltas
    common = ["--base-url", plain_server.url, "--num-prompts", "8", "--max-concurrency", "4", "--ignore-eos"]
    r = bench(*common, "--dataset-name", "random", "--random-input-len", "64", "--random-output-len", "8",
              "--result-dir", str(tmp_path / "random"))
    assert r.returncode == 0, r.stderr
    rnd = json.loads((tmp_path / "random" / "summary.json").read_text())
    r = bench(*common, "--dataset-name", "prefix", "--prefix-repetition-num-prefixes", "2",
              "--prefix-repetition-prefix-len", "64", "--prefix-repetition-suffix-len", "16",
              "--prefix-repetition-output-len", "8", "--result-dir", str(tmp_path / "prefix"))
    assert r.returncode == 0, r.stderr
    pre = json.loads((tmp_path / "prefix" / "summary.json").read_text())
    for s in (rnd, pre):
        assert s["completed"] == 8 and s["failed"] == 0 and s["total_output_tokens"] == 64
        for key in ("duration", "request_throughput", "output_throughput", "total_token_throughput",
                    "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p50_ttft_ms", "p75_ttft_ms", "p90_ttft_ms",
                    "p99_ttft_ms", "max_ttft_ms", "mean_tpot_ms", "p99_itl_ms", "mean_e2el_ms", "kv_block_size",
                    "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_hit_rate"):
            assert isinstance(s[key], (int, float)), key
    # the server's own tokenizer made the random prompts token-exact
    assert rnd["total_input_tokens"] == 8 * 64
    assert rnd["prefix_cache_hit_rate"] < 0.05 and any("cannot hit" in w for w in rnd["warnings"])
    assert pre["prefix_cache_hit_rate"] > 0.2 and not pre["warnings"]
    for png in ("ttft_distribution", "tpot_distribution", "throughput_over_time", "concurrency_over_time"):
        path = tmp_path / "random" / f"{png}.png"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert matplotlib.image.imread(path).shape[0] > 100
