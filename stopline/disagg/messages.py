"""Typed messages on the link between the two roles (msgspec). Each names the request's
incarnation, never its caller's id, so a late message can't touch a newer request that
reuses the id.

prefill -> decode: `Progress` (a chunk of the prompt ran: the decode side's wait for the
KV is still alive), then the KV itself (wire.py: a TransferHeader whose request_id is the
incarnation, then one frame per layer and kind).
decode -> prefill: `Ack` (the blocks are written, or why they were refused).
"""

from __future__ import annotations

import msgspec


class Progress(msgspec.Struct, tag="progress"):
    incarnation: str


class Ack(msgspec.Struct, tag="ack"):
    incarnation: str
    error: str | None = None  # None: written; else the reason the decode side refused them


class RoleSpec(msgspec.Struct, frozen=True):
    """What a role process needs beyond the engine config."""

    role: str  # "prefill" or "decode"
    kv_addr: str  # the decode side binds it (PULL); the prefill side pushes KV to it
    ack_addr: str  # the prefill side binds it (PULL); the decode side pushes acks to it
    reclaim_s: float  # the reclaim deadline, both sides
    # How the link's sockets attach (link.py): on one machine each role binds its PULL; with
    # one role remote, the local one binds both and the remote one connects both.
    bind_pull: bool = True
    bind_push: bool = False


LinkMsg = Progress | Ack
