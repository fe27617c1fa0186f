"""The KV transfer on the wire: one msgspec header frame, then one raw frame per layer
and kind (K then V), so block bytes go to ZMQ without a copy through the encoder.

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
    refs: list[BlockRef]  # the sender's blocks, named with their epochs
    dtype: str
    shapes: list[list[int]]
    sent_at: float = 0.0  # the sender's time.monotonic() before packing (one machine: one clock)
    first: int = 0  # the first block's index in the prompt: blocks a sliding window passed are not sent
    # The LoRA adapter the KV was computed under and its load id (None, 0: the base model):
    # the receiver takes it only for a request holding that very load.
    lora: str | None = None
    lora_load: int = 0
    # Each tensor's dtype where they differ (an int8 cache: K and V quants, then float32
    # scales); empty: every tensor is `dtype`.
    dtypes: list[str] = []


class BadTransfer(ValueError):
    """The frames do not describe a transfer this cache can take."""


_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(TransferHeader)


def pack(request_id: str, cache: KVCache, epochs: BlockEpochs, refs: Sequence[BlockRef],
         first: int = 0, lora: tuple[str, int] | None = None) -> list[bytes | memoryview]:
    """lora: (adapter, load id) the blocks were computed under; None: the base model."""
    t0 = time.monotonic()
    epochs.check(refs)  # a stale ref fails before any byte is read
    data = cache.read_blocks([r.block for r in refs])
    names = [str(t.dtype).removeprefix("torch.") for t in data]
    head = TransferHeader(request_id, list(refs), names[0], [list(t.shape) for t in data], t0, first,
                          *(lora or (None, 0)), dtypes=names if len(set(names)) > 1 else [])
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
    """Write received blocks into the receiver's reserved blocks, checking their epochs."""
    if len(dst) != len(head.refs):
        raise BadTransfer(f"{len(head.refs)} blocks sent for {len(dst)} reserved")
    want = len(cache.k) + len(cache.v) + len(cache.k_scale) + len(cache.v_scale)
    if len(data) != want:
        raise BadTransfer(f"{len(data)} tensors for a cache of {len(cache.k)} layers ({want} tensors)")
    for t, c in zip(data, cache.k + cache.v + cache.k_scale + cache.v_scale, strict=True):
        if t.dtype != c.dtype:  # a float32 sender and an int8 receiver, or the reverse
            raise BadTransfer(f"KV blocks of {t.dtype} for a cache of {c.dtype} (both sides need the "
                              f"same --kv-cache-dtype)")
    epochs.check(dst)
    cache.write_blocks([r.block for r in dst], data)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
