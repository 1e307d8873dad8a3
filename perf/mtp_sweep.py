"""Baseline vs MTP serving sweep in one command: the table, a plot and all raw JSON.

    python -m perf.mtp_sweep --scale cpu --k 1 2
    python -m perf.mtp_sweep --scale cpu --k 1 --peer vllm --peer llama.cpp   # make peers
    python -m perf.mtp_sweep --scale full --model /models/DeepSeek-V3 \\
        --server-args "--devices=cuda:0 --draft_model /models/DeepSeek-V3-MTP"

For each method (baseline, MTP with each --k, --adaptive, each --peer's) it starts the
server, warms it up, runs perf/bench_serving.py at every --concurrency on the same ShareGPT
prompts and settings (greedy, ignore_eos), and stops it. --peer (perf/peers.py): vLLM plain
and with deepseek_mtp at each --k, llama.cpp's llama-server with a slot per request in
flight; each peer's greedy tokens on held-out prompts are compared with ours before it is
benchmarked; a peer that fails is noted and the sweep goes on. --launch replaces our
daemon with any command ({port} and {k} substituted; it must serve /health; one that
returns needs --launch-stop).
--rounds N (N > 1) measures our methods side by side instead of one after another: all
our servers run at once (ports --port, --port + 1, ...), and at each concurrency N rounds
run every method once, round r on prompts of seed --seed + r (so no round finds the last
one's prompts in the prefix cache), in an order rotated by r. A row is the round of median
throughput, its speedup the median of each round's ratio to that round's baseline: drift
in the machine's speed over the sweep (10-30% on a shared 2-core machine) falls on every
method alike. It needs a model that fits once per method; peers still run after ours.
Scales: full = 2500 in / 1500 out, 80 requests per level; cpu = 256 / 128,
max(24, 2 x concurrency). Writes to --result-dir results.md (per method and concurrency:
TPOT, TTFT, tokens/s, speedup over the baseline, acceptance length and per draft position,
the batch-1 ceiling of perf/step_cost.py, the peers' agreement), sweep.png, sweep.json and
raw/ (bench_serving's).
"""

from __future__ import annotations

import itertools
import json
import re
import shlex
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from perf import bench_serving, peers, step_cost
from perf.common import RESULTS, command, machine, md_table, parser
from perf.daemon import Daemon, flag_value, warm_up
from xllm_py.assets import bundled_model
from xllm_py.config import ModelConfig
from xllm_py.speculative.hot_vocab import draft_vocab_size, token_map_path

PRESETS = {
    "full": {"input_len": 2500, "output_len": 1500, "prompts": lambda c: 80},
    "cpu": {"input_len": 256, "output_len": 128, "prompts": lambda c: max(24, 2 * c)},
}  # fmt: skip
POS = "spec_decode_per_position_acceptance_rates"  # [j - 1]: accepted at position j / drafts
ROW_KEYS = ("mean_tpot_ms", "mean_ttft_ms", "output_throughput", "total_token_throughput",
            "failed", "completed", "spec_decode_acceptance_length",
            "spec_decode_acceptance_rate", POS)  # fmt: skip


@dataclass
class Method:
    """One row group: a server started by `cmd` (stopped by `stop` too, for a launcher that
    returns), ready once /health answers; `engine`: the peer whose greedy tokens are
    compared with ours first (None: ours)."""

    name: str
    tag: str  # file names: server_{tag}.log, raw/{tag}_c{concurrency}.json
    cmd: list[str]
    stop: list[str] | None = None
    engine: str | None = None


def server_command(args, k: int, adaptive: bool = False, port: int | None = None) -> list[str]:
    port = port or args.port
    if args.launch:
        return shlex.split(args.launch.format(port=port, k=k))
    cmd = [
        sys.executable, "-m", "xllm_py", "--port", str(port), f"--num_speculative_tokens={k}",
    ]  # fmt: skip
    cmd += ["--speculative_adaptive=true"] * adaptive
    cmd += ["--graph_warm_up=startup"]  # graph mode (where on) complete before /health
    return cmd + ["--model", args.model] * bool(args.model) + shlex.split(args.server_args)


def lengths(args) -> tuple[int, int]:
    p = PRESETS[args.scale]
    return args.input_len or p["input_len"], args.output_len or p["output_len"]


def bench_argv(args, url: str, concurrency: int, raw: Path, name: str, seed: int = 0) -> list[str]:
    """bench_serving's flags; `seed` is added to --seed (a round's prompts)."""
    input_len, output_len = lengths(args)
    n = args.num_prompts or PRESETS[args.scale]["prompts"](concurrency)
    argv = ["--base-url", url, "--num-prompts", str(n), "--max-concurrency", str(concurrency),
            "--input-len", str(input_len), "--output-len", str(output_len), "--ignore-eos",
            "--sharegpt-output-range-ratio", str(args.output_range_ratio),
            "--temperature", "0", "--seed", str(args.seed + seed), "--save-result",
            "--result-dir", str(raw), "--result-filename", f"{name}.json",
            "--disable-tqdm"]  # fmt: skip
    return argv + (["--tokenizer", args.model] if args.model else [])


def peer_methods(args) -> tuple[list[Method], dict]:
    """The --peer servers on the checkpoint (perf/peers.py), and what the agreement check
    needs: our greedy tokens on held-out prompts, at our daemon's dtype."""
    for engine in args.peer:
        if why := peers.missing(engine):
            sys.exit(f"--peer {engine}: {why}")
    model = Path(args.model or bundled_model())
    dtype = peers.resolved_dtype(flag_value(shlex.split(args.server_args), "dtype"))
    max_len = sum(lengths(args)) + 64
    methods = []
    if "vllm" in args.peer:
        for k in [0, *args.k]:
            name = "vLLM" + f" MTP k={k}" * bool(k)
            cmd = peers.vllm_command(model, args.port, k, dtype, max_len)
            methods.append(Method(name, f"vllm_k{k}", cmd, engine="vllm"))
    info: dict = {"dtype": dtype}
    if "llama.cpp" in args.peer:
        gguf = peers.convert(model, outtype=peers.OUTTYPES[dtype])
        cmd = peers.llama_server_command(gguf, args.port, max(args.concurrency), max_len,
                                         peers.server_threads())  # fmt: skip
        methods.append(Method("llama.cpp (no MTP)", "llama_cpp", cmd, engine="llama.cpp"))
        info |= {"gguf": str(gguf), "llama_cpp": peers.llama_cpp_source()}
    print(f"== our greedy tokens: {args.peer_prompts} prompts x {args.peer_tokens}", flush=True)
    info["prompts"] = peers.held_out_prompt_ids(model, args.peer_prompts)
    info["ours"] = peers.ours_greedy(model, dtype, info["prompts"], args.peer_tokens)
    return methods, info


def table(rows: list[dict]) -> str:
    head = ["method", "concurrency", "mean TPOT (ms)", "mean TTFT (ms)", "output tok/s",
            "total tok/s", "speedup", "acceptance length", "acceptance at 1..k", "ceiling",
            "failed"]  # fmt: skip
    acc, ceil = "spec_decode_acceptance_length", "ceiling"
    return md_table(head, [
        [r["method"], r["concurrency"], f"{r['mean_tpot_ms']:.1f}", f"{r['mean_ttft_ms']:.1f}",
         f"{r['output_throughput']:.1f}", f"{r['total_token_throughput']:.1f}",
         f"{r['speedup']:.2f}x", "" if r[acc] is None else f"{r[acc]:.2f}",
         " / ".join(f"{x:.2f}" for x in r[POS] or ()),
         "" if r[ceil] is None else f"{r[ceil]:.2f}x", r["failed"]]
        for r in rows]) + "\n"  # fmt: skip


def draft_vocab(flags: list[str], model: str) -> int:
    """The hot tokens our servers' drafts read (--speculative_draft_vocab_size in `flags`,
    "auto" sized from the token map as the engine sizes it; 0: the whole vocabulary)."""
    value = flag_value(flags, "speculative_draft_vocab_size") or "auto"
    path = token_map_path(
        flag_value(flags, "speculative_token_map"), flag_value(flags, "draft_model"), model
    )
    cfg = ModelConfig.from_pretrained(model)
    size = None if value == "auto" else int(value)
    return draft_vocab_size(size, path, cfg.vocab_size, cfg.is_v4)


def add_ceiling(args, rows: list[dict], input_len: int, output_len: int) -> dict | None:
    """Each MTP row's `ceiling` (perf/step_cost.py) at its k and measured acceptance length,
    the KV read over input_len + output_len / 2 tokens; routing statistics from
    --ceiling-routing, else measured here on the model (which must then fit this machine).
    A failure leaves the column empty rather than losing the sweep."""
    rows_k = [(r, re.fullmatch(r"MTP k=(\d+)", r["method"])) for r in rows]
    rows_k = [(r, int(m.group(1))) for r, m in rows_k if m and r["spec_decode_acceptance_length"]]
    if args.no_ceiling or not rows_k:
        return None
    try:
        model = args.model or bundled_model()
        flags = shlex.split(args.server_args)
        draft = flag_value(flags, "draft_model")
        bm = step_cost.byte_model(model, draft_model=draft, draft_vocab=draft_vocab(flags, model))
        if args.ceiling_routing:
            routing = json.loads(args.ceiling_routing.read_text())["routing"]
        else:
            window = max(k for _, k in rows_k) + 1
            routing = step_cost.routing_stats(model, args.ceiling_prompts, 32, window, draft)
        context = input_len + output_len // 2
        for r, k in rows_k:
            acc = r["spec_decode_acceptance_length"]
            r["ceiling"] = step_cost.ceiling_row(bm, routing, k, acc, context)["ceiling"]
    except Exception as e:  # noqa: BLE001 - the column is an extra, the sweep is the result
        print(f"ceiling column left empty: {type(e).__name__}: {e}", flush=True)
        return None
    return {"context": context, "routing": routing, "byte_model": bm.__dict__}


def rounds_note(rounds: int, rows: list[dict]) -> str:
    """With --rounds: how the rows were measured, and each round's speedups."""
    if rounds == 1:
        return ""
    lines = [
        f"- {r['method']}, concurrency {r['concurrency']}: "
        + " / ".join(f"{x:.2f}x" for x in r["round_speedups"])
        for r in rows
        if r["round_speedups"] and r["method"] != "baseline"
    ]
    return (
        f"Our methods ran side by side: all their servers up at once, {rounds} rounds at each "
        "concurrency, every method once a round on that round's prompts, in an order rotated "
        "by the round. A row is the method's round of median throughput; its speedup is the "
        "median of the rounds' speedups (each round's throughput over that round's "
        "baseline), which were:\n\n" + "\n".join(lines) + "\n\n"
    )


def peer_note(agree: dict[str, dict]) -> str:
    """The footer on --peer: whether the other engines compute what ours does."""
    lines = [
        f"- {name}: {100 * a['prompts_identical']:.0f}% of {a['num_prompts']} held-out prompts "
        f"identical to ours over {a['max_tokens']} greedy tokens, "
        f"{100 * a['mean_identical_fraction']:.1f}% of tokens identical, matching prefixes "
        f"{100 * a['prefix_agreement']:.1f}% of all tokens"
        for name, a in agree.items()
    ]  # fmt: skip
    return (
        "\nPeers against ours (the same prompt ids):\n" + "\n".join(lines) + "\n" if lines else ""
    )


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for method in dict.fromkeys(r["method"] for r in rows):
        rs = [r for r in rows if r["method"] == method]
        c = [r["concurrency"] for r in rs]
        a.plot(c, [r["output_throughput"] for r in rs], marker="o", label=method)
        b.plot(c, [r["mean_tpot_ms"] for r in rs], marker="o", label=method)
    for ax, title in ((a, "output tokens/s"), (b, "mean TPOT (ms)")):
        ax.set_xscale("log", base=2)
        ax.set(xlabel="concurrency", title=title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


FLAGS = [  # (flag, type, default, help)
    ("--scale", ("cpu", "full"), "cpu", "length and request-count preset"),
    ("--model", str, None, "checkpoint directory (None: the bundled model)"),
    ("--k", int, [1], "MTP draft counts to sweep"),
    ("--concurrency", int, [1, 2, 4, 8, 16, 20, 40, 80], "concurrency levels"),
    ("--num-prompts", int, 0, "requests per level (0: the preset's)"),
    ("--input-len", int, 0, "prompt tokens (0: the preset's)"),
    ("--output-len", int, 0, "output tokens (0: the preset's)"),
    ("--output-range-ratio", float, 0.0, "r in [0, 1): each request's output length drawn "
     "from [len * (1 - r), len * (1 + r)], the same draws for every method (0: every request "
     "runs to --output-len, so plain decoding keeps a wave's requests in step: "
     "perf/lockstep.py)"),
    ("--seed", int, 0, "prompt sampling seed"),
    ("--port", int, 8711, "port of the server (with --rounds: of the first of ours)"),
    ("--result-dir", Path, RESULTS / "mtp_sweep", "output folder"),
    ("--server-args", str, "", "more flags for our daemon, one quoted string"),
    ("--launch", str, None, "command starting another server instead ({port}, {k})"),
    ("--launch-stop", str, None, "with --launch: command stopping what it started, for "
     "launchers that return (e.g. 'scripts/launch_cluster.sh stop')"),
    ("--rounds", int, 1, "over 1: our methods' servers all up at once, and this many "
     "interleaved rounds at each concurrency, rows the medians (see above)"),
    ("--adaptive", bool, False, "also run MTP with --speculative_adaptive (k <= largest --k)"),
    ("--no-ceiling", bool, False, "leave out the ceiling column"),
    ("--ceiling-routing", Path, None, "a perf/step_cost.py JSON of this model whose routing "
     "the ceiling uses (None: measured here, loading the model in this process)"),
    ("--ceiling-prompts", int, 4, "held-out prompts to measure routing on"),
    ("--peer", peers.ENGINES, [], "also serve the model with this engine (again for another; "
     "`make peers` installs them) and benchmark it the same way, after checking that its "
     "greedy tokens agree with ours", {"action": "append", "nargs": None}),
    ("--peer-prompts", int, 4, "prompts for the agreement"),
    ("--peer-tokens", int, 32, "greedy tokens per prompt for the agreement"),
]  # fmt: skip


def run_method(args, m: Method, raw: Path, peer: dict) -> tuple[dict[int, dict], dict | None]:
    """Start m's server, compare a peer's greedy tokens with ours (`peer`: the prompts and our
    tokens), warm it up, benchmark it at every concurrency, stop it."""
    print(f"== {m.name}: starting the server", flush=True)
    log = args.result_dir / f"server_{m.tag}.log"
    wait = peers.STARTUP_TIMEOUT if m.engine else 600.0
    daemon = Daemon(m.cmd, args.port, log, stop_cmd=m.stop, group=True, startup_timeout=wait)
    results, agree = {}, None
    try:
        if m.engine:
            theirs = peers.served_greedy(daemon.url, m.engine, peer["prompts"], args.peer_tokens)
            agree = peers.agreement(peer["ours"], theirs)
            same = 100 * agree["mean_identical_fraction"]
            print(f"   greedy tokens identical to ours: {same:.1f}%", flush=True)
        warm_up(daemon.url)
        for c in args.concurrency:
            res = results[c] = bench_serving.run(
                bench_argv(args, daemon.url, c, raw, f"{m.tag}_c{c}")
            )
            print(f"   concurrency {c:>3}: {res['output_throughput']:8.1f} output tok/s, "
                  f"TPOT {res['mean_tpot_ms']:7.1f} ms, TTFT {res['mean_ttft_ms']:7.1f} ms, "
                  f"failed {res['failed']}", flush=True)  # fmt: skip
    finally:
        daemon.stop()
    return results, agree


def run_interleaved(args, methods: list[Method], raw: Path) -> dict[str, dict[int, dict]]:
    """Our methods side by side (--rounds): every server started and warmed up, then at
    each concurrency --rounds rounds of every method, in an order rotated by the round.
    Returns each method's median round by concurrency, with `round_speedups` (each round's
    throughput over that round's baseline) and `speedup` (their median)."""
    daemons: dict[str, Daemon] = {}
    rounds: dict[str, dict[int, list[dict]]] = {m.name: {} for m in methods}
    try:
        for i, m in enumerate(methods):
            print(f"== {m.name}: starting the server (port {args.port + i})", flush=True)
            log = args.result_dir / f"server_{m.tag}.log"
            daemons[m.name] = Daemon(m.cmd, args.port + i, log, group=True, startup_timeout=600.0)
            warm_up(daemons[m.name].url)
        for c in args.concurrency:
            for r in range(args.rounds):
                turn = r % len(methods)
                for m in methods[turn:] + methods[:turn]:
                    name = f"{m.tag}_c{c}_r{r}"
                    argv = bench_argv(args, daemons[m.name].url, c, raw, name, seed=r)
                    res = bench_serving.run(argv)
                    rounds[m.name].setdefault(c, []).append(res)
                    print(f"   concurrency {c:>3}, round {r}, {m.name}: "
                          f"{res['output_throughput']:8.1f} output tok/s", flush=True)  # fmt: skip
    finally:
        for d in daemons.values():
            d.stop()
    base = rounds[methods[0].name]
    results: dict[str, dict[int, dict]] = {}
    for m in methods:
        results[m.name] = {}
        for c, runs in rounds[m.name].items():
            tput = [x["output_throughput"] for x in runs]
            ratios = [t / b["output_throughput"] for t, b in zip(tput, base[c])]
            row = runs[tput.index(statistics.median_low(tput))]
            speedup = statistics.median(ratios)
            results[m.name][c] = row | {"round_speedups": ratios, "speedup": speedup}
    return results


def run_methods(args, methods: list[Method], raw: Path, peer: dict):
    """Each method's results by concurrency, the peers' agreement, and the peer methods that
    did not run, with why: a peer that fails (its server does not start, or errs; vLLM's
    CPU attention cannot run every model) is noted and the sweep goes on, and the peer's
    later methods are not started. A failure of ours ends the sweep: it is the result."""
    results: dict[str, dict[int, dict]] = {}
    agree: dict[str, dict] = {}
    failed: dict[str, str] = {}
    broken: dict[str, str] = {}  # peer engine -> the method that failed
    if args.rounds > 1:
        ours = [m for m in methods if m.engine is None]
        results = run_interleaved(args, ours, raw)
        methods = [m for m in methods if m.engine is not None]
    for m in methods:
        if m.engine in broken:
            failed[m.name] = f"Not started: {broken[m.engine]} failed."
            continue
        try:
            results[m.name], a = run_method(args, m, raw, peer)
        except Exception as e:
            if m.engine is None:
                raise
            first = str(e).splitlines()[0] if str(e) else ""
            failed[m.name] = f"{type(e).__name__}: {first} (log: server_{m.tag}.log)"
            broken[m.engine] = m.name
            print(f"   {m.name} failed, the sweep goes on: {failed[m.name]}", flush=True)
            continue
        agree |= {m.name: a} if a else {}
    return results, agree, failed


def main(argv: list[str] | None = None) -> dict:
    args = parser(__doc__, FLAGS).parse_args(argv)
    if args.adaptive and args.launch:
        sys.exit("--adaptive runs our daemon with --speculative_adaptive; not with --launch")
    if args.rounds < 1:
        sys.exit(f"--rounds {args.rounds}: at least 1")
    if args.rounds > 1 and args.launch_stop:
        sys.exit("--rounds runs our servers at once; not with --launch-stop (a launcher that "
                 "returns)")  # fmt: skip
    (raw := args.result_dir / "raw").mkdir(parents=True, exist_ok=True)
    input_len, output_len = lengths(args)
    stop = shlex.split(args.launch_stop) if args.launch and args.launch_stop else None
    # with --rounds our servers run at once: one port each
    ports = itertools.count(args.port) if args.rounds > 1 else itertools.repeat(args.port)
    methods = [Method("baseline", "k0", server_command(args, 0, port=next(ports)), stop)]
    methods += [Method(f"MTP k={k}", f"k{k}", server_command(args, k, port=next(ports)), stop)
                for k in args.k]  # fmt: skip
    if args.adaptive:
        cmd = server_command(args, max(args.k), adaptive=True, port=next(ports))
        methods.append(Method(f"MTP adaptive k<={max(args.k)}", "adaptive", cmd))
    peer: dict = {}
    if args.peer:
        more, peer = peer_methods(args)
        methods += more
    results, agree, failed = run_methods(args, methods, raw, peer)
    rows = []
    for c in args.concurrency:
        base = results["baseline"][c]
        for m in methods:
            if m.name not in results:
                continue
            r = results[m.name][c]
            speedup = r.get("speedup") or r["output_throughput"] / base["output_throughput"]
            rows.append({"method": m.name, "concurrency": c, "speedup": speedup,
                         "round_speedups": r.get("round_speedups"),
                         "ttft_ratio": r["mean_ttft_ms"] / base["mean_ttft_ms"], "ceiling": None,
                         **{key: r.get(key) for key in ROW_KEYS}})  # fmt: skip
    cmd = command("mtp_sweep", argv)
    summary = {
        "command": cmd, "scale": args.scale, "input_len": input_len, "output_len": output_len,
        "output_range_ratio": args.output_range_ratio,
        "machine": machine(), "rounds": args.rounds, "rows": rows,
        "peers": {**peer, "agreement": agree, "failed": failed} if peer else None,
        "ceiling": add_ceiling(args, rows, input_len, output_len),
    }  # fmt: skip
    (args.result_dir / "sweep.json").write_text(json.dumps(summary, indent=2))
    out_words = f"{output_len} output tokens"
    if r := args.output_range_ratio:
        lo, hi = bench_serving.random_length_bounds(output_len, r, 1)
        out_words = f"{lo}-{hi} output tokens (drawn per request, centre {output_len})"
    md = (
        f"# MTP sweep ({args.scale})\n\n`{cmd}`\n\nMachine: {json.dumps(summary['machine'])}\n\n"
        f"ShareGPT prompts cut/extended to {input_len} input tokens, {out_words} "
        "(ignore_eos), greedy; the same prompts and settings for every method. Speedup = "
        "output tok/s over the baseline at the same concurrency, measured in this run. "
        "Acceptance at 1..k = the share of verification passes whose draft j was accepted. "
        "Ceiling = the batch-1 bandwidth bound on that speedup at the row's k and acceptance "
        "length (perf/step_cost.py; perf/README.md says how to read it).\n\n"
        + rounds_note(args.rounds, rows)
        + table(rows)
        + peer_note(agree)
        + ("\nPeers that did not run:\n" if failed else "")
        + "".join(f"- {name}: {why}\n" for name, why in failed.items())
    )
    (args.result_dir / "results.md").write_text(md)
    plot(rows, args.result_dir / "sweep.png")
    print(md)
    return summary


if __name__ == "__main__":
    main()
