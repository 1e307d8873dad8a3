#!/usr/bin/env python3
"""How often a checkpoint's MTP head predicts the target's own next-next token, and how
often the engine accepts its drafts.

    python tools/eval_mtp_agreement.py --model xllm_py/assets/tiny-deepseek-v3-mtp --prompts 50
    python tools/eval_mtp_agreement.py --model DIR --engine --prompts 40 --new-tokens 48

For held-out ShareGPT conversations (the training tool holds out every 50th),
the first user turn is rendered with the chat template, the target model
continues it greedily (--new-tokens), and then, at every position i of that
continuation, the MTP head gets the target's hidden state h_i and token t_{i+1}
and its top-1 is compared with t_{i+2}. That is the acceptance rate of a
greedy one-token MTP draft. Also prints the held-out continuations.

With --depth K, draft depths 2..K too (tools/distill_mtp.py's chain: depth j runs the
layer on its own depth j - 1 output and the target's token, as served when the drafts
before it were accepted), teacher-forced on the target's greedy continuations.

Uses HF transformers for the target and the training tool's MTP module (an
evaluation tool, independent of the engine). Writes JSON with --output.

--engine instead measures the engine itself: the held-out prompts one at a time (batch
1), --new-tokens each, EOS ignored, confidence scheduling off (every draft verified), at
each --k: greedy requests, and at temperature 1 with sampled and with greedy drafts
(unseeded requests, the engine seeded). Prints the mean acceptance length (1 + accepted /
drafts) and the acceptance at each draft position (accepted there / drafts).
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

from tools.train_tiny_model import MTPLayer, load_hf_model  # noqa: E402
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
def evaluate(model_dir: Path, n_prompts: int, new_tokens: int, show: int, depth: int = 1) -> dict:
    from tokenizers import Tokenizer

    from tools.distill_mtp import agreement_on

    model = load_hf_model(model_dir)
    cfg = model.config
    mtp = load_mtp(model_dir, cfg)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    eos = cfg.eos_token_id
    seqs, first, samples = [], [], []
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
        if k < show:
            samples.append({"prompt": prompt[:300], "continuation": tok.decode(seq[len(ids) :])})
        if len(seq) - len(ids) >= 2 + depth:  # something for every depth to predict
            seqs.append(seq)
            first.append(len(ids))
    # Row i of depth j predicts token i + j + 1 (the MTP block attends over its own
    # earlier positions, so it runs on the whole sequence); rows predicting a generated
    # token count.
    agreement = agreement_on(model, mtp, seqs, first, depth)
    return {
        "model": str(model_dir),
        "prompts": n_prompts,
        "new_tokens": new_tokens,
        "mtp_top1_agreement": agreement[0],
        "mtp_top1_agreement_per_depth": agreement,
        "samples": samples,
    }


def engine_acceptance(model_dir: Path, n_prompts: int, new_tokens: int, ks: list[int]) -> dict:
    from xllm_py import LLM, SamplingParams

    rows = []
    arms = [("greedy", 0.0, "sampled"), ("T=1, sampled drafts", 1.0, "sampled")]
    arms.append(("T=1, greedy drafts", 1.0, "greedy"))
    for k in ks:
        for name, temperature, drafting in arms:
            llm = LLM(
                model=str(model_dir), dtype="float32", num_speculative_tokens=k, seed=0,
                max_seqs_per_batch=1, speculative_confidence="off",
                speculative_draft_sampling=drafting,
            )  # fmt: skip
            tok = llm.get_tokenizer()
            prompts = [
                tok.apply_chat_template([{"role": "user", "content": t}])
                for t in held_out_user_turns(n_prompts, 0, 2000)
            ]
            sp = SamplingParams(max_tokens=new_tokens, temperature=temperature, ignore_eos=True)
            llm.generate(prompts, sp)
            m = llm.get_metrics()
            per_position = [a / max(m.drafts, 1) for a in m.accepted_per_position]
            rows.append(
                {"k": k, "arm": name, "acceptance_length": m.mean_acceptance_length,
                 "per_position": per_position, "drafts": m.drafts}
            )  # fmt: skip
            print(
                f"k={k} {name:<22} acceptance length {m.mean_acceptance_length:.3f}  "
                f"per position {' / '.join(f'{a:.2f}' for a in per_position)}",
                flush=True,
            )
    return {"command": " ".join(sys.argv), "model": str(model_dir), "prompts": n_prompts,
            "new_tokens": new_tokens, "rows": rows}  # fmt: skip


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
    ap.add_argument("--depth", type=int, default=1, help="draft depths to evaluate (chained)")
    ap.add_argument("--engine", action="store_true", help="measure the engine's acceptance")
    ap.add_argument("--k", type=int, nargs="+", default=[1, 3], help="with --engine: drafts")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.engine:
        res = engine_acceptance(args.model, args.prompts, args.new_tokens, args.k)
        if args.output:
            args.output.write_text(json.dumps(res, indent=2))
        return
    res = evaluate(args.model, args.prompts, args.new_tokens, args.show, args.depth)
    for s in res["samples"]:
        print(f"--- prompt: {s['prompt']!r}\n    reply:  {s['continuation']!r}")
    per_depth = ", ".join(
        f"depth {j + 1}: {a:.1%}" for j, a in enumerate(res["mtp_top1_agreement_per_depth"])
    )
    print(f"MTP top-1 agreement with the target's token after next: {per_depth}")
    if args.output:
        args.output.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
