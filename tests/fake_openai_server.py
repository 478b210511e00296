"""An OpenAI-compatible streaming server whose timing the test sets: the first token
after --ttft-ms, then one token every --itl-ms. A prompt with FAIL gets a 500, one
with HANG never answers. /metrics grows fixed prefix-cache and speculation counters
per request. Run: python fake_openai_server.py --port P [--ttft-ms 200] [--itl-ms 50]"""
import argparse
import asyncio
import json

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

PER_REQUEST = {"queries": 100, "hits": 40, "drafts": 10, "draft_tokens": 30, "accepted": 20}


def build_app(ttft_s: float, itl_s: float) -> FastAPI:
    app = FastAPI()
    totals = dict.fromkeys(PER_REQUEST, 0)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

    @app.get("/metrics")
    async def metrics():
        t = totals
        return PlainTextResponse(
            "# TYPE vllm:prefix_cache_queries counter\n"
            f'vllm:prefix_cache_queries_total{{model_name="fake"}} {t["queries"]}\n'
            "# TYPE vllm:prefix_cache_hits counter\n"
            f'vllm:prefix_cache_hits_total{{model_name="fake"}} {t["hits"]}\n'
            "# TYPE vllm:spec_decode_num_drafts counter\n"
            f'vllm:spec_decode_num_drafts_total{{model_name="fake"}} {t["drafts"]}\n'
            "# TYPE vllm:spec_decode_num_draft_tokens counter\n"
            f'vllm:spec_decode_num_draft_tokens_total{{model_name="fake"}} {t["draft_tokens"]}\n'
            "# TYPE vllm:spec_decode_num_accepted_tokens counter\n"
            f'vllm:spec_decode_num_accepted_tokens_total{{model_name="fake"}} {t["accepted"]}\n'
            "# TYPE vllm:cache_config_info gauge\n"
            'vllm:cache_config_info{block_size="16",model_name="fake"} 1.0\n')

    async def generate(body: dict, chat: bool):
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        if "HANG" in prompt:
            await asyncio.sleep(3600)
        if "FAIL" in prompt:
            return JSONResponse({"error": {"message": "told to fail", "type": "InternalServerError",
                                           "param": None, "code": 500}}, 500)
        n = body.get("max_tokens") or 16
        for k, v in PER_REQUEST.items():
            totals[k] += v

        async def stream():
            await asyncio.sleep(ttft_s)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            for i in range(n):
                # sleep to an absolute schedule, so a late wake-up does not shift later tokens
                await asyncio.sleep(max(0.0, t0 + i * itl_s - loop.time()))
                delta = {"delta": {"content": f" t{i}"}} if chat else {"text": f" t{i}"}
                yield f"data: {json.dumps({'choices': [{'index': 0, **delta, 'finish_reason': None}]})}\n\n"
            usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": n,
                     "total_tokens": len(prompt.split()) + n}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(await request.json(), chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await generate(await request.json(), chat=True)

    return app


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--ttft-ms", type=float, default=200)
    ap.add_argument("--itl-ms", type=float, default=50)
    a = ap.parse_args()
    uvicorn.run(build_app(a.ttft_ms / 1000, a.itl_ms / 1000), host="127.0.0.1", port=a.port, log_level="warning",
                timeout_graceful_shutdown=1)
