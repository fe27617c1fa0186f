"""KV transfer throughput over ZMQ: pack a prompt's blocks from a KV cache, send them
PUSH -> PULL with zero-copy frames, unpack and write them into a second cache. ipc:// vs
tcp loopback, to decide whether a same-machine fast path pays (issue 25).

    python -m stopline.bench.disagg_wire [--tokens 1500] [--reps 3]

The shape defaults to SmolLM2-135M (30 layers, 3 KV heads, head_dim 64, fp32).
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time

import zmq

from stopline.disagg.epochs import BlockEpochs
from stopline.disagg.wire import pack, unpack, write
from stopline.kv.block_pool import BlockPool
from stopline.kv.kv_cache import KVCache


def _side(layers: int, blocks: int, block_size: int, heads: int, head_dim: int):
    pool = BlockPool(blocks, block_size)
    cache = KVCache(layers, blocks, block_size, heads, head_dim)
    pool.on_allocate = cache.zero
    return pool, cache, BlockEpochs(pool)


def measure(addr: str, tokens: int, reps: int, layers: int = 30, heads: int = 3,
            head_dim: int = 64, block_size: int = 16) -> tuple[float, float]:
    """(MB per transfer, MB/s end to end: pack, send, receive, unpack, write)."""
    n = -(-tokens // block_size)
    spool, scache, sep = _side(layers, n, block_size, heads, head_dim)
    rpool, rcache, rep = _side(layers, n, block_size, heads, head_dim)
    src, dst = spool.allocate(n), rpool.allocate(n)
    for t in scache.k + scache.v:
        t.normal_()
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(addr)
    push = ctx.socket(zmq.PUSH)
    push.connect(pull.getsockopt_string(zmq.LAST_ENDPOINT))
    nbytes = 0

    def receive() -> None:
        for _ in range(reps):
            frames = pull.recv_multipart(copy=False)
            head, data = unpack([f.buffer for f in frames])
            write(rcache, rep, rep.refs(dst), head, data)

    t0 = time.perf_counter()
    th = threading.Thread(target=receive)
    th.start()
    for _ in range(reps):
        frames = pack("bench", scache, sep, sep.refs(src))
        nbytes = sum(memoryview(f).nbytes for f in frames)
        push.send_multipart(frames, copy=False)
    th.join()
    dt = time.perf_counter() - t0
    push.close(0)
    pull.close(0)
    ctx.term()
    return nbytes / 1e6, reps * nbytes / 1e6 / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    d = tempfile.mkdtemp()
    print("| transport | MB per transfer | MB/s (pack+send+unpack+write) |")
    print("|---|---|---|")
    for name, addr in (("ipc", f"ipc://{d}/kv"), ("tcp loopback", "tcp://127.0.0.1:*")):
        mb, rate = measure(addr, a.tokens, a.reps)
        print(f"| {name} | {mb:.1f} | {rate:.0f} |")


if __name__ == "__main__":
    main()
