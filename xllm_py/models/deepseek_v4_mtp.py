"""DeepSeek-V4's Multi-Token-Prediction layer, as a draft model.

The release keeps it beside the target as `mtp.{j}.*` (V4-Flash and V4-Pro: one layer,
`num_nextn_predict_layers` = 1): a V4 decoder block with four pieces in front and a head
behind. It drafts from the target's residual STREAMS, not from a collapsed hidden state:

    z = h_proj(hnorm(streams_i)) + e_proj(enorm(embed(t_{i+1})))   # per stream, [hc, hidden]
    streams' = block(z)                                             # its own cache rows
    logits = head(norm(hc_collapse(streams')))                      # predicts t_{i+2}

`hnorm` and `h_proj` act on each of the hc_mult streams alone, `e_proj`'s output is added to
every stream (two projections summed, where V3 concatenates and projects once). The block
is a sliding-window layer (no compressor, no indexer: the release's last `compress_ratios`
entry is 0) with score-routed MoE (no `tid2eid`), rotated by the main RoPE; it attends over
its own cache rows (cache layer num_hidden_layers + j), written for the positions the MTP
passes run at. `hc_collapse` is the target's `hc_head` form with this layer's own
`hc_head_fn/base/scale`, `norm` its own; `embed` and `head` are the target's, shared in
memory (the release carries no copies). A chained draft step feeds the block's output
streams back as the next step's `streams_i`, before the collapse (vLLM's and SGLang's
choice; DeepSeek's reference drafts one token).

The 0731 releases carry a DSpark drafter under the same names instead; config.py tells the
two apart by their tensors and refuses DSpark.
"""

from __future__ import annotations

import torch
from torch import nn

from xllm_py.models.deepseek_v3 import process_tree
from xllm_py.models.deepseek_v4 import DecoderLayer, DeepseekV4ForCausalLM, collapse
from xllm_py.models.deepseek_v4_config import SLIDING, V4Config
from xllm_py.models.layers.compressed_attention import linear
from xllm_py.models.layers.norm import RMSNorm


class MTPLayer(DecoderLayer):
    """The block (`attn.*`, `ffn.*`, `hc_attn_*`, ... as a target layer's) and the pieces
    around it, all `mtp.{j}.*` in the release."""

    def __init__(self, cfg: V4Config, j: int, ropes, parallel) -> None:
        super().__init__(cfg, cfg.num_hidden_layers + j, ropes, kind=SLIDING, parallel=parallel)
        n, hidden = cfg.hc_mult, cfg.hidden_size
        self.e_proj, self.h_proj = linear(hidden, hidden), linear(hidden, hidden)
        self.enorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.hc_head_fn = nn.Parameter(torch.zeros(n, n * hidden))
        self.hc_head_base = nn.Parameter(torch.zeros(n))
        self.hc_head_scale = nn.Parameter(torch.ones(1))

    def head_input(self, streams: torch.Tensor) -> torch.Tensor:
        """Block output streams [T, hc, hidden] -> the head's input [T, hidden]."""
        return self.norm(collapse(streams, self.hc_head_fn, self.hc_head_base,
                                  self.hc_head_scale, self.cfg))  # fmt: skip


class DeepseekV4MTP(nn.Module):
    """The draft: `num_mtp_layers` MTP layers over a loaded V4 target, sharded as the
    target is (its `parallel`). The proposer (speculative/mtp_proposer.py) drives it as it
    drives V3's."""

    def __init__(self, cfg: V4Config, target: DeepseekV4ForCausalLM, num_mtp_layers: int) -> None:
        super().__init__()
        if num_mtp_layers < 1:
            raise ValueError(
                f"num_nextn_predict_layers={num_mtp_layers}: the checkpoint has no MTP layer "
                "to draft with"
            )
        self.config = cfg
        self.parallel = target.parallel
        self.mtp = nn.ModuleList(
            MTPLayer(cfg, j, target.model.ropes, target.parallel) for j in range(num_mtp_layers)
        )
        self._target = [target]  # shared, deliberately not registered

    @property
    def target(self) -> DeepseekV4ForCausalLM:
        return self._target[0]

    @property
    def layers(self) -> nn.ModuleList:
        return self.mtp

    @property
    def cache_dims(self) -> list[int]:
        """Numbers per token of each MTP layer's cache rows."""
        return [layer.attn.cache_width for layer in self.mtp]

    def process_weights_after_loading(self) -> None:
        process_tree(self)

    def forward(
        self, next_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, step: int = 0
    ) -> torch.Tensor:
        """Draft step `step` at `positions` [T]: the streams there [T, hc, hidden] (the
        target's, or the previous step's output) and the token after each [T] -> the
        block's output streams [T, hc, hidden]."""
        layer = self.mtp[step % len(self.mtp)]
        views, cis = self.target.views_and_rotations(positions)
        e = layer.e_proj(layer.enorm(self.target.model.embed_tokens(next_ids)))
        z = layer.h_proj(layer.hnorm(hidden)) + e.unsqueeze(1)
        return layer(z, next_ids, cis, views)

    def head_norm(self, x: torch.Tensor, step: int = 0) -> torch.Tensor:
        """Block output streams of step `step` -> the (shared) head's input."""
        return self.mtp[step % len(self.mtp)].head_input(x)

    def compute_logits(self, x: torch.Tensor, step: int = 0) -> torch.Tensor:
        return self.target.head(self.head_norm(x, step)).float()
