"""Checkpoints as operators handle them: FP8 block-quantised and sharded targets,
tools/export_deepseek_mtp.py, and loading the MTP draft from either layout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tools.make_random_checkpoint import make_random_checkpoint
from xllm_py import LLM, SamplingParams
from xllm_py.weights.fp8 import Fp8Config, dequantize, quantize
from xllm_py.weights.loader import tensor_files

ROOT = Path(__file__).resolve().parent.parent
EXPORT = ROOT / "tools" / "export_deepseek_mtp.py"
BLOCK = (32, 32)  # the random checkpoint's dims (80, 144, 48, ...) leave partial edge blocks


def reference_dequant(q: torch.Tensor, scale_inv: torch.Tensor, block) -> torch.Tensor:
    """Block by block, written independently of xllm_py.weights.fp8."""
    out = torch.empty(q.shape)
    for bi in range(scale_inv.shape[0]):
        for bj in range(scale_inv.shape[1]):
            rows = slice(bi * block[0], (bi + 1) * block[0])
            cols = slice(bj * block[1], (bj + 1) * block[1])
            out[rows, cols] = q[rows, cols].float() * scale_inv[bi, bj]
    return out


def all_tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory) -> Path:
    return make_random_checkpoint(tmp_path_factory.mktemp("fp8"), fp8_block=BLOCK, shards=2, seed=3)


@pytest.fixture(scope="module")
def fp32_reference(fp8_ckpt, tmp_path_factory) -> Path:
    """The same weights, dequantised independently and saved in float32, no quantization_config."""
    out = tmp_path_factory.mktemp("fp8_dequantised")
    stored = all_tensors(fp8_ckpt)
    plain = {}
    for name, t in stored.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            plain[name] = reference_dequant(t, stored[name + "_scale_inv"], BLOCK)
        else:
            plain[name] = t.float()
    save_file(plain, str(out / "model.safetensors"))
    cfg = json.loads((fp8_ckpt / "config.json").read_text())
    del cfg["quantization_config"]
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_dequantize_handles_partial_edge_blocks():
    w = torch.randn(70, 45)
    q, scale_inv = quantize(w, BLOCK)
    assert q.dtype == torch.float8_e4m3fn and scale_inv.shape == (3, 2)
    got = dequantize(q, scale_inv, BLOCK, torch.float32)
    assert torch.equal(got, reference_dequant(q, scale_inv, BLOCK))
    assert (got - w).abs().max() < 0.1 * w.abs().max()  # e4m3 keeps ~2 significant digits


def test_bad_scale_shape_and_unknown_quant_method_are_clear_errors():
    q, scale_inv = quantize(torch.randn(64, 64), BLOCK)
    with pytest.raises(ValueError, match="weight_scale_inv has shape"):
        dequantize(q, scale_inv[:1], BLOCK, torch.float32)
    with pytest.raises(ValueError, match="quant_method='awq'"):
        Fp8Config.from_quantization_config({"quant_method": "awq"})


def test_fp8_sharded_checkpoint_matches_its_dequantised_float32_copy(fp8_ckpt, fp32_reference):
    index = json.loads((fp8_ckpt / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2
    prompts = [{"prompt_token_ids": p} for p in ([5, 9, 11, 3], list(range(20, 57)), [7] * 9)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=0)
    a = LLM(model=str(fp8_ckpt), dtype="float32", block_size=16).generate(prompts, params)
    b = LLM(model=str(fp32_reference), dtype="float32", block_size=16).generate(prompts, params)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for lx, ly, t in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, x.outputs[0].token_ids):
            assert lx[t] == pytest.approx(ly[t], abs=1e-5)


def run_export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXPORT), *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def exported(fp8_ckpt, tmp_path_factory) -> Path:
    (fp8_ckpt / "tokenizer_config.json").write_text('{"eos_token": "<eos>"}')
    out = tmp_path_factory.mktemp("export") / "mtp"
    r = run_export("--input-dir", str(fp8_ckpt), "--output-dir", str(out), "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout
    return out


def test_export_layout_names_shapes_dtypes_and_values(fp8_ckpt, fp32_reference, exported):
    cfg_in = json.loads((fp8_ckpt / "config.json").read_text())
    cfg = json.loads((exported / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["first_k_dense_replace"] == 0
    assert cfg["architectures"] == ["DeepseekV3MtpForCausalLM"]
    assert cfg["model_type"] == "deepseek_v3_mtp" and "quantization_config" not in cfg
    assert cfg["hidden_size"] == cfg_in["hidden_size"]
    assert (exported / "tokenizer_config.json").read_text() == '{"eos_token": "<eos>"}'
    index = json.loads((exported / "model.safetensors.index.json").read_text())
    out = all_tensors(exported)
    assert set(index["weight_map"]) == set(out)
    n = cfg_in["num_hidden_layers"]
    originals = all_tensors(fp32_reference)
    expected = {}
    for name, t in originals.items():
        if name.startswith(f"model.layers.{n}."):
            rest = name[len(f"model.layers.{n}.") :]
            top = rest.split(".")[0] in ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")
            expected["model." + rest if top else f"model.layers.0.{rest}"] = t
    assert set(out) == set(expected)
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in out and "model.enorm.weight" in out
    for name, t in out.items():
        assert t.dtype == torch.float32, name
        assert t.shape == expected[name].shape, name
        assert torch.equal(t, expected[name]), name
    assert not any(k.endswith("_scale_inv") for k in out)


def test_engine_loads_exported_draft_same_as_in_checkpoint_draft(fp8_ckpt, exported):
    from xllm_py.worker.worker import load_draft_model

    llm = LLM(model=str(fp8_ckpt), dtype="float32", block_size=16)
    w = llm.engine.core.executor.worker
    inside = load_draft_model(w.config, w.model, None, w.device, w.dtype)
    outside = load_draft_model(w.config, w.model, str(exported), w.device, w.dtype)
    a, b = inside.layers[0], outside.layers[0]
    for x, y in [
        (a.self_attn.w_in, b.self_attn.w_in),
        (a.mlp.w13, b.mlp.w13),
        (a.mlp.w2, b.mlp.w2),
        (a.eh_proj.weight, b.eh_proj.weight),
        (a.enorm.scale, b.enorm.scale),
        (a.shared_head.norm.scale, b.shared_head.norm.scale),
    ]:
        assert torch.equal(x, y)
    assert inside.target is w.model  # embedding and head are the target's own tensors
    assert not any("embed" in n or "head.head" in n for n in dict(outside.named_parameters()))


def test_exported_draft_decodes_like_the_checkpoints_own_mtp(tmp_path):
    """The operator's path: export the bundled model's MTP layer with the tool's defaults
    (bfloat16, the checkpoint's own dtype), serve with draft_model=that directory. Greedy
    float32 decoding with k=2 chained drafts gives the same token ids as the in-checkpoint
    MTP, and the same drafts: every acceptance counter is equal too."""
    bundled = ROOT / "xllm_py" / "assets" / "tiny-deepseek-v3-mtp"
    out = tmp_path / "mtp"
    r = run_export("--input-dir", str(bundled), "--output-dir", str(out))
    assert r.returncode == 0, r.stderr
    prompts = [
        "<|bos|><|user|>\nHow do I reverse a list in Python?\n<|assistant|>\n",
        "<|bos|><|user|>\nWrite a short poem about the sea.\n<|assistant|>\n",
        "<|bos|><|user|>\nWhat is the capital of France?\n<|assistant|>\n",
    ]
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)

    def decode(draft_model):
        llm = LLM(
            dtype="float32",
            num_speculative_tokens=2,
            draft_model=draft_model,
            max_cache_size=64 << 20,  # plenty for 3 requests; allocating more is slow
        )
        worker = llm.engine.core.executor.worker
        assert worker.config.spec.draft_model == draft_model and worker.draft is not None
        ids = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        return ids, llm.get_metrics()

    own_ids, own = decode(None)
    ids, exported_stats = decode(str(out))
    assert ids == own_ids
    assert exported_stats == own
    assert own.accepted_per_position[1] > 0  # the second, chained draft was used and kept


def edit_draft(src: Path, edit, dst: Path | None = None) -> Path:
    """`edit(tensors)` applied to the draft's safetensors shard, in a copy of `src` at `dst`
    (or in place); returns the shard's path."""
    if dst is not None:
        dst.mkdir()
        for f in src.iterdir():
            (dst / f.name).write_bytes(f.read_bytes())
    shard = next((dst or src).glob("*.safetensors"))
    t = load_file(str(shard))
    edit(t)
    save_file(t, str(shard))
    return shard


def test_draft_with_a_head_copy_that_differs_is_refused(fp8_ckpt, exported, tmp_path):
    from xllm_py.worker.worker import load_draft_model

    def shift_head(t):
        t["model.shared_head.head.weight"] = t["model.shared_head.head.weight"] + 1

    bad = tmp_path / "bad"
    edit_draft(exported, shift_head, bad)
    llm = LLM(model=str(fp8_ckpt), dtype="float32", block_size=16)
    w = llm.engine.core.executor.worker
    with pytest.raises(ValueError, match="shared_head.head"):
        load_draft_model(w.config, w.model, str(bad), w.device, w.dtype)


def test_bf16_export_of_a_float32_target_loads_and_a_misshapen_copy_is_refused(
    fp32_reference, tmp_path
):
    """An export at the tool's default bfloat16 of a float32 checkpoint: its embedding and
    head copies equal the target's only at bf16 precision, which is how they are compared.
    A copy of the wrong shape is refused with both shapes named."""
    from xllm_py.worker.worker import load_draft_model

    out = tmp_path / "bf16"
    r = run_export("--input-dir", str(fp32_reference), "--output-dir", str(out))
    assert r.returncode == 0, r.stderr
    llm = LLM(model=str(fp32_reference), dtype="float32", block_size=16)
    w = llm.engine.core.executor.worker
    draft = load_draft_model(w.config, w.model, str(out), w.device, w.dtype)
    assert len(draft.layers) == 1
    rows = w.model.lm_head.weight.shape[0]

    def drop_a_row(t):
        t["model.shared_head.head.weight"] = t["model.shared_head.head.weight"][:-1].clone()

    edit_draft(out, drop_a_row)
    with pytest.raises(ValueError, match=rf"has shape \({rows - 1}, .* has \({rows}"):
        load_draft_model(w.config, w.model, str(out), w.device, w.dtype)


def test_draft_with_an_unexpected_tensor_is_refused_by_name(fp8_ckpt, exported, tmp_path):
    from xllm_py.worker.worker import load_draft_model

    def add_lm_head(t):
        t["lm_head.weight"] = t["model.shared_head.head.weight"].clone()  # not a draft name

    bad = tmp_path / "extra"
    shard = edit_draft(exported, add_lm_head, bad)
    index = bad / "model.safetensors.index.json"
    meta = json.loads(index.read_text())
    meta["weight_map"]["lm_head.weight"] = shard.name
    index.write_text(json.dumps(meta))
    llm = LLM(model=str(fp8_ckpt), dtype="float32", block_size=16)
    w = llm.engine.core.executor.worker
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_draft_model(w.config, w.model, str(bad), w.device, w.dtype)


def test_export_with_two_mtp_layers(tmp_path):
    src = make_random_checkpoint(tmp_path / "two", num_mtp=2, seed=5)
    out = tmp_path / "two-mtp"
    r = run_export("--input-dir", str(src), "--output-dir", str(out), "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    names = set(all_tensors(out))
    assert {
        "model.layers.1.enorm.weight",
        "model.layers.0.eh_proj.weight",
        "model.embed_tokens.weight",
    } <= names
    from xllm_py.worker.worker import load_draft_model

    llm = LLM(model=str(src), dtype="float32", block_size=16)
    w = llm.engine.core.executor.worker
    draft = load_draft_model(w.config, w.model, str(out), w.device, w.dtype)
    assert len(draft.layers) == 2


def _assert_clean_failure(r: subprocess.CompletedProcess, out: Path, pattern: str) -> None:
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and pattern in lines[0], r.stderr
    assert not out.exists()
    assert not any(p.name.startswith(f".{out.name}.") for p in out.parent.iterdir())


def test_export_bad_inputs_fail_cleanly(tmp_path, fp8_ckpt):
    out = tmp_path / "out"
    _assert_clean_failure(
        run_export("--input-dir", str(tmp_path / "nope"), "--output-dir", str(out)),
        out,
        "no such directory",
    )
    no_mtp = make_random_checkpoint(tmp_path / "nomtp", num_mtp=0)
    _assert_clean_failure(
        run_export("--input-dir", str(no_mtp), "--output-dir", str(out)), out, "no MTP layer"
    )
    # a truncated shard
    trunc = tmp_path / "trunc"
    trunc.mkdir()
    for f in fp8_ckpt.iterdir():
        (trunc / f.name).write_bytes(f.read_bytes())
    shard = sorted(trunc.glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    _assert_clean_failure(
        run_export("--input-dir", str(trunc), "--output-dir", str(out)), out, shard.name
    )
    # an index naming a file that is not there
    missing = tmp_path / "missing"
    missing.mkdir()
    for f in fp8_ckpt.iterdir():
        (missing / f.name).write_bytes(f.read_bytes())
    sorted(missing.glob("*.safetensors"))[0].unlink()
    _assert_clean_failure(
        run_export("--input-dir", str(missing), "--output-dir", str(out)), out, "does not exist"
    )


def test_export_refuses_to_overwrite_without_force(tmp_path, fp8_ckpt):
    out = tmp_path / "existing"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    r = run_export("--input-dir", str(fp8_ckpt), "--output-dir", str(out))
    assert r.returncode != 0 and "--force" in r.stderr
    assert (out / "keep.txt").read_text() == "mine"
    r = run_export("--input-dir", str(fp8_ckpt), "--output-dir", str(out), "--force")
    assert r.returncode == 0, r.stderr
    assert not (out / "keep.txt").exists()
    with safe_open(str(next(out.glob("*.safetensors"))), "pt") as f:
        assert f.get_tensor("model.enorm.weight").dtype == torch.bfloat16  # the default --dtype


def test_auto_draft_vocab_sizes_the_hot_head_from_the_token_map(tmp_path):
    """--speculative_draft_vocab_size auto, the default: a token map beside the checkpoint
    gives the draft a head over the fewest hot tokens that cover 99.5% of its counts,
    rounded up to 64, at least 512 or a quarter of the vocabulary; without a map, with 0,
    or where the cover is most of the vocabulary (a flat map) the draft reads the whole
    vocabulary. A value that is neither is refused by name."""
    from xllm_py.speculative.hot_vocab import TOKEN_MAP_FILE, save_token_map

    path = make_random_checkpoint(tmp_path / "ckpt", seed=6)  # vocab 320

    def hot(**kw):
        llm = LLM(model=str(path), dtype="float32", num_speculative_tokens=1, **kw)
        head = llm.engine.core.executor.worker.runner.proposer.hot
        return None if head is None else head.token_ids.tolist()

    assert hot() is None  # no token map
    order = torch.arange(319, -1, -1)  # most frequent first: ids 319, 318, ...
    counts = torch.cat([torch.full((70,), 100), torch.ones(20), torch.zeros(230)])
    save_token_map(path / TOKEN_MAP_FILE, order, counts)  # 70 tokens: 99.7% of 7,020
    assert hot() == order[:128].tolist()
    assert hot(speculative_draft_vocab_size="auto") == order[:128].tolist()
    assert hot(speculative_draft_vocab_size=0) is None
    assert hot(speculative_draft_vocab_size="96") == order[:96].tolist()
    counts = torch.cat([torch.full((10,), 100), torch.zeros(310)])  # 10 tokens: all of them
    save_token_map(path / TOKEN_MAP_FILE, order, counts)
    assert hot() == order[:80].tolist()  # at least a quarter of the vocabulary (< 512)
    save_token_map(path / TOKEN_MAP_FILE, order, torch.ones(320))  # flat: 319 tokens > 320 / 2
    assert hot() is None
    for bad in ("most", "-1", 1.5):
        with pytest.raises(ValueError, match=f"--speculative_draft_vocab_size={bad}: expected"):
            LLM(model=str(path), speculative_draft_vocab_size=bad)


def test_checkpoint_without_mtp_layer_cannot_give_a_draft(tmp_path):
    from xllm_py.worker.worker import load_draft_model

    src = make_random_checkpoint(tmp_path / "nomtp", num_mtp=0)
    llm = LLM(model=str(src), dtype="float32", block_size=16)
    w = llm.engine.core.executor.worker
    with pytest.raises(ValueError, match="no MTP layer"):
        load_draft_model(w.config, w.model, None, w.device, w.dtype)


def test_a_token_map_beside_a_single_file_checkpoint_is_not_read_as_weights(tmp_path):
    """A hot-vocabulary token map saved next to an unindexed checkpoint (the engine's
    default place for it) is neither an unexpected tensor nor in the loader's files."""
    from xllm_py.speculative.hot_vocab import TOKEN_MAP_FILE, save_token_map

    path = make_random_checkpoint(tmp_path / "ckpt", seed=5)
    save_token_map(path / TOKEN_MAP_FILE, torch.arange(320), torch.ones(320))
    assert all(f.name != TOKEN_MAP_FILE for f in tensor_files(path).values())
    llm = LLM(model=str(path), dtype="float32", num_speculative_tokens=1,
              speculative_draft_vocab_size=40)  # fmt: skip
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert len(llm.generate({"prompt_token_ids": [3, 4, 5]}, params)[0].outputs[0].token_ids) == 8
