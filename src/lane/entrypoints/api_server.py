"""``lane serve``: the OpenAI-compatible API server (FastAPI + uvicorn) in front of
one engine-core process per data-parallel replica (seed steps 9-14, 37-40, 50, 52,
56, 57). Every error is an OpenAI-style body; validation errors are 400, not 422."""
from __future__ import annotations

import asyncio
import gc
import hmac
import importlib
import logging
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

import lane
from lane.config import EngineArgs
from lane.engine.async_llm import AsyncLLM
from lane.entrypoints.openai_serving import APIError, ChatOptions, OpenAIServing, bad_request, error_body
from lane.entrypoints.protocol import (TOKEN_ID_MARK, ChatCompletionRequest, CompletionRequest,
                                       DetokenizeRequest, ErrorResponse, ModelCard, ModelList, TokenizeRequest)
from lane.sampling_params import ParamError
from lane.tracing import Step, tracer

logger = logging.getLogger(__name__)

HTTP_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                    405: "MethodNotAllowedError", 500: "InternalServerError", 503: "ServiceUnavailableError"}
PUBLIC_PATHS = ("/health", "/metrics", "/version", "/openapi.json")


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable sentence from pydantic's errors, and the parameter it is about."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', 'cannot be parsed')}", None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # a union type reports one error per branch: name the field once
    param = next((p for p in loc if not p.isdigit() and p not in {"str", "list[str]", "list[int]",
                                                                   "list[list[int]]"}), None)
    if first.get("type") == "missing":
        msg = f"field required: {'.'.join(loc)}" if loc else "the request body is missing"
    else:
        msg = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}"
    return msg, param


# what /openapi.json says of errors: every one is an OpenAI-style body
ERROR_RESPONSES = {"4XX": {"model": ErrorResponse, "description": "A request the server will not serve"},
                   "5XX": {"model": ErrorResponse, "description": "An engine failed, is down or overloaded"}}


def document_schema(app: FastAPI, vocab_size: int) -> None:
    """/openapi.json as this server answers: no FastAPI 422 responses (validation errors
    are 400s here), token ids within this model's vocabulary."""
    generate = app.openapi

    def bound_token_ids(node) -> None:
        if isinstance(node, dict):
            if node.pop(TOKEN_ID_MARK, False):
                node.update(minimum=0, maximum=vocab_size - 1)
            for value in node.values():
                bound_token_ids(value)
        elif isinstance(node, list):
            for value in node:
                bound_token_ids(value)

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = generate()  # cached on the app: edited once, in place
            for operations in schema["paths"].values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            bound_token_ids(schema)
        return app.openapi_schema

    app.openapi = openapi


def build_app(engine: AsyncLLM, served_model_names: list[str], api_key: str | None = None,
              chat: ChatOptions | None = None) -> FastAPI:
    # no /docs pages (they load scripts from a CDN); /openapi.json describes the routes
    app = FastAPI(title="lane", version=lane.__version__, openapi_url="/openapi.json", docs_url=None,
                  redoc_url=None, responses=ERROR_RESPONSES)
    document_schema(app, engine.processor.vocab_size)
    serving = OpenAIServing(engine, served_model_names, chat)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError):
        msg, param = validation_message(exc)
        return JSONResponse(error_body(400, msg, "BadRequestError", param), 400)

    @app.exception_handler(APIError)
    async def on_api_error(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, exc: StarletteHTTPException):
        return JSONResponse(error_body(exc.status_code, str(exc.detail),
                                       HTTP_ERROR_TYPES.get(exc.status_code, "Error")), exc.status_code)

    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, exc: Exception):
        logger.exception("Unexpected error while serving a request")
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}: {exc}",
                                       "InternalServerError"), 500)

    if engine.traces is not None:
        @app.middleware("http")
        async def arrival_time(request: Request, call_next):
            request.state.arrival = time.monotonic()  # step 11 starts when the request arrives
            return await call_next(request)

        @app.get("/v1/traces/{request_id}")
        async def get_trace(request_id: str):
            trace = engine.traces.get(request_id)
            if trace is None:
                raise APIError(404, f"no trace for request {request_id!r} (only the last "
                                    f"{engine.traces.max_requests} are kept)", "NotFoundError", "request_id")
            trace["model"] = served_model_names[0]
            return trace

    if api_key:
        @app.middleware("http")
        async def authenticate(request: Request, call_next):
            if request.method != "OPTIONS" and not request.url.path.startswith(PUBLIC_PATHS):
                given = request.headers.get("Authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                    return JSONResponse(error_body(401, "Unauthorized: a valid 'Authorization: Bearer' "
                                                        "API key is required", "AuthenticationError"), 401)
            return await call_next(request)

    @app.get("/health")
    async def health():
        if tracer.enabled:  # step 57
            now = time.monotonic()
            tracer.record(Step.HEALTH_PROBE, now, now, None, healthy=engine.is_healthy)
        if engine.is_healthy:
            return Response(status_code=200)
        dead = ", ".join(f"engine core {i} (exit code {c})" for i, c in engine.client.dead.items())
        return JSONResponse(error_body(503, f"engine not running: {dead or 'stopping'}",
                                       "ServiceUnavailableError"), 503)

    @app.get("/version")
    async def version():
        return {"version": lane.__version__}

    @app.get("/metrics")
    async def metrics():
        t0 = time.monotonic()
        engine.flush_stats()
        body = generate_latest(engine.registry)
        if tracer.enabled:  # step 56
            tracer.record(Step.METRICS_PUBLISH, t0, time.monotonic(), None, bytes=len(body))
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[ModelCard(id=name, root=engine.model_config.model,
                                         max_model_len=engine.max_model_len)
                               for name in served_model_names]).model_dump()

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw_request: Request):
        return await serving.create_completion(request, raw_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request):
        return await serving.create_chat_completion(request, raw_request)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest):
        serving.check_model(request.model)
        try:
            if request.messages is not None:
                chat = ChatCompletionRequest(messages=request.messages, tools=request.tools)
                ids = engine.processor.apply_chat_template(chat.conversation(), request.add_generation_prompt,
                                                           serving.chat.chat_template, chat.tool_dicts(),
                                                           request.chat_template_kwargs)
            elif request.prompt is not None:
                ids = engine.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
            else:
                raise ParamError("prompt", "give a prompt or messages")
        except ParamError as e:
            raise bad_request(e) from None
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                "token_strs": engine.tokenizer.convert_ids_to_tokens(ids)}

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest):
        serving.check_model(request.model)
        try:
            engine.processor.check_token_ids(request.tokens, "tokens")
        except ParamError as e:
            raise bad_request(e) from None
        return {"prompt": engine.tokenizer.decode(request.tokens)}

    return app


async def serve(args: EngineArgs, host: str, port: int, data_parallel_size: int = 1,
                served_model_name: list[str] | None = None, api_key: str | None = None,
                uvicorn_log_level: str = "warning", trace_max_requests: int = 100,
                max_num_waiting_requests: int | None = None, chat: ChatOptions | None = None) -> None:
    engine = AsyncLLM(args, data_parallel_size, served_model_name[0] if served_model_name else None,
                      trace_max_requests=trace_max_requests, max_num_waiting_requests=max_num_waiting_requests)
    names = served_model_name or [engine.served_model_name]
    try:
        # xgrammar checks every constraint here (a 400 for a bad one): imported while the engines
        # start, not by the first constrained request, whose import would stall every stream
        await asyncio.to_thread(importlib.import_module, "xgrammar")
        # What start-up made (torch, transformers, the tokenizer, xgrammar: ~300k objects) stays
        # for the server's life: frozen, the collector's full passes no longer walk it. One took
        # ~0.5 s on a 2-core EPYC, a stall of every stream whenever the allocations of serving
        # triggered it (as vLLM's freeze_gc_heap; the engines freeze theirs). Done while the
        # engines still load.
        gc.collect()
        gc.freeze()
        await engine.start()
        app = build_app(engine, names, api_key, chat)
        config = uvicorn.Config(app, host=host, port=port, log_level=uvicorn_log_level,
                                timeout_graceful_shutdown=5, access_log=False)
        server = uvicorn.Server(config)
        r = engine.client.ready
        logger.info("Serving %s as %s with %d engine core(s) (pids %s), %d KV blocks of %d tokens each",
                    engine.model_config.short_name, ", ".join(repr(n) for n in names), len(r),
                    ", ".join(str(x.pid) for x in r), r[0].num_gpu_blocks, r[0].block_size)

        async def announce() -> None:
            while not server.started:
                await asyncio.sleep(0.05)
            logger.info("API server listening on http://%s:%d (OpenAI routes under /v1; /health, /metrics)",
                        host, port)

        announcer = asyncio.create_task(announce())
        # uvicorn handles SIGINT / SIGTERM: it stops accepting, lets responses in flight
        # finish (5 s at most) and returns; the engines are then stopped below
        await server.serve()
        announcer.cancel()
    finally:
        engine.shutdown()
        logger.info("Shut down")

