"""Adaptive speculation (--speculative_adaptive, speculative/adaptive.py): the controller picks
the k with the most tokens per second from what it measured, per batch size; the
engine stays lossless whatever k each step carries, including k = 0 steps that skip
the MTP pass. Confidence-scheduled draft length (--speculative_confidence,
speculative/confidence.py): scores calibrated into chances, runs cut at a fixed threshold
or where a row stops paying for itself. The ShareGPT lossless bar at batch 1/8/64 is in
test_spec_sharegpt.py."""

from __future__ import annotations

import math
import random

import pytest
import torch

from tests.test_spec_decode import GREEDY, baseline, ckpt, generate, prompts  # noqa: F401
from xllm_py import LLM
from xllm_py.engine.scheduler import Scheduler
from xllm_py.executor.messages import NewRequestData, SchedulerOutput
from xllm_py.sampling_params import SamplingParams
from xllm_py.speculative.adaptive import EXPLORE_EVERY, AdaptiveSpeculation, batch_bucket
from xllm_py.speculative.confidence import ConfidencePolicy
from xllm_py.speculative.gate import PERIOD


def simulate(ctl: AdaptiveSpeculation, batches, cost, accept: float, steps: int) -> list[int]:
    """Drive the controller like the engine does: choose, then report a clean step's cost
    (when the previous step carried the same k) and every request's verdicts, drafts
    accepted one after another with probability `accept` (deterministic pattern)."""
    chosen, prev, n = [], None, 0
    for step in range(steps):
        b = batches(step)
        k = ctl.choose(b)
        if prev == k:
            ctl.observe_step(b, k, cost(b, k))
        verdicts = []
        for _ in range(b):
            accepted = 0
            while accepted < k and (n % 100) < accept * 100:
                accepted += 1
                n += 37  # a fixed stride through 0..99: the acceptance rate is `accept`
            n += 37
            verdicts.append((k, accepted))
        ctl.observe_acceptance(verdicts)
        chosen.append(k)
        prev = k
    return chosen


def settled(chosen: list[int]) -> int:
    """The k of most steps in the second half (exploration aside)."""
    tail = chosen[len(chosen) // 2 :]
    return max(set(tail), key=tail.count)


def test_cheap_drafts_that_are_accepted_run_at_the_largest_k():
    ctl = AdaptiveSpeculation(3)
    chosen = simulate(ctl, lambda s: 1, lambda b, k: 1.0 + 0.1 * k, accept=0.8, steps=600)
    assert settled(chosen) == 3
    assert ctl.acceptance(0) == pytest.approx(0.8, abs=0.1)
    assert ctl.expected_tokens(3) > ctl.expected_tokens(1) > 1.0


def test_drafts_that_cost_more_than_they_save_are_turned_off():
    ctl = AdaptiveSpeculation(3)
    chosen = simulate(ctl, lambda s: 8, lambda b, k: 1.0 + 0.6 * k, accept=0.3, steps=600)
    assert settled(chosen) == 0
    tail = chosen[300:]
    # Off, except the trials that keep the other costs fresh (a neighbour every
    # EXPLORE_EVERY steps, any k whose costs went stale).
    assert 0.85 < tail.count(0) / len(tail) < 1.0


def test_each_batch_size_gets_its_own_k():
    """Drafting pays at batch 1 (cheap) but not at 16 (verification is compute-bound there);
    the load alternates between the two every 50 steps."""

    def cost(b, k):
        return 1.0 + (0.05 if b == 1 else 0.8) * k

    ctl = AdaptiveSpeculation(2)
    chosen = simulate(ctl, lambda s: 1 if (s // 50) % 2 else 16, cost, accept=0.6, steps=1000)
    at_1 = [k for s, k in enumerate(chosen) if s >= 500 and (s // 50) % 2]
    at_16 = [k for s, k in enumerate(chosen) if s >= 500 and not (s // 50) % 2]
    assert settled(at_1) == 2 and settled(at_16) == 0
    assert batch_bucket(1) != batch_bucket(16) and batch_bucket(3) == batch_bucket(4)


def test_a_changed_workload_changes_k():
    """Acceptance falls from 0.9 to 0.1 at step 400: k follows within the next 200 steps."""
    ctl = AdaptiveSpeculation(2)
    cost = lambda b, k: 1.0 + 0.3 * k  # noqa: E731
    first = simulate(ctl, lambda s: 4, cost, accept=0.9, steps=400)
    second = simulate(ctl, lambda s: 4, cost, accept=0.1, steps=400)
    assert settled(first) == 2 and settled(second) == 0
    # every k was tried in the first steps, the periodic trials come every EXPLORE_EVERY
    assert set(first[:12]) == {0, 1, 2}
    assert len([k for k in second[200:] if k]) <= 2 * (200 // EXPLORE_EVERY + 1) * 3


def test_only_clean_steps_are_timed():
    """A step with a prompt chunk, or one verifying fewer drafts than it asks for (the
    first step after k grew), says nothing about the cost of k."""
    ctl = AdaptiveSpeculation(2)
    sched = Scheduler.__new__(Scheduler)
    sched.adaptive, sched.confidence = ctl, None
    sched._emitted, sched._drafted_before = None, None

    def step(**kw):
        sched.record_step_time(SchedulerOutput(num_draft_tokens=2, **kw), 0.5)
        return sum(len(b.recent.get(2, ())) for b in ctl.buckets.values())

    assert step(num_scheduled_tokens={"a": 3, "b": 1}, spec_token_ids={"a": [1, 2]}) == 0
    prefill = NewRequestData("c", [1, 2, 3], 3, SamplingParams(), [0], 0)
    assert (
        step(new_requests=[prefill], num_scheduled_tokens={"a": 3}, spec_token_ids={"a": [1, 2]})
        == 0
    )
    assert step(num_scheduled_tokens={"a": 3}, spec_token_ids={"a": [1, 2]}) == 1
    assert ctl.buckets[batch_bucket(1)].costs[2] == 0.5


def test_adaptive_needs_drafts_and_replaces_the_disable_batch_size(ckpt):  # noqa: F811
    with pytest.raises(ValueError, match="speculative_adaptive=true needs num_speculative"):
        LLM(model=str(ckpt), speculative_adaptive=True)
    with pytest.raises(ValueError, match="speculative_disable_batch_size=4 and speculative_ad"):
        LLM(
            model=str(ckpt),
            num_speculative_tokens=2,
            speculative_adaptive=True,
            speculative_disable_batch_size=4,
        )


def test_k_changing_every_few_steps_is_lossless(ckpt, prompts, baseline):  # noqa: F811
    """The engine follows whatever k the controller picks: off (no MTP pass, prompt chunks
    included, which leaves gaps in the requests' MTP cache), 1, 2, and back."""
    llm = LLM(
        model=str(ckpt),
        dtype="float32",
        block_size=16,
        num_speculative_tokens=2,
        speculative_adaptive=True,
    )
    ctl = llm.engine.core.scheduler.adaptive
    pattern = [0, 0, 0, 2, 2, 1, 0, 2, 2, 2, 1, 1]
    steps = iter(range(10**6))
    chosen = []
    ctl.choose = lambda batch: chosen.append(pattern[next(steps) % len(pattern)]) or chosen[-1]
    proposer = llm.engine.core.executor.worker.runner.proposer
    seen = []
    propose = proposer.propose

    def spy(items, hidden, k=None):
        seen.append((k, [it.start for it in items]))
        return propose(items, hidden, k)

    proposer.propose = spy
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == baseline
    m = llm.get_metrics()
    assert m.drafts > 0 and max(len(m.accepted_per_position), 0) <= 2
    # A step at k = 0 runs no MTP pass, not even over prompt chunks.
    assert chosen.count(0) > 0 and all(k != 0 for k, _ in seen)
    assert any(k == 2 for k, _ in seen)
    blocks = llm.engine.core.blocks
    assert blocks.num_free_blocks == blocks.num_blocks


def test_adaptive_engine_reports_its_choices(ckpt, prompts, baseline):  # noqa: F811
    tokens, llm = generate(ckpt, prompts, num_speculative_tokens=2, speculative_adaptive=True)
    assert tokens == baseline
    spec = llm.get_stats().spec
    assert len(spec.adaptive_k) == 1 and 0 <= spec.adaptive_k[0] <= 2
    # every k was tried while the controller measured the first batch size it saw
    assert len(spec.steps_by_k) == 3 and all(n > 0 for n in spec.steps_by_k)


# ---- confidence-scheduled draft length (speculative/confidence.py) ------------------------------


def calibrated(policy: ConfidencePolicy, rates: dict[float, float], steps: int = 200):
    """Feed the policy verdicts of first drafts: a draft scored s is accepted at rates[s]
    (deterministic pattern); second drafts are always accepted."""
    for step in range(steps):
        results = []
        for score, rate in rates.items():
            accepted = 2 if (step * rate) % 1 + rate >= 1 else 0
            results.append(([score, 0.95], accepted))
        policy.observe_acceptance(results)


def test_confidence_is_calibrated_and_a_fixed_threshold_cuts_runs():
    policy = ConfidencePolicy(2, threshold=0.5)
    # unmeasured bins are optimistic: their drafts are verified (and so measured)
    assert policy.plan([[0.15, 0.95]]) == [2]
    calibrated(policy, {0.95: 0.9, 0.15: 0.1})
    assert policy.chance(0, 0.95) == pytest.approx(0.9, abs=0.05)
    assert policy.chance(0, 0.15) == pytest.approx(0.1, abs=0.05)
    # sure first drafts keep their run; an unsure one ends it at once
    assert policy.plan([[0.95, 0.95], [0.15, 0.95], []]) == [2, 0, 0]


def test_auto_threshold_follows_the_cost_of_a_row():
    def fed(row_cost: float, fixed: float = 0.018) -> ConfidencePolicy:
        policy = ConfidencePolicy(3, threshold="auto")
        calibrated(policy, {0.95: 0.9, 0.55: 0.5, 0.15: 0.1})
        for step in range(64):  # decode steps of 8 requests, 8..32 rows
            rows = 8 + step % 25
            policy.observe_step(8, rows, fixed + row_cost * rows, rows, True, True)
        return policy

    runs = [[0.95, 0.95, 0.95], [0.55, 0.95, 0.95], [0.15, 0.95, 0.95]]
    # rows nearly free (a memory-bound step): every run goes deep, even unsure ones
    cheap = fed(0.00001)
    assert cheap.plan(runs) == [3, 3, 3]
    # a row costs about what a step costs per request: only the sure drafts pay
    dear = fed(0.004)
    take = dear.plan(runs)
    assert take[0] >= 1 and take[2] == 0 and take[0] >= take[1] >= take[2]


# ---- the draft gate of "auto" (speculative/gate.py) -------------------------------------------


def gated(policy, batches, step_cost, yield_on: float, steps: int, prompt_pass=None):
    """Drive an "auto" policy like the engine does: ask whether the step drafts, then report
    it (steady when the step before drafted alike) with the tokens it emitted, `yield_on`
    per request when it verified drafts, 1 otherwise; its cost step_cost(batch, drafting).
    prompt_pass(step): the seconds the MTP pass over a prompt chunk arriving at that step
    costs (0: none), paid only if the step drafts; such a step is not a steady one.
    Returns (the choices, tokens emitted, seconds spent)."""
    chosen, before, tokens_sum, seconds_sum = [], None, 0.0, 0.0
    for step in range(steps):
        b = batches(step)
        drafting = policy.drafting(b)
        tokens = b * yield_on if drafting and before else b  # before: drafts to verify
        seconds = step_cost(b, drafting)
        prompt = prompt_pass(step) if prompt_pass is not None else 0.0
        if prompt and drafting:
            seconds += prompt
        policy.observe_prompt_passes(drafting, tokens, prompt if drafting else 0.0)
        if not prompt:
            policy.observe_step(b, b, seconds, tokens, drafting, before == drafting)
        chosen.append(drafting)
        tokens_sum, seconds_sum, before = tokens_sum + tokens, seconds_sum + seconds, drafting
    return chosen, tokens_sum / seconds_sum


def fixed_rate(batches, step_cost, yield_on: float, drafting: bool, steps: int) -> float:
    """Tokens per second of the same steps, every one drafting (or none)."""
    b = [batches(step) for step in range(steps)]
    tokens = sum(n * (yield_on if drafting else 1.0) for n in b)
    return tokens / sum(step_cost(n, drafting) for n in b)


def test_auto_measures_plain_steps_and_turns_drafting_off_where_it_does_not_pay():
    """The MTP passes cost a share of every step; at batch 1 the drafts pay (1.6 tokens
    for 1.3 steps' time), at batch 16 the passes and verification rows make a step 1.8
    times as dear and drafting loses. Either way "auto" runs within a few percent of the
    faster kind, and measures a plain step before it trusts drafting."""
    policy = ConfidencePolicy(1, threshold="auto")

    def cost(b, drafting):
        return 0.010 + 0.001 * b + (0.003 + 0.0012 * b if drafting else 0.0)

    first, _ = gated(policy, lambda s: 1, cost, 1.6, 80)
    assert False in first  # a plain step is measured, not assumed
    at1, rate1 = gated(policy, lambda s: 1, cost, 1.6, 2000)
    at16, rate16 = gated(policy, lambda s: 16, cost, 1.6, 2000)
    on1, off1 = (fixed_rate(lambda s: 1, cost, 1.6, d, 1) for d in (True, False))
    on16, off16 = (fixed_rate(lambda s: 16, cost, 1.6, d, 1) for d in (True, False))
    assert rate1 > 0.97 * on1 and on1 > 1.1 * off1
    assert rate16 > 0.97 * off16 and off16 > 1.1 * on16
    assert sum(at1) / len(at1) > 0.9 and sum(at16) / len(at16) < 0.1
    assert policy.gate.steps[False] > 0 and policy.gate.steps[True] > 0
    # the batch-1 decision holds after the batch-16 steps: buckets are measured apart
    again, _ = gated(policy, lambda s: 1, cost, 1.6, 320)
    assert sum(again) >= 320 - 2 * PERIOD  # plain decoding in trials only


def test_auto_turns_drafting_back_on_when_it_starts_to_pay():
    policy = ConfidencePolicy(2, threshold="auto")

    def cost(b, drafting):
        return 0.010 + (0.006 if drafting else 0.0)

    bad, _ = gated(policy, lambda s: 4, cost, 1.2, 600)  # 1.2 tokens for 1.6 steps' time
    assert sum(bad[-300:]) < 0.1 * 300
    # 2.2 for 1.6: drafting pays now, noticed at the next trial (a few hundred steps on,
    # drafting having measured 25% slower)
    good, _ = gated(policy, lambda s: 4, cost, 2.2, 1000)
    assert sum(good[-300:]) > 0.9 * 300


def test_auto_holds_a_decision_while_the_batch_size_moves():
    """A batch that moves between 3 and 4 every few steps (requests finishing and being
    admitted) does not switch drafting on and off with it: each switch costs a step that
    no steady step measures (here: drafts proposed and never verified)."""
    policy = ConfidencePolicy(1, threshold="auto")

    def cost(b, drafting):
        return 0.010 + 0.002 * b + (0.008 if drafting else 0.0)

    batches = lambda s: 3 + (s // 3) % 2  # noqa: E731
    chosen, rate = gated(policy, batches, cost, 1.6, 1600)
    switches = sum(a != b for a, b in zip(chosen, chosen[1:]))
    assert switches <= 1600 // PERIOD
    assert rate > 0.97 * max(fixed_rate(batches, cost, 1.6, d, 1600) for d in (True, False))


def test_auto_compares_the_kinds_under_the_same_load_while_the_machine_speed_drifts():
    """The machine's speed moves (other processes, the clock): every step costs 1.5 times
    as much for 48 steps, then its own cost for 48, and so on, three periods each way.
    Drafting is 10% slower at any load. Measured apart (drafting's periods in the fast
    phase, plain decoding's in the slow one), drafting would look 35% faster; compared in
    adjacent pairs, "auto" keeps it off and runs within a few percent of plain decoding."""
    policy = ConfidencePolicy(1, threshold="auto")
    step = iter(range(10**6))

    def cost(b, drafting):
        load = 1.5 if (next(step) // (3 * PERIOD)) % 2 else 1.0
        return load * 0.010 * (1.6 / 0.9 if drafting else 1.0)

    chosen, rate = gated(policy, lambda s: 1, cost, 1.6, 3000)
    assert sum(chosen[-2000:]) < 0.2 * 2000
    plain = 2 / (0.010 + 0.015)  # a token a step, half the steps at each load
    assert rate > 0.95 * plain


def test_auto_compares_drafting_with_plain_decoding_at_the_same_batch_size():
    """A batch that holds 3 requests for 40 steps, then 4 for 40 (requests finishing and
    being admitted in waves), where a step's cost grows with its requests as it does on 2
    CPU cores (the bundled small model: about 13, 22, 31 and 40 ms at 1-4 requests), so
    per request a step of 3 is 29% faster than one of 4. Drafting is 8% slower at both. A
    drafting period at 3 set against a plain one at 4, per request, would measure it 19%
    faster; compared at the same batch size, "auto" keeps drafting off."""
    policy = ConfidencePolicy(1, threshold="auto")
    cost = lambda b, drafting: (0.004 + 0.009 * b) * (1.6 / 0.92 if drafting else 1.0)  # noqa: E731
    batches = lambda s: 3 if (s // 40) % 2 else 4  # noqa: E731
    chosen, rate = gated(policy, batches, cost, 1.6, 4000)
    assert sum(chosen[-3000:]) < 0.2 * 3000
    assert rate > 0.97 * fixed_rate(batches, cost, 1.6, False, 4000)


def test_one_lucky_trial_does_not_turn_drafting_on():
    """On a shared machine a period's speed moves by itself: here every 16 steps cost a
    random factor (sd 12%) times their own cost. Drafting is 8% slower; a trial period that
    happens to run fast measures it faster than plain decoding now and then, but a trial
    makes only two ratios of the five a bucket keeps, and a second trial must agree with
    it to change the decision. Over five such machines "auto" drafts little and never
    loses more than 3%. (With one trial enough to decide, it drafted 24% of the steps.)"""
    shares, rates = [], []
    for seed in range(5):
        policy = ConfidencePolicy(1, threshold="auto")
        rng = random.Random(seed)
        load = [math.exp(rng.gauss(0.0, 0.12)) for _ in range(8000 // 16)]
        step = iter(range(10**6))

        def cost(b, drafting, load=load, step=step):
            return load[next(step) // 16] * 0.010 * (1.6 / 0.92 if drafting else 1.0)

        chosen, rate = gated(policy, lambda s: 4, cost, 1.6, 8000)
        shares.append(sum(chosen[-6000:]) / 6000)
        rates.append(rate / (4 / (0.010 * sum(load) / len(load))))  # over always plain
    assert sum(shares) / len(shares) < 0.2
    assert min(rates) > 0.97


def test_trials_of_drafting_that_does_not_pay_cost_about_one_percent():
    """Drafting 30% slower (1.2 tokens for 1.7 steps' time: the bundled tiny model at k = 3
    on 2 cores). Once the gate has decided, its trials of drafting are spaced by what one
    costs, so over 20,000 steps "auto" runs within 1.5% of plain decoding. (Trials spaced
    by the gap in tenths alone came every 25 periods here and cost 1.7%.)"""
    policy = ConfidencePolicy(3, threshold="auto")
    cost = lambda b, drafting: 0.017 if drafting else 0.010  # noqa: E731
    gated(policy, lambda s: 4, cost, 1.2, 400)  # measured, and decided
    chosen, rate = gated(policy, lambda s: 4, cost, 1.2, 20000)
    assert 0 < sum(chosen) < 0.03 * 20000  # it keeps trying drafting, seldom
    assert rate > 0.985 * 4 / 0.010


def test_a_batch_size_the_ramp_passes_through_follows_its_nearest_measured_one():
    """Waves of requests: 120 steps at batch 4, then the wave drains, 6 steps at 2 and 6
    at 1, too few for a pair at either size. Drafting is 30% slower at every size. The
    batch-4 bucket decides; the others, having no pairs of their own, run on its median
    rather than alternating the kinds (drafting half their periods) for good."""
    policy = ConfidencePolicy(3, threshold="auto")
    cost = lambda b, drafting: (0.006 + 0.001 * b) * (1.7 if drafting else 1.0)  # noqa: E731
    batches = lambda s: (4, 2, 1)[(s % 132 >= 120) + (s % 132 >= 126)]  # noqa: E731
    gated(policy, batches, cost, 1.2, 132 * 40)
    chosen, _ = gated(policy, batches, cost, 1.2, 132 * 40)
    ramp = [d for s, d in enumerate(chosen) if batches(s) < 4]
    assert sum(ramp) < 0.1 * len(ramp)


def test_auto_charges_drafting_for_its_mtp_passes_over_prompts():
    """Decode steps that draft emit 1.6 tokens for 1.5 plain steps' time (7% faster), but
    a drafting step also runs the MTP layer over the prompt chunks it carries: here one
    every 20 steps, for 4 plain steps' time, which makes drafting 6% slower end to end.
    "auto" charges those passes to drafting and keeps it off."""
    policy = ConfidencePolicy(1, threshold="auto")
    cost = lambda b, drafting: 0.015 if drafting else 0.010  # noqa: E731

    def prompt_pass(step):
        return 0.040 if step % 20 == 10 else 0.0

    chosen, rate = gated(policy, lambda s: 1, cost, 1.6, 3000, prompt_pass)
    assert sum(chosen[-2000:]) < 0.2 * 2000
    assert rate > 0.97 * 100.0  # plain decoding: a token per 10 ms
    assert policy.gate.prompt_cost() == pytest.approx(0.040 / (20 * 1.6), rel=0.15)


def test_a_fixed_threshold_always_drafts():
    policy = ConfidencePolicy(2, threshold=0.5)
    costly, _ = gated(policy, lambda s: 8, lambda b, d: 0.1 if d else 0.01, 1.0, 50)
    assert all(costly) and policy.gate is None


def test_confidence_scheduling_is_lossless_and_cuts_drafts(ckpt, prompts, baseline):  # noqa: F811
    """A fixed threshold on the random test checkpoint (whose drafts are rarely accepted):
    once measured, its drafts are cut, and the tokens are the plain run's."""
    tokens, llm = generate(ckpt, prompts, num_speculative_tokens=3, speculative_confidence="0.5")
    assert tokens == baseline
    every, off = generate(ckpt, prompts, num_speculative_tokens=3, speculative_confidence="off")
    assert every == baseline
    assert 0 < llm.get_metrics().draft_tokens < off.get_metrics().draft_tokens / 2


def test_the_plan_does_not_depend_on_the_tokens_drawn():
    """Property: for the same draft distributions, whichever tokens the draft sampler draws,
    every draft gets the same score and the policy the same plan. (A score taken from the
    drawn token's own probability biases the output: speculative/confidence.py.)"""
    from xllm_py.worker.runner_request import RunnerRequest

    llm = LLM(dtype="float32", num_speculative_tokens=2, max_cache_size=1 << 20)
    runner = llm.engine.core.executor.worker.runner
    vocab = runner.vocab_size
    settings = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=12, top_p=0.9),
        SamplingParams(temperature=1.2, min_p=0.05),
        SamplingParams(temperature=0.8, presence_penalty=0.8, repetition_penalty=1.3),
        SamplingParams(temperature=0.9, seed=7),  # coupled drafts
        SamplingParams(temperature=0.0),  # greedy
    ]
    policy = ConfidencePolicy(2, threshold=0.5)
    calibrated(policy, {(b + 0.5) / 10: b / 10 for b in range(10)})
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        logits = torch.randn(len(settings), vocab, generator=gen) * (1 + trial % 4)
        context = {
            f"r{i}": (RunnerRequest([1, 2, 3, 4 + i], 3, p, [], 3), [5 + i])
            for i, p in enumerate(settings)
        }
        ids = list(context)
        drawn, scored = [], []
        for draw in range(4):
            runner.sampler.generator.manual_seed(1000 * trial + draw)
            runner.draft_sampler.begin(context)
            tokens, scores = runner.draft_sampler.choose(logits.clone(), ids, 1, [[9]] * len(ids))
            drawn.append(tokens.tolist())
            scored.append(scores.tolist())
        assert all(s == scored[0] for s in scored)
        plans = [policy.plan([[0.9, s] for s in scores]) for scores in scored]
        assert all(p == plans[0] for p in plans)
        if trial == 0:  # unseeded sampled rows really drew different tokens
            assert len({tuple(t[:4]) for t in drawn}) > 1


@pytest.mark.parametrize("interleave", ["round", "step"])
def test_gate_check_measures_plain_auto_and_always_on_the_same_rounds(tmp_path, interleave):
    """perf/gate_check.py, small: three engines, interleaved rounds (or steps), the ratios
    it reports are its own rounds' (auto's steps split into drafting and not)."""
    from perf.gate_check import main

    out = tmp_path / "gate.json"
    r = main(["--concurrency", "2", "--num-prompts", "4", "--input-len", "32",
              "--output-len", "8", "16", "--rounds", "2", "--interleave", interleave,
              "--out", str(out)])  # fmt: skip
    assert out.is_file() and r["settings"]["k"] == 1
    for arm in ("plain", "auto", "always"):
        assert len(r["output_tok_s"][arm]) == 2 and min(r["output_tok_s"][arm]) > 0
    for arm in ("auto", "always"):
        want = [x / p for x, p in zip(r["output_tok_s"][arm], r["output_tok_s"]["plain"])]
        assert r["ratio_to_plain"][arm] == pytest.approx(want)
    assert r["auto_steps"]["drafting"] > 0  # a new bucket measures drafting first


def test_lockstep_check_keeps_plain_waves_together_unless_the_first_is_staggered(tmp_path):
    """perf/lockstep.py, small: with fixed output lengths plain decoding admits each wave
    in one step; spreading the first wave's lengths makes requests finish, and their
    successors get admitted, one at a time from then on."""
    from perf.lockstep import main

    out = tmp_path / "lockstep.json"
    r = main(["--concurrency", "2", "--num-prompts", "6", "--input-len", "16",
              "--output-len", "8", "--rounds", "1", "--out", str(out)])  # fmt: skip
    assert out.is_file() and len(r["staggered_over_lockstep"]) == 1
    lockstep, staggered = (r["rounds"][a][0]["steps"] for a in ("lockstep", "staggered"))
    assert [k for k in lockstep if k.startswith("admit")] == ["admit 2 beside 0"]
    assert lockstep["admit 2 beside 0"]["count"] == 3  # 6 requests, 3 waves
    assert staggered["admit 1 beside 1"]["count"] >= 3
    tokens = {
        a: r["rounds"][a][0]["output_tok_s"] * r["rounds"][a][0]["seconds"] for a in r["rounds"]
    }
    assert tokens["lockstep"] == pytest.approx(6 * 8) and tokens["staggered"] == pytest.approx(
        5 * 8 + 4
    )
