"""The int8 kernel (csrc/int8_gemm.c and the files it calls) of two builds, checked equal bit for
bit: for a refactor of the kernels that must not change a bit of what they compute.

    cp ~/.cache/stopline/native/stopline_kernels-<hash>.so /tmp/old.so   # before the change
    python bench/int8_bits.py --against /tmp/old.so                       # after it

"After" is the work tree's library as the engine builds and loads it (native.kernels()). For
each format (Q4_1, Q4_K, Q8_0, Q6_K), two shapes and each row count, x's rows are random
(some with large values, one group of zeros), the weight random in that format, and every path
the libraries switch between runs: the panels (split off), the split many-row paths (the
default), and the AMX tiles for every format where the OS grants them. Each output must equal
the old library's default path, bit for bit. Exits 1 at the first difference.

--code also compares the two libraries' machine code function by function (objdump, with
addresses and RIP-relative offsets taken out): for a refactor meant to change no instruction,
the list of functions whose instructions differ.
"""

from __future__ import annotations

import argparse
import ctypes
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf
import torch

from stopline.model.kernels import native
from stopline.model.kernels.int8_linear import Int8Weight, amx_granted

# The K-quant blocks come from the tests' GGUF maker (gguf cannot quantize to them): the
# repository root on the path, so the script runs as `python bench/int8_bits.py` too.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.tiny_model import kquant_blocks  # noqa: E402

ROWS = [1, 2, 3, 7, 19, 32, 64, 128, 700]
# (K, N): K-quants need K in whole 256-blocks
SHAPES = {"q4_1": [(576, 960), (1536, 576)], "q8_0": [(576, 960), (1536, 576)],
          "q4_k": [(512, 960), (1536, 576)], "q6_k": [(512, 960), (1536, 576)]}


def typed(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.stopline_quantize_rows.argtypes = [p, i, i, p, p, p, p]
    for fmt in SHAPES:
        getattr(lib, f"stopline_{fmt}_i8_gemm").argtypes = [p, p, p, p, p, p, i, i, i]
    for name in ("stopline_i8_split", "stopline_i8_amx", "stopline_int8_prefetch"):
        if hasattr(lib, name):
            getattr(lib, name).argtypes = [i]
    if hasattr(lib, "stopline_int8_prefetch"):
        lib.stopline_int8_prefetch(native.int8_prefetch())
    return lib


def functions(lib: Path) -> dict[str, list[str]]:
    """Each function's instructions in lib, without addresses (where the linker put a function
    or a constant is not what a refactor changes)."""
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "--no-addresses", str(lib)], capture_output=True,
                          text=True, check=True).stdout
    out: dict[str, list[str]] = {}
    body: list[str] = []
    for line in text.splitlines():
        if m := re.match(r"^<(.+)>:$", line.strip()):
            body = out.setdefault(m.group(1), [])
        elif line.strip():
            ins = re.sub(r"#.*$", "", line.strip())
            ins = re.sub(r"-?0x[0-9a-f]+\(%rip\)", "RIP", ins)
            body.append(" ".join(re.sub(r"\b[0-9a-f]+ <", "<", ins).split()))
    return out


def run(lib: ctypes.CDLL, w: Int8Weight, x: torch.Tensor, split: int = 1, amx: int = 0) -> torch.Tensor:
    """Int8Weight's call through `lib`, on the given paths."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    d, ds = torch.empty(m, k // 32), torch.empty(m, k // 32)
    s = torch.empty(m, k // 32, dtype=torch.int32)
    y = torch.full((m, w.out_features), float("nan"))
    lib.stopline_i8_split(split)
    lib.stopline_i8_amx(amx)
    lib.stopline_quantize_rows(x.data_ptr(), m, k, q.data_ptr(), d.data_ptr(), ds.data_ptr(), s.data_ptr())
    if w.fmt == "q6_k":
        s = q.view(m, k // 16, 16).sum(-1, dtype=torch.int32)
    getattr(lib, f"stopline_{w.fmt}_i8_gemm")(q.data_ptr(), d.data_ptr(), ds.data_ptr(), s.data_ptr(),
                                              w.packed.data_ptr(), y.data_ptr(), m, k, w.out_features)
    lib.stopline_i8_split(1)
    lib.stopline_i8_amx(0)
    return y


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--against", required=True, help="the old kernels library (.so)")
    ap.add_argument("--rows", type=int, nargs="+", default=ROWS)
    ap.add_argument("--formats", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--code", action="store_true", help="also compare the machine code (objdump)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="int8bits-"))
    shutil.copy(args.against, tmp / "old.so")  # a copy: dlopen never takes it for one already loaded
    old = typed(ctypes.CDLL(str(tmp / "old.so")))
    new = typed(native.kernels())
    print(f"old: {args.against}, new: {new._name} (this work tree's, as the engine loads it)", flush=True)
    paths = {"panels": (0, 0), "split": (1, 0)}
    if amx_granted():
        paths["amx"] = (1, 2)
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for fmt in args.formats:
        for k, n in SHAPES[fmt]:
            if fmt in ("q4_k", "q6_k"):  # random blocks: gguf cannot quantize to the K-quants
                raw = kquant_blocks(fmt, n, k, seed=n + k)
            else:
                raw = gguf.quants.quantize(torch.randn(n, k, generator=gen).numpy(), gguf.GGMLQuantizationType[fmt.upper()])
            w = Int8Weight.from_raw(fmt, raw, k)
            for rows in args.rows:
                x = torch.randn(rows, k, generator=gen)
                x[::5] *= 1e3
                x[0, :32] = 0.0
                want = run(old, w, x)
                for name, (split, amx) in paths.items():
                    got = run(new, w, x, split, amx)
                    if not torch.equal(got.view(torch.int32), want.view(torch.int32)):
                        print(f"DIFFERS: {fmt} {k}x{n}, {rows} rows, new {name} against old", flush=True)
                        sys.exit(1)
                    checked += 1
            print(f"{fmt} {k}x{n}: rows {' '.join(map(str, args.rows))}, paths {', '.join(paths)}: equal", flush=True)
    print(f"{checked} outputs equal to {args.against}'s, bit for bit")
    if args.code:
        a, b = functions(Path(args.against)), functions(Path(new._name))
        differ = sorted(n for n in set(a) | set(b) if a.get(n) != b.get(n))
        print(f"machine code: {len(set(a) | set(b)) - len(differ)} functions the same, {len(differ)} differ"
              + (f": {', '.join(differ)}" if differ else ""))


if __name__ == "__main__":
    main()
