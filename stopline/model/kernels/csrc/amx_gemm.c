/* y = x @ w.T with bf16 inputs and fp32 sums on AMX tiles (tdpbf16ps): the "fast" numerics
 * mode's kernel where the CPU has AMX-BF16 (docs/numerics.md).
 *
 * Batch invariance: an output element y[r][n] is the tile accumulator's lane for row r,
 * started at zero and updated once per 32-wide k tile in k order, by tdpbf16ps with row r of
 * the A tile and the same B tile whatever M is. A tile's rows are independent lanes, so a row's
 * bits depend only on its own x and the weights: not on M, on how rows are cut into tiles of
 * up to 16, or on which thread runs the panel. tdpbf16ps sums the 16 pairs of a tile in its
 * own order (not vdpbf16ps's), so every row count goes through this kernel once it is chosen;
 * the choice depends only on the CPU, the env and K, never on M.
 *
 * Weights: the bf16 panel layout of bf16_gemm.c (per k-pair 32 columns x 2 bf16, 128 bytes)
 * is already the B tile's layout: 16 pairs x 16 columns, rows 128 bytes apart, columns 0-15 at
 * +0 and 16-31 at +64. The Q4_1 path dequantizes a group of 32 k into that layout in a 2 KiB
 * buffer (q4_bf16.h, the dequantization and rounding of bf16_gemm.c's q4 kernel, so the same B
 * tile and the same bits) and loads B from there: fewer bytes read for few rows.
 *
 * Tile state needs the kernel's permission (arch_prctl ARCH_REQ_XCOMP_PERM); stopline_amx_init
 * asks once and the Python side falls back to the AVX512-BF16 kernel if it is refused.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "fetch.h"
#include "q4_bf16.h"

#define TR 16 /* rows a tile holds */
#define Q4_REC (PANEL * 2 * 2 + 16 * PANEL)
#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 0 when tiles may be used. */
int stopline_amx_init(void) {
#ifdef SYS_arch_prctl
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1;
#else
    return -1;
#endif
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) TileCfg;

/* Tiles: 0,1 C of rows a (columns 0-15, 16-31), 2,3 C of rows b, 4 A rows a, 5 A rows b,
 * 6,7 B (columns 0-15, 16-31). */
static inline TARGET void config(TileCfg* cur, int ma, int mb) {
    if (cur->palette == 1 && cur->rows[0] == ma && cur->rows[2] == (mb ? mb : 1)) return;
    memset(cur, 0, sizeof *cur);
    cur->palette = 1;
    int mbb = mb ? mb : 1;
    const int rows[8] = {ma, ma, mbb, mbb, ma, mbb, 16, 16};
    for (int t = 0; t < 8; t++) {
        cur->rows[t] = (uint8_t)rows[t];
        cur->colsb[t] = 64;
    }
    _tile_loadconfig(cur);
}

/* Rows [0, ma) and [ma, ma + mb) of x (mb may be 0) against one panel, K / 32 k tiles; B tile
 * t for k tile kt at Bp(kt) + {0, 64}, rows 128 bytes apart. */
#define RUN_BLOCK(BP)                                                                          \
    do {                                                                                       \
        _tile_zero(0); _tile_zero(1);                                                          \
        if (mb) { _tile_zero(2); _tile_zero(3); }                                              \
        for (int kt = 0; kt < K / 32; kt++) {                                                  \
            const char* b = (const char*)(BP);                                                 \
            _tile_loadd(6, b, 128);                                                            \
            _tile_loadd(7, b + 64, 128);                                                       \
            _tile_loadd(4, x + kt * 32, ldx * 2);                                              \
            _tile_dpbf16ps(0, 4, 6);                                                           \
            _tile_dpbf16ps(1, 4, 7);                                                           \
            if (mb) {                                                                          \
                _tile_loadd(5, x + (long)ma * ldx + kt * 32, ldx * 2);                         \
                _tile_dpbf16ps(2, 5, 6);                                                       \
                _tile_dpbf16ps(3, 5, 7);                                                       \
            }                                                                                  \
        }                                                                                      \
        _tile_stored(0, y, ldy * 4);                                                           \
        _tile_stored(1, y + 16, ldy * 4);                                                      \
        if (mb) {                                                                              \
            _tile_stored(2, y + (long)ma * ldy, ldy * 4);                                      \
            _tile_stored(3, y + (long)ma * ldy + 16, ldy * 4);                                 \
        }                                                                                      \
    } while (0)

static TARGET void bf16_block(const uint16_t* x, long ldx, const uint16_t* P, float* y, long ldy,
                              int ma, int mb, int K) {
    RUN_BLOCK(P + (long)kt * 16 * 2 * PANEL);
}

/* One group's 32 x 32 Q4_1 weights as bf16 in the panel layout (q4_bf16.h, as bf16_gemm.c).
 * Its record is fetched 2 KiB ahead into L1 and 12 KiB into L2 first (fetch.h; as for
 * q8_group): a group's dequantization is too little work to hide the memory's latency
 * behind. bench/quant_time.py --amx --against, same bits: 0.73-0.76x the time at one row and
 * at eight, 0.83-0.85x at 32; 1 or 4 KiB ahead into L1 and 16 or 24 KiB into L2 were no
 * different. */
static inline TARGET void q4_group(const uint8_t* rec, uint16_t* out) {
    fetch_record(rec, Q4_REC, 1);
    Q4Scales sc = q4_scales(rec);
    for (int p = 0; p < 16; p++) {
        __m512bh w0, w1;
        q4_pair(rec, p, &sc, &w0, &w1);
        _mm512_store_si512((void*)(out + p * 2 * PANEL), (__m512i)w0);
        _mm512_store_si512((void*)(out + p * 2 * PANEL + PANEL), (__m512i)w1);
    }
}

/* One group's 32 x 32 Q8_0 weights as bf16 in the panel layout: d[32] f16, then per k-pair
 * 64 int8, 16 for each of the vectors A-D (lane 2j + e: column j of the vector's 8, k = 2p + e).
 * d * q is exact in fp32 (11 by 8 significant bits), then rounded to bf16 as the copy was. */
#define Q8_REC (PANEL * 2 + 16 * 64)
static inline TARGET void q8_group(const uint8_t* rec, uint16_t* out) {
    fetch_record(rec, Q8_REC, 1);
    const __m512i lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i hi = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
    __m512 d0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)rec));
    __m512 d1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(rec + 32)));
    __m512 dA = _mm512_permutexvar_ps(lo, d0), dB = _mm512_permutexvar_ps(hi, d0);
    __m512 dC = _mm512_permutexvar_ps(lo, d1), dD = _mm512_permutexvar_ps(hi, d1);
    for (int p = 0; p < 16; p++) {
        const __m128i* q = (const __m128i*)(rec + 64 + p * 64);
        __m512 wA = _mm512_mul_ps(dA, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))));
        __m512 wB = _mm512_mul_ps(dB, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))));
        __m512 wC = _mm512_mul_ps(dC, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 2))));
        __m512 wD = _mm512_mul_ps(dD, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 3))));
        _mm512_store_si512((void*)(out + p * 2 * PANEL), (__m512i)_mm512_cvtne2ps_pbh(wB, wA));
        _mm512_store_si512((void*)(out + p * 2 * PANEL + PANEL), (__m512i)_mm512_cvtne2ps_pbh(wD, wC));
    }
}

/* Rows cut into tiles of up to 16, two tiles (a block of up to 32 rows) at a time. */
static inline void split(int M, int c, int chunks, int* m0, int* mr) {
    *m0 = (int)((long)M * c / chunks);
    *mr = (int)((long)M * (c + 1) / chunks) - *m0;
}

/* Panels are handed out guided, not static: a thread that finishes its static share early
 * (its panels came from cache, the other's from memory) waits at the region's end, and past
 * OpenMP's short spin (stopline/__init__.py) it sleeps and must be woken for the next region.
 * A panel's bits are one thread's work whichever thread takes it. Fast mode, 32 streams,
 * linears timed inside the step (`stopline bench floors`), two interleaved runs: 0.77-0.78x
 * the time (step 0.91-0.93x). */

/* x: M x K bf16, w: bf16 panels (bf16_gemm.c), y: M x N fp32; K a multiple of 32, N of 32. */
TARGET void stopline_amx_bf16_gemm(const uint16_t* x, const uint16_t* w, float* y, int M, int K, int N) {
    long panel_elems = (long)K * PANEL, ldx = K, ldy = N;
    int chunks = (M + TR - 1) / TR;
#pragma omp parallel
    {
        TileCfg cfg = {0};
#pragma omp for schedule(guided)
        for (int p = 0; p < N / PANEL; p++) {
            const uint16_t* P = w + p * panel_elems;
            for (int c = 0; c < chunks; c += 2) {
                int m0, ma, m1, mb = 0;
                split(M, c, chunks, &m0, &ma);
                if (c + 1 < chunks) split(M, c + 1, chunks, &m1, &mb);
                config(&cfg, ma, mb);
                bf16_block(x + (long)m0 * ldx, ldx, P, y + (long)m0 * ldy + p * PANEL, ldy, ma, mb, K);
            }
        }
        _tile_release();
    }
}

/* y = x @ w.T from GGUF blocks, 32 rows (two tiles) a pass: GROUP dequantizes one record of
 * REC bytes (32 k x 32 columns) into the B tiles' layout. More rows take more passes, each
 * dequantizing again (the Python side sends them to the bf16 copy, which reads no blocks);
 * a row's bits are its own lane's either way. The dequantized group alternates between two
 * buffers so the next group's stores do not wait on the tile loads of the last. */
#define BLOCK_GEMM(NAME, GROUP, REC)                                                           \
    TARGET void NAME(const uint16_t* x, const uint8_t* w, float* y, int M, int K, int N) {     \
        long panel_bytes = (long)(K / 32) * (REC), ldx = K, ldy = N;                           \
        if (M > 2 * TR) {                                                                      \
            for (int r0 = 0; r0 < M; r0 += 2 * TR)                                             \
                NAME(x + (long)r0 * ldx, w, y + (long)r0 * ldy, M - r0 < 2 * TR ? M - r0 : 2 * TR, K, N); \
            return;                                                                            \
        }                                                                                      \
        int chunks = (M + TR - 1) / TR;                                                        \
        int ma = chunks == 2 ? M / 2 : M, mb = M - ma;                                         \
        _Pragma("omp parallel")                                                                \
        {                                                                                      \
            TileCfg cfg = {0};                                                                 \
            uint16_t buf[2 * 16 * 2 * PANEL] __attribute__((aligned(64)));                     \
            config(&cfg, ma, mb);                                                              \
            _Pragma("omp for schedule(guided)")                                                \
            for (int p = 0; p < N / PANEL; p++) {                                              \
                const uint8_t* P = w + p * panel_bytes;                                        \
                float* yp = y + p * PANEL;                                                     \
                {                                                                              \
                    float* y = yp; /* RUN_BLOCK stores through y */                            \
                    RUN_BLOCK((GROUP(P + (long)kt * (REC), buf + (kt & 1) * 16 * 2 * PANEL),   \
                               buf + (kt & 1) * 16 * 2 * PANEL));                              \
                }                                                                              \
            }                                                                                  \
            _tile_release();                                                                   \
        }                                                                                      \
    }

BLOCK_GEMM(stopline_amx_q4_1_gemm, q4_group, Q4_REC)
BLOCK_GEMM(stopline_amx_q8_0_gemm, q8_group, Q8_REC)
