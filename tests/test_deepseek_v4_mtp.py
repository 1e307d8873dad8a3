"""DeepSeek-V4's MTP draft (models/deepseek_v4_mtp.py) through the engine. The tiny HF
checkpoints of test_deepseek_v4.py (HF transformers does not model the MTP layer) get a
random one in the release's layout, `mtp.0.*` beside the target's tensors. Drafts from a
random layer are rarely right, so these tests are about losslessness, the one promise MTP
makes: with every draft verified (confidence scheduling off),

- greedy: 32 ragged prompts give plain decoding's tokens at k = 1 and k = 3, on both
  configs (sliding / CSA / HCA layers, hc_mult 2 and 4), drafts verified and some accepted;
- sampled (drafts drawn from the draft's distribution, the default): at temperature 1.0,
  k = 2, the tokens at every generated position keep plain decoding's distribution
  (tests/test_spec_sampling_distribution.py's chi-square test and helpers).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import tests.test_spec_sampling_distribution as dist
from tests.test_deepseek_v4 import CONFIGS, drawn, hf_checkpoint
from tests.test_deepseek_v4_engine import generate, tokens
from xllm_py.models.deepseek_v4 import DeepseekV4ForCausalLM, V4Config
from xllm_py.models.deepseek_v4_mtp import DeepseekV4MTP

PROMPTS = [[(11 * i + 5 * j) % 90 + 3 for j in range(3 + (7 * i) % 29)] for i in range(32)]
SAMPLES = 1000  # per arm


def with_mtp(name: str, path, seed: int = 1):
    """hf_checkpoint's model and one random MTP layer, saved as `mtp.0.*` in a file of its
    own (the release keeps it in its last shard)."""
    hf_checkpoint(name, path)
    cfg = V4Config.from_dict(json.loads((path / "config.json").read_text()))
    draft = DeepseekV4MTP(cfg, DeepseekV4ForCausalLM(cfg), 1)
    gen = torch.Generator().manual_seed(seed)
    state = {n: drawn(n, t.shape, gen) for n, t in draft.state_dict().items()}
    save_file(state, path / "model-mtp.safetensors")
    return path


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    return with_mtp(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def plain(checkpoint):
    return tokens(generate(checkpoint, PROMPTS)[1])


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_output_is_identical_under_mtp(checkpoint, plain, k):
    llm, outs = generate(checkpoint, PROMPTS, num_speculative_tokens=k,
                         speculative_confidence="off")  # fmt: skip
    assert tokens(outs) == plain
    m = llm.get_metrics()
    assert m.draft_tokens > len(PROMPTS) and 0 < m.accepted_tokens < m.draft_tokens


def test_sampled_drafts_keep_the_distribution(tmp_path):
    path = with_mtp(next(iter(CONFIGS)), tmp_path)
    ids = [(5 * j) % 90 + 3 for j in range(2 * dist.BLOCK + 1)]
    opts = dict(model=str(path), speculative_confidence="off")
    plain = dist.draw(dist.engine(0, 1, **opts), ids, "t1.0", samples=SAMPLES)
    llm = dist.engine(2, 2, **opts)
    spec = dist.draw(llm, ids, "t1.0", samples=SAMPLES)
    m = llm.get_metrics()
    assert 0 < m.accepted_tokens < m.draft_tokens
    dist.assert_same_distribution(plain, spec, "V4, MTP k=2 vs plain, t1.0")
