"""The offline API as a user drives it: text and token-id prompts, stopping rules,
sampling controls, logprobs, and ValueErrors that name the bad field."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.hf_reference import random_prompts
from xllm_py import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(model=str(tiny_model_dir), dtype="float32", block_size=16)


@pytest.fixture(scope="module")
def prompts(vocab_size):
    return [{"prompt_token_ids": p} for p in random_prompts(vocab_size, [4, 11, 30, 7], seed=3)]


@pytest.mark.parametrize(
    "field, prompt, params",
    [
        ("prompt", "", SamplingParams()),
        ("prompt", {"prompt_token_ids": []}, SamplingParams()),
        ("prompt_token_ids", {"prompt_token_ids": [1, 384]}, SamplingParams()),
        ("prompt_token_ids", {"prompt_token_ids": [1, -1]}, SamplingParams()),
        ("prompt", {"prompt_token_ids": [5] * 256}, SamplingParams()),  # context is 256
    ],
)
def test_bad_prompts_raise_naming_the_field(llm, field, prompt, params):
    with pytest.raises(ValueError, match=field):
        llm.generate(prompt, params)
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("max_tokens", {"max_tokens": -1}),
        ("prompt_logprobs", {"prompt_logprobs": -1}),
        ("temperature", {"temperature": -0.5}),
        ("top_p", {"top_p": 0.0}),
        ("top_p", {"top_p": 1.5}),
        ("top_k", {"top_k": -3}),
        ("min_p", {"min_p": 2.0}),
        ("logprobs", {"logprobs": -1}),
        ("min_tokens", {"min_tokens": 9, "max_tokens": 4}),
    ],
)
def test_bad_sampling_params_raise_naming_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_one_bad_prompt_queues_nothing(llm, prompts):
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([prompts[0], {"prompt_token_ids": [10**6]}], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished()


def test_text_prompt_roundtrip_and_stop_string(llm):
    tok = llm.get_tokenizer()
    out = llm.generate(
        "The quick brown fox", SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    )[0]
    c = out.outputs[0]
    assert out.prompt_token_ids[0] == tok.bos_token_id
    assert c.text == tok.decode(c.token_ids)
    assert len(c.token_ids) == 20 and c.finish_reason == "length"
    # stop on a piece of the text the model produced: the output is cut right before it
    stop = c.text[len(c.text) // 2 :][:3]
    assert stop.strip(), c.text
    cut = llm.generate(
        "The quick brown fox",
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop]),
    )[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == c.text[: c.text.find(stop)]
    assert len(cut.token_ids) < 20


def test_stop_token_ids_and_min_tokens(llm, prompts):
    greedy = llm.generate(prompts[1], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    toks = greedy[0].outputs[0].token_ids
    target = toks[5]
    first = toks.index(target)
    out = llm.generate(
        prompts[1], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[target])
    )
    c = out[0].outputs[0]
    assert (
        c.token_ids == toks[: first + 1] and c.finish_reason == "stop" and c.stop_reason == target
    )
    # min_tokens bans the stop token until enough tokens exist
    out = llm.generate(
        prompts[1],
        SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[target], min_tokens=first + 2),
    )
    c = out[0].outputs[0]
    assert target not in c.token_ids[: first + 2]
    assert len(c.token_ids) >= first + 2


def test_eos_stops_unless_ignored(tiny_model_dir, prompts, tmp_path):
    # Declare as EOS (config.json eos_token_id) the token greedy decoding produces third.
    llm = LLM(model=str(tiny_model_dir), dtype="float32", block_size=16)
    free = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    toks = llm.generate(prompts[2], free)[0].outputs[0].token_ids
    eos = toks[2]
    shutil.copytree(tiny_model_dir, tmp_path / "ckpt")
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    cfg["eos_token_id"] = eos
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(cfg))
    llm2 = LLM(model=str(tmp_path / "ckpt"), dtype="float32", block_size=16)
    stopped = llm2.generate(prompts[2], SamplingParams(max_tokens=10, temperature=0))[0].outputs[0]
    assert stopped.token_ids == toks[: toks.index(eos) + 1] and stopped.finish_reason == "stop"
    ignored = llm2.generate(prompts[2], free)[0].outputs[0]
    assert ignored.token_ids == toks and ignored.finish_reason == "length"


def test_seed_is_reproducible_whatever_the_batch(llm, prompts):
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    alone = llm.generate(prompts[0], p)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=16, temperature=0.7) for _ in prompts[1:]]
    mixed = llm.generate(prompts[1:] + [prompts[0]], others + [p])[-1].outputs[0].token_ids
    assert alone == mixed
    other_seed = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=99)
    assert llm.generate(prompts[0], other_seed)[0].outputs[0].token_ids != alone


def test_top_k_1_is_greedy(llm, prompts):
    greedy = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    topk1 = llm.generate(
        prompts, SamplingParams(max_tokens=10, temperature=1.3, top_k=1, ignore_eos=True)
    )
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in topk1]


def test_logprobs_top_n(llm, prompts):
    out = llm.generate(
        prompts[0], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=3)
    )
    c = out[0].outputs[0]
    assert len(c.logprobs) == 5
    for tok, lp in zip(c.token_ids, c.logprobs):
        assert tok in lp and 3 <= len(lp) <= 4
        assert lp[tok] == pytest.approx(max(lp.values()))  # greedy: the chosen token is the top one
        assert all(v <= 0 for v in lp.values())


def test_checkpoint_without_tokenizer_needs_token_ids(tmp_path, tiny_model_dir, vocab_size):
    for f in tiny_model_dir.iterdir():
        if not f.name.startswith("tokenizer"):
            shutil.copy(f, tmp_path / f.name)
    llm = LLM(model=str(tmp_path), dtype="float32", block_size=16)
    out = llm.generate({"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=3, temperature=0))
    assert len(out[0].outputs[0].token_ids) >= 1 and out[0].outputs[0].text == ""
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate("hello", SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="stop"):  # no tokenizer: stop strings cannot match
        llm.generate({"prompt_token_ids": [3, 4]}, SamplingParams(max_tokens=3, stop=["x"]))


def test_stop_strings_wait_for_min_tokens(llm):
    free = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    text = llm.generate("Hello world", free)[0].outputs[0].text
    stop = text[:2]  # appears right at the start of the output
    assert stop.strip(), text
    early = llm.generate("Hello world", SamplingParams(max_tokens=16, temperature=0, stop=[stop]))
    assert early[0].outputs[0].finish_reason == "stop"
    late = llm.generate(
        "Hello world", SamplingParams(max_tokens=16, temperature=0, stop=[stop], min_tokens=16)
    )[0].outputs[0]
    assert len(late.token_ids) == 16 and late.finish_reason == "length"


def test_bfloat16_runs_the_same_model(tiny_model_dir, prompts):
    """bfloat16 (dtype="auto" on accelerators) must compute the same model
    up to rounding: the first greedy token agrees with float32 for most prompts and the
    log-probabilities of float32's choices stay close."""
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=5)
    f32 = LLM(model=str(tiny_model_dir), dtype="float32", block_size=16).generate(prompts, params)
    bf16 = LLM(model=str(tiny_model_dir), dtype="bfloat16", block_size=16).generate(prompts, params)
    agree = sum(a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0] for a, b in zip(f32, bf16))
    assert agree >= len(prompts) - 1
    for a, b in zip(f32, bf16):
        first_a, first_b = a.outputs[0], b.outputs[0]
        tok = first_a.token_ids[0]
        if tok in first_b.logprobs[0]:
            assert first_b.logprobs[0][tok] == pytest.approx(first_a.logprobs[0][tok], abs=0.15)
