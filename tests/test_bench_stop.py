"""`stopline bench stop` once end to end on the tiny random model (seconds), so it can't rot."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from stopline.bench import stop
from stopline.bench.stop_report import render
from stopline.config import EngineConfig
from stopline.model.loader import load_model


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
    # Two rounds of every pair; the reference runs bracket every storm, each storm's ratio is
    # against its own two, and a pair's ratio is the mean of its rounds'.
    runs, pairs = p["unconstrained_runs_tok_s"], len(p["rows"])
    assert p["rounds"] == 2 and len(runs) == 2 * pairs + 1
    for i, r in enumerate(p["rows"]):
        assert len(r["runs"]) == 2
        for k, run in enumerate(r["runs"]):
            at = k * pairs + i  # the storm ran between reference runs at and at + 1
            assert run["unconstrained_around_tok_s"] == pytest.approx((runs[at] + runs[at + 1]) / 2)
            assert run["ratio"] == pytest.approx(run["tok_s"] / run["unconstrained_around_tok_s"])
        assert r["ratio_vs_unconstrained"] == pytest.approx(sum(r["ratio_runs"]) / 2)
    assert len(p["light_wave_runs"]["fresh"]) == len(p["light_wave_runs"]["after_storm"]) == 2
    report = render(res)
    assert "Preemption storm" in report and "Recovery" in report
