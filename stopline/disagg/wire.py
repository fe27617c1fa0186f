"""The KV transfer on the wire: one msgspec header frame, then one raw frame per layer
and kind, so block bytes go to ZMQ without a copy through the encoder. A model whose layers
form several KV groups (docs/sliding-window.md) ships each group's blocks in the one
transfer: the header names each group's window, first block index and block count, and the
frames are group 0's layers (K, then V), then group 1's, and so on. An int8 cache
(`--kv-cache-dtype int8`) ships each group's K and V quants, then their scales, the header
naming each frame's dtype; a receiver whose cache holds another dtype refuses the transfer.

The sender checks its refs' epochs before reading and the receiver checks its own before
writing: a block freed and reused on either side makes the transfer fail loudly, never
decode garbage.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import msgspec
import torch

from stopline.disagg.epochs import BlockEpochs, BlockRef
from stopline.kv.kv_cache import KVCache


class TransferHeader(msgspec.Struct, frozen=True):
    request_id: str
    refs: list[BlockRef]  # the sender's blocks, named with their epochs: group 0's, then 1's ...
    dtype: str
    shapes: list[list[int]]
    # Per KV layer group, in group order: the sender's window (the receiver checks it against
    # its own), the index in the prompt of the group's first block (the blocks its window no
    # longer reads are not sent), and how many of `refs` are the group's.
    windows: list[int]
    firsts: list[int]
    counts: list[int]
    sent_at: float = 0.0  # the sender's time.monotonic() before packing (one machine: one clock)
    # The LoRA adapter the KV was computed under and its load id (None, 0: the base model):
    # the receiver takes it only for a request holding that very load.
    lora: str | None = None
    lora_load: int = 0
    # Each frame's dtype where they differ (an int8 cache: quants, then float32 scales);
    # empty: every frame is `dtype`.
    dtypes: list[str] = []


class BadTransfer(ValueError):
    """The frames do not describe a transfer this cache can take."""


_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(TransferHeader)


def pack(request_id: str, cache: KVCache, epochs: BlockEpochs, refs: Sequence[BlockRef],
         first: int = 0, lora: tuple[str, int] | None = None) -> list[bytes | memoryview]:
    """The blocks of a model of one layer group. lora: (adapter, load id) the blocks were
    computed under; None: the base model."""
    return pack_groups(request_id, cache, [epochs], [(0, first, refs)], lora)


def pack_groups(request_id: str, cache: KVCache, epochs: Sequence[BlockEpochs],
                parts: Sequence[tuple[int, int, Sequence[BlockRef]]],
                lora: tuple[str, int] | None = None) -> list[bytes | memoryview]:
    """parts: per layer group (window, first, refs); epochs: each group's."""
    t0 = time.monotonic()
    if len(parts) != len(cache.groups) or len(epochs) != len(parts):
        raise BadTransfer(f"{len(parts)} groups of blocks for a cache of {len(cache.groups)}")
    for ep, (_, _, refs) in zip(epochs, parts, strict=True):
        ep.check(refs)  # a stale ref fails before any byte is read
    data = [t for g, (_, _, refs) in enumerate(parts) for t in cache.read_blocks([r.block for r in refs], group=g)]
    names = [str(t.dtype).removeprefix("torch.") for t in data]
    head = TransferHeader(request_id, [r for _, _, refs in parts for r in refs],
                          names[0], [list(t.shape) for t in data],
                          windows=[w for w, _, _ in parts], firsts=[f for _, f, _ in parts],
                          counts=[len(refs) for _, _, refs in parts], sent_at=t0,
                          lora=lora[0] if lora else None, lora_load=lora[1] if lora else 0,
                          dtypes=names if len(set(names)) > 1 else [])
    return [_ENC.encode(head)] + [memoryview(t.contiguous().numpy()).cast("B") for t in data]


def unpack(frames: Sequence[bytes | memoryview]) -> tuple[TransferHeader, list[torch.Tensor]]:
    if not frames:
        raise BadTransfer("no frames")
    try:
        head = _DEC.decode(frames[0])
    except msgspec.DecodeError as e:
        raise BadTransfer(f"bad transfer header: {e}") from e
    names = head.dtypes or [head.dtype] * len(head.shapes)
    dtypes = [getattr(torch, n, None) for n in names]
    for n, dtype in zip(names, dtypes, strict=True):
        if not isinstance(dtype, torch.dtype):
            raise BadTransfer(f"unknown dtype {n!r}")
    if not (len(head.windows) == len(head.firsts) == len(head.counts) >= 1) or sum(head.counts) != len(head.refs):
        raise BadTransfer(f"header names {len(head.refs)} blocks in groups {head.counts} "
                          f"from {head.firsts} of windows {head.windows}")
    if len(frames) - 1 != len(head.shapes) or len(dtypes) != len(head.shapes):
        raise BadTransfer(f"header names {len(head.shapes)} tensors and {len(dtypes)} dtypes, "
                          f"got {len(frames) - 1} frames")
    out = []
    for f, shape, dtype in zip(frames[1:], head.shapes, dtypes, strict=True):
        t = torch.frombuffer(bytearray(f), dtype=dtype)
        if t.numel() != _numel(shape):
            raise BadTransfer(f"frame of {t.numel()} values for shape {shape}")
        out.append(t.view(shape))
    return head, out


def write(cache: KVCache, epochs: BlockEpochs, dst: Sequence[BlockRef], head: TransferHeader,
          data: Sequence[torch.Tensor]) -> None:
    """Write received blocks into the receiver's reserved blocks (one layer group), checking
    their epochs."""
    write_groups(cache, [epochs], [dst], head, data)


def write_groups(cache: KVCache, epochs: Sequence[BlockEpochs], dst: Sequence[Sequence[BlockRef]],
                 head: TransferHeader, data: Sequence[torch.Tensor]) -> None:
    """Write each layer group's received blocks into the receiver's reserved blocks of that
    group (dst, epochs: per group), checking every epoch before writing any block."""
    if len(dst) != len(head.counts) or len(cache.groups) != len(dst):
        raise BadTransfer(f"blocks of {len(head.counts)} layer groups sent, {len(dst)} reserved, "
                          f"a cache of {len(cache.groups)}")
    for g, (d, n) in enumerate(zip(dst, head.counts, strict=True)):
        if len(d) != n:
            raise BadTransfer(f"{n} blocks sent for {len(d)} reserved" + (f" in layer group {g}" if g else ""))
    want = cache.kinds * len(cache.k)
    if len(data) != want:
        raise BadTransfer(f"{len(data)} tensors for a cache of {len(cache.k)} layers ({want} tensors)")
    widths = [cache.kinds * len(layers) for layers in cache.groups]  # K and V (and scales) of each layer
    mine = [dtype for g in range(len(dst)) for dtype in cache.dtypes(g)]
    for t, dtype in zip(data, mine, strict=True):
        if t.dtype != dtype:  # a float32 sender and an int8 receiver, or the reverse
            raise BadTransfer(f"KV blocks of {t.dtype} for a cache of {dtype} (both sides need the "
                              f"same --kv-cache-dtype)")
    for ep, d in zip(epochs, dst, strict=True):
        ep.check(d)
    at = 0
    for g, (d, width) in enumerate(zip(dst, widths, strict=True)):
        cache.write_blocks([r.block for r in d], data[at:at + width], group=g)
        at += width


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
