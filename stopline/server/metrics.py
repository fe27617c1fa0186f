"""Prometheus metrics (`GET /metrics`). Names are stable; docs/api.md lists them.

Gauges and engine counters come from the engine's latest snapshot (taken by the core after
every step), read at scrape time, so a scrape never waits for a step. Latencies and
per-outcome counts are recorded on the frontend as outputs arrive. Each registry belongs to
one server, so several servers in one process (tests) don't collide.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from stopline.engine.async_engine import AsyncEngine, EngineObserver
from stopline.engine.messages import AbortTiming
from stopline.engine.snapshot import Snapshot
from stopline.request import AbortSource, FinishReason, Usage
from stopline.stats import MASK_BOUNDS

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05,
                   0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ABORT_STATES = ("waiting", "prefilling", "running", "preempted", "swapped")
PREEMPTION_MODES = ("recompute", "swap")
DISCARD_REASONS = ("cancel", "preempt", "stop", "error")
APIS = ("chat", "completions", "messages", "responses")


class Recent:
    """The latest samples of a latency, for exact percentiles (the histograms' buckets are
    too coarse to read a p50 from) over a window that follows the load as it changes."""

    def __init__(self, size: int) -> None:
        self.samples: deque[float] = deque(maxlen=size)

    def add(self, seconds: float) -> None:
        self.samples.append(seconds)

    def percentiles(self, qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> dict[str, float | int | None]:
        xs = sorted(self.samples)
        out: dict[str, float | int | None] = {"n": len(xs)}
        for q in qs:
            out[f"p{round(q * 100)}"] = xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None
        return out


class TokenRate:
    """Tokens per second sent out over the last `window` seconds."""

    def __init__(self, window: float = 2.0) -> None:
        self.window = window
        self._marks: deque[tuple[float, int]] = deque()

    def add(self, n: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._marks.append((now, n))
        # Dropped here too, not only when read: only the console reads the rate, and a server
        # nobody watches kept every mark (the soak's 0.94 KiB a request, issue 47).
        self._drop(now)

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self._drop(now)
        return sum(n for _, n in self._marks) / self.window

    def _drop(self, now: float) -> None:
        while self._marks and self._marks[0][0] < now - self.window:
            self._marks.popleft()


class ServerMetrics(EngineObserver):
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        src = ["source"]
        self.abort_accept = Histogram(
            "stopline_abort_accept_latency_seconds",
            "Disconnect or cancel call -> abort accepted by the engine core.",
            src, buckets=LATENCY_BUCKETS, registry=r)
        self.abort_quiet = Histogram(
            "stopline_abort_latency_seconds",
            "Disconnect or cancel call -> engine quiet (the terminal output left the core; no further step includes the request).",
            src, buckets=LATENCY_BUCKETS, registry=r)
        self.reclaim = Histogram(
            "stopline_reclaim_latency_seconds",
            "Disconnect or cancel call -> the request's KV blocks back in the pool.",
            src, buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("stopline_time_to_first_token_seconds",
                              "Arrival at the server -> first token of a sample.",
                              buckets=TOKEN_BUCKETS, registry=r)
        self.itl = Histogram("stopline_inter_token_latency_seconds",
                             "Time between consecutive tokens of a sample.",
                             buckets=TOKEN_BUCKETS, registry=r)
        self.finished = Counter("stopline_request_finished",
                                "Sequences ended, by finish reason (a request with n samples counts n).",
                                ["reason"], registry=r)
        for reason in FinishReason:
            self.finished.labels(reason.value)
        # Terminal 'abort' outputs by who ended them: the engine's own stops (pause, sleep,
        # update, shutdown, replica) reach their client as errors (docs/engine-stops.md).
        self.aborted = Counter("stopline_aborted_sequences",
                               "Sequences whose terminal output was an abort, by source and whether "
                               "the engine initiated it (then the client got an error).",
                               ["source", "engine_initiated"], registry=r)
        for src in AbortSource:
            self.aborted.labels(src.value, str(src.engine_initiated).lower())
        self.prompt_tokens = Counter("stopline_prompt_tokens", "Prompt tokens of admitted requests.",
                                     registry=r)
        self.generation_tokens = Counter("stopline_generation_tokens",
                                         "Tokens generated and sent out by the engine core.", registry=r)
        self.rejected = Counter("stopline_requests_rejected",
                                "Generation requests refused before admission, by HTTP status.",
                                ["status"], registry=r)
        self.requests = Counter("stopline_api_requests",
                                "Generation requests admitted, by API (chat, completions, "
                                "messages, responses).", ["api"], registry=r)
        for api in APIS:
            self.requests.labels(api)
        self.reasoning_tokens = Counter("stopline_reasoning_tokens",
                                        "Thinking tokens sent out (markers included).", registry=r)
        self.usage_unsent = Counter("stopline_usage_unsent",
                                    "Streams that asked for usage but whose client left before the "
                                    "final usage chunk could be sent.", registry=r)
        # For the web console: recent latencies and the last few aborts' timings.
        self.recent_ttft = Recent(512)
        self.recent_itl = Recent(4096)
        self.token_rate = TokenRate()
        self.recent_aborts: deque[AbortTiming] = deque(maxlen=8)

    def bind(self, engine: AsyncEngine) -> None:
        self.registry.register(_EngineCollector(engine))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    # ---- EngineObserver -------------------------------------------------------------------
    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)
        self.recent_ttft.add(seconds)

    def on_token_gap(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self.recent_itl.add(seconds)

    def on_tokens(self, n: int) -> None:
        self.token_rate.add(n)

    def on_sample_end(self, reason: str, usage: Usage | None) -> None:
        self.finished.labels(reason).inc()
        if usage is not None:
            self.generation_tokens.inc(usage.completion_tokens)
            self.reasoning_tokens.inc(usage.reasoning_tokens)

    def on_aborted(self, source: str) -> None:
        self.aborted.labels(source, str(AbortSource(source).engine_initiated).lower()).inc()

    def on_request_end(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def on_abort_timing(self, timing: AbortTiming) -> None:
        self.abort_accept.labels(timing.source).observe(timing.accept_s)
        self.abort_quiet.labels(timing.source).observe(timing.quiet_s)
        self.reclaim.labels(timing.source).observe(timing.reclaim_s)
        self.recent_aborts.append(timing)


class _EngineCollector(Collector):
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        e = self.engine
        # Ray replicas (stopline/cluster): each engine family once, one series per replica.
        replicas = getattr(getattr(e, "backend", None), "snapshots", None)
        per = replicas() if replicas is not None else None
        snaps = per if per is not None else {"": e.snapshot}
        lab = ["replica"] if per is not None else []

        def key(r: str) -> list[str]:
            return [r] if per is not None else []

        def gauge(name: str, doc: str, values: dict[str, float]) -> Metric:
            g = GaugeMetricFamily(name, doc, labels=lab)
            for r, v in values.items():
                g.add_metric(key(r), v)
            return g

        def counter(name: str, doc: str, values: dict[str, float]) -> Metric:
            c = CounterMetricFamily(name, doc, labels=lab)
            for r, v in values.items():
                c.add_metric(key(r), v)
            return c

        gauges = [
            ("stopline_requests_running", "Sequences scheduled in the engine (prefilling or decoding).", "running"),
            ("stopline_requests_waiting", "Sequences admitted to the engine, not yet scheduled.", "waiting"),
            ("stopline_requests_preempted", "Sequences preempted or swapped out, waiting to resume.", "preempted"),
            ("stopline_kv_blocks_total", "KV blocks in the pool.", "kv_blocks_total"),
            ("stopline_kv_blocks_used", "KV blocks owned by live requests (or fenced).", "kv_blocks_used"),
            ("stopline_kv_blocks_cached", "Free KV blocks holding a reusable prefix.", "kv_blocks_cached"),
        ]
        for name, doc, field in gauges:
            yield gauge(name, doc, {r: getattr(s, field) for r, s in snaps.items()})
        yield GaugeMetricFamily("stopline_requests_open", "Requests with an open stream on this server.",
                                value=e.num_open)
        # The roles of --disagg (stopline/disagg) and the core process: admitting needs each
        # healthy (not stuck, not dead).
        health = getattr(getattr(e, "backend", None), "health", None)
        dead_role = health is not None and any("role" in r and r["state"] != "healthy" for r in health())
        yield GaugeMetricFamily("stopline_engine_healthy", "1 while the engine admits requests, else 0.",
                                value=int(e.ready and not dead_role))
        aborts = CounterMetricFamily("stopline_aborts", "Aborts applied by the engine, by source and "
                                     "the state the sequence was in.", labels=lab + ["source", "state"])
        pre = CounterMetricFamily("stopline_preemptions", "Preemptions, by mode.", labels=lab + ["mode"])
        disc = CounterMetricFamily("stopline_spec_discarded_tokens", "Drafts never verified or "
                                   "after a stop: their step's result was void (cancel, preempt, "
                                   "error) or a stop came first.", labels=lab + ["reason"])
        for r, s in snaps.items():
            seen = {(src, st): n for src, st, n in s.aborts}
            for src in [a.value for a in AbortSource]:
                for st in ABORT_STATES:
                    aborts.add_metric(key(r) + [src, st], seen.pop((src, st), 0))
            for (src, st), n in seen.items():
                aborts.add_metric(key(r) + [src, st], n)
            for mode, n in (dict.fromkeys(PREEMPTION_MODES, 0) | s.preemptions).items():
                pre.add_metric(key(r) + [mode], n)
            for reason, n in (dict.fromkeys(DISCARD_REASONS, 0) | s.spec_discarded).items():
                disc.add_metric(key(r) + [reason], n)
        yield aborts
        yield pre
        # Every KV layer group's pool (one for most models; Gemma 3's global and local layers:
        # two), and the P/D split's blocks by group: a windowed group ships fewer.
        groups = GaugeMetricFamily("stopline_kv_group_blocks", "KV blocks of each layer group's pool, "
                                   "by state (used, cached, free).", labels=lab + ["group", "window", "state"])
        moved = CounterMetricFamily("stopline_kv_transfer_blocks", "KV blocks the prefill/decode split "
                                    "moved, by direction (sent by prefill, received by decode) and "
                                    "layer group.", labels=lab + ["direction", "group"])
        for r, s in snaps.items():
            for g, (window, total, used, cached) in enumerate(s.kv_groups):
                for state, n in (("used", used), ("cached", cached), ("free", total - used - cached)):
                    groups.add_metric(key(r) + [str(g), str(window), state], n)
            for direction, g, n in s.transfer_blocks:
                moved.add_metric(key(r) + [direction, str(g)], n)
        yield groups
        yield moved
        counters = [
            ("stopline_recomputed_tokens", "Tokens computed again after a recompute preemption.",
             "recomputed_tokens"),
            ("stopline_tokens_after_abort", "Tokens computed for a request in the step in flight "
             "when its abort was accepted (never delivered).", "tokens_after_abort"),
            ("stopline_engine_steps", "Engine steps run.", "steps"),
            ("stopline_engine_busy_steps", "Engine steps that ran a forward.", "busy_steps"),
            ("stopline_engine_busy_step_seconds", "Seconds of the steps that ran a forward, from "
             "the step's start to its outcome applied.", "busy_seconds"),
            ("stopline_engine_execute_seconds", "Of those, seconds in the worker's run (the forward "
             "and sampling; with async scheduling, the previous step's text overlaps it).",
             "execute_seconds"),
            ("stopline_audits", "Ownership audits run on sampled busy steps (--audit-every).",
             "audits"),
            ("stopline_audit_failures", "Sampled ownership audits that found a leak, a double "
             "count or a holder still holding a finished request.", "audit_failures"),
            ("stopline_audit_seconds", "Seconds the sampled ownership audits took.", "audit_seconds"),
            ("stopline_spec_draft_tokens", "Draft tokens scheduled for verification (speculative "
             "decoding).", "spec_drafted"),
            ("stopline_spec_accepted_tokens", "Verified drafts that equal the sampled token, "
             "delivered.", "spec_accepted"),
            ("stopline_spec_rejected_tokens", "Verified drafts that did not equal the sampled token "
             "(or followed one that did not).", "spec_rejected"),
        ]
        for name, doc, field in counters:
            yield counter(name, doc, {r: getattr(s, field) for r, s in snaps.items()})
        yield disc
        yield counter("stopline_spec_verify_steps", "Verify runs processed (one per speculating "
                      "request and step).", {r: s.spec_verify_steps for r, s in snaps.items()})

        yield gauge("stopline_grammar_compiles_pending", "Grammar compiles started and not yet "
                    "ended (structured requests waiting for their grammar share them).",
                    {r: s.grammar_compiles_pending for r, s in snaps.items()})
        masks = HistogramMetricFamily("stopline_grammar_mask_seconds", "Seconds to fill one "
                                      "token's grammar mask (a step's rows are filled in one "
                                      "batched call; each row counts its share).", labels=lab)
        for r, s in snaps.items():
            counts = s.grammar_mask_counts or [0] * (len(MASK_BOUNDS) + 1)
            cum = list(itertools.accumulate(counts))
            buckets = [(repr(b), c) for b, c in zip(MASK_BOUNDS, cum, strict=False)]
            masks.add_metric(key(r), buckets + [("+Inf", cum[-1])], s.grammar_mask_sum)
        yield masks

        lora = {name: (GaugeMetricFamily if name in ("references", "resident") else CounterMetricFamily)(
            f"stopline_lora_{name}", doc, labels=lab + ["adapter"]) for name, doc in [
                ("references", "Live requests holding each LoRA adapter (0 when idle)."),
                ("requests", "Requests admitted under each LoRA adapter."),
                ("tokens", "Tokens generated under each LoRA adapter (ended requests)."),
                ("loads", "Loads of each LoRA adapter."),
                ("unloads", "Unloads of each LoRA adapter (done: its last request ended)."),
                ("evictions", "Times each LoRA adapter left its slot, unused, for another (--max-loras)."),
                ("resident", "1 while the LoRA adapter sits in one of the --max-loras slots."),
            ]}
        for r, s in snaps.items():
            for adapter, values in s.loras.items():
                for fam, v in zip(lora.values(), values, strict=True):
                    fam.add_metric(key(r) + [adapter], v)
        yield from lora.values()

        def rate(s: Snapshot) -> float:
            verified = s.spec_accepted + s.spec_rejected
            return s.spec_accepted / verified if verified else 0.0

        yield gauge("stopline_spec_acceptance_rate", "Accepted over verified drafts (discarded "
                    "drafts were never verified and do not count).", {r: rate(s) for r, s in snaps.items()})
