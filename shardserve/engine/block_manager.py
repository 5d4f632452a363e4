"""Paged KV-cache blocks with automatic prefix caching.

Each request owns a list of block ids (its block table). A *full* block is named by a chained
hash of (parent block's hash, the block's token ids), so equal prefixes give equal hash chains:

    tokens:  [t0 .. t15][t16 .. t31][t32 .. t37]      block_size = 16
    hashes:  h0 = H(None, t0..15)   h1 = H(h0, t16..31)   (last block not full: no hash)

A freed block keeps its hash and stays findable until it is reused: free blocks sit in an LRU
queue (front = evicted first), and a prefix hit on a free block takes it back out of the queue.
Reference counts let many requests share one cached block. The queue, front to back:

    [ freed, nothing cached (latest first) | never used (by id) | spares | freed, cached (oldest first) ]

A request that takes the newest blocks also holds the never-used blocks after them as its spares
(up to MAX_SPARES, no more than it can still fill) and grows into them first: a sequence's blocks
then lie in one run of memory, which the decode attention reads at a higher rate than blocks
scattered among other sequences' (prompts admitted together would otherwise each grow into
blocks interleaved with all the others'). Spares count as free: they are handed to another
request before any cached block is evicted.

Blocks are made on first use, so a pool of many blocks costs nothing until it fills (the
simulator holds a thousand replicas' pools at once).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from shardserve.request import Request

MAX_SPARES = 16  # blocks held after a request's last one for its growth


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()  # kept with the hash so a hash collision can never alias


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 max_spares: int = MAX_SPARES):
        self.block_size = block_size
        self.max_spares = max_spares
        self.enable_prefix_caching = enable_prefix_caching
        self._num_blocks = num_blocks
        self.blocks: list[Block] = []  # made on first use: block i exists once i < len(blocks)
        self._free_front: list[int] = []  # freed blocks holding no hash: a stack, top = front of the queue
        self._free_back: OrderedDict[int, None] = OrderedDict()  # freed cached blocks, least recent first
        self._spares: dict[str, list[int]] = {}  # request id -> never-used blocks right after its last one
        self._num_spares = 0
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.num_prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # of which found

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_front) + self._num_blocks - len(self.blocks) + self._num_spares + len(self._free_back)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self._num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_prefix(self, req: Request) -> list[int]:
        """Block ids caching the longest prefix of `req`'s tokens. Leaves at least one token to
        compute, since the step that computes the last token is the one that yields logits."""
        if not self.enable_prefix_caching:
            return []
        self._extend_hashes(req)
        hits: list[int] = []
        token_ids = req.all_token_ids
        for i, h in enumerate(req.block_hashes):
            block_id = self.cached.get(h)
            tokens = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
        if hits and len(hits) * self.block_size >= req.num_tokens:
            hits.pop()  # a full hit: recompute the last block rather than write into a shared one
        return hits

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (the prefix-cache hit-rate metrics)."""
        if self.enable_prefix_caching:
            self.num_prefix_queries += num_tokens
            self.num_prefix_hits += num_hit_tokens

    def can_allocate(self, req: Request, num_new_tokens: int, prefix_hits: list[int] = ()) -> bool:
        num_tokens = req.num_computed_tokens + len(prefix_hits) * self.block_size + num_new_tokens
        needed = self.blocks_needed(num_tokens) - len(req.block_ids) - len(prefix_hits)
        reclaimed = sum(1 for b in prefix_hits if self.blocks[b].ref_count == 0)  # hits sitting in the free queue
        return needed <= self.num_free_blocks - reclaimed

    def allocate(self, req: Request, num_new_tokens: int, prefix_hits: list[int] = ()) -> None:
        """Grow `req`'s block table to hold `num_new_tokens` more tokens, taking `prefix_hits`
        first (their tokens count as computed). Call `can_allocate` first."""
        for block_id in prefix_hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                self._take_free(block_id)
            block.ref_count += 1
            req.block_ids.append(block_id)
        req.num_computed_tokens += len(prefix_hits) * self.block_size
        needed = self.blocks_needed(req.num_computed_tokens + num_new_tokens) - len(req.block_ids)
        spares = self._spares.get(req.req_id, [])
        for _ in range(needed):
            if spares:
                self._num_spares -= 1
                block = self.blocks[spares.pop(0)]
            else:
                block = self._pop_free()
            block_id = block.block_id
            if block.hash is not None:  # evict the least recently freed cached block
                if self.cached.get(block.hash) == block_id:
                    del self.cached[block.hash]
                block.hash, block.token_ids = None, ()
            block.ref_count = 1
            req.block_ids.append(block_id)
        self._reserve(req)

    def _reserve(self, req: Request) -> None:
        """Hold the never-used blocks after `req`'s last block as its spares, if it has the newest."""
        if not req.block_ids or req.block_ids[-1] != len(self.blocks) - 1:
            return
        final = len(req.prompt_token_ids) + req.params.max_tokens
        count = min(self.max_spares, self.blocks_needed(final) - len(req.block_ids), self._num_blocks - len(self.blocks))
        if count <= 0:
            return
        spares = self._spares.setdefault(req.req_id, [])
        for _ in range(count):
            self.blocks.append(Block(len(self.blocks)))
            spares.append(len(self.blocks) - 1)
        self._num_spares += count

    def cache_full_blocks(self, req: Request) -> None:
        """Publish the hashes of `req`'s blocks that are now full and computed."""
        if not self.enable_prefix_caching:
            return
        self._extend_hashes(req)
        num_full = min(req.num_computed_tokens // self.block_size, len(req.block_hashes), len(req.block_ids))
        token_ids = None
        for i in range(req.num_published_blocks, num_full):
            block = self.blocks[req.block_ids[i]]
            if block.hash is None:
                token_ids = token_ids or req.all_token_ids
                block.hash = req.block_hashes[i]
                block.token_ids = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
                self.cached.setdefault(block.hash, block.block_id)
        req.num_published_blocks = max(req.num_published_blocks, num_full)

    def free_request(self, req: Request) -> None:
        """Drop `req`'s references. Tail blocks are queued first, so they are evicted before
        the prefix blocks that other requests are more likely to share."""
        for block_id in reversed(req.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is None:  # holds nothing reusable: hand it out first
                    self._free_front.append(block_id)
                else:
                    self._free_back[block_id] = None
        req.block_ids = []
        req.num_published_blocks = 0
        spares = self._spares.pop(req.req_id, [])
        self._free_front.extend(reversed(spares))
        self._num_spares -= len(spares)

    def _pop_free(self) -> Block:
        """The block at the front of the free queue, out of it."""
        if self._free_front:
            return self.blocks[self._free_front.pop()]
        if len(self.blocks) < self._num_blocks:
            self.blocks.append(Block(len(self.blocks)))
            return self.blocks[-1]
        if self._num_spares:  # take back the end of the largest reservation
            owner = max(self._spares, key=lambda r: len(self._spares[r]))
            self._num_spares -= 1
            block_id = self._spares[owner].pop()
            if not self._spares[owner]:
                del self._spares[owner]
            return self.blocks[block_id]
        block_id, _ = self._free_back.popitem(last=False)
        return self.blocks[block_id]

    def _take_free(self, block_id: int) -> None:
        """Take a free block (a prefix hit) out of the queue."""
        if self._free_back.pop(block_id, False) is False:
            self._free_front.remove(block_id)

    def _extend_hashes(self, req: Request) -> None:
        bs = self.block_size
        num_full = req.num_tokens // bs
        for i in range(len(req.block_hashes), num_full):
            parent = req.block_hashes[i - 1] if i else None
            tokens = tuple(req.token_at(j) for j in range(i * bs, (i + 1) * bs))
            req.block_hashes.append(hash((parent, tokens)))
