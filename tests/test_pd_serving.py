"""Prefill/decode disaggregation served (docs/pd.md): a prefill daemon (--pd_role=prefill)
and a decode daemon (--pd_role=decode --pd_prefill URL), real processes on loopback, the
prompts' blocks moved by Mooncake's transfer engine. Through the decode daemon, greedy
completions equal a colocated daemon's, tokens and logprobs, with MTP (k = 2): the decode
daemon found every moved block in its prefix cache (its /metrics), so it computed only
each prompt's last partial block. A decode daemon of another block size is refused at its
first request, the field named, and computes its prompts itself; so does the first one
once the prefill daemon is gone, with the same answers. A prefill call without the
cluster token is refused."""

from __future__ import annotations

import pytest

from tests.server_utils import HTTP, Server
from xllm_py import LLM
from xllm_py.pd import transfer
from xllm_py.pd.compat import PREFILL_ROUTE
from xllm_py.sharegpt import held_out_user_turns

try:
    transfer.transfer_engine_class()
except RuntimeError as e:  # no Mooncake wheel, or no rdma-core (make setup fetches both)
    pytest.skip(str(e), allow_module_level=True)

BLOCK = 16
FLAGS = ("--dtype=float32", f"--block_size={BLOCK}", "--num_speculative_tokens=2",
         "--max_cache_size=16000000", "--speculative_confidence=off")  # fmt: skip
TOKEN = "pd-test-token-0123456789"
HITS = "xllm:prefix_cache_hits_total"


@pytest.fixture(scope="module")
def prompts():
    tok = LLM(dtype="float32", max_cache_size=1 << 20).get_tokenizer()
    texts = held_out_user_turns(4, 100, 600)
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]


def complete(url: str, ids: list[int]) -> tuple[list[str], list[float]]:
    body = {"prompt": ids, "max_tokens": 16, "temperature": 0, "logprobs": 1, "ignore_eos": True}
    r = HTTP.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"]


def assert_same(got, want):
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=1e-4)


def test_decode_through_a_prefill_instance_is_colocated_decoding(prompts):
    env = {"XLLM_CLUSTER_TOKEN": TOKEN}
    with Server(*FLAGS) as colocated:
        want = [complete(colocated.url, p) for p in prompts]
    with Server(*FLAGS, "--pd_role=prefill", env=env) as prefill:
        with Server(*FLAGS, "--pd_role=decode", f"--pd_prefill={prefill.url}", env=env) as dec:
            for p, w in zip(prompts[:3], want):
                assert_same(complete(dec.url, p), w)
            moved = sum((len(p) - 1) // BLOCK * BLOCK for p in prompts[:3])  # full blocks' tokens
            assert dec.metric(HITS) == moved > 0  # every full block arrived, none computed
            refused = HTTP.post(prefill.url + PREFILL_ROUTE, json={}, timeout=10)
            assert refused.status_code == 401
            # another block size: refused at the first request, naming the field, and the
            # decode daemon computes its prompts itself
            other = [f for f in FLAGS if not f.startswith("--block_size")] + ["--block_size=32"]
            with Server(*other, "--pd_role=decode", f"--pd_prefill={prefill.url}",
                        env=env) as odd:  # fmt: skip
                assert_same(complete(odd.url, prompts[0]), want[0])
                assert "block_size: this instance has 16, the peer 32" in odd.output()
            assert "not compatible, not asked again" in odd.output()
            prefill.stop()
            for p, w in zip(prompts[3:], want[3:]):  # no prefill instance left: computed here
                assert_same(complete(dec.url, p), w)
            assert dec.metric(HITS) == moved
            assert "computed here, its transfer failed" in dec.output()
