"""The PD router (`xllm --pd_role=router --pd_decode URL... [--pd_prefill URL...]`): one
HTTP front for a prefill/decode deployment. It serves no model. Each API request goes to
the live decode instance with the fewest requests in flight from here, told which prefill
instance to have the prompt prefilled by (PREFILL_HEADER: the live one with the fewest
prompts out from here, or none; pd/roles.py), and its answer streams back through the
router unchanged. The router's calls carry the cluster token when one is set, and with
--cluster_tls_cert they go over HTTPS (presenting this certificate under --cluster_tls_ca:
instances then serve only mutual-TLS clients); clients reach the router itself over HTTP.

- **Health.** Every `--pd_health_interval` seconds the router calls each instance's
  /health. An instance that fails a check (a draining daemon answers 503), or refuses a
  connection, gets no new requests until it passes one. A request whose decode instance
  cannot be reached is sent to the next live one; nothing has reached the model then.
- **A decode instance that dies mid-answer.** Its streamed clients get an error event in
  their API's shape (and OpenAI's `[DONE]`), the others a 502; new requests go elsewhere.
- **No live decode instance.** 503 in the API's error shape. With no live prefill
  instance, decode instances are told to compute prompts themselves.
- **Stored responses** (OpenAI's Responses API) live on the decode instance that made
  them. GET and DELETE /v1/responses/{id}, and a POST /v1/responses whose
  `previous_response_id` names one, go to the live decode instance that holds it (asked
  in turn with GET /v1/responses/{id}); none holding it: 404 (the POST goes as any other,
  and the instance answers that it has no such response).
- **/health** is 200 while a decode instance is live; **/metrics** has each instance's
  state, requests and failures (Prometheus text).

Clients' headers that matter upstream (authorization, x-api-key, anthropic-version,
content-type, accept) are passed on; each daemon checks its own --api_key."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from xllm_py.config import PDConfig
from xllm_py.pd.compat import PREFILL_HEADER, TOKEN_HEADER, client_ssl, credentials, fewest

logger = logging.getLogger(__name__)
GENERATING = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")
API_ROUTES = (*GENERATING, "/v1/messages/count_tokens")
PASSED_HEADERS = ("authorization", "x-api-key", "anthropic-version", "anthropic-beta",
                  "content-type", "accept")  # fmt: skip
ANSWER_HEADERS = ("content-type", "retry-after", "allow", "cache-control")
MAX_BODY_BYTES = 64 << 20  # the daemons apply their own, smaller --max_request_body_bytes


@dataclass
class Instance:
    url: str
    role: str  # "prefill" | "decode"
    live: bool = True  # until a check or a connection says otherwise
    in_flight: int = 0  # requests from here not yet answered in full
    requests: int = 0
    failures: int = 0  # times found down (a failed check, connection or answer)
    why: str = ""  # the last failure


def _error(path: str, status: int, message: str) -> JSONResponse:
    """An error in the shape of the API at `path` (Anthropic's on /v1/messages)."""
    if path.startswith("/v1/messages"):
        kind = "overloaded_error" if status == 503 else "api_error"
        body = {"type": "error", "error": {"type": kind, "message": message}}
    else:
        body = {"error": {"message": message, "type": "server_error", "param": None,
                          "code": None}}  # fmt: skip
    return JSONResponse(body, status)


def _stream_error(path: str, message: str) -> bytes:
    """The event that ends a stream cut short, in the API's shape."""
    if path.startswith("/v1/messages"):
        event = {"type": "error", "error": {"type": "api_error", "message": message}}
        return f"event: error\ndata: {json.dumps(event)}\n\n".encode()
    if path.startswith("/v1/responses"):
        event = {"type": "error", "code": "server_error", "message": message, "param": None}
        return f"event: error\ndata: {json.dumps(event)}\n\n".encode()
    error = {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
    return f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()


class Router:
    """The instances, their health and the forwarding (`app()` is its HTTP front)."""

    def __init__(self, pd: PDConfig) -> None:
        self.pd = pd
        self.decode = [Instance(u, "decode") for u in pd.decode_urls]
        self.prefill = [Instance(u, "prefill") for u in pd.prefill_urls]
        self.client: httpx.AsyncClient | None = None
        self._turns = {"decode": 0, "prefill": 0}

    def pick(self, group: list[Instance]) -> Instance | None:
        """The live instance of `group` with the fewest requests in flight (ties in turn)."""
        live = [i for i in group if i.live]
        if not live:
            return None
        role = live[0].role
        self._turns[role] += 1
        return fewest(live, lambda i: i.in_flight, self._turns[role])

    def _down(self, inst: Instance, why: str) -> None:
        """Mark `inst` down (counted and logged once, until it passes a check again)."""
        inst.why = why
        if inst.live:
            inst.failures += 1
            logger.warning("PD router: %s %s is down: %s", inst.role, inst.url, why)
        inst.live = False

    async def check(self, inst: Instance) -> None:
        try:
            r = await self.client.get(inst.url + "/health", timeout=max(self.pd.health_interval, 1))
            ok, why = r.status_code == 200, f"/health answered {r.status_code}"
        except httpx.HTTPError as e:
            ok, why = False, f"/health: {type(e).__name__}: {e}"
        if ok and not inst.live:
            logger.info("PD router: %s %s is live", inst.role, inst.url)
            inst.live = True
        elif not ok:
            self._down(inst, why)

    async def watch(self) -> None:
        """Check every instance each health interval, until cancelled."""
        while True:
            await asyncio.gather(*(self.check(i) for i in self.decode + self.prefill))
            await asyncio.sleep(self.pd.health_interval)

    async def forward(self, request: Request) -> Response:
        """Send the request to a decode instance (with the prefill instance chosen for it
        in PREFILL_HEADER), and stream its answer back."""
        path = request.url.path
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            return _error(path, 413, f"request body of {declared} bytes exceeds {MAX_BODY_BYTES}")
        body = await request.body()
        headers = self._upstream_headers(request)
        holder = await self._previous_response_holder(path, body, headers)
        prefill = None
        if path in GENERATING:  # in flight until the answer's first bytes
            prefill = self.pick(self.prefill)
            headers[PREFILL_HEADER] = prefill.url if prefill is not None else ""
            if prefill is not None:
                prefill.requests += 1
                prefill.in_flight += 1
        try:
            return await self._send(request, body, headers, prefill, holder)
        except BaseException:
            self._done(prefill)
            raise

    async def stored(self, request: Request) -> Response:
        """GET / DELETE /v1/responses/{id}: to the decode instance that holds it."""
        headers = self._upstream_headers(request)
        rid = request.path_params["response_id"]
        holder = await self._holder(rid, headers)
        if holder is None:
            return _error(request.url.path, 404, f"no live decode instance holds response {rid!r}")
        return await self._send(request, b"", headers, None, holder)

    def _upstream_headers(self, request: Request) -> dict[str, str]:
        """The client's headers that matter upstream, and the cluster token when set."""
        headers = {h: request.headers[h] for h in PASSED_HEADERS if h in request.headers}
        if self.pd.token:
            headers[TOKEN_HEADER] = self.pd.token
        return headers

    async def _holder(self, rid: str, headers: dict) -> Instance | None:
        """The live decode instance that answers GET /v1/responses/{rid}, if any."""
        for inst in [i for i in self.decode if i.live]:
            try:
                r = await self.client.get(f"{inst.url}/v1/responses/{rid}", headers=headers)
            except httpx.HTTPError:
                continue
            if r.status_code == 200:
                return inst
        return None

    async def _previous_response_holder(self, path: str, body: bytes, headers: dict):
        """For POST /v1/responses continuing a stored response: the instance holding it."""
        if path != "/v1/responses" or b"previous_response_id" not in body:
            return None
        try:
            rid = json.loads(body).get("previous_response_id")
        except (ValueError, AttributeError):
            return None  # the daemon answers the malformed body
        return await self._holder(rid, headers) if isinstance(rid, str) and rid else None

    async def _send(self, request, body, headers, prefill, holder=None) -> Response:
        """To `holder`, or else to the picked live decode instance (the next one when one
        cannot be reached)."""
        path, tried = request.url.path, []
        while (inst := holder or self.pick(self.decode)) is not None:
            holder = None  # one try for the holder: unreachable, it is down like any other
            upstream = self.client.build_request(
                request.method, inst.url + path, params=request.query_params, content=body,
                headers=headers)  # fmt: skip
            try:
                answer = await self.client.send(upstream, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                self._down(inst, f"{type(e).__name__}: {e}")
                tried.append(inst.url)
                continue  # nothing reached the model: the next live instance
            except httpx.HTTPError as e:
                inst.failures, inst.why = inst.failures + 1, f"{type(e).__name__}: {e}"
                self._done(prefill)
                return _error(path, 502, f"decode instance {inst.url} failed: {inst.why}")
            inst.requests += 1
            inst.in_flight += 1
            return StreamingResponse(
                self._relay(inst, answer, path, prefill),
                status_code=answer.status_code,
                headers={h: answer.headers[h] for h in ANSWER_HEADERS if h in answer.headers},
            )
        where = f" (unreachable: {', '.join(tried)})" if tried else ""
        self._done(prefill)
        return _error(path, 503, f"no live decode instance{where}")

    @staticmethod
    def _done(prefill: Instance | None) -> None:
        """The request's prefill is over (or never happened): the prefill instance's load."""
        if prefill is not None and prefill.in_flight > 0:
            prefill.in_flight -= 1

    async def _relay(self, inst: Instance, answer: httpx.Response, path: str, prefill):
        try:
            async for chunk in answer.aiter_raw():
                self._done(prefill)  # the first bytes: the prompt was prefilled
                prefill = None
                yield chunk
        except httpx.HTTPError as e:
            self._down(inst, f"answer cut short: {type(e).__name__}: {e}")
            if answer.headers.get("content-type", "").startswith("text/event-stream"):
                yield _stream_error(path, f"decode instance {inst.url} failed mid-answer")
        finally:
            self._done(prefill)
            inst.in_flight -= 1
            await answer.aclose()

    async def health(self, request: Request) -> Response:
        live = {r: sum(i.live for i in group) for r, group in
                (("decode", self.decode), ("prefill", self.prefill))}  # fmt: skip
        return JSONResponse(live, 200 if live["decode"] else 503)

    async def metrics(self, request: Request) -> Response:
        lines = []
        for name, kind, help_, value in (
            ("instance_up", "gauge", "1 while the instance passes its checks", lambda i: i.live),
            ("in_flight", "gauge", "requests sent and not yet answered in full",
             lambda i: i.in_flight),
            ("requests_total", "counter", "requests sent to the instance", lambda i: i.requests),
            ("failures_total", "counter", "times the instance was found down: a failed check, "
             "a refused connection, an answer cut short", lambda i: i.failures),
        ):  # fmt: skip
            lines += [f"# HELP xllm_router:{name} {help_}", f"# TYPE xllm_router:{name} {kind}"]
            lines += [f'xllm_router:{name}{{role="{i.role}",url="{i.url}"}} {int(value(i))}'
                      for i in self.decode + self.prefill]  # fmt: skip
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        verify = client_ssl(self.pd) or True  # True: https:// against the system's roots
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), verify=verify)
        await asyncio.gather(*(self.check(i) for i in self.decode + self.prefill))
        watcher = asyncio.create_task(self.watch())
        try:
            yield
        finally:
            watcher.cancel()
            await self.client.aclose()

    def app(self) -> Starlette:
        routes = [Route(p, self.forward, methods=["POST"]) for p in API_ROUTES]
        routes += [
            Route("/v1/models", self.forward, methods=["GET"]),
            Route("/v1/responses/{response_id}", self.stored, methods=["GET", "DELETE"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ]
        return Starlette(routes=routes, lifespan=self.lifespan)


def run_router(a) -> int:
    """Serve the router of EngineArgs `a` until SIGTERM/SIGINT; the exit code."""
    import uvicorn

    router = Router(credentials(a.pd_config(), a))
    logger.info("PD router at http://%s:%d: decode %s, prefill %s", a.host, a.port,
                list(a.pd_decode), list(a.pd_prefill))  # fmt: skip
    config = uvicorn.Config(router.app(), host=a.host, port=a.port, log_level=a.log_level,
                            access_log=a.log_level == "debug")  # fmt: skip
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per health check
    uvicorn.Server(config).run()
    return 0
