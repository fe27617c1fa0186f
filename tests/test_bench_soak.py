"""`stopline bench soak` end to end on the tiny random model (seconds), so it can't rot.

The result's shape and its bookkeeping only: no memory figure is asserted here (100 requests
say nothing about growth, and RSS on a CI runner is not this test's business)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from stopline.bench import soak
from tests.bench_support import assert_stamped


def test_slope_is_least_squares() -> None:
    assert soak.slope([0, 1, 2, 3], [5, 7, 9, 11]) == pytest.approx(2.0)
    assert soak.slope([10, 20, 30], [4, 4, 4]) == pytest.approx(0.0)
    assert soak.slope([1], [1]) is None
    assert soak.slope([2, 2], [1, 3]) is None


def test_rss_and_children_of_this_process() -> None:
    assert 0 < soak.rss(os.getpid(), "RssAnon") <= soak.rss(os.getpid())
    now = soak.rss(os.getpid())  # read first: RSS may grow between the two reads, HWM with it
    assert soak.rss(os.getpid(), "VmHWM") >= now
    assert os.getpid() in soak.children(os.getppid())


def test_plan_is_seeded_and_mixes_closes_and_shared_heads() -> None:
    a, b = soak.Plan(3, 8), soak.Plan(3, 8)
    reqs = [a.request(i) for i in range(400)]
    assert reqs == [b.request(i) for i in range(400)]
    closes = sum(c is not None for _, _, c in reqs)
    assert 150 < closes < 250  # about half
    assert all(4 <= mt <= 8 for _, mt, _ in reqs)
    heads = sum(any(p.startswith(h) for h in a.heads) for p, _, _ in reqs)
    assert 200 < heads < 340  # two thirds start with a shared head: prefix hits
    assert len({p for p, _, _ in reqs}) > 250  # and most are new text: misses


@pytest.mark.timeout(300)
def test_soak_end_to_end_on_tiny_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    n = 100
    out = tmp_path / "soak.json"
    res = soak.run(model=str(tiny_model_dir), requests=n, concurrency=8, max_tokens=6, port=None,
                   sample_every=10, kv_cache_gb=0.05, seed=1, log_path=tmp_path / "soak.log",
                   progress=False, command="pytest")
    out.write_text(json.dumps(res))  # JSON-clean
    assert res["requests_done"] == n and res["stopped"] is None
    assert not res["errors"] and "error" not in res["outcomes"]
    # every request ended exactly once, on both sides
    assert sum(res["outcomes"].values()) == n
    assert 0 < res["outcomes"].get("closed", 0) <= res["planned_closes"] < n
    assert sum(res["server_finished"].values()) == n + res["warmup_requests"]
    assert res["server_finished"].get("abort", 0) <= res["outcomes"]["closed"]
    pids = res["pids"]
    assert pids["server"] != pids["core"] and min(pids.values()) > 0
    assert [s[0] for s in res["samples"]] == list(range(0, n + 1, 10))
    assert all(len(s) == len(res["samples_columns"]) == 6 for s in res["samples"])
    assert all(0 < s[4] <= s[2] and 0 < s[5] <= s[3] for s in res["samples"])  # RssAnon <= VmRSS
    assert isinstance(res["stalls"], list)
    for name in ("server", "core"):
        p = res["processes"][name]
        assert p["pid"] == pids[name]
        assert 0 < p["start_rss"] <= p["peak_rss"] and 0 < p["end_rss"] <= p["peak_rss"]
        assert isinstance(p["slope_b_per_request"], float)
        assert isinstance(p["anon_slope_b_per_request"], float)
    assert res["second_half"]["samples"] == 6  # 50, 60, ..., 100
    assert res["requests_per_s"] > 0
    assert_stamped(res)
    table = soak.summary(res)
    assert "server" in table and "core" in table and f"{n} requests" in table


def test_server_tracer_reports_growth_since_its_baseline(monkeypatch: pytest.MonkeyPatch) -> None:
    import tracemalloc

    from fastapi import FastAPI

    from stopline.server import memtrace

    monkeypatch.delenv(memtrace.ENV, raising=False)
    app = FastAPI()
    memtrace.install(app)
    assert not any(getattr(r, "path", "") == "/debug/tracemalloc" for r in app.routes)
    was_tracing = tracemalloc.is_tracing()
    monkeypatch.setenv(memtrace.ENV, "1")
    try:
        memtrace.install(app)
        assert any(getattr(r, "path", "") == "/debug/tracemalloc" for r in app.routes)
        tracer = memtrace.Tracer(1)
        assert tracer.growth()["top"] == []  # the first call is the baseline
        held = [bytearray(1000) for _ in range(1000)]
        top = tracer.growth()["top"]
        assert top[0]["size_diff"] >= 1_000_000 and top[0]["count_diff"] >= 1000
        assert top[0]["traceback"][-1].startswith(__file__)
        del held
    finally:
        if not was_tracing:
            tracemalloc.stop()


@pytest.mark.timeout(300)
def test_traced_soak_reports_the_core_growth_too(tiny_model_dir: Path, tmp_path: Path) -> None:
    """--tracemalloc traces the engine-core process as well as the server (issue 47 item 4):
    each answers for itself, and the result lists the top growth sites per process."""
    n = 40
    res = soak.run(model=str(tiny_model_dir), requests=n, concurrency=8, max_tokens=6, port=None,
                   sample_every=10, kv_cache_gb=0.05, seed=2, log_path=tmp_path / "soak.log",
                   tracemalloc=3, progress=False, command="pytest")
    json.dumps(res)
    assert res["requests_done"] == n and "error" not in res["outcomes"]
    traced = res["tracemalloc"]
    assert set(traced) == {"server", "core"}
    for name in ("server", "core"):
        t = traced[name]
        assert "error" not in t, t
        assert t["pid"] == res["pids"][name]  # the process itself answered
        assert t["traced_bytes"] > 0 and t["top"], t
        for site in t["top"]:
            assert 1 <= len(site["traceback"]) <= 3 and ":" in site["traceback"][-1], site
    assert any("/stopline/" in f for s in traced["core"]["top"] for f in s["traceback"])
    table = soak.summary(res)
    assert "core allocations grown" in table and "server allocations grown" in table


def test_tracemalloc_route_refuses_an_unknown_process(monkeypatch: pytest.MonkeyPatch) -> None:
    import tracemalloc

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from stopline.server import errors, memtrace

    was_tracing = tracemalloc.is_tracing()
    monkeypatch.setenv(memtrace.ENV, "1")
    try:
        app = FastAPI()
        errors.install(app)
        memtrace.install(app)
        with TestClient(app) as client:
            r = client.get("/debug/tracemalloc", params={"process": "gpu"})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "process" and "server, core" in r.json()["error"]["message"]
            assert client.get("/debug/tracemalloc").json()["top"] == []  # the server's baseline
    finally:
        if not was_tracing:
            tracemalloc.stop()


def test_an_engine_process_answers_its_growth_only_when_traced(monkeypatch: pytest.MonkeyPatch) -> None:
    from stopline.engine import memtrace

    monkeypatch.setattr(memtrace, "_process", None)
    monkeypatch.delenv(memtrace.ENV, raising=False)
    assert not memtrace.start_from_env()
    got = memtrace.growth()
    assert got["pid"] == os.getpid() and memtrace.ENV in got["error"]


def test_the_bound_per_request_is_a_setting() -> None:
    """--limit-b: the same growth (150 B a request, in both RSS figures) passes the default 1 KiB
    bound and fails issue 47's 0.1 KiB."""
    rows = [[n, n / 10, 10**8 + 150 * n, 10**9 + 150 * n, 10**8 + 150 * n, 10**9 + 150 * n]
            for n in range(0, 10_001, 500)]

    def judged(limit: float) -> dict:
        res = {"samples": rows, "requests_done": 10_000, "end_idle": rows[-1], "stopped": None,
               "pids": {"server": 1, "core": 2}, "peak_rss": {"server": 0, "core": 0},
               "limit_b_per_request": limit}
        soak._judge(res)
        return res

    assert judged(soak.LIMIT_B_PER_REQUEST)["pass"]
    low = judged(102)
    assert not low["pass"] and low["processes"]["core"]["anon_slope_b_per_request"] == pytest.approx(150)
    shown = soak.summary(low | {"requests_per_s": 1, "elapsed_s": 1, "outcomes": {}, "stalls": [],
                                "config": {"concurrency": 16}})
    assert "limit 102 B/request: FAIL" in shown
