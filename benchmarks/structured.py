"""Structured outputs: what a JSON schema costs a served batch, one `lane serve`, one run.

1. Throughput: 32 concurrent chat requests (SmolLM2, greedy, ``--max-tokens``) with a JSON
   schema against the same 32 unconstrained, alternated over ``--rounds``: output tok/s
   each and their ratio (target >= 0.9).
2. Compile time: xgrammar's compile of the schema for SmolLM2's tokenizer (cold, in-process),
   and of a few schema sizes.
3. The first structured request of the server's life, joining 31 free streams mid-way: the
   others' max inter-token latency, against the same with a free newcomer (the engine makes its
   grammar manager then: the tokenizer, xgrammar and its tables, in the compile thread).
   A new schema while others decode: 31 requests with the warm schema stream; one request
   joins mid-way, with a never-seen schema or the warm one (alternated, 3 each, medians). Its
   TTFT, and the 31 others' P99 inter-token latency, one against the other (target: within
   15 %).
4. Tool calls (the server runs examples/tool_chat_template_hermes.jinja with the hermes
   parser), all with the same two tools in the prompt: 32 ``tool_choice="required"`` requests
   (held to the tools' schema) against the same 32 with ``"none"`` (free text); and 32
   ``"auto"`` against ``"none"`` -- the same prompt and greedy tokens, so their ratio is what
   the streaming tool parser costs.

    python benchmarks/structured.py [--concurrency 32] [--max-tokens 64] [--rounds 2]

The last line is a JSON object of the headline figures.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

import openai

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offline_throughput import check_quiet  # noqa: E402
from peers import free_port  # noqa: E402
from serving import pct, stop, wait_ready  # noqa: E402

TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples",
                        "tool_chat_template_hermes.jinja")


def person_schema(tag: str = "") -> dict:
    return {"type": "object", "additionalProperties": False,
            "required": ["name", "age", "role", "skills" + tag],
            "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
                           "role": {"enum": ["engineer", "teacher", "doctor", "artist"]},
                           "skills" + tag: {"type": "array", "items": {"type": "string", "maxLength": 16},
                                            "maxItems": 4}}}


TOPICS = ["a nurse", "a pilot", "a painter", "a chef", "a teacher", "a coder", "a farmer", "a doctor"]


TOOLS = [{"type": "function", "function": {
    "name": "record_person", "description": "Store a person's profile.", "parameters": person_schema()}},
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                      "parameters": {"type": "object", "required": ["city"],
                                                     "properties": {"city": {"type": "string"}}}}}]


async def one(client, model: str, i: int, max_tokens: int, schema: dict | None, **kw) -> dict:
    """Streams one request: its TTFT, inter-token gaps and output tokens (usage)."""
    if schema is not None:
        kw["response_format"] = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
    t0 = time.perf_counter()
    times, tokens = [], 0
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} as JSON."}],
        max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True}, **kw)
    async for ch in stream:
        if ch.choices and (ch.choices[0].delta.content or ch.choices[0].delta.tool_calls):
            times.append(time.perf_counter())
        if ch.usage is not None:
            tokens = ch.usage.completion_tokens
    return {"ttft": times[0] - t0 if times else None, "gaps": [b - a for a, b in zip(times, times[1:])],
            "tokens": tokens, "end": time.perf_counter()}


async def batch(client, model, n, max_tokens, schema, **kw) -> tuple[float, float]:
    """(output tok/s of the batch, mean per-request decode tok/s). The second is like for like:
    constrained answers end when their JSON does, so the batch's tail thins out."""
    t0 = time.perf_counter()
    res = await asyncio.gather(*(one(client, model, i, max_tokens, schema, **kw) for i in range(n)))
    # tokens after the first chunk over the time after it (a tool-call stream's chunks may hold several)
    per_request = [(r["tokens"] - 1) / sum(r["gaps"]) for r in res if r["gaps"] and r["tokens"] > 1]
    return sum(r["tokens"] for r in res) / (time.perf_counter() - t0), sum(per_request) / len(per_request)


async def newcomer(client, model, n, max_tokens, schema, new_schema) -> dict:
    """n - 1 warm-schema requests; at the first token of theirs, one more with ``new_schema``."""
    first = asyncio.Event()

    async def warm(i):
        r = await one(client, model, i, max_tokens, schema)
        first.set()
        return r

    async def late():
        await asyncio.sleep(0.5)  # the others are decoding by now
        return await one(client, model, n, max_tokens, new_schema)

    tasks = [asyncio.create_task(warm(i)) for i in range(n - 1)] + [asyncio.create_task(late())]
    res = await asyncio.gather(*tasks)
    return {"others": res[:-1], "late": res[-1]}


def compile_times() -> dict:
    import xgrammar as xgr

    from lane.config import ModelConfig

    mc = ModelConfig(None)
    info = xgr.TokenizerInfo.from_huggingface(mc.get_tokenizer(), vocab_size=mc.hf_config.vocab_size)
    out = {}
    for name, schema in (("person", person_schema()),
                         ("person_x8", {"type": "object", "properties": {f"p{i}": person_schema(str(i))
                                                                         for i in range(8)}})):
        comp = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        t0 = time.perf_counter()
        comp.compile_json_schema(json.dumps(schema))
        out[name] = round((time.perf_counter() - t0) * 1000, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    check_quiet()
    compiles = compile_times()
    print(f"xgrammar compile (ms, cold, SmolLM2 tokenizer): {compiles}", flush=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile("w+", prefix="lane-structured-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "lane.entrypoints.cli", "serve", "--port", str(port),
                             "--max-num-seqs", str(args.concurrency),
                             "--chat-template", TEMPLATE, "--enable-auto-tool-choice", "--tool-call-parser", "hermes"], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(url, proc, "lane", 300, log.name)
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)

        async def run_all():
            n, mt = args.concurrency, args.max_tokens
            model = (await client.models.list()).data[0].id
            await batch(client, model, n, mt, None)  # warm-up, free: no structured request yet
            # the first structured request of the server's life joins n - 1 free streams (the engine
            # makes its grammar manager then: tokenizer, xgrammar, its tables); the others' max
            # inter-token gap, against the same with a free newcomer
            first_free = await newcomer(client, model, n, mt, None, None)
            first = await newcomer(client, model, n, mt, None, person_schema("_first"))
            await batch(client, model, n, mt, person_schema())  # the schema's compile
            free, constrained = [], []
            for _ in range(args.rounds):
                free.append(await batch(client, model, n, mt, None))
                constrained.append(await batch(client, model, n, mt, person_schema()))
            warm, new = [], []
            for r in range(3):  # alternated: a never-seen schema each time, or the warm one
                warm.append(await newcomer(client, model, n, mt, person_schema(), person_schema()))
                new.append(await newcomer(client, model, n, mt, person_schema(), person_schema(f"_new{r}")))
            tools = {"required": [], "auto": [], "none": []}
            await batch(client, model, n, mt, None, tools=TOOLS, tool_choice="required")  # its compile
            for _ in range(args.rounds):
                for choice, runs in tools.items():
                    runs.append(await batch(client, model, n, mt, None, tools=TOOLS, tool_choice=choice))
            return free, constrained, warm, new, tools, first_free, first

        free, constrained, warm, new, tools, first_free, first = asyncio.run(run_all())
    finally:
        stop(proc)

    def median(xs):
        return sorted(xs)[len(xs) // 2]

    p99 = {k: median([pct([g for r in run["others"] for g in r["gaps"]], 99) * 1000 for run in v])
           for k, v in (("warm", warm), ("new", new))}
    ttft = {k: median([run["late"]["ttft"] * 1000 for run in v]) for k, v in (("warm", warm), ("new", new))}
    f_tok, c_tok = max(t for t, _ in free), max(t for t, _ in constrained)
    f_req, c_req = max(r for _, r in free), max(r for _, r in constrained)
    first_max = {k: max(g for r in run["others"] for g in r["gaps"]) * 1000
                 for k, run in (("free", first_free), ("structured", first))}
    res = {
        "first_structured_others_max_itl_ms": round(first_max["structured"], 1),
        "first_free_others_max_itl_ms": round(first_max["free"], 1),
        "first_structured_ttft_ms": round(first["late"]["ttft"] * 1000, 1),
        "output_tok_s_free": round(f_tok, 1), "output_tok_s_json_schema": round(c_tok, 1),
        "ratio": round(c_tok / f_tok, 3), "per_request_decode_ratio": round(c_req / f_req, 3),
        "compile_ms_person": compiles["person"], "compile_ms_person_x8": compiles["person_x8"],
        "ttft_ms_warm_schema": round(ttft["warm"], 1), "ttft_ms_new_schema": round(ttft["new"], 1),
        "others_p99_itl_ms_warm": round(p99["warm"], 1), "others_p99_itl_ms_new": round(p99["new"], 1),
        "others_p99_itl_ratio": round(p99["new"] / p99["warm"], 3),
        "tool_required_ratio": round(max(t for t, _ in tools["required"]) / max(t for t, _ in tools["none"]), 3),
        "tool_required_per_request_ratio": round(max(r for _, r in tools["required"])
                                                 / max(r for _, r in tools["none"]), 3),
        "tool_auto_vs_none_ratio": round(max(t for t, _ in tools["auto"]) / max(t for t, _ in tools["none"]), 3),
    }
    print(f"\n{args.concurrency} concurrent, max_tokens {args.max_tokens}: output tok/s free {res['output_tok_s_free']}, "
          f"JSON schema {res['output_tok_s_json_schema']} ({res['ratio']}x; per-request decode rate "
          f"{res['per_request_decode_ratio']}x)")
    print(f"a new schema's own TTFT {res['ttft_ms_new_schema']} ms (warm schema: {res['ttft_ms_warm_schema']} ms); "
          f"the others' P99 ITL {res['others_p99_itl_ms_new']} ms (without it: {res['others_p99_itl_ms_warm']} ms)")
    print(f"the first structured request of the server's life: the others' max ITL "
          f"{res['first_structured_others_max_itl_ms']} ms (a free newcomer instead: "
          f"{res['first_free_others_max_itl_ms']} ms), its own TTFT {res['first_structured_ttft_ms']} ms")
    print(f"tool_choice required: {res['tool_required_ratio']}x none's output tok/s (per request "
          f"{res['tool_required_per_request_ratio']}x); auto (hermes parser) against none, same tokens: "
          f"{res['tool_auto_vs_none_ratio']}x")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
