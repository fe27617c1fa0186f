"""The stop path under a storm that draws every feature: hundreds of jobs with n from 1 to 4,
greedy and seeded sampling with penalties, logprobs, stop strings, deadlines and queue
timeouts, reused caller ids, cancels racing a natural finish and then resubmitted, random
aborts in every state, a pool small enough to force preemption (recompute, swap, auto),
async scheduling on and off, small steps moved to fewer threads, and the same through the
async engine over ZMQ and through the prefill/decode split (both roles local, or either one
remote over TCP).

Checked (docs/stop-path.md): the ledger and holder audit after every step (debug mode, freed
blocks poisoned with NaN); the pool back to baseline at the end; every survivor's output
(greedy and seeded alike) equals the same job run undisturbed; every aborted or timed-out
one's delivered tokens are a prefix of that output and nothing arrives after the abort;
exactly one terminal output per job and sample with the right reason, never `error`.
Seeded: a failure reproduces. The machinery is in tests/chaos_support.py;
bench/chaos_soak.py runs it over fresh seeds for as long as asked.
"""

from __future__ import annotations

import dataclasses
import random
import subprocess
import sys
import threading

import pytest

from stopline.config import EngineConfig
from stopline.engine.core import EngineCore
from stopline.model.loaders.loader import load_model
from stopline.request import FinishReason
from tests.chaos_support import (
    check_storm,
    delivered,
    grammar_workload,
    lora_workload,
    make_workload,
    run_async_storm,
    run_reference,
    run_storm,
    storm_config,
    untimed,
)
from tests.tiny_families import make_family_dir
from tests.tiny_model import make_tiny_gguf, make_tiny_llama_dir

COUNT = 400


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_llama_dir(tmp_path_factory.mktemp("chaos") / "tiny", seed=7, init_std=0.1,
                               vocab_size=384, layers=2)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(str(tiny_dir), progress=False)


@pytest.fixture(scope="module")
def storm_work(tiny):
    """The storm's jobs and their reference outputs, computed once for every test."""
    work = make_workload(seed=11, count=COUNT, vocab=tiny.config.vocab_size)
    return work, run_reference(tiny, work)


def test_the_workload_draws_every_feature(storm_work):
    work, _ = storm_work
    params = [j.params for j in work]
    assert {p.n for p in params} == {1, 2, 3, 4}
    assert sum(p.temperature > 0 and p.seed is not None for p in params) > COUNT // 4
    assert sum(p.needs_penalties for p in params) > 20
    assert sum(p.logprobs is not None for p in params) > 20
    assert sum(p.prompt_logprobs is not None for p in params) > 10
    assert sum(p.max_tokens == 0 for p in params) > 3
    assert sum(bool(p.stop) for p in params) > 20
    assert sum(p.deadline is not None for p in params) > 3
    assert sum(p.queue_timeout is not None for p in params) > 3
    assert sum(j.race for j in work) > 5 and sum(j.resubmit for j in work) == sum(j.race for j in work)
    callers = [j.caller_id for j in work]
    assert len(set(callers)) < len(callers) - 20  # caller ids reused


@pytest.mark.parametrize("mode,async_scheduling,speculative", [
    ("recompute", False, "off"), ("swap", False, "on"), ("recompute", True, "off"), ("auto", True, "on")])
def test_storm(tiny, storm_work, mode, async_scheduling, speculative):
    work, ref = storm_work
    res = run_storm(tiny, work, storm_config(mode, async_scheduling, speculative=speculative), seed=5)
    stats = res.engine.lifecycle.stats
    if speculative == "on":  # verify steps ran among the cancels and preemptions, losslessly
        assert stats.spec_verify_steps > 0 and stats.spec_accepted > 0, stats
        assert stats.spec_drafted == (stats.spec_accepted + stats.spec_rejected
                                      + sum(stats.spec_discarded.values()))
    # The storm really exercised the stop path.
    assert sum(stats.preemptions.values()) > 20, stats.preemptions
    if mode != "recompute":
        assert stats.preemptions["swap"] > 0
    for state in ("waiting", "prefilling", "running"):
        assert res.states_hit[state] > 0, f"no abort landed in state {state}: {dict(res.states_hit)}"
    preempted_states = {"recompute": ["preempted"], "swap": ["swapped"], "auto": ["preempted", "swapped"]}[mode]
    assert sum(res.states_hit[s] for s in preempted_states) > 0, f"no abort while preempted: {dict(res.states_hit)}"
    assert check_storm(work, ref, res) > 100
    reasons = {(t[0].finish_reason, t[0].stop_detail in ("eos", "max_tokens"))
               for t in res.terminals.values()}
    assert (FinishReason.STOP, False) in reasons, "no stop string ended a job"
    assert stats.finished.get("error", 0) == 0
    # thinking requests ran among them, some past their budget (issue 45)
    assert sum(1 for t in res.terminals.values() if t[0].usage and t[0].usage.reasoning_tokens) > 5


def test_storm_with_admission_lookahead(tiny, storm_work):
    """The storms above admit into any free room (admission_lookahead=0), so that the pool
    runs dry all the time. Here the default admission, which keeps room for the running
    requests' next tokens, on a pool small enough that it still preempts (6 times here, where
    20 blocks gave 1). No deadlines: the storm's wall-clock timeouts end jobs early on a slow
    host, and on one CI run the pool of 20 then never ran dry; without them whether it preempts
    no longer hangs on the host's speed."""
    work, ref = storm_work
    work = [dataclasses.replace(j, params=untimed(j.params)) for j in work[:150]]
    if work[-1].race:
        work = work[:-1]  # a raced job comes with its resubmit
    config = dataclasses.replace(storm_config("auto", False, lookahead=EngineConfig.admission_lookahead),
                                 num_blocks=14)
    res = run_storm(tiny, work, config, seed=9)
    assert sum(res.engine.lifecycle.stats.preemptions.values()) > 0
    assert check_storm(work, ref, res) > 20


def test_async_storm_over_zmq(tiny_dir, tiny, storm_work):
    """Through the async engine and the core process: aborts sent on the wall clock land
    between steps, mid-forward and before their add is acknowledged."""
    work, ref = storm_work
    work = [j for j in work[:120] if not (j.race or j.resubmit)]
    config = dataclasses.replace(storm_config("auto", True), num_blocks=60)
    # Cancels go out within 0.1 s: on a fast host, a later one mostly finds its request
    # already ended (5-9 landed with 0.4 s).
    res = run_async_storm(str(tiny_dir), work, config, seed=21, max_delay=0.1, slow=0.25,
                          max_buffered=2, freeze=0.5)
    assert check_storm(work, ref, res) > 10  # aborts that landed before their request ended (25-36 seen)
    assert res.pauses > 0  # slow readers' streams filled and their requests paused
    assert res.freezes > 0  # the core process stopped and continued mid-storm


@pytest.mark.parametrize("subprocess", [True, False])
def test_async_storm_with_engine_stops(tiny_dir, tiny, storm_work, subprocess):
    """The async storm (cancels, preemption, async scheduling, slow readers) with engine-wide
    stops drawn all along (issue 46): pause and resume in every mode, sleep and wake, weight
    updates in every mode (to the same weights: new versions, the same tokens). Every request
    ends once, equal to its solo run (or a prefix of it when a cancel or an engine stop ended
    it); the audit and the pool come back clean."""
    from stopline.engine.async_engine import AsyncEngine
    from stopline.engine.liveness import Bounds

    work, ref = storm_work
    work = [j for j in work[:60] if not (j.race or j.resubmit)]
    config = dataclasses.replace(storm_config("auto", True), num_blocks=60)
    # A weight update loads and calibrates the model on the core's stepping thread; on a
    # loaded 2-core host that can starve the heartbeat past the default 5 s stuck bound.
    make = (lambda d, c, progress, **kw: AsyncEngine.in_subprocess(
        d, c, progress=progress, liveness=Bounds(30.0, 120.0), **kw)) if subprocess else None
    res = run_async_storm(str(tiny_dir), work, config, seed=31, max_delay=0.1, slow=0.25,
                          max_buffered=2, stops=0.15, subprocess=subprocess, make=make)
    check_storm(work, ref, res)
    # In turn: pause keep, update keep, pause wait, update wait, sleep wait, then the aborts.
    assert {"pause:keep", "update:keep", "pause:wait"} <= set(res.stops), dict(res.stops)
    assert max(res.versions) > 0  # outputs carried a later weight version


@pytest.fixture(scope="module")
def lora_work(tiny, tiny_dir, tmp_path_factory):
    """Three LoRA adapters of the storm's model, jobs drawing them (three in four), and the
    reference with every adapter loaded."""
    from tests.lora_support import make_adapter

    root = tmp_path_factory.mktemp("chaos_loras")
    adapters = {n: str(make_adapter(tiny_dir, root / n, seed=s, r=r))
                for n, s, r in (("a", 1, 4), ("b", 2, 8), ("c", 3, 2))}
    work = lora_workload(seed=31, count=200, vocab=tiny.config.vocab_size, names=sorted(adapters))
    return work, run_reference(tiny, work, adapters=adapters), adapters


@pytest.mark.parametrize("mode,async_scheduling,speculative,slots", [
    ("recompute", False, "off", 8), ("auto", True, "off", 8), ("swap", False, "on", 8), ("auto", True, "on", 2)])
def test_lora_storm(tiny, lora_work, mode, async_scheduling, speculative, slots):
    """The storm with adapters: jobs of three adapters and the base share steps while cancels,
    preemption (recompute and swap), speculation and unloads (abort: its requests end `abort`; wait: new ones are refused) race;
    every survivor equals its reference, the audit (each adapter's count is its live requests)
    holds after every step and the counts are zero at the end. slots: --max-loras; with 2 for
    three adapters, requests wait for a slot and unused adapters are evicted (the audit checks
    that no scheduled request's adapter ever leaves its slot)."""
    work, ref, adapters = lora_work
    assert len({j.params.lora for j in work}) == 4
    config = dataclasses.replace(storm_config(mode, async_scheduling, speculative=speculative),
                                 max_loras=slots, max_cpu_loras=max(slots, len(adapters)))
    res = run_storm(tiny, work, config, seed=33, adapters=adapters, unload_p=0.03)
    if slots < len(adapters):
        assert res.engine.adapters.slot_waits > 0  # requests waited for a slot
    stats = res.engine.lifecycle.stats
    if speculative == "on":  # verify steps of adapter rows, losslessly
        assert stats.spec_verify_steps > 0 and stats.spec_accepted > 0, stats
    assert sum(stats.preemptions.values()) > 5, stats.preemptions
    assert res.unloads > 3
    assert stats.aborts and any(src == "unload" for src, _ in stats.aborts), dict(stats.aborts)
    assert check_storm(work, ref, res) > 30
    assert stats.finished.get("error", 0) == 0
    assert sum(res.engine.adapters.unloads.values()) >= res.unloads - len(adapters)


def test_async_lora_storm_over_zmq(tiny_dir, lora_work):
    """The same through the core process: loads and unloads are messages to the core, racing
    the cancels (sent on the wall clock) and the adds."""
    work, ref, adapters = lora_work
    work = [j for j in work[:120] if not (j.race or j.resubmit)]
    config = dataclasses.replace(storm_config("auto", True), num_blocks=60)
    res = run_async_storm(str(tiny_dir), work, config, seed=35, max_delay=0.1, adapters=adapters,
                          churn=0.3)
    assert res.unloads > 0
    assert check_storm(work, ref, res) > 5


def test_async_storm_through_the_split(tiny_dir, tiny, storm_work):
    """The same storm through `serve --disagg`'s engine (a prefill and a decode process):
    cancels land before, during and after the KV transfer; outputs equal the reference and
    both roles' audits and pools come back clean."""
    from stopline.disagg.frontend import disagg_engine

    work, ref = storm_work
    work = [j for j in work[:80] if not (j.race or j.resubmit)]
    config = dataclasses.replace(storm_config("auto", True), num_blocks=60)
    res = run_async_storm(str(tiny_dir), work, config, seed=23, max_delay=0.1, slow=0.25,
                          max_buffered=2, freeze=0.5,
                          make=lambda d, c, progress, **kw: disagg_engine(d, c, progress=progress, **kw))
    assert check_storm(work, ref, res) > 5
    assert res.pauses > 0 and res.freezes > 0  # slow readers; roles stopped and continued


def test_async_lora_storm_through_the_split(tiny_dir, lora_work):
    """The adapter storm through the split: jobs of three adapters and the base are prefilled
    under their adapter and decoded under it, while unloads (abort or wait, on both roles) and
    loads race the cancels before, during and after the transfer; outputs equal the reference,
    both roles' audits and pools come back clean and their references are zero."""
    from stopline.disagg.frontend import disagg_engine

    work, ref, adapters = lora_work
    work = [j for j in work[:100] if not (j.race or j.resubmit)]
    config = dataclasses.replace(storm_config("auto", True), num_blocks=60)
    res = run_async_storm(str(tiny_dir), work, config, seed=37, max_delay=0.1, adapters=adapters,
                          churn=0.3, make=lambda d, c, progress, **kw: disagg_engine(d, c, progress=progress, **kw))
    assert res.unloads > 0
    assert check_storm(work, ref, res) > 5


_REMOTE_ROLE = """
import sys
from stopline.disagg.frontend import remote_spec
from stopline.disagg.role import RoleFactory
from stopline.engine.proc import core_proc
from stopline.engine.proc.remote import core_addresses
from tests.chaos_support import storm_config
import dataclasses
model, front, role = sys.argv[1:4]
cfg = dataclasses.replace(storm_config("auto", True), num_blocks=60)
if role == "decode":  # as `stopline role decode`: received KV enters its prefix cache
    cfg = dataclasses.replace(cfg, enable_prefix_caching=True)
core_proc.main(core_addresses(front), model, cfg, True, None, 1,
               RoleFactory(remote_spec(role, front, 3.0)))
"""


@pytest.mark.parametrize("remote", ["prefill", "decode"])
def test_async_storm_through_the_split_with_a_remote_role(tiny_dir, tiny, storm_work, remote):
    """The split storm with one role as `stopline role` runs it (its own process, reached
    over TCP, the link's sockets bound by the local role): the storm's engine settings, which
    the CLI does not all expose, so the role is started from Python."""
    from stopline.disagg.frontend import disagg_engine
    from tests.server_harness import REPO, free_ports

    work, ref = storm_work
    work = [j for j in work[:80] if not (j.race or j.resubmit)]
    config = dataclasses.replace(storm_config("auto", True), num_blocks=60)
    front = f"127.0.0.1:{free_ports(5)}"
    role = subprocess.Popen([sys.executable, "-c", _REMOTE_ROLE, str(tiny_dir), front, remote], cwd=REPO)
    try:
        res = run_async_storm(str(tiny_dir), work, config, seed=29, max_delay=0.1,
                              make=lambda d, c, progress, **kw: disagg_engine(
                                  d, c, progress=progress, remote=remote, listen=front, **kw))
        assert check_storm(work, ref, res) > 5
        assert role.wait(10) == 0  # the front end's close stopped it
    finally:
        if role.poll() is None:
            role.kill()
            role.wait(5)


def test_solo_matches_reference(tiny, storm_work):
    """The storm compares with a reference run of all its jobs in one batch; batch
    invariance makes that each job's solo output. Checked here on a sample, greedy and
    seeded, n > 1 included, each on a fresh engine of its own."""
    work, ref = storm_work
    rng = random.Random(3)
    seeded = [j for j in work if j.params.n == 1 and j.params.temperature > 0]
    greedy = [j for j in work if j.params.n == 1 and j.params.temperature == 0]
    sample = rng.sample(seeded, 5) + rng.sample(greedy, 4) + [j for j in work if j.params.n > 2][:2]
    for job in sample:
        eng = EngineCore(tiny, EngineConfig(num_blocks=256, block_size=4))
        eng.add_request(job.caller_id, job.prompt, untimed(job.params))
        solo = {i: [] for i in range(job.params.n)}
        while eng.has_unfinished():
            for out in eng.step():
                solo[out.index] += delivered(out)
        assert all(solo[i] == ref[job.key][i] for i in range(job.params.n)), job.key


def test_storm_mixing_the_quantized_kernel_and_the_library(tiny_dir, tmp_path_factory, stopline_cache_dir):
    """The same storm on the model as a Q4_1 GGUF, with the quantized-weight kernel taking
    steps of up to 8 rows and the float32 library the larger ones (recomputed prompts, the
    batched reference): a request decodes on one path and is re-prefilled or compared on the
    other, so any bit the two paths disagree on shows up as a mismatch."""
    from stopline.model.kernels.native import try_kernels

    if try_kernels() is None:
        pytest.skip("stopline's C kernels are not built here")
    gguf_path = make_tiny_gguf(tiny_dir, tmp_path_factory.mktemp("chaos_q4") / "tiny.gguf", qtype="Q4_1")
    q4 = load_model(gguf_path, progress=False, cache_dir=stopline_cache_dir)
    # With logprobs, so that outputs are compared to the last bit, not just their argmax.
    work = make_workload(seed=13, count=300, vocab=q4.config.vocab_size)
    for job in work:
        job.params = dataclasses.replace(job.params, logprobs=0)
    ref = run_reference(q4, work)
    config = dataclasses.replace(storm_config("recompute", False), quant_max_rows=8)
    res = run_storm(q4, work, config, seed=6)
    assert res.engine.model.one_row_ok and res.engine.model.lm_head.kc() is not None
    assert sum(res.engine.lifecycle.stats.preemptions.values()) > 10
    assert check_storm(work, ref, res) > 50


@pytest.mark.parametrize("kv, attention", [("auto", "auto"), ("int8", "auto"), ("int8", "torch")])
def test_storm_in_fast_numerics(tiny_dir, tmp_path_factory, stopline_cache_dir, kv, attention):
    """The storm in the fast numerics mode, on the Q4_1 model (the int8 kernel where the CPU
    has VNNI, else bf16), with async scheduling, swap-or-recompute preemption and speculation:
    every output equals the fast reference run to the logprob. kv int8: the same on an int8
    KV cache (its blocks swapped out and in, copied for forks, poisoned when freed), read by
    the C attention or by torch's (gathered and in DecodeRows, dequantized)."""
    from stopline.model.kernels.bf16_linear import BF16Weight
    from stopline.model.kernels.int8_linear import Int8Weight, int8_ready
    from stopline.model.kernels.native import has_bf16, try_kernels

    if try_kernels() is None or not has_bf16():
        pytest.skip("no fast numerics here (no C kernels or no AVX512-BF16)")
    gguf_path = make_tiny_gguf(tiny_dir, tmp_path_factory.mktemp("chaos_fast") / "tiny.gguf", qtype="Q4_1")
    q4 = load_model(gguf_path, progress=False, cache_dir=stopline_cache_dir)
    work = make_workload(seed=19, count=200, vocab=q4.config.vocab_size)
    for job in work:
        job.params = dataclasses.replace(job.params, logprobs=0)
    ref = run_reference(q4, work, attention=attention, numerics="fast", kv_cache_dtype=kv)
    config = dataclasses.replace(storm_config("auto", True, attention=attention, speculative="on"),
                                 numerics="fast", kv_cache_dtype=kv)
    res = run_storm(q4, work, config, seed=12)
    assert res.engine.kv.quantized == (kv == "int8")
    assert isinstance(res.engine.model.layers[0]["gate_up"].fast, Int8Weight if int8_ready() else BF16Weight)
    stats = res.engine.lifecycle.stats
    assert sum(stats.preemptions.values()) > 5 and stats.spec_verify_steps > 0, stats
    assert kv != "int8" or stats.swapped_blocks > 0, "no int8 block was swapped"
    assert check_storm(work, ref, res) > 30
    assert stats.finished.get("error", 0) == 0


def test_storm_with_small_steps_on_fewer_threads(tiny_dir, tmp_path_factory, stopline_cache_dir,
                                               monkeypatch):
    """The Q4_1 storm on two threads with a neighbour always taking a core: every small step
    on stopline's kernels runs on one thread (worker/cpu_share.py), the others on two, and
    outputs still equal the reference run on two threads, to the logprob."""
    import torch

    from stopline.model.kernels.native import try_kernels

    if try_kernels() is None:
        pytest.skip("stopline's C kernels are not built here")

    class Neighbour:
        def others(self) -> float:
            return 1.0

    monkeypatch.setattr("stopline.worker.runner.CpuShare", Neighbour)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gguf_path = make_tiny_gguf(tiny_dir, tmp_path_factory.mktemp("chaos_q4_threads") / "tiny.gguf",
                                   qtype="Q4_1")
        q4 = load_model(gguf_path, progress=False, cache_dir=stopline_cache_dir)
        work = make_workload(seed=17, count=150, vocab=q4.config.vocab_size)
        if work[-1].race:
            work = work[:-1]  # a raced job comes with its resubmit
        for job in work:
            job.params = dataclasses.replace(job.params, logprobs=0)
        ref = run_reference(q4, work)
        config = dataclasses.replace(storm_config("auto", True), quant_max_rows=8)
        res = run_storm(q4, work, config, seed=8)
        assert res.engine.runner.threads.dropped_steps > 20, res.engine.runner.threads.dropped_steps
        assert sum(res.engine.lifecycle.stats.preemptions.values()) > 5
        assert check_storm(work, ref, res) > 20
    finally:
        torch.set_num_threads(before)


def test_storm_on_torch_attention(tiny):
    """The fallback attention (torch's ops, decode rows) under the same storm, against a
    reference on the same backend: where the C kernels can't build, this is the engine (and
    the storms above already run on it)."""
    from stopline.model.kernels.native import try_kernels

    if try_kernels() is None:
        pytest.skip("the C kernels are off here: every storm above runs on torch attention")
    work = make_workload(seed=17, count=200, vocab=tiny.config.vocab_size)
    ref = run_reference(tiny, work, attention="torch")
    res = run_storm(tiny, work, storm_config("swap", True, attention="torch"), seed=8)
    assert res.engine.model.attention == "torch" and res.engine.runner.rows is not None
    assert sum(res.engine.lifecycle.stats.preemptions.values()) > 10
    assert check_storm(work, ref, res) > 30


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_grammar_storm(tiny, mode):
    """Structured jobs (json_schema incl. a recursive one, regex, choice) under aborts in
    every state (compiling included), preemption mid-object and async scheduling: survivors
    equal their undisturbed run, the audit (grammar consumed == committed) holds after every
    step, nothing ends `error` but the job whose grammar cannot compile, nothing is left
    (matchers, compile tickets, compiles pending, compile threads once closed). Seeded:
    replay a failing seed with grammar_workload(seed=S) and run_storm(seed=S')."""
    work = grammar_workload(seed=13, count=60, vocab=tiny.config.vocab_size)
    bad = dataclasses.replace(work[0], key="impossible", caller_id="impossible", abort=None,
                              params=dataclasses.replace(work[0].params, n=1, grammar="start: nope"))
    before = set(threading.enumerate())
    ref = run_reference(tiny, work)
    res = run_storm(tiny, [*work, bad], storm_config(mode, True), seed=17)
    eng = res.engine
    stats = eng.lifecycle.stats
    assert sum(stats.preemptions.values()) > 0 and eng.grammar.mask_seconds.count > 100
    assert check_storm(work, ref, res) > 5
    (term,) = res.terminals[("impossible", 0)]
    assert term.finish_reason is FinishReason.ERROR and "grammar" in (term.stop_detail or ""), term
    assert stats.finished.get("error", 0) == 1
    assert not eng.grammar.matchers and not eng.grammar.waiting and eng.grammar.pending_compiles() == 0
    eng.grammar.close()
    left = [t for t in set(threading.enumerate()) - before if t.name.startswith("stopline-grammar")]
    assert not left, left


def test_grammar_that_cannot_advance_ends_error_in_that_step(tiny):
    """A matcher with no token allowed (put in its error state here) fails its request in
    the very next step, with the reason; the other request streams on undisturbed."""
    from stopline.grammar.formats import response_format_grammar
    from stopline.request import SamplingParams
    eng = EngineCore(tiny, storm_config("recompute", True))
    g = response_format_grammar({"type": "regex", "regex": "[a-c]{40}"})
    stuck = eng.add_request("stuck", [5, 6, 7], SamplingParams(max_tokens=30, temperature=0.0, grammar=g))
    other = eng.add_request("other", [5, 6, 7], SamplingParams(max_tokens=5, temperature=0.0))
    outs: dict[str, list] = {stuck: [], other: []}
    for _ in range(200):
        if stuck in [i for i, m in ((r.incarnation, eng.grammar.matchers.get(r.internal_id))
                                    for r in eng.live_requests()) if m is not None and m.consumed]:
            break
        for o in eng.step():
            outs[o.incarnation].append(o)
    (req,) = [r for r in eng.live_requests() if r.incarnation == stuck]
    m = eng.grammar.matchers[req.internal_id]
    assert not m.consume(0) and m.error  # token 0 is outside [a-c]: error state, no mask
    got = eng.step()
    term = [o for o in got if o.incarnation == stuck and o.finished]
    assert term and term[0].finish_reason is FinishReason.ERROR, got
    assert "cannot advance" in term[0].stop_detail
    while eng.has_unfinished():
        outs[other] += eng.step()
    assert outs[other][-1].finish_reason is FinishReason.LENGTH
    eng.audit()
    eng.grammar.close()


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """A sliding-window model (tiny Mistral, window 16: four blocks of 4)."""
    d = make_family_dir(tmp_path_factory.mktemp("chaos_window"), "mistral_window")
    return load_model(str(d), progress=False)


@pytest.mark.parametrize("mode,async_scheduling", [("swap", True), ("recompute", False), ("auto", True)])
def test_storm_on_a_sliding_window_model(windowed, mode, async_scheduling):
    """The storm on a model whose blocks go back as its window slides past them, while
    cancels (mid-prefill too), n > 1 families and preemption by swap and recompute run; the
    engine audits the ledger and its per-request tables after every step (debug)."""
    work = make_workload(seed=23, count=160, vocab=windowed.config.vocab_size)
    ref = run_reference(windowed, work)
    # A pool of 20 blocks: the window gives blocks back, so that 40 would rarely run dry.
    config = dataclasses.replace(storm_config(mode, async_scheduling), num_blocks=20)
    res = run_storm(windowed, work, config, seed=9)
    stats = res.engine.lifecycle.stats
    assert res.engine.kv_manager.window == 16 and stats.window_freed_blocks > 50, stats.window_freed_blocks
    assert sum(stats.preemptions.values()) > 10, stats.preemptions
    if mode != "recompute":
        assert stats.preemptions["swap"] > 0
    assert res.states_hit["prefilling"] > 0 and res.states_hit["running"] > 0, dict(res.states_hit)
    assert any(j.params.n > 1 for j in work)
    assert check_storm(work, ref, res) > 30
    assert stats.finished.get("error", 0) == 0


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return make_family_dir(tmp_path_factory.mktemp("chaos_hybrid"), "gemma3")


@pytest.fixture(scope="module")
def hybrid(hybrid_dir):
    """A model of two KV layer groups (tiny Gemma 3: two local layers of window 16, one
    global layer): the local group's blocks go back as the window slides, the global's stay."""
    return load_model(str(hybrid_dir), progress=False)


@pytest.mark.parametrize("mode,async_scheduling,attention,local",
                         [("swap", True, "auto", None), ("recompute", False, "auto", None),
                          ("auto", True, "auto", None), ("swap", True, "torch", None),
                          ("swap", True, "auto", 16), ("recompute", False, "auto", 16),
                          ("auto", True, "torch", 16)])
def test_storm_on_a_model_with_local_and_global_layers(hybrid, mode, async_scheduling, attention, local):
    """The sliding-window storm on per-group block tables: cancels (mid-prefill too), n > 1
    families, swap and recompute preemption, async scheduling; the audit checks both pools
    and every request's tables after every step (debug poisons freed blocks of either).
    local: a local pool of that many blocks beside the global 40 (sized by the window: its
    table grows chunk by chunk, and preemption makes room in whichever pool is short)."""
    work = make_workload(seed=23, count=160, vocab=hybrid.config.vocab_size)
    ref = run_reference(hybrid, work, attention=attention)  # each attention has its own bits
    config = dataclasses.replace(storm_config(mode, async_scheduling, attention=attention),
                                 window_pool_blocks=local)
    res = run_storm(hybrid, work, config, seed=9)
    stats = res.engine.lifecycle.stats
    kv = res.engine.kv_manager
    assert [p.num_blocks for p in kv.pools] == [40, local or 40]
    assert attention != "torch" or res.engine.runner.rows is not None  # decode rows of both groups
    assert kv.windows == [0, 16] and stats.window_freed_blocks > 50, stats.window_freed_blocks
    assert sum(stats.preemptions.values()) > 10, stats.preemptions
    if mode != "recompute":
        assert stats.preemptions["swap"] > 0
    assert res.states_hit["prefilling"] > 0 and res.states_hit["running"] > 0, dict(res.states_hit)
    assert check_storm(work, ref, res) > 30
    assert stats.finished.get("error", 0) == 0
    assert kv.num_used == 0


def test_async_storm_through_the_split_on_local_and_global_layers(hybrid_dir, hybrid):
    """The split storm on the tiny Gemma 3: each prompt's KV crosses as one transfer of both
    groups' live blocks (the local group's only those its window still reads) while cancels
    land before, during and after it and decode preempts; outputs equal the reference, and
    both roles' audits (every step, debug) and every group's pool come back clean."""
    from stopline.disagg.frontend import disagg_engine

    work = make_workload(seed=31, count=100, vocab=hybrid.config.vocab_size)
    work = [j for j in work if not (j.race or j.resubmit)]
    ref = run_reference(hybrid, work)
    config = dataclasses.replace(storm_config("auto", True), num_blocks=60)
    res = run_async_storm(str(hybrid_dir), work, config, seed=41, max_delay=0.1, slow=0.25,
                          max_buffered=2, make=lambda d, c, progress, **kw: disagg_engine(d, c, progress=progress, **kw))
    assert check_storm(work, ref, res) > 5
    moved = {(d, g): n for snap in res.snapshots for d, g, n in snap.transfer_blocks}
    assert 0 < moved["received", 1] < moved["received", 0], moved  # the window's blocks only
    assert moved["sent", 1] < moved["sent", 0]
    assert sum(sum(snap.preemptions.values()) for snap in res.snapshots) > 0
    assert all(len(snap.kv_groups) == 2 for snap in res.snapshots)
