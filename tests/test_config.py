"""Config parsing: a real DeepSeek-V3 config.json parses with the right derived values,
old and new rope writers agree, optional fields may be null, and every bad input is
rejected with an error that names the offending field."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os

import pytest
import torch

from tools.make_header_checkpoint import DEEPSEEK_V3_CONFIG
from xllm_py.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    RopeConfig,
    SchedulerConfig,
)
from xllm_py.models.layers.rope import inverse_frequencies

torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)

# The released DeepSeek-V3 config.json, with the HF bookkeeping fields users will pass too.
DEEPSEEK_V3 = DEEPSEEK_V3_CONFIG | {
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
    "transformers_version": "4.33.1",
}


def v3(**changes) -> dict:
    cfg = copy.deepcopy(DEEPSEEK_V3)
    cfg.update(changes)
    return cfg


def m(factor: float, x: float) -> float:
    """docs/design.md section 3: m(x) = 0.1 * x * ln(factor) + 1."""
    return 0.1 * x * math.log(factor) + 1


# ---- the real checkpoint ----------------------------------------------------------------------


def test_deepseek_v3_config_parses_with_derived_values():
    cfg = ModelConfig.from_dict(v3(), "/ckpt")
    assert cfg.path == "/ckpt"
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (129280, 7168, 61)
    assert cfg.num_attention_heads == 128 and cfg.q_lora_rank == 1536
    assert cfg.kv_cache_dim == 576  # 512 latent + 64 roped key per token per layer
    assert cfg.qk_head_dim == 192
    assert cfg.softmax_scale == pytest.approx(192**-0.5 * (0.1 * math.log(40) + 1) ** 2, rel=1e-12)
    assert cfg.rope.type == "yarn" and cfg.rope.factor == 40.0 and cfg.rope.theta == 10000.0
    assert cfg.rope.original_max_position == 4096
    assert (cfg.rope.beta_fast, cfg.rope.beta_slow) == (32.0, 1.0)
    assert cfg.rope.cos_sin_scale == 1.0  # m(1.0) / m(1.0)
    assert cfg.num_moe_layers == 58
    assert cfg.is_moe_layer(2) is False and cfg.is_moe_layer(3) is True
    assert cfg.is_moe_layer(60) is True
    assert cfg.num_nextn_predict_layers == 1
    assert (cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok) == (8, 4, 8)
    assert cfg.routed_scaling_factor == 2.5
    assert cfg.eos_token_ids == (1,) and cfg.bos_token_id == 0
    assert cfg.checkpoint_dtype == "bfloat16"
    assert cfg.quantization_config["weight_block_size"] == [128, 128]
    assert cfg.max_position_embeddings == 163840


def test_from_pretrained_reads_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(v3()))
    cfg = ModelConfig.from_pretrained(tmp_path)
    assert cfg == ModelConfig.from_dict(v3(), str(tmp_path))
    assert cfg.path == str(tmp_path)


def test_directory_without_config_json_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        ModelConfig.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="config.json"):
        ModelConfig.from_pretrained(tmp_path / "does_not_exist")


def test_model_config_is_frozen():
    cfg = ModelConfig.from_dict(v3())
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.vocab_size = 1


# ---- rope writers -----------------------------------------------------------------------------


def _new_style(cfg: dict) -> dict:
    """What newer writers (transformers >= 5) emit: `rope_parameters`, theta inside."""
    cfg = copy.deepcopy(cfg)
    params = cfg.pop("rope_scaling")
    params["rope_type"] = params.pop("type")
    params["rope_theta"] = cfg.pop("rope_theta")
    cfg["rope_parameters"] = params
    return cfg


def test_rope_scaling_and_rope_parameters_give_identical_rope():
    old = ModelConfig.from_dict(v3())
    new = ModelConfig.from_dict(_new_style(v3()))
    assert new.rope == old.rope
    assert new.softmax_scale == old.softmax_scale
    assert new.rope.cos_sin_scale == old.rope.cos_sin_scale


def test_rope_theta_inside_rope_parameters_is_used():
    cfg = _new_style(v3())
    cfg["rope_parameters"]["rope_theta"] = 50000.0
    assert ModelConfig.from_dict(cfg).rope.theta == 50000.0


def test_config_written_by_transformers_parses_like_the_original():
    transformers = pytest.importorskip("transformers")
    hf = transformers.DeepseekV3Config(
        **{k: v for k, v in v3().items() if k not in ("auto_map", "architectures")}
    ).to_dict()
    hf["architectures"] = ["DeepseekV3ForCausalLM"]
    assert ModelConfig.from_dict(hf).rope == ModelConfig.from_dict(v3()).rope


def test_no_rope_scaling_means_plain_rope():
    cfg = v3()
    del cfg["rope_scaling"]
    parsed = ModelConfig.from_dict(cfg)
    assert parsed.rope == RopeConfig(theta=10000.0)
    assert parsed.rope.cos_sin_scale == 1.0
    assert parsed.softmax_scale == pytest.approx(192**-0.5)


def test_cos_sin_scale_is_ratio_of_mscales():
    cfg = v3()
    cfg["rope_scaling"].update(mscale=0.707, mscale_all_dim=1.0)
    rope = ModelConfig.from_dict(cfg).rope
    assert rope.cos_sin_scale == pytest.approx(m(40, 0.707) / m(40, 1.0))
    assert rope.softmax_mscale == pytest.approx(m(40, 1.0) ** 2)


def test_unsupported_rope_type_is_rejected():
    cfg = v3()
    cfg["rope_scaling"]["type"] = "linear"
    with pytest.raises(ValueError, match="rope"):
        ModelConfig.from_dict(cfg)


# ---- optional fields and spellings ------------------------------------------------------------


def test_q_lora_rank_null_is_accepted():
    cfg = ModelConfig.from_dict(v3(q_lora_rank=None))  # DeepSeek-V2-Lite style: plain q_proj
    assert cfg.q_lora_rank is None
    assert cfg.qk_head_dim == 192


def test_single_group_routing_is_accepted():
    cfg = ModelConfig.from_dict(v3(n_group=1, topk_group=1))
    assert (cfg.n_group, cfg.topk_group) == (1, 1)


def test_first_k_dense_replace_zero_makes_every_layer_moe():
    cfg = ModelConfig.from_dict(v3(first_k_dense_replace=0))
    assert cfg.num_moe_layers == 61
    assert cfg.is_moe_layer(0)


def test_dtype_spelling_accepted_instead_of_torch_dtype():
    cfg = v3(dtype="float32")
    del cfg["torch_dtype"]
    assert ModelConfig.from_dict(cfg).checkpoint_dtype == "float32"


def test_eos_token_id_list_becomes_tuple():
    assert ModelConfig.from_dict(v3(eos_token_id=[1, 7])).eos_token_ids == (1, 7)


def test_deepseek_v2_architecture_is_accepted():
    assert ModelConfig.from_dict(v3(architectures=["DeepseekV2ForCausalLM"])).vocab_size == 129280


# ---- bad model configs ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field_name",
    [
        "kv_lora_rank",
        "vocab_size",
        "qk_rope_head_dim",
        "num_hidden_layers",
        "max_position_embeddings",
    ],
)
def test_missing_required_field_is_named(field_name):
    cfg = v3()
    del cfg[field_name]
    with pytest.raises(ValueError, match=field_name):
        ModelConfig.from_dict(cfg)


def test_missing_moe_field_is_named_when_there_are_moe_layers():
    cfg = v3()
    del cfg["moe_intermediate_size"]
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        ModelConfig.from_dict(cfg)


@pytest.mark.parametrize("archs", [["LlamaForCausalLM"], [], None])
def test_unsupported_architectures_are_rejected(archs):
    with pytest.raises(ValueError, match="architectures"):
        ModelConfig.from_dict(v3(architectures=archs))


def test_experts_not_divisible_by_groups_names_both():
    with pytest.raises(ValueError, match="n_routed_experts") as err:
        ModelConfig.from_dict(v3(n_routed_experts=250))
    assert "n_group" in str(err.value)


def test_topk_group_above_n_group_is_rejected():
    with pytest.raises(ValueError, match="topk_group"):
        ModelConfig.from_dict(v3(topk_group=9))


def test_more_experts_per_token_than_experts_is_rejected():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_dict(v3(num_experts_per_tok=257))


def test_unsupported_routing_is_rejected_naming_the_value():
    with pytest.raises(ValueError, match="scoring_func='sqrtsoftplus'"):
        ModelConfig.from_dict(v3(scoring_func="sqrtsoftplus"))
    with pytest.raises(ValueError, match="topk_method='random'"):
        ModelConfig.from_dict(v3(topk_method="random"))


def test_a_v2_config_routes_by_softmax_and_plain_top_k_unless_it_says_otherwise():
    v2 = v3(architectures=["DeepseekV2ForCausalLM"])
    del v2["scoring_func"], v2["topk_method"]
    cfg = ModelConfig.from_dict(v2)
    assert (cfg.scoring_func, cfg.topk_method) == ("softmax", "greedy")
    cfg = ModelConfig.from_dict(dict(v2, topk_method="group_limited_greedy"))
    assert cfg.topk_method == "group_limited_greedy"


# ---- engine-side configs ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, field_name",
    [
        (lambda: CacheConfig(max_memory_utilization=0), "max_memory_utilization"),
        (lambda: CacheConfig(max_memory_utilization=1.5), "max_memory_utilization"),
        (lambda: CacheConfig(block_size=96), "block_size"),
        (lambda: CacheConfig(block_size=0), "block_size"),
        (lambda: CacheConfig(max_cache_size=-1), "max_cache_size"),
        (lambda: CacheConfig(num_lookahead_tokens=-1), "num_lookahead_tokens"),
        (lambda: SchedulerConfig(max_tokens_per_batch=0), "max_tokens_per_batch"),
        (lambda: SchedulerConfig(max_seqs_per_batch=0), "max_seqs_per_batch"),
        (lambda: SchedulerConfig(max_model_len=-1), "max_model_len"),
        (lambda: DeviceConfig(device="tpu"), "device"),
        (lambda: DeviceConfig(device="cuda:x"), "device"),
        (lambda: DeviceConfig(dtype="int8"), "dtype"),
    ],
)
def test_engine_configs_reject_bad_values_naming_the_field(make, field_name):
    with pytest.raises(ValueError, match=field_name):
        make()


def test_engine_config_defaults_are_valid():
    CacheConfig()
    SchedulerConfig()
    for device in ("cpu", "cuda", "cuda:1", "npu:0"):
        DeviceConfig(device=device)
    for dtype in ("float32", "bfloat16", "bf16", "float16", "auto"):
        DeviceConfig(dtype=dtype)
    assert DeviceConfig(dtype="bf16").torch_dtype() is torch.bfloat16
    assert DeviceConfig(dtype="float32").torch_dtype() is torch.float32


def test_max_model_len_cannot_exceed_the_model_context():
    model = ModelConfig.from_dict(v3())
    parts = dict(model=model, cache=CacheConfig(), device=DeviceConfig())
    assert EngineConfig(scheduler=SchedulerConfig(), **parts).max_model_len == 163840
    assert (
        EngineConfig(scheduler=SchedulerConfig(max_model_len=4096), **parts).max_model_len == 4096
    )
    with pytest.raises(ValueError, match="max_model_len"):
        EngineConfig(scheduler=SchedulerConfig(max_model_len=163841), **parts)


# ---- YaRN inverse frequencies -----------------------------------------------------------------


def _yarn_inv_freq_reference(theta, dim, factor, orig_max_pos, beta_fast, beta_slow) -> list[float]:
    """YaRN from its formulas (docs/design.md section 3, DeepSeek's modeling code), in float64.

    Pair i rotates at theta^(-2i/dim). The dimension at which a frequency makes r full
    turns over the original context is d(r) = dim * ln(L / (2 pi r)) / (2 ln theta).
    Pairs below floor(d(beta_fast)) keep the original frequency (extrapolation), pairs
    above ceil(d(beta_slow)) are divided by `factor` (interpolation), and a linear ramp
    blends the two in between."""

    def turns_dim(r):
        return dim * math.log(orig_max_pos / (2 * math.pi * r)) / (2 * math.log(theta))

    low = max(math.floor(turns_dim(beta_fast)), 0)
    high = min(math.ceil(turns_dim(beta_slow)), dim - 1)
    out = []
    for i in range(dim // 2):
        extra = theta ** (-2 * i / dim)
        inter = extra / factor
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: extrapolate, 1: interpolate
        out.append(extra * (1 - ramp) + inter * ramp)
    return out


def test_yarn_inverse_frequencies_match_the_formulas():
    rope = ModelConfig.from_dict(v3()).rope
    got = inverse_frequencies(rope, 64).double()
    want = torch.tensor(
        _yarn_inv_freq_reference(10000.0, 64, 40.0, 4096, 32.0, 1.0), dtype=torch.float64
    )
    assert got.shape == (32,)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    # For these constants the ramp runs over pairs 10..23: the fast pairs are untouched,
    # the slow pairs are exactly interpolated.
    assert got[0].item() == pytest.approx(1.0)
    assert got[9].item() == pytest.approx(10000.0 ** (-18 / 64), rel=1e-5)
    assert got[31].item() == pytest.approx(10000.0 ** (-62 / 64) / 40, rel=1e-5)


def test_plain_rope_inverse_frequencies():
    got = inverse_frequencies(RopeConfig(theta=10000.0), 64).double()
    want = torch.tensor([10000.0 ** (-2 * i / 64) for i in range(32)], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


@pytest.mark.parametrize(
    "given, meant", [("cuda", "cuda:0"), ("npu", "npu:0"), ("cuda:1", "cuda:1"), ("cpu", "cpu")]
)
def test_accelerator_without_index_means_its_first_visible_device(given, meant):
    # torch.cuda.set_device("cuda") raises; each process sees its devices from 0
    assert DeviceConfig(device=given).device == meant


def test_memory_split_follows_vllms_meaning_of_max_memory_utilization():
    from xllm_py.worker.worker import memory_split

    gib = 2**30
    # an 80 GiB device at 0.9: 72 GiB for the process, 30 GiB of it taken by the weights
    assert memory_split(80 * gib, 30 * gib, 0.9) == 42 * gib
    assert memory_split(80 * gib, 30 * gib, 0.5) == 10 * gib
    # weights that do not leave room for a cache: an error naming the flag and the figures
    with pytest.raises(ValueError, match=r"--max_memory_utilization=0.4: .*32.0 GiB.*40.0 GiB"):
        memory_split(80 * gib, 40 * gib, 0.4)


def test_cpu_kv_budget_is_a_fraction_of_the_ram_still_available():
    from xllm_py.worker.worker import available_memory, kv_cache_budget

    cpu = torch.device("cpu")
    free = available_memory(cpu)
    budget = kv_cache_budget(cpu, 0.5)
    assert abs(budget - free // 2) < free // 20  # RAM moves a little between the two reads


def test_profiling_forward_of_the_largest_step_leaves_generation_alone():
    """The start-up profiling pass (run on accelerators before sizing the cache) runs the
    largest step over throw-away caches: on CPU it completes and the engine's output after
    it is the same as before."""
    from xllm_py import LLM, SamplingParams

    llm = LLM(dtype="float32", num_speculative_tokens=1)
    params = SamplingParams(temperature=0, max_tokens=12)
    before = llm.generate(["Hello there"], params)[0].outputs[0].token_ids
    worker = llm.engine.core.executor.worker
    worker.profile_forward(3 * llm.engine.core.config.cache.block_size + 5)
    assert llm.generate(["Hello there"], params)[0].outputs[0].token_ids == before


# ---- EngineArgs: each option declared once (xllm_py/args.py) -------------------------------------


def test_engine_args_defaults_build_the_config_dataclasses_defaults():
    """The config dataclasses keep defaults of their own (for direct construction); the
    flags' defaults must build exactly those."""
    from xllm_py.args import EngineArgs
    from xllm_py.config import SpecConfig

    config = EngineArgs().engine_config()
    assert config.cache == dataclasses.replace(CacheConfig(), num_lookahead_tokens=0)
    assert config.scheduler == SchedulerConfig()
    # the daemon's one difference: graph mode where it pays (CPU, float32), compiled in the
    # background; the offline engine's options build the dataclass's own default
    graphs = dict(enable_graph=True, graph_warm_up="background")
    assert config.device == dataclasses.replace(DeviceConfig(), **graphs)
    assert EngineArgs.for_offline().engine_config().device == DeviceConfig()
    assert config.spec == SpecConfig()


def test_every_flag_has_a_concern_and_help():
    from xllm_py.args import GROUPS
    from xllm_py.cli import build_parser

    parser = build_parser()
    titles = set(GROUPS.values())
    for group in parser._action_groups:
        if group.title in titles:
            assert group._group_actions, group.title
            for action in group._group_actions:
                assert len(action.help) > 10, action.dest
    grouped = {a.dest for g in parser._action_groups if g.title in titles for a in g._group_actions}
    from xllm_py.args import EngineArgs

    assert grouped == {f.name for f in dataclasses.fields(EngineArgs)}


def test_llm_takes_the_engine_options_and_refuses_the_daemons():
    from xllm_py import LLM
    from xllm_py.args import EngineArgs

    args = EngineArgs.for_offline(device="cpu", draft_device="cpu", num_speculative_tokens=1)
    assert (args.devices, args.draft_devices) == ("cpu", "cpu")
    with pytest.raises(TypeError, match="--port is an option of the `xllm` daemon"):
        LLM(port=9000)
    with pytest.raises(TypeError, match="--api_key"):
        LLM(api_key="x")
    with pytest.raises(TypeError, match="unexpected keyword argument 'blok_size'"):
        LLM(blok_size=16)
    with pytest.raises(ValueError, match="--max_seqs_per_batch=0: must be >= 1"):
        LLM(max_seqs_per_batch=0)


def test_secrets_never_show_in_help_or_repr():
    import subprocess
    import sys

    env = {**os.environ, "XLLM_API_KEY": "sekrit", "XLLM_CLUSTER_TOKEN": "t0ken-s3"}
    r = subprocess.run(
        [sys.executable, "-m", "xllm_py", "--help"], capture_output=True, text=True, env=env
    )
    assert r.returncode == 0 and "--api_key" in r.stdout and "XLLM_API_KEY" in r.stdout
    assert "sekrit" not in r.stdout + r.stderr and "t0ken-s3" not in r.stdout + r.stderr
    from xllm_py.cli import build_parser

    args = build_parser().parse_args(["--api_key=sekrit", "--cluster_token=t0ken-s3"])
    assert "sekrit" not in repr(args) and "t0ken-s3" not in repr(args)
    assert "sekrit" not in " ".join(args.node_argv())
    assert args.secret("api_key") == "sekrit"


def test_bool_flags_take_every_spelling():
    from xllm_py.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["--enable_graph"]).enable_graph is True
    assert parse(["--enable_graph=true"]).enable_graph is True
    assert parse(["--enable_prefix_cache", "false"]).enable_prefix_cache is False
    assert parse(["--strict_request_fields=1"]).strict_request_fields is True
    with pytest.raises(SystemExit):
        parse(["--enable_prefix_cache=maybe"])
