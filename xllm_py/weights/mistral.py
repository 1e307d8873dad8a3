"""Mistral's own checkpoint layout (Mistral Large 3): `params.json` (read by config.py) and
Mistral's tensor names, which are DeepSeek-V3's modules under other names:

    tok_embeddings / norm / output                      model.embed_tokens / model.norm / lm_head
    layers.N.attention_norm, ffn_norm                   model.layers.N.input_layernorm,
                                                        post_attention_layernorm
    layers.N.attention.{wq, wq_a, q_a_norm, wq_b,       model.layers.N.self_attn.{q_proj,
      wkv_a_with_mqa, kv_a_norm, wkv_b, wo}               q_a_proj, q_a_layernorm, q_b_proj,
                                                          kv_a_proj_with_mqa, kv_a_layernorm,
                                                          kv_b_proj, o_proj}
    layers.N.feed_forward.{w1, w2, w3}                  model.layers.N.mlp.{gate, down, up}_proj
    layers.N.gate                                       model.layers.N.mlp.gate
    layers.N.shared_experts.{w1, w2, w3}                model.layers.N.mlp.shared_experts.*_proj
    layers.N.experts.E.{w1, w2, w3}                     model.layers.N.mlp.experts.E.*_proj

The last part of a name (`weight`, `weight_scale`, ...) is kept. Mistral rotates
interleaved pairs as DeepSeek does, so no weight is permuted. The vision tower's tensors
(`vision_encoder.*`, `vision_language_adapter.*`, `patch_merger.*`,
`pre_mm_projector_norm.*`) are left unread: the engine serves text. Any other name is an
error naming it; the loader then checks the mapped names against the model's own list, so
a missing tensor is an error naming it too.
"""

from __future__ import annotations

import re
from pathlib import Path

from xllm_py.config import CONFIG_FILE, MISTRAL_PARAMS_FILE

VISION_PREFIXES = ("vision_encoder.", "vision_language_adapter.", "patch_merger.",
                   "pre_mm_projector_norm.")  # fmt: skip
_TOP = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}
_LAYER_MODULES = {
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attention.wq": "self_attn.q_proj",
    "attention.wq_a": "self_attn.q_a_proj",
    "attention.q_a_norm": "self_attn.q_a_layernorm",
    "attention.wq_b": "self_attn.q_b_proj",
    "attention.wkv_a_with_mqa": "self_attn.kv_a_proj_with_mqa",
    "attention.kv_a_norm": "self_attn.kv_a_layernorm",
    "attention.wkv_b": "self_attn.kv_b_proj",
    "attention.wo": "self_attn.o_proj",
    "gate": "mlp.gate",
}
_FFN = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_NAME = re.compile(r"^layers\.(\d+)\.(.+)\.([a-z_]+)$")
_FFN_OWNER = re.compile(r"^(feed_forward|shared_experts|experts\.(\d+))\.(w[123])$")


def is_mistral_layout(path: str | Path) -> bool:
    """A checkpoint directory in Mistral's layout: params.json and no config.json."""
    path = Path(path)
    return (path / MISTRAL_PARAMS_FILE).is_file() and not (path / CONFIG_FILE).is_file()


def hf_name(name: str) -> str | None:
    """The DeepSeek-V3 (HF) name of Mistral tensor `name`; None for a vision-tower tensor.
    ValueError for a name that is neither."""
    if name.startswith(VISION_PREFIXES):
        return None
    top, _, leaf = name.partition(".")
    if top in _TOP and "." not in leaf:
        return f"{_TOP[top]}.{leaf}"
    m = _NAME.match(name)
    if m:
        layer, module, leaf = m.groups()
        if module in _LAYER_MODULES:
            return f"model.layers.{layer}.{_LAYER_MODULES[module]}.{leaf}"
        f = _FFN_OWNER.match(module)
        if f:
            owner, expert, w = f.groups()
            where = {"feed_forward": "mlp", "shared_experts": "mlp.shared_experts"}.get(owner)
            where = where or f"mlp.experts.{expert}"
            return f"model.layers.{layer}.{where}.{_FFN[w]}.{leaf}"
    raise ValueError(f"Mistral checkpoint tensor {name!r} has no DeepSeek-V3 counterpart")


def name_map(stored: list[str]) -> dict[str, str]:
    """{HF name: stored Mistral name} for every text tensor of a Mistral checkpoint."""
    out: dict[str, str] = {}
    for name in stored:
        hf = hf_name(name)
        if hf is None:
            continue
        if hf in out:
            raise ValueError(f"Mistral tensors {out[hf]!r} and {name!r} both map to {hf!r}")
        out[hf] = name
    return out


def mistral_name(hf: str) -> str:
    """The inverse, for tools and tests writing a checkpoint in Mistral's layout."""
    for top, mapped in _TOP.items():
        if hf.startswith(mapped + ".") and hf.count(".") == mapped.count(".") + 1:
            return top + hf[len(mapped) :]
    m = re.match(r"^model\.layers\.(\d+)\.(.+)\.([a-z_]+)$", hf)
    if not m:
        raise ValueError(f"{hf!r} is not a DeepSeek-V3 decoder tensor name")
    layer, module, leaf = m.groups()
    for mistral, ours in _LAYER_MODULES.items():
        if module == ours:
            return f"layers.{layer}.{mistral}.{leaf}"
    for w, proj in _FFN.items():
        for owner, where in (("feed_forward", "mlp"), ("shared_experts", "mlp.shared_experts")):
            if module == f"{where}.{proj}":
                return f"layers.{layer}.{owner}.{w}.{leaf}"
        e = re.fullmatch(rf"mlp\.experts\.(\d+)\.{proj}", module)
        if e:
            return f"layers.{layer}.experts.{e.group(1)}.{w}.{leaf}"
    raise ValueError(f"{hf!r} has no Mistral counterpart")
