"""``lane proxy``: one OpenAI endpoint in front of prefill and decode ``lane serve`` instances
(PD disaggregation, seed step 55; vLLM's disaggregated-serving proxy, ours).

A request goes twice, with one ``X-Request-Id`` (the instances adopt it, so their traces join):
1. to a prefill instance (round-robin over the healthy ones) with ``max_tokens: 1``, no stream,
   and ``kv_transfer_params: {"do_remote_decode": true}``; its response says where its KV is;
2. to a decode instance with those ``kv_transfer_params``; its answer (streamed or not) is
   the client's.

Every instance's ``/health`` is checked each ``--health-interval`` seconds (1 by default); a dead
one leaves the rotation (and comes back when healthy); with no prefill or no decode instance
left, requests get 503. A client that
leaves during either leg cancels that leg (the instance aborts it and frees its blocks; the
prefill side's kept blocks are freed once pulled, or at its connector's timeout).

The proxy keeps spans of its own (on the instances' clock, CLOCK_MONOTONIC): step 13 for each
request (which instances it picked), step 57 for each health check and step 56 for each scrape
of its /metrics. ``GET /v1/traces/ID`` merges them with both instances' traces of the request.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
import uuid
from dataclasses import dataclass, field

import httpx2 as httpx
import uvicorn
from fastapi import FastAPI, Request
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from starlette.responses import JSONResponse, Response, StreamingResponse

from lane.entrypoints.openai_serving import error_body
from lane.tracing import Span, Step, TraceStore, span_dict

logger = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 1.0
# what the prefill leg must not carry: it answers with one token, whole
PREFILL_DROPS = ("stream_options", "min_tokens", "max_completion_tokens", "n", "logprobs", "top_logprobs")


@dataclass
class Instance:
    role: str  # "prefill" or "decode"
    url: str
    healthy: bool = False
    last_error: str = ""
    checked: float = 0.0


@dataclass
class Pool:
    instances: list[Instance]
    _rr: itertools.count = field(default_factory=itertools.count)

    def pick(self) -> Instance | None:
        live = [i for i in self.instances if i.healthy]
        return live[next(self._rr) % len(live)] if live else None


def _error(status: int, message: str, kind: str = "ServiceUnavailableError") -> JSONResponse:
    return JSONResponse(error_body(status, message, kind), status_code=status)


class Proxy:
    def __init__(self, prefill: list[str], decode: list[str], health_interval_s: float = HEALTH_INTERVAL_S) -> None:
        self.health_interval_s = health_interval_s
        self.spans = TraceStore()  # the proxy's own: step 13 per request; 56, 57 in the background
        self.prefill = Pool([Instance("prefill", u) for u in prefill])
        self.decode = Pool([Instance("decode", u) for u in decode])
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(600, connect=5))
        self.registry = CollectorRegistry()
        self.requests = Counter("lane_proxy:requests", "Requests the proxy passed on.", ["outcome"],
                                registry=self.registry)
        self.up = Gauge("lane_proxy:instance_healthy", "1 while an instance answers its /health.",
                        ["role", "url"], registry=self.registry)

    @property
    def instances(self) -> list[Instance]:
        return self.prefill.instances + self.decode.instances

    async def check_health(self) -> None:
        """Each instance's /health, every health_interval_s (seed step 57, from the router's side)."""
        while True:
            await asyncio.gather(*(self._check(i) for i in self.instances))
            await asyncio.sleep(self.health_interval_s)

    async def _check(self, inst: Instance) -> None:
        was, t0 = inst.healthy, time.monotonic()
        try:
            r = await self.client.get(inst.url + "/health", timeout=1.0)
            inst.healthy, inst.last_error = r.status_code == 200, "" if r.status_code == 200 else f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            inst.healthy, inst.last_error = False, type(e).__name__
        inst.checked = time.monotonic()
        self.spans.add(Span(Step.HEALTH_PROBE, t0, inst.checked - t0, None,
                            {"instance": "proxy", "probed": f"{inst.role} {inst.url}", "healthy": inst.healthy}))
        self.up.labels(inst.role, inst.url).set(int(inst.healthy))
        if was != inst.healthy:
            (logger.info if inst.healthy else logger.warning)(
                "%s instance %s is %s%s", inst.role, inst.url, "healthy" if inst.healthy else "down",
                f" ({inst.last_error})" if inst.last_error else "")

    async def forward(self, path: str, raw: Request) -> Response:
        try:
            body = json.loads(await raw.body())
        except ValueError as e:
            return _error(400, f"malformed JSON body: {e}", "BadRequestError")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object", "BadRequestError")
        t_pick = time.monotonic()
        p, d = self.prefill.pick(), self.decode.pick()
        if p is None or d is None:
            self.requests.labels("no_instance").inc()
            missing = "prefill" if p is None else "decode"
            return _error(503, f"no healthy {missing} instance (lane proxy checks each one's /health every "
                               f"{self.health_interval_s:g} s)")
        rid = raw.headers.get("x-request-id") or uuid.uuid4().hex
        self.spans.add(Span(Step.DP_ROUTE, t_pick, time.monotonic() - t_pick, [rid],
                            {"instance": "proxy", "prefill": p.url, "decode": d.url}))
        headers = {"X-Request-Id": rid}
        if auth := raw.headers.get("authorization"):
            headers["Authorization"] = auth
        leg1 = {k: v for k, v in body.items() if k not in PREFILL_DROPS}
        leg1.update(stream=False, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        try:
            r = await self.client.post(p.url + path, json=leg1, headers=headers)
        except httpx.HTTPError as e:
            self.requests.labels("prefill_failed").inc()
            return _error(502, f"the prefill instance {p.url} failed: {type(e).__name__}: {e}", "BadGatewayError")
        if r.status_code != 200:  # its error is the client's (a bad request is bad on both)
            self.requests.labels("prefill_error").inc()
            return Response(r.content, r.status_code, media_type="application/json")
        params = r.json().get("kv_transfer_params")
        if not params:
            self.requests.labels("prefill_failed").inc()
            return _error(502, f"the prefill instance {p.url} returned no kv_transfer_params: is it started with "
                               f"--kv-transfer-config and kv_role kv_producer or kv_both?", "BadGatewayError")
        leg2 = dict(body, kv_transfer_params=params)
        if body.get("stream"):
            return await self._stream(d, path, leg2, headers)
        try:
            r = await self.client.post(d.url + path, json=leg2, headers=headers)
        except httpx.HTTPError as e:
            self.requests.labels("decode_failed").inc()
            return _error(502, f"the decode instance {d.url} failed: {type(e).__name__}: {e}", "BadGatewayError")
        self.requests.labels("ok" if r.status_code == 200 else "decode_error").inc()
        return Response(r.content, r.status_code, media_type="application/json",
                        headers={"X-Request-Id": rid, "X-Prefill-Instance": p.url, "X-Decode-Instance": d.url})

    async def _stream(self, d: Instance, path: str, body: dict, headers: dict) -> Response:
        req = self.client.build_request("POST", d.url + path, json=body, headers=headers)
        try:
            upstream = await self.client.send(req, stream=True)
        except httpx.HTTPError as e:
            self.requests.labels("decode_failed").inc()
            return _error(502, f"the decode instance {d.url} failed: {type(e).__name__}: {e}", "BadGatewayError")
        if upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            self.requests.labels("decode_error").inc()
            return Response(content, upstream.status_code, media_type="application/json")

        async def relay():
            try:  # a client that leaves closes this generator: the upstream stream closes, the decode
                async for chunk in upstream.aiter_raw():  # instance aborts the request and frees its blocks
                    yield chunk
                self.requests.labels("ok").inc()
            finally:
                await upstream.aclose()

        return StreamingResponse(relay(), media_type="text/event-stream",
                                 headers={"X-Request-Id": headers["X-Request-Id"], "X-Decode-Instance": d.url})

    async def trace(self, request_id: str) -> Response:
        """Both instances' spans of one request and the proxy's, on one time axis (CLOCK_MONOTONIC
        is one clock for the processes of a machine), each span saying where it ran; with the
        proxy's health checks and scrapes that ran while the request was in flight. A step some
        part skipped but another ran counts as run."""
        merged, found = [], None
        for inst in self.instances:
            try:
                r = await self.client.get(f"{inst.url}/v1/traces/{request_id}", timeout=10)
            except httpx.HTTPError:
                continue
            if r.status_code != 200:
                continue
            trace = r.json()
            found = found or trace
            for s in trace["spans"]:
                s.setdefault("attrs", {})["instance"] = f"{inst.role} {inst.url}"
                merged.append(s)
        if found is None:
            return _error(404, f"no instance holds a trace of {request_id} (are they started with --trace?)",
                          "NotFoundError")
        own = self.spans.requests.get(request_id) or self.spans.requests.get(request_id.partition("-")[2]) or []
        merged += [span_dict(s) for s in own]
        timed = [s for s in merged if not s.get("skipped") and s["step"] >= 10]
        t0, t1 = min(s["start"] for s in timed), max(s["start"] + s["dur"] for s in timed)
        merged += [span_dict(s) for s in self.spans.background if t0 <= s.start <= t1]
        ran = {s["step"] for s in merged if not s.get("skipped")}
        reasons = {s["step"]: s for s in merged if s.get("skipped") and s["step"] not in ran}
        merged = [s for s in merged if not s.get("skipped")] + list(reasons.values())
        merged.sort(key=lambda s: (s["start"], s["step"]))
        return JSONResponse({**found, "spans": merged})


def build_app(proxy: Proxy) -> FastAPI:
    app = FastAPI(title="lane proxy", docs_url=None, redoc_url=None)

    @app.on_event("startup")
    async def start_checks() -> None:
        await asyncio.gather(*(proxy._check(i) for i in proxy.instances))
        app.state.health_task = asyncio.get_running_loop().create_task(proxy.check_health())

    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await proxy.forward("/v1/completions", raw)

    @app.post("/v1/chat/completions")
    async def chat(raw: Request):
        return await proxy.forward("/v1/chat/completions", raw)

    @app.get("/v1/models")
    async def models():
        d = proxy.decode.pick()
        if d is None:
            return _error(503, "no healthy decode instance")
        r = await proxy.client.get(d.url + "/v1/models")
        return Response(r.content, r.status_code, media_type="application/json")

    @app.get("/v1/traces/{request_id}")
    async def traces(request_id: str):
        return await proxy.trace(request_id)

    @app.get("/health")
    async def health():
        ok = proxy.prefill.pick() is not None and proxy.decode.pick() is not None
        body = {"status": "ok" if ok else "unavailable",
                "instances": [{"role": i.role, "url": i.url, "healthy": i.healthy, "error": i.last_error}
                              for i in proxy.instances]}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        t0 = time.monotonic()
        body = generate_latest(proxy.registry)
        proxy.spans.add(Span(Step.METRICS_PUBLISH, t0, time.monotonic() - t0, None,
                             {"instance": "proxy", "bytes": len(body)}))
        return Response(body, media_type="text/plain; version=0.0.4")

    return app


def urls(hosts: list[str], ports: list[int], what: str) -> list[str]:
    if len(hosts) == 1 and len(ports) > 1:
        hosts = hosts * len(ports)
    if len(hosts) != len(ports):
        raise ValueError(f"--{what}-hosts and --{what}-ports: {len(hosts)} hosts for {len(ports)} ports")
    return [f"http://{h}:{p}" for h, p in zip(hosts, ports)]


def run(host: str, port: int, prefill: list[str], decode: list[str],
        health_interval_s: float = HEALTH_INTERVAL_S) -> None:
    proxy = Proxy(prefill, decode, health_interval_s)
    logger.info("lane proxy on http://%s:%d: prefill %s, decode %s", host, port, ", ".join(prefill), ", ".join(decode))
    uvicorn.run(build_app(proxy), host=host, port=port, log_level="warning")
