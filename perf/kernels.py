"""Kernel benchmark: each op of xllm_py/ops and each backend, its time per call, the
bytes it must move and the FLOPs it must do per second, against the device's peak.

    paged_mla  decode attention over the paged latent cache (B requests, H heads, a
               context of --context tokens each). Backends: gather (the form the engine
               used before: every request's whole context copied out of the cache at
               once, then one masked softmax), torch (block-wise), triton (in place).
    fused_moe  the routed experts of one MoE layer for B tokens. Backends: torch (the
               grouped loop over active experts), triton (the fused kernels).
    fp8_gemm   one block-FP8 linear for B tokens. Backends: torch (dequantise, then a
               matmul), triton (block-scaled kernel).

Bytes are what the op cannot avoid reading (the context's latents; the weights of the
experts the tokens pick; the FP8 weight and its scales); FLOPs are the multiply-adds of
its matmuls. On CPU the Triton rows are skipped (Triton's interpreter is a correctness
check, not a speed); run it on a GPU for those. --memory adds, for paged_mla, the peak
extra memory each backend allocates in one call (torch's profiler, allocations minus
frees in time order): the gather form holds the whole context, the block-wise form a
bounded chunk.

    python -m perf.kernels                      # CPU: the small model's shapes, 2 threads
    python -m perf.kernels --memory --batch 1 32 --context 1800
    python -m perf.kernels --device cuda        # DeepSeek-V3 shapes per GPU (TP 8)
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from perf.common import RESULTS, command, machine, md_table, parser, settings, write_json
from perf.gpu_report import peak_bandwidth
from perf.step_cost import sync

# Per-device shapes. cuda: DeepSeek-V3 on 8 GPUs (16 of 128 heads; 32 of 256 experts);
# cpu: the bundled small model's (xllm_py/assets/small-deepseek-v3-mtp).
SHAPES = {
    "cuda": dict(heads=16, kv_lora=512, rope=64, hidden=7168, inter=2048, experts=32, top_k=8),
    "cpu": dict(heads=8, kv_lora=512, rope=64, hidden=512, inter=256, experts=16, top_k=4),
}
# Datasheet dense bf16 tensor-core peaks, FLOP/s (words all in the device name).
PEAK_FLOPS = [(("H200",), 989e12), (("H100",), 989e12), (("A100",), 312e12)]


def timeit(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Median seconds per call after two warm-up calls."""
    fn(), fn()
    times = []
    for _ in range(iters):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def peak_extra_bytes(fn: Callable[[], object]) -> int:
    """The most memory `fn` held at once beyond what existed before it (CPU)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    held = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        held += e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        peak = max(peak, held)
    return peak


def mla_case(s: dict, batch: int, context: int, block: int, dtype, device) -> tuple:
    """Arguments of one decode call (Q = 1), every request at `context` tokens."""
    g = torch.Generator(device="cpu").manual_seed(0)
    width = -(-context // block)
    d = s["kv_lora"] + s["rope"]
    cache = torch.randn(batch * width + 1, block, d, generator=g).to(device, dtype)
    table = torch.randperm(batch * width, generator=g).view(batch, width).to(device)
    q = torch.randn(batch, 1, s["heads"], d, generator=g).to(device, dtype) / d**0.5
    lens = torch.full((batch,), context, device=device)
    ones = torch.ones(batch, dtype=torch.long, device=device)
    args = (q, cache, table, lens, ones, 1.0, s["kv_lora"])
    moved = (batch * context * d + q.numel() + batch * s["heads"] * s["kv_lora"]) * cache.itemsize
    flops = 2 * batch * s["heads"] * context * (d + s["kv_lora"])
    return args, moved, flops


def moe_case(s: dict, tokens: int, dtype, device) -> tuple:
    from xllm_py.models.layers.linear import gemm_layout

    g = torch.Generator(device="cpu").manual_seed(0)
    e, h, i, k = s["experts"], s["hidden"], s["inter"], s["top_k"]
    w13 = gemm_layout((torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(device, dtype))
    w2 = gemm_layout((torch.randn(e, h, i, generator=g) / i**0.5).to(device, dtype))
    x = torch.randn(tokens, h, generator=g).to(device, dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)]).to(device)
    weights = torch.rand(tokens, k, generator=g).to(device, dtype)
    active = ids.unique().numel()
    moved = (active * 3 * h * i + 2 * tokens * h) * w13.itemsize
    return (x, weights, ids, w13, w2, 0), moved, 2 * tokens * k * 3 * h * i


def fp8_case(s: dict, tokens: int, dtype, device) -> tuple:
    from xllm_py.weights.fp8 import Fp8Weight, block_index, quantize

    n, k = 2 * s["inter"], s["hidden"]
    w, scale = quantize(torch.randn(n, k) / k**0.5, (128, 128))
    rows, cols = block_index(n, 128), block_index(k, 128)
    weight = Fp8Weight(w.to(device), scale.to(device), rows, cols, (128, 128))
    x = torch.randn(tokens, k).to(device, dtype)
    return (x, weight), n * k + scale.numel() * 4 + 2 * tokens * (n + k), 2 * tokens * n * k


def gather_mla(q, cache, block_table, ctx_lens, q_lens, scale, kv_lora_rank):
    """Decode attention as the engine ran it before the block-wise form (Q = 1): every
    request's whole context copied out of the cache, an additive mask, one softmax."""
    B, _, H, D = q.shape
    num_blocks, block_size, _ = cache.shape
    kv = cache.view(num_blocks, -1).index_select(0, block_table.reshape(-1)).view(B, -1, D)
    pos = torch.arange(kv.shape[1], device=q.device)
    mask = torch.zeros(B, 1, kv.shape[1], dtype=q.dtype, device=q.device)
    mask.masked_fill_((pos >= ctx_lens.view(-1, 1)).unsqueeze(1), float("-inf"))
    scores = torch.baddbmm(mask, q.view(B, H, D), kv.transpose(1, 2), alpha=scale)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(kv.dtype)
    return torch.bmm(probs, kv[..., :kv_lora_rank]).view(B, 1, H, kv_lora_rank)


def backends(op: str, device: torch.device) -> dict[str, Callable]:
    from xllm_py.ops import fp8_gemm, fused_moe, paged_mla

    table = {
        "paged_mla": {
            "gather": gather_mla,
            "torch": paged_mla.paged_mla_torch,
            "triton": paged_mla.paged_mla_triton,
        },
        "fused_moe": {"torch": fused_moe.fused_moe_reference, "triton": fused_moe.fused_moe_triton},
        "fp8_gemm": {"torch": fp8_gemm.fp8_gemm_reference, "triton": fp8_gemm.fp8_gemm_triton},
    }[op]
    return table if device.type == "cuda" else {k: v for k, v in table.items() if k != "triton"}


def bench(args) -> list[dict]:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    s = SHAPES[device.type]
    rows = []
    for op in args.ops:
        for batch in args.batch:
            if op == "paged_mla":
                case = mla_case(s, batch, args.context, args.block_size, dtype, device)
            else:
                case = (moe_case if op == "fused_moe" else fp8_case)(s, batch, dtype, device)
            call, moved, flops = case
            for name, fn in backends(op, device).items():
                once = lambda fn=fn, call=call: fn(*call)  # noqa: E731
                sec = timeit(once, device, args.iters)
                row = dict(op=op, backend=name, batch=batch, ms=sec * 1e3,
                           gb_per_s=moved / sec / 1e9, tflop_per_s=flops / sec / 1e12)  # fmt: skip
                if args.memory and op == "paged_mla" and device.type == "cpu":
                    row["peak_extra_mib"] = peak_extra_bytes(once) / 2**20
                print("  ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                for k, v in row.items()), flush=True)  # fmt: skip
                rows.append(row)
    return rows


FLAGS = [
    ("--device", str, "cuda" if torch.cuda.is_available() else "cpu", "cpu or cuda[:N]"),
    (
        "--dtype",
        ("float32", "bfloat16", "float16"),
        None,
        "default: bfloat16 on cuda, float32 on cpu (the engine's defaults)",
    ),  # fmt: skip
    ("--ops", str, ["paged_mla", "fused_moe", "fp8_gemm"], "which ops"),
    ("--batch", int, [1, 32], "batch sizes (requests for attention, tokens for MoE/GEMM)"),
    ("--context", int, 1800, "tokens of context per request (paged_mla)"),
    ("--block-size", int, 128, "KV cache block size (the engine's default)"),
    ("--threads", int, 0, "torch CPU threads (0: torch's default)"),
    ("--iters", int, 20, "timed calls per row (the median is reported)"),
    ("--memory", bool, False, "paged_mla on CPU: also the peak extra memory per call"),
    (
        "--hbm-gbps",
        float,
        None,
        "peak memory bandwidth in GB/s (default: the datasheet's by GPU name, or a measured copy)",
    ),  # fmt: skip
    ("--out", str, None, "result JSON (default perf/results/kernels/<device>.json)"),
]


def main(argv: list[str] | None = None) -> dict:
    args = parser(__doc__, FLAGS).parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = peak_bandwidth(args, device, name)
    flops_peak = next((f for w, f in PEAK_FLOPS if all(x in name for x in w)), None)
    if device.type == "cpu":
        print("CPU: Triton timings need a GPU (on CPU Triton runs in its interpreter, a "
              "correctness check); timing the torch backends", flush=True)  # fmt: skip
    rows = bench(args)
    for row in rows:
        row["fraction_of_peak_bandwidth"] = row["gb_per_s"] * 1e9 / peak["bytes_per_s"]
        if flops_peak:
            row["fraction_of_peak_flops"] = row["tflop_per_s"] * 1e12 / flops_peak
    head = list(dict.fromkeys(k for r in rows for k in r))
    cell = lambda v: f"{v:.3g}" if isinstance(v, float) else ("" if v is None else v)  # noqa: E731
    print(md_table(head, [[cell(r.get(k)) for k in head] for r in rows]))
    result = dict(command=command("kernels", argv), machine=machine(), settings=settings(args),
                  device=name, peak_bandwidth=peak, peak_flops=flops_peak, rows=rows)  # fmt: skip
    slug = name.replace(" ", "_")
    write_json(args.out or RESULTS / "kernels" / f"{slug}.json", result)
    return result


if __name__ == "__main__":
    main()
