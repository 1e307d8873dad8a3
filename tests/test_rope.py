"""RoPE has two forms of one table (models/layers/rope.py): complex multiplies in eager code
on CPU and CUDA, real (cos, sin) arithmetic in compiled graphs and on NPUs. Both rotate
alike, on DeepSeek-V3's own YaRN settings and at its longest positions."""

from __future__ import annotations

import pytest
import torch

from tests.test_config import v3
from xllm_py.config import ModelConfig
from xllm_py.models.layers.rope import RotaryEmbedding, apply_rope


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_rope_rotates_like_the_complex_one(dtype):
    cfg = ModelConfig.from_dict(v3())  # YaRN factor 40 over 4096 positions, as DeepSeek-V3
    assert cfg.rope.type == "yarn" and cfg.max_position_embeddings == 163840
    rotary = RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim, cfg.max_position_embeddings)
    g = torch.Generator().manual_seed(0)
    positions = torch.cat([torch.arange(8), torch.randint(8, 163840, (56,), generator=g)])
    x = torch.randn(64, 17, cfg.qk_rope_head_dim, generator=g).to(dtype)
    complex_form = apply_rope(x, rotary(positions))
    real_form = apply_rope(x, rotary.cos_sin[positions].unsqueeze(1))
    assert real_form.dtype == complex_form.dtype == dtype
    assert (real_form.float() - complex_form.float()).abs().max() <= 1e-6
    # and it is a rotation: pair norms are kept (scaled by YaRN's cos/sin factor)
    scale = cfg.rope.cos_sin_scale
    pairs = x.float().view(64, 17, -1, 2).norm(dim=-1) * scale
    out_pairs = real_form.float().view(64, 17, -1, 2).norm(dim=-1)
    assert out_pairs == pytest.approx(pairs, rel=1e-2 if dtype == torch.bfloat16 else 1e-5)
