"""Kernels whose result for a row does not depend on the other rows of the batch.

A GEMM library picks its kernel (and so its summation order) by the shape of the call, so a
row can come out with different bits depending on how many rows share its step. Measured on
this machine's MKL: `F.linear(x, w)` gives different rows for M = 1, M in 2..15 and M >= 16;
`x @ w_t` with the weight stored transposed (K x N, contiguous) gives the same rows for
every M >= 2 with one thread, while with two threads the K = 1536 projection splits again
at M = 17..129. Rather than trust either, each weight calibrates itself: it multiplies
random rows at a ladder of row counts (shifted, so a row also changes its place in the
tile) and keeps the row counts whose every row matches the others bit for bit. A batch then
runs as tiles of kept heights only (padded with zero rows), which is one GEMM whenever the
library allows it. (Attention's own fixed reduction order is in `attention.py`.)

Two GEMM libraries serve the CPU: BLAS (`x @ w_t`, MKL) and oneDNN's packed fp32 GEMM.
Timed per weight inside the engine (two engines stepping alternately, SmolLM2, 30 layers),
oneDNN wins on the MLP's gate/up projection (11 rows 38 against 51 ms a step, 64 rows 92
against 100) and on the LM head (2 rows 11.5 against 13.9, 11 rows 17 against 27) and loses
on the small attention projections at every batch (a fixed cost per call); on the down
projection it wins from 32 rows but loses at 2 (17 against 13 ms), which is the
single-stream step. So only the largest weights take oneDNN. Each calibrates with its own
kernel, and a weight keeps one library for every batch (two libraries' bits differ).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from stopline.config import LINEAR_BACKENDS
from stopline.model.kernels.bf16_linear import BF16Weight
from stopline.model.kernels.int8_linear import Int8Weight
from stopline.model.kernels.native import try_kernels
from stopline.model.kernels.quant_linear import QuantWeight

_pinned = threading.local()


def _threads() -> int:
    """The thread count the library's orders are looked up for: the current one, or the
    one pinned while a step runs on fewer threads (stopline/worker/cpu_share.py)."""
    return getattr(_pinned, "threads", None) or torch.get_num_threads()


@contextlib.contextmanager
def threads_pinned(threads: int) -> Iterator[None]:
    """Within it, kc() and heights() answer for `threads` whatever the current count: a step
    moved to fewer threads keeps the block orders found at the full count."""
    before = getattr(_pinned, "threads", None)
    _pinned.threads = threads
    try:
        yield
    finally:
        _pinned.threads = before

# A tile costs its rows plus this many rows' worth of fixed overhead (call, weight reads).
_TILE_OVERHEAD_ROWS = 8

# Row counts every weight is probed up to, however few rows its engine's steps carry.
MIN_PROBE_ROWS = 64

# Weights with at least this many elements take oneDNN where it is available: SmolLM2's
# gate/up (1.77M) and LM head (28M), not down (0.88M), q/k/v (0.55M) or o (0.33M).
ONEDNN_MIN_ELEMENTS = 1 << 20


def probe_heights(max_rows: int) -> list[int]:
    """Row counts to calibrate: every count up to 16, then steps of about 1/8."""
    out = list(range(1, min(16, max_rows) + 1))
    h = 16
    while h < max_rows:
        h += max(4, 1 << max(0, h.bit_length() - 4))
        out.append(min(h, max_rows))
    return out


MatMul = Callable[[torch.Tensor], torch.Tensor]


def calibrate(mm: MatMul, in_features: int, max_rows: int, seed: int = 0,
              device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> tuple[int, ...]:
    """The row counts at which `mm(x)` gives every row the same bits as at every other
    kept count. Seeded from 2 rows (a lone decode pads to 2; one row goes down another path
    in every library tried); if that class stops short of 16 rows, the class of 16 is tried
    too and the cheaper one for a spread of batch sizes wins."""
    # Probed to at least MIN_PROBE_ROWS whatever the engine's own limit, and the class picked
    # by a fixed spread of sizes: engines with other step budgets then keep the same heights
    # for the batches they share, so a request gets the same bits in either (on a Zen 5 host
    # 2 and 3 rows disagree with 4 and up: an engine probing only up to 5 rows kept {2, 3}).
    probes = [h for h in probe_heights(max(max_rows, MIN_PROBE_ROWS)) if h >= 2]
    small = _chain(mm, in_features, probes, 2, seed, device, dtype)
    if small and small[-1] >= 16:
        return small
    large = _chain(mm, in_features, probes, 16, seed, device, dtype)
    if not large:
        return small
    sizes = (1, 4, 16, 64)
    cost = {c: sum(_plan_cost(n, c) for n in sizes) for c in (small, large) if c}
    return min(cost, key=cost.__getitem__)


def _chain(mm: MatMul, k: int, probes: list[int], first: int, seed: int,
           device: str | torch.device, dtype: torch.dtype) -> tuple[int, ...]:
    shift_span = 8
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(max(probes) + shift_span, k, generator=gen).to(device, dtype)
    ref: torch.Tensor | None = None
    known = torch.zeros(x.shape[0], dtype=torch.bool, device=device)
    if first not in probes:
        return ()
    kept = []
    for h in [first] + [h for h in probes if h != first]:
        s = (h * 5) % shift_span  # the rows sit at a different place in each tile
        y = mm(x[s:s + h])
        if ref is None:
            ref = y.new_zeros(x.shape[0], y.shape[1])
        seen = known[s:s + h]
        if not kept or torch.equal(y[seen], ref[s:s + h][seen]):
            ref[s:s + h] = y
            known[s:s + h] = True
            kept.append(h)
    return tuple(sorted(kept))


def tile_plan(n: int, heights: tuple[int, ...]) -> Sequence[tuple[int, int]]:
    """Cover n rows with tiles of allowed heights: [(rows used, tile height), ...], chosen
    by cost (padded rows plus a fixed overhead per tile)."""
    plans = _plans(heights)
    return plans[n] if n < len(plans) else _plan_long(n, heights)


@functools.lru_cache(maxsize=64)
def _plans(heights: tuple[int, ...]) -> list[tuple[tuple[int, int], ...]]:
    top = heights[-1]
    cost = [0.0] * (top + 1)
    plans: list[tuple[tuple[int, int], ...]] = [()] * (top + 1)
    for n in range(1, top + 1):
        best_cost, best_plan = float("inf"), ()
        for h in heights:
            if h >= n:
                c = h + _TILE_OVERHEAD_ROWS
                if c < best_cost:
                    best_cost, best_plan = c, ((n, h),)
                break  # larger heights only pad more
            c = h + _TILE_OVERHEAD_ROWS + cost[n - h]
            if c < best_cost:
                best_cost, best_plan = c, ((h, h),) + plans[n - h]
        cost[n], plans[n] = best_cost, best_plan
    return plans


def _plan_cost(n: int, heights: tuple[int, ...]) -> int:
    return sum(h + _TILE_OVERHEAD_ROWS for _, h in tile_plan(n, heights))


def _plan_long(n: int, heights: tuple[int, ...]) -> Sequence[tuple[int, int]]:
    top = heights[-1]
    full, rest = divmod(n, top)
    return ((top, top),) * full + (_plans(heights)[rest] if rest else ())


def onednn_available(device: str | torch.device) -> bool:
    return (torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pick_backend(w: torch.Tensor, backend: str = "auto") -> str:
    """"blas" or "onednn" for this weight (see the module docstring for the rule)."""
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear backend must be one of {', '.join(LINEAR_BACKENDS)}, got {backend!r}")
    if backend == "blas":
        return "blas"
    if not onednn_available(w.device):
        if backend == "onednn":
            raise ValueError(f"linear backend 'onednn' needs a CPU build of torch with oneDNN; "
                             f"the weights are on {w.device}")
        return "blas"
    return "onednn" if backend == "onednn" or w.numel() >= ONEDNN_MIN_ELEMENTS else "blas"


class InvariantLinear:
    """y = x @ w.T whose rows never depend on the other rows of x.

    quant: the same weight in a GGUF block format; batches of up to `quant_max_rows` rows
    then run through the quantized-weight kernel, which reads a fraction of the bytes and
    sums in the library's order, so its rows carry the library's bits (checked at first use;
    where they would not, the kernel is not used).

    fast: the weight for the fast numerics mode (bf16, or blocks against int8 activations);
    every batch then runs through its kernel, whose rows are invariant by construction, and
    no library path is built."""

    def __init__(self, w: torch.Tensor, max_rows: int, backend: str = "auto",
                 quant: QuantWeight | None = None, quant_max_rows: int = 16,
                 fast: BF16Weight | Int8Weight | None = None) -> None:
        self.out_features, self.in_features = w.shape
        self.fast = fast
        if fast is not None:
            self.device, self.dtype, self.max_rows = w.device, w.dtype, max(2, max_rows)
            self.backend = "int8" if isinstance(fast, Int8Weight) else "bf16"
            self.quant, self.quant_max_rows, self._kc, self._heights = None, 0, {}, {}
            return
        self.device, self.dtype = w.device, w.dtype
        self.max_rows = max(2, max_rows)
        self.quant = quant if quant is not None and w.device.type == "cpu" and quant_max_rows > 0 else None
        self.quant_max_rows = quant_max_rows
        # With blocks and the backend left to us, a BLAS whose order the kernel cannot match
        # (K = 1024 and 2048 on the Intel Xeon test host) gives way to oneDNN (see _find_kc).
        self._w = w if backend == "auto" and self.quant is not None and onednn_available(w.device) else None
        self._use(w, pick_backend(w, backend))

    def _use(self, w: torch.Tensor, backend: str) -> None:
        self.backend = backend
        if self.backend == "onednn":
            # Packed once into oneDNN's blocked layout (hinted with the largest batch); the
            # plain weight is not kept.
            packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), self.max_rows)
            self._mm: MatMul = lambda x: torch.ops.mkldnn._linear_pointwise(
                x.contiguous(), packed, None, "none", [], "")
        else:
            w_t = w.t().contiguous()
            self._mm = lambda x: x @ w_t
        self._heights: dict[int, tuple[int, ...]] = {}
        self._kc: dict[int, int | None] = {}

    def heights(self) -> tuple[int, ...]:
        # The library's choice of kernel depends on the thread count too.
        threads = _threads()
        found = self._heights.get(threads)
        if found is None:
            key = (self.backend, self.in_features, self.out_features, self.dtype,
                   str(self.device), self.max_rows, threads)
            if key not in _CALIBRATED:  # depends on the shape, not the values
                _CALIBRATED[key] = calibrate(self._mm, self.in_features, self.max_rows,
                                             device=self.device, dtype=self.dtype)
            found = self._heights[threads] = _CALIBRATED[key]
        return found

    def kc(self) -> int | None:
        """The block size at which the quantized kernel sums like the library, or None when
        the kernel is not used for this weight (none, unavailable, or no order matched)."""
        if self.quant is None:
            return None
        threads = _threads()
        if threads not in self._kc:
            found = self._find_kc(threads)
            if found is None and self._w is not None and self.backend == "blas" and not self._kc:
                # No thread count has used BLAS's bits yet, so switching costs no row its bits.
                self._use(self._w, "onednn")
                found = self._find_kc(threads)
            self._w = None  # decided: the plain weight is not kept
            self._kc[threads] = found
        return self._kc[threads]

    def _find_kc(self, threads: int) -> int | None:
        if try_kernels() is None:
            return None
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(max(self.quant_max_rows, 3), self.in_features, generator=gen, dtype=self.dtype)
        key = (self.backend, self.in_features, self.out_features, self.max_rows, threads)
        known = _KC.get(key)
        if known is not None:
            # The order belongs to the shape; this weight only checks its own packing, which
            # every row shows: a few rows, and 13 for a second kernel chunk. (Checking all
            # quant_max_rows = 512 rows of every weight had cost 1.4 s of the engine's start.)
            sizes = sorted({n for n in (1, 2, 3, 13) if n <= x.shape[0]})
            want = self._library(x[:sizes[-1]])
            if all(torch.equal(self.quant(x[:n], known), want[:n]) for n in sizes):
                return known
        want = self._library(x)
        # Rows 0..2 decide; then the probed batch sizes up to quant_max_rows must agree too.
        # Probed, not every size: the library's rows come only from tiles of heights its
        # calibration found agreeing, and a kernel row's sum does not depend on the batch (its
        # chunks of 1..12 rows are all among the probes).
        sizes = [n for n in probe_heights(self.quant_max_rows) if n <= x.shape[0]]
        for kc in range(32, self.in_features + 1, 32):
            if torch.equal(self.quant(x[:3], kc), want[:3]) and all(
                    torch.equal(self.quant(x[:n], kc), want[:n]) for n in sizes):
                _KC[key] = kc
                return kc
        return None

    def own_kernel(self, rows: int) -> bool:
        """Whether `rows` rows run on stopline's kernels, whose bits never depend on the
        thread count (the bf16 ones, or the quantized one with a matched order)."""
        if self.fast is not None:
            return True
        return 0 < rows <= self.quant_max_rows and self.kc() is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fast is not None:
            return self.fast(x)
        n = x.shape[0]
        if 0 < n <= self.quant_max_rows and self.quant is not None:
            kc = self.kc()
            if kc is not None:
                return self.quant(x, kc)
        return self._library(x)

    def _library(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if n == 0:
            return x.new_empty(0, self.out_features)
        plan = tile_plan(n, self.heights())
        if len(plan) == 1 and plan[0][1] == n:
            return self._mm(x)
        parts = []
        start = 0
        for used, h in plan:
            tile = x[start:start + used]
            if used < h:  # zero rows pad the tile up to a kept height
                tile = F.pad(tile, (0, 0, 0, h - used))
            parts.append(self._mm(tile)[:used])
            start += used
        return torch.cat(parts) if len(parts) > 1 else parts[0]


_CALIBRATED: dict[tuple, tuple[int, ...]] = {}
_KC: dict[tuple, int] = {}  # the kc that matched the library for a shape, tried first next time


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm whose result for a row does not depend on the other rows. On the CPU,
    stopline's C kernel (one call instead of torch's ~8 ops; `csrc/rms_norm.c`) where it
    is built; else torch's fused kernel when a probe finds it row-invariant (measured here:
    it is, and 2-3x faster than the float64 form); otherwise the mean of squares is taken
    in float64, whose reduction order is irrelevant after rounding."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and w.dtype == torch.float32:
        lib = try_kernels()
        if lib is not None:
            x, w = x.contiguous(), w.contiguous()  # held: the C call reads them by address
            y = torch.empty_like(x)
            lib.stopline_rms_norm(x.data_ptr(), w.data_ptr(), y.data_ptr(),
                                  x.numel() // x.shape[-1], x.shape[-1], eps)
            return y
    if _fused_norm_ok(x.device.type, torch.get_num_threads(), x.shape[-1]):
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return _rms_norm_f64(x, w, eps)


def _rms_norm_f64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    var = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float64).square_()
    return x * var.div_(x.shape[-1]).add_(eps).rsqrt_().to(x.dtype) * w


@functools.lru_cache(maxsize=16)
def _fused_norm_ok(device: str, threads: int, width: int) -> bool:
    """Whether torch's fused RMS norm gives a row of this width the same bits in any batch
    (the vector loop's tail depends on the width, so each width is probed)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(160, width, generator=gen).to(device)
    w = torch.randn(width, generator=gen).to(device)
    ref = F.rms_norm(x, (width,), w, 1e-5)
    return all(torch.equal(F.rms_norm(x[s:s + n].clone(), (width,), w, 1e-5), ref[s:s + n])
               for n in (1, 2, 3, 7, 16, 17, 33, 64, 127) for s in (0, 5, 30))
