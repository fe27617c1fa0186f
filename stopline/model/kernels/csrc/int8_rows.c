/* The int8 kernel's (int8_gemm.c) many-row path for Q4_1 and Q4_K weights on the VNNI panels:
 * the panel's nibbles split once into a per-thread buffer that every chunk of rows reuses.
 *
 * int8_gemm.c's panel splits each step's 64 bytes into the low and high nibbles (three vector
 * ops) for every chunk of up to 6 rows, so at 512 rows a panel's nibbles are split 86 times;
 * here once a call, by the panel's first chunk as it computes (a separate pass over the panel
 * first was 0.95-0.97x the panels at 32 rows on two threads). Everything else is the panel's, term for term: the integer sums of a
 * group (exact, any order) and the float chain per output over the groups in k order
 * (acc = fma(float(sum), dw * d, acc); acc = fma(mw, ds, acc)), so the bits are the same at
 * every row count and however the rows are chunked.
 *
 * Split layout (also amx_i8_gemm.c's): group g at g * 1024 bytes, the low nibbles (columns
 * 0-15) of step t at + t * 64, the high ones (columns 16-31) at + 512 + t * 64.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "int8_epilogue.h"
#include "panel.h"

#define GROUP 32
#define MR 6
#define UNROLL _Pragma("GCC unroll 6")
#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")))

static inline TARGET __m512 f16x16(const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}

/* Rows [0, mr) of one panel: P its records, U its split nibbles. The panel's first chunk
 * (first = 1) splits them from the records as it goes and stores them to U; the others load
 * them from U. */
static inline TARGET __attribute__((always_inline)) void
rows_panel(const int8_t* xq, const float* xd, const float* xds, int K, const uint8_t* P, long rec_bytes,
           uint8_t* U, float* y, long ldy, int mr, int f32, int first) {
    const int head = f32 ? 256 : 128;
    const __m512i low = _mm512_set1_epi8(0x0f);
    const int groups = K / GROUP;
    __m512 acc[MR][2];
    UNROLL for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        uint8_t* u = U + (long)g * 1024;
        __m512i sum[MR][2];
        UNROLL for (int r = 0; r < mr; r++) sum[r][0] = sum[r][1] = _mm512_setzero_si512();
        _Pragma("GCC unroll 8") for (int t = 0; t < GROUP / 4; t++) {
            __m512i w0, w1;
            if (first) {
                __m512i v = _mm512_loadu_si512((const void*)(P + (long)g * rec_bytes + head + t * 64));
                w0 = _mm512_and_si512(v, low);
                w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                _mm512_store_si512((void*)(u + t * 64), w0);
                _mm512_store_si512((void*)(u + 512 + t * 64), w1);
            } else {
                w0 = _mm512_load_si512((const void*)(u + t * 64));
                w1 = _mm512_load_si512((const void*)(u + 512 + t * 64));
            }
            UNROLL for (int r = 0; r < mr; r++) {
                __m512i xv = _mm512_set1_epi32(*(const int32_t*)(xq + (long)r * K + g * GROUP + 4 * t));
                sum[r][0] = _mm512_dpbusd_epi32(sum[r][0], w0, xv);
                sum[r][1] = _mm512_dpbusd_epi32(sum[r][1], w1, xv);
            }
        }
        const uint8_t* rec = P + (long)g * rec_bytes;
        const float* fs = (const float*)rec;
        __m512 d0 = f32 ? _mm512_loadu_ps(fs) : f16x16(rec), d1 = f32 ? _mm512_loadu_ps(fs + 16) : f16x16(rec + 32);
        __m512 m0 = f32 ? _mm512_loadu_ps(fs + 32) : f16x16(rec + 64);
        __m512 m1 = f32 ? _mm512_loadu_ps(fs + 48) : f16x16(rec + 96);
        UNROLL for (int r = 0; r < mr; r++) {
            long i = (long)r * groups + g;
            __m512 xdr = _mm512_set1_ps(xd[i]), xdsr = _mm512_set1_ps(xds[i]);
            acc[r][0] = i8_q4_group(acc[r][0], sum[r][0], d0, m0, xdr, xdsr);
            acc[r][1] = i8_q4_group(acc[r][1], sum[r][1], d1, m1, xdr, xdsr);
        }
    }
    UNROLL for (int r = 0; r < mr; r++) {
        _mm512_storeu_ps(y + r * ldy, acc[r][0]);
        _mm512_storeu_ps(y + r * ldy + 16, acc[r][1]);
    }
}

typedef void (*RowsFn)(const int8_t*, const float*, const float*, int, const uint8_t*, long, uint8_t*, float*,
                       long);
#define ROWS_FN(name, n, f32, first)                                                             \
    static TARGET __attribute__((noinline)) void name(const int8_t* xq, const float* xd,         \
                                                      const float* xds, int K, const uint8_t* P, \
                                                      long rec_bytes, uint8_t* U, float* y,      \
                                                      long ldy) {                                \
        rows_panel(xq, xd, xds, K, P, rec_bytes, U, y, ldy, n, f32, first);                      \
    }
#define ROWS_FNS(kind, f32)                                                                      \
    ROWS_FN(kind##_4, 4, f32, 0) ROWS_FN(kind##_5, 5, f32, 0) ROWS_FN(kind##_6, 6, f32, 0)        \
    ROWS_FN(kind##_4f, 4, f32, 1) ROWS_FN(kind##_5f, 5, f32, 1) ROWS_FN(kind##_6f, 6, f32, 1)
ROWS_FNS(q4, 0)
ROWS_FNS(q4k, 1)

/* The calling thread's scratch for its team's split nibbles, kept and grown rather than
 * allocated (and its pages faulted in) every call of a fraction of a millisecond. One buffer
 * per thread that calls the kernel (the engine's few), never freed: groups x 1 KiB per team
 * thread, 96 KiB for SmolLM2's down on two. NULL if it cannot grow. */
uint8_t* stopline_i8_scratch(size_t bytes) {
    static __thread uint8_t* buf;
    static __thread size_t cap;
    if (bytes > cap) {
        free(buf);
        buf = aligned_alloc(64, (bytes + 63) / 64 * 64);
        cap = buf ? bytes : 0;
    }
    return buf;
}

/* Set by benchmarks to compare with the panels (int8_linear.use_split); on by default. */
int stopline_i8_split_on = 1;

void stopline_i8_split(int on) { stopline_i8_split_on = on; }

/* M > 3 * MR rows (so every chunk holds 4-6 rows) of a Q4_1 (f32 = 0) or Q4_K (f32 = 1)
 * weight: int8_gemm.c's gemm arguments. Whole panels a thread (guided), as there. -1, with
 * nothing done, where the scratch could not be had. */
TARGET int stopline_i8_q4_rows(int f32, long rec_bytes, const int8_t* xq, const float* xd,
                               const float* xds, const uint8_t* w, float* y, int M, int K, int N) {
    const int groups = K / GROUP, chunks = (M + MR - 1) / MR;
    const long panel_bytes = (long)groups * rec_bytes;
    const RowsFn fns[2][MR + 1] = {{0, 0, 0, 0, f32 ? q4k_4 : q4_4, f32 ? q4k_5 : q4_5, f32 ? q4k_6 : q4_6},
                                   {0, 0, 0, 0, f32 ? q4k_4f : q4_4f, f32 ? q4k_5f : q4_5f, f32 ? q4k_6f : q4_6f}};
    const size_t per_thread = (size_t)groups * 1024;
    uint8_t* bufs = stopline_i8_scratch(per_thread * omp_get_max_threads());
    if (!bufs) return -1;
#pragma omp parallel
    {
        uint8_t* U = bufs + per_thread * omp_get_thread_num();
#pragma omp for schedule(guided)
        for (int p = 0; p < N / PANEL; p++) {
            const uint8_t* P = w + p * panel_bytes;
            for (int c = 0; c < chunks; c++) {
                int m0 = (int)((long)M * c / chunks), mr = (int)((long)M * (c + 1) / chunks) - m0;
                long o = (long)m0 * groups;
                fns[c == 0][mr](xq + (long)m0 * K, xd + o, xds + o, K, P, rec_bytes, U, y + (long)m0 * N + p * PANEL, N);
            }
        }
    }
    return 0;
}

/* Q8_0 at more than 3 chunks of rows: the panel's loop, with each group's sums started at
 * -128 s rather than 0, so the offset of the stored v + 128 comes off inside the integer sum
 * (exact: the same integer as the panel's sum - 128 s) and the epilogue drops its subtraction:
 * acc = fma(float(sum), dw * d, acc), as documented in int8_gemm.c. */
static inline TARGET __attribute__((always_inline)) void
q8_rows_panel(const int8_t* xq, const float* xd, const int32_t* xs, int K, const uint8_t* P, float* y, long ldy,
              int mr) {
    const int groups = K / GROUP;
    const long rec_bytes = PANEL * 2 + GROUP * PANEL;
    __m512 acc[MR][2];
    UNROLL for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        const uint8_t* rec = P + (long)g * rec_bytes;
        __m512i sum[MR][2];
        UNROLL for (int r = 0; r < mr; r++) sum[r][0] = sum[r][1] = _mm512_set1_epi32(-128 * xs[(long)r * groups + g]);
        _Pragma("GCC unroll 8") for (int t = 0; t < GROUP / 4; t++) {
            __m512i w0 = _mm512_loadu_si512((const void*)(rec + 64 + t * 128));
            __m512i w1 = _mm512_loadu_si512((const void*)(rec + 64 + t * 128 + 64));
            UNROLL for (int r = 0; r < mr; r++) {
                __m512i xv = _mm512_set1_epi32(*(const int32_t*)(xq + (long)r * K + g * GROUP + 4 * t));
                sum[r][0] = _mm512_dpbusd_epi32(sum[r][0], w0, xv);
                sum[r][1] = _mm512_dpbusd_epi32(sum[r][1], w1, xv);
            }
        }
        __m512 d0 = f16x16(rec), d1 = f16x16(rec + 32);
        UNROLL for (int r = 0; r < mr; r++) {
            __m512 xdr = _mm512_set1_ps(xd[(long)r * groups + g]);
            acc[r][0] = i8_scaled(acc[r][0], sum[r][0], d0, xdr);
            acc[r][1] = i8_scaled(acc[r][1], sum[r][1], d1, xdr);
        }
    }
    UNROLL for (int r = 0; r < mr; r++) {
        _mm512_storeu_ps(y + r * ldy, acc[r][0]);
        _mm512_storeu_ps(y + r * ldy + 16, acc[r][1]);
    }
}

typedef void (*Q8RowsFn)(const int8_t*, const float*, const int32_t*, int, const uint8_t*, float*, long);
#define Q8_ROWS_FN(n)                                                                            \
    static TARGET __attribute__((noinline)) void q8_rows_##n(const int8_t* xq, const float* xd,  \
                                                             const int32_t* xs, int K,           \
                                                             const uint8_t* P, float* y, long ldy) { \
        q8_rows_panel(xq, xd, xs, K, P, y, ldy, n);                                              \
    }
Q8_ROWS_FN(4)
Q8_ROWS_FN(5)
Q8_ROWS_FN(6)

/* M > 3 * MR rows of a Q8_0 weight: int8_gemm.c's gemm arguments, whole panels a thread. */
TARGET void stopline_i8_q8_rows(const int8_t* xq, const float* xd, const int32_t* xs, const uint8_t* w, float* y,
                                int M, int K, int N) {
    const int groups = K / GROUP, chunks = (M + MR - 1) / MR;
    const long panel_bytes = (long)groups * (PANEL * 2 + GROUP * PANEL);
    const Q8RowsFn fns[MR + 1] = {0, 0, 0, 0, q8_rows_4, q8_rows_5, q8_rows_6};
#pragma omp parallel for schedule(guided)
    for (int p = 0; p < N / PANEL; p++)
        for (int c = 0; c < chunks; c++) {
            int m0 = (int)((long)M * c / chunks), mr = (int)((long)M * (c + 1) / chunks) - m0;
            long o = (long)m0 * groups;
            fns[mr](xq + (long)m0 * K, xd + o, xs + o, K, w + p * panel_bytes, y + (long)m0 * N + p * PANEL, N);
        }
}
