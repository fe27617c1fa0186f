"""`stopline bench stop` once end to end on the tiny random model (seconds), so it can't rot."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from stopline.bench import stop
from stopline.bench.stop_report import render
from stopline.config import EngineConfig
from stopline.model.loaders.loader import load_model
from tests.bench_support import assert_stamped


def test_stop_benchmark_runs_and_reports(tiny_model_dir: Path, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # The tiny model's context is 1,024 tokens: shorter "long" prompts than SmolLM2's.
    monkeypatch.setattr(stop, "make_prompts", functools.partial(stop.make_prompts, long_tokens=60))
    loaded = load_model(str(tiny_model_dir), progress=False)
    out = tmp_path / "stop.json"
    res = stop.run(loaded, out, n=8, max_tokens=6, storm_n=8, fraction=0.25, seed=0,
                   combos=[("recompute", "cost"), ("swap", "newest")], base=EngineConfig())
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    for key in ("cancel_storm", "cancel_storm_under_pressure"):
        c = res[key]
        assert c["tokens_after_abort_per_abort"] == 0
        assert c["ratio_twins_over_aborts"] > 0 and c["abort_to_reclaim_steps_max"] <= 1
        # Two runs a side (aborts, twins, twins, aborts): the ratio is of their sums.
        runs = c["survivors_s_runs"]
        assert len(runs["aborts"]) == len(runs["twins"]) == 2
        assert c["ratio_twins_over_aborts"] == pytest.approx(sum(runs["twins"]) / sum(runs["aborts"]))
    p = res["preemption_storm"]
    assert p["pool_blocks"] < p["demand_blocks"]
    assert [(r["mode"], r["policy"]) for r in p["rows"]] == [("recompute", "cost"), ("swap", "newest")]
    assert all(r["tok_s"] > 0 for r in p["rows"])
    # Two rounds of every pair; each storm ran beside its own unconstrained run, its ratio is
    # against that run, and a pair's ratio is the mean of its rounds'.
    runs, pairs = p["unconstrained_runs_tok_s"], len(p["rows"])
    assert p["rounds"] == 2 and p["method"] == "side by side" and len(runs) == 2 * pairs
    for i, r in enumerate(p["rows"]):
        assert len(r["runs"]) == 2
        for k, run in enumerate(r["runs"]):
            assert run["unconstrained_around_tok_s"] == pytest.approx(runs[k * pairs + i])
            assert run["ratio"] == pytest.approx(run["tok_s"] / run["unconstrained_around_tok_s"])
        assert r["ratio_vs_unconstrained"] == pytest.approx(sum(r["ratio_runs"]) / 2)
    assert len(p["null_ratios"]) == 2 and all(x > 0 for x in p["null_ratios"])
    assert len(p["light_wave_runs"]["fresh"]) == len(p["light_wave_runs"]["after_storm"]) == 2
    report = render(res)
    assert "Preemption storm" in report and "Recovery" in report and "beside itself" in report
    assert_stamped(res)
    # each of the report's three tables is headed by the run's host, commit and command
    head = f"On {res['machine']['summary']}, torch {res['torch']}, commit {res['git']}: `"
    assert report.count(head) == 3


def test_side_by_side_runs_each_engine_to_the_end(tiny_model_dir: Path) -> None:
    """Engines stepped in turn by tokens out: each produces every token of every job, and
    each is timed by its own steps only."""
    loaded = load_model(str(tiny_model_dir), progress=False)
    jobs = [stop.Job(f"j{i}", [5 + i, 9, 11, 40 + i], 5 + i) for i in range(6)]
    tight = EngineConfig(num_blocks=6, block_size=4, admission_lookahead=0)
    roomy = EngineConfig(num_blocks=64, block_size=4)
    a, b = stop.run_side_by_side(loaded, [tight, roomy], jobs, "test")
    want = sum(j.max_tokens for j in jobs)
    assert a.tokens_out == b.tokens_out == want
    assert a.steps > b.steps and sum(a.preemptions.values()) > 0 and not b.preemptions
    assert a.total_seconds > 0 and b.total_seconds > 0
