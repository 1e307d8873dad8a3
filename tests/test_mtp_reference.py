"""The MTP draft's arithmetic against an independent reference.

The reference is written here from the DeepSeek-V3 report's MTP module, reading the
checkpoint's own tensors with plain torch ops:

    x = eh_proj([RMSNorm_e(Emb(t_{i+1})) ; RMSNorm_h(h_i)])     h_i: target, after its norm
    x = TRM(x)                                                  a full decoder block, causal
    logits = head(RMSNorm_shared(x))                            predicts t_{i+2}

The decoder block is HF transformers' `DeepseekV3DecoderLayer` (MLA + MoE, itself checked
against our target layers in test_hf_reference.py) loaded with the MTP layer's weights,
and h_i comes from HF's target model: nothing here runs xllm_py's model code. Chained
drafting (k > 1) follows the engine's documented rule (speculative/mtp_proposer.py): step s runs
MTP layer s mod n one position further, on the previous step's block output (before the
shared norm) and its own draft; every layer used attends over the verified positions,
computed from (h_i, t_{i+1}).

Every draft the engine proposed while decoding a few prompts is recomputed by the
reference from the verified tokens alone, and the engine's draft logits must agree to
1e-4 (float32), for k = 1, 2, 3 with one MTP layer and k = 1, 2 with two. The random
checkpoint's norm weights are drawn from [0.7, 1.3], so a norm left out shows.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.hf_reference import checkpoint_tensors
from tools.make_random_checkpoint import make_random_checkpoint
from xllm_py import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8], list(range(10, 47)), [200, 3, 17, 90, 41, 8, 8, 9, 100, 12, 77]]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=[1, 2], ids=["1-mtp-layer", "2-mtp-layers"])
def ckpt(request, tmp_path_factory):
    n = request.param
    # The second checkpoint has an unusual rms_norm_eps: every norm must read it from the
    # config (a default of 1e-6 would pass with DeepSeek-V3's own value).
    overrides = dict(rms_norm_eps=0.05) if n == 2 else None
    return make_random_checkpoint(
        tmp_path_factory.mktemp(f"mtp{n}"), overrides, num_mtp=n, seed=4 + n
    )


class Reference:
    """HF's target for h_i, and the MTP layers written out from the checkpoint's tensors."""

    def __init__(self, path) -> None:
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

        raw = json.loads((path / "config.json").read_text())
        self.n_layers, self.n_mtp = raw["num_hidden_layers"], raw["num_nextn_predict_layers"]
        self.eps = raw["rms_norm_eps"]
        self.target = DeepseekV3ForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        self.w = checkpoint_tensors(path)
        cfg = DeepseekV3Config.from_pretrained(path)
        cfg._attn_implementation = "eager"
        self.blocks = []
        for j in range(self.n_mtp):
            i = self.n_layers + j  # an MoE layer: i >= first_k_dense_replace
            block = DeepseekV3DecoderLayer(cfg, layer_idx=i).eval()
            block.load_state_dict(self._block_state(i, block), strict=True)
            self.blocks.append(block)

    def _block_state(self, i: int, block) -> dict[str, torch.Tensor]:
        """The checkpoint's model.layers.{i} block tensors in HF's parameter layout (the
        routed experts stacked into gate_up_proj [E, 2I, H] and down_proj [E, H, I])."""
        prefix = f"model.layers.{i}."
        state = {}
        for name in block.state_dict():
            if name == "mlp.experts.gate_up_proj":
                e = block.mlp.experts.gate_up_proj.shape[0]
                state[name] = torch.stack(
                    [
                        torch.cat(
                            [
                                self.w[f"{prefix}mlp.experts.{x}.gate_proj.weight"],
                                self.w[f"{prefix}mlp.experts.{x}.up_proj.weight"],
                            ]
                        )
                        for x in range(e)
                    ]
                )
            elif name == "mlp.experts.down_proj":
                e = block.mlp.experts.down_proj.shape[0]
                state[name] = torch.stack(
                    [self.w[f"{prefix}mlp.experts.{x}.down_proj.weight"] for x in range(e)]
                )
            else:
                state[name] = self.w[prefix + name]
        return state

    def rms(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return self.w[name] * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def _block(self, j: int, x: torch.Tensor) -> torch.Tensor:
        """The MTP layer's decoder block over positions 0..T-1 with a causal mask."""
        t = x.shape[0]
        pos = torch.arange(t).unsqueeze(0)
        rope = self.target.model.rotary_emb(x.unsqueeze(0), pos)
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        return self.blocks[j](x.unsqueeze(0), attention_mask=mask, position_embeddings=rope)[0]

    def _mtp_input(self, j: int, h: torch.Tensor, next_tokens: list[int]) -> torch.Tensor:
        p = f"model.layers.{self.n_layers + j}."
        e = self.w["model.embed_tokens.weight"][torch.tensor(next_tokens)]
        cat = torch.cat([self.rms(e, p + "enorm.weight"), self.rms(h, p + "hnorm.weight")], -1)
        return cat @ self.w[p + "eh_proj.weight"].T

    def _logits(self, j: int, x: torch.Tensor) -> torch.Tensor:
        p = f"model.layers.{self.n_layers + j}."
        return self.rms(x, p + "shared_head.norm.weight") @ self.w[p + "shared_head.head.weight"].T

    @torch.inference_mode()
    def draft_logits(self, tokens: list[int], drafts: list[int]) -> list[torch.Tensor]:
        """tokens t_0..t_P (verified; the target has hidden states at 0..P-1), the engine's
        drafts d_1..d_k -> the reference logits of each draft step [V]."""
        ids = torch.tensor([tokens[:-1]])
        h = self.target.model(input_ids=ids).last_hidden_state[0]  # [P, hidden], after norm
        verified = [self._mtp_input(j, h, tokens[1:]) for j in range(self.n_mtp)]
        chained: list[list[torch.Tensor]] = [[] for _ in range(self.n_mtp)]
        out, prev = [], None
        for s in range(len(drafts)):
            j = s % self.n_mtp
            if s:  # one position further: previous block output and the previous draft
                chained[j].append(self._mtp_input(j, prev, [drafts[s - 1]]))
            x = self._block(j, torch.cat([verified[j], *chained[j]]))[-1:]
            out.append(self._logits(j, x)[0])
            prev = x
        return out


def run_engine(path, k: int):
    """Greedy decoding with k drafts; per proposal: (verified tokens, drafts, draft logits)."""
    llm = LLM(model=str(path), dtype="float32", block_size=16, num_speculative_tokens=k)
    runner = llm.engine.core.executor.worker.runner
    proposer, draft = runner.proposer, runner.proposer.draft
    logits_seen: list[torch.Tensor] = []
    records = []

    def compute_logits(x, step=0, _inner=draft.compute_logits):
        logits = _inner(x, step)
        logits_seen.append(logits.clone())
        return logits

    def propose(items, hidden, k=None, _inner=proposer.propose):
        logits_seen.clear()
        drafts, scores = _inner(items, hidden, k)
        want = [n for n, it in enumerate(items) if it.wants_drafts]
        for row, n in enumerate(want):
            it = items[n]
            tokens = runner.requests[it.req_id].token_ids[: it.start + 1] + it.next_ids
            steps = [logits[row] for logits in logits_seen[: len(drafts[n])]]
            records.append((tokens, drafts[n], steps))
        return drafts, scores

    draft.compute_logits = compute_logits
    proposer.propose = propose
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outs)
    return records, llm.get_metrics()


@pytest.mark.parametrize("k", [1, 2, 3])
def test_engine_draft_logits_equal_the_reference(ckpt, k):
    n_mtp = json.loads((ckpt / "config.json").read_text())["num_nextn_predict_layers"]
    if n_mtp > 1 and k > n_mtp:
        with pytest.raises(ValueError, match=f"num_speculative_tokens={k}: the draft has 2 MTP"):
            LLM(model=str(ckpt), dtype="float32", num_speculative_tokens=k)
        return
    ref = Reference(ckpt)
    records, metrics = run_engine(ckpt, k)
    assert records and 0 < metrics.drafts <= len(records)  # the last proposals go unused
    full = [r for r in records if len(r[1]) == k]
    assert len(full) >= len(PROMPTS)  # chained drafts through every step (and every layer)
    for tokens, drafts, steps in records:
        expected = ref.draft_logits(tokens, drafts)
        for s, (ours, theirs) in enumerate(zip(steps, expected)):
            where = f"prompt len {len(tokens)}, step {s} of {drafts}"
            assert (ours - theirs).abs().max().item() < 1e-4, where
            assert drafts[s] == int(theirs.argmax()), where
