#!/usr/bin/env python3
"""How often a checkpoint's MTP head predicts the target's own next-next token.

    python tools/eval_mtp_agreement.py --model xllm_py/assets/tiny-deepseek-v3-mtp --prompts 50

For held-out ShareGPT conversations (the training tool holds out every 50th),
the first user turn is rendered with the chat template, the target model
continues it greedily (--new-tokens), and then, at every position i of that
continuation, the MTP head gets the target's hidden state h_i and token t_{i+1}
and its top-1 is compared with t_{i+2}. That is the acceptance rate of a
greedy one-token MTP draft. Also prints the held-out continuations.

Uses HF transformers for the target and the training tool's MTP module (an
evaluation tool, independent of the engine). Writes JSON with --output.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.train_tiny_model import MTPLayer, mtp_states  # noqa: E402
from xllm_py.sharegpt import held_out_user_turns  # noqa: E402
from xllm_py.weights.loader import tensor_files  # noqa: E402


def load_mtp(model_dir: Path, cfg) -> MTPLayer:
    mtp = MTPLayer(cfg, cfg.num_hidden_layers)
    prefix = f"model.layers.{cfg.num_hidden_layers}."
    files = tensor_files(model_dir)
    state = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, f in files.items():
        if not name.startswith(prefix):
            continue
        with safe_open(f, "pt") as st:
            t = st.get_tensor(name).float()
        rest = name[len(prefix) :]
        if rest.startswith(("embed_tokens.", "shared_head.head.")):
            continue
        if rest.startswith("shared_head.norm."):
            state["head_norm.weight"] = t
        elif rest.startswith(("enorm.", "hnorm.", "eh_proj.")):
            state[rest] = t
        elif ".experts." in rest:  # per-expert tensors -> HF's stacked layout
            _, _, e, proj, _ = rest.split(".")
            experts.setdefault("mlp.experts", {}).setdefault(int(e), {})[proj] = t
        else:
            state["block." + rest] = t
    per = experts["mlp.experts"]
    state["block.mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([per[e]["gate_proj"], per[e]["up_proj"]]) for e in sorted(per)]
    )
    state["block.mlp.experts.down_proj"] = torch.stack([per[e]["down_proj"] for e in sorted(per)])
    mtp.load_state_dict(state)
    return mtp.eval()


@torch.inference_mode()
def evaluate(model_dir: Path, n_prompts: int, new_tokens: int, show: int) -> dict:
    from tokenizers import Tokenizer
    from transformers import DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg = model.config
    mtp = load_mtp(model_dir, cfg)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    eos = cfg.eos_token_id
    agree = total = 0
    samples = []
    for k, prompt in enumerate(held_out_user_turns(n_prompts, 0, 2000)):
        text = f"<|bos|><|user|>\n{prompt}\n<|assistant|>\n"
        ids = tok.encode(text, add_special_tokens=False).ids[-512:]
        gen = model.generate(
            torch.tensor([ids]),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
        )
        seq = gen[0].tolist()
        cont = seq[len(ids) :]
        if k < show:
            samples.append({"prompt": prompt[:300], "continuation": tok.decode(cont)})
        hidden = model.model(input_ids=torch.tensor([seq])).last_hidden_state  # [1, S, H]
        # positions i whose next-next token is part of the continuation: i + 2 >= len(ids)
        first = len(ids) - 2
        last = len(seq) - 3
        if last < first:
            continue
        pos = torch.arange(first, last + 1)
        # The MTP block attends over its own earlier positions, so it runs on the whole prefix.
        full_pos = torch.arange(0, last + 1)
        hf = hidden[:, full_pos]
        nf = torch.tensor([seq])[:, full_pos + 1]
        x = mtp_states(model, mtp, hf, model.model.embed_tokens(nf))
        pred = model.lm_head(x).argmax(-1)[0, first:]
        target = torch.tensor(seq)[pos + 2]
        agree += int((pred == target).sum())
        total += len(pos)
    return {
        "model": str(model_dir),
        "prompts": n_prompts,
        "new_tokens": new_tokens,
        "positions": total,
        "mtp_top1_agreement": agree / max(total, 1),
        "samples": samples,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, required=True, help="checkpoint with one MTP layer")
    ap.add_argument("--prompts", type=int, default=50, help="held-out prompts to continue")
    ap.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--show", type=int, default=3, help="continuations to print")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--output", type=Path, help="write the result as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    res = evaluate(args.model, args.prompts, args.new_tokens, args.show)
    for s in res["samples"]:
        print(f"--- prompt: {s['prompt']!r}\n    reply:  {s['continuation']!r}")
    print(
        f"MTP top-1 agreement with the target's next-next token: "
        f"{res['mtp_top1_agreement']:.1%} over {res['positions']} positions"
    )
    if args.output:
        args.output.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
