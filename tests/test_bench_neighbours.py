"""`stopline bench neighbours` on the tiny model: both phases timed, the neighbour gone after."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stopline.cli import main
from tests.bench_support import assert_stamped
from tests.engine_support import sharp_tiny_dir


def _neighbours_running() -> int:
    n = 0
    for cmd in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            n += b"busy, idle = float" in cmd.read_bytes()
        except OSError:
            continue
    return n


def test_neighbours_times_both_phases(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, capsys) -> None:
    model = sharp_tiny_dir(tmp_path_factory)
    out = tmp_path / "n.json"
    rc = main(["bench", "neighbours", "--model", str(model), "--streams", "2", "--rounds", "2", "--steps", "3",
               "--settle", "1", "--settle-s", "0", "--warm", "1", "--num-blocks", "64", "--out", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["steps_each"] == 6 and r["quiet_p50_ms"] > 0 and r["neighbour_p50_ms"] > 0
    assert r["slowdown"] == pytest.approx(r["neighbour_p50_ms"] / r["quiet_p50_ms"])
    assert r["neighbour_cores"] == pytest.approx(0.5) and r["threads"] >= 1
    assert set(r["moved_steps"]) == {"quiet", "neighbour"}
    assert_stamped(r)
    assert _neighbours_running() == 0
    assert "slowdown" in capsys.readouterr().out


def test_neighbours_phases_open_for_the_settle_seconds(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A phase is timed only after --settle-s seconds of untimed steps, however fast a step is:
    the thread choice's window then holds the phase alone."""
    model = sharp_tiny_dir(tmp_path_factory)
    out = tmp_path / "n.json"
    rc = main(["bench", "neighbours", "--model", str(model), "--streams", "1", "--rounds", "1", "--steps", "2",
               "--settle", "1", "--settle-s", "0.1", "--warm", "1", "--num-blocks", "256", "--out", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["settle_s"] == 0.1 and len(r["settles"]) == 2
    assert all(p["s"] >= 0.1 and p["steps"] > 1 for p in r["settles"]), r["settles"]
    assert _neighbours_running() == 0


def test_neighbours_stops_at_the_context_end(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Phases longer than the context can hold end with a clear error, not a timing of nothing."""
    model = sharp_tiny_dir(tmp_path_factory)
    with pytest.raises(SystemExit, match="context's end"):
        main(["bench", "neighbours", "--model", str(model), "--streams", "1", "--rounds", "2", "--steps", "2",
              "--settle", "600", "--settle-s", "0", "--warm", "1", "--num-blocks", "256",
              "--out", str(tmp_path / "n.json")])
    assert _neighbours_running() == 0


def test_neighbours_refuses_bad_phases(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="busy-ms"):
        main(["bench", "neighbours", "--busy-ms", "0", "--out", str(tmp_path / "n.json")])
    with pytest.raises(SystemExit, match="settle-s"):
        main(["bench", "neighbours", "--settle-s", "-1", "--out", str(tmp_path / "n.json")])
