"""The MTP ceiling of perf/step_cost.py on the bundled model: the byte model accounts for
every tensor of the checkpoint, a pass reads what it must, the ceiling obeys its definition,
and routing is measured through the Router hooks. Only what must hold whatever the weights
and timings."""

from __future__ import annotations

import json
import math

import pytest

from perf import step_cost as mc
from xllm_py.assets import bundled_model

MODEL = bundled_model()
CFG = json.loads((mc.Path(MODEL) / "config.json").read_text())
E, TOP_K = CFG["n_routed_experts"], CFG["num_experts_per_tok"]


@pytest.fixture(scope="module")
def bm() -> mc.ByteModel:
    return mc.byte_model(MODEL)


def synthetic_routing(max_window: int) -> dict:
    """A routing table any real one could be: top_k experts for one token, more for more
    tokens, never more than all of them."""
    moe = CFG["num_hidden_layers"] - CFG["first_k_dense_replace"]

    def table(layers: int) -> dict:
        return {w: [min(TOP_K + 1.3 * (w - 1), E)] * layers for w in range(1, max_window + 1)}

    return {"target": table(moe), "draft": table(CFG["num_nextn_predict_layers"])}


def test_byte_model_accounts_for_every_tensor(bm):
    """Parts sum to the checkpoint's bytes at 4 bytes a value, less the MTP layer's copies of
    the target's embedding and head (the draft shares the target's)."""
    from safetensors import safe_open

    weight_map = json.loads((mc.Path(MODEL) / "model.safetensors.index.json").read_text())
    shapes = {}
    for name, shard in weight_map["weight_map"].items():  # the checkpoint, nothing beside it
        with safe_open(str(mc.Path(MODEL) / shard), "pt") as f:
            shapes[name] = f.get_slice(name).get_shape()
    n = CFG["num_hidden_layers"]
    copies = {f"model.layers.{n}.embed_tokens.weight", f"model.layers.{n}.shared_head.head.weight"}
    assert copies <= set(shapes)
    expected = 4 * sum(math.prod(s) for name, s in shapes.items() if name not in copies)
    embedding = 4 * math.prod(shapes["model.embed_tokens.weight"])
    parts = (
        bm.target_dense
        + bm.head
        + embedding
        + E * sum(bm.expert)
        + sum(bm.draft_dense)
        + E * sum(bm.draft_expert)
    )
    assert bm.total_weights == parts == expected
    assert bm.head == 4 * CFG["vocab_size"] * CFG["hidden_size"] == bm.draft_head
    assert len(bm.expert) == n - CFG["first_k_dense_replace"]
    assert len(bm.draft_dense) == len(bm.draft_expert) == CFG["num_nextn_predict_layers"]
    assert bm.kv_token_layer == 4 * (CFG["kv_lora_rank"] + CFG["qk_rope_head_dim"])
    half = mc.byte_model(MODEL, "bfloat16", draft_vocab=1024)
    assert 2 * half.total_weights == bm.total_weights
    assert half.draft_head == 2 * 1024 * CFG["hidden_size"] < half.head


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_pass_bytes_and_ceiling(bm, k):
    routing = synthetic_routing(k + 1)
    for accept in (1.0, 1 + k / 2, 1.0 + k):
        b = mc.step_bytes(bm, routing, k, accept, context=300)
        weights_read = b["plain"] - CFG["num_hidden_layers"] * b["kv"] - bm.embed_row
        assert weights_read < bm.total_weights  # a plain step skips the unchosen experts
        assert b["plain"] < b["verify"]
        assert b["draft"] >= k * bm.head  # every draft token reads the shared head
        row = mc.ceiling_row(bm, routing, k, accept, 300)
        assert row["verify_cost"] > 1 and row["draft_cost"] > 0
        assert row["ceiling"] < accept
        assert row["ceiling"] == pytest.approx(accept / row["step_cost"])
    verify = mc.ceiling_row(bm, routing, k, 1.0 + k, 300)["verify_cost"]
    assert mc.ceiling(1.0 + k, verify, 0.0, k) == (1 + k) / verify
    assert mc.ceiling(1.0 + k, 1.0, 0.0, k) == 1 + k  # free drafts, free verification


def test_windows_interpolate_between_measured_ones(bm):
    routing = synthetic_routing(3)
    table = routing["target"]
    assert mc._distinct(table, 1, 0) == TOP_K
    assert mc._distinct(table, 1.5, 0) == pytest.approx((table[1][0] + table[2][0]) / 2)
    assert mc._distinct({str(w): v for w, v in table.items()}, 3, 0) == table[3][0]


def test_main_from_results_and_earlier_routing(tmp_path, capsys):
    """No engine: acceptance from a sweep JSON, routing from an earlier run's JSON."""
    sweep = {
        "input_len": 256,
        "output_len": 128,
        "rows": [
            {"method": "baseline", "concurrency": 1, "speedup": 1.0,
             "spec_decode_acceptance_length": None},
            {"method": "MTP k=1", "concurrency": 1, "speedup": 1.05,
             "spec_decode_acceptance_length": 1.6},
            {"method": "MTP k=2", "concurrency": 1, "speedup": 0.95,
             "spec_decode_acceptance_length": 2.0},
        ],
    }  # fmt: skip
    (tmp_path / "sweep.json").write_text(json.dumps(sweep))
    earlier = {"context": 99, "routing": json.loads(json.dumps(synthetic_routing(3)))}
    (tmp_path / "earlier.json").write_text(json.dumps(earlier))
    out = mc.main(["--k", "1", "2", "--results", str(tmp_path / "sweep.json"),
                   "--reuse", str(tmp_path / "earlier.json"),
                   "--output", str(tmp_path / "ceiling.json")])  # fmt: skip
    assert out["context"] == 256 + 64
    assert [r["k"] for r in out["rows"]] == [1, 2]
    assert [r["acceptance_length"] for r in out["rows"]] == [1.6, 2.0]
    assert [(c["k"], c["speedup"]) for c in out["compare"]] == [(1, 1.05), (2, 0.95)]
    for c in out["compare"]:
        assert c["ratio"] == pytest.approx(c["speedup"] / c["ceiling"])
    assert json.loads((tmp_path / "ceiling.json").read_text())["rows"] == out["rows"]
    printed = capsys.readouterr().out
    assert "| ceiling |" in printed and "measured/ceiling" in printed


def test_routing_measured_through_router_hooks():
    """One prompt, a few tokens: one token reads exactly top_k distinct experts in every MoE
    layer, the target's and the MTP layer's; more tokens read no fewer and at most all."""
    routing = mc.routing_stats(MODEL, prompts=1, new_tokens=6, max_window=3)
    moe = CFG["num_hidden_layers"] - CFG["first_k_dense_replace"]
    assert len(routing["target"][1]) == moe and len(routing["draft"][1]) == 1
    for part in ("target", "draft"):
        table = routing[part]
        assert table[1] == [TOP_K] * len(table[1])
        for w in (2, 3):
            for a, b in zip(table[w - 1], table[w]):
                assert a <= b <= min(w * TOP_K, E)
