"""The stop path under a storm: thousands of requests, random aborts in every state, a pool
small enough to force preemption (recompute and swap), n > 1 among them.

Checked (DESIGN.md contracts): the ledger audit after every step (debug mode, freed blocks
poisoned with NaN); the pool back to baseline at the end; every survivor's greedy output equals
the same request run without interference; every aborted request's delivered tokens are a
prefix of that output and nothing arrives after the abort; exactly one terminal output per
request with the right reason. Seeded: a failure reproduces.
"""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from stopline.config import EngineConfig
from stopline.engine.core import EngineCore
from stopline.lifecycle import state_name
from stopline.model.loader import load_model
from stopline.request import AbortSource, FinishReason, SamplingParams
from tests.tiny_model import make_tiny_llama_dir

TARGET_STATES = ["waiting", "prefilling", "running", "preempted", "swapped", "any"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_llama_dir(tmp_path_factory.mktemp("chaos") / "tiny", seed=7, init_std=0.1,
                               vocab_size=384, layers=2)
    return load_model(str(path), progress=False)


def make_workload(seed: int, count: int, vocab: int):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, vocab) for _ in range(rng.randrange(4, 20))] for _ in range(8)]
    work = []
    for i in range(count):
        base = list(rng.choice(prefixes)) if rng.random() < 0.5 else []
        prompt = base + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 24))]
        n = 1 if rng.random() < 0.9 else rng.choice([2, 3])
        params = SamplingParams(n=n, temperature=0.0, max_tokens=rng.randrange(1, 20))
        abort = None
        if rng.random() < 0.45:
            abort = (rng.choice(TARGET_STATES), rng.randrange(0, 12))
        work.append((f"r{i}", prompt, params, abort))
    return work


def run_reference(loaded, work):
    """Each request's output with no aborts and an ample pool (batch invariance makes this
    the same as running it alone; test_solo_matches_reference checks that on a sample)."""
    eng = EngineCore(loaded, EngineConfig(num_blocks=4096, block_size=4, max_num_seqs=256,
                                          max_num_batched_tokens=4096))
    ref = defaultdict(lambda: defaultdict(list))
    for rid, prompt, params, _ in work:
        eng.add_request(rid, prompt, params)
    while eng.has_unfinished():
        for out in eng.step():
            ref[out.request_id][out.index] += out.new_token_ids
    return ref


def run_storm(loaded, work, config: EngineConfig, seed: int):
    rng = random.Random(seed)
    eng = EngineCore(loaded, config)
    got = defaultdict(lambda: defaultdict(list))
    terminals = defaultdict(list)
    aborted_at: dict[str, dict[int, int]] = {}  # id -> index -> tokens delivered at the abort
    states_hit = defaultdict(int)
    pending = list(work)
    plans = {rid: abort for rid, _, _, abort in work}
    age = defaultdict(int)
    live: set[str] = set()
    steps = 0
    while pending or eng.has_unfinished():
        for _ in range(rng.randrange(0, 12)):
            if pending:
                rid, prompt, params, _ = pending.pop(0)
                eng.add_request(rid, prompt, params)
                live.add(rid)
        # Abort requests whose target state is reached (or whose patience ran out).
        for rid in list(live):
            plan = plans[rid]
            if plan is None or rid in aborted_at:
                continue
            fam = eng.families.get(rid)
            state = state_name(fam.members[0]) if fam is not None else "waiting"
            target, patience = plan
            if state != "waiting" or target == "waiting":
                age[rid] += 1  # patience runs from admission, or the backlog would decide
            if state == target or target == "any" and age[rid] > patience or age[rid] > 3 * patience + 30:
                states_hit[state] += 1
                aborted_at[rid] = {i: len(got[rid][i]) for i in range(8)}
                eng.abort(rid, AbortSource.CANCEL)
                if rng.random() < 0.2:
                    eng.abort(rid, AbortSource.CANCEL)  # twice is the same as once
        for out in eng.step():
            got[out.request_id][out.index] += out.new_token_ids
            if out.request_id in aborted_at and out.new_token_ids:
                raise AssertionError(f"{out.request_id}: tokens delivered after its abort")
            if out.finished:
                terminals[(out.request_id, out.index)].append(out)
                if all((out.request_id, i) in terminals for i in range(_n(work, out.request_id))):
                    live.discard(out.request_id)
        steps += 1
        assert steps < 100_000, "the engine stopped making progress"
    eng.abort("never-existed")  # unknown id: a no-op
    eng.step()
    eng.audit()
    assert eng.pool.num_used == 0, "blocks still owned after every request ended"
    return got, terminals, aborted_at, states_hit, eng


_N_CACHE: dict[str, int] = {}


def _n(work, rid):
    if not _N_CACHE or rid not in _N_CACHE:
        for r, _, p, _ in work:
            _N_CACHE[r] = p.n
    return _N_CACHE[rid]


@pytest.mark.parametrize("mode,async_scheduling", [("recompute", False), ("swap", False),
                                                   ("recompute", True), ("auto", True)])
def test_storm(tiny, mode, async_scheduling):
    _N_CACHE.clear()
    work = make_workload(seed=11, count=600, vocab=tiny.config.vocab_size)
    ref = run_reference(tiny, work)
    cfg = EngineConfig(num_blocks=40, block_size=4, max_num_seqs=24, max_num_batched_tokens=24,
                       preemption_mode=mode, debug=True, target_step_ms=None, max_preemptions=1000,
                       async_scheduling=async_scheduling)
    got, terminals, aborted_at, states_hit, eng = run_storm(tiny, work, cfg, seed=5)
    stats = eng.lifecycle.stats
    # The storm really exercised the stop path.
    assert sum(stats.preemptions.values()) > 20, stats.preemptions
    if mode != "recompute":
        assert stats.preemptions["swap"] > 0
    for state in ("waiting", "prefilling", "running", "swapped" if mode == "swap" else "preempted"):
        assert states_hit[state] > 0, f"no abort landed in state {state}: {dict(states_hit)}"
    n_abort = 0
    for rid, _prompt, params, _ in work:
        for i in range(params.n):
            outs = terminals[(rid, i)]
            assert len(outs) == 1, f"{rid}[{i}]: {len(outs)} terminal outputs"
            term = outs[0]
            want = ref[rid][i]
            tokens = got[rid][i]
            if term.finish_reason is FinishReason.ABORT:
                n_abort += 1
                assert rid in aborted_at
                assert tokens == want[: len(tokens)], f"{rid}[{i}]: aborted output is not a prefix"
                assert len(tokens) <= aborted_at[rid][i]
                assert term.usage.completion_tokens == len(tokens)
            else:
                assert term.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), term
                assert tokens == want, f"{rid}[{i}]: survivor differs from its undisturbed run"
    assert n_abort > 100
