"""Mistral Large 3's layout: `params.json` and Mistral's tensor names (weights/mistral.py),
softmax routing, YaRN with `apply_scale: false` and Llama-4's position-dependent query
scaling, and compressed-tensors' FP8_BLOCK scales (`weight_scale`).

- A tiny random checkpoint written in Mistral's names and params.json gives the same logits
  (1e-5, float32) as the same weights in DeepSeek-V3's layout with the equivalent
  config.json, and greedy tokens equal.
- Independently, HF transformers' Mistral-4 model (MLA + softmax MoE + Llama-4 query
  scaling, its own code) on the same weights gives those logits (1e-4); with its query
  scaling switched off it does not, so the prompts reach the positions where it matters.
- The same weights FP8_BLOCK-quantised, once in Mistral's layout with compressed-tensors'
  `weight_scale` names and once in DeepSeek's (`weight_scale_inv`, `quant_method: fp8`),
  give the same logits.
- A tensor with no DeepSeek counterpart, a missing tensor, and params.json fields the engine
  does not read are errors naming them; the vision tower's tensors are skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.hf_reference import LM_HEAD_GAIN
from xllm_py import LLM, SamplingParams
from xllm_py.config import config_from_mistral_params
from xllm_py.plan import make_plan
from xllm_py.weights.fp8 import quantize
from xllm_py.weights.mistral import hf_name, mistral_name

SEED = 3
ORIGINAL_MAX = 16  # YaRN's and Llama-4 scaling's: the 40-token prompt runs past it twice
PROMPTS = [[5, 17, 42, 99, 3], [(7 * i + 11) % 384 for i in range(40)]]
NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
BLOCK = (32, 32)

DIMS = dict(vocab_size=384, hidden_size=64, intermediate_size=128, moe_intermediate_size=16,
            num_hidden_layers=3, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32,
            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8,
            num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
            routed_scaling_factor=1.5, max_position_embeddings=64, rms_norm_eps=1e-5)  # fmt: skip
YARN = dict(factor=4.0, original_max_position_embeddings=ORIGINAL_MAX, beta_fast=32, beta_slow=1)
L4_BETA = 0.1


def params_json() -> dict:
    """Mistral's params.json for DIMS (field names as Mistral writes them)."""
    d = DIMS
    return {
        "dim": d["hidden_size"], "n_layers": d["num_hidden_layers"],
        "hidden_dim": d["intermediate_size"], "n_heads": d["num_attention_heads"],
        "n_kv_heads": d["num_attention_heads"], "head_dim": d["qk_nope_head_dim"] + 8,
        "vocab_size": d["vocab_size"], "norm_eps": d["rms_norm_eps"],
        "q_lora_rank": d["q_lora_rank"], "kv_lora_rank": d["kv_lora_rank"],
        "qk_rope_head_dim": d["qk_rope_head_dim"], "qk_nope_head_dim": d["qk_nope_head_dim"],
        "v_head_dim": d["v_head_dim"], "max_position_embeddings": d["max_position_embeddings"],
        "rope_theta": 10000.0, "tied_embeddings": False,
        "moe": {"num_experts": d["n_routed_experts"],
                "num_experts_per_tok": d["num_experts_per_tok"],
                "expert_hidden_dim": d["moe_intermediate_size"],
                "first_k_dense_replace": d["first_k_dense_replace"],
                "num_shared_experts": d["n_shared_experts"],
                "routed_scale": d["routed_scaling_factor"], "num_expert_groups": 1,
                "num_expert_groups_per_tok": 1},
        "yarn": {"factor": YARN["factor"], "original_max_position_embeddings": ORIGINAL_MAX,
                 "beta": YARN["beta_fast"], "alpha": YARN["beta_slow"], "apply_scale": False},
        "llama_4_scaling": {"original_max_position_embeddings": ORIGINAL_MAX, "beta": L4_BETA},
    }  # fmt: skip


def deepseek_config() -> dict:
    """The equivalent DeepSeek-V3 config.json, written out by hand."""
    return DIMS | {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "scoring_func": "softmax",
        "topk_method": "greedy",
        "norm_topk_prob": True,
        "n_group": 1,
        "topk_group": 1,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "yarn", **YARN, "attention_factor": 1.0},
        "llama_4_scaling": {"beta": L4_BETA, "original_max_position_embeddings": ORIGINAL_MAX},
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }


def hf_mistral4(l4_beta: float = L4_BETA):
    """HF's Mistral-4 model on DIMS, weights re-initialised as tests/hf_reference.py does."""
    import transformers

    cfg = transformers.Mistral4Config(
        **{k: v for k, v in DIMS.items()},
        num_key_value_heads=DIMS["num_attention_heads"],
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        rope_interleave=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, **YARN,
                         "attention_factor": 1.0, "llama_4_scaling_beta": l4_beta},
    )  # fmt: skip
    torch.manual_seed(SEED)
    model = transformers.Mistral4ForCausalLM(cfg).float().eval()
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.empty(p.shape).uniform_(0.7, 1.3, generator=gen))
            elif name == "model.embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                gain = LM_HEAD_GAIN if name == "lm_head.weight" else 1.0
                p.copy_(torch.randn(p.shape, generator=gen) * (gain / p.shape[-1] ** 0.5))
    return model


def deepseek_tensors(model) -> dict[str, torch.Tensor]:
    """HF's state dict with its stacked experts split into DeepSeek's per-expert tensors."""
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base, inter = name.removesuffix("gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :inter].contiguous()
                out[f"{base}{e}.up_proj.weight"] = t[e, inter:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{name.removesuffix('down_proj')}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t.contiguous()
    return out


def quantized(tensors: dict[str, torch.Tensor], scale_suffix: str) -> dict[str, torch.Tensor]:
    """Every projection but the MLA down-projections and the router FP8 e4m3 with block
    scales named `scale_suffix` (FP8_BLOCK keeps wq_a / wkv_a_with_mqa and the gate dense)."""
    out = {}
    for name, t in tensors.items():
        dense = ("q_a_proj", "kv_a_proj_with_mqa", "mlp.gate.", "embed_tokens", "lm_head")
        if t.dim() == 2 and not any(d in name for d in dense):
            out[name], out[name + scale_suffix] = quantize(t, BLOCK)
        else:
            out[name] = t
    return out


def write(path: Path, tensors: dict, config: dict, mistral: bool) -> Path:
    path.mkdir(parents=True)
    if mistral:
        tensors = {mistral_name(n): t for n, t in tensors.items()}
        (path / "params.json").write_text(json.dumps(config))
    else:
        (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "consolidated.safetensors"), metadata={"format": "pt"})
    return path


def engine_logits(path: Path) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens per prompt and the logits of every generated token [NEW_TOKENS, vocab]."""
    llm = LLM(model=str(path), dtype="float32", block_size=16, max_cache_size=2**24)
    model = llm.engine.core.executor.worker.runner.model
    tokens, logits = [], []
    inner = model.compute_logits
    for p in PROMPTS:
        seen: list[torch.Tensor] = []

        def record(x, seen=seen):
            seen.append(inner(x))
            return seen[-1]

        model.compute_logits = record
        try:
            out = llm.generate([{"prompt_token_ids": p}], GREEDY)[0].outputs[0]
        finally:
            model.compute_logits = inner
        tokens.append(list(out.token_ids))
        logits.append(torch.cat(seen)[:NEW_TOKENS].float())
    del llm
    return tokens, logits


@pytest.fixture(scope="module")
def hf_model():
    return hf_mistral4()


@pytest.fixture(scope="module")
def layouts(hf_model, tmp_path_factory):
    """(DeepSeek layout, Mistral layout) of the same weights, and the engine's run of each."""
    root = tmp_path_factory.mktemp("mistral")
    tensors = deepseek_tensors(hf_model)
    ds = write(root / "ds", tensors, deepseek_config(), mistral=False)
    mi = write(root / "mistral", tensors, params_json(), mistral=True)
    return engine_logits(ds), engine_logits(mi)


def test_params_json_reads_as_the_equivalent_deepseek_config():
    cfg = config_from_mistral_params(params_json())
    want = deepseek_config()
    for key in DIMS:
        assert cfg[key] == want[key], key
    assert cfg["rope_scaling"] == want["rope_scaling"]
    routing = (cfg["scoring_func"], cfg["topk_method"], cfg["norm_topk_prob"])
    assert routing == ("softmax", "greedy", True)
    assert cfg["llama_4_scaling"] == {"original_max_position_embeddings": 16, "beta": L4_BETA}
    # apply_scale true (or absent): YaRN's m(factor)^2 on the softmax scale, cos/sin unscaled
    scaled = config_from_mistral_params(params_json() | {"yarn": {"factor": 4.0,
                                        "original_max_position_embeddings": 16}})  # fmt: skip
    assert scaled["rope_scaling"]["mscale_all_dim"] == 1.0


def test_mistral_layout_gives_the_deepseek_layouts_logits(layouts):
    (ds_tokens, ds_logits), (mi_tokens, mi_logits) = layouts
    assert mi_tokens == ds_tokens
    for a, b in zip(ds_logits, mi_logits):
        assert (a - b).abs().max() <= 1e-5


def test_mistral_layout_decodes_as_hf_mistral4(layouts, hf_model):
    _, (tokens, logits) = layouts
    unscaled = hf_mistral4(l4_beta=0.0)
    for p, toks, got in zip(PROMPTS, tokens, logits):
        ids = torch.tensor([p + toks[:-1]])
        with torch.no_grad():
            want = hf_model(ids).logits[0, len(p) - 1 :].float()
            off = unscaled(ids).logits[0, len(p) - 1 :].float()
        assert want.argmax(-1).tolist() == toks
        assert (want - got).abs().max() <= 1e-4
        if ids.shape[1] > ORIGINAL_MAX:  # positions past it: the query scaling is in play
            assert (off - got).abs().max() > 1e-2


def test_fp8_block_in_mistral_layout_equals_deepseeks_fp8(hf_model, tmp_path):
    tensors = deepseek_tensors(hf_model)
    ds_cfg = deepseek_config() | {"quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK)}}  # fmt: skip
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block",
               "block_structure": list(BLOCK), "dynamic": False}  # fmt: skip
    acts = {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128,
            "dynamic": True, "symmetric": True}  # fmt: skip
    ct = {"quant_method": "compressed-tensors", "format": "float-quantized",
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                        "input_activations": acts}},
          "ignore": ["tok_embeddings", "output", "re:.*wq_a$", "re:.*wkv_a_with_mqa$",
                     "re:.*gate$"]}  # fmt: skip
    ds = write(tmp_path / "ds", quantized(tensors, "_scale_inv"), ds_cfg, mistral=False)
    mi = write(tmp_path / "mi", quantized(tensors, "_scale"), params_json() | {
        "quantization_config": ct}, mistral=True)  # fmt: skip
    (ds_tokens, ds_logits), (mi_tokens, mi_logits) = engine_logits(ds), engine_logits(mi)
    assert mi_tokens == ds_tokens
    assert all((a - b).abs().max() <= 1e-5 for a, b in zip(ds_logits, mi_logits))


def test_names_map_both_ways_and_the_vision_tower_is_skipped():
    for name in ["layers.2.experts.7.w3.weight_scale", "layers.0.attention.wkv_a_with_mqa.weight",
                 "layers.1.shared_experts.w2.weight", "tok_embeddings.weight", "output.weight",
                 "layers.0.feed_forward.w1.weight", "layers.1.gate.weight"]:  # fmt: skip
        assert mistral_name(hf_name(name)) == name
    expert = "model.layers.1.mlp.experts.3.gate_proj.weight"
    assert hf_name("layers.1.experts.3.w1.weight") == expert
    assert hf_name("vision_encoder.transformer.layers.0.attention.wq.weight") is None


def test_unknown_missing_and_unread_are_refused(hf_model, tmp_path):
    tensors = {mistral_name(n): t for n, t in deepseek_tensors(hf_model).items()}
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "params.json").write_text(json.dumps(params_json()))
    save_file(tensors | {"layers.0.attention.wz.weight": torch.zeros(2, 2),
                         "vision_encoder.patch_conv.weight": torch.zeros(2, 2)},
              str(extra / "consolidated.safetensors"))  # fmt: skip
    with pytest.raises(ValueError, match=r"'layers\.0\.attention\.wz\.weight'"):
        LLM(model=str(extra), dtype="float32")
    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "params.json").write_text(json.dumps(params_json()))
    save_file({n: t for n, t in tensors.items() if n != "layers.1.ffn_norm.weight"},
              str(missing / "consolidated.safetensors"))  # fmt: skip
    with pytest.raises(ValueError, match=r"layers\.1\.ffn_norm\.weight"):
        LLM(model=str(missing), dtype="float32")
    with pytest.raises(ValueError, match="'sliding_window' is not read"):
        config_from_mistral_params(params_json() | {"sliding_window": 4096})
    with pytest.raises(ValueError, match="qformat_weight"):
        config_from_mistral_params(params_json() | {"quantization": {"qformat_weight": "fp8_e4m3"}})
    groups = params_json()
    groups["moe"] = groups["moe"] | {"num_expert_groups": 4}
    with pytest.raises(ValueError, match="num_expert_groups=4"):
        config_from_mistral_params(groups)


def test_plan_prices_the_mistral_layout_as_the_deepseek_one(hf_model, tmp_path):
    tensors = deepseek_tensors(hf_model)
    ds = write(tmp_path / "ds", quantized(tensors, "_scale_inv"), deepseek_config() | {
        "quantization_config": {"quant_method": "fp8", "weight_block_size": list(BLOCK)}},
        mistral=False)  # fmt: skip
    ct = {"quant_method": "compressed-tensors", "format": "float-quantized",
          "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "symmetric": True,
                                              "strategy": "block",
                                              "block_structure": list(BLOCK)}}}}  # fmt: skip
    mi = write(tmp_path / "mi", quantized(tensors, "_scale"),
               params_json() | {"quantization_config": ct}, mistral=True)  # fmt: skip
    want, got = (make_plan(p, 1, weight_dtype="fp8", num_speculative_tokens=0) for p in (ds, mi))
    assert got.totals == want.totals and got.rank_bytes() == want.rank_bytes()
    assert (
        got.rank_bytes("experts")
        < sum(t.numel() for n, t in tensors.items() if ".experts." in n) * 2
    )
