"""The ``lane`` command: generate, serve, proxy, bench, trace, explain, tiny-model, build-kernels."""
from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys

from lane.logger import set_level


def parse_bytes(text: str) -> int:
    """'4G', '512MiB', '1e9' or a plain integer -> bytes."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]?)(i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4G, 512M, 1073741824)")
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2).upper()]
    return int(float(m.group(1)) * scale)


# lane serve's step budget: a wave of 256-token prompts then reaches its first tokens 36-40 % sooner
# at 8 and 32 streams than at 2048, for the same tok/s (benchmarks/scheduler_budget.py, issue 30)
SERVE_MAX_NUM_BATCHED_TOKENS = 512


def add_engine_args(p: argparse.ArgumentParser, serve: bool = False) -> None:
    """Engine flags, spelled as vLLM spells them (``serve``: lane serve's defaults, tuned for latency
    under load; vLLM's serve and offline defaults differ too)."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="HF model directory or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 on CPUs with AVX512-BF16/AMX, else float32")
    g.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "w8a8"],
                   help="auto (default): a GGUF's Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K weights stay in their blocks, multiplied by "
                        "integer kernels (a fifth of the memory of float32, faster decode); none: dequantized at "
                        "load to --dtype; int8: a safetensors checkpoint's linear and expert weights quantized "
                        "to int8 per output channel at load (W8A16); w8a8: the same, and activations quantized "
                        "to int8 per token (int8 GEMMs)")
    g.add_argument("--device", default="auto",
                   help="auto or cpu: lane runs on the CPU (its CUDA path is not built yet: other devices are refused)")
    g.add_argument("--threads", type=int, default=None,
                   help="threads of torch and the CPU kernels (default and most: the CPUs this process may use)")
    g.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV block (default 16, or a multiple of a compressed model's rates)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--max-num-batched-tokens", type=int, default=SERVE_MAX_NUM_BATCHED_TOKENS if serve else 2048,
                   help="token budget per step: prompt chunks and decode rows together (default: 2048; "
                        f"{SERVE_MAX_NUM_BATCHED_TOKENS} for lane serve, where smaller chunks let a wave of "
                        "prompts reach their first tokens sooner)")
    g.add_argument("--max-num-seqs", type=int, default=128, help="running requests at most")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--kv-cache-memory-bytes", type=parse_bytes, default=None,
                   help="KV cache budget (default: a quarter of free RAM, at most 4 GiB)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8_e4m3"],
                   help="KV cache storage: auto (the model dtype), or 8 bits with a scale per token and KV head "
                        "(C8), dequantized block by block inside the attention kernels")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                   help='prefill/decode disaggregation: the KV connector and this engine\'s role, e.g. '
                        '\'{"kv_connector": "ExampleConnector", "kv_role": "kv_both", '
                        '"kv_connector_extra_config": {"shared_storage_path": "/tmp/lane-kv"}}\'')
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\' '
                        'or \'{"method": "mtp", "num_speculative_tokens": 2}\'')
    d = p.add_argument_group("parallelism")
    d.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks each model replica is split over (attention heads, FFN, experts, vocabulary)")
    d.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="model replicas, each its own engine with its own tensor-parallel ranks (lane serve)")
    d.add_argument("--enable-expert-parallel", action="store_true",
                   help="the tensor-parallel ranks hold whole experts (num_experts / tp each), not a slice of each")
    add_eplb_args(d)
    d.add_argument("--enable-sequence-parallel", action="store_true",
                   help="sequence parallelism (needs -tp > 1): between attention and the FFN each rank holds only "
                        "its rows; the all-reduces become reduce-scatters and all-gathers, norms run on 1/tp of the rows")
    d.add_argument("--enable-dsa-cp", action="store_true",
                   help="DSA context parallelism (V3.2 / V4 sparse layers, needs -tp > 1): in a prefill step each rank "
                        "runs the lightning indexer and sparse attention for its share of the rows, every head")
    d.add_argument("--distributed-executor-backend", choices=["mp", "ray"], default=None,
                   help="mp (default past one rank): a process per rank; ray: Ray actors on a running cluster")
    d.add_argument("--nnodes", type=int, default=1, help="machines one replica's ranks span (mp backend)")
    d.add_argument("--node-rank", type=int, default=0, help="this machine's index among --nnodes")
    d.add_argument("--master-addr", default="127.0.0.1", help="node 0's address (torch.distributed rendezvous)")
    d.add_argument("--master-port", type=int, default=29500,
                   help="node 0's rendezvous port with --nnodes > 1 (+1 and +2 carry the engine's messages); "
                        "one machine picks free ports itself")
    d.add_argument("--rpc-secret-file", default=None, metavar="FILE",
                   help="with --nnodes > 1: the secret that signs every message between the machines (default "
                        "~/.cache/lane/rpc-secret, or LANE_RPC_SECRET); node 0 writes one where none exists, "
                        "headless nodes need the same")
    d.add_argument("--worker-timeout", type=float, default=60.0,
                   help="seconds a step may take on the workers before the engine fails")


def add_eplb_args(group) -> None:
    group.add_argument("--enable-eplb", action="store_true",
                       help="expert-parallel load balancing (needs --enable-expert-parallel): count each expert's "
                            "tokens, replicate the hot ones and move their weights between ranks while serving")
    group.add_argument("--eplb-config", default=None, metavar="JSON",
                       help='EPLB\'s settings (vLLM\'s fields), e.g. \'{"window_size": 1000, "step_interval": 3000, '
                            '"num_redundant_experts": 0, "log_balancedness": false, "log_balancedness_interval": 1, '
                            '"use_async": false}\'')


def engine_args(args: argparse.Namespace, show_progress: bool = True):
    from lane.config import EngineArgs

    return EngineArgs(args.model, show_progress=show_progress, **engine_kwargs(args))


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(dtype=args.dtype, threads=args.threads, block_size=args.block_size,
                enable_prefix_caching=args.enable_prefix_caching,
                max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                max_model_len=args.max_model_len, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                kv_cache_dtype=args.kv_cache_dtype, seed=args.seed, quantization=args.quantization, tensor_parallel_size=args.tensor_parallel_size,
                data_parallel_size=args.data_parallel_size, enable_expert_parallel=args.enable_expert_parallel,
                distributed_executor_backend=args.distributed_executor_backend, nnodes=args.nnodes,
                node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port,
                worker_timeout=args.worker_timeout, speculative_config=args.speculative_config,
                enable_eplb=args.enable_eplb, eplb_config=args.eplb_config,
                enable_sequence_parallel=args.enable_sequence_parallel, enable_dsa_cp=args.enable_dsa_cp,
                kv_transfer_config=args.kv_transfer_config,
                device=None if args.device == "auto" else args.device, rpc_secret_file=args.rpc_secret_file)


def cmd_generate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from lane import LLM, SamplingParams
    from lane.sampling_params import ParamError

    try:
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
            max_tokens=args.max_tokens, seed=args.sample_seed, stop=args.stop or None,
            ignore_eos=args.ignore_eos, repetition_penalty=args.repetition_penalty)
    except ParamError as e:
        parser.error(f"--{e.param.replace('_', '-')}: {e}")
    if args.quiet:
        set_level(logging.WARNING)
        os.environ["LANE_LOGGING_LEVEL"] = "WARNING"  # worker processes too
    try:
        llm = LLM(args.model, show_progress=not args.quiet, **engine_kwargs(args))
    except (ValueError, FileNotFoundError, TypeError) as e:
        parser.error(str(e))
    try:
        prompt = ({"prompt_token_ids": llm.apply_chat_template([{"role": "user", "content": args.prompt}])}
                  if args.chat else args.prompt)
        if not args.chat:
            print(args.prompt, end="", flush=True)
        for delta in llm.stream(prompt, params):
            print(delta, end="", flush=True)
        print()
    except ValueError as e:
        parser.error(str(e))
    finally:
        llm.shutdown()
    return 0


def chat_options(args: argparse.Namespace, parser: argparse.ArgumentParser):
    """The chat route's flags, checked: a template file that exists and parses, parser names
    that exist, auto tool choice with its parser."""
    from lane.entrypoints.openai_serving import ChatOptions

    template = None
    if args.chat_template is not None:
        if os.path.isfile(args.chat_template):
            with open(args.chat_template, encoding="utf-8") as f:
                template = f.read()
        elif "{{" in args.chat_template or "{%" in args.chat_template:  # given inline, as vLLM allows
            template = args.chat_template
        else:
            parser.error(f"--chat-template {args.chat_template!r} is not a file (nor a Jinja template)")
        try:
            import jinja2

            jinja2.Environment().parse(template)
        except jinja2.TemplateSyntaxError as e:
            parser.error(f"--chat-template: not a valid Jinja template: {e}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser (e.g. hermes, deepseek_v3)")
    return ChatOptions(template, args.enable_auto_tool_choice, args.tool_call_parser, args.reasoning_parser)


def cmd_build_kernels() -> int:
    import time

    from lane import platform
    from lane.model_executor.layers import cpu_kernels

    set_level("INFO")  # the build's progress lines
    t0 = time.perf_counter()
    if os.environ.get("LANE_CPU_KERNELS", "1") == "0":
        print("LANE_CPU_KERNELS=0: the kernels are off; nothing to build", file=sys.stderr)
        return 0
    if not cpu_kernels.build():  # not an error: lane runs its torch paths (the install goes on)
        print("the CPU kernels could not be built (see the warning above); lane will run its torch paths",
              file=sys.stderr)
        return 0
    print(f"CPU kernels for {platform.cpu_isa()} ready in {cpu_kernels.cache_root()} "
          f"({time.perf_counter() - t0:.1f} s)")
    return 0


def cmd_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from lane import platform
    from lane.config import EngineArgsError, KVTransferConfig, SpeculativeConfig
    from lane.entrypoints import event_loop
    from lane.entrypoints.api_server import serve

    if not 0 < args.port < 65536:
        parser.error(f"--port must be in [1, 65535], got {args.port}")
    if args.data_parallel_size < 1:
        parser.error(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    if args.max_num_waiting_requests < 1:
        parser.error(f"--max-num-waiting-requests must be >= 1, got {args.max_num_waiting_requests}")
    api_key = args.api_key or os.environ.get("LANE_API_KEY") or None
    try:
        eargs = engine_args(args)
        eargs.enable_tracing, eargs.trace_layers = args.trace or args.trace_layers, args.trace_layers
        pc = eargs.create_parallel_config()
        platform.check_device(eargs.device)
        SpeculativeConfig.parse(eargs.speculative_config)  # its syntax now; what the model allows at start
        KVTransferConfig.parse(eargs.kv_transfer_config)
    except (ValueError, FileNotFoundError, TypeError) as e:
        parser.error(str(e))
    if args.headless != (pc.node_rank > 0):
        parser.error("--headless goes with --node-rank > 0 (node 0 runs the engine and the API server)"
                     if args.headless else f"--node-rank {pc.node_rank} runs workers only: add --headless")
    if args.headless:
        from lane.executor.multiproc_executor import run_headless

        signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
        try:
            return run_headless(eargs)
        except (ValueError, FileNotFoundError) as e:
            parser.error(str(e))
    # uvicorn traps SIGTERM, drains, then re-raises it at the handler found before it:
    # make that one an orderly exit, so serve() still stops the engine processes
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    chat = chat_options(args, parser)
    try:
        event_loop.run(serve(eargs, args.host, args.port, data_parallel_size=args.data_parallel_size,
                          served_model_name=args.served_model_name, api_key=api_key,
                          trace_max_requests=args.trace_max_requests,
                          max_num_waiting_requests=args.max_num_waiting_requests, chat=chat))
    except KeyboardInterrupt:
        pass
    except EngineArgsError as e:  # a bad --model or --max-model-len, found while the engines start
        parser.error(str(e))
    except (RuntimeError, TimeoutError, ValueError) as e:
        print(f"lane serve: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_trace(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from lane.tracing.client import run

    if args.prompt_file:
        if not os.path.isfile(args.prompt_file):
            parser.error(f"--prompt-file {args.prompt_file!r} is not a file")
        with open(args.prompt_file) as f:
            args.prompt = f.read()
    if args.prompt is None and args.request_id is None:
        parser.error("give a PROMPT (or --prompt-file) to send, or --request-id of a request already served")
    if args.max_tokens < 1:
        parser.error(f"--max-tokens must be >= 1, got {args.max_tokens}")
    try:
        json_path, html_path, trace = run(args.base_url, args.prompt, args.request_id, args.model,
                                          args.max_tokens, args.chat, args.output_dir, args.api_key)
    except Exception as e:  # network errors, a server without --trace: say so, no traceback
        print(f"lane trace: {e}", file=sys.stderr)
        return 1
    from lane.tracing import coverage_line

    recorded = [s for s in trace["spans"] if not s.get("skipped")]
    print(f"request {trace['request_id']}: {len(recorded)} spans")
    print(coverage_line(trace["spans"]))
    print(f"wrote {json_path} (Perfetto / chrome://tracing) and {html_path}")
    return 0


def cmd_bench_compare(argv: list[str]) -> int:
    from lane.bench.report import compare

    p = argparse.ArgumentParser(prog="lane bench compare",
                                description="two benchmark runs side by side (lane bench or vllm bench JSON)")
    p.add_argument("run_a")
    p.add_argument("run_b")
    args = p.parse_args(argv)
    for path in (args.run_a, args.run_b):
        if not os.path.isfile(path):
            p.error(f"{path!r} is not a file")
    try:
        print(compare(args.run_a, args.run_b))
    except ValueError as e:  # not JSON
        p.error(str(e))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["bench", "compare"]:
        return cmd_bench_compare(argv[2:])
    parser = argparse.ArgumentParser(prog="lane", description="lane: an LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--quiet", action="store_true", help="no progress bars or start-up log, only warnings")
    add_engine_args(gen)

    srv = sub.add_parser("serve", help="start the OpenAI-compatible API server")
    srv.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                     help="model (same as --model), as `vllm serve MODEL` takes it")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--served-model-name", nargs="+", default=None,
                     help="names the API accepts for the model (default: the model's file or directory name)")
    srv.add_argument("--headless", action="store_true",
                     help="with --nnodes > 1 and --node-rank > 0: run this machine's worker ranks only (no API server)")
    srv.add_argument("--max-num-waiting-requests", type=int, default=1024,
                     help="requests an engine may have waiting; past it new requests get 503 with Retry-After")
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or set LANE_API_KEY)")
    srv.add_argument("--trace", action="store_true",
                     help="record every request's steps (GET /v1/traces/ID, lane trace)")
    srv.add_argument("--trace-layers", action="store_true", help="with --trace: one span per layer, not per forward")
    srv.add_argument("--trace-max-requests", type=int, default=100, help="with --trace: traces kept")
    from lane.entrypoints.tool_parsers import REASONING_PARSERS, TOOL_PARSERS

    c = srv.add_argument_group("chat")
    c.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template (a file, or the template itself) used instead of the model's")
    c.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto": the model decides to call tools, --tool-call-parser reads its calls')
    c.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                   help="the model's tool-call format")
    c.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                   help="split the model's thinking into reasoning_content")
    add_engine_args(srv, serve=True)

    from lane.bench.benchmark import add_cli_args as add_bench_args

    bench = sub.add_parser("bench", help="benchmark an OpenAI-compatible server (vllm bench serve's flags); "
                                         "`lane bench compare A.json B.json` compares two runs")
    add_bench_args(bench)
    tr = sub.add_parser("trace", help="trace one request through a `lane serve --trace`: trace.json + trace.html")
    tr.add_argument("prompt", nargs="?", default=None, help="the prompt to send (or give --request-id)")
    tr.add_argument("--base-url", default="http://127.0.0.1:8000", help="server URL without /v1")
    tr.add_argument("--request-id", default=None, help="fetch the trace of a request already served")
    tr.add_argument("--prompt-file", default=None, help="read the prompt from this file")
    tr.add_argument("--model", default=None, help="model name (default: the server's first)")
    tr.add_argument("--max-tokens", type=int, default=32)
    tr.add_argument("--chat", action="store_true", help="send it to /v1/chat/completions")
    tr.add_argument("--output-dir", default=".", help="where trace.json and trace.html go")
    tr.add_argument("--api-key", default=os.environ.get("LANE_API_KEY"))
    px = sub.add_parser("proxy", help="one OpenAI endpoint in front of prefill and decode lane serve instances "
                                      "(PD disaggregation)")
    px.add_argument("--host", default="127.0.0.1")
    px.add_argument("--port", type=int, default=8000)
    px.add_argument("--prefiller-hosts", nargs="+", default=["127.0.0.1"])
    px.add_argument("--prefiller-ports", nargs="+", type=int, required=True)
    px.add_argument("--decoder-hosts", nargs="+", default=["127.0.0.1"])
    px.add_argument("--decoder-ports", nargs="+", type=int, required=True)
    px.add_argument("--health-interval", type=float, default=1.0,
                    help="seconds between two /health checks of every instance (step 57 in a trace)")
    ex = sub.add_parser("explain", help="which implementation and attention backend a model gets, and its KV layout")
    ex.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                    help="HF model directory or .gguf file (default: the embedded SmolLM2)")
    ex.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ex.add_argument("--block-size", type=int, default=None)
    ex.add_argument("--kv-cache-memory-bytes", type=parse_bytes, default=None)
    ex.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8_e4m3"],
                    help="the cache's bytes per token stored in 8 bits (C8) rather than the model dtype")
    ex.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "w8a8"],
                    help="the weights' resident memory under this --quantization (as lane serve takes it)")
    ex.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                    help="the cache layout with prefix caching on (default) or off")
    ex.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                    help="show the layout over this many ranks: who holds which heads, experts, vocabulary rows")
    ex.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                    help="with --enable-expert-parallel: replicas whose attention is data parallel, the experts "
                         "spread over every replica's ranks")
    ex.add_argument("--enable-expert-parallel", action="store_true")
    add_eplb_args(ex)

    tm = sub.add_parser("tiny-model", help="write a small random checkpoint of an architecture (SmolLM2's tokenizer)")
    tm.add_argument("arch", choices=["llama", "qwen3", "qwen3_moe", "kimi_linear", "deepseek_v3", "deepseek_v32",
                                    "glm_moe_dsa", "deepseek_v4"])
    tm.add_argument("out_dir")
    tm.add_argument("--seed", type=int, default=0)
    tm.add_argument("--fp8", action="store_true",
                    help="DeepSeek V3 / V3.2 only: store linear weights FP8 block-quantised (weight_scale_inv), as released")
    tm.add_argument("--shape", default=None, choices=["llama-3.2-1b", "llama-3.2-3b"],
                    help="llama only: a full-size random Llama of this Llama-3.2 shape (SmolLM2's vocabulary), "
                         "in bf16, written one tensor at a time")
    tm.add_argument("--seed-shape", action="store_true",
                    help="deepseek_v4 only: V4-Flash's layer pattern scaled down (2 sliding-window layers, then CSA "
                         "and HCA alternating, HCA rate 128; 6 layers), the seed deployment's model")
    tm.add_argument("--mtp-draft", default=None, metavar="DIR",
                    help="DeepSeek only: write the MTP layers as a separate draft checkpoint here (DeepSeekMTPModel / "
                         "DeepSeekV4MTPModel), for --speculative-config '{\"method\": \"mtp\", \"model\": DIR}'")
    sub.add_parser("build-kernels", help="compile the CPU kernels for this CPU now (the install's last step), "
                                         "so the first `lane serve` finds them cached")
    args = parser.parse_args(argv)
    if args.command == "build-kernels":
        return cmd_build_kernels()
    if args.command == "explain":
        from lane.entrypoints.explain import explain

        if args.block_size is not None and args.block_size < 1:
            ex.error(f"--block-size must be >= 1, got {args.block_size}")
        try:
            print(explain(args.model_tag, args.dtype, args.block_size, args.kv_cache_memory_bytes,
                          args.enable_prefix_caching, args.quantization, args.tensor_parallel_size,
                          args.enable_expert_parallel, args.enable_eplb, args.eplb_config,
                          args.data_parallel_size, args.kv_cache_dtype))
        except (ValueError, FileNotFoundError, OSError) as e:
            ex.error(str(e))
        return 0
    if args.command == "tiny-model":
        from lane.entrypoints.tiny_model import write_tiny_model

        try:
            out = write_tiny_model(args.arch, args.out_dir, args.seed, fp8=args.fp8, shape=args.shape,
                                   seed_shape=args.seed_shape)
            print(f"wrote {out}")
            if args.mtp_draft:
                from lane.entrypoints.tiny_model import split_mtp_draft

                print(f"wrote the MTP draft {split_mtp_draft(args.out_dir, args.mtp_draft)} (the target keeps none)")
        except ValueError as e:
            tm.error(str(e))
        return 0
    if args.command == "trace":
        return cmd_trace(args, tr)
    if args.command == "proxy":
        from lane.entrypoints.proxy import run as run_proxy, urls

        if not 0 < args.port < 65536:
            px.error(f"--port must be in [1, 65535], got {args.port}")
        if not 0 < args.health_interval <= 3600:
            px.error(f"--health-interval must be in (0, 3600] seconds, got {args.health_interval}")
        try:
            prefill = urls(args.prefiller_hosts, args.prefiller_ports, "prefiller")
            decode = urls(args.decoder_hosts, args.decoder_ports, "decoder")
        except ValueError as e:
            px.error(str(e))
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        run_proxy(args.host, args.port, prefill, decode, args.health_interval)
        return 0
    if args.command == "generate":
        return cmd_generate(args, gen)
    if args.command == "serve":
        if args.model_tag is not None:
            if args.model is not None and args.model != args.model_tag:
                srv.error("give the model either as MODEL or as --model, not both")
            args.model = args.model_tag
        return cmd_serve(args, srv)
    if args.command == "bench":
        from lane.bench.benchmark import main as bench_main

        return bench_main(args, bench)
    return 2


if __name__ == "__main__":
    sys.exit(main())
