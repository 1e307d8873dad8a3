"""DeepSeek-V4 under tensor and expert parallelism, two real ranks joined by gloo (the
harness of tests/test_tensor_parallel.py): each loads its shard of a tiny V4 in the
release's quantised layout (tools/quantize_fp4.py --fp8-dense: FP4 routed experts, block-FP8
attention and shared experts) with a random MTP layer, and runs the whole engine; greedy
tokens and logprobs with MTP drafts (k = 1) must be one process's.

- tp 2: query heads, sinks and output groups split, the shared KV head, compressors and
  indexer whole; every expert split on its intermediate columns (FP4 dequantised at load,
  then sliced; the FP8 slices dequantised with the blocks they touch); the embedding and
  head split along the vocabulary;
- tp 2, ep 2: the routed experts whole on their rank, kept packed (--weight_dtype fp4),
  the other rank's never read.

A two-node cluster (`xllm --nnodes=2 --ep_size=2`: the master and a gRPC worker, as a
user starts them) serves the float checkpoint's completions, MTP on, with one process's
greedy text. Without processes: a layout that does not divide is refused naming the
numbers."""

from __future__ import annotations

import functools
import shutil

import pytest

from tests.ranks import run_ranks, use_parallel_workers
from tests.server_utils import HTTP
from tests.test_deepseek_v4_mtp import with_mtp
from tools.quantize_fp4 import quantize_checkpoint
from xllm_py import LLM, SamplingParams
from xllm_py.assets import BUNDLED_MODEL_DIR
from xllm_py.models.deepseek_v4 import DeepseekV4ForCausalLM, V4Config
from xllm_py.parallel.context import ParallelContext

NAME = "hc2-sliding-csa-hca"  # 4 heads in 2 output groups, 4 experts, vocabulary 96
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
PROMPTS = [[(7 * i + 3 * j) % 90 + 3 for j in range(n)] for i, n in enumerate((5, 29, 17, 40))]


def generate(path, parallel: ParallelContext | None = None, **engine):
    if parallel is not None:
        use_parallel_workers(parallel)
    llm = LLM(model=str(path), dtype="float32", block_size=4, max_cache_size=4 << 20,
              num_speculative_tokens=1, speculative_confidence="off", **engine)  # fmt: skip
    outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]
    m = llm.get_metrics()
    layer = llm.engine.core.executor.worker.model.model.layers[1]  # CSA, score-routed
    experts = sorted(int(e) for e in layer.ffn.experts)
    held = (layer.attn.heads, experts, type(layer.ffn.experts[str(experts[0])].w1).__name__)
    outs = [(list(o.token_ids), o.logprobs) for o in outs]
    return outs, (m.draft_tokens, m.accepted_tokens), held


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    root = tmp_path_factory.mktemp("v4tp")
    return quantize_checkpoint(with_mtp(NAME, root / "float"), root / "release", dense=True)


@pytest.mark.parametrize(
    "ep_size, engine", [(1, {}), (2, {"weight_dtype": "fp4"})], ids=["tp2", "tp2_ep2_fp4"]
)
def test_two_ranks_generate_like_one_process(release, ep_size, engine, tmp_path):
    outs, drafts, held = generate(release, **engine)
    assert drafts[0] > 0
    packed = "Fp4Linear" if engine else "Linear"
    assert held == (4, [0, 1, 2, 3], packed)
    ranks = run_ranks(ep_size, functools.partial(generate, release, **engine), tmp_path)
    for r, (r_outs, r_drafts, r_held) in enumerate(ranks):
        experts = [0, 1, 2, 3] if ep_size == 1 else [2 * r, 2 * r + 1]
        assert r_held == (2, experts, packed), f"rank {r}"  # its shard
        assert r_drafts == drafts, f"rank {r}"
        for (tokens, logprobs), (r_tokens, r_logprobs) in zip(outs, r_outs):
            assert r_tokens == tokens, f"rank {r}"
            for want, got in zip(logprobs, r_logprobs):
                assert list(got) == list(want), f"rank {r}"
                assert max(abs(got[t] - want[t]) for t in want) < 1e-4, f"rank {r}"


def test_a_two_node_cluster_serves_like_one_process(release):
    from tests.test_cluster import LAYOUTS, Cluster

    model = release.parent / "float"  # with_mtp's checkpoint, given the bundled tokenizer
    for f in BUNDLED_MODEL_DIR.iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy(f, model / f.name)
    llm = LLM(model=str(model), dtype="float32", num_speculative_tokens=1)
    greedy = SamplingParams(max_tokens=8, temperature=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy)
    want = [o.outputs[0].text for o in outs]
    flags = ("--model", str(model), "--dtype=float32", "--num_speculative_tokens=1")
    with Cluster(*flags, layout=LAYOUTS["ep"]) as c:
        c.wait_healthy()
        for p, text in zip(PROMPTS, want):
            body = {"prompt": p, "max_tokens": 8, "temperature": 0}
            r = HTTP.post(c.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == text


def test_a_layout_that_does_not_divide_is_refused():
    import transformers

    from tests.test_deepseek_v4 import CONFIGS

    cfg = V4Config.from_dict(transformers.DeepseekV4Config(**CONFIGS[NAME]).to_dict())
    three = ParallelContext(tp_rank=0, tp_size=3, ep_size=1)
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by tp_size=3"):
        DeepseekV4ForCausalLM(cfg, three)
