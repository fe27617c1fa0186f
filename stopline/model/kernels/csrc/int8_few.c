/* The int8 kernel's panels for a few rows (1 to 3: decode of one to three streams) of Q4_1,
 * Q4_K, Q8_0 and Q6_K weights: int8_gemm.c's i8_panel arithmetic, bit for bit, with fewer
 * instructions for the 4-bit formats and a software prefetch where it pays.
 *
 * Fewer instructions. i8_panel splits each 64-byte step of a 4-bit record into its two
 * nibbles (and, shift, and) and sums each half apart. Here the step's bytes v go into
 * vpdpbusd as they are, beside their high nibbles h = v & 0xf0:
 *     A = sum v * q = S_lo + 16 S_hi,   B = sum h * q = 16 S_hi,
 * so S_lo = A - B and S_hi = B >> 4, exactly (integer sums, |A| < 2^21): one and a step
 * instead of three. The float steps after the integer sums are i8_panel's, in its order.
 * SmolLM2's Q4_1 layers at one row on one thread of the Intel Xeon host, 200 passes
 * alternated with i8_panel: 1.43 against 1.69 ms (median) from L2 (the first three linears
 * over and over); from L3 or memory (all 30 layers) level, bound there by what one core reads.
 *
 * Prefetch. On the Intel Xeon host, with each record fetched 2-8 KiB ahead into L1, a
 * one-stream step's linears took 6-48% less time (medians of steps alternated in one
 * process, one and two threads, a shared host) and the kernel alone 12%; on the AMD EPYC (Zen 4)
 * host every prefetch tried slowed it (int8_gemm.c). So the distance is a setting,
 * stopline_int8_prefetch, which native.py makes 4096 on Intel and 0 elsewhere. Prefetches
 * past a weight's end are hints that never fault. (docs/benchmarks.md, "One stream on the
 * Intel Xeon host".)
 *
 * Layout, formulas and the record sizes: int8_gemm.c (panels of 32 columns; Q4_K's record is
 * Q4_1's with float32 scales and minima).
 */
#include <immintrin.h>
#include <stdint.h>

#include "int8_epilogue.h"
#include "panel.h"

#define GROUP 32
#define Q4_REC (PANEL * 2 * 2 + GROUP / 2 * PANEL)
#define Q4K_REC (PANEL * 4 * 2 + GROUP / 2 * PANEL)
#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")))

/* int8_gemm.c's PanelFn for `name` at n rows: one signature for every format, whose body is
 * `call` (Q4 formats read x's ds, Q8_0 and Q6_K x's sums xs). */
#define FEW_FN(name, n, call)                                                                    \
    TARGET void stopline_##name##_i8_few_##n(const int8_t* xq, const float* xd, const float* xds, \
                                             const int32_t* xs, int K, const uint8_t* P, float* y, \
                                             long ldy) {                                           \
        (void)xds;                                                                                 \
        (void)xs;                                                                                  \
        call;                                                                                      \
    }

/* Bytes ahead of the record in use that a pass fetches into L1, 0: none (the default; see
 * stopline_int8_prefetch). */
static int prefetch_ahead;

/* Sets the few-row panels' prefetch distance in bytes (0 turns it off); returns the old one. */
int stopline_int8_prefetch(int bytes) {
    int old = prefetch_ahead;
    prefetch_ahead = bytes > 0 ? bytes : 0;
    return old;
}

static inline TARGET __m512 f16x16(const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}

static inline TARGET __attribute__((always_inline)) void
q4_few(const int8_t* xq, const float* xd, const float* xds, int K, const uint8_t* P, float* y,
       long ldy, const int mr, const int f32) {
    const int groups = K / GROUP;
    const long rec_bytes = f32 ? Q4K_REC : Q4_REC;
    const int head = f32 ? 256 : 128; /* bytes of scales and minima before the quants */
    const long ahead = prefetch_ahead;
    const __m512i high = _mm512_set1_epi8((char)0xf0);
    __m512 acc[3][2];
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        const uint8_t* rec = P + (long)g * rec_bytes;
        if (ahead)
            for (long c = 0; c < rec_bytes; c += 64) _mm_prefetch((const char*)(rec + ahead + c), _MM_HINT_T0);
        /* even and odd steps apart: more vpdpbusd chains in flight (integer sums: any order) */
        __m512i a[3][2], b[3][2];
        for (int r = 0; r < mr; r++) a[r][0] = a[r][1] = b[r][0] = b[r][1] = _mm512_setzero_si512();
        _Pragma("GCC unroll 8") for (int t = 0; t < GROUP / 4; t++) {
            __m512i v = _mm512_loadu_si512((const void*)(rec + head + t * 64));
            __m512i h = _mm512_and_si512(v, high);
            for (int r = 0; r < mr; r++) {
                __m512i xv = _mm512_set1_epi32(*(const int32_t*)(xq + (long)r * K + g * GROUP + 4 * t));
                a[r][t & 1] = _mm512_dpbusd_epi32(a[r][t & 1], v, xv);
                b[r][t & 1] = _mm512_dpbusd_epi32(b[r][t & 1], h, xv);
            }
        }
        const float* fs = (const float*)rec;
        __m512 d0 = f32 ? _mm512_loadu_ps(fs) : f16x16(rec), d1 = f32 ? _mm512_loadu_ps(fs + 16) : f16x16(rec + 32);
        __m512 m0 = f32 ? _mm512_loadu_ps(fs + 32) : f16x16(rec + 64);
        __m512 m1 = f32 ? _mm512_loadu_ps(fs + 48) : f16x16(rec + 96);
        for (int r = 0; r < mr; r++) {
            __m512i A = _mm512_add_epi32(a[r][0], a[r][1]), B = _mm512_add_epi32(b[r][0], b[r][1]);
            __m512i lo = _mm512_sub_epi32(A, B), hi = _mm512_srai_epi32(B, 4);
            long i = (long)r * groups + g;
            __m512 xdr = _mm512_set1_ps(xd[i]), xdsr = _mm512_set1_ps(xds[i]);
            acc[r][0] = i8_q4_group(acc[r][0], lo, d0, m0, xdr, xdsr);
            acc[r][1] = i8_q4_group(acc[r][1], hi, d1, m1, xdr, xdsr);
        }
    }
    for (int r = 0; r < mr; r++) {
        _mm512_storeu_ps(y + r * ldy, acc[r][0]);
        _mm512_storeu_ps(y + r * ldy + 16, acc[r][1]);
    }
}

/* Q8_0 (the LM head's format in SmolLM2's GGUF): i8_panel's steps as they are, with the
 * prefetch. Its record: dw[32] f16, then 8 steps of 128 bytes, v + 128 of columns 0-15 in the
 * first 64 and of 16-31 in the second; x's offset 128 * s comes off each exact sum. */
#define Q8_REC (PANEL * 2 + GROUP * PANEL)
static inline TARGET __attribute__((always_inline)) void
q8_few(const int8_t* xq, const float* xd, const int32_t* xs, int K, const uint8_t* P, float* y,
       long ldy, const int mr) {
    const int groups = K / GROUP;
    const long ahead = prefetch_ahead;
    __m512 acc[3][2];
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        const uint8_t* rec = P + (long)g * Q8_REC;
        if (ahead)
            for (long c = 0; c < Q8_REC; c += 64) _mm_prefetch((const char*)(rec + ahead + c), _MM_HINT_T0);
        __m512i a[3][2], b[3][2]; /* even steps' sums of each half, odd steps' */
        for (int r = 0; r < mr; r++) a[r][0] = a[r][1] = b[r][0] = b[r][1] = _mm512_setzero_si512();
        _Pragma("GCC unroll 8") for (int t = 0; t < GROUP / 4; t++) {
            __m512i w0 = _mm512_loadu_si512((const void*)(rec + 64 + t * 128));
            __m512i w1 = _mm512_loadu_si512((const void*)(rec + 64 + t * 128 + 64));
            for (int r = 0; r < mr; r++) {
                __m512i xv = _mm512_set1_epi32(*(const int32_t*)(xq + (long)r * K + g * GROUP + 4 * t));
                if (t & 1) {
                    b[r][0] = _mm512_dpbusd_epi32(b[r][0], w0, xv);
                    b[r][1] = _mm512_dpbusd_epi32(b[r][1], w1, xv);
                } else {
                    a[r][0] = _mm512_dpbusd_epi32(a[r][0], w0, xv);
                    a[r][1] = _mm512_dpbusd_epi32(a[r][1], w1, xv);
                }
            }
        }
        __m512 d0 = f16x16(rec), d1 = f16x16(rec + 32);
        for (int r = 0; r < mr; r++) {
            long i = (long)r * groups + g;
            __m512i off = _mm512_set1_epi32(128 * xs[i]);
            __m512 xdr = _mm512_set1_ps(xd[i]);
            __m512i s0 = _mm512_add_epi32(a[r][0], b[r][0]), s1 = _mm512_add_epi32(a[r][1], b[r][1]);
            acc[r][0] = i8_q8_group(acc[r][0], s0, off, d0, xdr);
            acc[r][1] = i8_q8_group(acc[r][1], s1, off, d1, xdr);
        }
    }
    for (int r = 0; r < mr; r++) {
        _mm512_storeu_ps(y + r * ldy, acc[r][0]);
        _mm512_storeu_ps(y + r * ldy + 16, acc[r][1]);
    }
}

FEW_FN(q8_0, 1, q8_few(xq, xd, xs, K, P, y, ldy, 1))
FEW_FN(q8_0, 2, q8_few(xq, xd, xs, K, P, y, ldy, 2))
FEW_FN(q8_0, 3, q8_few(xq, xd, xs, K, P, y, ldy, 3))

/* Q6_K: i8_panel's steps too, with the prefetch. Its record: s0[32], s1[32] float32 (the
 * scales of k 0-15 and of k 16-31), then Q8_0's 8 steps of q + 128; steps 0-3 are the first
 * half, 4-7 the second, each with its own exact sum and x's offset (xs: x's sums per 16 k). */
#define Q6K_REC (PANEL * 4 * 2 + GROUP * PANEL)
static inline TARGET __attribute__((always_inline)) void
q6k_few(const int8_t* xq, const float* xd, const int32_t* xs, int K, const uint8_t* P, float* y,
        long ldy, const int mr) {
    const int groups = K / GROUP;
    const long ahead = prefetch_ahead;
    __m512 acc[3][2];
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        const uint8_t* rec = P + (long)g * Q6K_REC;
        if (ahead)
            for (long c = 0; c < Q6K_REC; c += 64) _mm_prefetch((const char*)(rec + ahead + c), _MM_HINT_T0);
        __m512i lo[3][2], hi[3][2]; /* steps 0-3 (k 0-15), steps 4-7 (k 16-31) */
        for (int r = 0; r < mr; r++) lo[r][0] = lo[r][1] = hi[r][0] = hi[r][1] = _mm512_setzero_si512();
        _Pragma("GCC unroll 8") for (int t = 0; t < GROUP / 4; t++) {
            __m512i w0 = _mm512_loadu_si512((const void*)(rec + 256 + t * 128));
            __m512i w1 = _mm512_loadu_si512((const void*)(rec + 256 + t * 128 + 64));
            for (int r = 0; r < mr; r++) {
                __m512i xv = _mm512_set1_epi32(*(const int32_t*)(xq + (long)r * K + g * GROUP + 4 * t));
                if (t >= 4) {
                    hi[r][0] = _mm512_dpbusd_epi32(hi[r][0], w0, xv);
                    hi[r][1] = _mm512_dpbusd_epi32(hi[r][1], w1, xv);
                } else {
                    lo[r][0] = _mm512_dpbusd_epi32(lo[r][0], w0, xv);
                    lo[r][1] = _mm512_dpbusd_epi32(lo[r][1], w1, xv);
                }
            }
        }
        const float* fs = (const float*)rec;
        __m512 d0 = _mm512_loadu_ps(fs), d1 = _mm512_loadu_ps(fs + 16);
        __m512 e0 = _mm512_loadu_ps(fs + 32), e1 = _mm512_loadu_ps(fs + 48);
        for (int r = 0; r < mr; r++) {
            long i = (long)r * groups + g;
            __m512i off_lo = _mm512_set1_epi32(128 * xs[2 * i]), off_hi = _mm512_set1_epi32(128 * xs[2 * i + 1]);
            __m512 xdr = _mm512_set1_ps(xd[i]);
            acc[r][0] = i8_q8_group(acc[r][0], lo[r][0], off_lo, d0, xdr);
            acc[r][1] = i8_q8_group(acc[r][1], lo[r][1], off_lo, d1, xdr);
            acc[r][0] = i8_q8_group(acc[r][0], hi[r][0], off_hi, e0, xdr);
            acc[r][1] = i8_q8_group(acc[r][1], hi[r][1], off_hi, e1, xdr);
        }
    }
    for (int r = 0; r < mr; r++) {
        _mm512_storeu_ps(y + r * ldy, acc[r][0]);
        _mm512_storeu_ps(y + r * ldy + 16, acc[r][1]);
    }
}

FEW_FN(q6_k, 1, q6k_few(xq, xd, xs, K, P, y, ldy, 1))
FEW_FN(q6_k, 2, q6k_few(xq, xd, xs, K, P, y, ldy, 2))
FEW_FN(q6_k, 3, q6k_few(xq, xd, xs, K, P, y, ldy, 3))

FEW_FN(q4_1, 1, q4_few(xq, xd, xds, K, P, y, ldy, 1, 0))
FEW_FN(q4_1, 2, q4_few(xq, xd, xds, K, P, y, ldy, 2, 0))
FEW_FN(q4_1, 3, q4_few(xq, xd, xds, K, P, y, ldy, 3, 0))
FEW_FN(q4_k, 1, q4_few(xq, xd, xds, K, P, y, ldy, 1, 1))
FEW_FN(q4_k, 2, q4_few(xq, xd, xds, K, P, y, ldy, 2, 1))
FEW_FN(q4_k, 3, q4_few(xq, xd, xds, K, P, y, ldy, 3, 1))
