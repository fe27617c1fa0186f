"""Block epochs: a block id plus the number of times it has been handed out.

A transfer names (block, epoch). A block freed and reused gets a new epoch, so a late
transfer or read against the old epoch fails loudly instead of touching another
request's KV.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from stopline.kv.block_pool import BlockPool


class BlockRef(msgspec.Struct, frozen=True, array_like=True):
    block: int
    epoch: int


class StaleBlock(RuntimeError):
    """A block named by a transfer was freed and reused since the ref was taken."""


class BlockEpochs:
    """Counts allocations per block by chaining the pool's on_allocate hook."""

    def __init__(self, pool: BlockPool) -> None:
        self.epoch = [0] * pool.num_blocks
        self._pool = pool
        self._next = pool.on_allocate  # the KV cache's zeroing hook keeps running

        def bump(blocks: list[int]) -> None:
            for b in blocks:
                self.epoch[b] += 1
            if self._next is not None:
                self._next(blocks)

        pool.on_allocate = bump

    def refs(self, blocks: Sequence[int]) -> list[BlockRef]:
        return [BlockRef(b, self.epoch[b]) for b in blocks]

    def check(self, refs: Sequence[BlockRef]) -> None:
        """Raise StaleBlock if any ref's block was reallocated or is now free."""
        for r in refs:
            if not 0 <= r.block < len(self.epoch):
                raise StaleBlock(f"block {r.block} is outside the pool of {len(self.epoch)}")
            if self.epoch[r.block] != r.epoch:
                raise StaleBlock(f"block {r.block} is at epoch {self.epoch[r.block]}, the ref names {r.epoch}")
            if self._pool.refcount[r.block] == 0:
                raise StaleBlock(f"block {r.block} (epoch {r.epoch}) was freed")
