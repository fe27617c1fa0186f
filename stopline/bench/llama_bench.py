"""llama.cpp's own `llama-bench` on the same GGUF: the raw decode (tg128) and prefill (pp512)
rates that the floors report compares stopline with, measured in the same run.

llama-bench is not a dependency: `bash bench/peers/setup_llamacpp.sh` builds it beside
llama-server (under `$STOPLINE_PEERS_DIR`, default /work/peers); `STOPLINE_LLAMA_BENCH` names
another binary. Where there is none, the rows say so and nothing else changes.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

ENV_BINARY = "STOPLINE_LLAMA_BENCH"


@dataclass(frozen=True)
class LlamaBench:
    """Tokens per second (llama-bench's mean over its repetitions) and what produced them."""

    pp512: float
    tg128: float
    threads: int
    build: str

    def row(self) -> dict[str, float | int | str]:
        return {"pp512_tok_s": round(self.pp512, 1), "tg128_tok_s": round(self.tg128, 1),
                "threads": self.threads, "build": self.build}


def find_binary() -> Path | None:
    named = os.environ.get(ENV_BINARY)
    if named:
        return Path(named)
    peers = Path(os.environ.get("STOPLINE_PEERS_DIR", "/work/peers"))
    path = peers / "llama.cpp" / "build" / "bin" / "llama-bench"
    return path if path.is_file() and os.access(path, os.X_OK) else None


def parse(text: str) -> tuple[float, float, int, str]:
    """(pp512, tg128, threads, build) from `llama-bench -o json` output."""
    runs = json.loads(text)
    pp = [r for r in runs if r.get("n_prompt") == 512 and not r.get("n_gen")]
    tg = [r for r in runs if r.get("n_gen") == 128 and not r.get("n_prompt")]
    if not pp or not tg:
        raise ValueError("llama-bench printed no pp512 and tg128 results")
    build = f"{tg[0].get('build_commit', '?')} ({tg[0].get('build_number', '?')})"
    return float(pp[0]["avg_ts"]), float(tg[0]["avg_ts"]), int(tg[0].get("n_threads", 0)), build


def run(model: str | Path, threads: int, *, reps: int = 3, binary: Path | None = None,
        timeout_s: float = 900.0) -> LlamaBench:
    """Run llama-bench's pp512 and tg128 on `model` with `threads` threads. Raises
    FileNotFoundError where there is no binary, RuntimeError where it fails."""
    exe = binary or find_binary()
    if exe is None:
        raise FileNotFoundError("llama-bench not found: run bench/peers/setup_llamacpp.sh "
                                f"or set {ENV_BINARY}")
    cmd = [str(exe), "-m", str(model), "-p", "512", "-n", "128", "-t", str(threads),
           "-r", str(reps), "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench exited with {done.returncode}: {done.stderr.strip()[-500:]}")
    pp, tg, used, build = parse(done.stdout)
    return LlamaBench(pp, tg, used or threads, build)
