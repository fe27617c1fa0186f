"""Sizes of every workload. The defaults are the issue's; `quick()` scales them to a shared
2-core machine, and the test suite uses `tiny()` on a random 2-layer model."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

WORKLOADS = ("throughput", "invariance", "cancel_storm", "head_of_line", "nonstream_disconnect",
             "preemption")


@dataclass
class BenchConfig:
    seed: int = 0
    workloads: tuple[str, ...] = WORKLOADS
    # 1. throughput / latency (closed loop: `waves` x concurrency requests per level)
    concurrencies: tuple[int, ...] = (1, 8, 32, 64)
    output_tokens: int = 256
    prompt_tokens: int = 128
    waves: int = 2
    temperature: float = 0.0  # 0: greedy; above 0: sampled, request i seeded with seed*100003+i
    # 2. cancel storm
    storm_streams: int = 64
    storm_output_tokens: int = 128
    storm_prompt_tokens: int = 256
    storm_decode_streams: int = 32  # second variant: half of these closed mid-decode (0: skip)
    # 3. batch invariance
    invariance_requests: int = 24
    invariance_tokens: int = 64
    invariance_prompt_tokens: int = 64
    # 4. head-of-line
    hol_clients: int = 10
    hol_prompt_tokens: int = 3000
    hol_delays: tuple[float, ...] = (0.3, 1.5)
    hol_short_prompt_tokens: int = 24
    hol_short_tokens: int = 4
    # 5. preemption storm
    preempt_streams: int = 64
    preempt_output_tokens: int = 128
    preempt_prompt_tokens: int = 128
    preempt_kv_fraction: float = 0.25
    preempt_after_s: float = 5.0
    preempt_after_concurrency: int = 8
    preempt_bracket: bool = True  # an unconstrained reference after every variant too
    # stopline variants: (victim policy, preemption mode)
    preempt_variants: tuple[tuple[str, str], ...] = field(default_factory=lambda: (
        ("cost", "recompute"), ("cost", "swap"), ("cost", "auto"), ("newest", "recompute"),
        ("fewest-output", "recompute"), ("longest-output", "recompute"),
        ("least-computed", "recompute"), ("priority", "recompute")))
    # 6. non-stream disconnect
    nonstream_drop_s: float = 1.0
    nonstream_max_tokens: int = 2048
    # plumbing
    request_timeout: float = 900.0
    idle_timeout: float = 180.0

    def to_json(self) -> dict:
        return asdict(self)


def quick() -> BenchConfig:
    """The issue's workloads at sizes that finish in minutes per engine on 2 shared cores."""
    return replace(BenchConfig(), output_tokens=64, waves=1, storm_output_tokens=64,
                   storm_prompt_tokens=128, invariance_tokens=32, hol_prompt_tokens=1500,
                   preempt_output_tokens=64, preempt_prompt_tokens=64, preempt_after_s=3.0,
                   nonstream_max_tokens=1024,
                   preempt_variants=(("cost", "recompute"), ("cost", "swap"), ("cost", "auto")))


def small() -> BenchConfig:
    """Every workload at the smallest size that still says something: for an engine that
    takes seconds per step (stopline's batch-invariant kernels on 2 busy cores)."""
    return replace(BenchConfig(), output_tokens=16, prompt_tokens=64, waves=1,
                   storm_streams=32, storm_output_tokens=16, storm_prompt_tokens=64,
                   storm_decode_streams=16, invariance_requests=6, invariance_tokens=8,
                   invariance_prompt_tokens=32, hol_prompt_tokens=1500, hol_short_tokens=2,
                   preempt_streams=32, preempt_output_tokens=16, preempt_prompt_tokens=64,
                   preempt_after_s=5.0, preempt_variants=(("cost", "recompute"),),
                   nonstream_max_tokens=512, idle_timeout=300.0)


def tiny() -> BenchConfig:
    """Seconds on the tiny random model (context 1024): keeps the harness from rotting."""
    return replace(BenchConfig(), concurrencies=(1, 4), output_tokens=8, prompt_tokens=16, waves=1,
                   storm_streams=8, storm_output_tokens=8, storm_prompt_tokens=32,
                   storm_decode_streams=4, invariance_requests=3, invariance_tokens=8,
                   invariance_prompt_tokens=16, hol_clients=2, hol_prompt_tokens=200,
                   hol_delays=(0.05,), hol_short_prompt_tokens=8, hol_short_tokens=2,
                   preempt_streams=8, preempt_output_tokens=16, preempt_prompt_tokens=16,
                   preempt_after_s=1.0, preempt_after_concurrency=2,
                   preempt_variants=(("cost", "recompute"),),
                   # The tiny model decodes ~1,500 tok/s alone: drop early and ask for the whole
                   # context (the engine ends a request there) so the drop always wins the race.
                   nonstream_drop_s=0.05, nonstream_max_tokens=1024,
                   idle_timeout=30.0, request_timeout=60.0)


PROFILES = {"full": BenchConfig, "quick": quick, "small": small, "tiny": tiny}
