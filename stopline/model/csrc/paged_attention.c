/* Attention of query rows over the first n keys of their sequence, read in place from the
 * paged K/V cache: no gather, no padding, no copy of the decoding sequences' K/V.
 *
 * Why: in torch, a decode step's attention was ~15 small ops a layer (batched GEMMs, softmax,
 * per-tile partial sums), each a parallel region of its own; at 11 rows the two threads spent
 * a third of the step waiting on each other, and K/V had to be gathered or copied into
 * contiguous rows first.
 *
 * A row's result never depends on the rest of the batch, on padding or on chunking: each
 * (row, kv head) is one work item whose loops run over exactly its own n keys in index
 * order, whatever else the call holds, and whichever thread takes it. So a position gets the
 * same bits as a decode row, as a row of a prefill chunk of any size, and when it is
 * recomputed after preemption.
 *
 * Per query head: s_j = sum_d (q_d * scale) k_jd, as 16-lane FMA chains over d reduced by a
 * fixed tree; m = max_j s_j; p_j = exp(s_j - m) (exp below, ~1 ulp); l = sum_j p_j in 16
 * lanes (lane j mod 16) then the same tree; out = (sum_j p_j v_j) / l, the sum over j in
 * order. A NaN anywhere in a row's keys or values (the debug poison of freed blocks) reaches
 * its output.
 *
 * Layout: cache [kv_heads][slots][d] float32 per layer, slot = block * block_size + offset;
 * q rows [N][ldq] with head e at e * d; out [N][num_heads * d]; row i reads nkeys[i] keys
 * through the block table starting at tables[table_at[i]].
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd_math.h"

/* The fixed tree: halves added, then quarters, ... (GCC's reduce_add is also fixed, but
 * spelled out so the order is ours, not the compiler's). */
static inline float sum16(__m512 v) {
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    b = _mm_add_ss(b, _mm_movehdup_ps(b));
    return _mm_cvtss_f32(b);
}

static inline float max16(__m512 v) { return _mm512_reduce_max_ps(v); }

/* One (row, kv head): the group's g query heads over n keys. NV = d / 16, a constant in each
 * instantiation so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void item(
    const float* q, const float* kc, const float* vc, float* out, float* s, int g, int n, int bs,
    const int32_t* table, float scale, const int NV) {
    const int d = NV * 16;
    for (int e = 0; e < g; e++) {
        __m512 qv[NV];
        for (int c = 0; c < NV; c++)
            qv[c] = _mm512_mul_ps(_mm512_loadu_ps(q + e * d + 16 * c), _mm512_set1_ps(scale));
        float* se = s + (long)e * n;
        for (int j0 = 0, b = 0; j0 < n; j0 += bs, b++) {
            const float* kb = kc + (long)table[b] * bs * d;
            int m = n - j0 < bs ? n - j0 : bs;
            for (int o = 0; o < m; o++) {
                __m512 acc = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kb + o * d));
                for (int c = 1; c < NV; c++)
                    acc = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kb + o * d + 16 * c), acc);
                se[j0 + o] = sum16(acc);
            }
        }
        /* Softmax weights in place. The max is exact in any order; the NaN check keeps a
         * poisoned key from being skipped by max (which drops NaN). */
        __m512 mx = _mm512_set1_ps(-__builtin_inff());
        __m512 bad = _mm512_setzero_ps();
        int j = 0;
        for (; j + 16 <= n; j += 16) {
            __m512 v = _mm512_loadu_ps(se + j);
            mx = _mm512_max_ps(mx, v);
            bad = _mm512_add_ps(bad, _mm512_sub_ps(v, v)); /* NaN or inf - inf -> NaN, else 0 */
        }
        __mmask16 tail = (__mmask16)((1u << (n - j)) - 1);
        if (n - j) {
            __m512 v = _mm512_maskz_loadu_ps(tail, se + j);
            mx = _mm512_mask_max_ps(mx, tail, mx, v);
            bad = _mm512_add_ps(bad, _mm512_sub_ps(v, v));
        }
        __m512 shift = _mm512_add_ps(_mm512_set1_ps(max16(mx)), _mm512_set1_ps(sum16(bad)));
        __m512 lsum = _mm512_setzero_ps();
        for (j = 0; j + 16 <= n; j += 16) {
            __m512 p = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(se + j), shift));
            _mm512_storeu_ps(se + j, p);
            lsum = _mm512_add_ps(lsum, p);
        }
        if (n - j) {
            __m512 p = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, se + j), shift));
            _mm512_mask_storeu_ps(se + j, tail, p);
            lsum = _mm512_add_ps(lsum, _mm512_maskz_mov_ps(tail, p));
        }
        __m512 l = _mm512_set1_ps(sum16(lsum));
        __m512 acc[NV];
        for (int c = 0; c < NV; c++) acc[c] = _mm512_setzero_ps();
        for (int j0 = 0, b = 0; j0 < n; j0 += bs, b++) {
            const float* vb = vc + (long)table[b] * bs * d;
            int m = n - j0 < bs ? n - j0 : bs;
            for (int o = 0; o < m; o++) {
                __m512 p = _mm512_set1_ps(se[j0 + o]);
                for (int c = 0; c < NV; c++)
                    acc[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vb + o * d + 16 * c), acc[c]);
            }
        }
        for (int c = 0; c < NV; c++) _mm512_storeu_ps(out + e * d + 16 * c, _mm512_div_ps(acc[c], l));
    }
}

/* Returns 0, or -1 when scratch memory could not be had (the caller raises). d is 16, 32, 64
 * or 128. */
int stopline_paged_attention(const float* q, long ldq, const float* kc, const float* vc, float* out,
                             int rows, int heads, int kv_heads, int d, long slots, int bs,
                             const int32_t* nkeys, const int32_t* table_at, const int32_t* tables,
                             int max_keys, float scale) {
    int g = heads / kv_heads;
    int items = rows * kv_heads;
    int failed = 0;
#pragma omp parallel
    {
        float* s = malloc(sizeof(float) * (size_t)g * (size_t)(max_keys > 0 ? max_keys : 1));
        if (!s) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int it = 0; it < items; it++) {
            if (!s) continue;
            int i = it / kv_heads, h = it % kv_heads;
            const float* qi = q + (long)i * ldq + (long)h * g * d;
            const float* kh = kc + (long)h * slots * d;
            const float* vh = vc + (long)h * slots * d;
            float* oi = out + (long)i * heads * d + (long)h * g * d;
            const int32_t* t = tables + table_at[i];
            switch (d) {
            case 16: item(qi, kh, vh, oi, s, g, nkeys[i], bs, t, scale, 1); break;
            case 32: item(qi, kh, vh, oi, s, g, nkeys[i], bs, t, scale, 2); break;
            case 64: item(qi, kh, vh, oi, s, g, nkeys[i], bs, t, scale, 4); break;
            default: item(qi, kh, vh, oi, s, g, nkeys[i], bs, t, scale, 8); break;
            }
        }
        free(s);
    }
    return failed ? -1 : 0;
}
