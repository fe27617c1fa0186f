/* Q4_1 weights dequantized to bf16, one k-pair of a 32-column panel at a time: shared by the
 * AVX512-BF16 kernel (bf16_gemm.c, which feeds vdpbf16ps) and the AMX one (amx_gemm.c, which
 * lays the pairs out as B tiles), so both see the same bf16 weights bit for bit.
 *
 * A record (32 k x 32 columns): d[32] f16, m[32] f16, then per k-pair 32 bytes: byte i < 16
 * holds lane i of vectors A (low nibble) and B (high), byte 16 + i of C and D, where A's lane
 * 2j + e is column j's weight k = 2p + e (B: columns 8.., C: 16.., D: 24..). Each weight is
 * dequantized exactly in fp32, fma(d, q, m) (as quant_gemm.c), then rounded to bf16 (nearest
 * even, as the bf16 copy was from the fp32 dequantized weights). */
#ifndef STOPLINE_Q4_BF16_H
#define STOPLINE_Q4_BF16_H
#include <immintrin.h>
#include <stdint.h>

#include "panel.h"

#define Q4_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"), always_inline))

/* A record's scales and minimums, spread to the lanes of vectors A-D. */
typedef struct {
    __m512 dA, dB, dC, dD, mA, mB, mC, mD;
} Q4Scales;

static inline Q4_TARGET Q4Scales q4_scales(const uint8_t* rec) {
    const __m512i lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i hi = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
    __m512 d0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)rec));
    __m512 d1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(rec + 32)));
    __m512 m0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(rec + 64)));
    __m512 m1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(rec + 96)));
    Q4Scales s = {_mm512_permutexvar_ps(lo, d0), _mm512_permutexvar_ps(hi, d0),
                  _mm512_permutexvar_ps(lo, d1), _mm512_permutexvar_ps(hi, d1),
                  _mm512_permutexvar_ps(lo, m0), _mm512_permutexvar_ps(hi, m0),
                  _mm512_permutexvar_ps(lo, m1), _mm512_permutexvar_ps(hi, m1)};
    return s;
}

/* k-pair p of the record as bf16 pairs: *w0 columns 0-15, *w1 columns 16-31. */
static inline Q4_TARGET void q4_pair(const uint8_t* rec, int p, const Q4Scales* s, __m512bh* w0,
                                     __m512bh* w1) {
    /* float(q) by table (permutexvar reads an index's low 4 bits, so the low nibble needs no
     * mask): the same exact values as a conversion, on the other vector port. Against mask and
     * convert (the AMX kernel on SmolLM2's layer shapes, same bits, two runs): 0.87-0.89x the
     * time at 1-4 rows, 0.92x at 16, 0.97x at 32. */
    const __m512 q = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m128i* v = (const __m128i*)(rec + 128 + p * PANEL);
    __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128(v));
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(v + 1));
    __m512 wA = _mm512_fmadd_ps(s->dA, _mm512_permutexvar_ps(a, q), s->mA);
    __m512 wB = _mm512_fmadd_ps(s->dB, _mm512_permutexvar_ps(_mm512_srli_epi32(a, 4), q), s->mB);
    __m512 wC = _mm512_fmadd_ps(s->dC, _mm512_permutexvar_ps(b, q), s->mC);
    __m512 wD = _mm512_fmadd_ps(s->dD, _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), q), s->mD);
    *w0 = _mm512_cvtne2ps_pbh(wB, wA);
    *w1 = _mm512_cvtne2ps_pbh(wD, wC);
}

#endif
