"""Graph mode: forward passes over decode-like steps as one compiled graph per bucket.

A pass qualifies when every request in it has at most Q rows, Q one of the compiled
query lengths. Three kinds of pass do, each with its own `GraphRunner`:

    target decode / verification  every request samples all its rows: Q = 1, or Q = 1 + k
                                  with up to k drafts each
    MTP first pass                after such a step: each request's newly verified rows,
                                  at most 1 + k
    MTP chained draft step        Q = 1

A pass is padded to a bucket of B requests x Q rows (the smallest configured batch size
that holds it, the smallest Q that holds its longest request) and runs through the graph
compiled for that (B, Q). Under compilation RoPE takes a real-valued table and the MoE,
for few tokens, a static form that gathers the chosen experts' weights
(`MoE._routed_gathered`); for more it runs the eager grouped form as one opaque op
(`moe.routed_grouped`), the one place a graph reads values back to the host (the
per-expert counts): on CPU that measured faster than a static dense form (every
expert over every token), which a CUDA-graph capture would need instead.

Per step the graph's inputs are

    input_ids, positions, slot_mapping  [B * Q]  persistent per bucket, filled by copying
    extra row inputs  [B * Q, ...]  (the MTP passes' hidden states), zero-padded
    kv_blocks  [B, W]       W = blocks of the step's longest context, the one size that
                            varies (a dynamic dimension of the graph, not a recompile)
    ctx_lens, q_lens  [B]   the requests' lengths (padding requests: Q and Q)

(the last four made per step), the last three held by the bucket's one `ForwardContext`,
installed around the call. Padding rows write their (ignored) cache entries into a
scratch block past the block manager's blocks; their outputs are dropped.

Prefill and mixed prefill/decode steps stay eager, and so do the logits and sampling
(outside the graph). The backend is Inductor (`torch.compile`, `fullgraph=True`: a graph
break is an error, not a slow path); CUDA-graph capture of the same buffers is not
written yet. Tensor/expert parallel ranks run graphs too: every rank takes the same
bucket for a step (they run the same schedule), and the all-reduces are functional
collectives inside the graph (`ParallelContext.all_reduce`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from xllm_py.models.attention_layout import RequestLayout
from xllm_py.models.context import AttnGroup, ForwardContext, forward_context

logger = logging.getLogger(__name__)

# Measured on the bundled model, batch 1, 2 CPU threads (ms per decode step, eager 5.7):
# freezing (weights folded in as constants) 4.2; freezing + cpp_wrapper (the graph's
# kernels called from generated C++ rather than Python) 3.6.
INDUCTOR_OPTIONS = {"freezing": True, "cpp_wrapper": True}


@dataclass
class _Bucket:
    batch: int
    q_len: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    ctx: ForwardContext  # its one AttnGroup's block table and lengths are set per step


class GraphRunner:
    """Runs passes (see the module docstring) of `fn(input_ids, positions, *extras)`
    through compiled, fixed-shape graphs. `extras` gives each extra row input's trailing
    shape, for the warm-up's dummy step; `name` labels the progress bar and log line."""

    def __init__(
        self,
        fn: Callable[..., torch.Tensor],
        kv_caches: list[torch.Tensor],
        block_size: int,
        scratch_block: int,
        batch_sizes: tuple[int, ...],
        q_lens: tuple[int, ...],
        device: torch.device,
        dtype: torch.dtype,
        extras: tuple[tuple[int, ...], ...] = (),
        name: str = "target",
    ) -> None:
        self.extras = extras
        self.name = name
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.q_lens = tuple(q_lens)
        self.device = device
        self.dtype = dtype
        # One compiled entry per bucket (per engine in this process): beyond the limit,
        # dynamo would refuse to compile (an error under fullgraph=True).
        torch._dynamo.config.cache_size_limit += len(self.batch_sizes) * len(self.q_lens)
        self._compiled = torch.compile(fn, fullgraph=True, dynamic=False, options=INDUCTOR_OPTIONS)
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        self.steps: dict[tuple[int, int], int] = {}  # steps run per bucket (after warm-up)
        self.keys = [(b, q) for q in self.q_lens for b in self.batch_sizes]
        # Buckets compiled so far: a pass runs compiled only in one of these, so a bucket
        # compiling on another thread is never waited for (the pass runs eager meanwhile).
        self.ready: set[tuple[int, int]] = set()
        # Set once no compilation can happen in this process any more (worker.py): dynamo
        # may then check only the guards that tell compiled entries apart (`_stance`).
        self.fast_guards = False

    @property
    def warm(self) -> bool:
        """Every bucket is compiled."""
        return len(self.ready) == len(self.keys)

    def bucket_for(self, layouts: list[RequestLayout]) -> tuple[int, int] | None:
        """(B, Q) of the bucket this pass runs in, or None when it must run eager: the
        smallest compiled Q that holds every request's rows, the smallest B that holds the
        requests."""
        longest = max(lay.q_len for lay in layouts)
        q = min((q for q in self.q_lens if q >= longest), default=None)
        b = next((b for b in self.batch_sizes if b >= len(layouts)), None)
        return (b, q) if (b, q) in self.ready else None

    @torch.inference_mode()
    def warm_up(self, batch: int | None = None, progress: bool = True) -> float:
        """Compile every bucket (of `batch` requests: those only) not compiled yet, a dummy
        step each into the scratch block, each put to use as soon as it is ready; returns
        the seconds it took. Inductor's on-disk cache (--compile_cache_dir) makes a second
        start faster."""
        t0 = time.perf_counter()
        todo = [key for key in self.keys if key not in self.ready and batch in (None, key[0])]
        for b, q in tqdm(todo, desc=f"compiling {self.name} graphs", unit="graph",
                         disable=not progress):  # fmt: skip
            lay = RequestLayout(0, q, q, [self.scratch_block])
            extras = [torch.zeros(q, *shape, dtype=self.dtype) for shape in self.extras]
            self._run(self._bucket(b, q), [0] * q, list(range(q)), [lay], extras)
            self.ready.add((b, q))
        took = time.perf_counter() - t0
        if todo:
            logger.info("graph mode: %d %s graphs compiled in %.1f s", len(todo), self.name, took)
        return took

    def run(
        self,
        key: tuple[int, int],
        input_ids: list[int],
        positions: list[int],
        layouts,
        extras: list[torch.Tensor] = (),
    ) -> torch.Tensor:
        """Output rows [T, ...] of the pass's T real rows (the requests' q_len summed, in
        the order of `input_ids`); `extras` are the extra row inputs, [T, ...] each."""
        self.steps[key] = self.steps.get(key, 0) + 1
        return self._run(self._bucket(*key), input_ids, positions, layouts, extras)

    def _bucket(self, b: int, q: int) -> _Bucket:
        key = (b, q)
        if key not in self.buckets:
            dev, n = self.device, b * q
            group = AttnGroup(True, None, None, None, None, b, q)  # tables: set per step
            ctx = ForwardContext(
                torch.zeros(n, dtype=torch.long, device=dev), [group], self.kv_caches
            )
            self.buckets[key] = _Bucket(
                b,
                q,
                torch.zeros(n, dtype=torch.long, device=dev),
                torch.zeros(n, dtype=torch.long, device=dev),
                ctx,
            )
        return self.buckets[key]

    def _run(self, bk: _Bucket, input_ids, positions, layouts, extras=()) -> torch.Tensor:
        B, Q = bk.batch, bk.q_len
        bs, dev, scratch = self.block_size, self.device, self.scratch_block
        # Row b * Q + j is row j of request b. A request with q_len < Q fills the rest of
        # its Q rows with padding, like the requests past the last (B - len(layouts)):
        # token 0 at the request's last position, cache entry written to the scratch
        # block's slot j, output dropped.
        ids, pos, slots, real = [], [], [], []
        for b, lay in enumerate(layouts):
            first = lay.ctx_len - lay.q_len
            for j in range(Q):
                if j < lay.q_len:
                    p = first + j
                    ids.append(input_ids[lay.start + j])
                    slots.append(lay.block_ids[p // bs] * bs + p % bs)
                    real.append(b * Q + j)
                else:
                    p = lay.ctx_len - 1
                    ids.append(0)
                    slots.append(scratch * bs + j)
                pos.append(p)
        pad_reqs = B - len(layouts)
        pos += list(range(Q)) * pad_reqs
        bk.input_ids.copy_(torch.tensor(ids + [0] * (pad_reqs * Q)))
        bk.positions.copy_(torch.tensor(pos))
        bk.ctx.slot_mapping.copy_(
            torch.tensor(slots + [scratch * bs + j for j in range(Q)] * pad_reqs)
        )
        # The context width W (in blocks) is the graph's one dynamic size: at least 2, so
        # the compiler cannot specialise it to 1.
        width = max(2, max(-(-lay.ctx_len // bs) for lay in layouts))
        table = [(lay.block_ids + [scratch] * width)[:width] for lay in layouts]
        group = bk.ctx.groups[0]
        group.kv_blocks = torch.tensor(table + [[scratch] * width] * pad_reqs, device=dev)
        # A padding request's Q rows see the scratch block's first Q slots, which they write.
        group.ctx_lens = torch.tensor([lay.ctx_len for lay in layouts] + [Q] * pad_reqs, device=dev)
        group.q_lens = torch.tensor([lay.q_len for lay in layouts] + [Q] * pad_reqs, device=dev)
        torch._dynamo.mark_dynamic(group.kv_blocks, 1)
        n = len(real)
        dense = real[-1] == n - 1  # the real rows are rows 0 .. n-1: no gather, no scatter
        index = None if dense else torch.tensor(real, device=dev)
        rows = []
        for x in extras:
            full = x.new_zeros(B * Q, *x.shape[1:])
            if index is None:
                full[:n] = x
            else:
                full.index_copy_(0, index, x)
            rows.append(full)
        with forward_context(bk.ctx), self._stance():
            out = self._compiled(bk.input_ids, bk.positions, *rows)
        return out[:n] if index is None else out[index]

    def _stance(self):
        """After warm-up, dynamo checks only the guards that tell this function's compiled
        entries apart (the bucket's shapes, the engine's modules) rather than all of them
        (one per parameter and buffer): 0.45 -> 0.22 ms per call measured at batch 1, a
        decode step 4.4 -> 3.7 ms. Safe because warm-up compiled every entry a step can
        need and nothing compiles any more; before that, the full guards run."""
        if not self.fast_guards:
            return contextlib.nullcontext()
        return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
