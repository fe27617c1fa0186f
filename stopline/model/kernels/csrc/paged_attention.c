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
 *
 * An int8 cache (`--kv-cache-dtype int8`, fast numerics) holds each (kv head, slot) row as d
 * int8 quants and one float32 scale ([kv_heads][slots], written with the row by
 * layer_ops.c's stopline_rope_store_q8 and never changed after). The kernel reads a row as
 * float(q) * scale, one rounding a value, and then runs the float arithmetic above unchanged:
 * its result is, bit for bit, this kernel's over a float cache holding those products
 * (tests/test_kv_int8.py), and a row's bits still depend only on its own keys.
 *
 * A sliding window (a layer of Mistral or Gemma 3) keeps a row to its last `window` keys: the
 * row at position p = nkeys - 1 reads keys p - window + 1 .. p (transformers' mask), the same
 * loops over fewer keys, so the same batch invariance; keys before the window are never read.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd_math.h"

#define UNROLL _Pragma("GCC unroll 16")

/* The fixed tree: halves added, then quarters, ... (GCC's reduce_add is also fixed, but
 * spelled out so the order is ours, not the compiler's). For v_0..v_15:
 * a_i = v_i + v_(i+8), b_i = a_i + a_(i+4), c_i = b_i + b_(i+2), sum = c_0 + c_1. */
static inline float sum16(__m512 v) {
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    b = _mm_add_ss(b, _mm_movehdup_ps(b));
    return _mm_cvtss_f32(b);
}

/* sum16 of 16 vectors at once, the same additions on the same operands (so the same bits),
 * each step pairing two vectors' halves in one add: 15 adds and 30 shuffles for 16 sums
 * against 64 operations one by one. Lane 4q + j of the result is sum16(v[4j + q]). */
static inline __m512 sum16x16(const __m512 v[16]) {
    __m512 a[8], b[4], c[2];
    for (int t = 0; t < 8; t++) /* a of v[2t] in lanes 0-7, of v[2t+1] in 8-15 */
        a[t] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * t], v[2 * t + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * t], v[2 * t + 1], 0xEE));
    for (int t = 0; t < 4; t++) /* quarter q: b of v[4t + q] */
        b[t] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * t], a[2 * t + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * t], a[2 * t + 1], 0xDD));
    for (int t = 0; t < 2; t++) /* quarter q: c_0, c_1 of v[8t + q], then of v[8t + 4 + q] */
        c[t] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * t], b[2 * t + 1], 0x44),
                             _mm512_shuffle_ps(b[2 * t], b[2 * t + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
}

static inline float max16(__m512 v) { return _mm512_reduce_max_ps(v); }

/* A key's or value's row of d floats (NV lines of 64 bytes) fetched ahead. The cache rows
 * of a sequence lie in blocks scattered over the pool, one 4 KB page each at block size 16,
 * which the hardware prefetcher meets cold: without this the kernel waits on memory. */
#define KEYS_AHEAD 16
static inline __attribute__((always_inline)) void prefetch_row(const void* base, const float* sc, long slot,
                                                               const int NV, const int Q8) {
    if (Q8) { /* d bytes (one or two lines) and the scale */
        const char* r = (const char*)base + slot * NV * 16;
        UNROLL for (int c = 0; c < NV; c += 4) _mm_prefetch(r + 16 * c, _MM_HINT_T0);
        _mm_prefetch((const char*)(sc + slot), _MM_HINT_T0);
        return;
    }
    const float* r = (const float*)base + slot * NV * 16;
    UNROLL for (int c = 0; c < NV; c++) _mm_prefetch((const char*)(r + 16 * c), _MM_HINT_T0);
}

/* Floats 16c .. 16c+15 of the K or V row at `slot`: loaded, or for an int8 cache its quants
 * times the row's scale (each value one product, rounded once: torch's q.float() * scale). */
static inline __attribute__((always_inline)) __m512 load16(const void* base, const float* sc, long slot,
                                                           int c, const int NV, const int Q8) {
    if (Q8) {
        __m128i q = _mm_loadu_si128((const __m128i*)((const int8_t*)base + slot * NV * 16 + 16 * c));
        return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), _mm512_set1_ps(sc[slot]));
    }
    return _mm512_loadu_ps((const float*)base + slot * NV * 16 + 16 * c);
}

/* One key's 16-lane partial products with a query head (already scaled). */
static inline __attribute__((always_inline)) __m512 dot(const __m512* qv, const void* kc, const float* ks,
                                                        long slot, const int NV, const int Q8) {
    __m512 acc = _mm512_mul_ps(qv[0], load16(kc, ks, slot, 0, NV, Q8));
    UNROLL for (int c = 1; c < NV; c++) acc = _mm512_fmadd_ps(qv[c], load16(kc, ks, slot, c, NV, Q8), acc);
    return acc;
}

/* Softmax weights of one head's n scores, in place; returns their sum. The max is exact in
 * any order; the NaN check keeps a poisoned key from being skipped by max (which drops NaN). */
static inline float softmax_in_place(float* se, int n) {
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
    return sum16(lsum);
}

/* out[e] = (sum_j p_ej v_j) / l_e for EH heads at once, so each value row is read once for
 * them all and the EH * NV accumulators are independent chains (one head's NV alone leave
 * the FMA units waiting on latency). Each accumulator still sums j in order from zero. */
static inline __attribute__((always_inline)) void weighted_values(
    const void* vc, const float* vs, const int32_t* slot, const float* s, const float* l, float* out, int n,
    int d, const int NV, const int EH, const int Q8) {
    __m512 acc[4][8]; /* fixed sizes (EH <= 4, NV <= 8): arrays sized by NV or EH are put on the
                         stack, and the chains then go through memory */
    UNROLL for (int e = 0; e < EH; e++)
        UNROLL for (int c = 0; c < NV; c++) acc[e][c] = _mm512_setzero_ps();
    for (int j = 0; j < n; j++) {
        if (j + KEYS_AHEAD < n) prefetch_row(vc, vs, slot[j + KEYS_AHEAD], NV, Q8);
        __m512 vv[8];
        UNROLL for (int c = 0; c < NV; c++) vv[c] = load16(vc, vs, slot[j], c, NV, Q8);
        UNROLL for (int e = 0; e < EH; e++) {
            __m512 p = _mm512_set1_ps(s[(long)e * n + j]);
            UNROLL for (int c = 0; c < NV; c++) acc[e][c] = _mm512_fmadd_ps(p, vv[c], acc[e][c]);
        }
    }
    UNROLL for (int e = 0; e < EH; e++)
        UNROLL for (int c = 0; c < NV; c++)
            _mm512_storeu_ps(out + e * d + 16 * c, _mm512_div_ps(acc[e][c], _mm512_set1_ps(l[e])));
}

/* Heads a value pass takes at once: EH * NV accumulators plus NV loaded rows fit the 32
 * registers. */
#define MAX_EH(NV) ((NV) >= 8 ? 2 : 4)

/* One (row, kv head): the group's g query heads over n keys. NV = d / 16, a constant in each
 * instantiation so the accumulators stay in registers. Scratch: `slot` for n key slots, `s`
 * for g x n scores, `l` for g sums. */
static inline __attribute__((always_inline)) void item(
    const float* q, const void* kc, const void* vc, const float* ks, const float* vs, float* out,
    int32_t* slot, float* s, float* l, int g, int n, int first, int bs, const int32_t* table, float scale,
    const int NV, const int Q8) {
    const int d = NV * 16;
    if (first == 0) {
        for (int j = 0, b = 0; j < n; j += bs, b++) {
            int m = n - j < bs ? n - j : bs;
            for (int o = 0; o < m; o++) slot[j + o] = table[b] * bs + o;
        }
    } else { /* under a window: keys first .. n-1 become keys 0 .. n-first-1 */
        for (int k = first; k < n; k++) slot[k - first] = table[k / bs] * bs + k % bs;
        n -= first;
    }
    for (int t = 0; t < KEYS_AHEAD && t < n; t++) prefetch_row(kc, ks, slot[t], NV, Q8);
    if (Q8) {
        /* Each run of 16 keys dequantized once into kt (L1) and scored there by every head of
         * the group, rather than dequantized again for each head: the same products and sums
         * as below over the same values, so the same bits (1.3x the float cache's time at 4
         * rows of 256 keys before this). */
        float kt[16 * 128];
        int j0 = 0;
        for (; j0 < n; j0 += 16) {
            int m = n - j0 < 16 ? n - j0 : 16;
            for (int t = j0 + KEYS_AHEAD; t < j0 + KEYS_AHEAD + 16 && t < n; t++) prefetch_row(kc, ks, slot[t], NV, 1);
            if (j0 < KEYS_AHEAD)
                for (int t = j0; t < j0 + m; t++) prefetch_row(vc, vs, slot[t], NV, 1);
            for (int t = 0; t < m; t++)
                UNROLL for (int c = 0; c < NV; c++) _mm512_storeu_ps(kt + t * d + 16 * c, load16(kc, ks, slot[j0 + t], c, NV, 1));
            for (int e = 0; e < g; e++) {
                __m512 qv[8];
                UNROLL for (int c = 0; c < NV; c++)
                    qv[c] = _mm512_mul_ps(_mm512_loadu_ps(q + e * d + 16 * c), _mm512_set1_ps(scale));
                float* se = s + (long)e * n;
                if (m == 16) {
                    __m512 v[16];
                    UNROLL for (int t = 0; t < 16; t++)
                        v[t] = dot(qv, kt, 0, 4 * (t % 4) + t / 4, NV, 0);
                    _mm512_storeu_ps(se + j0, sum16x16(v));
                } else {
                    for (int t = 0; t < m; t++) se[j0 + t] = sum16(dot(qv, kt, 0, t, NV, 0));
                }
            }
        }
        for (int e = 0; e < g; e++) l[e] = softmax_in_place(s + (long)e * n, n);
    } else {
        for (int e = 0; e < g; e++) {
            __m512 qv[8];
            UNROLL for (int c = 0; c < NV; c++)
                qv[c] = _mm512_mul_ps(_mm512_loadu_ps(q + e * d + 16 * c), _mm512_set1_ps(scale));
            float* se = s + (long)e * n;
            int j0 = 0;
            for (; j0 + 16 <= n; j0 += 16) {
                if (e == 0) /* the first head brings the keys in; the others find them in cache */
                    for (int t = j0 + KEYS_AHEAD; t < j0 + KEYS_AHEAD + 16 && t < n; t++)
                        prefetch_row(kc, ks, slot[t], NV, Q8);
                if (e == g - 1 && j0 < KEYS_AHEAD) /* and the last the values the value pass starts with */
                    for (int t = j0; t < j0 + 16; t++) prefetch_row(vc, vs, slot[t], NV, Q8);
                __m512 v[16];
                UNROLL for (int t = 0; t < 16; t++) /* the order sum16x16 gives back as 0..15 */
                    v[t] = dot(qv, kc, ks, slot[j0 + 4 * (t % 4) + t / 4], NV, Q8);
                _mm512_storeu_ps(se + j0, sum16x16(v));
            }
            for (; j0 < n; j0++) se[j0] = sum16(dot(qv, kc, ks, slot[j0], NV, Q8));
            l[e] = softmax_in_place(se, n);
        }
    }
    for (int e0 = 0; e0 < g; e0 += MAX_EH(NV)) {
        const float* se = s + (long)e0 * n;
        float* oe = out + e0 * d;
        switch (g - e0 < MAX_EH(NV) ? g - e0 : MAX_EH(NV)) {
        case 1: weighted_values(vc, vs, slot, se, l + e0, oe, n, d, NV, 1, Q8); break;
        case 2: weighted_values(vc, vs, slot, se, l + e0, oe, n, d, NV, 2, Q8); break;
        case 3: weighted_values(vc, vs, slot, se, l + e0, oe, n, d, NV, 3, Q8); break;
        default: weighted_values(vc, vs, slot, se, l + e0, oe, n, d, NV, MAX_EH(NV), Q8); break;
        }
    }
}

/* Every row's items, on a float (Q8 0) or int8 (Q8 1) cache; ks, vs: the int8 rows' scales
 * [kv_heads][slots]. Returns 0, or -1 when scratch memory could not be had. */
static int run(const float* q, long ldq, const void* kc, const void* vc, const float* ks, const float* vs,
               float* out, int rows, int heads, int kv_heads, int d, long slots, int bs,
               const int32_t* nkeys, const int32_t* table_at, const int32_t* tables, int max_keys,
               float scale, int window, const int Q8) {
    int g = heads / kv_heads;
    int items = rows * kv_heads;
    long keys = max_keys > 0 ? max_keys : 1;
    long esz = Q8 ? 1 : (long)sizeof(float);
    int failed = 0;
#pragma omp parallel
    {
        /* per thread: g x keys scores, g sums, keys slots */
        float* s = malloc(sizeof(float) * (size_t)(g * keys + g) + sizeof(int32_t) * (size_t)keys);
        if (!s) {
#pragma omp atomic write
            failed = 1;
        }
        float* l = s + g * keys;
        int32_t* slot = (int32_t*)(l + g);
#pragma omp for schedule(dynamic, 1)
        for (int it = 0; it < items; it++) {
            if (!s) continue;
            int i = it / kv_heads, h = it % kv_heads;
            const float* qi = q + (long)i * ldq + (long)h * g * d;
            const char* kh = (const char*)kc + (long)h * slots * d * esz;
            const char* vh = (const char*)vc + (long)h * slots * d * esz;
            const float* ksh = Q8 ? ks + (long)h * slots : 0;
            const float* vsh = Q8 ? vs + (long)h * slots : 0;
            float* oi = out + (long)i * heads * d + (long)h * g * d;
            const int32_t* t = tables + table_at[i];
            int n = nkeys[i], first = window > 0 && n > window ? n - window : 0;
            switch (d) {
            case 16: item(qi, kh, vh, ksh, vsh, oi, slot, s, l, g, n, first, bs, t, scale, 1, Q8); break;
            case 32: item(qi, kh, vh, ksh, vsh, oi, slot, s, l, g, n, first, bs, t, scale, 2, Q8); break;
            case 64: item(qi, kh, vh, ksh, vsh, oi, slot, s, l, g, n, first, bs, t, scale, 4, Q8); break;
            default: item(qi, kh, vh, ksh, vsh, oi, slot, s, l, g, n, first, bs, t, scale, 8, Q8); break;
            }
        }
        free(s);
    }
    return failed ? -1 : 0;
}

/* d is 16, 32, 64 or 128; window 0 for full attention. */
int stopline_paged_attention_window(const float* q, long ldq, const float* kc, const float* vc,
                                    float* out, int rows, int heads, int kv_heads, int d, long slots,
                                    int bs, const int32_t* nkeys, const int32_t* table_at,
                                    const int32_t* tables, int max_keys, float scale, int window) {
    return run(q, ldq, kc, vc, 0, 0, out, rows, heads, kv_heads, d, slots, bs, nkeys, table_at, tables,
               max_keys, scale, window, 0);
}

/* The same over an int8 cache with its rows' scales. */
int stopline_paged_attention_q8(const float* q, long ldq, const int8_t* kc, const int8_t* vc,
                                const float* ks, const float* vs, float* out, int rows, int heads,
                                int kv_heads, int d, long slots, int bs, const int32_t* nkeys,
                                const int32_t* table_at, const int32_t* tables, int max_keys,
                                float scale, int window) {
    return run(q, ldq, kc, vc, ks, vs, out, rows, heads, kv_heads, d, slots, bs, nkeys, table_at, tables,
               max_keys, scale, window, 1);
}

/* Full attention (the fused decoder's call). */
int stopline_paged_attention(const float* q, long ldq, const float* kc, const float* vc, float* out,
                             int rows, int heads, int kv_heads, int d, long slots, int bs,
                             const int32_t* nkeys, const int32_t* table_at, const int32_t* tables,
                             int max_keys, float scale) {
    return stopline_paged_attention_window(q, ldq, kc, vc, out, rows, heads, kv_heads, d, slots, bs,
                                           nkeys, table_at, tables, max_keys, scale, 0);
}
