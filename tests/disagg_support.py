"""Helpers for the disaggregation tests: a prefill and a decode core in this process (their
link is real ZMQ over loopback, free ports), stepped in turn by the test, so each message
ordering can be set up by hand; and the front end's cut of a split request."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from stopline.config import EngineConfig
from stopline.disagg.decode_core import DecodeCore, split_blocks
from stopline.disagg.messages import RoleSpec
from stopline.disagg.prefill_core import PrefillCore
from stopline.engine.core import EngineCore
from stopline.engine.output import RequestOutput
from stopline.request import AbortSource, SamplingParams
from tests.engine_support import Result, assert_idle, collect

BLOCK = 4


def config(**kw: object) -> EngineConfig:
    base: dict = dict(num_blocks=64, block_size=BLOCK, debug=True, max_num_batched_tokens=8)
    return EngineConfig(**(base | kw))


@dataclass
class Pair:
    p: EngineCore  # with a PrefillRole
    d: EngineCore  # with a DecodeRole
    link_dir: str
    out: dict[tuple[str, int], Result] = field(default_factory=dict)
    p_out: list[RequestOutput] = field(default_factory=list)

    def add(self, rid: str, prompt: Sequence[int], params: SamplingParams) -> str:
        """As the front end does: decode first, then the prefill role with the full blocks."""
        inc = self.d.add_request(rid, prompt, params)
        n = split_blocks(len(prompt), BLOCK)
        if n:
            self.p.add_request(rid, prompt[:n * BLOCK], SamplingParams(max_tokens=1, lora=params.lora),
                               incarnation=inc)
        return inc

    def load_lora(self, name: str, path: str, load_id: int, decode_id: int | None = None) -> None:
        """As the front end does: the same adapter on both roles with the same load id
        (decode_id: another one on decode, to break that)."""
        for core, i in ((self.p, load_id), (self.d, load_id if decode_id is None else decode_id)):
            got = core.residency.load_lora(name, path, i)
            assert got["status"] == 200, got

    def unload_lora(self, name: str, policy: str) -> None:
        for core in (self.p, self.d):
            got = core.residency.unload_lora(name, policy)
            assert got["status"] == 200, got

    def abort(self, inc: str) -> None:
        self.d.abort([inc], AbortSource.CANCEL, time.monotonic())
        self.p.abort([inc], AbortSource.CANCEL, time.monotonic())

    def step_p(self) -> None:
        self.p_out += self.p.step()
        self.p.audit()

    def step_d(self) -> None:
        collect(self.out, self.d.step())
        self.d.audit()

    def settle(self, timeout: float = 10.0,
               until: Callable[[Pair], bool] | None = None) -> None:
        """Step both (link messages take a moment over loopback) until both are idle."""
        end = time.monotonic() + timeout
        while True:
            busy = self.p.has_unfinished() or self.d.has_unfinished()
            if (until(self) if until is not None else not busy):
                return
            assert time.monotonic() < end, "the pair did not settle"
            self.step_p()
            self.step_d()
            if not busy:
                time.sleep(0.001)

    def assert_idle(self) -> None:
        assert_idle(self.p)
        assert_idle(self.d)
        assert not len(self.p.role.sending) and not len(self.d.role.receiving)

    def close(self) -> None:
        self.p.close()
        self.d.role.link.close()
        shutil.rmtree(self.link_dir, ignore_errors=True)


def make_pair(loaded: object, reclaim_s: float = 3.0, **kw: object) -> Pair:
    link_dir = tempfile.mkdtemp(prefix="stopline-link-test-")
    kv, ack = f"ipc://{link_dir}/kv", f"ipc://{link_dir}/ack"
    p = PrefillCore(loaded, config(**kw), spec=RoleSpec("prefill", kv, ack, reclaim_s), progress=False)
    d = DecodeCore(loaded, config(**kw), spec=RoleSpec("decode", kv, ack, reclaim_s), progress=False)
    return Pair(p, d, link_dir)
