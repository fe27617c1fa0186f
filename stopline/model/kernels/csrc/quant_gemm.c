/* y = x @ w.T for weights kept in their GGUF block formats, dequantized in registers.
 *
 * Why: a lone decode reads every weight once a step, so its speed is the bytes it reads.
 * Q4_1 weights are 5 bits each here against 32 as float32.
 *
 * Every output element is summed in exactly the order the GEMM library uses on the
 * dequantized float32 weights: the k range is cut into blocks of `kc`, each block is one
 * sequential FMA chain from zero, and the blocks' sums are added in order (MKL on an Intel
 * Xeon: kc = 288 for K = 576, 384 for K = 1536; on a Zen 5 host 192 for both; oneDNN: kc =
 * 512 / 1024). The order differs between hosts, so the caller finds kc by probing
 * and uses this kernel only where the bits match, so a row's result never depends on which
 * path ran it. Dequantization is exact: d * q is exact in float32 (11 + 4 bits), so
 * fma(d, q, m) equals gguf's (d * q) + m, and likewise d * q for Q8_0 (11 + 8 bits).
 *
 * Packed layouts (built by stopline/model/quant_linear.py), in panels of 32 output columns,
 * panel-major, then one record per group of 32 k:
 *   Q4_1: d[32] f16, m[32] f16, then 16 k-pairs x 32 bytes (low nibble k even, high k odd)
 *   Q8_0: d[32] f16, then 32 k x 32 int8 (a GGUF's Q5_0 too, its quants q - 16)
 *   Q4_K: s[32] f32 (d * sc), n[32] f32 (-(dmin * m)), then Q4_1's 16 k-pairs x 32 bytes;
 *         w = fma(s, q, n), which is gguf's (d * sc) * q - dmin * m because s * q is exact
 *   Q6_K: s0[32] f32 (d * sc of k 0-15), s1[32] f32 (of k 16-31), then 32 k x 32 int8 (q - 32);
 *         w = s * q, gguf's own product
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#include "fetch.h"
#include "panel.h"

#define GROUP 32
#define Q4_REC (PANEL * 2 * 2 + GROUP / 2 * PANEL)
#define Q8_REC (PANEL * 2 + GROUP * PANEL)
#define Q4K_REC (PANEL * 4 * 2 + GROUP / 2 * PANEL)
#define Q6K_REC (PANEL * 4 * 2 + GROUP * PANEL)

/* Rows a panel pass carries: 12 rows x 2 vectors of 16 columns = 24 accumulators, which with
 * the dequantized weights and their scales fill the 32 vector registers, and each x broadcast
 * feeds two FMAs (one per 16 columns). It replaced a tall path (16 columns against up to 24
 * rows, one FMA per broadcast) built to spread the dequantization over more rows: on
 * SmolLM2's shapes with the weights streamed from memory (bench/quant_time.py, interleaved
 * A/B, same bits) this takes 0.69-0.71x its time at 9-12 rows, 0.82x at 31, 0.89x at 64. */
#define MR 12
/* Every loop over a chunk's rows is unrolled whole, so each accumulator is a register of its
 * own whatever gcc's unrolling limits. */
#define UNROLL _Pragma("GCC unroll 12")

/* How far a pass fetches its records (fetch.h). Measured on the layers' weights, interleaved
 * with the kernel without it: 14% less time at one row, 8% at four, none from eight (compute
 * bound). 2 KiB ahead into L1 rather than 4: on the Intel Xeon host (bench/quant_time.py
 * --against, same bits, three runs) 0.96x the time at one row, 0.90-0.99x at two, level at
 * four and eight; 1 KiB was no better than 4 KiB. Passes of up to FAR_ROWS rows also fetch
 * 12 KiB ahead into L2: they are too few rows to hide the memory's latency behind their FMAs
 * (the same kernel from cache runs ~1.5x faster). Three runs, same bits: 0.90-0.96x the time
 * at one row, 0.94-0.97x at two; at eight rows and more it cost 2-11%, so they skip it. */
#define FAR_ROWS 2

static inline void q4_deq(const uint8_t* nibbles, int pair, __m512 d0, __m512 d1, __m512 m0, __m512 m1,
                          __m512* we0, __m512* we1, __m512* wo0, __m512* wo1) {
    const __m128i* v = (const __m128i*)(nibbles + pair * PANEL);
    __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128(v));
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(v + 1));
    /* The low nibble's float(q) by table: permutexvar reads only an index's low 4 bits, so one
     * shuffle replaces a mask and a conversion (the same exact values; the high nibble keeps
     * its conversion, which balances the two vector ports better). bench/quant_time.py
     * --against, same bits, two runs: 0.95-0.99x the time from 1 to 12 rows. */
    const __m512 q = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    *we0 = _mm512_fmadd_ps(d0, _mm512_permutexvar_ps(a, q), m0);
    *we1 = _mm512_fmadd_ps(d1, _mm512_permutexvar_ps(b, q), m1);
    *wo0 = _mm512_fmadd_ps(d0, _mm512_cvtepi32_ps(_mm512_srli_epi32(a, 4)), m0);
    *wo1 = _mm512_fmadd_ps(d1, _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), m1);
}

static inline __m512 f16x16(const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}

/* A block's sums into y: the first block is stored, each later one added to what is there
 * (the library's order: blocks summed in turn). */
static inline void add_block(__m512 acc[][2], float* y, long ldy, int mr, int first) {
    UNROLL for (int r = 0; r < mr; r++) {
        float* yr = y + r * ldy;
        if (!first) {
            acc[r][0] = _mm512_add_ps(_mm512_loadu_ps(yr), acc[r][0]);
            acc[r][1] = _mm512_add_ps(_mm512_loadu_ps(yr + 16), acc[r][1]);
        }
        _mm512_storeu_ps(yr, acc[r][0]);
        _mm512_storeu_ps(yr + 16, acc[r][1]);
    }
}

/* One panel (32 columns) for rows [0, mr) of x; mr <= MR, fixed per call so the compiler
 * keeps the accumulators in registers. */
static inline __attribute__((always_inline)) void
q4_panel(const float* x, long ldx, const uint8_t* P, float* y, long ldy, int mr, int K, int kc) {
    __m512 acc[MR][2];
    for (int k0 = 0; k0 < K; k0 += kc) {
        int k1 = k0 + kc < K ? k0 + kc : K;
        UNROLL for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int g = k0 / GROUP; g < k1 / GROUP; g++) {
            const uint8_t* rec = P + (long)g * Q4_REC;
            fetch_record(rec, Q4_REC, mr <= FAR_ROWS);
            __m512 d0 = f16x16(rec), d1 = f16x16(rec + 32), m0 = f16x16(rec + 64), m1 = f16x16(rec + 96);
            const float* xk = x + g * GROUP;
            for (int p = 0; p < GROUP / 2; p++) {
                __m512 we0, we1, wo0, wo1;
                q4_deq(rec + 128, p, d0, d1, m0, m1, &we0, &we1, &wo0, &wo1);
                UNROLL for (int r = 0; r < mr; r++) {
                    __m512 xe = _mm512_set1_ps(xk[r * ldx + 2 * p]);
                    acc[r][0] = _mm512_fmadd_ps(xe, we0, acc[r][0]);
                    acc[r][1] = _mm512_fmadd_ps(xe, we1, acc[r][1]);
                    __m512 xo = _mm512_set1_ps(xk[r * ldx + 2 * p + 1]);
                    acc[r][0] = _mm512_fmadd_ps(xo, wo0, acc[r][0]);
                    acc[r][1] = _mm512_fmadd_ps(xo, wo1, acc[r][1]);
                }
            }
        }
        add_block(acc, y, ldy, mr, k0 == 0);
    }
}

static inline __attribute__((always_inline)) void
q8_panel(const float* x, long ldx, const uint8_t* P, float* y, long ldy, int mr, int K, int kc) {
    __m512 acc[MR][2];
    for (int k0 = 0; k0 < K; k0 += kc) {
        int k1 = k0 + kc < K ? k0 + kc : K;
        UNROLL for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int g = k0 / GROUP; g < k1 / GROUP; g++) {
            const uint8_t* rec = P + (long)g * Q8_REC;
            fetch_record(rec, Q8_REC, mr <= FAR_ROWS);
            __m512 d0 = f16x16(rec), d1 = f16x16(rec + 32);
            const float* xk = x + g * GROUP;
            for (int k = 0; k < GROUP; k++) {
                const __m128i* v = (const __m128i*)(rec + 64 + k * PANEL);
                __m512 w0 = _mm512_mul_ps(d0, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(v))));
                __m512 w1 = _mm512_mul_ps(d1, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(v + 1))));
                UNROLL for (int r = 0; r < mr; r++) {
                    __m512 xv = _mm512_set1_ps(xk[r * ldx + k]);
                    acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
                    acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
                }
            }
        }
        add_block(acc, y, ldy, mr, k0 == 0);
    }
}

/* Q4_K: Q4_1's loop with float32 scales and negated minima (see the header). */
static inline __attribute__((always_inline)) void
q4k_panel(const float* x, long ldx, const uint8_t* P, float* y, long ldy, int mr, int K, int kc) {
    __m512 acc[MR][2];
    for (int k0 = 0; k0 < K; k0 += kc) {
        int k1 = k0 + kc < K ? k0 + kc : K;
        UNROLL for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int g = k0 / GROUP; g < k1 / GROUP; g++) {
            const uint8_t* rec = P + (long)g * Q4K_REC;
            fetch_record(rec, Q4K_REC, mr <= FAR_ROWS);
            const float* f = (const float*)rec;
            __m512 d0 = _mm512_loadu_ps(f), d1 = _mm512_loadu_ps(f + 16);
            __m512 m0 = _mm512_loadu_ps(f + 32), m1 = _mm512_loadu_ps(f + 48);
            const float* xk = x + g * GROUP;
            for (int p = 0; p < GROUP / 2; p++) {
                __m512 we0, we1, wo0, wo1;
                q4_deq(rec + 256, p, d0, d1, m0, m1, &we0, &we1, &wo0, &wo1);
                UNROLL for (int r = 0; r < mr; r++) {
                    __m512 xe = _mm512_set1_ps(xk[r * ldx + 2 * p]);
                    acc[r][0] = _mm512_fmadd_ps(xe, we0, acc[r][0]);
                    acc[r][1] = _mm512_fmadd_ps(xe, we1, acc[r][1]);
                    __m512 xo = _mm512_set1_ps(xk[r * ldx + 2 * p + 1]);
                    acc[r][0] = _mm512_fmadd_ps(xo, wo0, acc[r][0]);
                    acc[r][1] = _mm512_fmadd_ps(xo, wo1, acc[r][1]);
                }
            }
        }
        add_block(acc, y, ldy, mr, k0 == 0);
    }
}

/* Q6_K: Q8_0's loop with a float32 scale a 16 k (see the header). */
static inline __attribute__((always_inline)) void
q6k_panel(const float* x, long ldx, const uint8_t* P, float* y, long ldy, int mr, int K, int kc) {
    __m512 acc[MR][2];
    for (int k0 = 0; k0 < K; k0 += kc) {
        int k1 = k0 + kc < K ? k0 + kc : K;
        UNROLL for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int g = k0 / GROUP; g < k1 / GROUP; g++) {
            const uint8_t* rec = P + (long)g * Q6K_REC;
            fetch_record(rec, Q6K_REC, mr <= FAR_ROWS);
            const float* f = (const float*)rec;
            const float* xk = x + g * GROUP;
            for (int h = 0; h < 2; h++) {
                __m512 d0 = _mm512_loadu_ps(f + 32 * h), d1 = _mm512_loadu_ps(f + 32 * h + 16);
                for (int k = 16 * h; k < 16 * h + 16; k++) {
                    const __m128i* v = (const __m128i*)(rec + 256 + k * PANEL);
                    __m512 w0 = _mm512_mul_ps(d0, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(v))));
                    __m512 w1 = _mm512_mul_ps(d1, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(v + 1))));
                    UNROLL for (int r = 0; r < mr; r++) {
                        __m512 xv = _mm512_set1_ps(xk[r * ldx + k]);
                        acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
                        acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
                    }
                }
            }
        }
        add_block(acc, y, ldy, mr, k0 == 0);
    }
}

/* One function per row count, each compiled on its own with the count a constant, so its
 * accumulators stay in registers; the entry points pick one from a table. */
typedef void (*PanelFn)(const float* x, long ldx, const uint8_t* P, float* y, long ldy, int K, int kc);
#define PANEL_FN(kind, n)                                                                     \
    static __attribute__((noinline)) void kind##_panel_##n(const float* x, long ldx, const uint8_t* P, \
                                                           float* y, long ldy, int K, int kc) { \
        kind##_panel(x, ldx, P, y, ldy, n, K, kc);                                            \
    }
#define PANEL_FNS(kind)                                                                       \
    PANEL_FN(kind, 1) PANEL_FN(kind, 2) PANEL_FN(kind, 3) PANEL_FN(kind, 4) PANEL_FN(kind, 5)  \
    PANEL_FN(kind, 6) PANEL_FN(kind, 7) PANEL_FN(kind, 8) PANEL_FN(kind, 9) PANEL_FN(kind, 10) \
    PANEL_FN(kind, 11) PANEL_FN(kind, 12)                                                      \
    static const PanelFn kind##_panels[MR + 1] = {                                             \
        NULL, kind##_panel_1, kind##_panel_2, kind##_panel_3, kind##_panel_4, kind##_panel_5,  \
        kind##_panel_6, kind##_panel_7, kind##_panel_8, kind##_panel_9, kind##_panel_10,       \
        kind##_panel_11, kind##_panel_12};
PANEL_FNS(q4)
PANEL_FNS(q8)
PANEL_FNS(q4k)
PANEL_FNS(q6k)

/* The entry points. x: M x K float32 rows (contiguous), y: M x N; K and kc multiples of 32,
 * N of 32. Each thread takes whole panels, so a panel's bits never depend on which thread
 * ran it; guided, not static, so a thread the OS pauses for a neighbour does not hold its
 * share hostage (bench/contention.py, half a core taken, step p50 slowdown: 1 stream
 * 2.35-2.47x static -> 2.07x guided, 32 streams 1.74x -> 1.60x; quiet steps unchanged); a panel runs its rows in chunks of at most MR,
 * as even as possible (never a thin last chunk that pays a dequantization for a few rows).
 * The panel (12-30 KB) is still in L1/L2 when the next chunk reads it. */
static void gemm(const PanelFn* panels, long rec_bytes, const float* x, const uint8_t* w, float* y,
                 int M, int K, int N, int kc) {
    long panel_bytes = (long)(K / GROUP) * rec_bytes;
    int chunks = (M + MR - 1) / MR;
#pragma omp parallel for schedule(guided)
    for (int p = 0; p < N / PANEL; p++) {
        const uint8_t* P = w + p * panel_bytes;
        for (int c = 0; c < chunks; c++) {
            int m0 = (int)((long)M * c / chunks), mr = (int)((long)M * (c + 1) / chunks) - m0;
            panels[mr](x + (long)m0 * K, K, P, y + (long)m0 * N + p * PANEL, N, K, kc);
        }
    }
}

void stopline_q4_1_gemm(const float* x, const uint8_t* w, float* y, int M, int K, int N, int kc) {
    gemm(q4_panels, Q4_REC, x, w, y, M, K, N, kc);
}

void stopline_q8_0_gemm(const float* x, const uint8_t* w, float* y, int M, int K, int N, int kc) {
    gemm(q8_panels, Q8_REC, x, w, y, M, K, N, kc);
}

void stopline_q4_k_gemm(const float* x, const uint8_t* w, float* y, int M, int K, int N, int kc) {
    gemm(q4k_panels, Q4K_REC, x, w, y, M, K, N, kc);
}

void stopline_q6_k_gemm(const float* x, const uint8_t* w, float* y, int M, int K, int N, int kc) {
    gemm(q6k_panels, Q6K_REC, x, w, y, M, K, N, kc);
}
