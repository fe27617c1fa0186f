"""`stopline bench marathon` (issue 47): its schedule, log scanner and judge by hand, and a
short marathon end to end on the tiny model: 3 minutes of load with client cancels, one pause
(SIGSTOP) and one kill (SIGKILL, the core restarted) of the engine core. The canaries must come
back exact and the log clean; recovery bounds are generous (a busy 2-core box), the run's own
criteria are printed by the benchmark, not asserted here.

Select it alone with `pytest -m marathon`, leave it out with `-m 'not marathon'`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from stopline.bench import marathon
from tests.bench_support import assert_stamped


def test_schedule_spreads_faults_and_ends_on_a_pause() -> None:
    faults = marathon.schedule(3, 1, 1)
    assert [f.kind for f in faults] == ["kill", "pause"]
    assert 27 <= faults[0].at_s < faults[1].at_s <= 180 - 45
    faults = marathon.schedule(30, 30, 6)
    assert [f.kind for f in faults].count("kill") == 6 and faults[-1].kind == "pause"
    ts = [f.at_s for f in faults]
    assert ts == sorted(ts) and ts[0] >= 0.15 * 1800 and ts[-1] <= 0.75 * 1800
    assert marathon.schedule(5, 0, 0) == []
    with pytest.raises(ValueError, match="no room"):
        marathon.schedule(0.5, 1, 0)


def test_log_scan_finds_each_hard_zero_line() -> None:
    log = "\n".join([
        "INFO fine", "Traceback (most recent call last):", '  File "x.py", line 1', "ValueError: no",
        "ERROR stopline.engine: ownership audit failed at step 3: block 7: refcount 0 but not in "
        "the free queue (leak)", "block 9 released twice", "WARNING the engine core answers again"])
    scan = marathon.scan_log(log)
    assert scan["counts"] == {"traceback": 1, "audit failure": 1, "leak": 1, "double release": 1}
    assert not scan["clean"] and "ValueError: no" in scan["tracebacks"][0]
    # resource_tracker's words at exit count too
    assert marathon.scan_log("UserWarning: 1 leaked semaphore objects")["counts"]["leak"] == 1
    assert marathon.scan_log("ok\n")["clean"]


def _result(canaries: list[dict], faults: list[dict] | None = None) -> dict:
    fault = {"start_s": 10.0, "recovered_s": 20.0, "recovery_s": 4.0, "error": None}
    idle = {"kv_used": 0, "kv_total": 100}
    return {"canaries": canaries, "faults": [fault] if faults is None else faults,
            "final_canaries": {"exact": 5, "of": 5}, "idle_before": idle, "idle_after": idle,
            "log_scan": {"counts": {}, "clean": True}, "server": {"audit_failures": 0}}


def test_judge_counts_canary_errors_outside_fault_windows_and_wrong_tokens_everywhere() -> None:
    ok = [{"t": float(t), "s": 0.1, "result": "exact"} for t in range(0, 200, 2)]
    refused = [{"t": 9.5, "s": 1.0, "result": "error:503"},  # sent before, answered inside
               {"t": 15.0, "s": 0.1, "result": "error:503"}]
    checks = marathon.judge(_result(ok + refused))
    assert all(c["pass"] for c in checks.values()), checks
    late = marathon.judge(_result(ok + [{"t": 30.0, "s": 0.1, "result": "error:503"}]))
    assert not late["canary errors outside fault windows"]["pass"]
    wrong = marathon.judge(_result(ok + [{"t": 15.0, "s": 0.1, "result": "wrong"}]))
    assert not wrong["canary errors outside fault windows"]["pass"]
    slow = marathon.judge(_result(ok, [{"start_s": 10.0, "recovered_s": 50.0, "recovery_s": 35.0,
                                         "error": None}]))
    assert not slow["recovery after each fault"]["pass"]
    never = marathon.judge(_result(ok, [{"start_s": 10.0, "recovered_s": None, "recovery_s": None,
                                          "error": None}]))
    assert not never["recovery after each fault"]["pass"]


@pytest.mark.marathon
@pytest.mark.timeout(600)
def test_short_marathon_a_pause_and_kills_answered_by_the_standby(tiny_long_model_dir: Path,
                                                                  tmp_path: Path) -> None:
    """One fault of each kind with --standby-core: each kill of the core is answered by
    promoting the spare (by_standby), the pause turns /health stuck. Timings are the
    benchmark's criteria, not asserted here (a fresh core's reload: tests/test_core_restart.py)."""
    p = argparse.ArgumentParser()
    marathon.configure(p)
    args = p.parse_args(["--minutes", "3", "--pauses", "1", "--kills", "2", "--no-progress",
                         "--model", str(tiny_long_model_dir), "--concurrency", "4",
                         "--standby-core", "--recovery-limit-s", "150",
                         "--serve-args", "--block-size 4 --num-blocks 4096"])
    res = marathon.run(args, tmp_path / "marathon.log", command="pytest")
    (tmp_path / "marathon.json").write_text(json.dumps(res, default=str))  # JSON-clean
    report = marathon.summary(res)
    assert_stamped(res)
    assert "--standby-core" in res["serve_args"] and "standby" in res["config"]["mode"]
    # Every fault ran, on the core, and it came back from each: each kill by the spare.
    pauses, kills = ([f for f in res["faults"] if f["kind"] == k] for k in ("pause", "kill"))
    assert len(pauses) == 1 and len(kills) == 2, report
    for f in pauses + kills:
        assert f["target"] == "core" and f["error"] is None, report
        assert f["recovery_s"] is not None and f["recovery_s"] < 120, report  # generous: a busy box
    assert pauses[0]["marked_stuck_s"] is not None, report  # /health said stuck while it was stopped
    assert all(f["by_standby"] is True for f in kills), report  # the spare took over: no fresh load
    assert "the standby took over" in report
    # The canaries: never a wrong token; every one exact again after the last fault.
    assert not [c for c in res["canaries"] if c["result"] == "wrong"], report
    assert res["final_canaries"]["exact"] == 5, report
    assert res["criteria"]["canary errors outside fault windows"]["pass"], report
    # A clean log: no traceback, no audit failure, no leak, no double release.
    assert res["log_scan"]["clean"], report + "\n" + "\n\n".join(res["log_scan"]["tracebacks"])
    srv = res["server"]
    assert srv["audits"] > 0 and srv["audit_failures"] == 0, report
    assert res["criteria"]["pool use growth (idle after - idle before)"]["pass"], report
    # Load of every kind was served, and some was cancelled by its client.
    served = {k for k, per in res["outcomes"].items() if any(o.startswith("served") for o in per)}
    assert served == set(marathon.KINDS), report
    assert sum(per.get("cancelled by the client", 0) for per in res["outcomes"].values()) > 0, \
        (res["outcomes"], res["served_s_median"])
    assert srv["aborts"] > 0 and srv["aborts_by_source_last_process"].get("disconnect", 0) > 0, report
    assert {"server", "core", "core-standby"} <= set(res["rss"]), report
    assert len(res["samples"]) > 30 and all(s["kv_total"] for s in res["samples"][:5])


def test_standby_core_is_refused_beside_replicas_and_the_split(tmp_path: Path) -> None:
    p = argparse.ArgumentParser()
    marathon.configure(p)
    for mode in (["--replicas", "2"], ["--disagg"]):
        args = p.parse_args(["--minutes", "2", "--standby-core", *mode])
        with pytest.raises(SystemExit, match="--standby-core is for one engine core"):
            marathon.run(args, tmp_path / "marathon.log")
