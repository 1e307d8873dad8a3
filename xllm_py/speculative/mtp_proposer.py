"""Draft tokens from the model's own MTP layer(s).

After every target pass that drafts, one batched MTP pass runs over each request's
newly verified positions i (prefill chunks too, so the MTP layer's own latent cache is
filled up to the verified length; a step that does not draft, adaptive k = 0 or the
draft gate's plain periods, runs none and leaves those positions' slots unwritten):

    input   h_i (target hidden after the final norm) and t_{i+1}
    output  MTP block state x_i; logits at the request's last verified
            position predict its first draft token

Draft step s (s = 1..k-1) runs MTP layer `s mod n` (n MTP layers) one position
further, on the previous step's block state and its own draft token. The state is
chained *before* `shared_head.norm` (vLLM's choice; SGLang chains after it). On the
bundled model (8 held-out ShareGPT prompts, batch 8, k = 3, 48 tokens) both gave the
same mean acceptance length (2.09 before vs 2.11 after, within noise).

Each MTP layer attends over its own latent cache, so every layer a step will use
(layers 0..min(k, n)-1) runs over the newly verified positions, all on the same
(h_i, t_{i+1}) inputs; only layer 0's output feeds the first draft. With n = 1 the
one layer is reused for every step and its cache has no gaps. With n > 1, k <= n
(the loader refuses more): step s then uses layer s, whose cache holds the verified
positions plus the one it writes now; chaining past the last layer would attend
over positions that layer never wrote.

Draft positions live in the request's own blocks: the scheduler reserves k
look-ahead slots, and entries written for drafts that are later rejected are
overwritten when those positions are verified.

A greedy request's draft is the argmax of the draft's logits; a sampled request's is drawn
by the model runner's `choose` (worker/draft_sampler.py) from those logits after the
request's own processing. With a hot-vocabulary head (speculative/hot_vocab.py) the logits
cover the N hot tokens only; the target still verifies over the whole vocabulary.

Graph mode (worker/graph_runner.py, one runner per MTP layer in `graphs`): a pass
whose requests each have at most 1 + k rows (the first pass after a decode or
verification step) or one row (a chained step) runs in its layer's graph, each
request's rows padded to the bucket's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from xllm_py.models.attention_layout import RequestLayout, build_context
from xllm_py.models.context import forward_context
from xllm_py.models.deepseek_mtp import DeepseekV3MTP
from xllm_py.models.layers.moe import idle_forward
from xllm_py.speculative.hot_vocab import HotVocabHead
from xllm_py.structured import Matcher, allocate_bitmask, unpack_bitmask


def graph_q_lens(k: int, num_layers: int) -> dict[int, tuple[int, ...]]:
    """MTP layer -> the query lengths its passes take in graph mode (k drafts, `num_layers`
    MTP layers): 1 + k for the first pass (every layer a step uses fills its cache there),
    1 for the chained steps it runs."""
    out = {}
    for layer in range(min(k, num_layers)):
        chained = any(step % num_layers == layer for step in range(1, k))
        out[layer] = (1 + k, 1) if chained else (1 + k,)
    return out


@dataclass
class ProposeInput:
    req_id: str
    rows: list[int]  # rows of the target batch holding newly verified positions, in order
    start: int  # position of the first of them
    next_ids: list[int]  # t_{i+1} for each of those positions
    block_ids: list[int]
    wants_drafts: bool  # False while a prompt is still being prefilled
    matcher: Matcher | None = None  # structured output: drafts only what the grammar allows
    sampled: bool = False  # draws its drafts through `MTPProposer.choose` (a sampled request)


class MTPProposer:
    def __init__(
        self,
        draft: DeepseekV3MTP,
        num_tokens: int,
        kv_caches: list[torch.Tensor],
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        max_len: int,
        *,
        hot: HotVocabHead | None = None,
        graphs: dict[int, Any] | None = None,
        choose: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        """`hot`: drafts from the hot tokens only (--speculative_draft_vocab_size);
        `graphs`: MTP layer -> its worker/graph_runner.GraphRunner in graph mode (the
        layers and query lengths `graph_q_lens` names); `choose`: with sampled drafts,
        (logits [T, V], request ids, draft step, drafts so far) -> (draft tokens [T],
        scores [T]) (worker/draft_sampler.py); None: the argmax."""
        self.draft = draft
        self.max_len = max_len  # positions must stay below the context length
        self.k = num_tokens
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.graphs = graphs or {}
        self.hot = hot
        self.choose = choose

    def propose(
        self, items: list[ProposeInput], target_hidden: torch.Tensor | None, k: int | None = None
    ) -> tuple[list[list[int]], list[list[float]]]:
        """Per item, its drafts (k tokens, or none) and their scores (the top probability of
        the distribution each was drawn from: speculative/confidence.py calibrates them). `k`
        below the configured number (adaptive speculation) shortens the chain; every layer
        the configured number uses still fills its cache. Under DP attention the ranks
        first agree on the passes, and this rank joins those it has no tokens for
        (models/layers/moe.py); `items` may then be empty and `target_hidden` None."""
        k = self.k if k is None else min(k, self.k)
        want = [i for i, it in enumerate(items) if it.wants_drafts]
        fill, chain = bool(items), k if want else 0  # this rank's passes
        lockstep = self.draft.parallel.dp_attention
        if lockstep:
            fill, chain = self.draft.parallel.max_over_dp([int(fill), chain], self.device)
        drafts: list[list[int]] = [[] for _ in items]
        scores: list[list[float]] = [[] for _ in items]
        if not fill:
            return drafts, scores
        fills = range(1, min(self.k, len(self.draft.layers)))  # the later layers' caches
        if not items:
            for step in [0, *fills, *range(1, chain)]:
                self._idle(step)
            return drafts, scores
        rows = [r for it in items for r in it.rows]
        next_ids = [t for it in items for t in it.next_ids]
        positions = [it.start + j for it in items for j in range(len(it.rows))]
        layouts, start = [], 0
        for it in items:
            n = len(it.rows)
            layouts.append(RequestLayout(start, n, it.start + n, it.block_ids))
            start += n
        hidden = target_hidden[torch.tensor(rows, device=self.device)]
        x = self._run(next_ids, positions, hidden, layouts, step=0)
        for layer in fills:
            self._run(next_ids, positions, hidden, layouts, step=layer)
        if not want:
            for step in range(1, chain):
                self._idle(step)
            return drafts, scores
        last = torch.tensor(
            [layouts[i].start + layouts[i].q_len - 1 for i in want], device=self.device
        )
        x = x[last]
        followed = {i: 0 for i in want if items[i].matcher is not None}  # drafts to undo
        tokens, score = self._draft_tokens(x, 0, [items[i] for i in want], drafts, want)
        for i, t, c in zip(want, tokens.tolist(), score.tolist()):
            drafts[i].append(t)
            scores[i].append(c)
        for step in range(1, chain):
            # Chained draft j sits at (last verified position + j); stop at the context end,
            # or where the grammar is done (or refuses the draft).
            keep = [
                n
                for n, i in enumerate(want)
                if step < k
                and self._last(items[i]) + step < self.max_len
                and (i not in followed or self._follow(i, items[i], drafts[i][-1], followed))
            ]
            if not keep:
                if not lockstep:
                    break
                self._idle(step)  # the other ranks' chains go on
                want = []
                continue
            if len(keep) < len(want):
                want, x, tokens = [want[n] for n in keep], x[keep], tokens[keep]
            chain_layouts = [
                RequestLayout(j, 1, self._last(items[i]) + step + 1, items[i].block_ids)
                for j, i in enumerate(want)
            ]
            pos = [lay.ctx_len - 1 for lay in chain_layouts]
            x = self._run(tokens.tolist(), pos, x, chain_layouts, step)
            tokens, score = self._draft_tokens(x, step, [items[i] for i in want], drafts, want)
            for i, t, c in zip(want, tokens.tolist(), score.tolist()):
                drafts[i].append(t)
                scores[i].append(c)
        for i, n in followed.items():
            items[i].matcher.rollback(n)
        return drafts, scores

    def _idle(self, step: int) -> None:
        """DP attention: join draft pass `step`'s expert exchange with no tokens."""
        idle_forward(self.draft.layers[step % len(self.draft.layers)], self.dtype, self.device)

    @staticmethod
    def _follow(i: int, item: ProposeInput, draft: int, followed: dict[int, int]) -> bool:
        """Advance item i's grammar by its last draft (undone after drafting); False if
        the grammar refuses it or is complete: no draft can follow."""
        m = item.matcher
        if m.terminated or not m.accept(draft):
            return False
        followed[i] += 1
        return not m.terminated

    def _allowed(self, items: list[ProposeInput]) -> torch.Tensor | None:
        """Bool [T, vocab]: the tokens each item's grammar allows next (all, without one)."""
        if all(it.matcher is None for it in items):
            return None
        vocab = next(it.matcher for it in items if it.matcher is not None).vocab_size
        bitmask = allocate_bitmask(len(items), vocab)  # all allowed
        for n, it in enumerate(items):
            if it.matcher is not None and not it.matcher.terminated:
                it.matcher.fill(bitmask, n)
        return unpack_bitmask(bitmask, vocab).to(self.device)

    def _draft_tokens(
        self, x: torch.Tensor, step: int, items: list[ProposeInput], drafts, want: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft tokens [T] from block outputs x [T, hidden] of `items` (drafts: every
        item's drafts so far, `want` the indices of these), and each one's score [T]: the
        top probability of the distribution it was drawn from. The logits cover the whole vocabulary
        or the hot tokens (speculative/hot_vocab.py), among the tokens each row's grammar
        allows. Greedy: their argmax, scored by its probability (the top one); with a sampled
        item, `choose` draws from them."""
        allowed = self._allowed(items)
        sampled = self.choose is not None and any(it.sampled for it in items)
        if self.hot is not None:
            logits = self.hot.logits(self.draft.head_norm(x, step)).float()
            if allowed is not None:
                logits = logits.masked_fill(~allowed[:, self.hot.token_ids], float("-inf"))
            if sampled:
                full = logits.new_full((len(items), self.draft.config.vocab_size), float("-inf"))
                full[:, self.hot.token_ids] = logits
                logits = full
        else:
            logits = self.draft.compute_logits(x, step).float()
            if allowed is not None:
                logits = logits.masked_fill(~allowed, float("-inf"))
        if sampled:
            return self.choose(logits, [it.req_id for it in items], step, [drafts[i] for i in want])
        score, top = torch.softmax(logits, dim=-1).max(dim=-1)
        tokens = top if self.hot is None else self.hot.token_ids[top]
        return tokens, score.nan_to_num(0.0)  # nan: the grammar allows no (hot) token here

    @staticmethod
    def _last(item: ProposeInput) -> int:
        return item.start + len(item.rows) - 1  # the request's last verified position

    def _run(self, ids, positions, hidden, layouts: list[RequestLayout], step: int) -> torch.Tensor:
        graphs = self.graphs.get(step % len(self.draft.layers))
        key = None if graphs is None else graphs.bucket_for(layouts)
        if key is not None:
            return graphs.run(key, ids, positions, layouts, [hidden])
        pos = torch.tensor(positions, device=self.device)
        ctx = build_context(layouts, pos, self.kv_caches, self.block_size)
        with forward_context(ctx):
            return self.draft(torch.tensor(ids, device=self.device), pos, hidden, step)
