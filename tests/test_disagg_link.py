"""The link's bound PUSH socket (the role beside the front end when the other role is
remote) before its peer has connected: sends are kept, in order, and go out once it has."""

from __future__ import annotations

import time

import msgspec
import zmq

from stopline.disagg.link import KV_TAG, MSG_TAG, Link
from stopline.disagg.messages import Ack, LinkMsg


def test_a_bound_link_keeps_what_it_sends_before_its_peer_connects(tmp_path):
    pull_addr, push_addr = f"ipc://{tmp_path}/ack", f"ipc://{tmp_path}/kv"
    link = Link(pull_addr, push_addr, bind_pull=True, bind_push=True)
    ctx = zmq.Context()
    peer = ctx.socket(zmq.PULL)
    try:
        link.send(Ack("inc-1"))  # nobody connected: a bare NOBLOCK send raises zmq.Again here
        link.send(Ack("inc-2", "failed"))
        link.beat(["inc-1"])  # dropped: a beat nobody can hear says nothing the next won't
        peer.connect(push_addr)
        deadline = time.monotonic() + 5
        got: list[list[bytes]] = []
        while len(got) < 3 and time.monotonic() < deadline:
            link.beat(["inc-3"])  # flushes the kept messages first, then beats
            if peer.poll(100):
                while peer.poll(0):
                    got.append(peer.recv_multipart())
        dec = msgspec.msgpack.Decoder(LinkMsg)
        assert all(parts[0] == MSG_TAG for parts in got)
        msgs = [dec.decode(parts[1]) for parts in got]
        assert msgs[:2] == [Ack("inc-1"), Ack("inc-2", "failed")]
        assert all(m.incarnation == "inc-3" for m in msgs[2:]) and len(msgs) >= 3
    finally:
        peer.close(linger=0)
        ctx.term()
        link.close()


def test_an_ended_transfer_leaves_nothing_on_the_link(tmp_path):
    """Frames kept for a peer not yet connected belong to their request: dropping it takes
    its frames out (and only its), and the rest still go out in order."""
    pull_addr, push_addr = f"ipc://{tmp_path}/ack", f"ipc://{tmp_path}/kv"
    link = Link(pull_addr, push_addr, bind_pull=True, bind_push=True)
    ctx = zmq.Context()
    peer = ctx.socket(zmq.PULL)
    try:
        link.send_kv("inc-a", [b"a1", b"a2"])
        link.send(Ack("inc-x"))
        link.send_kv("inc-b", [b"b1"])
        assert link.queued() == {"inc-a", "inc-b"}
        link.drop("inc-a")
        link.drop("inc-zzz")  # nothing of it: nothing changes
        assert link.queued() == {"inc-b"}
        peer.connect(push_addr)
        deadline = time.monotonic() + 5
        got: list[list[bytes]] = []
        while len(got) < 2 and time.monotonic() < deadline:
            link.beat([])
            if peer.poll(100):
                while peer.poll(0):
                    got.append(peer.recv_multipart())
        assert [p[0] for p in got] == [MSG_TAG, KV_TAG] and got[1][1:] == [b"b1"]
        assert link.queued() == set()
    finally:
        peer.close(linger=0)
        ctx.term()
        link.close()
