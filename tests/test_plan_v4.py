"""The memory plan (xllm_py/plan.py) for DeepSeek-V4: header replicas of V4-Flash and V4-Pro
built from their published configs (`--model v4-flash`, `--model v4-pro`), checked against
the published parameter counts, against sums recomputed here from the headers, and against
DeepSeek-V3.2's replica (tools/make_header_checkpoint.py) at a 128k-token context; and a V4
release checkpoint directory (`.scale` tensors, FP4 experts as int8) read from its files."""

from __future__ import annotations

import functools
import json
import math

import pytest

import tools.make_header_checkpoint as header_tool
from tools.make_header_checkpoint import family_config, make_header_checkpoint
from xllm_py import plan as plan_module
from xllm_py.plan import (
    GIB,
    V4_FLASH,
    format_plan,
    main,
    make_plan,
    v4_names,
    v4_release_headers,
)
from xllm_py.weights.loader import layer_index

CONTEXT = 131072
H141 = dict(device_memory_gb=141)


@functools.cache
def _v4(model: str, devices: int, **kw):
    """A V4 plan (made once per arguments): tp = ep = devices unless told."""
    return make_plan(model, devices, **{"tp": devices, "ep": devices, **H141, **kw})


@pytest.fixture(scope="module")
def flash():
    return _v4("v4-flash", 8)


@pytest.fixture(scope="module")
def v32(tmp_path_factory):
    """A DeepSeek-V3.2 header replica (tools/make_header_checkpoint.py)."""
    out = tmp_path_factory.mktemp("deepseek-v3.2")
    return make_header_checkpoint(out, shards=4, config=family_config("deepseek-v3.2"))


@pytest.fixture(scope="module")
def pro_beside_v32(v32):
    """V4-Pro on 16 x 141 GiB, TP16/EP16, with V3.2 planned beside it on the same flags."""
    return _v4("v4-pro", 16, compare_with=str(v32))


def _close(x: float, ref: float, tol: float) -> bool:
    return abs(x / ref - 1) < tol


def test_replicas_match_the_published_counts(flash, pro_beside_v32):
    """V4-Flash: "284B total, 13B activated"; V4-Pro: "1.6T total, 49B activated" (its
    q_lora_rank and moe_intermediate_size are assumptions, plan.py's V4_PRO)."""
    f, p = flash.totals, pro_beside_v32.totals
    assert _close(f["main"], 284e9, 0.005) and _close(f["activated"], 13e9, 0.03)
    assert _close(p["main"], 1.6e12, 0.02) and _close(p["activated"], 49e9, 0.01)
    assert f["mtp_copies"] == p["mtp_copies"] == 0  # the MTP block shares embedding and head
    assert 0 < f["mtp_unique"] < f["main"] / 43 * 1.05  # one decoder block and its extras


def test_kv_bytes_by_layer_kind_are_ratio_scaled(flash):
    """Per token, a CSA layer holds one 512-wide entry and one 128-wide indexer key per 4
    tokens, an HCA layer one entry per 128, a sliding layer nothing (its window is a fixed
    cost a request); bf16, 2 B a number."""
    g = {group.kind: group for group in flash.cache}
    assert {k: x.layers for k, x in g.items()} == {"sliding window": 2, "CSA": 21, "HCA": 20}
    assert (g["CSA"].ratio, g["HCA"].ratio) == (4, 128)
    per_token = {k: x.bytes_per_block(128) / 128 for k, x in g.items()}
    assert per_token == {"sliding window": 0, "CSA": 21 * (1024 + 256) / 4, "HCA": 20 * 1024 / 128}
    assert flash.kv_bytes_per_token == sum(per_token.values()) == 6880
    # a request's fixed part: each layer's 128-token window, the compressors' float32 state
    window = 128 * 1024
    csa_state = 2 * 8 * 1024 * 4 + 2 * 8 * 256 * 4  # coff 2: 2 x 4 tokens of 2 x width
    hca_state = 2 * 128 * 512 * 4
    fixed = 43 * window + 21 * csa_state + 20 * hca_state
    assert flash.kv_state_per_request == fixed
    assert flash.request_bytes(CONTEXT) == fixed + CONTEXT * 6880
    # the release's FP8 entries: 448 e4m3 + 8 scale bytes + 64 bf16; indexer 128 e4m3 + 4
    fp8 = {x.kind: x for x in flash.other_caches[plan_module._FP8_ENTRIES]}
    assert fp8["CSA"].entry == {"entry": 584, "indexer key": 132} and fp8["HCA"].ratio == 128


@pytest.mark.parametrize("model,devices", [("v4-flash", 8), ("v4-pro", 16)])
def test_capacity_is_the_budget_left_after_weights(model, devices, pro_beside_v32):
    p = pro_beside_v32 if model == "v4-pro" else _v4(model, devices)
    budget = int(141 * GIB * 0.9) - p.rank_bytes() - 2 * GIB
    assert p.kv_budget == budget > 0
    assert p.tokens_per_replica == budget // p.kv_bytes_per_block * 128 > 0
    per_request = p.kv_state_per_request + CONTEXT // 128 * p.kv_bytes_per_block
    assert p.requests_per_replica(CONTEXT) == budget // per_request > 0
    # the routed experts dominate: E / ep whole, FP4 (0.5 B + a ue8m0 byte per 32 values)
    assert p.rank_bytes("experts") > 0.9 * p.rank_bytes()
    text = format_plan(p)
    assert f"replica    {p.tokens_per_replica // 128:,} blocks" in text
    assert f"= {budget / GIB:.2f} GiB for the KV cache" in text


def test_v4_pro_at_128k_holds_about_a_tenth_of_v32s_kv(pro_beside_v32):
    """At a 128k-token context V4-Pro's cache per token is about a tenth of V3.2's (both in
    bf16, as this engine holds V3.2's; 11.7%), so the same 16 devices hold several times
    the 128k requests. Computed from both plans, and printed."""
    pro, v32 = pro_beside_v32, pro_beside_v32.compared
    assert v32.kv_parts == {"latent": 512, "roped key": 64, "indexer key": 128}
    assert v32.kv_bytes_per_token == 61 * (512 + 64 + 128) * 2
    share = pro.request_bytes(CONTEXT) / v32.request_bytes(CONTEXT)
    assert share < 0.12
    assert pro.requests_per_replica(CONTEXT) > 5 * v32.requests_per_replica(CONTEXT) > 0
    text = format_plan(pro)
    assert f"v4-pro holds {share:.1%} of {v32.opts.model.split('/')[-1]}'s KV bytes" in text
    row = next(x for x in text.splitlines() if x.startswith("  KV bytes per token of it"))
    assert row.split()[-4:] == [f"{pro.request_bytes(CONTEXT) / CONTEXT:,.0f}", "B"] + [
        f"{v32.kv_bytes_per_token:,}",
        "B",
    ]


@pytest.mark.parametrize("tp,ep", [(8, 8), (8, 1)])
def test_rank_shares_add_up_to_the_checkpoint(tp, ep, flash):
    """Each rank-0 tensor times the ranks sharing it is its checkpoint tensor; EP leaves 256
    / ep experts a layer on a rank; scaled back up, they are the model."""
    p = flash if ep == 8 else _v4("v4-flash", 8, ep=1)
    h = v4_names(v4_release_headers(V4_FLASH), 43)
    split = (".attn.wq_b.", ".attn.wo_a.", ".attn.wo_b.", ".attn.attn_sink", ".shared_experts.")
    rebuilt, experts = 0, {}
    for t in p.tensors:
        if t.name not in h:  # the norms' float32 copies
            assert t.name.endswith("norm.scale")
            continue
        full, local = math.prod(h[t.name][1]), math.prod(t.shape)
        expert = ".ffn.experts." in t.name
        ways = 1 if expert and ep > 1 else tp if expert or any(s in t.name for s in split) else 1
        if t.name in ("model.embed_tokens.weight", "head.weight"):
            ways = tp
        assert local * ways == full, (t.name, t.shape, h[t.name])
        rebuilt += full
        if expert:
            experts.setdefault(t.name.split(".")[2], set()).add(int(t.name.split(".")[5]))
    assert len(experts) == 43 and all(e == set(range(256 // ep)) for e in experts.values())
    main = {n: s for n, s in h.items() if not n.startswith("model.layers.43.")}  # not MTP
    routed = sum(
        math.prod(s) for n, (_, s) in main.items() if ".experts." in n and "scale" not in n
    )
    assert rebuilt + routed - routed * (256 // ep) // 256 == sum(
        math.prod(s) for n, (_, s) in main.items() if not n.endswith("_scale_inv")
    )


def test_weights_priced_from_the_headers(flash):
    """fp8: FP8 tensors 1 B + float32 128x128 block scales; FP4 experts 0.5 B + a byte per
    32; the rest bf16 (float32 where the model holds float32)."""
    h = v4_names(v4_release_headers(V4_FLASH), 43)
    fp4 = [n for n in h if ".ffn.experts." in n and n.endswith(".weight") and layer_index(n) < 43]
    per_rank = sum(math.prod(h[n][1]) for n in fp4) // 8  # ep 8: 32 of 256 experts a layer
    assert all(h[n][0] == "F4" for n in fp4)
    assert (
        abs(
            sum(t.nbytes for t in flash.tensors if ".ffn.experts." in t.name)
            - per_rank * (0.5 + 1 / 32)
        )
        < 1
    )
    wq_a = next(t for t in flash.tensors if t.name == "model.layers.0.attn.wq_a.weight")
    assert wq_a.shape == (1024, 4096) and wq_a.nbytes == 1024 * 4096 + 8 * 32 * 4
    sink = next(t for t in flash.tensors if t.name == "model.layers.0.attn.attn_sink")
    assert sink.shape == (8,) and sink.nbytes == 8 * 4  # 64 heads / tp 8, float32


def test_mtp_layer_and_dp_attention():
    """k = 1 loads the MTP block (a sliding-window layer: no bytes a token, a window a
    request); DP attention holds attention whole and stores a token on one rank."""
    k1 = _v4("v4-flash", 8, num_speculative_tokens=1)
    assert k1.cache_layers == 44 and k1.rank_bytes("MTP") > 0
    assert k1.kv_bytes_per_token == _v4("v4-flash", 8).kv_bytes_per_token
    dp = _v4("v4-flash", 8, tp=0, ep=0, dp_attention=True)
    tp = dp.tp_layout
    assert (dp.opts.tp, dp.opts.ep) == (1, 8) and tp.opts.tp == 8
    assert dp.rank_bytes("experts") == tp.rank_bytes("experts")
    assert dp.rank_bytes("embedding/head") == 2 * 2 * 129280 * 4096
    assert dp.kv_bytes_per_token_per_rank == tp.kv_bytes_per_token_per_rank / 8
    assert dp.cluster_tokens > tp.cluster_tokens


TINY = V4_FLASH | {
    "num_hidden_layers": 4, "compress_ratios": [0, 4, 128, 4, 0], "num_hash_layers": 1,
    "hidden_size": 1024, "num_attention_heads": 8, "q_lora_rank": 256, "o_groups": 4,
    "o_lora_rank": 128, "n_routed_experts": 8, "moe_intermediate_size": 256,
    "index_n_heads": 4, "vocab_size": 2048,
}  # fmt: skip


def _write_release(path, cfg: dict, monkeypatch, change=None):
    """A V4 release checkpoint's config.json and headers in 3 shard files and an index,
    through tools/make_header_checkpoint.py's writer (taught int8 and ue8m0)."""
    monkeypatch.setitem(header_tool.DTYPE_BYTES, "I8", 1)
    monkeypatch.setitem(header_tool.DTYPE_BYTES, "F8_E8M0", 1)
    tensors = [(n, d, list(s)) for n, (d, s) in v4_release_headers(cfg).items()]
    if change:
        tensors = [change(*t) for t in tensors]
    path.mkdir()
    weight_map = {}
    for k in range(3):
        name = f"model-{k + 1:05d}-of-00003.safetensors"
        header_tool.write_header_file(path / name, tensors[k::3])
        weight_map |= {t[0]: name for t in tensors[k::3]}
    (path / header_tool.INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_a_release_directory_plans_as_the_replica(tmp_path, monkeypatch):
    """The release's names (`layers.N.attn.wq_a.weight` + `.scale`, `mtp.0.*`, `embed`,
    `head`) and dtypes read from files give the plan the in-memory replica gives."""
    monkeypatch.setitem(plan_module.V4_REPLICAS, "v4-tiny", TINY)
    path = _write_release(tmp_path / "tiny", TINY, monkeypatch)
    kw = dict(tp=2, ep=2, num_speculative_tokens=1)
    from_files, in_memory = make_plan(path, 2, **kw), make_plan("v4-tiny", 2, **kw)
    assert from_files.totals == in_memory.totals
    assert set(from_files.tensors) == set(in_memory.tensors)  # (read in shard order)
    assert from_files.cache == in_memory.cache and from_files.cache_layers == 5
    assert {t.kind for t in from_files.tensors} == set(plan_module.KINDS)


def test_a_shape_the_model_does_not_hold_is_refused(tmp_path, monkeypatch):
    def change(name, dtype, shape):
        return (
            (name, dtype, [shape[0] // 2, shape[1]])
            if name == "layers.1.attn.wo_a.weight"
            else (name, dtype, shape)
        )

    path = _write_release(tmp_path / "bad", TINY, monkeypatch, change)
    with pytest.raises(ValueError, match="model.layers.1.attn.wo_a.weight"):
        make_plan(path, 1)


@pytest.mark.parametrize(
    "devices,kw,flag",
    [
        (16, dict(), "--tp=16"),  # o_groups 8 cannot be split 16 ways
        (8, dict(ep=3), "--ep=3"),
        (8, dict(weight_dtype="int4"), "--weight_dtype=int4"),
        (8, dict(compare_with="/nonexistent"), "--compare_with=/nonexistent"),
        (8, dict(context=0), "--context=0"),
    ],
)
def test_bad_flags_are_named(devices, kw, flag):
    with pytest.raises(ValueError, match=flag):
        make_plan("v4-flash", devices, **kw)


def test_cli(capsys):
    """`--help` names the replicas and the new flags; the plan through main() prints the
    per-kind bytes a token, the capacity and the total parameters."""
    with pytest.raises(SystemExit):
        main(["--help"])
    helped = capsys.readouterr().out
    for word in ("v4-flash", "v4-pro", "--compare_with", "--context"):
        assert word in helped
    args = ["--model", "v4-flash", "--devices", "8", "--tp", "8", "--ep", "8"]
    assert main([*args, "--device_memory_gb", "141"]) == 0
    out = capsys.readouterr().out
    for line in ("284.33 B", "CSA                  21             4       6,720",
                 "HCA                  20           128         160", "weights fp8"):  # fmt: skip
        assert line in out, line
