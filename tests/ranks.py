"""Run a function on two (or `world`) real processes joined by torch.distributed (gloo),
each holding its tensor-parallel shard (or, with DP attention, its share of the routed
experts) of whatever model the function loads: the harness of the tensor-parallel,
DP-attention and distribution tests."""

from __future__ import annotations

import functools
import multiprocessing as mp
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from perf.daemon import free_port
from xllm_py.parallel.context import ParallelContext

WORLD = 2
DEADLINE_S = 240  # a rank that outlives this is killed (a hang guard, not a speed bound)


def use_parallel_workers(parallel: ParallelContext) -> None:
    """Every LLM built after this in the process holds this rank's shard (as a cluster
    node's worker does)."""
    import xllm_py.worker.worker as worker  # engine_core.local_executor builds it from here

    worker.Worker = functools.partial(worker.Worker, parallel=parallel)


def _rank_main(
    rank: int, port: int, ep_size: int, work: Callable, out_dir: Path, world: int, dp: bool
) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=DEADLINE_S),
        )
        if dp:  # DP attention: every rank its own requests, the routed experts shared
            parallel = ParallelContext.for_dp_attention()
            assert (parallel.dp_rank, parallel.dp_size, parallel.ep_size) == (rank, world, world)
        else:
            parallel = ParallelContext.from_group(ep_size=ep_size)
            assert (parallel.tp_rank, parallel.tp_size, parallel.ep_size) == (rank, world, ep_size)
        torch.save(work(parallel), out_dir / f"rank{rank}.pt")
        dist.destroy_process_group()
    except BaseException:
        (out_dir / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def run_ranks(
    ep_size: int, work: Callable, out_dir: Path, world: int = WORLD, dp_attention: bool = False
) -> list:
    """`work(parallel)` on each of `world` ranks (a picklable, module-level callable); every
    rank's result. `dp_attention`: the ranks' contexts are DP attention's (ep_size is then
    the world). A failing or hanging rank fails the test, and no process outlives it."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(r, port, ep_size, work, out_dir, world, dp_attention),
            daemon=True,
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + DEADLINE_S
    try:
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):
                break  # the other rank would wait in a collective: stop it now
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    errors = [f.read_text() for f in sorted(out_dir.glob("rank*.err"))]
    assert not errors, "\n".join(errors)
    codes = [p.exitcode for p in procs]
    assert codes == [0] * world, f"rank exit codes {codes} (killed after {DEADLINE_S} s?)"
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]


def lockstep_generate(llm, prompts: dict[int, list[int]], params, parallel: ParallelContext):
    """DP attention: this rank's requests ({index: prompt ids}) stepped while any rank has
    work, as the master's engine core steps its replicas; ({index: (tokens, logprobs)},
    the steps this rank ran)."""
    engine = llm.engine
    engine.core.lockstep = True
    for i, p in prompts.items():
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    done, steps = {}, 0
    while True:
        busy = torch.tensor([int(engine.has_unfinished())])
        dist.all_reduce(busy, op=dist.ReduceOp.MAX, group=parallel.dp_group)
        if not busy.item():
            return done, steps
        steps += 1
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = (out.outputs[0].token_ids, out.outputs[0].logprobs)
