"""``lane bench``: a serving benchmark client for any OpenAI-compatible server (lane,
vLLM, llama.cpp's server), with vllm bench serve's flags and figures, plus this run's
prefix-cache and speculative-decoding figures from the server's /metrics."""
from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time

import httpx2 as httpx

from lane.bench import datasets, report, server_metrics
from lane.bench.metrics import PERCENTILE_METRICS, calculate_metrics, parse_goodput
from lane.bench.runner import LoadConfig, run_load
from lane.entrypoints import event_loop


def add_cli_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default=None, help="server URL without /v1 (default: http://HOST:PORT)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--model", default=None, help="model name to request (default: the server's first)")
    g.add_argument("--backend", default="openai", choices=["openai", "vllm", "openai-chat"],
                   help="openai / vllm: /v1/completions; openai-chat: /v1/chat/completions")
    g.add_argument("--endpoint", default=None, choices=["/v1/completions", "/v1/chat/completions"])
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as 'Authorization: Bearer' (default: $OPENAI_API_KEY)")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request counts as failed")
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", default="random", choices=["random", "sharegpt", "prefix", "jsonl"])
    g.add_argument("--dataset-path", default=None, help="the sharegpt JSON or the jsonl file")
    g.add_argument("--num-prompts", type=int, default=1000)
    g.add_argument("--tokenizer", default=None,
                   help="HF directory or .gguf for token-exact prompts (default: the server's /tokenize, "
                        "else the embedded default model's tokenizer)")
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0)
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    g.add_argument("--prefix-repetition-output-len", type=int, default=128)
    g.add_argument("--sharegpt-output-len", type=int, default=None)
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s with Poisson arrivals; inf sends all at once")
    g.add_argument("--max-concurrency", type=int, default=None)
    g.add_argument("--num-warmups", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("sampling (not sent unless given: the server's defaults apply, as in vllm bench)")
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g = p.add_argument_group("results")
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    g.add_argument("--metric-percentiles", default="50,75,90,99")
    g.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50")
    g.add_argument("--result-dir", default=None, help="write summary.json, requests.csv and PNG plots here")
    g.add_argument("--save-result", action="store_true",
                   help="as vllm bench: save the results (to --result-dir, default the current directory)")
    g.add_argument("--result-filename", default=None, help="name of the JSON summary (default summary.json)")
    g.add_argument("--disable-tqdm", action="store_true")


def check_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    def positive(flag: str, value, allow_none=False):
        if value is None and allow_none:
            return
        if value is None or value <= 0:
            parser.error(f"{flag} must be > 0, got {value}")

    positive("--num-prompts", args.num_prompts)
    positive("--max-concurrency", args.max_concurrency, allow_none=True)
    positive("--request-rate", args.request_rate)
    positive("--random-input-len", args.random_input_len)
    positive("--random-output-len", args.random_output_len)
    positive("--request-timeout", args.request_timeout)
    if not 0.0 <= args.random_range_ratio < 1.0:
        parser.error(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if args.num_warmups < 0:
        parser.error(f"--num-warmups must be >= 0, got {args.num_warmups}")
    if args.dataset_name in ("sharegpt", "jsonl"):
        if not args.dataset_path:
            parser.error(f"--dataset-name {args.dataset_name} needs --dataset-path")
        if not os.path.isfile(args.dataset_path):
            parser.error(f"--dataset-path {args.dataset_path!r} is not a file")
    bad = [m for m in args.percentile_metrics.split(",") if m not in PERCENTILE_METRICS]
    if bad:
        parser.error(f"--percentile-metrics: unknown {bad}; choose from {','.join(PERCENTILE_METRICS)}")
    try:
        pcts = [float(x) for x in args.metric_percentiles.split(",")]
    except ValueError:
        parser.error(f"--metric-percentiles must be numbers, got {args.metric_percentiles!r}")
    if any(not 0 < x <= 100 for x in pcts):
        parser.error("--metric-percentiles must lie in (0, 100]")
    try:
        parse_goodput(args.goodput)
    except ValueError as e:
        parser.error(str(e))


def shared_prefix_lengths(token_lists: list[list[int]]) -> list[int]:
    """For each prompt, the longest prefix it shares with any other prompt (neighbours in
    sorted order are the closest)."""
    order = sorted(range(len(token_lists)), key=lambda i: token_lists[i])
    best = [0] * len(token_lists)
    for a, b in zip(order, order[1:]):
        x, y = token_lists[a], token_lists[b]
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        best[a], best[b] = max(best[a], n), max(best[b], n)
    return best


def load_tokenizer(args: argparse.Namespace, base_url: str, headers: dict):
    if args.tokenizer:
        return datasets.BenchTokenizer(args.tokenizer)
    try:
        return datasets.ServerTokenizer(base_url, args.model, headers)
    except (httpx.HTTPError, ValueError, KeyError):
        print("the server has no usable /tokenize: using the embedded default model's tokenizer "
              "(give --tokenizer for another)", file=sys.stderr)
        return datasets.BenchTokenizer(None)


def build_dataset(args: argparse.Namespace, tok) -> list[datasets.SampleRequest]:
    rng = random.Random(args.seed)
    if args.dataset_name == "random":
        return datasets.random_dataset(tok, args.num_prompts, args.random_input_len, args.random_output_len,
                                       args.random_range_ratio, rng)
    if args.dataset_name == "prefix":
        return datasets.prefix_dataset(tok, args.num_prompts, args.prefix_repetition_num_prefixes,
                                       args.prefix_repetition_prefix_len, args.prefix_repetition_suffix_len,
                                       args.prefix_repetition_output_len, rng)
    if args.dataset_name == "sharegpt":
        return datasets.sharegpt_dataset(tok, args.dataset_path, args.num_prompts, args.sharegpt_output_len, rng)
    return datasets.jsonl_dataset(tok, args.dataset_path, args.num_prompts, args.random_output_len)


def first_model(base_url: str, headers: dict) -> str:
    r = httpx.get(base_url + "/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def main(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    check_args(args, parser)
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    if base_url.endswith("/v1"):
        base_url = base_url[:-3]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    endpoint = "chat" if (args.endpoint == "/v1/chat/completions" or args.backend == "openai-chat") else "completions"
    try:
        model = args.model or first_model(base_url, headers)
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        print(f"lane bench: cannot reach an OpenAI-compatible server at {base_url}: {e}", file=sys.stderr)
        return 1
    args.model = model
    tok = load_tokenizer(args, base_url, headers)
    print(f"building {args.num_prompts} prompts ({args.dataset_name}) with {tok.name}'s tokenizer ...",
          file=sys.stderr)
    try:
        samples = build_dataset(args, tok)
    except (ValueError, OSError, KeyError) as e:
        print(f"lane bench: bad dataset: {e}", file=sys.stderr)
        return 1
    if not samples:
        print("lane bench: the dataset gave no prompts", file=sys.stderr)
        return 1
    shared = shared_prefix_lengths([s.prompt_token_ids for s in samples])

    before = server_metrics.scrape(base_url, headers)
    sampling = {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p),
                                  ("top_k", args.top_k), ("min_p", args.min_p)) if v is not None}
    cfg = LoadConfig(base_url, model, endpoint, args.request_rate, args.max_concurrency, args.num_warmups,
                     args.ignore_eos, args.seed, args.request_timeout, headers, extra_body=sampling,
                     show_progress=not args.disable_tqdm)
    # the tokenizer and dataset left millions of objects: collected now and frozen out of the
    # collector, or a full collection pauses the first wave of streams (~100 ms on a slow VM)
    gc.collect()
    gc.freeze()
    started = time.time()
    outputs, duration = event_loop.run(run_load(cfg, samples))
    after = server_metrics.scrape(base_url, headers)

    selected = args.percentile_metrics.split(",")
    percentiles = [float(x) for x in args.metric_percentiles.split(",")]
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)), "base_url": base_url,
              "model_id": model, "endpoint": endpoint, "dataset_name": args.dataset_name,
              "num_prompts": len(samples), "request_rate": args.request_rate,
              "max_concurrency": args.max_concurrency, "seed": args.seed,
              "max_shared_prefix_tokens": max(shared), "mean_shared_prefix_tokens": sum(shared) / len(shared)}
    result.update(calculate_metrics(outputs, duration, percentiles, selected, parse_goodput(args.goodput)))
    result.update(server_metrics.run_delta(before, after))
    warnings = []
    block = result.get("kv_block_size")
    if block and max(shared) < block:
        warnings.append(f"no two prompts share {block} tokens (longest shared prefix: {max(shared)} tokens), "
                        f"less than one KV block of {block}: the prefix cache cannot hit in this run")
    errors = [o.error for o in outputs if not o.success]
    if errors:
        warnings.append(f"{len(errors)} request(s) failed; first error: {errors[0]}")
    result["warnings"] = warnings
    result["errors"] = errors
    print(report.format_table(result, selected, percentiles))
    if args.result_dir or args.save_result:
        title = f"{model} @ {base_url}, {args.dataset_name}, c={args.max_concurrency or 'inf'}"
        paths = report.save(args.result_dir or ".", result, outputs, title,
                            args.result_filename or "summary.json")
        print(f"results: {', '.join(paths)}")
    return 0
