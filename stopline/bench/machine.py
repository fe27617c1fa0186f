"""A one-line description of the machine and software, for results files and figures."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def git_rev(repo: Path) -> str | None:
    try:
        rev = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def describe() -> dict[str, object]:
    mem = memory_gib()
    cores = os.cpu_count()
    return {
        "cpu": cpu_model(), "cores": cores, "memory_gib": round(mem, 1) if mem else None,
        "os": platform.platform(), "python": platform.python_version(),
        "summary": f"{cpu_model()}, {cores} cores, {mem:.0f} GiB RAM, {platform.system()}"
                   if mem else f"{cpu_model()}, {cores} cores",
    }
