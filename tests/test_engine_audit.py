"""The block ledger (docs/design.md, contract 1) holds after every step of a busy engine, and the
audit really catches the leaks and double counts it exists for."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stopline import LLM, FinishReason
from stopline.kv.block_pool import LedgerError, hash_blocks
from stopline.request import SamplingParams
from tests.engine_support import drive, greedy, random_prompts, sharp_tiny_dir

BS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sharp_tiny_dir(tmp_path_factory)


def _llm(model_dir: Path, **kw) -> LLM:
    kw.setdefault("num_blocks", 48)
    return LLM(model=str(model_dir), progress=False, block_size=BS, target_step_ms=None, **kw)


def _workload() -> list[tuple[str, list[int], SamplingParams]]:
    """Everything at once: shared prefixes, repeats, families, seeds, stops, penalties."""
    base = random_prompts(12, [2, 9, 16, 30, 45, 61], seed=21)
    prompts = base + [base[4][:20] + base[0], list(base[5]), base[5][:32] + [7]]
    kinds = [
        greedy(20), SamplingParams(temperature=0.8, seed=3, max_tokens=25, top_k=50),
        greedy(12, n=3), SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=18, ignore_eos=True),
        greedy(30, stop=["a"]), greedy(16, frequency_penalty=0.5, logprobs=2),
        SamplingParams(temperature=0, max_tokens=30, min_tokens=10),
    ]
    return [(f"w{i}", p, kinds[i % len(kinds)]) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("budget", [6, 64])
def test_ledger_holds_after_every_step(model_dir: Path, prefix_caching: bool, budget: int) -> None:
    # Admission keeps no room back for the running requests' next tokens, so the pool runs dry.
    llm = _llm(model_dir, num_blocks=32, max_num_batched_tokens=budget, enable_prefix_caching=prefix_caching,
               max_preemptions=1000, debug=True, admission_lookahead=0)
    e = llm.engine
    work = _workload()
    late = {3: work[10:13], 9: work[13:]}  # some arrive while others run
    early = [w for w in work if w not in work[10:]]
    peak = [0]

    def before(engine, step: int) -> None:
        for rid, p, params in late.get(step, []):
            engine.add_request(rid, p, params)

    def after(engine, step: int) -> None:
        peak[0] = max(peak[0], engine.pool.num_used)
        # The three ledger states add up to the pool, whatever the step.
        pool = engine.pool
        assert pool.num_free + pool.num_cached + pool.num_used == pool.num_blocks

    results = drive(e, early, before_step=before, after_step=after)
    expected = sum(params.n for _, _, params in work)
    assert len(results) == expected
    assert all(r.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) for r in results.values())
    # The pool ran dry: requests were preempted and resumed.
    assert peak[0] >= e.pool.num_blocks - 2
    assert sum(e.lifecycle.stats.preemptions.values()) > 0
    assert e.pool.num_used == 0
    # Finished prompts stay findable in the prefix cache, or nothing does.
    assert (e.pool.num_cached > 0) is prefix_caching


def test_outputs_do_not_depend_on_the_audits(model_dir: Path) -> None:
    """Debug mode (audit + poison) changes nothing about what is generated."""
    work = _workload()
    plain = drive(_llm(model_dir, max_preemptions=1000).engine, work, audit=False)
    checked = drive(_llm(model_dir, max_preemptions=1000, debug=True).engine, work)
    assert {k: r.token_ids for k, r in plain.items()} == {k: r.token_ids for k, r in checked.items()}


# ---- the audit has teeth --------------------------------------------------------------------

def _mid_run(model_dir: Path) -> LLM:
    """An engine stopped after a few steps with several requests holding blocks."""
    llm = _llm(model_dir, num_blocks=256)
    e = llm.engine
    for rid, p, params in _workload()[:6]:
        e.add_request(rid, p, params)
    for _ in range(3):
        e.step()
    e.audit()
    assert e.pool.num_used > 0
    return llm


def _owned_block(llm: LLM) -> tuple[object, int]:
    req = next(r for r in llm.engine.live_requests() if llm.engine.kv_manager.table(r))
    return req, llm.engine.kv_manager.table(req)[-1]


def test_audit_catches_a_leaked_reference(model_dir: Path) -> None:
    llm = _mid_run(model_dir)
    req, b = _owned_block(llm)
    llm.engine.kv_manager.seqs[req].block_ids.pop()  # the table forgot the block, the pool did not
    with pytest.raises(LedgerError, match=f"block {b}"):
        llm.engine.audit()


def test_audit_catches_a_double_count(model_dir: Path) -> None:
    llm = _mid_run(model_dir)
    _, b = _owned_block(llm)
    llm.engine.pool.refcount[b] += 1
    with pytest.raises(LedgerError, match=f"block {b}"):
        llm.engine.audit()


def test_audit_catches_an_owned_block_in_the_free_queue(model_dir: Path) -> None:
    llm = _mid_run(model_dir)
    _, b = _owned_block(llm)
    llm.engine.pool.free_queue[b] = None
    with pytest.raises(LedgerError, match="free queue"):
        llm.engine.audit()


def test_audit_catches_a_lost_free_block(model_dir: Path) -> None:
    llm = _mid_run(model_dir)
    b = next(iter(llm.engine.pool.free_queue))
    del llm.engine.pool.free_queue[b]
    with pytest.raises(LedgerError, match="leak"):
        llm.engine.audit()


def test_audit_catches_an_idle_engine_holding_blocks(model_dir: Path) -> None:
    llm = _llm(model_dir, num_blocks=64)
    llm.generate([[5, 6, 7]], greedy(3))
    llm.engine.audit()
    llm.engine.pool.allocate(1)
    with pytest.raises(LedgerError):
        llm.engine.audit()


# ---- poisoning ------------------------------------------------------------------------------

def test_debug_poisons_freed_blocks(model_dir: Path) -> None:
    llm = _llm(model_dir, num_blocks=64, enable_prefix_caching=False, debug=True)
    llm.generate(random_prompts(3, [9, 30], seed=1), greedy(10))
    kv = llm.engine.kv
    used = [b for b in range(64) if not torch.all(kv.block(kv.k[0], b) == 0)]
    assert used, "nothing was written"
    for t in kv.k + kv.v:
        for b in used:
            assert torch.isnan(kv.block(t, b)).all(), f"freed block {b} not poisoned"


def test_a_read_of_poisoned_kv_is_an_error_not_a_token(model_dir: Path) -> None:
    """What poisoning buys: a stale read shows up. Poison a live request's block behind the
    engine's back; its next step reads NaN and the request ends with an error."""
    llm = _llm(model_dir, num_blocks=64, debug=True)
    e = llm.engine
    other = random_prompts(1, [7], seed=3)[0]
    e.add_request("victim", random_prompts(1, [10], seed=2)[0], greedy(20))
    e.add_request("bystander", other, greedy(20))
    e.step()
    victim = e.families.find("victim").members[0]
    e.kv.poison([e.kv_manager.table(victim)[0]])
    results = drive(e)
    assert results[("victim", 0)].finish_reason is FinishReason.ERROR
    assert "NaN" in (results[("victim", 0)].stop_detail or "")
    # The bystander is unharmed: its output is its output alone.
    solo = _llm(model_dir, num_blocks=64).generate([other], greedy(20))[0].outputs[0].token_ids
    got = results[("bystander", 0)].token_ids
    assert got[-(len(solo) - 1):] == solo[1:] and len(got) == len(solo) - 1  # first came in step 0


def test_eviction_under_pressure_keeps_the_ledger(model_dir: Path) -> None:
    """A stream of distinct prompts through a small pool: cached blocks are evicted (oldest
    first) to make room for new ones, and nothing leaks."""
    llm = _llm(model_dir, num_blocks=32, debug=True)
    pool = llm.engine.pool
    first = random_prompts(2, [25, 11], seed=100)
    for i in range(12):
        llm.generate(first if i == 0 else random_prompts(2, [25, 11], seed=100 + i), greedy(6))
        assert pool.num_used == 0 and pool.num_free + pool.num_cached == pool.num_blocks
    assert pool.num_cached > 0
    # The first prompts' blocks were evicted for later ones; the last ones are still cached.
    assert pool.lookup(hash_blocks(first[0], BS)) == []
    last = random_prompts(2, [25, 11], seed=111)[0]
    assert len(pool.lookup(hash_blocks(last, BS))) == 25 // BS


# ---- the sampled busy-time audit (EngineConfig.audit_every) ---------------------------------

def test_sampled_audit_runs_on_every_nth_busy_step_and_changes_no_output(model_dir: Path) -> None:
    work = _workload()
    plain = drive(_llm(model_dir, max_preemptions=1000).engine, work, audit=False)
    e = _llm(model_dir, max_preemptions=1000, audit_every=3).engine
    sampled = drive(e, work, audit=False)
    assert {k: r.token_ids for k, r in plain.items()} == {k: r.token_ids for k, r in sampled.items()}
    st = e.lifecycle.stats
    assert st.audits == (e.steps + 2) // 3 and st.audits > 3  # steps 0, 3, 6, ...
    assert st.audit_failures == 0 and st.audit_seconds > 0


def test_sampled_audit_logs_and_counts_a_leak_and_keeps_serving(model_dir: Path, caplog) -> None:
    llm = _llm(model_dir, num_blocks=256, audit_every=1)
    e = llm.engine
    for rid, p, params in _workload()[:6]:
        e.add_request(rid, p, params)
    for _ in range(3):
        e.step()
    b = next(reversed(e.pool.free_queue))
    del e.pool.free_queue[b]  # a lost free block, planted mid-run
    with caplog.at_level("ERROR", logger="stopline.engine"):
        e.step()
    assert e.lifecycle.stats.audit_failures == 1
    assert any("ownership audit failed" in r.getMessage() and "leak" in r.getMessage()
               for r in caplog.records), caplog.text
    e.pool.free_queue[b] = None  # found again: the next audits pass
    while e.has_unfinished():
        e.step()
    assert e.lifecycle.stats.audit_failures == 1
    assert e.lifecycle.stats.audits == e.steps


def test_audit_every_must_not_be_negative() -> None:
    from stopline.config import EngineConfig

    with pytest.raises(ValueError, match="audit_every"):
        EngineConfig(audit_every=-1)
