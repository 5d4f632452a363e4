import random
from collections import OrderedDict

from shardserve.engine.block_manager import Block, BlockManager
from shardserve.request import Request, SamplingParams


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(), seed=0)


def test_allocate_and_free_counts_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    r = req("a", range(10))
    assert bm.can_allocate(r, 10)
    bm.allocate(r, 10)
    assert len(r.block_ids) == 3 and bm.num_free_blocks == 5
    r.num_computed_tokens = 10
    bm.allocate(r, 2)  # tokens 10, 11 still fit block 3
    assert len(r.block_ids) == 3
    r.num_computed_tokens = 12
    bm.allocate(r, 1)
    assert len(r.block_ids) == 4
    bm.free_request(r)
    assert bm.num_free_blocks == 8 and r.block_ids == []


def test_prefix_hit_shares_blocks_and_leaves_last_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = req("a", range(12))
    bm.allocate(a, 12)
    a.num_computed_tokens = 12
    bm.cache_full_blocks(a)
    b = req("b", list(range(10)) + [99, 98])
    hits = bm.find_prefix(b)
    assert hits == a.block_ids[:2]  # the third block differs in its last two tokens
    bm.allocate(b, 4, hits)
    assert b.num_computed_tokens == 8 and bm.blocks[hits[0]].ref_count == 2
    c = req("c", range(12))  # identical prompt: the last block is recomputed, not shared
    assert bm.find_prefix(c) == a.block_ids[:2]


def test_freed_cached_blocks_stay_findable_until_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = req("a", [1, 2, 3, 4, 5])
    bm.allocate(a, 5)
    a.num_computed_tokens = 5
    bm.cache_full_blocks(a)
    bm.free_request(a)
    assert bm.num_free_blocks == 4 and bm.usage == 0.0
    again = req("a2", [1, 2, 3, 4, 5])
    assert len(bm.find_prefix(again)) == 2
    filler = req("f", [7, 8])  # takes the uncached block first, so cached ones survive
    bm.allocate(filler, 2)
    assert len(bm.find_prefix(req("a3", [1, 2, 3, 4, 5]))) == 2
    big = req("g", range(100, 106))
    bm.allocate(big, 6)  # now the cached blocks must be evicted, tail block first
    assert bm.find_prefix(req("a4", [1, 2, 3, 4, 5])) == []


def test_hash_collision_cannot_alias_different_tokens():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = req("a", [1, 2, 3])
    bm.allocate(a, 3)
    a.num_computed_tokens = 3
    bm.cache_full_blocks(a)
    b = req("b", [5, 6, 7])
    b.block_hashes = list(a.block_hashes)  # forge a colliding hash
    assert bm.find_prefix(b) == []


class EagerQueueBlockManager(BlockManager):
    """The free queue as one OrderedDict of every block id, made up front: the reference the lazy
    queue (blocks made on first use) must hand blocks out exactly like."""

    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size, max_spares=0)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.queue = OrderedDict((i, None) for i in range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.queue)

    def _pop_free(self) -> Block:
        return self.blocks[self.queue.popitem(last=False)[0]]

    def _take_free(self, block_id: int) -> None:
        del self.queue[block_id]

    def free_request(self, req) -> None:
        for block_id in reversed(req.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.queue[block_id] = None
                if block.hash is None:
                    self.queue.move_to_end(block_id, last=False)
        req.block_ids = []
        req.num_published_blocks = 0


def test_lazy_free_queue_hands_out_blocks_like_the_eager_one():
    rng = random.Random(0)
    lazy, eager = BlockManager(40, 4, max_spares=0), EagerQueueBlockManager(40, 4)  # spares: tested below
    prompts = [[rng.randrange(3) for _ in range(rng.randrange(1, 14))] for _ in range(30)]  # shared prefixes
    live: dict[str, tuple[Request, Request]] = {}
    for step in range(600):
        if live and (rng.random() < 0.45 or lazy.num_free_blocks < 8):
            rid = rng.choice(sorted(live))
            for bm, r in zip((lazy, eager), live.pop(rid)):
                r.num_computed_tokens = r.num_tokens
                bm.cache_full_blocks(r)
                bm.free_request(r)
        else:
            prompt = rng.choice(prompts)
            pair = (req(f"{step}", prompt), req(f"{step}", prompt))
            hits = [bm.find_prefix(r) for bm, r in zip((lazy, eager), pair)]
            assert hits[0] == hits[1]
            skipped = len(hits[0]) * 4
            if not lazy.can_allocate(pair[0], len(prompt) - skipped, hits[0]):
                continue
            for bm, r, h in zip((lazy, eager), pair, hits):
                bm.allocate(r, len(prompt) - skipped, h)
            assert pair[0].block_ids == pair[1].block_ids
            live[f"{step}"] = pair
        assert lazy.num_free_blocks == eager.num_free_blocks and lazy.cached == eager.cached
    assert len(lazy.blocks) < 40 or eager.num_free_blocks < 40  # the lazy pool grew only as used


def grow(bm: BlockManager, r: Request, steps: int) -> None:
    """`steps` decode steps of `r`: one token computed, one more to store."""
    for _ in range(steps):
        r.num_computed_tokens = r.num_tokens
        r.output_token_ids.append(0)
        bm.allocate(r, 1)


def test_requests_admitted_together_grow_into_runs_of_their_own():
    bm = BlockManager(num_blocks=64, block_size=4)
    reqs = [Request(rid, list(range(6)), SamplingParams(max_tokens=20), seed=0) for rid in "abc"]
    for r in reqs:
        bm.allocate(r, 6)
    for _ in range(20):  # decode steps of the batch, interleaved as the engine runs them
        for r in reqs:
            grow(bm, r, 1)
    for r in reqs:  # 26 tokens: 7 blocks, one run each
        assert len(r.block_ids) == 7 and r.block_ids == list(range(r.block_ids[0], r.block_ids[0] + 7))
    assert len({b for r in reqs for b in r.block_ids}) == 21
    bm.free_request(reqs[0])  # nothing held beyond what it used (its spares were exactly its growth)
    assert bm.num_free_blocks == 64 - 14


def test_spares_count_as_free_and_go_to_others_before_any_cached_block():
    bm = BlockManager(num_blocks=10, block_size=4)
    cached = Request("cached", list(range(8)), SamplingParams(max_tokens=1), seed=0)  # 2 full blocks, 1 spare
    bm.allocate(cached, 8)
    cached.num_computed_tokens = 8
    bm.cache_full_blocks(cached)
    bm.free_request(cached)
    a = Request("a", list(range(4)), SamplingParams(max_tokens=100), seed=0)
    bm.allocate(a, 4)  # the spare given back, now the newest block: a reserves the 7 after it
    assert a.block_ids == [2] and bm._spares == {"a": list(range(3, 10))} and bm.num_free_blocks == 9
    b = req("b", [9] * 20)  # 5 blocks: all from a's spares (and the never-used), none evicted
    assert bm.can_allocate(b, 20)
    bm.allocate(b, 20)
    owned = a.block_ids + b.block_ids
    assert len(set(owned)) == len(owned) == 6 and bm.num_free_blocks == 4
    probe = req("probe", list(range(8)) + [1])
    assert len(bm.find_prefix(probe)) == 2  # the cached blocks survived
    grow(bm, a, 2)  # a's growth still finds its blocks
    bm.free_request(a)
    bm.free_request(b)
    assert bm.num_free_blocks == 10 and bm._num_spares == 0 and not bm._spares
