#!/usr/bin/env python3
"""Peak memory and speed of loading an FP8 checkpoint, dequantised at load and FP8-resident.

    python -m perf.load_memory                        # ~1 GB random FP8 checkpoint, 1 rank
    python -m perf.load_memory --checkpoint DIR --output perf/results/load_memory.json

Builds (once, under --work-dir) a random DeepSeek-V3-shaped FP8 checkpoint of about 1 GB
(tools/make_random_checkpoint.py, 128 x 128 blocks, 4 shards), then for each weight format
loads the target in a fresh process and reports, from the process's resident set size:

    final      anonymous RSS after loading minus before (the weights as held)
    overhead   peak anonymous RSS during loading minus after: the allocations loading
               needed on top (sampled every millisecond by a thread)
    mapped     peak file-backed RSS: pages of the memory-mapped shard files that reads
               touched (safetensors maps the files; the kernel can drop these pages
               at any time, they are not allocations)
    largest    bytes of the largest tensor as held, and overhead / largest
    read       GB read from the files and GB/s (the loader's own count)

The promise measured: overhead <= 3 x the largest tensor.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

OVERRIDES = dict(
    hidden_size=1024,
    intermediate_size=2048,
    moe_intermediate_size=768,
    n_routed_experts=64,
    num_experts_per_tok=6,
    n_group=8,
    topk_group=4,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=8,
    q_lora_rank=384,
    kv_lora_rank=256,
    qk_rope_head_dim=32,
    qk_nope_head_dim=64,
    v_head_dim=64,
)


def rss(kind: str = "RssAnon") -> int:
    """This process's resident bytes of one kind (RssAnon, RssFile, VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(kind + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {kind} in /proc/self/status")


class PeakSampler:
    """The largest RssAnon and RssFile seen while running (a thread sampling every 1 ms)."""

    def __enter__(self) -> PeakSampler:
        self.anon = self.file = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.anon = max(self.anon, rss("RssAnon"))
            self.file = max(self.file, rss("RssFile"))

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def measure(path: str, weight_dtype: str) -> dict:
    """In this (fresh) process: build and load the target, report the figures."""
    import torch

    from xllm_py.config import ModelConfig
    from xllm_py.models.deepseek_v3 import DeepseekV3ForCausalLM
    from xllm_py.weights.fp8 import Fp8Config, fp8_resident
    from xllm_py.weights.loader import Checkpoint, layer_index, load_weights

    torch.set_num_threads(2)
    cfg = ModelConfig.from_pretrained(path)
    fp8 = Fp8Config.from_quantization_config(cfg.quantization_config)
    ckpt = Checkpoint(path, fp8)
    with fp8_resident(fp8.block if weight_dtype == "fp8" else None):
        model = DeepseekV3ForCausalLM(cfg)  # torch.empty: pages untouched until loaded
    n = cfg.num_hidden_layers
    before, file_before = rss(), rss("RssFile")
    with PeakSampler() as peak:
        stats = load_weights(
            model, ckpt, lambda name: None if (layer_index(name) or 0) >= n else name
        )
    after = rss()
    largest = max(t.numel() * t.element_size() for t in model.state_dict().values())
    overhead = max(peak.anon - after, 0)
    return {
        "weight_dtype": weight_dtype,
        "final_bytes": after - before,
        "overhead_bytes": overhead,
        "mapped_file_bytes_peak": max(peak.file - file_before, 0),
        "largest_tensor_bytes": largest,
        "overhead_over_largest": round(overhead / largest, 2),
        "gb_read": round(stats.bytes_read / 1e9, 3),
        "seconds": round(stats.seconds, 2),
        "gb_per_s": round(stats.bytes_read / 1e9 / stats.seconds, 3),
    }


def build(work_dir: Path) -> Path:
    from tools.make_random_checkpoint import make_random_checkpoint

    path = work_dir / "fp8-1gb"
    if not (path / "config.json").is_file():
        print(f"writing a ~1 GB random FP8 checkpoint to {path} ...", flush=True)
        make_random_checkpoint(path, OVERRIDES, fp8_block=(128, 128), shards=4, seed=0)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--checkpoint", type=Path, help="an FP8 checkpoint (default: build one)")
    ap.add_argument(
        "--work-dir",
        type=Path,
        default=Path("/tmp/xllm-load-memory"),
        help="where the built checkpoint goes",
    )
    ap.add_argument(
        "--output",
        type=Path,
        default=ROOT / "perf/results/load_memory.json",
        help="JSON result file",
    )
    ap.add_argument("--child", nargs=2, metavar=("PATH", "WEIGHT_DTYPE"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(measure(*a.child)))
        return
    path = a.checkpoint or build(a.work_dir)
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    rows = []
    for wd in ("float32", "fp8"):
        t = time.monotonic()
        out = subprocess.run(
            [sys.executable, "-m", "perf.load_memory", "--child", str(path), wd],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"{wd}: {rows[-1]} ({time.monotonic() - t:.0f} s with start-up)", flush=True)
    print(f"\ncheckpoint {path}: {size / 1e9:.2f} GB on disk")
    head = ("weights", "final GB", "overhead GB", "mapped GB", "largest MB", "x largest", "GB/s")
    print("".join(f"{h:>12}" for h in head))
    for r in rows:
        cells = (
            r["weight_dtype"],
            f"{r['final_bytes'] / 1e9:.2f}",
            f"{r['overhead_bytes'] / 1e9:.3f}",
            f"{r['mapped_file_bytes_peak'] / 1e9:.3f}",
            f"{r['largest_tensor_bytes'] / 1e6:.1f}",
            f"{r['overhead_over_largest']:.2f}",
            f"{r['gb_per_s']:.2f}",
        )
        print("".join(f"{c:>12}" for c in cells))
    a.output.parent.mkdir(parents=True, exist_ok=True)
    a.output.write_text(
        json.dumps({"checkpoint_gb": round(size / 1e9, 3), "runs": rows}, indent=2) + "\n"
    )
    print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
