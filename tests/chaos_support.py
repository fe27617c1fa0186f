"""The chaos storm's machinery, shared by the CI test (tests/test_stop_chaos.py) and the
soak that runs it over fresh seeds for as long as asked (bench/chaos_soak.py).

A workload is many jobs that draw every feature the engine has: mixed lengths (half share
one of a few prefixes), n from 1 to 4, greedy and seeded temperature sampling with top-k /
top-p and penalties, logprobs, stop strings and min_tokens, deadlines and queue timeouts,
caller ids reused by later jobs, and aborts aimed at every state, some of them racing the
request's natural finish and followed by a resubmit under the same caller id. The storm
feeds the jobs into an engine a few a step, aborts each when its target state is reached,
and collects every output by incarnation; `check_storm` holds the result to the stop-path
contracts (docs/stop-path.md) against a reference run of the same jobs with no aborts and
an ample pool. `run_async_storm` does the same through the async engine and the core
process over ZMQ, with aborts landing whenever the wall clock says, mid-forward included.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import random
import signal
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

from stopline.config import EngineConfig
from stopline.engine.core import EngineCore
from stopline.lifecycle import state_name
from stopline.request import (
    AbortSource,
    FinishReason,
    ReasoningSpec,
    SamplingParams,
    UnknownAdapter,
)

TARGET_STATES = ["waiting", "prefilling", "running", "preempted", "swapped", "any"]
STOPS = ["e", "th", " a", "o", "in", "\n"]
_PREEMPTED = ("preempted", "swapped")  # either mode's victims: aimed at, either will do


@dataclass
class Job:
    key: str  # unique within the workload: results are compared by it
    caller_id: str  # the request_id the engine is given; later jobs may reuse it
    prompt: list[int]
    params: SamplingParams
    abort: tuple[str, int] | None = None  # (target state, patience in steps)
    race: bool = False  # cancelled as it finishes, then resubmitted (the next job, `resubmit`)
    resubmit: bool = False  # held back until the job before it ends, then sent at once

    @property
    def timed(self) -> bool:
        return self.params.deadline is not None or self.params.queue_timeout is not None


def storm_config(mode: str, async_scheduling: bool, wide: bool = False,
                 attention: str = "auto", lookahead: int = 0, speculative: str = "off") -> EngineConfig:
    """The storm's engine: a pool small enough to force preemption. wide: 64 sequences and
    a larger pool, so that many decode at once (with torch attention, their decode rows
    compact as they end). lookahead: admission_lookahead, 0 by default: admission that
    keeps room for the running requests' next tokens preempts far less, and the storm is
    here to preempt. speculative: "on" drafts wherever it can (verify steps then race the
    cancels and preemptions); off by default, so that a storm replays step for step."""
    if wide:
        size = dict(num_blocks=400, max_num_seqs=64, max_num_batched_tokens=64)
    else:
        size = dict(num_blocks=40, max_num_seqs=24, max_num_batched_tokens=24)
    return EngineConfig(block_size=4, preemption_mode=mode, debug=True, target_step_ms=None,
                        max_preemptions=1000, async_scheduling=async_scheduling,
                        attention_backend=attention, admission_lookahead=lookahead,
                        speculative=speculative, **size)


def _params(rng: random.Random) -> SamplingParams:
    kw: dict = dict(n=rng.choices([1, 2, 3, 4], [80, 10, 6, 4])[0], max_tokens=rng.randrange(1, 20))
    if rng.random() < 0.5:
        kw["temperature"] = 0.0
    else:
        kw.update(temperature=rng.uniform(0.6, 1.3), seed=rng.randrange(1 << 30))
        if rng.random() < 0.3:
            kw["top_k"] = rng.choice([5, 40])
        if rng.random() < 0.3:
            kw["top_p"] = rng.choice([0.8, 0.95])
    if rng.random() < 0.25:
        kw.update(presence_penalty=rng.uniform(-1, 1), frequency_penalty=rng.uniform(0, 1),
                  repetition_penalty=rng.choice([1.0, 1.2]))
    if rng.random() < 0.2:
        kw["logprobs"] = rng.choice([0, 2])
    if rng.random() < 0.2:
        kw["stop"] = rng.sample(STOPS, rng.randrange(1, 3))
        kw["min_tokens"] = rng.choice([0, 0, 2])
        kw["min_tokens"] = min(kw["min_tokens"], kw["max_tokens"])
    if rng.random() < 0.04:
        kw["deadline"] = rng.uniform(0.02, 0.5)
    elif rng.random() < 0.03:
        kw["queue_timeout"] = rng.uniform(0.01, 0.3)
    if rng.random() < 0.12:  # echo + logprobs: the prompt scored, sometimes nothing generated
        kw["prompt_logprobs"] = rng.choice([0, 2])
        if rng.random() < 0.3:
            kw.update(max_tokens=0, min_tokens=0)
    return SamplingParams(**kw)


def _reasoning(rng: random.Random) -> ReasoningSpec:
    """A thinking request: markers of plain ids (the end one two tokens long, so the budget's
    end may finish one the model began), opened by the prompt or not, a budget or none."""
    return ReasoningSpec([5], [6, 7], opened=rng.random() < 0.7,
                         max_thinking_tokens=rng.choice([None, 0, 1, 3, 6]))


def make_workload(seed: int, count: int, vocab: int) -> list[Job]:
    # Thinking requests are drawn apart, so that the rest stays as it was drawn before.
    think = random.Random(seed * 45 + 1)
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, vocab) for _ in range(rng.randrange(4, 20))] for _ in range(8)]
    jobs: list[Job] = []
    for i in range(count):
        base = list(rng.choice(prefixes)) if rng.random() < 0.5 else []
        prompt = base + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 24))]
        caller = f"r{i}" if not jobs or rng.random() > 0.15 else rng.choice(jobs).caller_id
        job = Job(f"k{i}", caller, prompt, _params(rng))
        if think.random() < 0.25:
            job.params.reasoning = _reasoning(think)
        if rng.random() < 0.45:
            job.abort = (rng.choice(TARGET_STATES), rng.randrange(0, 12))
        elif rng.random() < 0.06:
            job.race = True
        jobs.append(job)
        if job.race:
            again = dataclasses.replace(job, key=f"k{i}+", race=False, resubmit=True)
            jobs.append(again)
    return jobs


def delivered(out) -> list:
    """What an output delivers, as compared: token ids, or (token id, logprob) pairs when the
    request asked for logprobs (the floats expose any bit a kernel path changes); first the
    prompt's scores, when they come."""
    head = [] if out.prompt_logprobs is None else [("prompt", tuple(lp.logprob for lp in out.prompt_logprobs))]
    if not out.new_logprobs:
        return head + list(out.new_token_ids)
    return head + [(t, lp.logprob) for t, lp in zip(out.new_token_ids, out.new_logprobs, strict=True)]


def untimed(params: SamplingParams) -> SamplingParams:
    return dataclasses.replace(params, deadline=None, queue_timeout=None)


def lora_workload(seed: int, count: int, vocab: int, names: list[str]) -> list[Job]:
    """make_workload's jobs, three in four under one of the LoRA adapters `names` (seeded)."""
    rng = random.Random(seed)
    jobs = make_workload(seed, count, vocab)
    for k, j in enumerate(jobs):
        if j.resubmit:  # the same request again, under the same adapter
            j.params = dataclasses.replace(j.params, lora=jobs[k - 1].params.lora)
        elif rng.random() < 0.75:
            j.params = dataclasses.replace(j.params, lora=rng.choice(names))
    return jobs


def run_reference(loaded, work: list[Job], attention: str = "auto", numerics: str = "exact",
                  adapters: dict[str, str] | None = None, kv_cache_dtype: str = "auto"):
    """Each job's output with no aborts, no deadlines and an ample pool (batch invariance
    makes this the same as running it alone; test_solo_matches_reference checks that on a
    sample). attention, numerics, kv_cache_dtype: as the storm's (each gives a position other
    bits)."""
    eng = EngineCore(loaded, EngineConfig(num_blocks=4096, block_size=4, max_num_seqs=256,
                                          max_num_batched_tokens=4096, attention_backend=attention,
                                          speculative="off", numerics=numerics,
                                          kv_cache_dtype=kv_cache_dtype))
    for name, path in (adapters or {}).items():
        assert eng.residency.load_lora(name, path)["status"] == 200
    ref = defaultdict(lambda: defaultdict(list))
    key_of = {}
    for job in work:
        key_of[eng.add_request(job.caller_id, job.prompt, untimed(job.params))] = job.key
    while eng.has_unfinished():
        for out in eng.step():
            ref[key_of[out.incarnation]][out.index] += delivered(out)
    eng.grammar.close()  # its compile thread and probe process, if a job had a grammar
    return ref


@dataclass
class StormResult:
    got: dict  # key -> index -> delivered
    terminals: dict  # (key, index) -> [terminal outputs]
    aborted_at: dict  # key -> index -> tokens delivered when the abort was sent
    states_hit: dict  # state -> aborts sent there
    engine: EngineCore | None = None
    pauses: int = 0  # streams that filled while their reader slept (run_async_storm's slow ones)
    freezes: int = 0  # SIGSTOP/SIGCONT of an engine process during the storm
    refused: set = dataclasses.field(default_factory=set)  # keys refused: their adapter was unloading
    unloads: int = 0  # LoRA unloads during the storm (each reloaded later)
    # Engine-wide stops (run_async_storm's `stops`): what was drawn, the jobs an engine-
    # initiated end reached (their stream raised EngineStopped), those a pause kept out past
    # their queue timeout (never admitted), and the weight versions their outputs carried.
    stops: dict = field(default_factory=lambda: defaultdict(int))
    stopped: set = field(default_factory=set)
    held_out: set = field(default_factory=set)
    versions: set = field(default_factory=set)
    snapshots: list = field(default_factory=list)  # run_async_storm: each process's, at the end


def run_storm(loaded, work: list[Job], config: EngineConfig, seed: int,
              adapters: dict[str, str] | None = None, unload_p: float = 0.0) -> StormResult:
    """adapters: LoRA adapters loaded at the start; unload_p: the chance per step that one is
    unloaded (policy abort or wait, drawn), to be loaded again from the same files once gone."""
    rng = random.Random(seed)
    lrng = random.Random(seed + 2)  # its own draws: the storm's stay as they were
    eng = EngineCore(loaded, config)
    for name, path in (adapters or {}).items():
        assert eng.residency.load_lora(name, path)["status"] == 200
    res = StormResult(defaultdict(lambda: defaultdict(list)), defaultdict(list), {},
                      defaultdict(int), eng)
    pending = [j for j in work if not j.resubmit]
    held = {work[i - 1].key: j for i, j in enumerate(work) if j.resubmit}  # race job -> resubmit
    inc_of: dict[str, str] = {}
    job_of: dict[str, Job] = {}  # incarnation -> job
    age: dict[str, int] = defaultdict(int)
    live: set[str] = set()
    steps = 0

    def send(job: Job) -> None:
        try:
            inc = eng.add_request(job.caller_id, job.prompt, job.params)
        except UnknownAdapter:
            res.refused.add(job.key)  # its adapter is unloading: refused before anything queued
            again = held.pop(job.key, None)
            if again is not None:
                send(again)
            return
        inc_of[job.key], job_of[inc] = inc, job
        live.add(job.key)

    def churn() -> None:
        """Unload an adapter (its live jobs count as aborted now, when its policy is abort),
        and load again those that are gone."""
        for name, path in (adapters or {}).items():
            if name not in eng.adapters.loaded:
                assert eng.residency.load_lora(name, path)["status"] == 200
        if not adapters or lrng.random() >= unload_p:
            return
        name = lrng.choice(sorted(adapters))
        if not eng.adapters.serves(name):
            return
        policy = lrng.choice(["abort", "wait"])
        if policy == "abort":
            for key in live:
                job = job_of[inc_of[key]]
                if job.params.lora == name and key not in res.aborted_at:
                    res.aborted_at[key] = {i: len(res.got[key][i]) for i in range(4)}
        assert eng.residency.unload_lora(name, policy)["status"] == 200
        res.unloads += 1

    while pending or held or eng.has_unfinished():
        churn()
        for _ in range(rng.randrange(0, 12)):
            if pending:
                send(pending.pop(0))
        for key in list(live):
            job = job_of[inc_of[key]]
            if job.abort is None or key in res.aborted_at:
                continue
            fam = eng.families.get(inc_of[key])
            state = state_name(fam.members[0], eng.kv_manager) if fam is not None else "waiting"
            target, patience = job.abort
            if state != "waiting" or target == "waiting":
                age[key] += 1  # patience runs from admission, or the backlog would decide
            hit = state == target or (target in _PREEMPTED and state in _PREEMPTED)
            if hit or target == "any" and age[key] > patience or age[key] > 3 * patience + 30:
                res.states_hit[state] += 1
                res.aborted_at[key] = {i: len(res.got[key][i]) for i in range(4)}
                eng.abort([inc_of[key]], AbortSource.CANCEL, time.monotonic())
                if rng.random() < 0.2:
                    eng.abort([inc_of[key]], AbortSource.CANCEL, time.monotonic())  # twice is the same as once
        for out in eng.step():
            key = job_of[out.incarnation].key
            res.got[key][out.index] += delivered(out)
            if key in res.aborted_at and out.new_token_ids:
                raise AssertionError(f"{key}: tokens delivered after its abort")
            if not out.finished:
                continue
            res.terminals[(key, out.index)].append(out)
            job = job_of[out.incarnation]
            if all((key, i) in res.terminals for i in range(job.params.n)):
                live.discard(key)
                again = held.pop(key, None)
                if again is not None:
                    # The client's cancel raced the natural finish; it resubmits at once
                    # under the same caller id, and the late abort must not touch it.
                    eng.abort([inc_of[key]], AbortSource.CANCEL, time.monotonic())
                    send(again)
        steps += 1
        assert steps < 100_000, "the engine stopped making progress"
    eng.abort(["never-existed"], AbortSource.CANCEL, time.monotonic())  # unknown incarnation: a no-op
    eng.step()
    eng.audit()
    assert eng.pool.num_used == 0, "blocks still owned after every request ended"
    assert not any(eng.adapters.counts().values()), f"adapter references when idle: {eng.adapters.counts()}"
    return res


def check_storm(work: list[Job], ref, res: StormResult) -> int:
    """Exactly one terminal output per job and sample, never `error`; a survivor's tokens
    equal its reference; an aborted or timed-out one's are a prefix of it (an aborted one no
    longer than what it had at the abort). Returns the number of aborted samples."""
    n_abort = 0
    for job in work:
        if job.key in res.held_out:  # a pause held it past its queue timeout: never admitted
            assert not any(res.got[job.key][i] or res.terminals[(job.key, i)] for i in range(4)), job.key
            continue
        if job.key in res.stopped:  # ended by the engine: an error, with a prefix of its tokens
            for i in range(job.params.n):
                assert len(res.terminals[(job.key, i)]) <= 1, f"{job.key}[{i}]: two terminals"
                tokens = res.got[job.key][i]
                assert tokens == ref[job.key][i][: len(tokens)], f"{job.key}[{i}]: stopped, not a prefix"
            continue  # its stream raised EngineStopped: no terminal output is its end
        if job.key in res.refused:
            assert job.params.lora is not None and not any((job.key, i) in res.terminals for i in range(4))
            continue
        for i in range(job.params.n):
            outs = res.terminals[(job.key, i)]
            assert len(outs) == 1, f"{job.key}[{i}]: {len(outs)} terminal outputs"
            term = outs[0]
            want = ref[job.key][i]
            tokens = res.got[job.key][i]
            reason = term.finish_reason
            scored = bool(tokens) and isinstance(tokens[0], tuple) and tokens[0][0] == "prompt"
            assert term.usage.completion_tokens == len(tokens) - scored, f"{job.key}[{i}]: usage {term.usage}"
            if reason is FinishReason.ABORT:
                n_abort += 1
                unloaded = term.stop_detail == "unload" and job.params.lora is not None
                assert job.key in res.aborted_at or job.race or unloaded, f"{job.key}[{i}]: aborted unasked"
                assert tokens == want[: len(tokens)], f"{job.key}[{i}]: aborted output is not a prefix"
                if job.key in res.aborted_at:
                    assert len(tokens) <= res.aborted_at[job.key][i]
            elif reason is FinishReason.TIMEOUT:
                assert job.timed, f"{job.key}[{i}]: timed out without a deadline"
                assert tokens == want[: len(tokens)], f"{job.key}[{i}]: timed-out output is not a prefix"
            else:
                assert reason in (FinishReason.STOP, FinishReason.LENGTH), (job.key, i, term)
                first = next((k for k, (a, b) in enumerate(zip(tokens, want, strict=False)) if a != b), min(len(tokens), len(want)))
                assert tokens == want, (f"{job.key}[{i}]: survivor differs from its undisturbed run at "
                                        f"token {first} of {len(tokens)} (want {len(want)}); {term}; "
                                        f"stops {dict(res.stops)}")
    return n_abort


def run_async_storm(model_dir: str, work: list[Job], config: EngineConfig, seed: int,
                    *, subprocess: bool = True, make=None, max_delay: float = 0.4,
                    slow: float = 0.0, max_buffered: int = 64, freeze: float = 0.0,
                    adapters: dict[str, str] | None = None, churn: float = 0.0,
                    stops: float = 0.0) -> StormResult:
    """The storm through the async engine (the core in its own process, over ZMQ): each job
    streams in its own task; an aborted job's cancel goes out after a random wall-clock
    delay, so it lands between steps, mid-forward or mid-prefill as it happens. `make`:
    another engine factory (model_dir, config, progress, **streams) -> AsyncEngine, e.g. Ray
    replicas, whose utilities answer once per replica. max_delay: the latest a cancel goes
    out (s). slow: the share of jobs whose reader stops for a while after two outputs, so
    their streams fill (max_buffered) and their requests pause under the pool's pressure,
    then read on: slowness alone must never change or end a request. freeze: the longest
    SIGSTOP (s) of one of the engine's local processes (a replica, a role, the core) at random
    moments of the storm, each followed by SIGCONT; kept under the stuck bound, a stopped
    process only delays its requests. adapters: LoRA adapters loaded at the start (messages to
    the core); churn: the longest pause (s) between unloads of one of them (policy abort or
    wait, drawn), each loaded again from its files once gone. stops: the longest gap (s)
    between engine-wide stops drawn during the storm (docs/engine-stops.md): pause in every
    mode then resume, sleep and wake, and weight updates in every mode to the same weights
    (new versions, the same tokens: every request still equals its solo run)."""
    from stopline.engine.async_engine import AsyncEngine
    from stopline.engine.streams import EngineStopped, EngineUnavailable

    rng = random.Random(seed)
    res = StormResult(defaultdict(lambda: defaultdict(list)), defaultdict(list), {},
                      defaultdict(int))

    async def one(engine, job: Job, inc: str, delay: float | None, nap: float) -> None:
        # The cancel's clock starts before the add is acknowledged: a quick one overtakes it.
        adding = asyncio.ensure_future(engine.add(job.caller_id, job.prompt, job.params,
                                                  incarnation=inc))
        cancel = None
        if delay is not None:
            async def later() -> None:
                await asyncio.sleep(delay)
                res.aborted_at[job.key] = {i: len(res.got[job.key][i]) for i in range(4)}
                engine.abort([inc], AbortSource.CANCEL, time.monotonic())
            cancel = asyncio.create_task(later())
        try:
            stream = await adding
        except EngineUnavailable:  # held by a pause past its queue timeout
            res.held_out.add(job.key)
            if cancel is not None:
                cancel.cancel()
            return
        except UnknownAdapter:  # its adapter was unloading: refused, nothing queued
            res.refused.add(job.key)
            if cancel is not None:
                cancel.cancel()
            return
        try:
            async for out in stream:
                res.got[job.key][out.index] += delivered(out)
                res.versions.add(out.weight_version)
                if out.finished:
                    res.terminals[(job.key, out.index)].append(out)
                if nap and sum(map(len, res.got[job.key].values())) >= 2:
                    await asyncio.sleep(nap)  # the reader stops; the engine runs on until it pauses
                    nap = 0.0
        except EngineStopped:
            res.stopped.add(job.key)
        if cancel is not None:
            cancel.cancel()
        if job.race:  # cancel after the natural end, then the same caller id again
            engine.abort([inc], AbortSource.CANCEL, time.monotonic())

    async def main() -> None:
        factory = make or (AsyncEngine.in_subprocess if subprocess else AsyncEngine.in_process)
        engine = factory(model_dir, config, progress=False, max_buffered=max_buffered)
        pause = engine.backend.pause

        def counted(incs: list[str], paused: bool) -> None:
            res.pauses += len(incs) if paused else 0
            pause(incs, paused)

        engine.backend.pause = counted
        await engine.start()
        frozen: set[int] = set()
        timers: list[threading.Timer] = []
        frng = random.Random(seed + 1)  # its own draws: the jobs' stay as they were

        def thaw(pid: int) -> None:
            os.kill(pid, signal.SIGCONT)
            frozen.discard(pid)

        async def freezer() -> None:
            while True:
                await asyncio.sleep(frng.uniform(0.2, 0.8))
                pids = [p["pid"] for p in engine.backend.health()
                        if p.get("pid") and not p.get("remote") and p.get("state") == "healthy"]
                if not pids:
                    continue
                pid, stop_s = frng.choice(pids), frng.uniform(0.05, freeze)
                # The SIGCONT comes from a timer thread: due even if something on this loop
                # waited on the stopped process.
                timer = threading.Timer(stop_s, thaw, (pid,))
                frozen.add(pid)
                os.kill(pid, signal.SIGSTOP)
                timer.start()
                timers.append(timer)
                res.freezes += 1
                await asyncio.sleep(stop_s)

        srng = random.Random(seed + 2)

        async def stopper() -> None:
            try:
                await stops_drawn()
            except Exception:
                await engine.wake_up()  # the jobs held by the failed stop end; the storm fails
                raise

        # Every kind and mode in turn, those that keep the requests first (an abort ends many
        # jobs, and the storm ends with its last job), at random moments.
        drawn = ["pause:keep", "update:keep", "pause:wait", "update:wait", "sleep:wait",
                 "pause:abort", "update:abort", "sleep:abort"]

        # The second half of the jobs goes out once the stops that keep requests have each been
        # drawn, so a storm that runs fast still has them land while jobs are in flight.
        kept_drawn = asyncio.Event()

        async def stops_drawn() -> None:
            for k in itertools.count():
                if k == 3:
                    kept_drawn.set()
                await asyncio.sleep(srng.uniform(0.02, stops))
                kind, _, mode = drawn[k % len(drawn)].partition(":")
                if kind == "pause":
                    await engine.pause(mode, timeout=0.5)
                    await asyncio.sleep(srng.uniform(0, 0.1))
                    await engine.resume()
                elif kind == "sleep":
                    mode = "wait" if mode == "wait" else "abort"
                    try:
                        await engine.sleep(1, mode, timeout=0.5)
                        await asyncio.sleep(srng.uniform(0, 0.1))
                        await engine.wake_up()
                    except TimeoutError:  # still running after the wait: paused, not asleep
                        await engine.resume()
                else:
                    await engine.update_weights(model_dir, mode, timeout=0.5)
                res.stops[f"{kind}:{mode}"] += 1

        async def churner() -> None:
            names = sorted(adapters or {})
            while True:
                await asyncio.sleep(frng.uniform(0.05, churn))
                gone = set(names) - set(await engine.utility("loras"))
                for name in gone:
                    got = await engine.utility("load_lora", name, adapters[name])
                    assert got["status"] == 200, got
                name = frng.choice(names)
                if name not in gone:
                    got = await engine.utility("unload_lora", name, frng.choice(["abort", "wait"]))
                    assert got["status"] == 200, got
                    res.unloads += 1

        for name, path in (adapters or {}).items():
            got = await engine.utility("load_lora", name, path)
            assert got["status"] == 200, got
        churning = asyncio.create_task(churner()) if churn else None
        thawing = asyncio.create_task(freezer()) if freeze else None
        stopping = asyncio.create_task(stopper()) if stops else None
        try:
            tasks = []
            for n, job in enumerate(work):
                delay = rng.uniform(0.0, max_delay) if job.abort is not None else None
                nap = rng.uniform(0.2, 0.8) if rng.random() < slow else 0.0
                task = one(engine, job, f"{job.key}@{seed}", delay, nap)
                if stopping is not None and n == len(work) // 2:
                    await asyncio.wait_for(kept_drawn.wait(), 120)
                if job.resubmit:
                    await tasks[-1]  # the raced job ends first, then its resubmit goes out
                tasks.append(asyncio.ensure_future(task))
                if n % 4 == 3:
                    await asyncio.sleep(rng.uniform(0, 0.02))
            await asyncio.gather(*tasks)
            if stopping is not None:
                if stopping.done():
                    stopping.result()  # a stop that failed fails the storm
                stopping.cancel()
                await asyncio.gather(stopping, return_exceptions=True)
                await engine.wake_up()  # whatever it was cut in, the engine admits again
            if churning is not None:
                churning.cancel()
                await asyncio.gather(churning, return_exceptions=True)
            if thawing is not None:
                thawing.cancel()
                await asyncio.gather(thawing, return_exceptions=True)
                for t in timers:
                    t.join()
                assert not frozen
            audits = await engine.utility("audit")
            assert all(a is None for a in (audits if isinstance(audits, list) else [audits]))
            snaps = await engine.utility("snapshot")
            res.snapshots = snaps if isinstance(snaps, list) else [snaps]
            for snap in res.snapshots:
                assert snap.kv_blocks_used == 0 and snap.running == snap.waiting == 0, snap
                assert all(used == 0 for _, _, used, _ in snap.kv_groups), snap.kv_groups  # every layer group
                assert not any(v[0] for v in snap.loras.values()), f"adapter references when idle: {snap.loras}"
        finally:
            if stopping is not None:
                stopping.cancel()
            if churning is not None:
                churning.cancel()
            if thawing is not None:
                thawing.cancel()
            for t in timers:
                t.cancel()
            for pid in list(frozen):  # never leave a process stopped behind a failure
                thaw(pid)
            await engine.close()

    asyncio.run(main())
    return res


GRAMMARS = {  # response formats the grammar storm draws (stopline.grammar.formats)
    "schema": {"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 6}},
        "required": ["a", "b"], "additionalProperties": False}}},
    "tree": {"type": "json_schema", "json_schema": {"schema": {"$defs": {"n": {
        "type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/n"},
                                               "maxItems": 2}}, "required": ["c"]}}, "$ref": "#/$defs/n"}}},
    "regex": {"type": "regex", "regex": "[a-c]{2,12}"},
    "choice": {"type": "choice", "choice": ["yes", "no", "maybe"]},
}

# Tool calls the grammar storm draws too: a required call, a named one, and auto (text or a
# call, the grammar started by the call tag).
TOOLS = [{"type": "function", "function": {"name": "get", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}]
TOOL_CHOICES = ("required", {"type": "function", "function": {"name": "get"}}, "auto")


def grammar_workload(seed: int, count: int, vocab: int) -> list[Job]:
    """make_workload's jobs, each given one of GRAMMARS (seeded: the same seed, the same
    jobs; replay a failing seed by passing it here and to run_storm)."""
    from stopline.grammar.formats import response_format_grammar
    from stopline.grammar.tools import tool_plan
    rng = random.Random(seed)
    jobs = [j for j in make_workload(seed, count, vocab) if not (j.race or j.resubmit) and not j.timed]
    grammars = [response_format_grammar(GRAMMARS[k]) for k in sorted(GRAMMARS)]
    grammars += [tool_plan(TOOLS, choice).grammar for choice in TOOL_CHOICES]
    for j in jobs:
        g = rng.choice(grammars)
        j.params = dataclasses.replace(j.params, grammar=g, max_tokens=rng.randrange(4, 24),
                                       stop=[], min_tokens=0)
    return jobs
