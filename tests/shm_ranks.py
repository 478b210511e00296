"""One rank of the shared-memory collective tests (tests/test_shm_collectives.py starts
``world`` of these as real processes): every op through shared memory against gloo's
result on the same inputs, and what happens when a peer dies or stalls."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from lane.distributed.parallel_state import GroupCoordinator
from lane.distributed.shm_comm import CollectiveError, ShmCommunicator

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64]


def _inputs(rank: int, n: int, dtype: torch.dtype, cols: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + n)
    return torch.randint(-50, 50, (n, cols), generator=g).to(dtype)  # small integers: every sum exact


def check_ops(shm_group: GroupCoordinator, gloo_group: GroupCoordinator, rank: int, world: int) -> int:
    checked = 0
    for dtype in DTYPES:
        for n in (1, world + 1, 1001):  # 1001 rows x 3: not a multiple of the ranks, and chunked
            x = _inputs(rank, n, dtype)
            a, b = shm_group.all_reduce(x.clone(), 0), gloo_group.all_reduce(x.clone(), 0)
            assert torch.equal(a, b), ("all_reduce", dtype, n)
            splits = [n // world + (1 if r < n % world else 0) for r in range(world)]
            a, b = shm_group.reduce_scatter(x, splits, 0), gloo_group.reduce_scatter(x, splits, 0)
            assert a.shape[0] == splits[rank] and torch.equal(a, b), ("reduce_scatter", dtype, n)
            for dim in (0, -1):
                a, b = shm_group.all_gather(x, 0, dim=dim), gloo_group.all_gather(x, 0, dim=dim)
                assert torch.equal(a, b), ("all_gather", dtype, n, dim)
            mine = x[:splits[rank]]
            a, b = shm_group.all_gather_rows(mine, splits, 0), gloo_group.all_gather_rows(mine, splits, 0)
            assert a.shape[0] == n and torch.equal(a, b), ("all_gather_rows", dtype, n)
            g = torch.Generator().manual_seed(rank * 7 + n)
            counts = torch.multinomial(torch.ones(world), n, replacement=True, generator=g).bincount(
                minlength=world).tolist()
            (a, ra), (b, rb) = shm_group.all_to_all(x, counts, 0), gloo_group.all_to_all(x, counts, 0)
            assert ra == rb and torch.equal(a, b), ("all_to_all", dtype, n)
            checked += 6
    return checked


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int)
    p.add_argument("--world", type=int)
    p.add_argument("--port", type=int)
    p.add_argument("--case", choices=["ops", "peer-exits", "peer-stalls", "many"])
    p.add_argument("--timeout", type=float, default=30.0)
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", world_size=a.world, rank=a.rank,
                            timeout=datetime.timedelta(seconds=60))
    ranks = list(range(a.world))
    shm = ShmCommunicator.create(dist.group.WORLD, a.world, a.rank, a.timeout)
    assert shm is not None, "one machine, kernels built: the ranks must share memory"
    shm_group = GroupCoordinator("tp", ranks, a.rank, dist.group.WORLD, shm)
    gloo_group = GroupCoordinator("tp", ranks, a.rank, dist.group.WORLD)
    out: dict = {"rank": a.rank}
    if a.case == "ops":
        out["checked"] = check_ops(shm_group, gloo_group, a.rank, a.world)
        out["segment_left"] = [f for f in os.listdir("/dev/shm") if f.startswith("lane-shm-")] if os.path.isdir(
            "/dev/shm") else []
    elif a.case == "many":  # more ranks than cores: waits must yield, or this crawls
        t0 = time.perf_counter()
        x = torch.ones(2048)
        for i in range(300):
            shm_group.all_reduce(x.fill_(1.0), 0)
            assert float(x[0]) == a.world
        out["seconds"] = time.perf_counter() - t0
    else:
        if a.rank == 1:
            if a.case == "peer-exits":
                os._exit(0)
            time.sleep(a.timeout * 3)  # alive but never arrives
            os._exit(0)
        t0 = time.perf_counter()
        try:
            shm_group.all_reduce(torch.ones(16), 0)
            out["error"] = None
        except CollectiveError as e:
            out["error"] = str(e)
        out["seconds"] = time.perf_counter() - t0
    print(json.dumps(out), flush=True)
    sys.stdout.flush()
    os._exit(0)  # no destroy_process_group: a peer may be gone


if __name__ == "__main__":
    main()
