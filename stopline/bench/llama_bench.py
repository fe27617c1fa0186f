"""llama.cpp's own `llama-bench` on the same GGUF: the raw decode (tg128) and prefill (pp512)
rates that the floors report compares stopline with, measured in the same run.

llama-bench is not a dependency: `bash bench/peers/setup_llamacpp.sh` builds it beside
llama-server (under `$STOPLINE_PEERS_DIR`, default /work/peers); `STOPLINE_LLAMA_BENCH` names
another binary. `setup_ikllamacpp.sh` builds ik_llama.cpp's, which runs with its weights
repacked at load (`-rtr 1`), as its server does. Where there is none, the rows say so and
nothing else changes.

A build that dies on a signal is named by it: SIGILL is llama.cpp's native build using AMX tiles
on a host that advertises AMX but does not grant the tile state.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

ENV_BINARY = "STOPLINE_LLAMA_BENCH"
# build -> (its folder under the peers dir, llama-bench's extra flags, the script that builds it)
BUILDS = {"llama.cpp": ("llama.cpp", [], "setup_llamacpp.sh"),
          "ik_llama.cpp": ("ik_llama.cpp", ["-rtr", "1"], "setup_ikllamacpp.sh")}


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


def find_binary(build: str = "llama.cpp") -> Path | None:
    named = os.environ.get(ENV_BINARY)
    if named and build == "llama.cpp":
        return Path(named)
    peers = Path(os.environ.get("STOPLINE_PEERS_DIR", "/work/peers"))
    path = peers / BUILDS[build][0] / "build" / "bin" / "llama-bench"
    return path if path.is_file() and os.access(path, os.X_OK) else None


def died(returncode: int) -> str:
    """How a peer process ended, in words (a negative code is the signal that killed it)."""
    if returncode >= 0:
        return f"exited with {returncode}"
    sig = -returncode
    name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
    why = (": an instruction this host does not grant (e.g. AMX tiles advertised but not granted); "
           "build without it" if sig == signal.SIGILL else "")
    return f"died of {name}{why}"


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
        timeout_s: float = 900.0, build: str = "llama.cpp") -> LlamaBench:
    """Run `build`'s llama-bench pp512 and tg128 on `model` with `threads` threads. Raises
    FileNotFoundError where there is no binary, RuntimeError where it fails."""
    folder, extra, script = BUILDS[build]
    exe = binary or find_binary(build)
    if exe is None:
        raise FileNotFoundError(f"{build}'s llama-bench not found: run bench/peers/{script}"
                                + (f" or set {ENV_BINARY}" if build == "llama.cpp" else ""))
    cmd = [str(exe), "-m", str(model), "-p", "512", "-n", "128", "-t", str(threads),
           "-r", str(reps), *extra, "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench {died(done.returncode)}: {done.stderr.strip()[-500:]}")
    pp, tg, used, build = parse(done.stdout)
    return LlamaBench(pp, tg, used or threads, build)
