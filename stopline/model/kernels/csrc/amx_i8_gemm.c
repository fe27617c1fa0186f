/* The int8 kernel's (int8_gemm.c) many-row path on AMX-INT8 tiles, where the OS grants them:
 * the same arithmetic, so the same bits, as the VNNI panels at every row count.
 *
 * What a tile changes: only how each group's integer sum is formed. tdpbsud multiplies x's
 * signed quants (A: 16 rows x 32 k, straight from the row-major q, rows K apart) by the
 * weight's unsigned ones (B: 8 steps x 16 columns x 4 k, which is the packed layout's step
 * block as it stands: Q8_0 and Q6_K load it in place, Q4_1 and Q4_K after the nibbles are
 * split once per panel into a buffer that every row block reuses). Integer sums are exact in
 * any order, so C[r][c] is the VNNI kernel's sum for row r, column c, bit for bit. The float
 * epilogue per group is int8_gemm.c's, term for term and in group order (documented there; the
 * one copy in int8_epilogue.h):
 *     Q4_1, Q4_K:  acc = fma(float(sum), dw * d, acc); acc = fma(mw, ds, acc)
 *     Q8_0:        acc = fma(float(sum - 128 s), dw * d, acc)
 *     Q6_K:        acc = fma(float(sum_lo - 128 s_lo), s0 * d, acc); then _hi with s1
 * with the 16 rows' accumulators (one column half) held in registers across the groups.
 *
 * Why it exists, and why it is off by default (STOPLINE_INT8_AMX=1 turns it on): the VNNI panel
 * spends 8 vpdpbusd and 4 float ops on a row's 16 columns and one group; here the 8 vpdpbusd
 * are 1/16 of a tile op and only the 4 float ops are left to the vector units. On the one
 * AMX host measured (an Intel Xeon guest, docs/benchmarks.md) the tile ops were slow enough
 * (tdpbsud 16x16x32 and tilestored ~40-50 cycles each) that this path was no faster than the
 * VNNI panels with the nibbles split once (int8_rows.c): 419 against 427 GFLOPS at 512 rows.
 *
 * Rows run in blocks of 16 (a full tile); the caller sends the remainder (M % 16 rows) through
 * the VNNI panels, whose bits are the same. The next group's tile product is issued before the
 * current group's epilogue (two C tiles alternate), so the tile unit and the vector units
 * overlap.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "int8_epilogue.h"
#include "panel.h"

#define GROUP 32
#define TR 16
#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,amx-tile,amx-int8")))
enum { F_Q4_1, F_Q8_0, F_Q4_K, F_Q6_K };

/* Set by the Python side (int8_linear) once the OS granted the tile state; 0 keeps every row
 * count on the VNNI panels (and lets a benchmark compare the two in one process). */
int stopline_i8_amx_on = 0;

uint8_t* stopline_i8_scratch(size_t bytes); /* int8_rows.c */

void stopline_i8_amx(int on) { stopline_i8_amx_on = on; }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) TileCfg;

/* Tiles: 0, 1 the C of an even group (Q6_K: k 0-15, 16-31), 4, 5 of an odd one; 2, 3 A (Q6_K:
 * its two halves); 6, 7 B (likewise). */
static TARGET void config(int k6) {
    TileCfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        int c = t == 0 || t == 1 || t == 4 || t == 5, a = t == 2 || t == 3;
        cfg.rows[t] = c || a ? TR : k6 ? 4 : 8;
        cfg.colsb[t] = c ? 64 : a ? (k6 ? 16 : 32) : 64;
    }
    _tile_loadconfig(&cfg);
}

static inline TARGET __m512 f16x16(const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}

#define KB 8 /* groups whose sums a block's tile phase stores before its vector phase reads them */

/* A row block (16 rows) against one panel, both column halves, KB groups at a time: first every
 * tile product of the KB groups into S (a group's C tiles alternate between two sets, so a
 * product need not wait for the last one's store), then the float epilogue over them, the 16
 * rows' accumulators of one half in registers. The accumulators pass from one KB to the next
 * through y (a float stored and loaded: the same bits). Measured against the alternatives
 * (each group's epilogue one group behind its product; blocks of 4 double-buffered): as fast
 * or faster (docs/benchmarks.md). */
static inline TARGET __attribute__((always_inline)) void
block(const int8_t* xq, const float* xd, const float* xds, const int32_t* xs, int K, const uint8_t* P,
      const uint8_t* ub, long rec_bytes, float* y, long ldy, int fmt) {
    const int groups = K / GROUP;
    const int q8 = fmt == F_Q8_0 || fmt == F_Q6_K, k6 = fmt == F_Q6_K, f32 = fmt >= F_Q4_K;
    const int bstride = q8 ? 128 : 64;
    /* S[g - g0][h][lo/hi][16 rows x 16 columns] */
    int32_t S[KB][2][2][TR * 16] __attribute__((aligned(64)));
    for (int g0 = 0; g0 < groups; g0 += KB) {
        int gn = groups - g0 < KB ? groups - g0 : KB;
        for (int j = 0; j < gn; j++) {
            int g = g0 + j;
            const int8_t* x = xq + g * GROUP;
            const uint8_t* b0 = ub + (long)g * 1024;
            const uint8_t* b1 = b0 + (q8 ? 64 : 512);
            if (k6) {
                _tile_loadd(2, x, K);
                _tile_loadd(3, x + 16, K);
                _tile_loadd(6, b0, bstride);
                _tile_loadd(7, b0 + 4 * bstride, bstride);
                if (j & 1) {
                    _tile_zero(4); _tile_zero(5);
                    _tile_dpbsud(4, 2, 6); _tile_dpbsud(5, 3, 7);
                    _tile_stored(4, S[j][0][0], 64); _tile_stored(5, S[j][0][1], 64);
                } else {
                    _tile_zero(0); _tile_zero(1);
                    _tile_dpbsud(0, 2, 6); _tile_dpbsud(1, 3, 7);
                    _tile_stored(0, S[j][0][0], 64); _tile_stored(1, S[j][0][1], 64);
                }
                _tile_loadd(6, b1, bstride);
                _tile_loadd(7, b1 + 4 * bstride, bstride);
                if (j & 1) {
                    _tile_zero(4); _tile_zero(5);
                    _tile_dpbsud(4, 2, 6); _tile_dpbsud(5, 3, 7);
                    _tile_stored(4, S[j][1][0], 64); _tile_stored(5, S[j][1][1], 64);
                } else {
                    _tile_zero(0); _tile_zero(1);
                    _tile_dpbsud(0, 2, 6); _tile_dpbsud(1, 3, 7);
                    _tile_stored(0, S[j][1][0], 64); _tile_stored(1, S[j][1][1], 64);
                }
            } else {
                _tile_loadd(2, x, K);
                _tile_loadd(6, b0, bstride);
                _tile_loadd(7, b1, bstride);
                if (j & 1) {
                    _tile_zero(4); _tile_zero(5);
                    _tile_dpbsud(4, 2, 6); _tile_dpbsud(5, 2, 7);
                    _tile_stored(4, S[j][0][0], 64); _tile_stored(5, S[j][1][0], 64);
                } else {
                    _tile_zero(0); _tile_zero(1);
                    _tile_dpbsud(0, 2, 6); _tile_dpbsud(1, 2, 7);
                    _tile_stored(0, S[j][0][0], 64); _tile_stored(1, S[j][1][0], 64);
                }
            }
        }
        for (int h = 0; h < 2; h++) {
            __m512 acc[TR];
            _Pragma("GCC unroll 16") for (int r = 0; r < TR; r++)
                acc[r] = g0 ? _mm512_loadu_ps(y + r * ldy + 16 * h) : _mm512_setzero_ps();
            for (int j = 0; j < gn; j++) {
                int g = g0 + j;
                const int32_t* s = S[j][h][0];
                const uint8_t* rec = P + (long)g * rec_bytes;
                const float* fs = (const float*)rec;
                const __m512 dh = f32 ? _mm512_loadu_ps(fs + 16 * h) : f16x16(rec + 32 * h);
                if (k6) {
                    const __m512 eh = _mm512_loadu_ps(fs + 32 + 16 * h);
                    _Pragma("GCC unroll 16") for (int r = 0; r < TR; r++) {
                        long i = (long)r * groups + g;
                        __m512 xdr = _mm512_set1_ps(xd[i]);
                        __m512i lo = _mm512_sub_epi32(_mm512_load_si512(s + 16 * r), _mm512_set1_epi32(128 * xs[2 * i]));
                        __m512i hi = _mm512_sub_epi32(_mm512_load_si512(S[j][h][1] + 16 * r),
                                                      _mm512_set1_epi32(128 * xs[2 * i + 1]));
                        acc[r] = i8_scaled(acc[r], lo, dh, xdr);
                        acc[r] = i8_scaled(acc[r], hi, eh, xdr);
                    }
                } else if (q8) {
                    _Pragma("GCC unroll 16") for (int r = 0; r < TR; r++) {
                        long i = (long)r * groups + g;
                        __m512i v = _mm512_sub_epi32(_mm512_load_si512(s + 16 * r), _mm512_set1_epi32(128 * xs[i]));
                        acc[r] = i8_scaled(acc[r], v, dh, _mm512_set1_ps(xd[i]));
                    }
                } else {
                    const __m512 mh = f32 ? _mm512_loadu_ps(fs + 32 + 16 * h) : f16x16(rec + 64 + 32 * h);
                    _Pragma("GCC unroll 16") for (int r = 0; r < TR; r++) {
                        long i = (long)r * groups + g;
                        __m512i v = _mm512_load_si512(s + 16 * r);
                        __m512 xdr = _mm512_set1_ps(xd[i]);
                        acc[r] = i8_q4_group(acc[r], v, dh, mh, xdr, _mm512_set1_ps(xds[i]));
                    }
                }
            }
            _Pragma("GCC unroll 16") for (int r = 0; r < TR; r++) _mm512_storeu_ps(y + r * ldy + 16 * h, acc[r]);
        }
    }
}

#define BLOCK_FN(name, fmt)                                                                      \
    static TARGET __attribute__((noinline)) void name(                                           \
        const int8_t* xq, const float* xd, const float* xds, const int32_t* xs, int K,           \
        const uint8_t* P, const uint8_t* ub, long rec_bytes, float* y, long ldy) {               \
        block(xq, xd, xds, xs, K, P, ub, rec_bytes, y, ldy, fmt);                                \
    }
BLOCK_FN(block_q4_1, F_Q4_1)
BLOCK_FN(block_q8_0, F_Q8_0)
BLOCK_FN(block_q4_k, F_Q4_K)
BLOCK_FN(block_q6_k, F_Q6_K)

/* Rows [0, M16) of int8_gemm.c's gemm, M16 a multiple of 16; same arguments. Each thread takes
 * whole panels (guided), copies a panel's quants once into its buffer (Q4's nibbles split),
 * then runs every row block of the panel against it. -1, with nothing done, where the scratch
 * (int8_rows.c's) could not be had. */
TARGET int stopline_amx_i8_rows(int fmt, long rec_bytes, const int8_t* xq, const float* xd, const float* xds,
                                const int32_t* xs, const uint8_t* w, float* y, int M16, int K, int N,
                                int sums_a_group) {
    const int groups = K / GROUP, q8 = fmt == F_Q8_0 || fmt == F_Q6_K;
    const long panel_bytes = (long)groups * rec_bytes;
    const int head = fmt >= F_Q4_K ? 256 : q8 ? 64 : 128; /* bytes of scales before the quants */
    const __m512i low = _mm512_set1_epi8(0x0f);
    void (*fn)(const int8_t*, const float*, const float*, const int32_t*, int, const uint8_t*, const uint8_t*,
               long, float*, long) =
        fmt == F_Q4_1 ? block_q4_1 : fmt == F_Q8_0 ? block_q8_0 : fmt == F_Q4_K ? block_q4_k : block_q6_k;
    const size_t per_thread = (size_t)groups * 1024;
    uint8_t* bufs = stopline_i8_scratch(per_thread * omp_get_max_threads());
    if (!bufs) return -1;
#pragma omp parallel
    {
        uint8_t* ub = bufs + per_thread * omp_get_thread_num();
        config(fmt == F_Q6_K);
#pragma omp for schedule(guided)
        for (int p = 0; p < N / PANEL; p++) {
            const uint8_t* P = w + p * panel_bytes;
            /* The panel's quants into the thread's buffer once, for all its row blocks: Q4's
             * nibbles split (low: columns 0-15, high: 16-31, 512 bytes each a group), Q8's
             * copied as they are. Tile loads straight from the records read memory without
             * the prefetcher's help (the Q8_0 head at 512 rows: 0.5x the VNNI panels). */
            for (int g = 0; g < groups; g++) {
                const uint8_t* q = P + g * rec_bytes + head;
                for (int t = 0; t < GROUP / 4; t++) {
                    if (q8) {
                        _mm512_store_si512((void*)(ub + g * 1024 + t * 128), _mm512_loadu_si512((const void*)(q + t * 128)));
                        _mm512_store_si512((void*)(ub + g * 1024 + t * 128 + 64),
                                           _mm512_loadu_si512((const void*)(q + t * 128 + 64)));
                    } else {
                        __m512i v = _mm512_loadu_si512((const void*)(q + t * 64));
                        _mm512_store_si512((void*)(ub + g * 1024 + t * 64), _mm512_and_si512(v, low));
                        _mm512_store_si512((void*)(ub + g * 1024 + 512 + t * 64),
                                           _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
                    }
                }
            }
            for (int m0 = 0; m0 < M16; m0 += TR) {
                long o = (long)m0 * groups;
                fn(xq + (long)m0 * K, xd + o, xds + o, xs + o * sums_a_group, K, P, ub, rec_bytes,
                   y + (long)m0 * N + p * PANEL, N);
            }
        }
        _tile_release();
    }
    return 0;
}
