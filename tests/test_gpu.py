"""The GPU suite (`make test-gpu`, `pytest -m gpu`): the CPU suite's main promises, run on a
CUDA device. Without one every test here is skipped with the reason.

- The model on CUDA against HF transformers on the tiny random configs (HF runs on the
  CPU, in float32, as in test_hf_reference.py): float32 to the CPU suite's 1e-4;
  bfloat16 to a documented tolerance (below).
- Greedy MTP is lossless on CUDA: k = 1 and 3 at batch 1, 8 and 64 give plain decoding's
  tokens on held-out ShareGPT prompts (bundled model, float32).
- The REST daemon on a GPU with MTP on serves what the offline API gives.
- A 1-GPU "cluster" through scripts/launch_cluster.sh serves a completion.
- The KV cache is sized after the profiling forward of the largest step, within
  --max_memory_utilization of the device's memory.
- FP8-resident weights on CUDA follow the dequantised model.
Graph mode on CUDA is in test_graph_mode.py (also marked `gpu`).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.hf_reference import (
    CHECKPOINT_SEEDS,
    MAX_NEW_TOKENS,
    hf_greedy_detailed,
    make_hf_checkpoint,
    reference_prompts,
)
from tests.server_utils import HTTP, Server, free_port, free_port_range
from xllm_py import LLM, SamplingParams
from xllm_py.sharegpt import held_out_user_turns

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]
DEVICE = "cuda:0"
HF_CONFIG = "noq_yarn_mscale_grouped"  # no q-LoRA, YaRN, grouped routing
# bfloat16 keeps 8 bits of mantissa: logits of size ~10 carry errors of ~0.05, so only the
# first generated token (before any divergence compounds) is compared, to 0.1 in logprob.
BF16_FIRST_LOGPROB_ATOL = 0.1
SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "launch_cluster.sh"
# A fixed 1 GiB KV cache for the engines these tests make one after another in this process
# (the default would size each cache to 0.9 of the device); the sizing test sets its own.
CACHE = dict(max_cache_size=2**30)


@pytest.fixture(scope="module")
def hf_case(tmp_path_factory):
    path = make_hf_checkpoint(
        HF_CONFIG, tmp_path_factory.mktemp("gpu_hf"), seed=CHECKPOINT_SEEDS[HF_CONFIG]
    )
    prompts = reference_prompts(HF_CONFIG)
    return path, prompts, hf_greedy_detailed(path, prompts, MAX_NEW_TOKENS)["results"]


def engine_greedy(path, prompts, dtype):
    llm = LLM(model=str(path), device=DEVICE, dtype=dtype, block_size=16, **CACHE)
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    return [(o.token_ids, [lp[t] for lp, t in zip(o.logprobs, o.token_ids)]) for o in outs]


def test_float32_on_cuda_matches_hf(hf_case):
    path, prompts, want = hf_case
    for i, ((tokens, logprobs), (ref_tokens, ref_logprobs)) in enumerate(
        zip(engine_greedy(path, prompts, "float32"), want)
    ):
        assert tokens == ref_tokens, f"prompt {i}"
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) <= 1e-4, f"prompt {i}"


def test_bfloat16_on_cuda_matches_hf_first_token(hf_case):
    path, prompts, want = hf_case
    for i, ((tokens, logprobs), (ref_tokens, ref_logprobs)) in enumerate(
        zip(engine_greedy(path, prompts, "bfloat16"), want)
    ):
        assert tokens[0] == ref_tokens[0], f"prompt {i}"
        assert abs(logprobs[0] - ref_logprobs[0]) <= BF16_FIRST_LOGPROB_ATOL, f"prompt {i}"


@pytest.fixture(scope="module")
def sharegpt_prompts():
    tok = LLM(dtype="float32").get_tokenizer()
    return [
        tok.apply_chat_template([{"role": "user", "content": t}])
        for t in held_out_user_turns(64, 20, 600)
    ]


GREEDY = SamplingParams(max_tokens=20, temperature=0.0)


@pytest.fixture(scope="module")
def plain_on_cuda(sharegpt_prompts):
    llm = LLM(device=DEVICE, dtype="float32", block_size=16, max_seqs_per_batch=64, **CACHE)
    return [o.outputs[0].token_ids for o in llm.generate(sharegpt_prompts, GREEDY)]


@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("k", [1, 3])
def test_mtp_on_cuda_is_lossless(sharegpt_prompts, plain_on_cuda, batch, k):
    llm = LLM(
        device=DEVICE,
        dtype="float32",
        block_size=16,
        max_seqs_per_batch=batch,
        num_speculative_tokens=k,
        **CACHE,
    )
    tokens = [o.outputs[0].token_ids for o in llm.generate(sharegpt_prompts, GREEDY)]
    differ = [i for i, (a, b) in enumerate(zip(tokens, plain_on_cuda)) if a != b]
    assert not differ, f"{len(differ)} of {len(tokens)} prompts differ, e.g. #{differ[0]}"
    assert llm.get_metrics().accepted_tokens > 0


def test_rest_daemon_with_mtp_on_cuda(sharegpt_prompts):
    offline = LLM(device=DEVICE, dtype="float32", num_speculative_tokens=1, **CACHE)
    want = [o.outputs[0].text for o in offline.generate(sharegpt_prompts[:4], GREEDY)]
    del offline
    server = Server(
        f"--devices={DEVICE}", "--dtype=float32", "--num_speculative_tokens=1", startup_timeout=300
    )
    try:
        for prompt, text in zip(sharegpt_prompts[:4], want):
            r = HTTP.post(
                server.url + "/v1/completions",
                json={"prompt": prompt, "max_tokens": 20, "temperature": 0},
                timeout=120,
            )
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == text
    finally:
        assert server.stop() == 0


def test_one_gpu_cluster_through_the_launch_script(tmp_path):
    port = free_port_range(1)
    env = os.environ | {
        "NNODES": "1",
        "DEVICE_TYPE": "cuda",
        "LOG_DIR": str(tmp_path / "log"),
        "START_PORT": str(port),
        "MASTER_NODE_ADDR": f"127.0.0.1:{free_port()}",
        "HEALTH_TIMEOUT": "600",
    }
    try:
        up = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True)
        assert up.returncode == 0, up.stdout + up.stderr
        r = HTTP.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"prompt": "Hello", "max_tokens": 8, "ignore_eos": True},
            timeout=120,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    finally:
        down = subprocess.run(["bash", str(SCRIPT), "stop"], env=env, capture_output=True)
    assert down.returncode == 0


def test_kv_cache_sized_after_profiling_the_largest_step():
    """--max_memory_utilization on CUDA: weights, the profiled activation peak of the
    largest step and the KV cache together fit in that fraction of the device's memory."""
    llm = LLM(device=DEVICE, dtype="float32", max_memory_utilization=0.5)
    worker = llm.engine.core.executor.worker
    peak = worker.profile_activations()
    assert peak > 0
    free, total = torch.cuda.mem_get_info(DEVICE)
    cache = llm.engine.core.blocks.num_blocks * worker.bytes_per_block
    # in use now includes the cache; 64 MiB for the CUDA context's and allocator's slack
    assert total - free + peak <= 0.5 * total + 2**26
    assert cache > 0


def test_fp8_resident_on_cuda_follows_the_dequantised_model(tmp_path):
    """An FP8 checkpoint on CUDA, weights FP8-resident (the block-scaled GEMM where the
    start-up probe accepted it, else the reference) against the same weights dequantised
    to bfloat16 at load: the first generated token's logprob within the bf16 tolerance
    plus activation quantisation's (0.25)."""
    from tools.make_random_checkpoint import make_random_checkpoint
    from xllm_py.ops.fp8_gemm import fp8_gemm_available
    from xllm_py.weights.fp8 import Fp8Weight

    path = make_random_checkpoint(
        tmp_path / "fp8", dict(hidden_size=256, moe_intermediate_size=128), fp8_block=(128, 128)
    )
    prompts = [{"prompt_token_ids": [5, 6, 7, 8 + i]} for i in range(4)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)
    firsts = {}
    for wd in ("bf16", "fp8"):
        llm = LLM(model=str(path), device=DEVICE, dtype="bfloat16", weight_dtype=wd, **CACHE)
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        firsts[wd] = [o.logprobs[0][o.token_ids[0]] for o in outs]
        if wd == "fp8":
            w13 = llm.engine.core.executor.worker.model.model.layers[1].mlp.w13
            assert isinstance(w13, Fp8Weight) and w13.data.device.type == "cuda"
    print("block-scaled FP8 GEMM in use:", fp8_gemm_available(torch.device(DEVICE)))
    assert max(abs(a - b) for a, b in zip(firsts["bf16"], firsts["fp8"])) < 0.25
