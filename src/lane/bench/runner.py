"""Drive a run: warm-ups, then the dataset's requests at --request-rate (Poisson
arrivals, or all at once) under --max-concurrency, with a progress bar."""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import httpx2 as httpx
from tqdm import tqdm

from lane.bench.datasets import SampleRequest
from lane.bench.request import RequestInput, RequestOutput, endpoint_path, send_request


@dataclass
class LoadConfig:
    base_url: str
    model: str
    endpoint: str  # "completions" or "chat"
    request_rate: float = float("inf")
    max_concurrency: int | None = None
    num_warmups: int = 0
    ignore_eos: bool = False
    seed: int = 0
    timeout_s: float = 600.0
    headers: dict | None = None
    extra_body: dict | None = None
    show_progress: bool = True

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + endpoint_path(self.endpoint)


def arrival_gaps(n: int, rate: float, rng: random.Random) -> list[float]:
    """Seconds to wait before each request: exponential gaps (a Poisson process), or none."""
    if rate == float("inf"):
        return [0.0] * n
    return [rng.expovariate(rate) for _ in range(n)]


async def run_load(cfg: LoadConfig, samples: list[SampleRequest]) -> tuple[list[RequestOutput], float]:
    """Returns every request's output (failures included, in dataset order) and the duration."""
    inputs = [RequestInput(s.prompt, s.prompt_len, s.expected_output_len, cfg.model, cfg.endpoint,
                           cfg.ignore_eos, dict(cfg.extra_body or {})) for s in samples]
    conns = (cfg.max_concurrency or len(inputs)) + 8
    limits = httpx.Limits(max_connections=conns, max_keepalive_connections=conns)
    timeout = httpx.Timeout(cfg.timeout_s, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=cfg.headers) as client:
        for i in range(cfg.num_warmups):
            w = inputs[i % len(inputs)]
            res = await send_request(client, cfg.url, w, time.perf_counter())
            if not res.success:
                raise RuntimeError(f"warm-up request failed: {res.error}")
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        bar = tqdm(total=len(inputs), desc="requests", unit="req", disable=not cfg.show_progress)

        async def one(req: RequestInput, t_zero: float) -> RequestOutput:
            if sem is None:
                res = await send_request(client, cfg.url, req, t_zero)
            else:
                async with sem:
                    res = await send_request(client, cfg.url, req, t_zero)
            bar.update(1)
            return res

        rng = random.Random(cfg.seed)
        tasks = []
        t_zero = time.perf_counter()
        for req, gap in zip(inputs, arrival_gaps(len(inputs), cfg.request_rate, rng)):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(req, t_zero)))
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t_zero
        bar.close()
    return list(outputs), duration
