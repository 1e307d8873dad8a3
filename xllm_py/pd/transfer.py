"""The KV data plane: Mooncake's transfer engine, and cache blocks as memory regions.

Each instance starts a `KVTransport` on the address it is given (loopback by default) and
registers its KV cache tensors with it. A prefill instance then writes whole blocks
straight from its cache into the blocks a decode instance reserved: one region per run of
consecutive block ids per cache tensor, all in one batch (`write_blocks`).

Mooncake's Python wheels (`mooncake-transfer-engine-non-cuda` on CPU hosts; the CUDA,
NPU and EFA builds on accelerators) link against rdma-core's `libibverbs.so.1` (and
libnl) even for their TCP transport. Where the system has no rdma-core, `make setup`
unpacks Debian's three libraries into `.venv/lib/rdma`, and they are loaded from there
(or from `$XLLM_RDMA_LIBS`) before the engine. This is a trusted-network data plane, as
NCCL's is: it listens on `host` and carries raw cache bytes.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

import torch

PACKAGE = "mooncake-transfer-engine-non-cuda"
# rdma-core and its netlink libraries, in load order
RDMA_LIBS = ("libnl-3.so.200", "libnl-route-3.so.200", "libibverbs.so.1")


class TransferError(RuntimeError):
    """A KV transfer failed (the peer is gone, refused the write, or timed out)."""


def rdma_lib_dir() -> Path:
    return Path(os.environ.get("XLLM_RDMA_LIBS") or Path(sys.prefix) / "lib" / "rdma")


def transfer_engine_class():
    """Mooncake's TransferEngine class; a clear error naming the package when it is missing."""
    try:
        from mooncake.engine import TransferEngine
    except ModuleNotFoundError as e:
        raise RuntimeError(
            f"prefill/decode disaggregation needs Mooncake's transfer engine: pip install "
            f"{PACKAGE} (CPU hosts; mooncake-transfer-engine for CUDA)"
        ) from e
    except ImportError:  # the wheel is there, rdma-core is not on the library path
        folder = rdma_lib_dir()
        missing = [n for n in RDMA_LIBS if not (folder / n).exists()]
        if missing:
            raise RuntimeError(
                f"Mooncake's transfer engine needs rdma-core's libibverbs: install it (Debian: "
                f"apt-get install libibverbs1) or unpack {', '.join(missing)} into {folder} "
                "(`make setup` does) or the folder $XLLM_RDMA_LIBS names"
            ) from None
        for name in RDMA_LIBS:
            ctypes.CDLL(str(folder / name), mode=ctypes.RTLD_GLOBAL)
        from mooncake.engine import TransferEngine
    return TransferEngine


class KVTransport:
    """One instance's transfer engine, TCP over `host`, with no metadata server (Mooncake's
    peer-to-peer handshake). `session_id` is what peers write to. Every registered region
    is unregistered by `close` (`registered_bytes` counts what is still registered)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.engine = transfer_engine_class()()
        if self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError(f"Mooncake's transfer engine did not start on {host}")
        self.session_id = f"{host}:{self.engine.get_rpc_port()}"
        self._regions: dict[int, int] = {}  # address -> bytes
        self.bytes_written = 0

    @property
    def registered_bytes(self) -> int:
        return sum(self._regions.values())

    def register(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            if not t.is_contiguous():
                raise ValueError("a KV cache tensor to register must be contiguous")
            if self.engine.register_memory(t.data_ptr(), t.nbytes) != 0:
                raise RuntimeError(f"Mooncake refused to register {t.nbytes} bytes")
            self._regions[t.data_ptr()] = t.nbytes

    def close(self) -> None:
        for address in list(self._regions):
            self.engine.unregister_memory(address)
            del self._regions[address]

    def write_blocks(
        self,
        session_id: str,
        src: list[torch.Tensor],
        src_blocks: list[int],
        dst_addresses: list[int],
        dst_blocks: list[int],
    ) -> int:
        """Copy blocks `src_blocks` of this instance's cache tensors `src` into blocks
        `dst_blocks` of the peer's, whose tensors start at `dst_addresses` (same shapes:
        the compatibility record says so). Returns the bytes written."""
        if len(src_blocks) != len(dst_blocks) or len(src) != len(dst_addresses):
            raise ValueError("source and destination blocks (and tensors) must pair up")
        local, remote, lengths = [], [], []
        for t, base in zip(src, dst_addresses):
            stride = t.stride(0) * t.element_size()
            for s, d, n in block_runs(src_blocks, dst_blocks):
                local.append(t.data_ptr() + s * stride)
                remote.append(base + d * stride)
                lengths.append(n * stride)
        if not lengths:
            return 0
        if self.engine.batch_transfer_sync_write(session_id, local, remote, lengths) != 0:
            raise TransferError(f"the KV write to {session_id} failed ({sum(lengths)} bytes)")
        self.bytes_written += sum(lengths)
        return sum(lengths)


def block_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(first source block, first destination block, count) for each run in which both
    block ids go up by one: one memory region each instead of one per block."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs
