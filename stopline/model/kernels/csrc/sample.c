/* Random sampling of one token per chosen row of the logits, in one pass over the vocabulary.
 *
 * Why: drawing 49,152 exponential variates from a torch generator and a float64 softmax took
 * ~1.4 ms a row here, which at 64 sampled rows doubled the step. This is the same draw (an
 * exponential race: token v wins if w_v / E_v is the largest, w_v = exp((x_v - max) / T),
 * E_v ~ Exp(1), which picks v with probability softmax(x / T)_v), with the variates from a
 * counter-based hash of (key, v): a row's token depends only on its logits and its key, never
 * on other rows or on what was drawn before (the key is per request and per token index, so a
 * preempted request draws the same tokens again).
 *
 * E_v = -log(u_v), u_v = (2k + 1) 2^-24 with k the top 23 bits of
 * triple32(triple32(v ^ key_lo) ^ key_hi) (Chris Wellons' 32-bit integer hash, 2 rounds).
 * stopline/worker/sampler.py has the same draw in torch, for where these kernels are off.
 * Ties go to the first index. Tokens at -inf never win (w = 0); a row must have one finite. */
#include <immintrin.h>
#include <stdint.h>

#include "simd_math.h"

static inline __m512i triple32(__m512i x) {
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 17));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0xed5ad4bbu));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 11));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0xac4c1b51u));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0x31848babu));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 14));
}

static int64_t race_row(const float* x, int n, float inv_temp, uint32_t key_lo, uint32_t key_hi) {
    const __m512 ninf = _mm512_set1_ps(-__builtin_inff());
    __m512 mx = ninf;
    for (int j = 0; j < n; j += 16) {
        __mmask16 k = n - j >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1);
        mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(ninf, k, x + j));
    }
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    const __m512 t = _mm512_set1_ps(inv_temp);
    const __m512i lo = _mm512_set1_epi32((int)key_lo), hi = _mm512_set1_epi32((int)key_hi);
    const __m512 ulp = _mm512_set1_ps(1.0f / 16777216.0f);
    __m512 best = _mm512_setzero_ps();
    __m512i at = _mm512_setzero_si512(), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int j = 0; j < n; j += 16, idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16))) {
        __mmask16 k = n - j >= 16 ? 0xFFFF : (__mmask16)((1u << (n - j)) - 1);
        __m512 v = _mm512_mask_loadu_ps(ninf, k, x + j);
        __m512 w = exp_ps(_mm512_mul_ps(_mm512_sub_ps(v, m), t));
        w = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, ninf, _CMP_NEQ_OQ), w);
        __m512i h = triple32(_mm512_xor_si512(triple32(_mm512_xor_si512(idx, lo)), hi));
        __m512i odd = _mm512_or_si512(_mm512_slli_epi32(_mm512_srli_epi32(h, 9), 1), _mm512_set1_epi32(1));
        __m512 u = _mm512_mul_ps(_mm512_cvtepi32_ps(odd), ulp);
        __m512 s = _mm512_div_ps(w, _mm512_sub_ps(_mm512_setzero_ps(), log_ps(u)));
        __mmask16 gt = _mm512_cmp_ps_mask(s, best, _CMP_GT_OQ);
        best = _mm512_mask_mov_ps(best, gt, s);
        at = _mm512_mask_mov_epi32(at, gt, idx);
    }
    float b = _mm512_reduce_max_ps(best);
    if (!(b > 0.0f)) return 0; /* no finite logit: the caller never passes such a row */
    __mmask16 top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(b), _CMP_EQ_OQ);
    return _mm512_mask_reduce_min_epi32(top, at);
}

/* out[i] = the token drawn from row rows[i] of x (row stride ld) at temperature 1/inv_temp[i]
 * with key (keys[2i], keys[2i+1]). */
void stopline_sample_rows(const float* x, long ld, const int64_t* rows, const float* inv_temp,
                          const uint32_t* keys, int nrows, int n, int64_t* out) {
    #pragma omp parallel for if (nrows >= 8) schedule(static)
    for (int i = 0; i < nrows; i++)
        out[i] = race_row(x + rows[i] * ld, n, inv_temp[i], keys[2 * i], keys[2 * i + 1]);
}
