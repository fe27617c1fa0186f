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
#include <stdlib.h>

#define PANEL 32
#define GROUP 32
#define Q4_REC (PANEL * 2 * 2 + GROUP / 2 * PANEL)
#define Q8_REC (PANEL * 2 + GROUP * PANEL)
#define MR 8
#define AHEAD_BYTES 4096

/* Bytes of weights a pass fetches ahead of the record it reads. Panels lie one after another,
 * but the hardware prefetcher stops at each 4 KB page, and a small batch is bound by how fast
 * the weights stream in: a step of a few rows reads ~100 MB of them (SmolLM2). Measured on the
 * layers' weights, interleaved with the kernel without it: 14% less time at one row, 8% at
 * four, none from eight (compute bound). A prefetch past the end of the weights is harmless:
 * prefetches do not fault. Tall chunks (9 rows and more) do without: measured, it made no
 * difference to them. */
static inline void fetch_ahead(const uint8_t* rec, int bytes) {
    for (int o = 0; o < bytes; o += 64) _mm_prefetch((const char*)(rec + AHEAD_BYTES + o), _MM_HINT_T0);
}

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
            fetch_ahead(rec, Q4_REC);
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
            fetch_ahead(rec, Q8_REC);
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

/* Taller batches: 16 columns (half a panel) against up to TALL rows at once. A weight is
 * dequantized once per row chunk, so its cost (about 3.5 instructions a k against one FMA
 * a row) shrinks as the chunk grows: 8 rows of 32 columns spend ~30% of the issue slots on
 * it, 24 rows of 16 about 13%. Each output is still one FMA chain per kc block, k in order.
 * The chunk's rows are first packed k-major (xp[k * mr + r]), so every broadcast is one
 * base register plus a constant: 24 row pointers would not fit in the registers. */
#define TALL 24
#define UNROLL _Pragma("GCC unroll 24")

static inline __attribute__((always_inline)) void
q4_half(const float* xp, const uint8_t* P, int half, float* y, long ldy, int mr, int K, int kc) {
    __m512 acc[TALL];
    const __m512i f = _mm512_set1_epi32(15);
    for (int k0 = 0; k0 < K; k0 += kc) {
        int k1 = k0 + kc < K ? k0 + kc : K;
        UNROLL for (int r = 0; r < mr; r++) acc[r] = _mm512_setzero_ps();
        for (int g = k0 / GROUP; g < k1 / GROUP; g++) {
            const uint8_t* rec = P + (long)g * Q4_REC;
            __m512 d = f16x16(rec + half * 32), m = f16x16(rec + 64 + half * 32);
            const float* xk = xp + (long)g * GROUP * mr;
            for (int p = 0; p < GROUP / 2; p++) {
                __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(rec + 128 + p * PANEL + half * 16)));
                __m512 we = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(a, f)), m);
                __m512 wo = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(a, 4)), m);
                const float* xe = xk + 2 * p * mr;
                /* every row's even k, then every row's odd k: each chain still goes k, k + 1 */
                UNROLL for (int r = 0; r < mr; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xe[r]), we, acc[r]);
                UNROLL for (int r = 0; r < mr; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xe[mr + r]), wo, acc[r]);
            }
        }
        UNROLL for (int r = 0; r < mr; r++) {
            if (k0) acc[r] = _mm512_add_ps(_mm512_loadu_ps(y + r * ldy), acc[r]);
            _mm512_storeu_ps(y + r * ldy, acc[r]);
        }
    }
}

static inline __attribute__((always_inline)) void
q8_half(const float* xp, const uint8_t* P, int half, float* y, long ldy, int mr, int K, int kc) {
    __m512 acc[TALL];
    for (int k0 = 0; k0 < K; k0 += kc) {
        int k1 = k0 + kc < K ? k0 + kc : K;
        UNROLL for (int r = 0; r < mr; r++) acc[r] = _mm512_setzero_ps();
        for (int g = k0 / GROUP; g < k1 / GROUP; g++) {
            const uint8_t* rec = P + (long)g * Q8_REC;
            __m512 d = f16x16(rec + half * 32);
            const float* xk = xp + (long)g * GROUP * mr;
            for (int k = 0; k < GROUP; k++) {
                __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(rec + 64 + k * PANEL + half * 16)));
                __m512 w = _mm512_mul_ps(d, _mm512_cvtepi32_ps(v));
                UNROLL for (int r = 0; r < mr; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xk[k * mr + r]), w, acc[r]);
            }
        }
        UNROLL for (int r = 0; r < mr; r++) {
            if (k0) acc[r] = _mm512_add_ps(_mm512_loadu_ps(y + r * ldy), acc[r]);
            _mm512_storeu_ps(y + r * ldy, acc[r]);
        }
    }
}

/* The row count is a constant in each case, so the accumulators stay in registers. */
#define CASE(fn, n) case n: fn(n); break;
#define SHORT_CASES(fn) CASE(fn, 1) CASE(fn, 2) CASE(fn, 3) CASE(fn, 4) CASE(fn, 5) CASE(fn, 6) \
    CASE(fn, 7) default: fn(8); break;
#define TALL_CASES(fn) CASE(fn, 9) CASE(fn, 10) CASE(fn, 11) CASE(fn, 12) CASE(fn, 13)          \
    CASE(fn, 14) CASE(fn, 15) CASE(fn, 16) CASE(fn, 17) CASE(fn, 18) CASE(fn, 19) CASE(fn, 20) \
    CASE(fn, 21) CASE(fn, 22) CASE(fn, 23) default: fn(24); break;

/* The packed rows of the calling thread, kept between calls (one step calls ~120 times). */
static __thread float* pack_buf;
static __thread long pack_cap;

static float* pack_space(long floats) {
    if (floats > pack_cap) {
        free(pack_buf);
        pack_cap = 0;
        if (posix_memalign((void**)&pack_buf, 64, (size_t)floats * sizeof(float))) {
            pack_buf = NULL;
            return NULL;
        }
        pack_cap = floats;
    }
    return pack_buf;
}

/* The entry points. x: M x K float32 rows (contiguous), y: M x N; K and kc multiples of 32,
 * N of 32. Up to 8 rows: whole panels, all rows at once. More: rows in chunks of at most
 * TALL, as even as possible (never a thin last chunk that pays a dequantization for a few
 * rows), over half panels; if the packing space cannot be had, chunks of 8 rows as above. */
#define GEMM(name, rec_bytes)                                                                 \
    void name(const float* x, const uint8_t* w, float* y, int M, int K, int N, int kc) {      \
        long panel_bytes = (long)(K / GROUP) * rec_bytes;                                     \
        float* xp = M > MR ? pack_space((long)M * K) : NULL;                                  \
        if (xp == NULL) {                                                                     \
            _Pragma("omp parallel for schedule(static)")                                      \
            for (int p = 0; p < N / PANEL; p++) {                                             \
                const uint8_t* P = w + p * panel_bytes;                                       \
                for (int m0 = 0; m0 < M; m0 += MR) {                                          \
                    const float* xr = x + (long)m0 * K;                                       \
                    float* yr = y + (long)m0 * N + p * PANEL;                                 \
                    switch (M - m0) { SHORT_CASES(PANEL_CALL) }                               \
                }                                                                             \
            }                                                                                 \
            return;                                                                           \
        }                                                                                     \
        int chunks = (M + TALL - 1) / TALL;                                                   \
        _Pragma("omp parallel")                                                               \
        {                                                                                     \
            _Pragma("omp for schedule(static)")                                               \
            for (int k = 0; k < K; k++)                                                       \
                for (int c = 0; c < chunks; c++) {                                            \
                    int m0 = (int)((long)M * c / chunks), mr = (int)((long)M * (c + 1) / chunks) - m0; \
                    for (int r = 0; r < mr; r++)                                              \
                        xp[(long)m0 * K + (long)k * mr + r] = x[(long)(m0 + r) * K + k];       \
                }                                                                             \
            _Pragma("omp for schedule(static)")                                               \
            for (int h = 0; h < N / 16; h++) {                                                \
                const uint8_t* P = w + (h / 2) * panel_bytes;                                 \
                int half = h % 2;                                                             \
                for (int c = 0; c < chunks; c++) {                                            \
                    int m0 = (int)((long)M * c / chunks), mr = (int)((long)M * (c + 1) / chunks) - m0; \
                    const float* xc = xp + (long)m0 * K;                                      \
                    float* yr = y + (long)m0 * N + h * 16;                                    \
                    switch (mr) { TALL_CASES(HALF_CALL) }                                     \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
    }

#define PANEL_CALL(n) q4_panel(xr, K, P, yr, N, n, K, kc)
#define HALF_CALL(n) q4_half(xc, P, half, yr, N, n, K, kc)
GEMM(stopline_q4_1_gemm, Q4_REC)
#undef PANEL_CALL
#undef HALF_CALL
#define PANEL_CALL(n) q8_panel(xr, K, P, yr, N, n, K, kc)
#define HALF_CALL(n) q8_half(xc, P, half, yr, N, n, K, kc)
GEMM(stopline_q8_0_gemm, Q8_REC)
