"""The chaos storm's machinery, shared by the CI test (tests/test_stop_chaos.py) and the
soak that runs it over fresh seeds for as long as asked (bench/chaos_soak.py).

A workload is many requests of mixed lengths (half share one of a few prefixes), some with
n > 1, 45% with an abort aimed at a state. The storm feeds them into an engine a few a step,
aborts each when its target state is reached, and collects every output; `check_storm`
holds the result to the DESIGN.md contracts against a reference run of the same requests
with no aborts and an ample pool.
"""

from __future__ import annotations

import random
from collections import defaultdict

from stopline.config import EngineConfig
from stopline.engine.core import EngineCore
from stopline.lifecycle import state_name
from stopline.request import AbortSource, FinishReason, SamplingParams

TARGET_STATES = ["waiting", "prefilling", "running", "preempted", "swapped", "any"]


def storm_config(mode: str, async_scheduling: bool, wide: bool = False,
                 attention: str = "auto", lookahead: int = 0) -> EngineConfig:
    """The storm's engine: a pool small enough to force preemption. wide: 64 sequences and
    a larger pool, so that many decode at once (with torch attention, their decode rows
    compact as they end). lookahead: admission_lookahead, 0 by default: admission that
    keeps room for the running requests' next tokens preempts far less, and the storm is
    here to preempt."""
    if wide:
        size = dict(num_blocks=400, max_num_seqs=64, max_num_batched_tokens=64)
    else:
        size = dict(num_blocks=40, max_num_seqs=24, max_num_batched_tokens=24)
    return EngineConfig(block_size=4, preemption_mode=mode, debug=True, target_step_ms=None,
                        max_preemptions=1000, async_scheduling=async_scheduling,
                        attention_backend=attention, admission_lookahead=lookahead, **size)


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


def delivered(out) -> list:
    """What an output delivers, as compared: token ids, or (token id, logprob) pairs when the
    request asked for logprobs (the floats expose any bit a kernel path changes)."""
    if not out.new_logprobs:
        return list(out.new_token_ids)
    return [(t, lp.logprob) for t, lp in zip(out.new_token_ids, out.new_logprobs, strict=True)]


def run_reference(loaded, work, attention: str = "auto"):
    """Each request's output with no aborts and an ample pool (batch invariance makes this
    the same as running it alone; test_solo_matches_reference checks that on a sample).
    attention: as the storm's (the backends give a position different bits)."""
    eng = EngineCore(loaded, EngineConfig(num_blocks=4096, block_size=4, max_num_seqs=256,
                                          max_num_batched_tokens=4096, attention_backend=attention))
    ref = defaultdict(lambda: defaultdict(list))
    for rid, prompt, params, _ in work:
        eng.add_request(rid, prompt, params)
    while eng.has_unfinished():
        for out in eng.step():
            ref[out.request_id][out.index] += delivered(out)
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
    n_of = {rid: params.n for rid, _, params, _ in work}
    age = defaultdict(int)
    live: set[str] = set()
    incs: dict[str, str] = {}
    steps = 0
    while pending or eng.has_unfinished():
        for _ in range(rng.randrange(0, 12)):
            if pending:
                rid, prompt, params, _ = pending.pop(0)
                incs[rid] = eng.add_request(rid, prompt, params)
                live.add(rid)
        # Abort requests whose target state is reached (or whose patience ran out).
        for rid in list(live):
            plan = plans[rid]
            if plan is None or rid in aborted_at:
                continue
            fam = eng.families.get(incs[rid])
            state = state_name(fam.members[0]) if fam is not None else "waiting"
            target, patience = plan
            if state != "waiting" or target == "waiting":
                age[rid] += 1  # patience runs from admission, or the backlog would decide
            if state == target or target == "any" and age[rid] > patience or age[rid] > 3 * patience + 30:
                states_hit[state] += 1
                aborted_at[rid] = {i: len(got[rid][i]) for i in range(8)}
                eng.abort(incs[rid], AbortSource.CANCEL)
                if rng.random() < 0.2:
                    eng.abort(incs[rid], AbortSource.CANCEL)  # twice is the same as once
        for out in eng.step():
            got[out.request_id][out.index] += delivered(out)
            if out.request_id in aborted_at and out.new_token_ids:
                raise AssertionError(f"{out.request_id}: tokens delivered after its abort")
            if out.finished:
                terminals[(out.request_id, out.index)].append(out)
                if all((out.request_id, i) in terminals for i in range(n_of[out.request_id])):
                    live.discard(out.request_id)
        steps += 1
        assert steps < 100_000, "the engine stopped making progress"
    eng.abort("never-existed")  # unknown id: a no-op
    eng.step()
    eng.audit()
    assert eng.pool.num_used == 0, "blocks still owned after every request ended"
    return got, terminals, aborted_at, states_hit, eng


def check_storm(work, ref, got, terminals, aborted_at) -> int:
    """Exactly one terminal output per request and sample; a survivor's tokens equal its
    reference; an aborted one's are a prefix of it, no longer than what it had at the abort.
    Returns the number of aborted samples."""
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
    return n_abort
