"""Add tokens to a checkpoint's tokenizer and grow its vocabulary tensors to match.

    python tools/add_special_tokens.py --model DIR --deepseek-tool-tokens
    python tools/add_special_tokens.py --model DIR --token '<tag>' --token '</tag>'

This is how the bundled model got DeepSeek-V3's tool-call tokens (`<｜tool▁calls▁begin｜>`
and the rest), so that DeepSeek-V3's tool-call format runs end to end on it.

- Each new token is an *added* token of `tokenizer.json` (never split by the BPE, never
  normalized). As in DeepSeek-V3's own tokenizer, they are not "special": decoding keeps
  them, so a tool-call parser sees them in the text.
- `config.json`'s `vocab_size` grows to cover them, rounded up to a multiple of
  `--pad-to` (so that tensor-parallel ranks split it evenly; the rows past the last
  token are padding no tokenizer id reaches).
- Every tensor whose first dimension is the vocabulary (the embedding, the output head,
  and the MTP layer's stored copies of both) gets new rows equal to the mean of its
  existing rows: a new token's input embedding is an average token, and its logit is the
  average logit, far below the likely ones (on the bundled model the new tokens' logits
  sit at least 10 below the log-partition at every position measured), so the model's
  outputs for text without the new tokens stay what they were.

Only the shards holding those tensors are rewritten (in place, or into --output-dir).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from xllm_py.weights.loader import tensor_files

# DeepSeek-V3's tool-call and tool-output markers, as its tokenizer spells them
DEEPSEEK_TOOL_TOKENS = (
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
)


def add_tokens(
    model_dir: str | Path,
    tokens: list[str],
    output_dir: str | Path | None = None,
    pad_to: int = 16,
) -> dict:
    """Add `tokens` (those not already in the tokenizer) and grow the vocabulary tensors.
    Returns {"added": {token: id}, "vocab_size": new size, "tensors": [names grown]}."""
    src = Path(model_dir)
    dst = Path(output_dir) if output_dir is not None else src
    if dst != src:
        shutil.copytree(src, dst, dirs_exist_ok=True)
    tok_file = dst / "tokenizer.json"
    tok = json.loads(tok_file.read_text())
    known = set(tok["model"]["vocab"]) | {t["content"] for t in tok["added_tokens"]}
    next_id = 1 + max([*tok["model"]["vocab"].values(), *(t["id"] for t in tok["added_tokens"])])
    added = {}
    for text in tokens:
        if text in known or text in added:
            continue
        added[text] = next_id
        tok["added_tokens"].append(
            {
                "id": next_id,
                "content": text,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": False,
            }
        )
        next_id += 1

    cfg_file = dst / "config.json"
    cfg = json.loads(cfg_file.read_text())
    old_vocab = int(cfg["vocab_size"])
    new_vocab = max(old_vocab, -(-next_id // pad_to) * pad_to)
    grown = []
    if new_vocab > old_vocab:
        for path in sorted(set(tensor_files(dst).values())):
            with safe_open(str(path), "pt") as f:
                meta = f.metadata()
                tensors = {n: f.get_tensor(n) for n in f.keys()}
            changed = False
            for name, t in tensors.items():
                if t.dim() == 2 and t.shape[0] == old_vocab:
                    mean = t.float().mean(0, keepdim=True).to(t.dtype)
                    extra = mean.expand(new_vocab - old_vocab, -1)
                    tensors[name] = torch.cat([t, extra]).contiguous()
                    grown.append(name)
                    changed = True
            if changed:
                save_file(tensors, str(path), metadata=meta)
        cfg["vocab_size"] = new_vocab
        cfg_file.write_text(json.dumps(cfg, indent=2) + "\n")
    tok_file.write_text(json.dumps(tok, ensure_ascii=False, indent=2) + "\n")
    return {"added": added, "vocab_size": new_vocab, "tensors": sorted(grown)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint directory (HF layout)")
    p.add_argument("--output-dir", help="write a copy here instead of changing --model")
    p.add_argument("--token", action="append", default=[], help="a token to add (repeatable)")
    p.add_argument(
        "--deepseek-tool-tokens",
        action="store_true",
        help="add DeepSeek-V3's nine tool-call and tool-output tokens",
    )
    p.add_argument(
        "--pad-to",
        type=int,
        default=16,
        help="round vocab_size up to a multiple of this (default 16)",
    )
    args = p.parse_args(argv)
    tokens = [*(DEEPSEEK_TOOL_TOKENS if args.deepseek_tool_tokens else ()), *args.token]
    if not tokens:
        p.error("nothing to add: give --token or --deepseek-tool-tokens")
    if args.pad_to < 1:
        p.error(f"--pad-to: {args.pad_to} must be at least 1")
    out = add_tokens(args.model, tokens, args.output_dir, args.pad_to)
    print(json.dumps(out, ensure_ascii=False, indent=2))


if __name__ == "__main__":
    main()
