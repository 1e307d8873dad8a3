"""Shared fixtures: a tiny random DeepSeek-V3 checkpoint written by HF transformers
(independent of our code), optionally with a small BPE tokenizer; and a shallow random
copy of the bundled model for tests whose check holds for any weights."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import safetensors.torch
import torch

from tests.hf_reference import TINY_CONFIGS, make_hf_checkpoint
from tools.make_random_checkpoint import make_random_checkpoint
from xllm_py.assets import BUNDLED_MODEL_DIR

ENGINE_CONFIG = "noq_yarn_mscale_grouped"  # YaRN, grouped routing, one dense layer

torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)

# Without a GPU, Triton kernels (xllm_py/ops) run on CPU tensors through Triton's
# interpreter. Triton reads this when a kernel is defined, so it is set before any test
# module imports one; the engine processes tests start inherit it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_TEXT = (
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens and "
    "verifies them in one pass. DeepSeek-V3 uses multi-head latent attention and a mixture of "
    "experts. Hello world! How are you today? Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12. "
) * 20


def _write_tokenizer(path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<bos>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([_TEXT], trainer)
    assert tok.get_vocab_size() <= vocab_size
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<bos>", "eos_token": "<eos>", "add_bos_token": True})
    )


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Checkpoint with tokenizer; eos_token_id is the tokenizer's <eos> (id 1)."""
    path = tmp_path_factory.mktemp("tiny_ckpt")
    make_hf_checkpoint(ENGINE_CONFIG, path)
    _write_tokenizer(path, TINY_CONFIGS[ENGINE_CONFIG]["vocab_size"])
    cfg = json.loads((path / "config.json").read_text())
    cfg["eos_token_id"], cfg["bos_token_id"] = 1, 0
    (path / "config.json").write_text(json.dumps(cfg))
    return path


# The bundled model's dimensions that `shallow_model` keeps
BUNDLED_SHAPES = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
    "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
    "num_experts_per_tok", "n_group", "topk_group", "first_k_dense_replace",
)  # fmt: skip
SHALLOW_LAYERS = 2  # one dense decoder layer and one MoE layer
# Its output heads are scaled up this much: random weights give flat next-token
# distributions, whose greedy choice is a near tie far more often than a trained model's
# (the median gap between the top two log-probabilities: 0.16, against the bundled
# model's 0.82), and a near tie can go either way between two exact ways of computing it.
SHALLOW_HEAD_SCALE = 4.0


def copy_bundled_tokenizer(path) -> None:
    """The bundled model's tokenizer and generation config, into checkpoint dir `path`."""
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(BUNDLED_MODEL_DIR / name, path / name)


def make_shallow_model(path) -> str:
    """A random checkpoint at `path` of the bundled model's shapes (vocabulary, attention,
    experts, one MTP layer) with SHALLOW_LAYERS decoder layers instead of 8, its heads
    scaled by SHALLOW_HEAD_SCALE, and the bundled tokenizer."""
    bundled = json.loads((BUNDLED_MODEL_DIR / "config.json").read_text())
    dims = {key: bundled[key] for key in BUNDLED_SHAPES}
    dims |= dict(num_hidden_layers=SHALLOW_LAYERS, max_position_embeddings=2048)
    make_random_checkpoint(path, dims, num_mtp=1)
    weights = safetensors.torch.load_file(path / "model.safetensors")
    for name in weights:
        if name == "lm_head.weight" or name.endswith("shared_head.head.weight"):
            weights[name] *= SHALLOW_HEAD_SCALE
    safetensors.torch.save_file(weights, path / "model.safetensors", {"format": "pt"})
    copy_bundled_tokenizer(path)
    return str(path)


@pytest.fixture(scope="session")
def shallow_model(tmp_path_factory) -> str:
    """make_shallow_model's checkpoint, for the tests that compare two ways of running one
    model (graphs against eager, ranks against one process), which hold for any weights:
    the engine's work and Inductor's compile time grow with the layers."""
    return make_shallow_model(tmp_path_factory.mktemp("shallow_model"))


@pytest.fixture(scope="session")
def vocab_size():
    return TINY_CONFIGS[ENGINE_CONFIG]["vocab_size"]
