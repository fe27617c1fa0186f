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

#include "q4_bf16.h"

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

/* The same products from Q4_1 weights kept in their blocks (5 bits a weight instead of 16),
 * dequantized to bf16 by q4_bf16.h exactly as the bf16 copy was made, so both kernels give
 * every output the same bits and the caller may pick either by row count. */
#define Q4_REC (PANEL * 2 * 2 + 16 * PANEL)

static inline TARGET __attribute__((always_inline)) void
q4_bf16_panel(const uint16_t* x, long ldx, const uint8_t* P, float* y, long ldy, int mr, int K) {
    __m512 acc[MR][2];
    UNROLL for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int g = 0; g < K / 32; g++) {
        const uint8_t* rec = P + (long)g * Q4_REC;
        for (int o = 0; o < Q4_REC; o += 64) _mm_prefetch((const char*)(rec + 4096 + o), _MM_HINT_T0);
        Q4Scales sc = q4_scales(rec);
        const uint16_t* xg = x + g * 32;
        for (int p = 0; p < 16; p++) {
            __m512bh w0, w1;
            q4_pair(rec, p, &sc, &w0, &w1);
            UNROLL for (int r = 0; r < mr; r++) {
                __m512bh xv = (__m512bh)_mm512_set1_epi32(*(const int32_t*)(xg + r * ldx + 2 * p));
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, w0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, w1);
            }
        }
    }
    UNROLL for (int r = 0; r < mr; r++) {
        _mm512_storeu_ps(y + r * ldy, acc[r][0]);
        _mm512_storeu_ps(y + r * ldy + 16, acc[r][1]);
    }
}

typedef void (*Q4Fn)(const uint16_t* x, long ldx, const uint8_t* P, float* y, long ldy, int K);
#define Q4_FN(n)                                                                                 \
    static TARGET __attribute__((noinline)) void q4_bf16_panel_##n(const uint16_t* x, long ldx,  \
                                                                   const uint8_t* P, float* y,  \
                                                                   long ldy, int K) {           \
        q4_bf16_panel(x, ldx, P, y, ldy, n, K);                                                  \
    }
Q4_FN(1) Q4_FN(2) Q4_FN(3) Q4_FN(4) Q4_FN(5) Q4_FN(6)
Q4_FN(7) Q4_FN(8) Q4_FN(9) Q4_FN(10) Q4_FN(11) Q4_FN(12)
static const Q4Fn q4_panels[MR + 1] = {
    0, q4_bf16_panel_1, q4_bf16_panel_2, q4_bf16_panel_3, q4_bf16_panel_4, q4_bf16_panel_5,
    q4_bf16_panel_6, q4_bf16_panel_7, q4_bf16_panel_8, q4_bf16_panel_9, q4_bf16_panel_10,
    q4_bf16_panel_11, q4_bf16_panel_12};

/* K a multiple of 32, N of 32 (the Q4_1 layout's own limits). */
void stopline_q4_1_bf16_gemm(const uint16_t* x, const uint8_t* w, float* y, int M, int K, int N) {
    long panel_bytes = (long)(K / 32) * Q4_REC;
    int chunks = (M + MR - 1) / MR;
#pragma omp parallel for schedule(static)
    for (int p = 0; p < N / PANEL; p++) {
        const uint8_t* P = w + p * panel_bytes;
        for (int c = 0; c < chunks; c++) {
            int m0 = (int)((long)M * c / chunks), mr = (int)((long)M * (c + 1) / chunks) - m0;
            q4_panels[mr](x + (long)m0 * K, K, P, y + (long)m0 * N + p * PANEL, N, K);
        }
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
