"""The prefill role: the plug-in (engine/role.py) with which an EngineCore computes prompts
(chunked, interruptible as in one engine) and ships each prompt's KV blocks to the decode
role instead of sampling.

Its prompts are the full blocks of the client's prompt (the front end cuts the rest): when
the last chunk has run, the blocks are packed (wire.pack checks their epochs), pushed over
the link, and held by `Transfers(SEND)` while the request sits paused (it takes no step)
until the decode side acks, refuses, or the reclaim deadline passes. An ack finishes the
request here (its terminal output never reaches a client: the front end forwards only
errors); a refusal or the deadline fails it with an error, through the one release, so
the transfer entry and then the blocks are freed in that order. A request under a LoRA
adapter is computed under it, and its transfer names the adapter and load id. A heartbeat
thread tells the decode side which requests this process still holds. Aborts apply as in one
engine: at each step start, right after a forward, and at the next chunk boundary.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from stopline.config import EngineConfig
from stopline.disagg.epochs import BlockEpochs
from stopline.disagg.link import Link
from stopline.disagg.messages import Ack, RoleSpec
from stopline.disagg.transfers import Side, Transfers
from stopline.disagg.wire import pack_groups
from stopline.engine.core import EngineCore, ModelSource
from stopline.engine.families import hold
from stopline.engine.role import Role
from stopline.kv.block_pool import LedgerError
from stopline.lifecycle import Holder
from stopline.request import FinishReason, Request

log = logging.getLogger("stopline.disagg.prefill")

HANDED_OFF = "handed off to the decode engine"


class Backlog:
    """Holder of a request's KV frames the link could not send yet (no peer connected): the
    request's release drops them, so a transfer never outlives its request on the link."""

    name = "link backlog"

    def __init__(self, link: Link) -> None:
        self.link = link

    def release(self, req: Request) -> None:
        self.link.drop(req.incarnation)

    def preempt(self, req: Request) -> None:
        pass  # packed at hand-off: the frames are the transfer, which waits for its ack

    def holds(self, req: Request) -> bool:
        return req.incarnation in self.link.queued()


class PrefillRole(Role):
    name = "prefill"

    def __init__(self, spec: RoleSpec) -> None:
        self.spec = spec

    def bind(self, core: EngineCore) -> list[Holder]:
        self.core = core
        # Each KV layer group numbers its blocks in its own pool: each has its epochs.
        self.group_epochs = [BlockEpochs(p) for p in core.kv_manager.pools]
        self.epochs = self.group_epochs[0]
        self.sending = Transfers(Side.SEND, self.spec.reclaim_s)
        spec = self.spec
        self.link = Link(spec.ack_addr, spec.kv_addr, bind_pull=spec.bind_pull, bind_push=spec.bind_push,
                         wake=lambda: core.wake())
        self._stop_beat = threading.Event()
        self._beat_thread = threading.Thread(target=self._heartbeat, daemon=True, name="stopline-beat")
        self._beat_thread.start()
        # The transfer entry, then the frames still on the link; the blocks last.
        return [self.sending, Backlog(self.link)]

    # ---- the loop's view ------------------------------------------------------------------
    # A request waiting for its ack is paused: the loop sleeps until the link wakes it or the
    # reclaim deadline (wake_at) is due. An ack with no request left must still be read.
    def messages(self) -> bool:
        return self.link.pending()

    def wake_at(self) -> float:
        return self.sending.next_deadline()

    def step_start(self) -> None:
        self._take_link()
        for req in self.sending.expired():
            self.core.lifecycle.fail(req, FinishReason.ERROR,
                                     f"send transfer not acked by the decode engine within "
                                     f"{self.spec.reclaim_s:g} s (reclaim deadline)")

    def _heartbeat(self) -> None:
        """Tell the decode side, every quarter of the reclaim deadline, which requests this
        process still holds (queued, prefilling or sending): its wait for their KV is alive.
        A thread, not the step: one chunk of a long prompt can take longer than the deadline.
        A dead or wedged-out process stops beating and the decode side reclaims."""
        while not self._stop_beat.wait(self.spec.reclaim_s / 4):
            try:
                # Queued adds too: one long step can keep an add in the inbox past the deadline.
                incs = list(self.core.families.by_incarnation) + self.core.inbox.queued()
            except RuntimeError:  # the table changed under the copy: the next beat has it
                continue
            self.link.beat(incs)

    def close(self) -> None:
        """Stop the heartbeat and the link (tests; a role process just exits)."""
        self._stop_beat.set()
        self._beat_thread.join(2.0)
        self.link.close()

    def prefilled(self, req: Request) -> bool:
        kv = self.core.kv_manager
        # Each layer group's blocks its window still reads (all, without a window): the
        # blocks a window passed are not sent (KVManager.export_prefix).
        parts = kv.export_prefix(req, len(req.prompt_token_ids) // self.core.pool.block_size)
        refs = [ep.refs(blocks) for ep, (_, blocks) in zip(self.group_epochs, parts, strict=True)]
        # The adapter load it ran under travels with the KV: decode takes it only under the same.
        frames = pack_groups(req.incarnation, self.core.kv, self.group_epochs,
                             [(w, first, r) for w, (first, _), r in zip(kv.windows, parts, refs, strict=True)],
                             self.core.adapters.held.get(req))
        self.sending.start(req, [r for rs in refs for r in rs])
        sent = self.core.lifecycle.stats.transfer_blocks
        for g, r in enumerate(refs):
            sent["sent", g] += len(r)
        hold(req)  # holds its blocks, takes no step
        self.link.send_kv(req.incarnation, frames)
        return True

    def _take_link(self) -> None:
        lifecycle = self.core.lifecycle
        for msg in self.link.take():
            if not isinstance(msg, Ack):
                continue
            fam = self.core.families.get(msg.incarnation)
            req = fam.members[0] if fam is not None else None
            if req is None or req.status.is_finished or self.sending.done(req) is None:
                continue  # aborted or expired meanwhile: a late ack changes nothing
            if msg.error is None:
                lifecycle.finish(req, FinishReason.STOP, HANDED_OFF)
            else:
                lifecycle.fail(req, FinishReason.ERROR, f"decode engine refused the KV: {msg.error}")

    def audit(self, live: Sequence[Request]) -> None:
        self.sending.audit(live)
        stray = self.link.queued() - {r.incarnation for r in live}
        if stray:
            raise LedgerError(f"KV frames of ended requests wait on the link: {sorted(stray)}")


def PrefillCore(model: ModelSource = None, config: EngineConfig | None = None, *,  # noqa: N802
                spec: RoleSpec, progress: bool = True, **kwargs: Any) -> EngineCore:
    """An EngineCore serving the prefill side of a split (its role: `core.role`)."""
    return EngineCore(model, config, progress=progress, role=PrefillRole(spec), **kwargs)
