"""Where this process sits inside its model replica, and the two collectives the model uses.

A replica of `tp_size` ranks runs one model together (docs/design.md section 2):

    attention     heads split: rank r holds heads [r*H/tp, (r+1)*H/tp); o_proj partial sums
                  are all-reduced. The latent KV cache is per token: full on every rank.
    dense MLP,    intermediate dim split (gate/up rows, down_proj columns), partial sums
    shared exp.   all-reduced.
    routed exp.   ep_size == 1: every expert split like the MLP.
                  ep_size == tp_size: rank r holds experts [r*E/ep, (r+1)*E/ep) whole and
                  runs them on the tokens routed to them (routing is replicated).
                  A MoE layer all-reduces routed + shared partial sums once.
    embedding,    vocabulary split: rank r holds rows [r*V/tp, (r+1)*V/tp)
    lm_head       (models/layers/vocab_parallel.py). Lookups outside them give zeros and
                  the embeddings are all-reduced; the logits slices are all-gathered, so
                  every rank samples from the same full logits. The MTP draft uses both.
    norms, router, MTP eh_proj: replicated.

DP attention (`--enable_dp_attention`, `ParallelContext.dp_attention`): each of dp_size
ranks is a whole replica for everything but the routed experts (tp_size 1: attention with
every head over its own requests and its own latent cache; dense layers, shared experts,
embedding and lm_head replicated, so nothing outside the MoE needs a collective). The
routed experts are partitioned over all dp_size ranks (ep_size == dp_size), and each MoE
layer sends every (token, expert) assignment to the rank owning the expert and the results
back (`all_to_all`, models/layers/moe.py). Every rank must join every exchange of every
step, with no tokens if it has no work (models/layers/moe.py, lockstep).

The context is passed explicitly to the model constructors; there is no module-level
process group. Build it in a worker, after `torch.distributed.init_process_group`, with
`ParallelContext.from_group(group, ep_size)` (the group of this replica's ranks; the
world group when dp_size == 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc


@dataclass(frozen=True)
class ParallelContext:
    """tp_rank / tp_size: this rank inside the replica. ep_size: 1 (experts split on their
    intermediate dim) or tp_size (experts partitioned). group: the replica's process group;
    None when tp_size == 1, or for a model built only to see its shard shapes (then
    `all_reduce` and `all_gather` refuse to run)."""

    tp_rank: int = 0
    tp_size: int = 1
    ep_size: int = 1
    group: dist.ProcessGroup | None = None
    # DP attention: this rank among dp_size ranks, and their group (the experts' exchange)
    dp_rank: int = 0
    dp_size: int = 1
    dp_group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank={self.tp_rank} is outside [0, tp_size={self.tp_size})")
        if self.dp_size > 1:
            if not 0 <= self.dp_rank < self.dp_size:
                raise ValueError(f"dp_rank={self.dp_rank} is outside [0, dp_size={self.dp_size})")
            if self.tp_size != 1 or self.ep_size != self.dp_size:
                raise ValueError(
                    f"DP attention over dp_size={self.dp_size} ranks needs tp_size=1 and "
                    f"ep_size={self.dp_size} (got tp_size={self.tp_size}, ep_size={self.ep_size})"
                )
        elif self.ep_size not in (1, self.tp_size):
            raise ValueError(
                f"ep_size={self.ep_size}: must be 1 or equal to tp_size={self.tp_size} "
                "(experts are partitioned across the tensor-parallel ranks)"
            )
        # looked up here, once: graph mode's compiled all-reduce reads it while tracing
        group = self.dp_group if self.dp_attention else self.group
        backend = None if group is None else dist.get_backend(group)
        object.__setattr__(self, "_backend", backend)

    @classmethod
    def from_group(cls, group: dist.ProcessGroup | None = None, ep_size: int = 1):
        """The context of this process in `group` (default: the world group)."""
        size = dist.get_world_size(group)
        if size == 1:
            return cls(ep_size=ep_size)
        return cls(dist.get_rank(group), size, ep_size, group or dist.group.WORLD)

    @classmethod
    def for_dp_attention(cls, group: dist.ProcessGroup | None = None):
        """DP attention over `group`'s ranks (default: the world group): attention and
        every other layer whole on each rank, the routed experts partitioned over all."""
        size = dist.get_world_size(group)
        if size == 1:
            return cls()
        return cls(ep_size=size, dp_rank=dist.get_rank(group), dp_size=size,
                   dp_group=group or dist.group.WORLD)  # fmt: skip

    @property
    def dp_attention(self) -> bool:
        return self.dp_size > 1

    @property
    def ep_rank(self) -> int:
        if self.dp_attention:
            return self.dp_rank
        return self.tp_rank if self.ep_size > 1 else 0

    def all_to_all(
        self, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]
    ) -> torch.Tensor:
        """DP attention: rows of `x` grouped by destination rank (send_counts[r] rows to
        rank r) in, the rows every rank sent here out (recv_counts[r] from rank r), in rank
        order. Exact in any dtype: rows are copied, never summed (gloo moves bf16 as it is)."""
        out = x.new_empty((sum(recv_counts), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=self.dp_group)
        return out

    def counts_to_all(self, send_counts: torch.Tensor) -> torch.Tensor:
        """DP attention: every rank's int64 count for this rank (send_counts[r] goes to r)."""
        out = torch.empty_like(send_counts)
        dist.all_to_all_single(out, send_counts, group=self.dp_group)
        return out

    def max_over_dp(self, values: list[int], device: torch.device) -> list[int]:
        """DP attention: the element-wise maximum of `values` over the ranks (lockstep's
        agreement on the passes of a step; a tensor on `device`, where NCCL wants it);
        `values` itself on one rank."""
        if not self.dp_attention:
            return values
        t = torch.tensor(values, dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.dp_group)
        return t.tolist()

    def split(self, total: int, name: str, over: str = "tp_size") -> int:
        """This rank's share of `total` split `over` ("tp_size" or "ep_size") ways; `name` is
        the config field, for the error."""
        parts = getattr(self, over)
        if total % parts:
            raise ValueError(f"{name}={total} is not divisible by {over}={parts}")
        return total // parts

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the replica, in place where the backend allows; returns the sum."""
        if self.tp_size == 1:
            return x
        if self.group is None:
            raise RuntimeError("ParallelContext without a process group cannot all-reduce")
        # gloo has no bf16/fp16 sum: reduce in float32 and cast back.
        low = x.dtype in (torch.bfloat16, torch.float16) and self.backend == "gloo"
        y = x.float() if low else x
        if torch.compiler.is_compiling():
            # Graph mode (worker/graph_runner.py): the functional form, which a compiled
            # graph holds as one of its ops.
            y = fc.all_reduce(y, "sum", self.group)
        else:
            dist.all_reduce(y, group=self.group)
        return y.to(x.dtype) if low else y

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' `x` concatenated along `dim` in rank order (a new tensor; the same on
        every rank). Exact in any dtype: data is copied, never summed (gloo gathers bf16
        as it is, unlike its sum). Eager only: its one user, the LM head's logits, runs
        outside graph mode's graphs."""
        if self.tp_size == 1:
            return x
        if self.group is None:
            raise RuntimeError("ParallelContext without a process group cannot all-gather")
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    @property
    def backend(self) -> str | None:
        """The process group's backend ("gloo", "nccl", ...); None without a group."""
        return self._backend


SINGLE = ParallelContext()  # one process: every layer whole, the collectives no-ops
