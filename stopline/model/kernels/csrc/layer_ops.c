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

/* One head's rotary embedding: o = (x * cos) + (roll(x, d / 2) * sin), half = d / 2. 16
 * lanes at a time: gcc left the plain loop scalar (o might alias the row). Each lane is the
 * same two products and one add. Warm cache, 32 rows: 12 -> 7 us a layer. */
static inline void rope_head(const float* x, const float* c, const float* s, float* o, int half) {
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
            float* o = e < hq ? q_out + ((long)i * hq + e) * d : kc + ((e - hq) * nslots + slots[i]) * d;
            rope_head(row + e * d, c, s, o, half);
        }
        for (int e = 0; e < hk; e++)
            memcpy(vc + (e * nslots + slots[i]) * d, row + (hq + hk + e) * d, sizeof(float) * (size_t)d);
    }
}

/* One K or V row of d floats (d a multiple of 16) as int8 quants q and a scale *sc, the int8
 * KV cache's form (kv_cache.py `quantize_rows` is the same arithmetic in torch, and equals
 * this bit for bit): sc = max|x| / 127, q = round(min(max(x * (1 / sc), -127), 127)) (nearest
 * even); all zeros: sc = 0, q = 0. A NaN or an infinity in the row makes sc NaN and q 0, so
 * every value read back is NaN and the row's request fails as it would with a float cache. */
static inline void quant_row(const float* x, int d, int8_t* q, float* sc) {
    __m512 mx = _mm512_setzero_ps(), bad = _mm512_setzero_ps();
    for (int j = 0; j < d; j += 16) {
        __m512 v = _mm512_loadu_ps(x + j);
        mx = _mm512_max_ps(mx, _mm512_abs_ps(v));
        bad = _mm512_add_ps(bad, _mm512_sub_ps(v, v)); /* NaN or inf - inf -> NaN, else 0 */
    }
    float scale = _mm512_reduce_max_ps(mx) / 127.0f + _mm512_reduce_add_ps(bad);
    *sc = scale;
    if (!(scale > 0.0f)) { /* zero, or NaN */
        memset(q, 0, (size_t)d);
        return;
    }
    __m512 inv = _mm512_set1_ps(1.0f / scale), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    for (int j = 0; j < d; j += 16) {
        __m512 y = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_loadu_ps(x + j), inv), lo), hi);
        _mm_storeu_si128((__m128i*)(q + j), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(y)));
    }
}

/* stopline_rope_store into an int8 cache: each (kv head, row)'s k (after rotation) and v are
 * quantized on their own (quant_row) into kc, vc [hk][slots][d] int8 and their scales ks, vs
 * [hk][slots]. A row's quants and scale depend on that row's values only and are written
 * once, so a block's earlier rows never change as later tokens arrive. d: 16 .. 128. */
void stopline_rope_store_q8(const float* qkv, int n, int hq, int hk, int d, const int64_t* pos,
                            const float* cos, const float* sin, const int64_t* slots, int8_t* kc,
                            int8_t* vc, float* ks, float* vs, long nslots, float* q_out) {
    int width = (hq + 2 * hk) * d, half = d / 2;
    #pragma omp parallel for if (n >= 8) schedule(static)
    for (int i = 0; i < n; i++) {
        float k[128];
        const float* row = qkv + (long)i * width;
        const float* c = cos + pos[i] * d;
        const float* s = sin + pos[i] * d;
        for (int e = 0; e < hq; e++) rope_head(row + e * d, c, s, q_out + ((long)i * hq + e) * d, half);
        for (int e = 0; e < hk; e++) {
            long at = e * nslots + slots[i];
            rope_head(row + (hq + e) * d, c, s, k, half);
            quant_row(k, d, kc + at * d, ks + at);
            quant_row(row + (hq + hk + e) * d, d, vc + at * d, vs + at);
        }
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
