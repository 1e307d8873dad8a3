"""FP8 block-quantised checkpoints held FP8-resident (--weight_dtype fp8) against the same
checkpoints dequantised at load, and sliced loading: each tensor-/expert-parallel rank reads
only its part of the files.

The checkpoints are tools/make_random_checkpoint.py's, quantised with 32 x 32 blocks over
dims that are not multiples of 32 (partial edge blocks; fused gate|up and q|kv matrices
whose parts end mid-block), in two shards; float32 compute, so the reference path
(weights dequantised per matmul) must reproduce load-time dequantisation.
"""

from __future__ import annotations

import pytest
import torch

from tools.make_random_checkpoint import make_random_checkpoint
from xllm_py import LLM, SamplingParams
from xllm_py.config import ModelConfig
from xllm_py.models.deepseek_v3 import DeepseekV3ForCausalLM
from xllm_py.models.layers.linear import Linear, linear
from xllm_py.parallel.context import ParallelContext
from xllm_py.weights.fp8 import (
    Fp8Config,
    Fp8Weight,
    block_index,
    covering,
    dequantize,
    fp8_resident,
    quantize,
)
from xllm_py.weights.loader import Checkpoint, layer_index, load_weights

BLOCK = (32, 32)
# Expert-heavy, as DeepSeek-V3 is (its routed experts are ~95% of the weights): the
# embedding and head, which stay in the run dtype, do not dominate the byte count.
EXPERT_HEAVY = dict(n_routed_experts=32, moe_intermediate_size=96, n_group=4, topk_group=2)
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8_resident")
    return make_random_checkpoint(path, EXPERT_HEAVY, fp8_block=BLOCK, shards=2, seed=7)


def run(path, weight_dtype: str, dtype: str = "float32", k: int = 0, prompts=None):
    llm = LLM(
        model=str(path),
        dtype=dtype,
        weight_dtype=weight_dtype,
        block_size=16,
        max_cache_size=8 << 20,
        num_speculative_tokens=k,
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts or []], GREEDY)
    results = []
    for o in outs:
        c = o.outputs[0]
        results.append((c.token_ids, [lp[t] for lp, t in zip(c.logprobs, c.token_ids)]))
    return results, llm.engine.core.executor.worker


def prompts32() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, 40, (32,), generator=g).tolist()
    return [torch.randint(2, 320, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("k", [0, 1], ids=["plain", "mtp"])
def test_fp8_resident_generates_what_load_time_dequantisation_does(ckpt, k):
    prompts = prompts32()
    want, _ = run(ckpt, "float32", k=k, prompts=prompts)
    got, worker = run(ckpt, "fp8", k=k, prompts=prompts)
    assert isinstance(worker.model.model.layers[1].mlp.w13, Fp8Weight)  # really resident
    assert [t for t, _ in got] == [t for t, _ in want]
    worst = max(abs(a - b) for (_, g), (_, w) in zip(got, want) for a, b in zip(g, w))
    assert worst < 1e-3


def resident_bytes(model: torch.nn.Module) -> int:
    """Bytes of every weight the model holds (parameters, FP8 data, scales and block maps,
    fused matrices kept as plain attributes), each tensor once; the RoPE tables are not
    weights and are left out."""
    seen = {}
    for name, mod in model.named_modules():
        if name.endswith("rotary"):
            continue
        tensors = [*mod._parameters.values(), *mod._buffers.values()]
        tensors += [v for v in vars(mod).values() if isinstance(v, torch.Tensor)]
        for t in tensors:
            if t is not None:
                seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def test_fp8_resident_weights_take_at_most_55_percent_of_the_bf16_load(ckpt):
    _, bf16 = run(ckpt, "bf16", dtype="bfloat16", k=1)
    _, fp8 = run(ckpt, "fp8", dtype="bfloat16", k=1)
    for part in ("model", "draft"):
        ratio = resident_bytes(getattr(fp8, part)) / resident_bytes(getattr(bf16, part))
        assert ratio <= 0.55, f"{part}: {ratio:.3f}"


def test_weight_dtype_errors_name_the_values(ckpt):
    with pytest.raises(ValueError, match="weight_dtype=fp8: the checkpoint is not FP8"):
        LLM(dtype="float32", weight_dtype="fp8")  # the bundled model is not quantised
    with pytest.raises(ValueError, match="weight_dtype=bfloat16: .* float32"):
        LLM(model=str(ckpt), dtype="float32", weight_dtype="bf16")
    with pytest.raises(ValueError, match="weight_dtype=fp8 with enable_graph=True"):
        LLM(model=str(ckpt), weight_dtype="fp8", enable_graph=True)
    with pytest.raises(ValueError, match="weight_dtype=int4: the checkpoint has no INT4"):
        LLM(model=str(ckpt), weight_dtype="int4")


def test_fp8_weight_slices_and_fusions_dequantise_like_the_whole_tensor():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(70, 90, generator=g)
    q, s = quantize(w, BLOCK)
    full = dequantize(q, s, BLOCK, torch.float32)
    # a rank's rows 20..55 and columns 40..90: the blocks they touch, their own index maps
    rows, cols = covering(20, 35, 32), covering(40, 50, 32)
    part = Fp8Weight(
        q[20:55, 40:90],
        s[rows, cols],
        block_index(35, 32, 20),
        block_index(50, 32, 40),
        BLOCK,
    )
    assert torch.equal(part.dequant(torch.float32), full[20:55, 40:90]) and not part.aligned
    whole = Fp8Weight(q, s, block_index(70, 32), block_index(90, 32), BLOCK)
    assert whole.aligned
    # fused along rows: the first part ends mid-block (35 rows), the second starts there
    upper = Fp8Weight(
        q[:35], s[covering(0, 35, 32)], block_index(35, 32), block_index(90, 32), BLOCK
    )
    lower = Fp8Weight(
        q[35:], s[covering(35, 35, 32)], block_index(35, 32, 35), block_index(90, 32), BLOCK
    )
    assert torch.equal(Fp8Weight.cat([upper, lower]).dequant(torch.float32), full)
    fused = Fp8Weight.cat([whole, whole])
    assert torch.equal(fused.dequant(torch.float32), torch.cat([full, full]))
    stack = Fp8Weight.stack([whole, whole])
    assert torch.equal(stack[torch.tensor([1, 0, 1])].dequant(torch.float32)[2], full)
    x = torch.randn(3, 90, generator=g)
    assert torch.allclose(linear(x, whole), x @ full.T, atol=1e-5)


# ---- sliced loading ----------------------------------------------------------------------------


def _rank_load(path, parallel: ParallelContext, block=None):
    """This rank's target model, loaded (FP8-resident with `block`), and its Checkpoint."""
    cfg = ModelConfig.from_pretrained(path)
    ckpt = Checkpoint(path, Fp8Config.from_quantization_config(cfg.quantization_config))
    with fp8_resident(block):
        model = DeepseekV3ForCausalLM(cfg, parallel)
    n = cfg.num_hidden_layers
    load_weights(model, ckpt, lambda name: None if (layer_index(name) or 0) >= n else name)
    return ckpt, model


def stored_bytes(ckpt: Checkpoint) -> dict[str, int]:
    """Bytes of every tensor in the checkpoint, from the safetensors headers."""
    from safetensors import safe_open

    out = {}
    for f in set(ckpt.files.values()):
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                sl = st.get_slice(name)
                numel = 1
                for n in sl.get_shape():
                    numel *= n
                out[name] = numel * {"F8_E4M3": 1, "F32": 4, "BF16": 2}[sl.get_dtype()]
    return out


@pytest.mark.parametrize("ep_size", [1, 2], ids=["tp", "ep"])
@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_reads_only_its_part_of_the_files(ckpt, ep_size, rank):
    """Bytes read by a rank of a 2-way TP (or EP) target <= (its split tensors' bytes / 2 +
    the replicated ones') x 1.05; the 5% is for the scale blocks a slice shares with its
    neighbour. (Each rank's weights equal the whole-tensor loader's slices:
    test_tensor_parallel.py's shard test loads through the same sliced reads.)"""
    whole_ckpt, _ = _rank_load(ckpt, ParallelContext())
    part_ckpt, model = _rank_load(ckpt, ParallelContext(rank, 2, ep_size))
    sizes = stored_bytes(whole_ckpt)
    n = model.config.num_hidden_layers
    targets = model.state_dict(keep_vars=True)
    split = replicated = 0
    for name, size in sizes.items():
        weight = name.removesuffix("_scale_inv")
        if (layer_index(name) or 0) >= n:
            continue  # the MTP layer: not the target's
        t = targets.get(weight)
        if t is None or getattr(t, "shard", None) is not None or ".experts." in name:
            split += size  # another rank's expert, a slice, or this rank's share of experts
        else:
            replicated += size
    assert whole_ckpt.bytes_read == split + replicated  # one process reads everything once
    assert part_ckpt.bytes_read <= (split / 2 + replicated) * 1.05
    assert part_ckpt.bytes_read < 0.8 * whole_ckpt.bytes_read


@pytest.mark.parametrize("ep_size", [1, 2], ids=["tp", "ep"])
def test_fp8_resident_slices_hold_the_whole_tensors_blocks(ckpt, ep_size):
    """A TP/EP rank's FP8-resident linears (slices that start and end mid-block included)
    dequantise to exactly its slice of the whole dequantised weight."""
    _, whole = _rank_load(ckpt, ParallelContext())
    _, part = _rank_load(ckpt, ParallelContext(1, 2, ep_size), BLOCK)
    full = {n: m for n, m in whole.named_modules() if isinstance(m, Linear)}
    checked = 0
    for name, m in part.named_modules():
        if not isinstance(m, Linear) or m.block is None:
            continue
        shard = getattr(m.weight, "shard", None)
        want = full[name].weight if shard is None else shard.take(full[name].weight)
        m.process_weights_after_loading()
        assert isinstance(m.weight, Fp8Weight)
        assert torch.equal(m.weight.dequant(torch.float32), want), name
        checked += 1
    assert checked > 10
