"""A description of the machine and software, for results files and figures: every results
file a benchmark writes carries `stamp()`, so a figure can be traced to its host and commit."""

from __future__ import annotations

import os
import platform
import subprocess
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# The CPU flags stopline's kernels pick their code paths by (stopline/model/kernels: native.py,
# int8_linear.py, bf16_linear.py): the same CPU model name can hide a VM that masks some.
KERNEL_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512vl", "f16c", "avx512_bf16", "avx512_vnni",
                "amx_tile", "amx_bf16")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def isa_flags() -> list[str]:
    """Those of KERNEL_FLAGS this CPU reports (in KERNEL_FLAGS' order); [] where unreadable."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in KERNEL_FLAGS if f in have]
    except OSError:
        pass
    return []


def memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def git_rev(repo: Path = REPO) -> str | None:
    try:
        rev = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def amx_granted() -> bool | None:
    """Whether the OS grants this process AMX tile state (None: the CPU reports no AMX). Hosts
    differ here under the same CPU flags: a guest may advertise AMX and refuse its tiles."""
    if "amx_tile" not in isa_flags():
        return None
    from stopline.model.kernels import native

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # amx_ready's warning names the refusal
        return native.amx_ready()


def describe() -> dict[str, object]:
    mem = memory_gib()
    cores = os.cpu_count()
    amx = amx_granted()
    host = f"{cpu_model()}, {cores} cores" + ("" if amx is None else ", AMX granted" if amx else
                                             ", AMX advertised but not granted")
    return {
        "cpu": cpu_model(), "cores": cores, "memory_gib": round(mem, 1) if mem else None,
        "isa": isa_flags(), "amx_granted": amx,
        "os": platform.platform(), "python": platform.python_version(),
        "summary": f"{host}, {mem:.0f} GiB RAM, {platform.system()}" if mem else host,
    }


def stamp() -> dict[str, object]:
    """What every benchmark's results file records of where it ran: {"machine": describe(),
    "git": the commit (+dirty), or None outside a checkout}."""
    return {"machine": describe(), "git": git_rev()}


def summary(machine: object) -> str:
    """A results file's machine in one line: describe()'s summary, or the string older files hold."""
    return machine["summary"] if isinstance(machine, dict) else str(machine)
