/* y = x @ w.T with bf16 inputs and fp32 accumulation (AVX512-BF16 vdpbf16ps): the "fast"
 * numerics mode (docs/numerics.md).
 *
 * Batch invariance, as in quant_gemm.c: every output element y[r][n] is one sequential chain
 * from zero over the k-pairs in order, acc = dpbf16(acc, x[r][2p..2p+1], w[n][2p..2p+1]) for
 * p = 0 .. K/2 - 1, whatever M is, however the rows are chunked and whichever thread runs the
 * panel. So a row's bits never depend on the other rows of its batch.
 *
 * Packed layout (stopline/model/kernels/bf16_linear.py): panels of 32 output columns, panel-
 * major, then per k-pair 32 columns x (w[n][2p], w[n][2p+1]) as bf16: 128 bytes, two vectors
 * of 16 dwords each holding one column's pair. x: M x K bf16 (K even, zero padded by the
 * caller), y: M x N fp32 with N a multiple of 32.
 *
 * Compiled for AVX512-BF16 by attribute, not by the library's flags, so the other kernels
 * build and run on hosts without it; the caller checks the CPU flag before calling.
 */
#include <immintrin.h>
#include <stdint.h>

#define PANEL 32
#define MR 12
#define UNROLL _Pragma("GCC unroll 12")
#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

static inline TARGET __attribute__((always_inline)) void
bf16_panel(const uint16_t* x, long ldx, const uint16_t* P, float* y, long ldy, int mr, int K) {
    __m512 acc[MR][2];
    UNROLL for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int p = 0; p < K / 2; p++) {
        const uint16_t* rec = P + (long)p * 2 * PANEL;
        _mm_prefetch((const char*)(rec + 2048), _MM_HINT_T0);
        _mm_prefetch((const char*)(rec + 2048 + 32), _MM_HINT_T0);
        __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void*)rec);
        __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void*)(rec + PANEL));
        UNROLL for (int r = 0; r < mr; r++) {
            __m512bh xv = (__m512bh)_mm512_set1_epi32(*(const int32_t*)(x + r * ldx + 2 * p));
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, w0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, w1);
        }
    }
    UNROLL for (int r = 0; r < mr; r++) {
        _mm512_storeu_ps(y + r * ldy, acc[r][0]);
        _mm512_storeu_ps(y + r * ldy + 16, acc[r][1]);
    }
}

typedef void (*PanelFn)(const uint16_t* x, long ldx, const uint16_t* P, float* y, long ldy, int K);
#define PANEL_FN(n)                                                                              \
    static TARGET __attribute__((noinline)) void bf16_panel_##n(const uint16_t* x, long ldx,     \
                                                                const uint16_t* P, float* y,     \
                                                                long ldy, int K) {               \
        bf16_panel(x, ldx, P, y, ldy, n, K);                                                     \
    }
PANEL_FN(1) PANEL_FN(2) PANEL_FN(3) PANEL_FN(4) PANEL_FN(5) PANEL_FN(6)
PANEL_FN(7) PANEL_FN(8) PANEL_FN(9) PANEL_FN(10) PANEL_FN(11) PANEL_FN(12)
static const PanelFn panels[MR + 1] = {
    0, bf16_panel_1, bf16_panel_2, bf16_panel_3, bf16_panel_4, bf16_panel_5, bf16_panel_6,
    bf16_panel_7, bf16_panel_8, bf16_panel_9, bf16_panel_10, bf16_panel_11, bf16_panel_12};

/* Each thread takes whole panels; a panel runs its rows in chunks of at most MR (the chunking
 * changes no output's chain, only which registers hold it). */
void stopline_bf16_gemm(const uint16_t* x, const uint16_t* w, float* y, int M, int K, int N) {
    long panel_elems = (long)K * PANEL;
    int chunks = (M + MR - 1) / MR;
#pragma omp parallel for schedule(static)
    for (int p = 0; p < N / PANEL; p++) {
        const uint16_t* P = w + p * panel_elems;
        for (int c = 0; c < chunks; c++) {
            int m0 = (int)((long)M * c / chunks), mr = (int)((long)M * (c + 1) / chunks) - m0;
            panels[mr](x + (long)m0 * K, K, P, y + (long)m0 * N + p * PANEL, N, K);
        }
    }
}
