"""Paged attention: a query row's output has the same bits however it is batched."""

import pytest
import torch

import stopline.model.attention as attention
from stopline.model.attention import attend

PROBE = attention._fused_softmax_ok  # the real probe, before the fixture replaces it


@pytest.fixture(params=["fused", "float64"], autouse=True)
def softmax_path(request, monkeypatch):
    """Every property holds on both softmax paths (the probe picks fused where it can)."""
    monkeypatch.setattr(attention, "_fused_softmax_ok", lambda device, threads: request.param == "fused")
    return request.param

HK, G, D = 2, 3, 64
SCALE = D ** -0.5


def _prefill(q, k, v, start: int, end: int) -> torch.Tensor:
    """Rows start..end-1 of one sequence as a prefill chunk: [rows, HK, G, D]."""
    rows = end - start
    qs = q[start:end].permute(1, 0, 2, 3).reshape(HK, rows * G, D)
    keys = k[:end].permute(1, 2, 0)  # [HK, D, end]
    vals = v[:end].permute(1, 0, 2)  # [HK, end, D]
    causal = torch.arange(end)[None, :] > torch.arange(start, end)[:, None]
    masked = causal[:, None, :].expand(rows, G, end).reshape(rows * G, end)
    return attend(qs, keys, vals, masked, SCALE).view(HK, rows, G, D).permute(1, 0, 2, 3)


def _decode(seqs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]) -> torch.Tensor:
    """The last row of each sequence, as one padded decode batch: [b, HK, G, D]."""
    width = max(n for *_, n in seqs)
    width += -width % 16 + 16  # padding beyond the longest, as whole zero blocks
    qs = torch.stack([q[n - 1] for q, _, _, n in seqs])
    keys = torch.zeros(len(seqs), HK, D, width)
    vals = torch.zeros(len(seqs), HK, width, D)
    for i, (_, k, v, n) in enumerate(seqs):
        keys[i, :, :, :n] = k[:n].permute(1, 2, 0)
        vals[i, :, :n] = v[:n].permute(1, 0, 2)
    lens = torch.tensor([n for *_, n in seqs])
    masked = (torch.arange(width)[None, :] >= lens[:, None])[:, None, None, :]
    return attend(qs, keys, vals, masked, SCALE)


def _seq(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, HK, G, D, generator=g), torch.randn(n, HK, D, generator=g),
            torch.randn(n, HK, D, generator=g), n)


def test_same_bits_as_decode_alone_in_a_batch_and_in_prefill_chunks():
    # Long enough that a plain softmax-then-GEMM changes bits with the padding (measured:
    # from about 600 keys padded to 1300 on MKL).
    q, k, v, n = seq = _seq(600, 0)
    alone = _decode([seq])[0]
    batched = _decode([_seq(1300, 1), seq, _seq(7, 2), _seq(64, 3)])[1]
    whole = _prefill(q, k, v, 0, n)[-1]
    chunk = _prefill(q, k, v, 40, n)[-1]
    single = _prefill(q, k, v, n - 1, n)[-1]
    for other in (batched, whole, chunk, single):
        assert torch.equal(alone, other)


def test_every_row_of_a_prefill_matches_its_own_decode():
    q, k, v, n = _seq(40, 4)
    whole = _prefill(q, k, v, 0, n)
    for pos in (0, 1, 15, 16, 17, 39):
        assert torch.equal(whole[pos], _decode([(q, k, v, pos + 1)])[0]), pos


def test_matches_float64_softmax_attention():
    q, k, v, n = _seq(70, 5)
    got = _prefill(q, k, v, 0, n)
    qd = q.double().permute(1, 2, 0, 3)  # [HK, G, n, D]
    kd, vd = k.double().permute(1, 0, 2), v.double().permute(1, 0, 2)  # [HK, n, D]
    s = torch.einsum("hgqd,hkd->hgqk", qd, kd) * SCALE
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("hgqk,hkd->hgqd", s.softmax(-1), vd).permute(2, 0, 1, 3)
    assert torch.allclose(got.double(), ref, atol=1e-5, rtol=1e-5)


def test_masked_keys_with_zero_values_contribute_nothing_even_if_keys_are_nan():
    q, k, v, n = _seq(20, 6)
    clean = _decode([(q, k, v, n)])
    k2 = torch.cat([k, torch.full((12, HK, D), float("nan"))])
    v2 = torch.cat([v, torch.zeros(12, HK, D)])
    qs = q[n - 1][None]
    keys = k2.permute(1, 2, 0)[None]
    vals = v2.permute(1, 0, 2)[None]
    masked = (torch.arange(32) >= n)[None, None, None, :]
    assert torch.equal(attend(qs, keys, vals, masked, SCALE), clean)


def test_softmax_probe_rejects_a_kernel_whose_rows_move_with_the_padding(monkeypatch):
    def width_dependent(x, dim):  # a kernel whose result depends on the row's padded length
        return torch.nn.functional.softmax(x, dim=dim) * (1 + 1e-6 * (x.shape[-1] > 1024))

    PROBE.cache_clear()
    monkeypatch.setattr(attention.torch, "softmax", width_dependent)
    try:
        assert not PROBE("cpu", torch.get_num_threads())
    finally:
        PROBE.cache_clear()


@pytest.mark.parametrize("g", [1, 3])
def test_attend_rows_on_views_of_wider_buffers_gives_attends_bits(g):
    # DecodeRows hands out the first `width` keys of a longer capacity; P @ V then runs a
    # tile at a time. The result must be attend's, bit for bit, on the contiguous copy.
    torch.manual_seed(0)
    rows, hk, d, cap, width = 7, 2, 16, 4 * attention.KEY_TILE, 2 * attention.KEY_TILE
    kb, vb = torch.randn(rows, hk, cap, d), torch.randn(rows, hk, cap, d)
    lens = torch.randint(1, width + 1, (rows,))
    for r in range(rows):
        vb[r, :, lens[r]:] = 0.0
    masked = (torch.arange(width)[None, :] >= lens[:, None])[:, None, None, :]
    q = torch.randn(rows, hk, g, d)
    k, v = kb[:, :, :width], vb[:, :, :width]
    want = attend(q, k.contiguous().transpose(2, 3), v.contiguous(), masked, 0.25)
    got = attention.attend_rows(q, k.transpose(2, 3), v, masked, 0.25)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="whole tiles"):
        attention.attend_rows(q, k[:, :, :5].transpose(2, 3), v[:, :, :5], masked[..., :5], 0.25)


def test_a_library_whose_few_rows_take_another_kernel_gets_its_blocks_padded(monkeypatch) -> None:
    """Where the GEMM library gives 2 and 3 rows other bits than 4 and more (MKL on a Zen 5
    host does), the probe says 4, and a decode (G = 3 query rows) still gets the bits of the
    same position in a prefill chunk (G x rows)."""
    real = torch.matmul

    def odd(a, b):  # 2 or 3 rows: another summation order
        y = real(a, b)
        return y + 1e-3 if a.shape[-2] in (2, 3) else y

    monkeypatch.setattr(torch, "matmul", odd)
    attention.min_rows.cache_clear()
    try:
        assert attention.min_rows("cpu", torch.get_num_threads()) == 4
        q, k, v, n = seq = _seq(100, 0)
        assert torch.equal(_decode([seq])[0], _prefill(q, k, v, n - 5, n)[-1])
    finally:
        attention.min_rows.cache_clear()
