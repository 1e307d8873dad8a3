"""MTP speculative decoding is lossless: greedy outputs are token-identical to
decoding without drafts, whatever the batching, and the verification/bookkeeping
path is exercised both with the real MTP draft and with an oracle draft that is
always right (acceptance 1.0, k + 1 tokens per target pass)."""

from __future__ import annotations

import json
import shutil

import pytest

from perf.oracle import OracleProposer
from tests.test_engine import WITH_LOGPROBS, cached_prefix_tokens, chosen_logprobs
from tools.make_random_checkpoint import make_random_checkpoint
from xllm_py import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_random_checkpoint(tmp_path_factory.mktemp("spec"), seed=1)


@pytest.fixture(scope="module")
def prompts():
    base = [list(range(5, 5 + n)) for n in (3, 17, 56, 9, 2, 33)]  # all prefixes of base[2]
    shared = base[2][:48]  # 3 blocks of 16
    return base + [shared + [7, 8, 9], shared + [300, 301]]


def generate(path, prompts, params=GREEDY, **kw):
    llm = LLM(model=str(path), dtype="float32", block_size=16, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    blocks = llm.engine.core.blocks
    assert blocks.num_free_blocks == blocks.num_blocks  # nothing leaked
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.fixture(scope="module")
def baseline(ckpt, prompts):
    return generate(ckpt, prompts, enable_prefix_cache=False)[0]


@pytest.fixture(scope="module")
def follow_up(ckpt, prompts, baseline):
    """A second turn: base[2], its reply and new tokens. Its tokens and their logprobs
    without the prefix cache."""
    prompt = prompts[2] + baseline[2] + [250, 251, 252, 253, 254]
    llm = LLM(model=str(ckpt), dtype="float32", block_size=16, enable_prefix_cache=False)
    out = llm.generate({"prompt_token_ids": prompt}, WITH_LOGPROBS)[0].outputs[0]
    return prompt, out.token_ids, chosen_logprobs(out)


def with_oracle(llm, prompts, baseline, k):
    runner = llm.engine.core.executor.worker.runner
    ref = {tuple(p): p + b for p, b in zip(prompts, baseline)}
    runner.proposer = OracleProposer(runner, ref, k)
    return llm


@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_drafts_are_lossless(ckpt, prompts, baseline, k):
    tokens, llm = generate(ckpt, prompts, num_speculative_tokens=k, speculative_confidence="off")
    assert tokens == baseline
    m = llm.get_metrics()
    # k drafts per pass (confidence scheduling off), fewer only where max_tokens leaves less
    # room (the last pass)
    assert m.drafts > 0 and k * m.drafts - k * len(prompts) <= m.draft_tokens <= k * m.drafts


@pytest.mark.parametrize("k", [1, 3])
def test_oracle_draft_is_always_accepted(ckpt, prompts, baseline, k):
    llm = LLM(model=str(ckpt), dtype="float32", block_size=16, num_speculative_tokens=k)
    with_oracle(llm, prompts, baseline, k)
    before = llm.get_metrics()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == baseline
    m = llm.get_metrics()
    assert before.drafts == 0 and before.accepted_tokens == 0  # a snapshot, not a live view
    assert m.acceptance_rate == pytest.approx(1.0)
    assert len(m.accepted_per_position) == k and m.accepted_per_position[0] == m.drafts
    # every pass carries k drafts except, per request, the last (capped by max_tokens)
    assert k * m.drafts - k * len(prompts) <= m.draft_tokens
    assert m.mean_acceptance_length == pytest.approx(1 + m.draft_tokens / m.drafts)
    assert m.mean_acceptance_length > k + 1 - 0.5
    # per request (RequestOutput): every draft accepted, the counts add up to the totals,
    # and each request's acceptance rate (1.0) is in the histogram's last bucket
    assert all(o.num_accepted_tokens == o.num_draft_tokens > 0 for o in outs)
    assert sum(o.num_draft_tokens for o in outs) == m.draft_tokens
    assert m.acceptance_buckets == [0] * 10 + [len(prompts)]
    assert m.acceptance_sum == len(prompts) == m.finished_requests


@pytest.mark.parametrize(
    "kw",
    [
        dict(max_seqs_per_batch=1),
        dict(enable_chunked_prefill=True, max_tokens_per_batch=16),
        dict(enable_prefix_cache=False),
        dict(enable_prefix_cache=True),
        dict(max_cache_size=14 * 4 * 16 * 64 * 4),  # 14 blocks (3 layers + MTP): preemption
    ],
    ids=["one-seq-per-step", "chunked-prefill", "prefix-cache-off", "prefix-cache", "preemption"],
)
def test_lossless_with_oracle_under_batching_variants(ckpt, prompts, baseline, follow_up, kw):
    """Two waves in one engine: base[2] alone, then the rest, which (prefix cache on, the
    default) find base[2]'s blocks in the cache, the follow-up turn its reply's blocks too."""
    k = 3
    llm = LLM(model=str(ckpt), dtype="float32", block_size=16, num_speculative_tokens=k, **kw)
    with_oracle(llm, prompts + [follow_up[0]], baseline + [follow_up[1]], k)

    def generate(ps, params=GREEDY):
        return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in ps], params)]

    # (chunked prefill: the first steps prefill part of base[2] and sample no row)
    assert generate([prompts[2]])[0].token_ids == baseline[2]
    # The prompts that hit come next: admitted before anything can evict base[2]'s blocks.
    order = [6, 7, 5, 1, 3]
    wave = [prompts[4], follow_up[0]] + [prompts[i] for i in order]
    expected = [baseline[4], follow_up[1]] + [baseline[i] for i in order]
    # all but the last token of each went through the model
    computed = [prompts[2] + baseline[2][:-1]]
    expected_hits = sum(cached_prefix_tokens(p, computed) for p in wave)
    assert expected_hits == (4 + 3 + 3 + 2 + 1) * 16  # (56 + 23) // 16 blocks, then 48, 48, 32, 16
    before = llm.get_stats()
    outs = generate(wave, [GREEDY, WITH_LOGPROBS] + [GREEDY] * len(order))
    after = llm.get_stats()
    assert [o.token_ids for o in outs] == expected
    # base[2] + reply is 80 tokens, 5 blocks, but its last token was never computed (the
    # last pass's drafts stop short of it): a cached 5th block would serve a missing entry.
    assert chosen_logprobs(outs[1]) == pytest.approx(follow_up[2], abs=1e-4)
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    if kw.get("enable_prefix_cache", True):
        assert hits >= expected_hits
    else:
        assert hits == 0
    if "max_cache_size" in kw:
        assert llm.engine.core.blocks.num_blocks == 14
        assert after.num_preemptions > before.num_preemptions
    m = llm.get_metrics()
    assert m.drafts > 0 and m.acceptance_rate == pytest.approx(1.0)
    assert llm.engine.core.blocks.num_free_blocks == llm.engine.core.blocks.num_blocks


@pytest.mark.parametrize("max_tokens", [2, 5, 11])
def test_max_tokens_inside_an_accepted_run(ckpt, prompts, baseline, max_tokens):
    llm = LLM(model=str(ckpt), dtype="float32", block_size=16, num_speculative_tokens=3)
    with_oracle(llm, prompts, baseline, 3)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for o, b in zip(outs, baseline):
        assert o.outputs[0].token_ids == b[:max_tokens]
        assert o.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("k", [2, 3])
def test_drafts_stop_at_the_context_end(ckpt, k):
    """Requests that run into the model's context (512 positions, the end of its RoPE
    table), with the real MTP drafter: chained drafts that would sit past it are cut,
    first for some requests of the batch, then for all; tokens equal plain decoding's,
    each request fills its context exactly."""
    max_len = 512
    prompts = [[5 + i % 200 for i in range(n)] for n in (498, 506, 509, 510)]
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    plain, _ = generate(ckpt, prompts, params)
    spec, llm = generate(ckpt, prompts, params, num_speculative_tokens=k)
    assert spec == plain
    assert [len(p) + len(t) for p, t in zip(prompts, spec)] == [max_len] * len(prompts)
    assert llm.get_metrics().drafts > 0


def test_speculative_decoding_runs_in_bfloat16():
    """The bundled model in bfloat16 with k = 2: the draft's attention masks and caches
    take the run dtype, and the real MTP draft is mostly accepted, as in float32."""
    llm = LLM(dtype="bfloat16", block_size=16, num_speculative_tokens=2)
    outs = llm.generate(["Tell me about the history of Rome."] * 2, GREEDY)
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outs)
    assert llm.get_metrics().acceptance_rate > 0.3


def test_acceptance_counters_per_position():
    """What /metrics reports per draft position: passes with fewer drafts count too, and
    a longer pass later extends the positions without losing the earlier counts."""
    from xllm_py.speculative.metrics import SpecDecodeStats

    s = SpecDecodeStats()
    s.record([7], 1)
    s.record([], 0)  # a pass without drafts is not a draft pass
    s.record([4, 5, 6], 2)
    s.record([4, 5, 6], 0)
    assert (s.drafts, s.draft_tokens, s.accepted_tokens) == (3, 7, 3)
    assert s.accepted_per_position == [2, 1, 0]
    assert s.acceptance_rate == pytest.approx(3 / 7)
    assert s.mean_acceptance_length == pytest.approx(1 + 3 / 3)
    # finished requests' acceptance rates: each in the first bucket (0.0, 0.1, ..., 1.0)
    # that holds it, exactly on a bound included; none without drafts
    for drafts, accepted in [(5, 0), (10, 1), (3, 1), (7, 7), (0, 0), (30, 3)]:
        s.record_request(drafts, accepted)
    assert s.acceptance_buckets == [1, 2, 0, 0, 1, 0, 0, 0, 0, 0, 1]
    assert s.acceptance_sum == pytest.approx(0 + 0.1 + 1 / 3 + 1 + 0.1)
    assert s.finished_requests == 5


def with_eos(ckpt, eos: int, work):
    """A copy of the checkpoint at `work` whose EOS token is `eos`."""
    shutil.copytree(ckpt, work)
    cfg = json.loads((work / "config.json").read_text())
    cfg["eos_token_id"] = eos
    (work / "config.json").write_text(json.dumps(cfg))
    return work


def test_eos_inside_an_accepted_run(ckpt, prompts, baseline, tmp_path):
    eos = baseline[0][5]  # the 6th greedy token of the first prompt becomes EOS
    work = with_eos(ckpt, eos, tmp_path / "eos")
    params = SamplingParams(max_tokens=24, temperature=0.0)
    plain, _ = generate(work, prompts, params)
    llm = LLM(model=str(work), dtype="float32", block_size=16, num_speculative_tokens=3)
    with_oracle(llm, prompts, baseline, 3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert plain[0] == baseline[0][: baseline[0].index(eos) + 1]


def test_min_tokens_holds_under_speculation(ckpt, prompts, baseline, tmp_path):
    """EOS (the 6th greedy token of the first prompt) is banned until 10 tokens exist, in
    verification as in plain decoding: greedy rows give plain decoding's tokens; sampled
    rows (whose draws differ from plain decoding's, not their distribution) never end
    before 10 tokens."""
    eos = baseline[0][5]
    work = with_eos(ckpt, eos, tmp_path / "eos")
    greedy = SamplingParams(max_tokens=24, min_tokens=10, temperature=0.0)
    seeded = SamplingParams(max_tokens=24, min_tokens=10, temperature=0.7, seed=3)
    params = [greedy if i % 2 == 0 else seeded for i in range(len(prompts))]
    plain, _ = generate(work, prompts, params)
    spec, llm = generate(work, prompts, params, num_speculative_tokens=3)
    assert spec[::2] == plain[::2]
    assert eos not in plain[0][:10] and len(plain[0]) > 6
    assert all(len(t) >= 10 and eos not in t[:10] for t in spec)
    # an all-greedy batch verifies by argmax alone (no probabilities): the ban holds there too
    all_greedy, _ = generate(work, prompts[::2], greedy, num_speculative_tokens=3)
    assert all_greedy == plain[::2]
    assert llm.get_metrics().drafts > 0


def test_sampled_requests_with_drafts_are_seeded_and_mixed_batches_stay_lossless(
    ckpt, prompts, baseline
):
    seeded = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    params = [seeded if i % 2 else GREEDY for i in range(len(prompts))]
    runs = []
    for _ in range(2):
        llm = LLM(model=str(ckpt), dtype="float32", block_size=16, num_speculative_tokens=2)
        with_oracle(llm, prompts, baseline, 2)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        runs.append([o.outputs[0].token_ids for o in outs])
        assert llm.get_metrics().drafts > 0
    assert runs[0] == runs[1]  # seeded sampling repeats, drafts or not
    for i, toks in enumerate(runs[0]):
        if i % 2 == 0:
            assert toks == baseline[i]  # greedy rows are untouched by their sampled neighbours
        assert len(toks) == 24


def test_no_mtp_layer_is_a_clear_error(tmp_path):
    path = make_random_checkpoint(tmp_path / "nomtp", num_mtp=0)
    with pytest.raises(ValueError, match="no MTP layer"):
        LLM(model=str(path), dtype="float32", num_speculative_tokens=1)


def test_speculation_pauses_above_the_disable_batch_size(ckpt, prompts, baseline):
    def run(limit):
        llm = LLM(
            model=str(ckpt),
            dtype="float32",
            block_size=16,
            num_speculative_tokens=2,
            speculative_disable_batch_size=limit,
        )
        with_oracle(llm, prompts, baseline, 2)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == baseline
        return llm.get_metrics().drafts

    assert run(len(prompts) - 1) == 0  # all requests run together: always above the limit
    assert run(len(prompts)) > 0


def test_acceptance_is_logged_periodically(ckpt, prompts, baseline, caplog, monkeypatch):
    import logging

    from xllm_py.engine import llm_engine

    monkeypatch.setattr(llm_engine, "STATS_LOG_INTERVAL_S", 0.0)
    llm = LLM(model=str(ckpt), dtype="float32", block_size=16, num_speculative_tokens=1)
    with_oracle(llm, prompts, baseline, 1)
    with caplog.at_level(logging.INFO, logger="xllm_py.engine.llm_engine"):
        llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert any("acceptance rate 1.00" in r.getMessage() for r in caplog.records)


def test_draft_device_must_be_the_target_device(ckpt):
    with pytest.raises(ValueError, match="draft_devices='cuda:1' must equal devices='cpu'"):
        LLM(model=str(ckpt), device="cpu", num_speculative_tokens=1, draft_device="cuda:1")
    llm = LLM(model=str(ckpt), dtype="float32", num_speculative_tokens=1, draft_device="cpu")
    assert llm.engine.core.executor.worker.draft is not None


def test_logprobs_with_drafts_match_plain_decoding(ckpt, prompts, baseline):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    plain = LLM(model=str(ckpt), dtype="float32", block_size=16).generate(
        [{"prompt_token_ids": p} for p in prompts], params
    )
    llm = LLM(model=str(ckpt), dtype="float32", block_size=16, num_speculative_tokens=2)
    with_oracle(llm, prompts, baseline, 2)
    spec = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.get_metrics().accepted_tokens > 0
    for a, b in zip(plain, spec):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(b.outputs[0].logprobs) == 12
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            for t in la:
                assert la[t] == pytest.approx(lb[t], abs=1e-4)
