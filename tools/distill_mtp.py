#!/usr/bin/env python3
"""Distil a checkpoint's MTP layer towards its own target model, on CPU.

    python tools/distill_mtp.py --model xllm_py/assets/tiny-deepseek-v3-mtp \\
        --output-dir /tmp/distilled --minutes 30

A speculative draft is accepted when it agrees with the *target*, not with the
data. Pre-training teaches the MTP layer the true token i+2; this tool keeps
the target frozen and trains only the MTP layer (enorm, hnorm, eh_proj, its
decoder block and shared_head.norm; the shared embedding and head stay fixed)
to match the target's distribution at position i+1:

    loss = CE(softmax(target logits at i+1), MTP logits at i)    (soft labels)

which maximises the expected acceptance of a sampled draft and, through the
top-1, of a greedy one. Training data is half ShareGPT text and half the
target's own greedy continuations of training prompts (generated with this
engine), because that is the text the draft sees while serving.

Steps (cached in OUTPUT_DIR/work/): tokenise training text, generate
continuations, train, then write OUTPUT_DIR as a copy of --model whose MTP
tensors are replaced (same shard files and names, bf16). Prints held-out
top-1 agreement with the target on its own continuations before and after.
Uses HF transformers for the frozen target (a training tool only).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.eval_mtp_agreement import load_mtp  # noqa: E402
from tools.train_tiny_model import (  # noqa: E402
    load_hf_model,
    mtp_checkpoint_tensors,
    split_conversations,
    tokenize_stream,
)
from xllm_py.sharegpt import HELD_OUT_EVERY, held_out_user_turns, iter_conversations, turns  # noqa: E402


def prompt_text(user_turn: str) -> str:
    return f"<|bos|><|user|>\n{user_turn}\n<|assistant|>\n"


def generate(
    model_dir: Path,
    prompts: list[str],
    new_tokens: int,
    max_prompt: int,
    batch: int = 64,
    temperature: float = 0.0,
) -> list:
    """Continuations from this engine (greedy, or sampled at `temperature` with a seed per
    prompt): one token list (prompt + output) per prompt, up to `batch` sequences at once."""
    from xllm_py import LLM, SamplingParams

    llm = LLM(model=str(model_dir), dtype="float32", max_seqs_per_batch=batch)
    tok = llm.get_tokenizer()
    ids = [tok.encode(p, add_special_tokens=False)[-max_prompt:] for p in prompts]
    params = [
        SamplingParams(temperature=temperature, max_tokens=new_tokens, seed=n)
        for n in range(len(ids))
    ]
    outs = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=True)
    return [i + list(o.outputs[0].token_ids) for i, o in zip(ids, outs)]


def training_user_turns(n: int, max_chars: int) -> list[str]:
    out = []
    for i, conv in enumerate(iter_conversations()):
        if i % HELD_OUT_EVERY == 0:  # held out
            continue
        t = turns(conv)
        if t and t[0][0] == "user" and 0 < len(t[0][1]) < max_chars:
            out.append(t[0][1])
            if len(out) == n:
                break
    return out


def windows(stream: np.ndarray, rng: np.random.Generator, n: int, seq: int) -> torch.Tensor:
    starts = rng.integers(0, len(stream) - seq - 1, size=n)
    return torch.from_numpy(np.stack([stream[s : s + seq + 1] for s in starts]).astype(np.int64))


LOSSES = ("kl", "tv", "lk")


def chain_mask(n: int, depth: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention mask [1, 1, depth * n, depth * n] over `depth` segments of n rows,
    as serving attends: segment 0 (the pass over verified positions) is causal; row i of
    segment m > 0 (chained draft step m at position i + m) sees segment 0's rows 0..i and
    its own row i of segments 1..m (what the MTP layer's cache holds at that step)."""
    seg = torch.arange(depth).repeat_interleave(n)
    row = torch.arange(n).repeat(depth)
    qs, ks, qr, kr = seg[:, None], seg[None, :], row[:, None], row[None, :]
    allowed = ((ks == 0) & (kr <= qr)) | ((ks > 0) & (ks <= qs) & (kr == qr))
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, float("-inf"))[None, None]


def chain_logits(model, mtp, batch: torch.Tensor, chain: int = 1) -> list:
    """batch [B, S + 1] -> per draft depth j = 1..chain, (MTP logits, target logits), both
    [B, n, V] with n = S - chain: row i of depth j is the draft for token i + j + 1 and the
    target's logits at position i + j (which predict that token).

    Depth 1 takes (h_i, t_{i+1}) as the engine's first MTP pass does. Depth j > 1 takes the
    layer's own output at depth j - 1 (before shared_head.norm, where the engine chains)
    and the token t_{i+j}, at position i + j - 1: the chain as served when the drafts
    before it were accepted (teacher forcing on the target's own continuations)."""
    inp = batch[:, :-1]
    b, s = inp.shape
    n = s - chain
    with torch.no_grad():
        hidden = model.model(input_ids=inp, use_cache=False).last_hidden_state
        target = model.lm_head(hidden).float()
        embeds = model.model.embed_tokens(batch)
    hid_in, emb_in, pos, out = [], [], [], []
    x = hidden[:, :n]
    for j in range(1, chain + 1):
        # Each depth reruns the earlier segments (their keys are what it attends to).
        hid_in.append(x)
        emb_in.append(embeds[:, j : j + n])
        pos.append(torch.arange(j - 1, j - 1 + n))
        rope = model.model.rotary_emb(hidden, torch.cat(pos).unsqueeze(0).expand(b, -1))
        states = mtp.states(
            torch.cat(hid_in, 1), torch.cat(emb_in, 1), rope, chain_mask(n, j, hidden.dtype)
        )
        x = states[:, (j - 1) * n :]
        out.append((model.lm_head(mtp.head_norm(x)).float(), target[:, j : j + n]))
    return out


def draft_loss(kind: str, draft: torch.Tensor, target: torch.Tensor, kl_weight: float = 0.1):
    """The loss of draft logits against the target's (temperature 1), mean over rows.
    kl: soft cross-entropy (KL plus the target's entropy). tv: total variation, 1 - sum min(p, q),
    one minus the chance a sampled draft is accepted. lk: -log sum min(p, q) (the log of that
    chance) plus kl_weight x the soft cross-entropy, which keeps a gradient on tokens the
    draft gives no mass."""
    logq = torch.log_softmax(draft, dim=-1)
    p = torch.softmax(target, dim=-1)
    ce = -(p * logq).sum(-1).mean()
    if kind == "kl":
        return ce
    overlap = torch.minimum(p, logq.exp()).sum(-1)
    if kind == "tv":
        return (1 - overlap).mean()
    if kind == "lk":
        return -overlap.clamp_min(1e-6).log().mean() + kl_weight * ce
    raise ValueError(f"loss {kind!r}: expected one of {', '.join(LOSSES)}")


def distill_loss(
    model, mtp, batch: torch.Tensor, chain: int = 1, loss: str = "kl", weights=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the depth-weighted loss, top-1 agreement with the target per depth [chain])."""
    weights = weights or [1.0] * chain
    total, agree = 0.0, []
    for w, (draft, target) in zip(weights, chain_logits(model, mtp, batch, chain)):
        total = total + w * draft_loss(loss, draft, target)
        agree.append((draft.argmax(-1) == target.argmax(-1)).float().mean())
    return total / sum(weights), torch.stack(agree)


@torch.no_grad()
def agreement_on(model, mtp, seqs: list[list[int]], first: list[int], chain: int = 1) -> list:
    """Top-1 agreement per draft depth at the positions whose target prediction is a
    generated token (depth j: given the drafts before it were accepted)."""
    agree, total = [0] * chain, [0] * chain
    for seq, f in zip(seqs, first):
        for j, (draft, target) in enumerate(chain_logits(model, mtp, torch.tensor([seq]), chain)):
            # row i of depth j + 1 predicts token i + j + 2; keep rows where it was generated
            rows = slice(max(f - j - 2, 0), None)
            agree[j] += int((draft[0, rows].argmax(-1) == target[0, rows].argmax(-1)).sum())
            total[j] += draft[0, rows].shape[0]
    return [a / max(t, 1) for a, t in zip(agree, total)]


def prepare_data(
    model_dir: Path,
    work: Path,
    *,
    max_train_chars: int,
    gen_prompts: int,
    gen_tokens: int,
    seq_len: int,
    eval_prompts: int,
    eval_tokens: int = 128,
    gen_batch: int = 64,
    sampled_prompts: int = 0,
) -> tuple[list[np.ndarray], dict]:
    """Training and held-out data, cached in `work`: ([ShareGPT token stream, stream of the
    target's greedy continuations of training prompts, and with `sampled_prompts` its T=1
    continuations of as many other prompts], {"seqs", "first"}: the target's greedy
    continuations of held-out prompts with the index of each one's first generated token)."""
    real_file, gen_file, eval_file = work / "real.npy", work / "generated.npy", work / "eval.json"
    sampled_file = work / "sampled.npy"
    if not real_file.is_file():
        print("tokenising ShareGPT training text ...", flush=True)
        texts, _ = split_conversations(max_train_chars)
        np.save(real_file, tokenize_stream(texts, model_dir / "tokenizer.json"))
    turns_ = [prompt_text(t) for t in training_user_turns(gen_prompts + sampled_prompts, 2000)]
    for file, prompts, temperature in (
        (gen_file, turns_[:gen_prompts], 0.0),
        (sampled_file, turns_[gen_prompts:], 1.0),
    ):
        if prompts and not file.is_file():
            print(f"generating {len(prompts)} continuations at T={temperature} ...", flush=True)
            seqs = generate(model_dir, prompts, gen_tokens, seq_len, gen_batch, temperature)
            np.save(file, np.concatenate([np.asarray(s, dtype=np.uint16) for s in seqs]))
    if not eval_file.is_file():
        prompts = [prompt_text(t) for t in held_out_user_turns(eval_prompts, 0, 2000)]
        seqs = generate(model_dir, prompts, eval_tokens, 256, gen_batch)
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        first = [min(len(tok.encode(p, add_special_tokens=False).ids), 256) for p in prompts]
        eval_file.write_text(json.dumps({"seqs": seqs, "first": first}))
    streams = [np.load(real_file), np.load(gen_file)]
    if sampled_prompts:
        streams.append(np.load(sampled_file))
    ev = json.loads(eval_file.read_text())
    sizes = ", ".join(f"{len(x) / 1e6:.2f}M" for x in streams)
    print(f"training streams (ShareGPT, greedy, sampled): {sizes} tokens", flush=True)
    return streams, ev


def sample_batch(
    streams: list[np.ndarray], rng: np.random.Generator, batch_size: int, seq_len: int
) -> torch.Tensor:
    """Windows from each stream in equal shares (ShareGPT text first takes the remainder)."""
    share = batch_size // len(streams)
    counts = [batch_size - share * (len(streams) - 1)] + [share] * (len(streams) - 1)
    return torch.cat([windows(x, rng, c, seq_len) for x, c in zip(streams, counts) if c])


def make_optimizer(params: list[torch.nn.Parameter], lr: float) -> torch.optim.AdamW:
    """AdamW, weight decay on matrices only."""
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.01},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=lr,
        betas=(0.9, 0.95),
    )


def lr_at(peak: float, warmup: int, step: int, frac: float) -> float:
    """Linear warm-up over `warmup` steps, then cosine from `peak` to 0.1 x `peak` over the
    fraction `frac` of the budget spent."""
    return peak * min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr


@functools.cache
def bf16_pays() -> bool:
    """Whether bf16 matmuls are faster than float32 on this CPU (native bf16: AVX512-BF16 or
    AMX). Without it, autocast to bf16 ran 250x slower than float32 (AVX2-only EPYC)."""

    def seconds(dtype: torch.dtype) -> float:
        a = torch.randn(256, 256).to(dtype)
        a @ a
        t = time.perf_counter()
        for _ in range(3):
            a @ a
        return time.perf_counter() - t

    return seconds(torch.bfloat16) < seconds(torch.float32)


def train_step(
    model, mtp, opt, params, batch: torch.Tensor, chain: int = 1, loss: str = "kl", weights=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimiser step of the distillation loss (bf16 autocast where bf16 is native,
    grad-norm clip 1); returns (loss, top-1 agreement per depth)."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_pays()):
        value, agree = distill_loss(model, mtp, batch, chain, loss, weights)
    opt.zero_grad(set_to_none=True)
    value.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    return value, agree


def write_checkpoint(src: Path, out: Path, replaced: dict[str, torch.Tensor], meta: dict) -> None:
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy2(f, out / f.name)
    for f in sorted(src.glob("*.safetensors")):
        tensors = load_file(str(f))
        for name in tensors.keys() & replaced.keys():
            assert tensors[name].shape == replaced[name].shape, name
            tensors[name] = replaced[name].to(tensors[name].dtype).contiguous()
        save_file(tensors, str(out / f.name), metadata={"format": "pt"})
    (out / "distillation.json").write_text(json.dumps(meta, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, required=True, help="checkpoint with one MTP layer")
    ap.add_argument("--output-dir", type=Path, required=True, help="checkpoint directory to write")
    ap.add_argument("--minutes", type=float, default=30.0, help="training wall-clock budget")
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    ap.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate")
    ap.add_argument("--warmup", type=int, default=30, help="linear warm-up steps")
    ap.add_argument(
        "--max-train-chars", type=int, default=20_000_000, help="ShareGPT text to tokenise"
    )
    ap.add_argument(
        "--gen-prompts", type=int, default=1024, help="training prompts the target continues"
    )
    ap.add_argument("--gen-tokens", type=int, default=192, help="greedy tokens per continuation")
    ap.add_argument("--eval-prompts", type=int, default=32, help="held-out prompts to evaluate")
    ap.add_argument("--seed", type=int, default=0, help="data-order seed")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.output_dir.resolve() == args.model.resolve():
        sys.exit("--output-dir must differ from --model")
    work = args.output_dir / "work"
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    streams, ev = prepare_data(
        args.model,
        work,
        max_train_chars=args.max_train_chars,
        gen_prompts=args.gen_prompts,
        gen_tokens=args.gen_tokens,
        seq_len=args.seq_len,
        eval_prompts=args.eval_prompts,
    )

    model = load_hf_model(args.model)
    model.requires_grad_(False)
    cfg = model.config
    mtp = load_mtp(args.model, cfg).train()
    (before,) = agreement_on(model, mtp.eval(), ev["seqs"], ev["first"])
    print(f"held-out top-1 agreement before: {before:.1%}", flush=True)
    mtp.train()
    params = list(mtp.parameters())
    opt = make_optimizer(params, args.lr)
    rng = np.random.default_rng(args.seed)
    budget = args.minutes * 60
    start = time.time()
    step, log = 0, []
    bar = tqdm(total=int(budget), desc="distilling", unit="s")
    while (elapsed := time.time() - start) < budget:
        set_lr(opt, lr_at(args.lr, args.warmup, step, elapsed / budget))
        batch = sample_batch(streams, rng, args.batch_size, args.seq_len)
        loss, (agree,) = train_step(model, mtp, opt, params, batch)
        step += 1
        bar.update(int(time.time() - start) - bar.n)
        bar.set_postfix(step=step, loss=f"{loss.item():.3f}", agree=f"{agree.item():.2f}")
        if step % 100 == 0:
            log.append({"step": step, "loss": loss.item(), "train_agreement": agree.item()})
    bar.close()
    (after,) = agreement_on(model, mtp.eval(), ev["seqs"], ev["first"])
    print(f"held-out top-1 agreement after {step} steps: {after:.1%}", flush=True)
    meta = {
        "command": " ".join(sys.argv),
        "source": str(args.model),
        "steps": step,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "held_out_agreement_before": before,
        "held_out_agreement_after": after,
        "minutes": (time.time() - t0) / 60,
        "log": log,
    }
    write_checkpoint(
        args.model, args.output_dir, mtp_checkpoint_tensors(mtp, cfg.num_hidden_layers), meta
    )
    print(f"wrote {args.output_dir}", flush=True)


if __name__ == "__main__":
    main()
