"""The PD control plane over HTTP: a prefill instance's `POST /pd/prefill`, which a decode
instance calls with a prompt and where to write its blocks (xllm_py/pd/roles.py), and a
decode instance's reading of the router's choice of prefill instance (RouterChoice). It
carries the cluster token when one is set (--cluster_token_file, --cluster_token or
XLLM_CLUSTER_TOKEN); a call without it is refused and logged. With --cluster_tls_cert a
prefill or decode instance serves HTTPS, and with --cluster_tls_ca only to clients that
present a certificate the CA signed (the router, the other instances): mutual TLS."""

from __future__ import annotations

import dataclasses
import hmac
import logging
import ssl
import uuid

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from xllm_py.config import EngineConfig, PDConfig
from xllm_py.pd.compat import (
    CHOSEN_PREFILL,
    PREFILL_HEADER,
    PREFILL_ROUTE,
    TOKEN_HEADER,
    credentials,
)
from xllm_py.sampling_params import KVPush, SamplingParams

logger = logging.getLogger(__name__)
MAX_BODY_BYTES = 64 << 20  # a prompt at the longest context, its block list and addresses


class PrefillRequest(msgspec.Struct):
    prompt_token_ids: list[int]
    push: KVPush


def with_credentials(config: EngineConfig, a) -> EngineConfig:
    """`config` with the cluster token and TLS files its PD role uses, from EngineArgs
    `a`'s flags (unchanged without a role)."""
    if config.pd.role == "both":
        return config
    return dataclasses.replace(config, pd=credentials(config.pd, a))


def server_ssl(pd: PDConfig) -> dict:
    """uvicorn.Config's keywords for a PD instance: HTTPS with --cluster_tls_cert, client
    certificates signed by --cluster_tls_ca required (mutual TLS); {} otherwise."""
    if pd.role not in ("prefill", "decode") or pd.tls_cert is None:
        return {}
    mutual = pd.tls_ca is not None
    return {"ssl_certfile": pd.tls_cert, "ssl_keyfile": pd.tls_key, "ssl_ca_certs": pd.tls_ca,
            "ssl_cert_reqs": ssl.CERT_REQUIRED if mutual else ssl.CERT_NONE}  # fmt: skip


class RouterChoice:
    """ASGI middleware of a decode instance: a request carrying the router's choice of
    prefill instance (PREFILL_HEADER) has it in CHOSEN_PREFILL while it is handled, if the
    choice is one of --pd_prefill (or "": none) and, with a cluster token set, the request
    carries the token; anything else is ignored, so a client cannot make the instance
    call an address of its choosing."""

    def __init__(self, app, pd: PDConfig) -> None:
        self.app, self.pd = app, pd
        self.allowed = {"", *pd.prefill_urls}

    async def __call__(self, scope, receive, send):
        chosen = None
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            given = headers.get(PREFILL_HEADER.encode())
            token = headers.get(TOKEN_HEADER.encode(), b"")
            trusted = not self.pd.token or hmac.compare_digest(token, self.pd.token.encode())
            if given is not None and trusted and given.decode() in self.allowed:
                chosen = given.decode()
        reset = CHOSEN_PREFILL.set(chosen)
        try:
            await self.app(scope, receive, send)
        finally:
            CHOSEN_PREFILL.reset(reset)


def attach(app: FastAPI, engine, pd: PDConfig) -> None:
    """Add the prefill route to a prefill instance's app, the router's choice to a decode
    instance's (nothing for other roles)."""
    if pd.role == "decode":
        app.add_middleware(RouterChoice, pd=pd)
    if pd.role != "prefill":
        return

    @app.post(PREFILL_ROUTE, include_in_schema=False)
    async def prefill(request: Request):
        given = request.headers.get(TOKEN_HEADER, "")
        if pd.token and not hmac.compare_digest(given.encode(), pd.token.encode()):
            logger.warning("PD: a prefill request from %s without the cluster token, refused",
                           request.client.host if request.client else "?")  # fmt: skip
            return JSONResponse({"error": "missing or wrong cluster token"}, 401)
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            return JSONResponse({"error": f"body over {MAX_BODY_BYTES} bytes"}, 413)
        try:
            body = msgspec.json.decode(raw, type=PrefillRequest)
            sampling = SamplingParams(max_tokens=1, temperature=0.0, kv_push=body.push)
            engine.validate(body.prompt_token_ids, sampling)
        except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as e:
            return JSONResponse({"error": str(e)}, 400)
        last = None
        async for update in engine.generate(f"pd-{uuid.uuid4().hex}", None,
                                            body.prompt_token_ids, sampling):  # fmt: skip
            last = update
        if last is None or last.finish_reason == "abort":
            why = "the request ended" if last is None else last.stop_reason
            return JSONResponse({"error": f"the blocks were not written: {why}"}, 502)
        return {"blocks": len(body.push.block_ids)}
