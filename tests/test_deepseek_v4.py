"""DeepSeek-V4's arithmetic (xllm_py/models/deepseek_v4.py) against HF transformers'
`DeepseekV4ForCausalLM` on tiny random checkpoints that HF itself saves (the release's
tensor names), float32: the logits at every position of a prompt long enough that every
compressor emits entries and the indexer chooses among more than it keeps, within 1e-4,
and the same greedy continuation. Ours runs one request's prompt in chunks of uneven sizes
and then one token at a time over its own block-paged cache rows (block size 4, blocks out
of order: chunks and blocks end mid-window), which carry windows, pending tokens, overlap
series and entries from one call to the next; HF runs each sequence whole, without a cache.
Batches, the prefix cache and preemption through the engine: test_deepseek_v4_engine.py.

The configs mix the three attention kinds (sliding window, CSA, HCA), hash-routed and
score-routed MoE layers, hc_mult 2 and 4, plain and YaRN compress RoPE."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from xllm_py.args import EngineArgs
from xllm_py.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpecConfig,
)
from xllm_py.models.attention_layout import RequestLayout, build_context
from xllm_py.models.context import forward_context
from xllm_py.models.deepseek_v4 import CSA, HCA, SLIDING, DeepseekV4ForCausalLM, V4Config
from xllm_py.models.layers import compressed_attention
from xllm_py.processes import cluster_options

BASE = dict(
    vocab_size=96,
    hidden_size=64,
    moe_intermediate_size=32,
    num_attention_heads=4,
    head_dim=32,
    q_lora_rank=32,
    partial_rotary_factor=8 / 32,
    num_experts_per_tok=2,
    n_routed_experts=4,
    n_shared_experts=1,
    compress_rates={CSA: 4, HCA: 8},
    sliding_window=8,
    o_groups=2,
    o_lora_rank=16,
    # 8 indexer heads: a score is exactly 0 when ReLU zeroes every head, and two such
    # entries tie for the top-k, which either engine may break its own way (with 2 heads a
    # quarter of the entries score 0)
    index_n_heads=8,
    index_head_dim=16,
    index_topk=3,
    max_position_embeddings=256,
    dtype="float32",
)
CONFIGS = {
    "hc2-sliding-csa-hca": dict(
        BASE,
        num_hidden_layers=3,
        hc_mult=2,
        layer_types=[SLIDING, CSA, HCA],
        mlp_layer_types=["hash_moe", "moe", "moe"],
    ),
    "hc4-yarn-csa-first": dict(
        BASE,
        num_hidden_layers=4,
        hc_mult=4,
        layer_types=[CSA, HCA, SLIDING, CSA],
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    ),
}
PROMPT, CHUNKS, DECODE = 29, (5, 11, 13), 12  # 29 prompt tokens fed 5 + 11 + 13, then 12 decoded


def hf_checkpoint(name: str, path, seed: int = 0):
    """A random HF DeepseekV4ForCausalLM, every parameter and buffer drawn so that each
    one matters (HF initialises sinks, position biases, hash tables and hc biases to
    constants), saved with save_pretrained."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.DeepseekV4Config(**CONFIGS[name])
    model = transformers.DeepseekV4ForCausalLM(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.copy_(drawn(pname, p.shape, gen))
        for bname, b in model.named_buffers():
            if bname.endswith("tid2eid"):
                k, experts = cfg.num_experts_per_tok, cfg.n_routed_experts
                rows = [torch.randperm(experts, generator=gen)[:k] for _ in range(cfg.vocab_size)]
                b.copy_(torch.stack(rows))
            elif bname.endswith("e_score_correction_bias"):
                b.copy_(torch.rand(b.shape, generator=gen) * 0.1)
        model.lm_head.weight.mul_(3.0)  # peaky next-token distributions: real greedy margins
    model.save_pretrained(path)
    return model


def drawn(name: str, shape, gen: torch.Generator) -> torch.Tensor:
    """A random value for parameter `name` that matters, with activations staying O(1)."""
    if name.endswith("norm.weight"):
        return torch.empty(shape).uniform_(0.7, 1.3, generator=gen)
    if len(shape) == 1 or "position_bias" in name:  # sinks, hc biases and scales
        return torch.randn(shape, generator=gen) * 0.5
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=gen)
    return torch.randn(shape, generator=gen) / shape[-1] ** 0.5  # fan-in scaled


def ours(path) -> DeepseekV4ForCausalLM:
    cfg = V4Config.from_dict(json.loads((path / "config.json").read_text()))
    model = DeepseekV4ForCausalLM(cfg).eval()
    missing, unexpected = model.load_state_dict(load_file(path / "model.safetensors"), strict=False)
    assert not unexpected, unexpected
    assert not missing, missing
    model.process_weights_after_loading()
    return model


class OneRequest:
    """One request fed to the model a chunk at a time over its own paged cache rows."""

    def __init__(self, model: DeepseekV4ForCausalLM, max_tokens: int, block_size: int = 4):
        n = -(-max_tokens // block_size)
        self.model, self.block_size, self.done = model, block_size, 0
        self.caches = [torch.zeros(n + 1, block_size, w) for w in model.cache_dims]
        self.blocks = list(range(n, 0, -1))  # out of order, block 0 unused

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """The logits after each of the next tokens `ids` [S]."""
        s, n = self.done, ids.shape[0]
        pos = torch.arange(s, s + n)
        layout = [RequestLayout(0, n, s + n, self.blocks)]
        with forward_context(build_context(layout, pos, self.caches, self.block_size)):
            hidden = self.model(ids, pos)
        self.done += n
        return self.model.compute_logits(hidden)


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_and_greedy_tokens_equal_hf(name, tmp_path, monkeypatch):
    monkeypatch.setattr(compressed_attention, "QUERY_CHUNK", 4)  # chunks of 11, 13 split too
    hf = hf_checkpoint(name, tmp_path)
    model = ours(tmp_path)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(2, CONFIGS[name]["vocab_size"], (PROMPT,), generator=gen)
    request, logits, start = OneRequest(model, PROMPT + DECODE), [], 0
    with torch.no_grad():
        for size in CHUNKS:  # chunked prefill
            logits.append(request(prompt[start : start + size]))
            start += size
        tokens = prompt.tolist()
        for _ in range(DECODE):  # greedy, one token a step
            tokens.append(int(logits[-1][-1].argmax()))
            logits.append(request(torch.tensor(tokens[-1:])))
        want = hf(torch.tensor([tokens])).logits[0]
    got = torch.cat(logits)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()
    # the continuation is HF's own greedy one (its argmax at each decoded position)
    assert tokens[PROMPT:] == want[PROMPT - 1 : -1].argmax(-1).tolist()
    # the indexer kept fewer entries than the last queries could see
    assert len(tokens) // 4 > model.config.index_topk


def test_v4_config_reads_the_release_field_names():
    """The release's config.json spells some fields the older way: per-layer
    `compress_ratios` (0 / 4 / 128), `num_hash_layers`, `qk_rope_head_dim`."""
    raw = {
        k: v
        for k, v in CONFIGS["hc2-sliding-csa-hca"].items()
        if k not in ("layer_types", "mlp_layer_types")
    }
    raw |= {"compress_ratios": [0, 4, 128], "num_hash_layers": 1, "qk_rope_head_dim": 8}
    raw.pop("compress_rates")
    cfg = V4Config.from_dict(raw)
    assert cfg.layer_types == (SLIDING, CSA, HCA)
    assert cfg.mlp_layer_types == ("hash_moe", "moe", "moe")
    assert (cfg.rope_dim, cfg.csa_rate, cfg.hca_rate) == (8, 4, 128)
    assert cfg.compress_rope.type == "default" and cfg.compress_rope.theta == 160000.0
    yarn = {"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
            "beta_fast": 32, "beta_slow": 1, "rope_theta": 160000.0}  # fmt: skip
    cfg = V4Config.from_dict(raw | {"compress_rope_parameters": yarn})
    assert (cfg.compress_rope.type, cfg.compress_rope.factor) == ("yarn", 16.0)
    assert cfg.compress_rope.cos_sin_scale == 1.0 and cfg.main_rope.type == "default"
    with pytest.raises(ValueError, match="layer_types"):
        V4Config.from_dict(
            raw | {"compress_ratios": [0, 4, 16]} | {"layer_types": [SLIDING, "dense", HCA]}
        )


def test_what_v4_does_not_serve_yet_is_refused_naming_it(tmp_path):
    """MTP drafts without an MTP layer (or from a DSpark drafter), graph mode and DP
    attention are refused for V4 at start-up, each naming the flag, field or tensor;
    without them the config is accepted."""
    hf_checkpoint("hc2-sliding-csa-hca", tmp_path)
    model = ModelConfig.from_pretrained(tmp_path)
    assert model.architecture == "DeepseekV4ForCausalLM"
    assert (model.vocab_size, model.num_hidden_layers) == (96, 3)
    args = dict(model=model, cache=CacheConfig(), scheduler=SchedulerConfig())
    EngineConfig(device=DeviceConfig(), **args)
    with pytest.raises(ValueError, match="num_speculative_tokens=1 .*DeepseekV4.*no MTP layer"):
        EngineConfig(device=DeviceConfig(), spec=SpecConfig(num_speculative_tokens=1), **args)
    # with MTP layers (mtp.*) it drafts; the 0731 releases' DSpark drafter under the same
    # names is told from them by its tensors, and refused
    mtp = {"mtp.0.e_proj.weight": torch.zeros(4, 4), "mtp.0.enorm.weight": torch.ones(4)}
    save_file(mtp, tmp_path / "mtp.safetensors")
    EngineConfig(device=DeviceConfig(), spec=SpecConfig(num_speculative_tokens=1), **args)
    dspark = mtp | {"mtp.2.markov_head.markov_w1.weight": torch.zeros(4, 4)}
    save_file(dspark, tmp_path / "mtp.safetensors")
    with pytest.raises(ValueError, match="a DSpark drafter \\(mtp.2.markov_head.markov_w1"):
        EngineConfig(device=DeviceConfig(), spec=SpecConfig(num_speculative_tokens=1), **args)
    EngineConfig(device=DeviceConfig(), **args)  # served without drafts
    with pytest.raises(ValueError, match="enable_graph=True .*DeepseekV4"):
        EngineConfig(device=DeviceConfig(enable_graph=True), **args)
    # the daemon's graph mode where it pays (CPU, float32) stays off for V4 unless asked for
    assert not EngineArgs(model=str(tmp_path), dtype="float32").engine_config().device.enable_graph
    # a cluster runs V4 (tests/test_deepseek_v4_parallel.py), but not with DP attention
    cluster = EngineArgs(model=str(tmp_path), nnodes=2, master_node_addr="127.0.0.1:1",
                         dp_size=2, ep_size=2, enable_dp_attention=True)  # fmt: skip
    with pytest.raises(ValueError, match="--enable_dp_attention: .*DeepSeek-V4, whose DP"):
        cluster_options(cluster, EngineConfig(device=DeviceConfig(), **args))
    # the release's quantisation is read (tests/test_deepseek_v4_quantised.py), V4's
    # top-level expert_dtype into quantization_config as V4.1 has it
    raw = json.loads((tmp_path / "config.json").read_text())
    release = {"quantization_config": {"quant_method": "fp8"}, "expert_dtype": "fp4"}
    qc = ModelConfig.from_dict(raw | release).quantization_config
    assert qc == {"quant_method": "fp8", "expert_dtype": "fp4"}
