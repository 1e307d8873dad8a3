"""DeepSeek-V3's Multi-Token-Prediction (MTP) layers, as a draft model.

Each MTP layer j is an ordinary decoder layer (the target's own class: MLA +
MoE) with three extra pieces in front and one behind:

    x = eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)])     # [hidden, 2*hidden]
    x = decoder_block(x)                                   # own slice of the paged cache
    logits = lm_head(shared_head.norm(x))                  # predicts t_{i+2}

`embed` and `lm_head` are the target's, shared in memory: checkpoints carry
copies (`embed_tokens`, `shared_head.head`), which the loader checks are equal
to the target's and then drops. Under tensor parallelism the target holds
vocab_size / tp rows of each (models/layers/vocab_parallel.py), and the check
compares the copy's same rows.

Tensor/expert parallel: the decoder block is sharded exactly like the
target's layers (same classes, same `ParallelContext`, by default the
target's); enorm, hnorm, eh_proj and shared_head.norm are replicated; the
embedding and head are the target's vocabulary-split ones (logits gathered).

Checkpoint layouts (`draft_name_map`):
  in the target checkpoint  model.layers.{N + j}.{block | enorm | hnorm | eh_proj | shared_head.*}
  exported (tools/export_deepseek_mtp.py)
                            model.layers.{j}.{block},
                            model.{enorm | hnorm | eh_proj | shared_head.*}
                            (with several MTP layers: model.layers.{j}.{enorm | ...})
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn

from xllm_py.config import ModelConfig
from xllm_py.models.deepseek_v3 import DecoderLayer, DeepseekV3ForCausalLM, process_tree
from xllm_py.models.layers.linear import Linear
from xllm_py.models.layers.norm import RMSNorm
from xllm_py.parallel.context import SINGLE, ParallelContext

DRAFT_ARCHITECTURE = "DeepseekV3MtpForCausalLM"
V4_DRAFT_ARCHITECTURE = "DeepseekV4MtpForCausalLM"  # a V4 checkpoint's mtp.* layers
# The fields an exported draft must share with its target, by family.
_SHARED_FIELDS = (
    "hidden_size", "vocab_size", "num_attention_heads", "kv_lora_rank", "qk_rope_head_dim",
    "qk_nope_head_dim", "v_head_dim", "n_routed_experts",
)  # fmt: skip
_V4_SHARED_FIELDS = (
    "hidden_size", "vocab_size", "num_attention_heads", "head_dim", "hc_mult",
    "n_routed_experts", "moe_intermediate_size", "sliding_window",
)  # fmt: skip


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, j: int, parallel: ParallelContext = SINGLE) -> None:
        n = cfg.num_hidden_layers
        super().__init__(cfg, layer_idx=n + j, cache_index=n + j, parallel=parallel)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size)
        self.shared_head = SharedHead(cfg)

    def predict(
        self, hidden: torch.Tensor, next_embeds: torch.Tensor, rope, q_scale=None
    ) -> torch.Tensor:
        """h_i [T, hidden] and embed(t_{i+1}) [T, hidden] -> block output [T, hidden]."""
        x = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden)], dim=-1))
        h, delta = self(x, rope, None, q_scale)
        return h + delta  # the block output is used twice (head norm, next step's hnorm)


class DeepseekV3MTP(nn.Module):
    """The draft: `num_mtp_layers` MTP layers on top of a loaded target model, sharded like
    it (`parallel` defaults to the target's)."""

    def __init__(
        self,
        cfg: ModelConfig,
        target: DeepseekV3ForCausalLM,
        num_mtp_layers: int,
        parallel: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        if num_mtp_layers < 1:
            raise ValueError(
                f"{cfg.path}: num_nextn_predict_layers={num_mtp_layers}: the checkpoint has no MTP "
                "layer to draft with"
            )
        self.config = cfg
        self.parallel = target.parallel if parallel is None else parallel
        self.layers = nn.ModuleList(MTPLayer(cfg, j, self.parallel) for j in range(num_mtp_layers))
        # Shared with the target, deliberately not registered (not part of this model's state).
        self._target = [target]

    @property
    def target(self) -> DeepseekV3ForCausalLM:
        return self._target[0]

    @property
    def cache_dims(self) -> list[int]:
        """Numbers per token of each MTP layer's cache rows (a latent row each)."""
        return [self.config.kv_cache_dim] * len(self.layers)

    def process_weights_after_loading(self) -> None:
        process_tree(self)

    def forward(
        self, next_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, step: int = 0
    ) -> torch.Tensor:
        """Draft step `step` (layer step mod num layers) at `positions` [T]: the previous
        hidden state there [T, hidden] and the token after it [T] -> block output [T, hidden]."""
        layer = self.layers[step % len(self.layers)]
        rope, q_scale = self.target.rotary(positions), self.target.query_scale(positions)
        return layer.predict(hidden, self.target.model.embed_tokens(next_ids), rope, q_scale)

    def head_norm(self, x: torch.Tensor, step: int = 0) -> torch.Tensor:
        """The block output of step `step`, normalised for the (shared) head."""
        return self.layers[step % len(self.layers)].shared_head.norm(x)

    def compute_logits(self, x: torch.Tensor, step: int = 0) -> torch.Tensor:
        return self.target.compute_logits(self.head_norm(x, step))


def draft_name_map(names: list[str], num_hidden_layers: int, num_mtp: int, exported: bool):
    """Checkpoint name -> (draft parameter name | None to skip | ("shared", target name))."""
    layer = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
    top = re.compile(
        r"^model\.(enorm|hnorm|eh_proj|shared_head\.norm|shared_head\.head|embed_tokens)\.(.+)$"
    )
    out: dict[str, object] = {}
    for name in names:
        m = layer.match(name)
        if m:
            i, rest = int(m.group(1)), m.group(2)
            j = i if exported else i - num_hidden_layers
            if not 0 <= j < num_mtp:
                out[name] = None  # a target layer (in the target checkpoint)
            else:
                out[name] = _map_rest(rest, j)
            continue
        m = top.match(name)
        if exported and m and num_mtp == 1:
            out[name] = _map_rest(f"{m.group(1)}.{m.group(2)}", 0)
        elif exported and name == "model.embed_tokens.weight":
            out[name] = ("shared", "model.embed_tokens.weight")
        else:
            out[name] = None if not exported else name  # unexpected in an exported draft
    return out


def _map_rest(rest: str, j: int):
    if rest.startswith("embed_tokens."):
        return ("shared", "model.embed_tokens.weight")
    if rest.startswith("shared_head.head."):
        return ("shared", "lm_head.weight")
    return f"layers.{j}.{rest}"


def read_draft_config(path: str | Path, target: ModelConfig) -> int:
    """Check an exported draft's config.json against the target; return its MTP layer count."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"draft_model={str(path)!r}: no config.json in that directory")
    cfg = json.loads(cfg_file.read_text())
    archs = cfg.get("architectures") or []
    arch = V4_DRAFT_ARCHITECTURE if target.is_v4 else DRAFT_ARCHITECTURE
    if arch not in archs:
        raise ValueError(
            f"draft_model={str(path)!r}: architectures={archs!r}; expected [{arch!r}] for "
            f"{target.architecture} (made by tools/export_deepseek_mtp.py)"
        )
    for field in _V4_SHARED_FIELDS if target.is_v4 else _SHARED_FIELDS:
        if cfg.get(field) != target.raw.get(field):
            raise ValueError(
                f"draft_model={str(path)!r}: {field}={cfg.get(field)} but the target has "
                f"{target.raw.get(field)}"
            )
    # a V4 draft keeps the target's layer count (its layers' cache rows follow them)
    return int(cfg["num_nextn_predict_layers" if target.is_v4 else "num_hidden_layers"])


def check_shared_copy(name: str, stored: torch.Tensor, target_tensor: torch.Tensor) -> None:
    """The draft's copy must equal the target's tensor, compared at the coarser of the two
    dtypes (an exported bf16 copy of a float32 target compares as bf16). A target tensor
    holding a slice of the checkpoint's (`target_tensor.shard`: this rank's vocabulary rows)
    is compared with the same slice of the copy."""
    shard = getattr(target_tensor, "shard", None)
    target_tensor = target_tensor.detach()
    full = tuple(target_tensor.shape) if shard is None else shard.full_shape(target_tensor.shape)
    if tuple(stored.shape) != full:
        raise ValueError(
            f"draft tensor {name!r} has shape {tuple(stored.shape)} but the target's copy has "
            f"{full}"
        )
    if shard is not None:
        stored = shard.take(stored)
    stored = stored.to(target_tensor.device)  # read on the CPU; the target may be on a GPU
    if torch.equal(stored.to(target_tensor.dtype), target_tensor):  # the target's own cast
        return
    coarse = min(stored.dtype, target_tensor.dtype, key=lambda d: torch.finfo(d).eps * -1)
    if not torch.equal(stored.to(coarse), target_tensor.to(coarse)):
        raise ValueError(
            f"draft tensor {name!r} should be a copy of the target's tensor but differs from it"
        )
