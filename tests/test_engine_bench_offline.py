"""`stopline bench offline` end to end on the tiny model (a smoke test: seconds, not a benchmark)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stopline.cli import main
from tests.bench_support import assert_stamped
from tests.engine_support import sharp_tiny_dir


def test_bench_offline_writes_results(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path,
                                      capsys) -> None:
    model = sharp_tiny_dir(tmp_path_factory)
    out = tmp_path / "offline.json"
    rc = main(["bench", "offline", "--model", str(model), "--hf-dir", str(model), "--streams", "3",
               "--max-tokens", "6", "--num-blocks", "128", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    for side in ("stopline", "hf"):
        assert set(res["results"][side]) == {"1", "3"}
        for key, n in (("1", 1), ("3", 3)):
            r = res["results"][side][key]
            assert r["output_tokens"] == 6 * n and r["tok_s"] > 0
    assert set(res["speedup_vs_hf"]) == {"1", "3"}
    # Same weights, greedy: the two sides agree on every sequence of a sharp tiny model.
    assert res["greedy_sequences_equal_to_hf"] == {"1": "1/1", "3": "3/3"}
    assert res["command"].startswith("stopline bench offline")
    assert_stamped(res)
    assert "ratio" in capsys.readouterr().out
