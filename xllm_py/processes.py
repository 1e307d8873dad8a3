"""What the processes `xllm` starts set up, and the engine core process's entry point.

    ProcessOptions   process-wide state from the flags, applied once at a process's start:
                     the fault hook, the compiled-grammar cache's size, Inductor's cache
                     folder, torch's CPU threads and, on CPU, glibc's heap thresholds (the
                     daemon, a cluster worker node, the engine core process, the offline LLM)
    build_core       the engine core a daemon drives: None (LLMEngine builds a one-node
                     core), or on the master of a cluster the data-parallel core, once every
                     worker has registered and loaded
    Boot / core_main the engine core process (engine/core_process.py): the parent builds the
                     frozen EngineConfig, the process options and the cluster options once and
                     sends them as one typed msgspec message, the first on the pipe; the child
                     parses no command line and builds nothing twice

This module sits above engine/ and cluster/ (a cluster's core needs both), below cli.py.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

import msgspec

from xllm_py.args import EngineArgs
from xllm_py.cluster.layout import ClusterOptions
from xllm_py.config import EngineConfig
from xllm_py.engine import core_process

logger = logging.getLogger("xllm")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s (engine core): %(message)s"


@dataclass(frozen=True)
class ProcessOptions:
    """Process-wide state (EngineArgs' fields of the same names, resolved)."""

    enable_test_hooks: bool = False
    grammar_cache_bytes: int = 256 << 20
    compile_cache_dir: str | None = None  # TORCHINDUCTOR_CACHE_DIR to set (None: keep)
    cpu_threads: int = 0  # torch's CPU threads to set (0: leave them)
    on_cpu: bool = False  # the model runs on CPU: keep freed large blocks (keep_large_blocks)

    @classmethod
    def from_args(cls, a: EngineArgs, threads: bool) -> ProcessOptions:
        """`threads`: this process runs the model on CPU and sets torch's threads (one
        process: the cores less one, which the HTTP loop keeps; nnodes on one machine: a
        share each; --cpu_threads wins)."""
        given = a.compile_cache_dir != EngineArgs.compile_cache_dir
        cache = None
        if given or "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
            cache = os.path.expanduser(a.compile_cache_dir)
        cpu_threads = 0
        if threads and a.devices.startswith("cpu"):
            cores = os.cpu_count() or 1
            auto = max(1, cores // a.nnodes) if a.nnodes > 1 else max(1, cores - 1)
            cpu_threads = a.cpu_threads or auto
        on_cpu = a.devices.startswith("cpu")
        return cls(a.enable_test_hooks, a.grammar_cache_bytes, cache, cpu_threads, on_cpu)

    def apply(self) -> None:
        from xllm_py import structured
        from xllm_py.engine import faults

        faults.configure(self.enable_test_hooks)
        if self.compile_cache_dir is not None:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = self.compile_cache_dir
        structured.set_cache_limit(self.grammar_cache_bytes)
        if self.cpu_threads:
            import torch

            torch.set_num_threads(self.cpu_threads)
        if self.on_cpu:
            keep_large_blocks()


# Blocks up to this size come from (and go back to) the heap, which keeps this much free
KEEP_BYTES = 1 << 30


def keep_large_blocks() -> bool:
    """Have glibc's malloc serve blocks up to KEEP_BYTES from its heap and keep that much
    freed memory for reuse (False where this is not glibc). By default a block over 32 MiB
    is mapped from the kernel on every allocation and unmapped on every free, and the
    fresh pages fault in one by one: a sampled step's [rows, vocabulary] tensors (2,048 x
    8,208 float32 is 67 MB) then cost several times their arithmetic on CPU (a softmax
    over them here: 99 ms, 28 ms with this). The price is a resident size that stays at its
    peak, as with jemalloc or tcmalloc, which CPU PyTorch deployments often preload for
    the same reason."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        trim, mmap = -1, -3  # M_TRIM_THRESHOLD, M_MMAP_THRESHOLD (malloc.h)
        return bool(libc.mallopt(mmap, KEEP_BYTES)) and bool(libc.mallopt(trim, KEEP_BYTES))
    except (OSError, AttributeError):  # not glibc (musl, macOS): its own policy stays
        return False


def cluster_options(a: EngineArgs, config: EngineConfig) -> ClusterOptions | None:
    """This node's cluster options, token and TLS files read now (None: one node); the
    model must split over the layout (ValueError naming the numbers)."""
    if a.nnodes == 1:
        return None
    if config.model.is_v4 and a.enable_dp_attention:
        raise ValueError(
            f"--enable_dp_attention: {config.model.path} is DeepSeek-V4, whose DP attention "
            "is not implemented (its tensor, expert and data parallelism are)"
        )
    from xllm_py.cluster.layout import options_from_args

    options = options_from_args(a, read_secrets=True)
    options.layout.check_model(config.model)
    return options


def build_core(config: EngineConfig, cluster: ClusterOptions | None, on_worker_drain):
    """The engine core: None (LLMEngine builds a one-node core), or on the master of a
    cluster, the data-parallel core once every worker has registered and loaded.
    on_worker_drain(why): a worker got SIGTERM (called from the health monitor's thread)."""
    if cluster is None:
        return None
    from xllm_py.cluster.master import Cluster

    master = Cluster(cluster, config, on_worker_drain)
    try:
        return master.start()
    except BaseException as e:
        master.shutdown(f"the master failed to start: {e}", failure=True)
        raise


class Boot(msgspec.Struct):
    """The engine core process's whole configuration, built once in the parent."""

    config: EngineConfig
    process: ProcessOptions
    cluster: ClusterOptions | None
    log_level: str


def boot_for(a: EngineArgs, config: EngineConfig) -> Boot:
    process = ProcessOptions.from_args(a, threads=True)
    return Boot(config, process, cluster_options(a, config), a.log_level)


def start_core_process(a: EngineArgs, config: EngineConfig, on_worker_drain):
    """The engine core in a child process (`python -m xllm_py.processes`), loaded."""
    boot = msgspec.msgpack.encode(boot_for(a, config))
    return core_process.CoreProcessClient(__name__, boot, config, on_worker_drain)


def exit_with_parent(interval: float = 1.0) -> None:
    """Exit when the HTTP process is gone, however it went. Its pipe closing tells a core
    that is serving; a core still being built (weights loading, graphs compiling: minutes)
    reads nothing until it is, and would run on orphaned to the end of its start-up,
    holding its memory (a restarted daemon's core then finds the device full)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def core_main() -> int:
    """The engine core process: read Boot from the pipe, build the core it describes,
    serve it (engine/core_process.py's run_core)."""
    from xllm_py.engine.engine_core import EngineCore

    # The HTTP process owns the lifetime: a terminal's Ctrl-C or a SIGTERM to the process
    # group drains there, and the core exits when told to (or when its pipe closes, or its
    # parent is gone).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    exit_with_parent()
    channel = core_process.child_channel()
    try:
        boot = channel.recv_first(Boot)
        logging.basicConfig(level=boot.log_level.upper(), format=LOG_FORMAT)
        boot.process.apply()
        drain = lambda why: channel.send(core_process.WorkerDrain(why))  # noqa: E731
        core = build_core(boot.config, boot.cluster, drain) or EngineCore(boot.config)
        return core_process.run_core(core, channel)
    except EOFError:
        return 0  # the HTTP process is gone
    except BaseException as e:  # noqa: BLE001 - reported to the HTTP process, then exit 1
        logger.exception("engine core failed to start")
        core_process.report_failure(channel, e)
        return 1


if __name__ == "__main__":
    sys.exit(core_main())
