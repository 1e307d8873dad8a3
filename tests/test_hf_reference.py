"""xllm_py vs. HF transformers' DeepseekV3/V2ForCausalLM on tiny random DeepSeek-family checkpoints.

For every config in ``hf_reference.TINY_CONFIGS`` (MLA with / without q-LoRA, grouped / ungrouped
noaux_tc routing, 0-2 leading dense layers, default rope and three YaRN variants; and configs
shaped like DeepSeek-V2-Lite (softmax, greedy top-k), V2 (group-limited greedy), Moonlight (no
rope scaling, theta 50000) and Kimi-K2 (model_type kimi_k2, YaRN factor 32 with beta 1/1)) a
checkpoint is
written by HF ``save_pretrained`` and six prompts (1..100 tokens, straddling the 16-token KV block)
are greedily decoded for 32 tokens by HF (eager, float32, one prompt at a time, EOS ignored) and by
``xllm_py.LLM`` (all prompts in one batch). Token ids must be identical and chosen-token logprobs
within 1e-4. That is a fair bar because the references are decisive: every top1-top2 logit gap is
>= 2e-3 and every router group/expert top-k margin >= 1.2e-4 (guarded below), while HF's own fp32
vs fp64 logprobs differ by < 1e-5. ``e_score_correction_bias`` is random but non-negative: HF masks
dropped groups with -inf, DeepSeek's modeling_deepseek.py with 0.0, and the two agree only while
biased scores stay > 0 (see hf_reference's docstring).

Loading is checked too: a sharded checkpoint (index.json) decodes like the single-file one, and a
checkpoint with a missing, misshapen or unexpected tensor is rejected at load time with a ValueError
naming the tensor (and, for a wrong shape, both shapes).
"""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.hf_reference import (
    CHECKPOINT_SEEDS,
    MAX_NEW_TOKENS,
    TINY_CONFIGS,
    checkpoint_tensors,
    hf_greedy_detailed,
    make_hf_checkpoint,
    reference_prompts,
)
from xllm_py import LLM, SamplingParams

LOGPROB_ATOL = 1e-4
# Same weights, different mmap alignment -> different SIMD code paths (HF itself differs by ~8e-6).
SHARD_LOGPROB_ATOL = 5e-5
NAMES = list(TINY_CONFIGS)


def _llm(model_dir) -> LLM:
    return LLM(model=str(model_dir), device="cpu", dtype="float32", block_size=16)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(name, sharded=False) -> checkpoint directory, built once per session."""
    cache: dict[tuple[str, bool], Path] = {}

    def get(name: str, sharded: bool = False) -> Path:
        if (name, sharded) not in cache:
            out = tmp_path_factory.mktemp(f"{name}-sharded" if sharded else name)
            shard = "20KB" if sharded else None
            seed = CHECKPOINT_SEEDS[name]
            cache[name, sharded] = make_hf_checkpoint(name, out, seed=seed, max_shard_size=shard)
        return cache[name, sharded]

    return get


@pytest.fixture(scope="session")
def hf_ref(checkpoint):
    """hf_ref(name) -> hf_greedy_detailed on the single-file checkpoint, once per session."""
    cache: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in cache:
            prompts = reference_prompts(name)
            cache[name] = hf_greedy_detailed(checkpoint(name), prompts, MAX_NEW_TOKENS)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def engine_run(checkpoint):
    """engine_run(name, sharded=False) -> per prompt (token_ids, chosen logprobs, finish_reason)."""
    cache: dict[tuple[str, bool], list] = {}

    def get(name: str, sharded: bool = False) -> list:
        if (name, sharded) not in cache:
            prompts = reference_prompts(name)
            llm = _llm(checkpoint(name, sharded))
            params = SamplingParams(
                max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0
            )
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            assert len(outs) == len(prompts)
            runs = []
            for o in outs:
                out = o.outputs[0]
                toks = list(out.token_ids)
                assert out.logprobs is not None and len(out.logprobs) == len(toks)
                for t, d in zip(toks, out.logprobs):
                    assert t in d, f"chosen token {t} missing from logprobs {d}"
                lps = [float(getattr(d[t], "logprob", d[t])) for t, d in zip(toks, out.logprobs)]
                runs.append((toks, lps, out.finish_reason))
            del llm
            cache[name, sharded] = runs
        return cache[name, sharded]

    return get


def _assert_same(what, prompts, got, want, atol):
    """got: [(tokens, logprobs, finish_reason)], want: [(tokens, logprobs)], one per prompt."""
    assert len(got) == len(want) == len(prompts)
    for i, (p, (toks, lps, finish), (ref_toks, ref_lps)) in enumerate(zip(prompts, got, want)):
        where = f"{what}, prompt {i} (len {len(p)})"
        if toks != ref_toks:
            pairs = enumerate(zip(toks, ref_toks))
            k = next((j for j, (a, b) in pairs if a != b), min(len(toks), len(ref_toks)))
            pytest.fail(
                f"{where}: tokens diverge at step {k}: got {toks[k : k + 4]}, "
                f"want {ref_toks[k : k + 4]} (lengths {len(toks)} vs {len(ref_toks)})"
            )
        assert finish == "length", where
        err = max(abs(a - b) for a, b in zip(lps, ref_lps))
        assert err <= atol, f"{where}: max |logprob diff| = {err:.3g} > {atol}"


@pytest.mark.parametrize("name", NAMES)
def test_reference_is_decisive(name, hf_ref):
    """Guard for the harness itself: greedy choices and routing must not hinge on float noise."""
    ref = hf_ref(name)
    assert min(min(g) for g in ref["top1_top2_gaps"]) > 1e-3
    assert ref["min_router_margin"] > 1e-4
    assert all(len(t) == MAX_NEW_TOKENS for t, _ in ref["results"])


@pytest.mark.parametrize("name", NAMES)
def test_greedy_matches_hf(name, hf_ref, engine_run):
    want = hf_ref(name)["results"]
    _assert_same(name, reference_prompts(name), engine_run(name), want, LOGPROB_ATOL)


def test_sharded_checkpoint_matches_single_file(checkpoint, hf_ref, engine_run):
    name = "qlora_yarn_allmoe"
    sharded = checkpoint(name, sharded=True)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    single_t, sharded_t = checkpoint_tensors(checkpoint(name)), checkpoint_tensors(sharded)
    assert single_t.keys() == sharded_t.keys()
    assert all(torch.equal(single_t[k], sharded_t[k]) for k in single_t)

    prompts, got = reference_prompts(name), engine_run(name, sharded=True)
    single = [(t, lp) for t, lp, _ in engine_run(name)]
    _assert_same(f"{name} sharded vs single", prompts, got, single, SHARD_LOGPROB_ATOL)
    _assert_same(f"{name} sharded vs HF", prompts, got, hf_ref(name)["results"], LOGPROB_ATOL)


# --- malformed checkpoints must fail at load time, naming the offending tensor -------------------
# BAD_NAME: layer 0 dense, layers 1-2 MoE with 8 experts; hidden 96, kv_b_proj [192, 64].
BAD_NAME = "noq_yarn_mscale_grouped"


def _rewrite(checkpoint, tmp_path, edit) -> Path:
    bad = tmp_path / "bad"
    shutil.copytree(checkpoint(BAD_NAME), bad)
    tensors = load_file(bad / "model.safetensors")
    edit(tensors)
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    return bad


MISSING = [
    "model.layers.2.mlp.experts.5.up_proj.weight",
    "model.layers.1.mlp.gate.e_score_correction_bias",
    "model.layers.0.self_attn.kv_a_layernorm.weight",
    "lm_head.weight",
]


@pytest.mark.parametrize("tensor", MISSING)
def test_missing_tensor_is_rejected(tensor, checkpoint, tmp_path):
    bad = _rewrite(checkpoint, tmp_path, lambda t: t.pop(tensor))
    with pytest.raises(ValueError, match=re.escape(tensor)):
        _llm(bad)


MISSHAPEN = [
    ("model.layers.1.self_attn.kv_b_proj.weight", (64, 192)),  # same numel, transposed shape
    ("model.layers.2.mlp.experts.0.down_proj.weight", (32, 96)),  # one expert in the wrong layout
    ("model.layers.0.post_attention_layernorm.weight", (95,)),
]


@pytest.mark.parametrize("tensor,new_shape", MISSHAPEN)
def test_misshapen_tensor_is_rejected(tensor, new_shape, checkpoint, tmp_path):
    old_shape = tuple(checkpoint_tensors(checkpoint(BAD_NAME))[tensor].shape)
    assert old_shape != new_shape
    numel = torch.Size(new_shape).numel()

    def edit(t):
        t[tensor] = t[tensor].flatten()[:numel].reshape(new_shape).contiguous()

    bad = _rewrite(checkpoint, tmp_path, edit)
    with pytest.raises(ValueError, match=re.escape(tensor)) as err:
        _llm(bad)
    # Both shapes must be named; "(192, 64)", "[192, 64]", "torch.Size([192, 64])", "192x64" all do.
    for shape in (old_shape, new_shape):
        pattern = r"\b" + r"\D{1,3}".join(map(str, shape)) + r"\b"
        assert re.search(pattern, str(err.value)), (shape, str(err.value))


UNEXPECTED = ["model.layers.0.foo.weight", "model.layers.1.mlp.experts.8.up_proj.weight"]


@pytest.mark.parametrize("tensor", UNEXPECTED)
def test_unexpected_tensor_is_rejected(tensor, checkpoint, tmp_path):
    bad = _rewrite(checkpoint, tmp_path, lambda t: t.__setitem__(tensor, torch.zeros(32, 96)))
    with pytest.raises(ValueError, match=re.escape(tensor)):
        _llm(bad)
