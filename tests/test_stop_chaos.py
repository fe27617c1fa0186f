"""The stop path under a storm: thousands of requests, random aborts in every state, a pool
small enough to force preemption (recompute and swap), n > 1 among them.

Checked (DESIGN.md contracts): the ledger audit after every step (debug mode, freed blocks
poisoned with NaN); the pool back to baseline at the end; every survivor's greedy output equals
the same request run without interference; every aborted request's delivered tokens are a
prefix of that output and nothing arrives after the abort; exactly one terminal output per
request with the right reason. Seeded: a failure reproduces. The machinery is in
tests/chaos_support.py; bench/chaos_soak.py runs it over fresh seeds for as long as asked.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from stopline.config import EngineConfig
from stopline.engine.core import EngineCore
from stopline.model.loaders.loader import load_model
from tests.chaos_support import check_storm, make_workload, run_reference, run_storm, storm_config
from tests.tiny_model import make_tiny_gguf, make_tiny_llama_dir


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_llama_dir(tmp_path_factory.mktemp("chaos") / "tiny", seed=7, init_std=0.1,
                               vocab_size=384, layers=2)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(str(tiny_dir), progress=False)


@pytest.fixture(scope="module")
def storm_work(tiny):
    """The storm's 600 requests and their reference outputs, computed once for every test."""
    work = make_workload(seed=11, count=600, vocab=tiny.config.vocab_size)
    return work, run_reference(tiny, work)


@pytest.mark.parametrize("mode,async_scheduling", [("recompute", False), ("swap", False),
                                                   ("recompute", True), ("auto", True)])
def test_storm(tiny, storm_work, mode, async_scheduling):
    work, ref = storm_work
    got, terminals, aborted_at, states_hit, eng = run_storm(tiny, work, storm_config(mode, async_scheduling),
                                                            seed=5)
    stats = eng.lifecycle.stats
    # The storm really exercised the stop path.
    assert sum(stats.preemptions.values()) > 20, stats.preemptions
    if mode != "recompute":
        assert stats.preemptions["swap"] > 0
    for state in ("waiting", "prefilling", "running"):
        assert states_hit[state] > 0, f"no abort landed in state {state}: {dict(states_hit)}"
    preempted_states = {"recompute": ["preempted"], "swap": ["swapped"], "auto": ["preempted", "swapped"]}[mode]
    assert sum(states_hit[s] for s in preempted_states) > 0, f"no abort while preempted: {dict(states_hit)}"
    assert check_storm(work, ref, got, terminals, aborted_at) > 100


def test_storm_with_admission_lookahead(tiny, storm_work):
    """The storms above admit into any free room (admission_lookahead=0), so that the pool
    runs dry all the time. Here the default admission, which keeps room for the running
    requests' next tokens, on a pool small enough that it still preempts."""
    work, ref = storm_work
    work = work[:300]
    config = dataclasses.replace(storm_config("auto", False, lookahead=EngineConfig.admission_lookahead),
                                 num_blocks=20)
    got, terminals, aborted_at, _, eng = run_storm(tiny, work, config, seed=9)
    assert sum(eng.lifecycle.stats.preemptions.values()) > 0
    assert check_storm(work, ref, got, terminals, aborted_at) > 50


def test_solo_matches_reference(tiny, storm_work):
    """The storm compares with a reference run of all its requests in one batch; batch
    invariance makes that each request's solo output. Checked here on a sample, n > 1
    included, each on a fresh engine of its own."""
    work, ref = storm_work
    rng = random.Random(3)
    sample = rng.sample([w for w in work if w[2].n == 1], 10) + [w for w in work if w[2].n > 1][:2]
    for rid, prompt, params, _ in sample:
        eng = EngineCore(tiny, EngineConfig(num_blocks=256, block_size=4))
        eng.add_request(rid, prompt, params)
        solo = {i: [] for i in range(params.n)}
        while eng.has_unfinished():
            for out in eng.step():
                solo[out.index] += out.new_token_ids
        assert all(solo[i] == ref[rid][i] for i in range(params.n)), rid


def test_storm_on_torch_attention(tiny):
    """The fallback attention (torch's ops, decode rows) under the same storm, against a
    reference on the same backend: where the C kernels can't build, this is the engine."""
    work = make_workload(seed=17, count=300, vocab=tiny.config.vocab_size)
    ref = run_reference(tiny, work, attention="torch")
    config = storm_config("swap", True, attention="torch")
    got, terminals, aborted_at, _, eng = run_storm(tiny, work, config, seed=8)
    assert eng.model.attention == "torch" and eng.runner.rows is not None
    assert sum(eng.lifecycle.stats.preemptions.values()) > 10
    assert check_storm(work, ref, got, terminals, aborted_at) > 50


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
    work = [(rid, prompt, dataclasses.replace(params, logprobs=0), abort)
            for rid, prompt, params, abort in make_workload(seed=13, count=300, vocab=q4.config.vocab_size)]
    ref = run_reference(q4, work)
    config = dataclasses.replace(storm_config("recompute", False), quant_max_rows=8)
    got, terminals, aborted_at, _, eng = run_storm(q4, work, config, seed=6)
    assert eng.model.one_row_ok and eng.model.lm_head.kc() is not None
    assert sum(eng.lifecycle.stats.preemptions.values()) > 10
    assert check_storm(work, ref, got, terminals, aborted_at) > 50
