#!/usr/bin/env python3
"""Train an MTP layer for a DeepSeek-V3 checkpoint that has none, by distillation, on CPU.

    python tools/train_mtp_head.py --model TARGET --in-place-copy OUT --minutes 25
    python tools/train_mtp_head.py --model TARGET --output-dir DRAFT --minutes 25
    python tools/train_mtp_head.py --model TARGET --in-place-copy OUT --minutes 25 --resume

For a checkpoint without MTP weights (num_nextn_predict_layers 0 and no tensors past the
last layer), a new MTP layer is initialised so that it starts as "the target's last
layer applied once more to the final hidden state":

    decoder block      = a copy of the target's last layer (model.layers.{N-1})
    eh_proj [H, 2H]    = [0 | I]  (the input is cat(enorm(embed(t_{i+1})), hnorm(h_i)), so
                                   the hidden-state half passes through; the embedding half
                                   starts at zero and is learnt)
    enorm, hnorm, shared_head.norm = 1
    shared_head.head, embed_tokens = copies of the target's lm_head / embed_tokens

and then trained exactly as tools/distill_mtp.py trains an existing one: target frozen,
soft cross-entropy towards the target's distribution at the next position, on half
ShareGPT text and half the target's own greedy continuations (data cached in the work
directory). At the end the held-out top-1 agreement with the target (distill_mtp's
evaluation: the target's greedy continuations of --eval-prompts held-out ShareGPT
prompts) is printed for the initialised and the trained layer.

Output, one of:
  --in-place-copy DIR  a copy of --model with the new layer as model.layers.{N} (own shard
                       file, model-mtp.safetensors) and num_nextn_predict_layers = 1: serve
                       it with `LLM(model=DIR, num_speculative_tokens=k)`.
  --output-dir DIR     an exported draft directory in tools/export_deepseek_mtp.py's layout
                       (written by that tool's code): serve the unchanged target with
                       `LLM(model=TARGET, draft_model=DIR, num_speculative_tokens=k)`.
Both hold mtp_head_training.json (command, figures, log). Weights keep the target's
dtypes. An existing output directory is replaced only if this tool wrote it.

Budget and resuming: training stops after --minutes of training time or at --steps
(total, counted across resumed runs), whichever comes first; the learning-rate schedule
(warm-up, cosine) follows the larger of the two fractions spent. The training state (MTP
weights, AdamW moments, step, training seconds spent, data-order RNG) is saved to
WORK/state.safetensors + WORK/state.json every --save-every steps, at the end and on
Ctrl-C; `--resume` (or `--resume FILE`) continues from it with the same --minutes /
--steps. Safetensors and JSON only (no pickle).

Measured on the bundled model with its MTP layer stripped (2-core CPU shared with other
work, --minutes 24 --threads 1; --threads 1 avoids the slowdown of two multi-threaded jobs
on two cores): 731 steps, 24.8 minutes in all, held-out agreement 3.9% at initialisation,
86.2% after (the bundled, pre-trained and distilled MTP layer: 88.3% on the same set).

For the chain: with --chain K the layer is trained at draft depths 1..K, depth j > 1 running
on its own depth j - 1 output as the engine chains it (tools/distill_mtp.py, chain_logits),
the per-depth losses weighted by --chain-weights; --loss picks soft cross-entropy (kl),
total variation (tv) or -log of the expected acceptance of a sampled draft plus 0.1 x kl
(lk); --sampled-prompts adds the target's T=1 continuations to the greedy ones. With
--init checkpoint the model's own MTP layer is the start (no --force needed), so an
existing layer can be trained further: the bundled model's was, with --chain 3 --loss lk
(its README has the command and figures).

A checkpoint that already has MTP layers is refused unless --force (a new layer then
replaces them) or --init checkpoint. FP8 checkpoints are not supported (the frozen target
is HF transformers in float32; train on a dequantised copy). To make a test input from the
bundled model:

    python -c "from tools.train_mtp_head import strip_mtp; \\
        strip_mtp('xllm_py/assets/tiny-deepseek-v3-mtp', '/tmp/tiny-no-mtp')"
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.distill_mtp import (  # noqa: E402
    LOSSES,
    agreement_on,
    lr_at,
    make_optimizer,
    prepare_data,
    sample_batch,
    set_lr,
    train_step,
)
from tools.eval_mtp_agreement import load_mtp  # noqa: E402
from tools.export_deepseek_mtp import export  # noqa: E402
from tools.train_tiny_model import MTPLayer, load_hf_model, mtp_checkpoint_tensors  # noqa: E402
from xllm_py.weights.loader import INDEX_FILE, layer_index, tensor_files  # noqa: E402

META_FILE = "mtp_head_training.json"
MTP_SHARD = "model-mtp.safetensors"
STATE = "state.safetensors"
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


class UsageError(ValueError):
    """A problem with the command line or its inputs: printed as one line, exit status 2."""


# ---- the checkpoint -----------------------------------------------------------------------------


def read_config(model_dir: Path) -> dict:
    cfg_file = model_dir / "config.json"
    if not cfg_file.is_file():
        raise UsageError(f"--model {model_dir}: no config.json")
    return json.loads(cfg_file.read_text())


def is_mtp(name: str, n_layers: int) -> bool:
    """A tensor of an MTP layer: model.layers.{>= n_layers}.*"""
    i = layer_index(name)
    return i is not None and i >= n_layers


def mtp_tensor_names(model_dir: Path, n_layers: int) -> list[str]:
    return sorted(n for n in tensor_files(model_dir) if is_mtp(n, n_layers))


def check_target(model_dir: Path, force: bool, init: str = "last-layer") -> dict:
    """The target's config, after refusing what this tool cannot train on (with
    init="checkpoint", a model without an MTP layer to start from)."""
    if not model_dir.is_dir():
        raise UsageError(f"--model {model_dir}: no such directory")
    cfg = read_config(model_dir)
    if cfg.get("quantization_config"):
        raise UsageError(
            f"--model {model_dir}: FP8/quantised checkpoints are not supported; train on a "
            "dequantised copy"
        )
    n_layers = int(cfg["num_hidden_layers"])
    n_mtp = int(cfg.get("num_nextn_predict_layers") or 0)
    try:
        stored = mtp_tensor_names(model_dir, n_layers)
    except ValueError as e:  # no or unreadable weight files
        raise UsageError(f"--model {model_dir}: {e}") from None
    if init == "checkpoint":
        if n_mtp != 1 or not stored:
            raise UsageError(
                f"--init checkpoint: --model {model_dir} has no MTP layer to start from "
                f"(num_nextn_predict_layers={n_mtp}, {len(stored)} tensors at "
                f"model.layers.{n_layers}+; exactly one layer is needed)"
            )
        return cfg
    if (n_mtp or stored) and not force:
        raise UsageError(
            f"--model {model_dir} already has MTP weights (num_nextn_predict_layers={n_mtp}, "
            f"{len(stored)} tensors at model.layers.{n_layers}+); pass --force to train a new "
            "layer that replaces them, or --init checkpoint to train the existing one further"
        )
    return cfg


def stored_dtypes(model_dir: Path, names: list[str]) -> dict[str, torch.dtype]:
    files = tensor_files(model_dir)
    out = {}
    for name in names:
        with safe_open(files[name], "pt") as st:
            out[name] = _DTYPES[st.get_slice(name).get_dtype()]
    return out


def read_tensors(model_dir: Path, names: list[str]) -> dict[str, torch.Tensor]:
    files = tensor_files(model_dir)
    out = {}
    for name in names:
        with safe_open(files[name], "pt") as st:
            out[name] = st.get_tensor(name)
    return out


def new_layer_tensors(model_dir: Path, mtp: MTPLayer, n_layers: int) -> dict[str, torch.Tensor]:
    """The trained layer under model.layers.{n_layers}.*, each tensor in the dtype the target
    stores its counterpart in (the block's: layer N-1's; the norms and eh_proj: model.norm's),
    plus the copies of the embedding and head, byte for byte the target's."""
    own = mtp_checkpoint_tensors(mtp, n_layers)
    prefix, last = f"model.layers.{n_layers}.", f"model.layers.{n_layers - 1}."
    counterpart = {
        name: last + name[len(prefix) :]
        if not name[len(prefix) :].startswith(("enorm.", "hnorm.", "eh_proj.", "shared_head."))
        else "model.norm.weight"
        for name in own
    }
    dtypes = stored_dtypes(model_dir, sorted(set(counterpart.values())))
    out = {name: t.to(dtypes[counterpart[name]]).contiguous() for name, t in own.items()}
    copies = read_tensors(model_dir, ["lm_head.weight", "model.embed_tokens.weight"])
    out[prefix + "shared_head.head.weight"] = copies["lm_head.weight"]
    out[prefix + "embed_tokens.weight"] = copies["model.embed_tokens.weight"]
    return out


def _copy_other_files(src: Path, out: Path) -> None:
    """Tokenizer and the like: every file but the weights, their index and config.json."""
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", INDEX_FILE):
            shutil.copy2(f, out / f.name)


def _copy_without_mtp(src: Path, out: Path, n_layers: int, cfg_update: dict) -> dict[str, str]:
    """Write `src` into `out` without its tensors at model.layers.{>= n_layers} (shards that
    hold none are copied as they are), config.json updated; returns the weight map."""
    files = tensor_files(src)
    weight_map = {}
    for f in sorted(set(files.values())):
        names = [n for n, g in files.items() if g == f]
        keep = [n for n in names if not is_mtp(n, n_layers)]
        if len(keep) == len(names):
            shutil.copy2(f, out / f.name)
        elif keep:
            tensors = load_file(str(f))
            save_file({n: tensors[n] for n in keep}, str(out / f.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keep, f.name))
    _copy_other_files(src, out)
    cfg = read_config(src) | cfg_update
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return weight_map


def _write_index(out: Path, weight_map: dict[str, str]) -> None:
    total = 0
    for fname in sorted(set(weight_map.values())):
        with safe_open(out / fname, "pt") as st:
            for name in st.keys():
                total += st.get_tensor(name).nbytes
    (out / INDEX_FILE).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )


def _atomic_dir(out: Path, write) -> None:
    """Run write(tmp) on a fresh directory beside `out`, then move it to `out`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        write(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def strip_mtp(src: str | Path, out: str | Path) -> None:
    """A copy of checkpoint `src` without MTP layers (num_nextn_predict_layers 0)."""
    src, out = Path(src), Path(out)
    n_layers = int(read_config(src)["num_hidden_layers"])

    def write(tmp: Path) -> None:
        wm = _copy_without_mtp(src, tmp, n_layers, {"num_nextn_predict_layers": 0})
        _write_index(tmp, wm)

    _atomic_dir(out, write)


def write_in_place_copy(src: Path, out: Path, tensors: dict[str, torch.Tensor], meta: dict):
    """`src` plus the new layer N in its own shard, num_nextn_predict_layers = 1."""
    n_layers = int(read_config(src)["num_hidden_layers"])

    def write(tmp: Path) -> None:
        wm = _copy_without_mtp(src, tmp, n_layers, {"num_nextn_predict_layers": 1})
        save_file(tensors, str(tmp / MTP_SHARD), metadata={"format": "pt"})
        wm.update(dict.fromkeys(tensors, MTP_SHARD))
        _write_index(tmp, wm)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2))

    _atomic_dir(out, write)


def write_exported(src: Path, out: Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """The new layer as an exported draft directory, by tools/export_deepseek_mtp.py's own
    code, run on a checkpoint that holds only the new layer (and the target's config with
    num_nextn_predict_layers = 1)."""
    n_layers = int(read_config(src)["num_hidden_layers"])
    dtype = tensors[f"model.layers.{n_layers}.eh_proj.weight"].dtype  # the target's own dtype
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".mtp-only.", dir=out.parent) as tmp:
        only = Path(tmp)
        save_file(tensors, str(only / MTP_SHARD), metadata={"format": "pt"})
        _write_index(only, dict.fromkeys(tensors, MTP_SHARD))
        cfg = read_config(src) | {"num_nextn_predict_layers": 1}
        (only / "config.json").write_text(json.dumps(cfg, indent=2))
        _copy_other_files(src, only)
        (only / META_FILE).write_text(json.dumps(meta, indent=2))
        export(only, out, dtype, force=True)


def check_output(out: Path, src: Path) -> None:
    s, o = src.resolve(), out.resolve()
    if o == s or s in o.parents or o in s.parents:
        raise UsageError(f"{out}: the output must be outside --model and not contain it")
    if out.exists() and not (out / META_FILE).is_file():
        raise UsageError(
            f"{out} exists and was not written by this tool; remove it or pick another"
        )


# ---- the layer and its training state -----------------------------------------------------------


def init_mtp(model, cfg) -> MTPLayer:
    """A new MTP layer: the target's last layer applied again to the final hidden state."""
    n = cfg.num_hidden_layers
    mtp = MTPLayer(cfg, n)
    last = model.model.layers[n - 1].state_dict()
    block = mtp.block.state_dict()
    if last.keys() != block.keys() or any(last[k].shape != block[k].shape for k in last):
        raise UsageError(
            f"the target's last layer (model.layers.{n - 1}) is not shaped like an MTP layer "
            f"at index {n} (first_k_dense_replace={cfg.first_k_dense_replace}: one is dense, "
            "the other MoE); this initialisation needs both the same"
        )
    h = cfg.hidden_size
    with torch.no_grad():
        mtp.block.load_state_dict(last)
        mtp.eh_proj.weight.zero_()
        mtp.eh_proj.weight[:, h:].copy_(torch.eye(h))  # columns h..2h-1 see hnorm(h_i)
        for norm in (mtp.enorm, mtp.hnorm, mtp.head_norm):
            norm.weight.fill_(1.0)
    return mtp


def save_state(path: Path, mtp, opt, scalars: dict) -> None:
    """MTP weights and AdamW state as safetensors, the scalars as JSON beside it (.json)."""
    tensors = {f"mtp.{k}": v.detach().contiguous() for k, v in mtp.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        for k, v in s.items():
            tensors[f"opt.{i}.{k}"] = (v if torch.is_tensor(v) else torch.tensor(v)).contiguous()
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    path.with_suffix(".json.tmp").write_text(json.dumps(scalars, indent=2))
    tmp.replace(path)
    path.with_suffix(".json.tmp").replace(path.with_suffix(".json"))


def load_state(path: Path, mtp, opt) -> dict:
    if not path.is_file() or not path.with_suffix(".json").is_file():
        raise UsageError(f"--resume {path}: no such state file (and {path.stem}.json beside it)")
    tensors = load_file(str(path))
    mtp.load_state_dict({k[4:]: v for k, v in tensors.items() if k.startswith("mtp.")})
    state: dict[int, dict] = {}
    for k, v in tensors.items():
        if k.startswith("opt."):
            _, i, key = k.split(".", 2)
            state.setdefault(int(i), {})[key] = v
    opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})
    return json.loads(path.with_suffix(".json").read_text())


# ---- main ---------------------------------------------------------------------------------------


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated numbers") from None
    if any(v < 0 for v in values) or sum(values) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: weights must be >= 0 with a positive sum")
    return values


def parse_args(argv):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, required=True, help="target checkpoint without MTP")
    out = ap.add_mutually_exclusive_group(required=True)
    out.add_argument("--output-dir", type=Path, help="write an exported draft directory here")
    out.add_argument(
        "--in-place-copy", type=Path, help="write a copy of --model with the new layer here"
    )
    ap.add_argument(
        "--work-dir", type=Path, help="data cache and training state (default: OUT.work)"
    )
    ap.add_argument("--minutes", type=float, default=25.0, help="training-time budget")
    ap.add_argument("--steps", type=int, default=0, help="stop at this step (0: time only)")
    ap.add_argument(
        "--resume",
        nargs="?",
        const="auto",
        help="continue from a saved state (default file: WORK/state.safetensors)",
    )
    ap.add_argument("--save-every", type=int, default=50, help="steps between state saves")
    ap.add_argument("--force", action="store_true", help="train even if --model has MTP layers")
    ap.add_argument(
        "--init",
        choices=("last-layer", "checkpoint"),
        default="last-layer",
        help="start from the target's last layer (a new layer) or from --model's own MTP layer",
    )
    ap.add_argument(
        "--chain",
        type=int,
        default=1,
        help="train draft depths 1..K: depth j > 1 runs on the layer's own depth j - 1 output",
    )
    ap.add_argument(
        "--chain-weights",
        type=_floats,
        help="loss weight per depth, comma-separated (default: 0.8^(j-1))",
    )
    ap.add_argument(
        "--loss",
        choices=LOSSES,
        default="kl",
        help="kl: soft cross-entropy; tv: total variation; lk: -log expected acceptance + 0.1 kl",
    )
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    ap.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate")
    ap.add_argument("--warmup", type=int, default=30, help="linear warm-up steps")
    ap.add_argument(
        "--max-train-chars", type=int, default=20_000_000, help="ShareGPT text to tokenise"
    )
    ap.add_argument(
        "--gen-prompts", type=int, default=128, help="training prompts the target continues"
    )
    ap.add_argument("--gen-tokens", type=int, default=96, help="tokens per continuation")
    ap.add_argument(
        "--sampled-prompts",
        type=int,
        default=0,
        help="further training prompts the target continues at temperature 1",
    )
    ap.add_argument(
        "--gen-batch", type=int, default=256, help="sequences the engine generates at once"
    )
    ap.add_argument("--eval-prompts", type=int, default=32, help="held-out prompts to evaluate")
    ap.add_argument(
        "--eval-tokens", type=int, default=128, help="greedy tokens per held-out prompt"
    )
    ap.add_argument("--seed", type=int, default=0, help="data-order seed")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except UsageError as e:
        print(f"train_mtp_head: error: {e}", file=sys.stderr)
        return 2


def run(args) -> int:
    t0 = time.time()
    torch.set_num_threads(args.threads)
    check_target(args.model, args.force, args.init)
    out = args.output_dir or args.in_place_copy
    check_output(out, args.model)
    if args.steps < 0 or args.minutes <= 0:
        raise UsageError("--steps must be >= 0 and --minutes > 0")
    if not 1 <= args.chain < args.seq_len:
        raise UsageError(f"--chain {args.chain}: expected 1 <= K < --seq-len {args.seq_len}")
    weights = args.chain_weights or [0.8**j for j in range(args.chain)]
    if len(weights) != args.chain:
        raise UsageError(f"--chain-weights: {len(weights)} weights for --chain {args.chain}")
    work = args.work_dir or out.with_name(out.name + ".work")
    work.mkdir(parents=True, exist_ok=True)
    streams, ev = prepare_data(
        args.model,
        work,
        max_train_chars=args.max_train_chars,
        gen_prompts=args.gen_prompts,
        gen_tokens=args.gen_tokens,
        seq_len=args.seq_len,
        eval_prompts=args.eval_prompts,
        eval_tokens=args.eval_tokens,
        gen_batch=args.gen_batch,
        sampled_prompts=args.sampled_prompts,
    )

    model = load_hf_model(args.model)
    model.requires_grad_(False)
    cfg = model.config
    mtp = init_mtp(model, cfg) if args.init == "last-layer" else load_mtp(args.model, cfg)
    params = list(mtp.parameters())
    opt = make_optimizer(params, args.lr)
    rng = np.random.default_rng(args.seed)
    state_file = work / STATE
    step, spent, log, before = 0, 0.0, [], None
    if args.resume:
        resume = state_file if args.resume == "auto" else Path(args.resume)
        saved = load_state(resume, mtp, opt)
        step, spent, log, before = saved["step"], saved["seconds"], saved["log"], saved["before"]
        rng.bit_generator.state = saved["rng"]
    if before is None:
        before = agreement_on(model, mtp.eval(), ev["seqs"], ev["first"], args.chain)
        print(f"held-out top-1 agreement at the start, {_depths(before)}", flush=True)
    if args.resume:
        print(f"resuming at step {step} ({spent / 60:.1f} training minutes spent)", flush=True)
    else:
        print("training from step 0", flush=True)
    mtp.train()
    budget = args.minutes * 60

    def scalars() -> dict:
        return {
            "step": step,
            "seconds": spent,
            "log": log,
            "before": before,
            "rng": rng.bit_generator.state,
            "model": str(args.model),
        }

    def frac() -> float:
        return max(spent / budget, step / args.steps if args.steps else 0.0)

    bar = tqdm(
        total=args.steps or int(budget),
        initial=step if args.steps else int(spent),
        desc="training MTP layer",
        unit="step" if args.steps else "s",
    )
    interrupted = False
    try:
        while frac() < 1.0:
            begin = time.time()
            set_lr(opt, lr_at(args.lr, args.warmup, step, frac()))
            batch = sample_batch(streams, rng, args.batch_size, args.seq_len)
            loss, agree = train_step(model, mtp, opt, params, batch, args.chain, args.loss, weights)
            step += 1
            spent += time.time() - begin
            bar.update(1 if args.steps else int(spent) - bar.n)
            bar.set_postfix(step=step, loss=f"{loss.item():.3f}", agree=f"{agree[0].item():.2f}")
            if step % 25 == 0 or step == 1:
                log.append(
                    {
                        "step": step,
                        "minutes": spent / 60,
                        "loss": loss.item(),
                        "train_agreement": agree.tolist(),
                    }
                )
            if step % args.save_every == 0:
                save_state(state_file, mtp, opt, scalars())
    except KeyboardInterrupt:
        interrupted = True
    bar.close()
    save_state(state_file, mtp, opt, scalars())
    if interrupted:
        print(f"interrupted at step {step}; state saved to {state_file} (--resume)", flush=True)
        return 130
    after = agreement_on(model, mtp.eval(), ev["seqs"], ev["first"], args.chain)
    print(f"held-out top-1 agreement after {step} steps, {_depths(after)}", flush=True)
    meta = {
        "command": " ".join(sys.argv),
        "source": str(args.model),
        "init": "block = model.layers.{N-1}, eh_proj = [0 | I], norms = 1"
        if args.init == "last-layer"
        else f"{args.model}'s own MTP layer",
        "chain": args.chain,
        "chain_weights": weights,
        "loss": args.loss,
        "sampled_prompts": args.sampled_prompts,
        "steps": step,
        "training_minutes": spent / 60,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "lr": args.lr,
        "eval_prompts": len(ev["seqs"]),
        "held_out_agreement_init": before,  # per depth 1..chain
        "held_out_agreement_after": after,
        "minutes_this_run": (time.time() - t0) / 60,
        "log": log,
    }
    tensors = new_layer_tensors(args.model, mtp, cfg.num_hidden_layers)
    if args.in_place_copy:
        write_in_place_copy(args.model, out, tensors, meta)
    else:
        write_exported(args.model, out, tensors, meta)
    print(f"wrote {out} in {(time.time() - t0) / 60:.1f} min", flush=True)
    return 0


def _depths(agreement: list[float]) -> str:
    return ", ".join(f"depth {j + 1}: {a:.1%}" for j, a in enumerate(agreement))


if __name__ == "__main__":
    sys.exit(main())
