"""Contiguous copies of the decoding sequences' K/V, kept current one token at a time.

A decode step's attention needs each sequence's keys and values as one contiguous run. From
the paged cache that means gathering every block of every decoding sequence, every layer,
every step: at 64 streams of ~200 tokens about 0.75 GB copied a step, 40% of the step
(torch profiler; `bench/step_time.py --compare-decode-rows` times both paths). Here each decoding sequence owns a row of a per-layer
buffer [rows, kv_heads, width, head_dim]; a step writes its one new token into the row next
to writing it into the cache, and attention multiplies the rows in place. A sequence's
blocks are copied once, when it joins the decode set (after its prefill, or on return from
preemption). The buffer's width is a capacity: attention reads the first `width` keys of
each row, and the width follows the longest row up and down without moving anything (on
CPU the capacity is reserved up front and the OS backs a page only when it is first
written). When departures left the used rows mostly holes, the rows past the owned count
move down into the holes, in place; the buffers are re-laid out (one strided copy into new
ones) only when more rows or more width are needed than were reserved.

The numbers attention sees are the cache's (copies of them), so its result is bit for bit
the gather path's; the extra masked rows and key tiles of the buffer are the kind of
padding attention's reductions are probed to ignore. In debug mode every layer compares
the rows with the cache: a row that differs is a bug here (RowMismatch), except where the
cache holds the NaN poison of a freed block, which the row then takes, so that a read of
freed memory still fails the request as it would through a gather.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from stopline.kv.kv_cache import gather_blocks

if TYPE_CHECKING:
    from stopline.request import Request

# The next unit of columns is backed over this many steps (a unit is 64 or more steps).
_PRETOUCH_STEPS = 32


class RowMismatch(AssertionError):
    """Debug check: a decode row differs from the cache blocks it copies."""


@dataclass
class RowPlan:
    """Where one step's decodes sit in the buffer."""

    rows: torch.Tensor  # [B] buffer row of each decode row of the step
    used: int  # attention runs over rows [0, used)
    positions: torch.Tensor  # [B] position of each decode's new token
    masked: torch.Tensor  # [used, 1, 1, width] bool: positions past each row's length
    width: int  # attention reads keys [0, width) of each row
    fill: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (row, block in row, cache block)
    joined: torch.Tensor | None  # rows cleared and filled this step
    widen: tuple[int, int, int] | None  # (from, to, rows): columns cleared as the width grows
    check: list[tuple[int, int, torch.Tensor, int]]  # debug: (row, length, blocks, first live position)
    # Several KV layer groups: the joiners' cache blocks and the debug checks in groups 1 ..
    fill_more: list[torch.Tensor] | None = None
    check_more: list[list[tuple[int, int, torch.Tensor, int]]] | None = None


class DecodeRows:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                 tile: int, max_rows: int, max_bytes: int, *, verify: bool = False,
                 device: str = "cpu", null_block: int | Sequence[int] = -1,
                 layer_group: Sequence[int] | None = None) -> None:
        """tile: attention's key tile (the width is a whole number of them and of blocks);
        max_rows: the most sequences decoding at once; max_bytes: the most memory the
        buffers may take, beyond which a step gathers; layer_group: each layer's KV group
        (kv_cache.layer_groups; None: one), whose blocks its rows copy; null_block: each
        group's zero block (KVCache.nulls), or one for every group."""
        self.num_layers, self.hk, self.d = num_layers, num_kv_heads, head_dim
        self.bs = block_size
        self.unit = math.lcm(tile, block_size)
        self.max_rows = max(max_rows, 2)
        self.max_bytes = max_bytes
        self.verify = verify
        # A table's leading entries a sliding window passed point at its group's zero block
        # (one per group: the groups' pools may differ in size).
        self.nulls = [null_block] if isinstance(null_block, int) else list(null_block)
        self.layer_group = list(layer_group) if layer_group else [0] * num_layers
        self.device = device
        self.k: list[torch.Tensor] = []  # per layer [rows, kv_heads, capacity, head_dim]
        self.v: list[torch.Tensor] = []
        self.num_rows = 0
        self.capacity = 0  # allocated width
        self.width = 0  # width in use: a whole number of units, at least the longest row
        # On CPU the capacity is all of max_bytes, reserved: pages are backed as written.
        # (A first touch measured 250 ms a GB here; growing a fresh buffer every 64 tokens
        # at 64 streams made a 1-2 s step.) Elsewhere memory is not lazy: exact sizes.
        self._reserve = torch.device(device).type == "cpu"
        self.owner: dict[int, int] = {}  # sequence key -> row
        # Keys of ended or preempted requests. Their rows are dropped by the first plan()
        # they are not in: plan() runs on the forward's thread, which may be using (or about
        # to fill) a row while the engine's thread ends its request.
        self.released: set[int] = set()
        self.length: dict[int, int] = {}  # sequence key -> tokens in its row after this step
        self.relayouts = 0
        self.compactions = 0
        self._touched = (0, 0)  # (width, rows): rows [0, rows) have the unit past it backed

    def reset(self) -> None:
        """Forget every row and free the buffers (after a failed or interrupted step, whose
        rows are unsure, and when the engine goes idle)."""
        self.k, self.v = [], []
        self.num_rows = self.capacity = self.width = 0
        self._touched = (0, 0)
        self.owner.clear()
        self.length.clear()
        self.released.clear()

    # ---- holder (lifecycle.py) ------------------------------------------------------------
    name = "decode rows"

    def release(self, req: Request) -> None:
        self.released.add(req.internal_id)

    def preempt(self, req: Request) -> None:
        self.release(req)  # it rejoins with a fresh copy when it decodes again

    def holds(self, req: Request) -> bool:
        return req.internal_id in self.owner and req.internal_id not in self.released

    def _bytes(self, rows: int, width: int) -> int:
        return 2 * self.num_layers * self.hk * rows * width * self.d * 4

    def plan(self, keys: Sequence[int], lens: Sequence[int], tables: Sequence[Sequence[int]],
             more: Sequence[Sequence[Sequence[int]]] = ()) -> RowPlan | None:
        """keys: one per decode row (a lone decode comes twice, with the same key); lens: its
        length including the token this step computes; tables: its block table; more: its
        tables in KV groups 1 .. (one list per group). Returns None when the rows would not
        fit in max_bytes (the step gathers instead)."""
        seqs = dict(zip(keys, zip(lens, tables, strict=True), strict=True))
        need_rows = max(len(seqs), 2)  # the GEMMs take another path for a single row
        width = -(-max(lens) // self.unit) * self.unit
        if self._bytes(need_rows, width) > self.max_bytes:
            self.reset()
            return None
        for key in list(self.released):
            if key not in seqs:
                self.owner.pop(key, None)
                self.length.pop(key, None)
                self.released.discard(key)
        for key in [k for k in self.owner if k not in seqs]:  # left the decode set
            del self.owner[key]
            del self.length[key]
        # Attention runs over the width and every row up to the last one in use, so both are
        # kept tight. The width moves freely within the capacity; the rows are compacted in
        # place when departures left them mostly holes, and re-laid out only to grow.
        top = max(self.owner.values()) + 1 if self.owner else 0
        widen = None
        if need_rows > self.num_rows or width > self.capacity:
            self._relayout(need_rows, width)
        else:
            if top > need_rows + need_rows // 2 + 4:
                top = self._compact()
            if width > self.width and top:
                widen = (self.width, width, top)  # owned rows read zeros in their new columns
        self.width = width
        if widen is None and top and self._reserve:  # elsewhere memory is backed when allocated
            self._pretouch(top)
        # A sequence whose length did not move by exactly the one token is copied again.
        joiners = [k for k in seqs if k not in self.owner or self.length[k] != seqs[k][0] - 1]
        free = sorted(set(range(self.num_rows)) - set(self.owner.values()), reverse=True)
        for key in joiners:
            if key not in self.owner:
                self.owner[key] = free.pop()  # the lowest free row: keeps the used rows dense
        for key, (n, _) in seqs.items():
            self.length[key] = n
        used = max(max(self.owner.values()) + 1, 2)

        dev = self.device
        lens_by_row = [1] * used  # a free row's output is dropped; one key keeps it defined
        for key, (n, _) in seqs.items():
            lens_by_row[self.owner[key]] = n
        masked = torch.arange(self.width)[None, :] >= torch.tensor(lens_by_row)[:, None]
        fill_rows: list[int] = []
        fill_blocks: list[int] = []
        fill_src: list[int] = []
        for key in joiners:
            n, table = seqs[key]
            nb = -(-n // self.bs)
            fill_rows += [self.owner[key]] * nb
            fill_blocks += range(nb)
            fill_src += table[:nb]
        # A key's tables in groups 1 .. (a lone decode comes twice: the first copy's).
        at = {k: i for i, k in reversed(list(enumerate(keys)))} if more else {}
        more_src = [[b for key in joiners for b in g[at[key]][:-(-seqs[key][0] // self.bs)]] for g in more]

        def checks(table_of: Callable[[int], Sequence[int]], group: int = 0) -> list[tuple[int, int, torch.Tensor, int]]:
            if not self.verify:
                return []
            null = self.nulls[group] if group < len(self.nulls) else self.nulls[0]
            out = []
            for k, (n, _) in seqs.items():
                t = table_of(k)
                out.append((self.owner[k], n, torch.tensor(list(t[:-(-n // self.bs)]), device=dev),
                            self.bs * next((i for i, b in enumerate(t) if b != null), len(t))))
            return out

        def idx(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.long, device=dev)

        return RowPlan(
            rows=idx([self.owner[k] for k in keys]),
            used=used,
            positions=idx([n - 1 for n in lens]),
            masked=masked[:, None, None, :].to(dev),
            width=self.width,
            fill=(idx(fill_rows), idx(fill_blocks), idx(fill_src)) if joiners else None,
            joined=idx(sorted({self.owner[k] for k in joiners})) if joiners else None,
            widen=widen,
            check=checks(lambda k: seqs[k][1]),
            fill_more=[idx(src) for src in more_src] if more and joiners else None,
            check_more=[checks(lambda k, g=g: g[at[k]], gi) for gi, g in enumerate(more, 1)] if more else None,
        )

    def _relayout(self, need_rows: int, width: int) -> None:
        """New buffers, the rows still owned moved to the front in row order: copied from
        the old buffers (one strided copy), not gathered from the cache's blocks again."""
        # Room for every sequence the engine may run, where it fits: spare rows cost memory
        # only (attention stops at the last used row), and sequences then join without a
        # re-layout (growing a row at a time cost a copy of every row per join).
        num_rows = max(need_rows, self.max_rows)
        if self._bytes(num_rows, width) > self.max_bytes:
            num_rows = need_rows
        if self._reserve:
            per_unit = self._bytes(num_rows, self.unit)
            capacity = self.max_bytes // per_unit * self.unit
        else:  # some headroom, so a growing width is not a copy every unit
            capacity = min(width + width // 2 + self.unit,
                           self.max_bytes // self._bytes(num_rows, self.unit) * self.unit)
        keep = sorted(self.owner, key=self.owner.__getitem__) if self.k else []
        src = torch.tensor([self.owner[k] for k in keep], dtype=torch.long, device=self.device)
        n, cols = len(keep), min(self.width, width)
        dense = [self.owner[k] for k in keep] == list(range(n))
        shape = (num_rows, self.hk, capacity, self.d)
        fresh = not self.k
        for bufs in (self.k, self.v):
            for layer in range(self.num_layers):
                new = torch.empty(shape, device=self.device)
                if fresh:
                    bufs.append(new)
                    continue
                if n:
                    old = bufs[layer][:, :, :cols]
                    # Rows dense and in order copy straight across; index_select would
                    # first build the whole copy in fresh memory.
                    new[:n, :, :cols] = old[:n] if dense else old.index_select(0, src)
                    # Owned rows hold finite numbers up to the width (a masked key's value
                    # still meets its zero weight); the rest is cleared when a row is taken.
                    new[:n, :, cols:width].zero_()
                bufs[layer] = new  # one layer at a time: old and new never all coexist
        self.num_rows, self.capacity = num_rows, capacity  # plan() sets the width after
        self._touched = (0, 0)  # new buffers: nothing backed past the copied width
        self.owner = {k: i for i, k in enumerate(keep)}
        self.relayouts += 1

    def _pretouch(self, top: int) -> None:
        """Zero the next unit of columns past the width for a few of the used rows each
        step. Nothing reads them before the width grows, and then they are zeroed again, but
        by then their pages are backed: otherwise the step that widens first-touches the new
        columns of every row at once (measured: 576 ms at 64 streams, once every 64 tokens)."""
        start, end = self.width, self.width + self.unit
        if end > self.capacity:
            return
        if self._touched[0] != start:
            self._touched = (start, 0)
        r0 = self._touched[1]
        if r0 >= top:
            return
        r1 = min(top, r0 + -(-top // _PRETOUCH_STEPS))
        for buf in self.k + self.v:
            buf[r0:r1, :, start:end].zero_()
        self._touched = (start, r1)

    def _compact(self) -> int:
        """Move the rows owned at or past the number of owned rows into the free rows below
        it, within the buffers; returns the new top. (Re-laying out into fresh buffers
        instead wrote every kept row into memory never touched before: measured 1.8-1.9 s
        for the step in which 25 of 64 streams ended, nearly all of it page faults.)"""
        n = len(self.owner)
        holes = iter(sorted(set(range(n)) - set(self.owner.values())))
        moves = []
        for key, row in sorted(self.owner.items(), key=lambda kv: kv[1]):
            if row >= n:
                dst = next(holes)
                moves.append((row, dst))
                self.owner[key] = dst
        cols = self.width  # owned rows hold finite numbers up to here; plan() widens after
        for buf in self.k + self.v:
            for src, dst in moves:  # row by row: no temporary copy in fresh memory either
                buf[dst, :, :cols].copy_(buf[src, :, :cols])
        self.compactions += 1
        return n

    def update(self, layer: int, kc: torch.Tensor, vc: torch.Tensor, k_new: torch.Tensor,
               v_new: torch.Tensor, plan: RowPlan, ks: torch.Tensor | None = None,
               vs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """After the step's K/V went into the cache (kc, vc: [hk, slots, d]): copy the joiners'
        blocks into their rows, write every decode's new token (k_new, v_new: [B, hk, d], as
        the cache reads them back), and return this layer's used rows [used, hk, width, d].
        ks, vs: an int8 cache's row scales [hk, slots]: the rows hold its values dequantized."""
        hk, d, bs = self.hk, self.d, self.bs
        w = plan.width
        for buf, cache, sc, new in ((self.k[layer], kc, ks, k_new), (self.v[layer], vc, vs, v_new)):
            if plan.widen is not None:
                start, end, top = plan.widen
                buf[:top, :, start:end].zero_()
            if plan.fill is not None:
                rows, blocks, src = plan.fill
                group = self.layer_group[layer]
                if group and plan.fill_more is not None:  # the layer's own group's blocks
                    src = plan.fill_more[group - 1]
                # Cleared first: a row's last owner may have left NaN past this one's length.
                buf[:, :, :w].index_fill_(0, plan.joined, 0.0)
                data = gather_blocks(cache.view(hk, -1, bs, d), src,
                                     None if sc is None else sc.view(hk, -1, bs)).transpose(0, 1)  # [n, hk, bs, d]
                buf.view(self.num_rows, hk, -1, bs, d).transpose(1, 2).index_put_((rows, blocks), data)
            buf.transpose(1, 2).index_put_((plan.rows, plan.positions), new)
        group = self.layer_group[layer]
        check = plan.check_more[group - 1] if group and plan.check_more is not None else plan.check
        if check:
            self._verify(layer, kc, vc, check, ks, vs)
        return self.k[layer][:plan.used, :, :w], self.v[layer][:plan.used, :, :w]

    def _verify(self, layer: int, kc: torch.Tensor, vc: torch.Tensor,
                check: list[tuple[int, int, torch.Tensor, int]], ks: torch.Tensor | None = None,
                vs: torch.Tensor | None = None) -> None:
        hk, d, bs = self.hk, self.d, self.bs
        for row, n, blocks, lo in check:
            # Positions before lo: blocks a sliding window passed (given back, never read).
            for name, buf, cache, sc in (("K", self.k[layer], kc, ks), ("V", self.v[layer], vc, vs)):
                want = gather_blocks(cache.view(hk, -1, bs, d), blocks,
                                     None if sc is None else sc.view(hk, -1, bs)).view(hk, -1, d)[:, lo:n]
                if torch.equal(buf[row, :, lo:n], want):
                    continue
                if not torch.isfinite(want).all():
                    # Freed (poisoned) memory under a live sequence: read it as the cache
                    # holds it, so the request fails on NaN as it would without the rows.
                    buf[row, :, lo:n] = want
                    continue
                raise RowMismatch(f"layer {layer} {name}: decode row {row} differs from its "
                                  f"{n} cached positions")
