"""The decode role: the plug-in (engine/role.py) with which an EngineCore takes a split
request's prompt KV from the prefill role, then serves the request as one engine would
(sampling from the first token on, grammars, n > 1, speculation, stop strings, streams).

A request whose prompt has a full block to ship (`split_blocks`) waits in
`Transfers(RECV)` (a holder of the one release) instead of joining the scheduler's queue.
Its reclaim clock starts when it starts waiting and restarts at each `Progress` (the
prefill side's heartbeat, every quarter of the deadline, naming the requests it holds or
has queued), so a prefill side that never takes the request, or stops before its first
beat, does not hold it here past the deadline. When the KV arrives the blocks are written
into fresh blocks (wire.write checks their epochs), enter the prefix cache
(KVManager.import_prefix), and the request joins the queue at the same step boundary, so
its admission finds them as prefix hits and computes only the rest of its prompt. That
keeps the output exactly the single engine's: the decode side computes everything a
prefix hit would not. A transfer for a request that is no longer waiting (aborted,
expired) is refused with an Ack naming why and nothing is written.

A request under a LoRA adapter holds its reference here from its add (waiting included). Its
KV is taken only if the transfer names the adapter load the request holds (else the request
ends with an error, and the refusal is acked), and it enters the prefix cache under the
request's salt, so it is a hit for that adapter load only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from stopline.config import EngineConfig
from stopline.disagg.epochs import BlockEpochs
from stopline.disagg.link import Link
from stopline.disagg.messages import Ack, Progress, RoleSpec
from stopline.disagg.transfers import Side, Transfers
from stopline.disagg.wire import TransferHeader, write_groups
from stopline.engine.core import EngineCore, ModelSource
from stopline.engine.role import Role
from stopline.lifecycle import Holder
from stopline.request import Family, FinishReason, Request

log = logging.getLogger("stopline.disagg.decode")


def split_blocks(prompt_len: int, block_size: int) -> int:
    """Full prompt blocks the prefill side computes and ships: never the block holding the
    last prompt token, whose logits the decode side must compute (as a prefix hit would
    leave it). 0: the request runs on the decode side alone."""
    return (prompt_len - 1) // block_size


class DecodeRole(Role):
    name = "decode"

    def __init__(self, spec: RoleSpec) -> None:
        self.spec = spec
        self._waiting: dict[str, Family] = {}  # incarnation -> family waiting for its KV
        self.imported_blocks = 0
        # The last transfers: (bytes, seconds from the sender's pack to the blocks written here).
        self.transfer_log: list[tuple[int, float]] = []

    def bind(self, core: EngineCore) -> list[Holder]:
        if not core.kv_manager.prefix_caching:
            raise ValueError("the decode role needs prefix caching: received KV enters it")
        self.core = core
        spec = self.spec
        # Each KV layer group numbers its blocks in its own pool: each has its epochs.
        self.group_epochs = [BlockEpochs(p) for p in core.kv_manager.pools]
        self.epochs = self.group_epochs[0]
        self.receiving = Transfers(Side.RECV, spec.reclaim_s)
        self.link = Link(spec.kv_addr, spec.ack_addr, bind_pull=spec.bind_pull, bind_push=spec.bind_push,
                         wake=lambda: core.wake())
        return [self.receiving]  # the transfer entry before the blocks

    # What the link brought must be read even with no request here: stray KV is refused. A
    # request waiting for its KV takes no step: the loop sleeps until the link wakes it or the
    # reclaim deadline (wake_at) is due.
    def messages(self) -> bool:
        return self.link.pending()

    def holding(self) -> bool:
        return bool(len(self.receiving))

    def idle(self, req: Request) -> bool:
        return self._waiter(req.incarnation) is not None

    def wake_at(self) -> float:
        return self.receiving.next_deadline()

    def after_inbox(self) -> None:
        """New requests first: a KV that overtook nothing finds its waiter."""
        self._take_link()
        for req in self.receiving.expired():
            self.core.lifecycle.fail(req, FinishReason.ERROR,
                                     f"recv transfer: no word from the prefill engine within "
                                     f"{self.spec.reclaim_s:g} s (reclaim deadline)")
        self._forget_ended()

    def admit(self, fam: Family) -> bool:
        leader = fam.members[0]
        if split_blocks(leader.prompt_len, self.core.pool.block_size) == 0:
            return False
        self.receiving.start(leader, [])  # its clock runs from now: see the module's docstring
        self._waiting[fam.incarnation] = fam
        return True

    def _waiter(self, inc: str) -> Request | None:
        fam = self._waiting.get(inc)
        if fam is None:
            return None
        req = fam.members[0]
        return req if self.receiving.get(req) is not None else None

    def _take_link(self) -> None:
        for msg in self.link.take():
            if isinstance(msg, Progress):
                req = self._waiter(msg.incarnation)
                t = self.receiving.get(req) if req is not None else None
                if t is not None:
                    t.deadline = time.monotonic() + self.spec.reclaim_s
            elif isinstance(msg, tuple):
                self._receive(*msg)
        for err in self.link.bad:
            log.error("undecodable frames on the link: %s", err)
        self.link.bad.clear()

    def _receive(self, head: TransferHeader, data: list) -> None:
        core = self.core
        inc = head.request_id
        req = self._waiter(inc)
        if req is None:
            self.link.send(Ack(inc, "no request of this incarnation is waiting for KV "
                                    "(aborted, expired or unknown)"))
            return
        kv = core.kv_manager
        n = split_blocks(req.prompt_len, core.pool.block_size)
        try:
            if list(head.windows) != kv.windows:  # the sender's model is grouped otherwise
                raise ValueError(f"the KV came in {len(head.windows)} layer groups of windows "
                                 f"{head.windows}; this model's are {kv.windows}")
            for g, (first, count) in enumerate(zip(head.firsts, head.counts, strict=True)):
                if not 0 <= first <= n or count != n - first:
                    raise ValueError(f"{count} blocks sent from block {first}"
                                     + (f" in layer group {g}" if g else "") + f", {n} expected")
            sent = None if head.lora is None else (head.lora, head.lora_load)
            held = core.adapters.held.get(req)
            if sent != held:  # KV of another adapter, or of an earlier load of this one
                raise ValueError(f"the KV was computed under {_adapter(sent)}, the request here holds "
                                 f"{_adapter(held)}")
            got = kv.import_prefix(
                req.prompt_token_ids, n,
                lambda blocks: write_groups(core.kv, self.group_epochs,
                                            [ep.refs(b) for ep, b in zip(self.group_epochs, blocks, strict=True)],
                                            head, data),
                firsts=head.firsts, salt=kv.salt(req))  # found under its adapter only
        except Exception as exc:  # StaleBlock, BadTransfer, a shape mismatch: never decode it
            core.lifecycle.fail(req, FinishReason.ERROR, f"KV transfer failed: {exc}")
            self.link.send(Ack(inc, f"KV transfer failed: {exc}"))
            return
        self.imported_blocks += sum(got)
        received = core.lifecycle.stats.transfer_blocks
        for g, c in enumerate(got):
            received["received", g] += c
        if head.sent_at:
            nbytes = sum(t.numel() * t.element_size() for t in data)
            self.transfer_log = [*self.transfer_log[-999:], (nbytes, time.monotonic() - head.sent_at)]
        self.receiving.done(req)
        fam = self._waiting.pop(inc)
        if core.taken_sink is not None:  # before the ack: prefill may end, or die, from here on
            core.taken_sink([inc])
        self.link.send(Ack(inc))
        core.admit(fam)  # admitted in this step: its blocks are prefix hits now

    def _forget_ended(self) -> None:
        for inc in [i for i, f in self._waiting.items() if f.members[0].status.is_finished]:
            del self._waiting[inc]

    def transfers(self) -> list[tuple[int, float]]:
        return self.transfer_log

    def audit(self, live: Sequence[Request]) -> None:
        self.receiving.audit(live)


def _adapter(held: tuple[str, int] | None) -> str:
    return "the base model" if held is None else f"adapter {held[0]!r} (load {held[1]})"


def DecodeCore(model: ModelSource = None, config: EngineConfig | None = None, *,  # noqa: N802
               spec: RoleSpec, progress: bool = True, **kwargs: Any) -> EngineCore:
    """An EngineCore serving the decode side of a split (its role: `core.role`)."""
    return EngineCore(model, config, progress=progress, role=DecodeRole(spec), **kwargs)
