"""A hot-vocabulary draft head: the MTP draft's logits over the N tokens the target emits
most often, instead of the whole vocabulary.

Every draft token reads the head: on the bundled model (vocab 8192, hidden 256) that is
about a third of the bytes a step reads; on DeepSeek-V3 (129280 x 7168) it is ~0.9 GB
per draft token at bf16. Restricting the draft's head to the hot tokens cuts that to N
rows. A draft can then only propose hot tokens; it is still a proposal: verification
runs on the target's full distribution, against the distribution q the draft was drawn
from (one-hot for a greedy draft; for a sampled draft q is zero outside the hot tokens:
worker/draft_sampler.py), so the restricted head changes how often drafts are accepted,
never what is emitted.

The token map is a safetensors file (`token_ids` [V'] int64, most frequent first, and
their `counts`), built by tools/build_draft_vocab.py from the target's own continuations
of ShareGPT prompts, stored as `draft_vocab.safetensors` next to the checkpoint or
passed as a file (--speculative_token_map).

By default (--speculative_draft_vocab_size auto) a checkpoint that ships a token map drafts
from the fewest hot tokens that cover AUTO_COVERAGE of the tokens counted in it, rounded
up to a multiple of AUTO_MULTIPLE and at least AUTO_MIN (or a quarter of the vocabulary,
if less): the map counts greedy continuations, and sampled requests draw from a wider
set. A checkpoint without a map, or whose cover would be more than half the vocabulary
(little to save), drafts from the whole vocabulary. Both bundled models get 512 of their
8,208 tokens (99.6% and 100% of what their targets emitted): on the tiny one acceptance is
that of the whole vocabulary, and drafting that measured 0.98x plain decoding's speed
with the whole head ran at 1.08x with these 512 (perf/README.md).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from xllm_py.parallel.context import ParallelContext
from xllm_py.weights.loader import TOKEN_MAP_FILE

__all__ = [
    "TOKEN_MAP_FILE",
    "HotVocabHead",
    "auto_draft_vocab_size",
    "draft_vocab_size",
    "load_token_map",
    "save_token_map",
    "token_map_path",
]

AUTO_COVERAGE = 0.995  # "auto": the share of the map's counted tokens the hot tokens cover
AUTO_MULTIPLE = 64  # "auto": the hot tokens, rounded up to a multiple of this
AUTO_MIN = 512  # "auto": at least this many hot tokens (at most a quarter of the vocabulary)


def save_token_map(path: str | Path, token_ids: torch.Tensor, counts: torch.Tensor) -> None:
    save_file({"token_ids": token_ids.long(), "counts": counts.long()}, str(path))


def token_map_path(token_map: str | None, draft_model: str | None, model: str) -> Path:
    """--speculative_token_map, else the map next to the draft (--draft_model) or the model."""
    return Path(token_map) if token_map else Path(draft_model or model) / TOKEN_MAP_FILE


def auto_draft_vocab_size(path: str | Path, vocab_size: int) -> int:
    """--speculative_draft_vocab_size auto: the hot tokens to draft from with the token map
    at `path` (see the module docstring), 0 (the whole vocabulary) without one."""
    path = Path(path)
    if not path.is_file():
        return 0
    counts = load_file(str(path))["counts"].double()
    total = float(counts.sum())
    if total <= 0:
        return 0
    covered = int((counts.cumsum(0) < AUTO_COVERAGE * total).sum()) + 1
    size = max(-(-covered // AUTO_MULTIPLE) * AUTO_MULTIPLE, min(AUTO_MIN, vocab_size // 4))
    size = min(size, len(counts))
    return size if size <= vocab_size // 2 else 0


def draft_vocab_size(size: int | None, path: str | Path, vocab_size: int, is_v4: bool) -> int:
    """The hot tokens the draft reads (0: the whole vocabulary): --speculative_draft_vocab_size
    `size` as given, or for None ("auto") sized from the token map at `path`; never for
    DeepSeek-V4, whose draft has no hot head."""
    if size is not None:
        return size
    return 0 if is_v4 else auto_draft_vocab_size(path, vocab_size)


def load_token_map(path: str | Path, size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent token ids of the map at `path`, [size] int64."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(
            f"speculative_draft_vocab_size={size} needs a token map: no {path} (build one "
            "with tools/build_draft_vocab.py, or pass --speculative_token_map)"
        )
    ids = load_file(str(path))["token_ids"]
    if not 0 < size <= len(ids):
        raise ValueError(
            f"speculative_draft_vocab_size={size}: the token map {path} holds {len(ids)} tokens"
        )
    ids = ids[:size]
    if ids.min() < 0 or ids.max() >= vocab_size or len(ids.unique()) != len(ids):
        raise ValueError(f"{path}: token ids must be distinct and in [0, {vocab_size})")
    return ids


class HotVocabHead:
    """The LM head's rows for `token_ids`, whole on every rank (under tensor parallelism
    each rank contributes the rows it holds and one all-reduce at start-up completes the
    table: every entry has one non-zero term, so the sum is exact)."""

    def __init__(self, lm_head, token_ids: torch.Tensor, parallel: ParallelContext) -> None:
        weight = lm_head.weight  # [vocab / tp, hidden]: this rank's rows
        start = parallel.tp_rank * weight.shape[0]
        self.token_ids = token_ids.to(weight.device)
        local = self.token_ids - start
        mine = (local >= 0) & (local < weight.shape[0])
        rows = weight.new_zeros(len(token_ids), weight.shape[1])
        rows[mine] = weight[local[mine]]
        self.weight = parallel.all_reduce(rows).contiguous()  # [N, hidden]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] (after the draft's head norm) -> logits of the hot tokens [T, N]."""
        return F.linear(x, self.weight)
