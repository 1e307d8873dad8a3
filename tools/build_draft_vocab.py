#!/usr/bin/env python3
"""Build the token map of a hot-vocabulary MTP draft head (xllm_py/speculative/hot_vocab.py).

    python tools/build_draft_vocab.py --model xllm_py/assets/tiny-deepseek-v3-mtp
    python tools/build_draft_vocab.py --model DIR --prompts 2000 --output map.safetensors

The target generates greedy continuations of ShareGPT first user turns (training-side
conversations only: the held-out ones, every 50th, are left for evaluation), in its chat
template; the tokens it emits are counted and written most frequent first, with their
counts, to `draft_vocab.safetensors` in the model directory (the engine's default place)
or --output. Tokens never emitted follow in id order, so the map covers the vocabulary.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from xllm_py import LLM, SamplingParams  # noqa: E402
from xllm_py.sharegpt import HELD_OUT_EVERY, iter_conversations, turns  # noqa: E402
from xllm_py.speculative.hot_vocab import TOKEN_MAP_FILE, save_token_map  # noqa: E402


def training_prompts(n: int, max_chars: int = 2000) -> list[str]:
    """First user turns of conversations that are not held out."""
    out = []
    for i, conv in enumerate(iter_conversations()):
        t = turns(conv)
        if i % HELD_OUT_EVERY and t and t[0][0] == "user" and 0 < len(t[0][1]) < max_chars:
            out.append(t[0][1])
            if len(out) == n:
                break
    return out


def count_tokens(llm: LLM, prompts: list[str], tokens: int, batch: int) -> torch.Tensor:
    """How often the target emits each token id over greedy continuations of `prompts`."""
    tok = llm.get_tokenizer()
    vocab = llm.engine.config.model.vocab_size
    counts = torch.zeros(vocab, dtype=torch.long)
    params = SamplingParams(temperature=0.0, max_tokens=tokens)
    texts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    for i in tqdm(range(0, len(texts), batch), desc="target continuations", unit="batch"):
        for out in llm.generate(texts[i : i + batch], params):
            ids = torch.tensor(out.outputs[0].token_ids, dtype=torch.long)
            counts += torch.bincount(ids, minlength=vocab)
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, required=True, help="target checkpoint directory")
    ap.add_argument("--output", type=Path, help=f"map file (default: MODEL/{TOKEN_MAP_FILE})")
    ap.add_argument("--prompts", type=int, default=600, help="ShareGPT prompts to continue")
    ap.add_argument("--tokens", type=int, default=96, help="tokens generated per prompt")
    ap.add_argument("--batch", type=int, default=32, help="prompts generated at once")
    ap.add_argument("--device", default="cpu", help="device of the target")
    a = ap.parse_args()
    for flag, v in (("--prompts", a.prompts), ("--tokens", a.tokens), ("--batch", a.batch)):
        if v < 1:
            ap.error(f"{flag}={v} must be >= 1")
    llm = LLM(model=str(a.model), device=a.device)
    counts = count_tokens(llm, training_prompts(a.prompts), a.tokens, a.batch)
    order = sorted(range(len(counts)), key=lambda t: (-int(counts[t]), t))
    ids = torch.tensor(order, dtype=torch.long)
    out = a.output or a.model / TOKEN_MAP_FILE
    save_token_map(out, ids, counts[ids])
    total = int(counts.sum())
    cum = counts[ids].cumsum(0)
    for n in (256, 512, 1024, 2048, 4096):
        if n < len(ids):
            print(f"top {n:5d} tokens: {100 * int(cum[n - 1]) / total:5.1f}% of emitted tokens")
    print(f"wrote {out} ({len(ids)} tokens, {total} counted)")


if __name__ == "__main__":
    main()
