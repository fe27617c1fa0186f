"""The KV transfer's wire format and block epochs (issue 25, first slice)."""

import pytest
import torch

from stopline.disagg.epochs import BlockEpochs, BlockRef, StaleBlock
from stopline.disagg.wire import BadTransfer, pack, unpack, write
from stopline.kv.block_pool import BlockPool
from stopline.kv.kv_cache import KVCache


def _side(num_blocks=8, block_size=4):
    pool = BlockPool(num_blocks, block_size)
    cache = KVCache(2, num_blocks, block_size, 2, 3)
    pool.on_allocate = cache.zero
    return pool, cache, BlockEpochs(pool)


def test_blocks_arrive_bit_for_bit():
    spool, scache, sep = _side()
    rpool, rcache, rep = _side()
    src = spool.allocate(3)
    for t in scache.k + scache.v:
        t.copy_(torch.randn_like(t))
    rpool.allocate(2)  # the receiver's ids differ from the sender's
    dst = rpool.allocate(3)
    head, data = unpack(pack("r1", scache, sep, sep.refs(src)))
    assert head.request_id == "r1" and [r.block for r in head.refs] == src
    write(rcache, rep, rep.refs(dst), head, data)
    for a, b in zip(scache.read_blocks(src), rcache.read_blocks(dst), strict=True):
        assert torch.equal(a, b)


def test_allocation_still_zeroes_the_block():
    pool, cache, epochs = _side()
    b = pool.allocate(1)
    cache.k[0].fill_(5.0)
    pool.release(b, keep_cached=False)
    b2 = pool.allocate(1)
    assert b2 == b and epochs.epoch[b[0]] == 2
    assert torch.count_nonzero(cache.read_blocks(b2)[0]) == 0


def test_a_reused_block_refuses_a_late_send():
    pool, cache, epochs = _side()
    b = pool.allocate(1)
    old = epochs.refs(b)
    pool.release(b, keep_cached=False)
    with pytest.raises(StaleBlock, match="freed"):
        pack("r1", cache, epochs, old)
    pool.allocate(1)  # same id handed to someone else
    with pytest.raises(StaleBlock, match="epoch 2"):
        pack("r1", cache, epochs, old)


def test_a_reused_block_refuses_a_late_write():
    spool, scache, sep = _side()
    rpool, rcache, rep = _side()
    frames = pack("r1", scache, sep, sep.refs(spool.allocate(1)))
    dst = rpool.allocate(1)
    reserved = rep.refs(dst)
    rpool.release(dst, keep_cached=False)  # the request was aborted, block reused
    rpool.allocate(1)
    rcache.k[0].fill_(7.0)
    head, data = unpack(frames)
    with pytest.raises(StaleBlock):
        write(rcache, rep, reserved, head, data)
    assert torch.all(rcache.read_blocks(dst)[0] == 7.0)  # the new owner's KV is untouched


def test_bad_frames_get_a_clear_error():
    pool, cache, epochs = _side()
    frames = pack("r1", cache, epochs, epochs.refs(pool.allocate(2)))
    with pytest.raises(BadTransfer, match="frames"):
        unpack(frames[:-1])
    with pytest.raises(BadTransfer, match="header"):
        unpack([b"\xff\x00"] + frames[1:])
    with pytest.raises(BadTransfer, match="values"):
        unpack(frames[:1] + [bytes(4)] + frames[2:])
    head, data = unpack(frames)
    with pytest.raises(BadTransfer, match="reserved"):
        write(cache, epochs, epochs.refs(pool.allocate(1)), head, data)
    with pytest.raises(StaleBlock, match="outside"):
        epochs.check([BlockRef(99, 1)])


def test_the_header_names_the_adapter_load_the_kv_was_computed_under():
    pool, cache, epochs = _side()
    refs = epochs.refs(pool.allocate(2))
    head, _ = unpack(pack("r1", cache, epochs, refs, 0, ("fr", 3)))
    assert (head.lora, head.lora_load) == ("fr", 3)
    head, _ = unpack(pack("r2", cache, epochs, refs))
    assert (head.lora, head.lora_load) == (None, 0)  # the base model
