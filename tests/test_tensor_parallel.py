"""Tensor and expert parallelism (docs/design.md section 2) across real processes: two ranks
joined by torch.distributed (gloo) each load their shard and run the whole engine
(scheduler, paged latent cache, MTP drafts; the embedding and lm_head split along the
vocabulary); their greedy tokens and logprobs, and the hidden states and logits of every
sampled step, must match one process's.

Without processes: each rank's shard holds exactly its slice of the checkpoint (FP8
dequantised first; vocab/tp rows of the embedding and head), and impossible layouts are
refused with errors naming the numbers.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from tests.ranks import WORLD, run_ranks, use_parallel_workers
from tests.test_dsa import DSA
from tools.make_random_checkpoint import BASE_CONFIG, make_random_checkpoint
from xllm_py import LLM, SamplingParams
from xllm_py.config import ModelConfig
from xllm_py.models.deepseek_mtp import DeepseekV3MTP, check_shared_copy
from xllm_py.models.deepseek_v3 import DeepseekV3ForCausalLM
from xllm_py.models.layers.linear import Shard
from xllm_py.parallel.context import ParallelContext
from xllm_py.weights.fp8 import Fp8Config
from xllm_py.weights.loader import Checkpoint, layer_index, load_weights

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=3)
# Long prompts take the expanded attention form, decode steps the absorbed one; one token
# per step of 4 requests routes 8 or 12 assignments (both MoE execution paths run).
PROMPTS = [[5, 6, 7], list(range(10, 40)), [200, 3, 17, 90, 41, 8, 8, 9, 100, 12], [42]]
# Every step drafts: the confidence policy times the steps and switches drafting off where
# it does not pay, so two processes would take different steps (and the verification
# graphs would not run)
NO_POLICY = dict(speculative_confidence="off")


def generate(path, k: int, parallel: ParallelContext | None = None, **engine):
    """Greedy tokens and their logprobs (chosen + top 3) for PROMPTS, and every
    (hidden, logits) pair the engine sampled from."""
    if parallel is not None:
        use_parallel_workers(parallel)
    llm = LLM(
        model=str(path),
        dtype="float32",
        block_size=16,
        max_cache_size=4 << 20,  # same block count on every rank, whatever RAM is free
        num_speculative_tokens=k,
        **(NO_POLICY | engine),
    )
    model = llm.engine.core.executor.worker.model
    seen = []

    def compute_logits(hidden, _inner=model.compute_logits):
        logits = _inner(hidden)
        seen.append((hidden.clone(), logits.clone()))
        return logits

    model.compute_logits = compute_logits  # the draft calls the target's too
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    if engine.get("enable_graph"):
        runner = llm.engine.core.executor.worker.runner
        graph_steps = dict(runner.graphs.steps)
        graph_steps |= {("draft",) + key: n for key, n in runner.proposer.graphs[0].steps.items()}
        seen.append(graph_steps)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], seen


def assert_same_logprobs(got, want, where: str, tol: float = 1e-4) -> None:
    """Per generated token {id: logprob}: the same ids in the same order (chosen, then the
    top ones), the values within `tol` (the TP model's hidden states differ from one
    process's by float32 rounding of the split sums)."""
    assert len(got) == len(want), where
    for i, (g, w) in enumerate(zip(got, want)):
        assert list(g) == list(w), f"{where} token {i}: {list(g)} != {list(w)}"
        assert max(abs(g[t] - w[t]) for t in w) < tol, f"{where} token {i}: {g} vs {w}"


def _generate_all(jobs, parallel: ParallelContext):
    """One rank's work: every job on this rank's shard."""
    results = [generate(path, k, parallel) for path, k in jobs]
    # gloo cannot sum bf16: the context sums in float32 and gives bf16 back
    x = parallel.all_reduce(torch.full((3,), parallel.tp_rank + 1.5, dtype=torch.bfloat16))
    assert x.dtype == torch.bfloat16 and x.tolist() == [4.0] * 3
    # the logits gather: rank order along the last dim, bit for bit, in any dtype
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(parallel.tp_rank))
    for dtype in (torch.float32, torch.bfloat16):
        g = parallel.all_gather(x.to(dtype))
        parts = [torch.randn(2, 3, generator=torch.Generator().manual_seed(r)) for r in (0, 1)]
        assert g.dtype == dtype and torch.equal(g, torch.cat(parts, -1).to(dtype))
    return results


@pytest.fixture(scope="module")
def mtp_ckpt(tmp_path_factory):
    """q-LoRA, grouped routing, one dense layer, one MTP layer."""
    return make_random_checkpoint(tmp_path_factory.mktemp("tp_mtp"), seed=3)


@pytest.fixture(scope="module")
def jobs(mtp_ckpt, tiny_model_dir, tmp_path_factory):
    # tiny_model_dir: written by HF transformers, no q-LoRA (q_proj split), no MTP layer.
    # DeepSeek-V3.2 (tests/test_dsa.py's): the indexer replicated, its keys cached on every
    # rank beside the latent, so that all ranks pick the same tokens; MTP k = 1.
    v32 = make_random_checkpoint(tmp_path_factory.mktemp("tp_v32"), overrides=DSA, seed=2)
    return [(mtp_ckpt, 0), (mtp_ckpt, 1), (tiny_model_dir, 0), (v32, 1)]


@pytest.fixture(scope="module")
def single(jobs):
    return [generate(path, k) for path, k in jobs]


@pytest.mark.parametrize("ep_size", [1, 2], ids=["tp2", "tp2_ep2"])
def test_two_ranks_generate_like_one_process(jobs, single, ep_size, tmp_path):
    ranks = run_ranks(ep_size, functools.partial(_generate_all, jobs), tmp_path)
    for (path, k), (outs, seen), *per_rank in zip(jobs, single, *ranks):
        assert all(len(t) == GREEDY.max_tokens == len(lp) for t, lp in outs) and seen
        for r, (r_outs, r_seen) in enumerate(per_rank):
            where = f"{Path(path).name} k={k} rank {r}"
            assert [t for t, _ in r_outs] == [t for t, _ in outs], where
            for (_, r_lp), (_, lp) in zip(r_outs, outs):
                assert_same_logprobs(r_lp, lp, where)
            assert len(r_seen) == len(seen), where
            for (h, logits), (rh, r_logits) in zip(seen, r_seen):
                assert r_logits.shape == logits.shape and r_logits.dtype == torch.float32, where
                assert (rh - h).abs().max() < 1e-4, where
                assert (r_logits - logits).abs().max() < 1e-4, where
                assert torch.equal(r_logits.argmax(-1), logits.argmax(-1)), where
        # the vocab slices gathered over identical all-reduce results: the ranks agree exactly
        assert per_rank[0][0] == per_rank[1][0]
        for (_, a), (_, b) in zip(per_rank[0][1], per_rank[1][1]):
            assert torch.equal(a, b)


def _generate_in_graph_mode(path, parallel: ParallelContext):
    return generate(path, 1, parallel, enable_graph=True, graph_batch_sizes=[4])


# Slow (about 2.5 minutes of compiling on 2 cores): `make test-slow`. `make test` keeps graph
# mode on a tensor-parallel replica through tests/test_cluster.py's two-node graph test.
@pytest.mark.slow
def test_two_ranks_in_graph_mode_generate_like_one_eager_process(mtp_ckpt, tmp_path):
    """Graph mode (worker/graph_runner.py) on both ranks, all-reduces inside the graphs
    (the vocab-parallel embedding's among them; the logits gather runs outside): the
    tokens, logprobs, hidden states and logits of one eager process, MTP k = 1. (Expert
    parallel in graph mode: tests/test_cluster.py's two-node graph test.)"""
    ranks = run_ranks(1, functools.partial(_generate_in_graph_mode, mtp_ckpt), tmp_path)
    outs, seen = generate(mtp_ckpt, 1)
    for r, (r_outs, r_seen) in enumerate(ranks):
        graph_steps = r_seen.pop()
        # decode steps (all 4 requests with a draft, or one request left) ran in the graphs
        assert graph_steps[(4, 2)] >= 4 and graph_steps[("draft", 4, 2)] >= 4, graph_steps
        assert [t for t, _ in r_outs] == [t for t, _ in outs], f"rank {r}"
        for (_, r_lp), (_, lp) in zip(r_outs, outs):
            assert_same_logprobs(r_lp, lp, f"rank {r}")
        assert len(r_seen) == len(seen), f"rank {r}"
        for (h, logits), (rh, r_logits) in zip(seen, r_seen):
            assert (rh - h).abs().max() < 1e-4, f"rank {r}"
            assert (r_logits - logits).abs().max() < 1e-4, f"rank {r}"


def _hot_vocab_run(path, token_map, parallel: ParallelContext | None = None):
    """Greedy tokens with a hot-vocabulary draft head (k = 2, 100 of 320 tokens) and the
    head's table."""
    if parallel is not None:
        use_parallel_workers(parallel)
    llm = LLM(
        model=str(path),
        dtype="float32",
        block_size=16,
        max_cache_size=4 << 20,
        num_speculative_tokens=2,
        speculative_draft_vocab_size=100,
        **NO_POLICY,
        speculative_token_map=str(token_map),
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    hot = llm.engine.core.executor.worker.runner.proposer.hot
    return [o.outputs[0].token_ids for o in outs], hot.weight.clone(), hot.token_ids.clone()


def test_two_ranks_build_the_whole_hot_vocabulary_head(mtp_ckpt, single, jobs, tmp_path):
    """The hot tokens' head rows come from both ranks' vocabulary halves: after the one
    all-reduce each rank holds exactly one process's table, and the output is plain
    decoding's (and one process's)."""
    from xllm_py.speculative.hot_vocab import save_token_map

    token_map = tmp_path / "map.safetensors"
    order = torch.randperm(320, generator=torch.Generator().manual_seed(0))
    save_token_map(token_map, order, torch.arange(320, 0, -1))
    one = _hot_vocab_run(mtp_ckpt, token_map)
    assert one[0] == [t for t, _ in single[jobs.index((mtp_ckpt, 0))][0]]  # lossless
    assert (one[2] < 160).any() and (one[2] >= 160).any()  # hot rows on both ranks
    work = functools.partial(_hot_vocab_run, mtp_ckpt, token_map)
    for tokens, weight, ids in run_ranks(1, work, tmp_path):
        assert tokens == one[0] and torch.equal(ids, one[2]) and torch.equal(weight, one[1])


def _auto_hot_vocab_on_rank(path, maps, parallel: ParallelContext):
    """The error building an engine with "auto" hot vocabulary on this rank gives (None:
    none); each rank reads its own token map, `maps[rank]`."""
    use_parallel_workers(parallel)
    try:
        LLM(
            model=str(path),
            dtype="float32",
            block_size=16,
            max_cache_size=4 << 20,
            num_speculative_tokens=1,
            speculative_token_map=str(maps[parallel.tp_rank]),
        )
    except ValueError as e:
        return str(e)
    return None


def test_ranks_that_find_different_token_maps_refuse_auto_together(mtp_ckpt, tmp_path):
    """--speculative_draft_vocab_size auto sizes the head from each node's own token map:
    a rank with the map (128 hot tokens) and one without (the whole vocabulary) must not
    build the head on one side only (its all-reduce would meet another collective). Both
    ranks raise, naming what each found; with the same map on both they agree."""
    from xllm_py.speculative.hot_vocab import save_token_map

    token_map = tmp_path / "map.safetensors"
    counts = torch.cat([torch.full((70,), 100), torch.ones(20), torch.zeros(230)])
    save_token_map(token_map, torch.arange(320), counts)
    missing = tmp_path / "none.safetensors"
    (tmp_path / "differ").mkdir()
    (tmp_path / "same").mkdir()
    work = functools.partial(_auto_hot_vocab_on_rank, mtp_ckpt, [token_map, missing])
    errors = run_ranks(1, work, tmp_path / "differ")
    assert "this rank: 128 hot tokens" in errors[0] and "this rank: 0 hot tokens" in errors[1]
    assert all("different token maps" in e for e in errors)
    work = functools.partial(_auto_hot_vocab_on_rank, mtp_ckpt, [token_map, token_map])
    assert run_ranks(1, work, tmp_path / "same") == [None, None]


# ---- shards without processes (group None: shapes and loading only) ----


def _load(path, parallel: ParallelContext):
    cfg = ModelConfig.from_pretrained(path)
    ckpt = Checkpoint(path, Fp8Config.from_quantization_config(cfg.quantization_config))
    target = DeepseekV3ForCausalLM(cfg, parallel)
    n = cfg.num_hidden_layers
    load_weights(target, ckpt, lambda name: None if (layer_index(name) or 0) >= n else name)
    draft = DeepseekV3MTP(cfg, target, 1)
    mtp = f"model.layers.{n}."

    def draft_name(name):
        rest = name[len(mtp) :]
        if not name.startswith(mtp) or rest.startswith(("embed_tokens.", "shared_head.head.")):
            return None
        return f"layers.0.{rest}"

    load_weights(draft, ckpt, draft_name)
    return target, draft


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    return make_random_checkpoint(tmp_path_factory.mktemp("tp_fp8"), fp8_block=(32, 32), seed=4)


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("ep_size", [1, 2])
def test_each_rank_loads_its_slice_of_the_dequantised_checkpoint(fp8_ckpt, rank, ep_size):
    whole = [dict(m.state_dict(keep_vars=True)) for m in _load(fp8_ckpt, ParallelContext())]
    parts = _load(fp8_ckpt, ParallelContext(rank, WORLD, ep_size))
    n_sharded = 0
    for full_state, model in zip(whole, parts):
        for name, t in model.state_dict(keep_vars=True).items():
            shard = getattr(t, "shard", None)
            expected = full_state[name] if shard is None else shard.take(full_state[name])
            n_sharded += shard is not None
            assert torch.equal(t, expected), name
    assert n_sharded > 0
    layer = parts[0].model.layers[1]  # a MoE layer
    experts = sorted(int(e) for e in layer.mlp.experts)
    if ep_size == 1:  # every expert, each split on its intermediate dim
        assert experts == list(range(8))
        assert layer.mlp.experts["0"].down_proj.weight.shape == (80, 24)
    else:  # half of the experts, whole
        assert experts == list(range(4 * rank, 4 * rank + 4))
        assert layer.mlp.experts[str(4 * rank)].down_proj.weight.shape == (80, 48)
    # vocab 320: rows [160r, 160(r+1)) of the embedding and the head (the draft uses both)
    target = parts[0]
    for w in (target.model.embed_tokens.weight, target.lm_head.weight):
        assert w.shape == (160, 80) and w.shard == Shard(0, rank, WORLD)
    assert target.model.embed_tokens.vocab_start == 160 * rank and parts[1].target is target
    attn = layer.self_attn
    assert attn.num_heads == 2 and attn.q_b_proj.weight.shape == (2 * 32, 40)
    assert attn.kv_b_proj.weight.shape == (2 * (16 + 24), 48)
    assert attn.o_proj.weight.shape == (80, 2 * 24)


def _config(**overrides) -> ModelConfig:
    return ModelConfig.from_dict(dict(BASE_CONFIG, **overrides), "<test>")


@pytest.mark.parametrize(
    "overrides, parallel, message",
    [
        # vocab_size=321: divisible by 3, so the layers' checks are reached
        (dict(vocab_size=321), dict(tp_size=3), "num_attention_heads=4 is not divisible"),
        (
            dict(num_attention_heads=6, vocab_size=321),
            dict(tp_size=3, ep_size=3),
            "n_routed_experts=8 is not divisible by ep_size=3",
        ),
        (dict(intermediate_size=150), dict(tp_size=4), "intermediate_size=150 is not divisible"),
        (
            dict(moe_intermediate_size=50),
            dict(tp_size=4),
            "moe_intermediate_size=50 is not divisible by tp_size=4",
        ),
        (dict(vocab_size=322), dict(tp_size=4), "vocab_size=322 is not divisible by tp_size=4"),
    ],
)
def test_layouts_that_do_not_divide_are_refused(overrides, parallel, message):
    with torch.device("meta"), pytest.raises(ValueError, match=message):
        DeepseekV3ForCausalLM(_config(**overrides), ParallelContext(**parallel))


def test_tied_head_is_the_vocab_split_embedding():
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(_config(tie_word_embeddings=True), ParallelContext(1, 4))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.shape == (80, 80)
    assert model.lm_head.weight.shard == Shard(0, 1, 4)


def test_draft_copy_of_a_vocab_split_tensor_is_checked_on_this_ranks_rows():
    full = torch.randn(8, 3)
    held = torch.nn.Parameter(full[4:].clone(), requires_grad=False)
    held.shard = Shard(0, 1, 2)
    check_shared_copy("copy", full.clone(), held)
    other_rows = full.clone()
    other_rows[0] += 1  # rank 0's row: rank 0 checks it
    check_shared_copy("copy", other_rows, held)
    own_rows = full.clone()
    own_rows[5] += 1
    with pytest.raises(ValueError, match="'copy' should be a copy of the target's tensor"):
        check_shared_copy("copy", own_rows, held)
    with pytest.raises(ValueError, match=r"shape \(4, 3\) but the target's copy has \(8, 3\)"):
        check_shared_copy("copy", full[4:], held)


def test_expert_parallel_size_must_equal_tensor_parallel_size():
    with pytest.raises(ValueError, match="ep_size=2: must be 1 or equal to tp_size=4"):
        ParallelContext(tp_rank=0, tp_size=4, ep_size=2)
    with pytest.raises(ValueError, match=r"tp_rank=2 is outside \[0, tp_size=2\)"):
        ParallelContext(tp_rank=2, tp_size=2)


def test_single_process_collectives_are_no_ops_and_need_no_group():
    x = torch.ones(3)
    assert ParallelContext().all_reduce(x) is x
    assert ParallelContext().all_gather(x) is x
    with pytest.raises(RuntimeError, match="without a process group cannot all-reduce"):
        ParallelContext(0, 2).all_reduce(x)
    with pytest.raises(RuntimeError, match="without a process group cannot all-gather"):
        ParallelContext(0, 2).all_gather(x)
