"""The int8 kernel's many-row paths against the plain torch reference of the same arithmetic,
bit for bit, at many row counts, in every format; and every row the same as when computed
alone (batch invariance). The paths: Q4 nibbles split once a panel (csrc/int8_rows.c, more
than 18 rows) and AMX-INT8 tiles where the OS grants them (csrc/amx_i8_gemm.c, 64 rows up)."""

from __future__ import annotations

import pytest
import torch

from stopline.model.kernels.int8_linear import Int8Weight, amx_granted, has_vnni, use_amx, use_split
from stopline.model.kernels.int8_linear import reference as int8_reference
from stopline.model.kernels.native import _cpu_flags, try_kernels
from tests.test_numerics import _blocks

pytestmark = pytest.mark.skipif(not has_vnni() or try_kernels() is None,
                                reason="no AVX512-VNNI (or no C kernels) on this host")

# Row counts around the split path's threshold (19), the tiles' 16 and their threshold (64),
# odd ones up to 700.
ROWS = [1, 15, 17, 18, 19, 25, 63, 64, 65, 97, 129, 255, 333, 511, 700]
# (n, k): K of 16, 18 and 24 groups takes the tiles' blocks of 8 groups whole and in part.
SHAPES = {"q4_1": (96, 576), "q8_0": (64, 576), "q4_k": (96, 768), "q6_k": (64, 512)}


@pytest.fixture(params=["split", "tiles"])
def path(request):
    """Each many-row path in turn (tiles for every format where the OS grants them); the
    process defaults again after."""
    if request.param == "tiles":
        if not amx_granted():
            pytest.skip("no AMX-INT8 tile state on this host")
        use_amx(2)
    else:
        use_amx(0)
    yield request.param
    use_amx(None)
    use_split(True)


@pytest.mark.parametrize("fmt", sorted(SHAPES))
def test_many_rows_equal_reference_and_rows_alone(fmt: str, path: str) -> None:
    n, k = SHAPES[fmt]
    raw, _ = _blocks(fmt, n, k, seed=len(fmt) + n)
    weight = Int8Weight.from_raw(fmt, raw, k)
    x = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(n + k)) * 3
    alone = torch.cat([weight(x[i:i + 1]) for i in range(len(x))])
    assert torch.equal(alone, int8_reference(x, fmt, raw))
    for m in ROWS:
        assert torch.equal(weight(x[:m]), alone[:m]), f"{fmt}: {m} rows"
    # a batch cut where the tiles' blocks and the chunks fall differently
    assert torch.equal(torch.cat([weight(x[:101]), weight(x[101:])]), alone)


@pytest.mark.parametrize("fmt", sorted(SHAPES))
def test_many_row_paths_agree_with_the_panels(fmt: str, path: str) -> None:
    """The same call with the path switched off (every chunk of rows through the VNNI
    panels), a non-finite input included: it spoils its own row only, on every path."""
    n, k = SHAPES[fmt]
    raw, _ = _blocks(fmt, n, k, seed=3)
    weight = Int8Weight.from_raw(fmt, raw, k)
    x = torch.randn(333, k, generator=torch.Generator().manual_seed(9))
    x[5, 7] = float("nan")
    fast = weight(x)
    use_amx(0)
    use_split(False)
    panels = weight(x)
    assert torch.equal(fast.nan_to_num(7.0), panels.nan_to_num(7.0))
    assert fast[5].isnan().all() and not fast[[4, 6]].isnan().any()


def test_tiles_only_when_asked_and_granted(monkeypatch) -> None:
    """Off by default; STOPLINE_INT8_AMX=1 turns the tiles on where the CPU has AMX-INT8 and
    the OS grants the tile state."""
    try:
        monkeypatch.delenv("STOPLINE_INT8_AMX", raising=False)
        assert use_amx(None) == 0
        monkeypatch.setenv("STOPLINE_INT8_AMX", "1")
        assert use_amx(None) == int({"amx_tile", "amx_int8"} <= _cpu_flags() and amx_granted())
    finally:
        monkeypatch.delenv("STOPLINE_INT8_AMX")
        use_amx(None)


def test_packing_needs_no_kernels(monkeypatch) -> None:
    """Building a weight reads the tiles' switch; without the C kernels (STOPLINE_NATIVE=0) it
    still packs, as before the switch existed."""
    from stopline.model.kernels import int8_linear, native

    raw, _ = _blocks("q4_1", 32, 64, seed=1)
    monkeypatch.setenv("STOPLINE_NATIVE", "0")
    native.reset()
    int8_linear._amx_default.cache_clear()
    try:
        weight = Int8Weight.from_raw("q4_1", raw, 64)
        assert weight.packed.numel() == 2 * 640
    finally:
        monkeypatch.delenv("STOPLINE_NATIVE")
        native.reset()
        int8_linear._amx_default.cache_clear()
