"""bench/chaos_soak.py: the CI storm over fresh seeds (run briefly here so it cannot rot)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "chaos_soak.py"


@pytest.fixture
def soak():
    spec = importlib.util.spec_from_file_location("chaos_soak", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(soak, monkeypatch, *argv: str) -> int:
    monkeypatch.setattr(sys, "argv", ["chaos_soak.py", *argv])
    return soak.main()


def test_storms_pass_and_are_counted(soak, monkeypatch, capsys) -> None:
    assert run(soak, monkeypatch, "--storms", "2", "--count", "40", "--wide") == 0
    out = capsys.readouterr().out
    assert "seed 1000 recompute (torch attention): ok" in out  # --wide: the decode rows
    assert "seed 1001 swap (torch attention): ok" in out
    # 40 jobs a storm, plus the resubmits of those whose cancel races their end
    found = re.search(r"2 storms, (\d+) requests, 0 failed", out)
    assert found and int(found.group(1)) >= 80, out


def test_storms_run_on_the_attention_asked_for(soak, monkeypatch, capsys) -> None:
    from stopline.model.kernels.native import try_kernels

    if try_kernels() is None:
        pytest.skip("stopline's C kernels are not built here")
    assert run(soak, monkeypatch, "--storms", "1", "--count", "40", "--attention", "native") == 0
    assert "seed 1000 recompute (native attention): ok" in capsys.readouterr().out


def test_a_failed_storm_is_reported_with_its_replay_command(soak, monkeypatch, capsys) -> None:
    def broken(*_args):
        raise AssertionError("r3[0]: survivor differs from its undisturbed run")

    monkeypatch.setattr(soak, "check_storm", broken)
    assert run(soak, monkeypatch, "--storms", "1", "--count", "30", "--seed", "42",
               "--mode", "auto-async") == 1
    captured = capsys.readouterr()
    assert "survivor differs" in captured.err
    assert ("replay with: python bench/chaos_soak.py --seed 42 --storms 1 --count 30 "
            "--mode auto-async --attention auto") in captured.out


def test_bad_arguments_are_refused(soak, monkeypatch) -> None:
    with pytest.raises(SystemExit) as e:
        run(soak, monkeypatch, "--count", "0")
    assert e.value.code == 2


def test_quant_storms_run_on_the_kernel_and_replay_with_the_flag(soak, monkeypatch, capsys) -> None:
    from stopline.model.kernels.native import try_kernels

    if try_kernels() is None:
        pytest.skip("stopline's C kernels are not built here")
    assert run(soak, monkeypatch, "--storms", "1", "--count", "40", "--quant") == 0
    assert re.search(r"1 storms, (4\d) requests, 0 failed", capsys.readouterr().out)
    def broken(*_args):
        raise AssertionError("r1[0]: survivor differs from its undisturbed run")

    monkeypatch.setattr(soak, "check_storm", broken)
    assert run(soak, monkeypatch, "--storms", "1", "--count", "20", "--seed", "7", "--quant") == 1
    assert "--seed 7 --storms 1 --count 20 --mode auto-async --quant" in capsys.readouterr().out
