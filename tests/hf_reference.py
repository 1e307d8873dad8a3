"""Independent reference for xllm_py: tiny random DeepSeek-V3 checkpoints + HF greedy decoding.

HF transformers' ``DeepseekV3ForCausalLM`` (eager attention, eager experts, float32, one prompt at a
time so there is no padding) is the ground truth for greedy token ids and chosen-token logprobs.
Checkpoints come from ``save_pretrained`` (safetensors, per-expert tensor names, ``rope_parameters``
in config.json): a real HF-format DeepSeek-V3 directory minus the MTP layer and FP8 scales.
Needs transformers >= 5 (``rope_parameters``, ``experts_implementation``).

Weights are re-initialised so that the comparison is meaningful and robust to float noise:
  * fan-in scaled normal weights keep activations O(1); a larger lm_head gain makes next-token
    distributions peaky, so greedy argmax is decided by real margins, not by rounding;
  * RMSNorm weights are random around 1, so a missing or misapplied norm weight shows;
  * router logits are O(1), so sigmoid scores and group/expert choices are well separated;
  * ``e_score_correction_bias`` is random and NON-NEGATIVE: HF masks the experts of dropped groups
    with -inf, DeepSeek's released modeling_deepseek.py (and vLLM/SGLang grouped_topk) with 0.0;
    the two pick the same experts only while every biased score of a kept group is > 0, which
    sigmoid + non-negative bias guarantees. Being non-zero it still checks that the bias steers
    expert choice but is left out of the routing weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "beta_fast": 32, "beta_slow": 1}

_COMMON = dict(
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    num_nextn_predict_layers=0,
    qk_nope_head_dim=16,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
    dtype="float32",
)

# kwargs for transformers.DeepseekV3Config. Together they cover: q_lora_rank None / int;
# n_group 1 and > 1 with topk_group < n_group; first_k_dense_replace 0 / 1 / 2; default rope;
# YaRN (factor > 1) with mscale == mscale_all_dim, with mscale != mscale_all_dim, with no mscale
# keys, and with factor != max_position_embeddings / original_max_position_embeddings.
TINY_CONFIGS: dict[str, dict] = {
    # Default rope, q-LoRA, single group, two dense layers then one MoE layer.
    "qlora_rope_dense2": dict(
        _COMMON,
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=2,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    # No q-LoRA, 4 groups pick 2, YaRN with mscale != mscale_all_dim (HF scales cos/sin by
    # yarn_mscale(mscale) / yarn_mscale(mscale_all_dim), the softmax scale by
    # yarn_mscale(mscale_all_dim)^2).
    "noq_yarn_mscale_grouped": dict(
        _COMMON,
        vocab_size=384,
        hidden_size=96,
        intermediate_size=192,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=64,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        max_position_embeddings=256,
        rope_parameters=dict(
            _YARN, factor=4.0, original_max_position_embeddings=64, mscale=0.707, mscale_all_dim=1.0
        ),
    ),
    # q-LoRA, all layers MoE, 2 groups pick 1, YaRN as DeepSeek-V3 (mscale == mscale_all_dim).
    "qlora_yarn_allmoe": dict(
        _COMMON,
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=0,
        max_position_embeddings=256,
        rope_parameters=dict(
            _YARN, factor=4.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=1.0
        ),
    ),
    # No q-LoRA, 4 layers, one group, YaRN without mscale keys (HF: cos/sin scaled by
    # 0.1*ln(factor)+1, softmax scale untouched) and factor 2 != 512 / 128 (max_pos / original).
    "noq_yarn_plain_4layer": dict(
        _COMMON,
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=16,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=None,
        kv_lora_rank=48,
        qk_rope_head_dim=8,
        v_head_dim=24,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        max_position_embeddings=512,
        rope_parameters=dict(_YARN, factor=2.0, original_max_position_embeddings=128),
    ),
    # The other DeepSeek-V3-family checkpoints people serve, by what differs from V3 (each
    # family's public config.json, shrunk). "_hf": HF class family ("v2": DeepseekV2, which
    # routes by softmax); "_model_type": written over config.json's after saving.
    # DeepSeek-V2-Lite: no q-LoRA, softmax + plain top-k, no bias, unnormalised weights, 2 shared
    # experts, YaRN with mscale = mscale_all_dim = 0.707.
    "v2lite_softmax_greedy": dict(
        _COMMON,
        _hf="v2",
        vocab_size=320,
        hidden_size=64,
        intermediate_size=160,
        moe_intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        n_shared_experts=2,
        num_experts_per_tok=3,
        n_group=1,
        topk_group=1,
        topk_method="greedy",
        scoring_func="softmax",
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        first_k_dense_replace=1,
        max_position_embeddings=256,
        rope_parameters=dict(
            _YARN,
            factor=4.0,
            original_max_position_embeddings=64,
            mscale=0.707,
            mscale_all_dim=0.707,
        ),
    ),
    # DeepSeek-V2 (236B): q-LoRA, softmax, group-limited greedy (groups by their best expert),
    # routed scaling 16, unnormalised weights.
    "v2_group_limited": dict(
        _COMMON,
        _hf="v2",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=16,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        topk_method="group_limited_greedy",
        scoring_func="softmax",
        norm_topk_prob=False,
        routed_scaling_factor=16.0,
        first_k_dense_replace=1,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    # Moonlight-16B-A3B: V3 architecture, no q-LoRA, one group, 2 shared experts, no rope
    # scaling at all, theta 50000, routed scaling 2.446, eps 1e-5.
    "moonlight_like": dict(
        _COMMON,
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        n_shared_experts=2,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.446,
        rms_norm_eps=1e-5,
        first_k_dense_replace=1,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
    ),
    # Kimi-K2: model_type kimi_k2 on the V3 architecture, q-LoRA, one group, one dense layer,
    # routed scaling 2.827, theta 50000, YaRN factor 32 with beta_fast = beta_slow = 1.
    "kimi_like": dict(
        _COMMON,
        _model_type="kimi_k2",
        vocab_size=448,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=12,
        num_experts_per_tok=4,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.827,
        first_k_dense_replace=1,
        max_position_embeddings=2048,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=50000.0,
            factor=32.0,
            beta_fast=1,
            beta_slow=1,
            original_max_position_embeddings=64,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    ),
}

# DeepSeek-V3.2 (DeepseekV32ForCausalLM): V3 plus DSA's lightning indexer. With index_topk 16
# the longer prompts attend sparsely (300 tokens: each query sees its best 16); with 1024 the
# indexer selects every visible token and attention stays dense. 32 indexer heads keep
# exact-zero index scores (all heads' relu at 0) rare, so the top-k cut is never a tie.
_V32 = dict(
    _COMMON,
    _hf="v32",
    _prompt_lengths=[5, 17, 40, 120, 300],
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    max_position_embeddings=512,
    rope_parameters=dict(_YARN, factor=4.0, original_max_position_embeddings=128),
    index_head_dim=16,
    index_n_heads=32,
)
TINY_CONFIGS["v32_sparse"] = dict(_V32, index_topk=16)
TINY_CONFIGS["v32_dense_topk"] = dict(_V32, index_topk=1024, _prompt_lengths=[5, 40, 120])

# lm_head std = gain / sqrt(hidden) -> logits ~ N(0, gain^2): peaky next-token distributions.
LM_HEAD_GAIN = 6.0

# Weight seed per config, picked out of 0..15 so that on the reference prompts every greedy
# top1-top2 logit gap (>= 2e-2 for the V3 configs, >= 2e-3 for the others) and every router
# group/expert top-k margin (>= 2.9e-4 for V3's sigmoid, >= 1.2e-4 for the softmax routers,
# whose probabilities over all experts sit closer together) is far above float32 noise (HF
# fp32 vs fp64 logprobs differ by < 1e-5).
CHECKPOINT_SEEDS: dict[str, int] = {
    "qlora_rope_dense2": 6,
    "noq_yarn_mscale_grouped": 11,
    "qlora_yarn_allmoe": 0,
    "noq_yarn_plain_4layer": 9,
    "v2lite_softmax_greedy": 10,
    "v2_group_limited": 13,
    "moonlight_like": 1,
    "kimi_like": 0,
    "v32_sparse": 4,
    "v32_dense_topk": 0,
}

# Reference workload: prompt lengths straddle the 16-token block size (1, 16, 17) and exceed
# the YaRN original_max_position_embeddings (100 + 32 > 64 / 128).
PROMPT_LENGTHS = [1, 3, 16, 17, 40, 100]
MAX_NEW_TOKENS = 32
PROMPT_SEED = 1234


def _quiet_transformers():
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def make_hf_checkpoint(
    name: str,
    out_dir: Path,
    seed: int = 0,
    max_shard_size: str | int | None = None,
    overrides: dict | None = None,
) -> Path:
    """Build a random DeepseekV3ForCausalLM for TINY_CONFIGS[name] (with `overrides` of its
    fields); save_pretrained it to out_dir.

    Same (name, seed) -> identical weights whatever max_shard_size ("20KB": index.json + shards).
    """
    import transformers

    _quiet_transformers()
    out_dir = Path(out_dir)
    torch.manual_seed(seed)
    kwargs = dict(TINY_CONFIGS[name]) | (overrides or {})
    family, model_type = kwargs.pop("_hf", "v3"), kwargs.pop("_model_type", None)
    kwargs.pop("_prompt_lengths", None)
    prefix = {"v2": "DeepseekV2", "v3": "DeepseekV3", "v32": "DeepseekV32"}[family]
    config = getattr(transformers, f"{prefix}Config")(**kwargs)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 1:  # RMSNorm weights
                p.copy_(torch.empty(p.shape).uniform_(0.7, 1.3, generator=gen))
            elif pname == "model.embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=gen))
            else:  # nn.Linear [out, in] and HF's stacked experts [E, out, in]: fan-in scaled
                gain = LM_HEAD_GAIN if pname == "lm_head.weight" else 1.0
                p.copy_(torch.randn(p.shape, generator=gen) * (gain / p.shape[-1] ** 0.5))
        for mod in model.modules():
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.copy_(
                    torch.rand(mod.e_score_correction_bias.shape, generator=gen) * 0.5
                )
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out_dir, safe_serialization=True, **kwargs)
    if model_type:
        cfg_file = out_dir / "config.json"
        cfg_file.write_text(
            json.dumps(json.loads(cfg_file.read_text()) | {"model_type": model_type})
        )
    return out_dir


def random_prompts(vocab_size: int, lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def reference_prompts(name: str) -> list[list[int]]:
    cfg = TINY_CONFIGS[name]
    lengths = cfg.get("_prompt_lengths", PROMPT_LENGTHS)
    return random_prompts(cfg["vocab_size"], lengths, PROMPT_SEED)


def _router_margin_hook(margins: list[float]):
    """Hook for HF's V2/V3 routers: how far each group/expert top-k choice is from a tie."""

    def hook(router, args, _out):
        x = args[0].reshape(-1, router.hidden_dim).float()
        logits = x @ router.weight.float().T
        n, g, k, tg = logits.shape[0], router.num_group or 1, router.top_k, router.topk_group or 1
        if hasattr(router, "e_score_correction_bias"):  # V3: sigmoid, biased, top-2 sum per group
            s = torch.sigmoid(logits) + router.e_score_correction_bias
            grp = s.view(n, g, -1).topk(2, dim=-1).values.sum(-1)
        else:  # V2: softmax; group_limited_greedy ranks groups by their best expert
            s = logits.softmax(dim=-1)
            if router.topk_method == "greedy":
                g = tg = 1
            grp = s.view(n, g, -1).amax(dim=-1)
        if tg < g:
            gs = grp.sort(dim=-1, descending=True).values
            margins.append((gs[:, tg - 1] - gs[:, tg]).min().item())
        keep = torch.zeros_like(grp, dtype=torch.bool).scatter_(
            1, grp.topk(tg, dim=-1).indices, True
        )
        ss = s.masked_fill(~keep.repeat_interleave(s.shape[1] // g, dim=1), float("-inf"))
        ss = ss.sort(dim=-1, descending=True).values
        if torch.isfinite(ss[:, k]).any():
            margins.append((ss[:, k - 1] - ss[:, k]).min().item())

    return hook


def hf_greedy_detailed(
    model_dir: Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    dtype: torch.dtype = torch.float32,
) -> dict:
    """Greedy-decode each prompt with HF. Returns {"results": as hf_greedy, "top1_top2_gaps": per
    prompt, the logit gap at every generated position, "min_router_margin": the smallest
    group/expert top-k margin over all prefill and decode tokens}."""
    from transformers import GenerationConfig
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32TopkRouter

    from tools.train_tiny_model import load_hf_model

    _quiet_transformers()
    # By the checkpoint's architecture, under its own model_type (tools/train_tiny_model.py)
    model = load_hf_model(
        model_dir, dtype=dtype, attn_implementation="eager", experts_implementation="eager"
    )
    gcfg = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    model.generation_config = gcfg
    margins: list[float] = []
    handles = [
        m.register_forward_hook(_router_margin_hook(margins))
        for m in model.modules()
        if isinstance(m, (DeepseekV2TopkRouter, DeepseekV3TopkRouter, DeepseekV32TopkRouter))
    ]
    results, gaps = [], []
    try:
        with torch.inference_mode():
            for p in prompts:
                ids = torch.tensor([p], dtype=torch.long)
                out = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    generation_config=gcfg,
                    output_logits=True,
                    return_dict_in_generate=True,
                )
                toks = out.sequences[0, len(p) :].tolist()
                assert len(toks) == max_new_tokens, (len(toks), max_new_tokens)
                logits = torch.cat(out.logits, dim=0).float()  # [new tokens, vocab], raw
                assert logits.argmax(-1).tolist() == toks
                lps = (
                    torch.log_softmax(logits, dim=-1)
                    .gather(1, torch.tensor(toks)[:, None])[:, 0]
                    .tolist()
                )
                top2 = logits.topk(2, dim=-1).values
                gaps.append((top2[:, 0] - top2[:, 1]).tolist())
                results.append((toks, lps))
    finally:
        for h in handles:
            h.remove()
    return {
        "results": results,
        "top1_top2_gaps": gaps,
        "min_router_margin": min(margins) if margins else float("inf"),
    }


def hf_greedy(
    model_dir: Path, prompts: list[list[int]], max_new_tokens: int
) -> list[tuple[list[int], list[float]]]:
    """Per prompt: (greedy token ids, log_softmax(raw logits)[chosen] per token). EOS is ignored."""
    return hf_greedy_detailed(model_dir, prompts, max_new_tokens)["results"]


def checkpoint_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a (single-file or sharded) safetensors checkpoint directory."""
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else ["model.safetensors"]
    )
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(model_dir / f))
    return out
