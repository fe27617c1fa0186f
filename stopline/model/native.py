"""Build and load stopline's C kernels (`stopline/model/csrc/`) with the system C compiler.

The kernels are optional: where there is no compiler, no AVX-512, or the build fails, the
engine runs the same math through torch's GEMM libraries and says why once. The shared
object is built on first use into the user cache dir, keyed by the source, the compiler and
the flags, so an edited kernel or a new compiler rebuilds it; a build is written to a temp
name and renamed, so concurrent starts never load half a file.

It is linked with -fopenmp and so needs `libgomp.so.1`; torch has already loaded its own copy
under that name, and the dynamic linker reuses it, so the kernels share torch's thread pool
rather than starting a second one.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

_SOURCE = Path(__file__).with_name("csrc") / "quant_gemm.c"
_FLAGS = ["-O3", "-mavx512f", "-mf16c", "-fopenmp", "-shared", "-fPIC"]
_CPU_FLAGS = ("avx512f", "f16c")
# STOPLINE_NATIVE=0 turns the kernels off (the torch path is used everywhere).
ENV_SWITCH = "STOPLINE_NATIVE"


class NativeUnavailable(RuntimeError):
    """Why the C kernels cannot run here."""


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _compiler() -> str:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    raise NativeUnavailable("no C compiler (set CC, or install gcc)")


def _build(cc: str, out_dir: Path) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(_SOURCE.read_bytes() + version.encode() + " ".join(_FLAGS).encode()).hexdigest()[:16]
    lib = out_dir / f"quant_gemm-{key}.so"
    if lib.is_file():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=lib.name + ".", suffix=".tmp", dir=out_dir)
    os.close(fd)
    try:
        done = subprocess.run([cc, *_FLAGS, str(_SOURCE), "-o", tmp], capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            raise NativeUnavailable(f"{cc} failed to build {_SOURCE.name}: {done.stderr.strip()[-800:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


@functools.lru_cache(maxsize=1)
def quant_gemm() -> ctypes.CDLL:
    """The loaded quant_gemm library; NativeUnavailable says why it cannot be had."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        raise NativeUnavailable(f"turned off by {ENV_SWITCH}=0")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise NativeUnavailable(f"the kernels are written for x86-64 (this is {platform.machine()})")
    missing = [f for f in _CPU_FLAGS if f not in _cpu_flags()]
    if missing:
        raise NativeUnavailable(f"this CPU lacks {', '.join(missing)}")
    import torch  # noqa: F401  (its libgomp must be loaded first; see the module docstring)

    from stopline.model.weights_cache import default_cache_dir

    try:
        lib = ctypes.CDLL(str(_build(_compiler(), default_cache_dir() / "native")))
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeUnavailable(f"could not build or load the kernels: {e}") from e
    for fn in (lib.stopline_q4_1_gemm, lib.stopline_q8_0_gemm):
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        fn.restype = None
    return lib


def try_quant_gemm() -> ctypes.CDLL | None:
    """quant_gemm(), or None after one warning naming the reason."""
    try:
        return quant_gemm()
    except NativeUnavailable as e:
        _warn_once(str(e))
        return None


@functools.cache
def _warn_once(reason: str) -> None:
    warnings.warn(f"stopline's quantized-weight kernels are off ({reason}); "
                  f"the float32 GEMM libraries run every batch", stacklevel=3)
