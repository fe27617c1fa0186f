"""The KV block pool: reference counts, a free queue in eviction order, prefix hashes, audit.

Every block is in exactly one of three states (the ledger contract of docs/stop-path.md):
  free    refcount 0, no hash, in the free queue (handed out first)
  cached  refcount 0, hashed, in the free queue behind the free ones (LRU: evicted first
          is least recently released), and findable by its hash for prefix hits
  owned   refcount = number of live block tables (plus fence holds) that contain it
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence


class LedgerError(AssertionError):
    """The pool's accounting disagrees with the block tables: a leak or a double free."""


class OutOfBlocks(RuntimeError):
    """allocate() was asked for more blocks than can be had; callers check can_allocate first."""


def hash_blocks(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of token_ids.

    Each hash covers every token before it (the chain), so equal hashes mean equal prefixes.
    """
    return extend_hashes([], token_ids, block_size, len(token_ids) // block_size)


def extend_hashes(hashes: list[int], token_ids: Sequence[int], block_size: int, n_blocks: int,
                  salt: Hashable = None) -> list[int]:
    """Continue the chain of `hashes` (of token_ids' leading blocks) up to n_blocks blocks,
    in place; a request's chain grows as its generated tokens fill blocks. salt: what else
    the K/V depends on (a LoRA adapter and its load), so that no chain is shared across it."""
    h = hashes[-1] if hashes else (0x5707_11E if salt is None else hash((0x5707_11E, salt)))
    for i in range(len(hashes), n_blocks):
        h = hash((h, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        hashes.append(h)
    return hashes


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.refcount = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        # Front = next to hand out. Free blocks go to the front, cached ones to the back.
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.num_hashed_free = 0
        # Called with block ids whose contents become garbage (debug poisoning).
        self.on_garbage: Callable[[list[int]], None] | None = None
        # Called with block ids just handed out (the KV cache zeroes them).
        self.on_allocate: Callable[[list[int]], None] | None = None

    # ---- counts -------------------------------------------------------------------------
    @property
    def num_available(self) -> int:
        """Blocks allocate() can hand out now: free plus evictable cached."""
        return len(self.free_queue)

    @property
    def num_cached(self) -> int:
        return self.num_hashed_free

    @property
    def num_free(self) -> int:
        return len(self.free_queue) - self.num_hashed_free

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free_queue)

    # ---- allocation ---------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_queue):
            raise OutOfBlocks(f"asked for {n} blocks, {len(self.free_queue)} available")
        out = []
        evicted = []
        for _ in range(n):
            b, _ = self.free_queue.popitem(last=False)
            if self.block_hash[b] is not None:
                self._unhash(b)
                self.num_hashed_free -= 1
                evicted.append(b)
            self.refcount[b] = 1
            out.append(b)
        if evicted and self.on_garbage is not None:
            self.on_garbage(evicted)
        if out and self.on_allocate is not None:
            self.on_allocate(out)
        return out

    def touch(self, blocks: Iterable[int]) -> None:
        """Take one more reference on each block (prefix hit or a forked family member)."""
        for b in blocks:
            if self.refcount[b] == 0:
                del self.free_queue[b]
                if self.block_hash[b] is not None:
                    self.num_hashed_free -= 1
            self.refcount[b] += 1

    def release(self, blocks: Sequence[int], keep_cached: bool = True) -> None:
        """Drop one reference on each block. Tail blocks are released first so that, among a
        request's cached blocks, the end of its prefix is evicted before the start."""
        garbage = []
        for b in reversed(blocks):
            rc = self.refcount[b]
            if rc <= 0:
                raise LedgerError(f"double free of block {b}")
            self.refcount[b] = rc - 1
            if rc > 1:
                continue
            if self.block_hash[b] is not None and keep_cached:
                self.free_queue[b] = None
                self.num_hashed_free += 1
            else:
                if self.block_hash[b] is not None:
                    self._unhash(b)
                self.free_queue[b] = None
                self.free_queue.move_to_end(b, last=False)
                garbage.append(b)
        if garbage and self.on_garbage is not None:
            self.on_garbage(garbage)

    # ---- prefix cache -------------------------------------------------------------------
    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """The longest run of leading blocks whose hashes are cached (no references taken)."""
        out = []
        for h in hashes:
            b = self.hash_to_block.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def register(self, block: int, h: int) -> None:
        """Make an owned, fully written block findable by its chained hash."""
        if self.block_hash[block] is not None or h in self.hash_to_block:
            return  # already cached, or an identical block is: keep the first
        self.block_hash[block] = h
        self.hash_to_block[h] = block

    def _unhash(self, b: int) -> None:
        h = self.block_hash[b]
        self.block_hash[b] = None
        if self.hash_to_block.get(h) == b:
            del self.hash_to_block[h]

    def reset_prefix_cache(self) -> int:
        """Forget every cached (unowned) block's hash. Returns how many were dropped."""
        dropped = [b for b in self.free_queue if self.block_hash[b] is not None]
        for b in dropped:
            self._unhash(b)
            self.free_queue.move_to_end(b, last=False)
        self.num_hashed_free = 0
        return len(dropped)

    def forget_hashes(self) -> int:
        """Forget every block's hash, owned blocks' too: the weights changed, and no block
        computed under the old ones may be found again. Returns how many were dropped."""
        n = self.reset_prefix_cache()
        owned = [b for b, h in enumerate(self.block_hash) if h is not None]
        for b in owned:
            self._unhash(b)
        return n + len(owned)

    # ---- the ledger ---------------------------------------------------------------------
    def audit(self, tables: Iterable[Sequence[int]]) -> None:
        """Check the ledger against every holder of references (block tables, fence holds).

        Raises LedgerError naming the first discrepancy.
        """
        held = [0] * self.num_blocks
        for table in tables:
            for b in table:
                held[b] += 1
        n_free = n_cached = n_owned = 0
        for b in range(self.num_blocks):
            rc = self.refcount[b]
            in_queue = b in self.free_queue
            if rc != held[b]:
                raise LedgerError(f"block {b}: refcount {rc} but held by {held[b]} tables")
            if rc == 0:
                if not in_queue:
                    raise LedgerError(f"block {b}: refcount 0 but not in the free queue (leak)")
                if self.block_hash[b] is None:
                    n_free += 1
                else:
                    n_cached += 1
            else:
                if in_queue:
                    raise LedgerError(f"block {b}: owned (refcount {rc}) but in the free queue")
                n_owned += 1
            h = self.block_hash[b]
            if h is not None and self.hash_to_block.get(h) != b:
                raise LedgerError(f"block {b}: hash not in the prefix index")
        if n_free + n_cached + n_owned != self.num_blocks:
            raise LedgerError("free + cached + owned != pool size")
        if n_cached != self.num_hashed_free:
            raise LedgerError(f"cached count {self.num_hashed_free} != {n_cached}")
        if len(self.hash_to_block) != sum(h is not None for h in self.block_hash):
            raise LedgerError("prefix index holds hashes of no block")
