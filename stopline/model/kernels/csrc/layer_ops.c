/* The small element-wise steps of a decoder layer, one call each instead of 3-6 torch ops
 * (each a parallel region of its own and ~10-25 us of dispatch on a few rows).
 *
 * Every output element depends on its own row only, so the batch never changes a row's bits.
 * Built with -ffp-contract=off: a * b + c stays two roundings, as torch computes it.
 *
 * Both run on all threads from a few rows up (8 rows; 8192 gate elements), not only for big
 * batches: in the fused decoder a serial pass between two GEMMs lets the other thread outlast
 * OpenMP's short spin and sleep, and waking it costs the next region more than the pass took
 * (32 rows of SmolLM2: rope ~35 us a layer alone). With rms_norm.c's and decoder.c's
 * conversion likewise, interleaved runs: step 0.90-0.96x the time at 32 streams (both modes),
 * 0.83-0.95x at 16 (fast), 0.95-0.99x at 8 (exact). */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "simd_math.h"

/* How many rows ahead a row's cache rows are fetched for writing: they are cold lines (a
 * slot is written once), and owning them before the stores took one layer's call at 32 rows
 * of SmolLM2, slots scattered over a 1.5 GB cache, from 34 to 17 us (1 to 8 rows ahead
 * alike). */
#define AHEAD 2

/* Rotary embedding of a step's q and k heads, and k, v stored in the layer's cache.
 * qkv: rows of [q (hq heads) | k (hk) | v (hk)], d floats a head; cos, sin: [positions][d]
 * tables, sin with its first half negated, so rotate_half(x) * sin == roll(x, d / 2) * sin;
 * each element is (x * cos) + (roll(x) * sin), torch's order. q_out: [n][hq][d];
 * kc, vc: [hk][slots][d]; slots[i]: where row i's k and v go. */
__attribute__((target("prfchw")))
void stopline_rope_store(const float* qkv, int n, int hq, int hk, int d, const int64_t* pos,
                         const float* cos, const float* sin, const int64_t* slots, float* kc,
                         float* vc, long nslots, float* q_out) {
    int width = (hq + 2 * hk) * d, half = d / 2;
    #pragma omp parallel for if (n >= 8) schedule(static)
    for (int i = 0; i < n; i++) {
        if (i + AHEAD < n)
            for (int e = 0; e < hk; e++)
                for (int j = 0; j < d; j += 16) {
                    _m_prefetchw(kc + (e * nslots + slots[i + AHEAD]) * d + j);
                    _m_prefetchw(vc + (e * nslots + slots[i + AHEAD]) * d + j);
                }
        const float* row = qkv + (long)i * width;
        const float* c = cos + pos[i] * d;
        const float* s = sin + pos[i] * d;
        for (int e = 0; e < hq + hk; e++) {
            const float* x = row + e * d;
            float* o = e < hq ? q_out + ((long)i * hq + e) * d : kc + ((e - hq) * nslots + slots[i]) * d;
            /* 16 lanes at a time: gcc left the plain loop scalar (o might alias the row).
             * Each lane is the same two products and one add. Warm cache, 32 rows: 12 ->
             * 7 us a layer. */
            for (int j = 0; j < half; j += 16) {
                __mmask16 m = half - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (half - j)) - 1);
                __m512 a = _mm512_maskz_loadu_ps(m, x + j), b = _mm512_maskz_loadu_ps(m, x + j + half);
                __m512 lo = _mm512_add_ps(_mm512_mul_ps(a, _mm512_maskz_loadu_ps(m, c + j)),
                                          _mm512_mul_ps(b, _mm512_maskz_loadu_ps(m, s + j)));
                __m512 hi = _mm512_add_ps(_mm512_mul_ps(b, _mm512_maskz_loadu_ps(m, c + j + half)),
                                          _mm512_mul_ps(a, _mm512_maskz_loadu_ps(m, s + j + half)));
                _mm512_mask_storeu_ps(o + j, m, lo);
                _mm512_mask_storeu_ps(o + j + half, m, hi);
            }
        }
        for (int e = 0; e < hk; e++)
            memcpy(vc + (e * nslots + slots[i]) * d, row + (hq + hk + e) * d, sizeof(float) * (size_t)d);
    }
}

/* The MLP's gate: out = silu(g) * u, silu(g) = g / (1 + exp(-g)), for gu rows [g | u] of
 * 2 * inter floats. */
void stopline_silu_mul(const float* gu, int n, int inter, float* out) {
    #pragma omp parallel for if ((long)n * inter >= 8192) schedule(static)
    for (int i = 0; i < n; i++) {
        const float* g = gu + (long)i * 2 * inter;
        const float* u = g + inter;
        float* o = out + (long)i * inter;
        for (int j = 0; j < inter; j += 16) {
            __mmask16 m = inter - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (inter - j)) - 1);
            __m512 gv = _mm512_maskz_loadu_ps(m, g + j);
            __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv));
            __m512 sv = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
            _mm512_mask_storeu_ps(o + j, m, _mm512_mul_ps(sv, _mm512_maskz_loadu_ps(m, u + j)));
        }
    }
}
