"""The bundled model (xllm_py/assets/tiny-deepseek-v3-mtp): a real DeepSeek-V3
checkpoint with an MTP layer, trained on ShareGPT. It must load in HF
transformers and our engine must decode exactly what HF decodes."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from xllm_py import LLM, SamplingParams, sharegpt
from xllm_py.assets import BUNDLED_MODEL_DIR


def held_out_user_turns(n: int) -> list[str]:
    return sharegpt.held_out_user_turns(n, 20, 600)


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", block_size=16)  # no model: the bundled one


def test_bundled_checkpoint_layout():
    cfg = json.loads((BUNDLED_MODEL_DIR / "config.json").read_text())
    assert (
        cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["num_nextn_predict_layers"] == 1
    )
    assert cfg["first_k_dense_replace"] >= 1 and cfg["n_group"] > 1 and cfg["n_shared_experts"] >= 1
    assert cfg["rope_parameters"]["rope_type"] == "yarn"
    index = json.loads((BUNDLED_MODEL_DIR / "model.safetensors.index.json").read_text())
    n = cfg["num_hidden_layers"]
    assert len(set(index["weight_map"].values())) > 1
    for name in ("enorm", "hnorm", "eh_proj", "shared_head.head", "embed_tokens"):
        assert f"model.layers.{n}.{name}.weight" in index["weight_map"]
    size = sum(f.stat().st_size for f in BUNDLED_MODEL_DIR.iterdir())
    assert size < 40 * 2**20
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "README.md"):
        assert (BUNDLED_MODEL_DIR / f).is_file()


def test_greedy_matches_hf_on_held_out_sharegpt(llm):
    """Reference: HF's forward over prompt + our continuation, in one pass (teacher
    forcing). Every token we chose must be HF's argmax there, with the same logprob.
    (HF's own cached `generate` drifts from its full forward on this model by up to 0.2
    in logprob, so its step-by-step output is not used as the reference here.)"""
    from transformers import DeepseekV3ForCausalLM

    tok = llm.get_tokenizer()
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": p}]) for p in held_out_user_turns(6)
    ]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=0)
    ours = llm.generate(prompts, params)
    hf = DeepseekV3ForCausalLM.from_pretrained(
        BUNDLED_MODEL_DIR, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    for out in ours:
        toks = out.outputs[0].token_ids
        ids = torch.tensor([out.prompt_token_ids + toks])
        with torch.inference_mode():
            logprobs = torch.log_softmax(hf(ids).logits[0].float(), dim=-1)
        p = len(out.prompt_token_ids)
        ref = logprobs[p - 1 : p - 1 + len(toks)]
        assert ref.argmax(dim=-1).tolist() == toks
        for j, t in enumerate(toks):
            assert out.outputs[0].logprobs[j][t] == pytest.approx(ref[j, t].item(), abs=1e-4)


def test_chat_reply_is_text_and_stops_at_eos(llm):
    tok = llm.get_tokenizer()
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    assert prompt.startswith("<|bos|><|user|>\n") and prompt.endswith("<|assistant|>\n")
    out = llm.generate(prompt, SamplingParams(max_tokens=200, temperature=0))[0].outputs[0]
    words = [w for w in out.text.split() if w.isalpha()]
    assert len(words) >= 3, out.text  # real words, not byte soup
    assert out.finish_reason in ("stop", "length")


def test_bundled_mtp_draft_loads_from_the_target_checkpoint(llm):
    from xllm_py.worker.worker import load_draft_model

    w = llm.engine.core.executor.worker
    draft = load_draft_model(w.config, w.model, None, w.device, w.dtype)
    assert len(draft.layers) == 1 and draft.target is w.model
    assert not list(itertools.islice((n for n, _ in draft.named_parameters() if "embed" in n), 1))
