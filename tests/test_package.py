"""The package as a user meets it: import side effects and the command line."""

from __future__ import annotations

import os
import subprocess
import sys


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def test_import_chooses_a_short_openmp_spin_unless_set():
    show = "import stopline, os; print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    seen = [subprocess.run([sys.executable, "-c", show], capture_output=True, text=True, timeout=120,
                           env={**env, **extra}).stdout.split()
            for extra in ({}, {"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "5"})]
    assert seen == [["1000", "None"], ["None", "PASSIVE"], ["5", "None"]]


def test_cli_lists_its_commands():
    out = _run("-m", "stopline.cli", "--help")
    assert out.returncode == 0
    for cmd in ("generate", "serve", "bench"):
        assert cmd in out.stdout
    out = _run("-m", "stopline.cli", "bench", "--help")
    for cmd in ("offline", "stop", "serve"):
        assert cmd in out.stdout


def test_cli_generate_rejects_bad_input_clearly(tiny_model_dir):
    out = _run("-m", "stopline.cli", "generate", "hello", "--model", str(tiny_model_dir),
               "--max-tokens", "0", "--raw")
    assert out.returncode == 2
    assert "max_tokens" in out.stderr


def test_cli_generate_streams_text(tiny_model_dir):
    out = _run("-m", "stopline.cli", "generate", "hello", "--model", str(tiny_model_dir),
               "--max-tokens", "5", "--raw")
    assert out.returncode == 0, out.stderr
    assert "5 tokens" in out.stderr and "finish_reason=length" in out.stderr
