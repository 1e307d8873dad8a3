"""The second bundled checkpoint, xllm_py/assets/small-deepseek-v3-mtp: DeepSeek-V3's own
attention geometry (latent 512 + 64 per token and layer, q LoRA, 128-wide nope and value
heads) and routed experts at ~51M parameters, trained on ShareGPT. The rest of the suite
runs on the tiny model; this file checks the small one's promised limits and that its
MTP layer drafts without changing greedy output."""

from __future__ import annotations

import json
import math
from pathlib import Path

from safetensors import safe_open
from tokenizers import Tokenizer

from tools.train_tiny_model import SMALL_CONFIG
from xllm_py import LLM, SamplingParams
from xllm_py.assets import BUNDLED_MODEL_DIR

SMALL_MODEL_DIR = BUNDLED_MODEL_DIR.parent / "small-deepseek-v3-mtp"
MAX_PARAMETERS = 60_000_000  # the model and its MTP layer (not the layer's stored copies)
MAX_BYTES = 120_000_000  # every file of the asset as committed (work/ is gitignored)


def stored_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    shapes = {}
    for fname in sorted(set(index["weight_map"].values())):
        with safe_open(model_dir / fname, "pt") as st:
            for name in st.keys():
                shapes[name] = tuple(st.get_slice(name).get_shape())
    assert shapes.keys() == index["weight_map"].keys()
    return shapes


def test_small_checkpoint_geometry_and_limits():
    cfg = json.loads((SMALL_MODEL_DIR / "config.json").read_text())
    assert cfg == SMALL_CONFIG  # tools/train_tiny_model.py --preset small reproduces it
    assert (cfg["model_type"], cfg["architectures"]) == ("deepseek_v3", ["DeepseekV3ForCausalLM"])
    assert (cfg["topk_method"], cfg["scoring_func"], cfg["torch_dtype"]) == (
        "noaux_tc",
        "sigmoid",
        "bfloat16",
    )
    # DeepSeek-V3's attention geometry: what vLLM's MLA backends (CPU included) accept
    assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]) == (512, 64)
    assert (cfg["qk_nope_head_dim"], cfg["v_head_dim"]) == (128, 128)
    assert cfg["q_lora_rank"] and cfg["num_nextn_predict_layers"] == 1

    shapes = stored_shapes(SMALL_MODEL_DIR)
    n = cfg["num_hidden_layers"]
    copies = {f"model.layers.{n}.embed_tokens.weight", f"model.layers.{n}.shared_head.head.weight"}
    assert copies <= shapes.keys()
    params = {k: math.prod(s) for k, s in shapes.items() if k not in copies}
    assert sum(params.values()) <= MAX_PARAMETERS
    routed = sum(v for k, v in params.items() if ".mlp.experts." in k)
    attention = sum(v for k, v in params.items() if ".self_attn." in k)
    vocab = params["model.embed_tokens.weight"] + params["lm_head.weight"]
    assert routed > max(attention, vocab)  # the routed experts are the bulk, as in V3
    files = [f for f in SMALL_MODEL_DIR.iterdir() if f.is_file()]
    assert sum(f.stat().st_size for f in files) <= MAX_BYTES
    tok = Tokenizer.from_file(str(SMALL_MODEL_DIR / "tokenizer.json"))  # the tiny model's
    assert tok.get_vocab_size(with_added_tokens=True) <= cfg["vocab_size"]
    for name in ("tokenizer_config.json", "generation_config.json", "README.md"):
        assert (SMALL_MODEL_DIR / name).is_file()


def test_small_model_mtp_greedy_equals_plain_greedy():
    """Two short chat prompts, a few tokens each: MTP drafting (k = 2, every draft
    verified) must give the tokens plain greedy decoding gives, and some drafts must be
    accepted (the MTP layer predicts)."""
    # a small KV cache: the CPU default would take a share of the RAM (576 numbers a token)
    kw = dict(model=str(SMALL_MODEL_DIR), dtype="float32", block_size=16, max_cache_size=32 << 20)
    plain = LLM(**kw)
    tok = plain.get_tokenizer()
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": text}])
        for text in ("What is the capital of France?", "Write a short poem about the sea.")
    ]
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy)]
    spec = LLM(**kw, num_speculative_tokens=2, speculative_confidence="off")
    got = spec.generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in got] == want
    assert sum(o.num_accepted_tokens for o in got) > 0
