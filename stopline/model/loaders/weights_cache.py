"""On-disk cache of dequantized GGUF weights (float32 safetensors, plus the GGML blocks of
the weights the quantized kernel reads, as uint8).

Dequantizing a GGUF and parsing its 50k-entry vocabulary takes seconds; reading back a
safetensors file takes a fraction of that. The cache file holds everything a load needs
(weights, config, tokenizer state) so a hit never opens the GGUF at all.

Validity: the file name is keyed by the GGUF's resolved path, size and mtime plus a format
version, so an edited or replaced GGUF misses. A file is written to a temp name and renamed,
so readers never see a partial file; a file damaged anyway (truncated, garbage, bit flips) fails
the header parse or the CRC32 stored in its metadata and is rebuilt.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
import warnings
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

# Bump when the cached content changes meaning (layout, unpermute, tokenizer state, ...).
FORMAT_VERSION = 3  # 2: the GGML blocks of quantized weights too; 3: Q4_K, Q6_K, Q5_0 (as Q8_0) too

_META_PREFIX = "stopline."


def default_cache_dir() -> Path:
    """STOPLINE_CACHE_DIR if set, else the platform user cache dir for "stopline"."""
    env = os.environ.get("STOPLINE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("stopline"))


def cache_key(source: Path) -> str:
    """Key for a source file: its resolved path, size, mtime and the cache format version."""
    st = source.stat()
    raw = f"{FORMAT_VERSION}\0{source.resolve()}\0{st.st_size}\0{st.st_mtime_ns}"
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def cache_file(source: Path, cache_dir: Path | None = None) -> Path:
    """Where the cache for `source` lives (it may not exist)."""
    d = cache_dir if cache_dir is not None else default_cache_dir()
    # "<stem>--<path hash>-<key>": the path hash lets a rebuilt file replace the stale cache of the
    # same GGUF path without touching caches of same-named files elsewhere.
    path_hash = hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:8]
    return d / f"{source.stem}--{path_hash}-{cache_key(source)}.safetensors"


def _checksum(weights: dict[str, torch.Tensor]) -> str:
    crc = 0
    for name in sorted(weights):
        t = weights[name]
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(memoryview(t.numpy()).cast("B"), crc)
    return f"{crc:08x}"


def load(path: Path, key: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """(weights, extra) from a valid cache file, or None on a miss.

    An invalid file is deleted (with a warning) so the caller rebuilds it.
    """
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get(_META_PREFIX + "format") != str(FORMAT_VERSION) or meta.get(_META_PREFIX + "key") != key:
                raise ValueError("format version or key mismatch")
            weights = {name: f.get_tensor(name) for name in f.keys()}
        if _checksum(weights) != meta.get(_META_PREFIX + "crc32"):
            raise ValueError("checksum mismatch")
        extra = json.loads(meta[_META_PREFIX + "extra"])
    except Exception as e:  # any failure to read means rebuild, never crash
        warnings.warn(f"weights cache {path} is unusable ({e}); rebuilding it", stacklevel=3)
        with contextlib.suppress(OSError):
            path.unlink()
        return None
    return weights, extra


def save(path: Path, key: str, weights: dict[str, torch.Tensor], extra: dict[str, Any]) -> bool:
    """Write the cache atomically (temp file + rename). Returns False (with a warning) if the
    cache dir is not writable: caching is an optimization and must never fail a load."""
    meta = {
        _META_PREFIX + "format": str(FORMAT_VERSION),
        _META_PREFIX + "key": key,
        _META_PREFIX + "crc32": _checksum(weights),
        _META_PREFIX + "extra": json.dumps(extra),
    }
    tmp_name: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        os.close(fd)
        save_file(weights, tmp_name, metadata=meta)
        # mkstemp makes the file owner-only (0600); a cache file is ordinary data.
        os.chmod(tmp_name, 0o644)
        os.replace(tmp_name, path)
        tmp_name = None
        _remove_stale(path)
        return True
    except OSError as e:
        warnings.warn(f"could not write weights cache {path}: {e}", stacklevel=3)
        return False
    finally:
        if tmp_name is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp_name)


def _remove_stale(path: Path) -> None:
    """Delete older cache files of the same GGUF path (other key), each hundreds of MB, and
    temp files an interrupted writer left behind more than an hour ago."""
    prefix = path.name.rsplit("-", 1)[0]  # "<stem>--<path hash>"
    now = time.time()
    for other in path.parent.iterdir():
        stale = (other.suffix == ".safetensors" and other != path and other.name.rsplit("-", 1)[0] == prefix)
        with contextlib.suppress(OSError):
            if other.name.endswith(".tmp") and other.name.startswith(prefix) \
                    and now - other.stat().st_mtime > 3600:
                stale = True
            if stale:
                other.unlink()


def as_float32(arr: np.ndarray) -> torch.Tensor:
    """A float32, contiguous, writable torch tensor owning its memory (not a file mapping)."""
    a = np.asarray(arr, dtype=np.float32)
    if not (a.flags.c_contiguous and a.flags.writeable and a.flags.owndata):
        a = np.array(a, dtype=np.float32, order="C", copy=True)
    return torch.from_numpy(a)
