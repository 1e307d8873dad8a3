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

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank={self.tp_rank} is outside [0, tp_size={self.tp_size})")
        if self.ep_size not in (1, self.tp_size):
            raise ValueError(
                f"ep_size={self.ep_size}: must be 1 or equal to tp_size={self.tp_size} "
                "(experts are partitioned across the tensor-parallel ranks)"
            )
        # looked up here, once: graph mode's compiled all-reduce reads it while tracing
        backend = None if self.group is None else dist.get_backend(self.group)
        object.__setattr__(self, "_backend", backend)

    @classmethod
    def from_group(cls, group: dist.ProcessGroup | None = None, ep_size: int = 1):
        """The context of this process in `group` (default: the world group)."""
        size = dist.get_world_size(group)
        if size == 1:
            return cls(ep_size=ep_size)
        return cls(dist.get_rank(group), size, ep_size, group or dist.group.WORLD)

    @property
    def ep_rank(self) -> int:
        return self.tp_rank if self.ep_size > 1 else 0

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
