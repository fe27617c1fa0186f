"""stopline.bench.llama_bench: llama-bench's JSON read right, and clear errors without it.
A stand-in binary prints what llama-bench prints (its `-o json` shape)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from stopline.bench import llama_bench

RUNS = [
    {"build_commit": "abc1234", "build_number": 6000, "n_threads": 2, "n_prompt": 512, "n_gen": 0,
     "avg_ts": 269.4, "stddev_ts": 3.1},
    {"build_commit": "abc1234", "build_number": 6000, "n_threads": 2, "n_prompt": 0, "n_gen": 128,
     "avg_ts": 130.2, "stddev_ts": 0.8},
]


def _fake(tmp_path: Path, body: str) -> Path:
    exe = tmp_path / "llama-bench"
    exe.write_text("#!/bin/sh\n" + body)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return exe


def test_reads_pp512_and_tg128(tmp_path):
    args = tmp_path / "args"
    exe = _fake(tmp_path, f"echo \"$@\" > {args}\ncat <<'EOF'\n{json.dumps(RUNS)}\nEOF\n")
    got = llama_bench.run("/m.gguf", 2, reps=2, binary=exe)
    assert (got.pp512, got.tg128, got.threads) == (269.4, 130.2, 2)
    assert args.read_text().split() == ["-m", "/m.gguf", "-p", "512", "-n", "128", "-t", "2",
                                        "-r", "2", "-o", "json"]
    assert got.row()["tg128_tok_s"] == 130.2


def test_failures_name_the_problem(tmp_path, monkeypatch):
    with pytest.raises(RuntimeError, match="exited with 3: no model"):
        llama_bench.run("/m.gguf", 2, binary=_fake(tmp_path, "echo no model >&2; exit 3\n"))
    with pytest.raises(ValueError, match="no pp512"):
        llama_bench.parse(json.dumps(RUNS[1:]))
    monkeypatch.setenv("STOPLINE_PEERS_DIR", str(tmp_path / "none"))
    monkeypatch.delenv(llama_bench.ENV_BINARY, raising=False)
    with pytest.raises(FileNotFoundError, match="setup_llamacpp.sh"):
        llama_bench.run("/m.gguf", 2)


def test_ik_llama_bench_repacks_and_a_dead_build_is_named(tmp_path, monkeypatch):
    bin_dir = tmp_path / "peers" / "ik_llama.cpp" / "build" / "bin"
    bin_dir.mkdir(parents=True)
    args = tmp_path / "args"
    exe = _fake(bin_dir, f"echo \"$@\" > {args}\ncat <<'EOF'\n{json.dumps(RUNS)}\nEOF\n")
    monkeypatch.setenv("STOPLINE_PEERS_DIR", str(tmp_path / "peers"))
    monkeypatch.setenv(llama_bench.ENV_BINARY, str(tmp_path / "not-this-one"))  # llama.cpp's only
    assert llama_bench.find_binary("ik_llama.cpp") == exe
    assert llama_bench.find_binary() == tmp_path / "not-this-one"
    llama_bench.run("/m.gguf", 2, reps=1, build="ik_llama.cpp")
    assert args.read_text().split()[-4:] == ["-rtr", "1", "-o", "json"]
    # A native build using AMX tiles the host does not grant dies of SIGILL at its first prompt.
    with pytest.raises(RuntimeError, match="died of SIGILL: an instruction this host does not grant"):
        llama_bench.run("/m.gguf", 2, binary=_fake(tmp_path, "kill -ILL $$\n"))
    assert llama_bench.died(3) == "exited with 3"
    assert llama_bench.died(-9) == "died of SIGKILL"
