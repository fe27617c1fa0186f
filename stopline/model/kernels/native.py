"""Build and load stopline's C kernels (`stopline/model/kernels/csrc/*.c`, one shared object) with the
system C compiler.

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
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

log = logging.getLogger("stopline.native")

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = sorted(_CSRC.glob("*.c"))
_HEADERS = sorted(_CSRC.glob("*.h"))
# fp-contract=off: a * b + c stays two roundings unless a kernel asks for an FMA by name.
_FLAGS = ["-O3", "-mavx512f", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
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
    digest = hashlib.sha256(version.encode() + " ".join(_FLAGS).encode())
    for src in _SOURCES + _HEADERS:
        digest.update(src.name.encode() + b"\0" + src.read_bytes())
    lib = out_dir / f"stopline_kernels-{digest.hexdigest()[:16]}.so"
    if lib.is_file():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    log.info("building stopline's C kernels into %s (once; about 2 s)", lib)
    fd, tmp = tempfile.mkstemp(prefix=lib.name + ".", suffix=".tmp", dir=out_dir)
    os.close(fd)
    try:
        done = subprocess.run([cc, *_FLAGS, *map(str, _SOURCES), "-o", tmp, "-lm"], capture_output=True,
                              text=True, timeout=300)
        if done.returncode != 0:
            raise NativeUnavailable(f"{cc} failed to build the kernels: {done.stderr.strip()[-800:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


_outcome: ctypes.CDLL | NativeUnavailable | None = None
_lock = threading.Lock()


def kernels() -> ctypes.CDLL:
    """The loaded kernels library; NativeUnavailable says why it cannot be had. The outcome,
    either one, is kept: ops call this on every use."""
    global _outcome
    if _outcome is None:
        with _lock:
            if _outcome is None:
                try:
                    _outcome = _load()
                except NativeUnavailable as e:
                    _outcome = e.with_traceback(None)  # keeps the reason, not the caller's frames
    if isinstance(_outcome, NativeUnavailable):
        # A fresh exception each time: raising the kept one again would chain every caller's
        # frames onto its traceback, and keep them (and all they reference: engines, logits)
        # alive for the life of the process.
        raise NativeUnavailable(str(_outcome)) from None
    return _outcome


def reset() -> None:
    """Forget the outcome, so the next call tries again (tests, or after changing the env),
    and warns again if it fails."""
    global _outcome
    with _lock:
        _outcome = None
        _warn_once.cache_clear()
        amx_ready.cache_clear()


def _load() -> ctypes.CDLL:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        raise NativeUnavailable(f"turned off by {ENV_SWITCH}=0")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise NativeUnavailable(f"the kernels are written for x86-64 (this is {platform.machine()})")
    missing = [f for f in _CPU_FLAGS if f not in _cpu_flags()]
    if missing:
        raise NativeUnavailable(f"this CPU lacks {', '.join(missing)}")
    import torch  # noqa: F401  (its libgomp must be loaded first; see the module docstring)

    from stopline.model.loaders.weights_cache import default_cache_dir

    try:
        lib = ctypes.CDLL(str(_build(_compiler(), default_cache_dir() / "native")))
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeUnavailable(f"could not build or load the kernels: {e}") from e
    for fn in (lib.stopline_q4_1_gemm, lib.stopline_q8_0_gemm, lib.stopline_q4_k_gemm, lib.stopline_q6_k_gemm):
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        fn.restype = None
    lib.stopline_rms_norm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                      ctypes.c_int, ctypes.c_int, ctypes.c_float]
    lib.stopline_rms_norm.restype = None
    c_long, c_int, ptr = ctypes.c_long, ctypes.c_int, ctypes.c_void_p
    lib.stopline_add_rms_norm.argtypes = [ptr, ptr, ptr, ptr, c_int, c_int, ctypes.c_float]
    lib.stopline_add_rms_norm.restype = None
    lib.stopline_rope_store.argtypes = [ptr, c_int, c_int, c_int, c_int, ptr, ptr, ptr, ptr, ptr, ptr,
                                        c_long, ptr]
    lib.stopline_rope_store.restype = None
    lib.stopline_rope_store_q8.argtypes = [ptr, c_int, c_int, c_int, c_int, ptr, ptr, ptr, ptr, ptr, ptr,
                                           ptr, ptr, c_long, ptr]
    lib.stopline_rope_store_q8.restype = None
    lib.stopline_silu_mul.argtypes = [ptr, c_int, c_int, ptr]
    lib.stopline_silu_mul.restype = None
    lib.stopline_row_argmax.argtypes = [ptr, c_long, ptr, c_int, c_int, ptr]
    lib.stopline_row_argmax.restype = None
    lib.stopline_rows_ok.argtypes = [ptr, c_long, c_int, c_int, ptr]
    lib.stopline_rows_ok.restype = None
    lib.stopline_sample_rows.argtypes = [ptr, c_long, ptr, ptr, ptr, c_int, c_int, ptr]
    lib.stopline_sample_rows.restype = None
    lib.stopline_paged_attention.argtypes = [ptr, c_long, ptr, ptr, ptr, c_int, c_int, c_int, c_int,
                                             c_long, c_int, ptr, ptr, ptr, c_int, ctypes.c_float]
    lib.stopline_paged_attention.restype = c_int
    lib.stopline_paged_attention_window.argtypes = [*lib.stopline_paged_attention.argtypes, c_int]
    lib.stopline_paged_attention_window.restype = c_int
    lib.stopline_paged_attention_q8.argtypes = [ptr, c_long, ptr, ptr, ptr, ptr, ptr, c_int, c_int, c_int,
                                                c_int, c_long, c_int, ptr, ptr, ptr, c_int, ctypes.c_float,
                                                c_int]
    lib.stopline_paged_attention_q8.restype = c_int
    lib.stopline_decoder_layers.argtypes = [ptr, c_int, ptr, ptr, ptr]
    lib.stopline_decoder_layers.restype = c_int
    lib.stopline_bf16_gemm.argtypes = [ptr, ptr, ptr, c_int, c_int, c_int]
    lib.stopline_bf16_gemm.restype = None
    lib.stopline_q4_1_bf16_gemm.argtypes = [ptr, ptr, ptr, c_int, c_int, c_int]
    lib.stopline_q4_1_bf16_gemm.restype = None
    for fn in (lib.stopline_amx_bf16_gemm, lib.stopline_amx_q4_1_gemm, lib.stopline_amx_q8_0_gemm):
        fn.argtypes = [ptr, ptr, ptr, c_int, c_int, c_int]
        fn.restype = None
    lib.stopline_quantize_rows.argtypes = [ptr, c_int, c_int, ptr, ptr, ptr, ptr]
    lib.stopline_quantize_rows.restype = None
    for fn in (lib.stopline_q4_1_i8_gemm, lib.stopline_q8_0_i8_gemm, lib.stopline_q4_k_i8_gemm,
               lib.stopline_q6_k_i8_gemm):
        fn.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, c_int, c_int, c_int]
        fn.restype = None
    lib.stopline_i8_amx.argtypes = [c_int]
    lib.stopline_i8_amx.restype = None
    lib.stopline_i8_split.argtypes = [c_int]
    lib.stopline_i8_split.restype = None
    lib.stopline_lora_rows.argtypes = [ptr, c_long, ptr, c_long, c_int, ptr, ptr, ptr, ptr, ptr,
                                       c_int, c_int, c_int]
    lib.stopline_lora_rows.restype = None
    lib.stopline_amx_init.argtypes = []
    lib.stopline_amx_init.restype = c_int
    lib.stopline_int8_prefetch.argtypes = [c_int]
    lib.stopline_int8_prefetch.restype = c_int
    lib.stopline_int8_prefetch(int8_prefetch())
    return lib


# STOPLINE_INT8_PREFETCH=BYTES sets how far ahead the int8 kernel's 1-3 row panels fetch their
# weight records (0: no prefetch); unset, the CPU's vendor picks it (int8_prefetch).
PREFETCH_SWITCH = "STOPLINE_INT8_PREFETCH"


def _vendor() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        if line.startswith("vendor_id"):
            return line.split(":", 1)[1].strip()
    return ""


def int8_prefetch() -> int:
    """Bytes ahead the int8 kernel's few-row panels prefetch (csrc/int8_few.c). On the Intel
    Xeon host a one-row pass over SmolLM2's layers ran ~10% faster (median) with 2.5-5 KiB
    ahead; on the AMD EPYC (Zen 4) host any prefetch slowed it (csrc/int8_gemm.c): 4096 on
    Intel, 0 elsewhere, unless STOPLINE_INT8_PREFETCH says. Bits never depend on it."""
    value = os.environ.get(PREFETCH_SWITCH)
    if value is not None:
        try:
            return max(0, int(value))
        except ValueError:
            log.warning("%s=%r is not a byte count; ignored", PREFETCH_SWITCH, value)
    return 4096 if _vendor() == "GenuineIntel" else 0


def has_bf16() -> bool:
    """Whether this CPU runs AVX512-BF16 (the fast numerics mode's kernel, csrc/bf16_gemm.c)."""
    return platform.machine().lower() in ("x86_64", "amd64") and "avx512_bf16" in _cpu_flags()


# STOPLINE_AMX=0 keeps the fast mode on the AVX512-BF16 kernel where AMX is present.
AMX_SWITCH = "STOPLINE_AMX"


def has_amx() -> bool:
    """Whether the fast mode's linears run on AMX-BF16 tiles (csrc/amx_gemm.c): STOPLINE_AMX
    is not 0 and amx_ready(). Read when a weight is built, which fixes its kernel for every
    batch: tiles sum in their own order, so all row counts must take the same one."""
    return os.environ.get(AMX_SWITCH, "1") != "0" and amx_ready()


@functools.cache
def amx_ready() -> bool:
    """The CPU has AMX-BF16, the kernels are built and the OS grants the tile state."""
    if not has_bf16() or not {"amx_bf16", "amx_tile"} <= _cpu_flags():
        return False
    try:
        lib = kernels()
    except NativeUnavailable:
        return False
    if lib.stopline_amx_init() != 0:
        warnings.warn("the OS refused AMX tile state (arch_prctl); the fast mode runs the "
                      "AVX512-BF16 kernel", RuntimeWarning, stacklevel=2)
        return False
    return True


def try_kernels() -> ctypes.CDLL | None:
    """kernels(), or None after one warning naming the reason."""
    try:
        return kernels()
    except NativeUnavailable as e:
        _warn_once(str(e))
        return None


@functools.cache
def _warn_once(reason: str) -> None:
    warnings.warn(f"stopline's C kernels are off ({reason}); torch runs every op "
                  f"(the float32 GEMM libraries every batch)", stacklevel=3)
