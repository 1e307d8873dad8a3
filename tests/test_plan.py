"""The memory plan (xllm_py/plan.py) on a header-only replica of DeepSeek-V3
(tools/make_header_checkpoint.py), checked against DeepSeek's published parameter
counts, against sums recomputed here from the headers, and, on the bundled model,
against what a loaded model really holds."""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tools.make_header_checkpoint import family_config, make_header_checkpoint
from xllm_py.assets import bundled_model
from xllm_py.plan import GIB, format_plan, main, make_plan
from xllm_py.weights.loader import tensor_files

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    return make_header_checkpoint(tmp_path_factory.mktemp("deepseek-v3-headers"))


def _plan(*args, **kw):
    """make_plan with the MTP layer loaded unless a test says otherwise (the figures of
    docs/memory_plan.md are with k = 1; the flag's default is the engine's, 0)."""
    return make_plan(*args, **{"num_speculative_tokens": 1, **kw})


@pytest.fixture(scope="module")
def plan16(replica):
    return _plan(replica, 16, tp=16, ep=16, device_memory_gb=64)


def _headers(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape), read with the safetensors library (not the plan's reader)."""
    out = {}
    for f in sorted(set(tensor_files(path).values())):  # the weights (not a token map beside)
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                sl = st.get_slice(name)
                out[name] = (sl.get_dtype(), tuple(sl.get_shape()))
    return out


@pytest.fixture(scope="module")
def headers(replica):
    """The replica's headers, read once with the safetensors library (_headers)."""
    return _headers(replica)


@pytest.fixture(scope="module")
def family_replica(tmp_path_factory):
    """family -> a header replica of it in 4 shards, written once for the tests here."""

    @functools.cache
    def make(family: str) -> Path:
        out = tmp_path_factory.mktemp(family)
        return make_header_checkpoint(out, shards=4, config=family_config(family))

    return make


@pytest.fixture(scope="module")
def family_plan(family_replica):
    """family -> its plan on 8 devices of 141 GiB, tp 8, ep 8, no MTP layer (made once)."""

    @functools.cache
    def plan(family: str):
        path = family_replica(family)
        return _plan(path, 8, tp=8, ep=8, device_memory_gb=141, num_speculative_tokens=0)

    return plan


def test_replica_is_header_only_and_readable(replica, headers):
    shards = sorted(replica.glob("*.safetensors"))
    assert len(shards) == 163 and shards[0].name == "model-00001-of-000163.safetensors"
    apparent = sum(f.stat().st_size for f in shards)
    on_disk = sum(f.stat().st_blocks * 512 for f in shards)
    assert apparent > 680e9 and on_disk < 64 * 2**20  # ~688 GB of holes, a few MB of headers
    files = tensor_files(replica)  # the engine's loader accepts the index
    assert files["model.layers.61.shared_head.head.weight"].is_file()
    index = json.loads((replica / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(files)
    h = headers
    assert h["model.layers.3.mlp.experts.255.down_proj.weight"] == ("F8_E4M3", (7168, 2048))
    assert h["model.layers.3.mlp.experts.255.down_proj.weight_scale_inv"] == ("F32", (56, 16))
    assert h["model.layers.0.self_attn.kv_b_proj.weight"] == ("F8_E4M3", (32768, 512))
    assert h["model.layers.61.eh_proj.weight"] == ("BF16", (7168, 14336))
    assert h["model.layers.60.mlp.gate.e_score_correction_bias"] == ("F32", (256,))


def test_totals_match_deepseeks_published_counts(plan16):
    t = plan16.totals
    close = lambda x, ref, tol=0.02: abs(x / ref - 1) < tol  # noqa: E731
    assert close(t["main"], 671e9)  # "671B total"
    assert close(t["activated"], 37e9)  # "37B activated" (README_WEIGHTS.md: 36.6B, head
    assert close(t["activated"], 36.6e9, 0.005)  # counted, embedding not)
    assert close(t["mtp_unique"], 11.5e9)  # README_WEIGHTS.md: MTP, 11.5B unique parameters
    assert close(t["stored"], 685e9)  # "685B on Hugging Face" = main + MTP layer
    # DeepSeek's "14B MTP" is 685B - 671B. Counted, the MTP layer with its copies of the
    # embedding and head holds 13.46B: within 4% of 14B, not 2% (docs/memory_plan.md).
    assert close(t["mtp"], 14e9, 0.04) and abs(t["mtp"] / 1e9 - 13.46) < 0.01


# Published totals and activated parameters (model cards): V2-Lite "15.7B / 2.4B",
# V2 "236B / 21B", Moonlight "16B / 3B" (its card: 3B activated, embedding counted),
# Kimi-K2 "1T / 32B".
FAMILY_TOTALS = {
    "deepseek-v2-lite": (15.7e9, 2.4e9),
    "deepseek-v2": (236e9, 21e9),
    "moonlight-16b-a3b": (16e9, None),
    "kimi-k2": (1.03e12, 32e9),
    "kimi-k2-thinking": (1.03e12, 32e9),  # INT4 experts: counted as values, not words
    "deepseek-v3.2": (671e9, 37e9),  # V3.2-Exp's card: 685 B with its MTP layer, as V3
}


@pytest.mark.parametrize("family", sorted(FAMILY_TOTALS))
def test_other_family_replicas_match_their_published_counts(family, family_plan):
    """A header replica of each family from its published config (BF16 where it ships
    BF16, no q-LoRA where it has none, no routing bias outside noaux_tc) loads into the
    engine's meta model, shape-checked, and its totals are the model card's."""
    plan = family_plan(family)
    total, active = FAMILY_TOTALS[family]
    assert abs(plan.totals["main"] / total - 1) < 0.02
    if active:
        assert abs(plan.totals["activated"] / active - 1) < 0.05


def test_int4_experts_are_priced_as_the_engine_holds_them(family_plan):
    """Kimi-K2-Thinking's INT4 experts stay packed (`auto` is int4 for an INT4 checkpoint,
    as on CUDA): priced at their int32 words and bf16 group scales, 0.5625 bytes a value,
    a little over half Kimi-K2's FP8 experts with their block scales (the plans of the
    test above)."""
    plans = {f: family_plan(f) for f in ("kimi-k2", "kimi-k2-thinking")}
    fp8, int4 = (plans[f].rank_bytes("experts") for f in ("kimi-k2", "kimi-k2-thinking"))
    assert plans["kimi-k2-thinking"].opts.weight_dtype == "int4"
    assert 0.55 < int4 / fp8 < 0.58  # 0.5625 vs 1 + 4 / 128**2 bytes a value


def _split_ways(name: str, tp: int, ep: int) -> int:
    """How many ranks share this checkpoint tensor (independent of the model classes)."""
    if ".mlp.experts." in name:
        return tp if ep == 1 else 1  # split on the intermediate dim, or whole on one rank
    if ".mlp.gate." in name or "embed_tokens" in name or name == "lm_head.weight":
        return 1
    if any(s in name for s in (".q_b_proj.", ".kv_b_proj.", ".o_proj.")):
        return tp
    return tp if ".mlp." in name and name.endswith("_proj.weight") else 1


@pytest.mark.parametrize("tp,ep", [(16, 16), (8, 1)])
def test_rank_shares_add_up_to_the_checkpoint(replica, headers, plan16, tp, ep):
    plan = plan16 if (tp, ep) == (16, 16) else _plan(replica, tp, tp=tp, ep=ep)
    h = headers
    rebuilt, experts = 0, {}
    for t in plan.tensors:
        if t.name not in h:  # post-processing copies and rope tables
            continue
        full, local = math.prod(h[t.name][1]), math.prod(t.shape)
        if "embed_tokens" in t.name or t.name == "lm_head.weight":
            assert local in (full, full // tp), t.name  # replicated, or split by vocab rows
        else:
            assert local * _split_ways(t.name, tp, ep) == full, (t.name, t.shape, h[t.name])
        rebuilt += full
        if ".mlp.experts." in t.name:
            layer, e = t.name.split(".")[2], int(t.name.split(".")[5])
            experts.setdefault(layer, set()).add(e)
    per_rank = 256 // ep
    assert all(ids == set(range(per_rank)) for ids in experts.values()) and len(experts) == 59
    # rank 0's tensors, each scaled to its full size, and the other ranks' experts: the model
    routed = sum(math.prod(s) for n, (_, s) in h.items() if ".experts." in n and "scale" not in n)
    rebuilt += routed - routed * per_rank // 256
    assert rebuilt == plan.totals["main"] + plan.totals["mtp_unique"]


def test_rank_bytes_priced_from_the_headers(headers, plan16):
    """Per kind, rank 0's bytes recomputed from the headers: FP8 tensors 1 byte + their
    float32 scales, split 16 ways where the engine splits them; the rest bf16 (router
    float32); + the copies process_weights_after_loading keeps."""
    h, tp = headers, 16
    main = {n: s for n, (_, s) in h.items() if not n.startswith("model.layers.61.")}

    def cost(name: str) -> int:
        numel, ways = math.prod(main[name]), _split_ways(name, tp, tp)
        if name + "_scale_inv" in main:
            return (numel + 4 * math.prod(main[name + "_scale_inv"])) // ways
        return numel * (4 if ".mlp.gate." in name else 2) // ways

    experts = sum(cost(n) for n in main if ".mlp.experts." in n and "scale" not in n) // 16
    router = sum(cost(n) for n in main if ".mlp.gate." in n)
    assert plan16.rank_bytes("experts") == experts + router
    attn = [n for n in main if ".self_attn." in n and "scale" not in n]
    norms = sum(math.prod(main[n]) * 4 for n in attn if n.endswith("norm.weight"))
    w_uk_uv = sum(math.prod(main[n]) * 2 // tp for n in attn if ".kv_b_proj." in n)
    assert plan16.rank_bytes("attention") == sum(cost(n) for n in attn) + norms + w_uk_uv
    dense = [n for n in main if ".mlp." in n and ".experts." not in n and ".gate." not in n]
    assert plan16.rank_bytes("dense") == sum(cost(n) for n in dense if "scale" not in n)
    full_vocab = 2 * 2 * 129280 * 7168  # embed + head in bf16, replicated or vocab-split
    assert plan16.rank_bytes("embedding/head") in (full_vocab, full_vocab // tp)
    assert 0.8 * GIB < plan16.rank_bytes("MTP") < 1.0 * GIB  # 16 experts + attention/16 + eh


def test_kv_cache_and_capacity(replica, plan16):
    p = plan16
    assert p.cache_layers == 62 and p.kv_bytes_per_token == 62 * (512 + 64) * 2
    assert p.kv_bytes_per_block == 128 * p.kv_bytes_per_token
    budget = int(64 * GIB * 0.9) - p.rank_bytes() - 2 * GIB
    assert p.kv_budget == budget and p.tokens_per_replica == budget // p.kv_bytes_per_block * 128
    no_mtp = _plan(replica, 16, tp=8, ep=8, device_memory_gb=141, num_speculative_tokens=0)
    assert no_mtp.opts.dp == 2 and no_mtp.cache_layers == 61 and no_mtp.rank_bytes("MTP") == 0
    bf16 = _plan(replica, 16, tp=16, ep=16, weight_dtype="bf16")  # today's engine
    assert bf16.rank_bytes("experts") > 1.9 * p.rank_bytes("experts")
    assert bf16.kv_budget < 0 and bf16.tokens_per_replica == 0


@pytest.mark.parametrize(
    "kw,flag",
    [
        (dict(tp=12), "--tp=12"),  # 128 heads are not divisible by 12
        (dict(tp=3), "--tp=3"),  # does not divide 16 devices
        (dict(tp=16, ep=4), "--ep=4"),
        (dict(weight_dtype="fp16"), "--weight_dtype=fp16"),
        (dict(max_memory_utilization=1.5), "--max_memory_utilization=1.5"),
        (dict(dp_attention=True, tp=16), "--tp=16"),  # DP attention runs tp 1
        (dict(dp_attention=True, ep=8), "--ep=8"),  # its experts span all 16 devices
    ],
)
def test_bad_flags_are_named(replica, kw, flag):
    with pytest.raises(ValueError, match=flag):
        _plan(replica, 16, **kw)


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "xllm_py.plan", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def test_cli(replica, capsys):
    """`python -m xllm_py.plan --help` as a user runs it; the plans through main() in this
    process (the same parser and printer, without a second interpreter's start-up)."""
    helped = _cli("--help")
    assert helped.returncode == 0
    for flag in ("--model", "--devices", "--tp", "--ep", "--device_memory_gb", "--block_size",
                 "--max_memory_utilization", "--activation_reserve_gb", "--weight_dtype",
                 "--num_speculative_tokens", "--dp_attention"):  # fmt: skip
        assert flag in helped.stdout
    common = ["--model", str(replica), "--devices", "8", "--tp", "8", "--ep", "8"]
    assert main([*common, "--device_memory_gb", "141", "--num_speculative_tokens", "1"]) == 0
    out = capsys.readouterr().out
    per_token = "per token  62 cache layers x (512 latent + 64 roped key) x 2 B = 71,424 B"
    for line in ("671.03 B", per_token, "tp 8, ep 8"):
        assert line in out
    # the default is the engine's (EngineArgs): no MTP layer, one cache layer fewer
    assert main(common) == 0
    assert "per token  61 cache layers" in capsys.readouterr().out


def _row(text: str, label: str) -> list[str]:
    """The cells of one row of the DP-attention comparison: [TP/EP, DP attention]."""
    line = next(x for x in text.splitlines() if x.startswith(f"  {label}  "))
    return line.removeprefix(f"  {label}").split()


@pytest.mark.parametrize("devices,memory", [(16, 64), (8, 141)])
def test_dp_attention_stores_each_token_on_one_rank(replica, plan16, devices, memory):
    """DP attention over N ranks caches a token's latent on the one rank that serves its
    request, where TP/EP over the same N stores it on all N: at least (N - 1) / N fewer
    KV bytes per token per rank (the acceptance line of issue 37 at N = 16), the same
    bytes per token in each process. The price: attention, dense layers, embedding and
    head whole on every rank. On 16 x 64 GiB that leaves no room for a KV block (the plan
    says so); on 8 x 141 GiB the cluster holds ~5x the tokens of TP8/EP8."""
    dp = _plan(replica, devices, dp_attention=True, device_memory_gb=memory)
    tp = dp.tp_layout
    assert (dp.opts.tp, dp.opts.ep, dp.opts.dp) == (1, devices, devices)
    assert (tp.opts.tp, tp.opts.ep, tp.opts.dp_attention) == (devices, devices, False)
    assert dp.kv_bytes_per_token == tp.kv_bytes_per_token == 62 * (512 + 64) * 2
    tp_kv, dp_kv = tp.kv_bytes_per_token_per_rank, dp.kv_bytes_per_token_per_rank
    assert tp_kv == tp.kv_bytes_per_token  # every rank stores every token
    assert tp_kv - dp_kv >= tp_kv * (devices - 1) / devices
    # the routed experts as under EP, the rest whole: dense and vocab rows N x TP's share
    assert dp.rank_bytes("experts") == tp.rank_bytes("experts")
    assert dp.rank_bytes("dense") == devices * tp.rank_bytes("dense")
    assert dp.rank_bytes("embedding/head") == 2 * 2 * 129280 * 7168
    text = format_plan(dp)
    kv = _row(text, "KV bytes per token per rank")
    assert kv == [f"{tp.kv_bytes_per_token:,}", "B", f"{tp.kv_bytes_per_token // devices:,}", "B"]
    tokens = _row(text, "tokens in the cluster")
    assert tokens == [f"{tp.cluster_tokens:,}", f"{dp.cluster_tokens:,}"]
    if devices == 16:
        assert plan16.rank_bytes() == tp.rank_bytes()
        assert dp.kv_budget < 0 and dp.cluster_tokens == 0 and "does not fit" in text
    else:
        assert dp.cluster_tokens > 4 * tp.cluster_tokens > 0
        assert f"cluster    x dp 8 = {dp.cluster_tokens:,} tokens" in text


def test_traffic_per_token_step_by_hand():
    """The bundled model: hidden 256, 8 layers of which 7 MoE, top_k 2, bf16, 4 devices.
    TP/EP all-reduces 2 x 8 layers x 256 x 2 B; DP attention sends and gets back top_k
    rows of 256 x 2 B per MoE layer, 3/4 of them to other ranks."""
    dp = _plan(bundled_model(), 4, dp_attention=True)
    tp = dp.tp_layout
    assert tp.all_reduce_bytes_per_token == 2 * 8 * 256 * 2 == 8192
    assert dp.all_to_all_bytes_per_token == 2 * 2 * 256 * 2 * 3 / 4 * 7 == 10752
    assert tp.all_to_all_bytes_per_token == dp.all_reduce_bytes_per_token == 0
    assert tp.bytes_sent_per_token == 4 * 8192 * 2 * 3 / 4  # a ring, from each of 4 ranks
    text = format_plan(dp)
    assert _row(text, "all-reduce bytes per token per step") == ["8,192", "0"]
    assert _row(text, "all-to-all bytes per token per step") == ["0", "10,752"]
    # 4 heads cannot be split 8 ways: DP attention alone, and why
    alone = _plan(bundled_model(), 8, dp_attention=True)
    assert "num_attention_heads=4" in alone.tp_layout
    assert "--tp=8: num_attention_heads=4" in format_plan(alone)


def test_cli_error_names_the_flag(replica, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--model", str(replica), "--devices", "16", "--tp", "12"])
    assert exit_.value.code == 2 and "--tp=12" in capsys.readouterr().err


def test_bundled_model_plan_equals_the_loaded_model():
    """At tp = 1 in float32 the plan prices exactly what a loaded target + draft hold: every
    tensor they keep (parameters, buffers, fused and copied tensors), each storage once."""
    from xllm_py import LLM

    plan = _plan(bundled_model(), 1, weight_dtype="float32")
    llm = LLM(dtype="float32", num_speculative_tokens=1, max_cache_size=1 << 20)
    w = llm.engine.core.executor.worker
    storages: dict[int, tuple[int, int]] = {}
    for m in [*w.model.modules(), *w.draft.modules()]:
        held = [*m._parameters.values(), *m._buffers.values(), *vars(m).values()]
        for t in held:
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                storages[s.data_ptr()] = (s.nbytes(), s.nbytes() // t.element_size())
    assert plan.rank_bytes() == sum(b for b, _ in storages.values())
    # the elements: the checkpoint's (less the MTP layer's embedding/head copies) + the
    # copies processing adds (w_uk/w_uv, norm scales) + the rope tables (cis + cos_sin)
    attn = [m for m in w.model.modules() if hasattr(m, "w_uk")]
    attn += [m for m in w.draft.modules() if hasattr(m, "w_uk")]
    absorbed = sum(m.w_uk.numel() + m.w_uv.numel() for m in attn)
    assert absorbed == sum(math.prod(t.shape) for t in plan.tensors if "w_uk+w_uv" in t.name)
    scales = sum(math.prod(t.shape) for t in plan.tensors if t.name.endswith(".scale"))
    rope = w.model.rotary.cis.numel() + w.model.rotary.cos_sin.numel()
    t = plan.totals
    assert sum(n for _, n in storages.values()) == t["main"] + t["mtp_unique"] + absorbed + (
        scales + rope
    )
    # and the header totals are the checkpoint's element count, read here with safetensors
    assert t["stored"] == sum(math.prod(s) for _, s in _headers(Path(bundled_model())).values())


def test_v32_prices_the_indexer_cache_beside_the_mla_cache(family_replica):
    """DeepSeek-V3.2's indexer keeps one 128-wide key per token and layer beside the MLA
    latent (512) and roped key (64): the plan shows each and counts them all."""
    path = family_replica("deepseek-v3.2")
    plan = _plan(path, 8, tp=8, ep=8, device_memory_gb=141)
    assert plan.kv_parts == {"latent": 512, "roped key": 64, "indexer key": 128}
    assert plan.kv_bytes_per_token == plan.cache_layers * (512 + 64 + 128) * 2
    text = format_plan(plan)
    assert f"indexer key  {plan.cache_layers * 128 * 2:,} B a token" in text
