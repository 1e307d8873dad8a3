"""Block manager: allocation, reference counts, prefix caching, LRU eviction, and
the invariant users rely on: when every request is gone, every block is free."""

import pytest

from xllm_py.cache.block_manager import BlockManager
from xllm_py.engine.request import Request
from xllm_py.sampling_params import SamplingParams


def req(rid, tokens):
    return Request(rid, tokens, SamplingParams(max_tokens=8), (), 10_000)


def test_allocate_grows_block_table_and_free_returns_everything():
    bm = BlockManager(num_blocks=8, block_size=4)
    r = req("a", list(range(10)))
    assert bm.allocate(r, 10)
    assert len(r.block_ids) == 3 and bm.num_free_blocks == 5
    r.num_computed_tokens = 10
    assert bm.allocate(r, 1, num_lookahead=3)  # 14 tokens -> 4 blocks
    assert len(r.block_ids) == 4
    bm.free(r)
    assert bm.num_free_blocks == 8 and r.block_ids == []


def test_allocate_fails_without_side_effects_when_full():
    bm = BlockManager(num_blocks=2, block_size=4)
    r = req("a", list(range(12)))
    assert not bm.allocate(r, 12)
    assert r.block_ids == [] and bm.num_free_blocks == 2


def test_prefix_cache_hit_shares_blocks_and_never_covers_last_token():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = req("a", list(range(12)))
    assert bm.allocate(a, 12)
    bm.cache_full_blocks(a, 12)
    b = req("b", list(range(12)))  # identical prompt: 3 full blocks, but last token must compute
    hits = bm.find_cached_prefix(b)
    assert hits == a.block_ids[:2]
    assert bm.allocate(b, 4, hits=hits)
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert bm.ref_count[a.block_ids[0]] == 2
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 10


def test_different_prefix_does_not_hit():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.allocate(a, 9)
    bm.cache_full_blocks(a, 9)
    b = req("b", [1, 2, 3, 4, 0, 6, 7, 8, 9])  # same first block, second block differs
    assert bm.find_cached_prefix(b) == a.block_ids[:1]
    c = req("c", [0, 2, 3, 4, 5, 6, 7, 8, 9])  # first block differs: chained hash misses all
    assert bm.find_cached_prefix(c) == []


def test_freed_cached_blocks_are_revived_then_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = req("a", [1, 2, 3, 4, 5])
    assert bm.allocate(a, 5)
    bm.cache_full_blocks(a, 5)
    cached = a.block_ids[:2]
    bm.free(a)
    assert bm.num_free_blocks == 4
    b = req("b", [1, 2, 3, 4, 9])
    hits = bm.find_cached_prefix(b)
    assert hits == cached  # still findable after free
    assert bm.allocate(b, 1, hits=hits)
    bm.free(b)
    # A request that needs every block evicts the cached ones.
    c = req("c", list(range(100, 108)))
    assert bm.allocate(c, 8)
    assert bm.find_cached_prefix(req("d", [1, 2, 3, 4, 5])) == []
    bm.free(c)
    assert bm.num_free_blocks == 4


def test_unhashed_blocks_are_reused_before_cached_ones():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = req("a", [1, 2, 3])
    assert bm.allocate(a, 3)
    bm.cache_full_blocks(a, 3)  # block 0 of a hashed, block 1 partial
    partial = a.block_ids[1]
    bm.free(a)
    b = req("b", [7])
    assert bm.allocate(b, 1)
    assert b.block_ids[0] == partial
    assert bm.find_cached_prefix(req("c", [1, 2, 3])) != []  # the hashed block survived


@pytest.mark.parametrize("bad", [0, 3, -4])
def test_bad_block_size_is_rejected_by_config(bad):
    from xllm_py.config import CacheConfig

    with pytest.raises(ValueError, match="block_size"):
        CacheConfig(block_size=bad)


def test_moved_blocks_are_held_until_their_request_is_admitted():
    """PD decode (pd/roles.py): blocks moved for a waiting request are held, so no other
    allocation evicts them before the request is admitted; admitted, it owns them. With
    nothing running, held blocks that leave the queue's head no room are let go."""
    from xllm_py.config import SchedulerConfig
    from xllm_py.engine.scheduler import Scheduler

    bm = BlockManager(num_blocks=6, block_size=4)
    sched = Scheduler(SchedulerConfig(), bm)
    a = req("a", list(range(9)))  # 2 full blocks before its last token: moved and held
    held = bm.reserve_prefix(bm.prompt_hashes(a.prompt_token_ids, a.block_hashes))
    bm.commit_prefix(held, hold=True)
    a.prefix_hold = held
    b = req("b", list(range(100, 120)))  # needs 5 blocks: only 4 are not held
    assert not bm.allocate(b, 20)
    assert bm.cached_blocks(held.hashes) is not None
    sched.add_request(a)
    sched.schedule()
    assert a.num_computed_tokens == 8 and a.prefix_hold is None  # both blocks were hits
    assert [bm.ref_count[x] for x in a.block_ids[:2]] == [1, 1]  # its own, nothing else's
    sched.finish_request("a")
    assert bm.num_free_blocks == 6
    # nothing running: the head needs 5 blocks, a waiting request holds 2 of the 6
    c = req("c", list(range(200, 209)))
    held = bm.reserve_prefix(bm.prompt_hashes(c.prompt_token_ids, c.block_hashes))
    bm.commit_prefix(held, hold=True)
    c.prefix_hold = held
    sched.add_request(b)
    sched.add_request(c)
    out = sched.schedule()
    assert "b" in out.num_scheduled_tokens and c.prefix_hold is None  # let go, b admitted
    sched.finish_request("b")
    sched.finish_request("c")
    assert bm.num_free_blocks == 6
