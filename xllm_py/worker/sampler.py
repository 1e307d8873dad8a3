"""Turn logits into tokens, batched over requests with different parameters.

Order of operations for a row: logit bias, then the repetition, frequency and
presence penalties (over the tokens before the row's position: the prompt, the
outputs so far and, on a verification row, the drafts before it), then min_tokens
masking (EOS / stop ids -> -inf until `min_tokens` outputs exist), then a structured
output's grammar (tokens it does not allow at the row's position -> -inf), then greedy
argmax, or temperature, top-k, top-p and min-p filtering and a draw. Logprobs are
reported from the raw model distribution (log_softmax of the unprocessed logits),
as vLLM does.

Seeded rows are reproducible whatever else is in the batch: all filtering is
row-local and done in vocabulary order, and the draw is an exponential race
(argmax of p / E, E ~ Exp(1)) whose noise comes from a generator seeded by
(seed, index of the output token), so it does not depend on batch position,
on earlier steps, or on preemption. The race is what lets a seeded request's draft and
its verification row share one draw (worker/draft_sampler.py). Unseeded rows need no such
coupling and draw by inverse CDF, in two levels: a block of BLOCK tokens in proportion to
its mass, then a token of that block in proportion to its own. Each token's chance is
right to float rounding relative to its own probability, as the race's is, while a
single float32 cumsum over the vocabulary would be off by up to 1e-7 of the whole mass at
every token. It costs one uniform per level and row instead of an exponential per token:
2,048 rows x 8,208 tokens here, 18 ms against the race's 720 ms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_SEED_STRIDE = 0x9E3779B97F4A7C15  # spreads (seed, token index) pairs over 64-bit seeds
BLOCK = 64  # tokens per block of the unseeded rows' two-level inverse-CDF draw


@dataclass
class LogitAdjust:
    """Penalties and logit bias of the rows that have any (`rows`), as dense tensors."""

    rows: torch.Tensor  # [A] long: which rows of the batch
    counts: torch.Tensor  # [A, V] float32: each token's count in the outputs before the row
    seen: torch.Tensor  # [A, V] bool: in the prompt or those outputs
    presence: torch.Tensor  # [A, 1]
    frequency: torch.Tensor  # [A, 1]
    repetition: torch.Tensor  # [A, 1]
    bias: torch.Tensor | None  # [A, V], None when no row has a logit bias

    def apply(self, logits: torch.Tensor) -> None:
        x = logits[self.rows]
        if self.bias is not None:
            x = x + self.bias
        rep = self.repetition
        x = torch.where(self.seen, torch.where(x > 0, x / rep, x * rep), x)
        x = x - self.frequency * self.counts - self.presence * (self.counts > 0)
        logits[self.rows] = x


@dataclass
class SamplingBatch:
    """Per-row parameters of one step, built by the model runner."""

    temperature: torch.Tensor  # [R] float32; 1.0 on greedy rows (unused there)
    greedy: torch.Tensor  # [R] bool
    all_greedy: bool
    top_k: torch.Tensor | None  # [R] long, vocab size where disabled; None: no row uses it
    top_p: torch.Tensor | None  # [R] float32, 1.0 where disabled
    min_p: torch.Tensor | None  # [R] float32, 0.0 where disabled
    seeds: list[tuple[int, int]]  # (row, seed for this token)
    banned: list[tuple[int, list[int]]]  # (row, token ids masked for min_tokens)
    max_logprobs: int | None  # largest N requested, None if no row wants logprobs
    adjust: LogitAdjust | None = None  # penalties and logit bias; None: no row has any
    # structured outputs: (packed token bitmask [G, V/32], the G rows it applies to)
    grammar: tuple[torch.Tensor, list[int]] | None = None
    some_greedy: bool = True  # False: no row is greedy (nothing to make one-hot)

    @classmethod
    def greedy_rows(
        cls, banned=(), max_logprobs: int | None = None, adjust: LogitAdjust | None = None
    ) -> SamplingBatch:
        """A batch in which every row is greedy: no per-row tensors are needed."""
        return cls(None, None, True, None, None, None, [], list(banned), max_logprobs, adjust)


def token_seed(seed: int, output_index: int) -> int:
    return (seed + (output_index + 1) * _SEED_STRIDE) % (1 << 63)


class Sampler:
    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def __call__(
        self, logits: torch.Tensor, batch: SamplingBatch
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """logits [R, V] float32 -> (tokens [R], chosen logprob [R], top (values, ids) [R, N])."""
        logprobs = None if batch.max_logprobs is None else torch.log_softmax(logits, dim=-1)
        _prepare(logits, batch)
        greedy_tokens = logits.argmax(dim=-1)
        if batch.all_greedy:
            tokens = greedy_tokens
        else:
            probs = _processed(logits, batch)
            tokens = torch.where(batch.greedy, greedy_tokens, self.draws(probs, batch).pick(probs))
        return (tokens, *logprob_details(logprobs, tokens, batch.max_logprobs))

    def greedy(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Argmax per row after bias, penalties and the min_tokens bans [R]."""
        _prepare(logits, batch)
        return logits.argmax(dim=-1)

    def probabilities(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The distribution each row samples from [R, V]: one-hot on greedy rows."""
        _prepare(logits, batch)
        if not batch.some_greedy:
            return _processed(logits, batch)
        onehot = torch.zeros_like(logits).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        if batch.all_greedy:
            return onehot
        return torch.where(batch.greedy.unsqueeze(1), onehot, _processed(logits, batch))

    def draws(self, probs: torch.Tensor, batch: SamplingBatch) -> Draws:
        """The random numbers of one step's rows (probs [R, V]: their distributions)."""
        return Draws(self.generator, probs, batch.seeds)


class Draws:
    """One step's random numbers, row by row: a uniform in [0, 1) (`uniform` [R]), and the
    draws of tokens (`pick`). Unseeded rows take both from the engine's generator, fresh
    numbers at every pick; a seeded row from a generator seeded by (seed, output index),
    its tokens by an exponential race on one noise vector for all its picks."""

    def __init__(
        self, generator: torch.Generator | None, like: torch.Tensor, seeds: list[tuple[int, int]]
    ) -> None:
        self.generator = generator
        self.uniform = torch.rand(like.shape[0], generator=generator, device=like.device)
        self.noise: dict[int, torch.Tensor] = {}  # seeded row -> its race noise [V]
        for row, seed in seeds:
            self.uniform[row], self.noise[row] = seeded_draws(seed, like[row])

    def pick(self, weights: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
        """One token per row of `weights` [n, V] (non-negative, any scale, some positive),
        drawn in proportion to them; rows[i] is the batch row of weights[i] (None: i)."""
        tokens = _inverse_cdf(weights, self.generator)
        for row, noise in self.noise.items():
            at = [row] if rows is None else [i for i, r in enumerate(rows) if r == row]
            for i in at:
                tokens[i] = (weights[i] / noise).argmax()
        return tokens


def seeded_draws(seed: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The uniform and the exponential race noise [V] of one seeded row (`seed` from
    token_seed): the same numbers wherever and whenever they are drawn, so a sampled draft
    can race on the noise its verification row will use (worker/draft_sampler.py)."""
    g = torch.Generator(device=like.device).manual_seed(seed)
    uniform = torch.rand((), generator=g, device=like.device)
    return uniform, torch.empty_like(like).exponential_(generator=g)


def _inverse_cdf(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """A token per row in proportion to `weights` [R, V]: a block of BLOCK tokens by its
    mass, then a token within it (the module docstring says why two levels)."""
    rows, vocab = weights.shape
    full = vocab // BLOCK * BLOCK
    mass = weights[:, :full].reshape(rows, -1, BLOCK).sum(dim=-1)
    if full < vocab:
        mass = torch.cat([mass, weights[:, full:].sum(dim=-1, keepdim=True)], dim=1)
    block = _search(mass.double(), generator)
    ids = block.unsqueeze(1) * BLOCK + torch.arange(BLOCK, device=weights.device)
    inside = weights.gather(1, ids.clamp(max=vocab - 1)).masked_fill(ids >= vocab, 0.0)
    return block * BLOCK + _search(inside.double(), generator)


def _search(weights: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Per row of float64 `weights` [R, n], the index i at which a uniform share of the
    row's total first falls below the cumulative sum: chance weights[i] / total. A
    zero-weight index is never taken: its cumulative sum equals the one before it."""
    cum = weights.cumsum(dim=-1)
    total = cum[:, -1:]
    u = torch.rand(total.shape, generator=generator, dtype=total.dtype, device=total.device)
    index = torch.searchsorted(cum, u * total, right=True)
    # u * total can round up to the total: the last index with weight, not one past it
    last = (cum < total).sum(dim=-1, keepdim=True)
    return torch.minimum(index, last).squeeze(1)


def logprob_details(logprobs: torch.Tensor | None, tokens: torch.Tensor, n: int | None):
    """(chosen-token logprob [R], top-n (values, ids)) from raw logprobs, or (None, None)."""
    if logprobs is None:
        return None, None
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    return chosen, (logprobs.topk(n, dim=-1) if n else None)


def _prepare(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """In place, once per step's logits: bias and penalties, then the min_tokens bans,
    then the grammar's bitmask (structured outputs: disallowed tokens -> -inf)."""
    if batch.adjust is not None:
        batch.adjust.apply(logits)
    for row, ids in batch.banned:
        logits[row, ids] = float("-inf")
    if batch.grammar is not None:
        from xllm_py.structured import apply_bitmask

        apply_bitmask(logits, *batch.grammar)


def _processed(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature, top-k, top-p, then min-p: the normalised distribution a sampled row
    draws from. Normalised matters: plain sampling's exponential race does not care about
    scale, but verification compares p(d) with q(d), and an unnormalised p would accept
    drafts too rarely (min-p zeroes mass without renormalising)."""
    logits = logits / batch.temperature.unsqueeze(1)
    if batch.top_k is not None or batch.top_p is not None:
        logits = _filter_top_k_top_p(logits, batch.top_k, batch.top_p)
    if batch.min_p is not None:
        # p < min_p * p_max  <=>  logit < max logit + log(min_p): masked before the softmax,
        # so the softmax normalises what survives.
        floor = logits.amax(dim=-1, keepdim=True) + batch.min_p.unsqueeze(1).log()
        logits = logits.masked_fill(logits < floor, float("-inf"))
    return torch.softmax(logits, dim=-1)


def _filter_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask (-inf) tokens outside each row's top-k and nucleus; vocabulary order is kept.

    Top-k keeps the tokens at or above the row's k-th largest logit (ties included). The
    nucleus keeps, in descending order of probability after top-k (equal ones in
    vocabulary order), each token whose mass before it is below top_p (the top token
    always: its mass before is 0). Only the candidates are sorted: the largest top-k's
    worth, and for top-p the n most probable tokens, n doubled until their mass reaches
    every row's top_p (every token after them has at least that much mass before it, so is
    outside) and no token inside the nucleus ties one after them. A full sort of the
    vocabulary per row was most of a sampled step on CPU (2,048 rows x 8,208 tokens: 1.6 s,
    against 50 ms for their top 12). On other devices n is the vocabulary at once: reading
    the masses back to decide would stop the host for the device."""
    vocab = logits.shape[1]
    on_cpu = logits.device.type == "cpu"
    drop, width = None, vocab
    if top_k is not None:
        k = top_k.clamp(1, vocab)  # a top_k beyond the vocabulary keeps everything
        width = int(k.max()) if on_cpu else vocab
        kth = logits.topk(width, dim=-1).values.gather(1, (k - 1).unsqueeze(1))
        drop = logits < kth
    masked = logits if drop is None else logits.masked_fill(drop, float("-inf"))
    if top_p is None:
        return masked
    probs = torch.softmax(masked, dim=-1)
    # Rows at top_p == 1 are left alone: float32 cumsums reach 1.0 before the tail and
    # would drop tokens there.
    active = top_p < 1
    n = vocab if not on_cpu else width if width < vocab else min(64, vocab)
    while True:
        top, order, tied = _top_candidates(probs, n)
        mass = top.cumsum(dim=-1)
        last_inside = mass[:, -1] - top[:, -1] < top_p
        more = (mass[:, -1] < top_p) | (tied & last_inside)
        if n == vocab or not bool(more[active].any()):
            break
        n = min(2 * n, vocab)
    outside = (mass - top >= top_p.unsqueeze(1)) & active.unsqueeze(1)
    nucleus = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, order, ~outside)
    outside = ~nucleus & active.unsqueeze(1)
    return masked.masked_fill(outside, float("-inf"))


def _top_candidates(probs: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's n largest probabilities, descending with equal ones in vocabulary order,
    their token ids, and whether the n-th equals the next one (bool [R]): then which of the
    equal ones come first is not known from these n."""
    m = min(n + 1, probs.shape[1])
    top, order = probs.topk(m, dim=-1)
    order, perm = order.sort(dim=-1)  # by token id, then stably by probability
    top, perm = top.gather(1, perm).sort(dim=-1, descending=True, stable=True)
    order = order.gather(1, perm)
    tied = top[:, n - 1] == top[:, n] if m > n else torch.zeros_like(top[:, 0], dtype=torch.bool)
    return top[:, :n], order[:, :n], tied
