/* y = x @ w.T for weights kept in their GGUF block formats, dequantized in registers.
 *
 * Why: a lone decode reads every weight once a step, so its speed is the bytes it reads.
 * Q4_1 weights are 5 bits each here against 32 as float32.
 *
 * Every output element is summed in exactly the order the GEMM library uses on the
 * dequantized float32 weights: the k range is cut into blocks of `kc`, each block is one
 * sequential FMA chain from zero, and the blocks' sums are added in order (MKL: kc = 288
 * for K = 576, 384 for K = 1536; oneDNN: kc = 512 / 1024). The caller finds kc by probing
 * and uses this kernel only where the bits match, so a row's result never depends on which
 * path ran it. Dequantization is exact: d * q is exact in float32 (11 + 4 bits), so
 * fma(d, q, m) equals gguf's (d * q) + m, and likewise d * q for Q8_0 (11 + 8 bits).
 *
 * Packed layouts (built by stopline/model/quant_linear.py), in panels of 32 output columns,
 * panel-major, then one record per group of 32 k:
 *   Q4_1: d[32] f16, m[32] f16, then 16 k-pairs x 32 bytes (low nibble k even, high k odd)
 *   Q8_0: d[32] f16, then 32 k x 32 int8
 */
#include <immintrin.h>
#include <stdint.h>

#define PANEL 32
#define GROUP 32
#define Q4_REC (PANEL * 2 * 2 + GROUP / 2 * PANEL)
#define Q8_REC (PANEL * 2 + GROUP * PANEL)
#define MR 8

static inline void q4_deq(const uint8_t* rec, int pair, __m512 d0, __m512 d1, __m512 m0, __m512 m1,
                          __m512* we0, __m512* we1, __m512* wo0, __m512* wo1) {
    __m256i v = _mm256_loadu_si256((const __m256i*)(rec + 128 + pair * PANEL));
    __m512i a = _mm512_cvtepu8_epi32(_mm256_castsi256_si128(v));
    __m512i b = _mm512_cvtepu8_epi32(_mm256_extracti128_si256(v, 1));
    __m512i f = _mm512_set1_epi32(15);
    *we0 = _mm512_fmadd_ps(d0, _mm512_cvtepi32_ps(_mm512_and_si512(a, f)), m0);
    *we1 = _mm512_fmadd_ps(d1, _mm512_cvtepi32_ps(_mm512_and_si512(b, f)), m1);
    *wo0 = _mm512_fmadd_ps(d0, _mm512_cvtepi32_ps(_mm512_srli_epi32(a, 4)), m0);
    *wo1 = _mm512_fmadd_ps(d1, _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), m1);
}

static inline __m512 f16x16(const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}

/* A block's sums into y: the first block is stored, each later one added to what is there
 * (the library's order: blocks summed in turn). */
static inline void add_block(__m512 acc[][2], float* y, long ldy, int mr, int first) {
    for (int r = 0; r < mr; r++) {
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
static inline void q4_panel(const float* x, long ldx, const uint8_t* P, float* y, long ldy,
                            int mr, int K, int kc) {
    __m512 acc[MR][2];
    for (int k0 = 0; k0 < K; k0 += kc) {
        int k1 = k0 + kc < K ? k0 + kc : K;
        for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int g = k0 / GROUP; g < k1 / GROUP; g++) {
            const uint8_t* rec = P + (long)g * Q4_REC;
            __m512 d0 = f16x16(rec), d1 = f16x16(rec + 32), m0 = f16x16(rec + 64), m1 = f16x16(rec + 96);
            const float* xk = x + g * GROUP;
            for (int p = 0; p < GROUP / 2; p++) {
                __m512 we0, we1, wo0, wo1;
                q4_deq(rec, p, d0, d1, m0, m1, &we0, &we1, &wo0, &wo1);
                for (int r = 0; r < mr; r++) {
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

static inline void q8_panel(const float* x, long ldx, const uint8_t* P, float* y, long ldy,
                            int mr, int K, int kc) {
    __m512 acc[MR][2];
    for (int k0 = 0; k0 < K; k0 += kc) {
        int k1 = k0 + kc < K ? k0 + kc : K;
        for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int g = k0 / GROUP; g < k1 / GROUP; g++) {
            const uint8_t* rec = P + (long)g * Q8_REC;
            __m512 d0 = f16x16(rec), d1 = f16x16(rec + 32);
            const float* xk = x + g * GROUP;
            for (int k = 0; k < GROUP; k++) {
                __m256i v = _mm256_loadu_si256((const __m256i*)(rec + 64 + k * PANEL));
                __m512 w0 = _mm512_mul_ps(d0, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v))));
                __m512 w1 = _mm512_mul_ps(d1, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1))));
                for (int r = 0; r < mr; r++) {
                    __m512 xv = _mm512_set1_ps(xk[r * ldx + k]);
                    acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
                    acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
                }
            }
        }
        add_block(acc, y, ldy, mr, k0 == 0);
    }
}

#define DISPATCH(fn)                                                                      \
    switch (mr) {                                                                         \
    case 1: fn(xr, K, P, yr, N, 1, K, kc); break;                                         \
    case 2: fn(xr, K, P, yr, N, 2, K, kc); break;                                         \
    case 3: fn(xr, K, P, yr, N, 3, K, kc); break;                                         \
    case 4: fn(xr, K, P, yr, N, 4, K, kc); break;                                         \
    case 5: fn(xr, K, P, yr, N, 5, K, kc); break;                                         \
    case 6: fn(xr, K, P, yr, N, 6, K, kc); break;                                         \
    case 7: fn(xr, K, P, yr, N, 7, K, kc); break;                                         \
    default: fn(xr, K, P, yr, N, 8, K, kc); break;                                        \
    }

/* The entry points: panels split over the threads, rows in chunks of MR.
 * x: M x K float32 rows (contiguous), y: M x N. K and kc multiples of 32, N of 32. */
#define GEMM(name, rec_bytes, panel_fn)                                                   \
    void name(const float* x, const uint8_t* w, float* y, int M, int K, int N, int kc) {  \
        long panel_bytes = (long)(K / GROUP) * rec_bytes;                                 \
        _Pragma("omp parallel for schedule(static)")                                      \
        for (int p = 0; p < N / PANEL; p++) {                                             \
            const uint8_t* P = w + p * panel_bytes;                                       \
            for (int m0 = 0; m0 < M; m0 += MR) {                                          \
                int mr = M - m0 < MR ? M - m0 : MR;                                       \
                const float* xr = x + (long)m0 * K;                                       \
                float* yr = y + (long)m0 * N + p * PANEL;                                 \
                DISPATCH(panel_fn)                                                        \
            }                                                                             \
        }                                                                                 \
    }

GEMM(stopline_q4_1_gemm, Q4_REC, q4_panel)
GEMM(stopline_q8_0_gemm, Q8_REC, q8_panel)
