"""`stopline bench floors` runs on the tiny model and its numbers are positive and consistent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stopline.cli import main
from stopline.model.kernels.native import has_bf16, try_kernels
from tests.engine_support import sharp_tiny_dir


def test_floors_on_tiny_model(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, capsys) -> None:
    model = sharp_tiny_dir(tmp_path_factory)
    out = tmp_path / "floors.json"
    fast = has_bf16() and try_kernels() is not None
    texts = tmp_path / "texts.txt"
    texts.write_text("the cat sat on the mat and looked at the dog\n\nfour five six seven eight nine ten\n")
    rc = main(["bench", "floors", "--model", str(model), "--streams", "1", "4", "--buffer-mib", "64",
               "--reps", "2", "--warm", "2", "--steps", "4", "--num-blocks", "256", "--out", str(out),
               "--texts", str(texts)] + (["--accuracy"] if fast else ["--modes", "exact"]))
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["read_bandwidth_gbs"] > 0 and all(v > 0 for v in r["gemm_gflops_32_rows"].values())
    assert {(s["streams"], s["mode"]) for s in r["steps"]} >= {(1, "exact"), (4, "exact")}
    for s in r["steps"]:
        assert s["weight_bytes"] > 0 and s["kv_bytes"] > 0
        # The floor is a lower bound the measured step cannot beat by much (timer noise).
        assert 0 < s["floor_ms"] <= s["min_ms"] * 1.1 and s["min_ms"] <= s["p50_ms"]
        assert s["x_floor"] > 0.9
    kv = {s["streams"]: s["kv_bytes"] for s in r["steps"] if s["mode"] == "exact"}
    assert kv[4] > kv[1]  # four streams read more KV than one
    if fast:
        a = r["accuracy"]
        assert a["tokens"] > 10 and 0 <= a["top1_agreement"] <= 1 and a["ppl_ratio"] > 0
    assert "read bandwidth" in capsys.readouterr().out
