/* y = x @ w.T for Q4_1 and Q8_0 weights against activations quantized to int8 (AVX512-VNNI
 * vpdpbusd): the "fast" numerics mode's arithmetic for block weights (docs/numerics.md).
 *
 * Why: at one row the exact kernel (quant_gemm.c) and the bf16 one (bf16_gemm.c) spend more
 * time dequantizing each weight to a float than reading it (~100 us a SmolLM2 layer from
 * cache against ~65 us to stream its 2.2 MB), so a one-stream step is bound by arithmetic. Here
 * a weight is a byte lane of vpdpbusd, 64 products an instruction, and its group's scale is
 * applied once per 32 k: the step is left bound by its reads.
 *
 * Arithmetic. Each row of x is quantized per group of 32 k (stopline_quantize_rows): d =
 * max|x| / 127, q = round-to-nearest-even(x * (1 / d)), s = sum of the group's q, ds = d * s.
 * Then for each output element, over the groups g in k order, in fp32:
 *     Q4_1 (w = dw * u + mw, u in 0..15):   acc = fma(float(sum u * q), dw * d, acc)
 *                                           acc = fma(mw, ds, acc)
 *     Q8_0 (w = dw * v, v in -128..127):    acc = fma(float(sum v * q), dw * d, acc)
 * (int8_epilogue.h holds these float steps, once, for every int8 path: this file's panels,
 * int8_rows.c, int8_few.c and amx_i8_gemm.c.)
 * A group's integer sum is exact whatever order vpdpbusd adds in, and the float steps are one
 * chain per output in group order, so a row's bits depend on its own values and the weight
 * alone: never on the other rows, how they are chunked, or which thread runs the panel.
 * A group with a NaN or an infinity gets d = ds = NaN, so its rows' outputs are NaN (as the
 * float kernels' would be) rather than finite garbage the engine's bad-row check would miss.
 *
 * Packed layouts (stopline/model/kernels/int8_linear.py), panels of 32 output columns,
 * panel-major, one record per group of 32 k; step t (8 per group) covers k = 4t .. 4t+3:
 *   Q4_1: dw[32] f16, mw[32] f16, then 8 steps x 64 bytes: byte 4c + j holds column c's
 *         u at k = 4t + j in its low nibble and column 16 + c's in its high one   (640 B)
 *   Q8_0: dw[32] f16, then 8 steps x 128 bytes: byte 4c + j of the first 64 holds column
 *         c's v + 128 at k = 4t + j, of the second 64 column 16 + c's              (1088 B)
 * (Q8_0 is stored offset to unsigned, vpdpbusd's unsigned operand; the offset's 128 * s is
 * taken off the exact integer sum.)
 *   Q4_K: Q4_1's with dw[32] and mw[32] float32: d * sc and -(dmin * m) of the group's
 *         sub-block (quant_linear.kquant_parts), then Q4_1's 8 steps             (768 B)
 *   Q6_K: s0[32], s1[32] float32 (d * sc of k 0-15, of k 16-31), then Q8_0's 8 steps of
 *         q + 128 (q in -32..31). Each half has its own scale, so its own integer sum and
 *         offset (the caller passes x's sums per 16 k as s):                   (1280 B)
 *             acc = fma(float(sum_lo v * q), s0 * d, acc); acc = fma(float(sum_hi v * q), s1 * d, acc)
 *
 * Compiled for VNNI by attribute, as bf16_gemm.c is for BF16; the caller checks the CPU flag.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "int8_epilogue.h"
#include "panel.h"

#define GROUP 32
#define Q4_REC (PANEL * 2 * 2 + GROUP / 2 * PANEL)
#define Q8_REC (PANEL * 2 + GROUP * PANEL)
#define Q4K_REC (PANEL * 4 * 2 + GROUP / 2 * PANEL)
#define Q6K_REC (PANEL * 4 * 2 + GROUP * PANEL)
enum { F_Q4_1, F_Q8_0, F_Q4_K, F_Q6_K };
/* Rows a pass carries: per row two int32 group sums and two fp32 accumulators (16 columns
 * each), so 6 rows take 24 of the 32 vector registers, the rest the weights and scales. */
#define MR 6
#define UNROLL _Pragma("GCC unroll 6")
#define SPLIT_ROWS 3
/* No software prefetch (fetch.h): on the AMD EPYC (Zen 4) host the hardware prefetcher
 * streams these records on its own, and the prefetch instructions only took issue slots.
 * SmolLM2's 30 layers and head at one row, interleaved, three runs: 2.95-3.43 ms without,
 * 3.47-3.82 ms with fetch_record's 2 KiB + 12 KiB, 3.56-4.15 ms with 2 KiB alone. One thread
 * alone (bench/int8_stream.py): 26 GB/s without, 21-24 with each record fetched 4-16 KiB ahead
 * into L1, L2 or non-temporally. On the Intel Xeon host the opposite held at 1-3 rows, so
 * int8_few.c's panels (which take those rows) prefetch there, by CPU vendor (native.py). */
#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")))

/* x: M x K float32 -> q: M x K int8, d, ds: M x K/32 float, s: M x K/32 int32. K a multiple
 * of 32. Rows in parallel when there are enough of them to pay for waking a thread. */
TARGET void stopline_quantize_rows(const float* x, int M, int K, int8_t* q, float* d, float* ds,
                                   int32_t* s) {
    int groups = K / GROUP;
    long total = (long)M * groups;
    const __m512 big = _mm512_set1_ps(3.402823466e38f);
#pragma omp parallel for schedule(static) if ((long)M * K >= 16384)
    for (long i = 0; i < total; i++) {
        long r = i / groups, g = i % groups;
        const float* xg = x + r * K + g * GROUP;
        __m512 a = _mm512_loadu_ps(xg), b = _mm512_loadu_ps(xg + 16);
        __m512 aa = _mm512_abs_ps(a), ab = _mm512_abs_ps(b);
        /* NaN or infinity: not <= the largest float */
        int bad = _mm512_cmp_ps_mask(aa, big, _CMP_NLE_UQ) | _mm512_cmp_ps_mask(ab, big, _CMP_NLE_UQ);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(aa, ab));
        float dg = amax / 127.0f, inv = dg != 0.0f ? 1.0f / dg : 0.0f;
        if (bad) dg = NAN, inv = 0.0f;
        __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));
        __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inv)));
        int8_t* qg = q + r * K + g * GROUP;
        _mm_storeu_si128((__m128i*)qg, _mm512_cvtsepi32_epi8(qa));
        _mm_storeu_si128((__m128i*)(qg + 16), _mm512_cvtsepi32_epi8(qb));
        int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
        d[i] = dg;
        ds[i] = dg * (float)sum;
        s[i] = sum;
    }
}

static inline TARGET __m512 f16x16(const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}

/* One panel (32 columns) for rows [0, mr); fmt selects the record format. The group sums of
 * all mr rows are finished before any is scaled, so the weights are unpacked once a pass. */
static inline TARGET __attribute__((always_inline)) void
i8_panel(const int8_t* xq, const float* xd, const float* xds, const int32_t* xs, int K,
         const uint8_t* P, float* y, long ldy, int mr, int fmt) {
    const int groups = K / GROUP;
    const int q8 = fmt == F_Q8_0 || fmt == F_Q6_K, k6 = fmt == F_Q6_K, f32 = fmt >= F_Q4_K;
    const long rec_bytes = fmt == F_Q4_1 ? Q4_REC : fmt == F_Q8_0 ? Q8_REC : fmt == F_Q4_K ? Q4K_REC : Q6K_REC;
    const int head = f32 ? 256 : q8 ? 64 : 128;  /* bytes of scales before the quants */
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512 acc[MR][2];
    UNROLL for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        const uint8_t* rec = P + g * rec_bytes;
        /* Few rows leave too few vpdpbusd chains to hide its latency: they sum the even and
         * the odd steps apart and add the two at the end (integer sums: the same bits). Q6_K
         * sums its two halves (steps 0-3, 4-7) apart, as "sum" and "odd", for their scales. */
        __m512i sum[MR][2], odd[MR][2];
        UNROLL for (int r = 0; r < mr; r++) sum[r][0] = sum[r][1] = odd[r][0] = odd[r][1] = _mm512_setzero_si512();
        _Pragma("GCC unroll 8") for (int t = 0; t < GROUP / 4; t++) {
            __m512i w0, w1;
            if (q8) {
                w0 = _mm512_loadu_si512((const void*)(rec + head + t * 128));
                w1 = _mm512_loadu_si512((const void*)(rec + head + t * 128 + 64));
            } else {
                __m512i v = _mm512_loadu_si512((const void*)(rec + head + t * 64));
                w0 = _mm512_and_si512(v, low);
                w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
            UNROLL for (int r = 0; r < mr; r++) {
                __m512i xv = _mm512_set1_epi32(*(const int32_t*)(xq + (long)r * K + g * GROUP + 4 * t));
                if (k6 ? t >= 4 : mr <= SPLIT_ROWS && (t & 1)) {
                    odd[r][0] = _mm512_dpbusd_epi32(odd[r][0], w0, xv);
                    odd[r][1] = _mm512_dpbusd_epi32(odd[r][1], w1, xv);
                } else {
                    sum[r][0] = _mm512_dpbusd_epi32(sum[r][0], w0, xv);
                    sum[r][1] = _mm512_dpbusd_epi32(sum[r][1], w1, xv);
                }
            }
        }
        if (!k6 && mr <= SPLIT_ROWS)
            UNROLL for (int r = 0; r < mr; r++) {
                sum[r][0] = _mm512_add_epi32(sum[r][0], odd[r][0]);
                sum[r][1] = _mm512_add_epi32(sum[r][1], odd[r][1]);
            }
        const float* fs = (const float*)rec;
        __m512 d0 = f32 ? _mm512_loadu_ps(fs) : f16x16(rec), d1 = f32 ? _mm512_loadu_ps(fs + 16) : f16x16(rec + 32);
        if (k6) {
            __m512 e0 = _mm512_loadu_ps(fs + 32), e1 = _mm512_loadu_ps(fs + 48);
            UNROLL for (int r = 0; r < mr; r++) {
                long i = (long)r * groups + g;
                __m512i off_lo = _mm512_set1_epi32(128 * xs[2 * i]), off_hi = _mm512_set1_epi32(128 * xs[2 * i + 1]);
                __m512 xdr = _mm512_set1_ps(xd[i]);
                acc[r][0] = i8_q8_group(acc[r][0], sum[r][0], off_lo, d0, xdr);
                acc[r][1] = i8_q8_group(acc[r][1], sum[r][1], off_lo, d1, xdr);
                acc[r][0] = i8_q8_group(acc[r][0], odd[r][0], off_hi, e0, xdr);
                acc[r][1] = i8_q8_group(acc[r][1], odd[r][1], off_hi, e1, xdr);
            }
        } else if (q8) {
            UNROLL for (int r = 0; r < mr; r++) {
                long i = (long)r * groups + g;
                __m512i off = _mm512_set1_epi32(128 * xs[i]);
                __m512 xdr = _mm512_set1_ps(xd[i]);
                acc[r][0] = i8_q8_group(acc[r][0], sum[r][0], off, d0, xdr);
                acc[r][1] = i8_q8_group(acc[r][1], sum[r][1], off, d1, xdr);
            }
        } else {
            __m512 m0 = f32 ? _mm512_loadu_ps(fs + 32) : f16x16(rec + 64);
            __m512 m1 = f32 ? _mm512_loadu_ps(fs + 48) : f16x16(rec + 96);
            UNROLL for (int r = 0; r < mr; r++) {
                long i = (long)r * groups + g;
                __m512 xdr = _mm512_set1_ps(xd[i]), xdsr = _mm512_set1_ps(xds[i]);
                acc[r][0] = i8_q4_group(acc[r][0], sum[r][0], d0, m0, xdr, xdsr);
                acc[r][1] = i8_q4_group(acc[r][1], sum[r][1], d1, m1, xdr, xdsr);
            }
        }
    }
    UNROLL for (int r = 0; r < mr; r++) {
        _mm512_storeu_ps(y + r * ldy, acc[r][0]);
        _mm512_storeu_ps(y + r * ldy + 16, acc[r][1]);
    }
}

/* One function per row count and format, the count a constant so the sums stay in registers. */
typedef void (*PanelFn)(const int8_t* xq, const float* xd, const float* xds, const int32_t* xs,
                        int K, const uint8_t* P, float* y, long ldy);
#define PANEL_FN(kind, isq8, n)                                                                  \
    static TARGET __attribute__((noinline)) void kind##_panel_##n(                              \
        const int8_t* xq, const float* xd, const float* xds, const int32_t* xs, int K,          \
        const uint8_t* P, float* y, long ldy) {                                                 \
        i8_panel(xq, xd, xds, xs, K, P, y, ldy, n, isq8);                                       \
    }
#define PANEL_FNS(kind, isq8)                                                                    \
    PANEL_FN(kind, isq8, 1) PANEL_FN(kind, isq8, 2) PANEL_FN(kind, isq8, 3)                      \
    PANEL_FN(kind, isq8, 4) PANEL_FN(kind, isq8, 5) PANEL_FN(kind, isq8, 6)                      \
    static const PanelFn kind##_panels[MR + 1] = {0, kind##_panel_1, kind##_panel_2,            \
                                                  kind##_panel_3, kind##_panel_4,               \
                                                  kind##_panel_5, kind##_panel_6};
PANEL_FNS(q4, F_Q4_1)
/* Q4_1, Q4_K, Q8_0 and Q6_K at 1-3 rows: int8_few.c's panels (the same bits; fewer instructions for
 * the 4-bit ones, and a software prefetch where stopline_int8_prefetch turns it on). */
#define FEW_DECL(kind, n)                                                                        \
    void stopline_##kind##_i8_few_##n(const int8_t*, const float*, const float*, const int32_t*, \
                                      int, const uint8_t*, float*, long);
FEW_DECL(q4_1, 1) FEW_DECL(q4_1, 2) FEW_DECL(q4_1, 3)
FEW_DECL(q4_k, 1) FEW_DECL(q4_k, 2) FEW_DECL(q4_k, 3)
FEW_DECL(q8_0, 1) FEW_DECL(q8_0, 2) FEW_DECL(q8_0, 3)
FEW_DECL(q6_k, 1) FEW_DECL(q6_k, 2) FEW_DECL(q6_k, 3)
static const PanelFn q4_few_panels[MR + 1] = {0, stopline_q4_1_i8_few_1, stopline_q4_1_i8_few_2,
                                              stopline_q4_1_i8_few_3, q4_panel_4, q4_panel_5,
                                              q4_panel_6};
PANEL_FNS(q8, F_Q8_0)
static const PanelFn q8_few_panels[MR + 1] = {0, stopline_q8_0_i8_few_1, stopline_q8_0_i8_few_2,
                                              stopline_q8_0_i8_few_3, q8_panel_4, q8_panel_5,
                                              q8_panel_6};
PANEL_FNS(q4k, F_Q4_K)
static const PanelFn q4k_few_panels[MR + 1] = {0, stopline_q4_k_i8_few_1, stopline_q4_k_i8_few_2,
                                               stopline_q4_k_i8_few_3, q4k_panel_4, q4k_panel_5,
                                               q4k_panel_6};
PANEL_FNS(q6k, F_Q6_K)
static const PanelFn q6k_few_panels[MR + 1] = {0, stopline_q6_k_i8_few_1, stopline_q6_k_i8_few_2,
                                               stopline_q6_k_i8_few_3, q6k_panel_4, q6k_panel_5,
                                               q6k_panel_6};

/* The many-row path on AMX-INT8 tiles (amx_i8_gemm.c): the same bits, the group sums formed by
 * tile products. Used for the first M / 16 * 16 rows once M reaches AMX_ROWS and the Python
 * side has switched it on (the OS granted the tile state): 1 for the Q4 formats, 2 for all
 * (Q8_0's on tiles measured slower); the rest of the rows go through the panels. Below
 * AMX_ROWS the panels were as fast or faster (32 rows: 0.7-1.0x). */
extern int stopline_i8_amx_on;
int stopline_amx_i8_rows(int fmt, long rec_bytes, const int8_t* xq, const float* xd, const float* xds,
                          const int32_t* xs, const uint8_t* w, float* y, int M16, int K, int N,
                          int sums_a_group);
#define AMX_ROWS 64
/* More than 3 chunks of Q4_1 or Q4_K rows: the panel's nibbles split once, by its first chunk,
 * not per chunk (int8_rows.c; the same bits). One thread: 1.08x "before" at 32 rows, 1.08-1.10x
 * at 128-512; two: 0.99-1.11x at 32, 1.08-1.10x at 128-512 (docs/benchmarks.md). */
#define SPLIT_ROWS_MIN (3 * MR + 1)
/* Q8_0 at as many rows: the sums started at -128 s, one subtraction less a group (int8_rows.c):
 * the head alone 1.00-1.09x the panels at 32 and 512 rows, one run of six 0.79x. */
void stopline_i8_q8_rows(const int8_t* xq, const float* xd, const int32_t* xs, const uint8_t* w, float* y,
                         int M, int K, int N);
extern int stopline_i8_split_on;
int stopline_i8_q4_rows(int f32, long rec_bytes, const int8_t* xq, const float* xd, const float* xds,
                         const uint8_t* w, float* y, int M, int K, int N);

/* Each thread takes whole panels (guided, as quant_gemm.c, for neighbours); a panel runs its
 * rows in chunks of at most MR, as even as possible. The chunking changes which registers hold
 * a row's sums, never their order. */
static void gemm(const PanelFn* panels, int fmt, long rec_bytes, const int8_t* xq, const float* xd,
                 const float* xds, const int32_t* xs, const uint8_t* w, float* y, int M, int K, int N,
                 int sums_a_group) {
    if (stopline_i8_amx_on && M >= AMX_ROWS && (fmt == F_Q4_1 || fmt == F_Q4_K || stopline_i8_amx_on > 1)) {
        int m16 = M / 16 * 16;
        long o = (long)m16 * (K / GROUP);
        if (stopline_amx_i8_rows(fmt, rec_bytes, xq, xd, xds, xs, w, y, m16, K, N, sums_a_group) == 0) {
            xq += (long)m16 * K, xd += o, xds += o, xs += o * sums_a_group, y += (long)m16 * N, M -= m16;
            if (!M) return;
        }
    }
    if (stopline_i8_split_on && M >= SPLIT_ROWS_MIN && (fmt == F_Q4_1 || fmt == F_Q4_K) &&
        stopline_i8_q4_rows(fmt == F_Q4_K, rec_bytes, xq, xd, xds, w, y, M, K, N) == 0)
        return;
    if (stopline_i8_split_on && M >= SPLIT_ROWS_MIN && fmt == F_Q8_0) {
        stopline_i8_q8_rows(xq, xd, xs, w, y, M, K, N);
        return;
    }
    long panel_bytes = (long)(K / GROUP) * rec_bytes;
    int groups = K / GROUP, chunks = (M + MR - 1) / MR;
#pragma omp parallel for schedule(guided)
    for (int p = 0; p < N / PANEL; p++) {
        const uint8_t* P = w + p * panel_bytes;
        for (int c = 0; c < chunks; c++) {
            int m0 = (int)((long)M * c / chunks), mr = (int)((long)M * (c + 1) / chunks) - m0;
            long o = (long)m0 * groups;
            panels[mr](xq + (long)m0 * K, xd + o, xds + o, xs + o * sums_a_group, K, P,
                       y + (long)m0 * N + p * PANEL, N);
        }
    }
}

/* q, d, ds, s: stopline_quantize_rows' output for x (M x K); y: M x N float32. K and N
 * multiples of 32. */
void stopline_q4_1_i8_gemm(const int8_t* q, const float* d, const float* ds, const int32_t* s,
                           const uint8_t* w, float* y, int M, int K, int N) {
    gemm(q4_few_panels, F_Q4_1, Q4_REC, q, d, ds, s, w, y, M, K, N, 1);
}

void stopline_q8_0_i8_gemm(const int8_t* q, const float* d, const float* ds, const int32_t* s,
                           const uint8_t* w, float* y, int M, int K, int N) {
    gemm(q8_few_panels, F_Q8_0, Q8_REC, q, d, ds, s, w, y, M, K, N, 1);
}

void stopline_q4_k_i8_gemm(const int8_t* q, const float* d, const float* ds, const int32_t* s,
                           const uint8_t* w, float* y, int M, int K, int N) {
    gemm(q4k_few_panels, F_Q4_K, Q4K_REC, q, d, ds, s, w, y, M, K, N, 1);
}

/* s here: x's quant sums per 16 k (M x K/16), one per Q6_K scale. */
void stopline_q6_k_i8_gemm(const int8_t* q, const float* d, const float* ds, const int32_t* s,
                           const uint8_t* w, float* y, int M, int K, int N) {
    gemm(q6k_few_panels, F_Q6_K, Q6K_REC, q, d, ds, s, w, y, M, K, N, 2);
}
