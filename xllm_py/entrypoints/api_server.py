"""The OpenAI-compatible REST API (FastAPI), over one EngineClient (engine_client.py).

    POST /v1/completions        text or token-id prompts (one or a batch), n choices each
    POST /v1/chat/completions   messages rendered with the checkpoint's chat template
    POST /v1/responses  GET|DELETE /v1/responses/{id}   OpenAI's Responses API (responses.py)
    POST /v1/messages  POST /v1/messages/count_tokens   Anthropic's Messages API (messages.py)
    POST /tokenize  POST /detokenize   vLLM's token utilities (count, truncate, decode)
    GET  /v1/models   GET /version   GET /health   GET /metrics   GET /openapi.json

The generating POST endpoints stream with `"stream": true` (SSE: chat and completions
`data: {...}` chunks, then `data: [DONE]`; Responses and Messages their own events).
Every error has OpenAI's shape `{"error": {"message", "type", "param", "code"}}`, except
on /v1/messages, where it has Anthropic's `{"type": "error", "error": {"type",
"message"}}`: 400 bad input, 401 bad key, 404 unknown model or route, 405
wrong method (with `Allow`), 413 oversized body, 429 too many requests in flight, 500
this request failed on its own (the others go on), 503 draining or engine dead.
/openapi.json declares each route's request body and these answers.
A client that goes away (mid-stream or while waiting) aborts its requests, so
their KV blocks are freed at the next engine step; so does a streaming client that
reads nothing for --stream_stall_timeout seconds.

This module is the routes and their documentation; serving.py is what the APIs share,
chat.py and completions.py are each API's own answer, and responses.py and messages.py
convert their bodies to a chat request and its answer back (chat.py `chat_outputs`).
"""

from __future__ import annotations

import hmac

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from xllm_py import __version__
from xllm_py.engine.engine_client import EngineClient
from xllm_py.engine.metrics import CONTENT_TYPE, ServerMetrics
from xllm_py.entrypoints import messages, messages_request, responses
from xllm_py.entrypoints.chat import serve_chat
from xllm_py.entrypoints.completions import serve_completion
from xllm_py.entrypoints.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from xllm_py.entrypoints.route_docs import BODIES, error_docs, post_doc
from xllm_py.entrypoints.serving import OpenAIServer, ServerOptions, _internal_error


async def tokenize_route(server: OpenAIServer, request: Request) -> dict:
    req = await server.read_body(request, TokenizeRequest)

    def run() -> dict:
        prompt = req.prompt if req.prompt is not None else server.render_chat(req)
        _, ids = server.tokenize(prompt)
        out = {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids}
        strs = [server.formatter.token_str(t) for t in ids] if req.return_token_strs else None
        return out | {"token_strs": strs}

    return await server.run_blocking(run)


async def detokenize_route(server: OpenAIServer, request: Request) -> dict:
    req = await server.read_body(request, DetokenizeRequest)
    tokenizer = server.tokenizer
    if tokenizer is None:
        raise APIError(400, "tokens: this checkpoint has no tokenizer", param="tokens")
    vocab = server.engine.model_config.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        msg = f"tokens: {bad[0]} is not a token id (0..{vocab - 1})"
        raise APIError(400, msg, param="tokens")
    text = await server.run_blocking(tokenizer.decode, req.tokens, False)
    return {"prompt": text}


def _openapi(app: FastAPI, max_model_len: int) -> dict:
    """FastAPI's document plus the request bodies' JSON schemas, with the token limits
    this server enforces, so generated clients and fuzzers see what is accepted."""
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in BODIES:  # every body a route documented with `post_doc`
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):  # larger
                # never fits
                if name in body["properties"]:
                    for option in body["properties"][name].get("anyOf", []):
                        if option.get("type") == "integer":
                            option["maximum"] = max_model_len
            components[model.__name__] = body
        app.openapi_schema = schema
    return app.openapi_schema


def build_app(engine: EngineClient, opts: ServerOptions, metrics: ServerMetrics) -> FastAPI:
    app = FastAPI(
        title="xllm-py",
        description="OpenAI-compatible serving of DeepSeek-V3-family models with MTP.",
    )
    server = OpenAIServer(engine, opts, metrics)
    app.state.server = server
    _error_handlers(app)
    app.openapi = lambda: _openapi(app, server.max_model_len)
    keyed = [Depends(_key_check(opts.api_key))]
    app.include_router(_v1_routes(server, keyed))
    _token_routes(app, server, keyed)
    _status_routes(app, engine, metrics)
    return app


def _error_response(request: Request, e: APIError, headers=None) -> JSONResponse:
    """OpenAI's error shape, or Anthropic's on the Messages API's routes (messages.py)."""
    body = messages_request.error_body(e) if messages_request.owns(request.url.path) else e.body()
    return JSONResponse(body, status_code=e.status, headers=headers)


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return _error_response(request, e)

    @app.exception_handler(ClientDisconnect)
    async def _gone(_: Request, e: ClientDisconnect):
        return Response(status_code=499)  # the client left before its body arrived: no one to tell

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        return _error_response(request, _internal_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = "NotFoundError" if e.status_code == 404 else "invalid_request_error"
        error = APIError(e.status_code, str(e.detail), type=kind)
        return _error_response(request, error, e.headers)  # e.headers: a 405's Allow


def _key_check(api_key: str | None):
    """The dependency that checks `Authorization: Bearer KEY`, or Anthropic's `x-api-key:
    KEY` (in constant time)."""
    expected = f"Bearer {api_key}".encode()

    def check_key(request: Request) -> None:
        if not api_key:
            return
        given = request.headers.get("authorization", "").encode()
        anthropic = ("Bearer " + request.headers.get("x-api-key", "")).encode()
        if not (hmac.compare_digest(given, expected) or hmac.compare_digest(anthropic, expected)):
            raise APIError(
                401,
                "missing or wrong API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')",
                type="authentication_error",
                code="invalid_api_key",
            )

    return check_key


def _v1_routes(server: OpenAIServer, keyed: list) -> APIRouter:
    v1 = APIRouter(prefix="/v1", dependencies=keyed)

    @v1.post("/completions", **post_doc(CompletionRequest, "The completion"))
    async def completions(request: Request):
        return await serve_completion(server, request)

    @v1.post("/chat/completions", **post_doc(ChatCompletionRequest, "The chat completion"))
    async def chat_completions(request: Request):
        return await serve_chat(server, request)

    @v1.get("/models", responses=error_docs(401))
    async def models():
        card = {
            "id": server.opts.served_model_name,
            "object": "model",
            "created": 0,
            "owned_by": "xllm-py",
            "max_model_len": server.max_model_len,
        }
        return {"object": "list", "data": [card]}

    v1.include_router(responses.routes(server))  # OpenAI's Responses API
    v1.include_router(messages.routes(server))  # Anthropic's Messages API
    return v1


def _token_routes(app: FastAPI, server: OpenAIServer, keyed: list) -> None:
    """vLLM's token utilities, at the root as vLLM serves them."""

    @app.post(
        "/tokenize",
        dependencies=keyed,
        **post_doc(TokenizeRequest, "`count`, `max_model_len`, `tokens`", stream=False),
    )
    async def tokenize(request: Request):
        return await tokenize_route(server, request)

    @app.post(
        "/detokenize",
        dependencies=keyed,
        **post_doc(DetokenizeRequest, "`prompt`: the text of the ids", stream=False),
    )
    async def detokenize(request: Request):
        return await detokenize_route(server, request)


def _status_routes(app: FastAPI, engine: EngineClient, metrics: ServerMetrics) -> None:
    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/health", responses={503: {"description": "Draining, or the engine stopped"}})
    async def health():
        if engine.dead is not None:
            return JSONResponse({"status": "dead", "error": str(engine.dead)}, status_code=503)
        if engine.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    @app.get(
        "/metrics",
        response_class=Response,
        responses={200: {"description": "Prometheus text format", "content": {"text/plain": {}}}},
    )
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)
