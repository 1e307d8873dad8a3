"""Paged KV-cache blocks: allocation, reference counts, prefix caching.

The cache is `num_blocks` blocks of `block_size` token slots each (per layer
`[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`). A request owns
an ordered block table; token t lives in slot
`block_ids[t // block_size] * block_size + t % block_size`.

    request tokens: |<------ computed ------>|<- new ->|<- look-ahead ->|
    block table:    [ b7 ][ b2 ][ b9 ][ b4  ][ b11   ]
                     full blocks (hashed)     partial

Prefix caching: a full block of *verified* tokens is registered under a hash
chained over all tokens up to its end, `h_i = hash((h_{i-1}, tokens_i))`, so
equal hashes mean equal prefixes. Freed blocks keep their hash and stay
findable until reused. The free list is LRU: blocks are taken from its front;
blocks without a hash are put at the front (nothing to lose), hashed ones at
the back, and a request's blocks are freed tail first so its prefix survives
longest.

Invariant: every block is either in `_free` (ref_count 0) or owned by at least
one request (ref_count > 0).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol


class SequenceBlocks(Protocol):
    """What the block manager reads and writes of a sequence (engine/request.py
    `Request` is one): its tokens, how many are computed, and its block table with hashes."""

    all_token_ids: list[int]
    num_tokens: int
    num_computed_tokens: int
    block_ids: list[int]
    block_hashes: list[int]
    num_cached_blocks: int


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache has room for {num_blocks} blocks; need at least 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # prefix hash -> block id
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    # ---- prefix cache -------------------------------------------------------------------------

    def _update_hashes(self, req: SequenceBlocks) -> None:
        extend_hashes(req.block_hashes, req.all_token_ids, self.block_size)

    def find_cached_prefix(self, req: SequenceBlocks) -> list[int]:
        """Leading full blocks of `req` already in the cache. At least one token is left
        uncomputed, so the step that follows still produces logits to sample from."""
        if not self.enable_prefix_cache:
            return []
        self._update_hashes(req)
        limit = (req.num_tokens - 1) // self.block_size
        hits = []
        for h in req.block_hashes[:limit]:
            bid = self._cached.get(h)
            if bid is None:
                break
            hits.append(bid)
        return hits

    def cache_full_blocks(self, req: SequenceBlocks, num_verified_tokens: int) -> None:
        """Register the request's full blocks of verified tokens under their prefix hashes."""
        if not self.enable_prefix_cache:
            return
        self._update_hashes(req)
        n_full = min(num_verified_tokens // self.block_size, len(req.block_ids))
        for i in range(req.num_cached_blocks, n_full):
            bid, h = req.block_ids[i], req.block_hashes[i]
            if h not in self._cached and self.block_hash[bid] is None:
                self._cached[h] = bid
                self.block_hash[bid] = h
        req.num_cached_blocks = max(req.num_cached_blocks, n_full)

    # ---- a prompt's blocks computed elsewhere (prefill/decode disaggregation, xllm_py/pd) ---

    def prompt_hashes(self, prompt: list[int], hashes: list[int] | None = None) -> list[int]:
        """The prefix hashes of the prompt's blocks that a prefix-cache hit can cover: the
        full blocks before its last token (find_cached_prefix's limit). `hashes`: the
        request's `block_hashes`, extended in place, so its admission does not hash the
        prompt again."""
        hashes = extend_hashes([] if hashes is None else hashes, prompt, self.block_size)
        return hashes[: (len(prompt) - 1) // self.block_size]

    def cached_blocks(self, hashes: list[int]) -> list[int] | None:
        """The blocks cached under `hashes`, or None if any of them is not (evicted)."""
        found = [self._cached.get(h) for h in hashes]
        return None if None in found else found

    def reserve_prefix(self, hashes: list[int]) -> PrefixImport | None:
        """Free blocks to receive the KV of the prompt blocks `hashes` that are not cached
        here already, held (no request owns them, nothing finds them) until
        `commit_prefix` or `abort_prefix`. None, changing nothing, if they do not fit."""
        missing = [i for i, h in enumerate(hashes) if h not in self._cached]
        if len(missing) > len(self._free):
            return None
        return PrefixImport([hashes[i] for i in missing], [self._take_free() for _ in missing])

    def commit_prefix(self, imp: PrefixImport, hold: bool = False) -> None:
        """The blocks hold their KV now: cache them under their hashes (findable: the
        request that needs them takes them as prefix-cache hits), then let them go, or with
        `hold` keep them held until `abort_prefix` (its request's admission: no other
        allocation can evict them meanwhile)."""
        for h, bid in zip(imp.hashes, imp.block_ids):
            if h not in self._cached:
                self._cached[h] = bid
                self.block_hash[bid] = h
        if not hold:
            self.abort_prefix(imp)

    def abort_prefix(self, imp: PrefixImport) -> None:
        """Let the held blocks go; uncommitted ones come back unhashed (the transfer failed)."""
        for bid in imp.block_ids:
            self._release(bid)
        imp.block_ids = []

    # ---- allocation ---------------------------------------------------------------------------

    def allocate(
        self, req: SequenceBlocks, num_new_tokens: int, num_lookahead: int = 0, hits: list[int] = ()
    ) -> bool:
        """Grow `req`'s block table to hold computed + hits + new + look-ahead tokens.

        Returns False, changing nothing, if there are not enough free blocks."""
        total = (
            req.num_computed_tokens + len(hits) * self.block_size + num_new_tokens + num_lookahead
        )
        new_blocks = max(self.blocks_needed(total) - len(req.block_ids) - len(hits), 0)
        revived = sum(1 for b in hits if self.ref_count[b] == 0)  # cached blocks sitting in _free
        if new_blocks + revived > len(self._free):
            return False
        for b in hits:
            if self.ref_count[b] == 0:
                del self._free[b]
            self.ref_count[b] += 1
            req.block_ids.append(b)
        if not req.num_computed_tokens:  # admission: count prefix-cache queries and hits once
            self.prefix_queries += req.num_tokens
            self.prefix_hits += len(hits) * self.block_size
        if hits:
            req.num_cached_blocks = len(req.block_ids)
        for _ in range(new_blocks):
            req.block_ids.append(self._take_free())
        return True

    def _take_free(self) -> int:
        bid, _ = self._free.popitem(last=False)
        h = self.block_hash[bid]
        if h is not None:  # evict: the block's old contents are about to be overwritten
            del self._cached[h]
            self.block_hash[bid] = None
        self.ref_count[bid] = 1
        return bid

    def free(self, req: SequenceBlocks) -> None:
        """Release every block of `req` (finished, aborted or preempted)."""
        for bid in reversed(req.block_ids):
            self._release(bid)
        req.block_ids = []
        req.num_cached_blocks = 0

    def _release(self, bid: int) -> None:
        """Drop one reference; a block nobody holds goes back on the free list, at its
        front when it has no hash (nothing to lose), else at its back (findable longest)."""
        self.ref_count[bid] -= 1
        if self.ref_count[bid] == 0:
            self._free[bid] = None
            if self.block_hash[bid] is None:
                self._free.move_to_end(bid, last=False)


class PrefixImport:
    """Blocks reserved to receive a prompt's KV (`BlockManager.reserve_prefix`): the
    prefix hashes not cached yet and, in the same order, the blocks that will hold them."""

    def __init__(self, hashes: list[int], block_ids: list[int]) -> None:
        self.hashes = hashes
        self.block_ids = block_ids


def extend_hashes(hashes: list[int], tokens: list[int], block_size: int) -> list[int]:
    """Append to `hashes` the chained prefix hash of every further full block of `tokens`:
    `h_i = hash((h_{i-1}, tokens of block i))`, equal across processes (ints only)."""
    for i in range(len(hashes), len(tokens) // block_size):
        parent = hashes[i - 1] if i else 0
        hashes.append(hash((parent, tuple(tokens[i * block_size : (i + 1) * block_size]))))
    return hashes


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks of `block_size` tokens that hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)
