"""Run a function on two real processes joined by torch.distributed (gloo), each holding
its tensor-parallel shard of whatever model the function loads: the harness of the
tensor-parallel and distribution tests."""

from __future__ import annotations

import functools
import multiprocessing as mp
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from xllm_py.parallel.context import ParallelContext

WORLD = 2
DEADLINE_S = 240  # a rank that outlives this is killed (a hang guard, not a speed bound)


def use_parallel_workers(parallel: ParallelContext) -> None:
    """Every LLM built after this in the process holds this rank's shard (as a cluster
    node's worker does)."""
    import xllm_py.worker.worker as worker  # engine_core.local_executor builds it from here

    worker.Worker = functools.partial(worker.Worker, parallel=parallel)


def _rank_main(rank: int, port: int, ep_size: int, work: Callable, out_dir: Path) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=WORLD,
            timeout=timedelta(seconds=DEADLINE_S),
        )
        parallel = ParallelContext.from_group(ep_size=ep_size)
        assert (parallel.tp_rank, parallel.tp_size, parallel.ep_size) == (rank, WORLD, ep_size)
        torch.save(work(parallel), out_dir / f"rank{rank}.pt")
        dist.destroy_process_group()
    except BaseException:
        (out_dir / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(ep_size: int, work: Callable, out_dir: Path) -> list:
    """`work(parallel)` on each rank (a picklable, module-level callable); both ranks'
    results. A failing or hanging rank fails the test, and no process outlives it."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, port, ep_size, work, out_dir), daemon=True)
        for r in range(WORLD)
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
    assert codes == [0] * WORLD, f"rank exit codes {codes} (killed after {DEADLINE_S} s?)"
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(WORLD)]
