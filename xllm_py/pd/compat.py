"""What a prefill and a decode instance must share before KV blocks move between them.

Both build a `CompatRecord` from their engine config and compare it with the peer's at
their first meeting. Any difference would make the copied blocks wrong in silence (another
layout, block size, dtype or model), so the first differing field is named and the pair is
refused. Also what else both sides share: the prefill route and the header that carries
the cluster token, the control plane's credentials (the token, and TLS where
--cluster_tls_cert is given: every PD instance then serves HTTPS, with client
certificates required under --cluster_tls_ca), and `PDStats`, the transfer counters
/metrics reads.
"""

from __future__ import annotations

import bisect
import contextvars
import dataclasses
import hashlib
import json
import ssl

import msgspec

from xllm_py.config import EngineConfig, PDConfig

PREFILL_ROUTE = "/pd/prefill"  # a prefill instance's route, which decode instances call
TOKEN_HEADER = "x-xllm-cluster-token"  # the cluster token on that call
# The router's choice of prefill instance for a request it forwards to a decode instance
# (a URL, or "" for none live); the decode instance's HTTP layer puts a valid one here
# for the request's handler (pd/route.py), and AsyncEngine.generate into its sampling.
PREFILL_HEADER = "x-xllm-pd-prefill"
CHOSEN_PREFILL: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "xllm_pd_chosen_prefill", default=None
)
# upper bounds (s) of the transfer-latency histogram's buckets, then +Inf
TRANSFER_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def credentials(pd: PDConfig, a) -> PDConfig:
    """`pd` with the cluster token and TLS files of EngineArgs `a`: the token read now, the
    TLS files loaded once now (ValueError naming the flags if they cannot be)."""
    from xllm_py.tokens import read_token

    token = read_token(a.secret("cluster_token"), a.cluster_token_file)
    pd = dataclasses.replace(pd, token=token, tls_cert=a.cluster_tls_cert,
                             tls_key=a.cluster_tls_key, tls_ca=a.cluster_tls_ca)  # fmt: skip
    try:
        client_ssl(pd)
    except (OSError, ssl.SSLError) as e:
        flags = f"--cluster_tls_cert={pd.tls_cert}, _key={pd.tls_key}, _ca={pd.tls_ca}"
        raise ValueError(f"{flags}: cannot load them ({e})") from None
    return pd


def client_ssl(pd: PDConfig) -> ssl.SSLContext | None:
    """What the control plane's calls (router to instances, decode to prefill) dial
    https:// with: instances verified against --cluster_tls_ca (without it: the system's
    roots), and this node's certificate for the instances that ask for one (mutual TLS).
    None without --cluster_tls_cert."""
    if pd.tls_cert is None:
        return None
    context = ssl.create_default_context(cafile=pd.tls_ca)  # None: the system's roots
    context.load_cert_chain(pd.tls_cert, pd.tls_key)  # asked for only under mutual TLS
    return context


def fewest(candidates: list, load, turn: int):
    """The candidate with the least `load(c)`; ties go to the first from index `turn` on
    (turn taken modulo the count: callers advance it to spread ties in turn)."""
    turn %= len(candidates)
    return min(candidates[turn:] + candidates[:turn], key=load)


@dataclasses.dataclass
class PDStats:
    """One PD instance's transfers since it started. Blocks and bytes are those written to
    decode instances (prefill) or received (decode). A decode instance also counts the
    prompts whose blocks arrived, the failed ones (failed, refused or late: recomputed, or
    the request failed under --pd_on_transfer_failure=error), and the seconds from asking a
    prefill instance to the blocks' arrival (its prefill and the transfer), per bucket of
    TRANSFER_BUCKETS_S (not cumulative; the last is +Inf)."""

    blocks: int = 0
    bytes: int = 0
    transfers: int = 0
    failures: int = 0
    seconds: list[int] = dataclasses.field(
        default_factory=lambda: [0] * (len(TRANSFER_BUCKETS_S) + 1)
    )
    seconds_sum: float = 0.0

    def observe(self, seconds: float) -> None:
        self.seconds[bisect.bisect_left(TRANSFER_BUCKETS_S, seconds)] += 1
        self.seconds_sum += seconds


class CompatRecord(msgspec.Struct, frozen=True):
    """Compared field by field, in this order (the layout, which the others mostly decide,
    last)."""

    model: str  # architecture and a digest of the model config (its path left out)
    dtype: str
    block_size: int
    speculative: str  # "mtp" or "none" (k may differ: it changes no cache block)
    kv_lora_rank: int
    qk_rope_head_dim: int
    index_head_dim: int  # DeepSeek-V3.2's indexer keys (0: none)
    cache_dims: tuple[int, ...]  # each cache tensor's width per token: the KV layout


def model_identity(config: EngineConfig) -> str:
    fields = dataclasses.asdict(config.model)
    fields.pop("path", None)
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode())
    return f"{config.model.architecture}:{digest.hexdigest()[:16]}"


def compat_record(config: EngineConfig, dtype: str, cache_dims: list[int]) -> CompatRecord:
    """This instance's record: `dtype` and `cache_dims` as its worker resolved them (the
    worker's dtype and `cache_dims`)."""
    m, k = config.model, config.spec.num_speculative_tokens
    return CompatRecord(
        model=model_identity(config),
        dtype=dtype,
        block_size=config.cache.block_size,
        speculative="mtp" if k else "none",
        kv_lora_rank=m.kv_lora_rank,
        qk_rope_head_dim=m.qk_rope_head_dim,
        index_head_dim=m.index_head_dim if m.index_topk else 0,
        cache_dims=tuple(cache_dims),
    )


def mismatch(ours: CompatRecord, theirs: CompatRecord) -> str | None:
    """None when KV blocks can move between the two instances, else the first differing
    field with both values. A decode instance drafting with MTP reads the MTP layer's cache
    blocks of the prompt too, so the prefill side must run MTP as well."""
    for name in CompatRecord.__struct_fields__:
        a, b = getattr(ours, name), getattr(theirs, name)
        if a != b:
            return f"{name}: this instance has {a!r}, the peer {b!r}"
    return None
