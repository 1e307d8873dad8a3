"""The engine core's side of prefill/decode disaggregation (EngineCore holds one).

Prefill instance (`PrefillSide`): a request that carries a `KVPush` is computed like any
(one token, the prefix cache on); when it finishes, its prompt's full blocks, still cached
under their prefix hashes, are written into the decode instance's reserved blocks, after
the two compatibility records are compared. A failure finishes the request as "abort",
the reason in its stop_reason, which the PD prefill route answers with.

Decode instance (`DecodeSide`): a new request whose prompt has full blocks this instance
does not cache reserves blocks for them and asks a prefill instance (a thread here, over
HTTP) to fill them; the request waits meanwhile. Once written, the blocks are committed
as prefix-cache entries and the request is scheduled: it computes only its last partial
block. A transfer that fails or passes --pd_transfer_timeout is aborted and the request
computes its whole prompt here: slower, never wrong, never lost (or, with
--pd_on_transfer_failure=error, fails with the reason). Each prompt goes to the
prefill instance with the fewest prompts out from here; one that could not be reached, or
did not answer within the timeout, is left alone for RETRY_AFTER_S (with none left, every
prompt is computed here, as on a colocated instance). A prefill instance whose record
differs is refused (logged with the field) and not asked again.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass

import msgspec

from xllm_py.cache.block_manager import BlockManager, PrefixImport
from xllm_py.config import EngineConfig
from xllm_py.pd.compat import (
    PREFILL_ROUTE,
    TOKEN_HEADER,
    CompatRecord,
    PDStats,
    client_ssl,
    compat_record,
    fewest,
    mismatch,
)
from xllm_py.pd.transfer import KVTransport, TransferError
from xllm_py.sampling_params import KVPush

logger = logging.getLogger(__name__)
RETRY_AFTER_S = 10.0  # a prefill instance that was unreachable or late is not asked meanwhile


class PrefillUnreachable(TransferError):
    """The prefill instance refused the connection or did not answer in time."""


def _transport(config: EngineConfig, worker) -> tuple[KVTransport, CompatRecord, list]:
    caches = worker.runner.kv_caches
    transport = KVTransport(config.pd.transfer_host)
    transport.register(caches)
    record = compat_record(config, str(worker.dtype), worker.cache_dims)
    logger.info("PD %s: transfer engine at %s", config.pd.role, transport.session_id)
    return transport, record, caches


class PrefillSide:
    def __init__(self, config: EngineConfig, worker) -> None:
        self.transport, self.record, self.caches = _transport(config, worker)
        self.pushes: dict[str, KVPush] = {}
        self.stats = PDStats()

    def push(self, blocks: BlockManager, push: KVPush) -> str | None:
        """Write the finished request's blocks; None, or why they were not written."""
        theirs = msgspec.convert(push.record, CompatRecord)
        why = mismatch(self.record, theirs)
        if why is not None:
            logger.error("PD: a decode instance's KV layout differs, refused: %s", why)
            return f"refused: {why}"
        source = blocks.cached_blocks(push.hashes)
        if source is None:
            return "the prompt's blocks were evicted before the transfer"
        try:
            self.transport.write_blocks(
                push.session_id, self.caches, source, push.addresses, push.block_ids
            )
        except TransferError as e:
            return str(e)
        self.stats.blocks += len(push.block_ids)
        self.stats.bytes = self.transport.bytes_written
        return None

    def close(self) -> None:
        self.transport.close()


@dataclass
class _Waiting:
    req: object  # engine/request.py's Request, scheduled once its blocks are settled
    held: PrefixImport
    future: concurrent.futures.Future
    url: str
    asked: float  # time.monotonic() when the prefill instance was asked
    cancelled: bool = False


class DecodeSide:
    def __init__(self, config: EngineConfig, worker) -> None:
        self.transport, self.record, caches = _transport(config, worker)
        self.addresses = [t.data_ptr() for t in caches]
        self.bytes_per_block = worker.bytes_per_block
        self.stats = PDStats()
        self.pd = config.pd
        self.tls = client_ssl(config.pd)  # the prefill route over HTTPS with TLS flags
        self.pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="xllm-pd")
        self.waiting: dict[str, _Waiting] = {}
        self.refused: dict[str, str] = {}  # prefill URL -> why
        self.resting: dict[str, float] = {}  # prefill URL -> when it may be asked again
        self._turn = 0

    def _usable(self, url: str) -> bool:
        """Not refused, and not resting after a failure."""
        return url not in self.refused and self.resting.get(url, 0.0) <= time.monotonic()

    def _next_url(self) -> str | None:
        """The prefill instance with the fewest prompts out from here (ties in turn)."""
        live = [u for u in self.pd.prefill_urls if self._usable(u)]
        if not live:
            return None
        self._turn += 1
        out = {u: 0 for u in live}
        for w in self.waiting.values():
            out[w.url] = out.get(w.url, 0) + 1
        return fewest(live, out.__getitem__, self._turn)

    def admit(self, blocks: BlockManager, req) -> bool:
        """Start the transfer of `req`'s prompt blocks (True: it waits), or False: nothing
        to move (cached here already, no room, no prefill instance left, or the router
        saw none live). The router's choice wins unless it failed here meanwhile."""
        chosen = req.sampling.kv_source
        if chosen == "":
            return False
        url = chosen if chosen is not None and self._usable(chosen) else self._next_url()
        if url is None:
            return False
        held = blocks.reserve_prefix(blocks.prompt_hashes(req.prompt_token_ids, req.block_hashes))
        if held is None:
            return False
        if not held.block_ids:
            blocks.abort_prefix(held)
            return False
        push = KVPush(self.transport.session_id, self.addresses, held.block_ids, held.hashes,
                      msgspec.to_builtins(self.record))  # fmt: skip
        future = self.pool.submit(self._ask, url, req.prompt_token_ids, push)
        self.waiting[req.req_id] = _Waiting(req, held, future, url, time.monotonic())
        return True

    def _ask(self, url: str, ids: list[int], push: KVPush) -> None:
        body = json.dumps({"prompt_token_ids": ids, "push": asdict(push)}).encode()
        headers = {"content-type": "application/json"}
        if self.pd.token:
            headers[TOKEN_HEADER] = self.pd.token
        request = urllib.request.Request(url + PREFILL_ROUTE, body, headers)
        try:
            with urllib.request.urlopen(request, timeout=self.pd.transfer_timeout,
                                        context=self.tls) as r:  # fmt: skip
                r.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            raise TransferError(f"{url} answered {e.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as e:  # refused, reset, timed out
            raise PrefillUnreachable(f"{url} unreachable: {e}") from None

    def settled(self, blocks: BlockManager) -> tuple[list, list[tuple[str, str]]]:
        """Requests whose transfer ended, to schedule now: their blocks committed, or
        aborted to be computed here; and with --pd_on_transfer_failure=error, the failed
        ones instead, as (request id, why). Cancelled ones are dropped."""
        out, failed = [], []
        for req_id, w in list(self.waiting.items()):
            if not w.future.done():
                continue
            del self.waiting[req_id]
            error = w.future.exception()
            if error is None:
                moved = len(w.held.block_ids)
                blocks.commit_prefix(w.held, hold=not w.cancelled)
                if not w.cancelled:  # held until the scheduler admits it
                    w.req.prefix_hold = w.held
                self.stats.transfers += 1
                self.stats.blocks += moved
                self.stats.bytes += moved * self.bytes_per_block
                self.stats.observe(time.monotonic() - w.asked)
            else:
                self.stats.failures += 1
                blocks.abort_prefix(w.held)
                why = str(error) or type(error).__name__
                if "refused:" in why:
                    self.refused[w.url] = why
                    logger.error("PD: %s is not compatible, not asked again: %s", w.url, why)
                else:
                    logger.warning("PD: %s computed here, its transfer failed: %s", req_id, why)
                if isinstance(error, PrefillUnreachable):
                    self.resting[w.url] = time.monotonic() + RETRY_AFTER_S
                if self.pd.on_transfer_failure == "error" and not w.cancelled:
                    why = f"PD: the prompt's KV blocks did not arrive from {w.url}: {why}"
                    failed.append((req_id, why))
                    continue
            if not w.cancelled:
                out.append(w.req)
        return out, failed

    def cancel(self, req_id: str) -> bool:
        w = self.waiting.get(req_id)
        if w is not None:
            w.cancelled = True
        return w is not None

    def wait(self, timeout: float) -> None:
        futures = [w.future for w in self.waiting.values()]
        if futures:
            concurrent.futures.wait(futures, timeout, concurrent.futures.FIRST_COMPLETED)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.transport.close()
