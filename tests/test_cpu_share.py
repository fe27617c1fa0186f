"""Small steps on one thread fewer while neighbours take our CPUs (worker/cpu_share.py): the
share is read right from /proc's counters, the rule moves only small steps that run wholly
on stopline's kernels, and a moved step gives the same bits."""

from __future__ import annotations

import pytest
import torch

from stopline.config import EngineConfig
from stopline.engine.core import EngineCore
from stopline.worker.cpu_share import CpuShare, ThreadPolicy
from tests.engine_support import greedy_logprobs


class FakeProc:
    """/proc/stat and /proc/self/stat with counters the test moves, and a clock."""

    def __init__(self) -> None:
        self.t = 0.0
        self.busy = {0: 0, 1: 0, 2: 0}  # ticks per CPU (user); CPU 2 is not ours
        self.ours = 0

    def read(self, path: str) -> str:
        if path == "/proc/stat":
            lines = ["cpu  1 2 3 4 5 6 7 8 0 0"]
            lines += [f"cpu{c} {b} 0 0 999 0 0 0 0 0 0" for c, b in self.busy.items()]
            return "\n".join(lines) + "\nintr 5\n"
        return "42 (python (x) y) S " + " ".join(["1"] * 10) + f" {self.ours} 0 0 0"

    def clock(self) -> float:
        return self.t


def test_the_share_is_others_ticks_over_the_window() -> None:
    proc = FakeProc()
    share = CpuShare({0, 1}, period=0.1, window=0.5, read=proc.read, clock=proc.clock)
    assert share.others() == 0.0
    for _ in range(10):  # steps of 1/8 s (exact in binary): we take 15 ticks, a neighbour 5
        proc.t += 0.125
        proc.busy[0] += 10
        proc.busy[1] += 10
        proc.busy[2] += 10
        proc.ours += 15
        got = share.others()
    assert got == pytest.approx(0.4, abs=0.01)  # 5 ticks at 100 Hz every 1/8 s; CPU 2 is not ours
    proc.t += 0.05  # within a period: not read again
    proc.busy[0] += 100
    assert share.others() == got


def test_unreadable_proc_reads_as_no_neighbours() -> None:
    def read(path: str) -> str:
        raise OSError("no /proc here")

    assert CpuShare({0}, read=read).others() == 0.0


class Busy:
    def __init__(self, cores: float) -> None:
        self.cores = cores

    def others(self) -> float:
        return self.cores


def test_only_small_steps_on_our_kernels_drop_a_thread() -> None:
    yes, no = (lambda: True), (lambda: False)
    p = ThreadPolicy(2, Busy(0.6))
    assert p.pick(1, yes) == 1 and p.pick(4, yes) == 1
    assert p.pick(5, yes) == 2  # a bigger step keeps both
    assert p.pick(1, no) == 2  # the GEMM library's bits may follow the thread count
    assert ThreadPolicy(2, Busy(0.3)).pick(1, yes) == 2  # a light neighbour: both threads
    assert ThreadPolicy(1, Busy(1.0)).pick(1, yes) == 1
    assert ThreadPolicy(2, None).pick(1, yes) == 2  # adapt_threads off


def _run(q4, busy: float | None) -> tuple[dict, EngineCore]:
    eng = EngineCore(q4, EngineConfig(num_blocks=128, block_size=4, max_num_batched_tokens=64,
                                      quant_max_rows=16, debug=True, target_step_ms=None,
                                      speculative="off", adapt_threads=busy is not None))
    if busy is not None:
        eng.runner.threads.share = Busy(busy)
    return greedy_logprobs(eng, [[5, 17, 99, 23, 42, 7, 300, 12, 9, 81], [3, 1, 4, 1, 5]]), eng


@pytest.fixture
def two_threads():
    """The suite runs on one torch thread (tests/__init__.py); this test needs two."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_reading_takes_the_window_and_one_period() -> None:
    """A bench waits this long after a neighbour starts before it times the phase."""
    proc = FakeProc()
    share = CpuShare({0, 1}, period=0.05, window=0.25, read=proc.read, clock=proc.clock)
    assert ThreadPolicy(2, share).reading_s == pytest.approx(0.30)
    default = CpuShare({0, 1}, read=proc.read, clock=proc.clock)
    off = ThreadPolicy(2, None)  # adaptation off: its phases open as long as a default reading
    assert off.reading_s == pytest.approx(default.window + default.period)


def test_a_step_moved_to_fewer_threads_gives_the_same_bits(tiny_q4, two_threads) -> None:
    want, _ = _run(tiny_q4, None)
    got, eng = _run(tiny_q4, busy=1.0)
    assert eng.runner.threads.threads == 2
    assert eng.model.own_kernels(2, 2), "the tiny Q4_1 model's steps should run on the fused decoder"
    # The two streams' 11 decode steps moved (the prefill step, 15 rows, did not; no drafts).
    assert eng.runner.threads.dropped_steps >= 10, eng.runner.threads.dropped_steps
    assert got == want  # tokens and logprobs, to the bit
    assert torch.get_num_threads() == 2  # the count is back after each moved step
