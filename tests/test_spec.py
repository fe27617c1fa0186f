"""Speculative decoding (docs/speculative.md): n-gram drafts, lossless verification, the stop
path inside an accepted run, rewinds, and counters that stay true under cancel and preemption."""

from __future__ import annotations

import time

import pytest

from stopline.config import EngineConfig
from stopline.engine.core import EngineCore
from stopline.kv.block_pool import BlockPool
from stopline.kv.manager import KVManager
from stopline.lifecycle import Lifecycle
from stopline.model.loaders.loader import load_model
from stopline.request import AbortSource, FinishReason, Request, RequestStatus, SamplingParams
from stopline.sched.queues import Queues
from stopline.sched.scheduler import Scheduler
from stopline.server.format import UsageSum
from stopline.spec.drafts import Drafts
from stopline.spec.ngram import NgramIndex
from stopline.spec.policy import StepCosts, best_k, expected_tokens
from stopline.stats import StopStats
from tests.engine_support import collect, drive

# Loops back onto itself: the tiny random model's greedy output soon repeats, and drafts from
# the prompt and output then get accepted.
LOOP = [5, 6, 7, 8, 9, 10, 11, 12] * 4


def tiny_engine(loaded, mode: str, **kw: object) -> EngineCore:
    cfg = dict(block_size=4, num_blocks=256, debug=True, target_step_ms=None, speculative=mode)
    cfg.update(kw)
    return EngineCore(loaded, EngineConfig(**cfg), progress=False)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(str(tiny_model_dir), progress=False)


def spec_total(stats: StopStats) -> int:
    return stats.spec_accepted + stats.spec_rejected + sum(stats.spec_discarded.values())


def check_rewound(engine: EngineCore, _step: int) -> None:
    """After every step a decoding request's table covers exactly its computed tokens: the
    blocks only rejected drafts opened went back in the step that rejected them."""
    for r in engine.live_requests():
        kv = engine.kv_manager
        if r.status is RequestStatus.RUNNING and not kv.prefilling(r) and r.fork_leader is None:
            assert len(kv.table(r)) == kv.blocks_for(kv.computed(r)), r.incarnation


# ---- units ----------------------------------------------------------------------------------
def test_ngram_finds_the_latest_continuation_and_extends_a_loop():
    idx = NgramIndex()  # one per request: it indexes that request's tokens as they grow
    toks = [1, 2, 3, 4, 9, 1, 2, 3]
    assert idx.propose(toks, 3) == [4, 9, 1]  # after the earlier "1 2 3"
    assert NgramIndex().propose([7, 7, 7], 4) == [7, 7, 7, 7]  # a run continues as a run
    assert NgramIndex().propose([1, 2, 3, 4], 4) == []  # the suffix itself is no match
    toks += [4]
    assert idx.propose(toks, 2) == [9, 1]  # the index grows with the tokens


def test_auto_drafts_only_where_it_pays():
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    # One stream (1 token per 40 ms), verify rows at 1 ms: even a modest acceptance pays.
    assert best_k(0.6, 8, 1.0, 1 / 40) > 0
    # 32 streams (32 tokens per 250 ms), verify rows at 6 ms: a low acceptance never pays.
    assert best_k(0.2, 8, 6.0, 32 / 250) == 0
    assert best_k(0.95, 8, 6.0, 32 / 250) > 0
    costs = StepCosts()
    assert costs.extra_ms(1, 0) is None  # not measured: measure it
    costs.observe(1, 0, 20.0, 0)
    costs.observe(1, 4, 32.0, 1)
    assert costs.extra_ms(1, 2) is None  # one measurement is not trusted yet
    costs.observe(1, 4, 32.0, 2)
    costs.observe(1, 4, 32.0, 3)
    assert costs.extra_ms(1, 4) == pytest.approx(3.0)
    for step in range(4, 20):  # a busy host: verify steps no slower than plain ones
        costs.observe(1, 4, 20.0, step)
    assert costs.extra_ms(1, 20) == pytest.approx(0.1 * 20.0)  # never taken as free
    assert costs.extra_ms(1, 5000) is None  # stale: measured again


def test_auto_prior_is_not_another_requests_acceptance(tiny):
    """A request quoting its prompt (every draft accepted) must not make a new request of a
    full batch look like it: the newcomer starts at the neutral prior, and where no draft can
    pay at that, its n-gram index is not even asked."""
    cfg = EngineConfig(speculative="auto", speculative_tokens=8)
    drafts = Drafts(cfg, StopStats(), max_model_len=1024)
    quote = Request("q", LOOP, SamplingParams(max_tokens=64), incarnation="q")
    for _ in range(20):
        drafts.settle(quote, drafted=8, accepted=8, unverified=0, reason="stop", first_out=0)
    assert drafts.alpha(quote) > 0.9
    new = Request("n", LOOP, SamplingParams(max_tokens=64), incarnation="n")
    assert drafts.alpha(new) == pytest.approx(0.5)
    # 32 decodes in 32 ms; a verify row adds what a decode row costs: 0.5 never pays.
    for step in range(4):
        drafts.costs.observe(32, 0, 32.0, step)
        drafts.costs.observe(32, 4, 36.0, step)
    drafts.begin_step(10, 32)
    assert drafts.propose(new, room=8) == []
    assert drafts.state[new.internal_id].index.upto == 0  # the index was not asked
    drafts.begin_step(11, 1)  # one stream, cheap verify rows: the same request drafts
    drafts.costs.observe(1, 0, 4.0, 11)
    for step in range(12, 15):
        drafts.costs.observe(1, 4, 4.4, step)
    assert drafts.propose(new, room=8) != []


def test_usage_reports_prediction_tokens():
    from stopline.engine.output import RequestOutput
    from stopline.request import Usage

    u = UsageSum(10)
    u.add(RequestOutput("a", 0, usage=Usage(10, 5, draft_tokens=6, accepted_draft_tokens=4,
                                             rejected_draft_tokens=2)))
    assert u.body()["completion_tokens_details"] == {"accepted_prediction_tokens": 4,
                                                     "rejected_prediction_tokens": 2}
    assert "completion_tokens_details" not in UsageSum(10).body()


def test_preemption_drops_the_drafts_in_flight():
    """A request preempted while its verify step is in flight: the drafts count as discarded
    by preemption, the step's result is void by the epoch, and the audit finds nothing held."""
    cfg = EngineConfig(block_size=4, num_blocks=32, max_num_seqs=4, max_num_batched_tokens=64,
                       target_step_ms=None, debug=True, speculative="on", preemption_mode="recompute")
    stats = StopStats()
    pool = BlockPool(32, 4)
    kv = KVManager(pool, None, None, stats)
    queues = Queues()
    drafts = Drafts(cfg, stats, max_model_len=1024)
    life = Lifecycle(cfg, kv, [queues, drafts, kv], stats)
    sched = Scheduler(cfg, kv, queues, life, drafts)
    req = Request("a", LOOP[:12], SamplingParams(max_tokens=20, temperature=0.0), incarnation="a")
    sched.add(req)
    plan = sched.schedule()  # the prefill
    req.inflight_samples = 0
    kv.landed(req)
    req.output_token_ids.append(LOOP[12])  # its first token continues the loop
    kv.step_processed(plan.step_id)
    plan = sched.schedule()
    (ch,) = plan.chunks
    assert ch.drafts == LOOP[13:13 + len(ch.drafts)] and ch.drafts
    assert ch.num_logits == 1 + len(ch.drafts)
    life.preempt(req)
    assert req.epoch != ch.epoch  # the late result is void
    assert stats.spec_discarded["preempt"] == len(ch.drafts) == stats.spec_drafted
    kv.step_processed(plan.step_id)
    life.abort(req, __import__("stopline.request", fromlist=["AbortSource"]).AbortSource.CANCEL)
    life.audit([])
    assert not drafts.holds(req) and pool.num_used == 0


# ---- lossless on the tiny model -------------------------------------------------------------
def _requests(stop: tuple[str, ...] = ()):
    return [
        ("greedy", LOOP, SamplingParams(max_tokens=48, temperature=0.0, logprobs=2, stop=stop)),
        ("seeded", LOOP[3:], SamplingParams(max_tokens=48, temperature=0.7, seed=11, logprobs=1,
                                            repetition_penalty=1.05, stop=stop)),
        ("penalty", LOOP[1:], SamplingParams(max_tokens=40, temperature=0.0, frequency_penalty=0.2,
                                             presence_penalty=0.1, min_tokens=4)),
        ("short", [300, 301, 302, 300, 301, 302, 300], SamplingParams(max_tokens=7, temperature=0.0)),
    ]


def _same(a, b) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        assert x.token_ids == y.token_ids, key
        assert [(lp.token_id, lp.logprob, lp.top) for lp in x.logprobs] == \
               [(lp.token_id, lp.logprob, lp.top) for lp in y.logprobs], key
        assert (x.text, x.finish_reason, x.stop_detail) == (y.text, y.finish_reason, y.stop_detail), key
        assert x.usage.completion_tokens == y.usage.completion_tokens, key


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_lossless_on_the_tiny_model(tiny, async_scheduling):
    off = drive(tiny_engine(tiny, "off", async_scheduling=async_scheduling), _requests())
    # A stop string that first appears late in the greedy text, inside its last loop: a stop
    # inside an accepted run, after earlier runs were accepted.
    text = off[("greedy", 0)].text
    late = [text[i:i + 3] for i in range(len(text) * 3 // 4, len(text) - 3)]
    stop = tuple(x for x in late if text.find(x) >= len(text) * 3 // 4 and "\ufffd" not in x)[:1]
    assert stop, "no late stop string in the greedy text"
    off = drive(tiny_engine(tiny, "off", async_scheduling=async_scheduling), _requests(stop))
    eng = tiny_engine(tiny, "on", async_scheduling=async_scheduling)
    on = drive(eng, _requests(stop), after_step=check_rewound)
    _same(off, on)
    s = eng.stats
    assert s.spec_accepted > 0 and s.spec_rejected > 0
    assert s.spec_drafted == spec_total(s)  # every draft is exactly one of the outcomes
    per = [r.usage for r in on.values()]
    assert sum(u.accepted_draft_tokens for u in per) == s.spec_accepted
    assert sum(u.draft_tokens for u in per) == s.spec_drafted


def test_stop_token_and_max_tokens_inside_an_accepted_run(tiny):
    """Every token of the greedy loop as a stop token in turn, and every max_tokens: nothing
    after the stop is delivered, and the finish reason is the stop's."""
    base = drive(tiny_engine(tiny, "off"), [("a", LOOP, SamplingParams(max_tokens=40, temperature=0.0))])
    toks = base[("a", 0)].token_ids
    reqs = [(f"t{i}", LOOP, SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[t]))
            for i, t in enumerate(sorted(set(toks[8:])))]
    reqs += [(f"m{n}", LOOP, SamplingParams(max_tokens=n, temperature=0.0)) for n in (9, 13, 17, 22)]
    off = drive(tiny_engine(tiny, "off"), reqs)
    eng = tiny_engine(tiny, "on")
    on = drive(eng, reqs, after_step=check_rewound)
    _same(off, on)
    assert eng.stats.spec_accepted > 0
    assert eng.stats.spec_drafted == spec_total(eng.stats)


def test_cancel_during_a_verify_step_delivers_none_of_it(tiny):
    eng = tiny_engine(tiny, "on")
    inc = eng.add_request("a", LOOP, SamplingParams(max_tokens=60, temperature=0.0))
    execute = eng.runner.execute
    seen: dict[str, int] = {}

    def cancelling(plan, interrupt=None):
        result = execute(plan, interrupt)
        drafts = [c for c in plan.chunks if c.drafts]
        if drafts and "drafts" not in seen:
            seen["drafts"] = len(drafts[0].drafts)
            seen["delivered"] = len(drafts[0].req.output_token_ids)
            eng.abort([inc], AbortSource.CANCEL, time.monotonic())  # lands while the step is in flight
        return result

    eng.runner.execute = cancelling  # type: ignore[method-assign]
    results: dict = {}
    while eng.has_unfinished():
        collect(results, eng.step())
        eng.audit()
    r = results[("a", 0)]
    assert "drafts" in seen, "no verify step ran"
    assert r.finish_reason is FinishReason.ABORT
    assert len(r.token_ids) == seen["delivered"]  # nothing of the verify step
    s = eng.stats
    assert s.spec_discarded["cancel"] == seen["drafts"]
    assert s.spec_drafted == spec_total(s)
    assert r.usage.discarded_draft_tokens == seen["drafts"]
    assert eng.pool.num_used == 0


def test_auto_measures_then_speculates_on_a_loop(tiny):
    eng = tiny_engine(tiny, "auto")
    res = drive(eng, [("a", LOOP, SamplingParams(max_tokens=80, temperature=0.0))], after_step=check_rewound)
    assert eng.drafts.costs.plain and eng.drafts.costs.extra  # both costs measured
    assert eng.stats.spec_drafted > 0
    off = drive(tiny_engine(tiny, "off"), [("a", LOOP, SamplingParams(max_tokens=80, temperature=0.0))])
    _same(off, res)


# ---- lossless on SmolLM2 --------------------------------------------------------------------
def test_lossless_on_smollm2(smollm2):
    from stopline.bench.spec import PASSAGE

    tok = smollm2.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Repeat exactly:\n\n" + PASSAGE[:300]}],
                                   add_generation_prompt=True)
    prompt = tok.encode(text, add_special_tokens=False)
    reqs = [("greedy", prompt, SamplingParams(max_tokens=40, temperature=0.0, logprobs=1, stop=["pool"])),
            ("seeded", prompt, SamplingParams(max_tokens=24, temperature=0.6, seed=5,
                                              frequency_penalty=0.1))]
    cfg = dict(block_size=16, num_blocks=64, max_num_seqs=4, debug=True)
    off = drive(EngineCore(smollm2, EngineConfig(speculative="off", **cfg), progress=False), reqs)
    eng = EngineCore(smollm2, EngineConfig(speculative="on", **cfg), progress=False)
    on = drive(eng, reqs, after_step=check_rewound)
    _same(off, on)
    assert eng.stats.spec_accepted > 10


def test_metrics_export_the_counters():
    from types import SimpleNamespace

    from stopline.engine.snapshot import Snapshot
    from stopline.server.metrics import ServerMetrics

    m = ServerMetrics()
    m.bind(SimpleNamespace(snapshot=Snapshot(spec_drafted=10, spec_accepted=6, spec_rejected=2,
                                             spec_discarded={"cancel": 2}, spec_verify_steps=3),
                           num_open=0, ready=True))
    text = m.render()[0].decode()
    for line in ("stopline_spec_draft_tokens_total 10.0", "stopline_spec_accepted_tokens_total 6.0",
                 "stopline_spec_rejected_tokens_total 2.0", 'stopline_spec_discarded_tokens_total{reason="cancel"} 2.0',
                 'stopline_spec_discarded_tokens_total{reason="preempt"} 0.0', "stopline_spec_acceptance_rate 0.75"):
        assert line in text, line


def test_the_bench_alternates_modes_and_reports_the_spread(tiny):
    """`stopline bench spec`: sampled workloads too, each mode's ratio to off per round, the
    median with its lowest and highest, and seeded sampling equal across modes."""
    from stopline.bench import spec as bench

    cfg = EngineConfig(block_size=16, num_blocks=64, max_num_seqs=4)
    res = bench.run(tiny, cfg, streams=2, max_tokens=12, batch_tokens=6, rounds=3,
                    names=("free", "sampled", "sampled-batch"))
    rows = {(r["workload"], r["mode"]): r for r in res["rows"]}
    assert set(rows) == {(w, m) for w in ("free", "sampled", "sampled-batch") for m in bench.MODES}
    for r in rows.values():
        assert r["vs_off_min"] <= r["vs_off"] <= r["vs_off_max"]
        assert r["tok_s_min"] <= r["tok_s"] <= r["tok_s_max"]
        assert r["same_tokens_as_off"], r
    assert rows[("sampled", "off")]["vs_off"] == 1.0
    assert "(" in bench.table(res)  # the spread is shown
    with pytest.raises(ValueError, match="unknown workload"):
        bench.run(tiny, cfg, 2, 4, 4, 1, names=("nope",))
