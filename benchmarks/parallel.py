"""Tensor / expert parallelism's cost: per decode step, the time spent in collectives and
the bytes they move at TP > 1 and EP = 2, and decode throughput against TP = 1, all in one
run on the same machine: SmolLM2 (GGUF; its 9 heads split over 3 ranks, TP=2 is refused)
and the random DeepSeek V3.2 and V4 of moe_decode.py / v4_decode.py at TP=2 and EP=2.

On 2 cores no speed-up is expected (the ranks share the cores; TP=3 puts two on one):
this measures the overhead honestly. Decode figures are (time for 1 + N tokens) - (time
for 1 token), so prefill cancels out; collective figures are the same difference of the
ranks' own counters (rank 0's), divided by N decode steps. From the per-collective
figures it projects TP=16: a ring all-reduce over n ranks takes 2(n-1) latency steps and
moves 2(n-1)/n of the tensor per rank, so from n ranks to 16 a collective's time grows by
(15/16)/((n-1)/n) if bandwidth-bound (x1.9 from TP=2) and by 15/(n-1) if latency-bound (x15).

    python benchmarks/parallel.py [--batch-sizes 1,8] [--new-tokens 32] [--models smollm,v32,v4] [--no-dp]

It also measures, in the same run: each collective through shared memory against gloo and a
memcpy of the same bytes (2 and 3 ranks); every TP layout with sequence parallelism ("SP"),
with DSA context parallelism on the sparse models ("SP+CP"; prompts longer than index_topk
make the indexer select) and with gloo's collectives instead of shared memory ("gloo"); prefill
time against TP=1; and ``lane serve -dp 2 --enable-expert-parallel`` (lock-step, all-to-all)
against two independent replicas on the V4 model.

The last line is a JSON object of the headline figures.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_decode import CONFIG as V32_CONFIG, MODEL_DIR as V32_DIR, cached_model, prompts  # noqa: E402
from offline_throughput import check_quiet  # noqa: E402
from v4_decode import CONFIG as V4_CONFIG, MODEL_DIR as V4_DIR  # noqa: E402

from lane.tracing import STEPS  # noqa: E402



def tp16_factors(n: int) -> tuple[float, float]:
    """(bandwidth-bound, latency-bound) growth of a ring all-reduce's time from n ranks to 16."""
    return (15 / 16) / ((n - 1) / n), 15 / (n - 1)


COLLECTIVE_SIZES = [8 << 10, 64 << 10, 1 << 20]


def _transfer_floor(rank: int, nbytes: int, shared, res: dict) -> None:
    """The two ways n bytes can reach a rank from another core, timed on rank 0: reading them
    cold from DRAM (each time a fresh slice of a 1 GiB buffer, written first: its start is long
    out of any cache) and reading what rank 1 has just written (its cache lines move over). An all-reduce at 2 ranks can beat neither: each
    rank must receive the other's whole tensor's worth (half in a reduce-scatter, half in the
    all-gather), so its time is at least the faster of the two."""
    import torch
    import torch.distributed as dist

    n, reps = nbytes // 4, 200
    y = torch.empty(n)
    if rank == 0:
        cold = torch.ones(max(n * reps, 256 << 20))
        t0 = time.perf_counter()
        for i in range(reps):
            y.copy_(cold[i * n:(i + 1) * n])
        res[("cold read", nbytes)] = (time.perf_counter() - t0) / reps * 1e6
        del cold
    took = 0.0
    for i in range(reps):
        if rank == 1:
            shared[:n].fill_(float(i))  # plain stores, as a layer writes its output
        dist.barrier()
        if rank == 0:
            t0 = time.perf_counter()
            y.copy_(shared[:n])
            took += time.perf_counter() - t0
        dist.barrier()
    if rank == 0:
        res[("peer read", nbytes)] = took / reps * 1e6


def _floor_rank(rank: int, world: int, port: int, sizes: list[int], out, shared) -> None:
    import torch
    import torch.distributed as dist

    from lane.distributed.parallel_state import GroupCoordinator
    from lane.distributed.shm_comm import ShmCommunicator

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    shm = ShmCommunicator.create(dist.group.WORLD, world, rank, 60.0)
    ranks = list(range(world))
    groups = {"gloo": GroupCoordinator("tp", ranks, rank, dist.group.WORLD),
              "shm": GroupCoordinator("tp", ranks, rank, dist.group.WORLD, shm)} if shm else {
        "gloo": GroupCoordinator("tp", ranks, rank, dist.group.WORLD)}
    res: dict = {}
    for nbytes in sizes:
        x, y = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
        t0 = time.perf_counter()
        for _ in range(200):
            y.copy_(x)
        res[("memcpy", nbytes)] = (time.perf_counter() - t0) / 200 * 1e6
        _transfer_floor(rank, nbytes, shared, res)
        for kind, g in groups.items():
            ops = {"all_reduce": lambda: g.all_reduce(x, 0), "all_gather": lambda: g.all_gather(x, 0, dim=0),
                   "reduce_scatter": lambda: g.reduce_scatter(x, [x.shape[0] // world + (r < x.shape[0] % world)
                                                                   for r in range(world)], 0)}
            for op, fn in ops.items():
                for _ in range(20):
                    fn()
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(200):
                    fn()
                res[(f"{kind} {op}", nbytes)] = (time.perf_counter() - t0) / 200 * 1e6
    if rank == 0:
        out.put(res)
    dist.destroy_process_group()


def collective_floor(world: int) -> dict[tuple[str, int], float]:
    """(what, bytes) -> microseconds of a bare collective between ``world`` processes on this
    machine (nothing else running), through gloo and through shared memory, and of a memcpy of
    the same bytes: the latency every collective of a step pays at least."""
    import socket

    import torch
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # as lane's ranks on one machine
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    shared = torch.empty(max(COLLECTIVE_SIZES) // 4).share_memory_()  # rank 1 writes, rank 0 reads
    procs = [ctx.Process(target=_floor_rank, args=(r, world, port, COLLECTIVE_SIZES, q, shared))
             for r in range(world)]
    for p in procs:
        p.start()
    res = q.get(timeout=600)
    for p in procs:
        p.join()
    return res


def run_tokens(llm, ids, n: int) -> float:
    from lane import SamplingParams

    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in ids], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                 use_tqdm=False)
    return time.perf_counter() - t0


def stats_of(llm) -> dict[int, tuple[int, int, float]]:
    if llm.engine.worker is not None:  # one rank: no collectives
        return {}
    return llm.engine.executor.collective_rpc("collective_stats", unique_reply_rank=0)


def measure(model: str, layout: dict, batch: int, prompt_len: int, new: int, repeats: int, dtype: str) -> dict:
    from lane import LLM

    layout = dict(layout)
    gloo = layout.pop("gloo", False)  # the ranks' collectives over gloo's loopback TCP, not shared memory
    saved = os.environ.get("LANE_SHM_COLLECTIVES")
    if gloo:
        os.environ["LANE_SHM_COLLECTIVES"] = "0"  # the spawned workers inherit it
    try:
        llm = LLM(model, dtype=dtype, show_progress=False, max_num_seqs=max(8, batch), **layout)
    finally:
        if gloo:
            os.environ.pop("LANE_SHM_COLLECTIVES") if saved is None else os.environ.update(LANE_SHM_COLLECTIVES=saved)
    try:
        ids = prompts(batch, prompt_len)
        run_tokens(llm, ids, 2)  # warm-up
        best, per_step, prefill = float("inf"), {}, float("inf")
        for _ in range(repeats):
            stats_of(llm)  # reset
            t1 = run_tokens(llm, ids, 1)
            prefill = min(prefill, t1)
            s1 = stats_of(llm)
            tn = run_tokens(llm, ids, 1 + new)
            sn = stats_of(llm)
            if tn - t1 < best:
                best = tn - t1
                per_step = {STEPS[step].span: dict(calls=(sn[step][0] - s1.get(step, (0, 0, 0))[0]) / new,
                                                   bytes=(sn[step][1] - s1.get(step, (0, 0, 0))[1]) / new,
                                                   ms=(sn[step][2] - s1.get(step, (0, 0, 0))[2]) * 1e3 / new)
                            for step in sn}
        step_ms = best * 1e3 / new
        return dict(tok_s=batch * new / best, step_ms=step_ms, collectives=per_step, prefill_ms=prefill * 1e3,
                    comm_ms=sum(c["ms"] for c in per_step.values()))
    finally:
        llm.shutdown()


def data_parallel(model: str, n: int, prompt_len: int, new: int) -> dict:
    """Output tok/s of ``lane serve -dp 2`` with the experts over both replicas (lock-step,
    all-to-all) against two independent replicas (each its own experts), n concurrent requests."""
    import concurrent.futures as cf

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from utils import RemoteServer  # noqa: E402  (the tests' server runner: a free port, health-waited)

    out = {}
    ids = prompts(n, prompt_len)
    for label, extra in (("independent", []), ("wide EP", ["--enable-expert-parallel"])):
        print(f"[v4 serve -dp 2] {label} ...", flush=True)
        with RemoteServer(["--model", model, "--dtype", "float32", "--served-model-name", "m", "-dp", "2",
                           "--max-model-len", str(prompt_len + new + 8), *extra]) as s:
            c = s.client()

            def one(p):
                return c.completions.create(model="m", prompt=p, max_tokens=new, temperature=0,
                                            extra_body={"ignore_eos": True}).usage.completion_tokens

            one(ids[0][:8])  # warm-up
            t0 = time.perf_counter()
            with cf.ThreadPoolExecutor(n) as ex:
                tokens = sum(ex.map(one, ids))
            out[label] = tokens / (time.perf_counter() - t0)
        print(f"  {out[label]:.1f} output tok/s", flush=True)
    out["wide_ep_vs_independent"] = round(out["wide EP"] / out["independent"], 3)
    print(f"  -dp 2 --enable-expert-parallel: {out['wide_ep_vs_independent']:.2f}x two independent replicas")
    return {k: round(v, 2) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--models", default="smollm,v32,v4")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--dp", action=argparse.BooleanOptionalAction, default=True,
                    help="serve tiny V4 with -dp 2 --enable-expert-parallel against two independent replicas")
    ap.add_argument("--dp-requests", type=int, default=16)
    args = ap.parse_args()
    check_quiet()
    def tp(n: int, cp: bool = False, **kw) -> list[tuple[str, dict]]:
        """shm collectives; + sequence parallelism (+ DSA context parallelism); gloo instead."""
        out = [(f"TP={n}", dict(tensor_parallel_size=n, **kw)),
               (f"TP={n} SP", dict(tensor_parallel_size=n, enable_sequence_parallel=True, **kw)),
               (f"TP={n} gloo", dict(tensor_parallel_size=n, gloo=True, **kw))]
        if cp:
            out.insert(2, (f"TP={n} SP+CP", dict(tensor_parallel_size=n, enable_sequence_parallel=True,
                                                 enable_dsa_cp=True, **kw)))
        return out

    models = {"smollm": (None, [("TP=1", {}), *tp(3)]),
              "v32": (cached_model("deepseek_v32", V32_DIR, V32_CONFIG),
                      [("TP=1", {}), *tp(2, cp=True), ("EP=2", dict(tensor_parallel_size=2, enable_expert_parallel=True))]),
              "v4": (cached_model("deepseek_v4", V4_DIR, V4_CONFIG),
                     [("TP=1", {}), *tp(2, cp=True),
                      ("EP=2", dict(tensor_parallel_size=2, enable_expert_parallel=True))])}
    headline: dict = {}
    for world in (2, 3):
        floor = collective_floor(world)
        print(f"collectives between {world} processes on this machine (us a call; ratio: gloo / shm):")
        for nbytes in COLLECTIVE_SIZES:
            cells = []
            for op in ("all_reduce", "all_gather", "reduce_scatter"):
                g, m = floor[(f"gloo {op}", nbytes)], floor.get((f"shm {op}", nbytes))
                cells.append(f"{op} gloo {g:7.1f} shm {m:6.1f} ({g / m:4.1f}x)" if m else f"{op} gloo {g:7.1f}")
            print(f"  {nbytes / 1024:6.0f} KiB  memcpy {floor[('memcpy', nbytes)]:6.1f}  " + "  ".join(cells),
                  flush=True)
        if world == 2:
            # what no 2-rank all-reduce can beat here (_transfer_floor), against the target's 2x memcpy
            for nbytes in COLLECTIVE_SIZES:
                cold, peer, mc = floor[("cold read", nbytes)], floor[("peer read", nbytes)], floor[("memcpy", nbytes)]
                best = min(cold, peer)
                print(f"  {nbytes / 1024:6.0f} KiB  the other rank's bytes: a cold read {cold:6.1f}, a read of what it "
                      f"wrote {peer:6.1f} us: an all-reduce takes at least {best:6.1f} us = {best / mc:4.1f}x memcpy "
                      f"(shm all-reduce {floor[('shm all_reduce', nbytes)] / mc:4.1f}x)")
                headline[f"all_reduce_floor_over_memcpy_{nbytes >> 10}KiB"] = round(best / mc, 2)
                headline[f"shm_all_reduce_over_memcpy_{nbytes >> 10}KiB"] = round(
                    floor[("shm all_reduce", nbytes)] / mc, 2)
        headline[f"collectives_us_{world}ranks"] = {f"{k} {b}": round(us, 1) for (k, b), us in floor.items()}
    for name in filter(None, args.models.split(",")):
        model, layouts = models[name]
        for batch in map(int, args.batch_sizes.split(",")):
            base = None
            for label, layout in layouts:
                print(f"[{name} batch {batch}] {label} ...", flush=True)
                r = measure(model, layout, batch, args.prompt_len, args.new_tokens, args.repeats, args.dtype)
                base = base or r
                ratio = r["tok_s"] / base["tok_s"]
                rows = ""
                if layout.get("enable_sequence_parallel"):
                    from lane.distributed.parallel_state import row_splits

                    rows = f", prefill rows per rank {row_splits(batch * args.prompt_len, layout['tensor_parallel_size'])}"
                print(f"  decode {r['tok_s']:8.1f} tok/s ({ratio:.2f}x TP=1), {r['step_ms']:.2f} ms a step, "
                      f"collectives {r['comm_ms']:.2f} ms a step ({r['comm_ms'] / r['step_ms']:.0%}); prefill "
                      f"{r['prefill_ms']:.1f} ms ({base['prefill_ms'] / r['prefill_ms']:.2f}x TP=1){rows}")
                for span, c in r["collectives"].items():
                    if c["calls"] < 0.5:  # a prefill-only collective (DSA-CP's): none in decode steps
                        continue
                    print(f"    {span:<20} {c['calls']:5.1f} calls {c['bytes'] / 1024:9.1f} KiB {c['ms']:7.3f} ms "
                          f"a step ({c['ms'] / max(c['calls'], 1e-9) * 1e3:6.1f} us a call)")
                if label != "TP=1":
                    comm = r["comm_ms"]
                    bw, lat = tp16_factors(layout["tensor_parallel_size"])
                    headline[f"{name}_b{batch}_{label}"] = dict(
                        ratio_vs_tp1=round(ratio, 3), step_ms=round(r["step_ms"], 3),
                        prefill_ratio_vs_tp1=round(base["prefill_ms"] / r["prefill_ms"], 3),
                        comm_ms_per_step=round(comm, 3),
                        comm_share=round(comm / r["step_ms"], 3),
                        bytes_per_step=int(sum(c["bytes"] for c in r["collectives"].values())),
                        tp16_comm_ms_per_step=[round(comm * bw, 3), round(comm * lat, 3)])
    if args.dp:
        headline["dp"] = data_parallel(cached_model("deepseek_v4", V4_DIR, V4_CONFIG), args.dp_requests,
                                       args.prompt_len, args.new_tokens)
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
